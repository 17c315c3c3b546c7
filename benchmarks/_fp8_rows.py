"""The ``fp8`` part of benchmarks/experts_bench.py (was benchmarks/fp8_bench.py; a library).

What FP8 buys on one GPU: grouped GEMM, gated experts and the MoE layer, FP8 against bf16.
One process, random (never zero) inputs, medians after warm-up, the ceilings measured in the
same run (dense bf16 and dense FP8 [8192]^3 matmuls). Rows:

1. ``gmm``: the gate_up forward GEMM alone (tokens x d_model -> 2 d_ff, ``experts`` groups,
   balanced): bf16 Pallas Triton (`accel_kernels.gmm.triton`, the previous kernel), bf16 and FP8
   Pallas Mosaic GPU (`accel_kernels.gmm.mosaic_kernel`). Key ``fp8_gmm_over_bf16_rate`` = FP8
   Mosaic
   rate /
   bf16 Triton rate (and ``..._vs_mosaic_bf16``). GPU only.
2. ``experts``: `moe.gated_experts` forward + backward (``y`` and the gradients of
   ``sum(y * ct)``; ``y`` is returned, so the forward down GEMM runs), per layout:
   padded ``[E, C, d]`` ('einsum', balanced) and ragged ``[R, d]`` in the 128-aligned layout
   ('mosaic', balanced and Zipf s=1), for bf16 and FP8 recipes (``gemm``, ``+dgrad``,
   ``+wgrad``, ``+save_z``). ``experts_fp8_speedup_{layout}`` (``_ragged_zipf``) is the
   largest, over the backends timed for that layout, of bf16 time / best FP8 time on the same
   backend (``_recipe`` names the recipe and backend; ``experts_fp8_speedup_by_backend`` has
   every backend's), ``..._vs_fastest_bf16`` the fastest FP8 time against the fastest bf16
   time of any backend. ``--breakdown`` traces 3 steps of every row with ``jax.profiler`` and
   stores where the device time goes (`xla_comm.breakdown.op_breakdown`).
3. ``layer``: `moe.moe_apply` forward + backward on one device for each of
   ``--layer-transports`` (16k tokens, d 4096, d_ff 2048, 16 experts, top-2), bf16 vs FP8
   (dispatch + the GEMMs of ``--layer-recipe``), each FP8 row with its worst cosine / relative
   RMS error against the bf16 row. MFU counts useful bf16-equivalent FLOPs over the dense bf16
   rate: ``moe_layer_fp8_mfu_1gpu_{transport}``, and ``moe_layer_fp8_mfu_1gpu`` for the
   transport ``moe.auto_transport(1)`` picks.
"""

from __future__ import annotations

import functools
import tempfile
import traceback

import bench_util
import jax
import jax.numpy as jnp
import numpy as np
from bench_util import accuracy, group_sizes, padded_layout, record

import moe
from accel_kernels.gmm import api as gmm_api
from accel_kernels.gmm import mosaic_kernel as gmm_mosaic
from accel_kernels.gmm import triton as gmm_triton
from xla_comm.breakdown import op_breakdown
from xla_comm.trace import trace_steps

F8 = jnp.float8_e4m3fn
EXPERT_CASES = {  # --cases name: (layout, backend, routing)
    "padded_balanced": ("padded", "einsum", "balanced"),
    "padded_mosaic_balanced": ("padded", "mosaic", "balanced"),
    "ragged_balanced": ("ragged", "mosaic", "balanced"),
    "ragged_zipf": ("ragged", "mosaic", "zipf"),
}
ALIGN = gmm_mosaic.GROUP_ALIGNMENT
RECIPES = {
    "bf16": {},
    "fp8_gemm": {"gemm_dtype": "fp8"},
    "fp8_gemm_dgrad": {"gemm_dtype": "fp8", "dgrad_dtype": "fp8"},
    "fp8_all": {"gemm_dtype": "fp8", "dgrad_dtype": "fp8", "wgrad_dtype": "fp8"},
    "fp8_all_z": {"gemm_dtype": "fp8", "dgrad_dtype": "fp8", "wgrad_dtype": "fp8",
                  "save_z": "fp8"},
}


