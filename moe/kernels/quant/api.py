"""The FP8 quantization registry: what the expert GEMMs call to quantize their operands, each
with one ``implementation`` argument.

* ``'auto'``: lowered for CUDA, the Mosaic GPU kernel on Hopper where the shape fits it
  (`moe.kernels.platform.prefer_mosaic_gpu`, also with no GPU present), the Triton kernel
  before Hopper (Triton never runs on Hopper: jax deprecates it); the XLA reference elsewhere
  and for shapes the platform's kernel does not take;
* ``'xla'``: the XLA reference (`moe.kernels.quant.xla`);
* ``'triton'``: the Triton kernel (`moe.kernels.quant.triton`), compiled for GPUs and
  interpreted (slowly, for tests) when lowered for CPU;
* ``'mosaic'``: the Mosaic GPU kernel (`moe.kernels.quant.mosaic`) when lowered for CUDA, the
  XLA reference elsewhere.

Every implementation gives the same bytes. An explicit kernel that does not take the shape is
a ValueError naming the argument.
"""

from __future__ import annotations

import functools
import math
import typing
from typing import Literal

import jax
from jax import lax

from moe.activations import GatedActivation
from moe.kernels.platform import prefer_mosaic_gpu
from moe.kernels.quant import mosaic, triton, xla

__all__ = ["Implementation", "cols_t", "cols_t_and_rows", "gated_grad_rows", "gated_rows",
           "rows"]

Implementation = Literal["auto", "xla", "triton", "mosaic"]
_IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(Implementation)


def _check_implementation(implementation: str) -> None:
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not supported; use one of "
                         f"{_IMPLEMENTATIONS}.")


def _unfit(implementation: str, shape, needs: str):
    raise ValueError(f"implementation={implementation!r} does not take operands of shape "
                     f"{tuple(shape)} ({needs}); use 'auto' or 'xla'.")


def _choose(implementation, *, mosaic_fn, triton_fn, reference_fn, mosaic_ok, triton_ok,
            shape, needs, args):
    """``reference_fn(*args)`` or a kernel on ``args`` by ``implementation`` (module
    docstring); ``mosaic_fn(*args)``, ``triton_fn(interpret, *args)``."""
    _check_implementation(implementation)
    if implementation == "xla":
        return reference_fn(*args)
    if implementation == "auto":
        if prefer_mosaic_gpu():
            compiled = mosaic_fn if mosaic_ok else None
        else:
            compiled = functools.partial(triton_fn, False) if triton_ok else None
        if compiled is None:
            return reference_fn(*args)
        return lax.platform_dependent(*args, cuda=compiled, default=reference_fn)
    if implementation == "mosaic":
        if not mosaic_ok:
            _unfit("mosaic", shape, needs[0])
        return lax.platform_dependent(*args, cuda=mosaic_fn, default=reference_fn)
    if not triton_ok:
        _unfit("triton", shape, needs[1])
    return lax.platform_dependent(*args, cpu=functools.partial(triton_fn, True),
                                  default=functools.partial(triton_fn, False))


def _on_row_kernels(implementation, mosaic_fn, triton_fn, reference_fn, width: int, *args):
    """A row kernel (``[M, width]`` operands) on ``args`` with their leading axes flattened
    into rows, or ``reference_fn(*args)``."""
    m = math.prod(args[0].shape[:-1])
    return _choose(
        implementation,
        mosaic_fn=lambda *a: xla.on_rows(mosaic_fn, *a),
        triton_fn=lambda interpret, *a: xla.on_rows(
            functools.partial(triton_fn, interpret=interpret), *a),
        reference_fn=reference_fn,
        mosaic_ok=mosaic.supported(m, width), triton_ok=triton.supported(width),
        shape=args[0].shape,
        needs=(f"rows of a multiple of {mosaic.ROW_MULTIPLE} channels, a multiple of "
               f"{mosaic.BLOCK_ROWS} rows", "rows of a multiple of 16 channels"),
        args=args)


def _on_matrix_kernels(implementation, mosaic_fn, triton_fn, reference_fn, a: jax.Array):
    """A weight kernel (``[B, M, N]`` operands) on ``a [..., M, N]`` with its leading axes
    flattened, then unflattened in every output, or ``reference_fn(a)``."""
    lead = a.shape[:-2]

    def flat(fn):
        def run(a):
            out = fn(a.reshape(-1, *a.shape[-2:]))
            return jax.tree.map(lambda o: o.reshape(*lead, *o.shape[1:]), out)
        return run

    return _choose(
        implementation,
        mosaic_fn=flat(mosaic_fn),
        triton_fn=lambda interpret, a: flat(functools.partial(triton_fn,
                                                              interpret=interpret))(a),
        reference_fn=reference_fn,
        mosaic_ok=mosaic.tiles_supported(*a.shape[-2:]),
        triton_ok=triton.cols_supported(*a.shape[-2:]),
        shape=a.shape,
        needs=(f"M, N multiples of {mosaic.TILE}", f"M, N multiples of {triton.COL_TILE}"),
        args=(a,))


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
    return _on_row_kernels(implementation, mosaic.quantize_rows, triton.quantize_rows,
                           xla.quantize_rows_reference, x.shape[-1], x)


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
    return _on_row_kernels(implementation, functools.partial(mosaic.gated_quantize_rows, act=act),
                           functools.partial(triton.gated_quantize_rows, act=act),
                           functools.partial(xla.gated_quantize_rows_reference, act=act),
                           z.shape[-1] // 2, z)


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
        implementation,
        functools.partial(mosaic.gated_grad_quantize_rows, act=act, out_dtype=out_dtype),
        functools.partial(triton.gated_grad_quantize_rows, act=act, out_dtype=out_dtype),
        lambda z, dh: xla.gated_grad_quantize_rows_reference(z, dh, act, out_dtype),
        z.shape[-1] // 2, z, dh)


def cols_t(a: jax.Array, *, implementation: Implementation = "auto"):
    """``a [..., M, N]`` column-wise quantized and transposed, ``(e4m3 [..., N, M], scale
    [..., N])``: the K-major copy a FP8 GEMM contracting ``M`` reads.

    Example:
      >>> import jax.numpy as jnp
      >>> q, s = cols_t(jnp.ones((1, 64, 128)).at[0, 3, 5].set(8.0))
      >>> q.shape, float(s[0, 5]), float(s[0, 0])
      ((1, 128, 64), 0.03125, 0.00390625)
    """
    return _on_matrix_kernels(implementation, mosaic.quantize_cols_t, triton.quantize_cols_t,
                              xla.quantize_cols_t_reference, a)


def cols_t_and_rows(a: jax.Array, *, implementation: Implementation = "auto"):
    """``a [..., M, N]``'s two FP8 copies, ``(cols_t(a), rows(a))``, from two passes over it
    where a kernel runs (the same bytes as the two calls).

    Example:
      >>> import jax.numpy as jnp
      >>> (qt, sc), (q, sr) = cols_t_and_rows(jnp.ones((1, 64, 128)))
      >>> qt.shape, q.shape
      ((1, 128, 64), (1, 64, 128))
    """
    return _on_matrix_kernels(implementation, mosaic.quantize_cols_t_and_rows,
                              triton.quantize_cols_t_and_rows,
                              xla.quantize_cols_t_and_rows_reference, a)
