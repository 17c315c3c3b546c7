"""How long does a Muon step take, sharded, against optax.contrib.muon and against the limit?

LLaMA-like params (per layer four d x d, two d x f and one f x d; 8 layers, d 4096, f 11008:
1.62B) in each of ``--param-dtypes`` (bf16, or f32 master weights) on a 1-D 'data' mesh. A
step: a synthetic loss with random per-device gradient contributions (``sum_leaf sum_d <W,
D_d>``), ``jax.grad``, the update, apply; 5 Jordan Newton-Schulz steps everywhere. Variants:
``muon`` (``muon_jax.scale_by_muon`` sharded, library defaults, on replicated params; gradients
through ``muon_jax.reduced_view``: reduce-scattered to their owners, updates all-gathered),
``muon_chunked`` (``chunk_bytes``: the same ring bytes in chunks XLA can overlap),
``muon_overlap`` (``xla_comm.overlap``'s compile options), ``optax`` (``optax.contrib.muon``
on replicated params: every device orthogonalizes every matrix), ``optax_fsdp`` / ``muon_fsdp``
(params sharded over 'data' along d_model; XLA's partitioner shards optax's Newton-Schulz) and
``ns`` (Newton-Schulz alone on one device's share, no communication).

Limit = Newton-Schulz FLOPs / (devices x this process's dense bf16 rate) + one all-reduce of
the params, measured here. Every muon DP variant is traced (``xla_comm.trace``) for its
exposed collective time where the backend records device kernels. ``--symmetric-blocks 1,auto``
compares Newton-Schulz's symmetric products computed in full against the Hopper default.

    python3 benchmarks/muon_step.py --param-dtypes f32,bf16 --out muon_step.json  # 2+ GPUs
    python3 benchmarks/muon_step.py --param-dtypes f32 --variants muon,ns \\
        --symmetric-blocks 1,auto --out muon_step_1gpu.json                     # one GPU
    python3 benchmarks/muon_step.py --small                      # CPU, 8 simulated devices

JSON: ``{dtype}_params`` per param dtype (each variant under its ``LABELS`` name, ``limit``,
``ns_owner_share`` and the headline keys ``muon_step_*``), the first dtype's headline keys at
the top level and the others' as ``{dtype}_params_muon_step_*``; with several
``--symmetric-blocks``, ``update_s``, ``ns_s``, ``limit_s`` and ``symmetric_over_plain_update``.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import optax
from _lib import bench
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_jax
from muon_jax import newton_schulz
from xla_comm import hlo, overlap

MEASURES = ("muon_jax/", "moe/kernels/", "accel_kernels/")
VARIANTS = ("muon", "optax", "optax_fsdp", "muon_fsdp", "muon_chunked", "ns", "muon_overlap")
MUON_DP = ("muon", "muon_chunked", "muon_overlap")
LABELS = {"muon": "muon_jax_default", "muon_chunked": "muon_jax_chunked",
          "muon_overlap": "muon_jax_overlap", "optax": "optax_contrib_muon",
          "optax_fsdp": "optax_contrib_muon_fsdp", "muon_fsdp": "muon_jax_fsdp"}


def parse_args(argv=None):
    p = bench.parser(__doc__)
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--ns-method", choices=("auto", "standard", "gram"), default="auto")
    p.add_argument("--symmetric-blocks", default="auto",
                   help="ns_symmetric_blocks values (1: plain matmuls; N: row strips; tiles; "
                        "auto), comma separated")
    p.add_argument("--param-dtypes", default="bf16", help="bf16 and/or f32, comma separated")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--chunk-bytes", type=int, help="muon_chunked's chunk_bytes (128 MiB; small 1)")
    p.add_argument("--trace-dir", help="where to keep the profiler traces")
    a = bench.parse(p, argv, cpu_devices=8,
                    small=dict(layers=4, d_model=64, d_ff=176, ceiling_n=256, chunk_bytes=1),
                    full=dict(layers=8, d_model=4096, d_ff=11008, ceiling_n=8192,
                              chunk_bytes=128 * 2**20, warmup=2, iters=5))
    chosen = a.variants.split(",")
    if bad := set(chosen) - set(VARIANTS):
        p.error(f"unknown variants {sorted(bad)}; choose from {','.join(VARIANTS)}")
    a.variants = [v for v in VARIANTS if v in chosen and not (a.small and v == "muon_overlap")]
    a.symmetric_blocks = [v if v in ("auto", "tiles") else int(v)
                          for v in a.symmetric_blocks.split(",")]
    return a


def setup(a, pdtype, rate: float) -> SimpleNamespace:
    """The meshes, params, per-device gradient data, the loss and the limit."""
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    auto = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    d, f = a.d_model, a.d_ff
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_gate": (d, f),
              "w_up": (d, f), "w_down": (f, d)}

    def fill(shape, salt, scale):  # a multiplicative hash: 1.6B values in milliseconds
        i = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
        h = (i * jnp.uint32(2654435761) + jnp.uint32(97 * salt + 1)) >> 8
        return (scale * (h.astype(jnp.float32) / 2**24 - 0.5)).astype(pdtype)

    def tree(lead, salt, scale):
        return {f"layer_{i}": {k: fill((*lead, *s), salt + 7 * i + j, scale)
                               for j, (k, s) in enumerate(shapes.items())}
                for i in range(a.layers)}

    dsh = NamedSharding(mesh, P("data"))
    params = jax.jit(lambda: tree((), a.seed, 0.07), out_shardings=NamedSharding(mesh, P()))()
    data = jax.jit(lambda: tree((n,), a.seed + 1000, 3.5), out_shardings=dsh)()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    ns_flops = sum(a.layers * newton_schulz.ns_flops(*s, a.ns_steps) for s in shapes.values())
    buf = jax.jit(lambda: jnp.zeros((n, n_params), pdtype), out_shardings=dsh)()
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
                                 in_specs=P("data"), out_specs=P("data")))
    ar = bench.median_seconds(psum, (buf,), a.warmup, max(a.iters, 3))
    del buf
    limit = {"dense_tflops": rate / 1e12, "ns_seconds": ns_flops / (n * rate),
             "allreduce_seconds": ar, "seconds": ns_flops / (n * rate) + ar}
    return SimpleNamespace(n=n, mesh=mesh, auto=auto, shapes=shapes, params=params, data=data,
                           dsh=dsh, limit=limit, model={
                               "params": int(n_params), "matrices": a.layers * len(shapes),
                               "ns_flops_total": float(ns_flops), "mesh": [n],
                               "param_dtype": jnp.dtype(pdtype).name})


def loss_fn(ctx, fsdp: bool):
    def loss(p, data):  # sum_leaf sum_d <W, D_d>; FSDP: all-gather each matrix first
        full = NamedSharding(ctx.auto, P())
        terms = jax.tree.map(lambda w, x: jnp.einsum(
            "dmn,mn->d", x, jax.lax.with_sharding_constraint(w, full) if fsdp else w,
            preferred_element_type=jnp.float32,
            **({} if fsdp else {"out_sharding": ctx.dsh})).sum(), p, data)
        return sum(jax.tree.leaves(terms))
    return loss


def step_fn(tx, reduced: bool, loss):
    def step(p, state, data):
        grads = jax.grad(loss)(muon_jax.reduced_view(p, "data") if reduced else p, data)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state
    return step


def run(name, step, args, a, opts=None, jit_kw=None) -> dict:
    """Compile, read the collectives of and time one step."""
    t0 = time.perf_counter()
    compiled, dropped = bench.compile_with(jax.jit(step, **(jit_kw or {})).lower(*args), opts)
    colls = hlo.analyze_collectives(compiled)
    sec = bench.median_seconds(compiled, args, a.warmup, a.iters)
    print(f"  {name}: {sec:.4f} s/step (compile {time.perf_counter() - t0:.1f} s)", flush=True)
    rec = {"step_seconds": sec, "counts": colls.counts(), "ring_bytes_per_device":
           colls.ring_bytes, "hlo_bare_window_fraction": colls.bare_fraction,
           "_compiled": compiled, "_args": args}
    return rec | ({"options": opts, "options_dropped": dropped} if opts else {})


def variant(name, ctx, a, blocks) -> dict:
    ns = muon_jax.NewtonSchulzOptions(method=a.ns_method, symmetric_blocks=blocks)
    if name in MUON_DP:
        kw = {"chunk_bytes": a.chunk_bytes} if name == "muon_chunked" else {}
        tx = muon_jax.scale_by_muon(mu_dtype=jnp.float32, ns_steps=a.ns_steps, newton_schulz=ns,
                                    sharding=muon_jax.ShardingOptions(ctx.mesh, **kw))
        opts = overlap.overlap_compiler_options() if name == "muon_overlap" else None
        return run(name, step_fn(tx, True, loss_fn(ctx, False)),
                   (ctx.params, tx.init(ctx.params), ctx.data), a, opts)
    if name == "optax":
        tx = optax.contrib.muon(0.02, ns_steps=a.ns_steps)
        return run(name, step_fn(tx, False, loss_fn(ctx, False)),
                   (ctx.params, jax.jit(tx.init)(ctx.params), ctx.data), a)
    specs = {k: P("data", None) if s[0] == a.d_model else P(None, "data")
             for k, s in ctx.shapes.items()}
    fp = jax.device_put(ctx.params, {lk: {k: NamedSharding(ctx.auto, s) for k, s in specs.items()}
                                     for lk in ctx.params})
    fd = jax.device_put(ctx.data, NamedSharding(ctx.auto, P("data")))
    with jax.set_mesh(ctx.auto):
        if name == "optax_fsdp":
            tx = optax.contrib.muon(0.02, ns_steps=a.ns_steps)
            state = jax.jit(tx.init)(fp)
        else:
            tx = muon_jax.scale_by_muon(mu_dtype=jnp.float32, ns_steps=a.ns_steps,
                                        newton_schulz=ns,
                                        sharding=muon_jax.ShardingOptions(ctx.auto))
            state = tx.init(fp)
        sh = jax.tree.map(lambda x: x.sharding, (fp, state))
        return run(name, step_fn(tx, False, loss_fn(ctx, True)), (fp, state, fd), a,
                   jit_kw={"in_shardings": (*sh, jax.tree.map(lambda x: x.sharding, fd)),
                           "out_shardings": sh})


def ns_only(ctx, a, blocks, rate) -> dict:
    """Newton-Schulz alone on each device's owner share (f32 in, bf16 out)."""
    plan = muon_jax.scale_by_muon(sharding=muon_jax.ShardingOptions(ctx.mesh)).init(ctx.params).plan
    xs = jax.jit(lambda: [jnp.ones((ctx.n * s.k_owner, s.m, s.n), jnp.float32)
                          for s in plan.stacks], out_shardings=NamedSharding(ctx.mesh, P("data")))()
    f = jax.jit(jax.shard_map(lambda xs: [muon_jax.orthogonalize(
        x, ns_steps=a.ns_steps, method=a.ns_method, symmetric_blocks=blocks).astype(jnp.bfloat16)
        for x in xs], mesh=ctx.mesh, in_specs=P("data"), out_specs=P("data")))
    sec = bench.median_seconds(f, (xs,), a.warmup, a.iters)

    def flops(s):
        sb = newton_schulz.resolve_symmetric_blocks(blocks, shape=(s.k_owner, s.m, s.n))
        m = newton_schulz.resolve_ns_method(a.ns_method, s.m, s.n, jnp.bfloat16,
                                            symmetric_blocks=sb)
        return s.k_owner * newton_schulz.ns_flops(s.m, s.n, a.ns_steps, symmetric_blocks=sb,
                                                  method=m)

    total = sum(flops(s) for s in plan.stacks)
    print(f"  ns: {sec:.4f} s ({total / sec / 1e12:.1f} TFLOP/s)", flush=True)
    return {"seconds": sec, "flops": total, "tflops": total / sec / 1e12,
            "fraction_of_dense": total / sec / rate,
            "shapes": [[s.k_owner, s.m, s.n] for s in plan.stacks]}


