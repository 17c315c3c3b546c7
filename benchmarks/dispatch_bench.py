"""Check and time moe.dispatch / moe.combine (expert parallel over all devices), in parts.

``--part check`` (the default; was benchmarks/dispatch_check.py):

1. Checks (dropless): the native ``jax.lax.ragged_all_to_all`` path (GPU/TPU only) equals the
   CPU emulation, the ``'dropless'`` transport (bucketed ``all_to_all``) equals the emulation
   bit for bit (expert inputs, group sizes, outputs, gradients), and all equal the dense
   ``all_to_all`` path: expert inputs, group sizes, combined outputs and gradients, with
   per-expert scaling as the "experts". Balanced routing and a skewed one (every token on
   the first device's experts, the dropless exchange's worst case). JSON ``checks``.
2. Times, for every (transport, wire) pair, ``dispatch`` alone (forward, up to the expert
   layout: the time the FP8 <= 0.6x bf16 target is about, since combine returns bf16 either
   way) and ``dispatch -> combine`` (identity experts) forward and forward+backward: warmup,
   then the median of ``--iters`` runs, each ending in ``jax.block_until_ready``; random
   (non-zero) tokens and routing, sharded over the expert axis before timing. Also the bytes
   of every collective in the emitted HLO (buffer sizes; ragged buffers are worst-case sized)
   and GB/s per GPU two ways: ``GBps_buffer`` = payload all-to-all buffer bytes per device
   (capacity padding and the chunk a device keeps included) / time, ``GBps_remote`` = (P-1)/P
   of those bytes (what leaves the GPU; moe_layer_bench's figure) / time. JSON ``timings``.
3. A/B: dense ``dispatch`` with the bf16 and the FP8 wire timed interleaved (one call of each
   per round, 60 rounds), for the default wire kernels and for the XLA wire path: the
   headline FP8/bf16 dispatch-time ratio (benchmarks/collect.py), robust to drift between
   separately timed runs. JSON ``dispatch_ab``.

``--part phases`` (was benchmarks/dispatch_phases.py): every phase of the dense pipeline as
its own ``jax.jit(jax.shard_map(...))``, fed the real intermediate arrays of the phase before
(plan, quantize, gather, all_to_all, recv, combine, backward, whole, dropless; "before" /
"alt" rows are previous or alternative implementations, checked equal where they should be),
with GB/s three ways per exchange: ``buffer`` (all_to_all operand bytes per device),
``remote`` ((P-1)/P of those) and ``deepep`` (DeepEP's count: one row per (token, destination
rank), self included, no padding; bf16 2*d bytes, FP8 d + d/128), and each phase's compiled
HLO summary (cost-analysis bytes, top-level kernels, sort/gather/scatter/... op counts).
JSON ``phases``, ``derived``, ``summary`` (FP8 / bf16 time of the whole phases), ``errors``.

``--part layer`` (was benchmarks/moe_layer_dispatch.py, moe_layer_bench's dispatch timings):
dispatch -> combine alone on the MoE layer benchmark's data and routings (balanced and
Zipf-skewed, router + calibrated bias): dense bf16 / FP8, dropless and ragged bf16, forward
and forward + backward, bytes sent per device over the payload exchanges, and dense vs
dropless timed interleaved. JSON ``dispatch_combine``, ``dispatch_combine_ab``, ``routing``.

    python benchmarks/dispatch_bench.py                      # GPU, real sizes (check)
    python benchmarks/dispatch_bench.py --part phases --small  # CPU, 2 simulated devices
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
from _dispatch_combine import AXES, bench_dispatch, make_layer_data, make_routings  # noqa: E402
from _dispatch_harness import AXIS, dispatch_fns, make_inputs, make_mesh, print_table  # noqa: E402
from _dispatch_phases import run_phases  # noqa: E402
from bench_util import (  # noqa: E402
    add_routing_args,
    cli,
    env_info,
    fill_defaults,
    force_cpu_devices,
    interleaved_seconds,
    line_mesh,
    median_seconds,
    part_args,
    write_json,
)
from jax.sharding import PartitionSpec as P  # noqa: E402

from moe.dispatch import dispatch  # noqa: E402
from moe.dispatch.collectives import resolve_ragged_impl  # noqa: E402
from xla_comm import hlo  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DESCRIPTION = """\
Check and time moe.dispatch / moe.combine, expert parallel over all devices, in three parts:
  check   dense vs dropless vs ragged transport equal (bf16, FP8 wires; balanced, skewed
          routing), then dispatch / dispatch+combine fwd / fwd+bwd times and GB/s per pair,
          and the FP8/bf16 dense dispatch A/B (60 interleaved rounds). Default 16384 tokens/
          device, d_model 4096, E 16, top-2 (small: 64, 512). JSON (--out, default
          benchmarks/results/dispatch_check.json): checks, timings, dispatch_ab.
  phases  each phase of dispatch / combine (plan, quantize, gather, all_to_all, recv, combine,
          backward, whole, dropless) timed alone, GB/s buffer / remote / DeepEP-count, HLO op
          counts; 16384 tokens/device, d_model 4096 (small: 256, 512). JSON (default
          benchmarks/results/dispatch_phases.json): phases, derived, summary, errors.
  layer   dispatch -> combine alone on moe_layer_bench's data and routings (balanced, Zipf):
          dense bf16/FP8, dropless, ragged; fwd, fwd+bwd, MB sent/device, dense vs dropless
          A/B; 16384 tokens/device, d_model 4096 (small: 64, 128). JSON (default
          benchmarks/results/dispatch_combine.json): dispatch_combine, dispatch_combine_ab.
