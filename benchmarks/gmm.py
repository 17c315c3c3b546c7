"""How fast is each grouped GEMM the experts can run?

The ``accel_kernels.gmm`` registry's grouped GEMMs ('mosaic' = Pallas Mosaic GPU for Hopper,
'triton' = Pallas Triton, 'ragged_dot' = XLA's, 'einsum' = batched einsums on the
capacity-padded ``[E, C, d]`` layout) at the experts' gate_up shape (tokens x d_model -> 2 d_ff
in E groups, balanced and Zipf): forward (``fwd``) and weight gradient (``wgrad``, ``x_e^T
dz_e``), bf16 and FP8 (e4m3, K-major copies, scales in the epilogue). Each is checked against
an f32 reference (``ok``: rel_err <= 1e-2), then timed against this process's dense bf16 and
FP8 8192^3 ceilings; useful FLOPs count real rows only (padding is waste).

    python3 benchmarks/gmm.py --out gmm.json          # one Hopper GPU, about 2 minutes
    python3 benchmarks/gmm.py --small                 # CPU: emulated / interpreted kernels

JSON: ``gmm`` rows (kernel = BACKEND_DTYPE, op, routing, ms, tflops, over_dense, rel_err, ok),
the ceilings, ``fp8_gmm_over_bf16_rate`` (Mosaic FP8 / Triton bf16 forward rate, balanced) and
``..._vs_mosaic_bf16``.
"""

from __future__ import annotations

import traceback

import jax
import jax.numpy as jnp
from _lib import bench

from accel_kernels.gmm import api as gmm_api

MEASURES = ("moe/", "accel_kernels/")
BACKENDS = ("mosaic", "triton", "ragged_dot", "einsum")
F8 = jnp.float8_e4m3fn


def parse_args(argv=None):
    p = bench.parser(__doc__, 2)
    p.add_argument("--tokens", type=int, help="rows (32768; small 1024)")
    p.add_argument("--d-model", type=int, help="K (4096; small 256)")
    p.add_argument("--d-ff", type=int, help="N = 2 d_ff (2048; small 128)")
    p.add_argument("--experts", type=int, help="groups (8; small 4)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--ops", default="fwd,wgrad")
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--routings", default="balanced,zipf")
    p.add_argument("--ceiling-n", type=int, help="dense ceiling size (8192; small 256)")
    return bench.parse(p, argv, small=dict(tokens=1024, d_model=256, d_ff=128, experts=4,
                                           ceiling_n=256),
                       full=dict(tokens=32768, d_model=4096, d_ff=2048, experts=8, ceiling_n=8192))


def operands(a, routing: str, backend: str):
    """The GEMM's operands in ``backend``'s layout: ``(x, dz, gs, real_rows)``; ragged rows in
    groups of multiples of 128 (the Mosaic kernels' tile), or padded ``[E, C, d]``."""
    t, e = a.tokens, a.experts
    sizes = bench.group_sizes(routing, t, e, align=gmm_api.GROUP_ALIGNMENT)
    ks = jax.random.split(jax.random.key(a.seed), 2)
    x = bench.normal(ks[0], (t, a.d_model), 1.0, jnp.float32)
    dz = bench.normal(ks[1], (t, 2 * a.d_ff), 1.0, jnp.float32)
    if backend != "einsum":
        return x, dz, jnp.asarray(sizes), sizes
    return bench.padded(x, sizes), bench.padded(dz, sizes), jnp.asarray(sizes), sizes


def case(impl, op: str, dtype: str, x, dz, w, gs):
    """``(fn, args, reference)`` of one GEMM: ``fwd`` ``x @ w[e]``, ``wgrad`` ``x_e^T dz_e``;
    FP8 from e4m3 copies (the weight and, for wgrad, both operands K-major) with unit scales,
    the reference the f32 product of the same (rounded) values."""
    padded = x.ndim == 3
    if dtype == "bf16":
        xs, dzs, ws = (v.astype(jnp.bfloat16) for v in (x, dz, w))
        if op == "fwd":
            return (lambda x, w, gs: impl.fwd(x, w, gs, jnp.bfloat16)), (xs, ws, gs), \
                _ref_fwd(xs, ws, gs)
        return (lambda x, g, gs: impl.wgrad(x, g, gs, jnp.float32)), (xs, dzs, gs), \
            _ref_wgrad(xs, dzs, gs)
    x8, dz8, w8 = (v.astype(F8) for v in (x, dz, w))
    if op == "fwd":
        wt = jnp.swapaxes(w8, 1, 2)  # [E, N, K]: K-major
        s_a = jnp.ones(x.shape[:-1], jnp.float32)
        s_b = jnp.ones(wt.shape[:2], jnp.float32)
        return (lambda x, b, gs: impl.mm8(x, b, gs, jnp.bfloat16, s_a, s_b)), (x8, wt, gs), \
            _ref_fwd(x8, w8, gs)
    xt, dzt = (jnp.swapaxes(v, -1, -2) for v in (x8, dz8))  # [.., K, rows], [.., N, rows]
    s_a, s_b = jnp.ones(x.shape[-1:], jnp.float32), jnp.ones(dz.shape[-1:], jnp.float32)
    if padded:
        s_a, s_b = (jnp.broadcast_to(s, (x.shape[0], s.size)) for s in (s_a, s_b))
    return (lambda at, bt, gs: impl.tmm8(at, bt, gs, jnp.float32, s_a, s_b)), (xt, dzt, gs), \
        _ref_wgrad(x8, dz8, gs)


