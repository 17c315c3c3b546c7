"""The options: allowed values read off their Literal types, validated once, deprecated names."""

import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe
from moe import options as mo


@pytest.mark.parametrize("cls, field, tp", [
    (mo.DispatchOptions, "transport", mo.Transport),
    (mo.DispatchOptions, "dispatch_dtype", mo.WireDtype),
    (mo.DispatchOptions, "combine_grad_dtype", mo.WireDtype),
    (mo.DispatchOptions, "wire_implementation", mo.WireImplementation),
    (mo.DispatchOptions, "exchange_implementation", mo.ExchangeImplementation),
    (mo.ExpertOptions, "gemm_implementation", mo.GemmImplementation),
    (mo.ExpertOptions, "gemm_dtype", mo.GemmDtype),
    (mo.ExpertOptions, "dgrad_dtype", mo.GemmDtype),
    (mo.ExpertOptions, "wgrad_dtype", mo.GemmDtype),
    (mo.ExpertOptions, "save_z", mo.SaveZ),
])
def test_enum_fields_take_exactly_their_literal_values(cls, field, tp):
    allowed = mo.choices(tp)
    assert allowed and len(set(allowed)) == len(allowed)
    hints = typing.get_type_hints(cls)
    assert mo.choices(hints[field]) == allowed  # the field is annotated with that type
    for value in allowed:
        assert getattr(cls(**{field: value}), field) in allowed
    with pytest.raises(ValueError, match=rf"{field}='nope' is not supported; use one of"):
        cls(**{field: "nope"})


def test_choices_flattens_unions_with_none():
    assert mo.choices(typing.Literal["a", "b"] | None) == ("a", "b", None)
    assert mo.choices(typing.Literal["a"]) == ("a",)


@pytest.mark.parametrize("kw, err", [
    (dict(capacity_multiple=0), ValueError),
    (dict(capacity_factor=0.0), ValueError),
    (dict(capacity_factor="1"), TypeError),
    (dict(transport="ragged", capacity_factor=1.25), ValueError),
    (dict(overlap_chunks=0), ValueError),
])
def test_dispatch_options_reject_bad_numbers(kw, err):
    with pytest.raises(err):
        mo.DispatchOptions(**kw)


def test_axis_names_normalize():
    """One batch axis may be given as its name; a list of names becomes a tuple (hashable)."""
    assert mo.DispatchOptions(batch_axes="data").batch_axes == ("data",)
    assert mo.DispatchOptions(batch_axes=["data", "pipe"]).batch_axes == ("data", "pipe")
    assert hash(mo.DispatchOptions(batch_axes=["data"])) == hash(
        mo.DispatchOptions(batch_axes=("data",)))


@jax.jit  # one program, not one per op
def _layer_inputs():
    k = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(k[0], (2, 4, 16)), jax.random.normal(k[1], (16, 4)),
            jax.random.normal(k[2], (4, 16, 16)) * 0.1,
            jax.random.normal(k[3], (4, 8, 16)) * 0.1)


def test_moe_apply_opts_is_a_deprecated_name_of_options():
    x, router, wgu, wd = _layer_inputs()
    options = moe.MoEOptions.create(4, 2)
    want, _ = jax.jit(lambda *a: moe.moe_apply(*a, options=options))(x, router, wgu, wd)
    with pytest.warns(DeprecationWarning, match="opts=.* is deprecated; pass options="):
        got, _ = jax.jit(lambda *a: moe.moe_apply(*a, opts=options))(x, router, wgu, wd)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(TypeError, match="both options= and opts="):
        moe.moe_apply(x, router, wgu, wd, options=options, opts=options)
    with pytest.raises(TypeError, match="options must be a moe.MoEOptions"):
        moe.moe_apply(x, router, wgu, wd)


def test_module_opts_is_a_deprecated_name_of_options():
    options = moe.MoEOptions.create(4, 2)
    layer = nnx.eval_shape(lambda: moe.MoE(16, 8, options=options, rngs=nnx.Rngs(0)))
    assert layer.options is options
    with pytest.warns(DeprecationWarning, match="MoE.opts is deprecated"):
        assert layer.opts is options


def test_experts_apply_takes_the_options_object():
    x = jnp.ones((24, 16), jnp.float32)
    gs = jnp.array([8, 0, 12, 4], jnp.int32)
    wgu = jnp.full((4, 16, 16), 0.1, jnp.float32)
    wd = jnp.full((4, 8, 16), 0.1, jnp.float32)
    eo = moe.ExpertOptions(gemm_dtype="fp8", save_z="recompute", activation="gelu")
    # both in one jitted program (called eagerly they compile one program per op)
    got, want = jax.jit(lambda x, gs, wgu, wd: (
        moe.experts.experts_apply(x, gs, wgu, wd, options=eo),
        moe.gated_experts(x, gs, wgu, wd, gemm_dtype="fp8", save_z="recompute",
                          activation="gelu")))(x, gs, wgu, wd)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(TypeError, match="options must be a moe.ExpertOptions"):
        moe.experts.experts_apply(x, gs, wgu, wd, options={"gemm_dtype": "fp8"})


