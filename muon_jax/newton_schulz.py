"""Newton-Schulz orthogonalization of batches of matrices, and its coefficient schedules.

Pure functions on arrays: :func:`orthogonalize` maps ``[..., m, n]`` to an approximation of the
polar factor ``U V^T`` of every ``[m, n]`` matrix; :func:`resolve_ns_coeffs` turns a schedule
name or explicit coefficients into one ``(a, b, c)`` triple per step; :func:`ns_flops` counts the
matmul work. The sharded optimizer reuses these on the ``[K, m, n]`` stacks it owns.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias, get_args

import jax
import jax.numpy as jnp
import numpy as np

from accel_kernels import platform as target
from accel_kernels.symmetric import api as symmetric_api
from muon_jax import arguments
from muon_jax.symmetric import TILES_DTYPES, symmetric_matmul, symmetric_tiles_matmul

Coeffs: TypeAlias = tuple[float, float, float]
"""One Newton-Schulz step ``X -> a X + b (X X^T) X + c (X X^T)^2 X``."""

NsCoeffsLike: TypeAlias = (
    Literal["jordan", "standard", "polar_express", "dion"] | Sequence[float]
    | Sequence[Sequence[float]]
)
Preconditioning = Literal["frobenius", "spectral", "aol", "schatten"]
PRECONDITIONINGS: tuple[str, ...] = get_args(Preconditioning)
NsMethod = Literal["auto", "standard", "gram"]
NS_METHODS: tuple[str, ...] = get_args(NsMethod)
SymmetricBlocks: TypeAlias = int | Literal["auto", "tiles"]
"""How the products known to be symmetric are computed (:func:`resolve_symmetric_blocks`): in
that many row strips (1: plain matmuls), or ``'tiles'``: the symmetric-tile GPU kernel
(:func:`muon_jax.symmetric.symmetric_tiles_matmul`)."""

AUTO_SYMMETRIC_BLOCKS: dict[str, int] = {"gpu": 4}
"""``symmetric_blocks='auto'`` by backend for large enough banks
(:data:`AUTO_SYMMETRIC_MIN_WORK`; others: 1, plain matmuls). On a GPU the tiles the strips
skip pay for their extra, smaller matmuls and the mirroring pass only when those matmuls are
large, and more strips than 4 cut them too small to gain more."""

AUTO_TILES_MIN_SIDE = 2048
"""``'auto'`` takes the symmetric-tile kernel on Hopper GPUs for banks whose Gram side
``min(m, n)`` reaches this. It skips about half the tiles of the ``[p, p]`` products but paid
a mirroring pass over each, which outweighed the skipped tiles' time for small ``p`` (this
side is where the two were timed even, before the kernel stored its own mirror from its
epilogue: a smaller side may now pay)."""

AUTO_GRAM_MIN_ASPECT = 2.0
"""``ns_method='auto'`` takes the Gram form (with the symmetric-tile kernel) for matrices at
least this many times wider than tall (:func:`resolve_ns_method`)."""

AUTO_SYMMETRIC_MIN_WORK = 4e11
"""``'auto'`` takes the strips for a bank of ``B`` matrices ``[m, n]`` (``m <= n``, the Gram
side) only if ``B * m^2 * n`` reaches this and ``m >= 2048``: the strips skip half the tiles
of the ``[m, m]`` products but cut each into smaller GEMMs plus a mirror pass, which pays
only when those GEMMs are large and many; below this one plain GEMM was faster where
the two were timed."""


@dataclasses.dataclass(frozen=True)
class GramOptions:
    """How the Gram form of Newton-Schulz runs (see :func:`orthogonalize`).

    Attributes:
      restarts: steps (1-based) after which ``X`` is rebuilt from the accumulated polynomial
        and the Gram matrix recomputed from it. Entries ``>= ns_steps`` change nothing, so
        the default also serves short schedules. ``()`` is the naive Gram iteration.
      dtype: matmul operand dtype of the Gram form; ``None``: float16 where
        :func:`orthogonalize`'s ``dtype`` is bfloat16, else that ``dtype``. The product
        ``Q`` of a segment's polynomials scales the small singular directions up by the
        product of the ``a`` coefficients (about 40 over three Jordan steps) while the large
        ones stay near 1, so its rounding error, relative to its largest entries, lands on
        the large directions magnified: bfloat16's 8-bit mantissa makes that error larger
        than the whole band error of Jordan's polynomial; float16's 11 bits do not.
        Tensor-core GPUs multiply float16 at bfloat16's rate, and every value stays far
        inside float16's range (``X`` is normalized, so the entries of ``R`` are at most 1).
    """

    restarts: tuple[int, ...] = (2,)
    dtype: jax.typing.DTypeLike | None = None

    def __post_init__(self):
        r = tuple(self.restarts)
        if any(isinstance(t, bool) or not isinstance(t, int | np.integer) or t < 1 for t in r):
            raise ValueError(f"GramOptions.restarts must be step numbers >= 1, got {r!r}; "
                             "e.g. (2,) rebuilds X after the second step.")
        object.__setattr__(self, "restarts", tuple(sorted({int(t) for t in r})))


DEFAULT_GRAM = GramOptions()
"""The Gram form's default options (restart after step 2, float16 for bf16 inputs), shared as
the default argument of every function that takes them."""


def resolve_symmetric_blocks(blocks: SymmetricBlocks, platform: str | None = None, *,
                             name: str = "symmetric_blocks",
                             shape: tuple[int, ...] | None = None,
                             capability: tuple[int, int] | None = None) -> int | Literal["tiles"]:
    """How :func:`orthogonalize` computes its symmetric products for ``blocks``.

    ``'auto'``: on an NVIDIA Hopper GPU (compute ``capability`` 9.x), ``'tiles'`` for banks
    whose Gram side ``min(m, n)`` is at least :data:`AUTO_TILES_MIN_SIDE`, else 1; on other
    platforms :data:`AUTO_SYMMETRIC_BLOCKS` for ``platform`` when the bank ``shape``
    (``[..., m, n]``; None: any) is large enough (:data:`AUTO_SYMMETRIC_MIN_WORK`), else 1.
    ``platform`` and ``capability`` default to those programs are compiled for
    (:mod:`accel_kernels.platform`: the default device, or a declared GPU target). An int
    ``>= 1`` (row strips, :func:`muon_jax.symmetric.symmetric_matmul`) or ``'tiles'`` (the
    symmetric-tile kernel, :func:`muon_jax.symmetric.symmetric_tiles_matmul`) is returned as
    given. ``name``: the argument the error names.

    >>> resolve_symmetric_blocks(3), resolve_symmetric_blocks('auto', 'gpu')
    (3, 4)
    >>> (resolve_symmetric_blocks('auto', 'gpu', shape=(32, 4096, 4096)),
    ...  resolve_symmetric_blocks('auto', 'gpu', shape=(16, 1024, 2048)))
    (4, 1)
    >>> (resolve_symmetric_blocks('auto', 'gpu', shape=(4096, 4096), capability=(9, 0)),
    ...  resolve_symmetric_blocks('auto', 'gpu', shape=(1024, 4096), capability=(9, 0)))
    ('tiles', 1)
    """
    if blocks == "tiles":
        return "tiles"
    if blocks == "auto":
        if platform is None:
            # The kernels' notion of the target: it honours a declared GPU target when a CPU
            # process compiles for GPUs.
            platform, capability = target.target_platform(), target.cuda_capability()
        side = min(shape[-2:]) if shape is not None else None
        if platform == "gpu" and capability is not None and capability[0] == 9:
            return "tiles" if side is None or side >= AUTO_TILES_MIN_SIDE else 1
        auto = AUTO_SYMMETRIC_BLOCKS.get(platform, 1)
        if shape is not None:
            m, n = sorted(shape[-2:])
            if m < 2048 or math.prod(shape[:-2]) * m * m * n < AUTO_SYMMETRIC_MIN_WORK:
                return 1
        return auto
    if isinstance(blocks, bool) or not isinstance(blocks, int | np.integer) or blocks < 1:
        raise ValueError(f"{name} must be an int >= 1, 'auto' or 'tiles', got {blocks!r}; "
                         "1 computes every tile (plain matmuls).")
    return int(blocks)


def resolve_ns_method(method: NsMethod, m: int, n: int, dtype: jax.typing.DTypeLike, *,
                      single_triple: bool = True,
                      symmetric_blocks: int | Literal["tiles"] = 1) -> str:
    """``'standard'`` or ``'gram'``: what ``method`` means for an ``[m, n]`` matrix.

    ``'auto'`` takes the Gram form only with the symmetric-tile kernel
    (``symmetric_blocks='tiles'``, as :func:`resolve_symmetric_blocks` resolved it), for
    matrices at least :data:`AUTO_GRAM_MIN_ASPECT` times wider than tall, 16-bit operands and
    one repeated triple (``single_triple``: per-step schedules such as ``'polar_express'``
    open with steep polynomials the Gram form carries less accurately, see
    ``tests/muon_jax/test_gram_ns.py``); otherwise the standard form. The Gram form needs
    fewer FLOPs exactly when ``max(m, n) > 1.5 min(m, n)`` (:func:`ns_flops`), but with XLA's
    matmuls its many ``[p, p]`` products and elementwise passes do not outrun the standard
    form's fewer, larger matmuls.

    >>> resolve_ns_method('standard', 1024, 4096, 'bfloat16')
    'standard'
    >>> (resolve_ns_method('auto', 4096, 11008, 'bfloat16', symmetric_blocks='tiles'),
    ...  resolve_ns_method('auto', 4096, 4096, 'bfloat16', symmetric_blocks='tiles'))
    ('gram', 'standard')
    """
    if method not in NS_METHODS:
        raise ValueError(f"ns_method={method!r} is not supported; use one of {NS_METHODS}.")
    if method != "auto":
        return method
    narrow = jnp.dtype(dtype).name in ("bfloat16", "float16")
    wide = max(m, n) >= AUTO_GRAM_MIN_ASPECT * min(m, n)
    if symmetric_blocks == "tiles" and narrow and wide and single_triple:
        return "gram"
    return "standard"


@dataclasses.dataclass(frozen=True)
class NewtonSchulzOptions:
    """How Muon turns its momentum into an orthogonal direction, beyond the schedule
    (``ns_coeffs``, ``ns_steps``) and ``eps``, which stay flat arguments as in optax.

    Frozen and hashable: ``optax.inject_hyperparams`` keeps it static. Each field is checked
    here, naming it.

    Attributes:
      dtype: matmul operand dtype of the iteration (:func:`orthogonalize`'s ``dtype``):
        ``jnp.bfloat16`` for tensor-core speed, ``jnp.float32`` to match optax.
      preconditioning: how the input is scaled: ``'frobenius'``, ``'spectral'``, ``'aol'`` or
        ``'schatten'`` (:func:`orthogonalize`).
      method: ``'standard'`` Newton-Schulz, its ``'gram'`` form (iterates on ``X X^T``) or
        ``'auto'`` (:func:`resolve_ns_method`).
      gram: restarts and operand dtype of the Gram form (:class:`GramOptions`).
      symmetric_blocks: the symmetric products from one block triangle in this many row
        strips, ``'tiles'`` (the GPU kernel) or ``'auto'`` (:func:`resolve_symmetric_blocks`).
      adaptive: scale each orthogonalized matrix ``O`` by its dual norm ``<G, O> =
        sum(conj(G) * O)`` with its input ``G``, about the nuclear norm of ``G`` (optax's
        ``adaptive``, per matrix here).

    Example:
      >>> NewtonSchulzOptions(dtype='float32').dtype
      dtype('float32')
      >>> NewtonSchulzOptions(method='fast')  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: NewtonSchulzOptions: method='fast' is not supported; use one of ...
    """

    dtype: jax.typing.DTypeLike = jnp.bfloat16
    preconditioning: Preconditioning = "frobenius"
    method: NsMethod = "auto"
    gram: GramOptions = DEFAULT_GRAM
    symmetric_blocks: SymmetricBlocks = "auto"
    adaptive: bool = False

    def __post_init__(self):
        where = "NewtonSchulzOptions"
        object.__setattr__(self, "dtype", arguments.float_dtype(f"{where}: dtype", self.dtype))
        if self.preconditioning not in PRECONDITIONINGS:
            raise ValueError(f"{where}: preconditioning={self.preconditioning!r} is not "
                             f"supported; use one of {PRECONDITIONINGS}.")
        if self.method not in NS_METHODS:
            raise ValueError(f"{where}: method={self.method!r} is not supported; use one of "
                             f"{NS_METHODS}.")
        if not isinstance(self.gram, GramOptions):
            raise TypeError(f"{where}: gram={self.gram!r} is not a GramOptions; pass e.g. "
                            "gram=muon_jax.GramOptions(restarts=(2,)).")
        resolve_symmetric_blocks(self.symmetric_blocks, "cpu",
                                 name=f"{where}: symmetric_blocks")
        arguments.check_bool(f"{where}: adaptive", self.adaptive)


DEFAULT_NEWTON_SCHULZ = NewtonSchulzOptions()
"""Muon's default Newton-Schulz options, the default argument of the transforms."""


JORDAN_COEFFS: Coeffs = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic, used at every step (modded-nanogpt, 2024); optax calls it
``'standard'``."""

DION_COEFFS: tuple[Coeffs, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
"""The per-step schedule of Dion (Ahn et al. 2025), optax's ``'dion'`` preset."""

_POLAR_EXPRESS_RAW: tuple[Coeffs, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_PE_SAFETY = 1.01

POLAR_EXPRESS_COEFFS: tuple[Coeffs, ...] = tuple(
    (a / _PE_SAFETY, b / _PE_SAFETY**3, c / _PE_SAFETY**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]
) + (_POLAR_EXPRESS_RAW[-1],)
"""Polar Express degree-5 schedule (Amsel et al. 2025, Algorithm 1), with the paper's safety
factor: every step but the last evaluates its polynomial at ``x / 1.01``, i.e.
``(a / 1.01, b / 1.01**3, c / 1.01**5)``. Steps beyond the eighth repeat the last triple."""

SCHEDULES: tuple[str, ...] = ("jordan", "standard", "polar_express", "dion")


def _base_schedule(ns_coeffs: NsCoeffsLike) -> tuple[tuple[Coeffs, ...], bool]:
    """``ns_coeffs`` as its triples, and whether they are explicit per-step triples (which
    must number ``ns_steps``) rather than one triple or a named schedule (whose last triple
    repeats)."""
    if isinstance(ns_coeffs, str):
        named = {"jordan": (JORDAN_COEFFS,), "standard": (JORDAN_COEFFS,),
                 "polar_express": POLAR_EXPRESS_COEFFS, "dion": DION_COEFFS}
        if ns_coeffs not in named:
            raise ValueError(
                f"Unknown ns_coeffs schedule {ns_coeffs!r}; use one of {SCHEDULES}, one triple "
                "(a, b, c), or a tuple of per-step triples."
            )
        return named[ns_coeffs], False
    try:
        arr = np.asarray(ns_coeffs, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"ns_coeffs must be a schedule name {SCHEDULES}, a triple (a, b, c) of numbers "
            f"or a tuple of per-step triples; got {ns_coeffs!r} ({e})."
        ) from None
    _check_coeffs_shape(arr.shape)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"ns_coeffs must be finite, got {ns_coeffs!r}.")
    rows = arr.reshape(-1, 3)
    return tuple(tuple(float(v) for v in row) for row in rows), arr.ndim == 2 and len(rows) > 1


def _check_coeffs_shape(shape: tuple[int, ...]) -> None:
    """Raise unless ``shape`` is ``(3,)`` or ``(T, 3)`` with ``T >= 1``."""
    if not (shape == (3,) or (len(shape) == 2 and shape[1] == 3 and shape[0] >= 1)):
        raise ValueError(
            f"ns_coeffs must have shape (3,) or (T, 3) with T >= 1, got shape {shape}; "
            "pass one triple (a, b, c) or a tuple of per-step triples."
        )


def check_ns_steps(ns_steps: Any) -> int | jax.Array:
    """``ns_steps`` as a Python int ``>= 1``, or itself when traced (an integer scalar).

    >>> check_ns_steps(np.int32(3)), check_ns_steps(0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: ns_steps must be >= 1, got 0; pass e.g. ns_steps=5.
    """
    if arguments.is_traced(ns_steps):
        if np.ndim(ns_steps) != 0 or not jnp.issubdtype(ns_steps.dtype, jnp.integer):
            raise TypeError(f"ns_steps must be an integer scalar, got a traced {ns_steps.dtype}"
                            f"{list(np.shape(ns_steps))}; pass e.g. ns_steps=5.")
        return ns_steps
    if not isinstance(ns_steps, bool) and np.ndim(ns_steps) == 0 and \
            np.issubdtype(np.asarray(ns_steps).dtype, np.integer):
        ns_steps = int(ns_steps)  # a 0-d integer array (optax takes ns_steps as ArrayLike)
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        raise TypeError(
            f"ns_steps must be a Python int >= 1, got {ns_steps!r} ({type(ns_steps).__name__}); "
            "pass e.g. ns_steps=5."
        )
    if ns_steps < 1:
        raise ValueError(f"ns_steps must be >= 1, got {ns_steps}; pass e.g. ns_steps=5.")
    return ns_steps


def resolve_ns_coeffs(ns_coeffs: NsCoeffsLike, ns_steps: int) -> tuple[Coeffs, ...]:
    """Resolve a schedule to one ``(a, b, c)`` triple per Newton-Schulz step.

    A single triple (or ``'jordan'`` / ``'standard'``) is used at every step. Step ``t``
    (1-based) of a named per-step schedule (``'polar_express'``, ``'dion'``) uses its triple
    ``t``; when ``ns_steps`` exceeds the schedule's length the last triple repeats, when it is
    shorter only the first ``ns_steps`` run. Explicit per-step triples must number exactly
    ``ns_steps`` (optax runs all ``T`` of them whatever ``ns_steps >= T`` says, and refuses
    ``ns_steps < T``; a mismatch here is an error rather than either guess).

    Args:
      ns_coeffs: ``'jordan'`` (= ``'standard'``), ``'polar_express'``, ``'dion'``, one triple
        ``(a, b, c)`` or a sequence of ``ns_steps`` per-step triples.
      ns_steps: number of Newton-Schulz steps, ``>= 1`` (a Python or 0-d integer).

    Returns:
      A tuple of ``ns_steps`` triples of Python floats.

    >>> resolve_ns_coeffs('jordan', 2)
    ((3.4445, -4.775, 2.0315), (3.4445, -4.775, 2.0315))
    >>> len(resolve_ns_coeffs('polar_express', 10))
    10

    References:
      Amsel, Persson, Musco, Gower, `The Polar Express: Optimal Matrix Sign Methods and Their
      Application to the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_, 2025.
    """
    if arguments.is_traced(ns_steps):
        raise TypeError("resolve_ns_coeffs needs a concrete ns_steps; orthogonalize runs a "
                        "traced one as a loop.")
    ns_steps = check_ns_steps(ns_steps)
    schedule, explicit = _base_schedule(ns_coeffs)
    if explicit and len(schedule) != ns_steps:
        raise ValueError(
            f"ns_coeffs has {len(schedule)} per-step triples but ns_steps={ns_steps}; pass "
            f"ns_steps={len(schedule)} (optax runs every triple it is given), or one triple "
            "to repeat at every step.")
    steps = schedule[:ns_steps]
    return steps + (schedule[-1],) * (ns_steps - len(steps))


class LoopSchedule(NamedTuple):
    """A Newton-Schulz schedule run in a loop: step ``t`` (0-based, from ``start``) uses row
    ``min(t, T - 1)`` of ``table``; what :func:`schedule_steps` returns for a traced step
    count or traced coefficients.

    Example:
      >>> s = LoopSchedule(jnp.ones((1, 3)), 5)
      >>> s.table.shape, s.steps, s.start
      ((1, 3), 5, 0)
    """

    table: jax.Array  # [T, 3] float32
    steps: Any  # the number of steps: an int or a traced integer scalar
    start: int = 0  # steps already taken (the first one, fused into the preconditioning)


def schedule_steps(ns_coeffs: Any, ns_steps: Any) -> tuple[Coeffs, ...] | LoopSchedule:
    """The steps of a schedule: the triples of :func:`resolve_ns_coeffs` when ``ns_coeffs``
    and ``ns_steps`` are concrete, else a :class:`LoopSchedule` (either one traced).

    Explicit per-step triples fix the step count at their number ``T`` (``ns_steps`` must
    equal it, which is checked when it is concrete).

    >>> schedule_steps('jordan', 1)
    ((3.4445, -4.775, 2.0315),)
    >>> shapes = []
    >>> _ = jax.jit(lambda t: shapes.append(schedule_steps('dion', t).table.shape))(3)
    >>> shapes  # a traced step count: the five triples, looked up in the loop
    [(5, 3)]
    """
    if not arguments.is_traced(ns_coeffs):
        if not arguments.is_traced(ns_steps):
            return resolve_ns_coeffs(ns_coeffs, ns_steps)
        schedule, explicit = _base_schedule(ns_coeffs)
        if explicit:  # the triples fix the count
            return schedule
        return LoopSchedule(jnp.asarray(schedule, jnp.float32), check_ns_steps(ns_steps))
    shape = tuple(np.shape(ns_coeffs))
    _check_coeffs_shape(shape)
    table = jnp.reshape(ns_coeffs, (-1, 3)).astype(jnp.float32)
    if len(shape) == 2 and shape[0] > 1:
        if not arguments.is_traced(ns_steps) and check_ns_steps(ns_steps) != shape[0]:
            raise ValueError(f"ns_coeffs has {shape[0]} per-step triples but "
                             f"ns_steps={ns_steps}; pass ns_steps={shape[0]}.")
        return LoopSchedule(table, shape[0])
    return LoopSchedule(table, check_ns_steps(ns_steps))


class _Products(NamedTuple):
    """The matmuls of one orthogonalization: operand ``dtype``, accumulation in ``work``, and
    how the products known to be Hermitian are computed (``blocks``)."""

    dtype: Any
    work: Any
    complex_: bool
    blocks: int | str

    def ht(self, u: jax.Array) -> jax.Array:
        """``u^H`` (``u^T`` for real ``u``)."""
        u = jnp.swapaxes(u, -1, -2)
        return u.conj() if self.complex_ else u

    def plus_ht(self, u: jax.Array) -> jax.Array:
        """``u + u^H`` for a product ``u`` of :meth:`mms`: ``2 u`` where those come out exactly
        Hermitian (the tile kernel's, mirrored in its epilogue), which is the same value and
        saves the pass its transposed read would cost."""
        return 2 * u if self.blocks == "tiles" else u + self.ht(u)

    def mm(self, u: jax.Array, v: jax.Array) -> jax.Array:
        """``u @ v`` with ``dtype`` operands, accumulated in ``work``."""
        return jnp.matmul(u.astype(self.dtype), v.astype(self.dtype),
                          preferred_element_type=self.work)

    def mms(self, u: jax.Array, v: jax.Array, rows: jax.Array, out: Any = None) -> jax.Array:
        """``u @ v``, a product known to be Hermitian; ``rows``: the matrix whose conjugate
        transpose is ``v`` (``v`` itself when it is Hermitian), which the tile kernel reads."""
        out = self.work if out is None else out
        if self.blocks == "tiles":
            return symmetric_tiles_matmul(u, rows, dtype=self.dtype, preferred_element_type=out)
        return symmetric_matmul(u, v, blocks=self.blocks, dtype=self.dtype,
                                preferred_element_type=out)


def _products(shape: tuple[int, ...], dtype: Any, complex_: bool, method: NsMethod,
              gram: GramOptions, symmetric_blocks: SymmetricBlocks,
              steps: tuple[Coeffs, ...] | LoopSchedule) -> tuple[_Products, bool]:
    """The matmuls of an iteration on ``[..., p, q]`` (``p <= q``) matrices, and whether it
    takes the Gram form: ``method`` and ``symmetric_blocks`` resolved for this shape."""
    work = jnp.complex64 if complex_ else jnp.float32
    if complex_:
        dtype = jnp.complex64
    if not isinstance(gram, GramOptions):
        raise TypeError(f"gram must be a muon_jax.newton_schulz.GramOptions, got {gram!r}.")
    blocks = resolve_symmetric_blocks(symmetric_blocks, shape=shape)
    if symmetric_blocks == "auto" and blocks == "tiles" and (
            complex_ or jnp.dtype(dtype).name not in TILES_DTYPES):
        blocks = 1  # the kernel takes 16-bit real operands only
    looped = isinstance(steps, LoopSchedule)
    if looped and method == "gram":
        raise ValueError("method='gram' needs a concrete ns_steps and ns_coeffs (the restarts "
                         "fall on fixed steps); under optax.inject_hyperparams pass "
                         "static_args=('ns_steps',), or use method='auto' / 'standard'.")
    single = looped and steps.table.shape[0] == 1 or not looped and len(set(steps)) == 1
    use_gram = not looped and resolve_ns_method(method, shape[-2], shape[-1], dtype,
                                                single_triple=single,
                                                symmetric_blocks=blocks) == "gram"
    if use_gram:
        if gram.dtype is not None:
            dtype = gram.dtype
        elif not complex_ and jnp.dtype(dtype) == jnp.bfloat16:
            dtype = jnp.float16
    if symmetric_blocks == "auto" and blocks == "tiles" and \
            jnp.dtype(dtype).name not in TILES_DTYPES:
        blocks = 1  # a wide GramOptions.dtype (float32): the kernel cannot take its operands
    if blocks == "tiles" and (complex_ or jnp.dtype(dtype).name not in TILES_DTYPES):
        raise ValueError(f"symmetric_blocks='tiles' needs 16-bit real matmul operands "
                         f"{TILES_DTYPES}, got dtype={jnp.dtype(dtype).name}; pass "
                         "dtype=jnp.bfloat16, or symmetric_blocks=1 / 'auto'.")
    return _Products(dtype, work, complex_, blocks), use_gram


def _first_step(steps: tuple[Coeffs, ...] | LoopSchedule) -> tuple[Any, Any]:
    """The first step's triple and the steps after it."""
    if isinstance(steps, LoopSchedule):
        return tuple(steps.table[0]), steps._replace(start=1)
    return steps[0], steps[1:]


def _precondition(g: jax.Array, steps: Any, preconditioning: Preconditioning, eps: Any,
                  ops: _Products, *, fuse_first: bool) -> tuple[jax.Array, Any, Any]:
    """``X_0`` from ``g`` as ``preconditioning`` says: ``(X_0, A, steps left)``. ``'aol'`` and
    ``'schatten'`` scale from the Gram matrix ``A``, which the first step then reuses
    (``fuse_first``: that step is taken here; otherwise ``A`` is returned for the Gram form)."""
    if preconditioning not in ("aol", "schatten"):
        if preconditioning == "spectral":
            norm = jnp.linalg.norm(g, ord=2, axis=(-2, -1), keepdims=True)
        else:
            norm = jnp.sqrt(jnp.sum(jnp.abs(g) ** 2, axis=(-2, -1), keepdims=True))
        return g / (norm + eps).astype(ops.work), None, steps
    first_gram = ops.mms(g, ops.ht(g), g)
    if preconditioning == "aol":
        rows = jnp.maximum(jnp.sum(jnp.abs(first_gram), axis=-1, keepdims=True), eps)
        s = jax.lax.rsqrt(rows).astype(ops.work)  # [..., m, 1]
        y, first_gram = g * s, first_gram * s * jnp.swapaxes(s, -1, -2)
    else:
        fro = jnp.sqrt(jnp.sum(jnp.abs(first_gram) ** 2, axis=(-2, -1), keepdims=True))
        s = jax.lax.rsqrt(jnp.maximum(fro, eps)).astype(ops.work)
        y, first_gram = g * s, first_gram * (s * s)
    if not fuse_first:
        return y, first_gram, steps
    (a, b, c), steps = _first_step(steps)
    y = a * y + ops.mm(b * first_gram + ops.mms(c * first_gram, first_gram, first_gram), y)
    return y, None, steps


def _run_steps(y: jax.Array, steps: tuple[Coeffs, ...] | LoopSchedule,
               step: Callable[..., jax.Array]) -> jax.Array:
    """``step(y, a, b, c)`` over the schedule: unrolled, or as a loop."""
    if not isinstance(steps, LoopSchedule):
        for a, b, c in steps:
            y = step(y, a, b, c)
        return y
    last = steps.table.shape[0] - 1
    return jax.lax.fori_loop(
        steps.start, steps.steps,
        lambda t, y: step(y, *steps.table[jnp.minimum(t, last)]), y)


def _standard_steps(y: jax.Array, steps: tuple[Coeffs, ...] | LoopSchedule,
                    ops: _Products) -> jax.Array:
    """The standard Newton-Schulz steps ``X <- a X + (b A + c A A) X`` with ``A = X X^H``."""
    if ops.complex_ or jnp.finfo(ops.dtype).bits >= 32:
        def step(y, a, b, c):
            a_ = ops.mms(y, ops.ht(y), y)
            poly = b * a_ + ops.mms(c * a_, a_, a_)  # (c A) A, as in the reference codes
            return a * y + ops.mm(poly, y)

        return _run_steps(y, steps, step)
    # Narrow operands: X stays float32 (a X must not be rounded: rounding X itself puts noise
    # into the directions of small singular values, which later steps amplify), but nothing
    # else needs float32 storage. One cast of X per step feeds both X-matmuls; the Gram matrix
    # and the polynomial B = A (c A + b I) leave their matmuls in `dtype` (float32
    # accumulation on GPU/TPU): over [m, m] one `dtype` pass (c A + b I) instead of a float32
    # A A written and read back. Per step over the [m, n] iterate: one float32 -> dtype cast
    # and one fused a X + (B X) update.
    eye = jnp.eye(y.shape[-2], dtype=jnp.float32)

    def narrow_step(y, a, b, c):
        yn = y.astype(ops.dtype)
        a_ = ops.mms(yn, jnp.swapaxes(yn, -1, -2), yn, out=ops.dtype)
        shifted = (c * a_.astype(jnp.float32) + b * eye).astype(ops.dtype)
        poly = ops.mms(a_, shifted, shifted, out=ops.dtype)  # A, c A + b I commute: symmetric
        return (a * y + ops.mm(poly, yn)).astype(jnp.float32)

    return _run_steps(y, steps, narrow_step)


def _checked_input(x: jax.typing.ArrayLike) -> jax.Array:
    """``x`` as an array of rank >= 2 and a float or complex dtype; errors say the fix."""
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(
            f"orthogonalize needs an array of shape [..., m, n], got shape {x.shape}; reshape "
            "vectors to [1, n] or leave them to AdamW."
        )
    if not (jnp.issubdtype(x.dtype, jnp.complexfloating) or jnp.issubdtype(x.dtype, jnp.floating)):
        raise TypeError(f"orthogonalize needs a float or complex array, got dtype {x.dtype}; "
                        "cast it first.")
    return x


def orthogonalize(
    x: jax.typing.ArrayLike,
    *,
    ns_coeffs: NsCoeffsLike = "jordan",
    ns_steps: int = 5,
    eps: float = 1e-8,
    dtype: jax.typing.DTypeLike = jnp.bfloat16,
    preconditioning: Preconditioning = "frobenius",
    method: NsMethod = "auto",
    gram: GramOptions = DEFAULT_GRAM,
    symmetric_blocks: SymmetricBlocks = "auto",
) -> jax.Array:
    r"""Approximate the polar factor of each matrix in a batch by Newton-Schulz iteration.

    For each matrix ``G`` on the last two axes (transposed first when ``m > n``, so ``X X^T``
    is the small Gram matrix, and transposed back at the end):

    .. math::
      X_0 = G / (\|G\|_F + \epsilon), \quad
      A = X_t X_t^T, \quad B = b_t A + c_t A A, \quad X_{t+1} = a_t X_t + B X_t .

    ``preconditioning`` chooses how ``X_0`` is scaled (optax's options): ``'frobenius'`` as
    above; ``'spectral'``, by the largest singular value (an SVD per matrix: accurate, slow);
    ``'aol'``, no division, but the first step rescales the rows of ``X`` by
    ``s_i = (\sum_j |A_{ij}|)^{-1/2}`` (and ``A`` by ``s_i s_j``) before its polynomial, the
    almost-orthogonal-layer bound of Turbo-Muon, which keeps every singular value of ``s X``
    at most 1 and usually saves a step; ``'schatten'``, the first step divides ``X`` by
    ``\|A\|_F^{1/2} = \|X\|_{S_4}`` (and ``A`` by ``\|A\|_F``), a tighter bound than the
    Frobenius norm.

    The normalization, the iterate ``X`` and matmul accumulation are float32; the operands of
    the three matmuls per step are cast to ``dtype`` (bfloat16: tensor-core speed, and about 3%
    relative Frobenius difference from float32 on well-conditioned inputs). With a narrow
    ``dtype`` the Gram matrix ``A`` is also stored in ``dtype`` (it is rounded to ``dtype`` as a
    matmul operand anyway) and ``B = A (c A + b I)`` is one matmul with ``dtype`` operands and
    result; keeping ``X`` in float32 is what keeps small singular directions accurate on
    ill-conditioned inputs. Each step applies the odd quintic
    ``p_t(s) = a_t s + b_t s^3 + c_t s^5`` to every singular value, so for
    ``G = U diag(s) V^T`` the result is ``U diag(p_T(...p_1(s / ||G||_F))) V^T``.

    Singular-value bands (exact arithmetic; float32 agrees to ~1e-4). Input singular values
    ``s_i >= tau * ||G||_F`` map into ``[lo, hi]``; smaller ones map into ``[0, cap]``:

    * ``'jordan'``, 5 steps: ``tau = 1e-2``, ``[0.68, 1.14]``, ``cap = 1.21``. Jordan's
      iteration never converges to 1; more steps lower ``tau``, not the band.
    * ``'polar_express'``, 5 steps: ``tau = 1e-3``, ``[0.84, 1.13]``, ``cap = 1.13``.
    * ``'polar_express'``, ``ns_steps >= 8``: ``tau = 1e-3``, ``[0.999, 1.001]``,
      ``cap = 1.001``.

    bfloat16 matmul operands move each end by at most about 0.01 (the tests allow 0.02).

    Complex matrices iterate in complex64 with ``A = X X^H`` (``dtype`` applies to real ones),
    giving an approximation of the unitary polar factor.

    Args:
      x: array of shape ``[..., m, n]`` (``ndim >= 2``), float or complex dtype.
      ns_coeffs: ``'jordan'`` (3.4445, -4.7750, 2.0315) at every step; ``'polar_express'``
        (per-step coefficients of Amsel et al. with their 1.01 safety factor); one triple
        ``(a, b, c)``; or a tuple of per-step triples (see :func:`resolve_ns_coeffs`).
      ns_steps: number of iterations, ``>= 1``. Traced (``optax.inject_hyperparams``
        makes it state), the steps run in a ``jax.lax.fori_loop``; so do traced ``ns_coeffs``
        (one triple, or per-step triples that then set the step count). The Gram form needs
        a concrete step count (``'auto'`` then takes the standard form).
      eps: added to the Frobenius norm before dividing, so a zero matrix maps to zero.
      dtype: dtype of the matmul operands (``jnp.bfloat16`` for speed, ``jnp.float32`` for
        accuracy).
      preconditioning: ``'frobenius'``, ``'spectral'``, ``'aol'`` or ``'schatten'`` (above).
      method: ``'standard'``, ``'gram'`` (the iteration on ``X X^T``, :class:`GramOptions`)
        or ``'auto'`` (:func:`resolve_ns_method`).
      gram: the Gram form's restarts and operand dtype.
      symmetric_blocks: the products known to be symmetric (``X X^T`` and ``A (c A + b I)``
        in the standard form, every ``[p, p]`` product in the Gram form) are computed from
        one block triangle in this many row strips
        (:func:`muon_jax.symmetric.symmetric_matmul`); 1: plain matmuls; ``'tiles'``: a
        GPU kernel that computes only the output tiles on and above the diagonal
        (:func:`muon_jax.symmetric.symmetric_tiles_matmul`; Hopper GPUs, emulated on the
        CPU; 16-bit ``dtype`` only); ``'auto'``: :func:`resolve_symmetric_blocks` (4 on a GPU
        for banks of large matrices, else 1).

    Returns:
      Array of the shape and dtype of ``x``.

    >>> import jax, jax.numpy as jnp
    >>> g = jax.random.normal(jax.random.key(0), (4, 16, 8))
    >>> o = jax.jit(lambda g: orthogonalize(g, ns_coeffs='polar_express', ns_steps=8,
    ...                                     dtype=jnp.float32))(g)
    >>> bool(jnp.allclose(o.mT @ o, jnp.eye(8), atol=2e-2))  # orthonormal columns
    True

    References:
      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024.

      Amsel, Persson, Musco, Gower, `The Polar Express: Optimal Matrix Sign Methods and Their
      Application to the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_, 2025.

      Boissin et al., `Turbo-Muon: Accelerating Orthogonality-Based Optimization with
      Pre-Conditioning <https://arxiv.org/abs/2512.04632>`_, 2025 (AOL).

      Grishina et al., `Accelerating Newton-Schulz Iteration for Orthogonalization via
      Chebyshev-type Polynomials <https://arxiv.org/abs/2506.10935>`_, 2025 (Schatten-4).
    """
    steps = schedule_steps(ns_coeffs, ns_steps)
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(f"preconditioning={preconditioning!r} is not supported; use one of "
                         f"{PRECONDITIONINGS}.")
    x = _checked_input(x)
    complex_ = jnp.issubdtype(x.dtype, jnp.complexfloating)
    transposed = x.shape[-2] > x.shape[-1]
    g = x.astype(jnp.complex64 if complex_ else jnp.float32)
    if transposed:  # iterate on the wide orientation: X X^H is the small Gram matrix
        g = jnp.swapaxes(g, -1, -2)
    ops, use_gram = _products(g.shape, dtype, complex_, method, gram, symmetric_blocks, steps)
    y, first_gram, steps = _precondition(g, steps, preconditioning, eps, ops,
                                         fuse_first=not use_gram)
    if use_gram:
        y = _gram_steps(y, first_gram, steps, gram.restarts, mm=ops.mm, mms=ops.mms,
                        plus_ht=ops.plus_ht, ht=ops.ht)
    else:
        y = _standard_steps(y, steps, ops)
    if transposed:
        y = jnp.swapaxes(y, -1, -2)
    return y.astype(x.dtype)


def _gram_steps(y, r, steps, restarts, *, mm, mms, plus_ht, ht):
    r"""Newton-Schulz steps on the Gram matrix ``R = X X^H``, ``X`` rebuilt only at restarts.

    Each step's polynomial is ``P = a I + Z`` with ``Z = b R + c R^2``; ``X_{t+1} = P X_t``
    gives ``R_{t+1} = P R_t P``, and since every ``P`` is a polynomial in the same ``R`` the
    product ``Q = P_t ... P_1`` can be carried instead of ``X``: the ``[p, q]`` iterate is
    touched once per segment (``X <- Q X``) instead of twice per step.
    """
    total = len(steps)
    ends = {t for t in restarts if t < total} | {total}
    # Q is carried as alpha I + W: the identity part stays an exact scalar, so X_new =
    # alpha X + W X keeps the float32 iterate unrounded in its dominant term (as the standard
    # step's a X does) and the bf16 rounding of X only enters through W X, whose range lies
    # in the large singular directions. Folding alpha into W would round alpha X to bf16 and
    # put noise into the small singular directions that later steps amplify.
    alpha, w = 1.0, None
    for t, (a, b, c) in enumerate(steps, start=1):
        if r is None:
            r = mms(y, ht(y), y)
        z = b * r + c * mms(r, r, r)
        if w is None:
            alpha, w = a, z
        else:  # (alpha I + W)(a I + Z)
            alpha, w = alpha * a, a * w + alpha * z + mms(w, z, z)
        if t in ends:
            # Restart: rebuild X and, for the next segment, its Gram matrix from scratch. R
            # squares X's condition number, and in bf16 its small eigenvalues (sigma^2 of the
            # small singular values) sink below the rounding of the large ones; after a step
            # or two those singular values have grown enough for a fresh R to resolve them.
            y = alpha * y + mm(w, y)
            alpha, w, r = 1.0, None, None
        else:  # R <- P R P = a^2 R + a (R Z + Z R) + Z R Z; R Z = Z R, so it is symmetrized
            rz = mms(r, z, z)
            r = a * a * r + a * plus_ht(rz) + mms(z, rz, rz)
    return y


def ns_flops(m: int, n: int, ns_steps: int, *, method: Literal["standard", "gram"] = "standard",
             gram: GramOptions = DEFAULT_GRAM,
             symmetric_blocks: int | Literal["tiles"] = 1) -> int:
    r"""Matmul FLOPs of :func:`orthogonalize` on one ``[m, n]`` matrix.

    With ``p = min(m, n)`` and ``q = max(m, n)`` (the iteration runs on the wide orientation),
    each standard step computes ``X X^T`` (``2 p^2 q``), ``A A`` (``2 p^3``) and ``B X``
    (``2 p^2 q``). The Gram form splits the ``T`` steps into ``k`` segments at the restarts;
    each segment computes ``X X^T`` and ``Q X`` once, and per step ``R R`` (``Z``), ``W Z``
    (all but its first step) and the two products of ``R <- P R P`` (all but its last step):

    .. math::
      \mathrm{standard} = T (4 p^2 q + 2 p^3), \qquad
      \mathrm{gram} = 4 k p^2 q + (8 T - 6 k) p^3 .

    So the Gram form needs fewer FLOPs exactly when ``q > 1.5 p``. With
    ``symmetric_blocks = s > 1`` the symmetric products (standard: ``X X^T`` and ``A A``;
    Gram: all but ``Q X``) count ``(s + 1) / (2 s)`` of their FLOPs, the tiles they compute;
    with ``'tiles'``, the kernel's share of its output tiles for ``p`` padded as it pads it
    (:func:`accel_kernels.symmetric.api.tile_share`: about half for large ``p``).
    Elementwise work (``O(p q)`` per step) is left out.

    Args:
      m: rows of the matrix.
      n: columns of the matrix.
      ns_steps: Newton-Schulz steps.
      method: ``'standard'`` or ``'gram'`` (what :func:`resolve_ns_method` returns).
      gram: the Gram form's restarts.
      symmetric_blocks: row strips of the symmetric products, or ``'tiles'`` (as resolved
        by :func:`resolve_symmetric_blocks`).

    Returns:
      The FLOP count as a Python int (multiply and add counted separately).

    >>> ns_flops(2, 3, 1)
    64
    >>> ns_flops(1024, 4096, 5, method='gram') / ns_flops(1024, 4096, 5)
    0.6666666666666666
    """
    for name, v in (("m", m), ("n", n), ("ns_steps", ns_steps)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"ns_flops: {name} must be a positive int, got {v!r}.")
    p, q, t = min(m, n), max(m, n), int(ns_steps)
    s = resolve_symmetric_blocks(symmetric_blocks)
    if s == "tiles":  # the kernel's output tiles that touch the upper triangle, p padded
        num, den = symmetric_api.tile_share(p)
    else:
        num, den = s + 1, 2 * s
    if method == "standard":
        sym = t * (2 * p * p * q + 2 * p**3)  # X X^T and A A
        return t * 2 * p * p * q + (sym * num) // den
    if method != "gram":
        raise ValueError(f"ns_flops: method must be 'standard' or 'gram', got {method!r}.")
    k = 1 + sum(1 for r in gram.restarts if r < t)
    sym = 2 * k * p * p * q + (8 * t - 6 * k) * p**3  # X X^T and the [p, p] products
    return 2 * k * p * p * q + (sym * num) // den
