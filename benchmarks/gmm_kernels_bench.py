"""Grouped-GEMM kernels alone on one GPU: correctness, then TFLOP/s against dense ceilings.

Times, in one process, on random (never zero) inputs:

* the ceilings: a dense bf16 and a dense FP8 (e4m3 x e4m3, XLA) [8192]^3 matmul;
* the Mosaic GPU kernels of ``moe/_gmm_mosaic.py``: ``gmm`` (bf16 with ``[G, K, N]`` and
  K-major ``[G, N, K]`` weights, FP8 K-major) at the gated experts' gate_up shape
  (tokens x d_model -> 2 d_ff) and ``tgmm`` (the weight gradient ``x^T dz``: bf16 on the
  token-major operands, bf16 and FP8 on K-major copies), balanced and Zipf-skewed groups;
* the Pallas Triton kernels of ``moe/_gmm_pallas.py`` (bf16, and FP8 with K-major weights);
* XLA batched FP8 and bf16 einsums on the capacity-padded layout ``[E, C, d]``.

Before timing, each kernel is checked against an f32 XLA reference on the same (aligned)
groups: max |out - ref| / max |ref|. Results go to ``--out`` (JSON) and a table.

Usage:
  python benchmarks/gmm_kernels_bench.py --out gmm.json          # one H200: ~2-3 minutes
  python benchmarks/gmm_kernels_bench.py --only mosaic --configs fp8
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_util  # noqa: E402

from moe import _gmm_mosaic, _gmm_pallas  # noqa: E402

F8 = jnp.float8_e4m3fn


def aligned_sizes(routing: str, tokens: int, groups: int, align: int, s: float = 1.0):
    """Group sizes (multiples of ``align``) summing to ``tokens``: equal or Zipf(s)."""
    p = np.full(groups, 1.0 / groups) if routing == "balanced" else \
        1.0 / np.arange(1, groups + 1) ** s
    p = p / p.sum()
    sizes = np.floor(p * tokens / align).astype(np.int64) * align
    sizes[0] += tokens - sizes.sum()
    return jnp.asarray(sizes.astype(np.int32))


def timed(fn, args, warmup=3, iters=20, inner=3):
    def calls(*a):
        return [fn(*a) for _ in range(inner)]
    sec, _ = bench_util.median_seconds(calls, args, warmup, iters)
    return sec / inner


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def ref_gmm(a, w, gs, k_major):
    w = jnp.swapaxes(w, 1, 2) if k_major else w
    return jax.lax.ragged_dot(a.astype(jnp.float32), w.astype(jnp.float32), gs,
                              precision=jax.lax.Precision.HIGHEST)


def ref_tgmm(a, b, gs, k_major):
    if k_major:
        a, b = a.T, b.T
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(a.astype(jnp.float32), b.astype(jnp.float32), gs, dn,
                                      precision=jax.lax.Precision.HIGHEST)


def row(report, name, flops, fn, args, ref=None, tol=None):
    """Check (if ``ref``), time, and append one row; errors are recorded, not raised."""
    entry = {"name": name}
    try:
        out = jax.block_until_ready(fn(*args))
        if ref is not None:
            entry["rel_err"] = rel_err(out, ref)
            entry["ok"] = bool(entry["rel_err"] <= tol)
        sec = timed(fn, args)
        entry.update(ms=sec * 1e3, tflops=flops / sec / 1e12)
    except Exception as e:  # noqa: BLE001 - a benchmark records and goes on
        entry["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        traceback.print_exc(limit=3)
    report["rows"].append(entry)
    print(f"{name:58s} " + (f"{entry['ms']:8.3f} ms {entry['tflops']:7.1f} TF/s"
                             if "ms" in entry else entry.get("error", "")[:80])
          + (f"  err {entry['rel_err']:.2e}" if "rel_err" in entry else ""), flush=True)
    return entry


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--only", default="all", help="all | ceiling | mosaic | triton | xla")
    ap.add_argument("--configs", default="bf16,bf16_kmajor,fp8")
    a = ap.parse_args(argv)
    t, d, f2, e = a.tokens, a.d_model, 2 * a.d_ff, a.experts
    report = {"env": bench_util.env_info(), "shape": dict(tokens=t, d_model=d, n=f2, experts=e),
              "rows": []}
    keys = jax.random.split(jax.random.key(0), 8)
    want = set(a.configs.split(","))
    only = a.only

    def save():
        bench_util.write_json(a.out, report)

    if only in ("all", "ceiling"):
        n = 8192
        x = jax.random.normal(keys[0], (n, n), jnp.bfloat16)
        y = jax.random.normal(keys[1], (n, n), jnp.bfloat16)
        mm = jax.jit(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.float32)
                     .astype(jnp.bfloat16))
        report["dense_bf16"] = row(report, "ceiling dense bf16 8192^3", 2 * n**3, mm, (x, y))
        x8, y8t = x.astype(F8), y.T.astype(F8)
        mm8 = jax.jit(lambda u, v: jax.lax.dot_general(
            u, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16))
        report["dense_fp8"] = row(report, "ceiling dense fp8 8192^3 (B K-major)", 2 * n**3,
                                  mm8, (x8, y8t))
        save()

    lhs = jax.random.normal(keys[2], (t, d), jnp.float32)
    w = jax.random.normal(keys[3], (e, d, f2), jnp.float32) * d**-0.5
    flops = 2.0 * t * d * f2
    for routing in ("balanced", "zipf"):
        gs = aligned_sizes(routing, t, e, _gmm_mosaic.GROUP_ALIGNMENT)
        report.setdefault("group_sizes", {})[routing] = np.asarray(gs).tolist()
        if only in ("all", "mosaic"):
            for cfg in ("bf16", "bf16_kmajor", "fp8"):
                if cfg not in want:
                    continue
                dt = F8 if cfg == "fp8" else jnp.bfloat16
                kmaj = cfg != "bf16"
                a_ = lhs.astype(dt)
                w_ = (jnp.swapaxes(w, 1, 2) if kmaj else w).astype(dt)
                ref = ref_gmm(a_, w_, gs, kmaj)
                fn = jax.jit(functools.partial(_gmm_mosaic.gmm, rhs_k_major=kmaj))
                row(report, f"mosaic gmm {cfg} {routing}", flops, fn, (a_, w_, gs), ref, 1e-2)
                save()
            # wgrad: out[g] = x_g^T @ dz_g, [E, d, 2 d_ff]
            dz = jax.random.normal(keys[4], (t, f2), jnp.float32)
            for cfg in ("bf16", "bf16_kmajor", "fp8"):
                if cfg not in want:
                    continue
                dt = F8 if cfg == "fp8" else jnp.bfloat16
                kmaj = cfg != "bf16"
                a_, b_ = lhs.astype(dt), dz.astype(dt)
                if kmaj:
                    a_, b_ = a_.T, b_.T
                ref = ref_tgmm(a_, b_, gs, kmaj)
                fn = jax.jit(functools.partial(_gmm_mosaic.tgmm, k_major=kmaj))
                row(report, f"mosaic tgmm {cfg} {routing}", flops, fn, (a_, b_, gs), ref, 1e-2)
                save()
        if only in ("all", "triton"):
            a16, w16 = lhs.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
            ref = ref_gmm(a16, w16, gs, False)
            fn = jax.jit(functools.partial(_gmm_pallas.gmm, out_dtype=jnp.bfloat16))
            row(report, f"triton gmm bf16 {routing}", flops, fn, (a16, w16, gs), ref, 1e-2)
            a8, w8 = lhs.astype(F8), jnp.swapaxes(w, 1, 2).astype(F8)
            ref = ref_gmm(a8, w8, gs, True)
            fn = jax.jit(functools.partial(_gmm_pallas.gmm, transpose_rhs=True,
                                           out_dtype=jnp.bfloat16))
            row(report, f"triton gmm fp8 K-major {routing}", flops, fn, (a8, w8, gs), ref, 1e-2)
            save()
    if only in ("all", "xla"):
        c = t // e
        xp = jax.random.normal(keys[5], (e, c, d), jnp.float32)
        bf = jax.jit(lambda u, v: jnp.einsum("ecd,edf->ecf", u, v,
                                             preferred_element_type=jnp.float32)
                     .astype(jnp.bfloat16))
        row(report, "xla batched bf16 [E,C,d]x[E,d,f]", flops, bf,
            (xp.astype(jnp.bfloat16), w.astype(jnp.bfloat16)))
        wt8 = jnp.swapaxes(w, 1, 2).astype(F8)
        for out_dt in (jnp.bfloat16, jnp.float32):
            f8 = jax.jit(lambda u, v, o=out_dt: jnp.einsum("ecd,efd->ecf", u, v,
                                                           preferred_element_type=o))
            row(report, f"xla batched fp8 K-major -> {jnp.dtype(out_dt).name}", flops, f8,
                (xp.astype(F8), wt8))
        # With per-row x per-column power-of-two scales applied to a bf16 product.
        sa = jnp.exp2(jnp.round(jax.random.normal(keys[6], (e, c, 1))))
        sb = jnp.exp2(jnp.round(jax.random.normal(keys[7], (e, 1, f2))))
        f8s = jax.jit(lambda u, v, p, q: (jnp.einsum("ecd,efd->ecf", u, v,
                                                     preferred_element_type=jnp.bfloat16)
                                          * (p * q)).astype(jnp.bfloat16))
        row(report, "xla batched fp8 K-major, bf16 out * row*col scale", flops, f8s,
            (xp.astype(F8), wt8, sa, sb))
        save()
    print("rows:", len(report["rows"]))
    save()


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f}s")
