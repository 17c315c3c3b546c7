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
    got = moe.experts.experts_apply(x, gs, wgu, wd, options=eo)
    want = moe.gated_experts(x, gs, wgu, wd, gemm_dtype="fp8", save_z="recompute",
                             activation="gelu")
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

