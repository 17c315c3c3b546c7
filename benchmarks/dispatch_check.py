"""Check and time moe.dispatch / moe.combine: dense vs dropless vs ragged transport, bf16 vs FP8.

1. Checks (dropless): the native ``jax.lax.ragged_all_to_all`` path (GPU/TPU only) equals the
   CPU emulation, the ``'dropless'`` transport (bucketed ``all_to_all``) equals the emulation
   bit for bit (expert inputs, group sizes, outputs, gradients), and all equal the dense
   ``all_to_all`` path: expert inputs, group sizes, combined outputs and gradients, with
   per-expert scaling as the "experts". Balanced routing and a skewed one (every token on
   the first device's experts, the dropless exchange's worst case).
2. Times, for every (transport, wire) pair, ``dispatch`` alone (forward, up to the expert
   layout: the time the FP8 <= 0.6x bf16 target is about, since combine returns bf16 either
   way) and ``dispatch -> combine`` (identity experts) forward and forward+backward: warmup,
   then the median of ``--iters`` runs, each ending in ``jax.block_until_ready``; random
   (non-zero) tokens and routing, sharded over the expert axis before timing (unsharded
   inputs would add a host-side reshard to every call). Also reports the bytes of every
   collective in the emitted HLO (buffer sizes; ragged buffers are worst-case sized) and GB/s
   per GPU two ways: ``GBps_buffer`` = payload all-to-all buffer bytes per device (capacity
   padding and the chunk a device keeps included) / time, ``GBps_remote`` = (P-1)/P of those
   bytes (what leaves the GPU; moe_layer_bench's figure) / time. benchmarks/dispatch_phases.py
   times each phase and also gives DeepEP's count.
3. A/B: dense ``dispatch`` with the bf16 and the FP8 wire timed interleaved (one call of each
   per round, 60 rounds), for the default wire kernels and for the XLA wire path: the
   headline FP8/bf16 dispatch-time ratio (benchmarks/collect.py), robust to drift between
   separately timed runs (which moved single figures by 10-15% on the H200s).

Prints a table and writes JSON to ``--out``.

    python benchmarks/dispatch_check.py                      # GPU, real sizes
    python benchmarks/dispatch_check.py --small              # CPU, 8 simulated devices
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_util import (  # noqa: E402
    add_routing_args,
    cli,
    env_info,
    fill_defaults,
    force_cpu_devices,
    median_seconds,
    write_json,
)
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from moe._transport import resolve_ragged_impl  # noqa: E402
from moe.dispatch import combine, dispatch  # noqa: E402
from xla_comm import hlo  # noqa: E402

AXIS = "expert"
_EXCHANGES = ("all-to-all", "ragged-all-to-all")


def parse_args():
    p = cli(__doc__)
    add_routing_args(p, tokens="16384; small 64", d_model="4096; small 512")
    p.add_argument("--check-tokens", type=int, help="tokens per device for the checks")
    p.add_argument("--warmup", type=int, help="untimed runs first (default 3; small: 1)")
    p.add_argument("--iters", type=int, help="timed runs (default 20; small: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ab-configs", default="auto,xla",
                   help="A/B configurations: auto (library default wire kernels), xla (XLA wire "
                        "path), auto_memcpy_p2p (auto, compiled with XLA's "
                        "xla_gpu_use_memcpy_local_p2p: copies instead of NCCL between the GPUs "
                        "of one process)")
    p.add_argument("--ab-only", action="store_true", help="skip the checks and other timings")
    p.add_argument("--out", default="benchmarks/results/dispatch_check.json")
    return fill_defaults(
        p.parse_args(),
        small=dict(tokens=64, d_model=512, check_tokens=32, iters=3, warmup=1),
        full=dict(tokens=16384, d_model=4096, check_tokens=2048, iters=20, warmup=3))


ARGS = parse_args()
if ARGS.small:
    force_cpu_devices(ARGS.cpu_devices)


def collective_bytes(rep: hlo.CollectiveReport) -> dict[str, int]:
    """Full-buffer bytes of the exchanges and all-gathers of a report, by kind."""
    out: dict[str, int] = {}
    for c in rep.of_kind(*_EXCHANGES, "all-gather"):
        out[c.kind] = out.get(c.kind, 0) + c.buffer_bytes
    return out


def payload_bytes(lowered, branch: int | None = None) -> int:
    """Bytes of the payload exchanges (all-to-all / ragged-all-to-all arrays of 2-D or more
    rows; the count exchange is 1-D and left out) of a lowered program, as emitted.
    ``branch``: of the exchanges inside ``lax.switch`` branches (the dropless buckets), count
    only those of that branch (read from the ops' ``branch_<i>_fun`` metadata)."""
    rep = hlo.analyze_collectives(lowered)
    text = hlo.hlo_text(lowered)
    total = 0
    for c in rep.of_kind(*_EXCHANGES):
        line = next((ln for ln in text.splitlines() if f"{c.name} =" in ln), "")
        b = re.search(r"/branch_(\d+)_fun/", line)
        if branch is not None and b and int(b.group(1)) != branch:
            continue
        total += sum(hlo.array_nbytes(dt, shape)
                     for dt, shape in zip(c.dtypes, c.shapes, strict=True) if len(shape) >= 2)
    return total


def make_inputs(mesh, n_dev, tokens, d, experts, k, seed):
    """Random tokens, distinct top-k expert ids from random logits, softmax weights; all
    sharded over the expert axis (as the per-device arrays of a real step are)."""
    kx, kl, kc = jax.random.split(jax.random.key(seed), 3)

    def make():
        x = jax.random.normal(kx, (n_dev * tokens, d), jnp.float32).astype(jnp.bfloat16)
        logits = jax.random.normal(kl, (n_dev * tokens, experts), jnp.float32)
        w, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        ct = jax.random.normal(kc, (n_dev * tokens, d), jnp.float32).astype(jnp.bfloat16)
        return x, ids.astype(jnp.int32), w, ct

    sh = NamedSharding(mesh, P(AXIS))
    return jax.jit(make, out_shardings=(sh, sh, sh, sh))()


def expert_scale(ex, sizes, transport, num_experts):
    """'Experts' that scale rows by (1 + global expert id) / E, so misrouting shows."""
    el = sizes.shape[0]
    first = jax.lax.axis_index(AXIS) * el
    if ex.ndim == 3:  # dense layout
        s = (1.0 + first + jnp.arange(el)) / num_experts
        return ex * s[:, None, None].astype(ex.dtype)
    row_e = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(ex.shape[0]), side="right")
    s = (1.0 + first + jnp.minimum(row_e, el - 1)) / num_experts
    return ex * s[:, None].astype(ex.dtype)


