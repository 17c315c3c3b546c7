"""tests/_cuda_export lowers Mosaic GPU and Triton kernels for CUDA with no GPU present."""

import jax
import jax.numpy as jnp
import pytest
from _cuda_export import (
    MOSAIC_GPU_CALLS,
    TRITON_CALL,
    TRITON_DEPRECATED,
    cuda_mesh,
    export_for_cuda,
    loops_outside_scans,
)
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton
from jax.sharding import PartitionSpec as P


def _add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def _triton_params():
    """Explicit Triton parameters (jax 0.10 lowers a bare pallas_call with Mosaic GPU)."""
    return (getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams)()


def test_mosaic_gpu_kernel_lowers_for_cuda():
    kernel = plgpu.kernel(_add_one, out_type=jax.ShapeDtypeStruct((128, 128), jnp.float32))
    text = export_for_cuda(kernel, jax.ShapeDtypeStruct((128, 128), jnp.float32))
    assert any(f"custom_call @{name}(" in text for name in MOSAIC_GPU_CALLS), text[:2000]


@pytest.mark.filterwarnings(TRITON_DEPRECATED)
def test_triton_kernel_lowers_for_cuda_inside_shard_map():
    mesh = cuda_mesh((4,), ("x",))
    call = pl.pallas_call(_add_one, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                          compiler_params=_triton_params())
    f = jax.shard_map(lambda x: call(x) * 2.0, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                      check_vma=False)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=jax.NamedSharding(mesh, P("x")))
    text = export_for_cuda(f, x)
    assert text.count(TRITON_CALL) == 1 and "stablehlo.multiply" in text
    assert loops_outside_scans(text) == 0


def test_loops_outside_scans_sees_an_interpreted_kernel_but_not_a_cumsum():
    call = pl.pallas_call(_add_one, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
                          grid=(2,), interpret=True)
    x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    assert loops_outside_scans(export_for_cuda(call, x)) >= 1
    ids = jax.ShapeDtypeStruct((8,), jnp.int32)
    assert loops_outside_scans(export_for_cuda(jnp.cumsum, ids)) == 0