def exposed(results: dict, trace_dir: str) -> dict:
    """Exposed collective time of every muon DP variant's 3 traced steps (None on CPU)."""
    profs = {k: bench.trace_profile(r["_compiled"], r["_args"], os.path.join(trace_dir, k), 3,
                                    hlo=False) for k, r in results.items() if k in MUON_DP}
    return {k: p.get("overlap", p) for k, p in profs.items()}


def one_config(a, pdtype, blocks, rate) -> dict:
    """Every variant at one param dtype and ns_symmetric_blocks; the headline keys."""
    ctx = setup(a, pdtype, rate)
    print(f"{ctx.model['params'] / 1e6:,.0f}M {ctx.model['param_dtype']} params, "
          f"symmetric blocks {blocks}: limit {ctx.limit['seconds']:.4f} s", flush=True)
    rep = {"model": ctx.model, "limit": ctx.limit, "ns_symmetric_blocks": blocks}
    with jax.set_mesh(ctx.mesh):  # optax's ops on explicitly sharded arrays need it ambient
        results = {v: variant(v, ctx, a, blocks) for v in a.variants if v != "ns"}
        if "ns" in a.variants:
            rep["ns_owner_share"] = ns_only(ctx, a, blocks, rate)
        rep["trace_by_variant"] = exposed(results, a.trace_dir or tempfile.mkdtemp(prefix="muon_"))
    dp = {k: r["step_seconds"] for k, r in results.items() if k in MUON_DP}
    best = min(dp, key=dp.get) if dp else None

    def sec(k):
        return results[k]["step_seconds"] if k in results else None

    def ratio(x, y):
        return x / y if x and y else None

    rep.update({LABELS[k]: {kk: vv for kk, vv in r.items() if not kk.startswith("_")}
                for k, r in results.items()})
    rep.update(muon_step_seconds=dp.get(best), muon_step_variant=best,
               muon_step_speedup_vs_optax=ratio(sec("optax"), dp.get(best)),
               muon_step_speedup_vs_optax_fsdp=ratio(sec("optax_fsdp"), dp.get(best)),
               muon_step_fsdp_seconds=sec("muon_fsdp"), optax_step_seconds=sec("optax"),
               optax_fsdp_step_seconds=sec("optax_fsdp"),
               muon_step_over_limit=ratio(dp.get(best), ctx.limit["seconds"]),
               muon_step_exposed_comm_fraction=rep["trace_by_variant"].get(best, {}).get(
                   "exposed_fraction"))
    if "muon" in results and "muon_chunked" in results:
        rep["chunking_ring_bytes_equal"] = (results["muon"]["ring_bytes_per_device"]
                                            == results["muon_chunked"]["ring_bytes_per_device"])
    return rep


