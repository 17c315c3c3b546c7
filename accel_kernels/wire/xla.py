"""The wire codec and the row gathers around the exchanges, in XLA: the reference the wire
kernels (`accel_kernels.wire.triton`, `accel_kernels.wire.mosaic`) give the same bytes as, and
what runs where no kernel does.

Rows are sent either as-is (any float dtype) or as FP8, i.e. the e4m3 bytes of
:func:`moe.fp8.quantize` followed by its packed E8M0 scale words, fused into one row of
``(H + H // block_size) / 4`` uint32 words (one collective instead of two; 32-bit words so
the gathers, transposes and copies around the exchange move 4 bytes per element, not 1).

References: DeepEP (FP8 dispatch with UE8M0 scales).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from accel_kernels import fp8


def pack_fp8_words(q: fp8.Fp8Array) -> jax.Array:
    """The FP8 wire row of an :class:`moe.fp8.Fp8Array` ``[N, H]``: ``uint32[N, H/4 + W]``.

    Word ``j < H/4`` holds e4m3 bytes ``4j .. 4j+3`` (little-endian, byte ``4j`` lowest); the
    last ``W = ceil(H / (4 * block_size))`` words (:func:`moe.fp8.num_scale_words`) are the
    packed E8M0 scale words, whose slots past the last block hold :data:`moe.fp8.E8M0_PAD`.
    As bytes, the row is ``bytes(e4m3 data) ++ bytes(int32 scales)``: the same bytes as a
    uint8 row, typed as 32-bit words so that XLA moves them 4 bytes per element.

    Args:
      q: FP8 rows ``[N, H]`` (scales ``[N, W]``).

    Returns:
      uint32 ``[N, H // 4 + W]``.

    Example:
      >>> q = fp8.quantize(jnp.ones((2, 512)), 128)
      >>> pack_fp8_words(q).shape
      (2, 129)
      >>> pack_fp8_words(fp8.quantize(jnp.ones((2, 768)), 128)).shape  # 6 blocks: 2 words
      (2, 194)

    References:
      DeepEP UE8M0 scale layout (four scale bytes per int32 word).
    """
    lead, h = q.data.shape[:-1], q.data.shape[-1]
    data = jax.lax.bitcast_convert_type(q.data.reshape(*lead, h // 4, 4), jnp.uint32)
    scales = jax.lax.bitcast_convert_type(q.scales, jnp.uint32)
    return jnp.concatenate([data, scales], axis=-1)


def unpack_fp8_words(buf: jax.Array, width: int, block_size: int) -> fp8.Fp8Array:
    """Invert :func:`pack_fp8_words` on ``buf [..., width / 4 + W]``: an ``Fp8Array
    [..., width]`` (the padding slots of the last scale word are carried, never read).

    Args:
      buf: uint32 wire rows (possibly exchanged / reshaped on leading axes).
      width: logical row width ``H`` (a multiple of ``block_size``).
      block_size: FP8 channels per scale.

    Returns:
      The :class:`moe.fp8.Fp8Array`.

    Example:
      >>> q = fp8.quantize(jnp.ones((2, 512)), 128)
      >>> unpack_fp8_words(pack_fp8_words(q), 512, 128).data.shape
      (2, 512)

    References:
      DeepEP UE8M0 scale layout.
    """
    fp8.check_width(width, block_size, what="width")
    lead, nw = buf.shape[:-1], width // 4
    if buf.shape[-1] != nw + fp8.num_scale_words(width, block_size):
        raise ValueError(
            f"buf.shape[-1] = {buf.shape[-1]} is not the FP8 wire width of {width} channels "
            f"in blocks of {block_size} ({nw + fp8.num_scale_words(width, block_size)} words); "
            "pass the width and block_size the rows were encoded with."
        )
    data = jax.lax.bitcast_convert_type(buf[..., :nw], jnp.float8_e4m3fn)  # [..., H/4, 4]
    scales = jax.lax.bitcast_convert_type(buf[..., nw:], jnp.int32)
    return fp8.Fp8Array(data=data.reshape(*lead, width), scales=scales, block_size=block_size)


def encode_rows(
    rows: jax.Array, *, wire: Literal["fp8"] | jnp.dtype, block_size: int
) -> jax.Array:
    """Encode rows ``[N, H]`` for the wire: a dtype cast, or fused FP8 bytes + E8M0 scales.

    FP8: ``uint32[N, H / 4 + ceil(H / (4 * block_size))]`` holding ``bytes(e4m3(x / scale))
    ++ bytes(int32 scales)`` (:func:`pack_fp8_words`).

    Args:
      rows: float array ``[N, H]``.
      wire: ``'fp8'`` or a float dtype to cast to.
      block_size: FP8 channels per scale (``H`` must be a multiple of ``block_size``).

    Returns:
      The wire buffer (zero rows decode to zero rows).

    Example:
      >>> encode_rows(jnp.ones((2, 512)), wire="fp8", block_size=128).shape
      (2, 129)

    References:
      DeepEP FP8 dispatch (e4m3 payload + UE8M0 scales).
    """
    if isinstance(wire, str):
        return pack_fp8_words(fp8.quantize(rows, block_size))
    return rows.astype(wire)


def gather_rows(
    rows: jax.Array, index: jax.Array, *, wire: Literal["fp8"] | jnp.dtype, block_size: int
) -> jax.Array:
    """Send buffer ``out[i] = encode(rows[index[i]])`` (a zero row where ``index[i]`` is out of
    range), in XLA: the rows are encoded ONCE (``N`` rows of ``rows``, however often each is
    sent), then their wire words are gathered (for FP8: e4m3 + scale bytes, half the bytes of
    bf16).

    Example:
      >>> gather_rows(jnp.ones((2, 512)), jnp.array([1, 2, 0]), wire="fp8",
      ...             block_size=128).shape
      (3, 129)
    """
    buf = encode_rows(rows, wire=wire, block_size=block_size)
    return jnp.take(buf, index, axis=0, mode="fill", fill_value=0)


def gather_weighted_rows(
    rows: jax.Array,
    weights: jax.Array,
    slot: jax.Array,
    *,
    top_k: int,
    wire: Literal["fp8"] | jnp.dtype,
    block_size: int,
) -> jax.Array:
    """Send buffer ``out[i] = encode(weights[s] * rows[s // top_k])`` with ``s = slot[i]`` (f32
    product; a zero row where ``s >= weights.size``): what :func:`gather_rows` of the ``[S, H]``
    weighted rows gives, bit for bit, without building them.

    FP8: the block maxima of ``rows`` are taken once per row ``t`` (``T`` rows, not ``S``) and
    scaled by ``|weights[s]|`` (exact: rounding is monotone, :func:`moe.fp8.quantize_with_amax`),
    so the weighting, quantization and gather run as one elementwise pass over the ``M`` send
    rows with no ``[S, H]`` intermediate.

    Args:
      rows: float ``[T, H]``.
      weights: float ``[S]`` (``S = T * top_k``), one per slot.
      slot: int ``[M]``, the slot of each send row (``>= S``: padding).
      top_k: slots per row ``k``.
      wire, block_size: as :func:`encode_rows`.

    Returns:
      The wire buffer ``[M, wire_width]``.

    Example:
      >>> gather_weighted_rows(jnp.ones((2, 512)), jnp.ones(4), jnp.array([3, 4]), top_k=2,
      ...                      wire="fp8", block_size=128).shape
      (2, 129)

    References:
      DeepEP FP8 dispatch; combine's gradient travels in the dispatch direction.
    """
    s = weights.shape[0]
    slot = slot.astype(jnp.int32)
    tok = jax.lax.div(slot, jnp.int32(top_k))  # slots are >= 0: no floor-division fixups
    r = jnp.take(rows, tok, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    w = jnp.take(weights.astype(jnp.float32), slot, mode="fill", fill_value=0)
    x = w[:, None] * r
    if not isinstance(wire, str):
        return x.astype(wire)
    amax = jnp.take(fp8.block_amax(rows, block_size), tok, axis=0, mode="fill", fill_value=0)
    q = fp8.quantize_with_amax(x, jnp.abs(w)[:, None] * amax, block_size)
    buf = pack_fp8_words(q)
    return jnp.where((slot < s)[:, None], buf, jnp.zeros((), jnp.uint32))  # padding: 0 bytes


def decode_rows(
    buf: jax.Array,
    *,
    wire: Literal["fp8"] | jnp.dtype,
    width: int,
    block_size: int,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """Invert :func:`encode_rows` on ``buf [..., wire_width]``, returning ``[..., width]``.

    Args:
      buf: wire buffer from :func:`encode_rows` (possibly exchanged / reshaped on leading axes).
      wire: the ``wire`` given to :func:`encode_rows`.
      width: logical row width ``H``.
      block_size: the ``block_size`` given to :func:`encode_rows` (FP8 only).
      out_dtype: dtype of the decoded rows.

    Returns:
      ``out_dtype[..., H]``.

    Example:
      >>> b = encode_rows(jnp.ones((2, 512)), wire="fp8", block_size=128)
      >>> float(decode_rows(b, wire="fp8", width=512, block_size=128,
      ...                   out_dtype=jnp.float32).sum())
      1024.0

    References:
      DeepEP UE8M0 scale layout (four scale bytes per int32 word).
    """
    if isinstance(wire, str):
        return fp8.dequantize(unpack_fp8_words(buf, width, block_size), out_dtype)
    return buf.astype(out_dtype)