--small: CPU, --cpu-devices simulated devices (2). Details: the docstring of this file."""


# ----------------------------------------------------------------------------- arguments


def _common(p, *, tokens, d_model, warmup, iters, out):
    cli("", parser=p)
    add_routing_args(p, tokens=tokens, d_model=d_model)
    p.add_argument("--warmup", type=int, help=f"untimed calls first ({warmup})")
    p.add_argument("--iters", type=int, help=f"timed calls ({iters})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(RESULTS, out), help="JSON path ('' to skip)")


def _check_args(p):
    _common(p, tokens="16384; small 64", d_model="4096; small 512", warmup="3; small 1",
            iters="20; small 3", out="dispatch_check.json")
    p.add_argument("--check-tokens", type=int, help="tokens per device for the checks "
                   "(2048; small 32)")
    p.add_argument("--ab-configs", default="auto,xla",
                   help="A/B configurations: auto (library default wire kernels), xla (XLA wire "
                        "path), auto_memcpy_p2p (auto, compiled with XLA's "
                        "xla_gpu_use_memcpy_local_p2p: copies instead of NCCL between the GPUs "
                        "of one process)")
    p.add_argument("--ab-only", action="store_true", help="skip the checks and other timings")


def _check_finish(p, a):
    return fill_defaults(
        a, small=dict(tokens=64, d_model=512, check_tokens=32, iters=3, warmup=1),
        full=dict(tokens=16384, d_model=4096, check_tokens=2048, iters=20, warmup=3))


def _phases_args(p):
    _common(p, tokens="16384; small 256", d_model="4096; small 512", warmup="3; small 1",
            iters="20; small 2", out="dispatch_phases.json")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--no-hlo", action="store_true", help="skip the per-phase HLO summary")
    p.add_argument("--no-experiment", action="store_true",
                   help="skip the split-axis layout experiment (4 compiles; skipped with "
                        "--small)")


def _phases_finish(p, a):
    a = fill_defaults(a, small=dict(tokens=256, d_model=512, iters=2, warmup=1),
                      full=dict(tokens=16384, d_model=4096, iters=20, warmup=3))
    a.no_experiment = a.no_experiment or a.small
    return a


def _layer_args(p):
    _common(p, tokens="16384; small 64", d_model="4096; small 128", warmup="3; small 1",
            iters="10; small 2", out="dispatch_combine.json")
    p.add_argument("--dropless-capacity-factor", type=float, default=None,
                   help="first exchange bucket of the dropless transport (None: the "
                        "library default, 1.25)")
    p.add_argument("--fp8-block-size", type=int, help="FP8 channels per scale (128; small 32)")
    p.add_argument("--routing", nargs="+", choices=("balanced", "zipf"),
                   default=["balanced", "zipf"])
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of skewed routing")


def _layer_finish(p, a):
    return fill_defaults(
        a, small=dict(tokens=64, d_model=128, warmup=1, iters=2, fp8_block_size=32),
        full=dict(tokens=16384, d_model=4096, warmup=3, iters=10, fp8_block_size=128))


PARTS = {
    "check": ("transports checked equal, then timed; the FP8/bf16 A/B", _check_args,
              _check_finish),
    "phases": ("each phase of dispatch / combine timed alone", _phases_args, _phases_finish),
    "layer": ("dispatch -> combine on moe_layer_bench's data and routings", _layer_args,
              _layer_finish),
}


def parse_args(argv=None):
    return part_args(argv, DESCRIPTION, PARTS, default="check")[1]


# ----------------------------------------------------------------------------- check

_EXCHANGES = ("all-to-all", "ragged-all-to-all")


def collective_bytes(rep) -> dict[str, int]:
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


def skew_ids(ids, experts, n_dev):
    """Every token's k choices moved onto the first device's experts (distinct, same order):
    every source sends all its slots to device 0, the dropless exchange's worst case."""
    k = ids.shape[1]
    el = experts // n_dev
    if el < k:
        return ids
    return (ids % el).at[:, 1:].set((ids[:, :1] % el + jnp.arange(1, k)) % el)


