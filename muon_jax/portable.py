"""Mesh-independent checkpoints of sharded Muon state.

:class:`muon_jax.ShardedMuonState` keeps momentum in owner stacks ``[N * k_owner, m, n]`` whose
row order depends on the mesh: with two or more leaves sharded along their batch axis in one
stack (e.g. the expert banks of two MoE layers), each device joins its local blocks before the
split, so row ``k`` on mesh ``(8,)`` is not row ``k`` on ``(2, 4)``. Restoring raw owner stacks
onto another mesh hands momenta to the wrong matrices, silently.

:func:`portable_state` replaces every ``ShardedMuonState`` in an optimizer state by a
:class:`PortableMuonState`: the momentum of each Muon leaf in its *param's* shape and sharding
(the exit collectives of an update: all-gather of the stack axis where the param is replicated,
the inverse all-to-all where it is sharded; nothing lands on one device). That form means the
same on every mesh; save it with orbax, restore it with :func:`portable_target` as the abstract
target, and put it into the new mesh's owner blocks with :func:`restore_state` (the entry
collectives: a local slice where the param is replicated, an all-to-all where it is sharded).

Raw owner stacks can still be saved; :func:`plan_fingerprint` gives, per stack row, which
matrix it holds (a few bytes per matrix, host-side), and :func:`check_state` raises when a raw
state restored onto a new owner plan holds its rows in another order.

Example (orbax)::

    ckpt.save(path, {'params': params, 'opt': portable_state(opt_state)})
    # ... later, on any mesh, with opt_state = tx.init(params_on_new_mesh):
    target = {'params': abstract_params, 'opt': portable_target(opt_state)}
    restored = ckpt.restore(path, target)
    opt_state = restore_state(restored['opt'], opt_state)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding

from muon_jax import owner_plan, owners
from muon_jax.sharded_step import ShardedMuonState

__all__ = [
    "PortableMuonState",
    "check_state",
    "plan_fingerprint",
    "portable_state",
    "portable_target",
    "restore_state",
]


class PortableMuonState(NamedTuple):
    """Sharded Muon state in the params' shapes and shardings: the same on every mesh.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from muon_jax import MuonDimensionNumbers, ShardingOptions, scale_by_muon
      >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
      >>> tx = scale_by_muon(sharding=ShardingOptions(mesh),
      ...                    dimension_numbers=MuonDimensionNumbers(1, 2))  # a stack of 8
      >>> state = portable_state(tx.init({'w': jnp.ones((8, 4, 8))}))
      >>> type(state).__name__, [m.shape for m in state.mu]
      ('PortableMuonState', [(8, 4, 8)])
    """

    count: jax.Array  # int32 scalar: number of updates so far
    mu: tuple[jax.Array, ...]  # per Muon leaf (plan.leaves order), its param's shape/sharding


def _is_muon(x: Any) -> bool:
    """Whether ``x`` is a sharded or portable Muon state."""
    return isinstance(x, ShardedMuonState | PortableMuonState)


def _value(x: Any) -> Any:
    """The array inside ``x`` (itself, or the one leaf of a wrapper such as an nnx Variable)."""
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray):
        return x
    leaves = jax.tree.leaves(x)
    if len(leaves) != 1:
        raise TypeError(f"expected an array or a one-array wrapper, got {type(x).__name__}.")
    return leaves[0]


def _like(template: Any, value: Any) -> Any:
    """``value`` wrapped as ``template`` is (nnx ``Variable`` etc.), or bare."""
    if isinstance(template, jax.Array | jax.ShapeDtypeStruct | np.ndarray):
        return value
    return jax.tree.unflatten(jax.tree.structure(template), [value])


def _leaf_stacks(plan: Any) -> list[int]:
    """Per Muon leaf, the index of its stack."""
    out = [0] * len(plan.leaves)
    for si, s in enumerate(plan.stacks):
        for i in s.leaves:
            out[i] = si
    return out


def portable_state(opt_state: Any) -> Any:
    """Replace each ShardedMuonState in ``opt_state`` by its momentum in the params' shardings.

    For every ``ShardedMuonState`` (anywhere in an ``optax.chain`` / ``optax.partition`` /
    ``nnx.Optimizer`` state): ``mu_leaf = from_owners(mu_stacks)``, i.e. the collectives that
    return Muon's updates (all-gather of the stack axis where the param is replicated, the
    inverse all-to-all where it is sharded): every leaf gets its param's shape and sharding, no
    array is gathered onto one device. Bitwise exact (data movement only). ``MuonState`` and
    other states pass through. Jittable.

    Args:
      opt_state: an optimizer state tree.

    Returns:
      The same tree with each ``ShardedMuonState`` replaced by a :class:`PortableMuonState`
      (``count``, and ``mu``: one array per Muon leaf in ``plan.leaves`` order, i.e. the
      order of ``jax.tree.leaves`` of the Muon params), which means the same on every mesh.

    >>> from muon_jax import MuonDimensionNumbers, ShardingOptions, scale_by_muon
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> stack = MuonDimensionNumbers(1, 2)  # 'w' is 4 matrices [8, 8]
    >>> params = jax.device_put({'w': np.ones((4, 8, 8), np.float32)}, NamedSharding(mesh, jax.P()))
    >>> state = scale_by_muon(sharding=ShardingOptions(mesh), dimension_numbers=stack).init(params)
    >>> portable = portable_state(state)  # e.g. orbax: ckpt.save(path, portable)
    >>> type(portable).__name__, [m.shape for m in portable.mu]
    ('PortableMuonState', [(4, 8, 8)])
    """

    def one(x):
        if not isinstance(x, ShardedMuonState):
            return x
        plan = x.plan
        stacks = tuple(_value(m) for m in x.mu)
        if len(stacks) != len(plan.stacks):
            raise ValueError(
                f"ShardedMuonState has {len(stacks)} momentum stacks, its owner plan "
                f"{len(plan.stacks)}; pass a state made by scale_by_muon."
            )
        leaves = owners.from_owners(owners.split_chunks(stacks, plan), plan)
        return PortableMuonState(count=x.count, mu=tuple(leaves))

    return jax.tree.map(one, opt_state, is_leaf=_is_muon)


def restore_state(portable: Any, template: Any) -> Any:
    """Put a portable state into the owner blocks of ``template`` (e.g. on a new mesh).

    Inverse of :func:`portable_state` for the template's owner plans: for each
    ``ShardedMuonState`` of ``template``, ``mu_stacks = to_owners(portable.mu)`` (a local slice
    of the stack axis where the param is replicated, an all-to-all where it is sharded), cast to
    the template's momentum dtype; every other leaf comes from ``portable``. Jittable.

    Args:
      portable: a tree from :func:`portable_state` (e.g. restored by orbax with
        :func:`portable_target` as target), saved on any mesh.
      template: the optimizer state on the destination mesh, e.g. ``tx.init(params)`` with
        params placed as in training; only its structure, plans and dtypes are used (its
        leaves may be ``jax.ShapeDtypeStruct``).

    Returns:
      An optimizer state shaped like ``template``: ``ShardedMuonState`` with the template's
      plan and momentum sharded ``P(owner_axes)``, other leaves from ``portable``.

    Raises:
      ValueError: naming the leaf when the portable momentum does not fit the template's
        Muon leaves (another model), or a ``ShardedMuonState`` meets no portable state.

    >>> from muon_jax import MuonDimensionNumbers, ShardingOptions, scale_by_muon
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> stack = MuonDimensionNumbers(1, 2)  # 'w' is 4 matrices [8, 8]
    >>> params = jax.device_put({'w': np.ones((4, 8, 8), np.float32)}, NamedSharding(mesh, jax.P()))
    >>> tx = scale_by_muon(sharding=ShardingOptions(mesh), dimension_numbers=stack)
    >>> _, state = jax.jit(tx.update)(params, tx.init(params))
    >>> back = restore_state(portable_state(state), tx.init(params))  # any mesh
    >>> bool((back.mu[0] == state.mu[0]).all()), int(back.count)
    (True, 1)
    """

    def one(t, p):
        if not isinstance(t, ShardedMuonState):
            return p
        if not isinstance(p, PortableMuonState):
            raise ValueError(
                f"restore_state: the template holds a ShardedMuonState where the portable tree "
                f"holds {type(p).__name__}; pass portable_state(...) of the same optimizer."
            )
        plan = t.plan
        mus = tuple(_value(m) for m in p.mu)
        if len(mus) != len(plan.leaves):
            raise ValueError(
                f"restore_state: {len(mus)} portable momentum leaves for {len(plan.leaves)} "
                "Muon leaves in the template; save and restore the same model."
            )
        for m, leaf in zip(mus, plan.leaves, strict=True):
            if tuple(m.shape) != leaf.shape:
                raise ValueError(
                    f"restore_state: momentum of leaf {leaf.path!r} has shape {tuple(m.shape)}, "
                    f"the template's param {leaf.shape}; save and restore the same model."
                )
        stacks = owners.join_chunks(owners.to_owners(list(mus), plan), plan)
        mu = tuple(
            _like(tm, s.astype(_value(tm).dtype)) for tm, s in zip(t.mu, stacks, strict=True)
        )
        return ShardedMuonState(count=_like(t.count, _value(p.count)), mu=mu, plan=plan)

    return jax.tree.map(one, template, portable, is_leaf=_is_muon)


def _abstract(x: Any) -> Any:
    """``x`` as a ShapeDtypeStruct with its sharding."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def portable_target(template: Any) -> Any:
    """Abstract portable state for ``template``'s mesh: the target of an orbax restore.

    ``jax.ShapeDtypeStruct`` per leaf of ``portable_state(template)``, with the destination
    shardings (each momentum leaf sharded like its param), computed without touching data, so
    orbax reads every shard straight onto its device.

    Args:
      template: the optimizer state on the destination mesh (arrays or ShapeDtypeStructs
        carrying shardings).

    Returns:
      A tree of ``jax.ShapeDtypeStruct`` shaped like ``portable_state(template)``.

    >>> from muon_jax import MuonDimensionNumbers, ShardingOptions, scale_by_muon
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> stack = MuonDimensionNumbers(1, 2)  # 'w' is 4 matrices [8, 8]
    >>> params = jax.device_put({'w': np.ones((4, 8, 8), np.float32)}, NamedSharding(mesh, jax.P()))
    >>> tx = scale_by_muon(sharding=ShardingOptions(mesh), dimension_numbers=stack)
    >>> target = portable_target(tx.init(params))
    >>> target.mu[0].shape, target.mu[0].sharding.spec == jax.P()  # ckpt.restore(path, target)
    ((4, 8, 8), True)
    """

    def one(x):
        if not isinstance(x, ShardedMuonState):
            return jax.tree.map(_abstract, x)
        plan = x.plan
        mus = [_value(m) for m in x.mu]
        mesh = plan.mesh
        sharding = getattr(mus[0], "sharding", None) if mus else None
        if isinstance(sharding, NamedSharding):
            mesh = sharding.mesh  # concrete even when the plan holds an AbstractMesh
        where = _leaf_stacks(plan)
        mu = tuple(
            jax.ShapeDtypeStruct(leaf.shape, mus[where[i]].dtype,
                                 sharding=NamedSharding(mesh, owners.partition_spec(leaf.spec)))
            for i, leaf in enumerate(plan.leaves)
        )
        return PortableMuonState(count=_like(x.count, _abstract(_value(x.count))), mu=mu)

    return jax.tree.map(one, template, is_leaf=_is_muon)


