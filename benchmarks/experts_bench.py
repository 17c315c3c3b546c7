"""Grouped-GEMM and gated-experts timers on one device, in parts (``--part``).

``--part experts`` (the default): moe.experts.gated_experts forward + backward against a dense
bf16 matmul ceiling, per backend, option set and routing (below). ``--part kernels`` (was
benchmarks/gmm_kernels_bench.py): the grouped-GEMM kernels alone, checked, then timed
(benchmarks/_gmm_kernels.py). ``--part fp8`` (was benchmarks/fp8_bench.py): what FP8 buys at
three levels, grouped GEMM, gated experts and the MoE layer (benchmarks/_fp8_rows.py).

The experts part:

Times ``y`` and ``jax.grad`` of ``sum(y * ct)`` (ct a random cotangent) with respect to x,
w_gate_up and w_down (y is returned, so the forward down GEMM is not dead code) for each backend
('ragged_dot' and 'pallas' on [T, d], 'einsum' on capacity-padded [E, C, d]) and option set (z
saving, FP8 GEMMs), under balanced and Zipf-skewed routing. Useful work counts real tokens only:
6 * tokens * d_model * 3 * d_ff FLOPs (three GEMMs, forward + two backward), so padding (einsum
under skew) and dropped tokens (a capacity factor) count as waste. The ceiling is a dense bf16
matmul [T, d_model] @ [d_model, 2*d_ff] timed in the same run.

'pallas' (moe/gmm_triton.py, Pallas Triton kernels) runs on GPU only (on CPU Pallas would
interpret it, which measures nothing; --allow-interpret forces it, for plumbing checks). Before
its first timing a small correctness check compares it with 'ragged_dot' (max relative error
of y and the three gradients, f32 at highest precision and bf16; JSON "pallas_check"); if the
kernels fail to compile, the error is printed and recorded ("pallas_check"/"skipped") and the
'pallas' rows are skipped. Its rows run after the other backends' and the JSON is rewritten
after every row, so a timeout keeps what finished. --pallas-sweep times the three grouped
GEMMs alone (gmm fwd, gmm transposed = dgrad, tgmm = wgrad; gate_up shapes) for a few tilings
(JSON "pallas_sweep"); --gmm-tiling / --tgmm-tiling set the tiling gated_experts uses.

Usage:
  python benchmarks/experts_bench.py            # GPU: 32768 tokens, d 4096, d_ff 2048, 8 experts
  python benchmarks/experts_bench.py --small    # CPU-sized run
  python benchmarks/experts_bench.py --out res.json --configs bf16 recompute z_fp8
  python benchmarks/experts_bench.py --backends pallas --configs bf16 --pallas-sweep
  python benchmarks/experts_bench.py --backends pallas --gmm-tiling 128,256,64,8,3
  python benchmarks/experts_bench.py --part kernels --out gmm.json      # one H200: ~2-3 min
  python benchmarks/experts_bench.py --part kernels --only mosaic --configs fp8
  python benchmarks/experts_bench.py --part fp8 --out fp8.json   # one H200 (the layer compiles
                                                                 # slowly)
  python benchmarks/experts_bench.py --part fp8 --small          # CPU plumbing check
  python benchmarks/experts_bench.py --part fp8 --only gmm,experts --tokens 131072 \
      --d-model 2048 --d-ff 1408 --experts 16 --breakdown   # one layer of lm_step_bench's model
"""

from __future__ import annotations

import argparse
import functools
import math
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _fp8_rows  # noqa: E402
import _gmm_kernels  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_util import (  # noqa: E402
    experts_step,
    group_sizes,
    max_rel_err,
    median_seconds,
    padded_layout,
    part_args,
    write_json,
)

from accel_kernels.gmm import triton as gmm_triton  # noqa: E402
from moe.experts import gated_experts  # noqa: E402