def run_checks(a, mesh, n_dev, native_ok):
    x, ids, w, ct = make_inputs(mesh, a.check_tokens, a.d_model, a.experts, a.top_k,
                                a.seed + 1)
    results = {}
    impls = ["emulated"] + (["native"] if native_ok else [])
    cases = [(t, "emulated") for t in ("dense", "dropless")] + [("ragged", i) for i in impls]
    built = {(wire, t, i): dispatch_fns(mesh, P(AXIS), transport=t, impl=i, wire=wire,
                                        experts=a.experts, capacity_factor=None, scale=True)
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
        fns = built[(wire, transport, impl)]
        y, ex, sizes, dropped = jax.block_until_ready(fns.full(x, ids, w))
        dx, dw = jax.block_until_ready(fns.grad(x, ids, w, ct))
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


def run_timings(a, mesh, n_dev, native_ok):
    def time_fn(fn, *args):
        return median_seconds(fn, args, a.warmup, a.iters)[0]

    x, ids, w, ct = make_inputs(mesh, a.tokens, a.d_model, a.experts, a.top_k, a.seed)
    rows = []
    impl = "native" if native_ok else "emulated"
    for transport in ("dense", "dropless", "ragged"):
        for wire in ("bf16", "fp8"):
            if a.small and wire == "fp8" and transport != "dense":
                continue  # CPU plumbing check: the FP8 dropless/ragged paths are checked above
            cf = a.capacity_factor if transport == "dense" else None
            fns = dispatch_fns(mesh, P(AXIS), transport=transport, impl=impl, wire=wire,
                               experts=a.experts, capacity_factor=cf)
            dropped = int(jax.block_until_ready(fns.full(x, ids, w))[3].sum())
            fwd_low = fns.fwd.lower(x, ids, w)
            fwd_rep = hlo.analyze_collectives(fwd_low)  # as emitted
            # dropless: the emitted HLO holds one exchange per bucket: count the bucket taken
            branch = int(np.max(fns.bucket_rows(x, ids)[0])) if transport == "dropless" \
                else None
            disp_bytes = payload_bytes(fns.disp.lower(x, ids), branch)
            disp_s = time_fn(fns.disp, x, ids)
            fwd_s = time_fn(fns.fwd, x, ids, w)
            fwd_bytes = payload_bytes(fwd_low, branch)
            remote = (n_dev - 1) / n_dev
            row = dict(
                transport=transport, impl=impl if transport == "ragged" else "all_to_all",
                wire=wire, capacity_factor=cf,
                dispatch_fwd_ms=1e3 * disp_s,
                fwd_ms=1e3 * fwd_s,
                fwd_bwd_ms=1e3 * time_fn(fns.grad, x, ids, w, ct),
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


def run_ab(a, mesh, n_dev, rounds: int) -> dict:
    """Dense dispatch, bf16 vs FP8 wire, timed interleaved: each round times one bf16 call
    then one FP8 call (compiled executables, each call blocked), so clock or NVLink drift
    during the run hits both alike. Reports the medians, their ratio and the median of the
    per-round ratios, for the library default (wire_kernels='auto') and the XLA wire path."""
    x, ids, _, _ = make_inputs(mesh, a.tokens, a.d_model, a.experts, a.top_k, a.seed)
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
        times = interleaved_seconds({w: (lambda f=exe[w]: f(x, ids)) for w in ("bf16", "fp8")},
                                    rounds)
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


def main_check(a):
    devices = jax.devices()
    n_dev = len(devices)
    if a.experts % n_dev:
        raise SystemExit(f"--experts {a.experts} must be a multiple of the device count {n_dev}")
    mesh = make_mesh()
    native_ok = resolve_ragged_impl("auto") == "native"
    print(f"backend {jax.default_backend()} x{n_dev} ({devices[0].device_kind}), jax "
          f"{jax.__version__}; tokens/device {a.tokens}, d_model {a.d_model}, experts "
          f"{a.experts}, top-{a.top_k}")
    checks = {} if a.ab_only else run_checks(a, mesh, n_dev, native_ok)
    rows = [] if a.ab_only else run_timings(a, mesh, n_dev, native_ok)
    ab = run_ab(a, mesh, n_dev, rounds=5 if a.small else 60)
    print()
    head = ("transport", "impl", "wire", "dispatch_fwd_ms", "fwd_ms", "fwd_bwd_ms",
            "fwd_collective_mb", "fwd_GBps_remote", "dropped_frac")
    print(" | ".join(f"{h:>17s}" for h in head))
    for r in rows:
        print(" | ".join(f"{r[h]:>17.3f}" if isinstance(r[h], float) else f"{str(r[h]):>17s}"
                         for h in head))
    env = env_info()
    write_json(a.out, dict(
        config={k: v for k, v in vars(a).items() if k != "part"}, backend=env["backend"],
        device_kind=env["device_kind"], n_devices=n_dev, jax=env["jax"],
        python=env["python"], native_ragged=native_ok, checks=checks, timings=rows,
        dispatch_ab=ab,
    ))
    print(f"wrote {a.out}")
    if not all(c["ok"] for c in checks.values()):
        raise SystemExit("a check FAILED")


# ----------------------------------------------------------------------------- phases, layer


def main_phases(a) -> dict:
    t0 = time.perf_counter()
    report = run_phases(a)
    report["wall_s"] = time.perf_counter() - t0
    print_table(report)
    write_json(a.out, report)
    if a.out:
        print(f"wrote {a.out} ({report['wall_s']:.1f} s)")
    return report


def main_layer(a) -> dict:
    mesh = line_mesh(AXES)
    n = mesh.devices.size
    if a.experts % n:
        raise SystemExit(f"--experts {a.experts} must be a multiple of the {n} devices")
    report = dict(benchmark="dispatch_combine", env=env_info(),
                  settings={k: v for k, v in vars(a).items() if k not in ("out", "part")},
                  mesh={"data": 1, "expert": n}, errors={})
    data = make_layer_data(mesh, a, weights=False)
    biases, report["routing"] = make_routings(data, a)
    report["dispatch_combine"], report["dispatch_combine_ab"] = bench_dispatch(
        mesh, a, data, biases)
    for r in report["dispatch_combine"]:
        print(f"dispatch+combine {r['transport']:8s} {r['wire']:4s} {r['routing']:8s}: fwd "
              f"{r['fwd_ms']:8.3f} ms, fwd+bwd {r['fwd_bwd_ms']:8.3f} ms, "
              f"{r['sent_mb_per_device']:8.2f} MB sent/dev, {r['GBps_per_gpu']:8.2f} GB/s/GPU")
    write_json(a.out, report)
    if a.out:
        print(f"wrote {a.out}")
    return report


def main(argv=None):
    a = parse_args(argv)
    if a.small:
        force_cpu_devices(a.cpu_devices)
    return {"check": main_check, "phases": main_phases, "layer": main_layer}[a.part](a)


if __name__ == "__main__":
    main()
