"""The owner plan of sharded Muon: which whole matrices each device owns, and how they move.

Pure, static bookkeeping (no arrays): Muon leaves of one ``(m, n)``, dtype and sharding pattern
form a stack ``[K, m, n]``; its stack axis is split over ``shard_axes`` by a short list of
collective steps (:class:`Op`) derived from the params' shardings. :mod:`muon_jax.owners`
executes the plan. Errors name the leaf path and the mesh axis.

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
    (2020). Keller Jordan, distributed Muon in modded-nanogpt (2024).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_jax import matrices

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Chunk",
    "LeafPlan",
    "Op",
    "OwnerPlan",
    "ReplicatedGrads",
    "StackKey",
    "StackPlan",
    "check_chunk_bytes",
    "chunk_pieces",
    "chunk_sizes",
    "mesh_size",
    "owner_rows",
    "param_spec",
    "plan_owners",
    "resolve_shard_axes",
    "row_pieces",
    "spec_axes",
    "spec_dims",
]

Axes = tuple[str, ...]
MeshLike = Any  # jax.sharding.Mesh | jax.sharding.AbstractMesh
ReplicatedGrads = Literal["slice", "scatter"]
EntryOp = Literal["split", "a2a_m", "a2a_n"]

DEFAULT_CHUNK_BYTES: int | None = None
"""Default ``chunk_bytes``: one collective per stack and direction. Chunks let XLA overlap one
chunk's collectives with another's Newton-Schulz, but each adds its own collectives and
copies; one per stack is the simpler program, and chunking stays opt-in."""


@dataclasses.dataclass(frozen=True)
class StackKey:
    """What Muon leaves must share to form one stack: matrix shape, dtype and collectives.

    Attributes:
      m, n: matrix shape; dtype: gradient dtype.
      k_axes, m_axes, n_axes: mesh axes sharding the param's batch, ``m`` and ``n`` dims.
      rest_entry: how the stack axis is split over the remaining shard axes: ``'split'``
        (reduce-scatter or local slice) or ``'a2a_m'`` / ``'a2a_n'`` (the gradient arrives
        sharded along ``m`` / ``n``, see ``replicated_grads='scatter'``).
    """

    m: int
    n: int
    dtype: np.dtype
    k_axes: Axes
    m_axes: Axes
    n_axes: Axes
    rest_entry: EntryOp


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """One Muon leaf: its ``[B, m, n]`` view and its sharding (static).

    Attributes:
      path: leaf path for error messages.
      shape: global shape.
      dtype: the gradient (wire) dtype.
      view: global :class:`muon_jax.matrices.MatrixView`.
      spec: mesh axes per leaf dim of the param's sharding.
      entry_spec: mesh axes per leaf dim of the gradient as ``to_owners`` takes it.
      key: the :class:`StackKey` that groups it with other leaves.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    view: matrices.MatrixView
    spec: tuple[Axes, ...]
    entry_spec: tuple[Axes, ...]
    key: StackKey