DESCRIPTION = """\
Grouped-GEMM and gated-experts timers on one device, in three parts (--part):
  experts  moe.experts.gated_experts fwd+bwd per backend (ragged_dot, einsum, pallas), option
           set (--configs: save_z, FP8 GEMMs) and routing (balanced, Zipf), useful TFLOP/s vs
           a dense bf16 matmul of the same shape; 32768 tokens, d_model 4096, d_ff 2048, 8
           experts (--small: 1024, 512/512, 4). JSON (--out, default
           benchmarks/results/experts_bench.json): dense, results, skipped, pallas_check,
           pallas_sweep, pallas_tiling.
  kernels  the grouped-GEMM kernels alone (Mosaic GPU gmm / tgmm bf16 and FP8, Pallas Triton
           gmm, XLA batched einsums), each checked against an f32 reference, then TFLOP/s vs
           dense bf16 / FP8 8192^3 matmuls; same shapes; GPU. JSON (--out): rows, dense_bf16,
           dense_fp8, group_sizes, shape, env.
  fp8      FP8 against bf16 at three levels: gate_up gmm (GPU), gated experts (padded and
           ragged layouts, FP8 recipes, accuracy vs bf16, optional op breakdown) and the MoE
           layer on one device (16384 tokens, 16 experts); same shapes (--small: CPU). JSON
           (--out): ceilings, gmm, experts, layer, experts_fp8_speedup_*,
           fp8_gmm_over_bf16_rate*, moe_layer_{bf16,fp8}_{mfu,ms}_1gpu*.
Details: the docstring of this file and of benchmarks/_gmm_kernels.py, _fp8_rows.py."""


CONFIGS: dict[str, dict[str, str]] = {
    "bf16": {},
    "recompute": {"save_z": "recompute"},
    "z_fp8": {"save_z": "fp8"},
    "gemm_fp8": {"gemm_dtype": "fp8"},
    "wgrad_fp8": {"wgrad_dtype": "fp8"},
    "all_fp8": {"gemm_dtype": "fp8", "save_z": "fp8", "wgrad_dtype": "fp8"},
}
BACKENDS = ("ragged_dot", "einsum", "triton")
RAGGED_BACKENDS = ("ragged_dot", "triton")  # x as [T, d]; 'einsum' takes [E, C, d]
# --pallas-sweep candidates: (block_m, block_n, block_k, num_warps, num_stages).
GMM_SWEEP = ((128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 3),
             (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 32, 4, 5))
# tgmm: output tile [block_k, block_n], rows stepped by block_m.
TGMM_SWEEP = ((64, 128, 128, 8, 4), (64, 128, 128, 4, 3), (32, 128, 128, 4, 4),
              (64, 256, 128, 8, 3), (128, 128, 128, 8, 3), (64, 128, 64, 4, 4))
ROUTINGS = ("balanced", "zipf")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "experts_bench.json"


def _layout(backend: str, x_real: jax.Array, sizes: np.ndarray, capacity: int):
    """Expert inputs for a backend: ragged rows [T, d], or padded [E, C, d] (tokens past C drop).

    Returns (x, group sizes actually processed).
    """
    if backend in RAGGED_BACKENDS:
        return x_real, sizes
    return padded_layout(x_real, sizes, capacity), np.minimum(sizes, capacity)


def bench_dense(tokens: int, d_model: int, d_ff: int, warmup: int, iters: int, key) -> dict:
    """Dense bf16 [T, d] @ [d, 2 d_ff] (f32 accumulation): the matmul rate ceiling."""
    ka, kb = jax.random.split(key)
    a = jax.random.normal(ka, (tokens, d_model), jnp.bfloat16)
    b = jax.random.normal(kb, (d_model, 2 * d_ff), jnp.bfloat16)

    @jax.jit
    def dense(a, b):
        with jax.named_scope("dense_ceiling"):
            return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    sec = median_seconds(dense, (a, b), warmup, iters)[0]
    flops = 2.0 * tokens * d_model * 2 * d_ff
    return {"name": "dense_matmul", "seconds": sec, "tflops": flops / sec / 1e12}


