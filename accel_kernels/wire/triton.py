"""Pallas (Triton) kernels for the token wire: gather + encode, and gather + decode, one pass.

XLA splits FP8 encoding into a block-max reduction, a quantize fusion and a copy into the
packed row, then gathers the send buffer in another pass: several times the time the bytes
alone need (``benchmarks/dispatch_bench.py --part phases`` times them).
These kernels do each direction in one pass, one program per output row:

* :func:`gather_encode`: ``out[i] = encode(rows[index[i]])`` (a zero row where ``index[i]``
  is out of range): bf16 rows are copied, FP8 rows are quantized (block maxima, E8M0 scales,
  e4m3 data) and packed into uint32 words exactly as :func:`accel_kernels.wire.api.pack_fp8_words`
  (the same bytes as ``moe.fp8.quantize``: the scales come from the same integer arithmetic,
  :func:`moe.fp8.scales_from_amax_bits`, and the e4m3 cast rounds to nearest even as XLA's).
* :func:`gather_decode`: ``out[r] = decode(buf[index[r]])`` (zero where out of range): the
  inverse, fused with the row permutation the receiver needs (e.g. source-major -> expert
  layout), so no transpose pass follows.
* :func:`gather_rows_quantized`: ``rows(decode(buf[index[r]]))``, the decoded row quantized
  again with one power-of-two scale per row (`accel_kernels.quant.triton.quantize_rows`' bytes): the
  e4m3 operand of an FP8 expert GEMM straight from the one-byte wire rows, with no decoded
  bf16 copy written and read back.
* :func:`gather_local_rows_quantized`: the same bytes straight from the token rows when
  nothing is sent (one device on the expert axis): no wire rows are written at all.
* :func:`gather_weighted_rows_quantized`: the combine's gradient rows in the expert layout
  (weighted token gradients), quantized per row for the FP8 GEMMs, when nothing is sent.

Compiled through Triton on NVIDIA GPUs; in Pallas interpret mode (``interpret=True``, slow)
anywhere else, which is how the tests check them on CPU. They work inside ``jax.shard_map``
(the outputs carry the operands' varying axes; see ``accel_kernels.gmm.triton``). Row widths must be
powers of two (Triton block shapes): :func:`supported` says whether a shape can use them. A row
of fewer than four blocks has one scale word, its unused byte slots :data:`moe.fp8.E8M0_PAD`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from accel_kernels import fp8, triton_gpu
from accel_kernels.quant import xla as quant_xla
from accel_kernels.triton_gpu import PALLAS_IMPORT_ERROR, pl
from accel_kernels.triton_gpu import plgpu as _plgpu


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(width: int, *, fp8_wire: bool, block_size: int = 128) -> bool:
    """Whether rows of ``width`` channels can use these kernels (Triton needs power-of-two
    block shapes: ``width``, and for FP8 ``width / 4``, ``width / block_size`` and the scale
    words per row, all powers of two when ``width`` and ``block_size`` are)."""
    if PALLAS_IMPORT_ERROR is not None or not _pow2(width):
        return False
    if not fp8_wire:
        return True
    return _pow2(block_size) and width % block_size == 0 and width % 4 == 0


def _scale_word_shape(width: int, block_size: int) -> tuple[int, int]:
    """``(words, bytes used per word)`` of a row's scales: ``nb / 4`` full words, or one
    word holding all ``nb < 4`` bytes (``supported`` widths have ``nb`` a power of two)."""
    nb = width // block_size
    per = min(4, nb)
    return nb // per, per


def _shifts(n: int, m: int = 4) -> jax.Array:
    """uint32 ``[n, m]``: ``8 j`` in column j (byte j of a little-endian word); an iota, as
    kernels may not capture array constants."""
    return (lax.broadcasted_iota(jnp.int32, (n, m), 1) * 8).astype(jnp.uint32)


def _pack_words(b: jax.Array) -> jax.Array:
    """uint32 ``[n, m]`` byte values (``m <= 4``) -> ``[n]`` words (byte j in bits 8j..8j+7;
    slots ``m..3`` hold ``E8M0_PAD``)."""
    pad = sum(fp8.E8M0_PAD << (8 * j) for j in range(b.shape[1], 4))
    words = jnp.sum(b << _shifts(*b.shape), axis=1)
    return words | jnp.uint32(pad) if pad else words


def _unpack_words(w: jax.Array, m: int = 4) -> jax.Array:
    """uint32 ``[n]`` words -> ``[n, m]`` byte values (uint32): the first ``m`` bytes."""
    return (w[:, None] >> _shifts(w.shape[0], m)) & jnp.uint32(0xFF)


def _block_quantize(x: jax.Array, width: int, block_size: int):
    """A row ``[1, width]`` as the FP8 wire encodes it: ``(e4m3 [nb, block_size], E8M0 byte
    int32 [nb])`` for its ``nb`` blocks (the bytes of ``moe.fp8.quantize``)."""
    xb = x.astype(jnp.float32).reshape(width // block_size, block_size)
    bits = lax.bitcast_convert_type(xb, jnp.int32) & jnp.int32(0x7FFFFFFF)
    byte, inv_scale = fp8.scales_from_amax_bits(jnp.max(bits, axis=1))
    q = jnp.clip(xb * inv_scale[:, None], -fp8.E4M3_MAX, fp8.E4M3_MAX)
    return q.astype(jnp.float8_e4m3fn), byte


def _store_row_quantized(q_ref, s_ref, r, y: jax.Array) -> None:
    """Row ``r`` of ``(q_ref, s_ref)``: f32 ``y [1, width]`` as e4m3 with one power-of-two
    scale (`accel_kernels.quant.triton.quantize_rows`' bytes)."""
    (q,), scale = quant_xla.scale_and_cast([y], quant_xla.row_amax_bits(y))
    _plgpu.store(q_ref.at[pl.ds(r, 1), pl.ds(0, y.shape[1])], q)
    _plgpu.store(s_ref.at[pl.ds(r, 1)], scale)


def _encode_kernel(idx_ref, x_ref, out_ref, *, n_src, width, block_size, fp8_wire):
    i = pl.program_id(0)
    src = idx_ref[i]
    ok = (src >= 0) & (src < n_src)
    x = _plgpu.load(x_ref.at[pl.ds(jnp.where(ok, src, 0), 1), pl.ds(0, width)])  # [1, H]
    if not fp8_wire:
        y = jnp.where(ok, x.astype(out_ref.dtype), jnp.zeros((), out_ref.dtype))
        _plgpu.store(out_ref.at[pl.ds(i, 1), pl.ds(0, width)], y)
        return
    y, byte = _block_quantize(x, width, block_size)
    y = lax.bitcast_convert_type(y, jnp.uint8).astype(jnp.uint32)
    words = _pack_words(y.reshape(width // 4, 4))
    nsw, per = _scale_word_shape(width, block_size)
    swords = _pack_words(byte.astype(jnp.uint32).reshape(nsw, per))
    zero = jnp.zeros((), jnp.uint32)
    _plgpu.store(out_ref.at[pl.ds(i, 1), pl.ds(0, width // 4)],
                 jnp.where(ok, words, zero).reshape(1, width // 4))
    _plgpu.store(out_ref.at[pl.ds(i, 1), pl.ds(width // 4, nsw)],
                 jnp.where(ok, swords, zero).reshape(1, nsw))


def _decoded_row(buf_ref, s, *, width, block_size) -> jax.Array:
    """f32 ``[1, width]``: FP8 wire row ``s`` of ``buf_ref`` decoded (NaN where its block's
    scale byte is ``E8M0_NAN``)."""
    nb = width // block_size
    nsw, per = _scale_word_shape(width, block_size)
    words = _plgpu.load(buf_ref.at[pl.ds(s, 1), pl.ds(0, width // 4)]).reshape(width // 4)
    swords = _plgpu.load(buf_ref.at[pl.ds(s, 1), pl.ds(width // 4, nsw)]).reshape(nsw)
    data = _unpack_words(words).astype(jnp.uint8)  # [H/4, 4]
    data = lax.bitcast_convert_type(data, jnp.float8_e4m3fn).astype(jnp.float32)
    byte = _unpack_words(swords, per).reshape(nb).astype(jnp.int32)  # padding never read
    return (data.reshape(nb, block_size) * fp8.scale_from_byte(byte)[:, None]).reshape(1, width)


def _decode_kernel(idx_ref, buf_ref, out_ref, *, n_src, width, block_size, fp8_wire):
    r = pl.program_id(0)
    src = idx_ref[r]
    ok = (src >= 0) & (src < n_src)
    s = jnp.where(ok, src, 0)
    if not fp8_wire:
        x = _plgpu.load(buf_ref.at[pl.ds(s, 1), pl.ds(0, width)])
        y = jnp.where(ok, x.astype(out_ref.dtype), jnp.zeros((), out_ref.dtype))
        _plgpu.store(out_ref.at[pl.ds(r, 1), pl.ds(0, width)], y)
        return
    y = _decoded_row(buf_ref, s, width=width, block_size=block_size)
    fmax = float(jnp.finfo(out_ref.dtype).max)
    y = jnp.clip(y, -fmax, fmax).astype(out_ref.dtype)
    _plgpu.store(out_ref.at[pl.ds(r, 1), pl.ds(0, width)],
                 jnp.where(ok, y, jnp.zeros((), out_ref.dtype)))


def _rows_kernel(idx_ref, buf_ref, q_ref, s_ref, *, n_src, width, block_size):
    r = pl.program_id(0)
    src = idx_ref[r]
    ok = (src >= 0) & (src < n_src)
    y = _decoded_row(buf_ref, jnp.where(ok, src, 0), width=width, block_size=block_size)
    # e4m3 bytes, not packed words: packed words would make this kernel's stores a little
    # faster, but XLA fuses their bitcast to e4m3 into the weight gradient's transpose of
    # these rows, which then costs far more than the stores save.
    _store_row_quantized(q_ref, s_ref, r, jnp.where(ok, y, jnp.float32(0)))


def _local_rows_kernel(idx_ref, x_ref, q_ref, s_ref, *, n_src, width, block_size):
    i = pl.program_id(0)
    src = idx_ref[i]
    ok = (src >= 0) & (src < n_src)
    x = _plgpu.load(x_ref.at[pl.ds(jnp.where(ok, src, 0), 1), pl.ds(0, width)])  # [1, H]
    # The wire's rounding (encode, then decode: e4m3 per block of block_size channels times
    # its E8M0 scale, exact in f32), kept in registers instead of written as words.
    qb, byte = _block_quantize(x, width, block_size)
    y = (qb.astype(jnp.float32) * fp8.scale_from_byte(byte)[:, None]).reshape(1, width)
    _store_row_quantized(q_ref, s_ref, i, jnp.where(ok, y, jnp.float32(0)))


def _weighted_rows_kernel(slot_ref, w_ref, x_ref, q_ref, s_ref, *, n_slots, top_k, width,
                          wire_dtype):
    r = pl.program_id(0)
    s = slot_ref[r]
    ok = (s >= 0) & (s < n_slots)
    s = jnp.where(ok, s, 0)
    x = _plgpu.load(x_ref.at[pl.ds(s // top_k, 1), pl.ds(0, width)]).astype(jnp.float32)
    # The bytes of the combine gradient's send row (f32 product rounded to the wire's dtype),
    # then quantized per row as the expert GEMMs read it.
    y = (w_ref[s].astype(jnp.float32) * x).astype(wire_dtype).astype(jnp.float32)
    _store_row_quantized(q_ref, s_ref, r, jnp.where(ok, y, jnp.float32(0)))


def _row_warps(width: int) -> int:
    """Warps of a one-row program that quantizes the row per block and per row: one warp up
    to 2048 channels, four above (the faster count at each width where both were timed)."""
    return 1 if width <= 2048 else 4


def _launch(kernel, index, operand, out_shape, out_dtype, *, name, interpret, extra=(),
            num_warps=4, **kw):
    """One program per output row; interpret mode where asked (the CPU tests). ``out_shape``
    and ``out_dtype`` may be tuples (several outputs); ``extra`` operands come between
    ``index`` and ``operand``."""
    several = isinstance(out_dtype, tuple)
    outs = tuple(zip(out_shape, out_dtype, strict=True)) if several else ((out_shape, out_dtype),)
    out = triton_gpu.launch(functools.partial(kernel, **kw), (index, *extra, operand), outs,
                            grid=outs[0][0][0], name=name, interpret=interpret,
                            num_warps=num_warps)
    return out if several else out[0]


def gather_encode(
    rows: jax.Array,
    index: jax.Array,
    *,
    fp8_wire: bool,
    block_size: int = 128,
    out_dtype=None,
    interpret: bool = False,
) -> jax.Array:
    """``out[i] = encode(rows[index[i]])``, zero where ``index[i]`` is outside ``[0, T)``.

    FP8: ``uint32[M, H/4 + ceil(H/(4 block_size))]``, the bytes of ``moe.fp8.quantize``
    packed as :func:`accel_kernels.wire.api.pack_fp8_words`. Otherwise ``rows`` cast to
    ``out_dtype``.

    Args:
      rows: float ``[T, H]``.
      index: int32 ``[M]``.
      fp8_wire: encode as FP8 (else copy, casting to ``out_dtype``).
      block_size: FP8 channels per scale.
      out_dtype: dtype of the copied rows (default ``rows.dtype``; ignored for FP8).
      interpret: run in Pallas interpret mode (any backend, slow).

    Returns:
      ``[M, wire width]``.

    Example:
      >>> x = jnp.ones((4, 512), jnp.bfloat16)
      >>> gather_encode(x, jnp.array([3, 9], jnp.int32), fp8_wire=True,
      ...               interpret=True).shape
      (2, 129)

    References:
      DeepEP FP8 dispatch (tokens quantized once, UE8M0 scales).
    """
    t, h = rows.shape
    m = index.shape[0]
    if fp8_wire:
        shape, dtype = (m, h // 4 + fp8.num_scale_words(h, block_size)), jnp.uint32
    else:
        shape, dtype = (m, h), jnp.dtype(out_dtype or rows.dtype)
    return _launch(_encode_kernel, index.astype(jnp.int32), rows, shape, dtype,
                   name="wire_gather_encode", interpret=interpret, n_src=t, width=h,
                   block_size=block_size, fp8_wire=fp8_wire)


def gather_decode(
    buf: jax.Array,
    index: jax.Array,
    *,
    width: int,
    fp8_wire: bool,
    block_size: int = 128,
    out_dtype=jnp.bfloat16,
    interpret: bool = False,
) -> jax.Array:
    """``out[r] = decode(buf[index[r]])``, zero where ``index[r]`` is outside ``[0, N)``.

    Args:
      buf: wire rows ``[N, wire width]`` (uint32 FP8 words, or float rows).
      index: int32 ``[R]``.
      width: logical row width ``H``.
      fp8_wire: ``buf`` holds FP8 words (else float rows, cast to ``out_dtype``).
      block_size: FP8 channels per scale.
      out_dtype: output dtype.
      interpret: run in Pallas interpret mode (any backend, slow).

    Returns:
      ``out_dtype[R, H]``.

    Example:
      >>> b = gather_encode(jnp.ones((4, 512)), jnp.arange(4, dtype=jnp.int32),
      ...                   fp8_wire=True, interpret=True)
      >>> float(gather_decode(b, jnp.array([0, 7], jnp.int32), width=512, fp8_wire=True,
      ...                     interpret=True).astype(jnp.float32).sum())
      512.0

    References:
      DeepEP UE8M0 scale layout.
    """
    n = buf.shape[0]
    return _launch(_decode_kernel, index.astype(jnp.int32), buf, (index.shape[0], width),
                   jnp.dtype(out_dtype), name="wire_gather_decode", interpret=interpret,
                   n_src=n, width=width, block_size=block_size, fp8_wire=fp8_wire)


def gather_rows_quantized(
    buf: jax.Array,
    index: jax.Array,
    *,
    width: int,
    block_size: int = 128,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``rows(decode(buf[index[r]]))``: FP8 wire rows, gathered and re-quantized per row.

    Each gathered row is decoded to f32 (exact: e4m3 times a power of two) and quantized with
    one power-of-two scale per row, the bytes of
    ``accel_kernels.quant.xla.quantize_rows_reference(decode_rows(...))``; out-of-range ``index``
    entries give zero rows. One read of the one-byte wire row, one write of the e4m3 row.

    Args:
      buf: FP8 wire rows ``uint32[N, width / 4 + W]`` (:func:`gather_encode`).
      index: int32 ``[R]``.
      width: logical row width ``H``.
      block_size: FP8 channels per wire scale.
      interpret: run in Pallas interpret mode (any backend, slow).

    Returns:
      ``(e4m3 [R, H], f32 scale [R])``; a row holding NaN or inf gets a NaN scale.

    Example:
      >>> b = gather_encode(jnp.ones((4, 512)), jnp.arange(4, dtype=jnp.int32),
      ...                   fp8_wire=True, interpret=True)
      >>> q, s = gather_rows_quantized(b, jnp.array([1, 9], jnp.int32), width=512,
      ...                              interpret=True)
      >>> q.dtype, s.tolist() == [2.0**-8, 2.0**-126]  # out of range: a zero row
      (dtype(float8_e4m3fn), True)

    References:
      torchao float8 "rowwise" scaling; DeepEP UE8M0 scale layout.
    """
    r = index.shape[0]
    return _launch(_rows_kernel, index.astype(jnp.int32), buf, ((r, width), (r,)),
                   (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)),
                   name="wire_gather_rows_fp8", interpret=interpret, n_src=buf.shape[0],
                   width=width, block_size=block_size)


def gather_local_rows_quantized(
    rows: jax.Array,
    index: jax.Array,
    *,
    block_size: int = 128,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``rows(decode(encode(rows[index[i]])))``: FP8 dispatch where nothing is sent.

    With one device on the expert axis the FP8 wire rows would be written and read back by
    the same device. This pass gives the expert GEMM's e4m3 rows that
    :func:`gather_rows_quantized` would make from them (the same bytes: each gathered row is
    rounded as the wire rounds it, e4m3 per ``block_size`` channels with an E8M0 scale, then
    quantized with one power-of-two scale per row) without writing the wire: one read of the
    token row, one write of the e4m3 row. Out-of-range ``index`` entries give zero rows.

    Args:
      rows: float tokens ``[T, H]``.
      index: int32 ``[R]``, the token of each output row.
      block_size: FP8 channels per wire scale.
      interpret: run in Pallas interpret mode (any backend, slow).

    Returns:
      ``(e4m3 [R, H], f32 scale [R])``; a row holding NaN or inf gets a NaN scale.

    Example:
      >>> q, s = gather_local_rows_quantized(jnp.ones((4, 512)), jnp.array([1, 9], jnp.int32),
      ...                                    interpret=True)
      >>> q.dtype, s.tolist() == [2.0**-8, 2.0**-126]  # out of range: a zero row
      (dtype(float8_e4m3fn), True)

    References:
      DeepEP FP8 dispatch (UE8M0 block scales); torchao float8 "rowwise" scaling.
    """
    t, h = rows.shape
    r = index.shape[0]
    return _launch(_local_rows_kernel, index.astype(jnp.int32), rows, ((r, h), (r,)),
                   (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)),
                   name="wire_local_rows_fp8", interpret=interpret, n_src=t, width=h,
                   block_size=block_size, num_warps=_row_warps(h))


def gather_weighted_rows_quantized(
    rows: jax.Array,
    weights: jax.Array,
    slot: jax.Array,
    *,
    top_k: int,
    wire_dtype=jnp.bfloat16,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``rows(wire_dtype(weights[s] * rows[s // top_k]))`` per output row, ``s = slot[i]``.

    The combine's gradient in the expert layout when nothing is sent (one device on the expert
    axis), as the FP8 expert GEMMs read it: each row is the weighted token gradient the
    combine's backward would send (`accel_kernels.wire.api.gather_weighted_rows`, a float wire of
    ``wire_dtype``), quantized with one power-of-two scale per row, in one pass with no
    ``[R, H]`` copy written. Slots outside ``[0, weights.size)`` give zero rows.

    Args:
      rows: float ``[T, H]``, the token gradients.
      weights: float ``[S]`` (``S = T * top_k``), one per slot.
      slot: int32 ``[R]``, the slot of each output row.
      top_k: slots per token.
      wire_dtype: the float dtype the gradient rows are rounded to.
      interpret: run in Pallas interpret mode (any backend, slow).

    Returns:
      ``(e4m3 [R, H], f32 scale [R])``.

    Example:
      >>> q, s = gather_weighted_rows_quantized(
      ...     jnp.ones((2, 256)), jnp.array([0.5, 0.25, 1.0, 2.0]),
      ...     jnp.array([1, 3, 4], jnp.int32), top_k=2, interpret=True)
      >>> s.tolist() == [2.0**-10, 2.0**-7, 2.0**-126]  # the last slot: out of range
      True

    References:
      torchao float8 "rowwise" scaling.
    """
    t, h = rows.shape
    r = slot.shape[0]
    return _launch(_weighted_rows_kernel, slot.astype(jnp.int32), rows, ((r, h), (r,)),
                   (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)),
                   name="wire_weighted_rows_fp8", interpret=interpret, extra=(weights,),
                   n_slots=weights.shape[0], top_k=top_k, width=h,
                   wire_dtype=jnp.dtype(wire_dtype), num_warps=_row_warps(h))
