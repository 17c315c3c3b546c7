"""The row-wise FP8 quantization kernels of `accel_kernels.quant.api` in Pallas Mosaic GPU.

Same contract and bytes as the Triton kernels there (``quantize_rows``, ``gated_quantize_rows``
and ``gated_grad_quantize_rows``: one read of the operand, e4m3 rows with one power-of-two
scale per row, ``accel_kernels.fp8.scales_from_amax_bits``), written for the backend jax
keeps: on jax 0.11 every Pallas Triton call warns that Triton is deprecated.

Each kernel is a grid of one-warpgroup CTAs over blocks of :data:`BLOCK_ROWS` rows. A block
is loaded straight from global memory into registers in a layout where each warp owns one
row and its 32 lanes hold ``vec``-element vectors across the row
(:func:`accel_kernels.mosaic_gpu.row_layout`), so the
row maximum is a reduction across the lanes of one warp (shuffles, no shared memory) and the
stores are 16-byte vectors (8 bytes of e4m3).

Global-memory stores follow the rules jax's Mosaic GPU transfer planner enforces since jax
0.12 (each warp writes whole 32-byte sectors, at least 4 bytes per thread, each warpgroup whole
128-byte lines): the e4m3 rows are stored straight from registers, which needs ``vec >= 4``
(rows a multiple of 128 channels), and the per-row scales, 16 bytes per CTA, go through shared
memory and a TMA copy (:func:`accel_kernels.mosaic_gpu.store_small`). Rows must be a
multiple of 128 channels and the row count a multiple of :data:`BLOCK_ROWS`: :func:`supported`;
other shapes take the XLA path (`accel_kernels.quant.api`). The activations' sigmoid is traced
as ``1 / (1 + exp(-x))`` (Mosaic GPU has no ``logistic`` rule), so the activation backward's
e4m3 bytes may differ from the Triton kernel's by one code, in rare values.

The weights' two FP8 copies (``quantize_cols_t``, ``quantize_cols_t_and_rows``) are tile
kernels instead: two passes over ``[64, 128]`` tiles, the second transposing each e4m3 tile
through shared memory, so each tile is read from global memory twice and written once per
copy.

These kernels lower only for NVIDIA GPUs with Mosaic GPU (Hopper, ``sm_90a``); the tests
lower them for CUDA on the CPU and compare the Triton and XLA paths they replace;
``benchmarks/quant_bench.py`` compares their bytes and times on the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from accel_kernels import fp8
from accel_kernels import mosaic_gpu as mg
from accel_kernels.activations import GatedActivation
from accel_kernels.mosaic_gpu import F8, WARPS, plgpu, store_small
from accel_kernels.quant import xla as quant_xla

BLOCK_ROWS = WARPS
"""Rows per CTA: one per warp of its warpgroup."""


ROW_MULTIPLE = 128
"""Channels a row width must be a multiple of: 32 lanes times the 4-element lane vector that
makes an e4m3 store 4 bytes per thread."""


def supported(m: int, width: int) -> bool:
    """Whether ``m`` rows of ``width`` channels fit these kernels (``width`` a multiple of
    :data:`ROW_MULTIPLE`, ``m`` of :data:`BLOCK_ROWS`)."""
    return (mg.MOSAIC_IMPORT_ERROR is None and width >= ROW_MULTIPLE and width % ROW_MULTIPLE == 0
            and m % BLOCK_ROWS == 0)


def _block(width: int, itemsize: int):
    rows = mg.ds(lax.axis_index("rows") * BLOCK_ROWS, BLOCK_ROWS)
    return rows, mg.row_layout(mg.vector_length(width, itemsize))


def _scale_smem():
    return plgpu.SMEM((BLOCK_ROWS,), jnp.float32)


def _quantize_body(x_ref, q_ref, s_ref, smem, *, width):
    rows, layout = _block(width, x_ref.dtype.itemsize)
    (q,), s = mg.scaled_e4m3([mg.load_f32(x_ref.at[rows, :], layout)], layout)
    q_ref[rows, :] = q
    store_small(s, s_ref.at[rows], smem)


def _gated_body(z_ref, q_ref, s_ref, smem, *, width, act):
    rows, layout = _block(width, z_ref.dtype.itemsize)
    g = mg.load_f32(z_ref.at[rows, mg.ds(0, width)], layout)
    u = mg.load_f32(z_ref.at[rows, mg.ds(width, width)], layout)
    (q,), s = mg.scaled_e4m3([act.apply_parts(g, u, sigmoid=mg.sigmoid)], layout)
    q_ref[rows, :] = q
    store_small(s, s_ref.at[rows], smem)


def _gated_grad_body(z_ref, dh_ref, *out_refs, width, act):
    *dz_ref, q_ref, s_ref, smem = out_refs  # dz_ref: [] when only the FP8 copy is wanted
    rows, layout = _block(width, z_ref.dtype.itemsize)
    g = mg.load_f32(z_ref.at[rows, mg.ds(0, width)], layout)
    u = mg.load_f32(z_ref.at[rows, mg.ds(width, width)], layout)
    dh = mg.load_f32(dh_ref.at[rows, mg.ds(0, width)], layout)
    dg, du = act.grad_parts(g, u, dh, sigmoid=mg.sigmoid)
    (qg, qu), s = mg.scaled_e4m3([dg, du], layout)
    for start, d, q in ((0, dg, qg), (width, du, qu)):
        cols = mg.ds(start, width)
        if dz_ref:
            dz_ref[0][rows, cols] = d.astype(dz_ref[0].dtype)
        q_ref[rows, cols] = q
    store_small(s, s_ref.at[rows], smem)


AVOID_FP8_GEMMS = "bf16 expert GEMMs (gemm_dtype, dgrad_dtype and wgrad_dtype 'bf16')"
"""What keeps the layer off the FP8 operands' quantization kernels (for the error of
`accel_kernels.lowering.check_kernel_lowers`)."""


def launch(body, operands, outs, **kw):
    """:func:`accel_kernels.mosaic_gpu.launch` with this module's ``avoid``."""
    return mg.launch(body, operands, outs, avoid=AVOID_FP8_GEMMS, **kw)


