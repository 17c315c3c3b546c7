"""The FP8 expert GEMMs' gathered rows when nothing is sent, in Pallas Mosaic GPU.

Mosaic GPU twins of two kernels of `moe._wire_pallas` (Triton), with the same contract and
bytes; the layer lowers these on Hopper (`moe._platform.prefer_mosaic_gpu`):

* :func:`gather_local_rows_quantized`: ``rows(decode(encode(rows[index[i]])))``, the GEMM's
  e4m3 rows from the tokens with the FP8 wire's block rounding;
* :func:`gather_weighted_rows_quantized`: ``rows(wire_dtype(weights[s] * rows[s // top_k]))``,
  the combine gradient's rows in the expert layout.

One CTA (one warpgroup) per output row: it reads the row's index (a scalar load), then the
token row as ``[H / 128, 128]`` registers, warps over 128-channel blocks and lanes across a
block (:func:`block_layout`), so a block maximum is a reduction across one warp's lanes and the
row maximum one more across the warps. Rows of ``H`` a multiple of ``4 * block`` channels:
:func:`supported`.

The kernels take and give 2-D ``[rows, H]`` arrays and view a row as blocks inside. With a
``[R, H / 128, 128]`` output reshaped by XLA, the MoE layer's FP8 step on an H200 took 7.98
instead of 6.89 ms (the weight gradient's transpose of these rows read the reshape), though
the kernel alone was as fast as Triton's; 2-D, the layer took 6.82 ms against 6.93 with the
Triton kernels (BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from moe import _quant_mosaic as qm

F8 = jnp.float8_e4m3fn
_BLOCK = 128  # channels per register block of the weighted rows (any multiple of 32 works)


def supported(width: int, block_size: int = _BLOCK) -> bool:
    """Whether rows of ``width`` channels fit: ``block_size`` a multiple of 32 (at most 256)
    and ``width`` a multiple of ``4 * block_size`` (four blocks per warpgroup tile)."""
    return (qm.MOSAIC_IMPORT_ERROR is None and block_size % 32 == 0 and block_size <= 256
            and width % (4 * block_size) == 0)


def block_layout(block_size: int):
    """``[nb, block_size]`` registers: warp ``w`` holds blocks ``w mod 4``, lane ``l`` the
    ``block_size / 32`` channels at ``l * block_size / 32`` of each."""
    vec = block_size // 32
    return qm.plgpu.Layout.TILED(qm.plgpu.Tiling(((qm.WARPS, block_size), (vec,))),
                                 warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)


def _source(idx_ref, n: int):
    """This CTA's output row, its source row (0 where out of range) and whether in range."""
    i = lax.axis_index("rows")
    src = idx_ref[i]
    ok = (src >= 0) & (src < n)
    return i, jnp.where(ok, src, 0), ok


def _store_rows(q_ref, s_ref, i, y, layout, block_size: int) -> None:
    """Output row ``i``: f32 ``y [nb, block]`` as e4m3 with one power-of-two scale."""
    (q,), scale = qm.scaled_e4m3([y], layout, axes=(0, 1))
    _blocks(q_ref.at[i], block_size)[...] = q
    s_ref[i] = scale


def _blocks(ref, block_size: int):
    """A row ``ref [H]`` viewed as ``[H / block_size, block_size]``. The kernels take and give
    2-D ``[rows, H]`` arrays: an XLA reshape of a kernel's output in front of the weight
    gradient's transpose of these rows can make that transpose slow."""
    return ref.reshape(ref.shape[0] // block_size, block_size)


def _local_rows_body(idx_ref, x_ref, q_ref, s_ref, *, n_src, block_size):
    i, src, ok = _source(idx_ref, n_src)
    layout = block_layout(block_size)
    x = qm.load(_blocks(x_ref.at[src], block_size), layout)  # [nb, block]
    # The wire's rounding: e4m3 per block times its E8M0 scale (exact in f32).
    (qb,), scale = qm.scaled_e4m3([x], layout)
    y = qb.astype(jnp.float32) * qm.broadcast(scale, x.shape, layout)
    _store_rows(q_ref, s_ref, i, jnp.where(ok, y, jnp.float32(0)), layout, block_size)


def _weighted_rows_body(slot_ref, w_ref, x_ref, q_ref, s_ref, *, n_slots, top_k, wire_dtype):
    i, s, ok = _source(slot_ref, n_slots)
    layout = block_layout(_BLOCK)
    x = qm.load(_blocks(x_ref.at[s // top_k], _BLOCK), layout)
    # The bytes of the combine gradient's send row (the f32 product rounded to the wire's
    # dtype), then quantized per row.
    y = (w_ref[s].astype(jnp.float32) * x).astype(wire_dtype).astype(jnp.float32)
    _store_rows(q_ref, s_ref, i, jnp.where(ok, y, jnp.float32(0)), layout, _BLOCK)


def _rows_out(r: int, width: int):
    return (((r, width), F8), ((r,), jnp.float32))


def gather_local_rows_quantized(rows: jax.Array, index: jax.Array, *,
                                block_size: int = 128) -> tuple[jax.Array, jax.Array]:
    """`moe._wire_pallas.gather_local_rows_quantized` in Mosaic GPU (the same bytes).

    Args:
      rows: float tokens ``[T, H]``, ``H`` a multiple of ``4 * block_size``.
      index: int32 ``[R]``, the token of each output row (out of range: a zero row).
      block_size: FP8 channels per wire scale (a multiple of 32, at most 256).

    Returns:
      ``(e4m3 [R, H], f32 scale [R])``.
    """
    t, h = rows.shape
    if not supported(h, block_size):
        raise ValueError(f"rows of {h} channels with block_size={block_size} do not fit the "
                         "Mosaic GPU kernel (see supported()); use moe._wire_pallas.")
    r = index.shape[0]
    return qm.launch(functools.partial(_local_rows_body, n_src=t, block_size=block_size),
                     (index.astype(jnp.int32), rows), _rows_out(r, h), grid=r,
                     name="wire_local_rows_fp8_mgpu")


def gather_weighted_rows_quantized(rows: jax.Array, weights: jax.Array, slot: jax.Array, *,
                                   top_k: int, wire_dtype=jnp.bfloat16):
    """`moe._wire_pallas.gather_weighted_rows_quantized` in Mosaic GPU (the same bytes).

    Args:
      rows: float ``[T, H]`` token gradients, ``H`` a multiple of 512.
      weights: float ``[S]`` (``S = T * top_k``), one per slot.
      slot: int32 ``[R]``, the slot of each output row (out of range: a zero row).
      top_k: slots per token.
      wire_dtype: the float dtype the gradient rows are rounded to.

    Returns:
      ``(e4m3 [R, H], f32 scale [R])``.
    """
    t, h = rows.shape
    if not supported(h):
        raise ValueError(f"rows of {h} channels do not fit the Mosaic GPU kernel (a multiple "
                         f"of {4 * _BLOCK}); use moe._wire_pallas.")
    r = slot.shape[0]
    body = functools.partial(_weighted_rows_body, n_slots=weights.shape[0], top_k=top_k,
                             wire_dtype=jnp.dtype(wire_dtype))
    return qm.launch(body, (slot.astype(jnp.int32), weights, rows), _rows_out(r, h), grid=r,
                     name="wire_weighted_rows_fp8_mgpu")
