"""The three GEMMs of a grouped linear layer at a chosen precision, bf16 or FP8.

Shared by the expert layer (`moe.experts`) and the dense projections (`moe.fp8_dense`). An FP8
GEMM quantizes each operand along its contraction axis with one power-of-two scale per row
(tokens) or per output channel (weights), runs on the e4m3 payloads with f32 accumulation, and
multiplies its result by the exact scales (torchao's float8 "rowwise" recipe). The quantization
passes are `accel_kernels.quant.api`'s (one-pass kernels on NVIDIA GPUs, the same bytes from XLA
elsewhere); the GEMMs are an `accel_kernels.gmm.api` implementation's.

The weight gradient ``dW = a^T g`` contracts the token rows, along which the row-wise scales
vary. It reuses the row-quantized payloads that the forward and data-gradient GEMMs already
made (:func:`rows`): with ``a = s_a q_a`` and ``g = s_g q_g`` per row,
``dW = P * q_a^T (q_g * s_a s_g / P)`` where ``P = max_r s_a[r] s_g[r]``. The factor
``s_a s_g / P = 2^-k`` is folded into ``q_g`` (exact, except where a value leaves e4m3's
normal range and rounds to nearest even, i.e. in the rows that contribute least) as both
payloads are written transposed, and ``P`` scales the result. That is one XLA transpose
fusion reading and writing one byte per element (the rescaling happens in registers; no
wide copy is written) instead of a column-wise re-quantization from the compute dtype (two
reads of two bytes and a write); the products keep the row-wise precision of the other GEMMs.
XLA's fusion is used rather than a Pallas kernel, which moves these bytes slower and needs the
deprecated Triton backend, or integer ops on the e4m3 bits, which XLA splits into three
kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from accel_kernels.gmm import api as gmm_api
from accel_kernels.quant import api as quant_api
from accel_kernels.wire import api as wire_api

__all__ = ["dgrad", "forward", "rows", "rows_from_tokens", "rows_from_weighted",
           "rows_from_wire", "rows_if", "scaled_t", "weights", "wgrad", "wgrad_operands"]

_F32_BIAS = 127


def rows(a) -> tuple[jax.Array, jax.Array]:
    """A token operand as ``(e4m3 rows, f32 scale per row)``: quantized here in one pass
    (`accel_kernels.quant.api`), or passed in already quantized as that pair."""
    return a if isinstance(a, tuple) else quant_api.rows(a)


def rows_from_wire(wire: jax.Array, width: int, block_size: int,
                   index: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """FP8 wire rows (e4m3 + E8M0 scales per ``block_size`` channels,
    `accel_kernels.wire.api.encode_rows`), gathered by ``index`` if given (zero rows out of
    range), as the row-quantized pair of their decoded values: the bytes of ``rows(decoded
    rows)`` (`accel_kernels.wire.api.gather_rows_quantized`: one kernel pass on NVIDIA GPUs)."""
    return wire_api.gather_rows_quantized(wire, index, width=width, block_size=block_size)


def rows_from_tokens(tokens: jax.Array, index: jax.Array,
                     block_size: int) -> tuple[jax.Array, jax.Array]:
    """FP8 dispatch where nothing is sent (`moe.dispatch.collectives.TokenRows`): the
    row-quantized pair of ``decode(encode(tokens[index]))``, the bytes :func:`rows_from_wire` gives
    for the wire rows that the dispatch would have written
    (`accel_kernels.wire.api.gather_local_rows_quantized`)."""
    return wire_api.gather_local_rows_quantized(tokens, index, block_size=block_size)


def rows_from_weighted(rows: jax.Array, weights: jax.Array, slot: jax.Array, *, top_k: int,
                       wire_dtype) -> tuple[jax.Array, jax.Array]:
    """The row-quantized pair of the combine gradient's rows in the expert layout when nothing
    is sent: ``rows(wire_dtype(weights[s] * rows[s // top_k]))`` for each row's slot ``s``
    (zero rows for slots out of range; `accel_kernels.wire.api.gather_weighted_rows_quantized`)."""
    return wire_api.gather_weighted_rows_quantized(rows, weights, slot, top_k=top_k,
                                                   wire_dtype=wire_dtype)


def rows_if(wanted: bool, a):
    """``a``'s row-quantized pair (:func:`rows`) if an FP8 GEMM reads it, else None."""
    return rows(a) if wanted else None


def scaled_t(q: jax.Array, shift: jax.Array) -> jax.Array:
    """``e4m3(q * 2^-shift[..., None])`` transposed to ``[..., N, M]``, for e4m3 ``q
    [..., M, N]`` and integer ``shift >= 0`` per row: an exact rescaling in f32 (0 past f32's
    normal range, where e4m3 would round to 0 anyway) and a round-to-nearest-even cast, which
    XLA fuses with the transpose (one byte read and written per element)."""
    mult = jnp.ldexp(jnp.float32(1), -shift)[..., None]
    return jnp.swapaxes((q.astype(jnp.float32) * mult).astype(q.dtype), -1, -2)


def _exponent(s: jax.Array) -> jax.Array:
    """Biased f32 exponent (int32) of power-of-two scales; 255 for NaN."""
    return lax.bitcast_convert_type(s, jnp.int32) >> 23 & 0xFF


def wgrad_operands(a, g):
    """The K-major FP8 operands and epilogue scales of ``a^T @ g`` over the token rows, from
    row-quantized ``a [..., M, K]`` and ``g [..., M, N]`` (pairs, or arrays quantized here).

    Rows outside the groups must be zero (the expert layer's are): they count toward ``P``.

    Returns:
      ``(a_t [..., K, M], g_t [..., N, M], s_a [..., K], s_g [..., N])`` for
      ``tmm8``: ``a^T @ g = (a_t @ g_t^T) * s_a[:, None] * s_g[None, :]``, with the row scales'
      product folded into ``g_t`` relative to its maximum ``P`` (per leading index: per expert
      in the padded layout, over all groups in the ragged one) and ``s_a * s_g = P`` (two
      powers of two, so that neither underflows). A NaN scale (a row holding NaN or inf) makes
      the result NaN.
    """
    (aq, s_a), (gq, s_g) = rows(a), rows(g)
    # a's transpose takes no rescaling, but written as one (by 2^-0, a shift XLA cannot see
    # through) it is emitted as the same transpose fusion as g's, which moves e4m3 bytes
    # faster than XLA's plain transpose of them. The zeros pass the barrier with aq, one
    # shift per call: a zero shift shared by every layer lets XLA fuse all layers' transposes
    # into one multi-output fusion, slower than the plain transposes. The bytes are a's.
    no_shift, aq = lax.optimization_barrier((jnp.zeros(aq.shape[:-1], jnp.int32), aq))
    e = _exponent(s_a) + _exponent(s_g)  # log2(s_a s_g) + 2 * bias, per row
    top = jnp.max(e, axis=-1, keepdims=True)
    # P = 2^(top - 2 bias) as two factors, each within f32's normal range.
    half = (top - 2 * _F32_BIAS) // 2
    p_a = jnp.ldexp(jnp.float32(1), half)
    p_g = jnp.ldexp(jnp.float32(1), top - 2 * _F32_BIAS - half)
    bad = jnp.any(jnp.isnan(s_a) | jnp.isnan(s_g), axis=-1, keepdims=True)
    p_a = jnp.where(bad, jnp.nan, p_a)
    lead = aq.shape[:-2]
    return (scaled_t(aq, no_shift), scaled_t(gq, top - e),
            jnp.broadcast_to(p_a, (*lead, aq.shape[-1])),
            jnp.broadcast_to(p_g, (*lead, gq.shape[-1])))


def _mm8(ops: gmm_api.GroupedGemms, a, w_q, gs, out_dtype, trim: bool = True) -> jax.Array:
    """``(a_q @ w_q[e]^T) * s_a[row] * s_w[e, n]``; ``w_q``: K-major ``(e4m3 [E, N, K],
    scale [E, N])``."""
    aq, s_a = rows(a)
    return ops.mm8(aq, w_q[0], gs, out_dtype, s_a, w_q[1], trim=trim)


def weights(w: jax.Array) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """Both FP8 copies of ``w [E, K, N]``, ``(forward's, dgrad's)``, from two passes over it
    (`accel_kernels.quant.api.cols_t_and_rows`): the K-major copy with a scale per output channel
    (``[E, N, K]``, ``[E, N]``) and the row copy with a scale per ``K`` row (``[E, K, N]``,
    ``[E, K]``), the pairs :func:`forward` and :func:`dgrad` would make one at a time."""
    return quant_api.cols_t_and_rows(w)


def forward(ops: gmm_api.GroupedGemms, precision: str, a, w, gs, out_dtype) -> jax.Array:
    """``a @ w[e]`` per group (``w [E, K, N]``), bf16 or FP8 (``a`` may be an ``(e4m3,
    scale)`` pair; the weight is quantized per output channel into its K-major copy, or
    passed in as that pair, :func:`weights`)."""
    if precision == "fp8":
        w_q = w if isinstance(w, tuple) else quant_api.cols_t(w)
        return _mm8(ops, a, w_q, gs, out_dtype)
    return ops.fwd(a, w.astype(a.dtype), gs, out_dtype)


def dgrad(ops: gmm_api.GroupedGemms, precision: str, g, w, gs, out_dtype, *,
          trim: bool = True) -> jax.Array:
    """``g @ w[e]^T`` per group (the data gradient), bf16 or FP8 (``w [E, K, N]`` is
    K-major for it: quantized per row, or passed in as that pair, :func:`weights`; ``g``
    may be an ``(e4m3, scale)`` pair).
    ``trim=False``: an FP8 result may keep zero columns past ``K`` (``GroupedGemms.mm8``)."""
    if precision == "fp8":
        w_q = w if isinstance(w, tuple) else quant_api.rows(w)
        return _mm8(ops, g, w_q, gs, out_dtype, trim)
    return ops.dgrad(g, w.astype(g.dtype), gs, out_dtype)


def wgrad(ops: gmm_api.GroupedGemms, precision: str, a, g, gs, out_dtype,
          acc: jax.Array | None = None) -> jax.Array:
    """``a_e^T @ g_e`` per group (the weight gradient ``[E, K, N]``), bf16 or FP8 (``a`` and
    ``g`` may be row-quantized pairs; their transposed payloads with the row scales folded in,
    :func:`wgrad_operands`), plus ``acc`` (``[E, K, N]`` in ``out_dtype``) if given: added by
    the kernel where the implementation's does (``GroupedGemms.accumulates``), else after it."""
    kw = {"acc": acc} if acc is not None and ops.accumulates else {}
    if precision == "fp8":
        a_t, g_t, s_a, s_g = wgrad_operands(a, g)
        out = ops.tmm8(a_t, g_t, gs, out_dtype, s_a, s_g, **kw)
    else:
        out = ops.wgrad(a, g, gs, out_dtype, **kw)
    return out if acc is None or kw else out + acc
