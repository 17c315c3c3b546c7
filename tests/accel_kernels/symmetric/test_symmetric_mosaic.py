"""The symmetric-tile GEMM (`accel_kernels.symmetric.mosaic`) on the CPU.

The kernel runs only on a Hopper GPU. Here: its tile list covers the upper triangle and
nothing wholly below it, its shape checks name what is wrong, it lowers for CUDA to one Mosaic
GPU call carrying that tile list (with ``mirror`` or without), and in Pallas' Mosaic GPU
interpreter (jax >= 0.11) it writes ``u @ w^T`` on exactly the listed tiles, or with
``mirror`` that upper triangle mirrored over the whole matrix.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cuda_export import MOSAIC_GPU_CALLS, export_for_cuda, kernel_calls

from accel_kernels import mosaic_tiles as mk
from accel_kernels.symmetric import mosaic as ms
from accel_kernels.symmetric.api import mirror_upper

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
TILE_M, CTA_N = 128, 256  # the default tiling's [tile_m, 2 tile_n]


def _written(p, tile_m=TILE_M, cta_n=CTA_N):
    """``[p, p]`` mask of the elements the tile list covers (asserting no tile repeats)."""
    mi, ni = ms.upper_tile_map(p, tile_m, cta_n)
    assert mi.dtype == ni.dtype == np.int32
    assert len(set(zip(mi.tolist(), ni.tolist(), strict=True))) == len(mi), "a tile listed twice"
    mask = np.zeros((p, p), bool)
    for m, n in zip(mi.tolist(), ni.tolist(), strict=True):
        assert 0 <= m < p // tile_m and 0 <= n < p // cta_n, (m, n)
        mask[m * tile_m:(m + 1) * tile_m, n * cta_n:(n + 1) * cta_n] = True
    return mi, ni, mask


@pytest.mark.parametrize("p,tile_m,cta_n", [(128, 128, 128), (256, 128, 256), (384, 128, 128),
                                            (512, 128, 256), (1024, 128, 256), (1024, 64, 256),
                                            (768, 256, 128)])
def test_tile_map_covers_the_upper_triangle_and_only_tiles_that_touch_it(p, tile_m, cta_n):
    mi, ni, mask = _written(p, tile_m, cta_n)
    upper = np.triu(np.ones((p, p), bool))
    assert mask[upper].all(), "an element on or above the diagonal in no tile"
    # each tile holds an element with i <= j (its first row starts before its last column)
    for m, n in zip(mi.tolist(), ni.tolist(), strict=True):
        assert m * tile_m <= (n + 1) * cta_n - 1, (m, n)
    # and every tile that touches the triangle is listed: the fewest tiles that cover it
    touching = sum(m * tile_m <= (n + 1) * cta_n - 1
                   for m in range(p // tile_m) for n in range(p // cta_n))
    assert len(mi) == touching
    assert (np.diff(ni) >= 0).all()  # column band by column band


def test_tile_map_skips_about_half_the_tiles():
    """``(T + 2) / (2 T)`` of the tiles for ``T = p / tile_m`` row tiles (the module's count)."""
    for p in (512, 1024, 4096):
        t = p // TILE_M
        mi, _ = ms.upper_tile_map(p, TILE_M, CTA_N)
        assert len(mi) * 2 * t == (t + 2) * t * (p // CTA_N), p


def test_check_shapes_names_what_is_wrong():
    assert ms.check_shapes((2, 256, 64), (2, 256, 64), BF16) is None
    assert ms.check_shapes((1, 512, 128), (1, 512, 128), jnp.float16) is None
    for u, w in [((256, 64), (256, 64)), ((2, 256, 64), (2, 256, 128)),
                 ((2, 256, 64), (1, 256, 64))]:
        why = ms.check_shapes(u, w, BF16)
        assert why is not None and "u and w must both be [B, p, r]" in why, (u, w, why)
    why = ms.check_shapes((1, 256, 64), (1, 256, 64), jnp.float32)
    assert why is not None and "operands must be one of" in why and "float32" in why
    # p: a multiple of 2 tile_n = 256 (and tile_m = 128); r: of tile_k = 64 for 16-bit operands
    tiling = mk.default_tiling(BF16)
    for p, r in [(128, 64), (384, 64), (200, 64), (256, 40), (256, 96)]:
        why = ms.check_shapes((1, p, r), (1, p, r), BF16)
        assert why is not None and f"p={p}, r={r}" in why, (p, r, why)
        assert f"multiple of {2 * tiling.tile_n}" in why and f"r of {tiling.tile_k}" in why
    # a smaller tiling takes what the default one does not
    small = mk.MosaicTiling(tile_m=64, tile_n=64, tile_k=32)
    assert ms.check_shapes((1, 128, 32), (1, 128, 32), BF16, small) is None


def test_symmetric_upper_refuses_what_it_cannot_take_before_lowering():
    """The error repeats check_shapes' reason and names the option that avoids the kernel."""
    x = jnp.zeros((1, 200, 64), BF16)
    with pytest.raises(ValueError, match=r"symmetric_upper: p must be a multiple of 256.*"
                                         r"p=200, r=64") as err:
        ms.symmetric_upper(x, x)
    assert ms.AVOID in str(err.value)
    with pytest.raises(ValueError, match="operands must be one of"):
        ms.symmetric_upper(jnp.zeros((1, 256, 64)), jnp.zeros((1, 256, 64)))
    with pytest.raises(ValueError, match="u and w must share a dtype"):
        ms.symmetric_upper(jnp.zeros((1, 256, 64), BF16), jnp.zeros((1, 256, 64), jnp.float16))
    with pytest.raises(ValueError, match=r"u and w must both be \[B, p, r\]"):
        ms.symmetric_upper(jnp.zeros((256, 64), BF16), jnp.zeros((256, 64), BF16))
    # the mirror transposes [tile_m, tile_n] accumulators and [epi_m, epi_n] blocks in place
    y = jnp.zeros((1, 256, 64), BF16)
    for tiling in (mk.MosaicTiling(tile_m=64), mk.MosaicTiling(epi_n=32)):
        with pytest.raises(ValueError, match=r"mirror=True needs square tiles .*or "
                                             r"mirror=False and mirror the result"):
            ms.symmetric_upper(y, y, tiling=tiling, mirror=True)


def test_reference_is_the_full_product():
    rng = np.random.default_rng(0)
    u, w = (jnp.asarray(rng.standard_normal((2, 24, 40)), BF16) for _ in range(2))
    want = np.einsum("bik,bjk->bij", np.asarray(u, np.float32), np.asarray(w, np.float32))
    got = jax.jit(ms.symmetric_upper_reference, static_argnames="out_dtype")(
        u, w, out_dtype=jnp.float32)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-4)
    assert ms.symmetric_upper_reference(u, w).dtype == BF16


@pytest.mark.parametrize("b,p,r,dtype,out_dtype,mirror", [
    (2, 256, 128, BF16, None, False),
    (1, 512, 64, jnp.float16, jnp.float32, False),
    (2, 1024, 11008, BF16, None, True),  # Newton-Schulz's sizes: bf16 (standard form) ...
    (1, 512, 64, jnp.float16, jnp.float32, True),  # ... f32 results (Gram form)
])
def test_kernel_lowers_for_cuda_to_one_mosaic_call_with_the_tile_list(b, p, r, dtype,
                                                                      out_dtype, mirror):
    text = export_for_cuda(
        lambda u, w: ms.symmetric_upper(u, w, out_dtype=out_dtype, mirror=mirror),
        S((b, p, r), dtype), S((b, p, r), dtype))
    bits = {"bfloat16": "bf16", "float16": "f16"}[jnp.dtype(dtype).name]
    name = f"symmetric_{'full' if mirror else 'upper'}_{bits}"
    calls = kernel_calls(text, name)
    assert len(calls) == 1, len(calls)
    assert any(f"@{name}(" in calls[0] for name in MOSAIC_GPU_CALLS), calls[0][:200]
    # operands: the tile list (row and column tile indices) and u, w; result [B, p, p]
    tiles = len(ms.upper_tile_map(p, TILE_M, CTA_N)[0])
    elem = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
    ins, out = re.search(r":\s*\(([^()]*)\)\s*->\s*(tensor<[^>]*>)", calls[0]).groups()
    operand = f"tensor<{b}x{p}x{r}x{elem[jnp.dtype(dtype).name]}>"
    assert ins.replace(" ", "") == f"tensor<{tiles}xi32>,tensor<{tiles}xi32>,{operand},{operand}"
    assert out == f"tensor<{b}x{p}x{p}x{elem[jnp.dtype(out_dtype or dtype).name]}>"
    # the named scope by which xla_comm's cost model charges the call its share of the FLOPs
    total = (p // TILE_M) * (p // CTA_N)
    assert re.search(rf'loc\("[^"]*/tiles_{tiles}_of_{total}/{name}/', text)


# ----------------------------------------------------------------------------------------------
# The kernel's arithmetic in Pallas' Mosaic GPU interpreter: u @ w^T on the listed tiles.
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="jax 0.10's Mosaic GPU interpreter has no ref transposes (wgmma's "
                           "transposed w block: 'TransposeTransform' object has no attribute "
                           "'indices')")
def test_kernel_interpreted_writes_the_product_on_the_listed_tiles_only():
    """Two matrices, two contraction steps: the listed tiles hold ``u @ w^T`` (f32
    accumulation); the others keep the interpreter's NaN-filled uninitialized memory."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import (
            InterpretGPUParams,
            force_gpu_interpret_mode,
        )
    except ImportError:  # pragma: no cover - depends on the installed jax
        pytest.skip("no Mosaic GPU interpret mode in this jax")
    b, p, r = 2, 512, 128
    k1, k2 = jax.random.split(jax.random.key(0))
    u = jax.random.normal(k1, (b, p, r)).astype(BF16)
    w = jax.random.normal(k2, (b, p, r)).astype(BF16)  # not symmetric: each tile is checked
    with force_gpu_interpret_mode(InterpretGPUParams(uninitialized_memory="nan")):
        got = np.asarray(ms.symmetric_upper(u, w, out_dtype=jnp.float32))
    want = np.asarray(ms.symmetric_upper_reference(u, w, out_dtype=jnp.float32))
    _, _, mask = _written(p)
    mask = np.broadcast_to(mask, got.shape)
    # bf16 operands are exact in f32; only the summation order differs
    np.testing.assert_allclose(got[mask], want[mask], rtol=1e-5, atol=1e-4)
    assert np.isnan(got[~mask]).all()


@pytest.mark.skipif(jax.__version_info__ < (0, 11),
                    reason="jax 0.10's Mosaic GPU interpreter has no ref transposes")
@pytest.mark.parametrize("b,out_dtype", [(2, jnp.float32), (1, BF16)])
def test_kernel_interpreted_with_mirror_writes_the_upper_triangle_mirrored(b, out_dtype):
    """Every element written (none left NaN), each one below the diagonal exactly its mirror
    image, the upper triangle ``u @ w^T``'s: a non-symmetric product shows which writer won.
    Integer operands keep the bf16 result exact; f32 results (32-bit registers) and bf16
    ones (16-bit) take different shuffles into the transposed layout."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import (
            InterpretGPUParams,
            force_gpu_interpret_mode,
        )
    except ImportError:  # pragma: no cover - depends on the installed jax
        pytest.skip("no Mosaic GPU interpret mode in this jax")
    p, r = 512, 64  # four row tiles, two column bands: tiles above, on and below the diagonal
    rng = np.random.default_rng(b)
    u, w = (jnp.asarray(rng.integers(-2, 3, size=(b, p, r)), BF16) for _ in range(2))
    with force_gpu_interpret_mode(InterpretGPUParams(uninitialized_memory="nan")):
        got = np.asarray(ms.symmetric_upper(u, w, out_dtype=out_dtype, mirror=True))
    full = ms.symmetric_upper_reference(u, w, out_dtype=out_dtype)
    np.testing.assert_array_equal(got, np.asarray(mirror_upper(full)))
    np.testing.assert_array_equal(got, np.swapaxes(got, -1, -2))
