"""The dispatch plans: where every token slot goes, one plan type per transport.

A *slot* is one (token, choice) pair ``s = t * k + j`` of the local ``expert_ids [T, k]``.
Slots are ordered by (expert, t, j) with a stable sort; within each expert, the first slots in
(t, j) order are the ones kept when a capacity limit applies (GShard / Switch rule).
:class:`DensePlan`, :class:`RaggedPlan` and :class:`DroplessPlan` hold what
:func:`moe.dispatch.combine` and the backward passes need for their transport
(:data:`DispatchPlan` is their union); ``moe.dispatch.plan_build`` builds them, and the static sizes
(capacity, rows, buckets) come from the functions here.

References: GShard and Switch Transformer (capacity and dropping), DeepEP (count exchange
before payload exchange), MaxText's ragged MoE (sorted-by-expert send buffers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp

from accel_kernels.gmm import api as gmm_api

if TYPE_CHECKING:
    from moe.options import ResolvedOptions

AxisName = str | tuple[str, ...]
PlanTransport = Literal["dense", "ragged", "dropless"]

DROPLESS_CAPACITY_FACTOR = 1.25
"""The dropless transport's first-bucket factor when ``capacity_factor`` is None: a quarter
over the balanced share, so that a step of ordinary imbalance sends its one first exchange."""


def _static():
    return dataclasses.field(metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class PlanBase:
    """What every plan holds: the slots' send-buffer rows and the routing counts.

    ``N`` below is the number of send-buffer rows of the plan's transport (see each class).
    Plans are registered pytrees (int arrays are leaves; the static layout is metadata), so
    they can be returned from ``jax.shard_map`` and passed through ``jax.jit``.

    Attributes:
      send_slot: int32 ``[N]``, the slot ``t * k + j`` carried by each send-buffer row
        (``T * k`` marks a padding row). Send buffers are destination-major.
      slot_row: int32 ``[T, k]``, the send-buffer row of each slot (``N`` if dropped).
      send_counts: int32 ``[E]``, slots of this device routed to each global expert (before
        any capacity limit).
      recv_counts: int32 ``[P, E_local]``, slots that source device ``p`` routes to each local
        expert (before any capacity limit).
      group_sizes: int32 ``[E_local]``, valid rows per local expert in the expert layout.
      num_experts: global number of experts ``E``.
      axis_name: the expert-parallel mesh axis (or axes).
      axis_size: ``P``, the size of ``axis_name``.
      x_dtype: dtype name of the dispatched tokens (combine returns this dtype).
      block_size: FP8 block size (used by an FP8 combine gradient).
      wire_implementation: ``'auto'``, ``'xla'``, ``'triton'`` or ``'mosaic'``: who encodes
        and lays out the rows of both dispatch-direction exchanges (`accel_kernels.wire.api`).
    """

    transport: ClassVar[PlanTransport]

    send_slot: jax.Array
    slot_row: jax.Array
    send_counts: jax.Array
    recv_counts: jax.Array
    group_sizes: jax.Array
    num_experts: int = _static()
    axis_name: AxisName = _static()
    axis_size: int = _static()
    x_dtype: str = _static()
    block_size: int = _static()
    wire_implementation: str = _static()

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
    def kept(self) -> jax.Array:
        """bool ``[T, k]``, False for slots dropped by the capacity limit."""
        return self.slot_row < self.send_slot.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DensePlan(PlanBase):
    """The ``'dense'`` transport's plan: ``[E, C]`` capacity-padded send buffers.

    ``N = num_experts * capacity``: send-buffer row ``e * capacity + r`` is the ``r``-th kept
    slot of global expert ``e`` (see :class:`PlanBase` for the shared fields).

    Attributes:
      dropped: int32 ``[]``, slots of this device dropped by the capacity limit.
      capacity: ``C``, rows per (source, expert) (:func:`dense_capacity`).

    Example:
      >>> # inside shard_map: dense_plan(ids, num_experts=8, capacity=16, ...).expert_shape(64)
    """

    transport: ClassVar[PlanTransport] = "dense"

    dropped: jax.Array
    capacity: int = _static()

    def expert_shape(self, width: int) -> tuple[int, ...]:
        """Shape of the expert layout with rows of ``width``: ``[E_local, P * C, width]``."""
        return (self.num_local_experts, self.axis_size * self.capacity, width)


@dataclasses.dataclass(frozen=True)
class RaggedLayoutPlan(PlanBase):
    """The ragged expert layout ``[R, width]`` that ``'ragged'`` and ``'dropless'`` share:
    local expert 0's rows (source 0's, then source 1's, ...), then expert 1's, ...; nothing is
    dropped."""

    @property
    def dropped(self) -> jax.Array:
        """int32 ``[]``: 0, every slot is kept."""
        return jnp.zeros((), jnp.int32)

    @property
    def rows(self) -> int:
        """``R = P * T * min(k, E_local)`` (:func:`ragged_rows`): the worst-case layout rows."""
        return ragged_rows(self.num_tokens, self.top_k, self.num_experts, self.axis_size)

    @property
    def layout_rows(self) -> int:
        """Rows of the expert layout: ``R``."""
        return self.rows

    def expert_shape(self, width: int) -> tuple[int, ...]:
        """Shape of the expert layout with rows of ``width``: ``[layout_rows, width]``."""
        return (self.layout_rows, width)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedPlan(RaggedLayoutPlan):
    """The ``'ragged'`` transport's plan: exactly the routed rows, by ``ragged_all_to_all``.

    ``N = T * k``: the send buffer holds all slots sorted by (expert, t, j) (see
    :class:`PlanBase` for the shared fields).

    Attributes:
      send_offsets: int32 ``[E]``: first send-buffer row of each global expert.
      remote_offsets: int32 ``[E]``: row on expert ``e``'s owner where this device's slice for
        ``e`` lands.
      recv_offsets: int32 ``[P * E_local]``: row of this device's expert layout where the
        slice from source ``p`` for local expert ``l`` starts (index ``p * E_local + l``).
      return_offsets: int32 ``[P * E_local]``: send-buffer row on source ``p`` where its slice
        for local expert ``l`` started (where results go back to).
      exchange_implementation: ``'native'`` or ``'emulated'`` ``ragged_all_to_all``.
    """

    transport: ClassVar[PlanTransport] = "ragged"

    send_offsets: jax.Array
    remote_offsets: jax.Array
    recv_offsets: jax.Array
    return_offsets: jax.Array
    exchange_implementation: Literal["native", "emulated"] = _static()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DroplessPlan(RaggedLayoutPlan):
    """The ``'dropless'`` transport's plan: bucketed ``[P, c]`` all-to-all exchanges.

    Buffers are indexed by *pair rows*: row ``q * W + r`` is the ``r``-th row between this
    device and device ``q`` in a worst-case ``[P, W]`` buffer, ``W = T * min(k, E_local)``
    (:attr:`pair_width`), so ``N = R = P * W``: send-buffer pair row ``q * W + r`` is the
    ``r``-th of this device's slots for device ``q``, in (expert, t, j) order. The exchange
    sends only the first ``c`` rows of each block, ``c`` one of ``buckets``: the first ``c_0``
    in one exchange, the rest (``c - c_0``) in a second one when a pair needs them
    (``moe.dispatch.movement``). With one device on the expert axis the send buffer is the expert
    layout (aligned, with ``alignment > 1``) and nothing is exchanged. See :class:`PlanBase`
    for the shared fields.

    Attributes:
      layout_row: int32 ``[R]``: the expert-layout row of received pair row ``p * W + r``
        (``R``: no row); ``[0]`` with one device (no rows are received).
      pair_row: int32 ``[R]``: the received pair row of expert-layout row ``i`` (``R`` for
        padding rows), the inverse of ``layout_row``; ``[0]`` with one device.
      bucket: int32 ``[]``: index into ``buckets`` of the exchange capacity, the same on every
        device of the expert axis (it comes from the all-gathered counts).
      buckets: the rows per (source, destination) pair that the exchange can send, ascending
        (:func:`dropless_buckets`); the last is ``W``, the worst case.
      alignment: every local expert's rows start at a multiple of it in the expert layout
        (``accel_kernels.gmm.api.align_map``; the rows in between are zero), which then has
        ``accel_kernels.gmm.api.aligned_rows(R, E_local, alignment)`` rows. 1: plain ragged.
    """

    transport: ClassVar[PlanTransport] = "dropless"

    layout_row: jax.Array
    pair_row: jax.Array
    bucket: jax.Array
    buckets: tuple[int, ...] = _static()
    alignment: int = _static()

    @property
    def pair_width(self) -> int:
        """``W``: rows per (source, destination) pair in the worst case."""
        return pair_width(self.num_tokens, self.top_k, self.num_experts, self.axis_size)

    @property
    def layout_rows(self) -> int:
        """Rows of the expert layout: ``R``, or its aligned count."""
        if self.alignment == 1:
            return self.rows
        return gmm_api.aligned_rows(self.rows, self.num_local_experts, self.alignment)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TwoStagePlan:
    """The exchange past one host (``DispatchOptions.host_axis``): across hosts once per
    token, then within the host.

    The expert axis is ``(host_axis, *local_axes)``: ``H`` hosts of ``L`` devices, device
    ``(h, l)`` the ``h L + l``-th, host ``h`` holding the expert slots ``[h E / H, (h + 1) E /
    H)``. Stage 1 is a dense exchange over ``host_axis`` in which the hosts are the experts:
    a token goes to each host holding one of its slots (at most ``k_1`` of them, the
    columns), to the device with the same local index there, with the local ids of its slots
    on that host (:attr:`stage1`). That device's received rows are the tokens of stage 2, an
    exchange over the local axes to the host's experts, of the layer's transport
    (:attr:`stage2`, its ``k`` columns the token's slots, ``E / H`` for those on other hosts).

    Attributes:
      stage1: the :class:`DensePlan` over ``host_axis`` of the ``[T, k_1]`` host columns
        (``num_experts = H``, ``capacity = C_1`` tokens per (source, host)).
      stage2: the :class:`DensePlan` (``C_2`` rows per (forwarding device, expert)) or the
        one-bucket :class:`DroplessPlan` (``c_2`` rows per pair) over the local axes, of the
        ``[H C_1, k]`` received rows.
      kept: bool ``[T, k]``: the slots both stages delivered (as this source sees them).
      dropped: int32 ``[]``: this device's routed slots that a capacity dropped.
    """

    stage1: DensePlan
    stage2: DensePlan | DroplessPlan
    kept: jax.Array
    dropped: jax.Array

    @property
    def transport(self) -> PlanTransport:
        """The transport of stage 2, the layer's (stage 1 is always a dense exchange)."""
        return self.stage2.transport

    @property
    def axis_name(self) -> tuple[str, ...]:
        """The whole expert axis: the host axis, then the local axes."""
        local = self.stage2.axis_name
        return (self.stage1.axis_name, *((local,) if isinstance(local, str) else local))

    @property
    def axis_size(self) -> int:
        """``P = H L``."""
        return self.stage1.axis_size * self.stage2.axis_size

    @property
    def num_experts(self) -> int:
        return self.stage2.num_experts * self.stage1.axis_size

    @property
    def num_tokens(self) -> int:
        return self.kept.shape[0]

    @property
    def top_k(self) -> int:
        return self.kept.shape[1]

    @property
    def x_dtype(self) -> str:
        return self.stage1.x_dtype

    @property
    def block_size(self) -> int:
        return self.stage1.block_size

    @property
    def wire_implementation(self) -> str:
        return self.stage1.wire_implementation

    @property
    def group_sizes(self) -> jax.Array:
        """Valid rows per local expert in stage 2's layout."""
        return self.stage2.group_sizes

    def expert_shape(self, width: int) -> tuple[int, ...]:
        """Stage 2's expert layout with rows of ``width``."""
        return self.stage2.expert_shape(width)


DispatchPlan = DensePlan | RaggedPlan | DroplessPlan | TwoStagePlan
"""A plan of any transport (``isinstance(plan, DispatchPlan)`` works): what
:func:`moe.dispatch.dispatch` returns and :func:`moe.dispatch.combine` takes."""


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



class ExchangeSizes(NamedTuple):
    """The static sizes of one exchange (:func:`exchange_sizes`).

    Attributes:
      capacity: ``'dense'``: rows per (source, expert), ``C``; else None.
      buckets: ``'dropless'``: rows per (source, destination) pair that the exchange can
        send, ascending; else ``()``.
    """

    capacity: int | None
    buckets: tuple[int, ...]


def exchange_sizes(transport: PlanTransport, num_tokens: int, top_k: int, num_experts: int,
                   axis_size: int, capacity_factor: float | None, *,
                   multiple: int = 8) -> ExchangeSizes:
    """The static sizes of one exchange of ``transport`` for ``num_tokens`` tokens of
    ``top_k`` slots over ``num_experts`` experts on ``axis_size`` devices: ``'dense'``'s
    capacity (:func:`dense_capacity`), ``'dropless'``'s buckets (:func:`dropless_buckets`; the
    first bucket's factor :data:`DROPLESS_CAPACITY_FACTOR` when ``capacity_factor`` is None);
    ``'ragged'`` has none.

    Example:
      >>> exchange_sizes("dense", 1024, 2, 16, 2, 1.25)
      ExchangeSizes(capacity=160, buckets=())
      >>> exchange_sizes("dropless", 1024, 2, 16, 2, None).buckets
      (1280, 1920, 2048)
    """
    first = DROPLESS_CAPACITY_FACTOR if capacity_factor is None else capacity_factor
    sizes = {
        "dense": lambda: ExchangeSizes(dense_capacity(
            num_tokens, top_k, num_experts, capacity_factor, multiple=multiple), ()),
        "dropless": lambda: ExchangeSizes(None, dropless_buckets(
            num_tokens, top_k, num_experts, axis_size, first, multiple=multiple)),
        "ragged": lambda: ExchangeSizes(None, ()),
    }
    return sizes[transport]()


class TwoStageSizes(NamedTuple):
    """The static sizes of the two-stage exchange (:func:`two_stage_sizes`).

    Attributes:
      first: ``C_1``, stage 1's tokens per (source device, destination host).
      second: stage 2's rows: ``'dense'``: ``C_2`` per (forwarding device, expert);
        ``'dropless'``: ``c_2`` per (forwarding device, destination device) pair.
    """

    first: int
    second: int


def two_stage_sizes(transport: Literal["dense", "dropless"], num_tokens: int, top_k: int,
                    host_slots: int, num_experts: int, hosts: int, axis_size: int,
                    capacity_factor: float | None, *, multiple: int = 8) -> TwoStageSizes:
    """The static sizes of the two-stage exchange for ``T`` tokens of ``k`` slots reaching at
    most ``k_1 = host_slots`` of ``H = hosts`` hosts, ``E`` experts on ``P = axis_size``
    devices (``L = P / H`` per host), ``f`` the capacity factor (dropless: the first bucket's,
    :data:`DROPLESS_CAPACITY_FACTOR` when None).

    * ``C_1 = round_up(min(ceil(f T k_1 / H), T))``: each of ``T`` tokens goes to at most
      ``k_1`` hosts, at most once each (:func:`dense_capacity` with the hosts as experts);
    * dense: ``C_2 = min(round_up(min(ceil(f H T k / E), H T)), H C_1)``: a forwarding device
      receives ``T k`` slots for its host's ``E / H`` experts under balanced routing (the one-
      stage ``C`` of ``H T`` tokens), and holds ``H C_1`` rows, each at most once per expert;
    * dropless: ``c_2 = min(round_up(ceil(f T k / L)), W_2)``, the ``T k`` slots over the
      host's ``L`` devices, at most the pair width ``W_2 = H C_1 min(k, E / P)``.

    ``f`` None (dense): ``C_1 = T`` and ``C_2 = H C_1``, nothing dropped.

    Example:
      >>> two_stage_sizes("dense", 8192, 8, 4, 256, 8, 64, 1.25)  # DeepSeek-V3 at EP=64
      TwoStageSizes(first=5120, second=2560)
      >>> two_stage_sizes("dropless", 8192, 8, 4, 256, 8, 64, None)
      TwoStageSizes(first=5120, second=10240)
    """
    def dense():
        c1 = dense_capacity(num_tokens, host_slots, hosts, capacity_factor, multiple=multiple)
        return TwoStageSizes(c1, min(dense_capacity(hosts * num_tokens, top_k, num_experts,
                                                    capacity_factor, multiple=multiple),
                                     hosts * c1))

    def dropless():
        cf = DROPLESS_CAPACITY_FACTOR if capacity_factor is None else capacity_factor
        c1 = dense_capacity(num_tokens, host_slots, hosts, cf, multiple=multiple)
        per_pair = math.ceil(cf * num_tokens * top_k / (axis_size // hosts))
        e_local = num_experts // axis_size
        return TwoStageSizes(c1, min(-(-per_pair // multiple) * multiple,
                                     hosts * c1 * min(top_k, e_local)))

    return {"dense": dense, "dropless": dropless}[transport]()


class LayerSizes(NamedTuple):
    """The static sizes of one chunk's exchanges in the layer (:func:`layer_sizes`).

    Attributes:
      one: the one-stage exchange's (also the dropless overflow's with two stages).
      two: the two-stage exchange's, or None with one stage.
    """

    one: ExchangeSizes
    two: TwoStageSizes | None


def layer_sizes(options: ResolvedOptions, num_tokens: int, top_k: int) -> LayerSizes:
    """The static sizes of the layer's exchanges for a chunk of ``num_tokens`` tokens of
    ``top_k`` slots, from its resolved options: :func:`exchange_sizes`, and
    :func:`two_stage_sizes` when ``options.two_stage``.

    Example:
      >>> import jax, moe
      >>> mesh = jax.make_mesh((8,), ("expert",))
      >>> options = moe.MoEOptions.create(16, 2, capacity_factor=1.25).resolve(
      ...     4096, 128, 256, mesh=mesh)
      >>> layer_sizes(options, 512, 2)
      LayerSizes(one=ExchangeSizes(capacity=80, buckets=()), two=None)
    """
    d, slots, p = options.dispatch, options.num_slots, options.expert_axis_size
    one = exchange_sizes(d.transport, num_tokens, top_k, slots, p, d.capacity_factor,
                         multiple=d.capacity_multiple)
    two = None
    if options.two_stage:
        two = two_stage_sizes(d.transport, num_tokens, top_k, options.host_slots, slots,
                              options.hosts, p, d.capacity_factor, multiple=d.capacity_multiple)
    return LayerSizes(one, two)
