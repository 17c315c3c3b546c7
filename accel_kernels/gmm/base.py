"""What every grouped-GEMM implementation shares: the GEMMs' interface, the row groups, the
tile-aligned ragged layout and the FP8 scale epilogue done in XLA.

An implementation (:class:`GroupedGemms`) gives the five GEMMs of a grouped linear layer
``out[rows of e] = a[rows of e] @ w[e]`` (f32 accumulation):

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

Layouts: ragged ``[R, K]`` (rows grouped by expert, ``gs`` rows each) or capacity-padded
``[E, C, K]``, whose K-major copies are ``[E, K, C]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

GROUP_ALIGNMENT = 128
"""Row alignment of every group in the layout the Mosaic GPU kernels take (their row and
contraction tile)."""


@dataclasses.dataclass(frozen=True)
class GroupedGemms:
    """The GEMMs of one implementation and the layout of the token rows it takes."""

    x_ndim: int  # rank of the token operand: 2 = ragged [R, k], 3 = padded [E, C, k]
    fwd: Callable[..., jax.Array]
    dgrad: Callable[..., jax.Array]
    wgrad: Callable[..., jax.Array]
    mm8: Callable[..., jax.Array]
    tmm8: Callable[..., jax.Array]
    aligned: bool = False  # needs every group a multiple of GROUP_ALIGNMENT rows
    # wgrad and tmm8 take acc= (an existing output [G, N1, N2] in out_dtype) and add it in
    # the kernel; elsewhere the caller adds (moe.experts.fp8_gemm.wgrad).
    accumulates: bool = False


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


def group_ends(group_sizes: jax.Array) -> jax.Array:
    """Inclusive cumulative sum of the (few) group sizes, as one masked reduction: XLA lowers
    ``jnp.cumsum`` for CUDA to a scan loop (jax 0.11), which a handful of groups do not need.

    Example:
      >>> group_ends(jnp.array([2, 0, 3])).tolist()
      [2, 2, 5]
    """
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    n = gs.shape[0]
    tri = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
    return jnp.sum(jnp.where(tri, gs[None, :], 0), axis=1, dtype=jnp.int32)


def group_of_rows(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 ``[rows]``: the group of each ragged row (``G`` past ``sum(group_sizes)``).

    Example:
      >>> group_of_rows(jnp.array([2, 1]), 4).tolist()
      [0, 0, 1, 2]
    """
    ends = group_ends(group_sizes)
    g = jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right",
                         method="compare_all")
    return g.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# The FP8 scale epilogue in XLA (the 'mosaic' kernels apply the scales in theirs).
# ----------------------------------------------------------------------------------------------


def upcast(a: jax.Array) -> jax.Array:
    """FP8 payload as bf16 (exact) for the emulated FP8 GEMMs."""
    return a.astype(jnp.bfloat16)


def scale_rows(raw, s_a, s_b, gs, out_dtype):
    """``raw * s_a[row] * s_b[group of row, n]`` for a ragged ``[R, N]`` or padded
    ``[E, C, N]`` GEMM result (f32 products of exact powers of two)."""
    if raw.ndim == 3:
        s_b = s_b[:, None, :]
    else:
        s_b = jnp.take(s_b, group_of_rows(gs, raw.shape[0]), axis=0, mode="clip")
    return (raw.astype(jnp.float32) * s_a[..., None] * s_b).astype(out_dtype)


def scale_wgrad(raw, s_a, s_b, out_dtype):
    """``raw[e] * s_a[..., :, None] * s_b[..., None, :]`` for a weight-gradient result."""
    return (raw * s_a[..., :, None] * s_b[..., None, :]).astype(out_dtype)


def raw_dtype(out_dtype):
    """The unscaled FP8 product's dtype: bf16 unless the output is f32 (scales are powers
    of two, so scaling after the bf16 rounding changes nothing)."""
    return jnp.float32 if jnp.dtype(out_dtype) == jnp.float32 else jnp.bfloat16


def scaled_mm8(raw_fn):
    """``mm8`` from an unscaled ``raw_fn(a, b, gs, dtype)``: its result times the scales."""
    def mm8(a, b, gs, out_dtype, s_a, s_b, trim=True):
        del trim  # the result is exactly N wide
        return scale_rows(raw_fn(a, b, gs, raw_dtype(out_dtype)), s_a, s_b, gs, out_dtype)
    return mm8


def scaled_tmm8(raw_fn):
    """``tmm8`` from an unscaled f32 ``raw_fn(a_t, b_t, gs)``: its result times the scales."""
    def tmm8(at, bt, gs, out_dtype, s_a, s_b):
        return scale_wgrad(raw_fn(at, bt, gs), s_a, s_b, out_dtype)
    return tmm8


# ----------------------------------------------------------------------------------------------
# The tile-aligned ragged layout.
# ----------------------------------------------------------------------------------------------


def aligned_rows(rows: int, num_groups: int, alignment: int) -> int:
    """Static rows of the aligned layout of ``rows`` ragged rows in ``num_groups`` groups.

    Example:
      >>> aligned_rows(10, 2, 128)  # room for both groups to start on a tile
      384
    """
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
    ends, a_ends = group_ends(gs), group_ends(padded)
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
