"""Pallas Triton plumbing every Triton kernel here shares: the guarded import and one launcher.

The Triton kernels (`accel_kernels.gmm.triton`, `accel_kernels.quant.triton`,
`accel_kernels.wire.triton`) are what NVIDIA GPUs before Hopper run; the tests run them
interpreted on the CPU. On a jax whose Pallas Triton import fails :data:`PALLAS_IMPORT_ERROR`
says why and every Triton kernel reports itself unsupported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax

from accel_kernels import vma

try:  # Pallas (and its Triton dialect) ships with jax, but keep CPU-only imports safe.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    # jax >= 0.7 names it CompilerParams (older: TritonCompilerParams).
    TritonParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    PALLAS_IMPORT_ERROR: str | None = None
except Exception as e:  # pragma: no cover - depends on the installed jax
    pl = plgpu = TritonParams = None
    PALLAS_IMPORT_ERROR = f"{type(e).__name__}: {e}"


def launch(body: Callable, operands: Sequence[jax.Array], outs, *, grid: int | tuple[int, ...],
           name: str, interpret: bool, num_warps: int, num_stages: int = 1
           ) -> tuple[jax.Array, ...]:
    """``body`` as a ``pl.pallas_call`` named ``name`` over ``grid`` programs on ``operands``.

    Args:
      body: the kernel body (refs of the operands, then of the outputs).
      operands: its inputs.
      outs: ``(shape, dtype)`` of each output; they vary over the operands' mesh axes inside
        a check_vma ``shard_map``.
      grid: the programs.
      name: the kernel's name in traces and lowered modules.
      interpret: run the kernel in Pallas's interpreter (the CPU tests), outside the varying
        checks it does not type.
      num_warps, num_stages: the Triton compiler's parameters.

    Returns:
      The outputs, a tuple.
    """
    varying = vma.varying_of(*operands)

    def call(interp, *ops):
        return pl.pallas_call(
            body,
            out_shape=tuple(vma.out_struct(s, d, varying) for s, d in outs),
            grid=grid if isinstance(grid, tuple) else (grid,),
            interpret=interp,
            compiler_params=None if interp else TritonParams(num_warps=num_warps,
                                                             num_stages=num_stages),
            name=name,
        )(*ops)

    if interpret:
        return vma.unchecked(functools.partial(call, True), varying, *operands)
    return call(False, *operands)
