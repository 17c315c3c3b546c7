"""The ``kernels`` part of benchmarks/experts_bench.py (was benchmarks/gmm_kernels_bench.py;
a library, no command line of its own).

Grouped-GEMM kernels alone on one GPU, in one process, on random (never zero) inputs:

* the ceilings: a dense bf16 and a dense FP8 (e4m3 x e4m3, XLA) [8192]^3 matmul;
* the Mosaic GPU kernels of ``moe/gmm_mosaic.py``: ``gmm`` (bf16 with ``[G, K, N]`` and
  K-major ``[G, N, K]`` weights, FP8 K-major) at the gated experts' gate_up shape
  (tokens x d_model -> 2 d_ff) and ``tgmm`` (the weight gradient ``x^T dz``: bf16 on the
  token-major operands, bf16 and FP8 on K-major copies), balanced and Zipf-skewed groups;
* the Pallas Triton kernels of ``moe/gmm_triton.py`` (bf16, and FP8 with K-major weights);
* XLA batched FP8 and bf16 einsums on the capacity-padded layout ``[E, C, d]``.

Before timing, each kernel is checked against an f32 XLA reference on the same (aligned)
groups: max |out - ref| / max |ref| (``rel_err``, ``ok`` at 1e-2).
"""

from __future__ import annotations

import functools
import traceback

import bench_util
import jax
import jax.numpy as jnp
import numpy as np

from accel_kernels.gmm import mosaic_kernel as gmm_mosaic
from accel_kernels.gmm import triton as gmm_triton

F8 = jnp.float8_e4m3fn


def add_args(p):
    p.add_argument("--out", default=None, help="JSON path")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--only", default="all", help="all | ceiling | mosaic | triton | xla")
    p.add_argument("--configs", default="bf16,bf16_kmajor,fp8",
                   help="Mosaic GPU configurations (comma separated)")


def finish(p, a):
    return a


def timed(fn, args):
    return bench_util.per_call_seconds(fn, args, warmup=3, iters=20, inner=3)


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
            entry["rel_err"] = bench_util.max_rel_err(out, ref)
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


def ceiling_rows(report):
    """The dense bf16 and FP8 8192^3 ceilings (`bench_util.dense_ceiling`), as rows."""
    for dtype, name in (("bf16", "ceiling dense bf16 8192^3"),
                        ("fp8", "ceiling dense fp8 8192^3 (B K-major)")):
        entry = {"name": name}
        try:
            c = bench_util.dense_ceiling(8192, 3, 20, seed=0, inner=3, dtype=dtype)
            entry.update(ms=c["seconds"] * 1e3, tflops=c["tflops"])
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        report["rows"].append(entry)
        report[f"dense_{dtype}"] = entry
        print(f"{name:58s} " + (f"{entry['ms']:8.3f} ms {entry['tflops']:7.1f} TF/s"
                                 if "ms" in entry else entry["error"][:80]), flush=True)


def main(a) -> dict:
    t, d, f2, e = a.tokens, a.d_model, 2 * a.d_ff, a.experts
    report = {"env": bench_util.env_info(), "shape": dict(tokens=t, d_model=d, n=f2, experts=e),
              "rows": []}
    keys = jax.random.split(jax.random.key(0), 8)
    want = set(a.configs.split(","))
    only = a.only

    def save():
        bench_util.write_json(a.out, report)

    if only in ("all", "ceiling"):
        ceiling_rows(report)
        save()

    lhs = jax.random.normal(keys[2], (t, d), jnp.float32)
    w = jax.random.normal(keys[3], (e, d, f2), jnp.float32) * d**-0.5
    flops = 2.0 * t * d * f2
    for routing in ("balanced", "zipf"):
        gs = jnp.asarray(bench_util.group_sizes(routing, t, e, align=gmm_mosaic.GROUP_ALIGNMENT))
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
                fn = jax.jit(functools.partial(gmm_mosaic.gmm, rhs_k_major=kmaj))
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
                fn = jax.jit(functools.partial(gmm_mosaic.tgmm, k_major=kmaj))
                row(report, f"mosaic tgmm {cfg} {routing}", flops, fn, (a_, b_, gs), ref, 1e-2)
                save()
        if only in ("all", "triton"):
            a16, w16 = lhs.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
            ref = ref_gmm(a16, w16, gs, False)
            fn = jax.jit(functools.partial(gmm_triton.gmm, out_dtype=jnp.bfloat16))
            row(report, f"triton gmm bf16 {routing}", flops, fn, (a16, w16, gs), ref, 1e-2)
            a8, w8 = lhs.astype(F8), jnp.swapaxes(w, 1, 2).astype(F8)
            ref = ref_gmm(a8, w8, gs, True)
            fn = jax.jit(functools.partial(gmm_triton.gmm, transpose_rhs=True,
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
    return report
