"""FP8 dispatch feeding FP8 expert GEMMs: the forward GEMM reads x's e4m3 rows converted from
the wire rows (moe.experts.fp8_gemm.rows_from_wire), which must be the bytes of quantizing the
decoded rows again, so the layer's outputs and gradients are bit for bit those of the decoded
path."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _meshes import make_mesh

import moe
from accel_kernels.quant import api as quant_api
from accel_kernels.quant import xla as quant_xla
from accel_kernels.wire import api as wire_api
from moe.dispatch import collectives
from moe.experts import fp8_gemm


def _bytes(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype == jnp.float8_e4m3fn else a


def test_rows_from_wire_are_the_requantized_decoded_rows():
    rng = np.random.default_rng(0)
    d, block = 512, 128
    x = rng.standard_normal((12, d)).astype(np.float32)
    # blocks of one row 2^-30 .. 2^12 apart (values fall below e4m3's normal range when
    # rescaled to the row's scale), a zero row, a zero block, NaN and inf rows, 1e-30
    x[1] *= np.repeat(2.0 ** np.array([-30, -8, 0, 12]), block)
    x[2] = 0
    x[3, :block] = 0
    x[4, 5], x[5, 9] = np.nan, np.inf
    x[6] *= 1e-30
    x = jnp.asarray(x, jnp.bfloat16)

    @jax.jit  # one program (eager, each op would compile its own)
    def wire_and_want(x):
        wire = wire_api.encode_rows(x, wire="fp8", block_size=block)
        decoded = wire_api.decode_rows(wire, wire="fp8", width=d, block_size=block,
                                         out_dtype=jnp.bfloat16)
        return wire, quant_api.rows(decoded)

    wire, want = wire_and_want(x)
    got = jax.jit(fp8_gemm.rows_from_wire, static_argnums=(1, 2))(wire, d, block)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bytes(g), _bytes(w))
    s = np.asarray(got[1])
    assert np.isnan(s[[4, 5]]).all() and s[2] == 2.0**-126


E, K, D, F, T = 8, 2, 256, 128, 128


@functools.partial(jax.jit, static_argnums=0)
def _inputs(expert_devices):
    """x, router, w_gate_up, w_down: one program (eager, each random op compiles its own)."""
    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], (expert_devices, T, D), jnp.bfloat16)
    router = jax.random.normal(keys[1], (D, E), jnp.float32) * 0.1
    wgu = (jax.random.normal(keys[2], (E, D, 2 * F)) * D**-0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(keys[3], (E, F, D)) * F**-0.5).astype(jnp.bfloat16)
    return x, router, wgu, wd


@functools.cache
def _layer_grads(backend: str, transport: str, expert_devices: int, with_wire: bool):
    x, router, wgu, wd = _inputs(expert_devices)
    mesh = make_mesh((1, expert_devices))
    opts = moe.MoEOptions.create(E, K, transport=transport, gemm_implementation=backend,
                                 dispatch_dtype="fp8", gemm_dtype="fp8", dgrad_dtype="fp8",
                                 wgrad_dtype="fp8")

    def loss(x, wgu, wd):
        y, _ = moe.moe_apply(x, router, wgu, wd, options=opts, mesh=mesh)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    if with_wire:
        return fn(x, wgu, wd)
    real = moe.MoEOptions.resolve
    try:  # the same layer with the decoded rows quantized again
        moe.MoEOptions.resolve = lambda *a, **kw: dataclasses.replace(
            real(*a, **kw), wire_to_experts=False)
        return fn(x, wgu, wd)
    finally:
        moe.MoEOptions.resolve = real


@pytest.mark.parametrize("backend,transport,devices", [
    ("mosaic", "dropless", 1),  # the aligned layout, one expert device (no exchange)
    ("xla", "dropless", 2),  # plain ragged rows after a dropless exchange
])
def test_layer_through_the_wire_rows_gives_the_decoded_paths_bytes(backend, transport,
                                                                    devices):
    got = _layer_grads(backend, transport, devices, True)
    want = _layer_grads(backend, transport, devices, False)
    leaves = jax.tree.leaves(got)
    assert all(np.isfinite(np.asarray(a, np.float32)).all() for a in leaves)
    assert float(jnp.abs(got[0][1]).max()) > 0
    for g, w in zip(leaves, jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_with_wire_needs_fp8_tokens_on_a_ragged_layout():
    from moe.dispatch import dispatch_with_wire

    mesh = make_mesh((1,))

    def call(transport, dtype):
        def body(x, ids):
            return dispatch_with_wire(x, ids, num_experts=4, axis_name="expert",
                                      transport=transport, dispatch_dtype=dtype,
                                      with_wire=True)[1]
        f = jax.shard_map(body, mesh=mesh, in_specs=(jax.P(), jax.P()), out_specs=jax.P())
        return jax.eval_shape(f, jax.ShapeDtypeStruct((16, 128), jnp.bfloat16),
                              jax.ShapeDtypeStruct((16, 2), jnp.int32))

    # One device sends nothing: the tokens and the token of each layout row stand in for
    # the wire rows (the GEMM's rows are made from them, test below).
    local = call("dropless", "fp8")
    assert isinstance(local, collectives.TokenRows)
    assert local.tokens.shape == (16, 128) and local.index.dtype == jnp.int32
    for transport, dtype in (("dense", "fp8"), ("dropless", None)):
        with pytest.raises(ValueError, match="with_wire needs"):
            call(transport, dtype)


def test_wire_rows_kernel_gives_the_reference_bytes():
    """The Pallas pass (interpreted here) that gathers wire rows and re-quantizes them per row
    writes the bytes of XLA's gather, decode and quantize_rows, out-of-range rows as zeros."""
    from accel_kernels.wire import triton as wire_triton

    rng = np.random.default_rng(1)
    d, block = 512, 128
    x = rng.standard_normal((6, d)).astype(np.float32)
    x[1] *= np.repeat(2.0 ** np.array([-30, -8, 0, 12]), block)
    x[2] = 0
    x[3, 7] = np.nan
    index = jnp.array([5, 1, -1, 3, 0, 6, 2, 4, 1], jnp.int32)  # -1 and 6: out of range

    @jax.jit  # one program (eager, each op would compile its own)
    def wire_and_want(x, index):
        wire = wire_api.encode_rows(x, wire="fp8", block_size=block)
        ok = (index >= 0) & (index < wire.shape[0])
        rows = jnp.where(ok[:, None], wire[jnp.clip(index, 0, wire.shape[0] - 1)], 0)
        return wire, quant_xla.quantize_rows_reference(wire_api.decode_rows(
            rows, wire="fp8", width=d, block_size=block, out_dtype=jnp.float32))

    wire, want = wire_and_want(jnp.asarray(x, jnp.bfloat16), index)
    got = jax.jit(functools.partial(wire_triton.gather_rows_quantized, width=d,
                                    block_size=block, interpret=True))(wire, index)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bytes(g), _bytes(w))
    assert not np.asarray(got[0][2], np.float32).any()
    assert np.isnan(np.asarray(got[1])[3])
    xla = jax.jit(fp8_gemm.rows_from_wire, static_argnums=(1, 2))(wire, d, block, index)
    for g, w in zip(xla, want, strict=True):  # the XLA path (what runs on CPU) agrees
        np.testing.assert_array_equal(_bytes(g), _bytes(w))


