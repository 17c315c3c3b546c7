"""What do gated experts cost forward + backward, per backend and FP8 recipe?

``moe.gated_experts`` forward + backward (``y``, returned so the forward down GEMM runs, and
the gradients of ``sum(y * ct)`` w.r.t. x and both banks) on one device, per case (layout,
backend, routing) and recipe (``RECIPES``). Layouts: ragged ``[R, d]`` rows (128-aligned for
'mosaic') and capacity-padded ``[E, C, d]`` (C the largest group: nothing dropped). Useful
FLOPs = 18 * rows * d_model * d_ff (padding is waste); MFU against this process's dense bf16
ceiling, FP8 in bf16-equivalent FLOPs. Each FP8 row carries its worst cosine and relative RMS
error against the bf16 row of the same inputs. ``--breakdown`` traces 3 calls of each row.

``--part dense``: ``moe.fp8_dense`` (the experts' FP8 GEMMs on one group of rows, for a
model's dense projections) forward + backward against the bf16 ``x @ W`` of ``nnx.Linear``,
at the LM step's attention projections, per recipe (FP8 forward; + data gradient; all three).

    python3 benchmarks/experts.py --out experts.json       # one Hopper GPU, ~2 minutes
    python3 benchmarks/experts.py --tokens 131072 --d-model 2048 --d-ff 1408 --experts 16 \\
        --cases ragged_mosaic_balanced,ragged_mosaic_zipf   # one layer of the LM step
    python3 benchmarks/experts.py --part dense --out fp8_dense.json
    python3 benchmarks/experts.py --small [--part dense]   # CPU plumbing

JSON: ``experts`` rows, :func:`speedups`' keys and ``bf16_rate_over_dense`` per case;
``--part dense``: ``dense`` rows.
"""

from __future__ import annotations

import tempfile
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from _lib import bench

import moe
from accel_kernels.gmm import api as gmm_api

MEASURES = ("moe/", "accel_kernels/")
RECIPES = {
    "bf16": {},
    "fp8_gemm": {"gemm_dtype": "fp8"},
    "fp8_gemm_dgrad": {"gemm_dtype": "fp8", "dgrad_dtype": "fp8"},
    "fp8_all": {"gemm_dtype": "fp8", "dgrad_dtype": "fp8", "wgrad_dtype": "fp8"},
    "fp8_all_z": {"gemm_dtype": "fp8", "dgrad_dtype": "fp8", "wgrad_dtype": "fp8", "save_z": "fp8"},
    "recompute": {"save_z": "recompute"},
}
LAYOUTS = {"padded": ("einsum", "mosaic"), "ragged": ("mosaic", "triton", "ragged_dot")}
CASES = [f"{lay}_{b}_{r}" for lay, bs in LAYOUTS.items() for b in bs for r in ("balanced", "zipf")]
DENSE_RECIPES = {"forward": ("bf16", "bf16"), "forward_dgrad": ("fp8", "bf16"),
                 "all": ("fp8", "fp8")}  # name: (dgrad, wgrad) dtypes; the forward is FP8


def parse_args(argv=None):
    p = bench.parser(__doc__, 2)
    p.add_argument("--part", choices=("experts", "dense"), default="experts")
    p.add_argument("--tokens", type=int, help="rows (32768; small 1024)")
    p.add_argument("--cases", help=f"LAYOUT_BACKEND_ROUTING, from {','.join(CASES)}")
    p.add_argument("--recipes", default="bf16,fp8_all",
                   help=f"bf16 first (the reference), from {','.join(RECIPES)}")
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--breakdown", action="store_true", help="trace each row: op breakdown")
    p.add_argument("--shapes", help="--part dense: MxKxN,... (65536x2048x6144,65536x2048x2048)")
    a = bench.parse(p, argv, small=dict(tokens=1024, d_model=256, d_ff=128, experts=4,
                                        ceiling_n=256, shapes="256x128x384",
                                        cases="ragged_mosaic_balanced,padded_einsum_zipf"),
                    full=dict(tokens=32768, d_model=4096, d_ff=2048, experts=8, ceiling_n=8192,
                              shapes="65536x2048x6144,65536x2048x2048",
                              cases="padded_mosaic_balanced,ragged_mosaic_balanced,"
                                    "ragged_mosaic_zipf"))
    a.cases, a.recipes = a.cases.split(","), a.recipes.split(",")
    if set(a.cases) - set(CASES):
        p.error(f"--cases must name only {CASES}, got {a.cases}")
    if a.recipes[0] != "bf16" or set(a.recipes) - set(RECIPES):
        p.error(f"--recipes must start with bf16 and name only {list(RECIPES)}")
    return a


