"""The rows' round trip of :func:`moe.dispatch` and :func:`moe.combine` inside
``jax.shard_map``: wire formats, send buffers, the (bucketed) exchanges, the expert layouts, the
sums over the ``k`` choices, and the custom VJPs whose backward passes are the opposite
exchange. The layouts, transports and per-call data movement are described in
:mod:`moe.dispatch`; the plan (who sends which row where) is :mod:`moe.dispatch.plan`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from accel_kernels.wire import api as wire_api
from moe.dispatch import collectives
from moe.dispatch.plan import DensePlan, DispatchPlan, DroplessPlan, RaggedPlan, TwoStagePlan
from moe.options import WireDtype

__all__ = ["CombineResiduals", "Dispatched", "LayoutWithWire", "Wire", "WireRows", "back_row",
           "combine_rows", "combine_rows_forward", "combine_tokens", "combine_weights_grad",
           "dispatch_rows", "dispatch_tokens", "grad_wire_dtype", "sum_slots", "two_stage_combine",
           "two_stage_rows", "vary_like", "wire_for"]


@dataclasses.dataclass(frozen=True)
class Wire:
    """Static wire format of one direction: ``'fp8'`` or a dtype name; decoded to ``out``;
    ``implementation``: who encodes/gathers and decodes/lays out the rows
    (`accel_kernels.registry.Implementation`)."""

    wire: str
    out: str
    block_size: int
    implementation: str = "xla"

    @property
    def codec(self):
        return "fp8" if self.wire == "fp8" else jnp.dtype(self.wire)

    def decode(self, buf: jax.Array, width: int) -> jax.Array:
        """Wire rows ``[..., wire width]`` -> ``self.out[..., width]``."""
        return wire_api.decode_rows(buf, wire=self.codec, width=width,
                                      block_size=self.block_size, out_dtype=self.out)


def wire_for(name: WireDtype, dtype: jnp.dtype, block_size: int,
             implementation: str = "xla") -> Wire:
    """The :class:`Wire` of a ``dispatch_dtype`` / ``combine_grad_dtype`` for rows of ``dtype``."""
    if name == "fp8":
        return Wire("fp8", "bfloat16", block_size, implementation)
    wire = "bfloat16" if name == "bf16" else jnp.dtype(dtype).name
    return Wire(wire, wire, block_size, implementation)


class LayoutWithWire(NamedTuple):
    """The expert layout decoded, and the wire rows it was decoded from, in its order."""

    rows: jax.Array
    wire: jax.Array


def _two_phase(plan: DroplessPlan, exchange, finish):
    """The dropless exchange in two phases: ``exchange(0, c_0)`` sends the first bucket's rows
    of every pair, outside any branch (an async all-to-all that other work can overlap); the
    rest runs in the ``lax.switch`` branch of the step's bucket ``c_j``: ``exchange(c_0, c_j -
    c_0)`` sends the overflow (nothing in branch 0, the balanced case) and ``finish(recv, o)``
    reads the received rows, ``recv`` the first phase's ``[P * c_0]`` rows followed by the
    overflow's ``[P * o]``. Every device of the expert axis takes the same branch (the index
    comes from the all-gathered counts)."""
    c0 = plan.buckets[0]
    first = exchange(0, c0)
    if len(plan.buckets) == 1:
        return finish(first, 0)

    def branch(o, first):
        recv = first if o == 0 else jnp.concatenate([first, exchange(c0, o)], axis=0)
        return finish(recv, o)

    return jax.lax.switch(plan.bucket, [functools.partial(branch, c - c0)
                                        for c in plan.buckets], first)


def _pair_rows(a: jax.Array, plan: DroplessPlan, start: int, size: int) -> jax.Array:
    """Entries ``[start, start + size)`` of every pair block of ``a [P * W]``: ``[P * size]``.
    With one device the one bucket is ``W`` and ``a`` is the send buffer's slots: all of it
    (the aligned layout's, longer than ``W``, included)."""
    if plan.axis_size == 1:
        return a
    return a.reshape(plan.axis_size, -1)[:, start:start + size].reshape(-1)


def _pair_to_row(v: jax.Array, plan: DroplessPlan, c: int, o: int = 0) -> jax.Array:
    """Pair rows ``q * W + r`` -> rows of the received buffers of a two-phase exchange
    (:func:`_two_phase`): ``q * c + r`` in the first ``[P, c]`` block for ``r < c``, ``P * c +
    q * o + r - c`` in the overflow's ``[P, o]`` block after it; ``P * (c + o)`` where ``v``
    is out of range."""
    w, p = plan.pair_width, plan.axis_size
    if c == w:
        return v
    q, r = jax.lax.div(v, jnp.int32(w)), jax.lax.rem(v, jnp.int32(w))  # v >= 0
    row = jnp.where(r < c, q * c + r, p * c + q * o + r - c)
    return jnp.where(v < p * w, row, p * (c + o))


def _take_rows(rows: jax.Array, index: jax.Array) -> jax.Array:
    """``rows[index]``, a zero row where ``index`` is out of range."""
    return jnp.take(rows, index, axis=0, mode="fill", fill_value=0)


def _gather_decode(buf, index, w: Wire, width: int, fallback=None) -> jax.Array:
    """Wire rows ``buf[index]`` decoded in one pass by the wire kernels ``w.implementation``
    (`accel_kernels.wire.api.gather_decode`); ``fallback(buf, index)``: the XLA path."""
    return wire_api.gather_decode(buf, index, wire=w.codec, width=width,
                                  block_size=w.block_size, out_dtype=w.out,
                                  implementation=w.implementation, fallback=fallback)


def _dense_to_layout(recv: jax.Array, plan: DensePlan, w: Wire, width: int) -> jax.Array:
    """Received rows ``[P src * E_local * C, W]`` -> decoded expert layout ``[E_local, P * C,
    width]``: XLA decodes and transposes; the Pallas kernel (:func:`_gather_decode`) reads each
    expert-layout row from its source row (a permutation index) and decodes it in the same
    pass. With ``P = 1`` the rows already are the layout (decode only)."""
    p, el, c = plan.axis_size, plan.num_local_experts, plan.capacity

    def xla(recv, src=None):
        del src  # the transpose needs no index
        out = w.decode(recv, width)
        out = out.reshape(p, el, c, width)
        return out.transpose(1, 0, 2, 3).reshape(plan.expert_shape(width))

    if p == 1:
        return xla(recv)
    # expert-layout row (l, q, r) <- received row (q, l, r)
    src = (jax.lax.broadcasted_iota(jnp.int32, (el, p, c), 1) * (el * c)
           + jax.lax.broadcasted_iota(jnp.int32, (el, p, c), 0) * c
           + jax.lax.broadcasted_iota(jnp.int32, (el, p, c), 2))
    out = _gather_decode(recv, src.reshape(-1), w, width,
                         fallback=lambda recv, src: xla(recv).reshape(-1, width))
    return out.reshape(plan.expert_shape(width))


def _pairs_to_layout(recv: jax.Array, plan: DroplessPlan, c: int, o: int, w: Wire, width: int,
                     with_wire: bool = False):
    """Dropless: received rows ``[P src * (c + o), W]`` (a two-phase exchange's, see
    :func:`_pair_to_row`) -> decoded expert layout ``[R, width]`` (row ``i`` <- received row of
    ``plan.pair_row[i]``; padding rows zero), one gather + decode pass (the Pallas kernel,
    :func:`_gather_decode`, or XLA's gather of the wire words then decode). With ``P = 1`` the
    received rows already are the layout. ``with_wire``: a :class:`LayoutWithWire`, also the
    wire rows in the layout's order (XLA drops whichever is not used)."""
    if plan.axis_size == 1:
        out = w.decode(recv, width)
        return LayoutWithWire(out, recv) if with_wire else out
    index = _pair_to_row(plan.pair_row, plan, c, o)
    if with_wire:
        return LayoutWithWire(_pairs_to_layout(recv, plan, c, o, w, width),
                              _take_rows(recv, index))

    def xla(recv, index):
        return w.decode(_take_rows(recv, index), width)

    return _gather_decode(recv, index, w, width, fallback=xla)


def _to_experts(encode, plan: DispatchPlan, w: Wire, width: int, with_wire: bool = False):
    """Dispatch direction: ``encode(slots)`` builds the wire rows (format ``w``) carrying the
    slots ``slots`` (int32; ``T * k`` gives a zero row); exchange; return the expert layout
    decoded to ``w.out``. No collective runs when the expert axis has one device.
    ``with_wire`` (ragged layouts only): a :class:`LayoutWithWire`."""
    if isinstance(plan, DroplessPlan):
        def exchange(start, size):
            send = encode(_pair_rows(plan.send_slot, plan, start, size))  # [P dst * size, W]
            return collectives.dense_exchange(send, plan.axis_name)

        return _two_phase(plan, exchange, lambda recv, o: _pairs_to_layout(
            recv, plan, plan.buckets[0], o, w, width, with_wire))
    send = encode(plan.send_slot)
    if isinstance(plan, DensePlan):
        if with_wire:
            raise ValueError("the wire rows of the dense transport's padded layout are not "
                             "offered; ask for them with a ragged layout (dropless, ragged).")
        recv = collectives.dense_exchange(send, plan.axis_name)  # [P src, E_local, C, W]
        return _dense_to_layout(recv, plan, w, width)
    if plan.axis_size == 1:  # ragged
        recv = send  # sorted by expert: already the layout (R = T * k rows)
    else:
        recv = jnp.zeros_like(send, shape=(plan.rows, send.shape[-1]))  # varies like send
        recv = collectives.ragged_exchange(
            send, recv, plan.send_offsets, plan.send_counts, plan.remote_offsets,
            plan.recv_counts.reshape(-1), axis_name=plan.axis_name,
            implementation=plan.exchange_implementation,
        )
    out = w.decode(recv, width)
    return LayoutWithWire(out, recv) if with_wire else out


def _return_trip(expert_rows: jax.Array, plan: DensePlan | RaggedPlan) -> jax.Array:
    """Combine direction, dense and ragged: expert layout -> the returned rows ``[N, width]``
    on the source (:func:`back_row` gives the row of slot ``(t, j)``; rows of dropped slots
    are never read). No collective when the expert axis has one device.

    Dense: one all-to-all that splits the expert layout's second axis (``[E_local, P * C]``:
    block ``q`` of it goes to device ``q``) and concatenates what arrives along it, so no
    transpose into a destination-major buffer (a pass over every row, a sizeable share of
    dispatch + combine) runs first; returned row ``(l, q, r)`` is the result of local expert
    ``l`` of device ``q`` for this source's ``r``-th row sent there."""
    width = expert_rows.shape[-1]
    if isinstance(plan, DensePlan):
        p, el, c = plan.axis_size, plan.num_local_experts, plan.capacity
        rows = expert_rows.reshape(el, p * c, width)
        back = collectives.dense_exchange(rows, plan.axis_name, axis=1)
        return back.reshape(-1, width)
    if plan.axis_size == 1:
        return expert_rows  # R = T * k rows in sorted order: the send buffer's rows
    back = jnp.zeros_like(expert_rows, shape=(plan.send_slot.shape[0], width))
    return collectives.ragged_exchange(
        expert_rows, back, plan.recv_offsets, plan.recv_counts.reshape(-1),
        plan.return_offsets, plan.send_counts, axis_name=plan.axis_name,
        implementation=plan.exchange_implementation,
    )


def back_row(plan: DispatchPlan, j: int) -> jax.Array:
    """int32 ``[T]``: the row of :func:`_return_trip`'s result holding slot ``(t, j)`` (out of
    range for a dropped slot). Ragged: ``plan.slot_row``. Dense: ``slot_row = e * C + r``
    (global expert ``e = q * E_local + l``) becomes ``(l * P + q) * C + r``. Dropless with
    one bucket ``c``: pair row ``q * W + r`` becomes ``q * c + r``."""
    sr = plan.slot_row[:, j]
    if isinstance(plan, DroplessPlan):
        return _pair_to_row(sr, plan, plan.buckets[0])
    if isinstance(plan, RaggedPlan):
        return sr
    p, el, c = plan.axis_size, plan.num_local_experts, plan.capacity
    e, r = sr // c, sr % c
    n = plan.num_experts * c
    return jnp.where(sr < n, ((e % el) * p + e // el) * c + r, n)


def _from_experts(expert_rows: jax.Array, plan: DispatchPlan, reduce):
    """Combine direction: send the expert layout back to the sources and return ``reduce(back,
    row)``, ``back`` the returned rows and ``row(j)`` (int32 ``[T]``) the row of ``back``
    holding slot ``(t, j)``. Dropless: the rows for each source are gathered from the layout
    into ``[P, c]`` buffers and exchanged in two phases (:func:`_two_phase`), then reduced
    inside the bucket's branch (``back``'s shape depends on the bucket, so ``reduce`` must
    return arrays of fixed shapes)."""
    if not isinstance(plan, DroplessPlan):
        return reduce(_return_trip(expert_rows, plan), functools.partial(back_row, plan))
    c0 = plan.buckets[0]
    if plan.axis_size == 1:  # the layout is the source's sorted slots; one bucket
        return reduce(expert_rows, lambda j: _pair_to_row(plan.slot_row[:, j], plan, c0))

    def exchange(start, size):
        send = wire_api.gather_rows(
            expert_rows, _pair_rows(plan.layout_row, plan, start, size),
            wire=jnp.dtype(expert_rows.dtype), block_size=plan.block_size,
            implementation=plan.wire_implementation)
        return collectives.dense_exchange(send, plan.axis_name)

    return _two_phase(plan, exchange, lambda back, o: reduce(
        back, lambda j: _pair_to_row(plan.slot_row[:, j], plan, c0, o)))


def sum_slots(back: jax.Array, row, top_k: int, weights: jax.Array | None) -> jax.Array:
    """``sum_j weights[:, j] * back[row(j)]`` in f32 (``weights`` None: plain sum).

    One gather per choice ``j`` feeding an elementwise f32 sum, so XLA fuses the gathers,
    the weighting and the sum into one pass that writes only ``[T, width]``: no ``[T, k,
    width]`` intermediate and no batched dot with a contraction of size ``k``."""
    total = None
    for j in range(top_k):
        term = _take_rows(back, row(j)).astype(jnp.float32)
        if weights is not None:
            term = weights[:, j, None] * term
        total = term if total is None else total + term
    return total


def _keep_return_buffer(plan: DispatchPlan) -> bool:
    """Whether combine's backward reads the router gradient's expert outputs from the
    returned buffer itself (``N`` rows, no copy) rather than from gathered ``[T, k]`` slot
    rows: yes unless the buffer is more than twice their size (dense with a large capacity,
    e.g. dropless ``C = T``), where keeping it would cost more memory than the copy, or its
    shape depends on the exchange bucket (dropless with more than one bucket). With one
    device on the expert axis the buffer is ``expert_y`` itself."""
    rows = plan.send_slot.shape[0]
    if isinstance(plan, DroplessPlan):
        if len(plan.buckets) > 1:
            return False
        rows = plan.axis_size * plan.buckets[0]
    return rows <= 2 * plan.num_tokens * plan.top_k


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dispatch_rows(x: jax.Array, plan: DispatchPlan, w: Wire, with_wire: bool = False):
    """``x``'s slots sent on wire ``w`` into the expert layout (backward: the combine-direction
    exchange, summed over each token's ``k`` slots). ``with_wire`` (ragged layouts): also the
    wire rows of the layout, integer words that take no gradient: an FP8 GEMM can read the
    e4m3 payload from them without the decoded copy (`moe.experts`)."""
    def encode(slots):
        tok = jax.lax.div(slots, jnp.int32(plan.top_k))  # slots are >= 0
        return wire_api.gather_rows(x, tok, wire=w.codec,
                                      block_size=w.block_size, implementation=w.implementation)

    return _to_experts(encode, plan, w, x.shape[-1], with_wire)


def _dispatch_rows_fwd(x, plan, w, with_wire):
    return dispatch_rows(x, plan, w, with_wire), plan


def _dispatch_rows_bwd(w, with_wire, plan, ct):
    if with_wire:
        ct = ct.rows  # the wire words' cotangent is float0
    # Combine-direction exchange of the cotangent, summed over the k slots of each token.
    dx = _from_experts(ct, plan, lambda back, row: sum_slots(back, row, plan.top_k, None))
    return dx.astype(plan.x_dtype), None


dispatch_rows.defvjp(_dispatch_rows_fwd, _dispatch_rows_bwd)


class CombineResiduals(NamedTuple):
    """What combine's backward keeps: the expert outputs it reads again, and its inputs."""

    rows: jax.Array  # the returned buffer [N, width], or the slots' rows [T, k, width]
    weights: jax.Array  # [T, k] router weights
    plan: DispatchPlan


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def combine_rows(expert_y, weights, plan, grad_wire: WireDtype):
    """``expert_y`` sent back to its tokens, weighted and summed over the ``k`` choices
    (backward: the dispatch-direction exchange, on wire ``grad_wire``)."""
    return _combine_rows_fwd(expert_y, weights, plan, grad_wire)[0]


def _combine_rows_fwd(expert_y, weights, plan, grad_wire):
    w32 = weights.astype(jnp.float32)

    def reduce(back, row):
        y = sum_slots(back, row, plan.top_k, w32)
        if _keep_return_buffer(plan):
            return y, back  # [N, width]: read again by the backward's gathers
        return y, jnp.stack([_take_rows(back, row(j)) for j in range(plan.top_k)], axis=1)

    with jax.named_scope("combine_weighted_sum"):
        y, rows = _from_experts(expert_y, plan, reduce)
    return y.astype(plan.x_dtype), CombineResiduals(rows, weights, plan)


def combine_weights_grad(res: CombineResiduals, dy: jax.Array) -> jax.Array:
    """The exact gradient of combine's weights, ``<dy[t], expert output of slot (t, j)>`` (0
    for dropped slots), from :func:`combine_rows_forward`'s residuals."""
    rows, weights, plan = res.rows, res.weights, res.plan
    dy32 = dy.astype(jnp.float32)
    with jax.named_scope("combine_grad_weights"):
        dw = jnp.stack([
            jnp.sum(dy32 * (_take_rows(rows, back_row(plan, j)) if rows.ndim == 2
                            else rows[:, j]).astype(jnp.float32), axis=-1)
            for j in range(plan.top_k)], axis=1)
    return dw.astype(weights.dtype)


def grad_wire_dtype(grad_wire: WireDtype, res: CombineResiduals) -> jnp.dtype | str:
    """The codec of combine's gradient rows (``'fp8'`` or a float dtype)."""
    return wire_for(grad_wire, res.rows.dtype, res.plan.block_size,
                    res.plan.wire_implementation).codec


def _combine_rows_bwd(grad_wire, res: CombineResiduals, dy):
    weights, plan = res.weights, res.plan
    y_dtype = res.rows.dtype  # expert_y's dtype: the return trip keeps it
    dw = combine_weights_grad(res, dy)
    # Send row i carries weights[s] * dy[s // k] (s = its slot), encoded: for FP8 the scales
    # come from dy's block maxima (T rows) times |weight|, so no [T * k, d] rows exist.
    w = wire_for(grad_wire, y_dtype, plan.block_size, plan.wire_implementation)

    def encode(slots):
        return wire_api.gather_weighted_rows(
            dy, weights.reshape(-1), slots, top_k=plan.top_k, wire=w.codec,
            block_size=w.block_size)

    d_expert_y = _to_experts(encode, plan, w, dy.shape[-1]).astype(y_dtype)
    return d_expert_y, dw, None


combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)
combine_rows_forward = _combine_rows_fwd  # (y, residuals), for a VJP that holds the combine


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def two_stage_rows(x: jax.Array, plan: TwoStagePlan, w: Wire, with_wire: bool = False):
    """:func:`dispatch_rows` past one host: ``x``'s tokens encoded once on wire ``w`` and sent
    to their hosts (stage 1, over the host axis), the received wire rows forwarded as they
    came, not decoded, to the host's experts (stage 2, over the local axes), decoded there.
    Backward: each forwarding device sums its rows' slots in f32 (stage 2 back, rounded to
    the tokens' dtype), the sums cross back once per (token, host) and the source sums them
    over its hosts."""
    p1, p2 = plan.stage1, plan.stage2
    tok = jax.lax.div(p1.send_slot, jnp.int32(p1.top_k))
    send = wire_api.gather_rows(x, tok, wire=w.codec, block_size=w.block_size,
                                implementation=w.implementation)
    recv = collectives.dense_exchange(send, p1.axis_name)  # [H src * C_1, wire width]

    def forward(slots):  # stage 2's send rows: the received wire rows of its slots' tokens
        return _take_rows(recv, jax.lax.div(slots, jnp.int32(p2.top_k)))

    return _to_experts(forward, p2, w, x.shape[-1], with_wire)


def _two_stage_rows_fwd(x, plan, w, with_wire):
    return two_stage_rows(x, plan, w, with_wire), plan


def _two_stage_rows_bwd(w, with_wire, plan, ct):
    if with_wire:
        ct = ct.rows
    p1, p2 = plan.stage1, plan.stage2
    per_row = _from_experts(ct, p2, lambda back, row: sum_slots(back, row, p2.top_k, None))
    back = _return_trip(per_row.astype(p1.x_dtype), p1)
    dx = sum_slots(back, functools.partial(back_row, p1), p1.top_k, None)
    return dx.astype(p1.x_dtype), None


two_stage_rows.defvjp(_two_stage_rows_fwd, _two_stage_rows_bwd)


def two_stage_combine(expert_y: jax.Array, weights: jax.Array, plan: TwoStagePlan,
                      grad_wire: WireDtype) -> jax.Array:
    """:func:`combine_rows` past one host: the routing weights go with the tokens' rows to
    the forwarding devices (stage 1, f32, their gradient back the same way), each of which
    sums its host's weighted expert outputs per row in f32 (:func:`combine_rows` over stage 2,
    rounded to the tokens' dtype); the sums cross back once per (token, host), and the source
    adds them up (:func:`combine_rows` over stage 1 with weights 1). Backward: the output
    gradient goes to the forwarding devices in the tokens' dtype, as it is, and stage 2 sends
    ``weight * dy`` on ``grad_wire``, the bytes the one-stage exchange sends."""
    p1, p2 = plan.stage1, plan.stage2
    w1 = Wire("float32", "float32", p1.block_size, "xla")
    w2 = dispatch_rows(weights.astype(jnp.float32), dataclasses.replace(p1, x_dtype="float32"),
                       w1).reshape(-1, weights.shape[1])  # [H C_1, k] at the forwarding device
    expert_y, w2 = vary_like(expert_y, w2), vary_like(w2, expert_y)
    host_sum = combine_rows(expert_y, w2, p2, grad_wire)  # [H C_1, d] in the tokens' dtype
    ones = vary_like(jnp.ones(p1.slot_row.shape, jnp.float32), host_sum)
    return combine_rows(vary_like(host_sum, ones)[None], ones, p1, None)


def vary_like(x: jax.Array, *others) -> jax.Array:
    """``x``, typed by ``shard_map`` as varying over every mesh axis any leaf of ``others``
    varies over (adds a zero scalar; a no-op outside ``shard_map``). The custom VJPs need
    their inputs to vary like their cotangents, which come out of collectives."""
    zero = jnp.zeros((), x.dtype)
    for leaf in jax.tree.leaves(others):
        zero = zero + jnp.zeros_like(leaf, shape=(), dtype=x.dtype)
    return x + zero


class WireRows(NamedTuple):
    """Ragged ``expert_x``'s FP8 wire rows, from which an FP8 forward GEMM reads its e4m3 rows
    instead of quantizing ``expert_x`` again (the same bytes; `moe.experts.run_experts`)."""

    rows: jax.Array | collectives.TokenRows  # uint32 [R, width / 4 + W] as received, or the
    # tokens and the token of each row when nothing was sent (one device on the expert axis)
    width: int  # d_model
    block_size: int  # channels per E8M0 scale


class Dispatched(NamedTuple):
    """What :func:`dispatch_tokens` hands the local experts."""

    expert_x: jax.Array  # the expert layout: dense [E_local, P * C, d], else [R, d]
    wire: WireRows | None  # with_wire: the layout's FP8 wire rows
    group_sizes: jax.Array  # int32 [E_local]: valid rows per local expert
    plan: DispatchPlan  # for combine


def dispatch_tokens(x: jax.Array, plan: DispatchPlan, *, dispatch_dtype: WireDtype,
                    with_wire: bool = False) -> Dispatched:
    """``x [T, d]``'s slots sent by ``plan`` on the ``dispatch_dtype`` wire into the expert
    layout (:func:`dispatch_rows`), the arguments already checked (`moe.dispatch.dispatch_apply`
    checks them for its callers).

    ``with_wire`` (``dispatch_dtype='fp8'``, a ragged layout): also the layout's FP8 wire rows;
    with one device on the expert axis nothing is sent, and they are the tokens and the token
    of each row (:class:`moe.dispatch.collectives.TokenRows`), the bytes the wire rows would
    have given.

    Example:
      >>> # inside jax.shard_map over 'expert', with plan = build_plan(ids, ...):
      >>> # ex, wire, sizes, plan = dispatch_tokens(x, plan, dispatch_dtype='fp8')
    """
    k = plan.top_k
    block_size = plan.block_size
    local = with_wire and plan.axis_size == 1  # nothing is sent: the rows come from the tokens
    with jax.named_scope("dispatch_exchange"):
        x = vary_like(x, plan)
        wire = wire_for(dispatch_dtype, x.dtype, block_size, plan.wire_implementation)
        rows = two_stage_rows if isinstance(plan, TwoStagePlan) else dispatch_rows
        out = rows(x, plan, wire, with_wire and not local)
    if local:
        tokens = jax.lax.div(plan.send_slot, jnp.int32(k))  # slot T * k: token T, a zero row
        wire_rows = WireRows(collectives.TokenRows(x, tokens), x.shape[-1], block_size)
        return Dispatched(out, wire_rows, plan.group_sizes, plan)
    if with_wire:
        return Dispatched(out.rows, WireRows(out.wire, x.shape[-1], block_size),
                          plan.group_sizes, plan)
    return Dispatched(out, None, plan.group_sizes, plan)


def combine_tokens(expert_y: jax.Array, weights: jax.Array, plan: DispatchPlan,
                   grad_wire: WireDtype) -> jax.Array:
    """``expert_y`` sent back to its tokens, weighted by ``weights [T, k]`` and summed over the
    ``k`` choices (:func:`combine_rows`), the arguments already checked (:func:`moe.combine`
    checks them for its callers).

    Example:
      >>> # inside jax.shard_map, after dispatch_tokens: y = combine_tokens(ey, w, plan, None)
    """
    with jax.named_scope("combine"):
        expert_y, weights = (vary_like(expert_y, weights, plan),
                             vary_like(weights, expert_y, plan))
        if isinstance(plan, TwoStagePlan):
            return two_stage_combine(expert_y, weights, plan, grad_wire)
        return combine_rows(expert_y, weights, plan, grad_wire)
