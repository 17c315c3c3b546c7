"""Owner-compute (ZeRO-1) layout for Muon: whole matrices in stacks sharded over mesh axes.

Muon matrices are grouped by shape into stacks ``[K, m, n]`` (a leaf contributes its
``[B, m, n]`` batch; scanned layers and expert banks are stacks already). Each stack's ``K``
is sharded over ``shard_axes`` (``N`` devices), padded up to a multiple of ``N``, so every
device owns ``ceil(K / N)`` whole matrices: it keeps their momentum (memory ``1/N``) and runs
Newton-Schulz on them alone. All data movement is explicit, in ``jax.shard_map``:

- ``to_owners``: gradients -> owner blocks. Per shard axis ``a`` the gradient is either
  *unreduced* over ``a`` (a reduce-scatter of the locally stacked partial sums,
  ``psum_scatter``), replicated over ``a`` (a local slice, no communication), or sharded over
  ``a`` along a matrix axis (FSDP / tensor parallel: one ``all_to_all`` that trades the matrix
  split for a stack split).
- ``owner_map``: a function of owner blocks (momentum + Newton-Schulz) under
  ``in_specs = out_specs = P(owner_axes)``: no collective can appear inside it.
- ``from_owners``: owner blocks -> updates with exactly the params' shardings
  (``all_gather`` where the param is replicated, the inverse ``all_to_all`` where it is sharded).

With ``chunk_bytes`` a stack's owner blocks are split into chunks (``Layout.chunks``: rows
``start..start + rows`` of every device's block) that move and are orthogonalized
independently: the same bytes in more, smaller collectives that XLA may overlap with
Newton-Schulz of other chunks. Momentum stays one array per stack (``split_chunks`` /
``join_chunks``).

Bytes per device for a data-parallel step with unreduced gradients: reduce-scatter + all-gather
= one all-reduce, the traffic of data-parallel AdamW (plus padding of ``K`` to ``N``).

What XLA does otherwise (measured with :mod:`xla_comm.hlo`, jax 0.10.2, 8 CPU devices, an MLP
of six 64x64 matrices trained data-parallel; ring bytes/device, AdamW = one all-reduce):

1. ``with_sharding_constraint`` of the padded gradient stack to ``P('d')`` right after
   ``jax.grad``: the partitioner all-reduces every gradient, then moves stack slices with 7
   all-to-alls, then all-gathers: 2.25x AdamW (the "468 all-to-alls" prototype).
2. Constraining each gradient leaf to ``P('d', None)`` first, then one explicit
   ``all_to_all``: the partitioner still emits all-reduce + dynamic-slice; XLA:CPU never forms
   a reduce-scatter from it (its pipeline has no ``ReduceScatterCreator``; XLA:GPU/TPU run that
   pass right after SPMD partitioning). ``replicated_grads='scatter'`` uses this path (a good
   bet on GPU, one all-to-all of ~1/N of the params more than 'slice' on CPU).
3. Explicit meshes with ``unreduced`` (jax 0.10.2): ``jax.reshard(g_unreduced, P('d'))`` emits
   all-reduce + slice, and concatenating / padding unreduced arrays before the reshard gives
   *wrong values* (reduced twice). Parameters stored ``reduced`` break optax (no reduced rule
   for ``integer_pow`` / ``is_finite``), and adding a reduced bias to batch-sharded
   activations is a type error. What works: keep params replicated, differentiate with respect
   to a reduced *view* of the Muon matrices (:func:`muon_jax.dp.reduced_view`, a free cast):
   their gradients come out unreduced and ``to_owners`` reduce-scatters them itself.
   Measured: RS + AG = 229,376 B with 6 matrices padded to 8 (172,032 B AdamW), exactly
   AdamW's bytes when K is a multiple of N (tests/test_muon_sharded.py, a scanned 8-layer MLP
   with AdamW leaves: 238,336 B for both).
4. Replicated gradients (``jax.grad`` on replicated params, Auto or Explicit): the all-reduce
   happens in the backward pass, before the optimizer sees the gradient; owners slice locally
   and the updates are all-gathered: all-reduce + all-gather (353,024 B in that test, 1.48x).

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
    (2020). Keller Jordan, distributed Muon in modded-nanogpt (2024): all-reduce + all-gather.
  Liu et al., "Muon is Scalable for LLM Training" (Moonlight, 2025). XLA latency-hiding
    scheduler (openxla.org/xla) overlaps the explicit collectives with compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_jax import _dims
from muon_jax._layout import (
    DEFAULT_CHUNK_BYTES,
    Axes,
    Chunk,
    Layout,
    LeafPlan,
    MeshLike,
    Op,
    ReplicatedGrads,
    StackPlan,
    _parts,
    _size,
    check_chunk_bytes,
    chunk_pieces,
    param_spec,
    plan_layout,
    resolve_mesh,
    resolve_shard_axes,
    row_pieces,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Chunk",
    "Layout",
    "LeafPlan",
    "Op",
    "ReplicatedGrads",
    "StackPlan",
    "check_chunk_bytes",
    "from_owners",
    "init_owner_stacks",
    "join_chunks",
    "owner_map",
    "param_spec",
    "plan_layout",
    "replicated_zeros",
    "resolve_mesh",
    "resolve_shard_axes",
    "split_chunks",
    "to_owners",
]


def _local_layout(plan: LeafPlan, spec: tuple[Axes, ...], mesh: MeshLike) -> _dims.MatrixLayout:
    shape = tuple(s // _size(mesh, axes) for s, axes in zip(plan.shape, spec, strict=True))
    return plan.layout._replace(shape=shape)


def _pspec(spec: tuple[Axes, ...], **kw: Any) -> P:
    return P(*[(a[0] if len(a) == 1 else a) if a else None for a in spec], **kw)


def _explicit_axes(mesh: MeshLike) -> frozenset[str]:
    return frozenset(
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    )


def _constrain(x: jax.Array, spec: P, mesh: MeshLike) -> jax.Array:
    """Pin ``x`` to ``spec``: ``reshard`` on Explicit meshes, a sharding constraint on Auto."""
    explicit = _explicit_axes(mesh)
    if explicit and explicit == frozenset(mesh.axis_names):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    target = NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh) else spec
    if explicit:
        return x  # mixed meshes: shard_map's in_specs carry the constraint
    return jax.lax.with_sharding_constraint(x, target)


def _unreduced(x: Any) -> frozenset[str]:
    try:
        return frozenset(jax.typeof(x).sharding.spec.unreduced)
    except AttributeError:
        return frozenset()


def _shard_map(f: Callable, layout: Layout, in_specs: Any, out_specs: Any, **kw: Any):
    return jax.shard_map(f, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, **kw)


def init_owner_stacks(layout: Layout, dtype: Any = None) -> tuple[jax.Array, ...]:
    """Zero stacks in the owner layout (e.g. Muon momentum), one per stack.

    Args:
      layout: from :func:`plan_layout`.
      dtype: element type (None: each stack's gradient dtype).

    Returns:
      Tuple of ``[N * k_owner, m, n]`` arrays sharded ``P(owner_axes)``: 1/N per device.

    Example:
      >>> mus = init_owner_stacks(layout, jnp.float32)

    References:
      ZeRO stage 1 (Rajbhandari et al., 2020).
    """
    dts = [s.dtype if dtype is None else jnp.dtype(dtype) for s in layout.stacks]

    def zeros():
        return tuple(
            jnp.zeros((s.k_owner, s.m, s.n), dt) for s, dt in zip(layout.stacks, dts, strict=True)
        )

    out_specs = tuple(layout.owner_spec(s) for s in layout.stacks)
    return tuple(_shard_map(zeros, layout, (), out_specs)())


def replicated_zeros(layout: Layout, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros replicated over the layout's mesh (e.g. a step counter), eager or traced.

    Args:
      layout: from :func:`plan_layout`.
      shape: the array shape.
      dtype: the element type.

    Returns:
      An array sharded ``P()`` over ``layout.mesh``.

    Example:
      >>> count = replicated_zeros(layout, (), jnp.int32)

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    return _shard_map(lambda: jnp.zeros(shape, dtype), layout, (), P())()


def to_owners(grads: Sequence[jax.Array], layout: Layout) -> tuple[jax.Array, ...]:
    """Move gradients (one per Muon leaf) to owner chunks with explicit collectives.

    Per chunk (``layout.chunks``) and shard axis: reduce-scatter of unreduced partial sums
    (``psum_scatter``), a local slice of replicated gradients, or an all-to-all for
    matrix-sharded ones. Chunks of one stack split its bytes; their collectives are independent,
    so XLA can overlap one chunk's collective with another chunk's Newton-Schulz.

    Args:
      grads: gradient leaves in ``layout.leaves`` order (unreduced over shard axes allowed).
      layout: from :func:`plan_layout`.

    Returns:
      One ``[N * rows, m, n]`` array per ``layout.chunks``, sharded ``P(owner_axes)``; with
      one chunk per stack, one ``[N * k_owner, m, n]`` stack per ``layout.stacks``.

    Raises:
      ValueError: naming the leaf when its gradient's explicit sharding differs from the plan.

    Example:
      >>> owned = to_owners(jax.tree.leaves(grads), layout)  # one array per layout.chunks

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    mesh = layout.mesh
    explicit = _explicit_axes(mesh)
    placed, in_specs, local, per_stack_u = list(grads), [None] * len(grads), {}, []
    for s in layout.stacks:
        unreduced = {_unreduced(grads[i]) for i in s.leaves}
        if len(unreduced) != 1:
            raise ValueError(
                f"leaf {layout.leaves[s.leaves[0]].path!r}: gradients of one stack are "
                f"unreduced over different mesh axes {sorted(map(sorted, unreduced))}; "
                "reduce them alike."
            )
        u = unreduced.pop()
        per_stack_u.append(u)
        for i in s.leaves:
            leaf, x = layout.leaves[i], grads[i]
            typed = _typed_spec(x, explicit)
            want = tuple(tuple(a for a in e if a in explicit) for e in leaf.spec)
            if typed is not None and typed != want:
                raise ValueError(
                    f"leaf {leaf.path!r}: gradient sharding {typed} differs from the param "
                    f"sharding {want} the optimizer was initialized with; init with params "
                    "sharded as in training."
                )
            # Axes the gradient is unreduced over are reduce-scattered, never sliced.
            spec = tuple(tuple(a for a in e if a not in u) for e in leaf.entry_spec)
            if not u:
                placed[i] = _constrain(x, _pspec(spec), mesh)
            in_specs[i] = _pspec(spec, unreduced=u) if u else _pspec(spec)
            local[i] = _local_layout(leaf, spec, mesh)

    def entry(*blocks):
        out = []
        for s, u in zip(layout.stacks, per_stack_u, strict=True):
            mats = [_dims.to_matrices(blocks[i], local[i]) for i in s.leaves]
            f = _factor(s, layout)
            for start, rows in zip(s.offsets, s.chunks or (s.k_owner,), strict=True):
                # Rows start..start+rows of every owner's block: owner g's block is rows
                # g*k_owner.. of the (padded) local stack, as each op splits dim 0 evenly.
                ranges = [(g * s.k_owner + start, g * s.k_owner + start + rows) for g in range(f)]
                out.append(_entry_ops(s, _take_rows(mats, ranges), u, layout))
        return tuple(out)

    out_specs = tuple(layout.owner_spec(layout.stacks[c.stack]) for c in layout.chunks)
    return _shard_map(entry, layout, tuple(in_specs), out_specs)(*placed)


def _factor(s: StackPlan, layout: Layout) -> int:
    """Devices the stack's ops split it over: the local stack is ``[factor * k_owner, m, n]``."""
    return _size(layout.mesh, [a for op in s.ops for a in op.axes])


# XLA:GPU's concatenate kernel slows down with many operands (H200, jax 0.11.2: 2.2 TB/s for 8
# operands, 0.7 TB/s for 16-32); in-place dynamic_update_slice copies kept 1.4-1.5 TB/s.
_CONCAT_MAX = 8


def _assemble(pieces: Sequence[jax.Array | int]) -> jax.Array:
    """Concatenate ``pieces`` along axis 0; an int piece is that many zero rows.

    Zeros are padding of a real piece, so they share its type (e.g. unreduced).
    """
    ref = next(p for p in pieces if not isinstance(p, int))
    if len(pieces) == 1:
        return ref

    def zeros(rows: int) -> jax.Array:
        return jnp.pad(ref[:0], ((rows, 0),) + ((0, 0),) * (ref.ndim - 1))

    if len(pieces) <= _CONCAT_MAX:
        return jnp.concatenate([zeros(p) if isinstance(p, int) else p for p in pieces], axis=0)
    out, pos = zeros(sum(p if isinstance(p, int) else p.shape[0] for p in pieces)), 0
    for p in pieces:
        if not isinstance(p, int):
            out = jax.lax.dynamic_update_slice_in_dim(out, p, pos, axis=0)
        pos += p if isinstance(p, int) else p.shape[0]
    return out


def _take_rows(mats: Sequence[jax.Array], ranges: Sequence[tuple[int, int]]) -> jax.Array:
    """Rows ``[a, b)`` for each range of ``concatenate(mats)`` (zeros past its end), in order.

    Built from slices of ``mats`` in one copy, without materializing the concatenation.
    """
    pieces = row_pieces([x.shape[0] for x in mats], ranges)
    return _assemble([p if isinstance(p, int) else
                      mats[p[0]] if (p[1], p[2]) == (0, mats[p[0]].shape[0]) else
                      mats[p[0]][p[1]:p[2]] for p in pieces])


def _entry_ops(s: StackPlan, x: jax.Array, u: frozenset[str], layout: Layout) -> jax.Array:
    """Device-local: reduce-scatter / slice / all-to-all ``x`` into owner blocks."""
    mesh = layout.mesh
    extra = tuple(a for a in mesh.axis_names if a in u and a not in layout.shard_axes)
    if extra:  # unreduced over an axis that does not shard the stacks: plain all-reduce
        x = jax.lax.psum(x, extra)
    for op in s.ops:
        if set(op.axes) <= u:
            x = jax.lax.psum_scatter(x, op.axes, scatter_dimension=0, tiled=True)
        elif op.entry == "split" or set(op.axes) & u:
            if set(op.axes) & u:
                x = jax.lax.psum(x, tuple(a for a in op.axes if a in u))
            chunk = x.shape[0] // _size(mesh, op.axes)
            i = jax.lax.axis_index(op.axes)
            x = jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=0)
        else:
            x = jax.lax.all_to_all(x, op.axes, 0, 1 if op.entry == "a2a_m" else 2, tiled=True)
    return x