@dataclasses.dataclass(frozen=True)
class Op:
    """One collective step between gradient blocks and the owner blocks over mesh ``axes``.

    ``entry``: ``'split'`` (a reduce-scatter of unreduced partial sums, else a local slice),
    ``'a2a_m'`` / ``'a2a_n'`` (all-to-all: split K, gather the m / n axis).
    ``exit``: ``'gather'`` (all-gather K) or ``'a2a_m'`` / ``'a2a_n'`` (the inverse all-to-all).
    ``axes`` are major first; one collective runs over all of them.
    """

    axes: Axes
    entry: EntryOp
    exit: Literal["gather", "a2a_m", "a2a_n"]


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """Leaves of one :class:`StackKey`, owned as whole matrices.

    Attributes:
      m, n: matrix shape; dtype: gradient dtype.
      leaves: indices into ``OwnerPlan.leaves``.
      k_axes: mesh axes already sharding the leaves' batch axis.
      ops: entry/exit steps, in entry order.
      k_local: matrices per device before the ops (sum of local batch sizes).
      k_owner: matrices owned per device (padded).
      chunks: owned matrices per device of each chunk (sum ``k_owner``): each chunk moves by
        its own collectives and is orthogonalized on its own, so XLA's async collectives of one
        chunk overlap Newton-Schulz of another. Same bytes as one chunk. A chunk holds a
        contiguous range of the stack's matrices (:func:`owner_rows`), so its collectives wait
        only for the leaves in that range.
    """

    m: int
    n: int
    dtype: np.dtype
    leaves: tuple[int, ...]
    k_axes: Axes
    ops: tuple[Op, ...]
    k_local: int
    k_owner: int
    chunks: tuple[int, ...] = ()

    @property
    def owner_axes(self) -> Axes:
        """Mesh axes sharding the stack axis of the owner blocks, major first."""
        return self.k_axes + tuple(a for op in self.ops for a in op.axes)

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """``(m, n)``."""
        return (self.m, self.n)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start of each chunk in a device's owner block."""
        sizes = self.chunks or (self.k_owner,)
        return tuple(int(o) for o in np.cumsum((0,) + sizes[:-1]))


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Rows ``[start, start + rows)`` of every device's owner block of ``plan.stacks[stack]``.

    A chunk's owner array is ``[N * rows, m, n]``, sharded ``P(owner_axes)`` like its stack.
    """

    stack: int
    start: int
    rows: int


@dataclasses.dataclass(frozen=True)
class OwnerPlan:
    """The static owner-compute plan for a tree of Muon leaves (hashable: lives in state).

    Attributes:
      mesh: the mesh (concrete or abstract).
      shard_axes: mesh axes that shard the stacks.
      leaves: per Muon leaf, in ``jax.tree.leaves`` order.
      stacks: the stacks.
    """

    mesh: MeshLike
    shard_axes: Axes
    leaves: tuple[LeafPlan, ...]
    stacks: tuple[StackPlan, ...]

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """All chunks, stack by stack (a stack without ``chunks`` is one chunk)."""
        return tuple(
            Chunk(i, off, rows)
            for i, s in enumerate(self.stacks)
            for off, rows in zip(s.offsets, s.chunks or (s.k_owner,), strict=True)
        )

    @property
    def num_shards(self) -> int:
        """N: devices along ``shard_axes``."""
        return mesh_size(self.mesh, self.shard_axes)

    def owner_spec(self, stack: StackPlan) -> P:
        """PartitionSpec of an owner stack ``[N * k_owner, m, n]``."""
        return P(stack.owner_axes or None)

    def owner_shape(self, stack: StackPlan) -> tuple[int, int, int]:
        """Global shape of an owner stack."""
        return (stack.k_owner * self.num_shards, stack.m, stack.n)


jax.tree_util.register_static(OwnerPlan)


def mesh_size(mesh: MeshLike, axes: Sequence[str]) -> int:
    """Number of devices along ``axes`` of ``mesh``.

    >>> mesh_size(jax.sharding.AbstractMesh((2, 4), ('data', 'model')), ('model',))
    4
    """
    return math.prod(mesh.shape[a] for a in axes)


def spec_axes(entry: Any) -> Axes:
    """The mesh axes of one PartitionSpec entry (``None``, a name or a tuple of names).

    >>> spec_axes(None), spec_axes('data'), spec_axes(('data', 'model'))
    ((), ('data',), ('data', 'model'))
    """
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def resolve_shard_axes(
    mesh: MeshLike, shard_axes: str | Sequence[str] | None, *, where: str = "muon"
) -> Axes:
    """Validate ``shard_axes`` against ``mesh`` (default: all mesh axes, in mesh order).

    Args:
      mesh: the mesh.
      shard_axes: an axis name, a sequence of them, or None.
      where: context (e.g. the first leaf path) for error messages.

    Returns:
      The axes as a tuple, in mesh order.

    Raises:
      ValueError: an axis is not in the mesh, or repeats.

    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> resolve_shard_axes(mesh, 'data'), resolve_shard_axes(mesh, None)
    (('data',), ('data', 'model'))
    """
    names = tuple(mesh.axis_names)
    if shard_axes is None:
        return names
    axes = (shard_axes,) if isinstance(shard_axes, str) else tuple(shard_axes)
    for a in axes:
        if a not in names:
            raise ValueError(
                f"{where}: shard axis {a!r} is not an axis of the mesh {names}; pass "
                f"shard_axes as a subset of {names} (or None for all of them)."
            )
    if len(set(axes)) != len(axes) or not axes:
        raise ValueError(f"{where}: shard_axes={axes} must be distinct and non-empty.")
    return tuple(a for a in names if a in axes)


def spec_dims(spec: P | None, ndim: int) -> tuple[Axes, ...]:
    """Mesh axes per dim of a PartitionSpec, padded to ``ndim`` dims (None: replicated).

    >>> spec_dims(P('data'), 3)
    (('data',), (), ())
    """
    entries = () if spec is None else tuple(spec.partitions)
    return tuple(spec_axes(e) for e in entries + (None,) * (ndim - len(entries)))


def _normalize_spec(spec: Any, ndim: int, mesh: MeshLike, path: str) -> tuple[Axes, ...]:
    """Mesh axes per dim of a PartitionSpec (padded to ``ndim``), checked against the mesh."""
    if spec is not None and len(spec.partitions) > ndim:
        raise ValueError(f"{path}: sharding {spec} has more entries than the leaf rank {ndim}.")
    out = spec_dims(spec, ndim)
    for axes in out:
        for a in axes:
            if a not in mesh.axis_names:
                raise ValueError(
                    f"{path}: the param is sharded over mesh axis {a!r}, which is not in the "
                    f"optimizer's mesh {tuple(mesh.axis_names)}; use the params' mesh."
                )
    return out


def param_spec(x: Any) -> P | None:
    """The PartitionSpec of a param: its NamedSharding (concrete) or its explicit type.

    Inside ``jit`` only Explicit mesh axes are visible; Auto axes read as replicated.

    Args:
      x: an array, ``jax.ShapeDtypeStruct`` or tracer.

    Returns:
      A PartitionSpec, or None when unknown (treated as replicated).

    >>> mesh = jax.make_mesh((jax.device_count(),), ('d',))
    >>> param_spec(jax.device_put(np.ones((8, 4)), NamedSharding(mesh, P('d')))) == P('d')
    True
    """
    if not isinstance(x, jax.core.Tracer):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.spec
    try:
        s = jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None
    return getattr(s, "spec", None)


def _group_axes(
    spec: tuple[Axes, ...], group: tuple[int, ...], shape: tuple[int, ...], mesh: MeshLike,
    what: str, path: str,
) -> Axes:
    """Mesh axes sharding a merged group of dims; only its leading dim may be sharded."""
    if not group:
        return ()
    for d in group[1:]:
        if spec[d]:
            raise ValueError(
                f"{path}: dim {d} is sharded over {spec[d]} but is not the leading dim of the "
                f"{what} dims {group}; the owner plan can only split the leading dim of a "
                "merged group. Shard the leading dim instead, or change dimension_numbers."
            )
    d0 = group[0]
    if shape[d0] % mesh_size(mesh, spec[d0]):
        raise ValueError(
            f"{path}: dim {d0} of size {shape[d0]} is sharded over {spec[d0]} "
            f"({mesh_size(mesh, spec[d0])} devices), which does not divide it; pad the param."
        )
    return spec[d0]


def _view_spec(nspec: tuple[Axes, ...], view: matrices.MatrixView,
               where: str) -> tuple[Axes, ...]:
    """Mesh axes per axis of ``view.shape``: the leaf's, with a split (fused) axis, which
    must not be sharded, as two unsharded parts."""
    if view.split is None:
        return nspec
    s = view.split[0]
    if nspec[s]:
        raise ValueError(
            f"{where}: dim {s} holds {view.split[1]} fused matrices side by side "
            f"(SplitDimensionNumbers) and is sharded over {nspec[s]}; shard another dim, or "
            "view the leaf as one matrix with MuonDimensionNumbers.")
    return nspec[:s] + ((), ()) + nspec[s + 1:]


def _leaf_plan(
    path: str, shape: tuple[int, ...], dtype: Any, spec: Any, dim_nums: Any, *,
    mesh: MeshLike, shard: Axes, replicated_grads: ReplicatedGrads,
) -> LeafPlan:
    """Plan one leaf: its matrix view, the axes sharding it and how its gradient enters."""
    where = f"leaf {path!r}"
    view = matrices.matrix_view(shape, dim_nums, path=where)
    nspec = _normalize_spec(spec, len(shape), mesh, where)
    for a in [a for axes in nspec for a in axes if a not in shard][:1]:
        raise ValueError(
            f"{where}: the param is sharded over mesh axis {a!r}, which is not a shard axis "
            f"(shard_axes={shard}); add {a!r} to shard_axes or replicate the param over it."
        )
    vspec = _view_spec(nspec, view, where)
    k_axes = _group_axes(vspec, view.batch_axes, view.shape, mesh, "batch", where)
    m_axes = _group_axes(vspec, view.reduction_axes, view.shape, mesh, "reduction", where)
    n_axes = _group_axes(vspec, view.output_axes, view.shape, mesh, "output", where)
    rest = tuple(a for a in shard if a not in k_axes + m_axes + n_axes)
    entry, rest_entry = list(nspec), "split"
    if replicated_grads == "scatter" and rest:
        for group, op in ((view.reduction_axes, "a2a_m"), (view.output_axes, "a2a_n")):
            d0 = view.leaf_axis(group[0])
            if view.split is not None and d0 == view.split[0]:
                continue  # a fused axis arrives whole (its parts are separate matrices)
            if (shape[d0] // mesh_size(mesh, nspec[d0])) % mesh_size(mesh, rest) == 0:
                entry[d0], rest_entry = nspec[d0] + rest, op
                break
    dtype = np.dtype(dtype)
    key = StackKey(view.m, view.n, dtype, k_axes, m_axes, n_axes, rest_entry)
    return LeafPlan(path, shape, dtype, view, nspec, tuple(entry), key)


def _stack_plan(
    key: StackKey, idx: list[int], leaves: list[LeafPlan], *, mesh: MeshLike, shard: Axes,
    chunk_bytes: int | None,
) -> StackPlan:
    """Plan the stack of the leaves ``idx``: its collectives, owned matrices and chunks."""
    rest = tuple(a for a in shard if a not in key.k_axes + key.m_axes + key.n_axes)
    # Minor axes of a matrix dim go first: the replicated axes that 'scatter' appends to
    # it, then the param's own axes; each group is one collective over an axis tuple.
    ops = tuple(Op(axes, entry, exit_) for axes, entry, exit_ in (
        (rest, key.rest_entry, "gather"),
        (key.m_axes, "a2a_m", "a2a_m"),
        (key.n_axes, "a2a_n", "a2a_n"),
    ) if axes)
    k_local = sum(leaves[i].view.batch // mesh_size(mesh, key.k_axes) for i in idx)
    k_owner = -(-k_local // mesh_size(mesh, [a for op in ops for a in op.axes]))
    row_bytes = mesh_size(mesh, shard) * key.m * key.n * key.dtype.itemsize
    return StackPlan(key.m, key.n, key.dtype, tuple(idx), key.k_axes, ops, k_local, k_owner,
                     chunk_sizes(k_owner, row_bytes, chunk_bytes))


def plan_owners(
    leaves: Sequence[tuple[str, tuple[int, ...], Any, Any]],
    dim_nums: Sequence[Any],
    *,
    mesh: MeshLike,
    shard_axes: str | Sequence[str] | None = None,
    replicated_grads: ReplicatedGrads = "slice",
    chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
) -> OwnerPlan:
    """Plan which device owns each Muon matrix: stacks, their sharding and the collectives.

    Leaves of one :class:`StackKey` form a stack; its ``K`` (padded to a multiple of N /
    (devices already sharding the batch axis)) is split over ``shard_axes``.

    Args:
      leaves: per Muon leaf ``(path, shape, dtype, spec)``; ``spec`` a PartitionSpec or None.
      dim_nums: per leaf ``MuonDimensionNumbers`` or None (last two axes are the matrix).
      mesh: the mesh.
      shard_axes: axes sharding the stacks (None: all mesh axes).
      replicated_grads: for a shard axis over which the param is replicated, ``'slice'``
        (owners slice the all-reduced gradient: no extra collective) or ``'scatter'`` (take
        the gradient sharded along ``m`` / ``n`` and one all-to-all into the stack: XLA:GPU
        turns the all-reduce + slice before it into a reduce-scatter).
      chunk_bytes: target size of one collective (its full buffer, ``N * rows * m * n`` wire
        bytes): each stack's owner blocks are split into about equal chunks of at most this
        size (at least one matrix per device), each moved and orthogonalized on its own.
        ``None`` or 0: one chunk per stack.

    Returns:
      An :class:`OwnerPlan`.

    Raises:
      ValueError: naming the leaf path and mesh axis when a shard axis is missing from the
        mesh, or a param is sharded in a way the owner plan cannot serve.

    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> plan_owners([('v', (16, 32), np.float32, P(None, 'model'))], [None], mesh=mesh,
    ...             shard_axes='data')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: leaf 'v': the param is sharded over mesh axis 'model', which is not a shard ...
    >>> plan = plan_owners([('w', (8, 16, 32), np.float32, P())], [None], mesh=mesh)
    >>> plan.stacks[0].k_owner, plan.owner_shape(plan.stacks[0])  # 8 matrices, 8 devices
    (1, (8, 16, 32))

    References:
      ZeRO (Rajbhandari et al., 2020); Keller Jordan's distributed Muon (2024).
    """
    first = leaves[0][0] if leaves else "muon"
    shard = resolve_shard_axes(mesh, shard_axes, where=f"leaf {first!r}")
    if replicated_grads not in ("slice", "scatter"):
        raise ValueError(
            f"replicated_grads must be 'slice' or 'scatter', got {replicated_grads!r}."
        )
    check_chunk_bytes(chunk_bytes)
    plans = [
        _leaf_plan(path, tuple(int(s) for s in shape), dtype, spec, dn, mesh=mesh, shard=shard,
                   replicated_grads=replicated_grads)
        for (path, shape, dtype, spec), dn in zip(leaves, dim_nums, strict=True)
    ]
    groups: dict[StackKey, list[int]] = {}
    for i, leaf in enumerate(plans):
        groups.setdefault(leaf.key, []).append(i)
    stacks = tuple(_stack_plan(key, idx, plans, mesh=mesh, shard=shard, chunk_bytes=chunk_bytes)
                   for key, idx in groups.items())
    return OwnerPlan(mesh, shard, tuple(plans), stacks)


def row_pieces(
    sizes: Sequence[int], ranges: Sequence[tuple[int, int]]
) -> list[tuple[int, int, int] | int]:
    """Rows ``[a, b)`` of each range of a concatenation of blocks of ``sizes`` rows, as pieces.

    Returns ``(block, lo, hi)`` (rows ``lo..hi`` of a block) or an int (that many zero rows,
    past the end), in order, adjacent pieces merged.

    >>> row_pieces([2, 3], [(1, 4), (5, 7)])
    [(0, 1, 2), (1, 0, 2), 2]
    """
    ends = np.cumsum(sizes)
    pieces: list[tuple[int, int, int] | int] = []

    def add(piece):
        last = pieces[-1] if pieces else None
        if isinstance(piece, int) and isinstance(last, int):
            pieces[-1] = last + piece
        elif (isinstance(piece, tuple) and isinstance(last, tuple) and last[0] == piece[0]
              and last[2] == piece[1]):
            pieces[-1] = (last[0], last[1], piece[2])
        else:
            pieces.append(piece)

    for a, b in ranges:
        while a < b:
            i = int(np.searchsorted(ends, a, side="right"))
            if i == len(sizes):
                add(b - a)
                break
            lo = a - (int(ends[i - 1]) if i else 0)
            take = min(b, int(ends[i])) - a
            add((i, lo, lo + take))
            a += take
    return pieces


def chunk_pieces(stack: StackPlan, start: int, rows: int,
                 factor: int) -> list[tuple[int, int, int]]:
    """Where rows ``[start, start + rows)`` of a stack's local ``[factor * k_owner]`` stack land.

    Chunk ``j`` holds the contiguous rows ``factor * offsets[j]`` up to ``factor * (offsets[j]
    + chunks[j])`` of the local stack (:func:`owner_rows`), so row ``r`` sits at row ``r -
    factor * offsets[j]`` of that chunk's gathered ``[factor * chunks[j]]`` array. Returns
    ``(chunk, lo, hi)`` pieces, adjacent ones merged.

    >>> stack = StackPlan(2, 2, np.dtype('float32'), (0,), (), (), 4, 2, (1, 1))
    >>> chunk_pieces(stack, 0, 4, 2)  # chunk 0: rows 0, 1; chunk 1: rows 2, 3
    [(0, 0, 2), (1, 0, 2)]
    """
    sizes = stack.chunks or (stack.k_owner,)
    ends = np.cumsum(sizes) * factor
    pieces: list[tuple[int, int, int]] = []
    r, stop = start, start + rows
    while r < stop:
        j = int(np.searchsorted(ends, r, side="right"))
        lo = r - factor * stack.offsets[j]
        take = min(stop, int(ends[j])) - r
        pieces.append((j, lo, lo + take))
        r += take
    return pieces


def owner_rows(stack: StackPlan, factor: int) -> np.ndarray:
    """Which row of the local ``[factor * k_owner]`` stack each owner row holds.

    Owner ``g`` of the ``factor`` devices the stack's ops split it over keeps rows ``g *
    k_owner ..`` of the owner stack; its rows of chunk ``j`` are the ``g``-th block of
    ``chunks[j]`` rows of the chunk's contiguous range ``factor * offsets[j] ..`` of the local
    stack. One chunk: owner ``g`` keeps local rows ``g * k_owner ..``. Contiguous chunks let a
    chunk's collectives wait only for the leaves (e.g. the layers) whose rows it holds.

    >>> stack = StackPlan(2, 2, np.dtype('float32'), (0,), (), (), 4, 2, (1, 1))
    >>> owner_rows(stack, 2).tolist()  # owner 0: rows 0 and 2; owner 1: rows 1 and 3
    [0, 2, 1, 3]
    """
    sizes = stack.chunks or (stack.k_owner,)
    out = np.empty(factor * stack.k_owner, np.int64)
    for off, rows in zip(stack.offsets, sizes, strict=True):
        for g in range(factor):
            dst = g * stack.k_owner + off
            out[dst: dst + rows] = factor * off + g * rows + np.arange(rows)
    return out


def check_chunk_bytes(chunk_bytes: Any) -> None:
    """Raise ValueError unless ``chunk_bytes`` is None or an int >= 0.

    >>> check_chunk_bytes(-1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: chunk_bytes must be a byte count >= 0 or None, got -1; ...
    """
    if chunk_bytes is not None and (
        isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int | np.integer)
        or chunk_bytes < 0
    ):
        raise ValueError(
            f"chunk_bytes must be a byte count >= 0 or None, got {chunk_bytes!r}; pass e.g. "
            "128 * 2**20 (None or 0: one collective per stack)."
        )


def chunk_sizes(k_owner: int, row_bytes: int, chunk_bytes: int | None) -> tuple[int, ...]:
    """About equal chunk sizes summing to ``k_owner``, each at most ``chunk_bytes`` (>= 1 row).

    Args:
      k_owner: matrices owned per device.
      row_bytes: bytes one owned matrix per device adds to a collective (``N * m * n * size``).
      chunk_bytes: the target bytes of one collective (None or 0: one chunk).

    Returns:
      The rows per device of each chunk.

    >>> chunk_sizes(10, 1, 3), chunk_sizes(5, 100, 1), chunk_sizes(5, 1, None)
    ((2, 2, 3, 3), (1, 1, 1, 1, 1), (5,))
    """
    if not chunk_bytes or k_owner <= 1:
        return (k_owner,)
    rows = max(1, int(chunk_bytes) // row_bytes)
    count = -(-k_owner // rows)
    base, extra = divmod(k_owner, count)
    return tuple(base + (i >= count - extra) for i in range(count))
