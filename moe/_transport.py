"""Collective transports for expert-parallel token exchange (used inside ``jax.shard_map``).

Three pieces, all pure functions on per-device arrays:

* the wire codec: rows are sent either as-is (any float dtype) or as FP8, i.e. the e4m3 bytes
  of :func:`moe.fp8.quantize` followed by its packed E8M0 scale words, fused into one row of
  ``(H + H // block_size) / 4`` uint32 words (one collective instead of two; 32-bit words so
  the gathers, transposes and copies around the exchange move 4 bytes per element, not 1);
* ``dense_exchange``: a tiled ``jax.lax.all_to_all`` of a destination-major buffer;
* ``ragged_exchange``: ``jax.lax.ragged_all_to_all`` on GPU/TPU and, where XLA does not
  implement it (CPU), an emulation with identical semantics built from ``all_gather`` and
  gathers (correct, not fast).

References: DeepEP (FP8 dispatch with UE8M0 scales); MaxText's ragged MoE
(``ragged_all_to_all`` + ``ragged_dot``).
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from moe import _wire_mosaic, _wire_pallas, fp8
from moe._platform import prefer_mosaic_gpu

AxisName = str | tuple[str, ...]
RaggedImpl = Literal["auto", "native", "emulated"]
WireKernels = Literal["auto", "xla", "pallas"]

# Backends whose XLA implements the ragged-all-to-all HLO.
_NATIVE_RAGGED_BACKENDS = frozenset({"gpu", "cuda", "rocm", "tpu"})


def resolve_ragged_impl(impl: RaggedImpl) -> Literal["native", "emulated"]:
    """Pick the ragged all-to-all implementation: native where XLA has it, else emulated.

    Args:
      impl: ``'auto'`` (native on GPU/TPU, emulated elsewhere, by ``jax.default_backend()``),
        ``'native'`` or ``'emulated'``.

    Returns:
      ``'native'`` or ``'emulated'``.

    Example:
      >>> resolve_ragged_impl("emulated")
      'emulated'

    References:
      XLA:CPU has no ragged-all-to-all (docs/architecture.md, transports).
    """
    if impl not in ("auto", "native", "emulated"):
        raise ValueError(
            f"ragged_impl must be 'auto', 'native' or 'emulated', got {impl!r}; use 'auto' "
            "to pick by backend."
        )
    if impl != "auto":
        return impl
    return "native" if jax.default_backend() in _NATIVE_RAGGED_BACKENDS else "emulated"


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


class TokenRows(NamedTuple):
    """The FP8 dispatch's rows when nothing is sent (one device on the expert axis): layout
    row ``r`` carries token ``index[r]`` of ``tokens`` (a zero row where out of range). It
    stands in for the wire rows that would be written and read back by the same device; an
    FP8 GEMM quantizes its rows from it as from those wire rows (the same bytes,
    :func:`moe._wire_pallas.gather_local_rows_quantized`)."""

    tokens: jax.Array  # float [T, H]
    index: jax.Array  # int32 [R]


def check_wire_kernels(kernels: WireKernels) -> None:
    """ValueError unless ``kernels`` is a known wire-kernel choice usable here."""
    if kernels not in ("auto", "xla", "pallas"):
        raise ValueError(
            f"wire_kernels must be 'auto', 'xla' or 'pallas', got {kernels!r}; 'auto' uses the "
            "Pallas (Mosaic GPU or Triton) wire kernels on NVIDIA GPUs and XLA elsewhere."
        )
    if kernels == "pallas" and _wire_pallas.PALLAS_IMPORT_ERROR is not None:
        raise ValueError(
            f"wire_kernels='pallas' needs jax.experimental.pallas, which failed to import "
            f"({_wire_pallas.PALLAS_IMPORT_ERROR}); use 'auto' or 'xla'."
        )
    if kernels == "pallas" and jax.default_backend() == "tpu":
        raise ValueError("wire_kernels='pallas' are GPU kernels (Mosaic GPU, Triton); use "
                         "'auto' on TPU.")


def by_platform(args: tuple, *, xla, pallas, kernels: WireKernels):
    """``xla(*args)`` or ``pallas(interpret, *args)`` by ``kernels`` and lowering platform.

    ``'xla'`` (or ``pallas`` None: shape not supported): XLA. ``'auto'``: the compiled Pallas
    kernel when lowered for CUDA, XLA elsewhere. ``'pallas'``: compiled on GPUs, interpreted
    (slow; for tests) when lowered for CPU.
    """
    if kernels == "xla" or pallas is None:
        return xla(*args)
    if kernels == "pallas":
        return jax.lax.platform_dependent(
            *args, cpu=functools.partial(pallas, True), default=functools.partial(pallas, False))
    return jax.lax.platform_dependent(*args, cuda=functools.partial(pallas, False), default=xla)


def twin_kernels(mosaic, triton, *, mosaic_ok: bool, triton_ok: bool):
    """The ``pallas`` argument of :func:`by_platform` for a Pallas kernel with a Mosaic GPU
    twin, or None (XLA) where no kernel serves the shape.

    Compiled: on Hopper (`moe._platform.prefer_mosaic_gpu`, also with no GPU present) the
    Mosaic GPU twin where it takes the shape (``mosaic_ok``), never Triton, which jax
    deprecates; before Hopper the Triton kernel (``triton_ok``). Interpreted (on the CPU, for
    tests): the Triton kernel, where a compiled kernel would run.
    """
    if prefer_mosaic_gpu():
        if not mosaic_ok:
            return None
        compiled = mosaic
    elif triton_ok:
        compiled = functools.partial(triton, False)
    else:
        return None

    def pallas(interpret, *args):
        if interpret:
            return triton(True, *args) if triton_ok else compiled(*args)
        return compiled(*args)

    return pallas


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
    rows: jax.Array,
    index: jax.Array,
    *,
    wire: Literal["fp8"] | jnp.dtype,
    block_size: int,
    kernels: WireKernels = "xla",
) -> jax.Array:
    """Send buffer ``out[i] = encode(rows[index[i]])`` (a zero row where ``index[i]`` is out of
    range). XLA: the rows are encoded ONCE (``N`` rows of ``rows``, however often each is
    sent), then their wire words are gathered (for FP8: e4m3 + scale bytes, half the bytes of
    bf16). Pallas: one pass that reads each sent row and writes its encoding, the same bytes,
    in Mosaic GPU (:func:`moe._wire_mosaic.gather_encode`, `moe._platform.prefer_mosaic_gpu`
    and :func:`moe._wire_mosaic.wire_supported` widths) or else Triton
    (:func:`moe._wire_pallas.gather_encode`).

    Args:
      rows: float ``[N, H]``.
      index: int ``[M]`` (values ``>= N`` give zero rows).
      wire, block_size: as :func:`encode_rows`.
      kernels: ``'xla'``, ``'auto'`` or ``'pallas'`` (see :func:`by_platform`).

    Returns:
      The wire buffer ``[M, wire_width]``.

    Example:
      >>> gather_rows(jnp.ones((2, 512)), jnp.array([1, 2, 0]), wire="fp8",
      ...             block_size=128).shape
      (3, 129)

    References:
      DeepEP FP8 dispatch (tokens quantized once, before the exchange).
    """
    def xla(rows, index):
        buf = encode_rows(rows, wire=wire, block_size=block_size)
        return jnp.take(buf, index, axis=0, mode="fill", fill_value=0)

    is_fp8 = isinstance(wire, str)
    width = rows.shape[-1]
    kw = dict(fp8_wire=is_fp8, block_size=block_size, out_dtype=None if is_fp8 else wire)
    pallas = twin_kernels(
        functools.partial(_wire_mosaic.gather_encode, **kw),
        lambda interpret, *a: _wire_pallas.gather_encode(*a, interpret=interpret, **kw),
        mosaic_ok=_wire_mosaic.wire_supported(
            width, fp8_wire=is_fp8, block_size=block_size,
            itemsizes=(rows.dtype.itemsize, 4 if is_fp8 else jnp.dtype(wire).itemsize)),
        triton_ok=_wire_pallas.supported(width, fp8_wire=is_fp8, block_size=block_size))
    return by_platform((rows, index), xla=xla, pallas=pallas, kernels=kernels)


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


def dense_exchange(buf: jax.Array, axis_name: AxisName, *, axis: int = 0) -> jax.Array:
    """Tiled all-to-all on ``axis``: block ``p`` of it goes to device ``p``, and the blocks
    that arrive are concatenated along it in source order. No collective (``buf`` itself) when
    ``axis_name`` has one device.

    ``out[p] = buf_on_device_p[me]`` with ``buf`` viewed as ``[P, N/P, ...]`` along ``axis``.

    Args:
      buf: ``P * n`` rows along ``axis``, destination-major (``P`` = size of ``axis_name``).
      axis_name: the mesh axis (or axes) to exchange over.
      axis: the axis to split and concatenate.

    Returns:
      ``buf``'s shape, source-major along ``axis``.

    Example:
      >>> # inside jax.shard_map over 'expert': dense_exchange(buf, 'expert')

    References:
      GShard / Switch Transformer capacity-padded all-to-all dispatch.
    """
    if jax.lax.axis_size(axis_name) == 1:
        return buf
    return jax.lax.all_to_all(buf, axis_name, axis, axis, tiled=True)


def _ragged_all_to_all_emulated(
    operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
    output_offsets: jax.Array, *, axis_name: AxisName,
) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` from ``all_gather`` + gathers (see :func:`ragged_exchange`)."""
    p = jax.lax.axis_size(axis_name)
    n, m, k = operand.shape[0], output.shape[0], input_offsets.shape[0]
    spd = k // p  # slices per destination
    me = jax.lax.axis_index(axis_name)
    all_rows = jax.lax.all_gather(operand, axis_name, axis=0, tiled=True)  # [P*N, ...]
    meta = jnp.stack([input_offsets, send_sizes, output_offsets]).astype(jnp.int32)
    meta = jax.lax.all_gather(meta, axis_name, axis=0)  # [P, 3, K]
    mine = jax.lax.dynamic_slice_in_dim(meta, me * spd, spd, axis=2)  # [P, 3, spd]
    io, ss, oo = mine[:, 0, :, None], mine[:, 1, :, None], mine[:, 2, :, None]
    r = jnp.arange(n, dtype=jnp.int32)
    src = jnp.arange(p, dtype=jnp.int32)[:, None, None] * n + io + r  # [P, spd, N]
    dst = jnp.where(r < ss, oo + r, m)  # out-of-range -> dropped by the scatter
    row_src = jnp.full((m,), -1, jnp.int32).at[dst.reshape(-1)].set(src.reshape(-1), mode="drop")
    got = jnp.take(all_rows, jnp.maximum(row_src, 0), axis=0)
    keep = (row_src >= 0).reshape((m,) + (1,) * (output.ndim - 1))
    return jnp.where(keep, got, output)