def _typed_spec(x: Any, explicit: frozenset[str]) -> tuple[Axes, ...] | None:
    """Explicit-axis part of ``x``'s type sharding, per dim (None when no explicit axes)."""
    if not explicit:
        return None
    try:
        spec = jax.typeof(x).sharding.spec
    except AttributeError:
        return None
    entries = list(_parts(spec)) + [None] * (x.ndim - len(_parts(spec)))
    out = []
    for e in entries:
        axes = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
        out.append(tuple(a for a in axes if a in explicit))
    return tuple(out)


def owner_map(
    fn: Callable[..., tuple[jax.Array, ...]],
    layout: Layout,
    chunks: Sequence[Sequence[jax.Array]],
    scalars: Sequence[jax.Array] = (),
) -> list[tuple[jax.Array, ...]]:
    """Apply ``fn`` to each chunk's owner blocks, device-locally (no collectives).

    ``fn(stack_plan, blocks, scalars) -> tuple of blocks`` runs under ``jax.shard_map`` with
    ``in_specs = out_specs = P(owner_axes)`` (scalars replicated), once per chunk, so each
    device computes on its own whole matrices only, and chunks stay independent.

    Args:
      fn: the per-device computation (e.g. momentum + Newton-Schulz).
      layout: from :func:`plan_layout`.
      chunks: per ``layout.chunks``, a sequence of owner arrays (e.g. gradient, momentum).
      scalars: replicated scalars passed to ``fn`` (e.g. the step count).

    Returns:
      Per chunk, the tuple of owner arrays ``fn`` returned.

    Example:
      >>> owner_map(lambda s, b, c: (b[0] * 2,), layout, [(g,) for g in owner_grads])

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    chunks = [tuple(a) for a in chunks]
    plans = layout.chunks
    if len(chunks) != len(plans):
        raise ValueError(f"owner_map: got {len(chunks)} chunks, the layout has {len(plans)}.")
    counts = [len(a) for a in chunks]
    flat = [a for arrays in chunks for a in arrays]

    def body(*args):
        res, start = [], 0
        blocks, sc = args[: len(flat)], args[len(flat):]
        for c, n in zip(plans, counts, strict=True):
            res.append(tuple(fn(layout.stacks[c.stack], blocks[start: start + n], sc)))
            start += n
        return tuple(res)

    local = [jax.ShapeDtypeStruct((c.rows, *layout.stacks[c.stack].matrix_shape), a.dtype)
             for c, arrays in zip(plans, chunks, strict=True) for a in arrays]
    local += [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in scalars]
    shapes = jax.eval_shape(body, *local)
    specs = [layout.owner_spec(layout.stacks[c.stack]) for c in plans]
    in_specs = tuple(sp for sp, n in zip(specs, counts, strict=True) for _ in range(n))
    out_specs = tuple((sp,) * len(r) for sp, r in zip(specs, shapes, strict=True))
    f = _shard_map(body, layout, in_specs + (P(),) * len(scalars), out_specs)
    return list(f(*flat, *scalars))


def split_chunks(stacks: Sequence[jax.Array], layout: Layout) -> tuple[jax.Array, ...]:
    """Owner stacks (e.g. momentum, one per ``layout.stacks``) -> one array per chunk.

    Device-local static slices (no communication).

    Args:
      stacks: ``[N * k_owner, m, n]`` arrays sharded ``P(owner_axes)``.
      layout: from :func:`plan_layout`.

    Returns:
      One ``[N * rows, m, n]`` array per ``layout.chunks``.

    Example:
      >>> mu_chunks = split_chunks(state.mu, layout)

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    if all(len(s.chunks) <= 1 for s in layout.stacks):
        return tuple(stacks)

    def body(*xs):
        return tuple(xs[c.stack][c.start: c.start + c.rows] for c in layout.chunks)

    in_specs = tuple(layout.owner_spec(s) for s in layout.stacks)
    out_specs = tuple(in_specs[c.stack] for c in layout.chunks)
    return tuple(_shard_map(body, layout, in_specs, out_specs)(*stacks))


