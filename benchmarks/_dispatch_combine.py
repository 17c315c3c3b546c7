"""Dispatch -> combine alone on the MoE layer benchmark's data (a library, no command line).

Used by benchmarks/moe_layer_bench.py (its ``dispatch_combine`` / ``dispatch_combine_ab``
keys) and by ``benchmarks/dispatch_bench.py --part layer``: the layer's tokens, router and
expert weights (:func:`make_layer_data`), the routings (balanced, and a Zipf-skewed one from a
calibrated balancing bias: :func:`make_routings`), and :func:`bench_dispatch`: forward and
forward + backward per (transport, wire, routing), bytes sent over the payload exchanges, and
the dense vs dropless A/B timed interleaved.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _dispatch_harness import dispatch_fns
from bench_util import interleaved_seconds, per_call_seconds
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe
from xla_comm import hlo as mhlo

AXES = ("data", "expert")
ROUTINGS = ("balanced", "zipf")
DISPATCH_CASES = (("dense", "bf16"), ("dense", "fp8"), ("dropless", "bf16"), ("ragged", "bf16"))
# Dispatch -> combine alone takes well under a millisecond on one GPU, about what the host needs
# to launch it and wait: each timed sample is INNER calls issued back to back and blocked once,
# so the medians measure the device's work rather than launch and sync jitter.
INNER = 10


def make_layer_data(mesh, a, weights: bool = True) -> dict:
    """``x`` and ``ct`` [n, tokens, d] bf16 (tokens over every mesh axis), the f32 router
    kernel (replicated) and, with ``weights``, the bf16 expert banks (over 'expert')."""
    n = mesh.devices.size
    t, d, e = a.tokens, a.d_model, a.experts
    ks = jax.random.split(jax.random.key(a.seed), 5)
    tok = NamedSharding(mesh, P(AXES, None, None))
    wsp = NamedSharding(mesh, P("expert", None, None))
    rep = NamedSharding(mesh, P())

    def put(fn, sharding):
        return jax.jit(fn, out_shardings=sharding)()

    data = {
        "x": put(lambda: jax.random.normal(ks[0], (n, t, d), jnp.bfloat16), tok),
        "ct": put(lambda: jax.random.normal(ks[1], (n, t, d), jnp.bfloat16), tok),
        "router_kernel": put(lambda: jax.random.normal(ks[2], (d, e), jnp.float32) * d**-0.5,
                             rep),
    }
    if weights:
        f = a.d_ff
        data["w_gate_up"] = put(lambda: (jax.random.normal(ks[3], (e, d, 2 * f), jnp.float32)
                                         * d**-0.5).astype(jnp.bfloat16), wsp)
        data["w_down"] = put(lambda: (jax.random.normal(ks[4], (e, f, d), jnp.float32)
                                      * f**-0.5).astype(jnp.bfloat16), wsp)
    return data


# ----------------------------------------------------------------------------- routing


def zipf_shares(experts: int, s: float) -> np.ndarray:
    """Target share of the slots per expert: ``p_i ~ 1 / (i + 1)^s``."""
    p = 1.0 / np.arange(1, experts + 1) ** s
    return p / p.sum()


def calibrate_bias(data, a, target: np.ndarray, iters: int = 400) -> tuple[np.ndarray, dict]:
    """A balancing bias (selection only) under which the benchmark's tokens load the experts
    with the shares ``target``: ``bias += step * sign(target - share)``, ``step`` decaying
    geometrically from 0.05 to 1e-4 (the aux-loss-free balancing rule, aimed at ``target``);
    the bias with the smallest L1 error is kept. Returns ``(bias, achieved)``."""
    cfg = moe.RouterConfig(a.experts, a.top_k)
    x = data["x"].reshape(-1, a.d_model)

    @jax.jit
    def shares(bias):
        r = moe.route(x, data["router_kernel"], bias, config=cfg)
        return r.tokens_per_expert / (x.shape[0] * a.top_k)

    bias = np.zeros(a.experts, np.float32)
    best, best_err, step = bias.copy(), np.inf, 0.05
    decay = (1e-4 / step) ** (1.0 / iters)
    for _ in range(iters):
        got = np.asarray(shares(jnp.asarray(bias)))
        err = float(np.abs(got - target).sum())
        if err < best_err:
            best, best_err = bias.copy(), err
        bias = bias + step * np.sign(target - got).astype(np.float32)
        step *= decay
    return best, routing_stats(np.asarray(shares(jnp.asarray(best))), target)


def routing_stats(got: np.ndarray, target: np.ndarray | None = None) -> dict:
    out = {"shares": [round(float(v), 5) for v in got],
           "max_over_mean": float(got.max() * got.size)}
    if target is not None:
        out["target"] = [round(float(v), 5) for v in target]
        out["l1_error"] = float(np.abs(got - target).sum())
    return out


def make_routings(data, a) -> tuple[dict, dict]:
    """``({routing: bias [E]}, {routing: achieved shares})`` for the routings ``a.routing``."""
    biases, stats = {}, {}
    cfg = moe.RouterConfig(a.experts, a.top_k)
    x = data["x"].reshape(-1, a.d_model)
    for name in a.routing:
        if name == "balanced":
            biases[name] = np.zeros(a.experts, np.float32)
            counts = moe.route(x, data["router_kernel"], config=cfg).tokens_per_expert
            stats[name] = routing_stats(np.asarray(counts) / (x.shape[0] * a.top_k))
        else:
            biases[name], stats[name] = calibrate_bias(data, a, zipf_shares(a.experts, a.zipf_s))
    return biases, stats


# ----------------------------------------------------------------------------- timing


def bench_dispatch(mesh, a, data, biases) -> tuple[list[dict], dict]:
    """Rows per (transport, wire, routing), and the A/B of dense vs dropless (bf16) forward +
    backward timed interleaved per routing (``INNER`` calls of each per round, so drift during
    the run hits both alike); every timing is per call."""
    n = mesh.devices.size
    spec = P(tuple(mesh.axis_names))  # tokens over every mesh axis
    sh = NamedSharding(mesh, spec)
    x = jax.device_put(data["x"].reshape(-1, a.d_model), sh)
    ct = jax.device_put(data["ct"].reshape(-1, a.d_model), sh)
    cfg = moe.RouterConfig(a.experts, a.top_k)
    route = jax.jit(lambda x, b: moe.route(x, data["router_kernel"], b, config=cfg))
    routes = {}
    for routing, bias in biases.items():
        r = route(x, jnp.asarray(bias))
        routes[routing] = (jax.device_put(r.expert_ids.astype(jnp.int32), sh),
                           jax.device_put(r.weights, sh))
    rows, grads = [], {}
    for transport, wire in DISPATCH_CASES:
        cf = {"dense": a.capacity_factor, "dropless": a.dropless_capacity_factor}.get(transport)
        fns = dispatch_fns(mesh, spec, transport=transport, wire=wire, experts=a.experts,
                           capacity_factor=cf, block_size=a.fp8_block_size)
        fwd, grad = fns.fwd, fns.grad
        for routing, (ids, w) in routes.items():
            if routing != "balanced" and wire != "bf16":
                continue
            if transport == "dropless":  # the bucket this routing took (one mesh group)
                idx, buckets = fns.bucket_rows(x, ids)
                caps = [buckets[int(i)] for i in idx]
                wire_row = 2 * a.d_model if wire == "bf16" else \
                    a.d_model * (1 + 1 / a.fp8_block_size)  # e4m3 bytes + E8M0 scales
                # forward: P * c dispatched wire rows + P * c returned bf16 rows per device
                n_a2a, buffer = 2, n * max(caps) * (wire_row + 2 * a.d_model)
                sent = buffer * (n - 1) / n
            else:
                caps = None
                colls = mhlo.analyze_collectives(fwd.lower(x, ids, w).compile()).collectives
                a2a = [c for c in colls if c.kind in ("all-to-all", "ragged-all-to-all")
                       and len(c.shapes[0]) > 1]
                n_a2a, buffer = len(a2a), sum(c.buffer_bytes for c in a2a)
                sent = sum(c.ring_bytes for c in a2a)
            fwd_s = per_call_seconds(fwd, (x, ids, w), a.warmup, a.iters, INNER)
            bwd_s = per_call_seconds(grad, (x, ids, w, ct), a.warmup, a.iters, INNER)
            grads[(transport, wire, routing)] = (grad, (x, ids, w, ct))
            rows.append(dict(transport=transport, wire=wire, routing=routing,
                             capacity_factor=a.capacity_factor if transport == "dense"
                             else None, dropless_bucket_rows=caps,
                             fwd_ms=fwd_s * 1e3, fwd_bwd_ms=bwd_s * 1e3,
                             n_all_to_all_fwd=n_a2a,
                             buffer_mb_per_device=buffer / 2**20,
                             sent_mb_per_device=sent / 2**20,
                             GBps_per_gpu=sent / fwd_s / 1e9))
            print(f"dispatch+combine {transport:8s} {wire:4s} {routing:8s}: fwd "
                  f"{fwd_s * 1e3:8.3f} ms, fwd+bwd {bwd_s * 1e3:8.3f} ms", flush=True)
    ab = {}
    rounds = max(3, 2 * a.iters)
    for routing in routes:
        pair = {t: grads.get((t, "bf16", routing)) for t in ("dense", "dropless")}
        if None in pair.values():
            continue
        times = interleaved_seconds({t: (lambda fn=fn, args=args: [fn(*args)
                                                                    for _ in range(INNER)])
                                     for t, (fn, args) in pair.items()}, rounds)
        times = {t: [s / INNER for s in v] for t, v in times.items()}
        med = {t: float(np.median(v)) for t, v in times.items()}
        ab[routing] = dict(rounds=rounds, dense_ms=med["dense"] * 1e3,
                           dropless_ms=med["dropless"] * 1e3,
                           ratio_of_medians=med["dropless"] / med["dense"],
                           median_round_ratio=float(np.median(
                               [d / e for e, d in zip(times["dense"], times["dropless"],
                                                      strict=True)])))
        print(f"A/B dispatch+combine fwd+bwd {routing}: dense {ab[routing]['dense_ms']:.3f} ms, "
              f"dropless {ab[routing]['dropless_ms']:.3f} ms, ratio "
              f"{ab[routing]['ratio_of_medians']:.3f}", flush=True)
    return rows, ab
