"""Expert-parallel token dispatch and combine, for use inside ``jax.shard_map``.

Device ``i`` of the expert axis (size ``P``) owns global experts
``[i * E_local, (i + 1) * E_local)``, ``E_local = num_experts // P``. :func:`dispatch` sorts
this device's token slots by expert, exchanges counts and then the tokens (optionally as FP8),
and hands the local experts their rows; :func:`combine` sends expert outputs back, un-permutes
them, weights them and sums over the ``k`` choices. Both carry custom VJPs whose backward
passes are the opposite exchange (the combine gradient optionally in FP8 too).

Layouts (``C`` = per-(source, expert) capacity, ``R`` = :func:`moe._plan.ragged_rows`):

* ``'dense'``: ``expert_x[l, p * C + r]`` is the ``r``-th kept slot that source ``p`` routed to
  local expert ``l``; padding rows are zero. Feed a batched einsum ``'ecd,edf->ecf'``.
* ``'ragged'`` and ``'dropless'``: ``expert_x [R, d]`` holds local expert 0's rows (source
  0's, then source 1's, ...), then expert 1's, ...; rows past ``sum(group_sizes)`` are zero.
  Feed ``jax.lax.ragged_dot(expert_x, w, group_sizes)``. ``R = P * T * min(k, E_local)`` is
  the worst case; with ``P > 1`` most of it is padding in a balanced step, which the expert
  GEMMs pay for in zero stores (``P = 1``: ``R = T * k``, no padding).

Transports: ``'dense'`` exchanges ``[E, C]`` capacity-padded rows with ``all_to_all`` and drops
the slots past ``C``. ``'ragged'`` sends exactly the routed rows with ``ragged_all_to_all``.
``'dropless'`` sends, to every device, its slots in a ``[P, c]`` buffer with one
``all_to_all``, ``c`` the smallest of a few static bucket sizes
(:func:`moe._plan.dropless_buckets`: ``capacity_factor`` times the balanced share, growing
1.5x, at most 8, up to the worst case) that holds the fullest (source, destination) pair of
the step. The plan all-gathers the counts, so every device of the expert axis picks the
same bucket and one ``lax.switch`` branch per exchange runs: no slot is ever dropped, and no
second exchange is needed when a pair overflows the first bucket (a larger bucket is taken
instead). The received rows are laid out into the ragged layout in one gather (+ decode)
pass; the same bytes as ``'ragged'``, bit for bit. With one device on the expert axis no
transport exchanges anything (not even the counts): the send buffer is the expert layout.

Data movement per call (``S = T * k`` slots, ``N`` send rows; ``P * c`` for dropless): the
plan sorts ``S`` packed int32 keys once, for forward and backward (no pass over token rows);
FP8 quantizes the ``T`` tokens once and gathers their e4m3 + scale bytes into the send buffer
(never quantizing the ``N``-row buffer); the receive side dequantizes and lays out the expert
rows in one pass; combine's un-permute, weighting and sum over ``k`` are ``k`` row gathers
feeding one elementwise f32 sum (no ``[T, k, d]`` intermediate, no batched dot with a
contraction of size ``k``), and its backward reads the router gradient's rows straight from
the returned buffer (kept as the residual unless it is over twice the ``[T, k, d]`` slots,
e.g. dense dropless, or its shape depends on the dropless bucket: then the ``[T, k, d]`` slot
rows are kept). Combine's gradient builds its send rows ``weight * dy`` inside the gather; as
FP8 its scales come from ``dy``'s block maxima (``T`` rows) times ``|weight|`` (exact,
:func:`moe.fp8.quantize_with_amax`), so weighting, quantizing and gathering are one pass with
no ``[T * k, d]`` rows. Dropless passes over rows, forward: send gather (``P * c``),
exchange, layout gather (``R``); return gather from the layout (``P * c``), exchange, sum over
``k`` (``T``) + residual slot rows (``S``). Backward: the mirror image. With ``P = 1``: one
gather into the layout (``S``), and the sums over ``k`` straight from it.

Transport choice: here ``'auto'`` is ``'dense'``; the layer's ``'auto'``
(:func:`moe.auto_transport`) also picks ``'dropless'`` on one Hopper GPU. On 2x H200 (jax
0.11.2) ``all_to_all`` moved 153 GB/s per GPU but ``ragged_all_to_all`` 2.6 GB/s
(BENCHMARKS.md).

References: DeepEP (FP8 dispatch, count exchange first); GShard / Switch Transformer
(capacity, deterministic dropping); MaxText's ragged MoE (``ragged_all_to_all`` +
``ragged_dot``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from moe import _transport, _wire_pallas, fp8
from moe._plan import (
    AxisName,
    DispatchPlan,
    build_plan,
    dense_capacity,
    dropless_buckets,
    ragged_rows,
)

__all__ = ["DispatchPlan", "combine", "dense_capacity", "dispatch", "ragged_rows"]

Transport = Literal["dense", "ragged", "dropless", "auto"]
_DROPLESS_CAPACITY_FACTOR = 1.25  # transport="dropless", capacity_factor=None: the first bucket
WireDtype = Literal["bf16", "fp8"] | None


@dataclasses.dataclass(frozen=True)
class _Wire:
    """Static wire format of one direction: ``'fp8'`` or a dtype name; decoded to ``out``;
    ``kernels``: who encodes/gathers and decodes/lays out the rows (``_transport.by_platform``)."""

    wire: str
    out: str
    block_size: int
    kernels: str = "xla"

    @property
    def codec(self):
        return "fp8" if self.wire == "fp8" else jnp.dtype(self.wire)

    def decode(self, buf: jax.Array, width: int) -> jax.Array:
        """Wire rows ``[..., wire width]`` -> ``self.out[..., width]``."""
        return _transport.decode_rows(buf, wire=self.codec, width=width,
                                      block_size=self.block_size, out_dtype=self.out)


def _wire_for(name: WireDtype, dtype: jnp.dtype, block_size: int, kernels: str = "xla") -> _Wire:
    if name == "fp8":
        return _Wire("fp8", "bfloat16", block_size, kernels)
    wire = "bfloat16" if name == "bf16" else jnp.dtype(dtype).name
    return _Wire(wire, wire, block_size, kernels)


# ----------------------------------------------------------------------------- data movement


def _by_bucket(plan: DispatchPlan, fn, *args):
    """``fn(c, *args)`` with ``c`` the dropless exchange capacity ``plan.buckets[plan.bucket]``:
    a ``lax.switch`` over the static buckets (every device of the expert axis takes the same
    branch: the index comes from the all-gathered counts), or a plain call for one bucket."""
    if len(plan.buckets) == 1:
        return fn(plan.buckets[0], *args)
    return jax.lax.switch(plan.bucket, [functools.partial(fn, c) for c in plan.buckets], *args)


def _pair_head(a: jax.Array, plan: DispatchPlan, c: int) -> jax.Array:
    """The first ``c`` entries of every pair block of ``a [P * W]``: ``[P * c]``."""
    return a.reshape(plan.axis_size, -1)[:, :c].reshape(-1)


def _pair_to_row(v: jax.Array, plan: DispatchPlan, c: int) -> jax.Array:
    """Pair rows ``q * W + r`` -> rows ``q * c + r`` of a ``[P, c]`` buffer (``P * c`` where
    ``v`` is out of range)."""
    w, p = plan.pair_width, plan.axis_size
    if c == w:
        return v
    q, r = jax.lax.div(v, jnp.int32(w)), jax.lax.rem(v, jnp.int32(w))  # v >= 0
    return jnp.where(v < p * w, q * c + r, p * c)


def _take_rows(rows: jax.Array, index: jax.Array) -> jax.Array:
    """``rows[index]``, a zero row where ``index`` is out of range."""
    return jnp.take(rows, index, axis=0, mode="fill", fill_value=0)


def _dense_to_layout(recv: jax.Array, plan: DispatchPlan, w: _Wire, width: int) -> jax.Array:
    """Received rows ``[P src * E_local * C, W]`` -> decoded expert layout ``[E_local, P * C,
    width]``: XLA decodes and transposes; the Pallas kernel reads each expert-layout row from
    its source row (a permutation index) and decodes it in the same pass. With ``P = 1`` the
    rows already are the layout (decode only)."""
    p, el, c = plan.axis_size, plan.num_local_experts, plan.capacity

    def xla(recv):
        out = w.decode(recv, width)
        out = out.reshape(p, el, c, width)
        return out.transpose(1, 0, 2, 3).reshape(plan.expert_shape(width))

    def pallas(interpret, recv):
        # expert-layout row (l, q, r) <- received row (q, l, r)
        src = jax.lax.broadcasted_iota(jnp.int32, (el, p, c), 1) * (el * c) \
            + jax.lax.broadcasted_iota(jnp.int32, (el, p, c), 0) * c \
            + jax.lax.broadcasted_iota(jnp.int32, (el, p, c), 2)
        out = _wire_pallas.gather_decode(
            recv, src.reshape(-1), width=width, fp8_wire=w.wire == "fp8",
            block_size=w.block_size, out_dtype=w.out, interpret=interpret)
        return out.reshape(plan.expert_shape(width))

    ok = p > 1 and _wire_pallas.supported(width, fp8_wire=w.wire == "fp8",
                                          block_size=w.block_size)
    return _transport.by_platform((recv,), xla=xla, pallas=pallas if ok else None,
                                  kernels=w.kernels)


def _pairs_to_layout(recv: jax.Array, plan: DispatchPlan, c: int, w: _Wire, width: int):
    """Dropless: received rows ``[P src * c, W]`` -> decoded expert layout ``[R, width]``
    (row ``i`` <- received row ``plan.pair_row[i]``; padding rows zero), one gather + decode
    pass (the Pallas kernel, or XLA's gather of the wire words then decode). With ``P = 1``
    the received rows already are the layout."""
    if plan.axis_size == 1:
        return w.decode(recv, width)
    index = _pair_to_row(plan.pair_row, plan, c)

    def xla(recv, index):
        return w.decode(_take_rows(recv, index), width)

    def pallas(interpret, recv, index):
        return _wire_pallas.gather_decode(
            recv, index, width=width, fp8_wire=w.wire == "fp8", block_size=w.block_size,
            out_dtype=w.out, interpret=interpret)

    ok = _wire_pallas.supported(width, fp8_wire=w.wire == "fp8", block_size=w.block_size)
    return _transport.by_platform((recv, index), xla=xla, pallas=pallas if ok else None,
                                  kernels=w.kernels)


def _to_experts(encode, plan: DispatchPlan, w: _Wire, width: int) -> jax.Array:
    """Dispatch direction: ``encode(slots)`` builds the wire rows (format ``w``) carrying the
    slots ``slots`` (int32; ``T * k`` gives a zero row); exchange; return the expert layout
    decoded to ``w.out``. No collective runs when the expert axis has one device."""
    if plan.transport == "dropless":
        def bucket(c):
            send = encode(_pair_head(plan.send_slot, plan, c))  # [P dst * c, W]
            recv = _transport.dense_exchange(send, plan.axis_name)
            return _pairs_to_layout(recv, plan, c, w, width)

        return _by_bucket(plan, bucket)
    send = encode(plan.send_slot)
    if plan.transport == "dense":
        recv = _transport.dense_exchange(send, plan.axis_name)  # [P src, E_local, C, W]
        return _dense_to_layout(recv, plan, w, width)
    if plan.axis_size == 1:
        recv = send  # sorted by expert: already the layout (R = T * k rows)
    else:
        recv = jnp.zeros_like(send, shape=(plan.capacity, send.shape[-1]))  # varies like send
        recv = _transport.ragged_exchange(
            send, recv, plan.send_offsets, plan.send_counts, plan.remote_offsets,
            plan.recv_counts.reshape(-1), axis_name=plan.axis_name, impl=plan.ragged_impl,
        )
    return w.decode(recv, width)


def _return_trip(expert_rows: jax.Array, plan: DispatchPlan) -> jax.Array:
    """Combine direction, dense and ragged: expert layout -> the returned rows ``[N, width]``
    on the source (:func:`_back_row` gives the row of slot ``(t, j)``; rows of dropped slots
    are never read). No collective when the expert axis has one device.

    Dense: one all-to-all that splits the expert layout's second axis (``[E_local, P * C]``:
    block ``q`` of it goes to device ``q``) and concatenates what arrives along it, so no
    transpose into a destination-major buffer runs first (on H200 that transpose took 0.44 ms
    of a 2.4 ms dispatch + combine); returned row ``(l, q, r)`` is the result of local expert
    ``l`` of device ``q`` for this source's ``r``-th row sent there."""
    width = expert_rows.shape[-1]
    if plan.transport == "dense":
        p, el, c = plan.axis_size, plan.num_local_experts, plan.capacity
        rows = expert_rows.reshape(el, p * c, width)
        back = _transport.dense_exchange(rows, plan.axis_name, axis=1)
        return back.reshape(-1, width)
    if plan.axis_size == 1:
        return expert_rows  # R = T * k rows in sorted order: the send buffer's rows
    back = jnp.zeros_like(expert_rows, shape=(plan.send_slot.shape[0], width))
    return _transport.ragged_exchange(
        expert_rows, back, plan.recv_offsets, plan.recv_counts.reshape(-1),
        plan.return_offsets, plan.send_counts, axis_name=plan.axis_name,
        impl=plan.ragged_impl,
    )