def add_args(p):
    p.add_argument("--small", action="store_true",
                   help="CPU plumbing sizes (1024 tokens, 512/256; numbers mean nothing)")
    p.add_argument("--out", default=None, help="JSON path")
    p.add_argument("--only", default="ceilings,gmm,experts,layer")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="the dense layer's capacity factor")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help="expert recipes timed (bf16 first: the speedups and the accuracy "
                        "check compare with it)")
    p.add_argument("--layer-transports", default="dense,dropless",
                   help="transports of the layer rows (TRANSPORT or TRANSPORT_BACKEND, e.g. "
                        "dense_mosaic); the un-suffixed keys are those of "
                        "moe.auto_transport(1)")
    p.add_argument("--cases", default=",".join(EXPERT_CASES),
                   help="gated-experts cases timed (layout_routing)")
    p.add_argument("--breakdown", action="store_true",
                   help="trace each gated-experts row and record its op breakdown")
    for name, what in (("tokens", "gmm and gated-experts rows (32768)"),
                       ("experts", "gmm and gated-experts rows (8)"),
                       ("d-model", "every row (4096)"), ("d-ff", "every row (2048)")):
        p.add_argument(f"--{name}", type=int, default=None, help=what)
    p.add_argument("--layer-recipe", default="fp8_all", choices=list(RECIPES)[1:],
                   help="the FP8 GEMM recipe of the layer's 'fp8' variant (with FP8 dispatch)")


def finish(p, a):
    a.recipes = a.recipes.split(",")
    a.cases = a.cases.split(",")
    a.layer_transports = a.layer_transports.split(",")
    if not set(a.cases) <= EXPERT_CASES.keys():
        p.error(f"--cases must name only {sorted(EXPERT_CASES)}, got {a.cases}")
    if a.recipes[0] != "bf16" or not set(a.recipes) <= RECIPES.keys():
        p.error(f"--recipes must start with bf16 and name only {list(RECIPES)}")
    full = dict(tokens=32768, d_model=4096, d_ff=2048, experts=8, layer_tokens=16384,
                layer_experts=16, ceiling_n=8192, warmup=3, iters=10)
    small = dict(tokens=1024, d_model=512, d_ff=256, experts=4, layer_tokens=512,
                 layer_experts=8, ceiling_n=512, warmup=1, iters=2)
    for key, v in (small if a.small else full).items():
        if getattr(a, key, None) is None:
            setattr(a, key, v)
    return a


def timed(fn, args, a, inner=3):
    """Median seconds per call; each sample ``inner`` back-to-back calls (one with
    ``--small``: CPU plumbing, where the timing means nothing)."""
    return bench_util.per_call_seconds(fn, args, a.warmup, a.iters, 1 if a.small else inner)


def aligned_ragged(x_real: jax.Array, sizes: np.ndarray):
    """The 128-aligned ragged layout of rows grouped by ``sizes``: (x, group_sizes)."""
    src, _, _ = gmm_api.align_map(jnp.asarray(sizes), x_real.shape[0], ALIGN)
    return jnp.take(x_real, src, axis=0, mode="fill", fill_value=0), jnp.asarray(sizes)


