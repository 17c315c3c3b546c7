"""Soak run: thousands of steps of a tiny MoE model with sharded Muon must stay finite and learn.

The model (embed -> 2 x [RMSNorm, Linear, moe.MoE with FP8 dispatch] -> RMSNorm -> head) learns
a fixed next-token map ``x[t+1] = (7 x[t] + 3) mod V`` with 10% of the tokens replaced by
uniform noise; the model sees one token at a time, so the best loss is about 1.11 nats
(V = 32), not 0. Optimizer:
``optax.apply_if_finite(muon_jax.muon(..., mesh=mesh))`` with a warmup-cosine schedule; the
MoE balancing biases move every step (aux-loss-free balancing). Expert parallel over
'expert', data parallel over 'data', Muon state split over both.

Checks (exit status 1 if any fails): every loss finite; no step skipped as non-finite; final
params finite; the mean loss of the last 10% of steps is below half that of the first 1%, and
not above that of the second 10% (no late divergence).

``--sync-every 1`` (default) blocks on each step's results before dispatching the next. With
``--sync-every 0`` (steps queued asynchronously) this run deadlocks on XLA:CPU (jax 0.10.2, 8
host devices, 2 cores) after a few hundred steps: one step's all-to-all (MoE dispatch over
'expert') and all-reduce (over all 8 devices) wait forever for devices whose execution is
stuck behind a semaphore in ``CpuPjRtRawLoadedExecutable::Execute``; XLA aborts after
``--xla_cpu_collective_call_terminate_timeout_seconds`` (40 s).

Run (CPU, 8 simulated devices, a few minutes on 2 cores)::

    python benchmarks/soak.py --steps 2000 --out benchmarks/results/soak_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe  # noqa: E402
import muon_jax  # noqa: E402


class Block(nnx.Module):
    def __init__(self, d, d_ff, experts, top_k, mesh, fp8, *, rngs):
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.moe = moe.MoE(d, d_ff, options=moe.MoEOptions.create(
            experts, top_k, capacity_factor=2.0, dispatch_dtype="fp8" if fp8 else None,
            fp8_block_size=16), mesh=mesh, rngs=rngs)

    def __call__(self, x):
        y, aux = self.moe(self.proj(self.norm(x)))
        return x + y, aux


class Tiny(nnx.Module):
    def __init__(self, vocab, d, d_ff, experts, top_k, mesh, fp8, *, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, d_ff, experts, top_k, mesh, fp8, rngs=rngs)
                                for _ in range(2)])
        self.final_norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        auxes = []
        for b in self.blocks:
            x, aux = b(x)
            auxes.append(aux)
        return self.head(self.final_norm(x)), auxes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--mesh", default="2,4", help="'data,expert' sizes (product = devices)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-ff", type=int, default=32)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=250)
    p.add_argument("--sync-every", type=int, default=1,
                   help="block until each N-th step is done (0: never; see the docstring)")
    p.add_argument("--out", default="benchmarks/results/soak_cpu.json")
    return p.parse_args(argv)


def make_batch(rng, batch, seq, vocab):
    x = np.empty((batch, seq + 1), np.int32)
    x[:, 0] = rng.integers(0, vocab, batch)
    for t in range(seq):
        x[:, t + 1] = (7 * x[:, t] + 3) % vocab
    noise = rng.random(x.shape) < 0.1
    x[noise] = rng.integers(0, vocab, int(noise.sum()))
    return x


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = tuple(int(s) for s in args.mesh.split(","))
    mesh = jax.make_mesh(shape, ("data", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[: math.prod(shape)])
    mk = lambda: Tiny(args.vocab, args.d_model, args.d_ff, args.experts, args.top_k, mesh,
                      args.fp8, rngs=nnx.Rngs(args.seed))

    def shardings(tree):
        return jax.tree.map(lambda s: NamedSharding(mesh, s if s is not None else P()),
                            nnx.get_partition_spec(tree),
                            is_leaf=lambda x: isinstance(x, P) or x is None)

    with jax.set_mesh(mesh):
        graphdef, aparams, abias = nnx.split(nnx.eval_shape(mk), nnx.Param, moe.BalancingBias)
        params, bias = jax.jit(lambda: nnx.split(mk(), nnx.Param, moe.BalancingBias)[1:],
                               out_shardings=(shardings(aparams), shardings(abias)))()
        warmup = min(100, args.steps // 2)
        schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps,
                                                      end_value=0.1 * args.lr)
        tx = optax.apply_if_finite(
            muon_jax.muon(schedule, weight_decay=0.01, mesh=mesh), max_consecutive_errors=5)
        opt_state = tx.init(params)

    def loss_fn(p, bias, batch):
        logits, auxes = nnx.merge(graphdef, p, bias)(batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        lb = sum(a["load_balance_loss"] for a in auxes) / len(auxes)
        return ce + 0.01 * lb, (ce, auxes)

    @jax.jit
    def step(params, bias, opt_state, batch):
        (_, (ce, auxes)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, bias, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        leaves = jax.tree.leaves(bias)
        bias = jax.tree.unflatten(jax.tree.structure(bias), [
            moe.routing.update_balancing_bias(b, a["tokens_per_expert"], 1e-3)
            for b, a in zip(leaves, auxes, strict=True)])
        gnorm = optax.global_norm(grads)
        dropped = sum(a["dropped_tokens"] for a in auxes)
        return params, bias, opt_state, ce, gnorm, dropped

    rng = np.random.default_rng(args.seed)
    data_sharding = NamedSharding(mesh, P(("data", "expert")))
    losses, gnorms, dropped = [], [], []
    t0 = time.perf_counter()
    t_compiled = None
    with jax.set_mesh(mesh):
        for i in range(args.steps):
            batch = make_batch(rng, args.batch, args.seq, args.vocab)
            batch = jax.make_array_from_callback(batch.shape, data_sharding,
                                                 lambda idx, b=batch: b[idx])
            params, bias, opt_state, ce, gn, dr = step(params, bias, opt_state, batch)
            losses.append(ce)
            gnorms.append(gn)
            dropped.append(dr)
            if args.sync_every and (i + 1) % args.sync_every == 0:
                jax.block_until_ready((params, opt_state))
            if i == 0:
                jax.block_until_ready(ce)
                t_compiled = time.perf_counter()
            if (i + 1) % args.log_every == 0:
                recent = np.asarray(jax.device_get(losses[-args.log_every:]))
                print(f"step {i + 1:5d}  loss {recent.mean():.4f}  "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
    losses = np.asarray(jax.device_get(losses), np.float64)
    gnorms = np.asarray(jax.device_get(gnorms), np.float64)
    dropped = np.asarray(jax.device_get(dropped), np.int64)
    t_end = time.perf_counter()

    n10, n1 = max(1, args.steps // 10), max(1, args.steps // 100)
    first, last = float(losses[:n1].mean()), float(losses[-n10:].mean())
    second = float(losses[n10:2 * n10].mean())
    params_finite = bool(all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params)))
    bias_vals = np.concatenate([np.asarray(b) for b in jax.tree.leaves(bias)])
    skipped = int(opt_state.total_notfinite)
    checks = {
        "all_losses_finite": bool(np.isfinite(losses).all()),
        "no_skipped_steps": skipped == 0,
        "params_finite": params_finite,
        "loss_falls_by_half": last < 0.5 * first,
        "no_late_divergence": last <= second,
    }
    summary = {
        "args": vars(args),
        "mesh": dict(mesh.shape),
        "env": {"backend": jax.default_backend(), "n_devices": len(jax.devices()),
                "jax": jax.__version__, "python": platform.python_version()},
        "steps": args.steps,
        "loss_first_1pct_mean": first,
        "loss_second_10pct_mean": second,
        "loss_last_10pct_mean": last,
        "loss_min": float(losses.min()),
        "loss_max": float(losses.max()),
        "loss_at": {str(s): float(losses[s - 1]) for s in (1, 10, 100, 500, 1000, args.steps)
                    if s <= args.steps},
        "grad_norm_max": float(gnorms.max()),
        "grad_norm_last": float(gnorms[-1]),
        "dropped_tokens_total": int(dropped.sum()),
        "tokens_total": int(args.steps * args.batch * args.seq * args.top_k * 2),
        "skipped_nonfinite_steps": skipped,
        "param_abs_max": float(max(np.abs(np.asarray(x)).max() for x in jax.tree.leaves(params))),
        "balancing_bias_abs_max": float(np.abs(bias_vals).max()),
        "compile_plus_first_step_s": t_compiled - t0,
        "steps_per_s": (args.steps - 1) / max(t_end - t_compiled, 1e-9),
        "wall_s": t_end - t0,
        "checks": checks,
        "ok": all(checks.values()),
    }
    print(f"soak: {args.steps} steps on mesh {dict(mesh.shape)} (fp8 dispatch: {args.fp8})")
    print(f"  loss {first:.4f} (first 1%) -> {second:.4f} (10-20%) -> {last:.4f} (last 10%), "
          f"min {losses.min():.4f}, "
          f"max {losses.max():.4f}")
    print(f"  grad norm max {gnorms.max():.3g}, last {gnorms[-1]:.3g}; |param| max "
          f"{summary['param_abs_max']:.3g}; |bias| max {summary['balancing_bias_abs_max']:.3g}")
    print(f"  dropped token slots {summary['dropped_tokens_total']} of "
          f"{summary['tokens_total']}; skipped non-finite steps {skipped}")
    print(f"  {summary['steps_per_s']:.1f} steps/s after {summary['compile_plus_first_step_s']:.1f}"
          f" s compile; wall {summary['wall_s']:.1f} s")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2))
        print(f"wrote {out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
