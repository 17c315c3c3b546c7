"""Muon as Optax transforms: ``scale_by_muon`` (the direction) and ``muon`` (the optimizer).

Thin shells over pure functions: :func:`momentum_step` (momentum, bias correction, Nesterov),
:func:`muon_jax.orthogonalize` on each leaf's ``[B, m, n]`` view, and
:func:`muon_jax._dims.shape_scale`. ``muon`` routes hidden-layer matrices to Muon and the rest
to AdamW with :func:`optax.partition`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from muon_jax import _dims, _masking, _sharded, dp
from muon_jax._newton_schulz import NsCoeffsLike, orthogonalize, resolve_ns_coeffs


class MuonState(NamedTuple):
    """State of :func:`scale_by_muon`."""

    count: jax.Array  # int32 scalar: number of updates so far
    mu: optax.Updates  # momentum, same tree as the params


class ShardedMuonState(NamedTuple):
    """State of :func:`scale_by_muon` on a mesh: momentum of whole matrices, 1/N per device."""

    count: jax.Array  # int32 scalar: number of updates so far
    mu: tuple[jax.Array, ...]  # per stack [N * k_owner, m, n], sharded P(owner_axes)
    layout: _sharded.Layout  # the static plan (a pytree node without leaves)


jax.tree_util.register_static(_sharded.Layout)


def momentum_step(
    g: jax.Array,
    mu: jax.Array,
    count_inc: jax.Array,
    beta: jax.typing.ArrayLike,
    *,
    nesterov: bool = True,
) -> tuple[jax.Array, jax.Array]:
    r"""One momentum step with bias correction, as in :func:`optax.contrib.scale_by_muon`.

    .. math::
      \mu_t = \beta \mu_{t-1} + (1-\beta) g_t, \qquad
      \hat\mu_t = \begin{cases}
        \beta \frac{\mu_t}{1-\beta^{t+1}} + (1-\beta)\frac{g_t}{1-\beta^{t}} & \text{Nesterov}\\
        \frac{\mu_t}{1-\beta^{t}} & \text{otherwise.}\end{cases}

    Args:
      g: the gradient.
      mu: the previous momentum.
      count_inc: the step number ``t >= 1`` (int32 scalar).
      beta: momentum decay.
      nesterov: use the Nesterov form.

    Returns:
      ``(mu_t, mu_hat_t)``.

    >>> import jax.numpy as jnp
    >>> mu, mu_hat = momentum_step(jnp.ones(2), jnp.zeros(2), jnp.int32(1), 0.5, nesterov=False)
    >>> mu.tolist(), mu_hat.tolist()
    ([0.5, 0.5], [1.0, 1.0])
    """
    mu = (1 - beta) * g + beta * mu

    def corrected(t, count):
        return t / (1 - beta**count).astype(t.dtype)

    if nesterov:
        mu_hat = beta * corrected(mu, optax.safe_increment(count_inc)) + (1 - beta) * corrected(
            g, count_inc
        )
    else:
        mu_hat = corrected(mu, count_inc)
    return mu, mu_hat


def _layouts(tree: Any, dimension_numbers: _dims.DimNumsLike, what: str):
    """Validated ``(path, layout)`` per leaf; errors name the leaf and the fix."""
    flat_dims = _dims.resolve_dim_nums(dimension_numbers, tree)
    leaves_with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = []
    for (path, leaf), d in zip(leaves_with_path, flat_dims, strict=True):
        name = _dims.path_str(path)
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{what} leaf {name!r} has dtype {dtype}; Muon updates float matrices only: route "
                "it to AdamW (muon_mask) or keep it out of the optimized params."
            )
        out.append(_dims.matrix_layout(leaf.shape, d, path=f"{what} leaf {name!r}"))
    return out


def scale_by_muon(
    ns_coeffs: NsCoeffsLike = "jordan",
    ns_steps: int = 5,
    beta: jax.typing.ArrayLike = 0.95,
    eps: float = 1e-8,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = True,
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    shape_scaling: _dims.ShapeScaling = "spectral",
    dimension_numbers: _dims.DimNumsLike = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    shard_axes: str | tuple[str, ...] | None = None,
    chunk_bytes: int | None = _sharded.DEFAULT_CHUNK_BYTES,
) -> optax.GradientTransformation:
    r"""Rescale updates to Muon's direction: orthogonalized (Nesterov) momentum.

    Per leaf, viewed as a batch of ``[m, n]`` matrices (``m`` fan-in, ``n`` fan-out):

    .. math::
      \mu_t = \beta \mu_{t-1} + (1-\beta) G_t, \quad
      O_t = s(m, n) \cdot \mathrm{NS}(\hat\mu_t),

    with bias correction and Nesterov as :func:`optax.contrib.scale_by_muon`, NS the
    Newton-Schulz iteration of :func:`muon_jax.orthogonalize`, and ``s`` the shape scaling
    (``'spectral'``: ``sqrt(max(1, n/m))``; ``'rms_match'``: ``0.2 sqrt(max(m, n))``; ``None``: 1).
    Every leaf must be a float array of rank >= 2 (``None`` / ``optax.MaskedNode`` leaves pass
    through); route the rest elsewhere, as :func:`muon` does.

    Args:
      ns_coeffs: Newton-Schulz schedule: ``'jordan'``, ``'polar_express'``, a triple or
        per-step triples (see :func:`muon_jax.orthogonalize`).
      ns_steps: Newton-Schulz iterations, ``>= 1``.
      beta: momentum decay.
      eps: added to the Frobenius norm before Newton-Schulz.
      mu_dtype: dtype of the momentum (``None``: the params' dtype).
      nesterov: use Nesterov momentum.
      ns_dtype: dtype of the Newton-Schulz iteration.
      shape_scaling: ``'spectral'``, ``'rms_match'`` or ``None``.
      dimension_numbers: ``optax.contrib.MuonDimensionNumbers`` for every leaf, a tree (or
        prefix) of them, or a callable on params returning one. Entries that are ``None``
        (or ``MaskedNode``) use the default: the last two axes are the matrix (reduction, output)
        and leading axes are a batch, so ``[m, n]`` is one matrix and ``[L, m, n]`` a stack.
        Conv kernels ``[kh, kw, c_in, c_out]`` need ``MuonDimensionNumbers((0, 1, 2), 3)``.
      mesh: shard the optimizer over this mesh (ZeRO-1 owner compute, see
        :mod:`muon_jax._sharded`); ``None``: the ambient ``jax.set_mesh`` mesh at ``init``, and
        without one the unsharded path. Matrices of one shape form stacks whose stack axis is
        split over ``shard_axes``: each device keeps the momentum of, and orthogonalizes, only
        its own whole matrices; gradients arrive by reduce-scatter when they are unreduced
        (see :func:`muon_jax.dp.reduced_view`), else by a local slice (replicated) or an
        all-to-all (FSDP / tensor-parallel leaves); updates leave with the params' shardings.
        Call ``init`` on params placed as in training (Auto mesh axes are read from concrete
        arrays; Explicit axes also from traced types); updates come back in the gradient dtype.
      shard_axes: mesh axes that split the stacks (``None``: all mesh axes). Every mesh axis
        that shards a Muon param must be one of them.
      chunk_bytes: on a mesh, split each stack's owned matrices into chunks whose collectives
        move about this many bytes (full buffer ``N * rows * m * n`` in the gradient dtype; at
        least one matrix per device per chunk); each chunk is reduce-scattered, orthogonalized
        and all-gathered on its own, so XLA's async collectives of one chunk can overlap
        Newton-Schulz of another. Bytes moved, work per device and the state are unchanged.
        ``None`` (default) or 0: one collective per stack and direction, which was as fast on
        2x H200 over NVLink (see :data:`muon_jax._layout.DEFAULT_CHUNK_BYTES`); try e.g.
        ``256 * 2**20`` where communication is a larger share of the step.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`MuonState` (unsharded) or
      :class:`ShardedMuonState` (on a mesh).

    >>> import jax.numpy as jnp, optax
    >>> tx = scale_by_muon(ns_dtype=jnp.float32)
    >>> params = {'w': jnp.ones((4, 8))}
    >>> updates, state = tx.update({'w': jnp.eye(4, 8)}, tx.init(params))
    >>> updates['w'].shape, int(state.count)
    ((4, 8), 1)

    References:
      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024.

      Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025.

      Rajbhandari et al., `ZeRO <https://arxiv.org/abs/1910.02054>`_, 2020 (owner compute);
      Keller Jordan's distributed Muon (modded-nanogpt, 2024).
    """
    resolve_ns_coeffs(ns_coeffs, ns_steps)  # fail at construction on a bad schedule
    _dims.shape_scale(1, 1, shape_scaling)  # and on a bad scaling name
    _sharded.check_chunk_bytes(chunk_bytes)
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)
    if mu_dtype is not None and not jnp.issubdtype(mu_dtype, jnp.floating):
        raise ValueError(
            f"mu_dtype={mu_dtype} is not a float dtype; pass jnp.float32, jnp.bfloat16 or None "
            "(the params' dtype)."
        )

    def init_fn(params):
        _layouts(params, dimension_numbers, "params")
        resolved = _sharded.resolve_mesh(mesh)
        if resolved is not None:
            return _sharded_init(
                params, resolved, shard_axes, dimension_numbers, mu_dtype, chunk_bytes
            )
        mu = optax.tree.zeros_like(params, dtype=mu_dtype)
        return MuonState(count=jnp.zeros([], jnp.int32), mu=mu)

    def direction(mats, m, n):
        """Orthogonalized, shape-scaled ``[B, m, n]`` matrices: one definition for both paths."""
        o = orthogonalize(mats, ns_coeffs=ns_coeffs, ns_steps=ns_steps, eps=eps, dtype=ns_dtype)
        scale = _dims.shape_scale(m, n, shape_scaling)
        return o * jnp.asarray(scale, o.dtype) if scale != 1.0 else o

    def owner_step(stack, blocks, scalars):
        g, mu = blocks
        mu_new, mu_hat = momentum_step(g, mu, scalars[0], beta, nesterov=nesterov)
        o = direction(mu_hat, stack.m, stack.n)
        return mu_new.astype(mu.dtype), o.astype(stack.dtype)

    def update_fn(updates, state, params=None):
        del params
        if isinstance(state, ShardedMuonState):
            return _sharded_update(updates, state, owner_step)
        layouts = _layouts(updates, dimension_numbers, "updates")
        count_inc = optax.safe_increment(state.count)
        grads, treedef = jax.tree.flatten(updates)
        mus = treedef.flatten_up_to(state.mu)
        new_mu, out = [], []
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
        for path, g, m in zip(paths, grads, mus, strict=True):
            if tuple(g.shape) != tuple(m.shape):
                raise ValueError(
                    f"scale_by_muon: gradient leaf {_dims.path_str(path)!r} has shape {g.shape}, "
                    f"but its momentum (from the params at init) has {m.shape}; pass the "
                    "gradients of the params."
                )
        for g, m, layout in zip(grads, mus, layouts, strict=True):
            m, m_hat = momentum_step(g, m, count_inc, beta, nesterov=nesterov)
            new_mu.append(m if mu_dtype is None else m.astype(mu_dtype))
            o = direction(_dims.to_matrices(m_hat, layout), layout.m, layout.n)
            out.append(_dims.from_matrices(o, layout))
        mu = jax.tree.unflatten(treedef, new_mu)
        return jax.tree.unflatten(treedef, out), MuonState(count=count_inc, mu=mu)

    return optax.GradientTransformation(init_fn, update_fn)


def _replicated_grads(mesh: Any) -> _sharded.ReplicatedGrads:
    """'scatter' where XLA forms reduce-scatter from all-reduce + slice (GPU/TPU), else 'slice'."""
    abstract = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
    device = abstract.abstract_device
    platform = device.platform if device is not None else jax.default_backend()
    return "slice" if platform == "cpu" else "scatter"


def _sharded_init(
    params: Any, mesh: Any, shard_axes: Any, dimension_numbers: Any, mu_dtype: Any,
    chunk_bytes: int | None,
) -> ShardedMuonState:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    entries = [
        (_dims.path_str(path), x.shape, x.dtype, _sharded.param_spec(x)) for path, x in flat
    ]
    layout = _sharded.plan_layout(
        entries,
        _dims.resolve_dim_nums(dimension_numbers, params),
        mesh=mesh,
        shard_axes=shard_axes,
        replicated_grads=_replicated_grads(mesh),
        chunk_bytes=chunk_bytes,
    )
    mu = _sharded.init_owner_stacks(layout, mu_dtype)
    count = _sharded.replicated_zeros(layout, (), jnp.int32)
    return ShardedMuonState(count=count, mu=mu, layout=layout)


def _sharded_update(updates: Any, state: ShardedMuonState, owner_step: Any):
    layout = state.layout
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    if len(flat) != len(layout.leaves):
        raise ValueError(
            f"scale_by_muon: got {len(flat)} gradient leaves but the state was initialized for "
            f"{len(layout.leaves)}; pass gradients with the structure of the params."
        )
    for (path, g), leaf in zip(flat, layout.leaves, strict=True):
        if not jnp.issubdtype(g.dtype, jnp.floating):
            raise ValueError(
                f"scale_by_muon: gradient leaf {_dims.path_str(path)!r} has dtype {g.dtype}; "
                "Muon updates float matrices only: route it to AdamW (muon_mask) or keep it "
                "out of the optimized params."
            )
        if tuple(g.shape) != leaf.shape:
            raise ValueError(
                f"scale_by_muon: gradient leaf {_dims.path_str(path)!r} has shape {g.shape}, but "
                f"its param {leaf.path!r} had {leaf.shape}; pass the gradients of the params."
            )
    count_inc = optax.safe_increment(state.count)
    owner_grads = _sharded.to_owners([g for _, g in flat], layout)  # one per chunk
    mus = _sharded.split_chunks(state.mu, layout)
    with jax.named_scope("muon_owner_step"):
        res = _sharded.owner_map(
            owner_step, layout, list(zip(owner_grads, mus, strict=True)), (count_inc,)
        )
    out = _sharded.from_owners([r[1] for r in res], layout)
    mu = _sharded.join_chunks([r[0] for r in res], layout)
    new_state = ShardedMuonState(count=count_inc, mu=mu, layout=layout)
    return jax.tree.unflatten(treedef, out), new_state


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
    nesterov: bool = True,
    ns_dtype: jax.typing.DTypeLike = jnp.bfloat16,
    shape_scaling: _dims.ShapeScaling = "rms_match",
    muon_mask: _masking.MaskLike | None = None,
    dimension_numbers: _dims.DimNumsLike = None,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.95,
    adam_eps: jax.typing.ArrayLike = 1e-8,
    adam_weight_decay: jax.typing.ArrayLike | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    shard_axes: str | tuple[str, ...] | None = None,
    chunk_bytes: int | None = _sharded.DEFAULT_CHUNK_BYTES,
) -> optax.GradientTransformation:
    r"""Muon for hidden-layer matrices, AdamW for every other leaf.

    Muon leaves (chosen by ``muon_mask``, default :func:`muon_jax.default_muon_mask`):

    .. math::
      W \leftarrow W - \eta_t \, (O_t + \lambda W), \qquad O_t = \text{scale\_by\_muon}(G_t),

    with decoupled weight decay ``lambda = weight_decay``. Other leaves get
    ``optax.adamw(adam_learning_rate, adam_b1, adam_b2, adam_eps, adam_weight_decay)``.
    With the default ``shape_scaling='rms_match'`` Muon's updates have the RMS of AdamW's
    (~0.2), so one learning rate and weight decay can serve both.

    Args:
      learning_rate: Muon's learning rate, a float or an ``optax`` schedule.
      ns_coeffs: Newton-Schulz schedule (see :func:`muon_jax.orthogonalize`).
      ns_steps: Newton-Schulz iterations, ``>= 1``.
      beta: Muon momentum decay.
      eps: added to the Frobenius norm before Newton-Schulz.
      weight_decay: decoupled weight decay of the Muon leaves (multiplied by the learning rate).
      nesterov: Nesterov momentum for Muon.
      ns_dtype: dtype of the Newton-Schulz iteration.
      shape_scaling: ``'rms_match'``, ``'spectral'`` or ``None`` (see :func:`scale_by_muon`).
      muon_mask: ``None`` for the default rule, or a tree (prefix) of bools or a callable on
        params returning one (``True``: Muon); it replaces the default rule entirely.
      dimension_numbers: as in :func:`scale_by_muon`. Leaves with explicit (non-``None``)
        dimension numbers go to Muon under the default rule. Unlike
        ``optax.contrib.muon``, ``None`` here means "default layout", not "AdamW"; routing is
        ``muon_mask``'s job.
      adam_learning_rate: AdamW's learning rate (``None``: ``learning_rate``).
      adam_b1: AdamW's first-moment decay.
      adam_b2: AdamW's second-moment decay.
      adam_eps: AdamW's epsilon.
      adam_weight_decay: AdamW's decoupled weight decay (``None``: ``weight_decay``).
      mesh: shard Muon's state and work over this mesh (see :func:`scale_by_muon`);
        ``None``: the ambient ``jax.set_mesh`` mesh, if any, at ``init``. AdamW leaves keep
        the params' shardings; their gradients are all-reduced first if they arrive unreduced.
      shard_axes: mesh axes that split Muon's stacks (``None``: all mesh axes).
      chunk_bytes: target bytes of one collective of Muon's stacks (see
        :func:`scale_by_muon`; ``None``: one per stack).

    Returns:
      An ``optax.GradientTransformation`` (an ``optax.partition`` with labels ``'muon'`` and
      ``'adamw'``).

    >>> import jax, jax.numpy as jnp, optax
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

    def param_labels(params):
        flags = _masking.resolve_muon_mask(
            muon_mask, params, dimension_numbers=dimension_numbers
        )
        treedef = jax.tree.structure(params)
        return jax.tree.unflatten(treedef, ["muon" if f else "adamw" for f in flags])

    muon_tx = optax.chain(
        scale_by_muon(
            ns_coeffs,
            ns_steps,
            beta,
            eps,
            nesterov=nesterov,
            ns_dtype=ns_dtype,
            shape_scaling=shape_scaling,
            dimension_numbers=dimension_numbers,
            mesh=mesh,
            shard_axes=shard_axes,
            chunk_bytes=chunk_bytes,
        ),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    adamw_tx = _reducing(
        optax.adamw(
            adam_learning_rate,
            b1=adam_b1,
            b2=adam_b2,
            eps=adam_eps,
            weight_decay=adam_weight_decay,
        )
    )
    return optax.partition({"muon": muon_tx, "adamw": adamw_tx}, param_labels)
