"""The FP8 quantization registry: what the expert GEMMs call to quantize their operands.

Each function takes one ``implementation`` (:data:`accel_kernels.registry.Implementation`),
decided by the registry's one rule (`accel_kernels.registry`) among the XLA reference
(`accel_kernels.quant.xla`), the Triton kernels (`accel_kernels.quant.triton`: NVIDIA GPUs
before Hopper, interpreted on the CPU for tests) and the Mosaic GPU kernels
(`accel_kernels.quant.mosaic`: Hopper). Every implementation gives the same bytes.
"""

from __future__ import annotations

import functools
import math

import jax

from accel_kernels import registry
from accel_kernels.activations import GatedActivation
from accel_kernels.quant import xla
from accel_kernels.registry import Implementation, Kernels

__all__ = ["IMPLEMENTATIONS", "Implementation", "cols_t", "cols_t_and_rows", "gated_grad_rows",
           "gated_rows", "rows"]

IMPLEMENTATIONS = registry.Registry("quant", {
    "xla": "accel_kernels.quant.xla",
    "triton": "accel_kernels.quant.triton",
    "mosaic": "accel_kernels.quant.mosaic",
})


def _on_row_kernels(implementation, kernel: str, reference_fn, width: int, *args, **kw):
    """The row kernel ``kernel`` of the Mosaic and Triton modules (``[M, width]`` operands, with
    keywords ``kw``) on ``args`` with their leading axes flattened into rows, or
    ``reference_fn(*args)``, by the registry's rule."""
    implementation = registry.canonical(implementation)
    m = math.prod(args[0].shape[:-1])
    kernels = Kernels(xla=reference_fn)
    if implementation != "xla":
        mosaic = IMPLEMENTATIONS.module("mosaic")
        triton = IMPLEMENTATIONS.module("triton")
        mosaic_fn = functools.partial(getattr(mosaic, kernel), **kw)
        triton_fn = getattr(triton, kernel)
        kernels = Kernels(
            xla=reference_fn,
            mosaic=(lambda *a: xla.on_rows(mosaic_fn, *a)) if mosaic.supported(m, width)
            else None,
            triton=(lambda interpret, *a: xla.on_rows(
                functools.partial(triton_fn, interpret=interpret, **kw), *a))
            if triton.supported(width) else None,
            mosaic_needs=(f"rows of a multiple of {mosaic.ROW_MULTIPLE} channels, a multiple "
                          f"of {mosaic.BLOCK_ROWS} rows"),
            triton_needs="rows of a multiple of 16 channels")
    return registry.run(kernels, args, implementation, shape=args[0].shape)


def _on_matrix_kernels(implementation, kernel: str, reference_fn, a: jax.Array):
    """A weight kernel ``kernel`` (``[B, M, N]`` operands) on ``a [..., M, N]`` with its leading
    axes flattened, then unflattened in every output, or ``reference_fn(a)``."""
    implementation = registry.canonical(implementation)
    lead = a.shape[:-2]

    def flat(fn):
        def run(a):
            out = fn(a.reshape(-1, *a.shape[-2:]))
            return jax.tree.map(lambda o: o.reshape(*lead, *o.shape[1:]), out)
        return run

    kernels = Kernels(xla=reference_fn)
    if implementation != "xla":
        mosaic = IMPLEMENTATIONS.module("mosaic")
        triton = IMPLEMENTATIONS.module("triton")
        kernels = Kernels(
            xla=reference_fn,
            mosaic=flat(getattr(mosaic, kernel)) if mosaic.tiles_supported(*a.shape[-2:])
            else None,
            triton=(lambda interpret, a: flat(functools.partial(
                getattr(triton, kernel), interpret=interpret))(a))
            if triton.cols_supported(*a.shape[-2:]) else None,
            mosaic_needs=f"M, N multiples of {mosaic.TILE}",
            triton_needs=f"M, N multiples of {triton.COL_TILE}")
    return registry.run(kernels, (a,), implementation, shape=a.shape)


