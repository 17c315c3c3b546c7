"""Benchmark a Muon train step: sharded muon_jax vs optax.contrib.muon (DP and FSDP) vs the limit.

Params: LLaMA-like matrices, per layer four d x d, two d x f and one f x d (default 8 layers,
d 4096, f 11008: ~1.6B params), in ``--param-dtype`` (bf16, or f32 for f32 master weights, the
usual mixed-precision setup), on a 1-D mesh ('data',) of all devices. Step: a synthetic loss
whose per-device gradient contributions are random (``loss = sum_leaf sum_d <W, D_d>``, D
sharded over 'data'), jax.grad, the optimizer update, apply. All: 5 Jordan NS steps.
muon_jax: library defaults (f32 momentum, bf16 Newton-Schulz whatever the param dtype).
optax.contrib.muon: its defaults (momentum in the param dtype; its Newton-Schulz runs in the
dtype of the updates, i.e. bf16 for bf16 params and f32 for f32 params - the setting of
DESIGN.md's 0.61 s baseline).

Variants (``--variants``, comma separated; default all):

- ``muon``: sharded muon_jax (library defaults) on replicated (data-parallel) params, Explicit
  mesh; it differentiates w.r.t. ``muon_jax.reduced_view(params, 'data')`` so its gradients
  reach the owners by reduce-scatter (one per stack) and updates leave by all-gather.
- ``muon_chunked``: the same with ``chunk_bytes=--chunk-bytes`` (default 128 MiB; ``--small``:
  one matrix per device per chunk): per-chunk collectives that XLA can overlap with
  Newton-Schulz of other chunks. Its HLO ring bytes must equal ``muon``'s
  (``chunking_ring_bytes_equal``).
- ``muon_overlap``: ``muon`` compiled with ``xla_comm.overlap`` options (latency-hiding
  scheduler, combine thresholds).
- ``optax``: optax.contrib.muon on the same replicated params (all-reduced gradients; every
  device orthogonalizes every matrix).
- ``optax_fsdp``: optax.contrib.muon with params (and its state) sharded over 'data' along
  d_model (``P('data', None)``; ``P(None, 'data')`` for the f x d matrix), Auto mesh, jitted
  with those shardings: XLA's partitioner shards Newton-Schulz (DESIGN.md's 0.61 s baseline).
  The loss all-gathers each matrix (FSDP forward); gradients come back reduce-scattered.
- ``muon_fsdp``: sharded muon_jax on those FSDP params (all-to-all into whole-matrix owners
  and back): the comparison on equal params.
- ``ns``: Newton-Schulz alone on one device's owner share (no communication, no momentum):
  how far NS itself is from the dense matmul rate.

Limit = NS FLOPs / (N x dense bf16 matmul rate) + time of a psum of the params' bytes (in the
param dtype), both measured here. The exposed-communication fraction comes from a jax.profiler
trace (`xla_comm.trace.exposed_comm_fraction`) of the fastest muon DP variant when the backend
records device kernels (every DP variant is traced, e.g. with and without the overlap options:
``trace_by_variant``), else None (benchmarks/schedule_report.py predicts it from the
compiled schedule).

Usage:
  python benchmarks/muon_step.py --out muon_step.json          # GPU, real size
  python benchmarks/muon_step.py --small                         # CPU, 8 simulated devices
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VARIANTS = ("muon", "optax", "optax_fsdp", "muon_fsdp", "muon_chunked", "ns", "muon_overlap")
MUON_DP = ("muon", "muon_chunked", "muon_overlap")



DESCRIPTION = """\
One Muon train step on LLaMA-like matrices (default 8 layers, d 4096, f 11008: ~1.6B params;
--small: CPU, 8 devices, 4 layers, 64/176) over a 1-D 'data' mesh of all devices: sharded
muon_jax (DP, chunked, with overlap options, FSDP) against optax.contrib.muon (DP, FSDP),
Newton-Schulz alone and the limit (NS FLOPs at the dense rate + a psum of the params). JSON
(--out): per-variant results, limit, muon_step_seconds, muon_step_speedup_vs_optax(_fsdp),
muon_step_over_limit, muon_step_exposed_comm_fraction, trace_by_variant."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CPU sizes, 8 simulated devices")
    p.add_argument("--layers", type=int, help="8; small 4")
    p.add_argument("--d-model", type=int, help="4096; small 64")
    p.add_argument("--d-ff", type=int, help="11008; small 176")
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--ns-method", choices=("auto", "standard", "gram"), default="auto",
                   help="muon_jax's Newton-Schulz form (scale_by_muon's ns_method)")
    p.add_argument("--symmetric-blocks", default="auto",
                   type=lambda v: v if v in ("auto", "tiles") else int(v),
                   help="muon_jax's ns_symmetric_blocks: row strips of Newton-Schulz's symmetric "
                        "products (1: plain matmuls; tiles: the symmetric-tile kernel; default "
                        "auto)")
    p.add_argument("--param-dtype", choices=("bf16", "f32"), default="bf16",
                   help="dtype of the params, gradients and the all-reduce (default bf16)")
    p.add_argument("--ceiling-n", type=int, help="dense matmul size (8192; small 256)")
    p.add_argument("--warmup", type=int, help="2; small 1")
    p.add_argument("--iters", type=int, help="5; small 2")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default: all, in "
                        "this order, muon_overlap not with --small; the JSON is rewritten "
                        "after each)")
    p.add_argument("--chunk-bytes", type=int, default=None,
                   help="chunk_bytes of the muon_chunked variant (128 MiB; small: 1, i.e. "
                        "one matrix per device per chunk)")
    p.add_argument("--no-optax", action="store_true", help="skip the optax variants")
    p.add_argument("--trace-dir", default=None, help="where to keep the profiler trace")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.small and args.variants == ",".join(VARIANTS):  # overlap options are GPU-only
        args.variants = ",".join(v for v in VARIANTS if v != "muon_overlap")
    big = dict(layers=8, d_model=4096, d_ff=11008, ceiling_n=8192, warmup=2, iters=5,
               chunk_bytes=128 * 2**20)
    small = dict(layers=4, d_model=64, d_ff=176, ceiling_n=256, warmup=1, iters=2,
                 chunk_bytes=1)
    for k, v in (small if args.small else big).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in chosen if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {','.join(VARIANTS)}")
    if args.no_optax:
        chosen = [v for v in chosen if not v.startswith("optax")]
    args.variants = [v for v in VARIANTS if v in chosen]  # fixed order: most important first
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.small:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    sys.path[:0] = [str(ROOT), str(HERE)]
    t_start = time.perf_counter()

    import jax
    import jax.numpy as jnp
    import optax
    from bench_util import compile_with, dense_ceiling, env_info, median_seconds, write_json
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import muon_jax
    from muon_jax import newton_schulz
    from xla_comm import hlo, overlap

    report: dict = {"benchmark": "muon_step", "env": env_info(), "config": vars(args)}
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    auto_mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    # Dense bf16 matmul rate on one device (before the mesh becomes ambient).
    ceiling = dense_ceiling(args.ceiling_n, args.warmup, max(args.iters, 3))
    rate = ceiling["tflops"] * 1e12
    jax.set_mesh(mesh)  # optax's ops on explicitly sharded arrays need the ambient mesh
    d, f, layers = args.d_model, args.d_ff, args.layers
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d),
              "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    # FSDP: shard the d_model axis of every matrix.
    fsdp_specs = {k: P("data", None) if s[0] == d else P(None, "data") for k, s in shapes.items()}
    rep = NamedSharding(mesh, P())

    names = [(f"layer_{layer}", name) for layer in range(layers) for name in shapes]

    pdtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[args.param_dtype]

    def fill(shape, salt, scale):
        """Cheap deterministic pseudo-random values (param dtype) in [-scale/2, scale/2) (a
        multiplicative hash of the index: compiles and runs in milliseconds, unlike 1.6B
        threefry draws)."""
        i = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
        h = (i * jnp.uint32(2654435761) + jnp.uint32(97 * salt + 1)) >> 8
        return (scale * (h.astype(jnp.float32) / 2**24 - 0.5)).astype(pdtype)

    def make_tree(lead, salt, scale):
        out: dict = {}
        for j, (lk, name) in enumerate(names):
            out.setdefault(lk, {})[name] = fill((*lead, *shapes[name]), salt + j, scale)
        return out

    params = jax.jit(lambda: make_tree((), args.seed, 0.07), out_shardings=rep)()
    data_sharding = NamedSharding(mesh, P("data"))
    data = jax.jit(lambda: make_tree((n,), args.seed + 1000, 3.5), out_shardings=data_sharding)()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    ns_flops = sum(layers * newton_schulz.ns_flops(*s, args.ns_steps) for s in shapes.values())
    report["model"] = {"params": int(n_params), "matrices": layers * len(shapes),
                       "ns_flops_total": float(ns_flops), "mesh": [n],
                       "param_dtype": jnp.dtype(pdtype).name}

    def loss(p, data):  # sum_leaf sum_d <W, D_d>: per-device gradient contributions D_d
        terms = jax.tree.map(
            lambda w, x: jnp.einsum("dmn,mn->d", x, w, preferred_element_type=jnp.float32,
                                    out_sharding=data_sharding).sum(), p, data)
        return sum(jax.tree.leaves(terms))

    def fsdp_loss(p, data):  # FSDP forward: all-gather each matrix, then the same loss
        full = NamedSharding(auto_mesh, P())
        terms = jax.tree.map(
            lambda w, x: jnp.einsum("dmn,mn->d", x, jax.lax.with_sharding_constraint(w, full),
                                    preferred_element_type=jnp.float32).sum(), p, data)
        return sum(jax.tree.leaves(terms))

    def make_step(tx, reduced: bool, loss_fn=loss):
        def step(p, state, data):
            view = muon_jax.reduced_view(p, "data") if reduced else p
            grads = jax.grad(loss_fn)(view, data)
            updates, state = tx.update(grads, state, p)
            return optax.apply_updates(p, updates), state
        return step

    # Limit: the dense rate above and a psum of the params' bytes, measured here.
    buf = jax.jit(lambda: jnp.zeros((n, n_params), pdtype), out_shardings=data_sharding)()
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                                 in_specs=P("data"), out_specs=P("data")))
    ar_s, _ = median_seconds(psum, (buf,), args.warmup, max(args.iters, 3))
    del buf
    limit = ns_flops / (n * rate) + ar_s
    report["limit"] = {"dense_tflops": ceiling["tflops"], "ns_seconds": ns_flops / (n * rate),
                       "allreduce_seconds": ar_s, "seconds": limit}
    write_json(args.out, report)
    print(f"[{time.perf_counter() - t_start:6.1f}s] setup: dense {ceiling['tflops']:.1f} TFLOP/s, "
          f"psum {ar_s * 1e3:.2f} ms, limit {limit:.4f} s", flush=True)

    def run_variant(name, step, args_, opts=None, jit_kw=None):
        """Lower, compile, analyze and time one step; returns its record."""
        t0 = time.perf_counter()
        lowered = jax.jit(step, **(jit_kw or {})).lower(*args_)
        compiled, dropped = compile_with(lowered, opts)
        compile_s = time.perf_counter() - t0
        colls = hlo.analyze_collectives(compiled)
        sec, _ = median_seconds(compiled, args_, args.warmup, args.iters)
        rec = {"step_seconds": sec, "compile_seconds": compile_s, "counts": colls.counts(),
               "ring_bytes_per_device": colls.ring_bytes,
               "hlo_bare_window_fraction": colls.bare_fraction,
               "collectives_in_while_loops": len(colls.in_while_loop)}
        if opts is not None:
            rec.update(options=opts, options_dropped=dropped)
        results[name] = {"compiled": compiled, "report": colls, "seconds": sec,
                         "args": args_}
        report[f"muon_jax_{name[5:] or 'default'}" if name.startswith("muon") else name] = rec
        report["variants_done"] = list(results)
        report["elapsed_seconds"] = time.perf_counter() - t_start
        write_json(args.out, report)
        print(f"[{time.perf_counter() - t_start:6.1f}s] {name}: {sec:.4f} s/step "
              f"(compile {compile_s:.1f} s)", flush=True)
        return rec

    results: dict = {}
    fsdp_params = fsdp_data = None

    def to_fsdp():
        nonlocal fsdp_params, fsdp_data
        if fsdp_params is None:
            shard = {k: NamedSharding(auto_mesh, s) for k, s in fsdp_specs.items()}
            fsdp_params = jax.device_put(
                params, {lk: shard for lk in params})
            fsdp_data = jax.device_put(data, NamedSharding(auto_mesh, P("data")))
        return fsdp_params, fsdp_data

    # muon_jax resolves 'auto' per bank (by its shape and the GPU); recorded as asked.
    blocks = args.symmetric_blocks
    report["ns_symmetric_blocks"] = blocks
    ns = muon_jax.NewtonSchulzOptions(method=args.ns_method, symmetric_blocks=blocks)
    for name in args.variants:
        if name in MUON_DP:
            chunk_bytes = args.chunk_bytes if name == "muon_chunked" else None
            tx = muon_jax.scale_by_muon(
                mu_dtype=jnp.float32, ns_steps=args.ns_steps, newton_schulz=ns,
                sharding=muon_jax.ShardingOptions(mesh, chunk_bytes=chunk_bytes))
            state = tx.init(params)
            report[f"{name}_chunks"] = [list(s.chunks) for s in state.plan.stacks]
            opts = overlap.overlap_compiler_options() if name == "muon_overlap" else None
            run_variant(name, make_step(tx, reduced=True), (params, state, data), opts)
        elif name == "optax":
            base = optax.contrib.muon(0.02, ns_steps=args.ns_steps)
            base_state = jax.jit(base.init)(params)
            run_variant("optax_contrib_muon", make_step(base, reduced=False),
                        (params, base_state, data))
        elif name in ("optax_fsdp", "muon_fsdp"):
            fp, fd = to_fsdp()
            with jax.set_mesh(auto_mesh):
                if name == "optax_fsdp":
                    tx = optax.contrib.muon(0.02, ns_steps=args.ns_steps)
                    state = jax.jit(tx.init)(fp)
                    label = "optax_contrib_muon_fsdp"
                else:
                    tx = muon_jax.scale_by_muon(
                        mu_dtype=jnp.float32, ns_steps=args.ns_steps, newton_schulz=ns,
                        sharding=muon_jax.ShardingOptions(auto_mesh))
                    state = tx.init(fp)
                    label = "muon_fsdp"
                shardings = shardings_of((fp, state))
                run_variant(label, make_step(tx, reduced=False, loss_fn=fsdp_loss),
                            (fp, state, fd),
                            jit_kw={"in_shardings": (*shardings, shardings_of(fd)),
                                    "out_shardings": shardings})
        elif name == "ns":
            # Each device's owner share, orthogonalized as in the sharded step (f32 in, bf16
            # out), without momentum or communication.
            plan = muon_jax.scale_by_muon(
                sharding=muon_jax.ShardingOptions(mesh)).init(params).plan
            owner = NamedSharding(mesh, P("data"))
            xs = jax.jit(lambda stacks=plan.stacks: [
                jnp.ones((n * s.k_owner, s.m, s.n), jnp.float32) for s in stacks],
                out_shardings=owner)()
            ns_only = jax.shard_map(
                lambda xs: [muon_jax.orthogonalize(x, ns_steps=args.ns_steps,
                                                   method=args.ns_method,
                                                   symmetric_blocks=blocks)
                            .astype(jnp.bfloat16) for x in xs],
                mesh=mesh, in_specs=P("data"), out_specs=P("data"))
            t0 = time.perf_counter()
            compiled = jax.jit(ns_only).lower(xs).compile()
            sec, _ = median_seconds(compiled, (xs,), args.warmup, args.iters)
            del xs
            def stack_flops(s):
                sb = newton_schulz.resolve_symmetric_blocks(blocks, shape=(s.k_owner, s.m, s.n))
                method = newton_schulz.resolve_ns_method(args.ns_method, s.m, s.n, jnp.bfloat16,
                                                         symmetric_blocks=sb)
                return s.k_owner * newton_schulz.ns_flops(s.m, s.n, args.ns_steps,
                                                          symmetric_blocks=sb, method=method)

            flops = sum(stack_flops(s) for s in plan.stacks)
            report["ns_owner_share"] = {
                "seconds": sec, "tflops": flops / sec / 1e12,
                "fraction_of_dense": flops / sec / rate,
                "shapes": [[s.k_owner, s.m, s.n] for s in plan.stacks],
                "compile_and_run_seconds": time.perf_counter() - t0}
            write_json(args.out, report)
            print(f"[{time.perf_counter() - t_start:6.1f}s] ns: {sec:.4f} s "
                  f"({flops / sec / 1e12:.1f} TFLOP/s)", flush=True)

    muon_dp = {k: v for k, v in results.items() if k in MUON_DP}
    best = min(muon_dp, key=lambda k: muon_dp[k]["seconds"]) if muon_dp else None
    sharded_s = muon_dp[best]["seconds"] if best else None
    if "muon" in results and "muon_chunked" in results:
        a, b = results["muon_chunked"]["report"], results["muon"]["report"]
        report["chunking_ring_bytes_equal"] = a.ring_bytes == b.ring_bytes
        report["chunking_ring_bytes"] = {"chunked": a.ring_bytes, "unchunked": b.ring_bytes}

    # Exposed communication: a profiler trace of every data-parallel muon_jax variant (so the
    # default and the overlap-options builds are compared in one run); the headline is the
    # fastest variant's (None where the backend records no device kernels).
    exposed, source = None, None
    if best:
        report["trace_by_variant"] = {}
        root = args.trace_dir or tempfile.mkdtemp(prefix="muon_step_trace_")
        for name in muon_dp:
            try:
                from xla_comm.trace import exposed_comm_fraction
                trace_dir = os.path.join(root, name)
                compiled, cargs = results[name]["compiled"], results[name]["args"]
                jax.block_until_ready(compiled(*cargs))
                with jax.profiler.trace(trace_dir):
                    for _ in range(3):
                        jax.block_until_ready(compiled(*cargs))
                res = {k: v for k, v in exposed_comm_fraction(trace_dir).items()
                       if k != "devices"}
            except Exception as err:  # profiling is best effort
                res, trace_dir = {"error": repr(err)}, None
            report["trace_by_variant"][name] = res
            if name == best:
                report["trace"] = res
                if res.get("exposed_fraction") is not None:
                    exposed = res["exposed_fraction"]
                    source = f"jax.profiler trace ({trace_dir})"
        if exposed is None:
            source = ("no device trace; benchmarks/schedule_report.py predicts it from the "
                      "compiled schedule (xla_comm.schedule)")

    def sec_of(name):
        return results[name]["seconds"] if name in results else None

    optax_s, optax_fsdp_s = sec_of("optax_contrib_muon"), sec_of("optax_contrib_muon_fsdp")
    fsdp_s = sec_of("muon_fsdp")

    def ratio(a, b):
        return a / b if a and b else None

    report.update({
        "muon_step_seconds": sharded_s,
        "muon_step_variant": best,
        "muon_step_speedup_vs_optax": ratio(optax_s, sharded_s),
        "muon_step_speedup_vs_optax_fsdp": ratio(optax_fsdp_s, sharded_s),
        "optax_step_seconds": optax_s,
        "optax_fsdp_step_seconds": optax_fsdp_s,
        "muon_step_fsdp_seconds": fsdp_s,
        "muon_step_fsdp_speedup_vs_optax_fsdp": ratio(optax_fsdp_s, fsdp_s),
        "muon_step_over_limit": ratio(sharded_s, limit),
        "muon_step_exposed_comm_fraction": exposed,
        "muon_step_exposed_comm_source": source,
        "elapsed_seconds": time.perf_counter() - t_start,
    })
    write_json(args.out, report)

    rows = [("variant", "step s", "vs limit", "ring MB/dev", "collectives", "bare windows")]
    labels = {"muon": "muon_jax DP (default)", "muon_chunked": "muon_jax DP (chunked)",
              "muon_overlap": "muon_jax DP (overlap opts)",
              "optax_contrib_muon": "optax.contrib.muon DP (replicated)",
              "optax_contrib_muon_fsdp": "optax.contrib.muon FSDP (auto-sharded)",
              "muon_fsdp": "muon_jax FSDP"}
    for name, v in results.items():
        r = v["report"]
        rows.append((labels.get(name, name), f"{v['seconds']:.4f}", f"{v['seconds'] / limit:.2f}x",
                     f"{r.ring_bytes / 1e6:.1f}", str(r.counts()), f"{r.bare_fraction:.0%}"))
    if "ns_owner_share" in report:
        ns = report["ns_owner_share"]
        rows.append(("NS only, one owner share", f"{ns['seconds']:.4f}", "-", "-", "-",
                     f"{ns['fraction_of_dense']:.0%} of dense"))
    rows.append(("limit (NS / N rate + psum)", f"{limit:.4f}", "1.00x", "-", "-", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"{n_params / 1e6:,.1f}M params, {layers * len(shapes)} matrices, {n} devices, "
          f"dense {ceiling['tflops']:.1f} TFLOP/s, psum {ar_s * 1e3:.2f} ms")
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    if best:
        print(results[best]["report"].table())
    if "chunking_ring_bytes_equal" in report:
        print(f"muon_chunked: chunks per stack {report.get('muon_chunked_chunks')}; ring bytes "
              f"chunked == unchunked: {report['chunking_ring_bytes_equal']}")

    def fmt(x, spec=".2f", suffix="x"):
        return f"{x:{spec}}{suffix}" if x is not None else "skipped"

    print(f"speedup vs optax DP: {fmt(report['muon_step_speedup_vs_optax'])} | vs optax FSDP: "
          f"{fmt(report['muon_step_speedup_vs_optax_fsdp'])} | FSDP vs FSDP: "
          f"{fmt(report['muon_step_fsdp_speedup_vs_optax_fsdp'])} | over limit: "
          f"{fmt(report['muon_step_over_limit'])} | exposed comm: "
          f"{fmt(exposed, '.0%', '')} ({(source or '-').split(':')[0]}) | "
          f"total {report['elapsed_seconds']:.0f} s")
    return report


def shardings_of(tree):
    """The shardings of a tree of arrays (for jit's in_shardings / out_shardings)."""
    import jax

    return jax.tree.map(lambda x: x.sharding, tree)


if __name__ == "__main__":
    main()
