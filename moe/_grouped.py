"""The grouped-GEMM backends of the expert layer, bf16 and FP8, for both token layouts.

A backend gives the five GEMMs of a grouped linear layer ``out[rows of e] = a[rows of e] @ w[e]``
(f32 accumulation):

* ``fwd(a [..., K], w [E, K, N], gs, out_dtype) -> [..., N]`` (forward);
* ``dgrad(g [..., N], w [E, K, N], gs, out_dtype) -> [..., K]`` (``g @ w[e]^T``);
* ``wgrad(a [..., K], g [..., N], gs, out_dtype) -> [E, K, N]`` (``a_e^T @ g_e``);
* ``mm8(a [..., K], b [E, N, K], gs, out_dtype, s_a, s_b, trim=True) -> [..., N]``: FP8
  ``(a @ b[e]^T) * s_a[row] * s_b[e, n]`` with both payloads K-major (what FP8 tensor cores
  read) and the f32 dequantization scales ``s_a [...]`` (per row) and ``s_b [E, N]``;
  ``trim=False`` may return ``[..., N']``, ``N' >= N``, whose columns past ``N`` are zero
  (a kernel's padding, for a consumer that reads the first ``N`` columns: slicing them off
  is a copy of the whole result when the consumer is not an XLA fusion);
* ``tmm8(a_t, b_t, gs, out_dtype, s_a, s_b) -> [E, N1, N2]``: FP8 ``a_e^T @ b_e`` from
  K-major copies ``a_t [..., N1, rows]``, ``b_t [..., N2, rows]``, times ``s_a [..., N1]`` and
  ``s_b [..., N2]``.

The 'mosaic' kernels apply the scales to the f32 accumulator in their epilogue; the other
backends multiply the GEMM's result by them in XLA.

Layouts: ragged ``[R, K]`` (rows grouped by expert, ``gs`` rows each; backends 'ragged_dot',
'pallas', 'mosaic') or capacity-padded ``[E, C, K]`` ('einsum'), whose K-major copies are
``[E, K, C]``.

'mosaic' (Pallas Mosaic GPU, Hopper wgmma: `moe._gmm_mosaic`) needs the tile-aligned layout
(every group a multiple of 128 rows; :func:`align_map` makes it) and operand widths that are
multiples of its tiles (padded here when they are not). Lowered for CPU it runs its XLA
emulation (the same products through ``ragged_dot``), which is how tests exercise it there.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from moe import _gmm_mosaic, _gmm_pallas, _vma
from moe._tiling import pad_to

F8 = jnp.float8_e4m3fn
GROUP_ALIGNMENT = _gmm_mosaic.GROUP_ALIGNMENT


@dataclasses.dataclass(frozen=True)
class GroupedGemms:
    """The GEMMs of one backend and the layout of the token rows it takes."""

    x_ndim: int  # rank of the token operand: 2 = ragged [R, k], 3 = padded [E, C, k]
    fwd: Callable[..., jax.Array]
    dgrad: Callable[..., jax.Array]
    wgrad: Callable[..., jax.Array]
    mm8: Callable[..., jax.Array]
    tmm8: Callable[..., jax.Array]
    aligned: bool = False  # needs every group a multiple of GROUP_ALIGNMENT rows


class RowGroups(NamedTuple):
    """Group sizes of a layout plus how many leading rows of each group may be nonzero.

    Only 'mosaic' takes it (``gs`` of its GEMMs): it skips the row tiles past ``live``, whose
    outputs are zero and whose rows add nothing to a weight gradient, e.g. the empty slots of
    a capacity-padded layout run as rows.
    """

    sizes: jax.Array  # int32 [G]: rows of each group in the layout
    live: jax.Array  # int32 [G]: leading rows of each group that may be nonzero (<= sizes)


def split_groups(gs) -> tuple[jax.Array, jax.Array]:
    """``(sizes, live rows)`` of ``gs``: a :class:`RowGroups`, or plain int32 ``[G]`` sizes
    (every row live)."""
    return (gs.sizes, gs.live) if isinstance(gs, RowGroups) else (gs, gs)


def sizes_of(gs) -> jax.Array:
    """The group sizes of ``gs``: an int32 ``[G]`` array or a :class:`RowGroups`."""
    return split_groups(gs)[0]


def _dn(contract, ragged, group) -> lax.RaggedDotDimensionNumbers:
    return lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(contract, ([], [])),
        lhs_ragged_dimensions=ragged,
        rhs_group_dimensions=group,
    )


_RAGGED_FWD = _dn(([1], [1]), [0], [0])  # [R, k] x [E, k, n] -> [R, n]
_RAGGED_KMAJOR = _dn(([1], [2]), [0], [0])  # [R, n] x [E, k, n] -> [R, k] (w^T, no copy)
_RAGGED_WGRAD = _dn(([0], [0]), [0], [])  # [R, k] x [R, n] -> [E, k, n]


def _rd(a, b, gs, dn, out_dtype):
    out = lax.ragged_dot_general(a, b, gs, dn, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _up(a):
    """FP8 payload as bf16 (exact) for the emulated FP8 GEMMs."""
    return a.astype(jnp.bfloat16)


def group_of_rows(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 ``[rows]``: the group of each ragged row (``G`` past ``sum(group_sizes)``)."""
    ends = _gmm_mosaic.group_ends(group_sizes)
    g = jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right",
                         method="compare_all")
    return g.astype(jnp.int32)


