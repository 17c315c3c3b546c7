"""What does the whole MoE layer cost forward + backward, per transport, kernel and wire?

``moe.moe_apply`` forward + backward (the gradients of ``sum(y * ct)`` w.r.t. x, the router
kernel and both banks), expert parallel over all devices (mesh ('data', 'expert') = (1, n)),
bf16 activations and banks, f32 router, per variant (``VARIANTS``): transport (dense capacity
1.25, dropless = bucketed all_to_all, ragged = ragged_all_to_all), experts backend, wire (bf16,
FP8 = e4m3 rows with E8M0 scales) and recipe (``*_fp8all``: all six expert GEMMs in FP8 too);
``*_overlap`` compiles with ``xla_comm.overlap``'s options, ``*_xla_wire`` takes XLA's wire
path. Routing: balanced and Zipf (a balancing bias, an input of the one executable, calibrated
so expert i gets a share ~ 1 / (i + 1)^s).

MFU = useful FLOPs / (time x devices x this process's dense bf16 8192^3 rate), useful = the
router (6 T d E) and the three expert GEMMs of every kept slot (18 d d_ff per slot): capacity
padding and dropped slots are waste. The capacity, dropless and ragged layers are timed again
interleaved (A B A B) for the ratios of the summary. ``--profile DIR`` traces each balanced
variant: exposed collective time and the op breakdown (``xla_comm``).

    python3 benchmarks/layer.py --preset dropless --out dropless.json   # one GPU
    python3 benchmarks/layer.py --preset fp8 --out fp8_layer.json       # FP8 wire + GEMMs
    python3 benchmarks/layer.py --preset all --profile OUT/traces      # 2+ GPUs
    python3 benchmarks/layer.py --eager                                # moe.MoE outside jit
    python3 benchmarks/layer.py --small                                # CPU, 2 devices

JSON: ``layer`` rows, ``layer_ab``, ``routing`` and the flat keys of :func:`summary`;
``--eager``: ``eager_s``, ``jit_s``, ``eager_over_jit``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from _lib import bench

import moe
from xla_comm import overlap

MEASURES = ("moe/", "accel_kernels/")
BOTH = ("bf16", "fp8")
STEMS = {  # name stem: (transport, experts backend, wires)
    "dense_einsum": ("dense", "einsum", BOTH), "dense_auto": ("dense", "auto", BOTH),
    "dense_ragged_dot": ("dense", "ragged_dot", BOTH), "dense_pallas": ("dense", "triton", BOTH),
    "dropless": ("dropless", "auto", BOTH), "dropless_pallas": ("dropless", "triton", BOTH),
    "ragged": ("ragged", "ragged_dot", BOTH), "ragged_pallas": ("ragged", "triton", BOTH),
    "ragged_auto": ("ragged", "auto", BOTH)}
VARIANTS = {f"{s}_{w}": dict(transport=t, backend=b, wire=w)
            for s, (t, b, ws) in STEMS.items() for w in ws}
for _s in ("dense_auto", "dropless"):  # FP8 wire and every expert GEMM in FP8
    VARIANTS[f"{_s}_fp8all"] = dict(VARIANTS[f"{_s}_fp8"], recipe="fp8_all")
for _w in BOTH:
    VARIANTS[f"dense_einsum_{_w}_overlap"] = dict(VARIANTS[f"dense_einsum_{_w}"], overlap=True)
    VARIANTS[f"dense_einsum_{_w}_xla_wire"] = dict(VARIANTS[f"dense_einsum_{_w}"], kernels="xla")
CAPACITY, DROPLESS, RAGGED = "dense_einsum_bf16", "dropless_bf16", "ragged_auto_bf16"
PRESETS = {
    "dropless": [CAPACITY, DROPLESS, RAGGED, "dropless_fp8"],
    "fp8": ["dense_auto_bf16", "dense_auto_fp8all", "dropless_bf16", "dropless_fp8all"],
    "all": ["dense_einsum_bf16", "dense_einsum_fp8", "dense_einsum_bf16_overlap",
            "dense_einsum_fp8_overlap", "dense_einsum_bf16_xla_wire", "dense_einsum_fp8_xla_wire",
            "dense_pallas_bf16", "dense_ragged_dot_bf16", "dropless_bf16", "dropless_fp8",
            "ragged_auto_bf16"]}
FP8_ALL = dict(gemm_dtype="fp8", dgrad_dtype="fp8", wgrad_dtype="fp8")


def parse_args(argv=None):
    p = bench.parser(__doc__, 2)
    p.add_argument("--tokens", type=int, help="tokens per device (16384; small 64)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--fp8-block-size", type=int, help="channels per FP8 scale (128; small 32)")
    p.add_argument("--preset", choices=list(PRESETS), default="dropless")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="instead of --preset")
    p.add_argument("--zipf-variants", nargs="+", default=[CAPACITY, DROPLESS, RAGGED],
                   help="variants also timed under Zipf routing")
    p.add_argument("--routing", default="balanced,zipf")
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--profile", metavar="DIR", help="trace each balanced variant under DIR")
    p.add_argument("--eager", action="store_true", help="time moe.MoE called outside jit")
    a = bench.parse(p, argv, small=dict(tokens=64, d_model=128, d_ff=64, fp8_block_size=32,
                                        ceiling_n=512),
                    full=dict(tokens=16384, d_model=4096, d_ff=2048, fp8_block_size=128,
                              ceiling_n=8192))
    a.variants = a.variants or PRESETS[a.preset]
    return a


def step_of(name: str, a, mesh, data):
    """The compiled fwd+bwd step of a variant (routing bias an input) and its dropped count."""
    v = VARIANTS[name]
    cf = {"dense": a.capacity_factor}.get(v["transport"])
    opts = moe.MoEOptions.create(
        a.experts, a.top_k, expert_axis="expert", transport=v["transport"], capacity_factor=cf,
        dispatch_dtype=v["wire"], combine_grad_dtype=v["wire"],
        gemm_implementation=bench.implementation(v["backend"]),
        fp8_block_size=a.fp8_block_size, wire_implementation=v.get("kernels", "auto"),
        **(FP8_ALL if v.get("recipe") else {}))

    def fwd(x, rk, wgu, wd, bias):
        return moe.moe_apply(x, rk, wgu, wd, bias, options=opts, mesh=mesh)

    def loss(x, rk, wgu, wd, ct, bias):
        return jnp.sum(fwd(x, rk, wgu, wd, bias)[0].astype(jnp.float32) * ct.astype(jnp.float32))

    args = args_of(data, np.zeros(a.experts, np.float32))
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args)
    want = overlap.overlap_compiler_options() if v.get("overlap") else None
    step, dropped_opts = bench.compile_with(lowered, want)
    dropped = jax.jit(lambda x, rk, wgu, wd, bias: fwd(x, rk, wgu, wd, bias)[1]["dropped_slots"])
    return step, dropped, ({"options": want, "options_dropped": dropped_opts} if want else None)


def args_of(data, bias):
    return (data["x"], data["router_kernel"], data["w_gate_up"], data["w_down"], data["ct"],
            jnp.asarray(bias))


def time_variant(name, routing, a, report, step, dropped_fn, args) -> dict:
    n = len(jax.devices())
    sec = bench.median_seconds(step, args, a.warmup, a.iters)
    slots = n * a.tokens * a.top_k
    dropped = int(dropped_fn(*args[:4], args[5]))
    flops = 6.0 * n * a.tokens * a.d_model * a.experts + 18.0 * a.d_model * a.d_ff * (
        slots - dropped)
    v = VARIANTS[name]
    return dict(variant=name if routing == "balanced" else f"{name}_{routing}", base_variant=name,
                routing=routing, transport=v["transport"], backend=v["backend"], wire=v["wire"],
                recipe=v.get("recipe", "bf16"), ms=sec * 1e3, dropped_slots=dropped,
                dropped_frac=dropped / slots,
                mfu=flops / (sec * n * report["dense_bf16_tflops"] * 1e12))


def run_variants(a, report, mesh, data, biases) -> dict:
    """Time every variant under its routings; returns the summary's steps by name."""
    keep = {}
    for name in a.variants:
        try:
            step, dropped_fn, compiler = step_of(name, a, mesh, data)
        except Exception as err:  # noqa: BLE001  (one variant failing must not lose the rest)
            report["errors"][name] = repr(err)[:2000]
            print(f"{name}: FAILED {err!r}"[:500], flush=True)
            continue
        for routing in [r for r in biases if r == "balanced" or name in a.zipf_variants]:
            args = args_of(data, biases[routing])
            row = time_variant(name, routing, a, report, step, dropped_fn, args)
            if compiler:
                row["compiler"] = compiler
            if a.profile and routing == "balanced":
                row.update(bench.trace_profile(step, args, os.path.join(a.profile, name), 3))
            report["layer"].append(row)
            print(f"{row['variant']:32s} {row['ms']:9.3f} ms  MFU {row['mfu']:.3f}  dropped "
                  f"{row['dropped_frac']:.4f}", flush=True)
            bench.write_json(a.out, report)
        if name in (CAPACITY, DROPLESS, RAGGED):
            keep[name] = step
    return keep


