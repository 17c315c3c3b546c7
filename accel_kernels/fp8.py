"""FP8 (e4m3) block quantization with E8M0 scales packed four to an int32 word.

This is the wire format of expert-parallel dispatch (docs/architecture.md): per row
(the last axis, H channels), blocks of ``block_size`` channels share one power-of-two scale
``2^e``; the data is ``e4m3(x / 2^e)`` and the scale travels as its E8M0 byte ``e + 127``.
Four consecutive scale bytes are packed little-endian into one int32 word (block ``4w+j`` in
byte ``j`` of word ``w``), as DeepEP's UE8M0 layout.

Scales are computed from the bits of the float32 block maximum with integer arithmetic only
(no ``log2``, no rounding cast), so every backend produces the same bytes.

Gradients: :func:`quantize` is not differentiable (rounding to e4m3 and choosing a scale have
no useful derivative), and differentiating through it raises a ``TypeError``. Callers that
send FP8 over the wire define the backward pass themselves with ``jax.custom_vjp`` (e.g. the
cotangent travels back quantized, or in bf16). :func:`dequantize` is an ordinary array
function of ``q.data``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

__all__ = [
    "E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_PAD",
    "E8M0_NAN",
    "Fp8Array",
    "quantize",
    "quantize_with_amax",
    "block_amax",
    "block_scales",
    "scale_from_byte",
    "dequantize",
    "pack_e8m0",
    "unpack_e8m0",
    "scale_exponents",
    "wire_nbytes",
]

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn magnitude; quantized data saturates here."""
E8M0_BIAS = 127
"""E8M0 byte ``b`` encodes the scale ``2^(b - 127)``."""
E8M0_NAN = 0xFF
"""E8M0 NaN byte; produced only for blocks that contain a NaN or an infinity."""
E8M0_PAD = 0
"""E8M0 byte in the unused slots of the last scale word (when the blocks per row are not a
multiple of four); ignored when dequantizing."""

_F32_EXP_MASK = 0x7F800000
_F32_ABS_MASK = 0x7FFFFFFF
_F32_MANT_MASK = 0x007FFFFF
# 448 = 1.75 * 2^8: a float32 m * 2^E (1 <= m < 2) satisfies
# ceil(log2(m * 2^E / 448)) = E - 8 + (m > 1.75), and m > 1.75 <=> mantissa field > 0x600000.
_E4M3_MAX_EXP = 8
_E4M3_MAX_MANT = 0x600000
# Smallest and largest bytes quantize produces for finite input. Byte 1 (2^-126) is the
# smallest scale that is a normal float32, so neither the scale nor its inverse is a denormal
# that a flush-to-zero backend would turn into 0 (equivalently: amax is floored at
# 448 * 2^-126). The largest float32 (< 2^128) needs at most 2^120, byte 247.
_MIN_BYTE = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Array:
    """An FP8 block-quantized tensor: e4m3 payload plus packed E8M0 block scales.

    A registered pytree whose two leaves are ``data`` and ``scales``, so ``jax.tree.map`` can
    build matching ``PartitionSpec`` trees and custom VJPs can return cotangents of the same
    structure. No validation runs on construction (leaves may be specs, tracers or ``None``).

    Attributes:
      data: float8_e4m3fn ``[..., H]``, ``x / scale`` saturated to +-448.
      scales: int32 ``[..., ceil(H / (4 * block_size))]``; word ``w`` holds the E8M0 bytes of
        blocks ``4w .. 4w+3`` (block ``4w+j`` in byte ``j``, little-endian); slots past the
        last block hold :data:`E8M0_PAD`.
      block_size: channels per scale (static). ``None`` (an array built from leaves alone):
        ``H // (4 * scales.shape[-1])``, exact when the blocks fill every word.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from moe import quantize
      >>> q = quantize(jnp.ones((2, 512)))
      >>> q.shape, q.block_size, [leaf.dtype.name for leaf in jax.tree.leaves(q)]
      ((2, 512), 128, ['float8_e4m3fn', 'int32'])
    """

    data: jax.Array
    scales: jax.Array
    block_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        if self.block_size is None and hasattr(self.data, "shape") \
                and hasattr(self.scales, "shape") and self.scales.shape[-1]:
            object.__setattr__(
                self, "block_size", self.data.shape[-1] // (4 * self.scales.shape[-1]))

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the logical (dequantized) tensor."""
        return tuple(self.data.shape)


def _check_quantize_args(x: jax.Array, block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(
            f"block_size must be a Python int, got {type(block_size).__name__}; pass e.g. "
            "block_size=128."
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}; use e.g. 128.")
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits > 32:
        raise TypeError(
            f"x must be a float16/bfloat16/float32 array, got dtype {x.dtype}; cast x to "
            "float32 or bfloat16 before quantizing."
        )
    if x.ndim < 1:
        raise ValueError("x must have at least one axis (the channel axis H), got a scalar.")
    check_width(x.shape[-1], block_size, what="x.shape[-1]")


def num_scale_words(width: int, block_size: int) -> int:
    """int32 scale words per row of ``width`` channels: ``ceil(width / block_size / 4)``.

    Example:
      >>> num_scale_words(512, 128), num_scale_words(640, 128)
      (1, 2)
    """
    return -(-(width // block_size) // 4)


def check_width(width: int, block_size: int, *, what: str) -> None:
    """ValueError naming ``what`` unless ``width`` is a positive multiple of ``block_size``.

    Every FP8 feature axis of the library (wire rows, GEMM operands, saved ``z``) obeys this
    one rule; the last int32 scale word is padded when the blocks do not fill it.

    Example:
      >>> check_width(384, 128, what="d_model")  # passes
      >>> check_width(100, 128, what="d_model")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: d_model = 100 must be a positive multiple of the FP8 block size 128; ...
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
            or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}; use 128.")
    if width <= 0 or width % block_size:
        raise ValueError(
            f"{what} = {width} must be a positive multiple of the FP8 block size "
            f"{block_size}; pad it to a multiple of {block_size}, or choose a block size "
            f"dividing {width}."
        )


