"""The wire-kernel registry: the gathers that build and read the exchanged rows, each by an
XLA path or a Pallas kernel, chosen by one ``kernels`` argument (:data:`WireKernels`).

* ``'auto'``: the compiled kernels when lowered for CUDA (Mosaic GPU on Hopper,
  `moe.kernels.platform.prefer_mosaic_gpu`, where it takes the shape; Triton before Hopper;
  Triton never runs on Hopper, jax deprecates it), XLA elsewhere and for shapes the
  platform's kernel does not take;
* ``'xla'``: XLA (`moe.kernels.wire.xla`);
* ``'triton'``: the Triton kernel (`moe.kernels.wire.triton`) wherever it takes the shape,
  compiled for CUDA and interpreted (slowly, for tests) when lowered for CPU;
* ``'mosaic'``: the Mosaic GPU kernel (`moe.kernels.wire.mosaic`) where it takes the shape,
  when lowered for CUDA; XLA elsewhere.

All give the same bytes. The old ``'pallas'`` is accepted with a DeprecationWarning
(:func:`canonical_wire_kernels`).
"""

from __future__ import annotations

import functools
import typing
import warnings
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from moe.kernels.platform import prefer_mosaic_gpu
from moe.kernels.quant import xla as quant_xla
from moe.kernels.wire import mosaic, triton, xla
from moe.kernels.wire.xla import (
    decode_rows,
    encode_rows,
    gather_weighted_rows,
    pack_fp8_words,
    unpack_fp8_words,
)

__all__ = ["WireKernels", "canonical_wire_kernels", "check_wire_kernels", "decode_rows",
           "encode_rows", "gather_decode", "gather_local_rows_quantized", "gather_rows",
           "gather_rows_quantized", "gather_weighted_rows", "gather_weighted_rows_quantized",
           "pack_fp8_words", "unpack_fp8_words"]

WireKernels = Literal["auto", "xla", "triton", "mosaic"]
_WIRE_KERNELS: tuple[str, ...] = typing.get_args(WireKernels)


def canonical_wire_kernels(name: str) -> str:
    """``name``, with the deprecated ``'pallas'`` (and a warning) given its old meaning: the
    Triton kernels interpreted on the CPU (``'triton'``), the compiled kernels on a GPU
    (``'auto'``), by the default backend.

    Example:
      >>> canonical_wire_kernels("xla")
      'xla'
    """
    if name == "pallas":
        warnings.warn("wire_kernels 'pallas' is deprecated; use 'triton'", DeprecationWarning,
                      stacklevel=3)
        return "triton" if jax.default_backend() == "cpu" else "auto"
    return name


def check_wire_kernels(kernels: str) -> None:
    """ValueError unless ``kernels`` is a known wire-kernel choice usable here.

    Example:
      >>> check_wire_kernels("triton")
    """
    if kernels not in _WIRE_KERNELS:
        raise ValueError(
            f"wire_kernels must be one of {_WIRE_KERNELS}, got {kernels!r}; 'auto' uses the "
            "Pallas (Mosaic GPU or Triton) wire kernels on NVIDIA GPUs and XLA elsewhere."
        )
    if kernels == "triton" and triton.PALLAS_IMPORT_ERROR is not None:
        raise ValueError(
            f"wire_kernels='triton' needs jax.experimental.pallas, which failed to import "
            f"({triton.PALLAS_IMPORT_ERROR}); use 'auto' or 'xla'."
        )
    if kernels in ("triton", "mosaic") and jax.default_backend() == "tpu":
        raise ValueError(f"wire_kernels={kernels!r} are GPU kernels; use 'auto' on TPU.")


class Twins(NamedTuple):
    """A wire kernel's two implementations and whether each takes the shape at hand:
    ``mosaic(*args)``, ``triton(interpret, *args)``."""

    mosaic: Callable[..., jax.Array]
    triton: Callable[..., jax.Array]
    mosaic_ok: bool
    triton_ok: bool


def choose(args: tuple, *, xla: Callable, twins: Twins | None, kernels: str):
    """``xla(*args)`` or a kernel of ``twins`` on ``args`` by ``kernels`` (module docstring)
    and the lowering platform; ``twins`` None: no kernel serves the shape (XLA)."""
    if kernels == "xla" or twins is None:
        return xla(*args)
    if kernels == "auto":
        if prefer_mosaic_gpu():
            compiled = twins.mosaic if twins.mosaic_ok else None
        else:
            compiled = functools.partial(twins.triton, False) if twins.triton_ok else None
        if compiled is None:
            return xla(*args)
        return lax.platform_dependent(*args, cuda=compiled, default=xla)
    if kernels == "mosaic":
        if not twins.mosaic_ok:
            return xla(*args)
        return lax.platform_dependent(*args, cuda=twins.mosaic, default=xla)
    if kernels == "triton":
        if not twins.triton_ok:
            return xla(*args)
        return lax.platform_dependent(*args, cpu=functools.partial(twins.triton, True),
                                      cuda=functools.partial(twins.triton, False), default=xla)
    raise ValueError(f"wire_kernels must be one of {_WIRE_KERNELS}, got {kernels!r}.")