def ragged_exchange(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: AxisName,
    impl: Literal["native", "emulated"],
) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` (``impl='native'``) or its emulation (``'emulated'``).

    Slice ``i`` of sender ``s`` (``operand[input_offsets[i] : +send_sizes[i]]``) lands on device
    ``i // (K / P)`` at ``output[output_offsets[i] : +send_sizes[i]]``; rows nobody writes keep
    ``output``'s value. The emulation (any backend) all-gathers every operand, so it is for
    tests and CPU only; it ignores ``recv_sizes`` (implied by the senders' ``send_sizes``).
    The native op types its result like ``output``, so under ``shard_map``'s varying-axes
    checks ``output`` must vary over the operand's mesh axes: build it with
    ``jnp.zeros_like(operand, shape=...)``, not ``jnp.zeros``.

    Args:
      operand: ``[N, ...]`` rows to send.
      output: ``[M, ...]`` initial receive buffer.
      input_offsets, send_sizes, output_offsets, recv_sizes: int ``[K]``, ``K`` a multiple of
        the axis size ``P``, as for ``jax.lax.ragged_all_to_all``.
      axis_name: the mesh axis (or axes).
      impl: from :func:`resolve_ragged_impl`.

    Returns:
      ``output`` with received slices written.

    Example:
      >>> # inside shard_map: ragged_exchange(..., axis_name='expert', impl='native')

    References:
      ``jax.lax.ragged_all_to_all`` docstring; MaxText ragged MoE dispatch.
    """
    if impl == "native":
        # GPU/TPU only (XLA:CPU lacks the op; CI lowers it, benchmarks/dispatch_bench.py runs it
        # on GPUs and checks it equals the emulation bit for bit).
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                         output_offsets, recv_sizes, axis_name=axis_name)
    return _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes,
                                       output_offsets, axis_name=axis_name)
