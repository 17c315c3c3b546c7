"""The dispatch plans' builders: sort the slots by expert, count them, exchange the counts.

One builder per transport (:func:`dense_plan`, :func:`ragged_plan`, :func:`dropless_plan`,
chosen by :func:`build_plan`), sharing the sort and the counts (:func:`sort_slots`,
:func:`count_slots`, :func:`gather_counts`); the slot splits (:func:`split_first_bucket`,
:func:`split_local`) and the plans of the pipelined layer's chunks (:func:`chunk_plans`). The
plan types and their static sizes are :mod:`moe.dispatch.plan`.

Work: one int32 sort of ``S = T * k`` packed keys (:func:`sort_slots`), one scatter of ``S``
int32 (each slot's row), a gather of ``N`` int32 (each row's slot, dense and dropless),
``O(R * E_local)`` int32 compares (dropless: the expert layout's rows against the slice
starts) and ``O(P * E)`` count arithmetic; no pass over the token rows. With ``P = 1`` no
collective runs.

References: DeepEP (counts exchanged before the payload); GShard / Switch Transformer
(capacity rule, slots ranked in (t, j) order within each expert).
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from accel_kernels.gmm import api as gmm_api
from moe.dispatch.plan import (
    AxisName,
    DensePlan,
    DispatchPlan,
    DroplessPlan,
    LayerSizes,
    PlanTransport,
    RaggedPlan,
    TwoStagePlan,
    TwoStageSizes,
)
from moe.options import ResolvedOptions

__all__ = ["BucketSplit", "ChunkPlans", "CountedSlots", "GatheredCounts", "LocalPass",
           "LocalSplit", "PlanStatics", "SortedSlots", "build_plan", "chunk_plans",
           "count_slots", "dense_plan", "dropless_plan", "gather_counts", "host_columns",
           "layer_statics", "ragged_plan", "sort_slots", "split_first_bucket", "split_local",
           "split_two_stage", "two_stage_plan"]


class SortedSlots(NamedTuple):
    """Slots sorted by (expert, slot): int32 ``[S]`` each."""

    order: jax.Array  # slot ids by (expert, slot)
    expert: jax.Array  # the expert of each sorted slot, ``flat[order]``


class CountedSlots(NamedTuple):
    """This device's slots sorted and counted by global expert (:func:`count_slots`)."""

    order: jax.Array  # int32 [S]: slot ids by (expert, t, j)
    expert: jax.Array  # int32 [S]: the expert of each sorted slot
    send_counts: jax.Array  # int32 [E]: slots per global expert
    starts: jax.Array  # int32 [E]: first sorted position of each expert
    rank: jax.Array  # int32 [S]: position of each sorted slot within its expert


class GatheredCounts(NamedTuple):
    """What the all-gathered counts give the ragged layout (:func:`gather_counts`)."""

    counts: jax.Array  # int32 [P src, E]: every device's send_counts
    at_owner: jax.Array  # int32 [src, owner, E_local]: row on owner of the (src, l) slice
    recv_counts: jax.Array  # int32 [P src, E_local]: rows each source sends here
    group_sizes: jax.Array  # int32 [E_local]: rows per local expert
    recv_offsets: jax.Array  # int32 [P src, E_local]: layout row of each received slice
    me: jax.Array | int  # this device's index on the expert axis