def join_chunks(chunks: Sequence[jax.Array], layout: Layout) -> tuple[jax.Array, ...]:
    """Inverse of :func:`split_chunks`: one owner stack per ``layout.stacks``.

    Args:
      chunks: one ``[N * rows, m, n]`` array per ``layout.chunks``.
      layout: from :func:`plan_layout`.

    Returns:
      One ``[N * k_owner, m, n]`` array per ``layout.stacks``, sharded ``P(owner_axes)``.

    Example:
      >>> mu = join_chunks(new_mu_chunks, layout)

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    if all(len(s.chunks) <= 1 for s in layout.stacks):
        return tuple(chunks)

    def body(*xs):
        parts: list[list[jax.Array]] = [[] for _ in layout.stacks]
        for c, x in zip(layout.chunks, xs, strict=True):
            parts[c.stack].append(x)
        return tuple(_assemble(p) for p in parts)

    out_specs = tuple(layout.owner_spec(s) for s in layout.stacks)
    in_specs = tuple(out_specs[c.stack] for c in layout.chunks)
    return tuple(_shard_map(body, layout, in_specs, out_specs)(*chunks))


def from_owners(
    owner_chunks: Sequence[jax.Array], layout: Layout
) -> list[jax.Array]:
    """Return owner chunks to leaves with exactly the params' shardings.

    Per chunk and op in reverse: all-gather of the stack axis where the param is replicated,
    the inverse all-to-all where it is sharded along a matrix axis; then each leaf is cut from
    its rows of the chunks (device-local slices; padding dropped).

    Args:
      owner_chunks: one ``[N * rows, m, n]`` array per ``layout.chunks``.
      layout: from :func:`plan_layout`.

    Returns:
      Leaves in ``layout.leaves`` order, each of its param's shape and sharding.

    Example:
      >>> updates = from_owners(owner_updates, layout)

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    mesh = layout.mesh
    local = [_local_layout(leaf, leaf.spec, mesh) for leaf in layout.leaves]

    def exit_fn(*ys):
        gathered: list[list[jax.Array]] = [[] for _ in layout.stacks]
        for c, y in zip(layout.chunks, ys, strict=True):
            for op in reversed(layout.stacks[c.stack].ops):
                if op.exit == "gather":
                    y = jax.lax.all_gather(y, op.axes, axis=0, tiled=True)
                else:
                    y = jax.lax.all_to_all(
                        y, op.axes, 1 if op.exit == "a2a_m" else 2, 0, tiled=True
                    )
            gathered[c.stack].append(y)
        out: list[Any] = [None] * len(layout.leaves)
        for s, parts in zip(layout.stacks, gathered, strict=True):
            start = 0
            for i in s.leaves:
                pieces = chunk_pieces(s, start, local[i].batch)
                y = _assemble([parts[j] if (lo, hi) == (0, parts[j].shape[0]) else
                               parts[j][lo:hi] for j, lo, hi in pieces])
                out[i] = _dims.from_matrices(y, local[i])
                start += local[i].batch
        return tuple(out)

    in_specs = tuple(layout.owner_spec(layout.stacks[c.stack]) for c in layout.chunks)
    out_specs = tuple(_pspec(leaf.spec) for leaf in layout.leaves)
    return list(_shard_map(exit_fn, layout, in_specs, out_specs, check_vma=False)(*owner_chunks))
