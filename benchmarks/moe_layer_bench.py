"""Benchmark the expert-parallel MoE layer (moe.moe_apply) forward + backward, with MFU.

Times ``jax.grad`` of ``sum(y * ct)`` (``ct`` a random cotangent) with respect to x, the
router kernel, w_gate_up and w_down, expert parallel over all devices (mesh ('data', 'expert')
= (1, n_devices)), bf16 activations and expert weights (router kernel f32, as the router
computes in f32), for the variants in VARIANTS: dense transport (capacity 1.25) with einsum,
Pallas or ragged_dot experts; the dropless transports, ``'dropless'`` (bucketed all_to_all)
and ``'ragged'`` (ragged_all_to_all), with ragged_dot, Pallas or ``'auto'`` experts (Pallas
on NVIDIA GPUs, ragged_dot elsewhere); each with a bf16 or FP8 wire (FP8 for the dispatch and
for the combine gradient); the wire rows go through the Pallas wire kernels
(``wire_kernels='auto'`` on GPUs) except in the ``*_xla_wire`` variants.

Routing: ``balanced`` (a random router: every expert gets about T*k/E slots) and ``zipf``
(expert i gets a share ~ 1 / (i+1)^s of the slots, s = ``--zipf-s``): the balancing bias
argument of ``moe_apply`` (it changes the selection only) is calibrated on the benchmark's
tokens before timing so that the loads follow the target shares; the achieved shares are in
the JSON (``routing``). One executable serves both routings (the bias is an input).

MFU = useful FLOPs / (time x n_devices x dense rate), the dense rate being a bf16
8192^3 matmul on one device timed in the same run. Useful FLOPs count the router
(6 * tokens * d_model * E: forward + two backward GEMMs) and the three expert GEMMs of every
*kept* token slot (6 * d_model * d_ff forward, 12 * d_model * d_ff backward); capacity padding
and dropped slots are not useful work. Dropped fraction = dropped slots / (tokens * top_k).

Also times dispatch -> combine alone (identity experts; dense capacity 1.25 bf16 and FP8,
dropless and ragged bf16; both routings; alone: ``benchmarks/dispatch_bench.py --part layer``),
forward and forward + backward: GB/s per GPU =
bytes each device sends over the payload exchanges of the forward ((P-1)/P of each buffer:
from the compiled HLO via xla_comm.hlo for dense and ragged; for dropless, the buffers of the
bucket the step took) / forward time.

Op breakdown: ``jax.profiler`` traces of ``--profile-steps`` steps of the variants in
``--breakdown-variants`` (both routings), summed per op category by
`xla_comm.breakdown.op_breakdown` (sort, gathers/scatters, exchange, GEMMs, combine, ...), printed
as a table and stored under ``breakdown``; the same traces give the fraction of NCCL time
hidden under compute (`xla_comm.trace.exposed_comm_fraction`). ``--profile-variants`` are
traced for the latter only. Variants ending in ``_overlap`` are the same step compiled with
``xla_comm.overlap.overlap_compiler_options()``, so exposed communication is compared with and
without the overlap flags in one run.

Summary (``dropless`` in the JSON, also written alone to ``--dropless-out``), with ``{n}gpu``
the device count and kind (``{n}cpu`` on CPU): ``dropless_over_capacity_time_{n}gpu`` (dropless
layer / dense einsum capacity-1.25 layer, balanced) and ``..._zipf``; the same for the ragged
transport (``ragged_over_capacity_time_*``); ``dropless_dispatch_combine_over_dense_{n}gpu``
(dispatch + combine fwd+bwd, dropless / dense, bf16, balanced; ``..._zipf``);
``dropless_layer_mfu_{n}gpu``; the capacity layer's dropped fractions. Issue 14's keys are
those for 1 and 2 GPUs. The ratios come from the two sides timed interleaved (one call of
each per round, so drift hits both alike; ``layer_ab``, ``dispatch_combine_ab``); the
separately timed medians are kept as ``..._separate_runs_...``.

Usage:
  python benchmarks/moe_layer_bench.py                   # GPU: 16384 tokens/GPU, 4096/2048, E16 k2
  python benchmarks/moe_layer_bench.py --preset dropless --dropless-out r1.json  # issue 14
  python benchmarks/moe_layer_bench.py --small           # CPU, 2 simulated devices
  python benchmarks/moe_layer_bench.py --tokens 32768 --profile /tmp/moe_trace --out r.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
DESCRIPTION = """\
The expert-parallel MoE layer (moe.moe_apply) forward + backward over all devices, with MFU
against a dense bf16 matmul ceiling, per variant (transport: dense capacity 1.25 / dropless /
ragged; experts: einsum / ragged_dot / Pallas; wire bf16 / FP8; overlap flags; XLA wire) and
routing (balanced, Zipf); also dispatch -> combine alone, op breakdown and exposed collectives
from jax.profiler traces. Default 16384 tokens/device, d_model 4096, d_ff 2048, E 16, top-2
(--small: CPU, 2 devices, 64 tokens, 128/64). JSON (--out, default
benchmarks/results/moe_layer_bench.json): layer, layer_ab, dispatch_combine,
dispatch_combine_ab, routing, ceiling, dropless (the summary; also alone to --dropless-out).
Details: the docstring of this file."""


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _dispatch_combine import (  # noqa: E402
    AXES,
    ROUTINGS,
    bench_dispatch,
    make_layer_data,
    make_routings,
)
from _moe_layer_summary import dropless_summary, print_table  # noqa: E402
from bench_util import (  # noqa: E402
    add_routing_args,
    cli,
    compile_with,
    dense_ceiling,
    env_info,
    fill_defaults,
    force_cpu_devices,
    interleaved_seconds,
    line_mesh,
    median_seconds,
    write_json,
)

import moe  # noqa: E402
from xla_comm import overlap as moverlap  # noqa: E402
from xla_comm.breakdown import op_breakdown  # noqa: E402
from xla_comm.trace import exposed_comm_fraction, trace_steps  # noqa: E402

BOTH = ("bf16", "fp8")
# name stem: (transport, expert backend, wires). The dropless transport (bucketed all_to_all)
# and, for comparison, the ragged one with the same experts: backend 'auto' = Mosaic GPU on
# Hopper, Pallas Triton on other NVIDIA GPUs, ragged_dot elsewhere.
STEMS = {
    "dense_einsum": ("dense", "einsum", BOTH),
    "dense_ragged_dot": ("dense", "ragged_dot", BOTH),
    "dense_pallas": ("dense", "triton", ("bf16",)),
    "ragged": ("ragged", "ragged_dot", BOTH),
    "ragged_pallas": ("ragged", "triton", BOTH),
    "ragged_auto": ("ragged", "auto", ("bf16",)),
    "dropless": ("dropless", "auto", BOTH),
    "dropless_pallas": ("dropless", "triton", ("bf16",)),
}
VARIANTS: dict[str, dict] = {
    f"{stem}_{wire}": dict(transport=t, backend=b, wire=wire)
    for stem, (t, b, wires) in STEMS.items() for wire in wires}
for _wire in BOTH:
    # The same steps compiled with xla_comm.overlap.overlap_compiler_options() (latency-hiding
    # scheduler, combine thresholds, high-priority collective stream), and the XLA wire path
    # instead of the Pallas wire kernels (wire_kernels='auto' on GPUs).
    VARIANTS[f"dense_einsum_{_wire}_overlap"] = dict(VARIANTS[f"dense_einsum_{_wire}"],
                                                     overlap_options=True)
    VARIANTS[f"dense_einsum_{_wire}_xla_wire"] = dict(VARIANTS[f"dense_einsum_{_wire}"],
                                                      wire_kernels="xla")
# The capacity layer and the dropless one the summary compares (issue 14).
CAPACITY, DROPLESS, RAGGED = "dense_einsum_bf16", "dropless_bf16", "ragged_auto_bf16"
PRESETS = {
    "all": ["dense_einsum_bf16", "dense_einsum_fp8", "dense_einsum_bf16_overlap",
            "dense_einsum_fp8_overlap", "dense_einsum_bf16_xla_wire",
            "dense_einsum_fp8_xla_wire", "dense_pallas_bf16", "dense_ragged_dot_bf16",
            "dropless_bf16", "dropless_fp8", "ragged_auto_bf16"],
    "dropless": [CAPACITY, DROPLESS, RAGGED, "dropless_fp8"],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = cli(DESCRIPTION)
    add_routing_args(p, tokens="16384; small 64", d_model="4096; small 128")
    p.add_argument("--d-ff", type=int, help="2048; small 64")
    p.add_argument("--dropless-capacity-factor", type=float, default=None,
                   help="first exchange bucket of the dropless transport (None: the "
                        "library default, 1.25)")
    p.add_argument("--fp8-block-size", type=int, help="FP8 channels per scale (128; small 32)")
    p.add_argument("--preset", choices=list(PRESETS), help="variant list (all; small: dropless)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="overrides --preset")
    p.add_argument("--routing", nargs="+", choices=ROUTINGS, default=list(ROUTINGS))
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of skewed routing")
    p.add_argument("--zipf-variants", nargs="+", choices=list(VARIANTS),
                   default=[CAPACITY, DROPLESS, RAGGED],
                   help="variants also timed with Zipf routing (when selected)")
    p.add_argument("--no-dispatch-only", action="store_true",
                   help="skip the dispatch+combine-alone timings")
    p.add_argument("--ceiling-n", type=int, help="dense matmul size (8192; small 512)")
    p.add_argument("--warmup", type=int, help="3; small 1")
    p.add_argument("--iters", type=int, help="10; small 2")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="keep the jax.profiler traces under DIR/<variant> (default: a "
                        "temporary directory, removed at the end)")
    p.add_argument("--breakdown-variants", nargs="+", choices=list(VARIANTS),
                   default=[CAPACITY, DROPLESS, RAGGED],
                   help="variants traced for the op breakdown (when selected)")
    p.add_argument("--profile-variants", nargs="+", choices=list(VARIANTS),
                   default=["dense_einsum_bf16", "dense_einsum_fp8",
                            "dense_einsum_bf16_overlap", "dense_einsum_fp8_overlap"],
                   help="variants traced for the exposed-communication fraction (with "
                        "--profile)")
    p.add_argument("--profile-steps", type=int, help="traced steps (3; small 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results" / "moe_layer_bench.json"),
                   help="JSON path ('' to skip)")
    p.add_argument("--dropless-out", default="",
                   help="also write the dropless summary alone here (e.g. "
                        "OUT/dropless.json, then `report.py --adopt dropless`)")
    a = fill_defaults(
        p.parse_args(argv),
        small=dict(tokens=64, d_model=128, d_ff=64, ceiling_n=512, warmup=1, iters=2,
                   fp8_block_size=32, preset="dropless", profile_steps=1),
        full=dict(tokens=16384, d_model=4096, d_ff=2048, ceiling_n=8192, warmup=3, iters=10,
                  fp8_block_size=128, preset="all", profile_steps=3))
    if a.variants is None:
        a.variants = list(PRESETS[a.preset])
        if a.small:  # a CPU plumbing check: the three layers the summary compares
            a.variants = [v for v in a.variants if v in (CAPACITY, DROPLESS, RAGGED)]
    return a


# ----------------------------------------------------------------------------- the layer


def options(name: str, a) -> moe.MoEOptions:
    v = VARIANTS[name]
    cf = {"dense": a.capacity_factor, "dropless": a.dropless_capacity_factor}
    return moe.MoEOptions.create(
        a.experts, a.top_k,
        expert_axis="expert",
        transport=v["transport"],
        capacity_factor=cf.get(v["transport"]),
        dispatch_dtype=v["wire"],
        combine_grad_dtype=v["wire"],
        backend=v["backend"],
        fp8_block_size=a.fp8_block_size,
        wire_kernels=v.get("wire_kernels", "auto"),
    )


def layer_args(data, bias):
    return (data["x"], data["router_kernel"], data["w_gate_up"], data["w_down"], data["ct"],
            jnp.asarray(bias))


def build_layer(name, mesh, a, data):
    """The jitted fwd+bwd step (compiled with the overlap options for ``*_overlap`` variants,
    which records the options XLA applied; the routing bias is an input) and the
    dropped-token count."""
    opts = options(name, a)

    def fwd(x, rk, wgu, wd, bias):
        return moe.moe_apply(x, rk, wgu, wd, bias, options=opts, mesh=mesh)

    def loss(x, rk, wgu, wd, ct, bias):
        y, _ = fwd(x, rk, wgu, wd, bias)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    args = layer_args(data, np.zeros(a.experts, np.float32))
    compiler = None
    if VARIANTS[name].get("overlap_options"):
        want = moverlap.overlap_compiler_options()
        step, dropped_opts = compile_with(step.lower(*args), want)
        compiler = {"options": want, "options_dropped": dropped_opts}
    else:
        step = step.lower(*args).compile()
    dropped = jax.jit(lambda x, rk, wgu, wd, bias: fwd(x, rk, wgu, wd, bias)[1][
        "dropped_slots"])
    return step, dropped, compiler


def useful_flops(a, n_dev: int, kept_slots: int) -> float:
    tokens = n_dev * a.tokens
    router = 6.0 * tokens * a.d_model * a.experts
    experts = 18.0 * a.d_model * a.d_ff * kept_slots
    return router + experts


def bench_layer(name, routing, mesh, a, ceiling, step, dropped_fn, args) -> dict:
    n_dev = mesh.devices.size
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    first = time.perf_counter() - t0
    sec, times = median_seconds(step, args, a.warmup, a.iters)
    dropped = int(dropped_fn(*args[:4], args[5]))
    slots = n_dev * a.tokens * a.top_k
    flops = useful_flops(a, n_dev, slots - dropped)
    v = VARIANTS[name]
    return dict(variant=name if routing == "balanced" else f"{name}_{routing}",
                base_variant=name, routing=routing, transport=v["transport"],
                backend=v["backend"], wire=v["wire"],
                overlap_options=bool(v.get("overlap_options")),
                wire_kernels=v.get("wire_kernels", "auto"),
                capacity_factor={"dense": a.capacity_factor,
                                 "dropless": a.dropless_capacity_factor}.get(v["transport"]),
                seconds=sec, ms=sec * 1e3, times_s=times, first_call_s=first,
                dropped_slots=dropped, dropped_frac=dropped / slots, useful_flops=flops,
                useful_tflops_per_device=flops / sec / n_dev / 1e12,
                mfu=flops / (sec * n_dev * ceiling["tflops"] * 1e12))


def profile_layer(name, routing, a, step, args, trace_root: str) -> dict:
    """Op breakdown and exposed-collective fraction of a few traced steps."""
    trace_dir = os.path.join(trace_root, f"{name}_{routing}")
    err = trace_steps(step, args, trace_dir, a.profile_steps)
    if err:
        return {"breakdown": None, "overlap": {"exposed_fraction": None, "reason": err}}
    try:
        bd = op_breakdown(trace_dir, step.as_text(), steps=a.profile_steps)
    except Exception as e:  # keep the timings whatever the trace holds
        bd = {"error": repr(e)[:1000]}
    ov = exposed_comm_fraction(trace_dir)
    ov.pop("source", None)
    ov["trace_dir"] = trace_dir if a.profile else None
    return {"breakdown": bd, "overlap": ov}


def interleaved_ms(fns: dict, rounds: int) -> dict:
    """Median ms of each ``fn()`` in ``fns``, timed one call of each per round (blocked)."""
    return {k: float(np.median(v)) * 1e3 for k, v in interleaved_seconds(fns, rounds).items()}


def layer_ab(steps: dict, biases: dict, data, a) -> dict:
    """The capacity, dropless and ragged layer steps timed interleaved, per routing (the
    summary's layer ratios come from these when present)."""
    out = {}
    if CAPACITY not in steps or len(steps) < 2:
        return out
    for routing, bias in biases.items():
        args = layer_args(data, bias)
        fns = {k: (lambda f=f, args=args: f(*args)) for k, f in steps.items()
               if routing == "balanced" or k in a.zipf_variants}
        if CAPACITY not in fns or len(fns) < 2:
            continue
        ms = interleaved_ms(fns, max(3, 2 * a.iters))
        out[routing] = dict(rounds=max(3, 2 * a.iters), ms=ms,
                            over_capacity={k: v / ms[CAPACITY] for k, v in ms.items()})
        print(f"A/B layer {routing}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()),
              flush=True)
    return out


def main(a) -> dict:
    mesh = line_mesh(AXES)
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
    data = make_layer_data(mesh, a)
    biases, report["routing"] = make_routings(data, a)
    for name, st in report["routing"].items():
        print(f"routing {name}: expert shares max/mean {st['max_over_mean']:.2f}"
              + (f", L1 error vs target {st['l1_error']:.3f}" if "l1_error" in st else ""),
              flush=True)
    trace_root = a.profile or tempfile.mkdtemp(prefix="moe_layer_trace_")

    def dispatch_once():  # after the first variant: a timeout later keeps these numbers
        if a.no_dispatch_only or "dispatch_combine" in report or \
                "dispatch_combine" in report["errors"]:
            return
        try:
            report["dispatch_combine"], report["dispatch_combine_ab"] = bench_dispatch(
                mesh, a, data, biases)
        except Exception as err:
            report["errors"]["dispatch_combine"] = repr(err)[:2000]
            print(f"dispatch_combine: FAILED {err!r}"[:500], flush=True)
        write_json(a.out, report)

    headline = {}  # the steps the summary compares, timed again interleaved at the end
    for name in a.variants:
        try:
            step, dropped_fn, compiler = build_layer(name, mesh, a, data)
        except Exception as err:  # keep going: one variant failing must not lose the rest
            report["errors"][name] = repr(err)[:2000]
            print(f"{name}: FAILED {err!r}"[:500], flush=True)
            dispatch_once()
            continue
        routings = [r for r in biases if r == "balanced" or name in a.zipf_variants]
        for routing in routings:
            args = layer_args(data, biases[routing])
            try:
                row = bench_layer(name, routing, mesh, a, report["ceiling"], step,
                                  dropped_fn, args)
                if compiler:
                    row["compiler"] = compiler
            except Exception as err:
                report["errors"][f"{name}_{routing}"] = repr(err)[:2000]
                print(f"{name} {routing}: FAILED {err!r}"[:500], flush=True)
                continue
            report["layer"].append(row)
            print(f"{row['variant']:32s} {row['ms']:9.3f} ms  MFU {row['mfu']:.3f}  dropped "
                  f"{row['dropped_frac']:.4f}", flush=True)
            write_json(a.out, report)
            if name in a.breakdown_variants or (a.profile and name in a.profile_variants):
                prof = profile_layer(name, routing, a, step, args, trace_root)
                row["overlap"] = prof["overlap"]
                if name in a.breakdown_variants:
                    row["breakdown"] = prof["breakdown"]
                print(f"profile {row['variant']}: exposed collective fraction "
                      f"{row['overlap'].get('exposed_fraction')} "
                      f"{row['overlap'].get('reason', '')}", flush=True)
                write_json(a.out, report)
        if name in (CAPACITY, DROPLESS, RAGGED):
            headline[name] = step
        del step, dropped_fn
        dispatch_once()
    report["layer_ab"] = layer_ab(headline, biases, data, a)
    report["dropless"] = dropless_summary(report, capacity=CAPACITY, dropless=DROPLESS,
                                          ragged=RAGGED, routings=ROUTINGS)
    print_table(report)
    write_json(a.out, report)
    if a.dropless_out:
        write_json(a.dropless_out, dict(report["dropless"], env=report["env"],
                                        ceiling=report["ceiling"], routing=report["routing"],
                                        settings=report["settings"],
                                        breakdown={r["variant"]: r.get("breakdown")
                                                   for r in report["layer"]
                                                   if r.get("breakdown")}))
        print(f"wrote {a.dropless_out}")
    if a.out:
        print(f"wrote {a.out}")
    if not a.profile:
        import shutil

        shutil.rmtree(trace_root, ignore_errors=True)
    return report


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.small:
        force_cpu_devices(ARGS.cpu_devices)
    main(ARGS)
