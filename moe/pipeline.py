"""The MoE layer's expert-parallel chunks: per chunk dispatch, the local experts on the layout
it produced, combine; the first chunk's own-expert pass; the dropless layer's overflow pass.

:func:`run_chunks` runs the chunks of the pipelined layer (``DispatchOptions.overlap_chunks``)
one after another on the plans `moe.dispatch.plan_build.chunk_plans` built for them, so that
XLA's scheduler can put one chunk's async exchanges under another chunk's GEMMs; every step
reads the layer's :class:`moe.options.ResolvedOptions` as they came.

With ``DispatchOptions.local_first`` the first chunk's slots for this device's own experts go
through them with no exchange, so their GEMMs can run under the step's first all-to-all,
which no chunk's experts could cover.

The dropless transport sends the rows past its first bucket inside a ``lax.switch`` branch
(``moe.dispatch``), and XLA's latency-hiding scheduler keeps no async collective in flight
across a conditional whose branches hold collectives: in a pipeline every chunk's switch
would be a wall that the other chunks' exchanges cannot cross. So the pipelined dropless
layer splits each chunk's slots at the first bucket (:func:`moe.dispatch.split_first_bucket`):
the chunks exchange their first-bucket slots with the one-bucket exchange (no conditional in
the pipeline), and :func:`overflow_experts` runs the same body on the other slots, all chunks
in one ``lax.cond`` after the pipeline, taken only on steps where some pair of the expert axis
overflows the first bucket. The layer's output is a sum over slots, so the two passes add up
to the one-pass layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe.dispatch import DispatchPlan, TwoStagePlan, movement, plan_build
from moe.dispatch.plan import exchange_sizes
from moe.experts import Banks, CombineArgs, run_experts, shared_experts
from moe.options import ResolvedOptions

__all__ = ["Banks", "ChunkOutput", "Chunks", "chunk_experts", "overflow_experts",
           "overflow_token_counts", "run_chunks"]


class ChunkOutput(NamedTuple):
    """What :func:`chunk_experts` returns.

    Attributes:
      y: ``[T, d]`` the chunk's tokens' outputs, in their dtype.
      plan: the chunk's dispatch plan.
      banks: the expert weights for the next chunk to take: passed through this chunk's
        experts when it chains them (their gradient then accumulates in this chunk's
        weight-gradient GEMMs), else the banks it was given.
    """

    y: jax.Array
    plan: DispatchPlan
    banks: Banks


class Chunks(NamedTuple):
    """What :func:`run_chunks` returns.

    Attributes:
      y: ``[T, d]`` this device's tokens' outputs, in their dtype.
      dropped: int32 ``[]``: this device's slots that a capacity dropped.
      lost: bool ``[T, k]``: the slots routed to an expert that a capacity dropped (masked
        slots, and those another pass took, are not lost).
    """

    y: jax.Array
    dropped: jax.Array
    lost: jax.Array


def chunk_experts(x: jax.Array, weights: jax.Array, banks: Banks, plan: DispatchPlan,
                  options: ResolvedOptions, *, chain: bool = False) -> ChunkOutput:
    """One chunk: ``y = combine(experts(dispatch(x, plan)), weights)``.

    Args:
      x: ``[T, d]`` this device's tokens of the chunk.
      weights: ``[T, k]`` the combine weights.
      banks: this device's expert weights.
      plan: the chunk's dispatch plan (`moe.dispatch.plan_build.chunk_plans`).
      options: the layer's resolved options.
      chain: pass the banks through the experts (:class:`ChunkOutput`); every chunk but the
        last does, so that the backward's weight gradients accumulate from chunk to chunk.

    Returns:
      A :class:`ChunkOutput`.

    Example:
      >>> # inside jax.shard_map, as run_chunks runs each chunk:
      >>> # y, plan, banks = chunk_experts(x, weights, Banks(w_gate_up, w_down), plan,
      >>> #                                options, chain=True)
    """
    return _chunk(x, weights, banks, plan, options, chain, None)[0]


def _chunk(x: jax.Array, weights: jax.Array, banks: Banks, plan: DispatchPlan,
           options: ResolvedOptions, chain: bool, then: jax.Array | None
           ) -> tuple[ChunkOutput, jax.Array | None]:
    """:func:`chunk_experts`, and ``then`` (the next chunk's tokens, or None) made readable
    only once this chunk's expert layout has arrived (:func:`_in_order`)."""
    ex = movement.dispatch_tokens(x, plan, dispatch_dtype=options.dispatch.dispatch_dtype,
                                  with_wire=options.wire_to_experts)
    rows = ex.expert_x
    if then is not None:
        rows, then = _in_order(rows, then)
    combine = CombineArgs(weights, plan, options.dispatch.combine_grad_dtype)
    # The dense layout interleaves padding per source (row p * C + r), so its valid rows
    # are not a prefix: every row runs (padding rows are zero and are never read back by
    # combine).
    sizes = None if rows.ndim == 3 else ex.group_sizes
    y, banks = run_experts(rows, sizes, banks, options.experts,
                           block_size=options.fp8_block_size,
                           group_alignment=options.group_alignment, x_wire=ex.wire,
                           combine=combine, chain=chain)
    return ChunkOutput(y.astype(x.dtype), plan, banks), then


@jax.custom_vjp
def _in_order(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(a, b)`` as they are, neither usable before both exist (an
    ``optimization_barrier``, which XLA keeps as scheduling dependencies: what reads one
    waits for what made the other). The forward only: the cotangents pass as they come, as
    the backward's scheduler placed the exchanges better left free (the mirrored order
    exposed more of them in the compiled steps)."""
    return jax.lax.optimization_barrier((a, b))


def _in_order_fwd(a, b):
    return _in_order(a, b), None


def _in_order_bwd(_, cts):
    return cts


_in_order.defvjp(_in_order_fwd, _in_order_bwd)


def run_chunks(x: jax.Array, weights: jax.Array, banks: Banks, plans: plan_build.ChunkPlans,
               options: ResolvedOptions, *, shared: tuple[jax.Array, jax.Array] | None = None,
               shared_gate: jax.Array | None = None, mask: jax.Array | None = None) -> Chunks:
    """The layer's chunks on this device's tokens, then the overflow pass and the shared
    experts: ``y = sum over the passes of combine(experts(dispatch(x)))`` (+ ``shared(x)``).

    The chunks are independent until their outputs are concatenated, so XLA's scheduler can
    run one chunk's async exchanges under another chunk's GEMMs (forward and backward); the
    shared experts need no exchange and go right after the first chunk, whose exchange they
    can cover. Each chunk but the last passes the banks on to the next, so that in the
    backward (chunks in reverse) a chunk's weight-gradient GEMMs start from the later chunks'
    sum instead of XLA adding one full bank per chunk.

    With the two-stage exchange (:class:`moe.dispatch.TwoStagePlan`) the chunks' forward
    dispatches run in turn: chunk ``c + 1``'s tokens are read only once chunk ``c``'s expert
    layout has arrived (both of its stages). Left free, XLA's scheduler issues every chunk's
    first stage before any chunk's second (they are a data dependency apart): with one
    collective in flight the first chunk's experts then wait for the first stages of all
    chunks, which its GEMMs could have covered. The order changes no value.

    Args:
      x: ``[T, d]`` this device's tokens.
      weights: ``[T, k]`` their combine weights.
      banks: this device's expert weights.
      plans: the chunks' plans (`moe.dispatch.plan_build.chunk_plans`).
      options: the layer's resolved options.
      shared: the shared experts' ``(gate_up, down)``, or None.
      shared_gate: their gate ``[d, 1]``, or None.
      mask: bool ``[T]``, False for masked tokens (the shared experts give them 0), or None.

    Returns:
      The :class:`Chunks`.

    Example:
      >>> # inside jax.shard_map, as moe.layer runs them:
      >>> # y, dropped, lost = run_chunks(x, r.weights, banks, plans, options)
    """
    chunks, e_local = len(plans.plans), options.num_slots // options.expert_axis_size
    tc = x.shape[0] // chunks
    ys, lost, y_shared, dropped = [], [], None, jnp.zeros((), jnp.int32)
    chained = banks
    xs = [x[c * tc:(c + 1) * tc] for c in range(chunks)]
    # The two-stage exchange's chunks take their dispatches in turn (see run_chunks).
    in_turn = isinstance(plans.plans[0], TwoStagePlan)
    for c in range(chunks):
        part = slice(c * tc, (c + 1) * tc)
        y_local = lost_local = None
        with jax.named_scope(f"moe_chunk{c}"):  # a profile (or a cost model) tells them apart
            if c == 0 and plans.local is not None:  # its own experts' slots, no exchange
                local = plans.local
                w = weights[part] if local.columns is None else jnp.take_along_axis(
                    weights[part], local.columns, axis=1)
                with jax.named_scope("moe_local_first"):
                    y_local, _, chained = chunk_experts(x[part], w, chained, local.plan,
                                                        options, chain=True)
                dropped = dropped + local.plan.dropped
                lost_local = (local.expert_ids < e_local) & ~local.plan.kept
            then = xs[c + 1] if in_turn and c + 1 < chunks else None
            (y_c, plan, chained), then = _chunk(xs[c], weights[part], chained, plans.plans[c],
                                                options, c < chunks - 1, then)
            if then is not None:
                xs[c + 1] = then
        if y_local is not None:
            y_c = (y_c.astype(jnp.float32) + y_local.astype(jnp.float32)).astype(x.dtype)
        if c == 0 and shared is not None:
            y_shared = shared_experts(x, *shared, shared_gate,
                                      activation=options.experts.activation)
            if mask is not None:
                y_shared = jnp.where(mask[:, None], y_shared, jnp.zeros((), x.dtype))
        ys.append(y_c)
        dropped = dropped + plan.dropped
        lost_c = (plans.expert_ids[c] < options.num_slots) & ~plan.kept  # masked: not lost
        lost.append(lost_c if lost_local is None else lost_c | lost_local)
    y = ys[0] if chunks == 1 else jnp.concatenate(ys, axis=0)
    if plans.overflow_ids is not None:  # one branch for the expert axis: its collectives run
        axis = options.dispatch.expert_axis  # on every device of it
        y = y + overflow_experts(
            x, plans.overflow_ids, weights, banks, jax.lax.pmax(plans.overflows, axis) > 0,
            num_experts=options.num_slots, axis_name=axis, max_tokens=tc,
            body=functools.partial(_overflow_pass, options=options))
    if y_shared is not None:
        y = y + y_shared
    return Chunks(y, dropped, jnp.concatenate(lost, axis=0))


def _overflow_pass(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, banks: Banks, *,
                   options: ResolvedOptions) -> jax.Array:
    """One pass of the dropless overflow: the slots past the first bucket of ``T`` tokens,
    planned with the buckets of ``T`` tokens (all of them: it may take any)."""
    t, k = expert_ids.shape
    dispatch = options.dispatch
    sizes = exchange_sizes(dispatch.transport, t, k, options.num_slots,
                           options.expert_axis_size, dispatch.capacity_factor,
                           multiple=dispatch.capacity_multiple)
    plan = plan_build.build_plan(expert_ids, plan_build.layer_statics(options, x.dtype),
                                 transport=dispatch.transport, buckets=sizes.buckets,
                                 alignment=options.group_alignment or 1)
    return chunk_experts(x, weights, banks, plan, options).y


# An overflow step runs the overflow pass on the tokens that have a slot past the first
# bucket, gathered into the first of these shares of the device's tokens that holds them on
# every device of the expert axis: its cost follows the overflow, not the worst case.
_OVERFLOW_SHARES = (16, 4, 1)


def overflow_token_counts(num_tokens: int) -> tuple[int, ...]:
    """Token counts the overflow pass can run on, ascending: ``ceil(T / s)`` for ``s`` in
    16, 4, 1, rounded up to a multiple of 8 below ``T`` (the last is ``T``).

    Example:
      >>> overflow_token_counts(8192), overflow_token_counts(20)
      ((512, 2048, 8192), (8, 20))
    """
    counts = []
    for share in _OVERFLOW_SHARES:
        n = -(-num_tokens // share)
        n = min(-(-n // 8) * 8, num_tokens)
        if n not in counts:
            counts.append(n)
    return tuple(counts)


def overflow_experts(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, banks: Banks,
                     overflows: jax.Array, *, num_experts: int, axis_name, max_tokens: int,
                     body: Callable[[jax.Array, jax.Array, jax.Array, Banks], jax.Array]
                     ) -> jax.Array:
    """The MoE output of the slots ``expert_ids`` names when ``overflows``, else 0: ``[T, d]``.

    The slots past the first bucket of every chunk (the others are ``num_experts``), in one
    ``lax.cond`` on ``overflows`` (the same on every device of ``axis_name``, whose
    collectives the branch holds). In the branch, the tokens with such a slot are gathered
    into the first of :func:`overflow_token_counts` that holds them on every device of the
    axis (a ``lax.switch``), run through ``body`` in passes of at most ``max_tokens`` tokens,
    and scattered back: an overflow step pays for its overflow tokens, not for a worst-case
    layout of all of them. A custom VJP makes the backward another ``lax.cond`` that
    recomputes the forward inside its branch: differentiating the ``cond`` itself would make
    its residuals outputs of both branches, the untaken one filling them with zeros on every
    step. The untaken backward branch gives zero cotangents (one pass over the expert
    weights' size).

    Args:
      x: ``[T, d]`` this device's tokens.
      expert_ids: int ``[T, k]``.
      weights: ``[T, k]``.
      banks: this device's expert weights.
      overflows: bool ``[]``.
      num_experts: the "no expert" id.
      axis_name: the expert axis.
      max_tokens: the most tokens one pass takes (a chunk's: the pipeline's buffer sizes).
      body: one pass ``(x, ids, weights, banks) -> y``.

    Returns:
      ``[T, d]`` in ``x``'s dtype.

    Example:
      >>> # inside jax.shard_map, after the chunks sent their first buckets (moe.layer):
      >>> # y = y + overflow_experts(x, over_ids, weights, banks, overflows, num_experts=8,
      >>> #     axis_name="expert", max_tokens=chunk_tokens, body=one_chunk)
    """
    counts = overflow_token_counts(x.shape[0])

    def gathered(n, x, weights, banks, expert_ids, order):
        rows = order[:n]  # the tokens with an overflow slot first, then some without
        ys = [body(x[rows[i:i + max_tokens]], expert_ids[rows[i:i + max_tokens]],
                   weights[rows[i:i + max_tokens]], banks) for i in range(0, n, max_tokens)]
        y = ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=0)
        return jnp.zeros_like(x).at[rows].add(y, unique_indices=True)

    def run(x, weights, banks, expert_ids):
        has = jnp.any(expert_ids < num_experts, axis=1)
        order = jnp.argsort(~has, stable=True).astype(jnp.int32)
        need = jax.lax.pmax(jnp.sum(has, dtype=jnp.int32), axis_name)
        which = jnp.sum(jnp.asarray(counts, jnp.int32) < need, dtype=jnp.int32)
        return jax.lax.switch(which, [functools.partial(gathered, n) for n in counts],
                              x, weights, banks, expert_ids, order)

    def skip(x, weights, banks, expert_ids):
        del weights, banks, expert_ids
        return jnp.zeros_like(x)

    @jax.custom_vjp
    def over(x, weights, banks, expert_ids, overflows):
        return jax.lax.cond(overflows, run, skip, x, weights, banks, expert_ids)

    def over_fwd(x, weights, banks, expert_ids, overflows):
        return over(x, weights, banks, expert_ids, overflows), (x, weights, banks, expert_ids,
                                                                  overflows)

    def over_bwd(res, dy):
        x, weights, banks, expert_ids, overflows = res

        def grads(dy, x, weights, banks):
            _, vjp = jax.vjp(lambda x, w, b: run(x, w, b, expert_ids), x, weights, banks)
            return vjp(dy)

        def zeros(dy, x, weights, banks):
            del dy
            return jax.tree.map(jnp.zeros_like, (x, weights, banks))

        dx, dw, db = jax.lax.cond(overflows, grads, zeros, dy, x, weights, banks)
        return dx, dw, db, None, None

    over.defvjp(over_fwd, over_bwd)
    return over(x, weights, banks, expert_ids, overflows)