def bench_experts(
    backend: str,
    config: str,
    routing: str,
    sizes: np.ndarray,
    data: dict[str, jax.Array],
    args: argparse.Namespace,
) -> dict:
    tokens, e = args.tokens, args.experts
    d, f = args.d_model, args.d_ff
    if args.capacity_factor > 0:
        capacity = math.ceil(args.capacity_factor * tokens / e)
    else:
        capacity = int(sizes.max())  # dropless
    capacity = -(-capacity // 128) * 128  # GEMM-friendly multiple
    x, kept = _layout(backend, data["x"], sizes, capacity)
    gs = jnp.asarray(kept, jnp.int32)
    w_gu, w_d = data["w_gate_up"], data["w_down"]
    ct = jax.random.normal(jax.random.key(args.seed + 1), x.shape, jnp.bfloat16)
    opts = CONFIGS[config]

    def loss(x, w_gu, w_d, gs, ct):
        y = gated_experts(x, gs, w_gu, w_d, backend=backend, **opts)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    # y is an output: with only the gradients of this linear loss, XLA would drop the forward
    # down GEMM (the cotangent of y is ct, whatever y is).
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    t_compile = time.perf_counter()
    jax.block_until_ready(step(x, w_gu, w_d, gs, ct))
    t_compile = time.perf_counter() - t_compile
    sec = median_seconds(step, (x, w_gu, w_d, gs, ct), args.warmup, args.iters)[0]
    real_tokens = int(kept.sum())
    useful = 6.0 * real_tokens * d * 3 * f
    rows = int(np.prod(x.shape[:-1]))
    return {
        "backend": backend,
        "config": config,
        "options": opts,
        "routing": routing,
        "group_sizes": [int(s) for s in sizes],
        "real_tokens": real_tokens,
        "dropped_tokens": int(tokens - real_tokens),
        "rows_computed": rows,
        "seconds": sec,
        "first_call_seconds": t_compile,
        "useful_tflops": useful / sec / 1e12,
    }


def add_args(p: argparse.ArgumentParser) -> None:
    """The options of the experts part."""
    p.add_argument("--small", action="store_true", help="CPU sizes (1024 tokens, 512/512)")
    p.add_argument(
        "--tokens", type=int, default=None, help="tokens routed to this device's experts"
    )
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--d-ff", type=int, default=None)
    p.add_argument("--experts", type=int, default=None, help="local experts")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--routing", nargs="+", choices=ROUTINGS, default=list(ROUTINGS))
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of skewed routing")
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=0.0,
        help="einsum capacity C = cf * tokens / experts (tokens past C drop); 0: dropless",
    )
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON path ('' to skip)")
    p.add_argument(
        "--allow-interpret",
        action="store_true",
        help="time 'pallas' off GPU too (Pallas interpret mode: plumbing check, not a timing)",
    )
    p.add_argument(
        "--pallas-sweep", action="store_true", help="time gmm/gmm_t/tgmm alone per tiling"
    )
    p.add_argument(
        "--gmm-tiling",
        default=None,
        help="BM,BN,BK,WARPS,STAGES for gated_experts' gmm (fwd and dgrad) kernels",
    )
    p.add_argument(
        "--tgmm-tiling", default=None, help="BM,BN,BK,WARPS,STAGES for the tgmm (wgrad) kernel"
    )


