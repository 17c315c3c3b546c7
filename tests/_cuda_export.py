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
    "TRITON_DEPRECATED",
    "cuda_mesh",
    "export_for_cuda",
    "gemm_calls",
    "kernel_calls",
    "kernel_names",
    "loops_outside_scans",
]

# The GPU the benchmarks run on (H200: compute capability 9.0, 132 SMs).
CUDA_DEVICE = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
TRITON_CALL = "__gpu$xla.gpu.triton"
TRITON_DEPRECATED = "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
"""A ``pytest.mark.filterwarnings`` filter for tests that lower Triton kernels on purpose (they
test the Triton kernels, which GPUs before Hopper run; jax >= 0.11 deprecates Pallas Triton)."""
MOSAIC_GPU_CALLS = ("mosaic_gpu", "mosaic_gpu_v2")
# The suffix of a Triton kernel's Mosaic GPU twin (moe.kernels.quant.mosaic,
# moe.kernels.wire.mosaic); jax
# 0.11 numbers a Mosaic GPU module's symbol (``fp8_quantize_rows_mgpu_17``).
MOSAIC_TWIN = r"_mgpu(?:_\d+)?"


def _kernel_lines(text: str) -> list[str]:
    """The custom-call lines of Triton and Mosaic GPU kernels."""
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line
            and (TRITON_CALL in line or any(f"@{c}(" in line for c in MOSAIC_GPU_CALLS))]


def _named(name: str) -> re.Pattern:
    # Triton: ``name = "..."`` in the backend config; Mosaic GPU: a NUL-delimited symbol of the
    # serialized module.
    return re.compile(rf'(?:"|\\00){name}(?:"|\\00)')


def kernel_calls(text: str, name: str) -> list[str]:
    """The custom-call lines of the kernel named ``name``, in Triton or Mosaic GPU (where the
    row kernels are named ``name + "_mgpu"``, numbered since jax 0.11)."""
    pat = _named(rf"{re.escape(name)}(?:{MOSAIC_TWIN})?")
    return [line for line in _kernel_lines(text) if pat.search(line)]


def gemm_calls(text: str) -> list[str]:
    """The custom-call lines of the Mosaic GPU GEMM kernels (`moe.kernels.gmm.mosaic_kernel`:
    ``gmm_*``,
    ``tgmm_*``, ``dense_*`` with one group)."""
    pat = _named(r"(?:dense_)?t?gmm_\w+")
    return [line for line in _kernel_lines(text) if TRITON_CALL not in line and pat.search(line)]


def kernel_names(text: str, pattern: str) -> list[str]:
    """Sorted names (``_mgpu`` dropped) of the kernels whose name matches ``pattern``
    (a regex for the whole name), one per call."""
    pat = _named(rf"({pattern})")
    names = []
    for line in _kernel_lines(text):
        m = pat.search(line)
        if m:
            names.append(re.sub(MOSAIC_TWIN + "$", "", m.group(1)))
    return sorted(names)


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


F8 = "f8E4M3FN"
_DEF = re.compile(r"^\s*(%[\w.]+)(?::\d+)?\s*=\s*([\w.\"]+)")


def _uses(lines: list[str], at: int) -> list[tuple[int, str]]:
    """The lines after ``lines[at]`` that use the SSA value it defines, up to the next line
    that defines that name again (MLIR restarts numbering in isolated regions: shard_map
    bodies, private functions)."""
    name = _DEF.match(lines[at]).group(1)
    token = re.compile(re.escape(name) + r"(?![\w#:])")
    out = []
    for i in range(at + 1, len(lines)):
        m = _DEF.match(lines[i])
        if m and m.group(1) == name:
            break
        if token.search(lines[i].split("=", 1)[1] if m else lines[i]):
            out.append((i, lines[i]))
    return out


def assert_no_widened_fp8(text: str) -> None:
    """No e4m3 value of an exported module is converted to a wider type, except to be rescaled
    and converted straight back to e4m3 (multiplies by a power of two: a chain XLA fuses, so
    no wide copy is written).

    Each widening ``stablehlo.convert`` must feed only ``stablehlo.multiply`` ops whose results
    feed only converts back to e4m3.
    """
    widen = re.compile(rf"stablehlo\.convert .*\(tensor<[^>]*x{F8}>\) -> tensor<[^>]*>")
    narrow = re.compile(rf"stablehlo\.convert .*-> tensor<[^>]*x{F8}>")
    lines = text.splitlines()
    for at, line in enumerate(lines):
        if not widen.search(line):
            continue
        for i, use in _uses(lines, at):
            ok = "stablehlo.multiply" in use and all(
                narrow.search(u) for _, u in _uses(lines, i))
            assert ok, f"an e4m3 value converted to a wide type and kept: {line.strip()}"
