"""examples/lm_model.py's micro_batches: token streams that each layer runs in turn compute
the batch's logits and gradients (8 simulated CPU devices, mesh (2, 4), f32)."""

import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _paths import ROOT
from flax import nnx

sys.path.insert(0, str(ROOT / "examples"))

import lm_model  # noqa: E402
import train_lm  # noqa: E402


def _ce_and_grads(micro_batches: int, tokens):
    cfg = lm_model.LMConfig(d_model=32, num_heads=2, d_ff=16, num_experts=4, top_k=2,
                            capacity_factor=None, micro_batches=micro_batches)
    mesh = train_lm.build_mesh(None)
    model, _ = lm_model.create_sharded(cfg, optax.sgd(0.1), mesh=mesh, seed=0)

    @nnx.jit
    def run(model, tokens):
        def ce(model):
            logits, aux = model(tokens[:, :-1])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
            return loss, (logits, aux)

        (loss, (logits, aux)), grads = nnx.value_and_grad(ce, has_aux=True)(model)
        return logits, aux, grads

    with jax.set_mesh(mesh):
        return run(model, tokens)


def test_streams_give_the_batch_logits_counts_and_gradients():
    tokens = jax.random.randint(jax.random.key(1), (16, 9), 0, 256, jnp.int32)
    logits1, aux1, grads1 = _ce_and_grads(1, tokens)
    logits2, aux2, grads2 = _ce_and_grads(2, tokens)
    chex.assert_trees_all_close(logits2, logits1, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(aux2["tokens_per_expert"], aux1["tokens_per_expert"])
    assert int(aux2["dropped_tokens"]) == int(aux1["dropped_tokens"]) == 0
    chex.assert_trees_all_close(nnx.state(grads2), nnx.state(grads1), rtol=1e-5, atol=1e-6)
    # The balancing losses are per-stream means, averaged: close to the batch's, not equal.
    assert abs(float(aux2["load_balance_loss"]) - float(aux1["load_balance_loss"])) < 0.5


def test_micro_batches_is_checked():
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        lm_model.LMConfig(micro_batches=0)
    cfg = lm_model.LMConfig(d_model=32, num_heads=2, d_ff=16, num_experts=4, micro_batches=3)
    # Shapes only (the check is on the batch's shape): the model and the call traced, not run,
    # so no initializer or layer op compiles eagerly.
    model = nnx.eval_shape(lambda: lm_model.TransformerLM(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="not a multiple of micro_batches=3"):
        nnx.eval_shape(lambda m, x: m(x), model, jnp.zeros((4, 8), jnp.int32))
    args = train_lm.parse_args(["--micro-batches", "2", "--overlap-chunks", "1"])
    cfg = train_lm.model_config(args)
    assert (cfg.micro_batches, cfg.overlap_chunks) == (2, 1)
    assert train_lm.model_config(train_lm.parse_args([])).overlap_chunks == "auto"
