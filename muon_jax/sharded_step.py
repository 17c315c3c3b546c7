"""Muon's update on the owner blocks of a mesh: the sharded state, its init and its update.

ZeRO-1 owner compute behind :func:`muon_jax.scale_by_muon` with ``mesh=``: the params' leaves
form stacks (:func:`muon_jax.owner_plan.plan_owners`), each device keeps the momentum of its own
whole matrices (:class:`ShardedMuonState`), and an update moves the gradients to their owners,
runs the per-matrix step there and moves the results back (:mod:`muon_jax.owners`). The leaf
specs are the params' own (``param_specs`` or what the placed arrays show).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_jax import matrices, owner_plan, owners

__all__ = ["GatherDtype", "ShardedMuonState", "SpecsLike", "init_sharded",
           "resolve_gather_dtype", "update_sharded"]

SpecsLike = Any  # PartitionSpec | tree (prefix) of PartitionSpec / None | callable on params
GatherDtype = Literal["auto"] | jax.typing.DTypeLike | None


def resolve_gather_dtype(gather_dtype: GatherDtype, grad_dtype: Any,
                         ns_dtype: Any = jnp.bfloat16) -> jnp.dtype:
    """The dtype a stack's orthogonalized updates travel back in, for gradients of
    ``grad_dtype`` orthogonalized with ``ns_dtype`` matmul operands.

    ``'auto'``: bfloat16 for float32 gradients when Newton-Schulz runs in a 16-bit dtype
    (its result is no more precise than that: half the bytes for a rounding below its own),
    else the gradient dtype; ``None``: the gradient dtype; a dtype: itself.

    >>> resolve_gather_dtype("auto", jnp.float32), resolve_gather_dtype(None, jnp.float32)
    (dtype(bfloat16), dtype('float32'))
    >>> resolve_gather_dtype("auto", jnp.float32, jnp.float32)  # f32 Newton-Schulz: kept
    dtype('float32')
    """
    grad_dtype = jnp.dtype(grad_dtype)
    if isinstance(gather_dtype, str) and gather_dtype == "auto":
        narrow = jnp.dtype(ns_dtype).itemsize <= 2
        return jnp.dtype(jnp.bfloat16) if grad_dtype == jnp.float32 and narrow else grad_dtype
    return grad_dtype if gather_dtype is None else jnp.dtype(gather_dtype)


class ShardedMuonState(NamedTuple):
    """State of :func:`scale_by_muon` with ``mesh=``: momentum of whole matrices, 1/N per device.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from muon_jax import scale_by_muon
      >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
      >>> state = scale_by_muon(mesh=mesh).init({'w': jnp.ones((8, 4, 8))})
      >>> type(state).__name__, state.mu[0].shape, state.mu[0].sharding.spec == jax.P('data')
      ('ShardedMuonState', (8, 4, 8), True)
    """

    count: jax.Array  # int32 scalar: number of updates so far
    mu: tuple[jax.Array, ...]  # per stack [N * k_owner, m, n], sharded P(owner_axes)
    plan: owner_plan.OwnerPlan  # the static owner plan (a pytree node without leaves)


def _replicated_grads(mesh: Any) -> owner_plan.ReplicatedGrads:
    """'scatter' where XLA forms reduce-scatter from all-reduce + slice (GPU/TPU), else 'slice'."""
    abstract = mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
    device = abstract.abstract_device
    platform = device.platform if device is not None else jax.default_backend()
    return "slice" if platform == "cpu" else "scatter"


def _given_specs(params: Any, param_specs: SpecsLike) -> list[P]:
    """``param_specs`` per leaf of ``params`` (``None`` entries: replicated)."""
    if callable(param_specs) and not isinstance(param_specs, P):
        param_specs = param_specs(params)
    n = len(jax.tree.leaves(params))
    if isinstance(param_specs, P):
        return [param_specs] * n
    flat = matrices.broadcast_prefix(param_specs, params, name="param_specs",
                                     is_leaf=lambda x: x is None or isinstance(x, P))
    for s in flat:
        if s is not None and not isinstance(s, P):
            raise TypeError(f"param_specs leaves must be PartitionSpecs or None, got {s!r}.")
    return [P() if s is None else s for s in flat]


def _leaf_specs(params: Any, mesh: Any, shard_axes: Any, param_specs: SpecsLike) -> list[Any]:
    """Per leaf, the param's PartitionSpec: given, or read where it is visible."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    if param_specs is not None:
        given = _given_specs(params, param_specs)
        for (path, x), spec in zip(flat, given, strict=True):
            placed = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
            seen = placed.spec if isinstance(placed, NamedSharding) else None
            if seen is not None and (owner_plan.spec_dims(seen, x.ndim)
                                     != owner_plan.spec_dims(spec, x.ndim)):
                raise ValueError(
                    f"scale_by_muon: param leaf {matrices.path_str(path)!r} is sharded {seen}, "
                    f"but param_specs gives {spec}; pass the params' own specs."
                )
        return given
    shard = owner_plan.resolve_shard_axes(mesh, shard_axes)
    auto = [a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if a in shard and t == AxisType.Auto]
    for path, x in flat:
        if auto and isinstance(x, jax.core.Tracer):
            raise ValueError(
                f"scale_by_muon: param leaf {matrices.path_str(path)!r} is traced (init under "
                f"jax.jit, jax.eval_shape or nnx.jit) and the shard axes {tuple(auto)} are "
                "Auto, so its sharding is not visible; pass param_specs= (e.g. "
                "jax.tree.map(lambda x: x.sharding.spec, params), or P() for replicated "
                "params), call init outside jit on params placed as in training, or make the "
                "axes Explicit."
            )
    return [owner_plan.param_spec(x) for _, x in flat]


