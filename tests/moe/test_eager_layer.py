"""moe.MoE called outside a jit compiles its functional core once per shape (then runs it as a
compiled program), and inside a jit stays part of the caller's program; same results.
(benchmarks/eager_layer.py times the eager calls.)"""

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
    grads = nnx.grad(lambda m: jnp.sum(m(x)[0]))(layer)  # traced by grad: the direct path
    assert jnp.isfinite(grads.router_kernel[...]).all()