def parse_case(case: str) -> tuple[str, str, str]:
    """``'ragged_ragged_dot_zipf'`` -> ``('ragged', 'ragged_dot', 'zipf')``."""
    lay, rest = case.split("_", 1)
    backend, routing = rest.rsplit("_", 1)
    return lay, backend, routing


def layout(x, sizes: np.ndarray, lay: str, backend: str):
    """``(x, group sizes, group_alignment)`` in the case's layout."""
    if lay == "padded":
        return bench.padded(x, sizes), jnp.asarray(sizes), None
    if backend != "mosaic":
        return x, jnp.asarray(sizes), None
    src, _, _ = gmm_api.align_map(jnp.asarray(sizes), x.shape[0], gmm_api.GROUP_ALIGNMENT)
    return jnp.take(x, src, axis=0, mode="fill", fill_value=0), jnp.asarray(sizes), \
        gmm_api.GROUP_ALIGNMENT


def experts_case(report, a, data, case):
    """Every recipe of one case; returns ``{recipe: seconds}``."""
    lay, backend, routing = parse_case(case)
    sizes = bench.group_sizes(routing, a.tokens, a.experts, a.zipf_s)
    x, gs, align = layout(data["x"], sizes, lay, backend)
    ct = bench.normal(jax.random.key(7), x.shape)
    args = (x, data["w_gate_up"], data["w_down"], ct)
    useful, impl = 18.0 * a.tokens * a.d_model * a.d_ff, bench.implementation(backend)
    times, ref = {}, None
    for recipe in a.recipes:
        row = {"layout": lay, "backend": backend, "routing": routing, "recipe": recipe,
               "options": RECIPES[recipe]}
        try:
            step = bench.fwd_bwd(lambda x, wgu, wd, opts=RECIPES[recipe]: moe.gated_experts(
                x, gs, wgu, wd, gemm_implementation=impl, group_alignment=align, **opts), 3)
            step = step.lower(*args).compile()  # (y, dx, dw_gate_up, dw_down)
            out = jax.block_until_ready(step(*args))
            sec = bench.median_seconds(step, args, a.warmup, a.iters, 1 if a.small else 3)
        except Exception as err:  # noqa: BLE001  (record and go on)
            traceback.print_exc(limit=4)
            report["experts"].append({**row, "error": repr(err)[:500]})
            continue
        ref = out if recipe == "bf16" else ref
        times[recipe] = sec
        row.update(ms=sec * 1e3, useful_tflops=useful / sec / 1e12,
                   bf16_equiv_mfu=useful / sec / 1e12 / report["dense_bf16_tflops"])
        if recipe != "bf16" and ref is not None:
            row.update(bench.accuracy(out, ref))
        if a.breakdown:
            prof = bench.trace_profile(step, args, tempfile.mkdtemp(prefix="experts_"), 3, top=16)
            row["breakdown"] = prof.get("breakdown", prof)
        report["experts"].append(row)
        print(f"[experts] {case} {recipe}: {sec * 1e3:.3f} ms, MFU {row['bf16_equiv_mfu']:.3f}",
              flush=True)
        bench.write_json(a.out, report)
    return times


