"""``tgmm(acc=...)``: the weight-gradient kernel adding an existing output in its epilogue.

On the CPU: the emulation (`accel_kernels.gmm.mosaic.tgmm`) equals the product plus ``acc``
rounded once, an empty group gives ``acc``, a mismatched ``acc`` is refused, the kernel lowers
for CUDA to one Mosaic GPU call, and in Pallas' Mosaic GPU interpreter (jax >= 0.11) the kernel
itself writes ``acc + a_g^T b_g`` (bf16 and f32 outputs, FP8 with scales).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cuda_export import MOSAIC_GPU_CALLS, export_for_cuda

from accel_kernels.gmm import mosaic, mosaic_kernel

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
# 3 groups of 128-row multiples, the middle one empty; [N1, N2] one CTA tile of the default
# tiling ([tile_m, 2 tile_n] = [128, 256]) by two along N2.
SIZES, N1, N2 = (128, 0, 256), 128, 512


def _operands(seed=0, dtype=BF16, out_dtype=BF16):
    rng = np.random.default_rng(seed)
    rows = sum(SIZES)
    a = jnp.asarray(rng.standard_normal((rows, N1)), dtype)
    b = jnp.asarray(rng.standard_normal((rows, N2)), dtype)
    acc = jnp.asarray(rng.standard_normal((len(SIZES), N1, N2)) * 8, out_dtype)
    return a, b, jnp.asarray(SIZES, jnp.int32), acc


def _want(a, b, gs, acc, out_dtype, scales=None):
    """``acc + a_g^T b_g`` in float64, rounded once to ``out_dtype``."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    out, start = [], 0
    for n in np.asarray(gs):
        prod = a64[start:start + n].T @ b64[start:start + n]
        if scales is not None:
            prod = prod * np.asarray(scales[0])[:, None] * np.asarray(scales[1])[None, :]
        out.append(prod)
        start += n
    return (np.stack(out) + np.asarray(acc, np.float64)).astype(np.float32)


@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_emulation_adds_acc_to_the_product_once(out_dtype):
    a, b, gs, acc = _operands(out_dtype=out_dtype)
    got = jax.jit(lambda *x: mosaic.tgmm(*x[:3], k_major=False, out_dtype=out_dtype,
                                         acc=x[3]))(a, b, gs, acc)
    assert got.dtype == out_dtype
    want = _want(a, b, gs, acc, out_dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), want,
                               rtol=1e-5 if out_dtype == F32 else 2 ** -8, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(acc[1]))  # the empty group


def test_kernel_refuses_an_acc_unlike_its_output():
    a, b = S((256, N1), BF16), S((256, N2), BF16)
    gs = S((2,), jnp.int32)
    bad = S((2, N1, N2), F32)  # the output is bf16
    with pytest.raises(ValueError, match=r"acc must be \[2, 128, 512\] bfloat16"):
        export_for_cuda(lambda a, b, gs, acc: mosaic_kernel.tgmm(
            a, b, gs, out_dtype=BF16, acc=acc), a, b, gs, bad)


def test_lowers_for_cuda_to_one_mosaic_gpu_call():
    a, b, gs = S((384, N1), BF16), S((384, N2), BF16), S((3,), jnp.int32)
    text = export_for_cuda(lambda a, b, gs, acc: mosaic.tgmm(a, b, gs, k_major=False,
                                                            out_dtype=BF16, acc=acc),
                           a, b, gs, S((3, N1, N2), BF16))
    assert sum(text.count(f"custom_call @{c}(") for c in MOSAIC_GPU_CALLS) == 1
    # the add is the kernel's: no add over the output outside it
    assert not [ln for ln in text.splitlines() if "stablehlo.add" in ln and "3x128x512" in ln]


def _interpreted():
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import (
            InterpretGPUParams,
            force_gpu_interpret_mode,
        )
    except ImportError:  # pragma: no cover - depends on the installed jax
        pytest.skip("no Mosaic GPU interpret mode in this jax")
    return force_gpu_interpret_mode(InterpretGPUParams(uninitialized_memory="nan"))


@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="jax 0.10's Mosaic GPU interpreter has no ref transposes")
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_kernel_interpreted_adds_acc(out_dtype):
    a, b, gs, acc = _operands(1, out_dtype=out_dtype)
    with _interpreted():
        got = mosaic_kernel.tgmm(a, b, gs, out_dtype=out_dtype, acc=acc)
    want = _want(a, b, gs, acc, out_dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), want,
                               rtol=1e-5 if out_dtype == F32 else 2 ** -8, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(acc[1]))  # the empty group


@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="jax 0.10's Mosaic GPU interpreter has no ref transposes")
def test_kernel_interpreted_adds_acc_after_the_fp8_scales():
    a, b, gs, acc = _operands(2, dtype=F32)
    a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
    rng = np.random.default_rng(3)
    row_s = jnp.asarray(rng.uniform(0.5, 2, N1), F32)
    col_s = jnp.asarray(rng.uniform(0.5, 2, N2), F32)
    with _interpreted():
        got = mosaic_kernel.tgmm(a8.T, b8.T, gs, k_major=True, out_dtype=BF16,
                                 row_scale=row_s, col_scale=col_s, acc=acc)
    want = _want(a8, b8, gs, acc, BF16, (row_s, col_s))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2 ** -8, atol=1e-2)