def _block_amax_bits(x: jax.Array, block_size: int) -> jax.Array:
    """int32 bits of max |x| per block (integer order = magnitude order; NaN > inf > finite)."""
    lead, h = x.shape[:-1], x.shape[-1]
    xb = x.astype(jnp.float32).reshape(*lead, h // block_size, block_size)
    abs_bits = jax.lax.bitcast_convert_type(xb, jnp.int32) & _F32_ABS_MASK
    return jnp.max(abs_bits, axis=-1)


def scales_from_amax_bits(amax_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Block scales from the int32 bits of ``|amax|``: ``(E8M0 byte as int32, 1 / scale)``.

    Integer arithmetic only (also used inside the Pallas wire kernels, so both produce the
    same bytes). A NaN/inf block gets byte 0xFF and ``1 / scale = 1``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> amax = jnp.array([448.0, 3.0, jnp.inf])
      >>> byte, inv_scale = scales_from_amax_bits(jax.lax.bitcast_convert_type(amax, jnp.int32))
      >>> byte.tolist(), inv_scale.tolist()  # 448 = e4m3 max: scale 1; 3 -> 2^-7
      ([127, 120, 255], [1.0, 128.0, 1.0])
    """
    nonfinite = amax_bits >= _F32_EXP_MASK
    exp_field = amax_bits >> 23  # biased float32 exponent; 0 for zeros and denormals
    mant = amax_bits & _F32_MANT_MASK
    byte = exp_field - _E4M3_MAX_EXP + (mant > _E4M3_MAX_MANT).astype(jnp.int32)
    byte = jnp.maximum(byte, _MIN_BYTE)
    # 1/scale = 2^-(byte-127): biased float32 exponent 254 - byte, always normal here.
    inv_exp = jnp.where(nonfinite, E8M0_BIAS, 2 * E8M0_BIAS - byte)
    inv_scale = jax.lax.bitcast_convert_type(inv_exp << 23, jnp.float32)
    return jnp.where(nonfinite, E8M0_NAN, byte), inv_scale


def _quantize_from_amax_bits(x: jax.Array, amax_bits: jax.Array, block_size: int) -> Fp8Array:
    lead, h = x.shape[:-1], x.shape[-1]
    xb = x.astype(jnp.float32).reshape(*lead, h // block_size, block_size)
    byte, inv_scale = scales_from_amax_bits(amax_bits)
    y = jnp.clip(xb * inv_scale[..., None], -E4M3_MAX, E4M3_MAX)  # exact power-of-2 multiply
    data = y.astype(jnp.float8_e4m3fn).reshape(x.shape)
    pad = (-byte.shape[-1]) % 4
    if pad:
        byte = jnp.pad(byte, [(0, 0)] * (byte.ndim - 1) + [(0, pad)],
                       constant_values=E8M0_PAD)
    return Fp8Array(data=data, scales=pack_e8m0(byte.astype(jnp.uint8)),
                    block_size=block_size)


def _quantize_impl(x: jax.Array, block_size: int) -> Fp8Array:
    return _quantize_from_amax_bits(x, _block_amax_bits(x, block_size), block_size)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _quantize(x: jax.Array, block_size: int) -> Fp8Array:
    return _quantize_impl(x, block_size)


def _raising_jvp(message: str):
    """A ``custom_jvp`` rule that raises ``TypeError(message)``: for a function with no useful
    derivative."""

    def jvp(*_):
        raise TypeError(message)

    return jvp


_quantize.defjvp(_raising_jvp(
    "moe.fp8.quantize is not differentiable (e4m3 rounding and scale choice have no "
    "useful derivative). Wrap the FP8 path in jax.custom_vjp and define its backward "
    "pass (e.g. send the cotangent back in bf16 or quantize it too), or apply "
    "jax.lax.stop_gradient to x if no gradient is wanted."
))


def quantize(x: ArrayLike, block_size: int = 128) -> Fp8Array:
    """Quantize ``x`` to e4m3 with one power-of-two scale per block of the last axis.

    For each row and block ``b`` of ``block_size`` channels::

        amax  = max(|x_b|, 448 * 2^-126)
        scale = 2^ceil(log2(amax / 448))              (E8M0 byte: log2(scale) + 127)
        data  = e4m3(clip(x_b / scale, -448, 448))    (round to nearest even)

    The byte is computed from the float32 bits of ``amax`` (``E - 8 + (mantissa > 1.75)``),
    so it is exact. Zeros and denormals get the smallest scale 2^-126; finite input never
    produces byte 0xFF. A block holding a NaN or an infinity gets byte 0xFF (E8M0 NaN), so
    the whole block dequantizes to NaN. Works under ``jit``, ``vmap`` and ``shard_map`` and
    on any leading shape. Not differentiable: differentiating through it raises
    ``TypeError``; define the backward pass with ``jax.custom_vjp``.

    Args:
      x: float32/bfloat16/float16 array ``[..., H]`` with ``H`` a multiple of ``block_size``.
      block_size: channels per scale (static Python int).

    Returns:
      An :class:`Fp8Array` with ``data`` float8_e4m3fn ``[..., H]`` and ``scales`` int32
      ``[..., ceil(H / (4 * block_size))]`` (unused byte slots of the last word:
      :data:`E8M0_PAD`).

    Raises:
      ValueError: ``H`` is not a positive multiple of ``block_size``, or ``block_size`` is
        not positive.
      TypeError: ``x`` is not a float array of at most 32 bits, or ``block_size`` not an int.

    Example:
      >>> import jax.numpy as jnp
      >>> q = quantize(jnp.ones((2, 512)) * 3.0)
      >>> q.data.dtype, q.scales.shape, q.scales.dtype
      (dtype(float8_e4m3fn), (2, 1), dtype('int32'))
      >>> [int(b) for b in unpack_e8m0(q.scales)[0]]  # 2^ceil(log2(3/448)) = 2^-7
      [120, 120, 120, 120]
      >>> float(dequantize(q, jnp.float32)[0, 0])
      3.0

    References:
      DeepEP UE8M0 scale layout (github.com/deepseek-ai/DeepEP); OCP Microscaling Formats
      (MX) v1.0 specification (E8M0 scales); DeepSeek-V3 technical report (fine-grained FP8).
    """
    x = jnp.asarray(x)
    _check_quantize_args(x, block_size)
    return _quantize(x, int(block_size))


def block_amax(x: ArrayLike, block_size: int = 128) -> jax.Array:
    """Per-row block maxima of ``|x|`` in float32: the ``amax`` that :func:`quantize` uses.

    Computed on the float32 bits, so a block holding a NaN reports NaN (and an infinity,
    inf). Not differentiable in any useful sense (a max of magnitudes); meant as the input of
    :func:`quantize_with_amax`.

    Args:
      x: float32/bfloat16/float16 array ``[..., H]`` with ``H`` a multiple of ``block_size``.
      block_size: channels per block (static Python int).

    Returns:
      float32 ``[..., H // block_size]``.

    Example:
      >>> import jax.numpy as jnp
      >>> block_amax(jnp.arange(512.0).reshape(1, 512)).tolist()
      [[127.0, 255.0, 383.0, 511.0]]

    References:
      DeepEP / DeepSeek-V3 fine-grained FP8 (per-block amax scaling).
    """
    x = jnp.asarray(x)
    _check_quantize_args(x, block_size)
    bits = _block_amax_bits(jax.lax.stop_gradient(x), int(block_size))
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _quantize_amax(x: jax.Array, amax: jax.Array, block_size: int) -> Fp8Array:
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32) & _F32_ABS_MASK
    return _quantize_from_amax_bits(x, bits, block_size)


_quantize_amax.defjvp(_raising_jvp(
    "moe.fp8.quantize_with_amax is not differentiable; define the backward pass with "
    "jax.custom_vjp (see moe.fp8.quantize)."
))


def quantize_with_amax(x: ArrayLike, amax: ArrayLike, block_size: int = 128) -> Fp8Array:
    """:func:`quantize` with the block maxima supplied: the same bytes when ``amax`` equals
    :func:`block_amax` of ``x``, without the reduction over ``x``.

    Useful when ``amax`` is cheaper to get elsewhere. The case it exists for: rows scaled by a
    per-row factor, ``x = c[:, None] * y`` (float32 multiply). Rounding is monotone, so
    ``block_amax(c * y) == |c| * block_amax(y)`` exactly (NaN and overflow blocks included),
    and the maxima of ``y`` can be taken once and reused for many factors ``c`` (e.g. the
    ``k`` router weights of a token). ``amax`` is read through its float32 bits (sign
    ignored); only its value per block matters, not how it was computed.

    Args:
      x: float32/bfloat16/float16 array ``[..., H]`` with ``H`` a multiple of ``block_size``.
      amax: float array ``[..., H // block_size]`` (``x``'s leading shape), the block maxima
        of ``|x|``.
      block_size: channels per scale (static Python int).

    Returns:
      An :class:`Fp8Array`, as :func:`quantize`.

    Raises:
      ValueError / TypeError: as :func:`quantize`, or ``amax`` of the wrong shape.

    Example:
      >>> import jax.numpy as jnp
      >>> y = jnp.linspace(-3.0, 5.0, 1024).reshape(2, 512)
      >>> c = jnp.array([[0.5], [-2.0]])
      >>> q = quantize_with_amax(c * y, jnp.abs(c) * block_amax(y))
      >>> bool(jnp.all(q.scales == quantize(c * y).scales))
      True

    References:
      DeepEP UE8M0 layout; DeepSeek-V3 fine-grained FP8 quantization.
    """
    x, amax = jnp.asarray(x), jnp.asarray(amax)
    _check_quantize_args(x, block_size)
    want = x.shape[:-1] + (x.shape[-1] // block_size,)
    if amax.shape != want or not jnp.issubdtype(amax.dtype, jnp.floating):
        raise ValueError(
            f"amax must be a float array of shape {want} (x's leading axes, one value per "
            f"block of {block_size}), got shape {amax.shape} dtype {amax.dtype}; compute it "
            "with moe.fp8.block_amax."
        )
    return _quantize_amax(x, amax, int(block_size))


def dequantize(q: Fp8Array, dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
    """Reconstruct ``data * scale`` per block, saturating to ``dtype``'s finite range.

    ``y = clip(float32(data) * 2^(byte - 127), -max(dtype), max(dtype))``; a block with scale
    byte 0xFF (NaN or infinity in the input) is all NaN.

    Args:
      q: an :class:`Fp8Array` from :func:`quantize`.
      dtype: floating output dtype (default bfloat16).

    Returns:
      Array of ``q.shape`` and ``dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.linspace(-1.0, 1.0, 512).reshape(1, 512)
      >>> y = dequantize(quantize(x), jnp.float32)
      >>> bool(jnp.max(jnp.abs(y - x)) < 0.07)
      True

    References:
      OCP Microscaling Formats (MX) v1.0 specification; DeepEP UE8M0 scale layout.
    """
    if not isinstance(q, Fp8Array):
        raise TypeError(f"q must be an Fp8Array from moe.fp8.quantize, got {type(q).__name__}.")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype}; use e.g. jnp.bfloat16.")
    data, h, bs = q.data, q.data.shape[-1], q.block_size
    nwords = q.scales.shape[-1]
    if not bs or h % bs or nwords != num_scale_words(h, bs) \
            or q.scales.shape[:-1] != data.shape[:-1]:
        raise ValueError(
            f"q.scales shape {q.scales.shape} does not match q.data shape {data.shape} with "
            f"block_size {bs}: expected [..., ceil(H / (4 * block_size))] with the same leading "
            "axes; build q with quantize."
        )
    nblocks = h // bs
    scale = block_scales(q)
    y = data.astype(jnp.float32).reshape(*data.shape[:-1], nblocks, h // nblocks)
    y = y * scale[..., None]
    fmax = float(jnp.finfo(dtype).max)
    y = jnp.clip(y, -fmax, fmax)  # keeps NaN; stops 2^128 rounding to inf
    return y.reshape(data.shape).astype(dtype)


def block_scales(q: Fp8Array) -> jax.Array:
    """The scale of every block as float32: ``2^(byte - 127)`` (NaN for byte 0xFF).

    ``x ~= data * scale`` per block; scales are exact powers of two, so multiplying a product
    of FP8 payloads by them is exact (barring overflow).

    Args:
      q: an :class:`Fp8Array`.

    Returns:
      float32 ``[..., H // block_size]``.

    Example:
      >>> import jax.numpy as jnp
      >>> block_scales(quantize(jnp.full((1, 512), 3.0))).tolist()
      [[0.0078125, 0.0078125, 0.0078125, 0.0078125]]

    References:
      OCP Microscaling Formats (MX) v1.0 specification (E8M0 scales).
    """
    nblocks = q.data.shape[-1] // q.block_size
    return scale_from_byte(unpack_e8m0(q.scales).astype(jnp.int32)[..., :nblocks])


def scale_from_byte(byte: jax.Array) -> jax.Array:
    """The f32 scale ``2^(byte - 127)`` of E8M0 bytes (int32), NaN for the NaN byte 0xFF.

    Bit arithmetic only, so the Pallas kernels use it too.

    Args:
      byte: int32 E8M0 bytes (0..255), e.g. from :func:`scales_from_amax_bits`.

    Returns:
      float32 of ``byte``'s shape.

    Example:
      >>> import jax.numpy as jnp
      >>> scale_from_byte(jnp.array([127, 120, 255])).tolist()
      [1.0, 0.0078125, nan]
    """
    scale = jax.lax.bitcast_convert_type(byte << 23, jnp.float32)
    return jnp.where(byte == E8M0_NAN, jnp.float32(jnp.nan), scale)


def pack_e8m0(scale_bytes: ArrayLike) -> jax.Array:
    """Pack E8M0 bytes four to an int32 word, little-endian.

    ``word[..., w] = b[4w] | b[4w+1] << 8 | b[4w+2] << 16 | b[4w+3] << 24`` (as int32 bits).

    Args:
      scale_bytes: uint8 array ``[..., 4n]``.

    Returns:
      int32 array ``[..., n]``.

    Example:
      >>> import jax.numpy as jnp
      >>> hex(int(pack_e8m0(jnp.array([1, 2, 3, 4], jnp.uint8))[0]))
      '0x4030201'

    References:
      DeepEP UE8M0 scale layout (four UE8M0 scales per int32).
    """
    b = jnp.asarray(scale_bytes)
    if b.dtype != jnp.uint8:
        raise TypeError(
            f"scale_bytes must be uint8 E8M0 bytes, got dtype {b.dtype}; cast with "
            ".astype(jnp.uint8) or view float8_e8m0fnu as uint8."
        )
    if b.ndim < 1 or b.shape[-1] % 4 != 0:
        raise ValueError(
            f"scale_bytes.shape[-1] must be a multiple of 4, got shape {b.shape}; pad the "
            "number of blocks to a multiple of 4."
        )
    w = b.astype(jnp.uint32).reshape(*b.shape[:-1], b.shape[-1] // 4, 4)
    shifts = jnp.arange(4, dtype=jnp.uint32) * 8
    word = jnp.sum(w << shifts, axis=-1, dtype=jnp.uint32)  # disjoint bits: sum == or
    return jax.lax.bitcast_convert_type(word, jnp.int32)


def unpack_e8m0(words: ArrayLike) -> jax.Array:
    """Unpack int32 words into their four little-endian E8M0 bytes (inverse of ``pack_e8m0``).

    ``b[..., 4w+j] = (word[..., w] >> 8j) & 0xFF``.

    Args:
      words: int32 array ``[..., n]``.

    Returns:
      uint8 array ``[..., 4n]``.

    Example:
      >>> import jax.numpy as jnp
      >>> unpack_e8m0(jnp.array([0x04030201], jnp.int32)).tolist()
      [1, 2, 3, 4]

    References:
      DeepEP UE8M0 scale layout (four UE8M0 scales per int32).
    """
    w = jnp.asarray(words)
    if w.dtype != jnp.int32 or w.ndim < 1:
        raise TypeError(
            f"words must be an int32 array with at least one axis, got dtype {w.dtype} and "
            f"shape {w.shape}; pass Fp8Array.scales."
        )
    u = jax.lax.bitcast_convert_type(w, jnp.uint32)
    shifts = jnp.arange(4, dtype=jnp.uint32) * 8
    b = (u[..., None] >> shifts) & 0xFF
    return b.reshape(*w.shape[:-1], 4 * w.shape[-1]).astype(jnp.uint8)


def scale_exponents(q: Fp8Array) -> jax.Array:
    """Unbiased scale exponents ``e`` (scale ``2^e``) of every block.

    ``e = byte - 127``; a NaN block (byte 0xFF) reports 128.

    Args:
      q: an :class:`Fp8Array`.

    Returns:
      int32 array ``[..., H // block_size]``.

    Example:
      >>> import jax.numpy as jnp
      >>> scale_exponents(quantize(jnp.full((512,), 448.0))).tolist()
      [0, 0, 0, 0]

    References:
      OCP Microscaling Formats (MX) v1.0 specification (E8M0).
    """
    return unpack_e8m0(q.scales).astype(jnp.int32) - E8M0_BIAS


def wire_nbytes(q: Fp8Array) -> int:
    """Bytes a quantized tensor occupies on the wire: one per element plus four per word.

    ``nbytes = prod(data.shape) + 4 * prod(scales.shape)``; against bf16 this is
    ``(1 + 1 / block_size) / 2`` of the bytes.

    Args:
      q: an :class:`Fp8Array` (arrays or ``jax.ShapeDtypeStruct`` leaves).

    Returns:
      Python int byte count.

    Example:
      >>> import jax.numpy as jnp
      >>> wire_nbytes(quantize(jnp.zeros((8, 1024))))
      8256

    References:
      DeepEP low-latency dispatch (FP8 payload + UE8M0 scales).
    """
    data_bytes = int(np.prod(q.data.shape)) * np.dtype(q.data.dtype).itemsize
    return data_bytes + int(np.prod(q.scales.shape)) * np.dtype(q.scales.dtype).itemsize
