"""The token wire's kernels and the FP8 expert GEMMs' gathered rows, in Pallas Mosaic GPU.

Mosaic GPU twins of the kernels of `accel_kernels.wire.triton` (Triton), with the same contract and
bytes; the layer lowers these on Hopper (`accel_kernels.platform.prefer_mosaic_gpu`):

* :func:`gather_local_rows_quantized`: ``rows(decode(encode(rows[index[i]])))``, the GEMM's
  e4m3 rows from the tokens with the FP8 wire's block rounding;
* :func:`gather_weighted_rows_quantized`: ``rows(wire_dtype(weights[s] * rows[s // top_k]))``,
  the combine gradient's rows in the expert layout;
* :func:`gather_encode`, :func:`gather_decode`: the send buffer's rows gathered and encoded
  (FP8: e4m3 bytes and E8M0 block scales packed four to a uint32 word,
  `accel_kernels.wire.api.pack_fp8_words`; or a float cast), and received rows gathered into a
  layout and decoded;
* :func:`gather_rows_quantized`: received FP8 wire rows gathered and re-quantized per row for
  the FP8 GEMMs.

One CTA (one warpgroup) per output row (two rows for the two local gathers when the row count
is even, :data:`ROWS_PER_CTA`): it reads the row's index (a scalar load), then the token row
as ``[H / 128, 128]`` registers, warps over 128-channel blocks and lanes across a block
(:func:`block_layout`), so a block maximum is a reduction across one warp's lanes and the row
maximum one more across the warps. Rows of ``H`` a multiple of ``4 * block`` channels, blocks
of 128 or 256: :func:`supported`. The wire kernels view an FP8 row as ``[G, 4, block / 4,
4]`` (groups of four blocks, one scale word each; :func:`word_layout`): a lane holds the four
bytes of a wire word in one register, so words are packed and unpacked with shifts inside a
thread, and a scale word's four bytes, one per warp, are summed across the warps (rows of
``H`` a multiple of ``4 * block``, ``block`` a multiple of 128; float rows whose lane vector
holds 4 to 16 bytes: :func:`wire_supported`).

Every global store follows the rules of jax's Mosaic GPU transfer planner (checked since jax
0.12): each warp writes whole 32-byte sectors, at least 4 bytes per thread. A row's e4m3 bytes
are 4 or more per lane; the per-row scale and the FP8 wire's scale words are scalar stores.

The kernels take and give 2-D ``[rows, H]`` arrays and view a row as blocks inside: a
``[R, H / 128, 128]`` output reshaped by XLA, though as fast alone, slows the MoE layer's FP8
step, as the weight gradient's transpose of these rows reads the reshape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from accel_kernels import fp8
from accel_kernels import mosaic_gpu as mg
from accel_kernels.mosaic_gpu import F8, WARPS, pl, plgpu

_BLOCK = 128  # channels per register block of the weighted rows: 4 e4m3 bytes per lane


def supported(width: int, block_size: int = _BLOCK) -> bool:
    """Whether rows of ``width`` channels fit the two local gathers: ``block_size`` 128 or
    256 (a lane holds ``block_size / 32 >= 4`` channels, so each e4m3 store is at least 4 bytes
    per thread, as jax's transfer planner requires) and ``width`` a multiple of ``4 *
    block_size`` (four blocks per warpgroup tile)."""
    return (mg.MOSAIC_IMPORT_ERROR is None and block_size in (128, 256)
            and width % (4 * block_size) == 0)


def block_layout(block_size: int):
    """``[nb, block_size]`` registers: warp ``w`` holds blocks ``w mod 4``, lane ``l`` the
    ``block_size / 32`` channels at ``l * block_size / 32`` of each."""
    vec = block_size // 32
    return plgpu.Layout.TILED(plgpu.Tiling(((WARPS, block_size), (vec,))),
                                 warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)


def _source(idx_ref, n: int):
    """This CTA's output row, its source row (0 where out of range) and whether in range."""
    return _sources(idx_ref, n, 1)[0]


ROWS_PER_CTA = 2
"""Output rows one CTA of the local gathers handles (when the row count allows it), both row
indices loaded first: a little faster than one row per CTA for the local rows, no slower for
the weighted rows."""


def _rows_per_cta(r: int) -> int:
    return ROWS_PER_CTA if r % ROWS_PER_CTA == 0 else 1


def _sources(idx_ref, n: int, per: int):
    """This CTA's ``per`` output rows ``(i, source or 0, in range)``, indices loaded first."""
    base = lax.axis_index("rows") * per
    out = []
    for j in range(per):
        src = idx_ref[base + j]
        ok = (src >= 0) & (src < n)
        out.append((base + j, jnp.where(ok, src, 0), ok))
    return out


def _store_rows(q_ref, s_ref, i, y, layout, block_size: int) -> None:
    """Output row ``i``: f32 ``y [nb, block]`` as e4m3 with one power-of-two scale."""
    (q,), scale = mg.scaled_e4m3([y], layout, axes=(0, 1))
    _blocks(q_ref.at[i], block_size)[...] = q
    s_ref[i] = scale


def _view(ref, shape: tuple[int, ...]):
    """A row ``ref [H]`` viewed as ``shape`` (row-major). The kernels take and give 2-D
    ``[rows, H]`` arrays: an XLA reshape of a kernel's output in front of the weight
    gradient's transpose of these rows can make that transpose slow."""
    return ref.reshape(*shape)


def _blocks(ref, block_size: int):
    """A row ``ref [H]`` viewed as ``[H / block_size, block_size]``."""
    return _view(ref, (ref.shape[0] // block_size, block_size))


def _local_rows_body(idx_ref, x_ref, q_ref, s_ref, *, n_src, block_size, per):
    layout = block_layout(block_size)
    for i, src, ok in _sources(idx_ref, n_src, per):
        x = mg.load_f32(_blocks(x_ref.at[src], block_size), layout)  # [nb, block]
        # The wire's rounding: e4m3 per block times its E8M0 scale (exact in f32).
        (qb,), scale = mg.scaled_e4m3([x], layout)
        y = qb.astype(jnp.float32) * mg.broadcast(scale, x.shape, layout)
        _store_rows(q_ref, s_ref, i, jnp.where(ok, y, jnp.float32(0)), layout, block_size)


def _weighted_rows_body(slot_ref, w_ref, x_ref, q_ref, s_ref, *, n_slots, top_k, wire_dtype,
                        per):
    layout = block_layout(_BLOCK)
    for i, s, ok in _sources(slot_ref, n_slots, per):
        x = mg.load_f32(_blocks(x_ref.at[s // top_k], _BLOCK), layout)
        # The bytes of the combine gradient's send row (the f32 product rounded to the
        # wire's dtype), then quantized per row.
        y = (w_ref[s].astype(jnp.float32) * x).astype(wire_dtype).astype(jnp.float32)
        _store_rows(q_ref, s_ref, i, jnp.where(ok, y, jnp.float32(0)), layout, _BLOCK)


def _rows_out(r: int, width: int):
    return (((r, width), F8), ((r,), jnp.float32))


def gather_local_rows_quantized(rows: jax.Array, index: jax.Array, *,
                                block_size: int = 128) -> tuple[jax.Array, jax.Array]:
    """`accel_kernels.wire.triton.gather_local_rows_quantized` in Mosaic GPU (the same bytes).

    Args:
      rows: float tokens ``[T, H]``, ``H`` a multiple of ``4 * block_size``.
      index: int32 ``[R]``, the token of each output row (out of range: a zero row).
      block_size: FP8 channels per wire scale (128 or 256).

    Returns:
      ``(e4m3 [R, H], f32 scale [R])``.
    """
    t, h = rows.shape
    if not supported(h, block_size):
        raise ValueError(f"rows of {h} channels with block_size={block_size} do not fit the "
                         "Mosaic GPU kernel (see supported()); use accel_kernels.wire.triton.")
    r, per = index.shape[0], _rows_per_cta(index.shape[0])
    body = functools.partial(_local_rows_body, n_src=t, block_size=block_size, per=per)
    return mg.launch(body, (index.astype(jnp.int32), rows), _rows_out(r, h), grid=r // per,
                     name="wire_local_rows_fp8_mgpu", avoid=AVOID_WIRE)


def gather_weighted_rows_quantized(rows: jax.Array, weights: jax.Array, slot: jax.Array, *,
                                   top_k: int, wire_dtype=jnp.bfloat16):
    """`accel_kernels.wire.triton.gather_weighted_rows_quantized` in Mosaic GPU (the same bytes).

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
                         f"of {4 * _BLOCK}); use accel_kernels.wire.triton.")
    r, per = slot.shape[0], _rows_per_cta(slot.shape[0])
    body = functools.partial(_weighted_rows_body, n_slots=weights.shape[0], top_k=top_k,
                             wire_dtype=jnp.dtype(wire_dtype), per=per)
    return mg.launch(body, (slot.astype(jnp.int32), weights, rows), _rows_out(r, h),
                     grid=r // per, name="wire_weighted_rows_fp8_mgpu", avoid=AVOID_WIRE)


# ----------------------------------------------------------------------------------------------
# The token wire (`accel_kernels.wire.triton.gather_encode`, `gather_decode`,
# `gather_rows_quantized`):
# FP8 rows as uint32 words, four e4m3 bytes each, then the E8M0 scale words.
# ----------------------------------------------------------------------------------------------

AVOID_WIRE = "wire_implementation='xla'"
"""What keeps the dispatch off the wire kernels (`accel_kernels.lowering.check_kernel_lowers`)."""

WORD = 4
"""e4m3 bytes (or E8M0 scale bytes) per uint32 word of the wire."""


def wire_supported(width: int, *, fp8_wire: bool, block_size: int = 128,
                   itemsizes: tuple[int, ...] = (2,)) -> bool:
    """Whether the wire kernels take rows of ``width`` channels: FP8, ``block_size`` a
    multiple of 128 (a lane holds whole words of a block) and ``width`` a multiple of ``4 *
    block_size`` (whole scale words, one block per warp); float rows, a lane vector
    (:func:`float_vector`) of the row's dtypes, ``itemsizes`` (bytes of the source and
    destination rows)."""
    if mg.MOSAIC_IMPORT_ERROR is not None:
        return False
    if not fp8_wire:
        return float_vector(width, itemsizes) is not None
    return block_size % 128 == 0 and width % (WORD * block_size) == 0


def float_vector(width: int, itemsizes: tuple[int, ...]) -> int | None:
    """Elements per lane vector of a float row copy of ``width`` channels (the warps split the
    row), or None where no vector fits: at most 16 bytes of the widest dtype, and at least 4
    bytes of the narrowest, since jax's transfer planner rejects narrower global stores."""
    vec = mg.vector_length(width // WARPS, max(itemsizes)) if width % (WARPS * 32) == 0 \
        else 0
    return vec if vec and vec * min(itemsizes) >= 4 else None


def word_layout():
    """``[G, 4, block / 4, 4]`` registers of a row's ``G`` groups of four blocks (one scale
    word each): warp ``w`` holds block ``w`` of each group, lane ``l`` the words ``l mod 32``
    of a block, one register the four bytes of a word. A word is packed or unpacked inside
    one thread; a scale word's bytes come from the four warps."""
    return plgpu.Layout.TILED(plgpu.Tiling(((1, WARPS, 32, WORD),)), warp_dims=(-3,),
                                 lane_dims=(-2,), vector_dim=-1)


def _cast(x: jax.Array, layout) -> jax.Array:
    return plgpu.layout_cast(x, layout)


def _shifts(shape: tuple[int, ...], dim: int, layout) -> jax.Array:
    """uint32 ``8 j`` at index ``j`` of ``dim`` (byte ``j`` of a little-endian word)."""
    return _cast(lax.broadcasted_iota(jnp.uint32, shape, dim), layout) * jnp.uint32(8)


def _copy_row(src, dst, ok, width: int) -> None:
    """``dst [width] = src [width]`` cast to ``dst``'s dtype (zeros unless ``ok``)."""
    vec = float_vector(width, (src.dtype.itemsize, dst.dtype.itemsize))
    shape = (width // (32 * vec), 32 * vec)
    y = mg.load_raw(_view(src, shape), mg.row_layout(vec)).astype(dst.dtype)
    _view(dst, shape)[...] = jnp.where(ok, y, jnp.zeros((), dst.dtype))


def _shape(width: int, block_size: int) -> tuple[int, int, int, int]:
    return width // (WORD * block_size), WORD, block_size // WORD, WORD


def _data_words(ref, row, width: int):
    """Row ``row`` of wire ``ref``: its e4m3 words, as ``[G, 4, block / 4]`` or a row."""
    return ref.at[row, pl.ds(0, width // WORD)]


def _encode_body(idx_ref, x_ref, out_ref, *, n_src, width, block_size, fp8_wire):
    i, src, ok = _source(idx_ref, n_src)
    if not fp8_wire:
        _copy_row(x_ref.at[src], out_ref.at[i], ok, width)
        return
    layout, shape = word_layout(), _shape(width, block_size)
    x = mg.load_f32(_view(x_ref.at[src], shape), layout)
    # Per block (a warp's lanes): the E8M0 byte and e4m3 bytes of `moe.fp8.quantize`.
    byte, inv = fp8.scales_from_amax_bits(jnp.max(jnp.max(mg.abs_bits(x), axis=3), axis=2))
    inv = _cast(lax.broadcast_in_dim(inv, shape, [0, 1]), layout)
    q = jnp.clip(x * inv, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(F8)
    # Byte j of a word in bits 8j..8j+7 (`accel_kernels.wire.api.pack_fp8_words`).
    q = lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.uint32)
    words = jnp.sum(q << _shifts(shape, 3, layout), axis=3)  # [G, 4, block / 4]
    zero = jnp.uint32(0)
    _view(_data_words(out_ref, i, width), shape[:3])[...] = jnp.where(ok, words, zero)
    # Scale word g: byte j from block j of group g, i.e. warp j (a sum across the warps).
    blocks = layout.reduce((2, 3))
    part = byte.astype(jnp.uint32) << _shifts(shape[:2], 1, blocks)  # [G, 4]
    words = jnp.where(ok, jnp.sum(part, axis=1), zero)  # [G], every thread holds them all
    # One scalar store per scale word: a vector store of G words would cover partial 32-byte
    # sectors, which jax's transfer planner rejects (jax >= 0.12), and a TMA copy needs
    # 16-byte-aligned rows, which a wire row of G words is not in general.
    g_index = _cast(lax.broadcasted_iota(jnp.int32, shape[:1], 0), blocks.reduce(1)) \
        if shape[0] > 1 else None
    for g in range(shape[0]):
        word = words if g_index is None else jnp.where(g_index == g, words, zero)
        out_ref[i, width // WORD + g] = jnp.sum(word)


def _decoded(buf_ref, s, *, width: int, block_size: int) -> jax.Array:
    """f32 ``[G, 4, block / 4, 4]`` (:func:`word_layout`): FP8 wire row ``s`` decoded (NaN in
    a block whose scale byte is ``E8M0_NAN``), as `moe.fp8.dequantize` before its clip."""
    layout, shape = word_layout(), _shape(width, block_size)
    words = mg.load_raw(_view(_data_words(buf_ref, s, width), shape[:3]), layout.reduce(3))
    words = _cast(lax.broadcast_in_dim(words, shape, [0, 1, 2]), layout)
    data = (words >> _shifts(shape, 3, layout)).astype(jnp.uint8)  # byte j of each word
    data = lax.bitcast_convert_type(data, F8).astype(jnp.float32)
    blocks = layout.reduce((2, 3))
    if shape[0] == 1:  # one scale word: a scalar load
        sw = buf_ref[s, width // WORD]
    else:  # every thread loads the G words
        sw = mg.load_raw(buf_ref.at[s, pl.ds(width // WORD, shape[0])], layout.reduce((1, 2, 3)))
        sw = _cast(lax.broadcast_in_dim(sw, shape[:2], [0]), blocks)
    byte = (sw >> _shifts(shape[:2], 1, blocks)) & jnp.uint32(0xFF)  # [G, 4]
    scale = fp8.scale_from_byte(byte.astype(jnp.int32))
    return data * _cast(lax.broadcast_in_dim(scale, shape, [0, 1]), layout)


def _decode_body(idx_ref, buf_ref, out_ref, *, n_src, width, block_size, fp8_wire):
    r, s, ok = _source(idx_ref, n_src)
    if not fp8_wire:
        _copy_row(buf_ref.at[s, pl.ds(0, width)], out_ref.at[r], ok, width)
        return
    y = _decoded(buf_ref, s, width=width, block_size=block_size)
    fmax = float(jnp.finfo(out_ref.dtype).max)
    y = jnp.clip(y, -fmax, fmax).astype(out_ref.dtype)  # keeps NaN; 2^128 does not round to inf
    _view(out_ref.at[r], y.shape)[...] = jnp.where(ok, y, jnp.zeros((), out_ref.dtype))


def _wire_rows_body(idx_ref, buf_ref, q_ref, s_ref, *, n_src, width, block_size):
    r, s, ok = _source(idx_ref, n_src)
    layout = word_layout()
    y = jnp.where(ok, _decoded(buf_ref, s, width=width, block_size=block_size), jnp.float32(0))
    # The row maximum: over the groups in registers first, then one reduction across warps.
    amax = jnp.max(mg.abs_bits(y), axis=0)
    for ax in (2, 1, 0):
        amax = jnp.max(amax, axis=ax)
    byte, inv = fp8.scales_from_amax_bits(amax)
    q = jnp.clip(y * mg.broadcast(inv, y.shape, layout), -fp8.E4M3_MAX, fp8.E4M3_MAX)
    _view(q_ref.at[r], y.shape)[...] = q.astype(F8)
    s_ref[r] = fp8.scale_from_byte(byte)


def _check_wire(width: int, fp8_wire: bool, block_size: int, itemsizes=(2,)) -> None:
    if not wire_supported(width, fp8_wire=fp8_wire, block_size=block_size, itemsizes=itemsizes):
        raise ValueError(
            f"rows of {width} channels ({'FP8' if fp8_wire else 'float'} wire, block_size="
            f"{block_size}) do not fit the Mosaic GPU wire kernels (see wire_supported()); use "
            "accel_kernels.wire.triton.")


def gather_encode(rows: jax.Array, index: jax.Array, *, fp8_wire: bool, block_size: int = 128,
                  out_dtype=None) -> jax.Array:
    """`accel_kernels.wire.triton.gather_encode` in Mosaic GPU (the same bytes): ``out[i] =
    encode(rows[index[i]])``, zero where ``index[i]`` is outside ``[0, T)``.

    Args:
      rows: float ``[T, H]`` (:func:`wire_supported` widths).
      index: int32 ``[M]``.
      fp8_wire: encode as FP8 (else copy, casting to ``out_dtype``).
      block_size: FP8 channels per scale (a multiple of 128).
      out_dtype: dtype of the copied rows (default ``rows.dtype``; ignored for FP8).

    Returns:
      FP8: ``uint32[M, H / 4 + H / (4 block_size)]`` (`accel_kernels.wire.api.pack_fp8_words`);
      otherwise ``out_dtype[M, H]``.
    """
    t, h = rows.shape
    out_dtype = jnp.dtype(out_dtype or rows.dtype)
    _check_wire(h, fp8_wire, block_size, (rows.dtype.itemsize, out_dtype.itemsize))
    m = index.shape[0]
    if fp8_wire:
        out = ((m, h // WORD + fp8.num_scale_words(h, block_size)), jnp.uint32)
    else:
        out = ((m, h), out_dtype)
    body = functools.partial(_encode_body, n_src=t, width=h, block_size=block_size,
                             fp8_wire=fp8_wire)
    return mg.launch(body, (index.astype(jnp.int32), rows), (out,), grid=m,
                     name="wire_gather_encode_mgpu", avoid=AVOID_WIRE)[0]


def gather_decode(buf: jax.Array, index: jax.Array, *, width: int, fp8_wire: bool,
                  block_size: int = 128, out_dtype=jnp.bfloat16) -> jax.Array:
    """`accel_kernels.wire.triton.gather_decode` in Mosaic GPU (the same bytes): ``out[r] =
    decode(buf[index[r]])``, zero where ``index[r]`` is outside ``[0, N)``.

    Args:
      buf: wire rows ``[N, wire width]`` (uint32 FP8 words, or float rows).
      index: int32 ``[R]``.
      width: logical row width ``H`` (:func:`wire_supported`).
      fp8_wire: ``buf`` holds FP8 words (else float rows, cast to ``out_dtype``).
      block_size: FP8 channels per scale (a multiple of 128).
      out_dtype: output dtype.

    Returns:
      ``out_dtype[R, H]``.
    """
    _check_wire(width, fp8_wire, block_size,
                (buf.dtype.itemsize, jnp.dtype(out_dtype).itemsize))
    _check_buf(buf, width, fp8_wire, block_size)
    body = functools.partial(_decode_body, n_src=buf.shape[0], width=width,
                             block_size=block_size, fp8_wire=fp8_wire)
    return mg.launch(body, (index.astype(jnp.int32), buf),
                     (((index.shape[0], width), jnp.dtype(out_dtype)),), grid=index.shape[0],
                     name="wire_gather_decode_mgpu", avoid=AVOID_WIRE)[0]


def gather_rows_quantized(buf: jax.Array, index: jax.Array, *, width: int,
                          block_size: int = 128) -> tuple[jax.Array, jax.Array]:
    """`accel_kernels.wire.triton.gather_rows_quantized` in Mosaic GPU (the same bytes):
    ``rows(decode(buf[index[r]]))``, FP8 wire rows gathered and re-quantized with one
    power-of-two scale per row (zero rows where ``index`` is out of range).

    Args:
      buf: FP8 wire rows ``uint32[N, width / 4 + width / (4 block_size)]``.
      index: int32 ``[R]``.
      width: logical row width ``H``, a multiple of ``4 * block_size``.
      block_size: FP8 channels per wire scale (a multiple of 128).

    Returns:
      ``(e4m3 [R, H], f32 scale [R])``; a row holding NaN or inf gets a NaN scale.
    """
    _check_wire(width, True, block_size)
    _check_buf(buf, width, True, block_size)
    r = index.shape[0]
    body = functools.partial(_wire_rows_body, n_src=buf.shape[0], width=width,
                             block_size=block_size)
    return mg.launch(body, (index.astype(jnp.int32), buf), _rows_out(r, width), grid=r,
                     name="wire_gather_rows_fp8_mgpu", avoid=AVOID_WIRE)


def _check_buf(buf: jax.Array, width: int, fp8_wire: bool, block_size: int) -> None:
    want = width // WORD + fp8.num_scale_words(width, block_size) if fp8_wire else width
    if buf.ndim != 2 or buf.shape[1] != want or (fp8_wire and buf.dtype != jnp.uint32):
        raise ValueError(f"buf must be wire rows [N, {want}] of {width} channels "
                         f"({'uint32 FP8 words' if fp8_wire else 'float'}), got {buf.dtype}"
                         f"{list(buf.shape)}; pass the width and block_size they were encoded "
                         "with.")
