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

__all__ = [
    "CUDA_DEVICE",
    "MOSAIC_GPU_CALLS",
    "TRITON_CALL",
    "cuda_mesh",
    "export_for_cuda",
    "loops_outside_scans",
]

# The GPU the benchmarks run on (H200: compute capability 9.0, 132 SMs).
CUDA_DEVICE = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CALLS = ("mosaic_gpu", "mosaic_gpu_v2")


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


def loops_outside_scans(text: str) -> int:
    """``stablehlo.while`` ops of an exported module outside ``chlo.scan`` decompositions.

    An interpreted Pallas kernel lowers to such a loop; since jax 0.11 ``jnp.cumsum`` lowers for
    CUDA to a ``chlo.scan`` whose private ``@chlo.scan.impl_*`` function holds a while loop too.
    """
    funcs = re.split(r"^\s*func\.func ", text, flags=re.MULTILINE)
    return sum(f.count("stablehlo.while") for f in funcs if "@chlo.scan." not in f.split("(")[0])