def build(mesh, *, transport, impl, wire, experts, capacity_factor, scale):
    """jit(forward) and jit(forward + backward) of dispatch -> experts -> combine."""

    def local(x, ids, w):
        ex, sizes, plan = dispatch(
            x, ids, num_experts=experts, axis_name=AXIS, transport=transport,
            capacity_factor=capacity_factor, dispatch_dtype=wire, ragged_impl=impl)
        ey = expert_scale(ex, sizes, transport, experts) if scale else ex
        y = combine(ey, w, plan, combine_grad_dtype=wire)
        return y, ex, sizes, plan.dropped[None]

    spec = P(AXIS)
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec),
                      out_specs=(spec, spec, spec, spec))
    fwd = jax.jit(lambda x, ids, w: f(x, ids, w)[0])
    full = jax.jit(f)
    disp = jax.jit(jax.shard_map(
        lambda x, ids: dispatch(x, ids, num_experts=experts, axis_name=AXIS,
                                transport=transport, capacity_factor=capacity_factor,
                                dispatch_dtype=wire, ragged_impl=impl)[0],
        mesh=mesh, in_specs=(spec, spec), out_specs=spec))

    def loss(x, ids, w, ct):
        return jnp.sum(f(x, ids, w)[0].astype(jnp.float32) * ct.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 2)))
    return fwd, full, grad, disp


