"""The one-pass FP8 quantization kernels (accel_kernels.quant.api) give the bytes of their XLA
references, run in Pallas interpret mode on CPU; the compiled GPU path is lowered in
tests/moe/test_fp8_lowering.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from accel_kernels import fp8
from accel_kernels.activations import GatedActivation
from accel_kernels.quant import api as qp
from accel_kernels.quant import triton as qt
from accel_kernels.quant import xla as qx

KINDS = ("silu", "gelu", "clamped_swiglu")  # gelu_tanh: silu's sigmoid on another argument


def _bytes(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype == jnp.float8_e4m3fn else a


def _assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(_bytes(g), _bytes(w))


def test_quantize_rows_matches_moe_fp8_quantize():
    x = jax.random.normal(jax.random.key(0), (16, 256), jnp.bfloat16) * 5
    x = x.at[3, 7].set(jnp.inf).at[5, 1].set(jnp.nan).at[6].set(0).at[8, 0].set(1e-30)

    @jax.jit  # kernel and references in one program (eagerly every op compiles its own)
    def both(x):
        ref = fp8.quantize(x, block_size=256)
        return (qt.quantize_rows(x, interpret=True), qx.quantize_rows_reference(x),
                (ref.data, fp8.block_scales(ref)[:, 0]))

    (q, s), want, want_fp8 = both(x)
    _assert_same((q, s), want)
    _assert_same((q, s), want_fp8)
    chex.assert_shape((q, s), [(16, 256), (16,)])
    assert np.isnan(np.asarray(s)[[3, 5]]).all() and np.isfinite(np.asarray(s)[6])


@pytest.mark.parametrize("kind", KINDS)
def test_gated_kernels_match_references(kind):
    act = GatedActivation(kind)
    k1, k2 = jax.random.split(jax.random.key(1))
    z = (jax.random.normal(k1, (8, 128), jnp.float32) * 4).astype(jnp.bfloat16)
    dh = jax.random.normal(k2, (8, 64), jnp.float32)
    @jax.jit  # kernels and references in one program (eagerly every op compiles its own)
    def both(z, dh):
        return (qt.gated_quantize_rows(z, act, interpret=True),
                qt.gated_grad_quantize_rows(z, dh, act, interpret=True),
                qx.gated_quantize_rows_reference(z, act),
                qx.gated_grad_quantize_rows_reference(z, dh, act, jnp.bfloat16),
                act.apply(z), act.grad(z, dh))

    (hq, hs), (dz, dq, ds), want_h, want_dz, h_ref, dz_ref = both(z, dh)
    if kind == "silu":  # the same ops: the same bytes
        _assert_same((hq, hs, dz, dq, ds), (*want_h, *want_dz))
    # erf / sigmoid may differ by an ulp between the interpreter and XLA's fused kernels
    h = hq.astype(jnp.float32) * hs[:, None]
    chex.assert_trees_all_close(h, h_ref, rtol=0.07, atol=1e-3 * float(hs.max()))
    chex.assert_trees_all_close(dz.astype(jnp.float32), dz_ref, rtol=1e-2, atol=1e-5)
    dzq = dq.astype(jnp.float32) * ds[:, None]
    chex.assert_trees_all_close(dzq, dz_ref, rtol=0.07, atol=1e-3 * float(ds.max()))


def test_unsupported_widths_use_the_reference_and_kernels_refuse_them():
    x = jnp.ones((4, 200), jnp.bfloat16)  # 200 is not a multiple of 16
    assert not qt.supported(200) and qt.supported(1408)
    _assert_same(*jax.jit(lambda x: (qp.rows(x), qx.quantize_rows_reference(x)))(x))
    with pytest.raises(ValueError, match="multiple of 16"):
        qt.quantize_rows(x, interpret=True)
    with pytest.raises(ValueError, match="dh must be"):
        qt.gated_grad_quantize_rows(jnp.ones((4, 64)), jnp.ones((4, 16)),
                                    GatedActivation("silu"), interpret=True)


def test_rows_that_are_not_a_power_of_two_go_in_pieces():
    """d_ff = 1408 (the LM benchmark's): rows of 1024 + 256 + 128 channels."""
    assert qt._chunks(1408) == [(0, 1024), (1024, 256), (1280, 128)]
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(k1, (4, 1408), jnp.bfloat16) * 3
    act = GatedActivation("silu")
    z = jax.random.normal(k2, (4, 2 * 176), jnp.bfloat16)  # F = 176 = 128 + 32 + 16
    dh = jax.random.normal(k3, (4, 176), jnp.float32)

    @jax.jit  # kernels and references in one program (eagerly every op compiles its own)
    def both(x, z, dh):
        return ((qt.quantize_rows(x, interpret=True), qx.quantize_rows_reference(x)),
                (qt.gated_quantize_rows(z, act, interpret=True),
                 qx.gated_quantize_rows_reference(z, act)),
                (qt.gated_grad_quantize_rows(z, dh, act, interpret=True),
                 qx.gated_grad_quantize_rows_reference(z, dh, act, jnp.bfloat16)))

    for got, want in both(x, z, dh):
        _assert_same(got, want)


def test_block_rows_divide_the_rows():
    assert qt.block_rows(32768, 4096) == 2 and qt.block_rows(6, 256) == 2
    assert qt.block_rows(7, 4096) == 1 and qt.block_rows(64, 1408) == 4


def test_quantize_cols_t_matches_transposed_row_quantization():
    x = jax.random.normal(jax.random.key(3), (2, 64, 128), jnp.bfloat16) * 3
    x = x.at[0, 5, 7].set(jnp.nan).at[1, :, 3].set(0)

    @jax.jit  # kernels and reference in one program (eagerly every op compiles its own)
    def both(x):
        ref = fp8.quantize(jnp.swapaxes(x, 1, 2), block_size=64)
        # 2-D token operands [R, K] -> [K, R] (the weight gradient's K-major copies)
        return (qt.quantize_cols_t(x, interpret=True), qp.cols_t(x[0]),
                (ref.data, fp8.block_scales(ref)[..., 0]))

    (q, s), got, (ref_data, ref_scales) = both(x)
    _assert_same((q, s), (ref_data, ref_scales))
    chex.assert_shape((q, s), [(2, 128, 64), (2, 128)])
    _assert_same(got, (ref_data[0], ref_scales[0]))
    with pytest.raises(ValueError, match="multiples of"):
        qt.quantize_cols_t(x[:, :, :100], interpret=True)
    assert not qt.cols_supported(100, 64)
    _assert_same(*jax.jit(lambda x: (qp.cols_t(x), qx.quantize_cols_t_reference(x)))(
        x[:, :, :100]))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_kernels_lower_for_cuda_with_rows_in_pieces():
    """The compiled (not interpreted) kernels lower for CUDA at a width that is not a power of
    two (``F = 176 = 128 + 32 + 16``) and at the column kernels' tile; no GPU needed."""
    from _cuda_export import TRITON_CALL, export_for_cuda

    act = GatedActivation("silu")
    S = jax.ShapeDtypeStruct

    def fn(x, z, dh, w):
        return (qt.quantize_rows(x), qt.gated_quantize_rows(z, act),
                qt.gated_grad_quantize_rows(z, dh, act), qt.quantize_cols_t(w),
                qt.quantize_cols_t_and_rows(w.astype(jnp.float32)))

    text = export_for_cuda(fn, S((64, 176), jnp.bfloat16), S((64, 352), jnp.bfloat16),
                           S((64, 176), jnp.float32), S((2, 128, 192), jnp.bfloat16))
    # rows, gated, gated grad, column maxima, columns, both weight copies' two passes
    assert text.count(TRITON_CALL) == 7


def test_gated_grad_quantize_rows_fp8_only():
    """``out_dtype=None``: only ``(q, scale)``, the same bytes as the FP8 outputs of the call
    that also writes ``dz`` and as the reference."""
    act = GatedActivation("silu")
    rng = np.random.default_rng(8)
    z = jnp.asarray(rng.standard_normal((8, 128), np.float32) * 4, jnp.bfloat16)
    dh = rng.standard_normal((8, 64), np.float32)
    dh[2], dh[5, 1] = 0, np.nan
    kern = functools.partial(qt.gated_grad_quantize_rows, act=act, interpret=True)

    @jax.jit  # kernels and references in one program (eagerly every op compiles its own)
    def both(z, dh):
        return (kern(z, dh, out_dtype=None), kern(z, dh),
                qx.gated_grad_quantize_rows_reference(z, dh, act, None), act.grad(z, dh))

    got, (_, *with_dz), want, dz_ref = both(z, dh)
    assert len(got) == 2
    chex.assert_shape(got, [(8, 128), (8,)])
    _assert_same(got, tuple(with_dz))
    _assert_same(got, want)
    s = np.asarray(got[1])
    assert np.isnan(s[5]) and np.isfinite(np.delete(s, 5)).all() and s[2] == 2.0**-126
    assert not np.asarray(got[0]).astype(np.float32)[2].any()
    ok = np.arange(8) != 5
    dzq = np.asarray(got[0]).astype(np.float32)[ok] * s[ok, None]
    chex.assert_trees_all_close(dzq, np.asarray(dz_ref)[ok], rtol=0.07,
                                atol=1e-3 * float(s[ok].max()))


def test_gated_grad_reads_only_the_first_f_columns_of_a_wider_dh():
    """The FP8 data-gradient GEMM hands over ``dh`` with its column padding (and in bf16):
    the kernel and the reference read its first ``F`` columns only."""
    act = GatedActivation("silu")
    rng = np.random.default_rng(9)
    z = jnp.asarray(rng.standard_normal((8, 2 * 48), np.float32) * 4, jnp.bfloat16)
    dh = jnp.asarray(rng.standard_normal((8, 48), np.float32), jnp.bfloat16)
    wide = jnp.concatenate([dh, jnp.full((8, 16), jnp.nan, dh.dtype)], axis=1)

    @jax.jit  # kernel and references in one program (eagerly every op compiles its own)
    def run(z, dh, wide):
        return (qx.gated_grad_quantize_rows_reference(z, dh, act, None),
                qt.gated_grad_quantize_rows(z, wide, act, out_dtype=None, interpret=True),
                qx.gated_grad_quantize_rows_reference(z, wide, act, None),
                qp.gated_grad_rows(z, wide, act, None))  # on the CPU: the reference

    want, *got = run(z, dh, wide)
    for g in got:
        _assert_same(g, want)
    assert np.isfinite(np.asarray(want[1])).all()
