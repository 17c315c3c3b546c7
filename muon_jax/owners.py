"""Owner compute (ZeRO-1) for Muon: whole matrices in stacks sharded over mesh axes.

Muon matrices are grouped by shape into stacks ``[K, m, n]`` (a leaf contributes its
``[B, m, n]`` batch; scanned layers and expert banks are stacks already). Each stack's ``K``
is sharded over ``shard_axes`` (``N`` devices), padded up to a multiple of ``N``, so every
device owns ``ceil(K / N)`` whole matrices: it keeps their momentum (memory ``1/N``) and runs
Newton-Schulz on them alone. :mod:`muon_jax.owner_plan` decides the stacks; this module moves
the data, explicitly, in ``jax.shard_map``:

- :func:`to_owners`: gradients -> owner blocks. Per shard axis ``a`` the gradient is either
  *unreduced* over ``a`` (a reduce-scatter of the locally stacked partial sums,
  ``psum_scatter``), replicated over ``a`` (a local slice, no communication), or sharded over
  ``a`` along a matrix axis (FSDP / tensor parallel: one ``all_to_all`` that trades the matrix
  split for a stack split).
- :func:`owner_map`: a function of owner blocks (momentum + Newton-Schulz) under
  ``in_specs = out_specs = P(owner_axes)``: no collective can appear inside it.
- :func:`from_owners`: owner blocks -> updates with exactly the params' shardings
  (``all_gather`` where the param is replicated, the inverse ``all_to_all`` where it is sharded).

With ``chunk_bytes`` a stack's owner blocks are split into chunks (``OwnerPlan.chunks``: rows
``start..start + rows`` of every device's block, holding a contiguous range of the stack's
matrices, :func:`muon_jax.owner_plan.owner_rows`) that move and are orthogonalized
independently: the same bytes in more, smaller collectives that XLA may overlap with
Newton-Schulz of other chunks, and with the backward pass while it still computes the
gradients of other leaves (earlier layers). Momentum stays one array per stack
(:func:`split_chunks` / :func:`join_chunks`).

Why explicit collectives: left to the SPMD partitioner, a sharding constraint that moves
gradient stacks to their owners all-reduces every gradient first and then moves slices, and
XLA:CPU never turns all-reduce + slice into a reduce-scatter (XLA:GPU/TPU do, which
``replicated_grads='scatter'`` relies on). Bytes per device for a data-parallel step whose
gradients arrive unreduced (:func:`muon_jax.dp.reduced_view`): reduce-scatter + all-gather =
one all-reduce, the traffic of data-parallel AdamW (plus padding of ``K`` to ``N``); with
gradients all-reduced in the backward pass it is all-reduce + all-gather.

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
    (2020). Keller Jordan, distributed Muon in modded-nanogpt (2024): all-reduce + all-gather.
  Liu et al., "Muon is Scalable for LLM Training" (Moonlight, 2025).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_jax import dp, matrices, owner_plan
from muon_jax.owner_plan import Axes, LeafPlan, MeshLike, OwnerPlan, StackPlan, mesh_size

__all__ = [
    "from_owners",
    "init_owner_stacks",
    "join_chunks",
    "owner_map",
    "partition_spec",
    "replicated_zeros",
    "split_chunks",
    "to_owners",
]


def partition_spec(spec: Sequence[Axes], **kw: Any) -> P:
    """The PartitionSpec of per-dim mesh axes (trailing ``None`` dropped, as ``jit`` does).

    >>> partition_spec([('data',), (), ()]) == P('data')
    True
    >>> partition_spec([(), ('data', 'model')], unreduced={'pod'}) == P(None, ('data', 'model'),
    ...                                                                 unreduced={'pod'})
    True
    """
    parts = [(a[0] if len(a) == 1 else a) if a else None for a in spec]
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts, **kw)


def _local_view(leaf: LeafPlan, spec: Sequence[Axes], mesh: MeshLike) -> matrices.MatrixView:
    """The leaf's matrix view of one device's block when it is sharded as ``spec``."""
    shape = tuple(s // mesh_size(mesh, axes) for s, axes in zip(leaf.shape, spec, strict=True))
    return leaf.view.with_leaf_shape(shape)


def _explicit_axes(mesh: MeshLike) -> frozenset[str]:
    """The mesh's Explicit axes."""
    return frozenset(
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    )