def rows(x: jax.Array, *, implementation: Implementation = "auto"):
    """``x [..., K]`` row-wise as ``(e4m3 [..., K], scale f32 [...])``, one power-of-two
    scale per row: ``scale = 2^ceil(log2(amax / 448))``, ``q = e4m3(x / scale)``.

    Args:
      x: float ``[..., K]``.
      implementation: ``'auto'``, ``'xla'``, ``'triton'`` or ``'mosaic'`` (module docstring).

    Returns:
      ``(q float8_e4m3fn [..., K], scale float32 [...])``.

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = rows(jnp.full((2, 256), 3.0))
      >>> q.dtype, s.tolist()
      (dtype(float8_e4m3fn), [0.0078125, 0.0078125])
    """
    return _on_row_kernels(implementation, "quantize_rows", xla.quantize_rows_reference,
                           x.shape[-1], x)


def gated_rows(z: jax.Array, act: GatedActivation, *,
               implementation: Implementation = "auto"):
    """``act(z)`` (``z [..., 2F]``: gate columns, then up) quantized row-wise, ``(e4m3 [...,
    F], scale [...])``, from one read of ``z`` where a kernel runs.

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = gated_rows(jnp.ones((2, 64)), GatedActivation("silu"))
      >>> q.shape, s.shape
      ((2, 32), (2,))
    """
    return _on_row_kernels(implementation, "gated_quantize_rows",
                           functools.partial(xla.gated_quantize_rows_reference, act=act),
                           z.shape[-1] // 2, z, act=act)


def gated_grad_rows(z: jax.Array, dh: jax.Array, act: GatedActivation, out_dtype, *,
                    implementation: Implementation = "auto"):
    """The activation's backward ``dz = act'(z) dh`` as ``(dz, e4m3(dz), scale)``, or
    ``(e4m3(dz), scale)`` for ``out_dtype=None``; ``dh [..., F']`` may be wider than ``F``
    (only its first ``F`` columns are read).

    Example:
      >>> import jax.numpy as jnp
      >>> dz, q, s = gated_grad_rows(jnp.ones((2, 64)), jnp.ones((2, 32)),
      ...                            GatedActivation("silu"), jnp.bfloat16)
      >>> dz.shape, q.dtype, s.shape
      ((2, 64), dtype(float8_e4m3fn), (2,))
    """
    return _on_row_kernels(
        implementation, "gated_grad_quantize_rows",
        lambda z, dh: xla.gated_grad_quantize_rows_reference(z, dh, act, out_dtype),
        z.shape[-1] // 2, z, dh, act=act, out_dtype=out_dtype)


def cols_t(a: jax.Array, *, implementation: Implementation = "auto"):
    """``a [..., M, N]`` column-wise quantized and transposed, ``(e4m3 [..., N, M], scale
    [..., N])``: the K-major copy a FP8 GEMM contracting ``M`` reads.

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = cols_t(jnp.ones((1, 64, 128)).at[0, 3, 5].set(8.0))
      >>> q.shape, float(s[0, 5]), float(s[0, 0])
      ((1, 128, 64), 0.03125, 0.00390625)
    """
    return _on_matrix_kernels(implementation, "quantize_cols_t", xla.quantize_cols_t_reference, a)


def cols_t_and_rows(a: jax.Array, *, implementation: Implementation = "auto"):
    """``a [..., M, N]``'s two FP8 copies, ``(cols_t(a), rows(a))``, from two passes over it
    where a kernel runs (the same bytes as the two calls).

    Example:
      >>> import jax.numpy as jnp
      >>> (qt, sc), (q, sr) = cols_t_and_rows(jnp.ones((1, 64, 128)))
      >>> qt.shape, q.shape
      ((1, 128, 64), (1, 64, 128))
    """
    return _on_matrix_kernels(implementation, "quantize_cols_t_and_rows",
                              xla.quantize_cols_t_and_rows_reference, a)