def _back_row(plan: DispatchPlan, j: int) -> jax.Array:
    """int32 ``[T]``: the row of :func:`_return_trip`'s result holding slot ``(t, j)`` (out of
    range for a dropped slot). Ragged: ``plan.slot_row``. Dense: ``slot_row = e * C + r``
    (global expert ``e = q * E_local + l``) becomes ``(l * P + q) * C + r``. Dropless with
    one bucket ``c``: pair row ``q * W + r`` becomes ``q * c + r``."""
    sr = plan.slot_row[:, j]
    if plan.transport == "dropless":
        return _pair_to_row(sr, plan, plan.buckets[0])
    if plan.transport != "dense":
        return sr
    p, el, c = plan.axis_size, plan.num_local_experts, plan.capacity
    e, r = sr // c, sr % c
    n = plan.num_experts * c
    return jnp.where(sr < n, ((e % el) * p + e // el) * c + r, n)


def _from_experts(expert_rows: jax.Array, plan: DispatchPlan, reduce):
    """Combine direction: send the expert layout back to the sources and return ``reduce(back,
    row)``, ``back`` the returned rows and ``row(j)`` (int32 ``[T]``) the row of ``back``
    holding slot ``(t, j)``. Dropless: the rows for each source are gathered from the layout
    into a ``[P, c]`` buffer, exchanged, and reduced inside the bucket's branch (``back``'s
    shape depends on the bucket, so ``reduce`` must return arrays of fixed shapes)."""
    if plan.transport != "dropless":
        return reduce(_return_trip(expert_rows, plan), functools.partial(_back_row, plan))

    def bucket(c):
        back = expert_rows  # P = 1: the layout is the source's sorted slots
        if plan.axis_size > 1:
            send = _transport.gather_rows(
                expert_rows, _pair_head(plan.layout_row, plan, c),
                wire=jnp.dtype(expert_rows.dtype), block_size=plan.block_size,
                kernels=plan.wire_kernels)
            back = _transport.dense_exchange(send, plan.axis_name)
        return reduce(back, lambda j: _pair_to_row(plan.slot_row[:, j], plan, c))

    return _by_bucket(plan, bucket)


def _sum_slots(back: jax.Array, row, top_k: int, weights: jax.Array | None) -> jax.Array:
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
    if plan.transport == "dropless":
        if len(plan.buckets) > 1:
            return False
        rows = plan.axis_size * plan.buckets[0]
    return rows <= 2 * plan.num_tokens * plan.top_k


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dispatch_rows(x: jax.Array, plan: DispatchPlan, w: _Wire) -> jax.Array:
    def encode(slots):
        tok = jax.lax.div(slots, jnp.int32(plan.top_k))  # slots are >= 0
        return _transport.gather_rows(x, tok, wire=w.codec,
                                      block_size=w.block_size, kernels=w.kernels)

    return _to_experts(encode, plan, w, x.shape[-1])


def _dispatch_rows_fwd(x, plan, w):
    return _dispatch_rows(x, plan, w), plan


def _dispatch_rows_bwd(w, plan, ct):
    # Combine-direction exchange of the cotangent, summed over the k slots of each token.
    dx = _from_experts(ct, plan, lambda back, row: _sum_slots(back, row, plan.top_k, None))
    return dx.astype(plan.x_dtype), None


_dispatch_rows.defvjp(_dispatch_rows_fwd, _dispatch_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine_rows(expert_y, weights, plan, grad_wire: WireDtype):
    return _combine_rows_fwd(expert_y, weights, plan, grad_wire)[0]


def _combine_rows_fwd(expert_y, weights, plan, grad_wire):
    w32 = weights.astype(jnp.float32)

    def reduce(back, row):
        y = _sum_slots(back, row, plan.top_k, w32)
        if _keep_return_buffer(plan):
            return y, back  # [N, width]: read again by the backward's gathers
        return y, jnp.stack([_take_rows(back, row(j)) for j in range(plan.top_k)], axis=1)

    with jax.named_scope("combine_weighted_sum"):
        y, rows = _from_experts(expert_y, plan, reduce)
    return y.astype(plan.x_dtype), (rows, weights, plan)


def _combine_rows_bwd(grad_wire, res, dy):
    rows, weights, plan = res
    y_dtype = rows.dtype  # expert_y's dtype: the return trip keeps it
    dy32 = dy.astype(jnp.float32)
    with jax.named_scope("combine_grad_weights"):
        # Exact router gradient: <dy[t], expert output of slot (t, j)>; 0 for dropped slots.
        dw = jnp.stack([
            jnp.sum(dy32 * (_take_rows(rows, _back_row(plan, j)) if rows.ndim == 2
                            else rows[:, j]).astype(jnp.float32), axis=-1)
            for j in range(plan.top_k)], axis=1)
    # Send row i carries weights[s] * dy[s // k] (s = its slot), encoded: for FP8 the scales
    # come from dy's block maxima (T rows) times |weight|, so no [T * k, d] rows exist.
    w = _wire_for(grad_wire, y_dtype, plan.block_size, plan.wire_kernels)

    def encode(slots):
        return _transport.gather_weighted_rows(
            dy, weights.reshape(-1), slots, top_k=plan.top_k, wire=w.codec,
            block_size=w.block_size)

    d_expert_y = _to_experts(encode, plan, w, dy.shape[-1]).astype(y_dtype)
    return d_expert_y, dw.astype(weights.dtype), None


_combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


def _vary_like(x: jax.Array, *others) -> jax.Array:
    """``x``, typed by ``shard_map`` as varying over every mesh axis any leaf of ``others``
    varies over (adds a zero scalar; a no-op outside ``shard_map``). The custom VJPs need
    their inputs to vary like their cotangents, which come out of collectives."""
    zero = jnp.zeros((), x.dtype)
    for leaf in jax.tree.leaves(others):
        zero = zero + jnp.zeros_like(leaf, shape=(), dtype=x.dtype)
    return x + zero


# ----------------------------------------------------------------------------- validation


def _axis_size(axis_name: AxisName, fn: str) -> int:
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as err:
        raise ValueError(
            f"axis_name={axis_name!r} is not a bound mesh axis ({err}); call {fn} inside "
            "jax.shard_map over a mesh that has this axis, and pass the expert axis's name."
        ) from None


def _check_wire(name, arg: str) -> None:
    if name not in (None, "bf16", "fp8"):
        raise ValueError(f"{arg} must be None, 'bf16' or 'fp8', got {name!r}.")


def _check_fp8_width(width: int, block_size: int, what: str) -> None:
    fp8.check_width(width, block_size, what=what)
    if width % 4:
        raise ValueError(
            f"{what} = {width} must be a multiple of 4 for the FP8 wire (e4m3 bytes travel four "
            "to a 32-bit word); pad it, or use the bf16 wire."
        )


def _check_dispatch_args(x, expert_ids, num_experts, transport, capacity_factor,
                         capacity_multiple, dispatch_dtype, block_size, p):
    if transport not in ("dense", "ragged", "dropless", "auto"):
        raise ValueError(
            f"transport must be 'dense', 'dropless', 'ragged' or 'auto', got {transport!r}; "
            "'auto' (dense) is the measured default."
        )
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"x must be a float array [T, d_model] of this device's tokens, got shape "
            f"{x.shape} dtype {x.dtype}; reshape [batch, seq, d] to [batch * seq, d]."
        )
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise TypeError(f"expert_ids must be integer, got {expert_ids.dtype}; pass top-k indices.")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"expert_ids must be [T, top_k] with T = x.shape[0] = {x.shape[0]}, got shape "
            f"{expert_ids.shape}."
        )
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
        raise TypeError(f"num_experts must be a Python int, got {type(num_experts).__name__}.")
    if num_experts <= 0 or num_experts % p:
        raise ValueError(
            f"num_experts = {num_experts} must be a positive multiple of the expert-axis size "
            f"{p}; choose num_experts divisible by {p} or a smaller expert axis."
        )
    k = expert_ids.shape[1]
    if not 1 <= k <= num_experts:
        raise ValueError(
            f"top_k = expert_ids.shape[1] = {k} must be in [1, num_experts = {num_experts}]; "
            "lower top_k or add experts."
        )
    if capacity_factor is not None:
        if transport == "ragged":
            raise ValueError(
                "capacity_factor applies to transport='dense' (a drop limit) and 'dropless' "
                "(the exchange buffer), not 'ragged' (worst-case buffers); pass "
                "capacity_factor=None, or transport='dense' or 'dropless'."
            )
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
            raise TypeError(f"capacity_factor must be a float or None, got {capacity_factor!r}.")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor}.")
    if isinstance(capacity_multiple, bool) or not isinstance(capacity_multiple, int) \
            or capacity_multiple < 1:
        raise ValueError(f"capacity_multiple must be an int >= 1, got {capacity_multiple!r}.")
    _check_wire(dispatch_dtype, "dispatch_dtype")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}; use 128.")
    if dispatch_dtype == "fp8":
        _check_fp8_width(x.shape[1], block_size, "d_model (x.shape[-1])")