def _itemsize(wire) -> int:
    return 4 if isinstance(wire, str) else jnp.dtype(wire).itemsize


def gather_rows(rows: jax.Array, index: jax.Array, *, wire: Literal["fp8"] | jnp.dtype,
                block_size: int, kernels: WireKernels = "xla") -> jax.Array:
    """Send buffer ``out[i] = encode(rows[index[i]])`` (a zero row where ``index[i]`` is out of
    range): XLA encodes each row once, then gathers its wire words
    (:func:`moe.kernels.wire.xla.gather_rows`); a kernel reads each sent row and writes its
    encoding in one pass, the same bytes.

    Args:
      rows: float ``[N, H]``.
      index: int ``[M]`` (values ``>= N`` give zero rows).
      wire, block_size: as :func:`encode_rows`.
      kernels: one of :data:`WireKernels`.

    Returns:
      The wire buffer ``[M, wire_width]``.

    Example:
      >>> import jax.numpy as jnp
      >>> gather_rows(jnp.ones((2, 512)), jnp.array([1, 2, 0]), wire="fp8",
      ...             block_size=128).shape
      (3, 129)
    """
    is_fp8 = isinstance(wire, str)
    width = rows.shape[-1]
    kw = dict(fp8_wire=is_fp8, block_size=block_size, out_dtype=None if is_fp8 else wire)
    twins = Twins(
        functools.partial(mosaic.gather_encode, **kw),
        lambda interpret, *a: triton.gather_encode(*a, interpret=interpret, **kw),
        mosaic_ok=mosaic.wire_supported(width, fp8_wire=is_fp8, block_size=block_size,
                                        itemsizes=(rows.dtype.itemsize, _itemsize(wire))),
        triton_ok=triton.supported(width, fp8_wire=is_fp8, block_size=block_size))
    return choose((rows, index), xla=functools.partial(xla.gather_rows, wire=wire,
                                                       block_size=block_size),
                  twins=twins, kernels=kernels)


def gather_decode(buf: jax.Array, index: jax.Array, *, wire: Literal["fp8"] | jnp.dtype,
                  width: int, block_size: int, out_dtype, kernels: WireKernels,
                  fallback: Callable | None = None) -> jax.Array:
    """Wire rows ``buf[index]`` decoded to ``out_dtype [M, width]`` (zero rows out of range),
    in one pass where a kernel runs. ``fallback(buf, index)``: the XLA path, when the caller
    has a cheaper one than a gather (a transpose); by default a gather, then a decode.

    Example:
      >>> import jax.numpy as jnp
      >>> b = encode_rows(jnp.ones((2, 512)), wire="fp8", block_size=128)
      >>> gather_decode(b, jnp.array([1, 5]), wire="fp8", width=512, block_size=128,
      ...               out_dtype=jnp.float32, kernels="xla").sum(axis=1).tolist()
      [512.0, 0.0]
    """
    def gathered(buf, index):
        rows = jnp.take(buf, index, axis=0, mode="fill", fill_value=0)
        return decode_rows(rows, wire=wire, width=width, block_size=block_size,
                           out_dtype=out_dtype)

    fp8_wire = isinstance(wire, str)
    kw = dict(width=width, fp8_wire=fp8_wire, block_size=block_size, out_dtype=out_dtype)
    twins = Twins(
        functools.partial(mosaic.gather_decode, **kw),
        lambda interpret, *a: triton.gather_decode(*a, interpret=interpret, **kw),
        mosaic_ok=mosaic.wire_supported(
            width, fp8_wire=fp8_wire, block_size=block_size,
            itemsizes=(_itemsize(wire), jnp.dtype(out_dtype).itemsize)),
        triton_ok=triton.supported(width, fp8_wire=fp8_wire, block_size=block_size))
    return choose((buf, index), xla=fallback or gathered, twins=twins, kernels=kernels)


