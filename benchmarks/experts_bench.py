"""Benchmark moe.experts.gated_experts forward + backward against a dense bf16 matmul ceiling.

Times ``jax.grad`` of ``sum(y * ct)`` (ct a random cotangent) with respect to x, w_gate_up and
w_down for each backend ('ragged_dot' on [T, d], 'einsum' on capacity-padded [E, C, d]) and
option set (z saving, FP8 GEMMs), under balanced and Zipf-skewed routing. Useful work counts
real tokens only: 6 * tokens * d_model * 3 * d_ff FLOPs (three GEMMs, forward + two backward),
so padding (einsum under skew) and dropped tokens (a capacity factor) count as waste. The
ceiling is a dense bf16 matmul [T, d_model] @ [d_model, 2*d_ff] timed in the same run.

Usage:
  python benchmarks/experts_bench.py            # GPU: 32768 tokens, d 4096, d_ff 2048, 8 experts
  python benchmarks/experts_bench.py --small    # CPU-sized run
  python benchmarks/experts_bench.py --out res.json --configs bf16 recompute z_fp8
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

try:
    from moe.experts import gated_experts
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from moe.experts import gated_experts

CONFIGS: dict[str, dict[str, str]] = {
    "bf16": {},
    "recompute": {"save_z": "recompute"},
    "z_fp8": {"save_z": "fp8"},
    "gemm_fp8": {"gemm_dtype": "fp8"},
    "wgrad_fp8": {"wgrad_dtype": "fp8"},
    "all_fp8": {"gemm_dtype": "fp8", "save_z": "fp8", "wgrad_dtype": "fp8"},
}
BACKENDS = ("ragged_dot", "einsum")
ROUTINGS = ("balanced", "zipf")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "experts_bench.json"


def group_sizes_for(routing: str, tokens: int, experts: int, zipf_s: float) -> np.ndarray:
    """Token counts per expert summing to ``tokens``: equal, or Zipf p_i ~ 1 / i^s."""
    if routing == "balanced":
        p = np.full(experts, 1.0 / experts)
    elif routing == "zipf":
        p = 1.0 / np.arange(1, experts + 1) ** zipf_s
        p /= p.sum()
    else:
        raise ValueError(f"routing={routing!r}; use one of {ROUTINGS}.")
    sizes = np.floor(p * tokens).astype(np.int64)
    sizes[0] += tokens - sizes.sum()
    return sizes.astype(np.int32)


def median_seconds(fn: Callable, args, warmup: int, iters: int) -> float:
    """Median wall time of ``fn(*args)`` after ``warmup`` calls, each call blocked until ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _layout(backend: str, x_real: jax.Array, sizes: np.ndarray, capacity: int):
    """Expert inputs for a backend: ragged rows [T, d], or padded [E, C, d] (tokens past C drop).

    Returns (x, group sizes actually processed).
    """
    if backend == "ragged_dot":
        return x_real, sizes
    kept = np.minimum(sizes, capacity)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    c = np.arange(capacity)[None, :]
    src = np.where(c < kept[:, None], starts[:, None] + c, x_real.shape[0])  # T: a zero row
    padded = jnp.concatenate([x_real, jnp.zeros((1, x_real.shape[1]), x_real.dtype)])
    return padded[jnp.asarray(src)], kept


def bench_dense(tokens: int, d_model: int, d_ff: int, warmup: int, iters: int, key) -> dict:
    """Dense bf16 [T, d] @ [d, 2 d_ff] (f32 accumulation): the matmul rate ceiling."""
    ka, kb = jax.random.split(key)
    a = jax.random.normal(ka, (tokens, d_model), jnp.bfloat16)
    b = jax.random.normal(kb, (d_model, 2 * d_ff), jnp.bfloat16)

    @jax.jit
    def dense(a, b):
        with jax.named_scope("dense_ceiling"):
            return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    sec = median_seconds(dense, (a, b), warmup, iters)
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
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    t_compile = time.perf_counter()
    jax.block_until_ready(step(x, w_gu, w_d, gs, ct))
    t_compile = time.perf_counter() - t_compile
    sec = median_seconds(step, (x, w_gu, w_d, gs, ct), args.warmup, args.iters)
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    args = p.parse_args(argv)
    small = {"tokens": 1024, "d_model": 512, "d_ff": 512, "experts": 4, "warmup": 1, "iters": 3}
    full = {"tokens": 32768, "d_model": 4096, "d_ff": 2048, "experts": 8, "warmup": 3, "iters": 10}
    for k, v in (small if args.small else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
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
    results = []
    for routing in args.routing:
        sizes = group_sizes_for(routing, args.tokens, args.experts, args.zipf_s)
        for backend in args.backends:
            for config in args.configs:
                r = bench_experts(backend, config, routing, sizes, data, args)
                r["ratio_to_dense"] = r["useful_tflops"] / dense["tflops"]
                results.append(r)

    dev = jax.devices()[0]
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
    report = {
        "benchmark": "gated_experts_fwd_bwd",
        "device": dev.device_kind,
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "useful_flops_formula": "6 * real_tokens * d_model * 3 * d_ff",
        "dense": dense,
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
