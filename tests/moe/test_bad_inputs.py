"""A catalogue of bad inputs across muon_jax and moe: each raises ValueError/TypeError whose
message names the offending argument or leaf path (and, where the library has one, the fix).

Cases the reliability review found slipping through (a gradient of the wrong shape, an int
gradient on the sharded path, an int mu_dtype, a NaN loss scale, an empty MoE batch) are kept
here as regular cases now that the library catches them.
"""

import functools
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import moe
import muon_jax
from muon_jax import MuonDimensionNumbers as MDN
from muon_jax import loss_scale, newton_schulz


@functools.cache
def _mesh(kind=AxisType.Auto):
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(kind, kind))


def _put(x, spec=None, mesh=None):
    mesh = mesh or _mesh()
    return jax.device_put(x, NamedSharding(mesh, P() if spec is None else spec))


def _params():
    return {"w": _put(jnp.ones((4, 8)))}


def _sharded_update(grads):
    tx = muon_jax.scale_by_muon(sharding=muon_jax.ShardingOptions(_mesh()))
    params = _params()
    return jax.eval_shape(lambda g: tx.update(g, tx.init(params)), grads)  # trace, no compile


def _reduced_view_of_sharded():
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        return muon_jax.reduced_view({"w": _put(jnp.ones((8, 16)), P("data", None), mesh)},
                                     "data")


def _moe(**kw):
    mesh = kw.pop("mesh", _mesh())
    d_model, d_ff = kw.pop("d_model", 64), kw.pop("d_ff", 32)
    opts = moe.MoEOptions.create(kw.pop("num_experts", 8), kw.pop("top_k", 2), **kw)
    return moe.MoE(d_model, d_ff, options=opts, mesh=mesh, rngs=nnx.Rngs(0))


def _call(x_shape=(2, 8, 64), **kw):
    layer = _moe(**kw)
    with jax.set_mesh(_mesh()):
        return nnx.jit(lambda m, x: m(x))(layer, jnp.ones(x_shape))


def _moe_apply(w_down_shape=(8, 32, 64), bias_shape=(8,), expert_bias=False, **kw):
    opts = moe.MoEOptions.create(8, 2, expert_bias=expert_bias)
    return jax.eval_shape(
        lambda *a: moe.moe_apply(*a, options=opts, mesh=_mesh(), **kw),
        jnp.ones((2, 8, 64)), jnp.ones((64, 8)), jnp.ones((8, 64, 64)), jnp.ones(w_down_shape),
        jnp.zeros(bias_shape))


def _mdn_init(dims, shape=(4, 8)):
    return muon_jax.scale_by_muon(dimension_numbers={"w": dims}).init({"w": jnp.ones(shape)})


