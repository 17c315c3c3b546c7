"""Muon as Optax transforms: ``scale_by_muon`` (the direction) and ``muon`` (the optimizer).

Thin shells over pure functions: :func:`momentum_step` (momentum, bias correction, Nesterov)
and :func:`muon_direction` (:func:`muon_jax.orthogonalize` on each leaf's ``[B, m, n]`` view,
then :func:`muon_jax.matrices.shape_scale`). With ``sharding=`` the same per-matrix step runs
on the owner blocks of :mod:`muon_jax.owners`. ``muon`` routes hidden-layer matrices to Muon
and the rest to AdamW with :func:`optax.partition`.

Structural options live in frozen option objects (:class:`muon_jax.NewtonSchulzOptions`,
:class:`muon_jax.ShardingOptions`, :class:`AdamWOptions`), which ``optax.inject_hyperparams``
keeps static; the numbers stay flat, so it can inject them (``learning_rate``, ``beta``,
``weight_decay``, ``eps``, ``ns_steps``, a numeric ``shape_scaling``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from muon_jax import arguments, dp, layouts, masking, matrices
from muon_jax.newton_schulz import (
    DEFAULT_NEWTON_SCHULZ,
    NewtonSchulzOptions,
    NsCoeffsLike,
    orthogonalize,
    resolve_ns_coeffs,
    schedule_steps,
)
from muon_jax.sharded_step import ShardedMuonState, ShardingOptions, init_sharded, update_sharded


@dataclasses.dataclass(frozen=True)
class LeafViews:
    """The matrix view of each leaf, fixed at ``init`` (a pytree node without leaves).

    Example:
      >>> LeafViews((matrices.matrix_view((4, 8)),)).views[0].m
      4
    """

    views: tuple[matrices.MatrixView, ...]


jax.tree_util.register_static(LeafViews)


class MuonState(NamedTuple):
    """State of :func:`scale_by_muon` without sharding.

    Example:
      >>> import jax.numpy as jnp
      >>> from muon_jax import scale_by_muon
      >>> state = scale_by_muon().init({'w': jnp.ones((4, 8))})
      >>> type(state).__name__, int(state.count), state.mu['w'].shape
      ('MuonState', 0, (4, 8))
    """

    count: jax.Array  # int32 scalar: number of updates so far
    mu: optax.Updates  # momentum, same tree as the params
    # the leaves' matrix views from init (static; None: read from dimension_numbers)
    views: LeafViews | None = None


def _options_number(name: str, value: Any, **bounds: Any) -> Any:
    """An option object's number, checked: a float, or a JAX array as it came (optax_compat
    passes on the values ``optax.inject_hyperparams`` traced)."""
    arguments.check_number(name, value, **bounds)
    return value if isinstance(value, jax.Array) else float(value)


@dataclasses.dataclass(frozen=True)
class AdamWOptions:
    """The AdamW part of :func:`muon`, for every leaf that is not a hidden matrix:
    ``optax.adamw(learning_rate, b1, b2, eps, eps_root, weight_decay=weight_decay,
    nesterov=nesterov, mu_dtype=mu_dtype)``.

    Frozen: ``optax.inject_hyperparams`` keeps it static, so AdamW's learning rate and weight
    decay follow :func:`muon`'s (injected) ones unless given here.

    Attributes:
      learning_rate: AdamW's learning rate, a float or an optax schedule (``None``: Muon's).
      b1: first-moment decay, in ``[0, 1)``.
      b2: second-moment decay, in ``[0, 1)``; 0.95 is the usual value for LLM training
        (optax's default is 0.999).
      eps: added to the denominator, ``>= 0``.
      eps_root: added inside the square root, ``>= 0``.
      weight_decay: decoupled weight decay, a float or a schedule (``None``: Muon's; with
        ``shape_scaling='rms_match'`` one value serves both).
      nesterov: NAdamW (what ``optax.contrib.muon(nesterov=True)`` runs for these leaves).
      mu_dtype: dtype of the first moment (``None``: the params').

    Example:
      >>> AdamWOptions(learning_rate=3e-4).b2
      0.95
      >>> AdamWOptions(b1=1.0)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: AdamWOptions: b1=1.0 is out of range [0.0, 1.0); pass e.g. b1=0.9.
    """

    learning_rate: optax.ScalarOrSchedule | None = None
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    eps_root: float = 0.0
    weight_decay: optax.ScalarOrSchedule | None = None
    nesterov: bool = False
    mu_dtype: jax.typing.DTypeLike | None = None

    def __post_init__(self):
        w = "AdamWOptions: "
        for name in ("learning_rate", "weight_decay"):
            if getattr(self, name) is not None:
                arguments.check_schedule(w + name, getattr(self, name),
                                         fix=f"e.g. {name}=3e-4, a schedule or None (Muon's).")
        for name, fix in (("b1", "e.g. b1=0.9."), ("b2", "e.g. b2=0.95.")):
            object.__setattr__(self, name, _options_number(
                w + name, getattr(self, name), low=0.0, high=1.0, high_open=True, fix=fix))
        for name, example in (("eps", "1e-8"), ("eps_root", "0.0")):
            object.__setattr__(self, name, _options_number(
                w + name, getattr(self, name), low=0.0, fix=f"e.g. {name}={example}."))
        arguments.check_bool(w + "nesterov", self.nesterov)
        object.__setattr__(self, "mu_dtype", arguments.float_dtype(
            w + "mu_dtype", self.mu_dtype, none="the params' dtype"))


DEFAULT_ADAMW = AdamWOptions()
"""The default AdamW part of :func:`muon`."""


def momentum_step(
    g: jax.Array,
    mu: jax.Array,
    count_inc: jax.Array,
    beta: jax.typing.ArrayLike,
    *,
    nesterov: bool = True,
    bias_correction: bool = True,
) -> tuple[jax.Array, jax.Array]:
    r"""One momentum step: the EMA of gradients and the matrix Newton-Schulz orthogonalizes.

    .. math::
      \mu_t = \beta \mu_{t-1} + (1-\beta) g_t, \qquad
      \hat\mu_t = \begin{cases}
        \beta \frac{\mu_t}{1-\beta^{t+1}} + (1-\beta)\frac{g_t}{1-\beta^{t}} & \text{Nesterov}\\
        \frac{\mu_t}{1-\beta^{t}} & \text{otherwise,}\end{cases}

    as in :func:`optax.contrib.scale_by_muon`. Without bias correction the ``1 / (1 - beta^k)``
    factors are dropped: ``beta mu_t + (1 - beta) g_t`` (Nesterov) or ``mu_t``, which is
    ``torch.optim.Muon``'s ``grad.lerp(buf, momentum)`` or ``buf``.

    Args:
      g: the gradient.
      mu: the previous momentum.
      count_inc: the step number ``t >= 1`` (int32 scalar).
      beta: momentum decay (a number or a scalar array, e.g. traced).
      nesterov: use the Nesterov form.
      bias_correction: divide by ``1 - beta^k`` (optax) or not (PyTorch, Keller Jordan's and
        Moonlight's references).

    Returns:
      ``(mu_t, mu_hat_t)``.

    >>> mu, mu_hat = momentum_step(jnp.ones(2), jnp.zeros(2), jnp.int32(1), 0.5, nesterov=False)
    >>> mu.tolist(), mu_hat.tolist()
    ([0.5, 0.5], [1.0, 1.0])
    >>> momentum_step(jnp.ones(2), jnp.zeros(2), jnp.int32(1), 0.5,
    ...               bias_correction=False)[1].tolist()
    [0.75, 0.75]
    """
    mu = (1 - beta) * g + beta * mu

    def corrected(t, count):
        return t / (1 - beta**count).astype(t.dtype) if bias_correction else t

    if nesterov:
        mu_hat = beta * corrected(mu, optax.safe_increment(count_inc)) + (1 - beta) * corrected(
            g, count_inc
        )
    else:
        mu_hat = corrected(mu, count_inc)
    return mu, mu_hat


def muon_direction(
    mats: jax.Array,
    *,
    ns_coeffs: NsCoeffsLike = "jordan",
    ns_steps: Any = 5,
    eps: Any = 1e-8,
    shape_scaling: matrices.ShapeScaling = "spectral",
    newton_schulz: NewtonSchulzOptions = DEFAULT_NEWTON_SCHULZ,
) -> jax.Array:
    r"""Muon's direction for a ``[B, m, n]`` batch of (momentum) matrices ``M``:

    .. math::
      O = s(m, n) \cdot \mathrm{NS}(M) \quad (\text{times } \langle M, \mathrm{NS}(M) \rangle
      \text{ per matrix with } \texttt{adaptive}),

    NS the Newton-Schulz iteration of :func:`muon_jax.orthogonalize` with ``newton_schulz``'s
    options and ``s`` :func:`muon_jax.matrices.shape_scale`. The numbers may be traced.

    Args:
      mats: ``[B, m, n]`` float or complex matrices.
      ns_coeffs: the schedule (:func:`muon_jax.orthogonalize`).
      ns_steps: the iterations.
      eps: added to the norm before Newton-Schulz.
      shape_scaling: ``'spectral'``, ``'spectral_unclamped'``, ``'rms_match'``, a number
        ``c`` (``c sqrt(max(m, n))``) or ``None``.
      newton_schulz: the iteration's options.

    Returns:
      ``[B, m, n]`` in the dtype of ``mats``.

    >>> o = muon_direction(jnp.eye(4)[None] * 3.0, ns_coeffs='polar_express', ns_steps=8,
    ...                    shape_scaling=None, newton_schulz=NewtonSchulzOptions(dtype='float32'))
    >>> bool(jnp.allclose(o, jnp.eye(4), atol=1e-2))
    True
    """
    o = newton_schulz
    out = orthogonalize(mats, ns_coeffs=ns_coeffs, ns_steps=ns_steps, eps=eps, dtype=o.dtype,
                        preconditioning=o.preconditioning, method=o.method, gram=o.gram,
                        symmetric_blocks=o.symmetric_blocks)
    if o.adaptive:  # the dual norm <M, O> of each matrix
        out = jnp.sum(mats.conj() * out, axis=(-2, -1), keepdims=True).astype(out.dtype) * out
    scale = matrices.shape_scale(mats.shape[-2], mats.shape[-1], shape_scaling)
    if isinstance(scale, float) and scale == 1.0:
        return out
    return out * jnp.asarray(scale).astype(out.dtype)


def _muon_step(g: jax.Array, mu: jax.Array, count_inc: jax.Array, numbers: dict, *,
               out_dtype: Any, nesterov: bool, bias_correction: bool,
               newton_schulz: NewtonSchulzOptions) -> tuple[jax.Array, jax.Array]:
    """Momentum and direction of one ``[B, m, n]`` batch: one definition for both paths."""
    mu_new, mu_hat = momentum_step(g, mu, count_inc, numbers["beta"], nesterov=nesterov,
                                   bias_correction=bias_correction)
    o = muon_direction(mu_hat, ns_coeffs=numbers["ns_coeffs"], ns_steps=numbers["ns_steps"],
                       eps=numbers["eps"], shape_scaling=numbers["shape_scaling"],
                       newton_schulz=newton_schulz)
    return mu_new, o.astype(out_dtype)


def _check_direction_args(ns_coeffs: Any, ns_steps: Any, beta: Any, eps: Any, mu_dtype: Any,
                          nesterov: Any, bias_correction: Any, shape_scaling: Any,
                          dimension_numbers: Any, newton_schulz: Any, sharding: Any) -> Any:
    """Check :func:`scale_by_muon`'s arguments; returns ``mu_dtype`` canonical."""
    if arguments.is_traced(ns_coeffs) or arguments.is_traced(ns_steps):
        schedule_steps(ns_coeffs, ns_steps)
    else:
        resolve_ns_coeffs(ns_coeffs, ns_steps)
    arguments.check_number("beta", beta, low=0.0, high=1.0, high_open=True,
                           fix="a momentum decay in [0, 1), e.g. beta=0.95.")
    arguments.check_number("eps", eps, low=0.0, fix="e.g. eps=1e-8.")
    arguments.check_bool("nesterov", nesterov)
    arguments.check_bool("bias_correction", bias_correction)
    if not (shape_scaling is None or isinstance(shape_scaling, str)):
        arguments.check_number("shape_scaling", shape_scaling, low=0.0, low_open=True,
                               fix="'spectral', 'rms_match' or a factor c > 0.")
    elif shape_scaling is not None and shape_scaling not in matrices.SHAPE_SCALINGS:
        matrices.shape_scale(1, 1, shape_scaling)  # raises, naming the choices
    arguments.check_tree("dimension_numbers", dimension_numbers,
                    "MuonDimensionNumbers, a tree of them or a callable on params")
    if not isinstance(newton_schulz, NewtonSchulzOptions):
        raise TypeError(f"newton_schulz={newton_schulz!r} is not a muon_jax.NewtonSchulzOptions;"
                        " pass e.g. newton_schulz=muon_jax.NewtonSchulzOptions(dtype=jnp.float32).")
    if isinstance(sharding, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        raise TypeError("sharding= takes a muon_jax.ShardingOptions, not a mesh; pass "
                        "sharding=muon_jax.ShardingOptions(mesh).")
    if sharding is not None and not isinstance(sharding, ShardingOptions):
        raise TypeError(f"sharding={sharding!r} is not a muon_jax.ShardingOptions; pass "
                        "sharding=muon_jax.ShardingOptions(mesh), or None (unsharded).")
    return arguments.float_dtype("mu_dtype", mu_dtype, none="the params' dtype")


def scale_by_muon(
    ns_coeffs: NsCoeffsLike = "jordan",
    ns_steps: int = 5,
    beta: jax.typing.ArrayLike = 0.95,
    eps: jax.typing.ArrayLike = 1e-8,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = True,
    bias_correction: bool = True,
    shape_scaling: matrices.ShapeScaling = "spectral",
    dimension_numbers: matrices.DimNumsLike = None,
    newton_schulz: NewtonSchulzOptions = DEFAULT_NEWTON_SCHULZ,
    sharding: ShardingOptions | None = None,
) -> optax.GradientTransformation:
    r"""Rescale updates to Muon's direction: orthogonalized (Nesterov) momentum.

    Per leaf, viewed as a batch of ``[m, n]`` matrices (``m`` fan-in, ``n`` fan-out):

    .. math::
      \mu_t = \beta \mu_{t-1} + (1-\beta) G_t, \quad
      O_t = s(m, n) \cdot \mathrm{NS}(\hat\mu_t),

    with ``mu_hat`` the (bias-corrected) Nesterov or plain momentum of :func:`momentum_step`,
    NS the Newton-Schulz iteration of :func:`muon_jax.orthogonalize` and ``s`` the shape
    scaling of :func:`muon_jax.matrices.shape_scale` (:func:`muon_direction`). With
    ``newton_schulz.adaptive`` the orthogonalized matrix is scaled by its dual norm before
    ``s``: ``O <- <mu_hat, O> O`` with ``<A, B> = sum(conj(A) * B)`` per matrix, about the
    nuclear norm of ``mu_hat`` (steepest descent under the spectral norm, Bernstein and
    Newhouse). Every leaf must be a float array of rank >= 2 (``None`` /
    ``optax.MaskedNode`` leaves pass through); route the rest elsewhere, as :func:`muon` does.

    Each leaf's matrix view is fixed at ``init``: its ``dimension_numbers`` entry, else the
    view its Flax layer gives it (:func:`muon_jax.layouts.leaf_dimension_numbers`), else the
    default (last two axes the matrix, leading axes a batch; a warning names leaves of rank
    >= 3 that get it).

    The state type follows from the call: :class:`MuonState` without ``sharding``, and
    :class:`ShardedMuonState` with it.

    Args:
      ns_coeffs: Newton-Schulz schedule: ``'jordan'``, ``'polar_express'``, ``'dion'``, a
        triple or per-step triples (see :func:`muon_jax.orthogonalize`).
      ns_steps: Newton-Schulz iterations, ``>= 1``.
      beta: momentum decay, in ``[0, 1)``.
      eps: added to the Frobenius norm before Newton-Schulz, ``>= 0``.
      mu_dtype: dtype of the momentum (``None``: the params' dtype).
      nesterov: use Nesterov momentum.
      bias_correction: divide the momentum by ``1 - beta^t`` as optax does; ``False``
        reproduces ``torch.optim.Muon`` (and Keller Jordan's and Moonlight's references).
      shape_scaling: ``'spectral'``, ``'spectral_unclamped'``, ``'rms_match'``, a factor
        ``c > 0`` (``c sqrt(max(m, n))``: optax's ``consistent_rms``; ``'rms_match'`` is 0.2)
        or ``None``.
      dimension_numbers: ``optax.contrib.MuonDimensionNumbers`` (or
        :class:`muon_jax.SplitDimensionNumbers` for fused leaves) for every leaf, a tree (or
        prefix) of them, or a callable on params returning one. Entries that are ``None`` (or
        ``MaskedNode``) take the leaf's layer view or the default (above). Explicit entries
        always win.
      newton_schulz: the iteration's options (:class:`muon_jax.NewtonSchulzOptions`: matmul
        dtype, preconditioning, standard or Gram form, symmetric products, ``adaptive``).
      sharding: shard the optimizer ZeRO-1 style (:class:`muon_jax.ShardingOptions`: mesh,
        shard axes, param specs, chunking, wire dtypes); ``None``: unsharded.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`MuonState` (``sharding=None``)
      or :class:`ShardedMuonState`.

    >>> import optax
    >>> tx = scale_by_muon(newton_schulz=NewtonSchulzOptions(dtype=jnp.float32))
    >>> params = {'w': jnp.zeros((4, 8))}
    >>> updates, state = tx.update({'w': jnp.eye(4, 8)}, tx.init(params))
    >>> updates['w'].shape, int(state.count), type(state).__name__
    ((4, 8), 1, 'MuonState')
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> type(scale_by_muon(sharding=ShardingOptions(mesh)).init(params)).__name__
    'ShardedMuonState'

    References:
      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024.

      Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025.

      Bernstein and Newhouse, `Old Optimizer, New Norm: An Anthology
      <https://arxiv.org/abs/2409.20325>`_, 2024 (``adaptive``).

      Rajbhandari et al., `ZeRO <https://arxiv.org/abs/1910.02054>`_, 2020 (owner compute).
    """
    mu_dtype = _check_direction_args(ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov,
                                     bias_correction, shape_scaling, dimension_numbers,
                                     newton_schulz, sharding)
    numbers = {"beta": beta, "eps": eps, "ns_steps": ns_steps, "ns_coeffs": ns_coeffs,
               "shape_scaling": shape_scaling}
    step = functools.partial(_muon_step, nesterov=nesterov, bias_correction=bias_correction,
                             newton_schulz=newton_schulz)

    def init_fn(params):
        dims = layouts.leaf_dimension_numbers(params, dimension_numbers)
        views = _matrix_views(params, dims, "params")
        if sharding is not None:
            return init_sharded(params, sharding, dims, mu_dtype)
        mu = optax.tree.zeros_like(params, dtype=mu_dtype)
        return MuonState(count=jnp.zeros([], jnp.int32), mu=mu, views=LeafViews(tuple(views)))

    def update_fn(updates, state, params=None):
        del params
        if isinstance(state, ShardedMuonState):
            if sharding is None:
                raise TypeError("scale_by_muon: got a ShardedMuonState, but this transform "
                                "has sharding=None; update with the transform that made it.")
            return update_sharded(updates, state, step, numbers, sharding, newton_schulz.dtype)
        if not isinstance(state, MuonState):
            raise TypeError(
                f"scale_by_muon: state must be the MuonState of this transform's init, got "
                f"{type(state).__name__}."
            )
        views = state.views.views if state.views is not None else _matrix_views(
            updates, matrices.resolve_dim_nums(dimension_numbers, updates), "updates")
        return _unsharded_update(updates, state, views, step, numbers)

    return optax.GradientTransformation(init_fn, update_fn)


def _matrix_views(tree: Any, dims: list[Any], what: str) -> list[matrices.MatrixView]:
    """Validated matrix view per leaf; errors name the leaf and the fix."""
    leaves_with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = []
    for (path, leaf), d in zip(leaves_with_path, dims, strict=True):
        name = matrices.path_str(path)
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(
                f"{what} leaf {name!r} has dtype {dtype}; Muon updates float or complex "
                "matrices only: route it to AdamW (muon_mask) or keep it out of the optimized "
                "params."
            )
        out.append(matrices.matrix_view(leaf.shape, d, path=f"{what} leaf {name!r}"))
    return out


def _unsharded_update(updates: Any, state: MuonState, views: list, step: Callable,
                      numbers: dict) -> tuple[Any, MuonState]:
    """The per-leaf update of :func:`scale_by_muon` without a mesh."""
    count_inc = optax.safe_increment(state.count)
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    mus = treedef.flatten_up_to(state.mu)
    if len(views) != len(flat):
        raise ValueError(f"scale_by_muon: got {len(flat)} gradient leaves but the state was "
                         f"initialized for {len(views)}; pass gradients with the structure of "
                         "the params.")
    for (path, g), m, view in zip(flat, mus, views, strict=True):
        if tuple(g.shape) != tuple(m.shape) or tuple(g.shape) != view.leaf_shape:
            raise ValueError(
                f"scale_by_muon: gradient leaf {matrices.path_str(path)!r} has shape {g.shape}, "
                f"but its momentum (from the params at init) has {m.shape}; pass the "
                "gradients of the params."
            )
    new_mu, out = [], []
    for (_, g), m, view in zip(flat, mus, views, strict=True):
        m_new, o = step(matrices.to_matrices(g, view), matrices.to_matrices(m, view), count_inc,
                        numbers, out_dtype=g.dtype)
        new_mu.append(matrices.from_matrices(m_new, view).astype(m.dtype))
        out.append(matrices.from_matrices(o, view))
    mu = jax.tree.unflatten(treedef, new_mu)
    return jax.tree.unflatten(treedef, out), state._replace(count=count_inc, mu=mu)


def _reducing(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` after all-reducing gradients that arrive unreduced (same state as ``tx``)."""

    def update_fn(updates, state, params=None):
        return tx.update(jax.tree.map(dp.reduce_unreduced, updates), state, params)

    return optax.GradientTransformation(tx.init, update_fn)


def _check_optimizer_args(learning_rate: Any, weight_decay: Any, muon_mask: Any,
                          weight_decay_mask: Any, adamw: Any) -> None:
    """Check the arguments :func:`muon` adds to :func:`scale_by_muon`'s."""
    arguments.check_schedule("learning_rate", learning_rate,
                             fix="e.g. learning_rate=0.02 or an optax schedule.")
    arguments.check_schedule("weight_decay", weight_decay,
                             fix="e.g. weight_decay=0.01 or an optax schedule.")
    arguments.check_tree("muon_mask", muon_mask, "a tree of bools or a callable on params "
                         "returning one (None: muon_jax.default_muon_mask)")
    arguments.check_tree("weight_decay_mask", weight_decay_mask,
                         "a tree of bools or a callable on params returning one (None: every "
                         "leaf)")
    if not isinstance(adamw, AdamWOptions):
        raise TypeError(f"adamw={adamw!r} is not a muon_jax.AdamWOptions; pass e.g. "
                        "adamw=muon_jax.AdamWOptions(learning_rate=3e-4).")


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: NsCoeffsLike = "jordan",
    ns_steps: int = 5,
    beta: jax.typing.ArrayLike = 0.95,
    eps: jax.typing.ArrayLike = 1e-8,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    *,
    mu_dtype: jax.typing.DTypeLike | None = None,
    nesterov: bool = True,
    bias_correction: bool = True,
    shape_scaling: matrices.ShapeScaling = "rms_match",
    muon_mask: masking.MaskLike | None = None,
    dimension_numbers: matrices.DimNumsLike = None,
    weight_decay_mask: Any = None,
    adamw: AdamWOptions = DEFAULT_ADAMW,
    newton_schulz: NewtonSchulzOptions = DEFAULT_NEWTON_SCHULZ,
    sharding: ShardingOptions | None = None,
) -> optax.GradientTransformation:
    r"""Muon for hidden-layer matrices, AdamW for every other leaf.

    Muon leaves (chosen by ``muon_mask``, default :func:`muon_jax.default_muon_mask`):

    .. math::
      W \leftarrow W - \eta_t \, (O_t + \lambda W), \qquad O_t = \text{scale\_by\_muon}(G_t),

    with decoupled weight decay ``lambda = weight_decay``. Other leaves get
    ``optax.adamw`` with ``adamw``'s options (its learning rate and weight decay default to
    Muon's). With the default ``shape_scaling='rms_match'`` Muon's updates have the RMS of
    AdamW's (~0.2), so one learning rate and weight decay can serve both.
    ``torch.optim.Muon`` is ``bias_correction=False, shape_scaling='spectral'`` (its default
    ``adjust_lr_fn``), see the README's "Coming from PyTorch / optax.contrib";
    :func:`muon_jax.optax_compat.muon` takes ``optax.contrib.muon``'s arguments.

    Flax models need no dimension numbers: ``init`` on an ``nnx.State`` of the model's own
    variables (what ``nnx.Optimizer`` passes) reads each kernel's view from its layer, and
    Linen param trees from their auto-named modules
    (:func:`muon_jax.layouts.leaf_dimension_numbers`).

    Every argument is checked here; the numbers may also be traced (``optax.inject_hyperparams``
    needs no ``static_args`` for the defaults).

    Args:
      learning_rate: Muon's learning rate, a float or an ``optax`` schedule.
      ns_coeffs: Newton-Schulz schedule (see :func:`muon_jax.orthogonalize`).
      ns_steps: Newton-Schulz iterations, ``>= 1``.
      beta: Muon momentum decay, in ``[0, 1)``.
      eps: added to the Frobenius norm before Newton-Schulz.
      weight_decay: decoupled weight decay of the Muon leaves (multiplied by the learning
        rate), a float or a schedule.
      mu_dtype: dtype of Muon's momentum (``None``: the params' dtype).
      nesterov: Nesterov momentum for Muon.
      bias_correction: bias-corrected momentum (optax) or not (PyTorch); see
        :func:`scale_by_muon`.
      shape_scaling: ``'rms_match'``, ``'spectral'``, ``'spectral_unclamped'``, a factor
        ``c > 0`` (optax's ``consistent_rms``) or ``None`` (see
        :func:`muon_jax.matrices.shape_scale`).
      muon_mask: ``None`` for the default rule, or a tree (prefix) of bools or a callable on
        params returning one (``True``: Muon); it replaces the default rule entirely.
      dimension_numbers: as in :func:`scale_by_muon`, for the leaves Muon updates. Under the
        default rule, leaves with entries of their own (a tree of them) go to Muon; one
        ``MuonDimensionNumbers`` for the whole tree routes nothing (a bias still goes to
        AdamW and is not checked against it). Unlike ``optax.contrib.muon``, ``None`` here
        means "the layer's or the default view", not "AdamW"; routing is ``muon_mask``'s job.
      weight_decay_mask: which Muon leaves decay (a tree / prefix of bools or a callable, as
        ``optax.add_decayed_weights``' mask); ``None``: all of them.
      adamw: the AdamW part (:class:`AdamWOptions`: learning rate, betas, eps, weight decay,
        Nesterov, moment dtype).
      newton_schulz: Muon's Newton-Schulz options (:class:`muon_jax.NewtonSchulzOptions`).
      sharding: shard Muon's state and work over a mesh (:class:`muon_jax.ShardingOptions`);
        ``None``: unsharded. AdamW leaves keep the params' shardings; their gradients are
        all-reduced first if they arrive unreduced.

    Returns:
      An ``optax.GradientTransformation`` whose state is an ``optax.partition``'s, with
      labels ``'muon'`` and ``'adamw'``.

    >>> import optax
    >>> params = {'embed': jnp.ones((16, 8)), 'w': jnp.ones((8, 8)), 'b': jnp.zeros(8)}
    >>> tx = muon(0.02, weight_decay=0.1, adamw=AdamWOptions(learning_rate=3e-3))
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> sorted(updates)
    ['b', 'embed', 'w']

    References:
      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024.

      Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025.

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019.
    """
    _check_optimizer_args(learning_rate, weight_decay, muon_mask, weight_decay_mask, adamw)
    direction = functools.partial(
        scale_by_muon, ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov,
        bias_correction=bias_correction, shape_scaling=shape_scaling,
        newton_schulz=newton_schulz, sharding=sharding)
    direction(dimension_numbers=dimension_numbers)  # its arguments are checked now
    adamw_tx = _reducing(optax.adamw(
        learning_rate if adamw.learning_rate is None else adamw.learning_rate,
        b1=adamw.b1, b2=adamw.b2, eps=adamw.eps, eps_root=adamw.eps_root,
        weight_decay=weight_decay if adamw.weight_decay is None else adamw.weight_decay,
        mu_dtype=adamw.mu_dtype, nesterov=adamw.nesterov))

    def labels(params):
        flags = masking.resolve_muon_mask(muon_mask, params, dimension_numbers=dimension_numbers)
        return jax.tree.unflatten(jax.tree.structure(params),
                                  ["muon" if f else "adamw" for f in flags])

    def partitioned(view_dims: Any) -> optax.GradientTransformation:
        muon_tx = optax.chain(direction(dimension_numbers=view_dims),
                              optax.add_decayed_weights(weight_decay, weight_decay_mask),
                              optax.scale_by_learning_rate(learning_rate))
        return optax.partition({"muon": muon_tx, "adamw": adamw_tx}, labels)

    def init_fn(params):
        # The views are read here, where the model's own variables are seen (the partition
        # hands Muon's transform copies); the update reads them from Muon's state.
        flags = masking.resolve_muon_mask(muon_mask, params, dimension_numbers=dimension_numbers)
        return partitioned(layouts.views_by_path(params, dimension_numbers, flags)).init(params)

    def update_fn(updates, state, params=None):
        return partitioned(dimension_numbers).update(updates, state, params)

    return optax.GradientTransformation(init_fn, update_fn)
