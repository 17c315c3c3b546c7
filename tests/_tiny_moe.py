"""A tiny NNX model with MoE layers, trained by sharded Muon: shared by the reliability tests
(test_checkpoint, test_nonfinite, test_determinism) and the multi-process worker.

Everything is functional: ``params`` (nnx.Param), ``bias`` (the MoE balancing biases) and the
optimizer state are plain trees, so runs can be saved, restored and compared leaf by leaf.
"""

from __future__ import annotations

import functools

import _meshes as meshes
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe
import muon_jax

VOCAB, D, D_FF, E, K = 32, 64, 32, 8, 2
BATCH, SEQ = 8, 8  # 64 tokens: the batch splits over 8 devices
BIAS_RATE = 1e-2


# The model's meshes: (8,) -> ('expert',); (a, b) -> ('data', 'expert'); Auto axes (as
# examples/train_lm.py).
make_mesh = functools.partial(meshes.make_mesh, axis_type="auto")


class Block(nnx.Module):
    def __init__(self, mesh, dispatch_dtype, *, rngs):
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.proj = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.moe = moe.MoE(D, D_FF, options=moe.MoEOptions.create(
            E, K, dispatch_dtype=dispatch_dtype, fp8_block_size=16), mesh=mesh, rngs=rngs)

    def __call__(self, x):
        h = self.proj(self.norm(x))
        y, aux = self.moe(h)
        return x + y, aux


class TinyMoE(nnx.Module):
    """Embed -> 2 x (RMSNorm, Linear, MoE) -> RMSNorm -> head."""

    def __init__(self, mesh, *, dispatch_dtype=None, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([Block(mesh, dispatch_dtype, rngs=rngs) for _ in range(2)])
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        counts, lb = [], 0.0
        for b in self.blocks:
            x, aux = b(x)
            counts.append(aux["tokens_per_expert"])
            lb = lb + aux["load_balance_loss"]
        return self.head(self.final_norm(x)), counts, lb


def make_tx(mesh):
    return muon_jax.muon(0.02, weight_decay=0.01,
                         newton_schulz=muon_jax.NewtonSchulzOptions(dtype=jnp.float32),
                         sharding=muon_jax.ShardingOptions(mesh))


def _shardings(tree, mesh):
    specs = nnx.get_partition_spec(tree)
    return jax.tree.map(lambda s: NamedSharding(mesh, s if s is not None else P()), specs,
                        is_leaf=lambda x: isinstance(x, P) or x is None)


def build(mesh, seed=0, *, dispatch_dtype=None, tx=None):
    """(graphdef, params, bias, opt_state, tx), every array created in place on ``mesh``.

    The model is initialized inside ``jit`` with the params' shardings as ``out_shardings``
    (nothing is built on one device and then scattered), so the same code runs in one process
    and in several (``jax.distributed``).
    """

    def create():
        model = TinyMoE(mesh, dispatch_dtype=dispatch_dtype, rngs=nnx.Rngs(seed))
        return nnx.split(model, nnx.Param, moe.BalancingBias)

    with jax.set_mesh(mesh):
        graphdef, abs_params, abs_bias = nnx.split(
            nnx.eval_shape(lambda: TinyMoE(mesh, dispatch_dtype=dispatch_dtype,
                                           rngs=nnx.Rngs(seed))),
            nnx.Param, moe.BalancingBias)
        out = (_shardings(abs_params, mesh), _shardings(abs_bias, mesh))
        params, bias = jax.jit(lambda: create()[1:], out_shardings=out)()
        tx = make_tx(mesh) if tx is None else tx
        opt_state = tx.init(params)
    return graphdef, params, bias, opt_state, tx


def tokens(step, seed=0, mesh=None):
    """Deterministic batch of token ids for ``step`` (split over all mesh axes if given)."""
    rng = np.random.default_rng([seed, step])
    t = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    if mesh is None:
        return jnp.asarray(t)
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return jax.make_array_from_callback(t.shape, sharding, lambda idx: t[idx])


def loss_fn(params, graphdef, bias, batch):
    model = nnx.merge(graphdef, params, bias)
    logits, counts, lb = model(batch[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return ce + 0.01 * lb, (ce, counts)


def make_step(graphdef, tx, *, poison=None, scale_loss=None):
    """jit(params, bias, opt_state, batch[, flag]) -> (params, bias, opt_state, ce).

    ``poison(grads, flag)`` may corrupt the gradients (e.g. put a NaN in one shard);
    ``scale_loss(loss, opt_state)`` multiplies the loss (dynamic loss scaling).
    The balancing biases move by the observed expert loads (aux-loss-free balancing).
    """

    def step(params, bias, opt_state, batch, flag=False):
        def objective(p):
            loss, aux = loss_fn(p, graphdef, bias, batch)
            return (scale_loss(loss, opt_state) if scale_loss else loss), aux

        (_, (ce, counts)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        if poison is not None:
            grads = poison(grads, flag)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        leaves = jax.tree.leaves(bias)
        new = [moe.routing.update_balancing_bias(b, c, BIAS_RATE)
               for b, c in zip(leaves, counts, strict=True)]
        bias = jax.tree.unflatten(jax.tree.structure(bias), new)
        return params, bias, opt_state, ce

    return jax.jit(step)


def run(mesh, steps, *, start=0, state=None, seed=0, step_fn=None, **kw):
    """Train ``steps`` steps from ``state`` (or a fresh build); returns (state, losses)."""
    if state is None:
        graphdef, params, bias, opt_state, tx = build(mesh, seed, **kw)
    else:
        graphdef, params, bias, opt_state, tx = state
    step_fn = make_step(graphdef, tx) if step_fn is None else step_fn
    losses = []
    with jax.set_mesh(mesh):
        for i in range(start, start + steps):
            params, bias, opt_state, ce = step_fn(params, bias, opt_state, tokens(i, seed, mesh))
            # One step at a time: queued steps can deadlock XLA:CPU's in-process collectives
            # (see tests/integration/test_soak.py).
            jax.block_until_ready((params, opt_state))
            losses.append(ce)
    return (graphdef, params, bias, opt_state, tx), np.asarray(jax.device_get(losses))