# ----------------------------------------------------------------------------- public API


def dispatch(
    x: jax.Array,
    expert_ids: jax.Array,
    *,
    num_experts: int,
    axis_name: AxisName,
    transport: Transport = "auto",
    capacity_factor: float | None = None,
    capacity_multiple: int = 8,
    dispatch_dtype: WireDtype = None,
    block_size: int = 128,
    ragged_impl: _transport.RaggedImpl = "auto",
    wire_kernels: _transport.WireKernels = "auto",
) -> tuple[jax.Array, jax.Array, DispatchPlan]:
    """Send each token slot to the device that owns its expert, grouped by local expert.

    ``expert_x[row(t, j)] = x[t]`` for every kept slot ``(t, j)`` with ``expert_ids[t, j]`` on
    this device; dense keeps, per (source, expert), the first ``C`` slots in (t, j) order.
    Must run inside ``jax.shard_map`` with ``axis_name`` bound (other mesh axes, e.g. a batch
    axis ``'data'``, may be bound too; only ``axis_name`` is exchanged over).

    Args:
      x: ``[T, d_model]`` this device's tokens (float).
      expert_ids: int ``[T, k]`` global expert ids, distinct per token (as from ``top_k``).
      num_experts: global expert count ``E`` (a multiple of the ``axis_name`` size ``P``).
      axis_name: expert-parallel mesh axis name (or tuple of names).
      transport: ``'dense'`` (capacity-padded ``all_to_all``, drops over capacity),
        ``'dropless'`` (``all_to_all`` of per-(source, destination) buffers sized per step
        from a few static buckets, :func:`moe._plan.dropless_buckets`; never drops),
        ``'ragged'`` (dropless ``ragged_all_to_all``, emulated where XLA lacks it) or
        ``'auto'`` (= ``'dense'``, per the measurements in BENCHMARKS.md). ``'dropless'`` and
        ``'ragged'`` produce the same expert layout, bit for bit. With one device on
        ``axis_name`` no transport exchanges anything.
      capacity_factor: dense: ``C = ceil(capacity_factor * T * k / E)`` rounded up to
        ``capacity_multiple`` (capped at ``T``), slots past ``C`` per (source, expert) are
        dropped; None means ``C = T``, dropless. Dropless: the first bucket's rows per
        (source, destination) pair over the balanced share ``T * k / P`` (None: 1.25);
        larger buckets (1.5x each, at most 8, up to the worst case ``T * min(k, E_local)``)
        are taken when a pair needs them, so nothing is dropped. Not for ``'ragged'``.
      capacity_multiple: rounding of the dense capacity and of the dropless buckets
        (default 8).
      dispatch_dtype: wire format: None (``x.dtype``), ``'bf16'``, or ``'fp8'`` (e4m3 +
        packed E8M0 scales, dequantized to bf16 on arrival; ``d_model`` must be a multiple of
        ``block_size``).
      block_size: FP8 channels per scale.
      ragged_impl: ``'ragged'`` only: ``'auto'`` (native on GPU/TPU, emulated elsewhere),
        ``'native'``, ``'emulated'``.
      wire_kernels: who builds the send buffer (gather + encode) and, for the dense and
        dropless transports, decodes the received rows into the expert layout (and, for
        dropless, gathers the return trip's rows): ``'auto'`` (the Pallas
        kernels of ``moe._wire_pallas`` when lowered for NVIDIA GPUs, XLA elsewhere),
        ``'xla'``, or ``'pallas'`` (interpreted, slowly, on CPU). Same bytes either way.

    Returns:
      ``(expert_x, group_sizes, plan)``: ``expert_x`` dense ``[E_local, P * C, d_model]`` or
      ragged / dropless ``[R, d_model]`` (dtype: ``x.dtype``, or bf16 for ``'bf16'``/``'fp8'``);
      ``group_sizes`` int32 ``[E_local]`` valid rows per local expert; ``plan`` a
      :class:`DispatchPlan` for :func:`combine` (``plan.dropped``: slots dropped here).

    Example:
      >>> def layer(x, ids, w, wgu, wd):  # inside jax.shard_map over 'expert'
      ...     ex, sizes, plan = dispatch(x, ids, num_experts=8, axis_name='expert')
      ...     return combine(swiglu(ex, wgu, wd), w, plan)

    References:
      DeepEP; GShard / Switch Transformer capacity; MaxText ragged MoE.
    """
    x, expert_ids = jnp.asarray(x), jnp.asarray(expert_ids)
    p = _axis_size(axis_name, "dispatch")
    _check_dispatch_args(x, expert_ids, num_experts, transport, capacity_factor,
                         capacity_multiple, dispatch_dtype, block_size, p)
    _transport.check_wire_kernels(wire_kernels)
    transport = "dense" if transport == "auto" else transport
    t, k = expert_ids.shape
    impl = _transport.resolve_ragged_impl(ragged_impl) if transport == "ragged" else "native"
    buckets = ()
    if transport == "dense":
        capacity = dense_capacity(t, k, num_experts, capacity_factor,
                                  multiple=capacity_multiple)
    else:
        capacity = ragged_rows(t, k, num_experts, p)
    if transport == "dropless":
        factor = _DROPLESS_CAPACITY_FACTOR if capacity_factor is None else capacity_factor
        buckets = dropless_buckets(t, k, num_experts, p, factor, multiple=capacity_multiple)
    with jax.named_scope("dispatch_plan"):
        plan = build_plan(
            expert_ids, num_experts=num_experts, axis_name=axis_name, axis_size=p,
            transport=transport, capacity=capacity, ragged_impl=impl,
            x_dtype=jnp.dtype(x.dtype).name, block_size=block_size,
            wire_kernels=wire_kernels, buckets=buckets,
        )
    with jax.named_scope("dispatch_exchange"):
        x = _vary_like(x, plan)
        expert_x = _dispatch_rows(
            x, plan, _wire_for(dispatch_dtype, x.dtype, block_size, plan.wire_kernels))
    return expert_x, plan.group_sizes, plan