def _constrain(x: jax.Array, spec: P, mesh: MeshLike) -> jax.Array:
    """Pin ``x`` to ``spec``: ``reshard`` on Explicit meshes, a sharding constraint on Auto."""
    explicit = _explicit_axes(mesh)
    if explicit and explicit == frozenset(mesh.axis_names):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    if explicit:
        return x  # mixed meshes: shard_map's in_specs carry the constraint
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _shard_map(f: Callable, plan: OwnerPlan, in_specs: Any, out_specs: Any, *,
               whole: bool = False, **kw: Any):
    """``jax.shard_map`` over the plan's mesh; ``whole``: under ``jax.jit``, so an eager call
    compiles it in one piece (op by op, XLA:CPU of jax 0.11.2 crashed on a zero-row pad)."""
    fn = jax.shard_map(f, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs, **kw)
    return jax.jit(fn) if whole else fn


def init_owner_stacks(plan: OwnerPlan, dtype: Any = None) -> tuple[jax.Array, ...]:
    """Zero stacks in the owner blocks' sharding (e.g. Muon momentum), one per stack.

    Args:
      plan: from :func:`muon_jax.owner_plan.plan_owners`.
      dtype: element type (None: each stack's gradient dtype).

    Returns:
      Tuple of ``[N * k_owner, m, n]`` arrays sharded ``P(owner_axes)``: 1/N per device.

    >>> mesh = jax.make_mesh((jax.device_count(),), ('d',))
    >>> plan = owner_plan.plan_owners([('w', (8, 4, 4), 'float32', None)], [None], mesh=mesh)
    >>> [x.shape for x in init_owner_stacks(plan, jnp.bfloat16)]
    [(8, 4, 4)]
    """
    dts = [s.dtype if dtype is None else jnp.dtype(dtype) for s in plan.stacks]

    def zeros():
        return tuple(
            jnp.zeros((s.k_owner, s.m, s.n), dt) for s, dt in zip(plan.stacks, dts, strict=True)
        )

    out_specs = tuple(plan.owner_spec(s) for s in plan.stacks)
    return tuple(_shard_map(zeros, plan, (), out_specs)())


