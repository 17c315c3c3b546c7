"""The 'mosaic' grouped GEMMs: the Pallas Mosaic GPU wgmma kernels for Hopper
(`accel_kernels.gmm.mosaic_kernel`) when lowered for CUDA, their XLA emulation
(`accel_kernels.gmm.xla`) elsewhere, which is how tests exercise them on the CPU.

They need the tile-aligned layout (every group a multiple of 128 rows;
`accel_kernels.gmm.base.align_map` makes it) and operand widths that are multiples of their
tiles (padded here when they are not), and apply the FP8 scales to the f32 accumulator in
their epilogue.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from accel_kernels import mosaic_tiles, vma
from accel_kernels.gmm import mosaic_kernel
from accel_kernels.gmm.base import GroupedGemms, split_groups
from accel_kernels.gmm.xla import emulated_gmm, emulated_tgmm
from accel_kernels.tiling import pad_to


def _on_gpu(kernel_fn, emulated_fn, *args):
    """``kernel_fn(*args)`` when lowered for CUDA, ``emulated_fn(*args)`` elsewhere."""
    varying = vma.varying_of(*args)
    return lax.platform_dependent(
        *args,
        cuda=functools.partial(kernel_fn, varying),
        default=emulated_fn,
    )


def gmm(a, b, gs, *scales, k_major: bool, out_dtype, trim: bool = True):
    """``a @ b[g]`` (``b [G, K, N]``) or ``a @ b[g]^T`` (``b [G, N, K]``, ``k_major``), times
    ``scales = (s_a [R], s_b [G, N])`` if given. ``gs``: sizes or
    :class:`~accel_kernels.gmm.base.RowGroups`. ``trim=False``: ``N`` rounded up to the
    kernel's column tile, the extra columns zero."""
    n = b.shape[1] if k_major else b.shape[2]
    cfg = mosaic_tiles.default_tiling(a.dtype, out_dtype)
    width = n if trim else -(-n // (2 * cfg.tile_n)) * (2 * cfg.tile_n)

    def kernel(varying, a, b, gs, live, *scales):
        a_p = pad_to(a, 1, cfg.tile_k)
        b_p = pad_to(pad_to(b, 2 if k_major else 1, cfg.tile_k), 1 if k_major else 2,
                     2 * cfg.tile_n)
        kw = {}
        if scales:
            kw = dict(row_scale=scales[0], col_scale=pad_to(scales[1], 1, 2 * cfg.tile_n))
        out = mosaic_kernel.gmm(a_p, b_p, gs, rhs_k_major=k_major, out_dtype=out_dtype,
                                tiling=cfg, varying=varying, live_rows=live, **kw)
        return out[:, :width] if out.shape[1] != width else out

    emulated = functools.partial(emulated_gmm, k_major=k_major, out_dtype=out_dtype,
                                 width=width)
    return _on_gpu(kernel, emulated, a, b, *split_groups(gs), *scales)


def tgmm(a, b, gs, *scales, k_major: bool, out_dtype, acc=None):
    """Per-group ``a_g^T @ b_g``: ``a [R, N1]``, ``b [R, N2]`` or K-major ``[N1, R]``,
    ``[N2, R]``, times ``scales = (s_a [N1], s_b [N2])`` if given, plus ``acc [G, N1, N2]``
    (in ``out_dtype``) if given: the kernel adds it in its epilogue. ``gs``: sizes or
    :class:`~accel_kernels.gmm.base.RowGroups`."""
    n1 = a.shape[0] if k_major else a.shape[1]
    n2 = b.shape[0] if k_major else b.shape[1]
    prior = () if acc is None else (acc,)

    def kernel(varying, a, b, gs, live, *rest):
        scales, acc = (rest[:-1], rest[-1]) if prior else (rest, None)
        cfg = mosaic_tiles.default_tiling(a.dtype, out_dtype)
        ax = 0 if k_major else 1
        a_p, b_p = pad_to(a, ax, cfg.tile_m), pad_to(b, ax, 2 * cfg.tile_n)
        kw = {}
        if scales:
            kw = dict(row_scale=pad_to(scales[0], 0, cfg.tile_m),
                      col_scale=pad_to(scales[1], 0, 2 * cfg.tile_n))
        if acc is not None:
            kw["acc"] = pad_to(pad_to(acc, 1, cfg.tile_m), 2, 2 * cfg.tile_n)
        out = mosaic_kernel.tgmm(a_p, b_p, gs, k_major=k_major, out_dtype=out_dtype,
                                 tiling=cfg, varying=varying, live_rows=live, **kw)
        return out[:, :n1, :n2] if out.shape[1:] != (n1, n2) else out

    def emulated(a, b, gs, live, *rest):
        scales, acc = (rest[:-1], rest[-1]) if prior else (rest, None)
        if acc is None:
            return emulated_tgmm(a, b, gs, live, *scales, k_major=k_major, out_dtype=out_dtype)
        # the kernel adds the prior to its f32 accumulator and rounds once
        out = emulated_tgmm(a, b, gs, live, *scales, k_major=k_major, out_dtype=jnp.float32)
        return (out + acc.astype(jnp.float32)).astype(out_dtype)

    return _on_gpu(kernel, emulated, a, b, *split_groups(gs), *scales, *prior)


GEMMS = GroupedGemms(
    2,
    fwd=lambda a, w, gs, dt: gmm(a, w, gs, k_major=False, out_dtype=dt),
    dgrad=lambda g, w, gs, dt: gmm(g, w, gs, k_major=True, out_dtype=dt),
    wgrad=lambda a, g, gs, dt, acc=None: tgmm(a, g, gs, k_major=False, out_dtype=dt, acc=acc),
    mm8=lambda a, b, gs, dt, s_a, s_b, trim=True: gmm(a, b, gs, s_a, s_b, k_major=True,
                                                      out_dtype=dt, trim=trim),
    tmm8=lambda at, bt, gs, dt, s_a, s_b, acc=None: tgmm(at, bt, gs, s_a, s_b, k_major=True,
                                                         out_dtype=dt, acc=acc),
    aligned=True,
    accumulates=True,
)
