"""Expert-parallel token dispatch and combine, for use inside ``jax.shard_map``.

Device ``i`` of the expert axis (size ``P``) owns global experts
``[i * E_local, (i + 1) * E_local)``, ``E_local = num_experts // P``. :func:`dispatch` sorts
this device's token slots by expert, exchanges counts and then the tokens (optionally as FP8),
and hands the local experts their rows; :func:`combine` sends expert outputs back, un-permutes
them, weights them and sums over the ``k`` choices. Both carry custom VJPs whose backward
passes are the opposite exchange (the combine gradient optionally in FP8 too).

Layouts (``C`` = per-(source, expert) capacity, ``R`` = :func:`moe.dispatch.plan.ragged_rows`):

* ``'dense'``: ``expert_x[l, p * C + r]`` is the ``r``-th kept slot that source ``p`` routed to
  local expert ``l``; padding rows are zero. Feed a batched einsum ``'ecd,edf->ecf'``.
* ``'ragged'`` and ``'dropless'``: ``expert_x [R, d]`` holds local expert 0's rows (source
  0's, then source 1's, ...), then expert 1's, ...; rows past ``sum(group_sizes)`` are zero.
  Feed ``jax.lax.ragged_dot(expert_x, w, group_sizes)``. ``R = P * T * min(k, E_local)`` is
  the worst case; with ``P > 1`` most of it is padding in a balanced step, which the expert
  GEMMs pay for in zero stores (``P = 1``: ``R = T * k``, no padding).

Transports: ``'dense'`` exchanges ``[E, C]`` capacity-padded rows with ``all_to_all`` and drops
the slots past ``C``. ``'ragged'`` sends exactly the routed rows with ``ragged_all_to_all``.
``'dropless'`` sends, to every device, its slots in a ``[P, c]`` buffer of ``all_to_all``
exchanges, ``c`` the smallest of a few static bucket sizes
(:func:`moe.dispatch.plan.dropless_buckets`: ``capacity_factor`` times the balanced share, growing
1.5x, at most 8, up to the worst case) that holds the fullest (source, destination) pair of
the step. Each exchange runs in two phases: one ``all_to_all`` of the first bucket's ``c_0``
rows per pair, outside any branch, so XLA can run it asynchronously under other work (the
layer's other chunks, ``overlap_chunks``); then, in the ``lax.switch`` branch of the step's
bucket ``c_j``, the ``c_j - c_0`` rows past it (nothing in branch 0, which a balanced step
takes). The plan all-gathers the counts, so every device of the expert axis takes the same
branch: no slot is ever dropped. The received rows are laid out into the ragged layout in
one gather (+ decode) pass; the same bytes as ``'ragged'``, bit for bit. With one device on
the expert axis no transport exchanges anything (not even the counts): the send buffer is
the expert layout.

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

Past one host (``DispatchOptions.host_axis`` naming the first of the expert axes, e.g.
``('host', 'local')``): a :class:`TwoStagePlan`. Stage 1 sends each token once to each host
holding one of its slots (to the device of its own local index there), a dense exchange with
the hosts as experts; stage 2 forwards the received wire rows, undecoded, to the host's
experts; combine sums a host's weighted outputs there before they cross back. Capacity
applies per stage (``moe.dispatch.plan.two_stage_sizes``). Here only ``'dense'``; the MoE
layer also runs ``'dropless'`` (its overflow goes by the one-stage exchange).

Transport choice: here ``'auto'`` is ``'dense'``; the layer's ``'auto'``
(:func:`moe.auto_transport`, resolved with the layer's options) also picks ``'dropless'`` on
one Hopper GPU. Between GPUs, ``all_to_all`` moves the rows far faster than
``ragged_all_to_all``.

References: DeepEP (FP8 dispatch, count exchange first); GShard / Switch Transformer
(capacity, deterministic dropping); MaxText's ragged MoE (``ragged_all_to_all`` +
``ragged_dot``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe.dispatch.movement import Dispatched, WireRows, combine_tokens, dispatch_tokens
from moe.dispatch.plan import (
    AxisName,
    DensePlan,
    DispatchPlan,
    DroplessPlan,
    ExchangeSizes,
    RaggedPlan,
    TwoStagePlan,
    dense_capacity,
    exchange_sizes,
    ragged_rows,
    two_stage_sizes,
)
from moe.dispatch.plan_build import (
    BucketSplit,
    PlanStatics,
    build_plan,
    split_first_bucket,
    two_stage_plan,
)
from moe.options import (
    DispatchOptions,
    ExchangeImplementation,
    Transport,
    WireDtype,
    WireImplementation,
    check_choice,
    check_group_alignment,
    check_wire_width,
    renamed_keywords,
    resolve_exchange_implementation,
)

__all__ = ["BucketSplit", "DensePlan", "DispatchPlan", "Dispatched", "DroplessPlan", "RaggedPlan",
           "TwoStagePlan", "WireRows", "combine", "dense_capacity", "dispatch", "dispatch_apply",
           "dispatch_buckets", "dispatch_with_wire", "plan_dispatch", "ragged_rows",
           "split_first_bucket"]

_AUTO_TRANSPORT = {"auto": "dense"}  # the dispatch's own 'auto' (the layer's: auto_transport)


# ----------------------------------------------------------------------------- validation


def _axis_size(axis_name: AxisName, fn: str) -> int:
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as err:
        raise ValueError(
            f"axis_name={axis_name!r} is not a bound mesh axis ({err}); call {fn} inside "
            "jax.shard_map over a mesh that has this axis, and pass the expert axis's name."
        ) from None


def _check_dispatch_args(x, expert_ids, num_experts, block_size, p, dispatch_dtype):
    """The array checks of one dispatch (its options were validated by DispatchOptions)."""
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
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}; use 128.")
    if dispatch_dtype == "fp8":
        check_wire_width(x.shape[1], block_size, what="d_model (x.shape[-1])")


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
    exchange_implementation: ExchangeImplementation = "auto",
    wire_implementation: WireImplementation = "auto",
    group_alignment: int | None = None,
    **renamed: Any,
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
        from a few static buckets, :func:`moe.dispatch.plan.dropless_buckets`; never drops),
        ``'ragged'`` (dropless ``ragged_all_to_all``, emulated where XLA lacks it) or
        ``'auto'`` (= ``'dense'``: between devices the capacity-padded ``all_to_all`` moves
        the rows fastest). ``'dropless'`` and ``'ragged'`` produce the same expert layout,
        bit for bit. With one device on ``axis_name`` no transport exchanges anything.
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
      exchange_implementation: ``'ragged'`` only: ``'auto'`` (native on GPU/TPU, emulated
        elsewhere), ``'native'``, ``'emulated'`` (formerly ``ragged_impl``).
      wire_implementation: who builds the send buffer (gather + encode) and, for the dense
        and dropless transports, decodes the received rows into the expert layout (and, for
        dropless, gathers the return trip's rows): ``'auto'`` (the Pallas kernels when
        lowered for NVIDIA GPUs, XLA elsewhere), ``'xla'``, ``'triton'`` (interpreted,
        slowly, on CPU) or ``'mosaic'`` (`accel_kernels.wire.api`; formerly
        ``wire_kernels``). Same bytes either way.
      group_alignment: ``'dropless'`` only: None, or ``A`` to start every local expert's
        rows at a multiple of ``A`` in the layout (the rows in between are zero; ``R``
        becomes ``accel_kernels.gmm.api.aligned_rows(R, E_local, A)``), the layout the Mosaic
        GPU expert kernels read: pass the same ``group_alignment`` to
        :func:`moe.gated_experts`, which then gathers no aligned copy. Same rows, outputs and
        gradients. The MoE layer does this for 'mosaic' experts.
      **renamed: ``ragged_impl`` / ``wire_kernels``, the former names of
        ``exchange_implementation`` / ``wire_implementation`` (a ``DeprecationWarning``).

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
    kernels = renamed_keywords("dispatch", renamed,
                               exchange_implementation=exchange_implementation,
                               wire_implementation=wire_implementation)
    expert_x, _, group_sizes, plan = dispatch_with_wire(
        x, expert_ids, num_experts=num_experts, axis_name=axis_name, transport=transport,
        capacity_factor=capacity_factor, capacity_multiple=capacity_multiple,
        dispatch_dtype=dispatch_dtype, block_size=block_size, group_alignment=group_alignment,
        **kernels)
    return expert_x, group_sizes, plan


def dispatch_with_wire(x: jax.Array, expert_ids: jax.Array, *, num_experts: int,
                       axis_name: AxisName, block_size: int = 128,
                       group_alignment: int | None = None, with_wire: bool = False,
                       **options: Any
                       ) -> tuple[jax.Array, jax.Array | None, jax.Array, DispatchPlan]:
    """:func:`dispatch`, plus the FP8 wire rows of the ragged layout for the expert layer.

    Takes :func:`dispatch`'s keywords (``options``: its :class:`moe.DispatchOptions` fields,
    ``transport``, ``capacity_factor``, ``capacity_multiple``, ``dispatch_dtype``,
    ``exchange_implementation`` and ``wire_implementation``, under their former names too).
    Returns ``(expert_x, wire, group_sizes, plan)``: ``wire`` is None, or with ``with_wire``
    (``dispatch_dtype='fp8'`` and the ragged or dropless transport) the received uint32 wire
    rows ``[R, d_model / 4 + W]`` in the order of ``expert_x`` (e4m3 bytes and packed E8M0
    block scales, :func:`accel_kernels.wire.api.unpack_fp8_words`), which take no gradient. An
    FP8 GEMM reads its e4m3 operand from them; XLA then drops the decoded rows unless
    something else reads them (their gradient still flows to ``x``). With one device on the
    expert axis nothing is sent, and ``wire`` is a :class:`moe.dispatch.collectives.TokenRows`
    (``x`` and the token of each row) instead: the GEMM's rows are then made from the tokens
    in one pass, the bytes the wire rows would have given, and the wire rows are never written.
    """
    options = DispatchOptions(expert_axis=axis_name,
                              **renamed_keywords("dispatch_with_wire", options))
    out = dispatch_apply(x, expert_ids, num_experts=num_experts, options=options,
                         fp8_block_size=block_size, group_alignment=group_alignment,
                         with_wire=with_wire)
    return out.expert_x, None if out.wire is None else out.wire.rows, out.group_sizes, out.plan


def dispatch_buckets(num_tokens: int, top_k: int, *, num_experts: int, axis_size: int,
                     options: DispatchOptions) -> tuple[int, ...]:
    """The exchange buckets of ``options``' transport: for ``'dropless'``
    :func:`moe.dispatch.plan.dropless_buckets` with its ``capacity_factor`` (None:
    :data:`moe.dispatch.plan.DROPLESS_CAPACITY_FACTOR`) and ``capacity_multiple``; ``()`` for
    the transports that have none (`moe.dispatch.plan.exchange_sizes`).

    Example:
      >>> dispatch_buckets(1024, 2, num_experts=16, axis_size=2,
      ...                  options=DispatchOptions(transport="dropless"))
      (1280, 1920, 2048)
      >>> dispatch_buckets(1024, 2, num_experts=16, axis_size=2, options=DispatchOptions())
      ()
    """
    transport = _AUTO_TRANSPORT.get(options.transport, options.transport)
    return exchange_sizes(transport, num_tokens, top_k, num_experts, axis_size,
                          options.capacity_factor, multiple=options.capacity_multiple).buckets


def _check_plan_args(group_alignment, buckets, capacity, transport: str) -> None:
    """The plan's own arguments: each a positive size, and for the transport that has it."""
    check_group_alignment(group_alignment)
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity < 1):
        raise ValueError(f"capacity must be None or a positive int, got {capacity!r}.")
    if buckets is not None and (not buckets or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in buckets)
            or list(buckets) != sorted(set(buckets))):
        raise ValueError(f"buckets must be positive ints, strictly ascending, got {buckets!r}.")
    for name, value, owner in (("buckets", buckets, "dropless"), ("capacity", capacity, "dense"),
                               ("group_alignment", group_alignment, "dropless")):
        if value is not None and transport != owner:
            raise ValueError(f"{name}={value!r} is for transport={owner!r} only, got "
                             f"transport={transport!r}; drop it or use {owner!r}.")


