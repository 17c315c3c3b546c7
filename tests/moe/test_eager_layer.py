"""moe.MoE called outside a jit compiles its functional core once per shape (then runs it as a
compiled program), and so do its gradients outside a jit; inside a jit it stays part of the
caller's program; same results. (``benchmarks/layer.py --eager`` times the eager calls.)"""

import chex
import jax
import jax.numpy as jnp
from flax import nnx

import moe
from moe import module


def test_eager_calls_compile_once_per_shape_and_match_the_jitted_layer():
    layer = moe.MoE(64, 32, options=moe.MoEOptions.create(8, 2), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 32, 64))
    before = module._eager_apply._cache_size()
    y1, aux1 = layer(x)
    y2, _ = layer(x * 2)
    assert module._eager_apply._cache_size() == before + 1  # one compilation for the shape
    layer(x[:, :16])
    assert module._eager_apply._cache_size() == before + 2  # a new shape: a new one
    y_jit, aux_jit = nnx.jit(lambda m, x: m(x))(layer, x)
    assert module._eager_apply._cache_size() == before + 2  # inside a jit: not used
    chex.assert_trees_all_close((y1, aux1), (y_jit, aux_jit), rtol=1e-6, atol=1e-6)
    assert not jnp.allclose(y1, y2)


# Emitted once per program jax lowers (whether or not the persistent cache then has it).
_LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def test_eager_grads_compile_once_and_match_the_jitted_grads():
    layer = moe.MoE(64, 32, options=moe.MoEOptions.create(8, 2), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 32, 64))

    def loss(m):
        y, aux = m(x)
        return jnp.sum(y**2) + aux["load_balance_loss"] + aux["router_z_loss"]

    lowered = []

    def count(event, duration, **kwargs):
        if event == _LOWERING_EVENT:
            lowered.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        grads = nnx.grad(loss)(layer)
        first = len(lowered)
        again = nnx.grad(loss)(layer)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    # The forward and backward as a few compiled programs (10 on jax 0.10, 11 on 0.12), not op by op
    # (~600 programs, again on every call); the second grad reuses them all.
    assert first <= 20, lowered
    assert len(lowered) == first, lowered[first:]
    chex.assert_trees_all_equal(grads, again)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    traced = jax.jit(jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest)))).trace(params)
    assert "moe_apply" not in str(traced.jaxpr)  # inside a jit: traced inline, no nested call
    grads_jit = traced.lower().compile()(params)
    chex.assert_trees_all_close(grads, grads_jit, rtol=1e-6, atol=1e-6)
    assert all(jnp.abs(g).max() > 0 for g in jax.tree.leaves(grads))