def combine(
    expert_y: jax.Array,
    weights: jax.Array,
    plan: DispatchPlan,
    *,
    combine_grad_dtype: WireDtype = None,
) -> jax.Array:
    """Send expert outputs back to their tokens and take the weighted sum over the k choices.

    ``y[t] = sum_j weights[t, j] * expert_y[row(t, j)]`` (dropped slots contribute 0), computed
    in f32 and returned in the dispatched ``x``'s dtype. Gradients: ``d expert_y`` is the
    weighted cotangent ``weights[t, j] * dy[t]`` sent in the dispatch direction (as FP8 when
    ``combine_grad_dtype='fp8'``); ``d weights[t, j] = <dy[t], expert_y[row(t, j)]>``, exact.

    Args:
      expert_y: expert outputs in the layout :func:`dispatch` produced (last dim may differ
        from ``d_model``), as a float array. The return trip uses its dtype.
      weights: ``[T, k]`` router weights (f32).
      plan: the :class:`DispatchPlan` from the matching :func:`dispatch`.
      combine_grad_dtype: wire format of the backward exchange: None (``expert_y.dtype``),
        ``'bf16'`` or ``'fp8'`` (needs ``expert_y.shape[-1]`` a multiple of
        ``plan.block_size``).

    Returns:
      ``y [T, expert_y.shape[-1]]`` in the dispatched ``x``'s dtype.

    Example:
      >>> # inside jax.shard_map, after ex, sizes, plan = dispatch(...):
      >>> # y = combine(experts(ex), weights, plan, combine_grad_dtype='fp8')

    References:
      DeepEP combine; GShard / Switch Transformer (dropped slots contribute 0).
    """
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan must be the DispatchPlan returned by dispatch, got {type(plan)}.")
    expert_y, weights = jnp.asarray(expert_y), jnp.asarray(weights)
    _check_wire(combine_grad_dtype, "combine_grad_dtype")
    want = plan.expert_shape(expert_y.shape[-1] if expert_y.ndim else 0)
    if expert_y.shape != want or not jnp.issubdtype(expert_y.dtype, jnp.floating):
        raise ValueError(
            f"expert_y must be a float array in dispatch's layout {want}, got shape "
            f"{expert_y.shape} dtype {expert_y.dtype}; keep the expert outputs' leading axes."
        )
    if weights.shape != (plan.num_tokens, plan.top_k):
        raise ValueError(
            f"weights must be [T, k] = {(plan.num_tokens, plan.top_k)}, got {weights.shape}."
        )
    if combine_grad_dtype == "fp8":
        _check_fp8_width(expert_y.shape[-1], plan.block_size, "expert_y.shape[-1]")
    _axis_size(plan.axis_name, "combine")
    with jax.named_scope("combine"):
        expert_y, weights = _vary_like(expert_y, weights, plan), _vary_like(weights, expert_y, plan)
        return _combine_rows(expert_y, weights, plan, combine_grad_dtype)
