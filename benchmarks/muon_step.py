"""Benchmark a data-parallel Muon train step: sharded muon_jax vs optax.contrib.muon vs the limit.

Params: LLaMA-like matrices, per layer four d x d, two d x f and one f x d (default 8 layers,
d 4096, f 11008: ~1.6B params), bf16, replicated over a 1-D mesh ('data',) of all devices.
Step: a synthetic data-parallel loss whose per-device gradient contributions are random
(``loss = sum_leaf sum_d <W, D_d>``, D sharded over 'data'), jax.grad, the optimizer update,
apply. muon_jax differentiates with respect to ``muon_jax.reduced_view(params, 'data')`` so its
gradients reach the owners by reduce-scatter; optax.contrib.muon gets all-reduced gradients
and runs Newton-Schulz for every matrix on every device. Both: 5 Jordan NS steps in bf16
(muon_jax: f32 momentum, bf16 NS operands; optax: bf16 momentum, so its NS runs in bf16).

Limit = NS FLOPs / (N x dense bf16 matmul rate) + time of a psum of the params' bytes, both
measured here. The sharded step is compiled twice, with ``muon_jax.overlap`` options
(latency-hiding scheduler, combine thresholds) and without; the table shows the HLO collective
report of each and both step times. The exposed-communication fraction comes from a
jax.profiler trace (benchmarks/trace_overlap.py) when the backend records device kernels, else
the HLO estimate (ring bytes of collectives with no compute scheduled between start and done).

Usage:
  python benchmarks/muon_step.py --out muon_step.json          # GPU, real size
  python benchmarks/muon_step.py --small                         # CPU, 8 simulated devices
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="CPU sizes, 8 simulated devices")
    p.add_argument("--layers", type=int, help="8; small 8")
    p.add_argument("--d-model", type=int, help="4096; small 64")
    p.add_argument("--d-ff", type=int, help="11008; small 176")
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--ceiling-n", type=int, help="dense matmul size (8192; small 256)")
    p.add_argument("--warmup", type=int, help="2; small 1")
    p.add_argument("--iters", type=int, help="5; small 2")
    p.add_argument("--no-optax", action="store_true", help="skip the optax.contrib.muon baseline")
    p.add_argument("--trace-dir", default=None, help="where to keep the profiler trace")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    big = dict(layers=8, d_model=4096, d_ff=11008, ceiling_n=8192, warmup=2, iters=5)
    small = dict(layers=8, d_model=64, d_ff=176, ceiling_n=256, warmup=1, iters=2)
    for k, v in (small if args.small else big).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.small:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    sys.path[:0] = [str(ROOT), str(HERE)]

    import jax
    import jax.numpy as jnp
    import optax
    from bench_util import dense_ceiling, env_info, median_seconds, write_json
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import muon_jax
    from muon_jax import hlo, overlap

    report: dict = {"benchmark": "muon_step", "env": env_info(), "config": vars(args)}
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    # Dense bf16 matmul rate on one device (before the mesh becomes ambient).
    ceiling = dense_ceiling(args.ceiling_n, args.warmup, max(args.iters, 3))
    rate = ceiling["tflops"] * 1e12
    jax.set_mesh(mesh)  # optax's ops on explicitly sharded arrays need the ambient mesh
    d, f, layers = args.d_model, args.d_ff, args.layers
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d),
              "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    rep = NamedSharding(mesh, P())
    key = jax.random.key(args.seed)

    def init_params(key):
        out = {}
        for layer in range(layers):
            for name, shape in shapes.items():
                key, sub = jax.random.split(key)
                out.setdefault(f"layer_{layer}", {})[name] = (
                    0.02 * jax.random.normal(sub, shape, jnp.float32)).astype(jnp.bfloat16)
        return out

    params = jax.jit(init_params, out_shardings=rep)(key)
    data_sharding = NamedSharding(mesh, P("data"))
    data = jax.jit(
        lambda p, k: jax.tree.map(
            lambda w: jax.random.normal(k, (n, *w.shape), jnp.bfloat16), p),
        out_shardings=data_sharding)(params, jax.random.key(args.seed + 1))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    ns_flops = sum(layers * muon_jax.ns_flops(*s, args.ns_steps) for s in shapes.values())
    report["model"] = {"params": int(n_params), "matrices": layers * len(shapes),
                       "ns_flops_total": float(ns_flops), "mesh": [n]}

    def loss(p, data):  # sum_leaf sum_d <W, D_d>: per-device gradient contributions D_d
        terms = jax.tree.map(
            lambda w, x: jnp.einsum("dmn,mn->d", x, w, preferred_element_type=jnp.float32,
                                    out_sharding=data_sharding).sum(), p, data)
        return sum(jax.tree.leaves(terms))

    def make_step(tx, reduced: bool):
        def step(p, state, data):
            view = muon_jax.reduced_view(p, "data") if reduced else p
            grads = jax.grad(loss)(view, data)
            updates, state = tx.update(grads, state, p)
            return optax.apply_updates(p, updates), state
        return jax.jit(step)

    # Limit: the dense rate above and a psum of the params' bytes, measured here.
    buf = jax.device_put(jnp.zeros((n, n_params), jnp.bfloat16), data_sharding)
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                                 in_specs=P("data"), out_specs=P("data")))
    ar_s, _ = median_seconds(psum, (buf,), args.warmup, max(args.iters, 3))
    del buf
    limit = ns_flops / (n * rate) + ar_s
    report["limit"] = {"dense_tflops": ceiling["tflops"], "ns_seconds": ns_flops / (n * rate),
                       "allreduce_seconds": ar_s, "seconds": limit}
    write_json(args.out, report)

    # Sharded muon_jax: compiled with and without the overlap options.
    tx = muon_jax.scale_by_muon(mu_dtype=jnp.float32, ns_steps=args.ns_steps, mesh=mesh)
    state = tx.init(params)
    step = make_step(tx, reduced=True)
    lowered = step.lower(params, state, data)
    variants = {}
    options = {
        "default": None,
        "overlap": overlap.overlap_compiler_options(),
    }
    def compile_with(opts):
        """Compile, dropping options this XLA does not know (reported in the JSON)."""
        opts, dropped = dict(opts or {}), []
        while True:
            try:
                return (lowered.compile(compiler_options=opts) if opts else lowered.compile(),
                        dropped)
            except Exception as err:  # XLA names the unknown option in its message
                bad = [k for k in opts if k in str(err)]
                if not bad:
                    raise
                dropped.append(bad[0])
                opts.pop(bad[0])

    for name, opts in options.items():
        t0 = time.perf_counter()
        compiled, dropped = compile_with(opts)
        compile_s = time.perf_counter() - t0
        colls = hlo.analyze_collectives(compiled)
        sec, _ = median_seconds(compiled, (params, state, data), args.warmup, args.iters)
        variants[name] = {"compiled": compiled, "report": colls, "seconds": sec}
        report[f"muon_jax_{name}"] = {
            "step_seconds": sec, "compile_seconds": compile_s, "counts": colls.counts(),
            "options": opts, "options_dropped": dropped,
            "ring_bytes_per_device": colls.ring_bytes,
            "hlo_exposed_fraction": colls.exposed_fraction,
            "collectives_in_while_loops": len(colls.in_while_loop)}
        write_json(args.out, report)
    best = min(variants, key=lambda k: variants[k]["seconds"])
    sharded_s = variants[best]["seconds"]

    # Exposed communication: profiler trace (GPU) or the HLO estimate.
    exposed, source = None, None
    try:
        from trace_overlap import exposed_comm_fraction
        trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="muon_step_trace_")
        compiled = variants[best]["compiled"]
        jax.block_until_ready(compiled(params, state, data))
        with jax.profiler.trace(trace_dir):
            for _ in range(3):
                jax.block_until_ready(compiled(params, state, data))
        res = exposed_comm_fraction(trace_dir)
        report["trace"] = {k: v for k, v in res.items() if k != "devices"}
        if res.get("exposed_fraction") is not None:
            exposed, source = res["exposed_fraction"], f"jax.profiler trace ({trace_dir})"
    except Exception as err:  # profiling is best effort
        report["trace"] = {"error": repr(err)}
    if exposed is None:
        exposed = variants[best]["report"].exposed_fraction
        source = ("HLO estimate: ring bytes of collectives with no compute scheduled between "
                  "start and done / all ring bytes (not a measurement)")

    # Baseline: optax.contrib.muon on the same mesh and params.
    optax_s = None
    if not args.no_optax:
        base = optax.contrib.muon(0.02, ns_steps=args.ns_steps, mu_dtype=jnp.bfloat16)
        base_step = make_step(base, reduced=False)
        base_state = jax.jit(base.init)(params)
        optax_s, _ = median_seconds(base_step, (params, base_state, data), args.warmup,
                                    args.iters)
        report["optax_contrib_muon"] = {"step_seconds": optax_s}

    report.update({
        "muon_step_seconds": sharded_s,
        "muon_step_variant": best,
        "muon_step_speedup_vs_optax": (optax_s / sharded_s) if optax_s else None,
        "muon_step_over_limit": sharded_s / limit,
        "muon_step_exposed_comm_fraction": exposed,
        "muon_step_exposed_comm_source": source,
    })
    write_json(args.out, report)

    rows = [("variant", "step s", "ring MB/dev", "collectives", "HLO exposed")]
    for name, v in variants.items():
        r = v["report"]
        rows.append((f"muon_jax ({name})", f"{v['seconds']:.4f}", f"{r.ring_bytes / 1e6:.1f}",
                     str(r.counts()), f"{r.exposed_fraction:.0%}"))
    if optax_s:
        rows.append(("optax.contrib.muon", f"{optax_s:.4f}", "-", "-", "-"))
    rows.append(("limit (NS / N rate + psum)", f"{limit:.4f}", "-", "-", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"{n_params / 1e6:,.1f}M params, {layers * len(shapes)} matrices, {n} devices, "
          f"dense {ceiling['tflops']:.1f} TFLOP/s, psum {ar_s * 1e3:.2f} ms")
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    print(variants[best]["report"].table())
    speed = report["muon_step_speedup_vs_optax"]
    print(f"speedup vs optax: {speed:.2f}x" if speed else "speedup vs optax: skipped",
          f"| over limit: {report['muon_step_over_limit']:.2f}x | exposed comm: {exposed:.0%} "
          f"({source.split(':')[0]})")
    return report


if __name__ == "__main__":
    main()
