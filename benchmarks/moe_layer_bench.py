"""Benchmark the expert-parallel MoE layer (moe.moe_apply) forward + backward, with MFU.

Times ``jax.grad`` of ``sum(y * ct)`` (``ct`` a random cotangent) with respect to x, the
router kernel, w_gate_up and w_down, expert parallel over all devices (mesh ('data', 'expert')
= (1, n_devices)), bf16 activations and expert weights (router kernel f32, as the router
computes in f32), for the variants in VARIANTS: dense transport (capacity 1.25) with einsum,
Pallas or ragged_dot experts, ragged (dropless) transport with ragged_dot or Pallas experts,
each with a bf16 or FP8 wire (FP8 for the dispatch and for the combine gradient); the wire
rows go through the Pallas wire kernels (``wire_kernels='auto'`` on GPUs) except in the
``*_xla_wire`` variants.

MFU = useful FLOPs / (time x n_devices x dense rate), the dense rate being a bf16
8192^3 matmul on one device timed in the same run. Useful FLOPs count the router
(6 * tokens * d_model * E: forward + two backward GEMMs) and the three expert GEMMs of every
*kept* token slot (6 * d_model * d_ff forward, 12 * d_model * d_ff backward); capacity padding
and dropped slots are not useful work. Dropped fraction = dropped slots / (tokens * top_k).

Also times dispatch -> combine alone (identity experts, dense transport, bf16 and FP8 wire):
GB/s per GPU = bytes each device sends over the all-to-alls of the forward ((P-1)/P of each
buffer, from the compiled HLO via xla_comm.hlo) / forward time. (benchmarks/dispatch_check.py
times these too but reports no GB/s and parses argv at import, so it is not imported here.)

``--profile DIR`` captures a jax.profiler trace of a few steps of the variants in
``--profile-variants`` and reports the fraction of NCCL kernel time hidden under compute
(benchmarks/trace_overlap.py). Variants ending in ``_overlap`` are the same step compiled with
``xla_comm.overlap.overlap_compiler_options()``, so exposed communication is compared with and
without the overlap flags in one run.

Usage:
  python benchmarks/moe_layer_bench.py                   # GPU: 16384 tokens/GPU, 4096/2048, E16 k2
  python benchmarks/moe_layer_bench.py --small           # CPU, 8 simulated devices
  python benchmarks/moe_layer_bench.py --tokens 32768 --profile /tmp/moe_trace --out r.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS: dict[str, dict] = {
    "dense_einsum_bf16": dict(transport="dense", backend="einsum", wire="bf16"),
    "dense_einsum_fp8": dict(transport="dense", backend="einsum", wire="fp8"),
    "dense_ragged_dot_bf16": dict(transport="dense", backend="ragged_dot", wire="bf16"),
    "dense_ragged_dot_fp8": dict(transport="dense", backend="ragged_dot", wire="fp8"),
    "ragged_bf16": dict(transport="ragged", backend="ragged_dot", wire="bf16"),
    "ragged_fp8": dict(transport="ragged", backend="ragged_dot", wire="fp8"),
    "ragged_pallas_bf16": dict(transport="ragged", backend="pallas", wire="bf16"),
    "ragged_pallas_fp8": dict(transport="ragged", backend="pallas", wire="fp8"),
    # The same steps compiled with xla_comm.overlap.overlap_compiler_options() (latency-hiding
    # scheduler, combine thresholds, high-priority collective stream).
    "dense_einsum_bf16_overlap": dict(transport="dense", backend="einsum", wire="bf16",
                                      overlap=True),
    "dense_einsum_fp8_overlap": dict(transport="dense", backend="einsum", wire="fp8",
                                     overlap=True),
    # The XLA wire path instead of the Pallas wire kernels (wire_kernels='auto' on GPUs).
    "dense_einsum_bf16_xla_wire": dict(transport="dense", backend="einsum", wire="bf16",
                                       wire_kernels="xla"),
    "dense_einsum_fp8_xla_wire": dict(transport="dense", backend="einsum", wire="fp8",
                                      wire_kernels="xla"),
    "dense_pallas_bf16": dict(transport="dense", backend="pallas", wire="bf16"),
}
DEFAULT_VARIANTS = ["dense_einsum_bf16", "dense_einsum_fp8", "dense_einsum_bf16_overlap",
                    "dense_einsum_fp8_overlap", "dense_einsum_bf16_xla_wire",
                    "dense_einsum_fp8_xla_wire", "dense_pallas_bf16", "dense_ragged_dot_bf16",
                    "ragged_pallas_bf16", "ragged_bf16", "ragged_fp8"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="CPU sizes, 8 simulated devices")
    p.add_argument("--tokens", type=int, help="tokens per device (16384; small 128)")
    p.add_argument("--d-model", type=int, help="4096; small 256")
    p.add_argument("--d-ff", type=int, help="2048; small 128")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25, help="dense transport")
    p.add_argument("--fp8-block-size", type=int, help="FP8 channels per scale (128; small 32)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS)
    p.add_argument("--no-dispatch-only", action="store_true",
                   help="skip the dispatch+combine-alone timings")
    p.add_argument("--ceiling-n", type=int, help="dense matmul size (8192; small 512)")
    p.add_argument("--warmup", type=int, help="3; small 1")
    p.add_argument("--iters", type=int, help="10; small 2")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="capture jax.profiler traces under DIR/<variant> and report overlap")
    p.add_argument("--profile-variants", nargs="+", choices=list(VARIANTS),
                   default=["dense_einsum_bf16", "dense_einsum_fp8",
                            "dense_einsum_bf16_overlap", "dense_einsum_fp8_overlap"])
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results" / "moe_layer_bench.json"),
                   help="JSON path ('' to skip)")
    a = p.parse_args(argv)
    small = dict(tokens=128, d_model=256, d_ff=128, ceiling_n=512, warmup=1, iters=2,
                 fp8_block_size=32)
    full = dict(tokens=16384, d_model=4096, d_ff=2048, ceiling_n=8192, warmup=3, iters=10,
                fp8_block_size=128)
    for k, v in (small if a.small else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.small:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_util import (  # noqa: E402
    compile_with,
    dense_ceiling,
    env_info,
    median_seconds,
    write_json,
)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from trace_overlap import exposed_comm_fraction  # noqa: E402

import moe  # noqa: E402
from xla_comm import hlo, overlap  # noqa: E402

AXES = ("data", "expert")


def make_mesh():
    n = len(jax.devices())
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((1, n), AXES, axis_types=auto, devices=jax.devices())


def make_data(mesh, a):
    n = mesh.devices.size
    t, d, f, e = a.tokens, a.d_model, a.d_ff, a.experts
    ks = jax.random.split(jax.random.key(a.seed), 5)
    tok = NamedSharding(mesh, P(AXES, None, None))
    wsp = NamedSharding(mesh, P("expert", None, None))
    rep = NamedSharding(mesh, P())

    def put(fn, sharding):
        return jax.jit(fn, out_shardings=sharding)()

    return {
        "x": put(lambda: jax.random.normal(ks[0], (n, t, d), jnp.bfloat16), tok),
        "ct": put(lambda: jax.random.normal(ks[1], (n, t, d), jnp.bfloat16), tok),
        "router_kernel": put(lambda: jax.random.normal(ks[2], (d, e), jnp.float32) * d**-0.5,
                             rep),
        "w_gate_up": put(lambda: (jax.random.normal(ks[3], (e, d, 2 * f), jnp.float32)
                                  * d**-0.5).astype(jnp.bfloat16), wsp),
        "w_down": put(lambda: (jax.random.normal(ks[4], (e, f, d), jnp.float32)
                               * f**-0.5).astype(jnp.bfloat16), wsp),
    }


def options(name: str, a) -> moe.MoEOptions:
    v = VARIANTS[name]
    return moe.MoEOptions.create(
        a.experts, a.top_k,
        expert_axis="expert",
        transport=v["transport"],
        capacity_factor=a.capacity_factor if v["transport"] == "dense" else None,
        dispatch_dtype=v["wire"],
        combine_grad_dtype=v["wire"],
        backend=v["backend"],
        fp8_block_size=a.fp8_block_size,
        wire_kernels=v.get("wire_kernels", "auto"),
    )


def layer_args(data):
    return (data["x"], data["router_kernel"], data["w_gate_up"], data["w_down"], data["ct"])


def build_layer(name, mesh, a, data):
    """The jitted fwd+bwd step (compiled with the overlap options for ``*_overlap`` variants,
    which records the options XLA applied) and the dropped-token count."""
    opts = options(name, a)

    def fwd(x, rk, wgu, wd):
        return moe.moe_apply(x, rk, wgu, wd, opts=opts, mesh=mesh)

    def loss(x, rk, wgu, wd, ct):
        y, _ = fwd(x, rk, wgu, wd)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    compiler = None
    if VARIANTS[name].get("overlap"):
        want = overlap.overlap_compiler_options()
        step, dropped_opts = compile_with(step.lower(*layer_args(data)), want)
        compiler = {"options": want, "options_dropped": dropped_opts}
    dropped = jax.jit(lambda x, rk, wgu, wd: fwd(x, rk, wgu, wd)[1]["dropped_tokens"])
    return step, dropped, compiler


def useful_flops(a, n_dev: int, kept_slots: int) -> float:
    tokens = n_dev * a.tokens
    router = 6.0 * tokens * a.d_model * a.experts
    experts = 18.0 * a.d_model * a.d_ff * kept_slots
    return router + experts


def bench_layer(name, mesh, data, a, ceiling, step, dropped_fn) -> dict:
    n_dev = mesh.devices.size
    args = layer_args(data)
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    first = time.perf_counter() - t0
    sec, times = median_seconds(step, args, a.warmup, a.iters)
    dropped = int(dropped_fn(*args[:4]))
    slots = n_dev * a.tokens * a.top_k
    flops = useful_flops(a, n_dev, slots - dropped)
    row = dict(variant=name, **VARIANTS[name],
               capacity_factor=a.capacity_factor if VARIANTS[name]["transport"] == "dense"
               else None,
               seconds=sec, ms=sec * 1e3, times_s=times, first_call_s=first,
               dropped_slots=dropped, dropped_frac=dropped / slots, useful_flops=flops,
               useful_tflops_per_device=flops / sec / n_dev / 1e12,
               mfu=flops / (sec * n_dev * ceiling["tflops"] * 1e12))
    return row


def profile_layer(name, data, a, step) -> dict:
    args = layer_args(data)
    jax.block_until_ready(step(*args))
    trace_dir = os.path.join(a.profile, name)
    try:
        with jax.profiler.trace(trace_dir):
            for _ in range(a.profile_steps):
                jax.block_until_ready(step(*args))
    except Exception as err:  # a profiler failure must not lose the timings
        return {"exposed_fraction": None, "reason": f"profiler failed: {err!r}"}
    r = exposed_comm_fraction(trace_dir)
    r["trace_dir"] = trace_dir
    r.pop("source", None)
    return r


def build_dispatch(mesh, a, wire):
    """jit(forward) and jit(forward + backward) of dispatch -> combine (dense, identity; the
    library's default wire kernels)."""
    cf = a.capacity_factor

    def local(x, ids, w):
        ex, _, plan = moe.dispatch(x, ids, num_experts=a.experts, axis_name="expert",
                                   transport="dense", capacity_factor=cf, dispatch_dtype=wire,
                                   block_size=a.fp8_block_size)
        return moe.combine(ex, w, plan, combine_grad_dtype=wire)

    spec = P(AXES)
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    fwd = jax.jit(f)
    grad = jax.jit(jax.grad(lambda x, ids, w, ct: jnp.sum(
        f(x, ids, w).astype(jnp.float32) * ct.astype(jnp.float32)), argnums=(0, 2)))
    return fwd, grad


def bench_dispatch(mesh, a) -> list[dict]:
    n = mesh.devices.size
    t = n * a.tokens
    kx, kl, kc = jax.random.split(jax.random.key(a.seed + 7), 3)
    sh = NamedSharding(mesh, P(AXES))
    x = jax.device_put(jax.random.normal(kx, (t, a.d_model), jnp.bfloat16), sh)
    logits = jax.random.normal(kl, (t, a.experts), jnp.float32)
    w, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), a.top_k)
    ids, w = jax.device_put(ids.astype(jnp.int32), sh), jax.device_put(w, sh)
    ct = jax.device_put(jax.random.normal(kc, (t, a.d_model), jnp.bfloat16), sh)
    rows = []
    for wire in ("bf16", "fp8"):
        fwd, grad = build_dispatch(mesh, a, wire)
        colls = hlo.analyze_collectives(fwd.lower(x, ids, w).compile()).collectives
        a2a = [c for c in colls if c.kind in ("all-to-all", "ragged-all-to-all")]
        sent = sum(c.ring_bytes for c in a2a)
        fwd_s, _ = median_seconds(fwd, (x, ids, w), a.warmup, a.iters)
        bwd_s, _ = median_seconds(grad, (x, ids, w, ct), a.warmup, a.iters)
        rows.append(dict(transport="dense", wire=wire, capacity_factor=a.capacity_factor,
                         fwd_ms=fwd_s * 1e3, fwd_bwd_ms=bwd_s * 1e3,
                         n_all_to_all_fwd=len(a2a),
                         buffer_mb_per_device=sum(c.buffer_bytes for c in a2a) / 2**20,
                         sent_mb_per_device=sent / 2**20,
                         GBps_per_gpu=sent / fwd_s / 1e9))
    return rows