def skew_ids(ids, experts, n_dev):
    """Every token's k choices moved onto the first device's experts (distinct, same order):
    every source sends all its slots to device 0, the dropless exchange's worst case."""
    k = ids.shape[1]
    el = experts // n_dev
    if el < k:
        return ids
    return (ids % el).at[:, 1:].set((ids[:, :1] % el + jnp.arange(1, k)) % el)


def run_checks(mesh, n_dev, native_ok):
    a = ARGS
    x, ids, w, ct = make_inputs(mesh, n_dev, a.check_tokens, a.d_model, a.experts, a.top_k,
                                a.seed + 1)
    results = {}
    impls = ["emulated"] + (["native"] if native_ok else [])
    cases = [(t, i) for t in ("dense", "dropless") for i in ("emulated",)] + [
        ("ragged", i) for i in impls]
    built = {(wire, t, i): build(mesh, transport=t, impl=i, wire=wire, experts=a.experts,
                                 capacity_factor=None, scale=True)
             for wire in ("bf16", "fp8") for t, i in cases}
    skewed = jax.jit(lambda ids: skew_ids(ids, a.experts, n_dev),
                     out_shardings=ids.sharding)(ids)
    for routing, route in (("balanced", ids), ("skewed", skewed)):
        for wire in ("bf16", "fp8"):
            results.update(check_case(built, wire, routing, cases, x, route, w, ct))
    if not native_ok:
        print(f"check native ragged_all_to_all: skipped (backend {jax.default_backend()} has "
              "no ragged-all-to-all; run on GPU/TPU)")
    return results


def check_case(built, wire, routing, cases, x, ids, w, ct):
    results = {}
    outs = {}
    for transport, impl in cases:
        _, full, grad, _ = built[(wire, transport, impl)]
        y, ex, sizes, dropped = jax.block_until_ready(full(x, ids, w))
        dx, dw = jax.block_until_ready(grad(x, ids, w, ct))
        assert int(dropped.sum()) == 0
        outs[(transport, impl)] = dict(y=y, ex=ex, sizes=sizes, dx=dx, dw=dw)
    ref = outs[("dense", "emulated")]
    for key, o in outs.items():
        if key == ("dense", "emulated"):
            continue
        err = {name: float(jnp.max(jnp.abs(o[name].astype(jnp.float32)
                                           - ref[name].astype(jnp.float32))))
               for name in ("y", "dx", "dw")}
        ok = bool(np.array_equal(o["sizes"], ref["sizes"])) and all(
            v <= 1e-3 * float(jnp.max(jnp.abs(ref[n].astype(jnp.float32))))
            for n, v in err.items())
        bitwise = None
        if key != ("ragged", "emulated"):  # the same data movement as the emulation
            emu = outs[("ragged", "emulated")]
            names = ("ex", "sizes", "y", "dx", "dw")
            bitwise = all(np.array_equal(np.asarray(o[n], np.float32),
                                         np.asarray(emu[n], np.float32)) for n in names)
            ok &= bitwise
        impl = key[1] if key[0] == "ragged" else "all_to_all"
        name = f"{key[0]}[{impl}] vs dense, wire={wire}, {routing}"
        results[name] = dict(ok=ok, max_abs_err=err, bitwise_equal_emulated_ragged=bitwise)
        print(f"check {name:52s} {'OK' if ok else 'FAIL'}  max|err| {err}"
              + ("" if bitwise is None else f"  bitwise = ragged[emulated]: {bitwise}"))
    return results


def time_fn(fn, *args):
    return median_seconds(fn, args, ARGS.warmup, ARGS.iters)[0]


