"""The dispatch plan: where every token slot goes, computed from integer expert ids.

A *slot* is one (token, choice) pair ``s = t * k + j`` of the local ``expert_ids [T, k]``.
Slots are ordered by (expert, t, j) with a stable sort; within each expert, the first slots in
(t, j) order are the ones kept when a capacity limit applies (GShard / Switch rule).

References: GShard and Switch Transformer (capacity and dropping), DeepEP (count exchange
before payload exchange), MaxText's ragged MoE (sorted-by-expert send buffers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

from moe.kernels.gmm import api as gmm_api

AxisName = str | tuple[str, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """Everything :func:`moe.dispatch.combine` needs to send expert outputs back.

    A registered pytree (int arrays are leaves; the static layout is metadata), so it can be
    returned from ``jax.shard_map`` and passed through ``jax.jit``. ``N`` below is the number
    of send-buffer rows: ``num_experts * capacity`` for ``'dense'``, ``T * k`` for ``'ragged'``,
    ``R = P * W`` for ``'dropless'``.

    ``'dropless'`` indexes its buffers by *pair rows*: row ``q * W + r`` is the ``r``-th row
    between this device and device ``q`` in a worst-case ``[P, W]`` buffer, ``W =
    T * min(k, E_local)`` (:func:`pair_width`); the exchange sends only the first ``c`` rows
    of each block, ``c`` one of ``buckets``: the first ``c_0`` in one exchange, the rest (``c
    - c_0``) in a second one when a pair needs them (``moe._movement._two_phase``).

    Attributes:
      send_slot: int32 ``[N]``, the slot ``t * k + j`` carried by each send-buffer row
        (``T * k`` marks a padding row). Send buffers are destination-major: for ``'dense'``
        row ``e * capacity + r`` is the ``r``-th kept slot of global expert ``e``; for
        ``'ragged'`` rows are all slots sorted by (expert, t, j); for ``'dropless'`` pair row
        ``q * W + r`` is the ``r``-th of the slots for device ``q``, in that order.
      slot_row: int32 ``[T, k]``, the send-buffer row of each slot (``N`` if dropped).
      kept: bool ``[T, k]``, False for slots dropped by the capacity limit.
      send_counts: int32 ``[E]``, slots of this device routed to each global expert (before
        any capacity limit).
      recv_counts: int32 ``[P, E_local]``, slots that source device ``p`` routes to each local
        expert (before any capacity limit).
      group_sizes: int32 ``[E_local]``, valid rows per local expert in the expert layout.
      dropped: int32 ``[]``, slots of this device dropped by the capacity limit.
      send_offsets: ragged only, int32 ``[E]``: first send-buffer row of each global expert.
      remote_offsets: ragged only, int32 ``[E]``: row on expert ``e``'s owner where this
        device's slice for ``e`` lands.
      recv_offsets: ragged and dropless, int32 ``[P * E_local]``: row of this device's expert
        layout where the slice from source ``p`` for local expert ``l`` starts (index
        ``p*E_local+l``).
      return_offsets: ragged only, int32 ``[P * E_local]``: send-buffer row on source ``p``
        where its slice for local expert ``l`` started (where results go back to).
      transport: ``'dense'``, ``'ragged'`` or ``'dropless'``.
      num_experts: global number of experts ``E``.
      axis_name: the expert-parallel mesh axis (or axes).
      axis_size: ``P``, the size of ``axis_name``.
      capacity: dense: rows per (source, expert); ragged, dropless: rows ``R`` of the expert
        layout.
      ragged_impl: ``'native'`` or ``'emulated'`` (ragged only; ``'native'`` otherwise).
      x_dtype: dtype name of the dispatched tokens (combine returns this dtype).
      block_size: FP8 block size (used by an FP8 combine gradient).
      wire_kernels: ``'auto'``, ``'xla'``, ``'triton'`` or ``'mosaic'``: who encodes and lays out
      the rows
        of both dispatch-direction exchanges (`moe.kernels.wire.api`).
      layout_row: dropless only, int32 ``[R]``: the expert-layout row of received pair row
        ``p * W + r`` (``R``: no row).
      pair_row: dropless only, int32 ``[R]``: the received pair row of expert-layout row
        ``i`` (``R`` for padding rows); the inverse of ``layout_row``.
      bucket: dropless only, int32 ``[]``: index into ``buckets`` of the exchange capacity,
        the same on every device of the expert axis (it comes from the all-gathered counts).
      buckets: dropless only: the rows per (source, destination) pair that the exchange can
        send, ascending (:func:`dropless_buckets`); the last is ``W``, the worst case.
      alignment: dropless only: every local expert's rows start at a multiple of it in the
        expert layout (``moe.kernels.gmm.api.align_map``; the rows in between are zero), which then
        has ``moe.kernels.gmm.api.aligned_rows(R, E_local, alignment)`` rows. 1: plain ragged.
    """

    send_slot: jax.Array
    slot_row: jax.Array
    kept: jax.Array
    send_counts: jax.Array
    recv_counts: jax.Array
    group_sizes: jax.Array
    dropped: jax.Array
    send_offsets: jax.Array | None
    remote_offsets: jax.Array | None
    recv_offsets: jax.Array | None
    return_offsets: jax.Array | None
    transport: Literal["dense", "ragged", "dropless"] = dataclasses.field(
        metadata=dict(static=True))
    num_experts: int = dataclasses.field(metadata=dict(static=True))
    axis_name: AxisName = dataclasses.field(metadata=dict(static=True))
    axis_size: int = dataclasses.field(metadata=dict(static=True))
    capacity: int = dataclasses.field(metadata=dict(static=True))
    ragged_impl: Literal["native", "emulated"] = dataclasses.field(metadata=dict(static=True))
    x_dtype: str = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))
    wire_kernels: str = dataclasses.field(default="xla", metadata=dict(static=True))
    layout_row: jax.Array | None = None
    pair_row: jax.Array | None = None
    bucket: jax.Array | None = None
    buckets: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    alignment: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def num_local_experts(self) -> int:
        """``E_local = num_experts // axis_size``."""
        return self.num_experts // self.axis_size

    @property
    def num_tokens(self) -> int:
        """Local tokens ``T``."""
        return self.slot_row.shape[0]

    @property
    def top_k(self) -> int:
        """Slots per token ``k``."""
        return self.slot_row.shape[1]

    @property
    def pair_width(self) -> int:
        """``W``: rows per (source, destination) pair in the worst case (dropless)."""
        return pair_width(self.num_tokens, self.top_k, self.num_experts, self.axis_size)

    def expert_shape(self, width: int) -> tuple[int, ...]:
        """Shape of the expert layout with rows of ``width``: dense ``[E_local, P*C, width]``,
        ragged and dropless ``[R, width]``."""
        if self.transport == "dense":
            return (self.num_local_experts, self.axis_size * self.capacity, width)
        return (self.layout_rows, width)

    @property
    def layout_rows(self) -> int:
        """Rows of the ragged / dropless expert layout: ``R``, or its aligned count."""
        if self.alignment == 1:
            return self.capacity
        return gmm_api.aligned_rows(self.capacity, self.num_local_experts, self.alignment)