def print_table(report):
    c = report["ceiling"]
    e = report["env"]
    s = report["settings"]
    print(f"\nMoE layer fwd+bwd on {e['n_devices']}x {e['device_kind']} ({e['backend']}), jax "
          f"{e['jax']}: tokens/device {s['tokens']}, d_model {s['d_model']}, d_ff {s['d_ff']}, "
          f"E {s['experts']}, top-{s['top_k']}")
    print(f"dense bf16 ceiling {c['tflops']:.2f} TFLOP/s per device ({c['name']})")
    hdr = f"{'variant':26s} {'ms':>9s} {'TFLOP/s/dev':>11s} {'MFU':>7s} {'dropped':>8s} " \
          f"{'exposed':>8s}"
    print(hdr + "\n" + "-" * len(hdr))
    for r in report["layer"]:
        ov = r["overlap"].get("exposed_fraction") if isinstance(r.get("overlap"), dict) else None
        print(f"{r['variant']:26s} {r['ms']:9.3f} {r['useful_tflops_per_device']:11.3f} "
              f"{r['mfu']:7.3f} {r['dropped_frac']:8.4f} "
              f"{'-' if ov is None else f'{ov:.3f}':>8s}")
    for r in report.get("dispatch_combine", []):
        print(f"dispatch+combine dense {r['wire']:4s}: fwd {r['fwd_ms']:8.3f} ms, fwd+bwd "
              f"{r['fwd_bwd_ms']:8.3f} ms, {r['sent_mb_per_device']:8.2f} MB sent/dev, "
              f"{r['GBps_per_gpu']:8.2f} GB/s per GPU")