def gather_rows_quantized(wire: jax.Array, index: jax.Array | None = None, *, width: int,
                          block_size: int, kernels: WireKernels = "auto"):
    """FP8 wire rows (e4m3 + E8M0 scales per ``block_size`` channels, :func:`encode_rows`),
    gathered by ``index`` if given (zero rows out of range), as the row-quantized pair ``(e4m3
    [M, width], scale f32 [M])`` of their decoded values: the bytes of
    ``moe.kernels.quant.xla.quantize_rows_reference(decoded rows)``. Each block is rescaled by
    a power of two to the row's scale (exact unless a value drops below e4m3's normal range,
    where it rounds to nearest even as the re-quantization would).

    Example:
      >>> import jax.numpy as jnp
      >>> b = encode_rows(jnp.ones((2, 512)), wire="fp8", block_size=128)
      >>> q, s = gather_rows_quantized(b, width=512, block_size=128)
      >>> q.shape, s.shape
      ((2, 512), (2,))
    """
    if index is None:
        index = jnp.arange(wire.shape[0], dtype=jnp.int32)
    # Integer words take no gradient; say so, or autodiff would trace the Pallas call's JVP.
    wire, index = lax.stop_gradient(wire), lax.stop_gradient(index)

    def reference(wire, index):
        index = jnp.where(index < 0, wire.shape[0], index)  # out of range, not from the end
        rows = jnp.take(wire, index, axis=0, mode="fill", fill_value=0)
        decoded = decode_rows(rows, wire="fp8", width=width, block_size=block_size,
                              out_dtype=jnp.float32)
        # Written once: left to itself, XLA fuses the gather, decode and row maxima into the
        # consumers' transposes, which then recompute them.
        return lax.optimization_barrier(quant_xla.quantize_rows_reference(decoded))

    kw = dict(width=width, block_size=block_size)
    twins = Twins(
        functools.partial(mosaic.gather_rows_quantized, **kw),
        lambda interpret, *a: triton.gather_rows_quantized(*a, interpret=interpret, **kw),
        mosaic_ok=mosaic.wire_supported(width, fp8_wire=True, block_size=block_size),
        triton_ok=triton.supported(width, fp8_wire=True, block_size=block_size))
    return choose((wire, index), xla=reference, twins=twins, kernels=kernels)


def gather_local_rows_quantized(tokens: jax.Array, index: jax.Array, *, block_size: int,
                                kernels: WireKernels = "auto"):
    """FP8 dispatch where nothing is sent: the row-quantized pair of
    ``decode(encode(tokens[index]))``, the bytes :func:`gather_rows_quantized` gives for the
    wire rows that the dispatch would have written (zero rows where ``index`` is out of range).

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = gather_local_rows_quantized(jnp.ones((2, 512)), jnp.array([1, 7]),
      ...                                    block_size=128)
      >>> float(s[0]), bool(q[1].astype(jnp.float32).any())  # row 1: out of range, zero
      (0.00390625, False)
    """
    tokens, index = lax.stop_gradient(tokens), lax.stop_gradient(index)
    width = tokens.shape[-1]

    def reference(tokens, index):
        index = jnp.where(index < 0, tokens.shape[0], index)  # out of range, not from the end
        wire = gather_rows(tokens, index, wire="fp8", block_size=block_size)
        return gather_rows_quantized(wire, width=width, block_size=block_size)

    twins = Twins(
        functools.partial(mosaic.gather_local_rows_quantized, block_size=block_size),
        lambda interpret, *a: triton.gather_local_rows_quantized(
            *a, block_size=block_size, interpret=interpret),
        mosaic_ok=mosaic.supported(width, block_size),
        triton_ok=triton.supported(width, fp8_wire=True, block_size=block_size))
    return choose((tokens, index), xla=reference, twins=twins, kernels=kernels)


def gather_weighted_rows_quantized(rows: jax.Array, weights: jax.Array, slot: jax.Array, *,
                                   top_k: int, wire_dtype, kernels: WireKernels = "auto"):
    """The row-quantized pair of ``wire_dtype(weights[s] * rows[s // top_k])`` for each
    row's slot ``s`` (zero rows for slots out of range): the bytes
    ``quantize_rows_reference`` gives for what :func:`gather_weighted_rows` builds.

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = gather_weighted_rows_quantized(jnp.ones((2, 512)), jnp.ones(4),
      ...                                       jnp.array([3, 4]), top_k=2,
      ...                                       wire_dtype=jnp.bfloat16)
      >>> float(s[0]), bool(q[1].astype(jnp.float32).any())  # row 1: out of range, zero
      (0.00390625, False)
    """
    rows, weights, slot = (lax.stop_gradient(a) for a in (rows, weights, slot))
    wire_dtype = jnp.dtype(wire_dtype)

    def reference(rows, weights, slot):
        slot = jnp.where(slot < 0, weights.shape[0], slot)  # out of range, not from the end
        g = gather_weighted_rows(rows, weights, slot, top_k=top_k, wire=wire_dtype,
                                 block_size=rows.shape[-1])
        return quant_xla.quantize_rows_reference(g)

    kw = dict(top_k=top_k, wire_dtype=wire_dtype)
    twins = Twins(
        functools.partial(mosaic.gather_weighted_rows_quantized, **kw),
        lambda interpret, *a: triton.gather_weighted_rows_quantized(
            *a, interpret=interpret, **kw),
        mosaic_ok=mosaic.supported(rows.shape[-1]),
        triton_ok=triton.supported(rows.shape[-1], fp8_wire=False))
    return choose((rows, weights, slot), xla=reference, twins=twins, kernels=kernels)
