"""The FP8 expert GEMMs consume float8_e4m3fn operands on the GPU, with no bf16 copy of them.

The MoE layer's forward + backward is exported for CUDA (an abstract H200, no GPU needed) and
the StableHLO is read: every grouped GEMM of the ragged layout is a Mosaic GPU call whose two
matrix operands are ``f8E4M3FN``, every GEMM of the padded layout a ``dot_general`` of two
``f8E4M3FN`` operands, and no ``f8E4M3FN`` value is converted back to a wider type anywhere. The
token operands are quantized by the one-pass Pallas kernels of ``accel_kernels.quant.api`` (x, dy,
``act(z)`` and ``dz`` with the activation's backward; their Mosaic GPU twins in
``accel_kernels.quant.mosaic`` on Hopper), not by XLA's reduce + convert passes.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from _cuda_export import (
    cuda_mesh,
    export_for_cuda,
    gemm_calls,
    kernel_calls,
    kernel_names,
)

import moe
from xla_comm.lowered import widened_fp8

ALL_FP8 = dict(gemm_dtype="fp8", dgrad_dtype="fp8", wgrad_dtype="fp8")
E, K, D, F, TOKENS = 8, 2, 512, 256, 512
F8 = "f8E4M3FN"


@functools.cache
def _layer_grad_text(transport: str, backend: str, dispatch_dtype=None) -> str:
    mesh = cuda_mesh((1, 1), ("data", "expert"))
    opts = moe.MoEOptions.create(E, K, transport=transport, gemm_implementation=backend,
                                 dispatch_dtype=dispatch_dtype, **ALL_FP8)

    def loss(x, router, w_gate_up, w_down):
        y, _ = moe.moe_apply(x, router, w_gate_up, w_down, options=opts, mesh=mesh)
        return jnp.sum(y.astype(jnp.float32))

    S = jax.ShapeDtypeStruct
    return export_for_cuda(
        jax.grad(loss, argnums=(0, 2, 3)), S((1, TOKENS, D), jnp.bfloat16),
        S((D, E), jnp.float32), S((E, D, 2 * F), jnp.bfloat16), S((E, F, D), jnp.bfloat16))


def _operand_types(line: str) -> list[str]:
    """The operand tensor types of one StableHLO op line (``: (a, b) -> c``)."""
    sig = re.search(r":\s*\(([^()]*)\)\s*->", line)
    assert sig, line[-300:]
    return re.findall(r"tensor<[^>]*>", sig.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["dropless", "dense"])
def test_gemms_are_fp8_mosaic_calls(transport):
    """Ragged rows (dropless) and padded slots as rows (dense, tiles past the filled slots
    skipped) both run all six GEMMs as Mosaic GPU kernels on e4m3 operands."""
    text = _layer_grad_text(transport, "mosaic")
    calls = gemm_calls(text)
    # forward gate_up and down, data gradients of both, weight gradients of both
    assert len(calls) == 6, len(calls)
    for line in calls:
        matrices = [t for t in _operand_types(line) if not re.search(r"x(f32|i32)>$", t)]
        assert len(matrices) == 2 and all(t.endswith(f"x{F8}>") for t in matrices), matrices
    assert widened_fp8(text) == []


@pytest.mark.slow
def test_padded_layout_gemms_are_fp8_dots():
    text = _layer_grad_text("dense", "xla")
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line
            and f"x{F8}>" in line]
    assert len(dots) == 6, len(dots)
    for line in dots:
        assert all(t.endswith(f"x{F8}>") for t in _operand_types(line)), line[-300:]
    assert widened_fp8(text) == []


def _quantize_kernels(text: str) -> list[str]:
    """Names of the quantization kernels (Triton or Mosaic GPU calls) in an exported module."""
    return kernel_names(text, r"fp8_\w*(?:quantize|amax)\w*")


@pytest.mark.slow
@pytest.mark.parametrize("transport,backend", [("dropless", "mosaic"), ("dense", "xla")])
def test_operands_are_quantized_by_the_pallas_kernels(transport, backend):
    """All six GEMMs in FP8: x and dy by ``quantize_rows``, h = act(z) by the fused activation
    kernel (once: the backward keeps its e4m3 rows), dz by the fused activation-backward
    kernel (its FP8 copy only); each weight's two copies (forward: the transposed K-major
    copy, per column; dgrad: per row) from two passes (the maxima, then both copies); the weight
    gradients read the e4m3 rows of x, h, dy and dz, transposed by XLA (no kernel of these,
    dy's and dz's rescaled by powers of two on the way), with no second quantization. With
    one device and the dropless layout, dy's rows are made as the combine's backward gathers
    them (``wire_weighted_rows_fp8``, `moe.experts.fused_combine`), not written in bf16 first."""
    text = _layer_grad_text(transport, backend)
    fused = transport == "dropless"
    tokens = (["fp8_gated_grad_quantize_rows", "fp8_gated_quantize_rows"]
              + (1 if fused else 2) * ["fp8_quantize_rows"])
    weights = 2 * ["fp8_weight_amax", "fp8_weight_quantize"]  # both copies, two passes
    assert _quantize_kernels(text) == sorted(tokens + weights), _quantize_kernels(text)
    weighted = kernel_calls(text, "wire_weighted_rows_fp8")
    assert len(weighted) == (1 if fused else 0), len(weighted)


def test_widening_check_catches_a_wide_copy():
    """The check passes a rescale back to e4m3 (what the weight gradient's fold does) and
    fails a dequantized copy that is kept."""
    S = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    rescale = export_for_cuda(lambda q, m: (q.astype(jnp.float32) * m).astype(f8).T,
                              S((32, 16), f8), S((32, 1), jnp.float32))
    assert widened_fp8(rescale) == []
    for keep in (lambda q, m: q.astype(jnp.bfloat16) * 2,
                 lambda q, m: ((q.astype(jnp.float32) * m).astype(f8), q.astype(jnp.float32))):
        assert len(widened_fp8(export_for_cuda(keep, S((32, 16), f8),
                                               S((32, 1), jnp.float32)))) == 1


def test_gated_grad_kernel_reads_the_padded_bf16_dh():
    """With d_ff not a multiple of the FP8 GEMM's 256-column tile (384 -> 512), the
    activation-backward kernel reads the data-gradient GEMM's result as written: 512 columns,
    in bf16 (only dz's e4m3 rows are made from it), with no slice copy in between."""
    from accel_kernels.gmm.api import aligned_rows
    from moe.experts import gated_experts

    rows, d, f = 256, 256, 384

    def loss(x, w_gate_up, w_down):
        y = gated_experts(x, jnp.array([128, 128], jnp.int32), w_gate_up, w_down,
                          gemm_implementation="mosaic", **ALL_FP8)
        return jnp.sum(y.astype(jnp.float32))

    S = jax.ShapeDtypeStruct
    text = export_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), S((rows, d), jnp.bfloat16),
                           S((2, d, 2 * f), jnp.bfloat16), S((2, f, d), jnp.bfloat16))
    grad_calls = kernel_calls(text, "fp8_gated_grad_quantize_rows")
    assert len(grad_calls) == 1
    m = aligned_rows(rows, 2, 128)  # the rows as the kernels take them (tile-aligned groups)
    assert _operand_types(grad_calls[0]) == [f"tensor<{m}x{2 * f}xbf16>",
                                             f"tensor<{m}x512xbf16>"], grad_calls[0][-300:]
    assert not re.search(rf"stablehlo.slice.*-> tensor<{m}x{f}x(bf16|f32)>", text)


@pytest.mark.slow
def test_fp8_wire_rows_feed_the_fp8_gemm_without_a_second_quantization():
    """FP8 dispatch on the dropless layout: the forward gate_up GEMM reads x's e4m3 rows made
    by one Pallas pass (the wire's block rounding, then row scales), dy's are made as they
    are gathered, so the plain row quantization kernel does not run, and the six GEMMs stay
    FP8 Mosaic calls."""
    text = _layer_grad_text("dropless", "mosaic", dispatch_dtype="fp8")
    calls = gemm_calls(text)
    assert len(calls) == 6, len(calls)
    tokens = ["fp8_gated_grad_quantize_rows", "fp8_gated_quantize_rows"]  # x's, dy's: fused
    weights = 2 * ["fp8_weight_amax", "fp8_weight_quantize"]
    assert _quantize_kernels(text) == sorted(tokens + weights), _quantize_kernels(text)
    # One device sends nothing: one pass makes those rows from the tokens (with the wire's
    # rounding) and no wire rows are written or read.
    assert len(kernel_calls(text, "wire_local_rows_fp8")) == 1
    assert not kernel_calls(text, "wire_gather_encode")
    assert not kernel_calls(text, "wire_gather_rows_fp8")
