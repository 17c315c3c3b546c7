"""What FP8 buys on one GPU: grouped GEMM, gated experts and the MoE layer, FP8 against bf16.

One process, random (never zero) inputs, medians after warm-up, the ceilings measured in the
same run (dense bf16 and dense FP8 [8192]^3 matmuls). Rows:

1. ``gmm``: the gate_up forward GEMM alone (tokens x d_model -> 2 d_ff, ``experts`` groups,
   balanced): bf16 Pallas Triton (`moe._gmm_pallas`, the previous kernel), bf16 and FP8
   Pallas Mosaic GPU (`moe._gmm_mosaic`). Key ``fp8_gmm_over_bf16_rate`` = FP8 Mosaic rate /
   bf16 Triton rate (and ``..._vs_mosaic_bf16``).
2. ``experts``: `moe.gated_experts` forward + backward (``y`` and the gradients of
   ``sum(y * ct)``; ``y`` is returned, so the forward down GEMM runs), per layout:
   padded ``[E, C, d]`` ('einsum', balanced) and ragged ``[R, d]`` in the 128-aligned layout
   ('mosaic', balanced and Zipf s=1), for bf16 and FP8 recipes (``gemm``, ``+dgrad``,
   ``+wgrad``, ``+save_z``). Keys ``experts_fp8_speedup_padded`` / ``_ragged`` /
   ``_ragged_zipf``: bf16 time / best FP8 time, same backend and layout. ``--cases`` picks the
   (layout, routing) cases; ``--breakdown`` traces 3 steps of every row with ``jax.profiler``
   and stores where the device time goes (benchmarks/trace_breakdown.py: categories and the
   most expensive instructions, so the FP8 operands' quantization passes show by name).
3. ``layer``: `moe.moe_apply` forward + backward on one device for each of
   ``--layer-transports`` (dense: capacity factor 1.25; dropless) (16k tokens, d 4096, d_ff
   2048, 16 experts, top-2), bf16 vs FP8 (dispatch + the GEMMs of ``--layer-recipe``). Each
   FP8 row also carries its worst cosine / relative RMS error over the output gradients
   against the bf16 row of the same case. MFU counts useful bf16-equivalent FLOPs (router + 3
   GEMMs per kept slot, x3 for fwd+bwd) over the dense bf16 rate: keys
   ``moe_layer_fp8_mfu_1gpu_{transport}``, and ``moe_layer_fp8_mfu_1gpu`` for the transport
   the layer picks by default on one GPU (``moe.auto_transport(1)``).

Keys of section 2: ``experts_fp8_speedup_{layout}`` is the largest, over the backends timed
for that layout, of bf16 time / best FP8 time on the same backend (``_recipe`` names the
recipe and backend; ``experts_fp8_speedup_by_backend`` has every backend's), and
``..._vs_fastest_bf16`` the fastest FP8 time against the fastest bf16 time of any backend.

Usage:
  python benchmarks/fp8_bench.py --out fp8.json          # one H200 (the FP8 layer compiles slowly)
  python benchmarks/fp8_bench.py --small                 # CPU plumbing check (numbers mean nothing)
  python benchmarks/fp8_bench.py --only gmm,experts --tokens 131072 --d-model 2048 --d-ff 1408 \
      --experts 16 --breakdown                           # one layer of lm_step_bench's model
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_util  # noqa: E402
from experts_bench import group_sizes_for  # noqa: E402
from trace_breakdown import op_breakdown, trace_steps  # noqa: E402

import moe  # noqa: E402
from moe import _gmm_mosaic, _gmm_pallas, _grouped  # noqa: E402
from moe.experts import gated_experts  # noqa: E402

F8 = jnp.float8_e4m3fn
EXPERT_CASES = {  # --cases name: (layout, backend, routing)
    "padded_balanced": ("padded", "einsum", "balanced"),
    "padded_mosaic_balanced": ("padded", "mosaic", "balanced"),
    "ragged_balanced": ("ragged", "mosaic", "balanced"),
    "ragged_zipf": ("ragged", "mosaic", "zipf"),
}
ALIGN = _gmm_mosaic.GROUP_ALIGNMENT
RECIPES = {
    "bf16": {},
    "fp8_gemm": {"gemm_dtype": "fp8"},
    "fp8_gemm_dgrad": {"gemm_dtype": "fp8", "dgrad_dtype": "fp8"},
    "fp8_all": {"gemm_dtype": "fp8", "dgrad_dtype": "fp8", "wgrad_dtype": "fp8"},
    "fp8_all_z": {"gemm_dtype": "fp8", "dgrad_dtype": "fp8", "wgrad_dtype": "fp8",
                  "save_z": "fp8"},
}


def timed(fn, args, a, inner=3):
    """Median seconds per call; each sample is ``inner`` back-to-back calls (one with
    ``--small``: CPU plumbing, where the timing means nothing)."""
    inner = 1 if a.small else inner

    def calls(*xs):
        return [fn(*xs) for _ in range(inner)]
    sec, _ = bench_util.median_seconds(calls, args, a.warmup, a.iters)
    return sec / inner


def leaf_errors(got, want) -> list[tuple[float, float]]:
    """``(cosine, relative RMS error)`` of every leaf of ``got`` against ``want``."""
    out = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64).ravel(), np.asarray(w, np.float64).ravel()
        out.append((float(g @ w / max(np.linalg.norm(g) * np.linalg.norm(w), 1e-30)),
                    float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))))
    return out


def accuracy(got, want) -> dict:
    """Worst cosine and relative RMS error over the leaves of ``got`` against ``want``."""
    cos, rel = zip(*leaf_errors(got, want), strict=True)
    return {"worst_cos_vs_bf16": min(cos), "worst_rel_rms_vs_bf16": max(rel)}


def record(report, section, entry):
    report.setdefault(section, []).append(entry)
    bench_util.write_json(report["out"], report)
    keys = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in entry.items() if k not in ("options", "group_sizes", "breakdown"))
    print(f"[{section}] {keys}", flush=True)


def ceilings(report, a):
    """The dense bf16 and FP8 matmul ceilings (`bench_util.dense_ceiling`), timed as the rows
    are: ``inner`` back-to-back calls per sample."""
    for dtype in ("bf16", "fp8"):
        c = bench_util.dense_ceiling(a.ceiling_n, a.warmup, a.iters, seed=1,
                                     inner=1 if a.small else 3, dtype=dtype)
        report[f"dense_{dtype}_tflops"] = c["tflops"]
        record(report, "ceilings", {"name": f"dense_{dtype}", "n": c["n"],
                                    "ms": c["seconds"] * 1e3, "tflops": c["tflops"]})


def aligned_ragged(x_real: jax.Array, sizes: np.ndarray):
    """The 128-aligned ragged layout of rows grouped by ``sizes``: (x, group_sizes)."""
    src, _, _ = _grouped.align_map(jnp.asarray(sizes), x_real.shape[0], ALIGN)
    return jnp.take(x_real, src, axis=0, mode="fill", fill_value=0), jnp.asarray(sizes)


def gmm_rows(report, a, data):
    t, d, f2, e = a.tokens, a.d_model, 2 * a.d_ff, a.experts
    sizes = group_sizes_for("balanced", t, e, 1.0)
    x, gs = aligned_ragged(data["x"], sizes)
    gs_al = jnp.asarray(-(-sizes // ALIGN) * ALIGN, jnp.int32)
    w = data["w_gate_up"]
    flops = 2.0 * t * d * f2
    cands = {
        "triton_bf16": (jax.jit(functools.partial(_gmm_pallas.gmm, out_dtype=jnp.bfloat16)),
                        (x, w, gs_al)),
        "mosaic_bf16": (jax.jit(_gmm_mosaic.gmm), (x, w, gs_al)),
        "mosaic_fp8": (jax.jit(functools.partial(_gmm_mosaic.gmm, rhs_k_major=True)),
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
        sizes = group_sizes_for(routing, t, e, 1.0)
        if layout == "padded":
            c = int(sizes.max())
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            r = np.arange(c)[None, :]
            src = np.where(r < sizes[:, None], starts[:, None] + r, t)
            x = jnp.take(data["x"], jnp.asarray(src), axis=0, mode="fill", fill_value=0)
            gs, align = jnp.asarray(sizes), None
        else:
            x, gs = aligned_ragged(data["x"], sizes)
            align = ALIGN
        ct = jax.random.normal(jax.random.key(7), x.shape, jnp.bfloat16)
        times, ref = {}, None
        for recipe in a.recipes:
            opts = RECIPES[recipe]
            def loss(x, wgu, wd, ct, opts=opts, gs=gs, backend=backend, align=align):
                y = gated_experts(x, gs, wgu, wd, backend=backend, group_alignment=align,
                                  **opts)
                return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

            try:
                args = (x, data["w_gate_up"], data["w_down"], ct)
                # y is an output: with only the gradients of this linear loss, XLA would drop
                # the forward down GEMM (the cotangent of y is ct, whatever y is).
                step = jax.jit(lambda *a, loss=loss: y_and_grads(loss, *a))
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


def y_and_grads(loss, *args, argnums=(0, 1, 2)):
    """``(y, *d loss / d args[argnums])`` of a ``loss`` returning ``(value, y)``."""
    (_, y), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*args)
    return (y, *grads)


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
            y, aux = moe.moe_apply(x, rk, wgu, wd, opts=opts)
            obj = jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))
            return obj + aux["load_balance_loss"], aux["dropped_tokens"]

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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--only", default="ceilings,gmm,experts,layer")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
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
    a = p.parse_args(argv)
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


def main(argv=None):
    a = parse_args(argv)
    report = {"benchmark": "fp8", "env": bench_util.env_info(), "out": a.out,
              "settings": {k: v for k, v in vars(a).items() if k != "out"}}
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
    ceilings(report, a)
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


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f}s")