def _scale_rows(raw, s_a, s_b, gs, out_dtype):
    """``raw * s_a[row] * s_b[group of row, n]`` for a ragged ``[R, N]`` or padded
    ``[E, C, N]`` GEMM result (f32 products of exact powers of two)."""
    if raw.ndim == 3:
        s_b = s_b[:, None, :]
    else:
        s_b = jnp.take(s_b, group_of_rows(gs, raw.shape[0]), axis=0, mode="clip")
    return (raw.astype(jnp.float32) * s_a[..., None] * s_b).astype(out_dtype)


def _scale_wgrad(raw, s_a, s_b, out_dtype):
    """``raw[e] * s_a[..., :, None] * s_b[..., None, :]`` for a weight-gradient result."""
    return (raw * s_a[..., :, None] * s_b[..., None, :]).astype(out_dtype)


def _raw_dtype(out_dtype):
    """The unscaled FP8 product's dtype: bf16 unless the output is f32 (scales are powers
    of two, so scaling after the bf16 rounding changes nothing)."""
    return jnp.float32 if jnp.dtype(out_dtype) == jnp.float32 else jnp.bfloat16


def _scaled_mm8(raw_fn):
    def mm8(a, b, gs, out_dtype, s_a, s_b, trim=True):
        del trim  # the result is exactly N wide
        return _scale_rows(raw_fn(a, b, gs, _raw_dtype(out_dtype)), s_a, s_b, gs, out_dtype)
    return mm8


def _scaled_tmm8(raw_fn):
    def tmm8(at, bt, gs, out_dtype, s_a, s_b):
        return _scale_wgrad(raw_fn(at, bt, gs), s_a, s_b, out_dtype)
    return tmm8


RAGGED_DOT = GroupedGemms(
    2,
    fwd=lambda a, w, gs, dt: _rd(a, w, gs, _RAGGED_FWD, dt),
    dgrad=lambda g, w, gs, dt: _rd(g, w, gs, _RAGGED_KMAJOR, dt),
    wgrad=lambda a, g, gs, dt: _rd(a, g, gs, _RAGGED_WGRAD, dt),
    mm8=_scaled_mm8(lambda a, b, gs, dt: _rd(_up(a), _up(b), gs, _RAGGED_KMAJOR, dt)),
    tmm8=_scaled_tmm8(lambda at, bt, gs: _rd(_up(at).T, _up(bt).T, gs, _RAGGED_WGRAD,
                                             jnp.float32)),
)


def _es(spec, a, b, dt):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(dt)


EINSUM = GroupedGemms(
    3,
    fwd=lambda a, w, gs, dt: _es("eck,ekn->ecn", a, w, dt),
    dgrad=lambda g, w, gs, dt: _es("ecn,ekn->eck", g, w, dt),
    wgrad=lambda a, g, gs, dt: _es("eck,ecn->ekn", a, g, dt),
    # XLA emits FP8 tensor-core GEMMs for these on Hopper (both operands K-major).
    mm8=_scaled_mm8(lambda a, b, gs, dt: jnp.einsum("eck,enk->ecn", a, b,
                                                    preferred_element_type=dt)),
    tmm8=_scaled_tmm8(lambda at, bt, gs: jnp.einsum("ekc,enc->ekn", at, bt,
                                                    preferred_element_type=jnp.float32)),
)

