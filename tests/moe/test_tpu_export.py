"""The MoE layer's forward + backward lowered for TPU on a CPU-only machine (``jax.export``).

A TPU-only failure (a kernel or collective TPU cannot lower, a CUDA-only path picked by an
``'auto'`` option) shows here without a TPU. The library makes its ``'auto'`` choices at trace
time from ``jax.default_backend()``, so the test reports ``'tpu'`` there, as a TPU host does:
the experts then run ``ragged_dot`` / einsum, the wire encode and layout run in XLA (the
Pallas wire kernels are CUDA-only), and the ragged transport uses XLA's native
``ragged_all_to_all``.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import export

import moe

CASES = [("dense", {}), ("ragged", {}), ("dense", dict(dispatch_dtype="fp8", save_z="fp8"))]


@pytest.mark.parametrize("transport,extra", CASES, ids=["dense", "ragged", "dense-fp8"])
def test_moe_layer_forward_backward_exports_for_tpu(transport, extra, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    opts = moe.MoEOptions.create(8, 2, transport=transport, fp8_block_size=32, **extra)
    model = moe.MoE(128, 32, options=opts, mesh=mesh, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def step(params, x):
        def loss(params, x):
            y, aux = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(y.astype(jnp.float32) ** 2) + 0.01 * aux["load_balance_loss"]

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)

    x = jax.random.normal(jax.random.key(1), (4, 16, 128), jnp.bfloat16)
    # ragged_all_to_all is a custom call without export's compatibility guarantee; TPU's XLA
    # implements it.
    checks = [export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    exp = export.export(jax.jit(step), platforms=("tpu",), disabled_checks=checks)(params, x)
    assert exp.platforms == ("tpu",)
    # The ops alone: location metadata names source files, and a function traced first by
    # another test of the same process (tests/accel_kernels/wire/test_wire_triton.py) keeps
    # that file's name in the locations of this export.
    text = "\n".join(re.sub(r"\bloc\(.*$", "", ln) for ln in exp.mlir_module().splitlines()
                     if not ln.startswith("#loc"))
    targets = set(re.findall(r"custom_call @([\w$.]+)", text))
    spmd = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "xla_python_cpu_callback"}
    assert targets - spmd <= {"ragged_all_to_all"}, targets  # no Pallas / Triton / Mosaic call
    assert "tpu_custom_call" not in text and "triton" not in text
    if transport == "ragged":
        assert "ragged_all_to_all" in targets  # the native exchange, not the CPU emulation
    else:
        assert "stablehlo.all_to_all" in text
    assert exp.mlir_module_serialized  # the artifact a TPU host would compile