def dense_capacity(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    capacity_factor: float | None,
    *,
    multiple: int = 8,
) -> int:
    """Per-(source, expert) capacity of the dense transport.

    ``C = round_up(min(ceil(capacity_factor * T * k / E), T), multiple)``; ``capacity_factor
    None`` gives ``round_up(T, multiple)``, the worst case (a token picks an expert at most
    once), so nothing is dropped.

    Args:
      num_tokens: local tokens ``T``.
      top_k: slots per token ``k``.
      num_experts: global experts ``E``.
      capacity_factor: positive float, or None for dropless.
      multiple: round the capacity up to a multiple of this (8 keeps GPU tiles aligned).

    Returns:
      The capacity ``C`` (>= 1).

    Example:
      >>> dense_capacity(1024, 2, 16, 1.25)
      160

    References:
      GShard (Lepikhin et al., 2020) and Switch Transformer (Fedus et al., 2021) capacity.
    """
    if capacity_factor is None:
        raw = num_tokens
    else:
        raw = min(math.ceil(capacity_factor * num_tokens * top_k / num_experts), num_tokens)
    return -(-max(raw, 1) // multiple) * multiple


def ragged_rows(num_tokens: int, top_k: int, num_experts: int, axis_size: int) -> int:
    """Static rows ``R`` of the ragged expert layout: ``P * T * min(k, E_local)``.

    The worst case: every source routes all its tokens to this device, each token at most once
    per expert. Rows past ``sum(group_sizes)`` are padding: the layout is ``P`` times the
    ``T * k`` rows a device receives on average when ``E_local >= k``, so with ``P > 1`` the
    consumers of the layout (grouped GEMMs, elementwise passes) pay for ``(P - 1) / P`` padding
    rows in the balanced case (``P = 1``: none). No smaller static size can hold every routing.

    Args:
      num_tokens: local tokens ``T``.
      top_k: slots per token ``k``.
      num_experts: global experts ``E``.
      axis_size: expert-parallel size ``P``.

    Returns:
      ``R``.

    Example:
      >>> ragged_rows(64, 2, 16, 4)
      512

    References:
      MaxText ragged MoE (worst-case receive buffer for ``ragged_all_to_all``).
    """
    return axis_size * pair_width(num_tokens, top_k, num_experts, axis_size)


def pair_width(num_tokens: int, top_k: int, num_experts: int, axis_size: int) -> int:
    """``W = T * min(k, E_local)``: the most slots one device can route to another."""
    return num_tokens * min(top_k, num_experts // axis_size)


# Each bucket of the dropless exchange holds this many times the rows of the one below, so a
# routing that needs n rows per pair sends fewer than GROWTH * n (and at least the first);
# more when that would take more than _MAX_BUCKETS buckets (one lax.switch branch each).
_BUCKET_GROWTH = 1.5
_MAX_BUCKETS = 8


def dropless_buckets(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    axis_size: int,
    capacity_factor: float,
    *,
    multiple: int = 8,
) -> tuple[int, ...]:
    """Rows per (source, destination) pair that the dropless exchange can send, ascending.

    ``c_i = min(round_up(ceil(capacity_factor * g^i * T * k / P), multiple), W)`` for
    ``i = 0, 1, ...`` until ``c_i = W = T * min(k, E_local)``, the worst case (duplicates
    removed), with growth ``g = 1.5``, or the ``g`` that reaches ``W`` in 8 buckets when 1.5
    would take more. The exchange uses the smallest ``c_i`` that holds the fullest pair of the
    step, so it never drops a slot and sends less than ``g`` times the rows it needs (or
    ``c_0``). One device (``P = 1``): ``(W,)`` (nothing is exchanged).

    Args:
      num_tokens: local tokens ``T``.
      top_k: slots per token ``k``.
      num_experts: global experts ``E``.
      axis_size: expert-parallel size ``P``.
      capacity_factor: ``c_0`` over the balanced share ``T * k / P`` (> 0).
      multiple: round capacities up to a multiple of this.

    Returns:
      The capacities, ascending, the last one ``W``.

    Example:
      >>> dropless_buckets(1024, 2, 16, 2, 1.25)
      (1280, 1920, 2048)

    References:
      Tutel (adaptive capacity per step); GShard capacity factor.
    """
    w = pair_width(num_tokens, top_k, num_experts, axis_size)
    if axis_size == 1:
        return (w,)
    share = num_tokens * top_k / axis_size
    first = max(capacity_factor * share, 1.0)
    growth = max(_BUCKET_GROWTH, (w / first) ** (1.0 / (_MAX_BUCKETS - 1)))
    caps, f = [], first
    while not caps or caps[-1] < w:
        c = min(-(-math.ceil(f) // multiple) * multiple, w)
        if not caps or c > caps[-1]:
            caps.append(c)
        f *= growth
    return tuple(caps)


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def sort_slots(flat: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Slots sorted by (expert, slot): ``(order, expert_of_sorted)``, both int32 ``[S]``.

    One single-operand sort of the packed key ``expert * S + slot`` (unique keys, so no
    stability is needed, and the slot and expert come back by ``%`` and ``//``): half the bytes
    of a stable key/index argsort, and on GPU a plain radix sort of int32 keys. Falls back to
    the stable argsort when ``num_experts * S`` does not fit in int32.

    Args:
      flat: int32 ``[S]`` expert id of every slot, in ``[0, num_experts)``.
      num_experts: ``E``.

    Returns:
      ``order`` (slot ids by (expert, slot)) and ``expert_of_sorted`` (``flat[order]``).

    Example:
      >>> sort_slots(jnp.array([2, 0, 2, 1], jnp.int32), 3)[0].tolist()
      [1, 3, 0, 2]

    References:
      GShard / Switch Transformer (slots ranked in (t, j) order within each expert).
    """
    s = flat.shape[0]
    if num_experts * s < 2**31:
        key = jnp.sort(flat * s + jnp.arange(s, dtype=jnp.int32), stable=False)
        return key % s, key // s
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    return order, flat[order]


def _gather_counts(send_counts: jax.Array, axis_name: AxisName, p: int) -> jax.Array:
    """int32 ``[P src, E]``: every device's ``send_counts`` (no collective when ``P = 1``)."""
    if p == 1:
        return send_counts[None]
    return jax.lax.all_gather(send_counts, axis_name, axis=0)


def _last_at_most(starts: jax.Array, x: jax.Array) -> jax.Array:
    """Index of the last entry of the nondecreasing ``starts [..., n]`` that is ``<= x [...,
    m]``, shape ``[..., m]`` (a compare against every start: ``n`` is a few experts)."""
    return jnp.sum(starts[..., None, :] <= x[..., :, None], axis=-1, dtype=jnp.int32) - 1


def build_plan(
    expert_ids: jax.Array,
    *,
    num_experts: int,
    axis_name: AxisName,
    axis_size: int,
    transport: Literal["dense", "ragged", "dropless"],
    capacity: int,
    ragged_impl: Literal["native", "emulated"],
    x_dtype: str,
    block_size: int,
    wire_kernels: str = "xla",
    buckets: tuple[int, ...] = (),
    alignment: int = 1,
) -> DispatchPlan:
    """Sort slots by expert, count them, exchange counts; return the :class:`DispatchPlan`.

    Dense: ``kept[t, j] = rank of (t, j) among this device's slots of its expert < capacity``
    with slots ranked in (t, j) order. Ragged and dropless: every slot is kept. Dropless also
    picks the exchange bucket: the smallest of ``buckets`` that holds the fullest (source,
    destination) pair of the all-gathered counts, the same on every device of the axis.

    Work: one int32 sort of ``S = T * k`` packed keys (:func:`sort_slots`), one scatter of
    ``S`` int32 (each slot's row), a gather of ``N`` int32 (each row's slot, dense and
    dropless), ``O(R * E_local)`` int32 compares (dropless: the expert layout's rows against
    the slice starts) and ``O(P * E)`` count arithmetic; no pass over the token rows. With
    ``P = 1`` no collective runs.

    Args:
      expert_ids: int ``[T, k]`` global expert ids in ``[0, num_experts)``.
      num_experts, axis_name, axis_size, transport, capacity, ragged_impl, x_dtype,
        block_size, wire_kernels, buckets, alignment: see :class:`DispatchPlan` (already
        validated by ``dispatch``).

    Returns:
      The plan (its collectives: one tiny all-to-all (dense) or all-gather (ragged, dropless)
      of counts; none when ``P = 1``).

    Example:
      >>> # inside shard_map: build_plan(ids, num_experts=8, axis_name='expert', ...)

    References:
      DeepEP (counts exchanged before the payload); GShard capacity rule.
    """
    t, k = expert_ids.shape
    s = t * k
    p, e_total = axis_size, num_experts
    e_local = e_total // p
    flat = expert_ids.reshape(s).astype(jnp.int32)
    order, e_sorted = sort_slots(flat, e_total)  # slots by (expert, t, j)
    send_counts = jnp.zeros((e_total,), jnp.int32).at[flat].add(1)
    starts = _exclusive_cumsum(send_counts, 0)
    rank = jnp.arange(s, dtype=jnp.int32) - starts[e_sorted]  # position within its expert
    extra = {}

    if transport == "dense":
        c = capacity
        n = e_total * c
        row_sorted = jnp.where(rank < c, e_sorted * c + rank, n)
        slot_row = jnp.zeros((s,), jnp.int32).at[order].set(row_sorted, unique_indices=True)
        r = jnp.arange(c, dtype=jnp.int32)[None, :]
        src = jnp.minimum(starts[:, None] + r, s - 1)
        send_slot = jnp.where(r < send_counts[:, None], order[src], s).reshape(n)
        recv_counts = send_counts
        if p > 1:
            recv_counts = jax.lax.all_to_all(send_counts, axis_name, 0, 0, tiled=True)
        recv_counts = recv_counts.reshape(p, e_local)
        group_sizes = jnp.minimum(recv_counts, c).sum(axis=0)
        dropped = jnp.maximum(send_counts - c, 0).sum()
        ragged = dict(send_offsets=None, remote_offsets=None, recv_offsets=None,
                      return_offsets=None)
    else:
        me = jax.lax.axis_index(axis_name) if p > 1 else 0
        counts = _gather_counts(send_counts, axis_name, p)  # [P src, E]
        by_owner = counts.reshape(p, p, e_local)  # [src, owner, local expert]
        totals = by_owner.sum(axis=0)  # [owner, local expert]
        group_start = _exclusive_cumsum(totals, 1)  # [owner, l]
        before_src = _exclusive_cumsum(by_owner, 0)  # [src, owner, l]
        at_owner = group_start[None] + before_src  # row on owner of (src, l) slice
        recv_counts = jnp.take(by_owner, me, axis=1)  # [P, E_local]
        group_sizes = jnp.take(totals, me, axis=0)
        dropped = jnp.zeros((), jnp.int32)
        recv_offsets = jnp.take(at_owner, me, axis=1)  # [P src, E_local]
        if transport == "ragged":
            send_slot = order
            slot_row = jnp.zeros((s,), jnp.int32).at[order].set(
                jnp.arange(s, dtype=jnp.int32), unique_indices=True)
            src_starts = _exclusive_cumsum(counts, 1).reshape(p, p, e_local)
            ragged = dict(
                send_offsets=starts,
                remote_offsets=jnp.take(at_owner, me, axis=0).reshape(e_total),
                recv_offsets=recv_offsets.reshape(e_total),
                return_offsets=jnp.take(src_starts, me, axis=1).reshape(e_total),
            )
        else:
            send_slot, slot_row, extra = _dropless_rows(
                order, e_sorted, send_counts, counts, recv_counts, recv_offsets,
                p=p, e_local=e_local, w=capacity // p, buckets=buckets)
            if alignment > 1:
                send_slot, slot_row, extra = _aligned_rows(
                    send_slot, slot_row, extra, group_sizes, p=p, alignment=alignment)
            ragged = dict(send_offsets=None, remote_offsets=None,
                          recv_offsets=recv_offsets.reshape(e_total), return_offsets=None)
    kept = (slot_row < send_slot.shape[0]).reshape(t, k)
    return DispatchPlan(
        send_slot=send_slot,
        slot_row=slot_row.reshape(t, k),
        kept=kept,
        send_counts=send_counts,
        recv_counts=recv_counts,
        group_sizes=group_sizes.astype(jnp.int32),
        dropped=dropped.astype(jnp.int32),
        **ragged,
        transport=transport,
        num_experts=num_experts,
        axis_name=axis_name,
        axis_size=axis_size,
        capacity=capacity,
        ragged_impl=ragged_impl,
        x_dtype=x_dtype,
        block_size=block_size,
        wire_kernels=wire_kernels,
        buckets=tuple(buckets),
        alignment=alignment,
        **extra,
    )


def _aligned_rows(send_slot, slot_row, extra, group_sizes, *, p, alignment):
    """The dropless plan's row maps onto the ``alignment``-aligned expert layout: rows of
    the plain layout move to ``dst`` (``moe.kernels.gmm.api.align_map``), the rows between groups
    carry no slot (a zero row), and "no row" stays out of range."""
    s = slot_row.shape[0]
    n = send_slot.shape[0] if p == 1 else extra["pair_row"].shape[0]  # plain layout rows
    src, dst, _ = gmm_api.align_map(group_sizes, n, alignment)
    n_al = src.shape[0]

    def moved(rows):  # plain-layout row indices (out of range: none) -> aligned
        return jnp.where(rows < n, jnp.take(dst, jnp.minimum(rows, n - 1)), n_al)

    def pulled(vals, none):  # a value per plain-layout row -> per aligned row
        return jnp.where(src < n, jnp.take(vals, jnp.minimum(src, n - 1)), none)

    if p == 1:  # the send buffer is the layout: its slots move, slots' rows follow
        return pulled(send_slot, s), moved(slot_row), extra
    extra = dict(extra, layout_row=moved(extra["layout_row"]),
                 pair_row=pulled(extra["pair_row"], n))
    return send_slot, slot_row, extra


def _dropless_rows(order, e_sorted, send_counts, counts, recv_counts, recv_offsets, *, p,
                   e_local, w, buckets):
    """Pair rows of the dropless plan: ``(send_slot [P*W], slot_row [S], dict(layout_row,
    pair_row, bucket))`` (see :class:`DispatchPlan`)."""
    s = order.shape[0]
    n = p * w
    # Source side: sorted slot i goes to device q = e // E_local, row rank-within-q.
    dest_counts = send_counts.reshape(p, e_local).sum(axis=1)
    dest_start = _exclusive_cumsum(dest_counts, 0)
    q = e_sorted // e_local
    row_sorted = q * w + jnp.arange(s, dtype=jnp.int32) - dest_start[q]
    slot_row = jnp.zeros((s,), jnp.int32).at[order].set(row_sorted, unique_indices=True)
    r = jnp.arange(w, dtype=jnp.int32)[None, :]
    src = jnp.minimum(dest_start[:, None] + r, s - 1)
    send_slot = jnp.where(r < dest_counts[:, None], order[src], s).reshape(n)
    if p == 1:  # the send buffer is the expert layout: no permutation, one bucket
        return send_slot, slot_row, dict(bucket=jnp.zeros((), jnp.int32))
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
    need = counts.reshape(p, p, e_local).sum(axis=2).max()
    bucket = jnp.sum(jnp.asarray(buckets, jnp.int32) < need, dtype=jnp.int32)
    extra = dict(layout_row=layout_row.reshape(n), pair_row=pair_row, bucket=bucket)
    return send_slot, slot_row, extra