def main(a) -> dict:
    mesh = make_mesh()
    n = mesh.devices.size
    if a.experts % n:
        raise SystemExit(f"--experts {a.experts} must be a multiple of the {n} devices")
    report = dict(benchmark="moe_layer_fwd_bwd", env=env_info(),
                  settings={k: v for k, v in vars(a).items() if k != "out"},
                  mesh={"data": 1, "expert": n},
                  useful_flops_formula="6*tokens*d_model*E + 18*d_model*d_ff*kept_slots",
                  layer=[], errors={})
    report["ceiling"] = dense_ceiling(a.ceiling_n, a.warmup, max(a.iters, 5))
    print(f"ceiling: {report['ceiling']['tflops']:.2f} TFLOP/s", flush=True)
    write_json(a.out, report)
    data = make_data(mesh, a)

    def dispatch_once():  # after the first variant: a timeout later keeps these numbers
        if a.no_dispatch_only or "dispatch_combine" in report or \
                "dispatch_combine" in report["errors"]:
            return
        try:
            report["dispatch_combine"] = bench_dispatch(mesh, a)
        except Exception as err:
            report["errors"]["dispatch_combine"] = repr(err)[:2000]
            print(f"dispatch_combine: FAILED {err!r}"[:500], flush=True)
        write_json(a.out, report)

    for name in a.variants:
        try:
            step, dropped_fn, compiler = build_layer(name, mesh, a, data)
            row = bench_layer(name, mesh, data, a, report["ceiling"], step, dropped_fn)
            if compiler:
                row["compiler"] = compiler
        except Exception as err:  # keep going: one variant failing must not lose the rest
            report["errors"][name] = repr(err)[:2000]
            print(f"{name}: FAILED {err!r}"[:500], flush=True)
            dispatch_once()
            continue
        report["layer"].append(row)
        print(f"{name:26s} {row['ms']:9.3f} ms  MFU {row['mfu']:.3f}  dropped "
              f"{row['dropped_frac']:.4f}", flush=True)
        write_json(a.out, report)
        if a.profile and name in a.profile_variants:  # reuses the compiled step
            row["overlap"] = profile_layer(name, data, a, step)
            print(f"profile {name}: exposed collective fraction "
                  f"{row['overlap'].get('exposed_fraction')} "
                  f"{row['overlap'].get('reason', '')}", flush=True)
            write_json(a.out, report)
        del step, dropped_fn
        dispatch_once()
    print_table(report)
    write_json(a.out, report)
    if a.out:
        print(f"wrote {a.out}")
    return report


if __name__ == "__main__":
    main(ARGS)