def init_sharded(
    params: Any, mesh: Any, shard_axes: Any, param_specs: SpecsLike, dimension_numbers: Any,
    mu_dtype: Any, chunk_bytes: int | None,
) -> ShardedMuonState:
    """Plan the owners of ``params`` over ``mesh`` and make zero momentum in the owner blocks."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = _leaf_specs(params, mesh, shard_axes, param_specs)
    entries = [(matrices.path_str(path), x.shape, x.dtype, spec)
               for (path, x), spec in zip(flat, specs, strict=True)]
    plan = owner_plan.plan_owners(
        entries,
        matrices.resolve_dim_nums(dimension_numbers, params),
        mesh=mesh,
        shard_axes=shard_axes,
        replicated_grads=_replicated_grads(mesh),
        chunk_bytes=chunk_bytes,
    )
    mu = owners.init_owner_stacks(plan, mu_dtype)
    count = owners.replicated_zeros(plan, (), jnp.int32)
    return ShardedMuonState(count=count, mu=mu, plan=plan)


def _check_sharded_grads(flat: list, plan: owner_plan.OwnerPlan) -> None:
    """Raise naming the leaf when gradients do not fit the plan the state was made with."""
    if len(flat) != len(plan.leaves):
        raise ValueError(
            f"scale_by_muon: got {len(flat)} gradient leaves but the state was initialized for "
            f"{len(plan.leaves)}; pass gradients with the structure of the params."
        )
    for (path, g), leaf in zip(flat, plan.leaves, strict=True):
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            raise ValueError(
                f"scale_by_muon: gradient leaf {matrices.path_str(path)!r} has dtype {g.dtype}; "
                "Muon updates float or complex matrices only: route it to AdamW (muon_mask) or "
                "keep it out of the optimized params."
            )
        if tuple(g.shape) != leaf.shape:
            raise ValueError(
                f"scale_by_muon: gradient leaf {matrices.path_str(path)!r} has shape {g.shape}, "
                f"but its param {leaf.path!r} had {leaf.shape}; pass the gradients of the params."
            )


def update_sharded(updates: Any, state: ShardedMuonState, step: Callable,
                   gather_dtype: GatherDtype = None, ns_dtype: Any = jnp.bfloat16,
                   reduce_dtype: Any = None):
    """The update of :func:`muon_jax.scale_by_muon` on the owner blocks of ``state.plan``.

    ``step(g, mu, count, m, n, *, out_dtype)`` is the per-matrix step on ``[k, m, n]`` blocks
    (momentum, then the direction); the orthogonalized blocks travel back in
    :func:`resolve_gather_dtype` of ``gather_dtype`` (and ``ns_dtype``) and are cast to the
    gradients' dtype on arrival; unreduced gradients are summed on the way in in
    ``reduce_dtype`` (``None``: their own dtype).
    """
    plan = state.plan
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    _check_sharded_grads(flat, plan)
    count_inc = optax.safe_increment(state.count)
    # One per chunk.
    owner_grads = owners.to_owners([g for _, g in flat], plan, reduce_dtype=reduce_dtype)
    mus = owners.split_chunks(state.mu, plan)

    def owner_step(stack, blocks, scalars):
        g, mu = blocks
        mu_new, o = step(g, mu, scalars[0], stack.m, stack.n,
                         out_dtype=resolve_gather_dtype(gather_dtype, stack.dtype, ns_dtype))
        return mu_new.astype(mu.dtype), o

    with jax.named_scope("muon_owner_step"):
        res = owners.owner_map(
            owner_step, plan, list(zip(owner_grads, mus, strict=True)), (count_inc,)
        )
    out = owners.from_owners([r[1] for r in res], plan)
    out = [o.astype(g.dtype) for o, (_, g) in zip(out, flat, strict=True)]
    mu = owners.join_chunks([r[0] for r in res], plan)
    return jax.tree.unflatten(treedef, out), ShardedMuonState(count=count_inc, mu=mu, plan=plan)
