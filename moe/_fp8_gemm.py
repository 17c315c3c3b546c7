"""The three GEMMs of a grouped linear layer at a chosen precision, bf16 or FP8.

Shared by the expert layer (`moe.experts`) and the dense projections (`moe.fp8_dense`). An FP8
GEMM quantizes each operand along its contraction axis with one power-of-two scale per row
(tokens) or per output channel (weights), runs on the e4m3 payloads with f32 accumulation, and
multiplies its result by the exact scales (torchao's float8 "rowwise" recipe). The quantization
passes are `moe._quant_pallas`'s (one-pass kernels on NVIDIA GPUs, the same bytes from XLA
elsewhere); the GEMMs are a `moe._grouped` backend's.
"""

from __future__ import annotations

import jax

from moe import _grouped, _quant_pallas

__all__ = ["dgrad", "forward", "wgrad"]


def _token_rows(a) -> tuple[jax.Array, jax.Array]:
    """A token operand as ``(e4m3 rows, f32 scale per row)``: quantized here in one pass
    (`moe._quant_pallas`), or passed in already quantized as that pair."""
    return a if isinstance(a, tuple) else _quant_pallas.rows(a)


def _mm8(ops: _grouped.GroupedGemms, a, w_q, gs, out_dtype) -> jax.Array:
    """``(a_q @ w_q[e]^T) * s_a[row] * s_w[e, n]``; ``w_q``: K-major ``(e4m3 [E, N, K],
    scale [E, N])``."""
    aq, s_a = _token_rows(a)
    return ops.mm8(aq, w_q[0], gs, out_dtype, s_a, w_q[1])


def forward(ops: _grouped.GroupedGemms, precision: str, a, w, gs, out_dtype) -> jax.Array:
    """``a @ w[e]`` per group (``w [E, K, N]``), bf16 or FP8 (``a`` may be an ``(e4m3,
    scale)`` pair; the weight is quantized per output channel into its K-major copy)."""
    if precision == "fp8":
        return _mm8(ops, a, _quant_pallas.cols_t(w), gs, out_dtype)
    return ops.fwd(a, w.astype(a.dtype), gs, out_dtype)


def dgrad(ops: _grouped.GroupedGemms, precision: str, g, w, gs, out_dtype) -> jax.Array:
    """``g @ w[e]^T`` per group (the data gradient), bf16 or FP8 (``w [E, K, N]`` is
    K-major for it: quantized per row; ``g`` may be an ``(e4m3, scale)`` pair)."""
    if precision == "fp8":
        return _mm8(ops, g, _quant_pallas.rows(w), gs, out_dtype)
    return ops.dgrad(g, w.astype(g.dtype), gs, out_dtype)


def wgrad(ops: _grouped.GroupedGemms, precision: str, a, g, gs, out_dtype) -> jax.Array:
    """``a_e^T @ g_e`` per group (the weight gradient ``[E, K, N]``), bf16 or FP8 (K-major
    copies, one scale per channel over the token rows)."""
    if precision == "fp8":
        (aq, s_a), (gq, s_g) = _quant_pallas.cols_t(a), _quant_pallas.cols_t(g)
        return ops.tmm8(aq, gq, gs, out_dtype, s_a, s_g)
    return ops.wgrad(a, g, gs, out_dtype)
