"""A catalogue of bad inputs across muon_jax and moe: each raises ValueError/TypeError whose
message names the offending argument or leaf path (and, where the library has one, the fix).

Cases the reliability review found slipping through (a gradient of the wrong shape, an int
gradient on the sharded path, an int mu_dtype, a NaN loss scale, an empty MoE batch) are kept
here as regular cases now that the library catches them.
"""

import dataclasses
import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
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


# ------------------------------------------------------------- moe: every public argument

_X, _RK = jnp.ones((2, 8, 64)), jnp.ones((64, 8))
_WGU, _WD = jnp.ones((8, 64, 64)), jnp.ones((8, 32, 64))


def _apply(*args, **kw):
    """``moe_apply`` traced (no compile) on the layer's inputs, ``args`` replacing them."""
    a = [*args, *(_X, _RK, _WGU, _WD)[len(args):]]
    kw = {"options": moe.MoEOptions.create(8, 2), "mesh": _mesh(), **kw}
    return jax.eval_shape(lambda: moe.moe_apply(*a, **kw))


def _dense(x_shape=(8, 128), **kw):
    return jax.eval_shape(lambda: moe.fp8_dense(jnp.ones(x_shape), jnp.ones((128, 128)), **kw))


def _hf_block(e=8, d=16, f=8):
    """A Mixtral block's state dict (numpy, transformers' [out, in] weights)."""
    block = {"gate.weight": np.ones((e, d))}
    for i in range(e):
        block |= {f"experts.{i}.w1.weight": np.ones((f, d)),
                  f"experts.{i}.w3.weight": np.ones((f, d)),
                  f"experts.{i}.w2.weight": np.ones((d, f))}
    return block


_MIXTRAL = {"num_local_experts": 8, "num_experts_per_tok": 2}
_DEEPSEEK = {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2}


def _convert(family="mixtral", config=_MIXTRAL, **kw):
    return moe.convert.from_transformers(family, _hf_block(), config, **kw)


