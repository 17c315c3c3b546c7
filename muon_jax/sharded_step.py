"""Muon's update on the owner blocks of a mesh: the sharded state, its init and its update.

ZeRO-1 owner compute behind :func:`muon_jax.scale_by_muon` with ``mesh=``: the params' leaves
form stacks (:func:`muon_jax.owner_plan.plan_owners`), each device keeps the momentum of its own
whole matrices (:class:`ShardedMuonState`), and an update moves the gradients to their owners,
runs the per-matrix step there and moves the results back (:mod:`muon_jax.owners`). The leaf
specs are the params' own (``param_specs`` or what the placed arrays show).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_jax import arguments, matrices, owner_plan, owners

__all__ = ["GatherDtype", "ShardedMuonState", "ShardingOptions", "SpecsLike", "init_sharded",
           "resolve_gather_dtype", "update_sharded"]

SpecsLike = Any  # PartitionSpec | tree (prefix) of PartitionSpec / None | callable on params
GatherDtype = Literal["auto"] | jax.typing.DTypeLike | None
MeshLike = jax.sharding.Mesh | jax.sharding.AbstractMesh


@dataclasses.dataclass(frozen=True)
class ShardingOptions:
    """Where sharded Muon keeps its state and how its collectives move (ZeRO-1 owner compute,
    :mod:`muon_jax.owners`).

    Matrices of one shape form stacks whose stack axis is split over ``shard_axes``: each
    device keeps the momentum of, and orthogonalizes, only its own whole matrices; gradients
    arrive by reduce-scatter when they are unreduced (:func:`muon_jax.reduced_view`), else by
    a local slice (replicated) or an all-to-all (FSDP / tensor-parallel leaves); updates leave
    with the params' shardings, in the gradient dtype. Frozen (hashable but for
    ``param_specs``): ``optax.inject_hyperparams`` keeps it static, and a jax ``Mesh``, being
    callable, must travel inside it rather than as a flat argument.

    Attributes:
      mesh: the mesh (concrete or abstract). An ambient ``jax.set_mesh`` mesh is not used;
        pass ``jax.sharding.get_abstract_mesh()`` to shard over it.
      shard_axes: mesh axes that split the stacks (``None``: all of them). Every mesh axis
        that shards a Muon param must be one of them.
      param_specs: the params' ``PartitionSpec`` s (a spec for every leaf, a tree or prefix of
        them with ``None`` for replicated, or a callable on params returning one). ``None``:
        read at ``init`` from the params: concrete arrays and ``jax.ShapeDtypeStruct`` s carry
        their sharding, traced ones only their Explicit axes. Needed when ``init`` is traced
        (``jax.jit``, ``jax.eval_shape``, ``nnx.jit``) on a mesh whose shard axes are Auto.
      chunk_bytes: split each stack's owned matrices into chunks whose collectives move about
        this many bytes (full buffer ``N * rows * m * n`` in the gradient dtype; at least one
        matrix per device per chunk), each moved and orthogonalized on its own so XLA can
        overlap one chunk's collectives with another's Newton-Schulz. ``None`` (default) or
        0: one collective per stack and direction.
      gather_dtype: the dtype the orthogonalized updates travel in from their owners back to
        the params' shardings (all-gather or all-to-all), cast to the gradient dtype on
        arrival. ``'auto'`` (default): bfloat16 for float32 gradients when Newton-Schulz's
        operands are 16-bit (:func:`resolve_gather_dtype`: half the bytes, at a rounding of
        2^-9 per element of an update whose entries are all about the same size, no coarser
        than those matmuls); ``None``: the gradient dtype (the sharded update then equals the
        unsharded one); or a float dtype.
      reduce_dtype: the dtype in which gradients that arrive unreduced are summed on their
        way to the owners (the reduce-scatter, and the all-reduce over axes that do not shard
        the stacks), cast back after. ``None`` (default): the gradient dtype, exact.
        ``jnp.bfloat16`` halves those bytes for f32 gradients (the mixed-precision
        ``reduce_dtype`` of FSDP) but rounds each device's partial sum, and where the
        partials cancel the error is large relative to their sum. Replicated or sharded
        gradients move unsummed and keep their dtype.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
      >>> ShardingOptions(mesh, chunk_bytes=1).shard_axes is None
      True
      >>> ShardingOptions('data')  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      TypeError: ShardingOptions: mesh='data' (str) is not a jax.sharding.Mesh or AbstractMesh; ...
    """

    mesh: MeshLike
    shard_axes: str | tuple[str, ...] | None = None
    param_specs: SpecsLike = dataclasses.field(default=None, hash=False)
    chunk_bytes: int | None = owner_plan.DEFAULT_CHUNK_BYTES
    gather_dtype: GatherDtype = "auto"
    reduce_dtype: jax.typing.DTypeLike | None = None

    def __post_init__(self):
        where = "ShardingOptions"
        if not isinstance(self.mesh, MeshLike):
            raise TypeError(
                f"{where}: mesh={self.mesh!r} ({type(self.mesh).__name__}) is not a "
                "jax.sharding.Mesh or AbstractMesh; pass e.g. jax.make_mesh((8,), ('data',)), "
                "or sharding=None for an unsharded optimizer.")
        if self.shard_axes is not None and not isinstance(self.shard_axes, str | tuple | list):
            raise TypeError(f"{where}: shard_axes={self.shard_axes!r} is not a mesh axis name "
                            f"or a tuple of them; pass a subset of {tuple(self.mesh.axis_names)}"
                            " or None.")
        if isinstance(self.shard_axes, list):
            object.__setattr__(self, "shard_axes", tuple(self.shard_axes))
        owner_plan.resolve_shard_axes(self.mesh, self.shard_axes, where=where)
        if isinstance(self.param_specs, str | int | float):
            raise TypeError(f"{where}: param_specs={self.param_specs!r} is not a PartitionSpec, "
                            "a tree of them or a callable on params; pass e.g. "
                            "jax.tree.map(lambda x: x.sharding.spec, params), or None.")
        owner_plan.check_chunk_bytes(self.chunk_bytes)
        object.__setattr__(self, "gather_dtype", arguments.float_dtype(
            f"{where}: gather_dtype", self.gather_dtype, none="the gradient dtype",
            extra=("auto",)))
        object.__setattr__(self, "reduce_dtype", arguments.float_dtype(
            f"{where}: reduce_dtype", self.reduce_dtype, none="the gradient dtype"))


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
    """State of :func:`scale_by_muon` with ``sharding=``: momentum of whole matrices, 1/N per
    device.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from muon_jax import MuonDimensionNumbers, scale_by_muon
      >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
      >>> tx = scale_by_muon(sharding=ShardingOptions(mesh),
      ...                    dimension_numbers=MuonDimensionNumbers(1, 2))  # 8 matrices [4, 8]
      >>> state = tx.init({'w': jnp.ones((8, 4, 8))})
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


