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

Bytes per device for a data-parallel step with unreduced gradients: reduce-scatter + all-gather
= one all-reduce, the traffic of data-parallel AdamW (plus padding of ``K`` to ``N``).

What XLA does otherwise (measured with :mod:`muon_jax.hlo`, jax 0.10.2, 8 CPU devices, an MLP
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
   AdamW's bytes when K is a multiple of N.
4. Replicated gradients (``jax.grad`` on replicated params, Auto or Explicit): the all-reduce
   happens in the backward pass, before the optimizer sees the gradient; owners slice locally
   and the updates are all-gathered: all-reduce + all-gather (1.5x AdamW on CPU).

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
    (2020). Keller Jordan, distributed Muon in modded-nanogpt (2024): all-reduce + all-gather.
  Liu et al., "Muon is Scalable for LLM Training" (Moonlight, 2025). XLA latency-hiding
    scheduler (openxla.org/xla) overlaps the explicit collectives with compute.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_jax import _dims

__all__ = [
    "LeafPlan",
    "Op",
    "StackPlan",
    "Layout",
    "resolve_mesh",
    "resolve_shard_axes",
    "param_spec",
    "plan_layout",
    "init_owner_stacks",
    "replicated_zeros",
    "to_owners",
    "owner_map",
    "from_owners",
]

Axes = tuple[str, ...]
MeshLike = Any  # jax.sharding.Mesh | jax.sharding.AbstractMesh
ReplicatedGrads = Literal["slice", "scatter"]


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """One Muon leaf: its ``[B, m, n]`` view and its sharding (static).

    Attributes:
      path: leaf path for error messages.
      shape: global shape.
      dtype: the gradient (wire) dtype.
      layout: global :class:`muon_jax._dims.MatrixLayout`.
      spec: mesh axes per leaf dim of the param's sharding.
      entry_spec: mesh axes per leaf dim of the gradient as ``to_owners`` takes it.
      k_axes, m_axes, n_axes: mesh axes sharding ``B``, ``m``, ``n`` of the param.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    layout: _dims.MatrixLayout
    spec: tuple[Axes, ...]
    entry_spec: tuple[Axes, ...]
    k_axes: Axes
    m_axes: Axes
    n_axes: Axes


@dataclasses.dataclass(frozen=True)
class Op:
    """One collective step between gradient blocks and the owner layout over mesh ``axes``.

    ``entry``: ``'split'`` (a reduce-scatter of unreduced partial sums, else a local slice),
    ``'a2a_m'`` / ``'a2a_n'`` (all-to-all: split K, gather the m / n axis).
    ``exit``: ``'gather'`` (all-gather K) or ``'a2a_m'`` / ``'a2a_n'`` (the inverse all-to-all).
    ``axes`` are major first; one collective runs over all of them.
    """

    axes: Axes
    entry: Literal["split", "a2a_m", "a2a_n"]
    exit: Literal["gather", "a2a_m", "a2a_n"]


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """Leaves of one shape, dtype and sharding pattern, owned as whole matrices.

    Attributes:
      m, n: matrix shape; dtype: gradient dtype.
      leaves: indices into ``Layout.leaves``.
      k_axes: mesh axes already sharding the leaves' batch axis.
      ops: entry/exit steps, in entry order.
      k_local: matrices per device before the ops (sum of local batch sizes).
      k_owner: matrices owned per device (padded).
    """

    m: int
    n: int
    dtype: np.dtype
    leaves: tuple[int, ...]
    k_axes: Axes
    ops: tuple[Op, ...]
    k_local: int
    k_owner: int

    @property
    def owner_axes(self) -> Axes:
        """Mesh axes sharding the stack axis of the owner layout, major first."""
        return self.k_axes + tuple(a for op in self.ops for a in op.axes)


@dataclasses.dataclass(frozen=True)
class Layout:
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
    def num_shards(self) -> int:
        """N: devices along ``shard_axes``."""
        return math.prod(self.mesh.shape[a] for a in self.shard_axes)

    def owner_spec(self, stack: StackPlan) -> P:
        """PartitionSpec of an owner stack ``[N * k_owner, m, n]``."""
        return P(stack.owner_axes or None)

    def owner_shape(self, stack: StackPlan) -> tuple[int, int, int]:
        """Global shape of an owner stack."""
        return (stack.k_owner * self.num_shards, stack.m, stack.n)


def _size(mesh: MeshLike, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def resolve_mesh(mesh: MeshLike | None) -> MeshLike | None:
    """The mesh passed, else the ambient one (``jax.set_mesh``), else None.

    Args:
      mesh: a ``jax.sharding.Mesh`` / ``AbstractMesh`` or None.

    Returns:
      The mesh, or None when there is none.

    Example:
      >>> with jax.set_mesh(jax.make_mesh((8,), ('d',))):
      ...     resolve_mesh(None).axis_names
      ('d',)

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    if mesh is not None:
        return mesh
    ambient = jax.sharding.get_abstract_mesh()
    return None if ambient is None or ambient.empty else ambient


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

    Example:
      >>> resolve_shard_axes(jax.make_mesh((2, 4), ('data', 'model')), 'data')
      ('data',)

    References:
      ZeRO (Rajbhandari et al., 2020).
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


def _parts(spec: P | None) -> tuple[Any, ...]:
    """A PartitionSpec's per-dim entries (without unreduced / reduced)."""
    return () if spec is None else tuple(spec.partitions)


def _normalize_spec(spec: Any, ndim: int, mesh: MeshLike, path: str) -> tuple[Axes, ...]:
    entries = list(_parts(spec))
    if len(entries) > ndim:
        raise ValueError(f"{path}: sharding {spec} has more entries than the leaf rank {ndim}.")
    out: list[Axes] = []
    for e in entries + [None] * (ndim - len(entries)):
        if e is None or e is P.UNCONSTRAINED:
            out.append(())
        else:
            out.append((e,) if isinstance(e, str) else tuple(e))
    for axes in out:
        for a in axes:
            if a not in mesh.axis_names:
                raise ValueError(
                    f"{path}: the param is sharded over mesh axis {a!r}, which is not in the "
                    f"optimizer's mesh {tuple(mesh.axis_names)}; use the params' mesh."
                )
    return tuple(out)


def param_spec(x: Any) -> P | None:
    """The PartitionSpec of a param: its NamedSharding (concrete) or its explicit type.

    Inside ``jit`` only Explicit mesh axes are visible; Auto axes read as replicated.

    Args:
      x: an array or tracer.

    Returns:
      A PartitionSpec, or None when unknown (treated as replicated).

    Example:
      >>> param_spec(jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P('d'))))
      PartitionSpec('d',)

    References:
      JAX explicit sharding ("sharding in types").
    """
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and not isinstance(x, jax.core.Tracer):
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
                f"{what} dims {group}; the owner layout can only split the leading dim of a "
                "merged group. Shard the leading dim instead, or change dimension_numbers."
            )
    d0 = group[0]
    if shape[d0] % _size(mesh, spec[d0]):
        raise ValueError(
            f"{path}: dim {d0} of size {shape[d0]} is sharded over {spec[d0]} "
            f"({_size(mesh, spec[d0])} devices), which does not divide it; pad the param."
        )
    return spec[d0]