def _owner_rows(plan: Any) -> tuple[np.ndarray, ...]:
    """Per stack, the matrix each owner row holds (index over all Muon matrices; -1: padding)."""
    offsets = np.cumsum([0] + [leaf.view.batch for leaf in plan.leaves])
    out = []
    for s in plan.stacks:
        kk = math.prod(plan.mesh.shape[a] for a in s.k_axes)
        f = math.prod(plan.mesh.shape[a] for op in s.ops for a in op.axes)
        local = np.full((kk, f * s.k_owner), -1, np.int32)  # per row of each local stack
        for q in range(kk):
            r = 0
            for i in s.leaves:
                b = plan.leaves[i].view.batch // kk
                local[q, r: r + b] = offsets[i] + q * b + np.arange(b)
                r += b
        out.append(local[:, owner_plan.owner_rows(s, f)].reshape(-1))
    return tuple(out)


def _matrix_name(plan: Any, index: int) -> str:
    """``'path[j]'`` for a global matrix index of :func:`_owner_rows` (or ``'padding'``)."""
    starts = np.cumsum([0] + [leaf.view.batch for leaf in plan.leaves])
    i = int(np.searchsorted(starts, index, side="right")) - 1
    if index < 0 or i >= len(plan.leaves):
        return "padding" if index < 0 else f"matrix {index}"
    return f"{plan.leaves[i].path}[{index - starts[i]}]"