PALLAS = GroupedGemms(
    2,
    fwd=lambda a, w, gs, dt: _gmm_pallas.gmm(a, w, gs, out_dtype=dt),
    dgrad=lambda g, w, gs, dt: _gmm_pallas.gmm(g, w, gs, transpose_rhs=True, out_dtype=dt),
    wgrad=lambda a, g, gs, dt: _gmm_pallas.tgmm(a, g, gs, out_dtype=dt),
    mm8=_scaled_mm8(lambda a, b, gs, dt: _gmm_pallas.gmm(a, b, gs, transpose_rhs=True,
                                                         out_dtype=dt)),
    tmm8=_scaled_tmm8(lambda at, bt, gs: _gmm_pallas.tgmm(at.T, bt.T, gs,
                                                          out_dtype=jnp.float32)),
)


# ----------------------------------------------------------------------------------------------
# Mosaic GPU: the kernels when lowered for CUDA, their XLA emulation elsewhere.
# ----------------------------------------------------------------------------------------------


def _on_gpu(kernel_fn, emulated_fn, *args):
    """``kernel_fn(*args)`` when lowered for CUDA, ``emulated_fn(*args)`` elsewhere."""
    varying = _vma.varying_of(*args)
    return lax.platform_dependent(
        *args,
        cuda=functools.partial(kernel_fn, varying),
        default=emulated_fn,
    )