def gmm_rows(report, a, data):
    t, d, f2, e = a.tokens, a.d_model, 2 * a.d_ff, a.experts
    sizes = group_sizes("balanced", t, e)
    x, gs = aligned_ragged(data["x"], sizes)
    gs_al = jnp.asarray(-(-sizes // ALIGN) * ALIGN, jnp.int32)
    w = data["w_gate_up"]
    flops = 2.0 * t * d * f2
    cands = {
        "triton_bf16": (jax.jit(functools.partial(gmm_triton.gmm, out_dtype=jnp.bfloat16)),
                        (x, w, gs_al)),
        "mosaic_bf16": (jax.jit(gmm_mosaic.gmm), (x, w, gs_al)),
        "mosaic_fp8": (jax.jit(functools.partial(gmm_mosaic.gmm, rhs_k_major=True)),
                       (x.astype(F8), jnp.swapaxes(w, 1, 2).astype(F8), gs_al)),
    }
    rates = {}
    for name, (fn, args) in cands.items():
        try:
            sec = timed(fn, args, a)
        except Exception as err:  # noqa: BLE001 - record and go on
            record(report, "gmm", {"kernel": name, "error": repr(err)[:500]})
            continue
        rates[name] = flops / sec / 1e12
        record(report, "gmm", {"kernel": name, "ms": sec * 1e3, "tflops": rates[name]})
    if {"triton_bf16", "mosaic_fp8"} <= rates.keys():
        report["fp8_gmm_over_bf16_rate"] = rates["mosaic_fp8"] / rates["triton_bf16"]
    if {"mosaic_bf16", "mosaic_fp8"} <= rates.keys():
        report["fp8_gmm_over_bf16_rate_vs_mosaic_bf16"] = rates["mosaic_fp8"] / rates["mosaic_bf16"]


def experts_rows(report, a, data):
    t, d, f, e = a.tokens, a.d_model, a.d_ff, a.experts
    useful = 6.0 * t * d * 3 * f
    for layout, backend, routing in (EXPERT_CASES[c] for c in a.cases):
        sizes = group_sizes(routing, t, e)
        if layout == "padded":
            x, gs, align = padded_layout(data["x"], sizes, int(sizes.max())), \
                jnp.asarray(sizes), None
        else:
            (x, gs), align = aligned_ragged(data["x"], sizes), ALIGN
        ct = jax.random.normal(jax.random.key(7), x.shape, jnp.bfloat16)
        times, ref = {}, None
        for recipe in a.recipes:
            opts = RECIPES[recipe]
            try:
                args = (x, data["w_gate_up"], data["w_down"], ct)
                step = bench_util.experts_step(backend, gs, group_alignment=align, **opts)
                step = step.lower(*args).compile()
                grads = jax.block_until_ready(step(*args))
                sec = timed(step, args, a)
            except Exception as err:  # noqa: BLE001
                traceback.print_exc(limit=4)
                record(report, "experts", {"layout": layout, "routing": routing,
                                           "recipe": recipe, "error": repr(err)[:500]})
                continue
            times[recipe] = sec
            ref = grads if recipe == "bf16" else ref
            record(report, "experts", {
                "layout": layout, "backend": backend, "routing": routing, "recipe": recipe,
                "options": opts, "ms": sec * 1e3, "useful_tflops": useful / sec / 1e12,
                "bf16_equiv_mfu": useful / sec / 1e12 / report["dense_bf16_tflops"],
                **({} if ref is None or recipe == "bf16" else accuracy(grads, ref)),
                **({"breakdown": breakdown(step, args, f"experts_{layout}_{routing}_{recipe}")}
                   if a.breakdown else {})})
        fp8 = {k: v for k, v in times.items() if k != "bf16"}
        if "bf16" in times and fp8:
            best = min(fp8, key=fp8.get)
            key = f"experts_fp8_speedup_{layout}" + ("_zipf" if routing == "zipf" else "")
            speedups = report.setdefault("experts_fp8_speedup_by_backend", {})
            speedups[f"{key}_{backend}"] = {"speedup": times["bf16"] / fp8[best], "recipe": best,
                                            "bf16_ms": times["bf16"] * 1e3,
                                            "fp8_ms": fp8[best] * 1e3}
            # the key: the backend where FP8 gains most against bf16 on that same backend;
            # ..._vs_fastest_bf16: the fastest FP8 against the fastest bf16 of any backend
            mine = {k: v for k, v in speedups.items() if k.rsplit("_", 1)[0] == key}
            top = max(mine, key=lambda k: mine[k]["speedup"])
            report[key] = mine[top]["speedup"]
            report[key + "_recipe"] = f"{mine[top]['recipe']} ({top.rsplit('_', 1)[1]})"
            report[key + "_vs_fastest_bf16"] = (min(v["bf16_ms"] for v in mine.values())
                                                / min(v["fp8_ms"] for v in mine.values()))


def breakdown(step, args, name: str, steps: int = 3) -> dict:
    """Where a compiled step's device time goes: 3 traced calls, categories + top instructions."""
    trace_dir = tempfile.mkdtemp(prefix=f"fp8_{name}_")
    err = trace_steps(step, args, trace_dir, steps)
    if err:
        return {"error": err}
    try:
        bd = op_breakdown(trace_dir, step.as_text(), steps=steps, top=16)
    except Exception as e:  # noqa: BLE001  (keep the timings whatever the trace holds)
        return {"error": repr(e)[:1000]}
    print(f"\n{name}: {bd['total_us_per_step'] / 1e3:.3f} ms traced per step; top instructions:")
    for inst, cat, us in bd["top_ops"]:
        print(f"  {us / 1e3:8.3f} ms  {cat or '-':14s} {inst}")
    return bd


def layer_rows(report, a):
    t, d, f, e, k = a.layer_tokens, a.d_model, a.d_ff, a.layer_experts, a.top_k
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (1, t, d), jnp.bfloat16)
    ct = jax.random.normal(keys[1], (1, t, d), jnp.bfloat16)
    rk = jax.random.normal(keys[2], (d, e), jnp.float32) * d**-0.5
    wgu = (jax.random.normal(keys[3], (e, d, 2 * f)) * d**-0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(keys[4], (e, f, d)) * f**-0.5).astype(jnp.bfloat16)
    for case in a.layer_transports:  # "dense", "dropless", "dense_mosaic" (backend forced)
        transport, _, backend = case.partition("_")
        kw = {"capacity_factor": a.capacity_factor} if transport == "dense" else {}
        base = moe.MoEOptions.create(e, k, transport=transport, fp8_block_size=128,
                                     backend=backend or "auto", **kw)
        variants = {
            "bf16": base.replace(dispatch_dtype="bf16", combine_grad_dtype="bf16"),
            "fp8": base.replace(dispatch_dtype="fp8", combine_grad_dtype="fp8",
                                **RECIPES[a.layer_recipe]),
        }
        _layer_variants(report, a, variants, case, (x, rk, wgu, wd, ct))
    default = moe.auto_transport(1)
    for key in ("mfu", "ms"):
        for name in ("bf16", "fp8"):
            src = f"moe_layer_{name}_{key}_1gpu_{default}"
            if src in report:
                report[f"moe_layer_{name}_{key}_1gpu"] = report[src]
    report["moe_layer_default_transport"] = default
    if "moe_layer_fp8_ms_1gpu" in report and "moe_layer_bf16_ms_1gpu" in report:
        report["moe_layer_fp8_speedup_1gpu"] = (report["moe_layer_bf16_ms_1gpu"]
                                                / report["moe_layer_fp8_ms_1gpu"])


def _layer_variants(report, a, variants, transport, args):
    """Time the bf16 and FP8 layer of one transport; keys ``moe_layer_{name}_{mfu,ms}_1gpu_
    {transport}``."""
    t, d, f, e, k = a.layer_tokens, a.d_model, a.d_ff, a.layer_experts, a.top_k
    x, rk, wgu, wd, ct = args
    ref = None
    for name, opts in variants.items():
        def loss(x, rk, wgu, wd, ct, opts=opts):
            y, aux = moe.moe_apply(x, rk, wgu, wd, options=opts)
            obj = jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))
            return obj + aux["load_balance_loss"], aux["dropped_slots"]

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        try:
            grads, dropped = jax.block_until_ready(step(x, rk, wgu, wd, ct))
            sec = timed(step, (x, rk, wgu, wd, ct), a)
            ref = grads if name == "bf16" else ref
        except Exception as err:  # noqa: BLE001
            traceback.print_exc(limit=4)
            record(report, "layer", {"variant": name, "transport": transport,
                                     "error": repr(err)[:500]})
            continue
        kept = t * k - int(dropped)
        flops = 6.0 * t * d * e + 18.0 * d * f * kept  # router + 3 GEMMs, fwd + bwd
        mfu = flops / sec / 1e12 / report["dense_bf16_tflops"]
        record(report, "layer", {"variant": name, "transport": transport, "ms": sec * 1e3,
                                 "mfu": mfu, "dropped_frac": int(dropped) / (t * k),
                                 **({} if ref is None or name == "bf16"
                                    else accuracy(grads, ref))})
        report[f"moe_layer_{name}_mfu_1gpu_{transport}"] = mfu
        report[f"moe_layer_{name}_ms_1gpu_{transport}"] = sec * 1e3