def plan_fingerprint(opt_state: Any) -> tuple[tuple[np.ndarray, ...], ...]:
    """Which matrix each owner-stack row holds, per ShardedMuonState (host-side, tiny).

    Row ``g`` of stack ``s`` holds matrix ``rows[s][g]`` of the concatenation, in
    ``plan.leaves`` order, of every Muon leaf's ``[B, m, n]`` view (``-1``: padding). Two
    owner plans keep raw momentum stacks interchangeable iff their fingerprints are equal. Save it
    next to raw (non-portable) states and pass it to :func:`check_state` after restoring.

    Args:
      opt_state: an optimizer state tree (arrays or ShapeDtypeStructs; only plans are read).

    Returns:
      Per ``ShardedMuonState`` in tree order, a tuple of int32 numpy arrays
      ``[N * k_owner]``, one per stack.

    >>> from muon_jax import MuonDimensionNumbers, ShardingOptions, scale_by_muon
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> stack = MuonDimensionNumbers(1, 2)  # 'w' is 4 matrices [8, 8]
    >>> params = jax.device_put({'w': np.ones((4, 8, 8), np.float32)}, NamedSharding(mesh, jax.P()))
    >>> tx = scale_by_muon(sharding=ShardingOptions(mesh), dimension_numbers=stack)
    >>> (rows,), = plan_fingerprint(tx.init(params))
    >>> rows[rows >= 0].tolist()  # e.g. ckpt.save(path, {'opt': state, 'rows': ...})
    [0, 1, 2, 3]
    """
    states = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_muon)
              if isinstance(x, ShardedMuonState)]
    return tuple(_owner_rows(s.plan) for s in states)


