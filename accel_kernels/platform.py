"""Which accelerator the kernels are chosen for: the default backend's, or a declared target.

``'auto'`` choices (the grouped-GEMM backend, the wire and quantization kernels, the
transport) follow the accelerator a program is compiled for. That is the process's default
device, unless :func:`compiling_for_cuda` declares another: a CPU-only machine compiling for a
virtual GPU topology (``xla_comm.schedule.topology_mesh(..., target_config=...)``) then makes
the choices a GPU of that compute capability would.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_TARGET: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "moe_cuda_target", default=None)


@contextlib.contextmanager
def compiling_for_cuda(capability: tuple[int, int]) -> Iterator[None]:
    """Within the block, resolve ``'auto'`` kernel choices as on an NVIDIA GPU of compute
    capability ``capability`` (e.g. ``(9, 0)``, Hopper), whatever this process's devices are.

    For compiling (not running) a program for GPUs this machine lacks; the kernels themselves
    lower per platform (``jax.lax.platform_dependent``), so only the ``'auto'`` choices need it.

    Example:
      >>> with compiling_for_cuda((9, 0)):
      ...     cuda_capability()
      (9, 0)
      >>> cuda_capability()  # on the CPU
    """
    major, minor = (int(v) for v in capability)
    token = _TARGET.set((major, minor))
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_platform() -> str:
    """``'gpu'`` inside :func:`compiling_for_cuda`, else ``jax.default_backend()``.

    Example:
      >>> target_platform()  # on the CPU
      'cpu'
    """
    return "gpu" if _TARGET.get() is not None else jax.default_backend()


def cuda_capability() -> tuple[int, int] | None:
    """The CUDA compute capability kernels are chosen for: the default device's (None off
    NVIDIA GPUs), or the one :func:`compiling_for_cuda` declares.

    Example:
      >>> cuda_capability() is None  # on the CPU
      True
    """
    if _TARGET.get() is not None:
        return _TARGET.get()
    if jax.default_backend() != "gpu":
        return None
    try:  # pragma: no cover - GPU only
        dev = jax.devices()[0]
        if "cuda" not in dev.client.platform_version.lower():
            return None
        major, minor = str(dev.compute_capability).split(".")
        return int(major), int(minor)
    except Exception:  # pragma: no cover - GPU only
        return None


def prefer_mosaic_gpu() -> bool:
    """Whether a kernel with Mosaic GPU and Triton versions should lower its Mosaic GPU one:
    unless the default device is an NVIDIA GPU older than Hopper (Mosaic GPU targets
    ``sm_90a``). With no GPU present (CI lowering for CUDA) Mosaic GPU is what gets lowered.

    Example:
      >>> prefer_mosaic_gpu()  # on the CPU
      True
    """
    cc = cuda_capability()
    return cc is None or cc[0] >= 9