def plan_layout(
    leaves: Sequence[tuple[str, tuple[int, ...], Any, Any]],
    dim_nums: Sequence[Any],
    *,
    mesh: MeshLike,
    shard_axes: str | Sequence[str] | None = None,
    replicated_grads: ReplicatedGrads = "slice",
) -> Layout:
    """Plan the owner layout of Muon leaves: stacks, their sharding and the collectives.

    Leaves of equal ``(m, n)``, dtype and sharding pattern form a stack; its ``K`` (padded to a
    multiple of N / (devices already sharding the batch axis)) is split over ``shard_axes``.

    Args:
      leaves: per Muon leaf ``(path, shape, dtype, spec)``; ``spec`` a PartitionSpec or None.
      dim_nums: per leaf ``MuonDimensionNumbers`` or None (last two axes are the matrix).
      mesh: the mesh.
      shard_axes: axes sharding the stacks (None: all mesh axes).
      replicated_grads: for a shard axis over which the param is replicated, ``'slice'``
        (owners slice the all-reduced gradient: no extra collective) or ``'scatter'`` (take
        the gradient sharded along ``m`` / ``n`` and one all-to-all into the stack: XLA:GPU
        turns the all-reduce + slice before it into a reduce-scatter).

    Returns:
      A :class:`Layout`.

    Raises:
      ValueError: naming the leaf path and mesh axis when a shard axis is missing from the
        mesh, or a param is sharded in a way the owner layout cannot serve.

    Example:
      >>> lay = plan_layout([('w', (8, 16, 32), jnp.float32, P())], [None], mesh=mesh)
      >>> lay.stacks[0].k_owner  # 8 matrices over 8 devices
      1

    References:
      ZeRO (Rajbhandari et al., 2020); Keller Jordan's distributed Muon (2024).
    """
    first = leaves[0][0] if leaves else "muon"
    shard = resolve_shard_axes(mesh, shard_axes, where=f"leaf {first!r}")
    if replicated_grads not in ("slice", "scatter"):
        raise ValueError(
            f"replicated_grads must be 'slice' or 'scatter', got {replicated_grads!r}."
        )
    plans: list[LeafPlan] = []
    groups: dict[tuple, list[int]] = {}
    for (path, shape, dtype, spec), dn in zip(leaves, dim_nums, strict=True):
        shape = tuple(int(s) for s in shape)
        where = f"leaf {path!r}"
        layout = _dims.matrix_layout(shape, dn, path=where)
        nspec = _normalize_spec(spec, len(shape), mesh, where)
        for axes in nspec:
            for a in axes:
                if a not in shard:
                    raise ValueError(
                        f"{where}: the param is sharded over mesh axis {a!r}, which is not a "
                        f"shard axis (shard_axes={shard}); add {a!r} to shard_axes or replicate "
                        "the param over it."
                    )
        k_axes = _group_axes(nspec, layout.batch_axes, shape, mesh, "batch", where)
        m_axes = _group_axes(nspec, layout.reduction_axes, shape, mesh, "reduction", where)
        n_axes = _group_axes(nspec, layout.output_axes, shape, mesh, "output", where)
        rest = tuple(a for a in shard if a not in k_axes + m_axes + n_axes)
        entry = list(nspec)
        if replicated_grads == "scatter" and rest:
            for group in (layout.reduction_axes, layout.output_axes):
                d0 = group[0]
                if (shape[d0] // _size(mesh, nspec[d0])) % _size(mesh, rest) == 0:
                    entry[d0] = nspec[d0] + rest
                    break
        plan = LeafPlan(path, shape, np.dtype(dtype), layout, nspec, tuple(entry),
                        k_axes, m_axes, n_axes)
        key = (layout.m, layout.n, plan.dtype, k_axes, m_axes, n_axes, tuple(entry) != nspec,
               entry[layout.reduction_axes[0]] != nspec[layout.reduction_axes[0]])
        groups.setdefault(key, []).append(len(plans))
        plans.append(plan)

    stacks = []
    for (m, n, dtype, k_axes, m_axes, n_axes, scattered, on_m), idx in groups.items():
        rest = tuple(a for a in shard if a not in k_axes + m_axes + n_axes)
        rest_op = "a2a_m" if (scattered and on_m) else ("a2a_n" if scattered else "split")
        # Minor axes of a matrix dim go first: the replicated axes that 'scatter' appends to
        # it, then the param's own axes; each group is one collective over an axis tuple.
        ops = [Op(axes, e, x) for axes, e, x in ((rest, rest_op, "gather"),
                                                  (m_axes, "a2a_m", "a2a_m"),
                                                  (n_axes, "a2a_n", "a2a_n")) if axes]
        k_local = sum(plans[i].layout.batch // _size(mesh, k_axes) for i in idx)
        factor = _size(mesh, [a for op in ops for a in op.axes])
        stacks.append(StackPlan(m, n, dtype, tuple(idx), k_axes, tuple(ops), k_local,
                                -(-k_local // factor)))
    return Layout(mesh, shard, tuple(plans), tuple(stacks))


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
    """Move gradients (one per Muon leaf) to owner stacks with explicit collectives.

    Per stack and shard axis: reduce-scatter of unreduced partial sums (``psum_scatter``), a
    local slice of replicated gradients, or an all-to-all for matrix-sharded ones.

    Args:
      grads: gradient leaves in ``layout.leaves`` order (unreduced over shard axes allowed).
      layout: from :func:`plan_layout`.

    Returns:
      One ``[N * k_owner, m, n]`` stack per ``layout.stacks``, sharded ``P(owner_axes)``.

    Raises:
      ValueError: naming the leaf when its gradient's explicit sharding differs from the plan.

    Example:
      >>> stacks = to_owners(jax.tree.leaves(grads), layout)

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
        return tuple(
            _entry_stack(s, [_dims.to_matrices(blocks[i], local[i]) for i in s.leaves], u, layout)
            for s, u in zip(layout.stacks, per_stack_u, strict=True)
        )

    out_specs = tuple(layout.owner_spec(s) for s in layout.stacks)
    return _shard_map(entry, layout, tuple(in_specs), out_specs)(*placed)


def _entry_stack(
    s: StackPlan, mats: list[jax.Array], u: frozenset[str], layout: Layout
) -> jax.Array:
    """Device-local: stack, pad, then reduce-scatter / slice / all-to-all into owner blocks."""
    mesh = layout.mesh
    x = jnp.concatenate(mats, axis=0) if len(mats) > 1 else mats[0]
    extra = tuple(a for a in mesh.axis_names if a in u and a not in layout.shard_axes)
    if extra:  # unreduced over an axis that does not shard the stacks: plain all-reduce
        x = jax.lax.psum(x, extra)
    pad = s.k_owner * _size(mesh, [a for op in s.ops for a in op.axes]) - x.shape[0]
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0), (0, 0)))
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
    stacks: Sequence[Sequence[jax.Array]],
    scalars: Sequence[jax.Array] = (),
) -> list[tuple[jax.Array, ...]]:
    """Apply ``fn`` to each stack's owner blocks, device-locally (no collectives).

    ``fn(stack_plan, blocks, scalars) -> tuple of blocks`` runs under ``jax.shard_map`` with
    ``in_specs = out_specs = P(owner_axes)`` (scalars replicated), so each device computes on
    its ``k_owner`` whole matrices only.

    Args:
      fn: the per-device computation (e.g. momentum + Newton-Schulz).
      layout: from :func:`plan_layout`.
      stacks: per stack, a sequence of owner stacks (e.g. gradient, momentum).
      scalars: replicated scalars passed to ``fn`` (e.g. the step count).

    Returns:
      Per stack, the tuple of owner stacks ``fn`` returned.

    Example:
      >>> owner_map(lambda s, b, c: (b[0] * 2,), layout, [(g,) for g in owner_grads])

    References:
      ZeRO (Rajbhandari et al., 2020).
    """
    stacks = [tuple(a) for a in stacks]
    counts = [len(a) for a in stacks]
    flat = [a for arrays in stacks for a in arrays]

    def body(*args):
        res, start = [], 0
        blocks, sc = args[: len(flat)], args[len(flat):]
        for s, n in zip(layout.stacks, counts, strict=True):
            res.append(tuple(fn(s, blocks[start: start + n], sc)))
            start += n
        return tuple(res)

    local = [jax.ShapeDtypeStruct((s.k_owner, s.m, s.n), a.dtype)
             for s, arrays in zip(layout.stacks, stacks, strict=True) for a in arrays]
    local += [jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)) for c in scalars]
    shapes = jax.eval_shape(body, *local)
    specs = [layout.owner_spec(s) for s in layout.stacks]
    in_specs = tuple(sp for sp, n in zip(specs, counts, strict=True) for _ in range(n))
    out_specs = tuple((sp,) * len(r) for sp, r in zip(specs, shapes, strict=True))
    f = _shard_map(body, layout, in_specs + (P(),) * len(scalars), out_specs)
    return list(f(*flat, *scalars))


def from_owners(
    owner_stacks: Sequence[jax.Array], layout: Layout, *, param_specs: Sequence[P] | None = None
) -> list[jax.Array]:
    """Return owner stacks to leaves with exactly the params' shardings.

    Per op in reverse: all-gather of the stack axis where the param is replicated, the inverse
    all-to-all where it is sharded along a matrix axis; then unpad and unstack.

    Args:
      owner_stacks: one ``[N * k_owner, m, n]`` stack per ``layout.stacks``.
      layout: from :func:`plan_layout`.
      param_specs: per leaf, the params' current PartitionSpec when it carries ``reduced`` axes
        (the updates are cast to it); None: the plan's specs.

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
        out: list[Any] = [None] * len(layout.leaves)
        for s, y in zip(layout.stacks, ys, strict=True):
            for op in reversed(s.ops):
                if op.exit == "gather":
                    y = jax.lax.all_gather(y, op.axes, axis=0, tiled=True)
                else:
                    y = jax.lax.all_to_all(
                        y, op.axes, 1 if op.exit == "a2a_m" else 2, 0, tiled=True
                    )
            start = 0
            for i in s.leaves:
                out[i] = _dims.from_matrices(y[start: start + local[i].batch], local[i])
                start += local[i].batch
        return tuple(out)

    in_specs = tuple(layout.owner_spec(s) for s in layout.stacks)
    out_specs = tuple(_pspec(leaf.spec) for leaf in layout.leaves)
    out = list(_shard_map(exit_fn, layout, in_specs, out_specs, check_vma=False)(*owner_stacks))
    if param_specs is not None:
        out = [
            _constrain(u, spec, mesh) if spec is not None and spec.reduced else u
            for u, spec in zip(out, param_specs, strict=True)
        ]
    return out