def speedups(report, case: str, times: dict) -> None:
    """``experts_fp8_speedup_{layout}[_zipf]``: bf16 time / the best FP8 recipe's, on the
    backend of that layout where FP8 gains most (every backend's under ``..._by_backend``)."""
    lay, backend, routing = parse_case(case)
    fp8 = {k: v for k, v in times.items() if k.startswith("fp8")}
    if "bf16" not in times or not fp8:
        return
    best = min(fp8, key=fp8.get)
    key = f"experts_fp8_speedup_{lay}" + ("_zipf" if routing == "zipf" else "")
    by = report.setdefault("experts_fp8_speedup_by_backend", {})
    by[f"{key}_{backend}"] = {"speedup": times["bf16"] / fp8[best], "recipe": best,
                              "bf16_ms": times["bf16"] * 1e3, "fp8_ms": fp8[best] * 1e3}
    mine = {k: v for k, v in by.items() if k.rsplit("_", 1)[0] == key}
    top = max(mine, key=lambda k: mine[k]["speedup"])
    report[key] = mine[top]["speedup"]
    report[key + "_recipe"] = f"{mine[top]['recipe']} ({top.rsplit('_', 1)[1]})"
    report[key + "_vs_fastest_bf16"] = (min(v["bf16_ms"] for v in mine.values())
                                        / min(v["fp8_ms"] for v in mine.values()))


def dense_part(report, a) -> None:
    """``moe.fp8_dense`` against the bf16 matmul it replaces, per shape and recipe."""
    report["dense"] = []
    for m, k, n in (tuple(map(int, s.split("x"))) for s in a.shapes.split(",")):
        ks = jax.random.split(jax.random.key(7), 3)
        args = (bench.normal(ks[0], (m, k)), bench.normal(ks[1], (k, n), k**-0.5, jnp.float32),
                bench.normal(ks[2], (m, n), 1.0, jnp.float32))
        flops, inner = 6.0 * m * k * n, 1 if a.small else 3
        ref = bench.fwd_bwd(lambda x, w: jnp.dot(x, w.astype(x.dtype)), 2)  # nnx.Linear(bf16)
        want, base = ref(*args), bench.median_seconds(ref, args, a.warmup, a.iters, inner)
        report["dense"].append({"shape": [m, k, n], "recipe": "bf16", "ms": base * 1e3,
                                "tflops": flops / base / 1e12})
        for name, (dgrad, wgrad) in DENSE_RECIPES.items():
            fn = bench.fwd_bwd(lambda x, w, dg=dgrad, wg=wgrad: moe.fp8_dense(
                x, w, dgrad_dtype=dg, wgrad_dtype=wg), 2)
            err = bench.accuracy(fn(*args), want)
            sec = bench.median_seconds(fn, args, a.warmup, a.iters, inner)
            report["dense"].append({"shape": [m, k, n], "recipe": name, "ms": sec * 1e3,
                                    "tflops": flops / sec / 1e12, "speedup_vs_bf16": base / sec,
                                    **err})
        bench.write_json(a.out, report)
    bench.print_table(report["dense"], ["shape", "recipe", "ms", "tflops", "speedup_vs_bf16",
                                        "worst_cos_vs_bf16"])


def main(argv=None) -> dict:
    a = parse_args(argv)
    report = {"benchmark": f"experts_{a.part}", "env": bench.env(), "settings": bench.settings(a)}
    bench.ceilings(report, a.ceiling_n, a.small)
    if a.part == "dense":
        dense_part(report, a)
        return report
    ks = jax.random.split(jax.random.key(a.seed), 3)
    e, d, f = a.experts, a.d_model, a.d_ff
    data = {"x": bench.normal(ks[0], (a.tokens, d)),
            "w_gate_up": bench.normal(ks[1], (e, d, 2 * f), d**-0.5),
            "w_down": bench.normal(ks[2], (e, f, d), f**-0.5)}
    report["experts"] = []
    for case in a.cases:
        if parse_case(case)[1] == "triton" and not bench.on_gpu() and not a.small:
            continue  # interpreted off GPUs
        times = experts_case(report, a, data, case)
        speedups(report, case, times)
        if "bf16" in times:
            report.setdefault("bf16_rate_over_dense", {})[case] = (
                18.0 * a.tokens * d * f / times["bf16"] / 1e12 / report["dense_bf16_tflops"])
    bench.print_table(report["experts"], ["layout", "backend", "routing", "recipe", "ms",
                                          "bf16_equiv_mfu", "worst_cos_vs_bf16", "error"])
    print({k: v for k, v in report.items() if k.startswith("experts_fp8_speedup_")
           and not k.endswith("by_backend")})
    bench.write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
