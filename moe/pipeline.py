"""The MoE layer's expert-parallel body per chunk, and the dropless layer's overflow pass.

:func:`chunk_experts` is one chunk of the pipelined layer (``DispatchOptions.overlap_chunks``):
dispatch, the local experts on the layout it produced, combine. The layer runs it per chunk
so that XLA's scheduler can put one chunk's async exchanges under another chunk's GEMMs.

:func:`local_first_pass` runs the first chunk's slots for this device's own experts
(:func:`split_local`) with no exchange, so their GEMMs can run under the step's first
all-to-all, which no chunk's experts could cover (``DispatchOptions.local_first``).

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

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe import experts as _experts
from moe.dispatch import DispatchPlan, WireRows, dense_capacity, dispatch_apply, plan_dispatch
from moe.dispatch import combine as combine_fn
from moe.options import DispatchOptions, MoEOptions

__all__ = ["Banks", "ChunkOutput", "LocalSplit", "chunk_experts", "local_experts",
           "local_first_pass", "overflow_experts", "overflow_token_counts", "split_local"]


class Banks(NamedTuple):
    """This device's expert weights.

    Attributes:
      w_gate_up: ``[E_local, d, 2 f]``.
      w_down: ``[E_local, f, d]``.
      bias: ``(b_gate_up [E_local, 2 f], b_down [E_local, d])`` or None.
    """

    w_gate_up: jax.Array
    w_down: jax.Array
    bias: tuple[jax.Array, jax.Array] | None = None


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


def local_experts(ex: jax.Array, group_sizes: jax.Array, banks: Banks, options: MoEOptions,
                  ex_wire: WireRows | None, group_alignment: int | None,
                  combine: _experts.CombineArgs, *, chain: bool = False
                  ) -> tuple[jax.Array, Banks]:
    """The local experts on the layout ``dispatch`` produced (padded ``[E, C, d]`` or ragged,
    aligned to ``group_alignment``; ``ex_wire``: ragged ``ex``'s FP8 wire rows, which the FP8
    forward GEMM reads), combined back to the tokens: ``([T, d], banks)``, the banks passed
    through the experts' custom VJP when ``chain`` (``experts_apply(chain_weights=True)``), else
    as they came."""
    eo = options.experts
    bgu, bd = banks.bias if banks.bias is not None else (None, None)
    if ex.ndim == 3 and eo.backend == "triton":  # 2-D GEMMs
        e_local, c, d = ex.shape
        full = jnp.full((e_local,), c, dtype=jnp.int32)
        out = _experts.experts_apply(
            ex.reshape(e_local * c, d), full, banks.w_gate_up, banks.w_down, bgu, bd,
            options=eo, fp8_block_size=options.fp8_block_size, chain_weights=chain)
        ey, weights = out if chain else (out, None)
        y = combine_fn(ey.reshape(e_local, c, -1), combine.weights, combine.plan,
                       combine_grad_dtype=combine.grad_dtype)
    else:
        # The dense layout interleaves padding per source (row p * C + r), so its valid rows
        # are not a prefix: run every row (padding rows are zero and are never read back by
        # combine). ('mosaic' takes the padded layout itself: slots as rows, no gathers.)
        sizes = None if ex.ndim == 3 else group_sizes
        out = _experts.experts_apply(
            ex, sizes, banks.w_gate_up, banks.w_down, bgu, bd, options=eo,
            fp8_block_size=options.fp8_block_size, group_alignment=group_alignment,
            x_wire=ex_wire, combine=combine, chain_weights=chain)
        y, weights = out if chain else (out, None)
    if not chain:  # the banks as they came: autodiff sums this call's gradient into them
        return y, banks
    return y, Banks(*weights, banks.bias)


def chunk_experts(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, banks: Banks, *,
                  options: MoEOptions, dispatch_options: DispatchOptions, num_experts: int,
                  group_alignment: int | None, with_wire: bool,
                  buckets: tuple[int, ...] | None = None, plan: DispatchPlan | None = None,
                  chain: bool = False) -> ChunkOutput:
    """One chunk: ``y = combine(experts(dispatch(x, expert_ids)), weights)``.

    Args:
      x: ``[T, d]`` this device's tokens of the chunk.
      expert_ids: int ``[T, k]`` (``num_experts``: a slot that goes nowhere).
      weights: ``[T, k]`` the combine weights.
      banks: this device's expert weights.
      options: the layer's options (experts, FP8 block size).
      dispatch_options: the dispatch options of the chunk (its capacity factor).
      num_experts: experts of the dispatch (the padded count).
      group_alignment: the dropless layout's group alignment (None: plain).
      with_wire: the FP8 wire rows go to the FP8 expert GEMMs as they are.
      buckets: the dropless exchange's buckets (None: the options').
      plan: the chunk's dispatch plan, built beforehand (:func:`moe.dispatch.plan_dispatch`;
        None: built here).
      chain: pass the banks through the experts (:class:`ChunkOutput`); every chunk but the
        last does, so that the backward's weight gradients accumulate from chunk to chunk.

    Returns:
      A :class:`ChunkOutput`.

    Example:
      >>> # inside jax.shard_map over the expert axis, as moe.layer runs each chunk:
      >>> # y, plan, banks = chunk_experts(x, ids, weights, Banks(w_gate_up, w_down),
      >>> #     options=opts, dispatch_options=opts.dispatch, num_experts=8,
      >>> #     group_alignment=None, with_wire=False, chain=True)
    """
    ex, wire, group_sizes, plan = dispatch_apply(
        x, expert_ids, num_experts=num_experts, options=dispatch_options,
        fp8_block_size=options.fp8_block_size, group_alignment=group_alignment,
        with_wire=with_wire, buckets=buckets, plan=plan)
    combine = _experts.CombineArgs(weights, plan, dispatch_options.combine_grad_dtype)
    y, banks = local_experts(ex, group_sizes, banks, options, wire, group_alignment, combine,
                             chain=chain)
    return ChunkOutput(y.astype(x.dtype), plan, banks)


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
    own slots need no exchange: a dispatch over no mesh axis (``expert_axis=()``) hands them
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


def local_first_pass(x: jax.Array, local_ids: jax.Array, weights: jax.Array, banks: Banks, *,
                     options: MoEOptions, dispatch_options: DispatchOptions, num_experts: int,
                     group_alignment: int | None, with_wire: bool) -> ChunkOutput:
    """A chunk's slots for this device's own experts through them, with no exchange.

    ``y = combine(experts(dispatch(x, local_ids)), weights)`` over no mesh axis
    (``expert_axis=()``), so nothing here waits for the chunk's all-to-all and XLA can run
    these GEMMs under it (``DispatchOptions.local_first``). Dense keeps the exchange's
    capacity ``C`` per (source, expert) (``dense_capacity`` of the chunk's tokens over all
    ``num_experts``), so it keeps exactly the slots the exchange would have kept; dropless
    drops nothing either way. The banks come back chained (:func:`chunk_experts`): the
    chunk's exchanged pass takes them next.

    Args:
      x: ``[T, d]`` the chunk's tokens.
      local_ids: int ``[T, k]`` local expert ids, ``E_local`` for no expert
        (:func:`split_local`).
      weights: ``[T, k]`` the combine weights.
      banks: this device's expert weights.
      options: the layer's options.
      dispatch_options: the chunk's dispatch options (its expert axis bound).
      num_experts: ``E``, all experts of the expert axis (the padded count).
      group_alignment: the dropless layout's group alignment (None: plain).
      with_wire: FP8 GEMMs read the FP8 rows as the wire would carry them.

    Returns:
      A :class:`ChunkOutput` (its plan is the local dispatch's).

    Example:
      >>> # inside jax.shard_map over 'expert', before the first chunk's exchanged pass:
      >>> # local, remote = split_local(ids, num_experts=8, axis_name='expert')
      >>> # y0, _, banks = local_first_pass(x, local, w, banks, options=opts,
      >>> #     dispatch_options=opts.dispatch, num_experts=8, group_alignment=None,
      >>> #     with_wire=False)
    """
    t, k = local_ids.shape  # the exchange's capacity counts all k slots of a token
    e_local = num_experts // jax.lax.axis_size(dispatch_options.expert_axis)
    if k > e_local:
        # A token's distinct experts include at most E_local of this device's: keep the
        # columns that can hold them (its local slots first, ascending). Within one expert
        # the slots stay in token order, so a capacity keeps the same ones.
        order = jnp.argsort(local_ids, axis=1, stable=True)[:, :e_local]
        local_ids = jnp.take_along_axis(local_ids, order, axis=1)
        weights = jnp.take_along_axis(weights, order, axis=1)
    local_do = dataclasses.replace(dispatch_options, expert_axis=())
    capacity = None
    if dispatch_options.transport in ("auto", "dense"):  # the dispatch's 'auto' is dense
        capacity = dense_capacity(t, k, num_experts, dispatch_options.capacity_factor,
                                  multiple=dispatch_options.capacity_multiple)
    plan = plan_dispatch(local_ids, num_experts=e_local, options=local_do, x_dtype=x.dtype,
                         fp8_block_size=options.fp8_block_size,
                         group_alignment=group_alignment, capacity=capacity)
    with jax.named_scope("moe_local_first"):
        return chunk_experts(x, local_ids, weights, banks, options=options,
                             dispatch_options=local_do, num_experts=e_local,
                             group_alignment=group_alignment, with_wire=with_wire, plan=plan,
                             chain=True)


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
