"""One device on the expert axis with FP8 gradient GEMMs: the experts and the combine run as
one custom VJP (moe.experts.fused_combine) whose backward quantizes the experts' output gradient
as it gathers it from the token gradients. The rows must be the bytes of gathering then
quantizing, so the layer's outputs and gradients are bit for bit those of the two VJPs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _meshes import make_mesh

import moe
from accel_kernels.quant import xla as quant_xla
from accel_kernels.wire import api as wire_api
from accel_kernels.wire import triton as wire_triton
from moe.dispatch import plan_build
from moe.experts import fp8_gemm, fused_combine


def _bytes(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype == jnp.float8_e4m3fn else a


@pytest.mark.parametrize("wire_dtype", [jnp.bfloat16, jnp.float32])
def test_weighted_rows_kernel_gives_the_gather_then_quantize_bytes(wire_dtype):
    rng = np.random.default_rng(3)
    t, k, d = 6, 2, 256
    g = rng.standard_normal((t, d)).astype(np.float32)
    g[1] *= 2.0 ** -40  # tiny rows: scales far below 1
    g[2] = 0
    g[3, 9] = np.nan
    g = jnp.asarray(g, jnp.bfloat16)
    w = rng.uniform(0.01, 1.0, t * k).astype(np.float32)
    w[5] = 0.0
    w = jnp.asarray(w)
    slot = jnp.array([0, 3, 12, 5, 7, -1, 2, 11, 6, 40], jnp.int32)  # 12, -1, 40: out of range

    @jax.jit  # one program (eager, each op would compile its own)
    def gather_then_quantize(g, w, slot):
        sent = wire_api.gather_weighted_rows(g, w, jnp.where(slot < 0, t * k, slot), top_k=k,
                                               wire=jnp.dtype(wire_dtype), block_size=d)
        return quant_xla.quantize_rows_reference(sent)

    want = gather_then_quantize(g, w, slot)
    got = jax.jit(functools.partial(wire_triton.gather_weighted_rows_quantized, top_k=k,
                                    wire_dtype=wire_dtype, interpret=True))(g, w, slot)
    xla = jax.jit(functools.partial(fp8_gemm.rows_from_weighted, top_k=k,
                                    wire_dtype=wire_dtype))(g, w, slot)
    for path in (got, xla):
        for a, b in zip(path, want, strict=True):
            np.testing.assert_array_equal(_bytes(a), _bytes(b))
    s = np.asarray(got[1])
    assert np.isnan(s[[4, 8]]).all()  # slots 7 and 6: token 3, NaN
    assert s[2] == s[3] == s[5] == s[9] == 2.0**-126  # out of range; weight 0 on a zero row


# Small (4 experts, 64 tokens): the bytes compared do not depend on the size, the compile
# and the CPU's emulated GEMMs do.
E, K, D, F, T = 4, 2, 256, 128, 64


@functools.partial(jax.jit, static_argnums=(0, 1))
def _inputs(dtype, data):
    """x, router, w_gate_up, w_down: one program (eager, each random op compiles its own)."""
    keys = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(keys[0], (data, T, D), dtype)
    router = jax.random.normal(keys[1], (D, E), jnp.float32) * 0.1
    wgu = (jax.random.normal(keys[2], (E, D, 2 * F)) * D**-0.5).astype(dtype)
    wd = (jax.random.normal(keys[3], (E, F, D)) * F**-0.5).astype(dtype)
    return x, router, wgu, wd


@functools.cache
def _layer_grads(backend: str, dispatch_dtype, fused: bool, dtype=jnp.bfloat16, data=1):
    x, router, wgu, wd = _inputs(dtype, data)
    opts = moe.MoEOptions.create(E, K, transport="dropless", gemm_implementation=backend,
                                 dispatch_dtype=dispatch_dtype, gemm_dtype="fp8",
                                 dgrad_dtype="fp8", wgrad_dtype="fp8")

    def loss(x, router, wgu, wd):
        y, _ = moe.moe_apply(x, router, wgu, wd, options=opts, mesh=make_mesh((data, 1)))
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(y.astype(jnp.float32))), y

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    real, seen = fused_combine.applies, []

    def spy(*a):  # fused: the layer must take the one-VJP path; else: two custom VJPs
        seen.append(real(*a))
        return fused and seen[-1]

    try:
        fused_combine.applies = spy
        out = fn(x, router, wgu, wd)
    finally:
        fused_combine.applies = real
    assert seen == [True], seen
    return out


@pytest.mark.parametrize("backend,dispatch_dtype,dtype,data", [
    ("mosaic", "fp8", jnp.bfloat16, 1),  # the aligned layout, FP8 tokens (what one GPU runs)
    ("xla", None, jnp.bfloat16, 1),
    ("xla", None, jnp.float32, 1),
    ("mosaic", "fp8", jnp.bfloat16, 2),  # data parallel, one device per expert group
])
def test_layer_through_the_fused_combine_gives_the_two_vjps_bytes(backend, dispatch_dtype,
                                                                  dtype, data):
    got = _layer_grads(backend, dispatch_dtype, True, dtype, data)
    want = _layer_grads(backend, dispatch_dtype, False, dtype, data)
    leaves = jax.tree.leaves(got)
    assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in leaves)
    assert float(jnp.abs(got[1][1]).max()) > 0  # the router's gradient flows
    for g, w in zip(leaves, jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_applies_only_where_nothing_is_sent_and_dy_is_read_as_fp8():
    from moe import ExpertOptions
    from moe.experts.vjp import Call

    ids = jax.ShapeDtypeStruct((2, 2), jnp.int32)
    statics = plan_build.PlanStatics(num_experts=4, axis_name="expert", axis_size=1,
                                     x_dtype="float32", block_size=128)
    # the decision reads the plans' static fields only: abstract plans (nothing compiled)
    plans = jax.eval_shape(lambda ids: (
        plan_build.dropless_plan(ids, statics, buckets=(4,)),
        plan_build.ragged_plan(ids, statics, exchange_implementation="native"),
        plan_build.dense_plan(ids, statics, capacity=8)), ids)
    plan, ragged, dense = plans
    fp8_all = Call(experts=ExpertOptions(gemm_implementation="mosaic", gemm_dtype="fp8",
                                         dgrad_dtype="fp8", wgrad_dtype="fp8"),
                   fp8_block_size=128, mask_rows=True)
    assert fused_combine.applies(fp8_all, plan, None)
    assert fused_combine.applies(fp8_all, ragged, None)
    assert not fused_combine.applies(fp8_all, dense, None)  # the padded layout
    assert not fused_combine.applies(fp8_all, plan, "fp8")  # FP8 gradient wire
    bf16_wgrad = dataclasses.replace(
        fp8_all, experts=dataclasses.replace(fp8_all.experts, wgrad_dtype="bf16"))
    assert not fused_combine.applies(bf16_wgrad, plan, None)
    plan = dataclasses.replace(plan, axis_size=2)
    assert not fused_combine.applies(fp8_all, plan, None)