def check_state(opt_state: Any, fingerprint: Any) -> None:
    """Raise if raw owner stacks were saved in another row order than ``opt_state``'s plans.

    Compares ``fingerprint`` (saved with the state, from :func:`plan_fingerprint`) with the
    fingerprint of the owner plans in ``opt_state`` (e.g. the state restored onto a new mesh).

    Args:
      opt_state: the restored optimizer state (its plans are those of the new mesh).
      fingerprint: :func:`plan_fingerprint` of the state when it was saved.

    Returns:
      None.

    Raises:
      ValueError: naming the stack and the first row that holds another matrix, with the fix
        (checkpoint :func:`portable_state` and restore with :func:`restore_state`).

    >>> from muon_jax import MuonDimensionNumbers, ShardingOptions, scale_by_muon
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> stack = MuonDimensionNumbers(1, 2)  # 'w' is 4 matrices [8, 8]
    >>> params = jax.device_put({'w': np.ones((4, 8, 8), np.float32)}, NamedSharding(mesh, jax.P()))
    >>> state = scale_by_muon(sharding=ShardingOptions(mesh), dimension_numbers=stack).init(params)
    >>> check_state(state, plan_fingerprint(state))  # passes: same owner plan
    >>> check_state(state, ((np.arange(8)[::-1],),))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: check_state: Muon state 0, stack 0 [8x8] of ['w']: ...
    """
    want = plan_fingerprint(opt_state)
    got = tuple(tuple(np.asarray(r) for r in per) for per in fingerprint)
    fix = ("raw Muon owner stacks are mesh-specific; checkpoint muon_jax.portable_state("
           "opt_state) and restore with muon_jax.restore_state(restored, template).")
    if len(got) != len(want):
        raise ValueError(
            f"check_state: the fingerprint has {len(got)} sharded Muon states, the optimizer "
            f"state {len(want)}; {fix}"
        )
    states = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_muon)
              if isinstance(x, ShardedMuonState)]
    for k, (g, w, st) in enumerate(zip(got, want, states, strict=True)):
        if len(g) != len(w):
            raise ValueError(f"check_state: Muon state {k} has {len(w)} stacks, the saved one "
                             f"{len(g)}; {fix}")
        for si, (gr, wr) in enumerate(zip(g, w, strict=True)):
            if gr.shape == wr.shape and np.array_equal(gr, wr):
                continue
            s = st.plan.stacks[si]
            names = [st.plan.leaves[i].path for i in s.leaves]
            if gr.shape != wr.shape:
                detail = f"{gr.shape[0]} saved rows vs {wr.shape[0]}"
            else:
                r = int(np.flatnonzero(gr != wr)[0])
                detail = (f"row {r} holds {_matrix_name(st.plan, int(gr[r]))} in the "
                          f"checkpoint but {_matrix_name(st.plan, int(wr[r]))} here")
            raise ValueError(
                f"check_state: Muon state {k}, stack {si} [{s.m}x{s.n}] of {names}: {detail} "
                f"(saved on another mesh or owner plan); {fix}"
            )