def _f32(v):
    return v.astype(jnp.float32)


def _ref_fwd(x, w, gs):
    if x.ndim == 3:
        return jnp.einsum("eck,ekn->ecn", _f32(x), _f32(w), precision="highest")
    return jax.lax.ragged_dot(_f32(x), _f32(w), gs, precision=jax.lax.Precision.HIGHEST)


def _ref_wgrad(x, g, gs):
    if x.ndim == 3:
        return jnp.einsum("eck,ecn->ekn", _f32(x), _f32(g), precision="highest")
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(_f32(x), _f32(g), gs, dn, precision=jax.lax.Precision.HIGHEST)


def row(report, a, backend, op, dtype, routing, w) -> dict:
    """Check, then time, one GEMM; a failure is recorded and the run goes on."""
    entry = {"kernel": f"{backend}_{dtype}", "op": op, "routing": routing}
    try:
        x, dz, gs, sizes = operands(a, routing, backend)
        gemms = gmm_api.gemms(*bench.GEMM_LABELS.get(backend, (backend, 2)))
        fn, args, ref = case(gemms, op, dtype, x, dz, w, gs)
        fn = jax.jit(fn)
        out = jax.block_until_ready(fn(*args))
        entry["rel_err"] = bench.max_rel_err(out[..., :ref.shape[-1]], ref)
        entry["ok"] = entry["rel_err"] <= 1e-2
        sec = bench.median_seconds(fn, args, a.warmup, a.iters, 1 if a.small else 3)
        tflops = 2.0 * int(sizes.sum()) * a.d_model * 2 * a.d_ff / sec / 1e12
        entry.update(ms=sec * 1e3, tflops=tflops,
                     over_dense=tflops / report[f"dense_{dtype}_tflops"])
    except Exception as err:  # noqa: BLE001  (one kernel failing must not lose the others)
        traceback.print_exc(limit=3)
        entry["error"] = f"{type(err).__name__}: {str(err)[:600]}"
    report["gmm"].append(entry)
    bench.write_json(a.out, report)
    return entry


def main(argv=None) -> dict:
    a = parse_args(argv)
    report = {"benchmark": "gmm", "env": bench.env(), "settings": bench.settings(a), "gmm": []}
    bench.ceilings(report, a.ceiling_n, a.small)
    w = bench.normal(jax.random.key(a.seed + 1), (a.experts, a.d_model, 2 * a.d_ff),
                     a.d_model**-0.5, jnp.float32)
    for routing in a.routings.split(","):
        for backend in a.backends.split(","):
            if backend == "triton" and not bench.on_gpu() and not a.small:
                continue  # interpreted off GPUs: a plumbing check (--small), not a timing
            for op in a.ops.split(","):
                for dtype in a.dtypes.split(","):
                    row(report, a, backend, op, dtype, routing, w)
    rate = {r["kernel"]: r["tflops"] for r in report["gmm"]
            if r["op"] == "fwd" and r["routing"] == "balanced" and "tflops" in r}
    for key, base in (("fp8_gmm_over_bf16_rate", "triton_bf16"),
                      ("fp8_gmm_over_bf16_rate_vs_mosaic_bf16", "mosaic_bf16")):
        if "mosaic_fp8" in rate and base in rate:
            report[key] = rate["mosaic_fp8"] / rate[base]
    bench.print_table(report["gmm"], ["kernel", "op", "routing", "ms", "tflops", "over_dense",
                                      "rel_err", "ok", "error"])
    bench.write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
