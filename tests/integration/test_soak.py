"""Soak: the tiny MoE model (tests/_tiny_moe.py, FP8 dispatch) trained by
``optax.apply_if_finite(muon(mesh=(2, 4)))`` stays finite and learns.

The model learns a fixed next-token map ``x[t+1] = (7 x[t] + 3) mod V`` with 10% of the tokens
replaced by uniform noise; it sees one token at a time, so the best loss is about 1.11 nats
(V = 32), not 0. Every step is synchronized (queued multi-device steps can deadlock XLA:CPU's
in-process collectives). The test runs 40 steps; ``python tests/integration/test_soak.py 2000`` runs
a long soak and prints its summary.
"""

import json
import os
import sys
import time

import _tiny_moe as tm
import jax
import numpy as np
import optax

import muon_jax

STEPS = 40


def next_token_batch(rng: np.random.Generator) -> np.ndarray:
    """[BATCH, SEQ + 1] tokens of the map ``(7 x + 3) mod V``, 10% replaced by noise."""
    x = np.empty((tm.BATCH, tm.SEQ + 1), np.int32)
    x[:, 0] = rng.integers(0, tm.VOCAB, tm.BATCH)
    for t in range(tm.SEQ):
        x[:, t + 1] = (7 * x[:, t] + 3) % tm.VOCAB
    noise = rng.random(x.shape) < 0.1
    x[noise] = rng.integers(0, tm.VOCAB, int(noise.sum()))
    return x


def soak(steps: int, *, lr: float = 0.02, seed: int = 0) -> dict:
    """Train ``steps`` synchronized steps; the loss curve, checks and timings."""
    mesh = tm.make_mesh((2, 4))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 10), steps,
                                                  end_value=0.1 * lr)
    tx = optax.apply_if_finite(muon_jax.muon(schedule, weight_decay=0.01,
                                             sharding=muon_jax.ShardingOptions(mesh)),
                               max_consecutive_errors=5)
    graphdef, params, bias, opt_state, tx = tm.build(mesh, seed, dispatch_dtype="fp8", tx=tx)
    step = tm.make_step(graphdef, tx)
    sharding = jax.NamedSharding(mesh, jax.P(("data", "expert")))
    rng = np.random.default_rng(seed)
    losses = []
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        for _ in range(steps):
            batch = next_token_batch(rng)
            batch = jax.make_array_from_callback(batch.shape, sharding, lambda i, b=batch: b[i])
            params, bias, opt_state, ce = step(params, bias, opt_state, batch)
            jax.block_until_ready((params, opt_state))
            losses.append(ce)
    wall = time.perf_counter() - t0
    losses = np.asarray(jax.device_get(losses), np.float64)
    n10, n1 = max(1, steps // 10), max(1, steps // 100)
    first, second, last = (float(losses[:n1].mean()), float(losses[n10:2 * n10].mean()),
                           float(losses[-n10:].mean()))
    checks = {
        "all_losses_finite": bool(np.isfinite(losses).all()),
        "no_skipped_steps": int(opt_state.total_notfinite) == 0,
        "params_finite": all(bool(np.isfinite(np.asarray(x)).all())
                             for x in jax.tree.leaves(params)),
        "loss_falls_by_half": last < 0.5 * first,
        "no_late_divergence": last <= second,
    }
    return {"steps": steps, "loss_first_1pct_mean": first, "loss_second_10pct_mean": second,
            "loss_last_10pct_mean": last, "steps_per_s": steps / wall, "wall_s": wall,
            "checks": checks}


def test_soak_stays_finite_and_learns():
    summary = soak(STEPS)
    assert all(summary["checks"].values()), summary


if __name__ == "__main__":
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()
    print(json.dumps(soak(int(sys.argv[1]) if len(sys.argv) > 1 else 2000), indent=2))
