"""The wire-kernel registry: the gathers that build and read the exchanged rows.

Each gather takes one ``implementation`` (:data:`accel_kernels.registry.Implementation`),
decided by the registry's one rule (`accel_kernels.registry`) among XLA
(`accel_kernels.wire.xla`), the Triton kernels (`accel_kernels.wire.triton`: NVIDIA GPUs before
Hopper, interpreted on the CPU for tests) and the Mosaic GPU kernels
(`accel_kernels.wire.mosaic`: Hopper). All give the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from accel_kernels import registry
from accel_kernels.quant import xla as quant_xla
from accel_kernels.registry import Implementation, Kernels
from accel_kernels.wire import xla
from accel_kernels.wire.xla import (
    decode_rows,
    encode_rows,
    gather_weighted_rows,
    pack_fp8_words,
    unpack_fp8_words,
)

__all__ = ["IMPLEMENTATIONS", "Implementation", "decode_rows",
           "encode_rows", "gather_decode", "gather_local_rows_quantized", "gather_rows",
           "gather_rows_quantized", "gather_weighted_rows", "gather_weighted_rows_quantized",
           "pack_fp8_words", "unpack_fp8_words"]

IMPLEMENTATIONS = registry.Registry("wire", {
    "xla": "accel_kernels.wire.xla",
    "triton": "accel_kernels.wire.triton",
    "mosaic": "accel_kernels.wire.mosaic",
})


def _run(args: tuple, *, xla, implementation: str, kernels) -> Any:
    """``xla(*args)``, or a kernel of ``kernels(mosaic_module, triton_module)`` (a
    :class:`accel_kernels.registry.Kernels` without its ``xla``), by the registry's rule."""
    implementation = registry.canonical(implementation)
    found = Kernels(xla=xla)
    if implementation != "xla":
        found = dataclasses.replace(kernels(IMPLEMENTATIONS.module("mosaic"),
                                            IMPLEMENTATIONS.module("triton")), xla=xla)
    return registry.run(found, args, implementation, shape=args[0].shape)


MOSAIC_NEEDS = ("row widths the Mosaic GPU gathers take: accel_kernels.wire.mosaic.supported "
                "and wire_supported")
TRITON_NEEDS = "power-of-two row widths: accel_kernels.wire.triton.supported"


def _twins(mosaic_fn, triton_fn, *, mosaic_ok: bool, triton_ok: bool) -> Kernels:
    """A gather's two kernels where they take its operands: ``mosaic_fn(*args)`` and
    ``triton_fn(interpret, *args)``."""
    return Kernels(xla=None, mosaic=mosaic_fn if mosaic_ok else None,
                   triton=triton_fn if triton_ok else None, mosaic_needs=MOSAIC_NEEDS,
                   triton_needs=TRITON_NEEDS)


def _itemsize(wire) -> int:
    return 4 if isinstance(wire, str) else jnp.dtype(wire).itemsize


