"""Which accelerator the default backend is: the kernels' backends are chosen from it."""

from __future__ import annotations

import jax


def cuda_capability() -> tuple[int, int] | None:
    """The default device's CUDA compute capability, or None off NVIDIA GPUs.

    Example:
      >>> cuda_capability() is None  # on the CPU
      True
    """
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