def layer_ab(steps: dict, biases: dict, data, a) -> dict:
    """The capacity, dropless and ragged steps timed interleaved, per routing."""
    out = {}
    for routing, bias in biases.items():
        args = args_of(data, bias)
        fns = {k: (lambda f=f, args=args: f(*args)) for k, f in steps.items()
               if routing == "balanced" or k in a.zipf_variants}
        if CAPACITY not in fns or len(fns) < 2:
            continue
        ms = {k: v * 1e3 for k, v in bench.medians(bench.interleaved(
            fns, max(3, 2 * a.iters))).items()}
        out[routing] = {"ms": ms, "over_capacity": {k: v / ms[CAPACITY] for k, v in ms.items()}}
    return out


def summary(report, a) -> dict:
    """The flat keys the report reads: the dropless summary, the FP8 layer keys and the
    per-variant figures (the tag is the device count and kind: 1gpu, 2cpu, ...)."""
    e = report["env"]
    tag = f"{e['n_devices']}{'gpu' if e['backend'] in ('gpu', 'cuda') else e['backend']}"
    by = {r["variant"]: r for r in report["layer"]}
    out = {f"moe_layer_{k}_by_variant": {r["variant"]: r[k] for r in report["layer"]}
           for k in ("mfu", "ms", "dropped_frac")}
    out["moe_layer_exposed_comm_fraction_by_variant"] = {
        r["variant"]: r["overlap"]["exposed_fraction"] for r in report["layer"]
        if r.get("overlap", {}).get("exposed_fraction") is not None}
    for sfx in ("", "_zipf"):
        cap = by.get(CAPACITY + sfx)
        ab = report["layer_ab"].get(sfx[1:] or "balanced", {}).get("over_capacity", {})
        for key, name in (("dropless", DROPLESS), ("ragged", RAGGED), ("capacity", CAPACITY)):
            if (row := by.get(name + sfx)) is None:
                continue
            out[f"{key}_layer_ms_{tag}{sfx}"], out[f"{key}_layer_mfu_{tag}{sfx}"] = (
                row["ms"], row["mfu"])
            out[f"{key}_dropped_slots_{tag}{sfx}"] = row["dropped_slots"]
            out[f"{key}_dropped_frac_{tag}{sfx}"] = row["dropped_frac"]
            if cap and key != "capacity":
                out[f"{key}_over_capacity_time_{tag}{sfx}"] = ab.get(name, row["ms"] / cap["ms"])
    for transport, stem in (("dense", "dense_auto"), ("dropless", "dropless")):
        for label, name in (("bf16", f"{stem}_bf16"), ("fp8", f"{stem}_fp8all")):
            if name in by:
                out[f"moe_layer_{label}_mfu_{tag}_{transport}"] = by[name]["mfu"]
                out[f"moe_layer_{label}_ms_{tag}_{transport}"] = by[name]["ms"]
    default = moe.auto_transport(e["n_devices"])
    if f"moe_layer_fp8_ms_{tag}_{default}" in out and f"moe_layer_bf16_ms_{tag}_{default}" in out:
        for k in ("mfu", "ms"):
            for label in ("bf16", "fp8"):
                out[f"moe_layer_{label}_{k}_{tag}"] = out[f"moe_layer_{label}_{k}_{tag}_{default}"]
        out[f"moe_layer_fp8_speedup_{tag}"] = (out[f"moe_layer_bf16_ms_{tag}"]
                                               / out[f"moe_layer_fp8_ms_{tag}"])
    return out