def run_timings(mesh, n_dev, native_ok):
    a = ARGS
    x, ids, w, ct = make_inputs(mesh, n_dev, a.tokens, a.d_model, a.experts, a.top_k, a.seed)
    rows = []
    impl = "native" if native_ok else "emulated"
    bucket_of = jax.jit(jax.shard_map(  # the dropless exchange's bucket, per device
        lambda x, ids: dispatch(x, ids, num_experts=a.experts, axis_name=AXIS,
                                transport="dropless")[2].bucket[None],
        mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS)))
    for transport in ("dense", "dropless", "ragged"):
        for wire in ("bf16", "fp8"):
            if a.small and wire == "fp8" and transport != "dense":
                continue  # CPU plumbing check: the FP8 dropless/ragged paths are checked above
            cf = a.capacity_factor if transport == "dense" else None
            fwd, full, grad, disp = build(mesh, transport=transport, impl=impl, wire=wire,
                                          experts=a.experts, capacity_factor=cf, scale=False)
            dropped = int(jax.block_until_ready(full(x, ids, w))[3].sum())
            fwd_low = fwd.lower(x, ids, w)
            fwd_rep = hlo.analyze_collectives(fwd_low)  # as emitted
            # dropless: the emitted HLO holds one exchange per bucket: count the bucket taken
            branch = int(np.max(bucket_of(x, ids))) if transport == "dropless" else None
            disp_bytes = payload_bytes(disp.lower(x, ids), branch)
            disp_s = time_fn(disp, x, ids)
            fwd_s = time_fn(fwd, x, ids, w)
            fwd_bytes = payload_bytes(fwd_low, branch)
            remote = (n_dev - 1) / n_dev
            row = dict(
                transport=transport, impl=impl if transport == "ragged" else "all_to_all",
                wire=wire, capacity_factor=cf,
                dispatch_fwd_ms=1e3 * disp_s,
                fwd_ms=1e3 * fwd_s,
                fwd_bwd_ms=1e3 * time_fn(grad, x, ids, w, ct),
                fwd_collective_mb=sum(collective_bytes(fwd_rep).values()) / 2**20,
                dispatch_payload_mb=disp_bytes / 2**20,
                dispatch_GBps_buffer=disp_bytes / disp_s / 1e9,
                dispatch_GBps_remote=remote * disp_bytes / disp_s / 1e9,
                fwd_GBps_buffer=fwd_bytes / fwd_s / 1e9,
                fwd_GBps_remote=remote * fwd_bytes / fwd_s / 1e9,
                dropped_frac=dropped / (n_dev * a.tokens * a.top_k),
            )
            rows.append(row)
            print(f"{row['transport']:7s} {row['impl']:10s} {wire:5s} "
                  f"dispatch {row['dispatch_fwd_ms']:9.3f} ms  "
                  f"fwd {row['fwd_ms']:9.3f} ms  fwd+bwd {row['fwd_bwd_ms']:9.3f} ms  "
                  f"fwd collectives {row['fwd_collective_mb']:9.2f} MB/device  "
                  f"fwd {row['fwd_GBps_remote']:7.1f} GB/s remote "
                  f"({row['fwd_GBps_buffer']:7.1f} buffer)  "
                  f"dropped {row['dropped_frac']:.4f}")
    by = {(r["transport"], r["wire"]): r for r in rows}
    for transport in ("dense", "dropless", "ragged"):
        b, f = by.get((transport, "bf16")), by.get((transport, "fp8"))
        if b and f:
            print(f"{transport}: fp8/bf16 dispatch time "
                  f"{f['dispatch_fwd_ms'] / b['dispatch_fwd_ms']:.3f}, dispatch+combine fwd "
                  f"{f['fwd_ms'] / b['fwd_ms']:.3f}")
    return rows


