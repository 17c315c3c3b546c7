"""Lower JAX programs with Pallas kernels (Triton or Mosaic GPU) for CUDA on a machine with no GPU.

``export_for_cuda(fn, *avals)`` returns the StableHLO text that ``jax.export`` produces for
``platforms=('cuda',)``, kernels included as custom calls, so a test can check on CPU that the
compiled GPU path traces and lowers. Since jax 0.11, lowering a Triton kernel needs to know
which GPU it targets; with no GPU present it reads an abstract device from the ambient
abstract mesh (``jax.sharding.AbstractDevice``). Both pieces are provided here:

- top level: ``export_for_cuda`` sets an abstract mesh carrying ``CUDA_DEVICE``;
- inside ``jax.shard_map``: the map's own mesh becomes the ambient one, so build it with
  ``cuda_mesh(shape, names)`` (an ``AbstractMesh`` carrying ``CUDA_DEVICE``) and give the
  avals ``NamedSharding(cuda_mesh, spec)`` shardings.

Example::

    mesh = cuda_mesh((4,), ("expert",))
    f = jax.shard_map(step, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
    x = jax.ShapeDtypeStruct((4 * 128, 256), jnp.bfloat16,
                             sharding=jax.NamedSharding(mesh, P("expert")))
    text = export_for_cuda(f, x)
    assert text.count(TRITON_CALL) == 2
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from xla_comm import lowered
from xla_comm.lowered import MOSAIC_GPU_CALLS, TRITON_CALL, loops_outside_scans

__all__ = [
    "CUDA_DEVICE",
    "MOSAIC_GPU_CALLS",
    "TRITON_CALL",
    "TRITON_DEPRECATED",
    "cuda_mesh",
    "export_for_cuda",
    "gemm_calls",
    "kernel_calls",
    "kernel_names",
    "loops_outside_scans",
]

# A Hopper GPU of 132 SMs (compute capability 9.0), the kind the benchmarks run on.
CUDA_DEVICE = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
TRITON_DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
"""A ``pytest.mark.filterwarnings`` filter for tests that lower Triton kernels on purpose (they
test the Triton kernels, which GPUs before Hopper run; jax >= 0.11 deprecates Pallas Triton)."""
# The suffix of a Triton kernel's Mosaic GPU twin (accel_kernels.quant.mosaic,
# accel_kernels.wire.mosaic): the kernels' naming convention, not the lowering's.
MOSAIC_TWIN = "_mgpu"


def kernel_calls(text: str, name: str) -> list[str]:
    """The custom-call lines of the kernel named ``name``, in Triton or Mosaic GPU (where the
    row kernels are named ``name + "_mgpu"``)."""
    return lowered.kernel_calls(text, rf"{re.escape(name)}(?:{MOSAIC_TWIN})?")


def gemm_calls(text: str) -> list[str]:
    """The custom-call lines of the Mosaic GPU GEMM kernels (`accel_kernels.gmm.mosaic_kernel`:
    ``gmm_*``, ``tgmm_*``, ``dense_*`` with one group)."""
    return [line for line in lowered.kernel_calls(text, r"(?:dense_)?t?gmm_\w+?")
            if TRITON_CALL not in line]


def kernel_names(text: str, pattern: str) -> list[str]:
    """Sorted names (``_mgpu`` dropped) of the kernels whose name matches ``pattern``
    (a regex for the whole name), one per call."""
    return sorted(re.sub(MOSAIC_TWIN + "$", "", n)
                  for n in lowered.kernel_names(text, rf"(?:{pattern})(?:{MOSAIC_TWIN})?"))


def cuda_mesh(
    axis_shapes: Sequence[int],
    axis_names: Sequence[str],
    *,
    device: AbstractDevice = CUDA_DEVICE,
) -> AbstractMesh:
    """An ``AbstractMesh`` (Explicit axes) whose devices are ``device``: for ``shard_map``."""
    return AbstractMesh(tuple(axis_shapes), tuple(axis_names),
                        axis_types=(AxisType.Explicit,) * len(axis_shapes),
                        abstract_device=device)


def export_for_cuda(
    fn: Callable, *avals: jax.ShapeDtypeStruct | jax.Array, device: AbstractDevice = CUDA_DEVICE
) -> str:
    """The StableHLO text of ``jax.jit(fn)`` exported for CUDA, Triton and Mosaic GPU calls
    allowed; ``avals`` are ``jax.ShapeDtypeStruct``s (with shardings for sharded programs) or
    arrays."""
    allowed = [export.DisabledSafetyCheck.custom_call(name)
               for name in (TRITON_CALL, *MOSAIC_GPU_CALLS)]
    with jax.sharding.use_abstract_mesh(cuda_mesh((), (), device=device)):
        exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=allowed)(*avals)
    return exported.mlir_module()