def test_local_rows_kernel_gives_the_wire_paths_bytes():
    """With nothing sent, one Pallas pass (interpreted here) makes the GEMM's e4m3 rows from
    the tokens: the bytes of encoding, gathering, decoding and quantizing per row (XLA), out
    of range rows as zeros, a NaN row as a NaN scale; the XLA path agrees."""
    from accel_kernels.wire import triton as wire_triton

    rng = np.random.default_rng(2)
    d, block = 512, 128
    x = rng.standard_normal((6, d)).astype(np.float32)
    x[1] *= np.repeat(2.0 ** np.array([-30, -8, 0, 12]), block)
    x[2] = 0
    x[3, 7] = np.nan
    x[4, 100] = np.inf
    x[5] *= 1e-30
    x = jnp.asarray(x, jnp.bfloat16)
    index = jnp.array([5, 1, -1, 3, 0, 6, 2, 4, 1, 12], jnp.int32)  # -1, 6, 12: out of range
    wire = jax.jit(functools.partial(wire_api.encode_rows, wire="fp8", block_size=block))(x)
    want = jax.jit(fp8_gemm.rows_from_wire, static_argnums=(1, 2))(wire, d, block, index)
    got = jax.jit(functools.partial(wire_triton.gather_local_rows_quantized,
                                    block_size=block, interpret=True))(x, index)
    xla = jax.jit(fp8_gemm.rows_from_tokens, static_argnums=2)(x, index, block)
    for path in (got, xla):
        for g, w in zip(path, want, strict=True):
            np.testing.assert_array_equal(_bytes(g), _bytes(w))
    s = np.asarray(got[1])
    assert np.isnan(s[[3, 7]]).all() and s[2] == 2.0**-126
    assert not np.asarray(got[0][2], np.float32).any()