def run_ab(mesh, n_dev, rounds: int) -> dict:
    """Dense dispatch, bf16 vs FP8 wire, timed interleaved: each round times one bf16 call
    then one FP8 call (compiled executables, each call blocked), so clock or NVLink drift
    during the run hits both alike. Reports the medians, their ratio and the median of the
    per-round ratios, for the library default (wire_kernels='auto') and the XLA wire path."""
    a = ARGS
    x, ids, _, _ = make_inputs(mesh, n_dev, a.tokens, a.d_model, a.experts, a.top_k, a.seed)
    spec = P(AXIS)
    out = {}
    for config in a.ab_configs.split(","):
        kernels = "xla" if config == "xla" else "auto"
        opts = {"xla_gpu_use_memcpy_local_p2p": True} if config == "auto_memcpy_p2p" else None
        exe = {}
        try:
            for wire in ("bf16", "fp8"):
                f = jax.jit(jax.shard_map(
                    lambda x, ids, wire=wire, kernels=kernels: dispatch(
                        x, ids, num_experts=a.experts, axis_name=AXIS, transport="dense",
                        capacity_factor=a.capacity_factor, dispatch_dtype=wire,
                        wire_kernels=kernels)[0],
                    mesh=mesh, in_specs=(spec, spec), out_specs=spec))
                lowered = f.lower(x, ids)
                exe[wire] = lowered.compile(compiler_options=opts) if opts else lowered.compile()
                for _ in range(a.warmup):
                    jax.block_until_ready(exe[wire](x, ids))
        except Exception as err:  # e.g. an option this XLA does not know
            out[config] = {"error": repr(err)[:1000]}
            print(f"A/B {config}: FAILED {err!r}"[:300], flush=True)
            continue
        times = {"bf16": [], "fp8": []}
        for _ in range(rounds):
            for wire in ("bf16", "fp8"):
                t0 = time.perf_counter()
                jax.block_until_ready(exe[wire](x, ids))
                times[wire].append(time.perf_counter() - t0)
        med = {w: statistics.median(v) for w, v in times.items()}
        per_round = [f8 / b for b, f8 in zip(times["bf16"], times["fp8"], strict=True)]
        out[config] = dict(rounds=rounds, compiler_options=opts, bf16_ms=1e3 * med["bf16"],
                           fp8_ms=1e3 * med["fp8"],
                            ratio_of_medians=med["fp8"] / med["bf16"],
                            median_round_ratio=statistics.median(per_round),
                            bf16_ms_quartiles=[1e3 * q for q in
                                               statistics.quantiles(times["bf16"], n=4)],
                            fp8_ms_quartiles=[1e3 * q for q in
                                              statistics.quantiles(times["fp8"], n=4)])
        r = out[config]
        print(f"A/B dense dispatch, {config}, {rounds} interleaved rounds: "
              f"bf16 {r['bf16_ms']:.3f} ms, fp8 {r['fp8_ms']:.3f} ms, fp8/bf16 "
              f"{r['ratio_of_medians']:.3f} (median per-round ratio "
              f"{r['median_round_ratio']:.3f})", flush=True)
    return out


def main():
    a = ARGS
    devices = jax.devices()
    n_dev = len(devices)
    if a.experts % n_dev:
        raise SystemExit(f"--experts {a.experts} must be a multiple of the device count {n_dev}")
    mesh = Mesh(np.array(devices), (AXIS,))
    native_ok = resolve_ragged_impl("auto") == "native"
    print(f"backend {jax.default_backend()} x{n_dev} ({devices[0].device_kind}), jax "
          f"{jax.__version__}; tokens/device {a.tokens}, d_model {a.d_model}, experts "
          f"{a.experts}, top-{a.top_k}")
    checks = {} if a.ab_only else run_checks(mesh, n_dev, native_ok)
    rows = [] if a.ab_only else run_timings(mesh, n_dev, native_ok)
    ab = run_ab(mesh, n_dev, rounds=5 if a.small else 60)
    print()
    head = ("transport", "impl", "wire", "dispatch_fwd_ms", "fwd_ms", "fwd_bwd_ms",
            "fwd_collective_mb", "fwd_GBps_remote", "dropped_frac")
    print(" | ".join(f"{h:>17s}" for h in head))
    for r in rows:
        print(" | ".join(f"{r[h]:>17.3f}" if isinstance(r[h], float) else f"{str(r[h]):>17s}"
                         for h in head))
    env = env_info()
    write_json(a.out, dict(
        config=vars(a), backend=env["backend"], device_kind=env["device_kind"],
        n_devices=n_dev, jax=env["jax"], python=env["python"],
        native_ragged=native_ok, checks=checks, timings=rows, dispatch_ab=ab,
    ))
    print(f"wrote {a.out}")
    if not all(c["ok"] for c in checks.values()):
        raise SystemExit("a check FAILED")


if __name__ == "__main__":
    main()
