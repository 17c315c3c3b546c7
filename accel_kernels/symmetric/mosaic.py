"""A GEMM whose product is known to be symmetric, in Pallas Mosaic GPU: only the tiles that
touch the upper triangle are computed.

``symmetric_upper(u, w) -> c``: for ``u, w [B, p, r]``, ``c[b] = u[b] @ w[b]^T`` on every
``[tile_m, 2 tile_n]`` output tile that holds an element on or above the diagonal; tiles wholly
below it are left unwritten. When ``u w^T`` is symmetric (``w = u``: a Gram matrix ``X X^T``;
or ``u``, ``w`` polynomials in one symmetric matrix, which commute) the full product is the
upper triangle mirrored. With ``mirror=True`` the kernel writes that mirror itself: each
computed tile is also stored transposed below the diagonal from its epilogue, so the result is
the full symmetric matrix with no pass after the kernel; without it,
:func:`accel_kernels.symmetric.api.mirror_upper` does it in one elementwise pass. Newton-Schulz
spends most of its work on such products, so this kernel halves their tiles
(``(T + 2) / (2 T)`` of them for ``T = p / tile_m`` row tiles).

Both operands are read K-major (rows of ``u`` and of ``w`` along the contraction), the layout
in which ``X X^T`` needs no transposed copy of ``X``. The kernel runs on the persistent,
warp-specialized tile pipeline of `accel_kernels.mosaic_tiles` with a tile list in place of
the full tile grid: each CTA
walks ``(matrix, tile)`` pairs of the list, the memory warpgroup streams
``[tile_m, tile_k]`` / ``[2 tile_n, tile_k]`` blocks, two compute warpgroups accumulate
``[tile_m, tile_n]`` halves in f32 registers with ``wgmma``.

Hopper GPUs (``sm_90a``) only; :func:`symmetric_upper_reference` is the same product in XLA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from accel_kernels import mosaic_gpu as mg
from accel_kernels import mosaic_tiles as mt
from accel_kernels.mosaic_gpu import pl, plgpu

AVOID = "symmetric_blocks=1 or another int (XLA matmuls)"
"""The Newton-Schulz option that keeps the optimizer off this kernel."""

DTYPES = ("bfloat16", "float16")
"""Operand dtypes the kernel takes (16-bit wgmma operands with f32 accumulation)."""


def upper_tile_map(p: int, tile_m: int, cta_n: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column tile indices ``(mi, ni)`` (int32) of the ``[tile_m, cta_n]`` tiles of a
    ``[p, p]`` product that hold an element on or above the diagonal, column band by column
    band (tiles that run at once share their ``w`` rows).

    >>> mi, ni = upper_tile_map(512, 128, 256)
    >>> list(zip(mi.tolist(), ni.tolist()))
    [(0, 0), (1, 0), (0, 1), (1, 1), (2, 1), (3, 1)]
    """
    mi, ni = [], []
    for n in range(p // cta_n):
        # the row tiles that start above the band's last column
        rows = min(p // tile_m, -(-((n + 1) * cta_n) // tile_m))
        mi.extend(range(rows))
        ni.extend([n] * rows)
    return np.asarray(mi, np.int32), np.asarray(ni, np.int32)


def padded_size(p: int, r: int, dtype: DTypeLike = jnp.bfloat16,
                tiling: mt.MosaicTiling | None = None) -> tuple[int, int]:
    """The smallest ``(p', r') >= (p, r)`` that :func:`symmetric_upper` takes (zero rows and
    columns padded to ``u`` and ``w`` change nothing in the top-left ``[p, p]`` block).

    >>> padded_size(300, 100)
    (512, 128)
    """
    cfg = tiling or mt.default_tiling(dtype)
    step = math.lcm(2 * cfg.tile_n, cfg.tile_m)
    return -(-p // step) * step, -(-r // cfg.tile_k) * cfg.tile_k


def upper_tile_share(p: int, dtype: DTypeLike = jnp.bfloat16,
                     tiling: mt.MosaicTiling | None = None) -> tuple[int, int]:
    """``(written, total)``: the output tiles the kernel computes for a ``[p, p]`` product
    (``p`` padded by :func:`padded_size` first) and the tiles of the full product.

    >>> upper_tile_share(256), upper_tile_share(4096)
    ((2, 2), (272, 512))
    """
    cfg = tiling or mt.default_tiling(dtype)
    pp, _ = padded_size(p, 1, dtype, cfg)
    mi, _ = upper_tile_map(pp, cfg.tile_m, 2 * cfg.tile_n)
    return len(mi), (pp // cfg.tile_m) * (pp // (2 * cfg.tile_n))


def upper_tile_mask(p: int, dtype: DTypeLike = jnp.bfloat16,
                    tiling: mt.MosaicTiling | None = None) -> np.ndarray:
    """bool ``[p, p]``: the elements :func:`symmetric_upper` writes without ``mirror`` (``p``
    one it takes; with ``mirror`` it writes every element).

    >>> upper_tile_mask(512)[::128, ::128].astype(int).tolist()
    [[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]]
    """
    cfg = tiling or mt.default_tiling(dtype)
    tm, cta_n = cfg.tile_m, 2 * cfg.tile_n
    mi, ni = upper_tile_map(p, tm, cta_n)
    written = np.zeros((p // tm, p // cta_n), bool)
    written[mi, ni] = True
    return np.repeat(np.repeat(written, tm, axis=0), cta_n, axis=1)


def _store_transposed(value, slot) -> None:
    """``slot[...] = value^T``: a transposed view of a tiled SMEM ref takes registers in the
    transposed WGMMA layout (a shuffle within each quad of lanes away from the accumulator's)."""
    mg.transposed(slot)[...] = plgpu.layout_cast(value, plgpu.Layout.WGMMA_TRANSPOSED)


def _store(value, slot, dst, *, transpose: bool = False) -> None:
    """TMA-store ``value`` (``[epi, epi]`` registers) into ``dst`` through the SMEM ``slot``;
    ``transpose``: store ``value^T`` (written into the slot through a transposed view, which
    the TMA copy then moves as it lies)."""
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    if transpose:
        _store_transposed(value, slot)
    else:
        slot[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(slot, dst)


def _store_symmetrized(value, slot, dst) -> None:
    """TMA-store the symmetric matrix with ``value``'s upper triangle (a square block on the
    diagonal of the product) into ``dst``: ``value^T`` is read back through ``slot``."""
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    _store_transposed(value, slot)
    value_t = mg.load(slot, layout=plgpu.Layout.WGMMA, optimized=False)
    rows = lax.broadcasted_iota(jnp.int32, value.shape, 0)
    cols = lax.broadcasted_iota(jnp.int32, value.shape, 1)
    slot[...] = jnp.where(rows <= cols, value, value_t)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(slot, dst)


def _mirror_epilogue(acc, out_smem, out_tile, mirror_tile, block, wg, cfg: mt.MosaicTiling):
    """Store a compute warpgroup's ``[t, t]`` accumulator (``t = tile_m = tile_n``) both where
    it lies and transposed into ``mirror_tile``, so the product comes out symmetric.

    ``block``: the accumulator's ``(row, column)`` block index in ``[t, t]`` blocks of the
    product. Above the diagonal (row < column) every ``[epi, epi]`` block goes to both places.
    On it the blocks above the block diagonal do the same, the blocks on it are stored
    symmetrized and those below it not at all. Below it (the lower-left quarter of a
    diagonal ``[2 t, 2 t]`` block that a ``[t, 2 t]`` CTA tile computes) nothing is stored.
    Each element below the diagonal so has one writer, the mirror of the element above it:
    the result is exactly symmetric, the upper triangle as computed.
    """
    acc = acc.astype(out_smem.dtype)
    e = cfg.epi_m
    blocks = cfg.tile_m // e

    def part(i, j):
        return acc[i * e:(i + 1) * e, j * e:(j + 1) * e]

    def at(tile, i, j):
        return tile.at[i * e:(i + 1) * e, j * e:(j + 1) * e]

    row, col = block
    # Each branch's stores alternate between the warpgroup's two SMEM slots: a write into one
    # waits (wait_smem_to_gmem(1)) only for the store before last, the one that read it.

    @pl.when(row < col)
    def _above():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for i in range(blocks):
            for j in range(blocks):
                _store(part(i, j), out_smem.at[wg, 0], at(out_tile, i, j))
                _store(part(i, j), out_smem.at[wg, 1], at(mirror_tile, j, i), transpose=True)

    @pl.when(row == col)
    def _on():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        slot = 0
        for i in range(blocks):
            for j in range(i, blocks):
                if i == j:
                    _store_symmetrized(part(i, j), out_smem.at[wg, slot], at(out_tile, i, j))
                    slot ^= 1
                    continue
                _store(part(i, j), out_smem.at[wg, slot], at(out_tile, i, j))
                _store(part(i, j), out_smem.at[wg, slot ^ 1], at(out_tile, j, i),
                       transpose=True)


def _body(tile_mi, tile_ni, u_gmem, w_gmem, out_gmem, *, cfg: mt.MosaicTiling, mirror: bool):
    _, _, r = u_gmem.shape
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = 2 * tn
    k_iters = r // tk
    in_t = mg.smem_transforms(tk, u_gmem.dtype)
    in_specs = [mt.k_block((tm, tk), 1, in_t), mt.k_block((cta_n, tk), 1, in_t)]

    def tile(index, scope: mt.TileScope):
        b, t = index
        mi, ni = tile_mi[t], tile_ni[t]
        m_sl = pl.ds(mi * tm, tm)
        n_sl = pl.ds(ni * cta_n, cta_n)
        wg_n = pl.ds(scope.wg * tn, tn)
        out_tile = out_gmem.at[b, m_sl, n_sl].at[:, wg_n]
        if mirror:
            # The warpgroup's [tm, tn] accumulator is block (mi, 2 ni + wg) of the product in
            # [tm, tm] blocks (tn = tm); its transpose goes to block (2 ni + wg, mi). The tile
            # list holds the blocks with mi <= 2 ni + 1: all those on or above the diagonal,
            # and below it only the lower-left quarters (2 ni + 1, 2 ni) of the diagonal
            # [2 tm, 2 tm] blocks. Those quarters store nothing (the mirror of (2 ni, 2 ni + 1)
            # lands on them), so every element has exactly one writer and the result does not
            # depend on the order the CTAs run in.
            store = functools.partial(
                _mirror_epilogue, out_smem=scope.out_smem, out_tile=out_tile,
                mirror_tile=out_gmem.at[b, n_sl, m_sl].at[wg_n, :],
                block=(mi, 2 * ni + scope.wg), wg=scope.wg, cfg=cfg)
        else:
            store = None
        context = mt.tile_context(scope, out_tile, None, cfg, store=store)

        def mma(idxs, a_smem, b_smem, acc_ref):
            del idxs
            plgpu.wgmma(acc_ref, a_smem, mg.transposed(b_smem.at[wg_n, :]))
            plgpu.wgmma_wait(0)
            return acc_ref

        pipeline = mt.warp_pipeline(mma, context, k_iters, in_specs, cfg)
        pipeline(u_gmem.at[b, m_sl, :], w_gmem.at[b, n_sl, :], allocations=scope.allocs)

    mt.for_each_tile((out_gmem.shape[0], tile_mi.shape[0]), k_iters, in_specs,
                     (u_gmem.at[0], w_gmem.at[0]), out_gmem.dtype, cfg, False, tile)


def check_shapes(u_shape: tuple[int, ...], w_shape: tuple[int, ...], dtype: DTypeLike,
                 tiling: mt.MosaicTiling | None = None) -> str | None:
    """Why :func:`symmetric_upper` cannot take these operands (None: it can)."""
    cfg = tiling or mt.default_tiling(dtype)
    if len(u_shape) != 3 or tuple(u_shape) != tuple(w_shape):
        return f"u and w must both be [B, p, r]; got {tuple(u_shape)} and {tuple(w_shape)}"
    if jnp.dtype(dtype).name not in DTYPES:
        return f"operands must be one of {DTYPES}, got {jnp.dtype(dtype).name}"
    _, p, r = u_shape
    if p % (2 * cfg.tile_n) or p % cfg.tile_m or r % cfg.tile_k:
        return (f"p must be a multiple of {2 * cfg.tile_n} and {cfg.tile_m}, r of "
                f"{cfg.tile_k}; got p={p}, r={r}")
    return None


def symmetric_upper(u: jax.Array, w: jax.Array, *, out_dtype: DTypeLike | None = None,
                    tiling: mt.MosaicTiling | None = None,
                    varying: frozenset = frozenset(), mirror: bool = False) -> jax.Array:
    """``u @ w^T`` on the output tiles that touch the upper triangle: ``[B, p, p]``; with
    ``mirror``, that upper triangle mirrored (the full symmetric matrix).

    .. math::
      c_b[i, j] = \\sum_k u_b[i, k] \\, w_b[j, k] \\quad \\text{for every } (i, j),\\ i \\le j
      \\text{ (and the rest of their tiles)}; \\qquad
      \\text{mirror: } c_b[i, j] = c_b[j, i] \\ (i > j) .

    Without ``mirror`` tiles wholly below the diagonal are not written: their values are
    undefined. Use it for products known to be symmetric and mirror the result
    (:func:`accel_kernels.symmetric.api.mirror_upper`), or pass ``mirror=True``: the epilogue
    also stores each tile transposed below the diagonal, one writer per element, and the
    result equals ``mirror_upper`` of the unmirrored one, exactly symmetric.

    Args:
      u: ``[B, p, r]``, bfloat16 or float16.
      w: ``[B, p, r]``, the same dtype (``w = u`` for ``u u^T``).
      out_dtype: result dtype (default: the operands'); accumulation is f32.
      tiling: tile sizes (default :func:`accel_kernels.mosaic_tiles.default_tiling`); ``p``
        must be a multiple of ``2 tile_n`` and ``tile_m``, ``r`` of ``tile_k``.
      varying: mesh axes the output varies over inside a check_vma ``shard_map``.
      mirror: write the lower triangle too (``tiling`` needs ``tile_m = tile_n`` and
        ``epi_m = epi_n``, as the default has).

    Returns:
      ``[B, p, p]`` in ``out_dtype``.
    """
    out_dtype = jnp.dtype(out_dtype or u.dtype)
    cfg = tiling or mt.default_tiling(u.dtype, out_dtype)
    why = check_shapes(u.shape, w.shape, u.dtype, cfg)
    if why is not None or w.dtype != u.dtype:
        raise ValueError(f"symmetric_upper: {why or 'u and w must share a dtype'}; pad p and "
                         f"r (zero rows and columns change nothing) or use {AVOID}.")
    if mirror and (cfg.tile_m != cfg.tile_n or cfg.epi_m != cfg.epi_n):
        raise ValueError(f"symmetric_upper: mirror=True needs square tiles (tile_m = tile_n, "
                         f"epi_m = epi_n), got {cfg}; pass such a tiling (the default is one) "
                         "or mirror=False and mirror the result with mirror_upper.")
    n_mat, p, _ = u.shape
    mi, ni = upper_tile_map(p, cfg.tile_m, 2 * cfg.tile_n)
    bits = {"bfloat16": "bf16", "float16": "f16"}[jnp.dtype(u.dtype).name]
    name = f"symmetric_{'full' if mirror else 'upper'}_{bits}"
    kernel = mt.persistent_kernel(functools.partial(_body, cfg=cfg, mirror=mirror),
                                  (n_mat, p, p), out_dtype, varying, name, avoid=AVOID)
    # The scope tells a cost model reading the compiled HLO (xla_comm.costs.TILES_SCOPE) that
    # this custom call computes len(mi) of the full product's tiles: its shapes read as the
    # whole batched GEMM.
    written, total = upper_tile_share(p, u.dtype, cfg)
    with jax.named_scope(f"tiles_{written}_of_{total}"):
        return kernel(jnp.asarray(mi), jnp.asarray(ni), u, w)


def symmetric_upper_reference(u: jax.Array, w: jax.Array, *,
                              out_dtype: DTypeLike | None = None) -> jax.Array:
    """:func:`symmetric_upper`'s product in XLA, every tile computed (f32 accumulation).

    >>> import jax.numpy as jnp
    >>> symmetric_upper_reference(jnp.ones((1, 2, 3)), jnp.ones((1, 2, 3))).tolist()
    [[[3.0, 3.0], [3.0, 3.0]]]
    """
    out = jnp.einsum("bik,bjk->bij", u, w, preferred_element_type=jnp.float32)
    return out.astype(out_dtype or u.dtype)