class PairRows(NamedTuple):
    """The dropless plan's row maps (see :class:`moe.dispatch.plan.DroplessPlan`)."""

    send_slot: jax.Array
    slot_row: jax.Array  # flat [S]
    layout_row: jax.Array
    pair_row: jax.Array
    bucket: jax.Array


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def sort_slots(flat: jax.Array, num_experts: int) -> SortedSlots:
    """Slots sorted by (expert, slot): ``(order, expert)``, both int32 ``[S]``.

    One single-operand sort of the packed key ``expert * S + slot`` (unique keys, so no
    stability is needed, and the slot and expert come back by ``%`` and ``//``): half the bytes
    of a stable key/index argsort, and on GPU a plain radix sort of int32 keys. Falls back to
    the stable argsort when ``num_experts * S`` does not fit in int32.

    Args:
      flat: int32 ``[S]`` expert id of every slot, in ``[0, num_experts)``.
      num_experts: ``E``.

    Returns:
      ``order`` (slot ids by (expert, slot)) and ``expert`` (``flat[order]``).

    Example:
      >>> sort_slots(jnp.array([2, 0, 2, 1], jnp.int32), 3).order.tolist()
      [1, 3, 0, 2]

    References:
      GShard / Switch Transformer (slots ranked in (t, j) order within each expert).
    """
    s = flat.shape[0]
    if num_experts * s < 2**31:
        key = jnp.sort(flat * s + jnp.arange(s, dtype=jnp.int32), stable=False)
        return SortedSlots(key % s, key // s)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    return SortedSlots(order, flat[order])


def count_slots(expert_ids: jax.Array, num_experts: int) -> CountedSlots:
    """The slots of ``expert_ids [T, k]`` sorted by (expert, t, j) and counted per expert.

    ``send_counts[e] = #{s : flat[s] = e}``, ``starts`` its exclusive cumsum and ``rank[i] = i -
    starts[expert[i]]``.

    Example:
      >>> count_slots(jnp.array([[2, 0], [2, 1]]), 3).rank.tolist()
      [0, 0, 0, 1]
    """
    s = expert_ids.size
    flat = expert_ids.reshape(s).astype(jnp.int32)
    order, e_sorted = sort_slots(flat, num_experts)
    send_counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    starts = _exclusive_cumsum(send_counts, 0)
    rank = jnp.arange(s, dtype=jnp.int32) - starts[e_sorted]
    return CountedSlots(order, e_sorted, send_counts, starts, rank)


def gather_counts(send_counts: jax.Array, axis_name: AxisName, p: int) -> GatheredCounts:
    """All-gather every device's ``send_counts`` and place the ragged layout's slices.

    The layout on owner ``o`` holds local expert ``l``'s rows from source 0, 1, ...; slice
    ``(src, l)`` starts at ``sum_{l' < l} totals[o, l'] + sum_{src' < src} counts[src', o, l]``.
    No collective when ``P = 1``.
    """
    e_local = send_counts.shape[0] // p
    me = jax.lax.axis_index(axis_name) if p > 1 else 0
    counts = send_counts[None] if p == 1 else jax.lax.all_gather(send_counts, axis_name, axis=0)
    by_owner = counts.reshape(p, p, e_local)  # [src, owner, local expert]
    totals = by_owner.sum(axis=0)  # [owner, local expert]
    group_start = _exclusive_cumsum(totals, 1)  # [owner, l]
    before_src = _exclusive_cumsum(by_owner, 0)  # [src, owner, l]
    at_owner = group_start[None] + before_src  # row on owner of (src, l) slice
    return GatheredCounts(
        counts=counts, at_owner=at_owner,
        recv_counts=jnp.take(by_owner, me, axis=1),  # [P, E_local]
        group_sizes=jnp.take(totals, me, axis=0),
        recv_offsets=jnp.take(at_owner, me, axis=1),  # [P src, E_local]
        me=me)


def _last_at_most(starts: jax.Array, x: jax.Array) -> jax.Array:
    """Index of the last entry of the nondecreasing ``starts [..., n]`` that is ``<= x [...,
    m]``, shape ``[..., m]`` (a compare against every start: ``n`` is a few experts)."""
    return jnp.sum(starts[..., None, :] <= x[..., :, None], axis=-1, dtype=jnp.int32) - 1


def _slot_rows(order: jax.Array, row_sorted: jax.Array) -> jax.Array:
    """int32 ``[S]``: the row of each slot, from the row of each sorted slot."""
    return jnp.zeros(order.shape, jnp.int32).at[order].set(row_sorted, unique_indices=True)


class PlanStatics(NamedTuple):
    """The static fields every plan holds (:class:`moe.dispatch.plan.PlanBase`): what its
    builder is told, the same for the three transports."""

    num_experts: int  # E, global
    axis_name: AxisName  # the expert axis (or axes; () for a pass over no axis)
    axis_size: int  # P
    x_dtype: str  # dtype name of the dispatched tokens
    block_size: int  # channels per FP8 scale
    wire_implementation: str = "xla"  # the wire kernels (accel_kernels.wire.api)


def layer_statics(options: ResolvedOptions, x_dtype) -> PlanStatics:
    """The static fields of the MoE layer's plans over its expert axis, for tokens of
    ``x_dtype``."""
    return PlanStatics(options.num_slots, options.dispatch.expert_axis,
                       options.expert_axis_size, jnp.dtype(x_dtype).name,
                       options.fp8_block_size, options.dispatch.wire_implementation)


def dense_plan(expert_ids: jax.Array, statics: PlanStatics, *, capacity: int) -> DensePlan:
    """The :class:`moe.dispatch.plan.DensePlan` of ``expert_ids [T, k]``: keep the first
    ``capacity``.

    ``kept[t, j] = rank of (t, j) among this device's slots of its expert < capacity``, slots
    ranked in (t, j) order; one all-to-all of the counts (none when ``P = 1``).

    Args:
      expert_ids: int ``[T, k]`` global expert ids in ``[0, num_experts)``.
      statics: the plan's static fields (already validated by ``dispatch``).
      capacity: ``C``, rows per (source, expert).

    Returns:
      The plan.

    Example:
      >>> # inside shard_map: dense_plan(ids, PlanStatics(8, 'expert', 4, 'bfloat16', 128),
      >>> #                              capacity=16)
    """
    t, k = expert_ids.shape
    s, p, c, e = t * k, statics.axis_size, capacity, statics.num_experts
    sl = count_slots(expert_ids, e)
    n = e * c
    slot_row = _slot_rows(sl.order, jnp.where(sl.rank < c, sl.expert * c + sl.rank, n))
    r = jnp.arange(c, dtype=jnp.int32)[None, :]
    src = jnp.minimum(sl.starts[:, None] + r, s - 1)
    send_slot = jnp.where(r < sl.send_counts[:, None], sl.order[src], s).reshape(n)
    recv_counts = sl.send_counts
    if p > 1:
        recv_counts = jax.lax.all_to_all(sl.send_counts, statics.axis_name, 0, 0, tiled=True)
    recv_counts = recv_counts.reshape(p, e // p)
    return DensePlan(
        send_slot=send_slot, slot_row=slot_row.reshape(t, k), send_counts=sl.send_counts,
        recv_counts=recv_counts,
        group_sizes=jnp.minimum(recv_counts, c).sum(axis=0).astype(jnp.int32),
        dropped=jnp.maximum(sl.send_counts - c, 0).sum().astype(jnp.int32),
        **statics._asdict(), capacity=capacity)


def ragged_plan(expert_ids: jax.Array, statics: PlanStatics, *,
                exchange_implementation: Literal["native", "emulated"]) -> RaggedPlan:
    """The :class:`moe.dispatch.plan.RaggedPlan` of ``expert_ids [T, k]``: every slot, sorted.

    The send buffer is the sorted slots; the offsets of each (source, expert) slice on both
    sides come from the all-gathered counts (none gathered when ``P = 1``).

    Args:
      expert_ids: int ``[T, k]`` global expert ids in ``[0, num_experts)``.
      statics: the plan's static fields (already validated by ``dispatch``).
      exchange_implementation: ``'native'`` or ``'emulated'`` ``ragged_all_to_all``.

    Returns:
      The plan.

    Example:
      >>> # inside shard_map: ragged_plan(ids, statics, exchange_implementation='native')
    """
    t, k = expert_ids.shape
    s, p, e = t * k, statics.axis_size, statics.num_experts
    sl = count_slots(expert_ids, e)
    g = gather_counts(sl.send_counts, statics.axis_name, p)
    src_starts = _exclusive_cumsum(g.counts, 1).reshape(p, p, e // p)
    return RaggedPlan(
        send_slot=sl.order,
        slot_row=_slot_rows(sl.order, jnp.arange(s, dtype=jnp.int32)).reshape(t, k),
        send_counts=sl.send_counts, recv_counts=g.recv_counts,
        group_sizes=g.group_sizes.astype(jnp.int32),
        send_offsets=sl.starts,
        remote_offsets=jnp.take(g.at_owner, g.me, axis=0).reshape(e),
        recv_offsets=g.recv_offsets.reshape(e),
        return_offsets=jnp.take(src_starts, g.me, axis=1).reshape(e),
        **statics._asdict(), exchange_implementation=exchange_implementation)


def dropless_plan(expert_ids: jax.Array, statics: PlanStatics, *, buckets: tuple[int, ...],
                  alignment: int = 1) -> DroplessPlan:
    """The :class:`moe.dispatch.plan.DroplessPlan` of ``expert_ids [T, k]``: every slot, in pairs.

    Also picks the exchange bucket: the smallest of ``buckets`` that holds the fullest
    (source, destination) pair of the all-gathered counts, the same on every device of the
    axis (none gathered when ``P = 1``).

    Args:
      expert_ids: int ``[T, k]`` global expert ids in ``[0, num_experts)``.
      statics: the plan's static fields (already validated by ``dispatch``).
      buckets, alignment: see :class:`moe.dispatch.plan.DroplessPlan` (one device: ``(W,)``,
        whatever is passed).

    Returns:
      The plan.

    Example:
      >>> # inside shard_map: dropless_plan(ids, statics, buckets=(64, 96, 128))
    """
    t, k = expert_ids.shape
    p, e = statics.axis_size, statics.num_experts
    w = t * min(k, e // p)
    buckets = (w,) if p == 1 else tuple(buckets)  # one device: nothing is sent, one bucket
    sl = count_slots(expert_ids, e)
    g = gather_counts(sl.send_counts, statics.axis_name, p)
    rows = _pair_rows(sl, g, p=p, e_local=e // p, w=w, buckets=buckets)
    if alignment > 1:
        rows = _aligned(rows, g.group_sizes, p=p, alignment=alignment)
    return DroplessPlan(
        send_slot=rows.send_slot, slot_row=rows.slot_row.reshape(t, k),
        send_counts=sl.send_counts, recv_counts=g.recv_counts,
        group_sizes=g.group_sizes.astype(jnp.int32),
        layout_row=rows.layout_row, pair_row=rows.pair_row, bucket=rows.bucket,
        **statics._asdict(), buckets=tuple(buckets), alignment=alignment)


def build_plan(expert_ids: jax.Array, statics: PlanStatics, *, transport: PlanTransport,
               capacity: int | None = None, buckets: tuple[int, ...] = (),
               alignment: int = 1,
               exchange_implementation: Literal["native", "emulated"] = "emulated",
               ) -> DispatchPlan:
    """The plan of ``transport`` (decided: never ``'auto'``) for ``expert_ids [T, k]``, its
    sizes given: ``capacity`` for ``'dense'``, ``buckets`` and ``alignment`` for
    ``'dropless'``, ``exchange_implementation`` for ``'ragged'``.

    Example:
      >>> # inside shard_map: build_plan(ids, statics, transport='dense', capacity=16)
    """
    builders = {
        "dense": lambda: dense_plan(expert_ids, statics, capacity=capacity),
        "ragged": lambda: ragged_plan(expert_ids, statics,
                                      exchange_implementation=exchange_implementation),
        "dropless": lambda: dropless_plan(expert_ids, statics, buckets=buckets,
                                          alignment=alignment),
    }
    with jax.named_scope("dispatch_plan"):
        return builders[transport]()


def _pair_rows(sl: CountedSlots, g: GatheredCounts, *, p, e_local, w, buckets) -> PairRows:
    """Pair rows of the dropless plan (see :class:`moe.dispatch.plan.DroplessPlan`)."""
    order = sl.order
    s = order.shape[0]
    n = p * w
    # Source side: sorted slot i goes to device q = e // E_local, row rank-within-q.
    dest_counts = sl.send_counts.reshape(p, e_local).sum(axis=1)
    dest_start = _exclusive_cumsum(dest_counts, 0)
    q = sl.expert // e_local
    slot_row = _slot_rows(order, q * w + jnp.arange(s, dtype=jnp.int32) - dest_start[q])
    r = jnp.arange(w, dtype=jnp.int32)[None, :]
    src = jnp.minimum(dest_start[:, None] + r, s - 1)
    send_slot = jnp.where(r < dest_counts[:, None], order[src], s).reshape(n)
    if p == 1:  # the send buffer is the expert layout: no permutation, one bucket
        none = jnp.zeros((0,), jnp.int32)
        return PairRows(send_slot, slot_row, none, none, jnp.zeros((), jnp.int32))
    recv_counts, recv_offsets = g.recv_counts, g.recv_offsets
    # Expert side: source p's rows arrive sorted by local expert; slice (p, l) starts at
    # local_start[p, l] among them and at recv_offsets[p, l] in the expert layout.
    local_start = _exclusive_cumsum(recv_counts, 1)  # [P, E_local]
    rr = jnp.broadcast_to(r, (p, w))
    lr = _last_at_most(local_start, rr)  # [P, W] local expert of received row (p, r)
    to_layout = (jnp.take_along_axis(recv_offsets, lr, axis=1) + rr
                 - jnp.take_along_axis(local_start, lr, axis=1))
    layout_row = jnp.where(rr < recv_counts.sum(axis=1, keepdims=True), to_layout, n)
    # Inverse: layout row i lies in slice (l, p), slices ordered by l then p.
    i = jnp.arange(n, dtype=jnp.int32)
    lp = _last_at_most(recv_offsets.T.reshape(-1), i)  # index l * P + p
    l_i, p_i = lp // p, lp % p
    from_pair = p_i * w + local_start[p_i, l_i] + i - recv_offsets[p_i, l_i]
    pair_row = jnp.where(i < recv_counts.sum(), from_pair, n)
    # Bucket: the fullest (source, destination) pair, known alike on every device.
    need = g.counts.reshape(p, p, e_local).sum(axis=2).max()
    bucket = jnp.sum(jnp.asarray(buckets, jnp.int32) < need, dtype=jnp.int32)
    return PairRows(send_slot, slot_row, layout_row.reshape(n), pair_row, bucket)


class BucketSplit(NamedTuple):
    """The slots of ``expert_ids`` split at the dropless exchange's first bucket
    (:func:`split_first_bucket`).

    Attributes:
      first_ids: int ``[T, k]``: the slots the first bucket carries; the others (and masked
        slots) are ``num_experts``, no expert.
      overflow_ids: int ``[T, k]``: the other slots; the first bucket's are ``num_experts``.
      overflows: bool ``[]``: this device has a slot past the first bucket (a local flag:
        reduce it over the expert axis before branching on it).
    """

    first_ids: jax.Array
    overflow_ids: jax.Array
    overflows: jax.Array


def split_first_bucket(expert_ids: jax.Array, *, num_experts: int, axis_size: int,
                       first_bucket: int) -> BucketSplit:
    """Split the slots of ``expert_ids [T, k]`` into the first ``first_bucket`` of each
    destination device, in (t, j) order, and the rest.

    ``rank(s) = #{s' < s : dest(s') = dest(s)}`` with ``dest = id // E_local``; a slot is in
    the first bucket iff ``rank < first_bucket``. No destination then gets more than
    ``first_bucket`` first-bucket slots from this device, so a dropless exchange with the one
    bucket ``(first_bucket,)`` carries all of them (no ``lax.switch``), and the rest go by a
    separate pass. The MoE output is a sum over slots, so the two passes add up to the one
    (``moe.layer``'s pipelined dropless layer). A cumulative count over ``[T * k, P]``, no
    sort.

    Args:
      expert_ids: int ``[T, k]`` expert ids in ``[0, num_experts]`` (``num_experts``: masked).
      num_experts: ``E`` (a multiple of ``axis_size``).
      axis_size: devices ``P`` on the expert axis.
      first_bucket: rows per (source, destination) pair of the first bucket.

    Returns:
      A :class:`BucketSplit`.

    Example:
      >>> s = split_first_bucket(jnp.array([[0, 1], [0, 3], [1, 2]]), num_experts=4,
      ...                        axis_size=2, first_bucket=2)
      >>> s.first_ids.tolist(), s.overflow_ids.tolist(), bool(s.overflows)
      ([[0, 1], [4, 3], [4, 2]], [[4, 4], [0, 4], [1, 4]], True)
    """
    t, k = expert_ids.shape
    flat = expert_ids.reshape(t * k).astype(jnp.int32)
    dest = flat // (num_experts // axis_size)  # masked slots: axis_size, no destination
    hot = (dest[:, None] == jnp.arange(axis_size, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    rank = jnp.sum((jnp.cumsum(hot, axis=0) - hot) * hot, axis=1)
    first = rank < first_bucket
    none = jnp.int32(num_experts)
    over = jnp.where(first, none, flat)
    return BucketSplit(jnp.where(first, flat, none).reshape(t, k), over.reshape(t, k),
                       jnp.any(over < none))


def _aligned(rows: PairRows, group_sizes: jax.Array, *, p: int, alignment: int) -> PairRows:
    """The dropless plan's row maps onto the ``alignment``-aligned expert layout: rows of
    the plain layout move to ``dst`` (``accel_kernels.gmm.api.align_map``), the rows between groups
    carry no slot (a zero row), and "no row" stays out of range."""
    s = rows.slot_row.shape[0]
    n = rows.send_slot.shape[0] if p == 1 else rows.pair_row.shape[0]  # plain layout rows
    src, dst, _ = gmm_api.align_map(group_sizes, n, alignment)
    n_al = src.shape[0]

    def moved(r):  # plain-layout row indices (out of range: none) -> aligned
        return jnp.where(r < n, jnp.take(dst, jnp.minimum(r, n - 1)), n_al)

    def pulled(vals, none):  # a value per plain-layout row -> per aligned row
        return jnp.where(src < n, jnp.take(vals, jnp.minimum(src, n - 1)), none)

    if p == 1:  # the send buffer is the layout: its slots move, slots' rows follow
        return rows._replace(send_slot=pulled(rows.send_slot, s),
                             slot_row=moved(rows.slot_row))
    return rows._replace(layout_row=moved(rows.layout_row),
                         pair_row=pulled(rows.pair_row, n))


def host_columns(expert_ids: jax.Array, *, num_experts: int, hosts: int,
                 host_slots: int) -> jax.Array:
    """int32 ``[T, host_slots]``: the hosts holding each token's slots, ascending, then
    ``hosts`` (none). Host ``h`` holds experts ``[h E / H, (h + 1) E / H)``; ``num_experts``
    (a masked slot) is on no host. The caller guarantees no token reaches more than
    ``host_slots`` hosts (`moe.options.hosts_per_token`).

    Example:
      >>> host_columns(jnp.array([[0, 5], [1, 2], [8, 7]]), num_experts=8, hosts=4,
      ...              host_slots=2).tolist()
      [[0, 2], [0, 1], [3, 4]]
    """
    h = expert_ids // (num_experts // hosts)
    present = jnp.any(h[:, :, None] == jnp.arange(hosts, dtype=h.dtype), axis=1)
    key = jnp.where(present, jnp.arange(hosts, dtype=jnp.int32), hosts)
    return jnp.sort(key, axis=1)[:, :host_slots]


def _host_slot_ids(expert_ids: jax.Array, host_ids: jax.Array, *, num_experts: int,
                   hosts: int) -> jax.Array:
    """int32 ``[T, k_1, k]``: for each host column of a token, its ``k`` slots' expert ids
    within that host (``E / H``: a slot on another host, or no host)."""
    per_host = num_experts // hosts
    ids = expert_ids.astype(jnp.int32)
    here = ((ids[:, None, :] // per_host == host_ids[:, :, None])
            & (host_ids[:, :, None] < hosts))
    return jnp.where(here, ids[:, None, :] - host_ids[:, :, None] * per_host, per_host)


def _delivered(expert_ids, host_ids, plan1: DensePlan, kept2: jax.Array, *, num_experts: int,
               host_axis: AxisName) -> jax.Array:
    """bool ``[T, k]``: the slots stage 1 sent (their token's host row kept) and stage 2 kept
    (``kept2 [H C_1, k]`` at the forwarding devices, sent back over ``host_axis``)."""
    hosts = plan1.axis_size
    back = jax.lax.all_to_all(kept2.astype(jnp.int8)[None], host_axis, 1, 1, tiled=True)[0]
    h = expert_ids // (num_experts // hosts)
    kept = jnp.zeros(expert_ids.shape, bool)
    for m in range(host_ids.shape[1]):
        got = jnp.take(back, plan1.slot_row[:, m], axis=0, mode="fill", fill_value=0) > 0
        kept = kept | ((host_ids[:, m:m + 1] == h) & got)
    return kept


def two_stage_plan(expert_ids: jax.Array, statics: PlanStatics, *, host_slots: int,
                   sizes: TwoStageSizes, transport: Literal["dense", "dropless"],
                   alignment: int = 1) -> TwoStagePlan:
    """The :class:`moe.dispatch.plan.TwoStagePlan` of ``expert_ids [T, k]`` over the expert
    axis ``statics.axis_name = (host_axis, *local_axes)``.

    Stage 1: the token's hosts (:func:`host_columns`, ``k_1 = host_slots`` columns) planned
    as a dense exchange over ``host_axis`` with ``C_1 = sizes.first`` tokens per (source,
    host), kept in token order; the local ids of each sent row's slots on its host go with
    the plan (one all-to-all of ``[H C_1, k]`` int32). Stage 2: those rows' slots planned
    over the local axes by ``transport`` (``'dense'``: ``C_2 = sizes.second`` rows per
    (forwarding device, expert), in (source host, token, slot) order; ``'dropless'``: one
    bucket of ``c_2 = sizes.second`` rows per pair, which the caller guarantees holds every
    pair: :func:`split_two_stage`). Dense: the forwarding devices' kept flags come back over
    ``host_axis`` (one all-to-all of ``[H C_1, k]`` bytes) so the source knows its dropped
    slots.

    Example:
      >>> # inside shard_map over ('host', 'local'):
      >>> # two_stage_plan(ids, PlanStatics(8, ('host', 'local'), 8, 'float32', 128),
      >>> #                host_slots=2, sizes=TwoStageSizes(32, 16), transport='dense')
    """
    axes = statics.axis_name
    host_axis, *local = (axes,) if isinstance(axes, str) else axes
    e, hosts = statics.num_experts, jax.lax.axis_size(host_axis)
    host_ids = host_columns(expert_ids, num_experts=e, hosts=hosts, host_slots=host_slots)
    plan1 = dense_plan(host_ids, statics._replace(num_experts=hosts, axis_name=host_axis,
                                                  axis_size=hosts), capacity=sizes.first)
    meta = _host_slot_ids(expert_ids, host_ids, num_experts=e, hosts=hosts)
    meta = jnp.take(meta.reshape(-1, meta.shape[-1]), plan1.send_slot, axis=0, mode="fill",
                    fill_value=e // hosts)
    ids2 = jax.lax.all_to_all(meta, host_axis, 0, 0, tiled=True)
    local_axes = tuple(local)
    s2 = statics._replace(num_experts=e // hosts, axis_name=local_axes,
                          axis_size=statics.axis_size // hosts)
    plan2 = build_plan(ids2, s2, transport=transport, capacity=sizes.second,
                       buckets=(sizes.second,), alignment=alignment)
    routed = expert_ids < e
    if isinstance(plan2, DensePlan):  # the forwarding devices may drop slots
        kept = _delivered(expert_ids, host_ids, plan1, plan2.kept, num_experts=e,
                          host_axis=host_axis) & routed
    else:
        kept = routed
    return TwoStagePlan(plan1, plan2, kept,
                        jnp.sum(routed & ~kept, dtype=jnp.int32))


def split_two_stage(expert_ids: jax.Array, *, num_experts: int, axis_size: int,
                    host_axis: AxisName, sizes: TwoStageSizes) -> BucketSplit:
    """Split the slots of ``expert_ids [T, k]`` into those the dropless two-stage exchange's
    one bucket per stage carries and the rest (the overflow, sent by another pass).

    The devices of ``host_axis`` at this local index forward, each, the slots from all ``H``
    sources of this index to one destination device: a slot's stage-2 rank is its place
    among those, in (source host, token, slot) order, from the all-gathered counts per
    destination (one all-gather over ``host_axis`` of ``[P]`` int32); slots of rank below
    ``c_2 = sizes.second`` are eligible. A token's eligible slots on a host go with it when
    it is among the first ``C_1 = sizes.first`` tokens with eligible slots there. So no
    stage-1 (source, host) pair carries more than ``C_1`` tokens and no stage-2 pair more
    than ``c_2`` rows. A cumulative count over ``[T k, P]`` and one over ``[T, H]``, no sort.

    Args:
      expert_ids: int ``[T, k]`` in ``[0, num_experts]`` (``num_experts``: masked).
      num_experts: ``E``.
      axis_size: devices ``P`` of the expert axis (``host_axis`` first).
      host_axis: the host axis (bound: inside ``jax.shard_map``).
      sizes: the stages' sizes (:func:`moe.dispatch.plan.two_stage_sizes`).

    Returns:
      A :class:`BucketSplit`.

    Example:
      >>> # inside jax.shard_map over ('host', 'local'), as the layer splits its chunks:
      >>> # s = split_two_stage(ids, num_experts=8, axis_size=8, host_axis='host',
      >>> #                     sizes=TwoStageSizes(16, 8))
    """
    t, k = expert_ids.shape
    hosts = jax.lax.axis_size(host_axis)
    flat = expert_ids.reshape(t * k).astype(jnp.int32)
    dest = flat // (num_experts // axis_size)  # masked: axis_size, no destination
    hot = (dest[:, None] == jnp.arange(axis_size, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    gathered = jax.lax.all_gather(jnp.sum(hot, axis=0), host_axis)  # [H, P]
    me = jax.lax.axis_index(host_axis)
    before = jnp.sum(jnp.where(jnp.arange(hosts)[:, None] < me, gathered, 0), axis=0)
    rank = jnp.sum((jnp.cumsum(hot, axis=0) - hot + before[None, :]) * hot, axis=1)
    eligible = ((rank < sizes.second) & (dest < axis_size)).reshape(t, k)
    host = expert_ids.astype(jnp.int32) // (num_experts // hosts)
    on = (host[:, :, None] == jnp.arange(hosts, dtype=jnp.int32)) & eligible[:, :, None]
    has = jnp.any(on, axis=1).astype(jnp.int32)  # [T, H]
    fits = (jnp.cumsum(has, axis=0) - has) < sizes.first
    first = eligible & jnp.take_along_axis(fits, jnp.minimum(host, hosts - 1), axis=1)
    none = jnp.int32(num_experts)
    over = jnp.where(first | (expert_ids >= num_experts), none, expert_ids)
    return BucketSplit(jnp.where(first, expert_ids, none), over, jnp.any(over < none))


class LocalSplit(NamedTuple):
    """What :func:`split_local` returns.

    Attributes:
      local_ids: int ``[T, k]``: the slots this device's own experts take, as local expert
        ids ``[0, E_local)``; ``E_local`` (no expert) for every other slot.
      remote_ids: int ``[T, k]``: the other slots' global ids; ``num_experts`` (no expert) for
        the local ones.
    """

    local_ids: jax.Array
    remote_ids: jax.Array


def split_local(expert_ids: jax.Array, *, num_experts: int, axis_name) -> LocalSplit:
    """Split a chunk's slots into those this device's experts take and those sent away.

    Device ``i`` of ``axis_name`` owns global experts ``[i E_local, (i + 1) E_local)``. Its
    own slots need no exchange: a dispatch over no mesh axis (``axis_name=()``) hands them
    to the local experts while the exchange of the others is in flight (``DispatchOptions
    .local_first``); the layer's output, a sum over slots, is the sum of the two passes.

    Args:
      expert_ids: int ``[T, k]`` global ids in ``[0, num_experts]`` (``num_experts``: no
        expert).
      num_experts: ``E``, a multiple of the axis size.
      axis_name: the expert axis (bound: call inside ``jax.shard_map``).

    Returns:
      A :class:`LocalSplit`.

    Example:
      >>> # inside jax.shard_map over 'expert' (2 devices, 4 experts), on device 1:
      >>> # split_local(jnp.array([[0, 3], [2, 4]]), num_experts=4, axis_name='expert')
      >>> # -> local_ids [[2, 1], [0, 2]], remote_ids [[0, 4], [4, 4]]
    """
    e_local = num_experts // jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name).astype(expert_ids.dtype)
    mine = jax.lax.div(expert_ids, jnp.asarray(e_local, expert_ids.dtype)) == me  # none: P
    return LocalSplit(jnp.where(mine, expert_ids - me * e_local, e_local),
                      jnp.where(mine, num_experts, expert_ids))


class LocalPass(NamedTuple):
    """The first chunk's slots for this device's own experts (``DispatchOptions.local_first``).

    Attributes:
      expert_ids: int ``[T, k]`` local expert ids, ``E_local`` for no expert
        (:func:`split_local`).
      columns: int ``[T, E_local]``: the columns of the ``k`` that the plan carries when
        ``k > E_local`` (a token's distinct experts include at most ``E_local`` of this
        device's: its local slots first, ascending); None: all ``k``.
      plan: their plan, over no mesh axis.
    """

    expert_ids: jax.Array
    columns: jax.Array | None
    plan: DispatchPlan


class ChunkPlans(NamedTuple):
    """The plans of the pipelined layer's chunks (:func:`chunk_plans`).

    Attributes:
      plans: each chunk's dispatch plan.
      expert_ids: each chunk's slots, int ``[T_c, k]``, as its exchange carries them (the
        others, ``num_experts``, go nowhere).
      local: the first chunk's own-expert pass, or None.
      overflow_ids: the pipelined dropless layer's slots past the first bucket, int ``[T,
        k]`` for every chunk, or None (no such split).
      overflows: bool ``[]``: this device has such a slot (a local flag: reduce it over the
        expert axis before branching on it), or None.
    """

    plans: tuple[DispatchPlan, ...]
    expert_ids: tuple[jax.Array, ...]
    local: LocalPass | None
    overflow_ids: jax.Array | None
    overflows: jax.Array | None


def chunk_plans(expert_ids: jax.Array, options: ResolvedOptions, sizes: LayerSizes, *,
                x_dtype) -> ChunkPlans:
    """The plans of the layer's ``options.dispatch.overlap_chunks`` chunks of ``expert_ids``.

    Chunk ``c`` takes rows ``[c T_c, (c + 1) T_c)``. With ``local_first`` (and more than one
    device on the expert axis) the first chunk's own-expert slots go to a pass over no axis
    (:func:`split_local`), planned with the exchange's capacity ``C`` per (source, expert) of
    all ``num_slots`` experts, so it keeps exactly the slots the exchange would have kept.
    Pipelined dropless (several chunks, several buckets): the chunks carry each pair's first
    bucket (:func:`split_first_bucket`; no ``lax.switch`` between them) and the rest is the
    overflow. With two stages (``options.two_stage``) each chunk's plan is a
    :func:`two_stage_plan`; dropless, its slots are split at the stages' one bucket each
    (:func:`split_two_stage`, any chunk count) and the overflow goes by the one-stage
    exchange. Every chunk's plan comes from one batched pass (one sort, one count exchange):
    the plans depend on the routing alone, and per chunk their small, latency-bound kernels
    would be paid once more per chunk.

    Args:
      expert_ids: int ``[T, k]`` this device's slots (``num_slots``: masked, no expert).
      options: the layer's resolved options.
      sizes: a chunk's exchange sizes (:func:`moe.dispatch.plan.layer_sizes` of its tokens).
      x_dtype: the tokens' dtype.

    Returns:
      The :class:`ChunkPlans`.

    Example:
      >>> # inside jax.shard_map over the mesh, as moe.layer plans its chunks:
      >>> # plans = chunk_plans(ids, options, layer_sizes(...), x_dtype=x.dtype)
    """
    chunks, p, slots = options.dispatch.overlap_chunks, options.expert_axis_size, options.num_slots
    k = expert_ids.shape[1]
    (capacity, buckets), two = sizes
    statics = layer_statics(options, x_dtype)
    split, split_fn = chunks > 1 and len(buckets) > 1, None
    if two is not None:
        dispatch = options.dispatch
        split = bool(buckets)  # dropless: each stage's one bucket, the rest overflows
        split_fn = functools.partial(split_two_stage, num_experts=slots, axis_size=p,
                                     host_axis=dispatch.host_axis, sizes=two)

        def plan(ids):
            return two_stage_plan(ids, statics, host_slots=options.host_slots, sizes=two,
                                  transport=dispatch.transport,
                                  alignment=options.group_alignment or 1)
    else:
        if split:
            split_fn = functools.partial(split_first_bucket, num_experts=slots, axis_size=p,
                                         first_bucket=buckets[0])

        def plan(ids):
            return _one_stage(ids, statics, options, capacity,
                              buckets[:1] if split else buckets)

    local_ids, chunk_ids, over_ids, flags = _chunk_ids(expert_ids, options,
                                                       split_fn if split else None)
    if chunks == 1:
        plans = (plan(chunk_ids[0]),)
    else:
        batched = jax.vmap(plan)(jnp.stack(chunk_ids))
        plans = tuple(jax.tree.map(lambda a, c=c: a[c], batched) for c in range(chunks))
    local = None
    if local_ids is not None:
        ids, columns = local_ids, None
        if k > slots // p:
            columns = jnp.argsort(local_ids, axis=1, stable=True)[:, :slots // p]
            ids = jnp.take_along_axis(local_ids, columns, axis=1)
        local = LocalPass(local_ids, columns, _one_stage(ids, statics._replace(
            num_experts=slots // p, axis_name=(), axis_size=1), options, capacity, ()))
    if not split:
        return ChunkPlans(plans, tuple(chunk_ids), local, None, None)
    return ChunkPlans(plans, tuple(chunk_ids), local, jnp.concatenate(over_ids, axis=0),
                      sum(flags[1:], flags[0]))


def _one_stage(ids, statics: PlanStatics, options: ResolvedOptions, capacity, buckets
               ) -> DispatchPlan:
    """The one-stage plan of the layer's transport for ``ids``."""
    return build_plan(ids, statics, transport=options.dispatch.transport, capacity=capacity,
                      buckets=buckets, alignment=options.group_alignment or 1,
                      exchange_implementation=options.dispatch.exchange_implementation)


def _chunk_ids(expert_ids: jax.Array, options: ResolvedOptions, split_fn):
    """``(local_ids, chunk_ids, overflow_ids, flags)`` of :func:`chunk_plans`: each chunk's
    slots, the first chunk's own-expert ones split off with ``local_first``, each split by
    ``split_fn`` (a :class:`BucketSplit` of a chunk's ids, or None: no split)."""
    chunks, p = options.dispatch.overlap_chunks, options.expert_axis_size
    tc = expert_ids.shape[0] // chunks
    local_ids, chunk_ids, over_ids, flags = None, [], [], []
    for c in range(chunks):
        ids_c = expert_ids[c * tc:(c + 1) * tc]
        if c == 0 and options.dispatch.local_first and p > 1:  # one device sends nothing
            local_ids, ids_c = split_local(ids_c, num_experts=options.num_slots,
                                           axis_name=options.dispatch.expert_axis)
        if split_fn is not None:
            s = split_fn(ids_c)
            ids_c = s.first_ids
            over_ids.append(s.overflow_ids)
            flags.append(s.overflows.astype(jnp.int32))
        chunk_ids.append(ids_c)
    return local_ids, chunk_ids, over_ids, flags