def main(a) -> dict:
    report = {"benchmark": "fp8", "env": bench_util.env_info(), "out": a.out,
              "settings": {k: v for k, v in vars(a).items() if k not in ("out", "part")}}
    keys = jax.random.split(jax.random.key(0), 3)
    data = {
        "x": jax.random.normal(keys[0], (a.tokens, a.d_model), jnp.bfloat16),
        "w_gate_up": (jax.random.normal(keys[1], (a.experts, a.d_model, 2 * a.d_ff))
                      * a.d_model**-0.5).astype(jnp.bfloat16),
        "w_down": (jax.random.normal(keys[2], (a.experts, a.d_ff, a.d_model))
                   * a.d_ff**-0.5).astype(jnp.bfloat16),
    }
    only = set(a.only.split(","))
    on_gpu = jax.default_backend() == "gpu"
    bench_util.ceilings(report, a)
    if "gmm" in only and on_gpu:
        gmm_rows(report, a, data)
    if "experts" in only:
        experts_rows(report, a, data)
    if "layer" in only:
        layer_rows(report, a)
    headline = {k: v for k, v in report.items() if k.startswith(("fp8_gmm", "experts_fp8",
                                                                   "moe_layer", "dense_"))}
    print("\n".join(f"{k:45s} {v:.4g}" if isinstance(v, float) else f"{k:45s} {v}"
                    for k, v in headline.items()))
    bench_util.write_json(a.out, report)
    return report
