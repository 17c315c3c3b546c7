"""A GEMM whose product is known to be symmetric, in Pallas Mosaic GPU: only the tiles that
touch the upper triangle are computed.

``symmetric_upper(u, w) -> c``: for ``u, w [B, p, r]``, ``c[b] = u[b] @ w[b]^T`` on every
``[tile_m, 2 tile_n]`` output tile that holds an element on or above the diagonal; tiles wholly
below it are left unwritten. When ``u w^T`` is symmetric (``w = u``: a Gram matrix ``X X^T``;
or ``u``, ``w`` polynomials in one symmetric matrix, which commute) the full product is the
upper triangle mirrored, which :func:`accel_kernels.symmetric.api.mirror_upper` does in one
elementwise pass. Newton-Schulz spends most of its work on such products, so this kernel
halves their tiles (``(T + 2) / (2 T)`` of them for ``T = p / tile_m`` row tiles).

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
    """bool ``[p, p]``: the elements :func:`symmetric_upper` writes (``p`` one it takes).

    >>> upper_tile_mask(512)[::128, ::128].astype(int).tolist()
    [[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]]
    """
    cfg = tiling or mt.default_tiling(dtype)
    tm, cta_n = cfg.tile_m, 2 * cfg.tile_n
    mi, ni = upper_tile_map(p, tm, cta_n)
    written = np.zeros((p // tm, p // cta_n), bool)
    written[mi, ni] = True
    return np.repeat(np.repeat(written, tm, axis=0), cta_n, axis=1)


def _body(tile_mi, tile_ni, u_gmem, w_gmem, out_gmem, *, cfg: mt.MosaicTiling):
    _, _, r = u_gmem.shape
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = 2 * tn
    k_iters = r // tk
    in_t = mg.smem_transforms(tk, u_gmem.dtype)
    in_specs = [mt.k_block((tm, tk), 1, in_t), mt.k_block((cta_n, tk), 1, in_t)]

    def tile(index, scope: mt.TileScope):
        b, t = index
        m_sl = pl.ds(tile_mi[t] * tm, tm)
        n_sl = pl.ds(tile_ni[t] * cta_n, cta_n)
        wg_n = pl.ds(scope.wg * tn, tn)
        out_tile = out_gmem.at[b, m_sl, n_sl].at[:, wg_n]

        def mma(idxs, a_smem, b_smem, acc_ref):
            del idxs
            plgpu.wgmma(acc_ref, a_smem, mg.transposed(b_smem.at[wg_n, :]))
            plgpu.wgmma_wait(0)
            return acc_ref

        pipeline = mt.warp_pipeline(mma, mt.tile_context(scope, out_tile, None, cfg), k_iters,
                                    in_specs, cfg)
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
                    varying: frozenset = frozenset()) -> jax.Array:
    """``u @ w^T`` on the output tiles that touch the upper triangle: ``[B, p, p]``.

    .. math::
      c_b[i, j] = \\sum_k u_b[i, k] \\, w_b[j, k] \\quad \\text{for every } (i, j),\\ i \\le j
      \\text{ (and the rest of their tiles)}

    Tiles wholly below the diagonal are not written: their values are undefined. Use it for
    products known to be symmetric and mirror the result
    (:func:`accel_kernels.symmetric.api.mirror_upper`).

    Args:
      u: ``[B, p, r]``, bfloat16 or float16.
      w: ``[B, p, r]``, the same dtype (``w = u`` for ``u u^T``).
      out_dtype: result dtype (default: the operands'); accumulation is f32.
      tiling: tile sizes (default :func:`accel_kernels.mosaic_tiles.default_tiling`); ``p``
        must be a multiple of ``2 tile_n`` and ``tile_m``, ``r`` of ``tile_k``.
      varying: mesh axes the output varies over inside a check_vma ``shard_map``.

    Returns:
      ``[B, p, p]`` in ``out_dtype``.
    """
    out_dtype = jnp.dtype(out_dtype or u.dtype)
    cfg = tiling or mt.default_tiling(u.dtype, out_dtype)
    why = check_shapes(u.shape, w.shape, u.dtype, cfg)
    if why is not None or w.dtype != u.dtype:
        raise ValueError(f"symmetric_upper: {why or 'u and w must share a dtype'}; pad p and "
                         f"r (zero rows and columns change nothing) or use {AVOID}.")
    n_mat, p, _ = u.shape
    mi, ni = upper_tile_map(p, cfg.tile_m, 2 * cfg.tile_n)
    bits = {"bfloat16": "bf16", "float16": "f16"}[jnp.dtype(u.dtype).name]
    kernel = mt.persistent_kernel(functools.partial(_body, cfg=cfg), (n_mat, p, p), out_dtype,
                                  varying, f"symmetric_upper_{bits}", avoid=AVOID)
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
