"""Muon as Optax transforms: ``scale_by_muon`` (the direction) and ``muon`` (the optimizer).

Thin shells over pure functions: :func:`momentum_step` (momentum, bias correction, Nesterov),
:func:`muon_jax.orthogonalize` on each leaf's ``[B, m, n]`` view, and
:func:`muon_jax.matrices.shape_scale`. With ``mesh=`` the same per-matrix step runs on the
owner blocks of :mod:`muon_jax.owners`. ``muon`` routes hidden-layer matrices to Muon and the
rest to AdamW with :func:`optax.partition`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from muon_jax import dp, masking, matrices, newton_schulz, owner_plan
from muon_jax.newton_schulz import (
    GramOptions,
    NsCoeffsLike,
    NsMethod,
    Preconditioning,
    orthogonalize,
    resolve_ns_coeffs,
)
from muon_jax.sharded_step import (
    GatherDtype,
    ShardedMuonState,
    SpecsLike,
    init_sharded,
    update_sharded,
)

MeshArg = jax.sharding.Mesh | jax.sharding.AbstractMesh | None


class MuonState(NamedTuple):
    """State of :func:`scale_by_muon` without a mesh.

    Example:
      >>> import jax.numpy as jnp
      >>> from muon_jax import scale_by_muon
      >>> state = scale_by_muon().init({'w': jnp.ones((4, 8))})
      >>> type(state).__name__, int(state.count), state.mu['w'].shape
      ('MuonState', 0, (4, 8))
    """

    count: jax.Array  # int32 scalar: number of updates so far
    mu: optax.Updates  # momentum, same tree as the params


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
      beta: momentum decay.
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


def _matrix_views(tree: Any, dimension_numbers: matrices.DimNumsLike, what: str):
    """Validated matrix view per leaf; errors name the leaf and the fix."""
    flat_dims = matrices.resolve_dim_nums(dimension_numbers, tree)
    leaves_with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = []
    for (path, leaf), d in zip(leaves_with_path, flat_dims, strict=True):
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


def _float_dtype_or_none(value: Any, name: str, also: str = "") -> Any:
    """``value`` as a canonical float dtype, or ``None``; ``ValueError`` naming ``name``."""
    if value is None:
        return None
    try:
        dt = jax.dtypes.canonicalize_dtype(value)
    except TypeError:  # not a dtype at all, e.g. a misspelled name
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"{name}={dt or value} is not a float dtype; pass {also}"
                         "jnp.bfloat16, jnp.float32 or None (the gradient dtype).")
    return dt


def scale_by_muon(
    ns_coeffs: NsCoeffsLike = "jordan",
    ns_steps: int = 5,
    beta: jax.typing.ArrayLike = 0.95,
    eps: float = 1e-8,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = True,
    bias_correction: bool = True,
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    shape_scaling: matrices.ShapeScaling = "spectral",
    dimension_numbers: matrices.DimNumsLike = None,
    mesh: MeshArg = None,
    shard_axes: str | tuple[str, ...] | None = None,
    param_specs: SpecsLike = None,
    chunk_bytes: int | None = owner_plan.DEFAULT_CHUNK_BYTES,
    gather_dtype: GatherDtype = "auto",
    reduce_dtype: jax.typing.DTypeLike | None = None,
    preconditioning: Preconditioning = "frobenius",
    adaptive: bool = False,
    consistent_rms: float | None = None,
    ns_method: NsMethod = "auto",
    ns_gram: GramOptions = newton_schulz.DEFAULT_GRAM,
    ns_symmetric_blocks: newton_schulz.SymmetricBlocks = "auto",
) -> optax.GradientTransformation:
    r"""Rescale updates to Muon's direction: orthogonalized (Nesterov) momentum.

    Per leaf, viewed as a batch of ``[m, n]`` matrices (``m`` fan-in, ``n`` fan-out):

    .. math::
      \mu_t = \beta \mu_{t-1} + (1-\beta) G_t, \quad
      O_t = s(m, n) \cdot \mathrm{NS}(\hat\mu_t),

    with ``mu_hat`` the (bias-corrected) Nesterov or plain momentum of :func:`momentum_step`,
    NS the Newton-Schulz iteration of :func:`muon_jax.orthogonalize` (its ``preconditioning``),
    and ``s`` the shape scaling of :func:`muon_jax.matrices.shape_scale`, or ``consistent_rms
    \sqrt{\max(m, n)}``. With ``adaptive`` the orthogonalized matrix is scaled by its dual
    norm before ``s``: ``O <- <mu_hat, O> O`` with ``<A, B> = sum(conj(A) * B)`` per matrix,
    about the nuclear norm of ``mu_hat`` (steepest descent under the spectral norm, Bernstein
    and Newhouse). Every leaf must be a float array of rank
    >= 2 (``None`` / ``optax.MaskedNode`` leaves pass through); route the rest elsewhere, as
    :func:`muon` does.

    The state type follows from the call: :class:`MuonState` without ``mesh``, and
    :class:`ShardedMuonState` with one (an ambient ``jax.set_mesh`` mesh is not used; pass
    ``mesh=jax.sharding.get_abstract_mesh()`` to shard over it).

    Args:
      ns_coeffs: Newton-Schulz schedule: ``'jordan'``, ``'polar_express'``, a triple or
        per-step triples (see :func:`muon_jax.orthogonalize`).
      ns_steps: Newton-Schulz iterations, ``>= 1``.
      beta: momentum decay.
      eps: added to the Frobenius norm before Newton-Schulz.
      mu_dtype: dtype of the momentum (``None``: the params' dtype).
      nesterov: use Nesterov momentum.
      bias_correction: divide the momentum by ``1 - beta^t`` as optax does; ``False``
        reproduces ``torch.optim.Muon`` (and Keller Jordan's and Moonlight's references).
      ns_dtype: dtype of the Newton-Schulz matmul operands.
      shape_scaling: ``'spectral'``, ``'spectral_unclamped'``, ``'rms_match'`` or ``None``.
      dimension_numbers: ``optax.contrib.MuonDimensionNumbers`` for every leaf, a tree (or
        prefix) of them, or a callable on params returning one. Entries that are ``None``
        (or ``MaskedNode``) use the default: the last two axes are the matrix (reduction, output)
        and leading axes are a batch, so ``[m, n]`` is one matrix and ``[L, m, n]`` a stack.
        Conv kernels ``[kh, kw, c_in, c_out]`` need ``MuonDimensionNumbers((0, 1, 2), 3)``.
      mesh: shard the optimizer over this mesh (ZeRO-1 owner compute, see
        :mod:`muon_jax.owners`); ``None``: unsharded. Matrices of one shape form stacks whose
        stack axis is split over ``shard_axes``: each device keeps the momentum of, and
        orthogonalizes, only its own whole matrices; gradients arrive by reduce-scatter when
        they are unreduced (see :func:`muon_jax.dp.reduced_view`), else by a local slice
        (replicated) or an all-to-all (FSDP / tensor-parallel leaves); updates leave with the
        params' shardings, in the gradient dtype.
      shard_axes: mesh axes that split the stacks (``None``: all mesh axes). Every mesh axis
        that shards a Muon param must be one of them.
      param_specs: the params' ``PartitionSpec`` s (a spec for every leaf, a tree or prefix of
        them with ``None`` for replicated, or a callable on params returning one). ``None``:
        read at ``init`` from the params: concrete arrays and ``jax.ShapeDtypeStruct`` s carry
        their sharding, traced ones only their Explicit axes. Needed when ``init`` is traced
        (``jax.jit``, ``jax.eval_shape``, ``nnx.jit``) on a mesh whose shard axes are Auto.
      chunk_bytes: with a mesh, split each stack's owned matrices into chunks whose
        collectives move about this many bytes (full buffer ``N * rows * m * n`` in the
        gradient dtype; at least one matrix per device per chunk), each moved and
        orthogonalized on its own so XLA can overlap one chunk's collectives with another's
        Newton-Schulz. ``None`` (default) or 0: one collective per stack and direction (see
        :data:`muon_jax.owner_plan.DEFAULT_CHUNK_BYTES`).
      preconditioning: how Newton-Schulz scales its input (:func:`muon_jax.orthogonalize`):
        ``'frobenius'``, ``'spectral'``, ``'aol'`` or ``'schatten'``.
      adaptive: scale each orthogonalized matrix by ``<mu_hat, O>`` (above). optax sums that
        product over a whole leaf; here each matrix of a batched leaf gets its own (the same
        for 2-D leaves).
      consistent_rms: if given, the shape scaling is ``consistent_rms * sqrt(max(m, n))`` in
        place of ``shape_scaling`` (optax's ``consistent_rms``; ``'rms_match'`` is 0.2).
      gather_dtype: with a mesh, the dtype the orthogonalized updates travel in from their
        owners back to the params' shardings (all-gather or all-to-all), cast to the
        gradient dtype on arrival. ``'auto'`` (default): bfloat16 for float32 gradients
        when ``ns_dtype`` is 16-bit, else the gradient dtype
        (:func:`muon_jax.sharded_step.resolve_gather_dtype`); ``None``: the gradient dtype
        (the sharded update then equals the unsharded one); or a dtype. bfloat16 halves
        those bytes for f32 gradients at a relative rounding of 2^-9 per element of an
        update whose entries are all about the same size (orthogonal rows), no coarser than
        Newton-Schulz's 16-bit matmuls; 3-seed training runs ended within their seed spread
        of f32 gathers (docs/benchmark_log.md, The trainer).
      reduce_dtype: with a mesh, the dtype in which gradients that arrive unreduced
        (:func:`muon_jax.reduced_view`) are summed on their way to the owners (the
        reduce-scatter, and the all-reduce over axes that do not shard the stacks), cast
        back to the gradient dtype after. ``None`` (default): the gradient dtype, exact.
        ``jnp.bfloat16`` halves those bytes for f32 gradients, the other half of Muon's
        traffic (the mixed-precision ``reduce_dtype`` of FSDP), at a cost in precision:
        each device's partial sum rounds to bf16 (and, on GPU, each addition of the ring),
        and where the partials cancel the error is large relative to their sum, larger
        than bf16 Newton-Schulz's own (``tests/muon_jax/test_muon_sharded.py``). Not the
        default: no training run has set it yet. Replicated or sharded gradients move
        unsummed and keep their dtype.
      ns_method: ``'standard'`` Newton-Schulz, its ``'gram'`` form (iterates on ``X X^T``,
        fewer FLOPs for matrices more than 1.5x as wide as tall), or ``'auto'`` (today the
        standard form: see :func:`muon_jax.newton_schulz.resolve_ns_method`). Same on the
        sharded path: each owner runs it on its own matrices.
      ns_gram: restarts and operand dtype of the Gram form
        (:class:`muon_jax.newton_schulz.GramOptions`).
      ns_symmetric_blocks: Newton-Schulz's symmetric products (``X X^T`` and the polynomial
        in it) from one block triangle in this many row strips; ``'auto'``: 4 on a GPU for
        the banks of large matrices where that is faster, else 1 (plain matmuls). See
        :func:`muon_jax.orthogonalize`.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`MuonState` (``mesh=None``) or
      :class:`ShardedMuonState`.

    >>> import optax
    >>> tx = scale_by_muon(ns_dtype=jnp.float32)
    >>> params = {'w': jnp.ones((4, 8))}
    >>> updates, state = tx.update({'w': jnp.eye(4, 8)}, tx.init(params))
    >>> updates['w'].shape, int(state.count), type(state).__name__
    ((4, 8), 1, 'MuonState')
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> type(scale_by_muon(mesh=mesh).init(params)).__name__
    'ShardedMuonState'

    References:
      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024.

      Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025.

      Bernstein and Newhouse, `Old Optimizer, New Norm: An Anthology
      <https://arxiv.org/abs/2409.20325>`_, 2024 (``adaptive``).

      Rajbhandari et al., `ZeRO <https://arxiv.org/abs/1910.02054>`_, 2020 (owner compute).
    """
    resolve_ns_coeffs(ns_coeffs, ns_steps)  # fail at construction on a bad schedule
    matrices.shape_scale(1, 1, shape_scaling)  # and on a bad scaling name
    owner_plan.check_chunk_bytes(chunk_bytes)
    if mesh is not None:
        owner_plan.resolve_shard_axes(mesh, shard_axes, where="scale_by_muon")
    if not (isinstance(gather_dtype, str) and gather_dtype == "auto"):
        gather_dtype = _float_dtype_or_none(gather_dtype, "gather_dtype", "'auto', ")
    reduce_dtype = _float_dtype_or_none(reduce_dtype, "reduce_dtype")
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)
    if mu_dtype is not None and not jnp.issubdtype(mu_dtype, jnp.floating):
        raise ValueError(
            f"mu_dtype={mu_dtype} is not a float dtype; pass jnp.float32, jnp.bfloat16 or None "
            "(the params' dtype)."
        )

    if preconditioning not in newton_schulz.PRECONDITIONINGS:
        raise ValueError(f"preconditioning={preconditioning!r} is not supported; use one of "
                         f"{newton_schulz.PRECONDITIONINGS}.")
    newton_schulz.resolve_ns_method(ns_method, 1, 1, jnp.float32)  # a bad name fails here
    if not isinstance(ns_gram, GramOptions):
        raise TypeError(f"ns_gram must be a muon_jax.newton_schulz.GramOptions, got {ns_gram!r}.")
    newton_schulz.resolve_symmetric_blocks(ns_symmetric_blocks, name="ns_symmetric_blocks")
    if consistent_rms is not None and not (isinstance(consistent_rms, int | float)
                                           and consistent_rms > 0):
        raise ValueError(f"consistent_rms must be a positive float or None, got "
                         f"{consistent_rms!r}; 0.2 matches AdamW's update RMS.")

    def direction(mats, m, n):
        """Orthogonalized, shape-scaled ``[B, m, n]`` matrices: one definition for both paths."""
        o = orthogonalize(mats, ns_coeffs=ns_coeffs, ns_steps=ns_steps, eps=eps, dtype=ns_dtype,
                          preconditioning=preconditioning, method=ns_method, gram=ns_gram,
                          symmetric_blocks=ns_symmetric_blocks)
        if adaptive:  # the dual norm <mu_hat, O> of each matrix
            o = jnp.sum(mats.conj() * o, axis=(-2, -1), keepdims=True).astype(o.dtype) * o
        if consistent_rms is not None:
            scale = float(consistent_rms) * max(m, n) ** 0.5
        else:
            scale = matrices.shape_scale(m, n, shape_scaling)
        return o * jnp.asarray(scale, o.dtype) if scale != 1.0 else o

    def step(g, mu, count_inc, m, n, *, out_dtype):
        """Momentum and direction of one ``[B, m, n]`` batch."""
        mu_new, mu_hat = momentum_step(g, mu, count_inc, beta, nesterov=nesterov,
                                       bias_correction=bias_correction)
        return mu_new, direction(mu_hat, m, n).astype(out_dtype)

    def init_fn(params):
        _matrix_views(params, dimension_numbers, "params")
        if mesh is not None:
            return init_sharded(params, mesh, shard_axes, param_specs, dimension_numbers,
                                 mu_dtype, chunk_bytes)
        mu = optax.tree.zeros_like(params, dtype=mu_dtype)
        return MuonState(count=jnp.zeros([], jnp.int32), mu=mu)

    def update_fn(updates, state, params=None):
        del params
        if isinstance(state, ShardedMuonState):
            return update_sharded(updates, state, step, gather_dtype, ns_dtype, reduce_dtype)
        if not isinstance(state, MuonState):
            raise TypeError(
                f"scale_by_muon: state must be the MuonState of this transform's init, got "
                f"{type(state).__name__}."
            )
        views = _matrix_views(updates, dimension_numbers, "updates")
        return _unsharded_update(updates, state, views, step, mu_dtype)

    return optax.GradientTransformation(init_fn, update_fn)


def _unsharded_update(updates: Any, state: MuonState, views: list, step: Callable,
                      mu_dtype: Any) -> tuple[Any, MuonState]:
    """The per-leaf update of :func:`scale_by_muon` without a mesh."""
    count_inc = optax.safe_increment(state.count)
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    mus = treedef.flatten_up_to(state.mu)
    new_mu, out = [], []
    for (path, g), m in zip(flat, mus, strict=True):
        if tuple(g.shape) != tuple(m.shape):
            raise ValueError(
                f"scale_by_muon: gradient leaf {matrices.path_str(path)!r} has shape {g.shape}, "
                f"but its momentum (from the params at init) has {m.shape}; pass the "
                "gradients of the params."
            )
    for (_, g), m, view in zip(flat, mus, views, strict=True):
        m, o = step(matrices.to_matrices(g, view), matrices.to_matrices(m, view), count_inc,
                    view.m, view.n, out_dtype=g.dtype)
        m = matrices.from_matrices(m, view)
        new_mu.append(m if mu_dtype is None else m.astype(mu_dtype))
        out.append(matrices.from_matrices(o, view))
    mu = jax.tree.unflatten(treedef, new_mu)
    return jax.tree.unflatten(treedef, out), MuonState(count=count_inc, mu=mu)


def _reducing(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` after all-reducing gradients that arrive unreduced (same state as ``tx``)."""

    def update_fn(updates, state, params=None):
        return tx.update(jax.tree.map(dp.reduce_unreduced, updates), state, params)

    return optax.GradientTransformation(tx.init, update_fn)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: NsCoeffsLike = "jordan",
    ns_steps: int = 5,
    beta: jax.typing.ArrayLike = 0.95,
    eps: float = 1e-8,
    weight_decay: jax.typing.ArrayLike = 0.0,
    *,
    mu_dtype: jax.typing.DTypeLike | None = None,
    nesterov: bool = True,
    bias_correction: bool = True,
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    shape_scaling: matrices.ShapeScaling = "rms_match",
    muon_mask: masking.MaskLike | None = None,
    dimension_numbers: matrices.DimNumsLike = None,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.95,
    adam_eps: jax.typing.ArrayLike = 1e-8,
    adam_weight_decay: jax.typing.ArrayLike | None = None,
    mesh: MeshArg = None,
    shard_axes: str | tuple[str, ...] | None = None,
    param_specs: SpecsLike = None,
    chunk_bytes: int | None = owner_plan.DEFAULT_CHUNK_BYTES,
    gather_dtype: GatherDtype = "auto",
    reduce_dtype: jax.typing.DTypeLike | None = None,
    preconditioning: Preconditioning = "frobenius",
    adaptive: bool = False,
    consistent_rms: float | None = None,
    weight_decay_mask: Any = None,
    adam_eps_root: jax.typing.ArrayLike = 0.0,
    adam_nesterov: bool = False,
    adam_mu_dtype: jax.typing.DTypeLike | None = None,
    muon_weight_dimension_numbers: Any = None,
    ns_method: NsMethod = "auto",
    ns_gram: GramOptions = newton_schulz.DEFAULT_GRAM,
    ns_symmetric_blocks: newton_schulz.SymmetricBlocks = "auto",
) -> optax.GradientTransformation:
    r"""Muon for hidden-layer matrices, AdamW for every other leaf.

    Muon leaves (chosen by ``muon_mask``, default :func:`muon_jax.default_muon_mask`):

    .. math::
      W \leftarrow W - \eta_t \, (O_t + \lambda W), \qquad O_t = \text{scale\_by\_muon}(G_t),

    with decoupled weight decay ``lambda = weight_decay``. Other leaves get
    ``optax.adamw(adam_learning_rate, adam_b1, adam_b2, adam_eps, adam_weight_decay)``.
    With the default ``shape_scaling='rms_match'`` Muon's updates have the RMS of AdamW's
    (~0.2), so one learning rate and weight decay can serve both. ``torch.optim.Muon`` is
    ``bias_correction=False, shape_scaling='spectral'`` (its default ``adjust_lr_fn``), see
    the README's "Coming from PyTorch / optax.contrib".

    Args:
      learning_rate: Muon's learning rate, a float or an ``optax`` schedule.
      ns_coeffs: Newton-Schulz schedule (see :func:`muon_jax.orthogonalize`).
      ns_steps: Newton-Schulz iterations, ``>= 1``.
      beta: Muon momentum decay.
      eps: added to the Frobenius norm before Newton-Schulz.
      weight_decay: decoupled weight decay of the Muon leaves (multiplied by the learning rate).
      mu_dtype: dtype of Muon's momentum (``None``: the params' dtype).
      nesterov: Nesterov momentum for Muon.
      bias_correction: bias-corrected momentum (optax) or not (PyTorch); see
        :func:`scale_by_muon`.
      ns_dtype: dtype of the Newton-Schulz iteration.
      shape_scaling: ``'rms_match'``, ``'spectral'``, ``'spectral_unclamped'`` or ``None``
        (see :func:`muon_jax.matrices.shape_scale`).
      muon_mask: ``None`` for the default rule, or a tree (prefix) of bools or a callable on
        params returning one (``True``: Muon); it replaces the default rule entirely.
      dimension_numbers: as in :func:`scale_by_muon`, for the leaves Muon updates. Under the
        default rule, leaves with entries of their own (a tree of them) go to Muon; one
        ``MuonDimensionNumbers`` for the whole tree routes nothing (a bias still goes to
        AdamW and is not checked against it). Unlike
        ``optax.contrib.muon``, ``None`` here means "default view", not "AdamW"; routing is
        ``muon_mask``'s job.
      adam_learning_rate: AdamW's learning rate (``None``: ``learning_rate``).
      adam_b1: AdamW's first-moment decay.
      adam_b2: AdamW's second-moment decay.
      adam_eps: AdamW's epsilon.
      adam_weight_decay: AdamW's decoupled weight decay (``None``: ``weight_decay``).
      mesh: shard Muon's state and work over this mesh (see :func:`scale_by_muon`);
        ``None``: unsharded. AdamW leaves keep the params' shardings; their gradients are
        all-reduced first if they arrive unreduced.
      shard_axes: mesh axes that split Muon's stacks (``None``: all mesh axes).
      param_specs: the params' PartitionSpecs, for an ``init`` traced on Auto mesh axes (see
        :func:`scale_by_muon`).
      chunk_bytes: target bytes of one collective of Muon's stacks (see
        :func:`scale_by_muon`; ``None``: one per stack).
      gather_dtype: the dtype Muon's updates travel back to the params' shardings in (see
        :func:`scale_by_muon`; ``'auto'``: bfloat16 for float32 gradients and a 16-bit
        ``ns_dtype``; ``None``: the gradient dtype).
      reduce_dtype: the dtype unreduced Muon gradients are summed in on their way to the
        owners (see :func:`scale_by_muon`; ``None``: the gradient dtype).
      preconditioning: Newton-Schulz's input scaling, ``'frobenius'``, ``'spectral'``,
        ``'aol'`` or ``'schatten'`` (see :func:`muon_jax.orthogonalize`).
      adaptive: scale each orthogonalized matrix by its dual norm (see :func:`scale_by_muon`).
      ns_method: ``'auto'``, ``'standard'`` or ``'gram'`` Newton-Schulz (see
        :func:`scale_by_muon`).
      ns_gram: options of the Gram form (:class:`muon_jax.newton_schulz.GramOptions`).
      ns_symmetric_blocks: row strips of Newton-Schulz's symmetric products (see
        :func:`scale_by_muon`).
      consistent_rms: the factor of the ``'rms_match'``-style scaling ``consistent_rms *
        sqrt(max(m, n))``; given, it replaces ``shape_scaling`` (``None``: ``shape_scaling``,
        whose ``'rms_match'`` is 0.2).
      weight_decay_mask: which Muon leaves decay (a tree / prefix of bools or a callable, as
        ``optax.add_decayed_weights``' mask); ``None``: all of them.
      adam_eps_root: AdamW's ``eps_root``.
      adam_nesterov: the AdamW part is NAdamW (``optax.adamw(..., nesterov=True)``), which is
        what ``optax.contrib.muon(nesterov=True)`` runs; ``nesterov`` here is Muon's only.
      adam_mu_dtype: dtype of AdamW's first moment (``None``: the params'; optax's
        ``mu_dtype`` sets both Muon's and AdamW's).
      muon_weight_dimension_numbers: ``optax.contrib.muon``'s argument with its meaning: a tree
        (prefix) of ``MuonDimensionNumbers`` or ``None``, or a callable on params returning
        one; an entry sends its leaves to Muon with that matrix view, ``None`` to AdamW. It
        replaces ``muon_mask`` and ``dimension_numbers`` (pass neither with it).

    Returns:
      An ``optax.GradientTransformation`` (an ``optax.partition`` with labels ``'muon'`` and
      ``'adamw'``).

    >>> import optax
    >>> params = {'embed': jnp.ones((16, 8)), 'w': jnp.ones((8, 8)), 'b': jnp.zeros(8)}
    >>> tx = muon(0.02, weight_decay=0.1)
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
    if adam_learning_rate is None:
        adam_learning_rate = learning_rate
    if adam_weight_decay is None:
        adam_weight_decay = weight_decay
    if muon_weight_dimension_numbers is not None:
        if muon_mask is not None or dimension_numbers is not None:
            raise ValueError(
                "muon_weight_dimension_numbers (optax's routing: None entries go to AdamW) "
                "replaces muon_mask and dimension_numbers; pass it alone, or use muon_mask= and "
                "dimension_numbers= instead.")
        muon_mask = masking.mask_from_dimension_numbers(muon_weight_dimension_numbers)
        dimension_numbers = muon_weight_dimension_numbers

    def param_labels(params):
        flags = masking.resolve_muon_mask(muon_mask, params, dimension_numbers=dimension_numbers)
        treedef = jax.tree.structure(params)
        return jax.tree.unflatten(treedef, ["muon" if f else "adamw" for f in flags])

    muon_tx = optax.chain(
        scale_by_muon(
            ns_coeffs,
            ns_steps,
            beta,
            eps,
            mu_dtype,
            nesterov=nesterov,
            bias_correction=bias_correction,
            ns_dtype=ns_dtype,
            shape_scaling=shape_scaling,
            dimension_numbers=dimension_numbers,
            mesh=mesh,
            shard_axes=shard_axes,
            param_specs=param_specs,
            chunk_bytes=chunk_bytes,
            gather_dtype=gather_dtype,
            reduce_dtype=reduce_dtype,
            preconditioning=preconditioning,
            adaptive=adaptive,
            consistent_rms=consistent_rms,
            ns_method=ns_method,
            ns_gram=ns_gram,
            ns_symmetric_blocks=ns_symmetric_blocks,
        ),
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )
    adamw_tx = _reducing(
        optax.adamw(
            adam_learning_rate,
            b1=adam_b1,
            b2=adam_b2,
            eps=adam_eps,
            eps_root=adam_eps_root,
            weight_decay=adam_weight_decay,
            mu_dtype=adam_mu_dtype,
            nesterov=adam_nesterov,
        )
    )
    return optax.partition({"muon": muon_tx, "adamw": adamw_tx}, param_labels)
