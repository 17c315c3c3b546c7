"""Quickstart: train a tiny Flax NNX language model with muon_jax.muon (CPU, a few seconds).

The task is a synthetic "language" in which the next token is a fixed function of the
previous two, ``x[t+1] = (5 x[t] + 3 x[t-1] + 1) mod V`` (V = 16); a small MLP on two token
embeddings learns it. Hidden matrices train with Muon, the embedding, head, biases and norm
with AdamW (:func:`muon_jax.default_muon_mask` decides). Run::

    python3 examples/quickstart.py
"""

from __future__ import annotations

import argparse
import time

import jax
import optax
from flax import nnx

import muon_jax


class TinyLM(nnx.Module):
    """Embed two context tokens, two hidden layers, LayerNorm, output head."""

    def __init__(self, vocab: int, width: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.hidden1 = nnx.Linear(2 * width, 4 * width, rngs=rngs)
        self.hidden2 = nnx.Linear(4 * width, 2 * width, rngs=rngs)
        self.norm = nnx.LayerNorm(2 * width, rngs=rngs)
        self.head = nnx.Linear(2 * width, vocab, rngs=rngs)

    def __call__(self, context: jax.Array) -> jax.Array:
        h = self.embed(context).reshape(context.shape[0], -1)  # [batch, 2 * width]
        h = h + self.hidden2(jax.nn.gelu(self.hidden1(h)))
        return self.head(self.norm(h))


def make_batch(key: jax.Array, batch: int, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Random context pairs and the token the synthetic grammar says comes next."""
    context = jax.random.randint(key, (batch, 2), 0, vocab)
    target = (5 * context[:, 1] + 3 * context[:, 0] + 1) % vocab
    return context, target


def loss_fn(model: TinyLM, context: jax.Array, target: jax.Array) -> jax.Array:
    logits = model(context)
    return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()


@nnx.jit
def train_step(model: TinyLM, optimizer: nnx.Optimizer, context, target) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, context, target)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    model = TinyLM(args.vocab, args.width, rngs=nnx.Rngs(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 10, args.steps)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        muon_jax.muon(schedule, weight_decay=0.01),  # rms_match: one lr for Muon and AdamW
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    mask = muon_jax.default_muon_mask(nnx.state(model, nnx.Param))
    on_muon = [
        jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")
        for path, flag in jax.tree_util.tree_flatten_with_path(mask)[0]
        if flag
    ]
    print(f"Muon: {on_muon}; everything else: AdamW")

    key = jax.random.key(1)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        key, sub = jax.random.split(key)
        loss = train_step(model, optimizer, *make_batch(sub, args.batch, args.vocab))
        if step == 1 or step % args.log_every == 0:
            print(f"step {step:4d}  loss {float(loss):.4f}")
    context, target = make_batch(jax.random.key(2), 4096, args.vocab)
    final = float(loss_fn(model, context, target))
    accuracy = float((model(context).argmax(-1) == target).mean())
    elapsed = time.perf_counter() - start
    print(f"final loss {final:.4f}  accuracy {accuracy:.3f}  ({elapsed:.1f} s)")


if __name__ == "__main__":
    main()
