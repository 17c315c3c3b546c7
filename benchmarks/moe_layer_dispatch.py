"""Dispatch -> combine alone (identity experts) for benchmarks/moe_layer_bench.py: forward and
forward + backward per (transport, wire, routing), bytes sent over the payload exchanges, and
the dense vs dropless A/B timed interleaved."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_util import median_seconds
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe
from xla_comm import hlo as mhlo


def build_dispatch(mesh, a, transport, wire):
    """jit(forward) and jit(forward + backward) of dispatch -> combine (identity experts; the
    library's default wire kernels), and jit of the dropless bucket index per device."""
    cf = {"dense": a.capacity_factor, "dropless": a.dropless_capacity_factor}.get(transport)

    def disp(x, ids):
        return moe.dispatch(x, ids, num_experts=a.experts, axis_name="expert",
                            transport=transport, capacity_factor=cf, dispatch_dtype=wire,
                            block_size=a.fp8_block_size)

    def local(x, ids, w):
        ex, _, plan = disp(x, ids)
        return moe.combine(ex, w, plan, combine_grad_dtype=wire)

    def bucket(x, ids):
        plan = disp(x, ids)[2]
        return plan.bucket[None], plan.buckets

    spec = P(tuple(mesh.axis_names))  # tokens over every mesh axis
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    fwd = jax.jit(f)
    grad = jax.jit(jax.grad(lambda x, ids, w, ct: jnp.sum(
        f(x, ids, w).astype(jnp.float32) * ct.astype(jnp.float32)), argnums=(0, 2)))

    def bucket_rows(x, ids):
        """Rows per (source, destination) pair the dropless exchange sent, per device."""
        holder = {}

        def body(x, ids):
            b, caps = bucket(x, ids)
            holder["caps"] = caps
            return b

        idx = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec),
                                    out_specs=spec))(x, ids)
        return [holder["caps"][int(i)] for i in np.asarray(idx)]

    return fwd, grad, bucket_rows


DISPATCH_CASES = (("dense", "bf16"), ("dense", "fp8"), ("dropless", "bf16"), ("ragged", "bf16"))


def bench_dispatch(mesh, a, data, biases) -> tuple[list[dict], dict]:
    """Rows per (transport, wire, routing), and the A/B of dense vs dropless (bf16) forward +
    backward timed interleaved per routing (one call of each per round, so drift during the
    run hits both alike)."""
    n = mesh.devices.size
    sh = NamedSharding(mesh, P(tuple(mesh.axis_names)))
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
        fwd, grad, bucket_rows = build_dispatch(mesh, a, transport, wire)
        for routing, (ids, w) in routes.items():
            if routing != "balanced" and wire != "bf16":
                continue
            if transport == "dropless":  # the bucket this routing took (one mesh group)
                caps = bucket_rows(x, ids)
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
            fwd_s, _ = median_seconds(fwd, (x, ids, w), a.warmup, a.iters)
            bwd_s, _ = median_seconds(grad, (x, ids, w, ct), a.warmup, a.iters)
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
        times = {t: [] for t in pair}
        for _ in range(rounds):
            for t, (fn, args) in pair.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[t].append(time.perf_counter() - t0)
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
