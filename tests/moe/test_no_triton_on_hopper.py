"""On Hopper nothing lowers to Pallas Triton, which jax 0.11 deprecates.

The MoE layer's forward + backward (bf16 and FP8 dispatch, dense and dropless transports, one
and two devices on the expert axis, FP8 GEMMs) and ``moe.fp8_dense`` are exported for CUDA on
an abstract H200 with the GEMMs ``gemm_implementation='auto'`` takes on Hopper (``'mosaic'``;
'auto' is resolved from the process's own platform, the CPU here): every Pallas kernel in them
is a Mosaic GPU call. The Triton kernels stay
for NVIDIA GPUs before Hopper and for widths the Mosaic GPU kernels do not take (their own
tests cover those).
"""

import jax
import jax.numpy as jnp
import pytest
from _cuda_export import TRITON_CALL, cuda_mesh, export_for_cuda, gemm_calls, kernel_calls
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe

E, K, D, F, TOKENS = 8, 2, 512, 256, 256
S = jax.ShapeDtypeStruct


def _missing(text: str, names: set[str]) -> set[str]:
    """Which of the kernels ``names`` the program does not call."""
    return {n for n in names if not kernel_calls(text, n)}


@pytest.mark.parametrize("transport,dispatch_dtype,n_ep", [
    ("dense", None, 2), ("dropless", "fp8", 2), ("dense", "fp8", 1), ("dropless", None, 1)])
def test_moe_layer_has_no_triton_kernel(transport, dispatch_dtype, n_ep):
    fp8 = dispatch_dtype == "fp8"
    gemms = dict(gemm_dtype="fp8", dgrad_dtype="fp8", wgrad_dtype="fp8") if fp8 else {}
    opts = moe.MoEOptions.create(E, K, transport=transport, dispatch_dtype=dispatch_dtype,
                                 gemm_implementation="mosaic", wire_implementation="auto",
                                 **gemms)
    mesh = cuda_mesh((1, n_ep), ("data", "expert"))

    def loss(x, router, w_gate_up, w_down):
        y, _ = moe.moe_apply(x, router, w_gate_up, w_down, options=opts, mesh=mesh)
        return jnp.sum(y.astype(jnp.float32))

    def sds(shape, dtype, spec):
        return S(shape, dtype, sharding=NamedSharding(mesh, spec))

    text = export_for_cuda(
        jax.grad(loss, argnums=(0, 2, 3)), sds((n_ep, TOKENS, D), jnp.bfloat16, P("expert")),
        sds((D, E), jnp.float32, P()), sds((E, D, 2 * F), jnp.bfloat16, P("expert")),
        sds((E, F, D), jnp.bfloat16, P("expert")))
    assert TRITON_CALL not in text
    assert len(gemm_calls(text)) >= 6  # two layers' forward, data and weight gradients
    want = {"fp8_weight_quantize", "fp8_quantize_rows"} if fp8 else set()
    assert not _missing(text, want | ({"wire_gather_encode"} if n_ep > 1 else set()))


def test_fp8_dense_has_no_triton_kernel():
    def loss(x, w):
        y = moe.fp8_dense(x, w, dgrad_dtype="fp8", wgrad_dtype="fp8",
                          gemm_implementation="mosaic")
        return jnp.sum(y.astype(jnp.float32))

    text = export_for_cuda(jax.grad(loss, argnums=(0, 1)), S((256, D), jnp.bfloat16),
                           S((D, 384), jnp.float32))
    assert TRITON_CALL not in text
    assert len(gemm_calls(text)) >= 2  # forward, data gradient
    assert not _missing(text, {"fp8_quantize_rows", "fp8_weight_quantize"})