def plan_dispatch(
    expert_ids: jax.Array,
    *,
    num_experts: int,
    options: DispatchOptions,
    x_dtype: jnp.dtype | str = jnp.float32,
    fp8_block_size: int = 128,
    group_alignment: int | None = None,
    buckets: tuple[int, ...] | None = None,
    capacity: int | None = None,
) -> DispatchPlan:
    """The plan :func:`dispatch_apply` builds from ``expert_ids`` (and nothing of the tokens
    but their dtype): build it apart to batch the plans of several dispatches under
    ``jax.vmap`` (one sort for all of them).

    ``options`` are checked and their ``'auto'`` decided here (``transport``: ``'dense'``;
    ``exchange_implementation``: :func:`moe.options.resolve_exchange_implementation`), the
    sizes computed (:func:`dense_capacity`, :func:`dispatch_buckets`), and the plan built by
    `moe.dispatch.plan_build.build_plan`.

    Args:
      expert_ids: int ``[T, k]``.
      num_experts, options, fp8_block_size, group_alignment, buckets: as for
        :func:`dispatch_apply`.
      x_dtype: the dtype of the tokens it will dispatch (combine returns it).
      capacity: ``'dense'`` only: the rows per (source, expert), instead of the
        :func:`dense_capacity` of ``options.capacity_factor`` (e.g. a local pass over this
        device's own experts that must keep exactly the slots the exchange would keep).

    Returns:
      The transport's plan (a :class:`DensePlan`, :class:`RaggedPlan` or
      :class:`DroplessPlan`; with ``options.host_axis`` named, a :class:`TwoStagePlan` of the
      dense transport, each token reaching at most ``min(k, H)`` hosts).

    Example:
      >>> # inside jax.shard_map over 'expert', one plan per chunk in one batched sort:
      >>> # plans = jax.vmap(lambda ids: plan_dispatch(ids, num_experts=8, options=options,
      >>> #     x_dtype=x.dtype))(ids.reshape(chunks, -1, k))
    """
    if not isinstance(options, DispatchOptions):
        raise TypeError(f"options must be a moe.DispatchOptions, got {type(options).__name__}.")
    expert_ids = jnp.asarray(expert_ids)
    p = _axis_size(options.expert_axis, "dispatch")
    transport = _AUTO_TRANSPORT.get(options.transport, options.transport)
    _check_plan_args(group_alignment, buckets, capacity, transport)
    t, k = expert_ids.shape
    statics = PlanStatics(num_experts, options.expert_axis, p, jnp.dtype(x_dtype).name,
                          fp8_block_size, options.wire_implementation)
    sizes = exchange_sizes(transport, t, k, num_experts, p, options.capacity_factor,
                           multiple=options.capacity_multiple)
    if options.host_axis not in (None, "auto"):
        return _two_stage_plan(expert_ids, statics, options, sizes, capacity)
    return build_plan(expert_ids, statics, transport=transport,
                      capacity=capacity or sizes.capacity, buckets=buckets or sizes.buckets,
                      alignment=group_alignment or 1,
                      exchange_implementation=resolve_exchange_implementation(
                          options.exchange_implementation))