# (entry, argument, error, message pattern, call): every public argument of the moe entries
# (ENTRIES below) has at least one bad value here, and its error names the argument (or the
# config key / option it came in as), the value and, where there is one, the fix.
ARG_CASES = [
    # ------------------------------------------------------------------ RouterConfig
    ("RouterConfig", "num_experts", ValueError, "num_experts must be a positive int, got 0",
     lambda: moe.RouterConfig(0, 1)),
    ("RouterConfig", "top_k", ValueError, r"top_k must be an int in \[1, num_experts=4\], got 5",
     lambda: moe.RouterConfig(4, 5)),
    ("RouterConfig", "routed_scaling", ValueError,
     "routed_scaling must be a positive finite number, got nan",
     lambda: moe.RouterConfig(8, 2, routed_scaling=float("nan"))),
    ("RouterConfig", "routed_scaling", ValueError,
     "routed_scaling must be a positive finite number, got inf",
     lambda: moe.RouterConfig(8, 2, routed_scaling=float("inf"))),
    ("RouterConfig", "num_groups", ValueError,
     "num_groups must be a positive int dividing num_experts=8, got 3",
     lambda: moe.RouterConfig(8, 2, num_groups=3)),
    ("RouterConfig", "topk_groups", ValueError,
     r"topk_groups must be None or an int in \[1, num_groups=4\], got 0",
     lambda: moe.RouterConfig(8, 2, num_groups=4, topk_groups=0)),
    ("RouterConfig", "topk_groups", ValueError,
     r"topk_groups \* experts per group = 1 \* 2 < top_k = 3",
     lambda: moe.RouterConfig(8, 3, num_groups=4, topk_groups=1)),
    ("RouterConfig", "score_fn", ValueError, "score_fn must be 'softmax' or 'sigmoid', got 'relu'",
     lambda: moe.RouterConfig(8, 2, score_fn="relu")),
    ("RouterConfig", "renormalize", TypeError, "renormalize must be True or False, got 'yes'",
     lambda: moe.RouterConfig(8, 2, renormalize="yes")),
    ("RouterConfig", "stop_score_gradient", TypeError,
     "stop_score_gradient must be True or False, got 1",
     lambda: moe.RouterConfig(8, 2, stop_score_gradient=1)),
    ("RouterConfig", "router_bias", TypeError, "router_bias must be True or False, got None",
     lambda: moe.RouterConfig(8, 2, router_bias=None)),
    ("RouterConfig", "router_jitter_noise", ValueError,
     r"router_jitter_noise must be a number in \[0, 1\), got 1.5",
     lambda: moe.RouterConfig(8, 2, router_jitter_noise=1.5)),
    ("RouterConfig", "jitter_input", ValueError, "jitter_input must be 'all' or 'router', got 'x'",
     lambda: moe.RouterConfig(8, 2, jitter_input="x")),
    ("RouterConfig", "return_routing", TypeError, "return_routing must be True or False, got 'no'",
     lambda: moe.RouterConfig(8, 2, return_routing="no")),
    # ------------------------------------------------------------------ DispatchOptions
    ("DispatchOptions", "expert_axis", TypeError,
     "expert_axis must be a mesh axis name .*, got 3; e.g. expert_axis='expert'",
     lambda: moe.DispatchOptions(expert_axis=3)),
    ("DispatchOptions", "expert_axis", ValueError,
     r"expert_axis='ep' is not an axis of the mesh \('data', 'expert'\)",
     lambda: _moe(expert_axis="ep")),
    ("DispatchOptions", "batch_axes", TypeError,
     "batch_axes must be None or a tuple of mesh axis names, got 5",
     lambda: moe.DispatchOptions(batch_axes=5)),
    ("DispatchOptions", "batch_axes", ValueError,
     "batch_axes names 'dp', which is not an axis of the mesh",
     lambda: _moe(batch_axes=("dp",))),
    ("DispatchOptions", "transport", ValueError,
     "transport='bogus' is not supported; use one of",
     lambda: moe.DispatchOptions(transport="bogus")),
    ("DispatchOptions", "capacity_factor", ValueError,
     "capacity_factor must be a finite number > 0 or None, got 0.0",
     lambda: moe.DispatchOptions(capacity_factor=0.0)),
    ("DispatchOptions", "capacity_factor", ValueError,
     "capacity_factor must be a finite number > 0 or None, got inf",
     lambda: moe.DispatchOptions(capacity_factor=float("inf"))),
    ("DispatchOptions", "capacity_factor", TypeError,
     "capacity_factor must be a float or None, got '1'",
     lambda: moe.DispatchOptions(capacity_factor="1")),
    ("DispatchOptions", "capacity_factor", ValueError,
     "capacity_factor applies to transport='dense'",
     lambda: moe.DispatchOptions(transport="ragged", capacity_factor=1.0)),
    ("DispatchOptions", "dispatch_dtype", ValueError, "dispatch_dtype='fp16' is not supported",
     lambda: moe.DispatchOptions(dispatch_dtype="fp16")),
    ("DispatchOptions", "combine_grad_dtype", ValueError,
     "combine_grad_dtype='fp4' is not supported",
     lambda: moe.DispatchOptions(combine_grad_dtype="fp4")),
    ("DispatchOptions", "wire_implementation", ValueError,
     "wire_implementation='cuda' is not supported",
     lambda: moe.DispatchOptions(wire_implementation="cuda")),
    ("DispatchOptions", "overlap_chunks", ValueError,
     "overlap_chunks must be 'auto' or an int >= 1, got 0",
     lambda: moe.DispatchOptions(overlap_chunks=0)),
    ("DispatchOptions", "capacity_multiple", ValueError,
     "capacity_multiple must be an int >= 1, got 8.0",
     lambda: moe.DispatchOptions(capacity_multiple=8.0)),
    ("DispatchOptions", "exchange_implementation", ValueError,
     "exchange_implementation='xla' is not supported",
     lambda: moe.DispatchOptions(exchange_implementation="xla")),
    ("DispatchOptions", "host_axis", ValueError,
     r"host_axis='expert' must be None, 'auto' or the first name of expert_axis=\('host', "
     r"'expert'\)", lambda: moe.DispatchOptions(expert_axis=("host", "expert"),
                                                 host_axis="expert")),
    ("DispatchOptions", "host_axis", ValueError,
     r"host_axis='expert' \(the two-stage exchange\) runs the 'dense' and 'dropless' "
     "transports, got transport='ragged'",
     lambda: moe.DispatchOptions(host_axis="expert", transport="ragged")),
    ("DispatchOptions", "local_first", TypeError, "local_first must be True or False, got 1",
     lambda: moe.DispatchOptions(local_first=1)),
    # ------------------------------------------------------------------ ExpertOptions
    ("ExpertOptions", "gemm_implementation", ValueError,
     "gemm_implementation='cutlass' is not supported",
     lambda: moe.ExpertOptions(gemm_implementation="cutlass")),
    ("ExpertOptions", "gemm_dtype", ValueError, "gemm_dtype='fp4' is not supported",
     lambda: moe.ExpertOptions(gemm_dtype="fp4")),
    ("ExpertOptions", "dgrad_dtype", ValueError, "dgrad_dtype='fp16' is not supported",
     lambda: moe.ExpertOptions(dgrad_dtype="fp16")),
    ("ExpertOptions", "save_z", ValueError, "save_z='fp16' is not supported",
     lambda: moe.ExpertOptions(save_z="fp16")),
    ("ExpertOptions", "wgrad_dtype", ValueError, "wgrad_dtype='int8' is not supported",
     lambda: moe.ExpertOptions(wgrad_dtype="int8")),
    ("ExpertOptions", "num_shared_experts", ValueError,
     "num_shared_experts must be an int >= 0, got -1",
     lambda: moe.ExpertOptions(num_shared_experts=-1)),
    ("ExpertOptions", "activation", ValueError, "activation kind='relu' is not supported",
     lambda: moe.ExpertOptions(activation="relu")),
    ("ExpertOptions", "activation", ValueError, "clamped_swiglu limit must be a positive number",
     lambda: moe.ExpertOptions(activation=moe.GatedActivation("clamped_swiglu", limit=0.0))),
    ("ExpertOptions", "expert_bias", TypeError, "expert_bias must be True or False, got 'y'",
     lambda: moe.ExpertOptions(expert_bias="y")),
    ("ExpertOptions", "shared_expert_gate", ValueError,
     "shared_expert_gate=True gates the shared experts, but num_shared_experts=0",
     lambda: moe.ExpertOptions(shared_expert_gate=True)),
    ("ExpertOptions", "shared_expert_gate", TypeError,
     "shared_expert_gate must be True or False, got 1",
     lambda: moe.ExpertOptions(num_shared_experts=1, shared_expert_gate=1)),
    # ------------------------------------------------------------------ MoEOptions
    ("MoEOptions", "router", TypeError, "MoEOptions.router must be a RouterConfig, got dict",
     lambda: moe.MoEOptions(router={})),
    ("MoEOptions", "dispatch", TypeError,
     "MoEOptions.dispatch must be a DispatchOptions, got str",
     lambda: moe.MoEOptions(router=moe.RouterConfig(8, 2), dispatch="dense")),
    ("MoEOptions", "experts", TypeError,
     "MoEOptions.experts must be an ExpertOptions, got NoneType",
     lambda: moe.MoEOptions(router=moe.RouterConfig(8, 2), experts=None)),
    ("MoEOptions", "fp8_block_size", ValueError, "fp8_block_size must be a positive int, got 0",
     lambda: moe.MoEOptions.create(8, 2, fp8_block_size=0)),
    ("MoEOptions", "fp8_block_size", ValueError,
     r"d_model \(for dispatch_dtype='fp8'\) = 96 must be a positive multiple of the FP8 block "
     "size 128", lambda: _moe(d_model=96, dispatch_dtype="fp8", mesh=None)),
    # ------------------------------------------------------------------ moe.MoE
    ("MoE", "d_model", ValueError, "d_model must be a positive int, got 0",
     lambda: _moe(d_model=0)),
    ("MoE", "d_ff", ValueError, "d_ff must be a positive int, got 32.0", lambda: _moe(d_ff=32.0)),
    ("MoE", "options", TypeError, "options must be a moe.MoEOptions, got NoneType",
     lambda: moe.MoE(64, 32, options=None, rngs=nnx.Rngs(0))),
    ("MoE", "mesh", TypeError, "mesh must be a jax.sharding.Mesh .*, got str 'expert'",
     lambda: _moe(mesh="expert")),
    ("MoE", "dtype", TypeError, "dtype must be a floating-point dtype, got 'int32'",
     lambda: moe.MoE(64, 32, options=moe.MoEOptions.create(8, 2), dtype=jnp.int32,
                     rngs=nnx.Rngs(0))),
    ("MoE", "param_dtype", TypeError, "param_dtype must be a floating-point dtype, got 'float33'",
     lambda: moe.MoE(64, 32, options=moe.MoEOptions.create(8, 2), param_dtype="float33",
                     rngs=nnx.Rngs(0))),
    ("MoE", "rngs", TypeError, r"rngs must be an nnx.Rngs, got int; pass rngs=nnx.Rngs\(0\)",
     lambda: moe.MoE(64, 32, options=moe.MoEOptions.create(8, 2), rngs=0)),
    ("MoE", "rngs", ValueError, r"rngs\['jitter'\], which this Rngs lacks",
     lambda: moe.MoE(64, 32, options=moe.MoEOptions.create(8, 2, router_jitter_noise=0.1),
                     rngs=nnx.Rngs(params=0))),
    ("MoE.__call__", "x", ValueError, r"x must be \[batch, seq, d_model\], got shape \(16, 64\)",
     lambda: _call(x_shape=(16, 64))),
    ("MoE.__call__", "mask", ValueError,
     r"token_mask has shape \(2, 4\); it must be \[batch, seq\]",
     lambda: _moe()(jnp.ones((2, 8, 64)), jnp.ones((2, 4), bool))),
    ("MoE.__call__", "deterministic", TypeError,
     "deterministic must be True, False or None, got 'no'",
     lambda: _moe(mesh=None)(jnp.ones((2, 8, 64)), deterministic="no")),
    ("MoE.update_balancing_bias", "tokens_per_expert", ValueError,
     "tokens_per_expert must both have shape",
     lambda: _moe(mesh=None).update_balancing_bias(jnp.ones(4, jnp.int32))),
    ("MoE.update_balancing_bias", "rate", ValueError,
     "rate must be a finite number >= 0, got -0.001",
     lambda: _moe(mesh=None).update_balancing_bias(jnp.ones(8, jnp.int32), rate=-1e-3)),
    # ------------------------------------------------------------------ moe_apply
    ("moe_apply", "x", TypeError, "x must be a jax or numpy array, got list",
     lambda: _apply([[[1.0] * 64] * 8] * 2)),
    ("moe_apply", "x", TypeError, "x must be a floating-point array, got dtype int32",
     lambda: _apply(jnp.ones((2, 8, 64), jnp.int32))),
    ("moe_apply", "router_kernel", ValueError,
     r"router_kernel has shape \(64, 8\).*x's last axis", lambda: _apply(jnp.ones((2, 8, 32)))),
    ("moe_apply", "w_gate_up", ValueError,
     r"w_gate_up has shape \(4, 64, 64\), expected \[num_experts, d_model, 2 \* d_ff\]",
     lambda: _apply(_X, _RK, jnp.ones((4, 64, 64)))),
    ("moe_apply", "w_down", ValueError,
     r"w_down has shape \(8, 16, 64\), expected \[num_experts, d_ff, d_model\] = \(8, 32, 64\)",
     lambda: _apply(_X, _RK, _WGU, jnp.ones((8, 16, 64)))),
    ("moe_apply", "w_down", ValueError, r"w_down must have rank 3, got shape \(8, 32\)",
     lambda: _apply(_X, _RK, _WGU, jnp.ones((8, 32)))),
    ("moe_apply", "bias", ValueError,
     r"bias must have shape \[num_experts\] = \(8,\), got \(8, 1\)",
     lambda: _apply(_X, _RK, _WGU, _WD, jnp.zeros((8, 1)))),
    ("moe_apply", "shared", ValueError, r"shared must be a pair \(gate_up",
     lambda: _apply(shared=jnp.ones((64, 64)))),
    ("moe_apply", "shared", ValueError, r"shared has shapes \(64, 64\) and \(16, 64\)",
     lambda: _apply(shared=(jnp.ones((64, 64)), jnp.ones((16, 64))))),
    ("moe_apply", "options", TypeError, "options must be a moe.MoEOptions, got NoneType",
     lambda: _apply(options=None)),
    ("moe_apply", "mesh", TypeError, "mesh must be a jax.sharding.Mesh .*, got str 'm'",
     lambda: _apply(mesh="m")),
    ("moe_apply", "router_bias", ValueError, "router_bias was passed but router_bias=False",
     lambda: _apply(router_bias=jnp.zeros(8))),
    ("moe_apply", "expert_bias", ValueError,
     "expert_bias=True in the options needs the expert_bias= argument",
     lambda: _apply(options=moe.MoEOptions.create(8, 2, expert_bias=True))),
    ("moe_apply", "shared_gate", ValueError, "shared_gate gates the shared experts; pass shared=",
     lambda: _apply(shared_gate=jnp.ones((64, 1)))),
    ("moe_apply", "token_mask", TypeError, "token_mask must be a bool array .*, got dtype float32",
     lambda: _apply(token_mask=jnp.ones((2, 8)))),
    ("moe_apply", "jitter_key", TypeError, "jitter_key must be a PRNG key .*, got 3",
     lambda: _apply(options=moe.MoEOptions.create(8, 2, router_jitter_noise=0.1),
                    jitter_key=3)),
    ("moe_apply", "opts", TypeError, "moe_apply got both options= and opts=",
     lambda: _apply(opts=moe.MoEOptions.create(8, 2))),
    # ------------------------------------------------------------------ fp8_dense
    ("fp8_dense", "x", TypeError, "x must be a jax or numpy array, got list",
     lambda: moe.fp8_dense([[1.0] * 128], jnp.ones((128, 128)))),
    ("fp8_dense", "x", ValueError, r"x has 12 rows, not divisible by the 8 shards",
     lambda: _dense((12, 128), mesh=_mesh())),
    ("fp8_dense", "kernel", ValueError, r"kernel must be \[K, N\] with K = x.shape\[-1\]",
     lambda: moe.fp8_dense(jnp.ones((4, 128)), jnp.ones((1, 128, 128)))),
    ("fp8_dense", "kernel", TypeError, "x and kernel must be floating point, got float32 and int32",
     lambda: moe.fp8_dense(jnp.ones((4, 128)), jnp.ones((128, 128), jnp.int32))),
    ("fp8_dense", "dgrad_dtype", ValueError, "dgrad_dtype='fp16' is not supported",
     lambda: _dense(dgrad_dtype="fp16")),
    ("fp8_dense", "wgrad_dtype", ValueError, "wgrad_dtype='e5m2' is not supported",
     lambda: _dense(wgrad_dtype="e5m2")),
    ("fp8_dense", "gemm_implementation", ValueError,
     "gemm_implementation='cutlass' is not supported",
     lambda: _dense(gemm_implementation="cutlass")),
    ("fp8_dense", "renamed", TypeError,
     r"fp8_dense\(\) got an unexpected keyword argument 'kernel_impl'",
     lambda: _dense(kernel_impl="xla")),
    ("fp8_dense", "renamed", TypeError,
     r"fp8_dense\(\) got both backend= and gemm_implementation=; pass gemm_implementation=",
     lambda: _dense(backend="xla", gemm_implementation="mosaic")),
    ("fp8_dense", "mesh", TypeError, "mesh must be a jax.sharding.Mesh or None, got str 'm'",
     lambda: _dense(mesh="m")),
    ("fp8_dense", "token_axes", TypeError,
     "token_axes must be None, a mesh axis name or a tuple of names, got 5",
     lambda: _dense(mesh=_mesh(), token_axes=5)),
    ("fp8_dense", "token_axes", ValueError, "token_axes names 'model', not an axis of the mesh",
     lambda: _dense(mesh=_mesh(), token_axes="model")),
    # ------------------------------------------------------------------ moe.convert
    ("from_transformers", "family", ValueError, "family='llama' is not supported; use one of",
     lambda: _convert("llama")),
    ("from_transformers", "params", TypeError,
     "params must be a dict of the block's arrays by state-dict key, got list",
     lambda: moe.convert.from_transformers("mixtral", [], _MIXTRAL)),
    ("from_transformers", "config", TypeError,
     "config must be a dict of config values or a transformers config, got list",
     lambda: _convert(config=[])),
    ("from_transformers", "config", ValueError,
     "config lacks 'num_local_experts' or 'num_experts', which a mixtral block needs",
     lambda: _convert(config={"num_experts_per_tok": 2})),
    ("from_transformers", "config", ValueError,
     "the mixtral config's 'num_experts_per_tok' is None; it must be an int >= 1",
     lambda: _convert(config={**_MIXTRAL, "num_experts_per_tok": None})),
    ("from_transformers", "config", ValueError,
     r"config gives num_experts as \{'num_local_experts': 8, 'num_experts': 4\}, which disagree",
     lambda: _convert(config={**_MIXTRAL, "num_experts": 4})),
    ("from_transformers", "config", ValueError, "hidden_act='relu' has no equivalent",
     lambda: _convert(config={**_MIXTRAL, "hidden_act": "relu"})),
    ("from_transformers", "config", ValueError,
     "config lacks 'n_group', which a deepseek_v3 block needs",
     lambda: _convert("deepseek_v3", {k: v for k, v in _DEEPSEEK.items() if k != "n_group"})),
    ("from_transformers", "config", ValueError,
     "the deepseek_v3 config's values .*'n_group': 3.* give no valid options: num_groups must",
     lambda: _convert("deepseek_v3", {**_DEEPSEEK, "n_group": 3})),
    ("from_transformers", "config", ValueError, "deepseek_v3 scoring_func='softmax'; only",
     lambda: _convert("deepseek_v3", {**_DEEPSEEK, "scoring_func": "softmax"})),
    ("from_transformers", "prefix", TypeError, "prefix must be a str .*, got 3",
     lambda: _convert(prefix=3)),
    ("from_transformers", "prefix", ValueError, "no parameter key starts with prefix='mlp.'",
     lambda: _convert(prefix="mlp.")),
    ("from_transformers", "options", TypeError, "MoEOptions has no option 'tranport'",
     lambda: _convert(tranport="dense")),
    ("load", "model", TypeError, "model must be an nnx.Module .*, got NoneType",
     lambda: moe.convert.load(None, {})),
    ("load", "params", TypeError, "params must be a dict of arrays by variable name .*, got list",
     lambda: moe.convert.load(_moe(mesh=None), [])),
]