def test_compiling_for_cuda_resolves_auto_as_that_gpu_would():
    """A CPU compiling for a virtual Hopper topology makes the Hopper choices, then goes back."""
    from accel_kernels import platform
    from accel_kernels.gmm import api as gmm_api
    from moe.dispatch import collectives

    cpu = (gmm_api.auto_implementation(2), moe.auto_transport(1),
           collectives.resolve_ragged_impl("auto"))
    assert cpu == ("xla", "dense", "emulated")
    with platform.compiling_for_cuda((9, 0)):
        assert platform.cuda_capability() == (9, 0) and platform.target_platform() == "gpu"
        assert gmm_api.auto_implementation(2) == gmm_api.auto_implementation(3) == "mosaic"
        assert moe.auto_transport(1) == "dropless"
        assert collectives.resolve_ragged_impl("auto") == "native"
        with platform.compiling_for_cuda((8, 0)):  # an older GPU: Triton, padded einsum
            assert (gmm_api.auto_implementation(2),
                    gmm_api.auto_implementation(3)) == ("triton", "xla")
            assert not platform.prefer_mosaic_gpu()
        assert gmm_api.auto_implementation(2) == "mosaic"
    assert (gmm_api.auto_implementation(2), moe.auto_transport(1),
            collectives.resolve_ragged_impl("auto")) == cpu


# ----------------------------------------------------------------------------- renamed options


def test_the_former_kernel_names_map_onto_the_new_ones_with_a_warning():
    new = dict(gemm_implementation="xla", wire_implementation="xla",
               exchange_implementation="emulated")
    with pytest.warns(DeprecationWarning) as caught:
        old = moe.MoEOptions.create(4, 2, backend="xla", wire_kernels="xla",
                                    ragged_impl="emulated")
    assert {str(w.message).split("(")[1].split("=")[0] for w in caught} == {
        "backend", "wire_kernels", "ragged_impl"}
    assert old == moe.MoEOptions.create(4, 2, **new)
    with pytest.warns(DeprecationWarning, match=r"MoEOptions.replace\(backend=...\) is "
                                                "deprecated; pass gemm_implementation="):
        assert old.replace(backend="mosaic").experts.gemm_implementation == "mosaic"
    with pytest.raises(TypeError, match="got both backend= and gemm_implementation="):
        moe.MoEOptions.create(4, 2, backend="xla", gemm_implementation="xla")