def replicated_zeros(plan: OwnerPlan, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros replicated over the plan's mesh (e.g. a step counter), eager or traced.

    Args:
      plan: from :func:`muon_jax.owner_plan.plan_owners`.
      shape: the array shape.
      dtype: the element type.

    Returns:
      An array sharded ``P()`` over ``plan.mesh``.

    >>> mesh = jax.make_mesh((jax.device_count(),), ('d',))
    >>> plan = owner_plan.plan_owners([], [], mesh=mesh)
    >>> replicated_zeros(plan, (), jnp.int32).sharding.spec == P()
    True
    """
    return _shard_map(lambda: jnp.zeros(shape, dtype), plan, (), P())()


def _typed_spec(x: Any, explicit: frozenset[str]) -> tuple[Axes, ...] | None:
    """Explicit-axis part of ``x``'s type sharding, per dim (None when no explicit axes)."""
    if not explicit:
        return None
    try:
        spec = jax.typeof(x).sharding.spec
    except AttributeError:
        return None
    entries = tuple(spec.partitions) + (None,) * (x.ndim - len(spec.partitions))
    return tuple(tuple(a for a in owner_plan.spec_axes(e) if a in explicit) for e in entries)


def _stack_unreduced(grads: Sequence[Any], plan: OwnerPlan) -> list[frozenset[str]]:
    """Per stack, the mesh axes its gradients are unreduced over (the same for all of them)."""
    out = []
    for s in plan.stacks:
        unreduced = {dp.unreduced_axes(grads[i]) for i in s.leaves}
        if len(unreduced) != 1:
            raise ValueError(
                f"leaf {plan.leaves[s.leaves[0]].path!r}: gradients of one stack are "
                f"unreduced over different mesh axes {sorted(map(sorted, unreduced))}; "
                "reduce them alike."
            )
        out.append(unreduced.pop())
    return out


def _check_typed_sharding(x: Any, leaf: LeafPlan, explicit: frozenset[str]) -> None:
    """Raise naming the leaf when a gradient's explicit sharding is not its param's."""
    typed = _typed_spec(x, explicit)
    want = tuple(tuple(a for a in e if a in explicit) for e in leaf.spec)
    if typed is not None and typed != want:
        raise ValueError(
            f"leaf {leaf.path!r}: gradient sharding {typed} differs from the param sharding "
            f"{want} the optimizer was initialized with; init with params sharded as in "
            "training."
        )


def to_owners(grads: Sequence[jax.Array], plan: OwnerPlan, *,
              reduce_dtype: Any = None) -> tuple[jax.Array, ...]:
    """Move gradients (one per Muon leaf) to owner chunks with explicit collectives.

    Per chunk (``plan.chunks``) and shard axis: reduce-scatter of unreduced partial sums
    (``psum_scatter``), a local slice of replicated gradients, or an all-to-all for
    matrix-sharded ones. Chunks of one stack split its bytes; their collectives are independent,
    so XLA can overlap one chunk's collective with another chunk's Newton-Schulz.

    Args:
      grads: gradient leaves in ``plan.leaves`` order (unreduced over shard axes allowed).
      plan: from :func:`muon_jax.owner_plan.plan_owners`.
      reduce_dtype: the dtype unreduced gradients are summed in on the way (reduce-scatter,
        all-reduce), cast back to the gradient dtype after; ``None``: the gradient dtype.

    Returns:
      One ``[N * rows, m, n]`` array per ``plan.chunks``, sharded ``P(owner_axes)``; with
      one chunk per stack, one ``[N * k_owner, m, n]`` stack per ``plan.stacks``.

    Raises:
      ValueError: naming the leaf when its gradient's explicit sharding differs from the plan.

    >>> mesh = jax.make_mesh((jax.device_count(),), ('d',))
    >>> plan = owner_plan.plan_owners([('w', (8, 4, 4), 'float32', None)], [None], mesh=mesh)
    >>> g = jnp.arange(128.0).reshape(8, 4, 4)
    >>> (owned,) = to_owners([g], plan)
    >>> owned.shape, bool((owned == g).all())  # matrix k is owned by device k // k_owner
    ((8, 4, 4), True)

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    mesh = plan.mesh
    explicit = _explicit_axes(mesh)
    per_stack_u = _stack_unreduced(grads, plan)
    placed, in_specs, local = list(grads), [None] * len(grads), {}
    for s, u in zip(plan.stacks, per_stack_u, strict=True):
        for i in s.leaves:
            leaf = plan.leaves[i]
            _check_typed_sharding(grads[i], leaf, explicit)
            # Unreduced gradients come in the param's sharding (their remaining axes are
            # sliced, see _entry_ops); the unreduced axes are reduce-scattered.
            spec = tuple(tuple(a for a in e if a not in u)
                         for e in (leaf.spec if u else leaf.entry_spec))
            if not u:
                placed[i] = _constrain(grads[i], partition_spec(spec), mesh)
            in_specs[i] = partition_spec(spec, unreduced=u) if u else partition_spec(spec)
            local[i] = _local_view(leaf, spec, mesh)

    def entry(*blocks):
        out = []
        for s, u in zip(plan.stacks, per_stack_u, strict=True):
            mats = [matrices.to_matrices(blocks[i], local[i]) for i in s.leaves]
            f = _factor(s, plan)
            for start, rows in zip(s.offsets, s.chunks or (s.k_owner,), strict=True):
                # The chunk's contiguous rows of the (padded) local stack; each op splits dim
                # 0 evenly, so owner g gets its g-th block of them (owner_plan.owner_rows).
                ranges = [(f * start, f * (start + rows))]
                out.append(_entry_ops(s, _take_rows(mats, ranges), u, plan, reduce_dtype))
        return tuple(out)

    out_specs = tuple(plan.owner_spec(plan.stacks[c.stack]) for c in plan.chunks)
    return _shard_map(entry, plan, tuple(in_specs), out_specs, whole=True)(*placed)


def _factor(s: StackPlan, plan: OwnerPlan) -> int:
    """Devices the stack's ops split it over: the local stack is ``[factor * k_owner, m, n]``."""
    return mesh_size(plan.mesh, [a for op in s.ops for a in op.axes])


# Most operands per concatenate: XLA:GPU's concatenate slows down with many operands, in-place
# dynamic_update_slice copies do not.
_CONCAT_MAX = 8


def _assemble(pieces: Sequence[jax.Array | int]) -> jax.Array:
    """Concatenate ``pieces`` along axis 0; an int piece is that many zero rows of the same type."""
    ref = next(p for p in pieces if not isinstance(p, int))
    if len(pieces) == 1:
        return ref

    def zeros(rows: int) -> jax.Array:
        # Padding of a real piece, so it shares its type (e.g. unreduced). The padding value
        # is a zero of that type too: jax >= 0.12 requires pad's operand and value to be
        # unreduced over the same axes (zeros_like keeps the type there; older jax drops the
        # unreduced axes but accepts any value).
        empty = ref[:0]
        return jnp.pad(empty, ((rows, 0),) + ((0, 0),) * (ref.ndim - 1),
                       constant_values=jnp.zeros_like(empty, shape=()))

    if len(pieces) <= _CONCAT_MAX:
        return jnp.concatenate([zeros(p) if isinstance(p, int) else p for p in pieces], axis=0)
    out, pos = zeros(sum(p if isinstance(p, int) else p.shape[0] for p in pieces)), 0
    for p in pieces:
        if not isinstance(p, int):
            out = jax.lax.dynamic_update_slice_in_dim(out, p, pos, axis=0)
        pos += p if isinstance(p, int) else p.shape[0]
    return out


def _take_rows(mats: Sequence[jax.Array], ranges: Sequence[tuple[int, int]]) -> jax.Array:
    """Rows ``[a, b)`` per range of ``concatenate(mats)`` (zeros past its end), in one copy."""
    pieces = owner_plan.row_pieces([x.shape[0] for x in mats], ranges)
    return _assemble([p if isinstance(p, int) else
                      mats[p[0]] if (p[1], p[2]) == (0, mats[p[0]].shape[0]) else
                      mats[p[0]][p[1]:p[2]] for p in pieces])


def _entry_ops(s: StackPlan, x: jax.Array, u: frozenset[str], plan: OwnerPlan,
               reduce_dtype: Any = None) -> jax.Array:
    """Device-local: reduce-scatter / slice / all-to-all ``x`` into owner blocks."""
    mesh = plan.mesh
    dtype = x.dtype
    if u and reduce_dtype is not None:
        # The partial sums travel, and are added (by NCCL on GPU), in reduce_dtype; only
        # unreduced gradients: a replicated or sharded one moves without a sum.
        x = x.astype(reduce_dtype)
    extra = tuple(a for a in mesh.axis_names if a in u and a not in plan.shard_axes)
    if extra:  # unreduced over an axis that does not shard the stacks: plain all-reduce
        x = jax.lax.psum(x, extra)
    for op in s.ops:
        if set(op.axes) <= u:
            x = jax.lax.psum_scatter(x, op.axes, scatter_dimension=0, tiled=True)
        elif op.entry == "split" or (u and op.exit == "gather"):
            # Split dim 0 one axis at a time, major first (the tiled order of op.axes):
            # reduce-scatter over axes the gradient is unreduced over, slice over the others.
            for a in op.axes:
                if a in u:
                    x = jax.lax.psum_scatter(x, a, scatter_dimension=0, tiled=True)
                else:
                    chunk = x.shape[0] // mesh.shape[a]
                    x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(a) * chunk, chunk)
        else:
            x = jax.lax.all_to_all(x, op.axes, 0, 1 if op.entry == "a2a_m" else 2, tiled=True)
    return x.astype(dtype)


