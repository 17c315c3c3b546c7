"""Benchmark `moe.fp8_dense` (FP8 dense projections) against the bf16 ``x @ W`` it replaces.

For each shape (default: the LM step's attention projections, 64k tokens at d_model 2048: QKV
``[65536, 2048] x [2048, 6144]`` and output ``[65536, 2048] x [2048, 2048]``) and recipe
(``forward``: FP8 forward GEMM; ``forward_dgrad``: + FP8 data gradient; ``all``: + FP8 weight
gradient), times forward + backward of ``sum(y * ct)`` with respect to ``x`` (bf16) and ``W``
(f32 param, as ``nnx.Linear`` holds it) and compares y, dx and dW with the bf16 GEMM's
(worst cosine and relative RMS error; bar: cosine >= 0.996, relative RMS <= 0.09). The dense
bf16 and FP8 matmul ceilings are timed in the same run.

Usage:
  python benchmarks/fp8_dense_bench.py --out r.json    # one GPU
  python benchmarks/fp8_dense_bench.py --small         # CPU plumbing (timings mean nothing)
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_util import (  # noqa: E402
    accuracy,
    ceilings,
    cli,
    env_info,
    fill_defaults,
    per_call_seconds,
    record,
    y_and_grads,
)

import moe  # noqa: E402

DESCRIPTION = """\
moe.fp8_dense (FP8 dense projections) forward + backward against the bf16 x @ W it replaces,
per shape (default the LM step's attention projections: 65536x2048x6144 and 65536x2048x2048;
--small: 256x128x384 on CPU) and recipe (forward, forward_dgrad, all), with the worst cosine /
relative RMS error of y, dx, dW against bf16, and dense bf16 / FP8 matmul ceilings. JSON
(--out, none by default): ceilings, dense, dense_{bf16,fp8}_tflops."""


def timed(fn, args, a, inner=3):
    """Median seconds per call (each sample ``inner`` calls; one with ``--small``)."""
    return per_call_seconds(fn, args, a.warmup, a.iters, 1 if a.small else inner)


RECIPES = {  # name: (dgrad, wgrad) GEMM dtypes of moe.fp8_dense (its forward is FP8)
    "forward": ("bf16", "bf16"),
    "forward_dgrad": ("fp8", "bf16"),
    "all": ("fp8", "fp8"),
}


def _bf16_dense(x, w):
    """What ``nnx.Linear(dtype=bf16)`` computes: the f32 param cast to bf16, then x @ W."""
    return jnp.dot(x, w.astype(x.dtype))


def _step(dense):
    def loss(x, w, ct):
        y = dense(x, w)
        return jnp.sum(y.astype(jnp.float32) * ct), y

    return jax.jit(lambda *args: y_and_grads(loss, *args, argnums=(0, 1)))


def dense_rows(report, a):
    for m, k, n in a.shapes:
        keys = jax.random.split(jax.random.key(7), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = jax.random.normal(keys[1], (k, n), jnp.float32) * k**-0.5
        ct = jax.random.normal(keys[2], (m, n), jnp.float32)
        args = (x, w, ct)
        flops = 6.0 * m * k * n
        ref_step = _step(_bf16_dense)
        want = ref_step(*args)
        bf16_s = timed(ref_step, args, a)
        record(report, "dense", {"shape": [m, k, n], "recipe": "bf16", "ms": bf16_s * 1e3,
                                 "tflops": flops / bf16_s / 1e12})
        for name in a.recipes:
            dgrad, wgrad = RECIPES[name]
            step = _step(lambda x, w, dgrad=dgrad, wgrad=wgrad: moe.fp8_dense(
                x, w, dgrad_dtype=dgrad, wgrad_dtype=wgrad))
            err = accuracy(step(*args), want)
            sec = timed(step, args, a)
            record(report, "dense", {"shape": [m, k, n], "recipe": name, "ms": sec * 1e3,
                                     "tflops": flops / sec / 1e12,
                                     "speedup_vs_bf16": bf16_s / sec, **err})


def parse_args(argv=None):
    p = cli(DESCRIPTION)
    p.add_argument("--shapes", type=lambda s: [tuple(map(int, t.split("x")))
                                              for t in s.split(",")],
                   help="MxKxN,... (65536x2048x6144,65536x2048x2048; small 256x128x384)")
    p.add_argument("--recipes", nargs="+", choices=tuple(RECIPES), default=list(RECIPES))
    p.add_argument("--ceiling-n", type=int, help="8192; small 256")
    p.add_argument("--warmup", type=int, help="3; small 1")
    p.add_argument("--iters", type=int, help="10; small 2")
    p.add_argument("--out", default="", help="JSON path")
    return fill_defaults(
        p.parse_args(argv),
        small=dict(shapes=[(256, 128, 384)], ceiling_n=256, warmup=1, iters=2),
        full=dict(shapes=[(65536, 2048, 6144), (65536, 2048, 2048)], ceiling_n=8192,
                  warmup=3, iters=10))


def main(argv=None):
    a = parse_args(argv)
    report = {"benchmark": "fp8_dense", "env": env_info(), "out": a.out,
              "settings": {k: v for k, v in vars(a).items() if k != "out"}}
    ceilings(report, a)
    dense_rows(report, a)
    return report


if __name__ == "__main__":
    main()