def test_the_flat_keyword_functions_take_the_former_names():
    x, gs = jnp.ones((8, 16), jnp.float32), jnp.array([5, 3], jnp.int32)
    w_gu, w_d = jnp.ones((2, 16, 8)) * 0.1, jnp.ones((2, 4, 16)) * 0.1
    # Jitted (each call a fresh trace, so the warnings still fire): called eagerly these
    # compile one program per op.
    want = jax.jit(lambda: moe.gated_experts(x, gs, w_gu, w_d, gemm_implementation="xla"))()
    with pytest.warns(DeprecationWarning, match=r"gated_experts\(backend=...\)"):
        got = jax.jit(lambda: moe.gated_experts(x, gs, w_gu, w_d, backend="xla"))()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    k = jnp.ones((16, 32)) * 0.1
    with pytest.warns(DeprecationWarning, match=r"fp8_dense\(backend=...\)"):
        got = jax.jit(lambda: moe.fp8_dense(x, k, backend="xla"))()
    want = jax.jit(lambda: moe.fp8_dense(x, k, gemm_implementation="xla"))()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(TypeError, match=r"gated_experts\(\) got an unexpected keyword"):
        moe.gated_experts(x, gs, w_gu, w_d, kernels="xla")

    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])

    def rows(**kw):
        f = jax.shard_map(lambda x, ids: moe.dispatch(x, ids, num_experts=4, axis_name="expert",
                                                      transport="ragged", **kw)[0],
                          mesh=mesh, in_specs=(jax.P(), jax.P()), out_specs=jax.P())
        f = jax.jit(f)
        return f(jnp.arange(32.0).reshape(8, 4), jnp.array([[0, 1], [2, 3]] * 4, jnp.int32))

    with pytest.warns(DeprecationWarning) as caught:
        got = rows(ragged_impl="emulated", wire_kernels="xla")
    assert sorted(str(w.message).split("=")[0] for w in caught) == [
        "dispatch(ragged_impl", "dispatch(wire_kernels"]
    want = rows(exchange_implementation="emulated", wire_implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------------------- resolution


@pytest.mark.parametrize("mesh_shape, transport, gemm, chunks", [
    ((1, 1), "auto", "auto", "auto"),
    ((2, 4), "auto", "auto", "auto"),
    ((1, 8), "dropless", "mosaic", "auto"),
    ((2, 4), "ragged", "auto", 2),
    ((1, 8), "dense", "triton", "auto"),
])
def test_resolve_decides_every_auto_but_the_wire_kernels(mesh_shape, transport, gemm, chunks):
    mesh = jax.make_mesh(mesh_shape, ("data", "expert"), devices=jax.devices()[:8])
    options = moe.MoEOptions.create(6, 2, transport=transport, gemm_implementation=gemm,
                                    overlap_chunks=chunks)
    r = options.resolve(8192, 128, 64, mesh=mesh)
    ep = mesh_shape[1]
    assert r.dispatch.transport == (moe.auto_transport(ep) if transport == "auto"
                                    else transport)
    assert isinstance(r.dispatch.overlap_chunks, int)
    assert r.dispatch.exchange_implementation in ("native", "emulated")
    assert r.experts.gemm_implementation in ("xla", "triton", "mosaic")
    assert r.dispatch.batch_axes == ("data",) and r.token_axes == ("data", "expert")
    assert r.num_slots == -(-6 // ep) * ep and r.expert_axis_size == ep
    assert r.group_alignment == (128 if (r.dispatch.transport, r.experts.gemm_implementation)
                                 == ("dropless", "mosaic") else None)
    assert r.dispatch.wire_implementation == "auto"  # the kernel layer's per-gather rule
    # The parts as given, but for what was decided.
    assert r.router is options.router and r.experts.save_z == options.experts.save_z
    assert options.resolve(8192, 128, 64, mesh=mesh) == r  # hashable, deterministic


def test_resolve_is_the_one_validation_of_a_call():
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"d_model \(for dispatch_dtype='fp8'\) = 96 must be"):
        moe.MoEOptions.create(4, 2, dispatch_dtype="fp8").resolve(64, 96, 64, mesh=mesh)
    with pytest.raises(ValueError, match="expert_axis='experts' is not an axis of the mesh"):
        moe.MoEOptions.create(4, 2, expert_axis="experts").resolve(64, 128, 64, mesh=mesh)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        moe.MoEOptions.create(4, 2).resolve(64, 128, 64, mesh="mesh")


def test_the_resolved_options_reach_the_experts_unchanged(monkeypatch):
    """One resolution per call; its object, as it is, reaches the chunks' plans and the
    experts, and nothing below the top resolves or checks the options again."""
    from accel_kernels.gmm import api as gmm_api
    from moe import layer, pipeline

    resolved, seen = [], []
    real_resolve, real_plans, real_experts = (moe.MoEOptions.resolve,
                                              layer.plan_build.chunk_plans, pipeline.run_experts)

    def resolve(self, *a, **kw):
        resolved.append(real_resolve(self, *a, **kw))
        return resolved[-1]

    def chunk_plans(ids, options, *a, **kw):
        seen.append(("plans", options))
        return real_plans(ids, options, *a, **kw)

    def run_experts(x, gs, banks, options, **kw):
        seen.append(("experts", options))
        return real_experts(x, gs, banks, options, **kw)

    def refused(*a, **kw):
        raise AssertionError("the options were checked or resolved again below the top")

    monkeypatch.setattr(moe.MoEOptions, "resolve", resolve)
    monkeypatch.setattr(layer.plan_build, "chunk_plans", chunk_plans)
    monkeypatch.setattr(pipeline, "run_experts", run_experts)
    monkeypatch.setattr(gmm_api, "resolve", refused)
    monkeypatch.setattr(moe.MoEOptions, "check", refused)
    x, router, wgu, wd = _layer_inputs()
    mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices()[:8])
    options = moe.MoEOptions.create(4, 2, transport="dropless", overlap_chunks=2,
                                    local_first=True)
    jax.eval_shape(lambda *a: moe.moe_apply(*a, options=options, mesh=mesh), x, router, wgu,
                   wd)
    assert len(resolved) == 1
    assert [kind for kind, _ in seen] == ["plans", "experts", "experts", "experts"]
    assert seen[0][1] is resolved[0]
    assert all(o is resolved[0].experts for kind, o in seen[1:])