def _arguments(fn):
    return [p for p in inspect.signature(fn).parameters if p != "self"]


ENTRIES = {
    "RouterConfig": [f.name for f in dataclasses.fields(moe.RouterConfig)],
    "DispatchOptions": [f.name for f in dataclasses.fields(moe.DispatchOptions)],
    "ExpertOptions": [f.name for f in dataclasses.fields(moe.ExpertOptions)],
    "MoEOptions": [f.name for f in dataclasses.fields(moe.MoEOptions)],
    "MoE": _arguments(moe.MoE.__init__),
    "MoE.__call__": _arguments(moe.MoE.__call__),
    "MoE.update_balancing_bias": _arguments(moe.MoE.update_balancing_bias),
    "moe_apply": _arguments(moe.moe_apply),
    "fp8_dense": _arguments(moe.fp8_dense),
    "from_transformers": _arguments(moe.convert.from_transformers),
    "load": _arguments(moe.convert.load),
}


def test_every_public_moe_argument_has_a_bad_input_case():
    covered = {(entry, arg) for entry, arg, *_ in ARG_CASES}
    wanted = {(entry, arg) for entry, args in ENTRIES.items() for arg in args}
    assert not wanted - covered, sorted(wanted - covered)
    assert not covered - wanted, sorted(covered - wanted)


@pytest.mark.parametrize("case", ARG_CASES, ids=[
    f"{c[0]}.{c[1]}-{i}" for i, c in enumerate(ARG_CASES)])
def test_bad_moe_argument_raises_naming_it(case):
    _, _, err, match, fn = case
    with pytest.raises(err, match=match):
        fn()


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