def gather_rows(rows: jax.Array, index: jax.Array, *, wire: Literal["fp8"] | jnp.dtype,
                block_size: int, implementation: Implementation = "xla") -> jax.Array:
    """Send buffer ``out[i] = encode(rows[index[i]])`` (a zero row where ``index[i]`` is out of
    range): XLA encodes each row once, then gathers its wire words
    (:func:`accel_kernels.wire.xla.gather_rows`); a kernel reads each sent row and writes its
    encoding in one pass, the same bytes.

    Args:
      rows: float ``[N, H]``.
      index: int ``[M]`` (values ``>= N`` give zero rows).
      wire, block_size: as :func:`encode_rows`.
      implementation: one of :data:`accel_kernels.registry.Implementation`.

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

    def kernels(mosaic, triton):
        return _twins(
            functools.partial(mosaic.gather_encode, **kw),
            lambda interpret, *a: triton.gather_encode(*a, interpret=interpret, **kw),
            mosaic_ok=mosaic.wire_supported(width, fp8_wire=is_fp8, block_size=block_size,
                                            itemsizes=(rows.dtype.itemsize, _itemsize(wire))),
            triton_ok=triton.supported(width, fp8_wire=is_fp8, block_size=block_size))

    reference = functools.partial(xla.gather_rows, wire=wire, block_size=block_size)
    return _run((rows, index), xla=reference, implementation=implementation, kernels=kernels)


def gather_decode(buf: jax.Array, index: jax.Array, *, wire: Literal["fp8"] | jnp.dtype,
                  width: int, block_size: int, out_dtype, implementation: Implementation,
                  fallback: Callable | None = None) -> jax.Array:
    """Wire rows ``buf[index]`` decoded to ``out_dtype [M, width]`` (zero rows out of range),
    in one pass where a kernel runs. ``fallback(buf, index)``: the XLA path, when the caller
    has a cheaper one than a gather (a transpose); by default a gather, then a decode.

    Example:
      >>> import jax.numpy as jnp
      >>> b = encode_rows(jnp.ones((2, 512)), wire="fp8", block_size=128)
      >>> gather_decode(b, jnp.array([1, 5]), wire="fp8", width=512, block_size=128,
      ...               out_dtype=jnp.float32, implementation="xla").sum(axis=1).tolist()
      [512.0, 0.0]
    """
    def gathered(buf, index):
        rows = jnp.take(buf, index, axis=0, mode="fill", fill_value=0)
        return decode_rows(rows, wire=wire, width=width, block_size=block_size,
                           out_dtype=out_dtype)

    fp8_wire = isinstance(wire, str)
    kw = dict(width=width, fp8_wire=fp8_wire, block_size=block_size, out_dtype=out_dtype)

    def kernels(mosaic, triton):
        return _twins(
            functools.partial(mosaic.gather_decode, **kw),
            lambda interpret, *a: triton.gather_decode(*a, interpret=interpret, **kw),
            mosaic_ok=mosaic.wire_supported(
                width, fp8_wire=fp8_wire, block_size=block_size,
                itemsizes=(_itemsize(wire), jnp.dtype(out_dtype).itemsize)),
            triton_ok=triton.supported(width, fp8_wire=fp8_wire, block_size=block_size))

    return _run((buf, index), xla=fallback or gathered, implementation=implementation,
                kernels=kernels)


def gather_rows_quantized(wire: jax.Array, index: jax.Array | None = None, *, width: int,
                          block_size: int, implementation: Implementation = "auto"):
    """FP8 wire rows (e4m3 + E8M0 scales per ``block_size`` channels, :func:`encode_rows`),
    gathered by ``index`` if given (zero rows out of range), as the row-quantized pair ``(e4m3
    [M, width], scale f32 [M])`` of their decoded values: the bytes of
    ``accel_kernels.quant.xla.quantize_rows_reference(decoded rows)``. Each block is rescaled by
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

    def kernels(mosaic, triton):
        return _twins(
            functools.partial(mosaic.gather_rows_quantized, **kw),
            lambda interpret, *a: triton.gather_rows_quantized(*a, interpret=interpret, **kw),
            mosaic_ok=mosaic.wire_supported(width, fp8_wire=True, block_size=block_size),
            triton_ok=triton.supported(width, fp8_wire=True, block_size=block_size))

    return _run((wire, index), xla=reference, implementation=implementation,
                kernels=kernels)


def gather_local_rows_quantized(tokens: jax.Array, index: jax.Array, *, block_size: int,
                                implementation: Implementation = "auto"):
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

    def kernels(mosaic, triton):
        return _twins(
            functools.partial(mosaic.gather_local_rows_quantized, block_size=block_size),
            lambda interpret, *a: triton.gather_local_rows_quantized(
                *a, block_size=block_size, interpret=interpret),
            mosaic_ok=mosaic.supported(width, block_size),
            triton_ok=triton.supported(width, fp8_wire=True, block_size=block_size))

    return _run((tokens, index), xla=reference, implementation=implementation,
                kernels=kernels)


def gather_weighted_rows_quantized(rows: jax.Array, weights: jax.Array, slot: jax.Array, *,
                                   top_k: int, wire_dtype, implementation: Implementation = "auto"):
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

    def kernels(mosaic, triton):
        return _twins(
            functools.partial(mosaic.gather_weighted_rows_quantized, **kw),
            lambda interpret, *a: triton.gather_weighted_rows_quantized(
                *a, interpret=interpret, **kw),
            mosaic_ok=mosaic.supported(rows.shape[-1]),
            triton_ok=triton.supported(rows.shape[-1], fp8_wire=False))

    return _run((rows, weights, slot), xla=reference, implementation=implementation,
                kernels=kernels)