def _two_stage_plan(expert_ids, statics: PlanStatics, options: DispatchOptions,
                    one_stage: ExchangeSizes, capacity: int | None) -> TwoStagePlan:
    """:func:`plan_dispatch`'s two-stage plan (``options.host_axis`` named): dense only (the
    transport whose one-stage sizes have a capacity), each token reaching at most ``min(k,
    H)`` hosts (the layer bounds it by the router's groups)."""
    if one_stage.capacity is None or capacity is not None:
        raise ValueError(
            f"host_axis={options.host_axis!r} (two stages) takes transport='dense' and no "
            f"capacity here, got transport={options.transport!r}, capacity={capacity!r}; the "
            "MoE layer runs the dropless two-stage exchange (it sends the slots past each "
            "stage's bucket by the one-stage exchange).")
    hosts = _axis_size(options.host_axis, "dispatch")
    t, k = expert_ids.shape
    sizes = two_stage_sizes("dense", t, k, min(k, hosts), statics.num_experts, hosts,
                            statics.axis_size, options.capacity_factor,
                            multiple=options.capacity_multiple)
    return two_stage_plan(expert_ids, statics, host_slots=min(k, hosts), sizes=sizes,
                          transport="dense")


def dispatch_apply(
    x: jax.Array,
    expert_ids: jax.Array,
    *,
    num_experts: int,
    options: DispatchOptions,
    fp8_block_size: int = 128,
    group_alignment: int | None = None,
    with_wire: bool = False,
    buckets: tuple[int, ...] | None = None,
    plan: DispatchPlan | None = None,
) -> Dispatched:
    """:func:`dispatch_with_wire` with its options as one :class:`moe.DispatchOptions`:
    ``expert_axis``, ``transport`` (``'auto'``: dense), ``capacity_factor``,
    ``capacity_multiple``, ``dispatch_dtype``, ``wire_implementation`` and
    ``exchange_implementation`` are read; ``batch_axes``, ``overlap_chunks`` and
    ``combine_grad_dtype`` are the layer's.

    Checks its arguments, builds the plan (:func:`plan_dispatch`) and sends the tokens
    (`moe.dispatch.movement.dispatch_tokens`, which the MoE layer calls with its plans).

    Args:
      x, expert_ids, num_experts, group_alignment, with_wire: as for
        :func:`dispatch_with_wire`.
      options: the dispatch options.
      fp8_block_size: channels per FP8 scale of the wire (``block_size`` of
        :func:`dispatch`).
      buckets: the dropless exchange's rows per (source, destination) pair, ascending (None:
        :func:`dispatch_buckets`). The caller guarantees that no pair exceeds the last one
        (e.g. one bucket for the slots :func:`split_first_bucket` keeps): rows past it are
        not sent.
      plan: :func:`plan_dispatch` of these ``expert_ids`` with the same arguments, built
        beforehand (None: built here).

    Returns:
      A :class:`Dispatched`; ``wire`` is a :class:`WireRows` with ``with_wire``, else None.

    Example:
      >>> # inside jax.shard_map over 'expert':
      >>> # ex, wire, sizes, plan = dispatch_apply(x, ids, num_experts=8,
      >>> #     options=DispatchOptions(transport="dropless", dispatch_dtype="fp8"))
    """
    if not isinstance(options, DispatchOptions):
        raise TypeError(f"options must be a moe.DispatchOptions, got {type(options).__name__}.")
    x, expert_ids = jnp.asarray(x), jnp.asarray(expert_ids)
    p = _axis_size(options.expert_axis, "dispatch")
    _check_dispatch_args(x, expert_ids, num_experts, fp8_block_size, p, options.dispatch_dtype)
    if plan is None:
        plan = plan_dispatch(expert_ids, num_experts=num_experts, options=options,
                             x_dtype=x.dtype, fp8_block_size=fp8_block_size,
                             group_alignment=group_alignment, buckets=buckets)
    elif plan.kept.shape != expert_ids.shape or plan.x_dtype != jnp.dtype(x.dtype).name:
        raise ValueError(f"plan is for expert_ids of shape {plan.kept.shape} and tokens of "
                         f"{plan.x_dtype}, got {expert_ids.shape} and {x.dtype}; build it with "
                         "plan_dispatch from these expert_ids and x.dtype.")
    layout = plan.stage2 if isinstance(plan, TwoStagePlan) else plan
    if with_wire and (options.dispatch_dtype != "fp8" or isinstance(layout, DensePlan)):
        raise ValueError(f"with_wire needs dispatch_dtype='fp8' and a ragged layout (transport "
                         f"'dropless' or 'ragged'), got {options.dispatch_dtype!r} / "
                         f"{plan.transport!r}.")
    return dispatch_tokens(x, plan, dispatch_dtype=options.dispatch_dtype, with_wire=with_wire)


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
        raise TypeError(f"plan must be the DispatchPlan (a DensePlan, RaggedPlan or DroplessPlan) "
                        f"returned by dispatch, got {type(plan)}.")
    expert_y, weights = jnp.asarray(expert_y), jnp.asarray(weights)
    check_choice("combine_grad_dtype", combine_grad_dtype, WireDtype)
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
        check_wire_width(expert_y.shape[-1], plan.block_size, what="expert_y.shape[-1]")
    _axis_size(plan.axis_name, "combine")
    return combine_tokens(expert_y, weights, plan, combine_grad_dtype)