def owner_map(
    fn: Callable[..., tuple[jax.Array, ...]],
    plan: OwnerPlan,
    chunks: Sequence[Sequence[jax.Array]],
    scalars: Sequence[jax.Array] = (),
) -> list[tuple[jax.Array, ...]]:
    """Apply ``fn`` to each chunk's owner blocks, device-locally (no collectives).

    ``fn(stack_plan, blocks, scalars) -> tuple of blocks`` runs under ``jax.shard_map`` with
    ``in_specs = out_specs = P(owner_axes)`` (scalars replicated), once per chunk, so each
    device computes on its own whole matrices only, and chunks stay independent.

    Args:
      fn: the per-device computation (e.g. momentum + Newton-Schulz).
      plan: from :func:`muon_jax.owner_plan.plan_owners`.
      chunks: per ``plan.chunks``, a sequence of owner arrays (e.g. gradient, momentum).
      scalars: replicated scalars passed to ``fn`` (e.g. the step count).

    Returns:
      Per chunk, the tuple of owner arrays ``fn`` returned.

    >>> mesh = jax.make_mesh((jax.device_count(),), ('d',))
    >>> plan = owner_plan.plan_owners([('w', (8, 4, 4), 'float32', None)], [None], mesh=mesh)
    >>> ones = jax.device_put(jnp.ones((8, 4, 4)), NamedSharding(mesh, P('d')))
    >>> (doubled,), = owner_map(lambda s, b, c: (2 * b[0],), plan, [(ones,)])
    >>> float(doubled.sum())
    256.0

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    chunks = [tuple(a) for a in chunks]
    plans = plan.chunks
    if len(chunks) != len(plans):
        raise ValueError(f"owner_map: got {len(chunks)} chunks, the plan has {len(plans)}.")
    counts = [len(a) for a in chunks]
    flat = [a for arrays in chunks for a in arrays]

    def body(*args):
        res, start = [], 0
        blocks, sc = args[: len(flat)], args[len(flat):]
        for c, n in zip(plans, counts, strict=True):
            res.append(tuple(fn(plan.stacks[c.stack], blocks[start: start + n], sc)))
            start += n
        return tuple(res)

    local = [jax.ShapeDtypeStruct((c.rows, *plan.stacks[c.stack].matrix_shape), a.dtype)
             for c, arrays in zip(plans, chunks, strict=True) for a in arrays]
    local += [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in scalars]
    shapes = jax.eval_shape(body, *local)
    specs = [plan.owner_spec(plan.stacks[c.stack]) for c in plans]
    in_specs = tuple(sp for sp, n in zip(specs, counts, strict=True) for _ in range(n))
    out_specs = tuple((sp,) * len(r) for sp, r in zip(specs, shapes, strict=True))
    f = _shard_map(body, plan, in_specs + (P(),) * len(scalars), out_specs)
    return list(f(*flat, *scalars))


def split_chunks(stacks: Sequence[jax.Array], plan: OwnerPlan) -> tuple[jax.Array, ...]:
    """Owner stacks (e.g. momentum, one per ``plan.stacks``) -> one array per chunk.

    Device-local static slices (no communication).

    Args:
      stacks: ``[N * k_owner, m, n]`` arrays sharded ``P(owner_axes)``.
      plan: from :func:`muon_jax.owner_plan.plan_owners`.

    Returns:
      One ``[N * rows, m, n]`` array per ``plan.chunks``.

    >>> mesh = jax.make_mesh((jax.device_count(),), ('d',))
    >>> plan = owner_plan.plan_owners([('w', (16, 4, 4), 'float32', None)], [None], mesh=mesh,
    ...                               chunk_bytes=512)  # two chunks of 8 / N matrices
    >>> [x.shape for x in split_chunks(init_owner_stacks(plan), plan)]
    [(8, 4, 4), (8, 4, 4)]
    """
    if all(len(s.chunks) <= 1 for s in plan.stacks):
        return tuple(stacks)

    def body(*xs):
        return tuple(xs[c.stack][c.start: c.start + c.rows] for c in plan.chunks)

    in_specs = tuple(plan.owner_spec(s) for s in plan.stacks)
    out_specs = tuple(in_specs[c.stack] for c in plan.chunks)
    return tuple(_shard_map(body, plan, in_specs, out_specs)(*stacks))


def join_chunks(chunks: Sequence[jax.Array], plan: OwnerPlan) -> tuple[jax.Array, ...]:
    """Inverse of :func:`split_chunks`: one owner stack per ``plan.stacks``.

    Args:
      chunks: one ``[N * rows, m, n]`` array per ``plan.chunks``.
      plan: from :func:`muon_jax.owner_plan.plan_owners`.

    Returns:
      One ``[N * k_owner, m, n]`` array per ``plan.stacks``, sharded ``P(owner_axes)``.

    >>> mesh = jax.make_mesh((jax.device_count(),), ('d',))
    >>> plan = owner_plan.plan_owners([('w', (16, 4, 4), 'float32', None)], [None], mesh=mesh,
    ...                               chunk_bytes=512)  # two chunks of 8 / N matrices
    >>> [x.shape for x in join_chunks(split_chunks(init_owner_stacks(plan), plan), plan)]
    [(16, 4, 4)]
    """
    if all(len(s.chunks) <= 1 for s in plan.stacks):
        return tuple(chunks)

    def body(*xs):
        parts: list[list[jax.Array]] = [[] for _ in plan.stacks]
        for c, x in zip(plan.chunks, xs, strict=True):
            parts[c.stack].append(x)
        return tuple(_assemble(p) for p in parts)

    out_specs = tuple(plan.owner_spec(s) for s in plan.stacks)
    in_specs = tuple(out_specs[c.stack] for c in plan.chunks)
    return tuple(_shard_map(body, plan, in_specs, out_specs)(*chunks))


def from_owners(owner_chunks: Sequence[jax.Array], plan: OwnerPlan) -> list[jax.Array]:
    """Return owner chunks to leaves with exactly the params' shardings.

    Per chunk and op in reverse: all-gather of the stack axis where the param is replicated,
    the inverse all-to-all where it is sharded along a matrix axis; then each leaf is cut from
    its rows of the chunks (device-local slices; padding dropped).

    Args:
      owner_chunks: one ``[N * rows, m, n]`` array per ``plan.chunks``.
      plan: from :func:`muon_jax.owner_plan.plan_owners`.

    Returns:
      Leaves in ``plan.leaves`` order, each of its param's shape and sharding.

    >>> mesh = jax.make_mesh((jax.device_count(),), ('d',))
    >>> plan = owner_plan.plan_owners([('a', (3, 4, 4), 'float32', None),
    ...                                ('b', (4, 4), 'float32', None)], [None, None], mesh=mesh)
    >>> grads = [jnp.ones((3, 4, 4)), jnp.zeros((4, 4))]
    >>> [x.shape for x in from_owners(to_owners(grads, plan), plan)]
    [(3, 4, 4), (4, 4)]

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    mesh = plan.mesh
    local = [_local_view(leaf, leaf.spec, mesh) for leaf in plan.leaves]

    def exit_fn(*ys):
        gathered: list[list[jax.Array]] = [[] for _ in plan.stacks]
        for c, y in zip(plan.chunks, ys, strict=True):
            for op in reversed(plan.stacks[c.stack].ops):
                if op.exit == "gather":
                    y = jax.lax.all_gather(y, op.axes, axis=0, tiled=True)
                else:
                    y = jax.lax.all_to_all(
                        y, op.axes, 1 if op.exit == "a2a_m" else 2, 0, tiled=True
                    )
            gathered[c.stack].append(y)
        out: list[Any] = [None] * len(plan.leaves)
        for s, parts in zip(plan.stacks, gathered, strict=True):
            start, f = 0, _factor(s, plan)
            for i in s.leaves:
                pieces = owner_plan.chunk_pieces(s, start, local[i].batch, f)
                y = _assemble([parts[j] if (lo, hi) == (0, parts[j].shape[0]) else
                               parts[j][lo:hi] for j, lo, hi in pieces])
                out[i] = matrices.from_matrices(y, local[i])
                start += local[i].batch
        return tuple(out)

    in_specs = tuple(plan.owner_spec(plan.stacks[c.stack]) for c in plan.chunks)
    out_specs = tuple(partition_spec(leaf.spec) for leaf in plan.leaves)
    return list(_shard_map(exit_fn, plan, in_specs, out_specs, whole=True,
                           check_vma=False)(*owner_chunks))
