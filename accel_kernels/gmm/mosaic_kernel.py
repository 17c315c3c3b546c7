"""Grouped GEMMs in Pallas Mosaic GPU (Hopper wgmma): ``gmm`` (forward, dgrad), ``tgmm`` (wgrad).

Both take rows grouped by expert in the *tile-aligned* ragged layout: every group's size is a
multiple of the row tile (``group_alignment``, 128 by default), so a row tile (``gmm``) or a
contraction tile (``tgmm``) never straddles two groups. :func:`accel_kernels.gmm.base.align_map`
maps any ragged input to that layout; the layer's dispatch produces it directly. Rows past
``sum(group_sizes)`` are padding.

* ``gmm(lhs [M, K], rhs, group_sizes) -> [M, N]``: ``out[rows of g] = lhs[rows of g] @ W_g``
  with ``rhs`` either ``[G, K, N]`` (``W_g = rhs[g]``) or ``[G, N, K]`` (``rhs_k_major=True``,
  ``W_g = rhs[g]^T``). FP8 operands need ``rhs_k_major=True`` (FP8 wgmma reads both operands
  K-major).
* ``tgmm(a, b, group_sizes) -> [G, N1, N2]``: ``out[g] = a_g^T @ b_g`` over the rows of group
  ``g``, with ``a [M, N1]``, ``b [M, N2]``, or K-major copies ``a [N1, M]``, ``b [N2, M]``
  (``k_major=True``; required for FP8).

Both run on the persistent, warp-specialized tile pipeline of `accel_kernels.mosaic_tiles`;
only their tile bodies (which tiles, which blocks, when to store zeros) are here. A padding
tile (``gmm``) or an empty group (``tgmm``) stores zeros without loading anything. Operands
must be multiples of the tiles (the callers pad).

These kernels lower only for NVIDIA Hopper GPUs (``sm_90a``). Off GPU the registry
(`accel_kernels.gmm.api`) runs the same arithmetic through XLA (`accel_kernels.gmm.xla`), which
is how the tests check it on CPU; CI lowers the kernels for CUDA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from accel_kernels import mosaic_gpu as mg
from accel_kernels import mosaic_tiles as mt
from accel_kernels.gmm.base import GROUP_ALIGNMENT, group_ends  # noqa: F401 - the layout it takes
from accel_kernels.mosaic_gpu import pl, plgpu
from accel_kernels.mosaic_tiles import MosaicTiling

# ----------------------------------------------------------------------------------------------


def _gmm_body(tile_group, a_gmem, b_gmem, *rest, cfg: MosaicTiling, rhs_k_major: bool,
              num_groups: int, scaled: bool):
    row_s, col_s, out_gmem = rest if scaled else (None, None, rest[0])
    m, k = a_gmem.shape
    n = out_gmem.shape[1]
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = 2 * tn
    m_iters, n_iters, k_iters = m // tm, n // cta_n, k // tk
    in_t = mg.smem_transforms(tk, a_gmem.dtype)
    b_t = in_t if rhs_k_major else mg.smem_transforms(cta_n, b_gmem.dtype)
    b_spec = mt.k_block((cta_n, tk), 1, b_t) if rhs_k_major else mt.k_block((tk, cta_n), 0, b_t)
    in_specs = [mt.k_block((tm, tk), 1, in_t), b_spec]

    def tile(index, scope: mt.TileScope):
        (lin,) = index
        mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, cfg.snake_width)
        g = tile_group[mi]
        m_sl = pl.ds(mi * tm, tm)
        n_sl = pl.ds(ni * cta_n, cta_n)
        wg_n = pl.ds(scope.wg * tn, tn)
        out_tile = out_gmem.at[m_sl, n_sl].at[:, wg_n]

        def scale_refs():
            gc = jnp.minimum(g, num_groups - 1)
            return row_s.at[m_sl], col_s.at[gc, n_sl].at[wg_n]

        compute_context = mt.tile_context(scope, out_tile, scale_refs if scaled else None, cfg)

        def mma(idxs, a_smem, b_smem, acc_ref):
            del idxs
            b = mg.transposed(b_smem.at[wg_n, :]) if rhs_k_major else b_smem.at[:, wg_n]
            plgpu.wgmma(acc_ref, a_smem, b)
            plgpu.wgmma_wait(0)
            return acc_ref

        @pl.when(g < num_groups)
        def _():
            gc = jnp.minimum(g, num_groups - 1)
            b_rows = b_gmem.at[gc, n_sl, :] if rhs_k_major else b_gmem.at[gc, :, n_sl]
            pipeline = mt.warp_pipeline(mma, compute_context, k_iters, in_specs, cfg)
            pipeline(a_gmem.at[m_sl, :], b_rows, allocations=scope.allocs)

        @pl.when(g >= num_groups)
        def _():
            mt.zero_tile(scope.out_smem, out_tile, scope.wg, cfg)

    mt.for_each_tile((m_iters * n_iters,), k_iters, in_specs, (a_gmem, b_gmem.at[0]),
                   out_gmem.dtype, cfg, scaled, tile)


def tile_groups(group_sizes: jax.Array, m: int, tile_m: int,
                live_rows: jax.Array | None = None) -> jax.Array:
    """int32 ``[m // tile_m]``: the group of each row tile (``G`` for padding tiles).

    Assumes every group size is a multiple of ``tile_m`` (the aligned layout). With
    ``live_rows [G]``, a tile of group ``g`` that starts at or past its first ``live_rows[g]``
    rows is a padding tile too.
    """
    n_groups = group_sizes.shape[0]
    ends = group_ends(group_sizes)
    starts = jnp.arange(m // tile_m, dtype=jnp.int32) * tile_m
    g = jnp.minimum(jnp.searchsorted(ends, starts, side="right", method="compare_all"),
                    n_groups).astype(jnp.int32)
    if live_rows is None:
        return g
    gc = jnp.minimum(g, n_groups - 1)
    offset = starts - (ends[gc] - jnp.maximum(group_sizes.astype(jnp.int32), 0)[gc])
    return jnp.where(offset < live_rows.astype(jnp.int32)[gc], g, n_groups).astype(jnp.int32)


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    rhs_k_major: bool = False,
    out_dtype: DTypeLike | None = None,
    tiling: MosaicTiling | None = None,
    varying: frozenset = frozenset(),
    row_scale: jax.Array | None = None,
    col_scale: jax.Array | None = None,
    live_rows: jax.Array | None = None,
) -> jax.Array:
    """Grouped GEMM on the tile-aligned layout: ``out[rows of g] = lhs[rows of g] @ W_g``.

    ``W_g = rhs[g]`` (``rhs [G, K, N]``) or ``rhs[g]^T`` (``rhs [G, N, K]``,
    ``rhs_k_major=True``). ``M``, ``K``, ``N`` must be multiples of ``tile_m``, ``tile_k``,
    ``2 * tile_n``; every group size a multiple of ``tile_m``. Rows past ``sum(group_sizes)``
    come out zero. Accumulation is f32; ``out_dtype`` defaults to bf16 for FP8 operands.
    ``varying``: mesh axes the output varies over inside a check_vma ``shard_map``.
    ``row_scale [M]`` and ``col_scale [G, N]`` (f32, both or neither) multiply the f32
    accumulator in the epilogue: ``out[r, n] = acc[r, n] * row_scale[r] * col_scale[g, n]``
    (FP8 operands' dequantization scales, applied before the output cast).
    ``live_rows [G]`` (optional): only the first ``live_rows[g]`` rows of group ``g`` may be
    nonzero; its row tiles past them are not computed and come out zero (what the zero rows
    would give), e.g. the empty slots of a capacity-padded layout.
    """
    if out_dtype is None:
        out_dtype = jnp.bfloat16 if jnp.dtype(lhs.dtype).itemsize == 1 else lhs.dtype
    cfg = tiling or mt.default_tiling(lhs.dtype, out_dtype)
    m, k = lhs.shape
    n_groups = rhs.shape[0]
    n = rhs.shape[1] if rhs_k_major else rhs.shape[2]
    k2 = rhs.shape[2] if rhs_k_major else rhs.shape[1]
    if k2 != k or group_sizes.shape != (n_groups,):
        raise ValueError(f"gmm shapes disagree: lhs {lhs.shape}, rhs {rhs.shape} "
                         f"(rhs_k_major={rhs_k_major}), group_sizes {group_sizes.shape}.")
    if m % cfg.tile_m or k % cfg.tile_k or n % (2 * cfg.tile_n):
        raise ValueError(f"gmm needs M % {cfg.tile_m}, K % {cfg.tile_k}, N % {2 * cfg.tile_n} "
                         f"== 0; got M={m}, K={k}, N={n}.")
    if jnp.dtype(lhs.dtype).itemsize == 1 and not rhs_k_major:
        raise ValueError("FP8 gmm needs the weights K-major ([G, N, K], rhs_k_major=True).")
    scaled = row_scale is not None
    if scaled != (col_scale is not None):
        raise ValueError("gmm: pass row_scale and col_scale together (or neither).")
    if scaled and (row_scale.shape != (m,) or col_scale.shape != (n_groups, n)):
        raise ValueError(f"gmm: row_scale must be [{m}] and col_scale [{n_groups}, {n}]; got "
                         f"{row_scale.shape}, {col_scale.shape}.")
    body = functools.partial(_gmm_body, cfg=cfg, rhs_k_major=rhs_k_major, num_groups=n_groups,
                             scaled=scaled)
    kernel = mt.persistent_kernel(body, (m, n), out_dtype, varying,
                                  mt.kernel_name("gmm", lhs.dtype, n_groups))
    scales = (row_scale.astype(jnp.float32), col_scale.astype(jnp.float32)) if scaled else ()
    return kernel(tile_groups(group_sizes, m, cfg.tile_m, live_rows), lhs, rhs, *scales)


# ----------------------------------------------------------------------------------------------
# tgmm
# ----------------------------------------------------------------------------------------------


def _tgmm_body(start_tile, num_tiles, a_gmem, b_gmem, *rest, cfg: MosaicTiling,
               k_major: bool, scaled: bool, accumulate: bool):
    rest = list(rest)
    out_gmem = rest.pop()
    prior_gmem = rest.pop() if accumulate else None
    row_s, col_s = rest if scaled else (None, None)
    n_groups, n1, n2 = out_gmem.shape
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = 2 * tn
    rows = a_gmem.shape[1] if k_major else a_gmem.shape[0]
    m_iters, n_iters = n1 // tm, n2 // cta_n
    if k_major:
        a_t = b_t = mg.smem_transforms(tk, a_gmem.dtype)
        in_specs = [mt.k_block((tm, tk), 1, a_t), mt.k_block((cta_n, tk), 1, b_t)]
    else:
        a_t = mg.smem_transforms(tm, a_gmem.dtype)
        b_t = mg.smem_transforms(cta_n, b_gmem.dtype)
        in_specs = [mt.k_block((tk, tm), 0, a_t), mt.k_block((tk, cta_n), 0, b_t)]

    def tile(index, scope: mt.TileScope):
        g, lin = index
        mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, cfg.snake_width)
        steps = num_tiles[g]
        tok = pl.ds(pl.multiple_of(start_tile[g] * tk, tk), rows)
        m_sl = pl.ds(mi * tm, tm)
        n_sl = pl.ds(ni * cta_n, cta_n)
        wg_n = pl.ds(scope.wg * tn, tn)
        out_tile = out_gmem.at[g, m_sl, n_sl].at[:, wg_n]
        prior_tile = None if prior_gmem is None else prior_gmem.at[g, m_sl, n_sl].at[:, wg_n]

        def scale_refs():
            return row_s.at[m_sl], col_s.at[n_sl].at[wg_n]

        compute_context = mt.tile_context(scope, out_tile, scale_refs if scaled else None, cfg,
                                       prior_tile)

        def mma(idxs, a_smem, b_smem, acc_ref):
            del idxs
            if k_major:
                plgpu.wgmma(acc_ref, a_smem, mg.transposed(b_smem.at[wg_n, :]))
            else:
                plgpu.wgmma(acc_ref, mg.transposed(a_smem), b_smem.at[:, wg_n])
            plgpu.wgmma_wait(0)
            return acc_ref

        @pl.when(steps > 0)
        def _():
            if k_major:
                a_rows, b_rows = a_gmem.at[m_sl, tok], b_gmem.at[n_sl, tok]
            else:
                a_rows, b_rows = a_gmem.at[tok, m_sl], b_gmem.at[tok, n_sl]
            pipeline = mt.warp_pipeline(mma, compute_context, steps, in_specs, cfg)
            pipeline(a_rows, b_rows, allocations=scope.allocs)

        @pl.when(steps == 0)
        def _():  # scales do not change a zero; a prior output is copied
            mt.zero_tile(scope.out_smem, out_tile, scope.wg, cfg, scope.prior(prior_tile))

    mt.for_each_tile((n_groups, m_iters * n_iters), 2 * cfg.stages, in_specs, (a_gmem, b_gmem),
                   out_gmem.dtype, cfg, scaled, tile, accumulate=accumulate)


def contraction_tiles(group_sizes: jax.Array, rows: int, tile_k: int,
                      live_rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(first tile, number of tiles)`` int32 ``[G]`` of each group's contraction in
    :func:`tgmm`: its rows in ``tile_k`` tiles (the aligned layout), clipped to ``rows`` and,
    with ``live_rows``, to the tiles holding the group's first ``live_rows[g]`` rows."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(group_ends(sizes), rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    num_tiles = (ends - starts) // tile_k
    if live_rows is not None:
        live = jnp.maximum(live_rows.astype(jnp.int32), 0)
        num_tiles = jnp.minimum(num_tiles, -(-live // tile_k))
    return (starts // tile_k).astype(jnp.int32), num_tiles.astype(jnp.int32)


def tgmm(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    *,
    k_major: bool = False,
    out_dtype: DTypeLike = jnp.float32,
    tiling: MosaicTiling | None = None,
    varying: frozenset = frozenset(),
    row_scale: jax.Array | None = None,
    col_scale: jax.Array | None = None,
    live_rows: jax.Array | None = None,
    acc: jax.Array | None = None,
) -> jax.Array:
    """Per-group ``a_g^T @ b_g`` on the tile-aligned layout: ``[G, N1, N2]``, plus ``acc``.

    ``a [M, N1]``, ``b [M, N2]`` (rows grouped by ``group_sizes``), or their K-major copies
    ``a [N1, M]``, ``b [N2, M]`` with ``k_major=True`` (required for FP8). Group sizes must
    be multiples of ``tile_k``; ``N1 % tile_m == 0`` and ``N2 % (2 * tile_n) == 0``. An empty
    group gives zeros. Accumulation is f32. ``varying``: as in :func:`gmm`. ``row_scale
    [N1]`` and ``col_scale [N2]`` (f32, both or neither) multiply the accumulator in the
    epilogue: ``out[g, i, j] = acc[g, i, j] * row_scale[i] * col_scale[j]``.
    ``live_rows [G]`` (optional): as in :func:`gmm`; the contraction stops after the tiles
    holding group ``g``'s first ``live_rows[g]`` rows (the rest are zero in ``a`` or ``b``).
    ``acc [G, N1, N2]`` in ``out_dtype`` (optional): added in the epilogue (after the
    scales), ``out = acc + a_g^T @ b_g``; an empty group gives ``acc[g]``. One kernel reads it
    where an add after the kernel would read both outputs and write a third: the weight
    gradients of several token chunks accumulate this way.
    """
    cfg = tiling or mt.default_tiling(a.dtype, out_dtype)
    n1, rows = (a.shape if k_major else a.shape[::-1])
    n2, rows_b = (b.shape if k_major else b.shape[::-1])
    if rows != rows_b:
        raise ValueError(f"tgmm operands disagree: a {a.shape}, b {b.shape} (k_major={k_major}).")
    if n1 % cfg.tile_m or n2 % (2 * cfg.tile_n) or rows % cfg.tile_k:
        raise ValueError(f"tgmm needs N1 % {cfg.tile_m}, N2 % {2 * cfg.tile_n}, M % "
                         f"{cfg.tile_k} == 0; got N1={n1}, N2={n2}, M={rows}.")
    if jnp.dtype(a.dtype).itemsize == 1 and not k_major:
        raise ValueError("FP8 tgmm needs K-major operands (k_major=True).")
    n_groups = group_sizes.shape[0]
    start_tile, num_tiles = contraction_tiles(group_sizes, rows, cfg.tile_k, live_rows)
    scaled = row_scale is not None
    if scaled != (col_scale is not None):
        raise ValueError("tgmm: pass row_scale and col_scale together (or neither).")
    if scaled and (row_scale.shape != (n1,) or col_scale.shape != (n2,)):
        raise ValueError(f"tgmm: row_scale must be [{n1}] and col_scale [{n2}]; got "
                         f"{row_scale.shape}, {col_scale.shape}.")
    accumulate = acc is not None
    if accumulate and (acc.shape != (n_groups, n1, n2) or acc.dtype != jnp.dtype(out_dtype)):
        raise ValueError(f"tgmm: acc must be [{n_groups}, {n1}, {n2}] {jnp.dtype(out_dtype)} "
                         f"(the output's shape and dtype); got {acc.shape} {acc.dtype}.")
    body = functools.partial(_tgmm_body, cfg=cfg, k_major=k_major, scaled=scaled,
                             accumulate=accumulate)
    kernel = mt.persistent_kernel(body, (n_groups, n1, n2), out_dtype, varying,
                                  mt.kernel_name("tgmm", a.dtype, n_groups))
    scales = (row_scale.astype(jnp.float32), col_scale.astype(jnp.float32)) if scaled else ()
    prior = (acc,) if accumulate else ()
    return kernel(start_tile, num_tiles, a, b, *scales, *prior)