def _mosaic_gmm(a, b, gs, *scales, k_major: bool, out_dtype, trim: bool = True):
    """``a @ b[g]`` (``b [G, K, N]``) or ``a @ b[g]^T`` (``b [G, N, K]``, ``k_major``), times
    ``scales = (s_a [R], s_b [G, N])`` if given. ``gs``: sizes or :class:`RowGroups`.
    ``trim=False``: ``N`` rounded up to the kernel's column tile, the extra columns zero."""
    n = b.shape[1] if k_major else b.shape[2]
    cfg = _gmm_mosaic.default_tiling(a.dtype, out_dtype)
    width = n if trim else -(-n // (2 * cfg.tile_n)) * (2 * cfg.tile_n)

    def kernel(varying, a, b, gs, live, *scales):
        a_p = pad_to(a, 1, cfg.tile_k)
        b_p = pad_to(pad_to(b, 2 if k_major else 1, cfg.tile_k), 1 if k_major else 2,
                      2 * cfg.tile_n)
        kw = {}
        if scales:
            kw = dict(row_scale=scales[0], col_scale=pad_to(scales[1], 1, 2 * cfg.tile_n))
        out = _gmm_mosaic.gmm(a_p, b_p, gs, rhs_k_major=k_major, out_dtype=out_dtype,
                              tiling=cfg, varying=varying, live_rows=live, **kw)
        return out[:, :width] if out.shape[1] != width else out

    def emulated(a, b, gs, live, *scales):
        del live  # the rows past it are zero: computing them gives the kernel's zeros
        dn = _RAGGED_KMAJOR if k_major else _RAGGED_FWD
        if not scales:
            return pad_to(_rd(a, b, gs, dn, out_dtype), 1, width)
        raw = _rd(_up(a), _up(b), gs, dn, jnp.float32)
        return pad_to(_scale_rows(raw, *scales, gs, out_dtype), 1, width)

    return _on_gpu(kernel, emulated, a, b, *split_groups(gs), *scales)


def _mosaic_tgmm(a, b, gs, *scales, k_major: bool, out_dtype):
    """Per-group ``a_g^T @ b_g``: ``a [R, N1]``, ``b [R, N2]`` or K-major ``[N1, R]``,
    ``[N2, R]``, times ``scales = (s_a [N1], s_b [N2])`` if given. ``gs``: sizes or
    :class:`RowGroups`."""
    n1 = a.shape[0] if k_major else a.shape[1]
    n2 = b.shape[0] if k_major else b.shape[1]

    def kernel(varying, a, b, gs, live, *scales):
        cfg = _gmm_mosaic.default_tiling(a.dtype, out_dtype)
        ax = 0 if k_major else 1
        a_p, b_p = pad_to(a, ax, cfg.tile_m), pad_to(b, ax, 2 * cfg.tile_n)
        kw = {}
        if scales:
            kw = dict(row_scale=pad_to(scales[0], 0, cfg.tile_m),
                      col_scale=pad_to(scales[1], 0, 2 * cfg.tile_n))
        out = _gmm_mosaic.tgmm(a_p, b_p, gs, k_major=k_major, out_dtype=out_dtype,
                               tiling=cfg, varying=varying, live_rows=live, **kw)
        return out[:, :n1, :n2] if out.shape[1:] != (n1, n2) else out

    def emulated(a, b, gs, live, *scales):
        del live
        if k_major:
            a, b = a.T, b.T
        if not scales:
            return _rd(a, b, gs, _RAGGED_WGRAD, out_dtype)
        raw = _rd(_up(a), _up(b), gs, _RAGGED_WGRAD, jnp.float32)
        return _scale_wgrad(raw, *scales, out_dtype)

    return _on_gpu(kernel, emulated, a, b, *split_groups(gs), *scales)


MOSAIC = GroupedGemms(
    2,
    fwd=lambda a, w, gs, dt: _mosaic_gmm(a, w, gs, k_major=False, out_dtype=dt),
    dgrad=lambda g, w, gs, dt: _mosaic_gmm(g, w, gs, k_major=True, out_dtype=dt),
    wgrad=lambda a, g, gs, dt: _mosaic_tgmm(a, g, gs, k_major=False, out_dtype=dt),
    mm8=lambda a, b, gs, dt, s_a, s_b, trim=True: _mosaic_gmm(a, b, gs, s_a, s_b, k_major=True,
                                                              out_dtype=dt, trim=trim),
    tmm8=lambda at, bt, gs, dt, s_a, s_b: _mosaic_tgmm(at, bt, gs, s_a, s_b, k_major=True,
                                                       out_dtype=dt),
    aligned=True,
)

BACKENDS: dict[str, GroupedGemms] = {
    "ragged_dot": RAGGED_DOT,
    "einsum": EINSUM,
    "pallas": PALLAS,
    "mosaic": MOSAIC,
}


# ----------------------------------------------------------------------------------------------
# The tile-aligned ragged layout.
# ----------------------------------------------------------------------------------------------


def aligned_rows(rows: int, num_groups: int, alignment: int) -> int:
    """Static rows of the aligned layout of ``rows`` ragged rows in ``num_groups`` groups."""
    return -(-(rows + num_groups * (alignment - 1)) // alignment) * alignment


def align_map(group_sizes: jax.Array, rows: int, alignment: int):
    """Index maps between a ragged layout and its tile-aligned copy.

    The aligned layout puts group ``g`` at rows ``[A_g, A_g + gs_g)`` with ``A_g`` the
    cumulative sum of the sizes rounded up to ``alignment``; the rows in between are padding.

    Returns:
      ``(src, dst, aligned_sizes)``: aligned row ``i`` holds ragged row ``src[i]`` (``rows``:
      a padding row); ragged row ``r`` sits at aligned row ``dst[r]`` (out of range for
      padding rows); ``aligned_sizes`` int32 ``[G]`` are the rounded-up group sizes.
    """
    n = aligned_rows(rows, group_sizes.shape[0], alignment)
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    padded = -(-gs // alignment) * alignment
    ends, a_ends = _gmm_mosaic.group_ends(gs), _gmm_mosaic.group_ends(padded)
    starts, a_starts = ends - gs, a_ends - padded
    i = jnp.arange(n, dtype=jnp.int32)
    g_i = jnp.searchsorted(a_ends, i, side="right", method="compare_all")
    g_c = jnp.minimum(g_i, gs.shape[0] - 1)
    off = i - a_starts[g_c]
    src = jnp.where((g_i < gs.shape[0]) & (off < gs[g_c]), starts[g_c] + off, rows)
    r = jnp.arange(rows, dtype=jnp.int32)
    g_r = jnp.searchsorted(ends, r, side="right", method="compare_all")
    g_rc = jnp.minimum(g_r, gs.shape[0] - 1)
    dst = jnp.where(g_r < gs.shape[0], a_starts[g_rc] + r - starts[g_rc], n)
    return src.astype(jnp.int32), dst.astype(jnp.int32), padded