def init_sharded(params: Any, options: ShardingOptions, dim_nums: list[Any],
                 mu_dtype: Any) -> ShardedMuonState:
    """Plan the owners of ``params`` over ``options.mesh`` (``dim_nums``: per leaf) and make
    zero momentum in the owner blocks."""
    mesh = options.mesh
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    specs = _leaf_specs(params, mesh, options.shard_axes, options.param_specs)
    entries = [(matrices.path_str(path), x.shape, x.dtype, spec)
               for (path, x), spec in zip(flat, specs, strict=True)]
    plan = owner_plan.plan_owners(
        entries,
        dim_nums,
        mesh=mesh,
        shard_axes=options.shard_axes,
        replicated_grads=_replicated_grads(mesh),
        chunk_bytes=options.chunk_bytes,
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


def update_sharded(updates: Any, state: ShardedMuonState, step: Callable, numbers: dict,
                   options: ShardingOptions, ns_dtype: Any = jnp.bfloat16):
    """The update of :func:`muon_jax.scale_by_muon` on the owner blocks of ``state.plan``.

    ``step(g, mu, count, numbers, *, out_dtype)`` is the per-matrix step on
    ``[k, m, n]`` blocks (momentum, then the direction) with the hyperparameters ``numbers``;
    those that are arrays (traced under ``optax.inject_hyperparams``) enter the owners'
    ``shard_map`` as replicated inputs, which Explicit mesh axes require. The orthogonalized
    blocks travel back in :func:`resolve_gather_dtype` of ``options.gather_dtype`` (and
    ``ns_dtype``) and are cast to the gradients' dtype on arrival; unreduced gradients are
    summed on the way in in ``options.reduce_dtype`` (``None``: their own dtype).
    """
    plan = state.plan
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    _check_sharded_grads(flat, plan)
    count_inc = optax.safe_increment(state.count)
    # One per chunk.
    owner_grads = owners.to_owners([g for _, g in flat], plan,
                                   reduce_dtype=options.reduce_dtype)
    mus = owners.split_chunks(state.mu, plan)
    traced = [k for k, v in numbers.items() if isinstance(v, jax.Array)]

    def owner_step(stack, blocks, scalars):
        g, mu = blocks
        local = {**numbers, **dict(zip(traced, scalars[1:], strict=True))}
        out_dtype = resolve_gather_dtype(options.gather_dtype, stack.dtype, ns_dtype)
        mu_new, o = step(g, mu, scalars[0], local, out_dtype=out_dtype)
        return mu_new.astype(mu.dtype), o

    with jax.named_scope("muon_owner_step"):
        res = owners.owner_map(owner_step, plan, list(zip(owner_grads, mus, strict=True)),
                               (count_inc, *(numbers[k] for k in traced)))
    out = owners.from_owners([r[1] for r in res], plan)
    out = [o.astype(g.dtype) for o, (_, g) in zip(out, flat, strict=True)]
    mu = owners.join_chunks([r[0] for r in res], plan)
    return jax.tree.unflatten(treedef, out), ShardedMuonState(count=count_inc, mu=mu, plan=plan)