CASES = {
    # ---------------------------------------------------------------- muon_jax: options
    "ns_steps=0": (ValueError, "ns_steps must be >= 1",
                   lambda: muon_jax.scale_by_muon(ns_steps=0)),
    "ns_steps float": (TypeError, "ns_steps must be a Python int",
                       lambda: muon_jax.muon(0.1, ns_steps=5.0)),
    "ns_coeffs NaN": (ValueError, "ns_coeffs must be finite",
                      lambda: muon_jax.scale_by_muon(ns_coeffs=(float("nan"), 1.0, 1.0))),
    "ns_coeffs shape": (ValueError, r"ns_coeffs must have shape \(3,\) or \(T, 3\)",
                        lambda: muon_jax.scale_by_muon(ns_coeffs=(1.0, 2.0))),
    "ns_coeffs strings": (TypeError, "ns_coeffs must be a schedule name",
                          lambda: muon_jax.scale_by_muon(ns_coeffs=("a", "b", "c"))),
    "shape_scaling": (ValueError, "shape_scaling='moonlight' is not supported",
                      lambda: muon_jax.muon(0.1, shape_scaling="moonlight")),
    "ns_flops m=0": (ValueError, "m must be a positive int",
                     lambda: newton_schulz.ns_flops(0, 4, 5)),
    # ---------------------------------------------------------------- muon_jax: leaves
    "int leaf": (ValueError, r"params leaf 'w' has dtype int32.*muon_mask",
                 lambda: muon_jax.scale_by_muon().init({"w": jnp.ones((4, 8), jnp.int32)})),
    "vector leaf": (ValueError, r"'layer/b'.*rank >= 2.*AdamW",
                    lambda: muon_jax.scale_by_muon().init({"layer": {"b": jnp.ones(8)}})),
    "dim nums out of range": (ValueError, r"params leaf 'w': output_axis 3 does not fit",
                              lambda: _mdn_init(MDN(0, 3))),
    "dim nums overlap": (ValueError, r"params leaf 'w': reduction axes \(0,\) and output axes",
                         lambda: _mdn_init(MDN(0, 0))),
    "mask structure": (ValueError, "muon_mask must be a tree with the structure of the params",
                       lambda: muon_jax.muon(0.1, muon_mask={"x": True}).init(_params())),
    "mask not bool": (TypeError, "muon_mask leaves must be Python bools",
                      lambda: muon_jax.muon(0.1, muon_mask={"w": 1}).init(_params())),
    # ---------------------------------------------------------------- muon_jax: meshes
    "shard axis missing": (ValueError, r"ShardingOptions: shard axis 'model' is not an axis of",
                           lambda: muon_jax.ShardingOptions(_mesh(), shard_axes="model")),
    "shard axes repeated": (ValueError, r"shard_axes=\('data', 'data'\) must be distinct",
                            lambda: muon_jax.ShardingOptions(_mesh(), ("data", "data"))),
    "param sharded off shard_axes": (
        ValueError, r"leaf 'w': .*mesh axis 'expert', which is not a shard axis",
        lambda: muon_jax.scale_by_muon(
            sharding=muon_jax.ShardingOptions(_mesh(), shard_axes="data")).init(
            {"w": _put(jnp.ones((8, 16)), P("expert", None))})),
    "param on another mesh": (
        ValueError, r"leaf 'w': .*'expert', which is not in the optimizer's mesh",
        lambda: muon_jax.scale_by_muon(
            sharding=muon_jax.ShardingOptions(jax.make_mesh((8,), ("d",)))).init(
            {"w": _put(jnp.ones((8, 16)), P("expert", None))})),
    "non-leading merged dim sharded": (
        ValueError, r"leaf 'w': dim 1 is sharded over \('expert',\) but is not the leading dim",
        lambda: muon_jax.scale_by_muon(sharding=muon_jax.ShardingOptions(_mesh()),
                                       dimension_numbers=MDN((0, 1), 2)).init(
            {"w": _put(jnp.ones((4, 8, 16)), P(None, "expert", None))})),
    "sharded grad shape": (ValueError, r"gradient leaf 'w' has shape \(8, 4\)",
                           lambda: _sharded_update({"w": _put(jnp.ones((8, 4)))})),
    "sharded grad leaves": (ValueError, "got 2 gradient leaves but the state was initialized for 1",
                            lambda: _sharded_update({"w": _put(jnp.ones((4, 8))),
                                                     "v": _put(jnp.ones((4, 8)))})),
    "reduced_view of sharded": (ValueError, r"reduced_view: leaf 'w' is sharded over",
                                _reduced_view_of_sharded),
    # ---------------------------------------------------------------- muon_jax.loss_scale
    "backoff_factor": (ValueError, "backoff_factor=1.5",
                       lambda: loss_scale.dynamic_loss_scale(optax.sgd(1.0), backoff_factor=1.5)),
    "growth_interval": (ValueError, "growth_interval=0",
                        lambda: loss_scale.dynamic_loss_scale(optax.sgd(1.0), growth_interval=0)),
    "scale_loss state": (ValueError, "state must be the DynamicScaleState",
                         lambda: loss_scale.scale_loss(jnp.float32(1.0), optax.EmptyState())),
    # ---------------------------------------------------------------- moe: MoE options
    "d_model=0": (ValueError, "d_model must be a positive int", lambda: _moe(d_model=0)),
    "d_ff float": (ValueError, "d_ff must be a positive int, got 32.0", lambda: _moe(d_ff=32.0)),
    "top_k > experts": (ValueError, r"top_k must be an int in \[1, num_experts=4\]",
                        lambda: _moe(num_experts=4, top_k=5)),
    "expert_axis missing": (ValueError, "expert_axis='ep' is not an axis of the mesh",
                            lambda: _moe(expert_axis="ep")),
    "batch_axes missing": (ValueError, "batch_axes names 'dp'", lambda: _moe(batch_axes=("dp",))),
    "fp8 d_model": (ValueError, r"d_model \(for dispatch_dtype=.fp8.\) = 96 must be a positive "
                    "multiple of the FP8 "
                    "block size 128",
                    lambda: _moe(d_model=96, dispatch_dtype="fp8", mesh=None)),
    "fp8_block_size=0": (ValueError, "fp8_block_size must be a positive int",
                         lambda: _moe(dispatch_dtype="fp8", fp8_block_size=0, mesh=None)),
    "shared experts < 0": (ValueError, "num_shared_experts must be an int >= 0",
                           lambda: _moe(num_shared_experts=-1)),
    "shared gate alone": (ValueError, "shared_expert_gate=True gates the shared experts, but "
                          "num_shared_experts=0", lambda: _moe(shared_expert_gate=True)),
    "activation": (ValueError, "activation kind='relu' is not supported",
                   lambda: _moe(activation="relu")),
    "clamp limit": (ValueError, "clamped_swiglu limit must be a positive number",
                    lambda: _moe(activation=moe.GatedActivation("clamped_swiglu", limit=0.0))),
    "jitter range": (ValueError, r"router_jitter_noise must be a number in \[0, 1\)",
                     lambda: _moe(router_jitter_noise=1.5)),
    "jitter stream": (ValueError, r"rngs\['jitter'\], which this Rngs lacks",
                      lambda: moe.MoE(64, 32, options=moe.MoEOptions.create(
                          8, 2, router_jitter_noise=0.1), rngs=nnx.Rngs(params=0))),
    "score_fn": (ValueError, "score_fn must be 'softmax' or 'sigmoid'",
                 lambda: _moe(score_fn="relu")),
    "routed_scaling NaN": (ValueError, "routed_scaling must be a positive number, got nan",
                           lambda: _moe(routed_scaling=float("nan"))),
    "num_groups": (ValueError, "num_groups must be a positive int dividing num_experts=8",
                   lambda: _moe(num_groups=3)),
    "dispatch_dtype": (ValueError, "dispatch_dtype='fp16' is not supported",
                       lambda: _call(dispatch_dtype="fp16")),
    "transport": (ValueError, "transport='bogus' is not supported",
                  lambda: _call(transport="bogus")),
    "capacity_factor=0": (ValueError, "capacity_factor must be > 0", lambda: _call(
        capacity_factor=0.0)),
    "capacity with ragged": (ValueError, "capacity_factor applies to transport='dense'",
                             lambda: _call(transport="ragged", capacity_factor=1.0)),
    "gemm_dtype": (ValueError, "gemm_dtype='fp4' is not supported", lambda: _call(
        gemm_dtype="fp4")),
    # ---------------------------------------------------------------- moe: call inputs
    "x rank 2": (ValueError, r"x must be \[batch, seq, d_model\], got shape \(16, 64\)",
                 lambda: _call(x_shape=(16, 64))),
    "x d_model": (ValueError, r"router_kernel has shape \(64, 8\).*x's last axis",
                  lambda: _call(x_shape=(2, 8, 32))),
    "token_mask shape": (ValueError, r"token_mask has shape \(2, 4\); it must be \[batch, seq\]",
                         lambda: _moe()(jnp.ones((2, 8, 64)), jnp.ones((2, 4), bool))),
    "router_bias off": (ValueError, "router_bias was passed but router_bias=False",
                        lambda: _moe_apply(router_bias=jnp.zeros(8))),
    "expert_bias missing": (ValueError, "expert_bias=True needs expert_bias",
                            lambda: _moe_apply(expert_bias=True)),
    "moe_apply w_down": (ValueError, r"w_down has shape \(2, 16, 64\)",
                         lambda: _moe_apply(w_down_shape=(8, 16, 64))),
    "moe_apply bias": (ValueError, r"bias must have shape \[num_experts\] = \(8,\), got \(4,\)",
                       lambda: _moe_apply(bias_shape=(4,))),
    "balancing counts": (ValueError, "tokens_per_expert must both have shape",
                         lambda: _moe().update_balancing_bias(jnp.ones(4, jnp.int32))),
    # ---------------------------------------------------------------- moe: functional core
    "quantize int": (TypeError, "x must be a float16/bfloat16/float32 array, got dtype int32",
                     lambda: moe.quantize(jnp.ones((2, 512), jnp.int32))),
    "quantize block_size=0": (ValueError, "block_size must be positive",
                              lambda: moe.quantize(jnp.ones((2, 512)), 0)),
    "quantize width": (ValueError, r"x.shape\[-1\] = 96 must be a positive multiple",
                       lambda: moe.quantize(jnp.ones((2, 96)))),
    "group_sizes float": (TypeError, "group_sizes has dtype float32",
                          lambda: moe.gated_experts(jnp.ones((16, 64)), jnp.ones(8),
                                                    jnp.ones((8, 64, 64)), jnp.ones((8, 32, 64)))),
    "route bias": (ValueError, r"bias must have shape \[num_experts\] = \(8,\), got \(3,\)",
                   lambda: moe.route(jnp.ones((4, 64)), jnp.ones((64, 8)), jnp.zeros(3),
                                     config=moe.RouterConfig(8, 2))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_naming_the_argument(case):
    err, match, fn = CASES[case]
    with pytest.raises(err, match=match):
        fn()


# ----------------------------------------------------------------------------- empty trees


def test_empty_trees_are_fine():
    """Empty param trees are not an error: init/update give empty updates (sharded too)."""
    for tx in (muon_jax.muon(0.1), muon_jax.muon(0.1, sharding=muon_jax.ShardingOptions(_mesh())),
               loss_scale.dynamic_loss_scale(muon_jax.muon(0.1))):
        updates, _ = tx.update({}, tx.init({}), {})
        assert updates == {}


# ------------------------------------------------------------------ former gaps, now caught

GAPS = {
    "unsharded grad shape": (
        "scale_by_muon (unsharded) lets a gradient of the wrong shape reach jnp broadcasting: "
        "TypeError 'add got incompatible shapes' without the leaf path (the sharded path "
        "names it)",
        lambda: (lambda tx: tx.update({"w": jnp.ones((8, 4))}, tx.init({"w": jnp.ones((4, 8))})))(
            muon_jax.scale_by_muon()),
        r"'w'.*shape"),
    "sharded int grad": (
        "sharded scale_by_muon accepts an int32 gradient silently (unsharded raises naming "
        "the leaf)",
        lambda: _sharded_update({"w": _put(jnp.ones((4, 8), jnp.int32))}),
        r"'w'.*int32"),
    "mu_dtype int": (
        "scale_by_muon(mu_dtype=jnp.int32) is accepted: momentum is silently kept in int32",
        lambda: muon_jax.scale_by_muon(mu_dtype=jnp.int32).init(_params()),
        "mu_dtype"),
}


@pytest.mark.parametrize("case", list(GAPS))
def test_former_gaps(case):
    """Cases that once slipped through (the text says how); each now raises, naming the leaf."""
    _, fn, match = GAPS[case]
    with pytest.raises((ValueError, TypeError), match=match):
        fn()


def test_init_scale_nan():
    with pytest.raises(ValueError, match="init_scale=nan"):
        loss_scale.dynamic_loss_scale(optax.sgd(1.0), init_scale=float("nan"))


def test_zero_size_batch():
    try:
        y, _ = _call(x_shape=(0, 8, 64))
    except (ValueError, TypeError) as e:
        assert re.search(r"\bx\b", str(e)) and "gather" not in str(e), e
    else:
        assert y.shape == (0, 8, 64)