def eager(a) -> dict:
    """``moe.MoE`` called outside any jit (it compiles its functional core once per shape)
    against the same call under ``nnx.jit``: first calls, then medians."""
    from flax import nnx

    n = jax.device_count()
    tokens = 128 if a.small or not bench.on_gpu() else 8192
    d, f, e = (64, 32, 8) if tokens <= 1024 else (1024, 512, 16)
    layer = moe.MoE(d, f, options=moe.MoEOptions.create(e, 2),
                    mesh=jax.make_mesh((1, n), ("data", "expert")), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (n, tokens // n, d))
    jitted = nnx.jit(lambda m, x: m(x))

    def timed(fn):  # the first call's seconds, then the median of 10 more
        return bench.median_seconds(fn, (x,), 0, 1), bench.median_seconds(fn, (x,), 0, 10)

    (first, eager_s), (jit_first, jit_s) = timed(layer), timed(lambda x: jitted(layer, x))
    out = {"benchmark": "eager_layer", "env": bench.env(), "tokens": tokens, "d_model": d,
           "d_ff": f, "experts": e, "first_eager_s": first, "eager_s": eager_s,
           "jit_first_s": jit_first, "jit_s": jit_s, "eager_over_jit": eager_s / jit_s,
           "target": "eager_over_jit <= 3"}
    print(f"eager {eager_s * 1e3:.2f} ms (first {first:.2f} s), nnx.jit {jit_s * 1e3:.2f} ms: "
          f"eager / jit = {eager_s / jit_s:.2f}")
    bench.write_json(a.out, out)
    return out


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.eager:
        return eager(a)
    mesh = bench.line_mesh()
    if a.experts % mesh.devices.size:
        raise SystemExit(f"--experts {a.experts} must be a multiple of the devices")
    report = dict(benchmark="layer", env=bench.env(), settings=bench.settings(a), layer=[],
                  errors={}, useful_flops="6*tokens*d_model*E + 18*d_model*d_ff*kept_slots")
    bench.ceilings(report, a.ceiling_n, a.small, dtypes=("bf16",))
    data = bench.layer_data(mesh, a.tokens, a.d_model, a.experts, a.d_ff, a.seed)
    biases, report["routing"] = bench.routings(data, a.experts, a.top_k, a.routing.split(","),
                                               a.zipf_s)
    steps = run_variants(a, report, mesh, data, biases)
    report["layer_ab"] = layer_ab(steps, biases, data, a) if len(steps) > 1 else {}
    report.update(summary(report, a))
    bench.print_table(report["layer"], ["variant", "ms", "mfu", "dropped_frac"])
    print({k: v for k, v in report.items() if "_over_capacity_" in k or "speedup" in k})
    bench.write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