def finish(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    small = {"tokens": 1024, "d_model": 512, "d_ff": 512, "experts": 4, "warmup": 1, "iters": 3}
    full = {"tokens": 32768, "d_model": 4096, "d_ff": 2048, "experts": 8, "warmup": 3, "iters": 10}
    for k, v in (small if args.small else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


PARTS = {
    "experts": ("gated_experts fwd+bwd per backend, option set and routing", add_args, finish),
    "kernels": ("the grouped-GEMM kernels alone, checked, then timed", _gmm_kernels.add_args,
                _gmm_kernels.finish),
    "fp8": ("FP8 vs bf16: gmm, gated experts, the MoE layer", _fp8_rows.add_args,
            _fp8_rows.finish),
}


def parse_args(argv=None) -> argparse.Namespace:
    """The chosen part's arguments (``args.part``)."""
    return part_args(argv, DESCRIPTION, PARTS, default="experts")[1]


def _tiling(spec: str | None, default: gmm_triton.Tiling) -> gmm_triton.Tiling:
    if not spec:
        return default
    bm, bn, bk, warps, stages = (int(v) for v in spec.split(","))
    return gmm_triton.Tiling(bm, bn, bk, warps, stages)


def _tiling_dict(t: gmm_triton.Tiling) -> dict:
    return {k: getattr(t, k) for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages")}


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 4000 else text[:2000] + " ... " + text[-2000:]


def pallas_check(seed: int) -> dict:
    """gated_experts fwd+bwd, 'pallas' vs 'ragged_dot' on small random data (uneven groups, an
    empty group, padding rows): max relative error (max |diff| / max |ragged_dot|) of y, dx,
    dw_gate_up, dw_down, in f32 (both at 'highest' matmul precision) and in bf16."""
    r, d, f = 2048, 512, 256
    gs = jnp.asarray([1000, 0, 600, 300], jnp.int32)  # 148 padding rows
    keys = jax.random.split(jax.random.key(seed + 7), 4)
    base = (
        jax.random.normal(keys[0], (r, d)),
        jax.random.normal(keys[1], (4, d, 2 * f)) / math.sqrt(d),
        jax.random.normal(keys[2], (4, f, d)) / math.sqrt(f),
        jax.random.normal(keys[3], (r, d)),
    )

    def run(backend, dtype):
        return jax.block_until_ready(experts_step(backend, gs)(*(a.astype(dtype) for a in base)))

    out = {"shapes": {"rows": r, "d_model": d, "d_ff": f, "group_sizes": [1000, 0, 600, 300]}}
    names = ("y", "dx", "dw_gate_up", "dw_down")
    t0 = time.perf_counter()
    for tag, dtype, tol in (("f32", jnp.float32, 1e-4), ("bf16", jnp.bfloat16, 3e-2)):
        with jax.default_matmul_precision("highest"):
            got, want = run("triton", dtype), run("ragged_dot", dtype)
        errs = {n: max_rel_err(g, w) for n, g, w in zip(names, got, want, strict=True)}
        pad_zero = bool(np.all(np.asarray(got[0])[1900:] == 0))
        out[tag] = {
            "max_rel_err": errs,
            "tolerance": tol,
            "padding_rows_zero": pad_zero,
            "ok": bool(max(errs.values()) <= tol and pad_zero),
        }
        print(
            f"pallas check {tag}: max rel err vs ragged_dot "
            + " ".join(f"{n}={v:.2e}" for n, v in errs.items())
            + f" (tol {tol:g}), padding rows zero: {pad_zero}"
        )
    out["ok"] = bool(out["f32"]["ok"] and out["bf16"]["ok"])
    out["seconds"] = time.perf_counter() - t0
    if not out["ok"]:
        print("WARNING: pallas check above tolerance; its timings below are of a wrong result")
    return out


def pallas_sweep(sizes_by_routing: dict, data: dict, dense_tflops: float, args) -> list[dict]:
    """Time gmm (x @ W_gu), gmm_t (dz @ W_gu^T) and tgmm (x^T dz) alone for each tiling, and
    ragged_dot on the same GEMM; useful TFLOP/s = 2 * tokens * d_model * 2 d_ff / time."""
    t, d, f = args.tokens, args.d_model, args.d_ff
    x, w = data["x"], data["w_gate_up"]
    dz = jax.random.normal(jax.random.key(args.seed + 3), (t, 2 * f), jnp.bfloat16)
    flops = 2.0 * t * d * 2 * f
    # (candidates, operands, pallas call (a, b, gs, tiling), ragged_dot call or None)
    kernels = {
        "gmm": (
            GMM_SWEEP,
            (x, w),
            lambda a, b, gs, tl: gmm_triton.gmm(a, b, gs, tiling=tl),
            lambda a, b, gs: jax.lax.ragged_dot(a, b, gs),
        ),
        "gmm_t": (
            GMM_SWEEP,
            (dz, w),
            lambda a, b, gs, tl: gmm_triton.gmm(a, b, gs, transpose_rhs=True, tiling=tl),
            None,
        ),
        "tgmm": (
            TGMM_SWEEP,
            (x, dz),
            lambda a, b, gs, tl: gmm_triton.tgmm(a, b, gs, tiling=tl),
            None,
        ),
    }
    rows = []
    for routing, sizes in sizes_by_routing.items():
        gs = jnp.asarray(sizes, jnp.int32)
        for kname, (cands, operands, fn, ref) in kernels.items():
            variants = [(str(c), functools.partial(fn, tl=gmm_triton.Tiling(*c))) for c in cands]
            if ref is not None:
                variants.append(("ragged_dot", ref))
            for label, call in variants:
                row = {"routing": routing, "kernel": kname, "tiling": label}
                try:
                    step = jax.jit(call)
                    sec = median_seconds(step, (*operands, gs), args.warmup, args.iters)[0]
                    row.update(
                        seconds=sec,
                        tflops=flops / sec / 1e12,
                        ratio_to_dense=flops / sec / 1e12 / dense_tflops,
                    )
                    print(
                        f"sweep {routing:9s} {kname:6s} {label:26s} {sec * 1e3:8.3f} ms "
                        f"{row['tflops']:8.1f} TFLOP/s {row['ratio_to_dense']:6.3f}"
                    )
                except Exception as e:  # noqa: BLE001 - record and keep sweeping
                    row["error"] = _short_error(e)
                    print(f"sweep {routing:9s} {kname:6s} {label:26s} FAILED {row['error'][:200]}")
                rows.append(row)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.part != "experts":
        return {"kernels": _gmm_kernels.main, "fp8": _fp8_rows.main}[args.part](args)
    gmm_triton.GMM_TILING = _tiling(args.gmm_tiling, gmm_triton.GMM_TILING)
    gmm_triton.TGMM_TILING = _tiling(args.tgmm_tiling, gmm_triton.TGMM_TILING)
    keys = jax.random.split(jax.random.key(args.seed), 4)
    t, d, f, e = args.tokens, args.d_model, args.d_ff, args.experts
    data = {
        "x": jax.random.normal(keys[0], (t, d), jnp.bfloat16),
        "w_gate_up": (jax.random.normal(keys[1], (e, d, 2 * f)) / math.sqrt(d)).astype(
            jnp.bfloat16
        ),
        "w_down": (jax.random.normal(keys[2], (e, f, d)) / math.sqrt(f)).astype(jnp.bfloat16),
    }
    dense = bench_dense(t, d, f, args.warmup, args.iters, keys[3])
    dev = jax.devices()[0]
    results, skipped = [], []
    report = {
        "benchmark": "gated_experts_fwd_bwd",
        "device": dev.device_kind,
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "part")},
        "useful_flops_formula": "6 * real_tokens * d_model * 3 * d_ff",
        "dense": dense,
        "results": results,
        "skipped": skipped,
        "pallas_tiling": {
            "gmm": _tiling_dict(gmm_triton.GMM_TILING),
            "tgmm": _tiling_dict(gmm_triton.TGMM_TILING),
        },
    }
    sizes_by_routing = {
        r: group_sizes(r, args.tokens, args.experts, args.zipf_s) for r in args.routing
    }
    # 'pallas' last: a compile failure or a timeout there leaves the other rows written.
    backends = [b for b in args.backends if b != "triton"] + [
        b for b in args.backends if b == "triton"
    ]
    for backend in backends:
        if backend == "triton":
            on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
            if not on_gpu and not args.allow_interpret:
                reason = (
                    f"pallas: GPU only (default backend {jax.default_backend()!r}; Pallas "
                    "would interpret it: pass --allow-interpret for a plumbing check)"
                )
                print(f"skipping {reason}")
                skipped.append({"backend": "triton", "reason": reason})
                continue
            try:
                report["pallas_check"] = pallas_check(args.seed)
            except Exception as e:  # noqa: BLE001 - e.g. the Triton lowering fails to compile
                err = _short_error(e)
                traceback.print_exc()
                print(f"skipping pallas: the correctness check failed to run: {err[:500]}")
                report["pallas_check"] = {"ok": False, "error": err}
                skipped.append({"backend": "triton", "reason": "check failed", "error": err})
                write_json(args.out, report)
                continue
            write_json(args.out, report)
            if args.pallas_sweep:
                report["pallas_sweep"] = pallas_sweep(sizes_by_routing, data, dense["tflops"], args)
                write_json(args.out, report)
        for routing, sizes in sizes_by_routing.items():
            for config in args.configs:
                try:
                    r = bench_experts(backend, config, routing, sizes, data, args)
                except Exception as e:  # noqa: BLE001
                    if backend != "triton":
                        raise
                    err = _short_error(e)
                    print(f"skipping pallas {routing}/{config}: {err[:500]}")
                    skipped.append(
                        {"backend": backend, "routing": routing, "config": config, "error": err}
                    )
                    write_json(args.out, report)
                    continue
                r["ratio_to_dense"] = r["useful_tflops"] / dense["tflops"]
                results.append(r)
                print(
                    f"  {routing} {backend} {config}: {r['seconds'] * 1e3:.3f} ms, "
                    f"{r['useful_tflops']:.1f} TFLOP/s ({r['ratio_to_dense']:.3f} of dense)"
                )
                write_json(args.out, report)

    print(
        f"\ngated_experts fwd+bwd on {dev.device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}: tokens={args.tokens} d_model={args.d_model} d_ff={args.d_ff} "
        f"experts={args.experts}"
    )
    print(
        f"dense bf16 matmul ceiling: {dense['tflops']:.3f} TFLOP/s "
        f"({dense['seconds'] * 1e3:.3f} ms)"
    )
    cols = ("routing", "backend", "config", "ms", "TFLOP/s", "/dense", "rows", "dropped")
    widths = (9, 11, 10, 10, 9, 7, 8, 8)
    hdr = " ".join(
        c.ljust(w) if i < 3 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cols, widths, strict=True))
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(
            f"{r['routing']:9s} {r['backend']:11s} {r['config']:10s} {r['seconds'] * 1e3:10.3f} "
            f"{r['useful_tflops']:9.3f} {r['ratio_to_dense']:7.3f} {r['rows_computed']:8d} "
            f"{r['dropped_tokens']:8d}"
        )
    for sk in skipped:
        print(f"skipped: {sk}"[:300])
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f}s")