def _check(x: jax.Array, width: int, what: str) -> None:
    if x.ndim != 2 or not supported(x.shape[0], width):
        raise ValueError(
            f"{what} must be 2-D with rows a multiple of {BLOCK_ROWS} and a row width that is "
            f"a multiple of {ROW_MULTIPLE} for the Mosaic GPU quantization kernels, got shape "
            f"{x.shape}; accel_kernels.quant.api.rows (and its siblings) take the XLA path for "
            f"other "
            "shapes.")


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row-wise e4m3 quantization in one pass: ``(q [M, K], scale f32 [M])``.

    ``scale = 2^ceil(log2(amax / 448))`` per row, ``q = e4m3(clip(x / scale, -448, 448))``:
    the bytes of ``accel_kernels.quant.xla.quantize_rows_reference``.

    Args:
      x: float ``[M, K]``, ``M`` a multiple of 4 and ``K`` of 128.

    Returns:
      ``(q float8_e4m3fn [M, K], scale float32 [M])``.

    Example (lowered for CUDA; it runs on a Hopper GPU)::

      q, s = quantize_rows(jnp.full((4, 256), 3.0))  # s == [2^-7] * 4
    """
    m, k = x.shape
    _check(x, k, "x")
    return launch(functools.partial(_quantize_body, width=k), (x,),
                  (((m, k), F8), ((m,), jnp.float32)), grid=m // BLOCK_ROWS,
                  name="fp8_quantize_rows_mgpu",
                  scratch=(_scale_smem(),))


def gated_quantize_rows(z: jax.Array, act: GatedActivation) -> tuple[jax.Array, jax.Array]:
    """``h = act(z)`` quantized row-wise from one read of ``z``: ``(q [M, F], scale [M])``.

    Args:
      z: float ``[M, 2F]`` (gate columns, then up columns), ``F`` a multiple of 128.
      act: the gated activation.

    Returns:
      As :func:`quantize_rows` for ``act.apply(z)`` (computed in f32, not rounded first).
    """
    m, two_f = z.shape
    f = two_f // 2
    _check(z, f, "z")
    return launch(functools.partial(_gated_body, width=f, act=act), (z,),
                  (((m, f), F8), ((m,), jnp.float32)), grid=m // BLOCK_ROWS,
                  name="fp8_gated_quantize_rows_mgpu",
                  scratch=(_scale_smem(),))


def gated_grad_quantize_rows(z: jax.Array, dh: jax.Array, act: GatedActivation, *,
                             out_dtype=jnp.bfloat16):
    """The activation's backward ``dz = act'(z) dh`` in ``out_dtype`` and quantized row-wise.

    Args:
      z: float ``[M, 2F]``, ``F`` a multiple of 128.
      dh: float ``[M, F']``, ``F' >= F``; only the first ``F`` columns are read.
      act: the gated activation.
      out_dtype: dtype of the unquantized ``dz``; None: only the quantized copy.

    Returns:
      ``(dz out_dtype [M, 2F], q float8_e4m3fn [M, 2F], scale float32 [M])``; ``(q, scale)``
      if ``out_dtype`` is None.
    """
    m, two_f = z.shape
    f = two_f // 2
    _check(z, f, "z")
    outs = quant_xla.gated_grad_outputs(z, dh, out_dtype)
    return launch(functools.partial(_gated_grad_body, width=f, act=act), (z, dh), outs,
                  grid=m // BLOCK_ROWS, name="fp8_gated_grad_quantize_rows_mgpu",
                  scratch=(_scale_smem(),))


# ----------------------------------------------------------------------------------------------
# The weights' copies: column-wise quantization written transposed (K-major), and row-wise, in
# two tile passes over ``a [B, M, N]`` (`accel_kernels.quant.triton.quantize_cols_t(_and_rows)`).
# ----------------------------------------------------------------------------------------------

TILE = (64, 128)
"""(rows, columns) of a CTA's tile in both weight passes."""
_TILE_VEC = 4  # elements per lane vector of a tile row: 128 columns = 32 lanes x 4
_SMEM_PAD = 16
"""Bytes past each e4m3 tile row in SMEM. Rows must stay 16-byte aligned for Mosaic GPU's
vector stores (a 4-byte pad, which would make the transposed reads free of bank conflicts,
faults with a misaligned address); 16 bytes leave them 4-way conflicted, 0 bytes 32-way."""


def tiles_supported(m: int, n: int) -> bool:
    """Whether ``[..., m, n]`` fits the weight kernels' :data:`TILE`."""
    return mg.MOSAIC_IMPORT_ERROR is None and m % TILE[0] == 0 and n % TILE[1] == 0


def _tile_layout():
    return mg.row_layout(_TILE_VEC)


def _transposed_layout():
    """``[TILE[1], TILE[0]]`` registers read from the transposed SMEM tile: warp ``w`` holds
    rows ``w mod 4``, lane ``l`` column ``l mod 32``, one byte each (a warp stores 32
    consecutive bytes of an output row)."""
    return plgpu.Layout.TILED(plgpu.Tiling(((WARPS, 32), (1,))), warp_dims=(-3,),
                              lane_dims=(-2,), vector_dim=-1)


def _tile_index():
    b, i, j = (lax.axis_index(n) for n in ("b", "r", "c"))
    return b, i, j, mg.ds(i * TILE[0], TILE[0]), mg.ds(j * TILE[1], TILE[1])


def _amax_body(a_ref, col_ref, *rows):
    """Pass 1: each tile's column maxima (and row maxima) as int32 ``|x|`` bits."""
    b, i, j, rows_, cols = _tile_index()
    bits = mg.abs_bits(mg.load_f32(a_ref.at[b, rows_, cols], _tile_layout()))
    col_ref[b, i, cols] = jnp.max(bits, axis=0)
    if rows:  # [row_ref, smem]: 64 words, 256 bytes, through SMEM (store_small)
        row_ref, smem = rows
        store_small(jnp.max(bits, axis=1), row_ref.at[b, j, rows_], smem)


def _inv_scales(bits_ref, layout) -> jax.Array:
    return fp8.scales_from_amax_bits(mg.load_raw(bits_ref, layout))[1]  # int32, not via f32


def _cast(x: jax.Array, inv: jax.Array, axis: int, layout) -> jax.Array:
    """e4m3 of ``x * inv`` with ``inv`` along ``axis`` of ``x``."""
    inv = plgpu.layout_cast(lax.broadcast_in_dim(inv, x.shape, [axis]), layout)
    return jnp.clip(x * inv, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(F8)


def _quantize_tile_body(a_ref, col_bits_ref, *refs):
    """Pass 2: the tile scaled per column, cast, transposed through SMEM and copied into the
    K-major copy by TMA (and scaled per row into the row copy)."""
    *row, qt_ref, smem, smem_t = refs  # row: [row_bits_ref, q_ref] for both copies
    b, _, _, rows, cols = _tile_index()
    layout = _tile_layout()
    x = mg.load_f32(a_ref.at[b, rows, cols], layout)
    inv_c = _inv_scales(col_bits_ref.at[b, cols], layout.reduce(0))
    tile = smem.at[:, mg.ds(0, TILE[1])]
    tile[...] = _cast(x, inv_c, 1, layout)
    # The transposed tile is read one byte per lane; stored from registers that would be a
    # 1-byte-per-thread global write, so it goes back to SMEM, dense, and out by TMA.
    smem_t[...] = mg.load_raw(tile.transpose((1, 0)), _transposed_layout())
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem_t, qt_ref.at[b, cols, rows])
    if row:
        row_bits_ref, q_ref = row
        inv_r = _inv_scales(row_bits_ref.at[b, rows], layout.reduce(1))
        q_ref[b, rows, cols] = _cast(x, inv_r, 0, layout)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _scale_of(bits: jax.Array) -> jax.Array:
    return fp8.scale_from_byte(fp8.scales_from_amax_bits(bits)[0])


def _weight_passes(a: jax.Array, *, rows: bool, names: tuple[str, str]):
    if a.ndim != 3 or not tiles_supported(*a.shape[1:]):
        raise ValueError(f"a must be [B, M, N] with M and N multiples of {TILE} for the Mosaic "
                         f"GPU weight kernels, got {a.shape}; use accel_kernels.quant.api for "
                         f"other "
                         "shapes.")
    nb, m, n = a.shape
    mt, nt = m // TILE[0], n // TILE[1]
    grid = dict(grid=(nb, mt, nt), grid_names=("b", "r", "c"))
    outs = [((nb, mt, n), jnp.int32)] + ([((nb, nt, m), jnp.int32)] if rows else [])
    amax_smem = (plgpu.SMEM((TILE[0],), jnp.int32),) if rows else ()
    part = launch(_amax_body, (a,), outs, name=f"{names[0]}_mgpu", scratch=amax_smem, **grid)
    col_bits = jnp.max(part[0], axis=1)
    operands, outs = (a, col_bits), [((nb, n, m), F8)]
    if rows:
        row_bits = jnp.max(part[1], axis=1)
        operands, outs = (*operands, row_bits), [((nb, m, n), F8), *outs]
    smem = (plgpu.SMEM((TILE[0], TILE[1] + _SMEM_PAD), F8), plgpu.SMEM((TILE[1], TILE[0]), F8))
    q = launch(_quantize_tile_body, operands, outs, name=f"{names[1]}_mgpu", scratch=smem,
               **grid)
    cols_t = (q[-1], _scale_of(col_bits))
    return (cols_t, (q[0], _scale_of(row_bits))) if rows else cols_t


def quantize_cols_t(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`accel_kernels.quant.triton.quantize_cols_t` in Mosaic GPU (the same bytes): ``a [B, M, N]``
    column-wise as e4m3 written transposed, ``(q [B, N, M], scale f32 [B, N])``.

    Two passes of ``[64, 128]`` tiles: the column maxima, then each tile scaled, cast and
    transposed through SMEM (rows padded by :data:`_SMEM_PAD` bytes) and stored 32 bytes per
    warp.

    Args:
      a: float ``[B, M, N]``, ``M`` a multiple of 64 and ``N`` of 128.

    Returns:
      ``(q float8_e4m3fn [B, N, M], scale float32 [B, N])``.
    """
    return _weight_passes(a, rows=False, names=("fp8_col_amax", "fp8_quantize_cols_t"))


def quantize_cols_t_and_rows(a: jax.Array):
    """`accel_kernels.quant.triton.quantize_cols_t_and_rows` in Mosaic GPU (the same bytes):
    both FP8
    copies of a weight from two passes, the first taking each tile's column and row maxima,
    the second writing the transposed column copy and the row copy from one read of the tile.

    Args:
      a: float ``[B, M, N]``, ``M`` a multiple of 64 and ``N`` of 128.

    Returns:
      ``((q_t float8_e4m3fn [B, N, M], scale f32 [B, N]), (q float8_e4m3fn [B, M, N],
      scale f32 [B, M]))``.
    """
    return _weight_passes(a, rows=True, names=("fp8_weight_amax", "fp8_weight_quantize"))