def main(argv=None) -> dict:
    a = parse_args(argv)
    report = {"benchmark": "muon_step", "env": bench.env(), "settings": bench.settings(a)}
    bench.ceilings(report, a.ceiling_n, a.small, dtypes=("bf16",))
    rate = report["dense_bf16_tflops"] * 1e12
    dtypes = {"bf16": jnp.bfloat16, "f32": jnp.float32}
    runs = {}
    for i, name in enumerate(a.param_dtypes.split(",")):
        for blocks in a.symmetric_blocks:
            runs[(name, str(blocks))] = rep = one_config(a, dtypes[name], blocks, rate)
            report.setdefault(f"{name}_params", rep)
            prefix = "" if i == 0 else f"{name}_params_"
            report.update({prefix + k: v for k, v in rep.items() if k.startswith(
                ("muon_step_", "optax_")) and prefix + k not in report})
            bench.write_json(a.out, report)
    if len(a.symmetric_blocks) > 1:
        first = a.param_dtypes.split(",")[0]
        mine = {b: r for (d, b), r in runs.items() if d == first}
        report["update_s"] = {b: r["muon_step_seconds"] for b, r in mine.items()}
        report["ns_s"] = {b: r.get("ns_owner_share", {}).get("seconds") for b, r in mine.items()}
        report["limit_s"] = {b: r.get("ns_owner_share", {}).get("flops", 0) / rate
                             for b, r in mine.items()}  # its Newton-Schulz FLOPs, dense rate
        other = [b for b in mine if b != "1"]
        if "1" in mine and other and report["update_s"]["1"]:
            report["symmetric_over_plain_update"] = (report["update_s"][other[0]]
                                                     / report["update_s"]["1"])
    bench.print_table([{"config": f"{d} {b}", **{k: r.get(k) for k in (
        "muon_step_seconds", "muon_step_over_limit", "muon_step_speedup_vs_optax")}}
        for (d, b), r in runs.items()], ["config", "muon_step_seconds", "muon_step_over_limit",
                                         "muon_step_speedup_vs_optax"])
    bench.write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
