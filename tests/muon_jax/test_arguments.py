"""Every public argument of Muon's transforms and option objects is checked where it enters
(construction, no tracing): a bad value raises ValueError or TypeError naming the argument."""

import inspect
import math

import jax
import jax.numpy as jnp
import pytest

import muon_jax
from muon_jax import optax_compat

MESH = jax.make_mesh((8,), ("data",))
NAN = math.nan

# Bad values per argument; each is tried alone, the other arguments at their defaults.
SHARED = {  # arguments muon, scale_by_muon and their optax_compat twins all take
    "ns_coeffs": ["quintic", (1.0, 2.0), ("a", "b", "c")],
    "ns_steps": [0, "five"],
    "beta": [1.5, -0.1, 1.0, "x"],
    "eps": [-1.0, "x"],
    "mu_dtype": [jnp.int32, "f32"],
    "nesterov": ["yes", None],
    "sharding": [MESH, "data"],
}
DIRECTION = {  # muon_jax.muon and muon_jax.scale_by_muon
    **SHARED,
    "ns_coeffs": SHARED["ns_coeffs"] + [(NAN, 1.0, 1.0)],
    "ns_steps": SHARED["ns_steps"] + [5.0, True],
    "bias_correction": [0, None],
    "shape_scaling": ["moonlight", 0.0, -1.0],
    "dimension_numbers": ["torch", 3],
    "newton_schulz": ["float32", jnp.float32],
}
OPTIMIZER = {  # what muon_jax.muon adds
    "learning_rate": ["x", -0.1, NAN, None],
    "weight_decay": [-0.1, "x"],
    "muon_mask": ["all", 1],
    "weight_decay_mask": ["x"],
    "adamw": [{"b1": 0.9}, 0.1],
}
COMPAT = {  # what optax_compat adds
    "adaptive": ["yes"],
    "preconditioning": ["newton"],
}
COMPAT_OPTIMIZER = {
    "learning_rate": OPTIMIZER["learning_rate"],
    "weight_decay": OPTIMIZER["weight_decay"],
    "weight_decay_mask": OPTIMIZER["weight_decay_mask"],
    "adam_b1": [1.5, "x"],
    "adam_b2": [-0.5],
    "adam_eps_root": [-1.0],
    "adam_weight_decay": [-1.0, "x"],
    "adam_learning_rate": ["x", -1.0],
    "muon_weight_dimension_numbers": ["all"],
    "consistent_rms": [0.0, -0.2, "x"],
}
OPTIONS = {  # name: (callable, required arguments, bad values)
    "NewtonSchulzOptions": (muon_jax.NewtonSchulzOptions, {}, {
        "dtype": [jnp.int32, "f32"], "preconditioning": ["newton"], "method": ["fast"],
        "gram": [(2,)], "symmetric_blocks": [0, "all"], "adaptive": ["yes"]}),
    "ShardingOptions": (muon_jax.ShardingOptions, {"mesh": MESH}, {
        "mesh": ["data", None], "shard_axes": ["model", ("data", "data"), 3],
        "param_specs": ["data"], "chunk_bytes": [-1, 1.5, True],
        "gather_dtype": [jnp.int32, "f32"], "reduce_dtype": [jnp.int32, "bf16"]}),
    "AdamWOptions": (muon_jax.AdamWOptions, {}, {
        "learning_rate": ["x", -1.0], "b1": [1.0, "x"], "b2": [-0.5], "eps": [-1.0],
        "eps_root": [NAN], "weight_decay": [-1.0], "nesterov": ["no"],
        "mu_dtype": [jnp.int32]}),
}
LR = {"learning_rate": 0.02}
ALL = {
    **OPTIONS,
    "muon": (muon_jax.muon, LR, {**DIRECTION, **OPTIMIZER}),
    "scale_by_muon": (muon_jax.scale_by_muon, {}, DIRECTION),
    "optax_compat.muon": (optax_compat.muon, LR, {**SHARED, **COMPAT, **COMPAT_OPTIMIZER}),
    "optax_compat.scale_by_muon": (optax_compat.scale_by_muon, {},
                                   {**SHARED, **COMPAT, "weight_dimension_numbers": ["all"]}),
}


def _label(value):
    return getattr(value, "__name__", None) or repr(value)


CASES = [pytest.param(make, required, arg, value, id=f"{name}-{arg}={_label(value)}")
         for name, (make, required, bad) in ALL.items()
         for arg, values in bad.items() for value in values]


@pytest.mark.parametrize("make,required,arg,value", CASES)
def test_bad_argument_is_named(make, required, arg, value):
    with pytest.raises((ValueError, TypeError)) as info:
        make(**{**required, arg: value})
    assert arg in str(info.value), str(info.value)


@pytest.mark.parametrize("name", list(ALL))
def test_every_argument_is_swept(name):
    make, _, bad = ALL[name]
    assert set(inspect.signature(make).parameters) == set(bad)
