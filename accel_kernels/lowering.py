"""The jax versions the GPU kernels are tested on, and a clear error where one does not lower.

The Pallas Mosaic GPU kernels lean on jax internals that change between releases (jax 0.12's
transfer planner, for one, rejects global stores that earlier versions took). The test suite
lowers every kernel for CUDA on jax :data:`TESTED_JAX` (lowest, highest). On a jax outside that
range, :func:`check_kernel_lowers` lowers each kernel once, at its first use with a given shape,
before it is placed in the user's program, and turns a failure into a
:class:`KernelLoweringError` that names the kernel, the jax version and the option that avoids
the kernel. On a tested jax it costs a version comparison.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

import jax

__all__ = ["TESTED_JAX", "KernelLoweringError", "check_kernel_lowers", "is_tested",
           "version_tuple"]

TESTED_JAX = ("0.10.2", "0.12.1")
"""The lowest and highest jax the kernels' tests passed on (CI runs both; on the highest, its
``jax_internals`` pass: lowerings, interpreted kernels, doctests)."""


class KernelLoweringError(ValueError):
    """A GPU kernel of this package does not lower on the installed jax."""


def version_tuple(version: str) -> tuple[int, ...]:
    """``'0.12.0.1'`` -> ``(0, 12, 0, 1)`` (a suffix such as ``.dev2026`` is dropped).

    Example:
      >>> version_tuple("0.12.0.1"), version_tuple("0.13.0.dev20270101")
      ((0, 12, 0, 1), (0, 13, 0))
    """
    parts = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if m is None or m.group(0) != part:
            if m is not None:
                parts.append(int(m.group(0)))
            break
        parts.append(int(part))
    return tuple(parts)


def is_tested(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed jax) lies in :data:`TESTED_JAX`.

    Example:
      >>> is_tested("0.11.2"), is_tested("0.13.0")
      (True, False)
    """
    v = version_tuple(version or jax.__version__)
    lo, hi = (version_tuple(x) for x in TESTED_JAX)
    return lo <= v <= hi


@functools.cache
def _installed_is_tested() -> bool:
    return is_tested()


_LOWERED: dict[tuple, None] = {}


def check_kernel_lowers(name: str, call: Callable, operands: Sequence[jax.Array], *,
                        avoid: str) -> None:
    """Lower ``call(*operands)`` (one kernel) for CUDA once per shape if the installed jax is
    untested, raising :class:`KernelLoweringError` if that fails.

    Args:
      name: the kernel's name (for the message).
      call: the kernel call, a function of arrays.
      operands: its operands (arrays or tracers: only shapes and dtypes are read).
      avoid: the option that keeps the layer off this kernel, e.g. ``"wire_implementation='xla'"``.

    Raises:
      KernelLoweringError: the kernel does not lower on this jax.

    Example:
      >>> import jax.numpy as jnp
      >>> check_kernel_lowers("add", lambda x: x + 1, [jnp.ones(4)], avoid="-")  # tested jax
    """
    if _installed_is_tested():
        return
    avals = tuple(jax.ShapeDtypeStruct(jax.typeof(o).shape, jax.typeof(o).dtype)
                  for o in operands)
    key = (name, avals)
    if key in _LOWERED:
        return
    checks = [jax.export.DisabledSafetyCheck.custom_call(c)
              for c in ("mosaic_gpu", "mosaic_gpu_v2", "__gpu$xla.gpu.triton")]
    try:
        jax.export.export(jax.jit(call), platforms=["cuda"], disabled_checks=checks)(*avals)
    except Exception as e:
        lo, hi = TESTED_JAX
        raise KernelLoweringError(
            f"the GPU kernel {name} does not lower on jax {jax.__version__} for operands "
            f"{[f'{a.dtype}{list(a.shape)}' for a in avals]} ({type(e).__name__}: "
            f"{str(e)[:300]}). This package's kernels are tested on jax {lo} to {hi}: install "
            f"one of those (pip install 'jax<={hi}'), or keep the layer off this kernel with "
            f"{avoid}."
        ) from e
    _LOWERED[key] = None
