"""How long does a whole train step of the MoE language model take, in bf16 and in FP8?

One step of ``examples/lm_model.py`` as ``examples/train_lm.py`` trains it (cross-entropy +
0.01 load-balancing + 1e-3 router z-loss; ``muon_jax.muon`` sharded, or ``--optimizer adamw``),
jitted over the split NNX state (donated) on the mesh ('data', 'expert') = (1, devices); bf16
compute, f32 params, ``--attention`` (auto: cuDNN's on NVIDIA GPUs). ``VARIANTS`` add FP8 step
by step: the wire, the expert GEMMs' forward and data gradient, their weight gradient, then
attention's projections through ``moe.fp8_dense`` (forward and data gradient; all three).

MFU = ``lm_model.train_flops_per_token`` x tokens / (time x devices x this process's dense
bf16 8192^3 rate). ``lm_step_fp8_speedup`` = bf16 step time / the fastest FP8-GEMM variant's.
``--profile DIR`` traces 3 steps of each variant: exposed collective time and device time per
region (``bench.lm_regions``) and op category. ``--read-trace DIR`` runs nothing: it reads the
newest trace under DIR for its exposed collective time, or with ``--hlo`` (the traced
executable's HLO, as ``--hlo-dir`` writes it) its time per region and category.

    python3 benchmarks/lm_step.py --variants bf16 fp8_proj --profile /tmp/lm --out lm_step.json
    python3 benchmarks/lm_step.py --small                       # CPU, 8 simulated devices
    python3 benchmarks/lm_step.py --read-trace /tmp/lm/bf16 --hlo /tmp/hlo/bf16.hlo.txt

JSON: ``steps`` (per variant; with ``--profile`` its ``overlap`` and ``breakdown``),
``ceiling``, ``ceiling_fp8`` and the keys of :func:`summarize`.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _lib import bench
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_jax
from xla_comm import breakdown

sys.path.append(str(bench.library_root() / "examples"))
import lm_model  # noqa: E402  (examples/lm_model.py)

MEASURES = ("moe/", "muon_jax/", "accel_kernels/", "examples/lm_model.py")
AXES = ("data", "expert")
_B, _FD, _ALL = ("bf16",) * 3, ("fp8", "fp8", "bf16"), ("fp8",) * 3
VARIANTS = {  # name: (wire, expert GEMMs, projection GEMMs) as (forward, dgrad, wgrad)
    "bf16": ("bf16", _B, _B), "fp8_dispatch": ("fp8", _B, _B), "fp8_gemm": ("fp8", _FD, _B),
    "fp8": ("fp8", _ALL, _B), "fp8_proj_fd": ("fp8", _ALL, _FD), "fp8_proj": ("fp8", _ALL, _ALL)}
FP8_GEMMS = ("fp8_gemm", "fp8", "fp8_proj_fd", "fp8_proj")


def parse_args(argv=None):
    p = bench.parser(__doc__)
    p.add_argument("--batch", type=int, help="sequences (64; small 16)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25, help="<= 0: dropless")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                   default=["bf16", "fp8_dispatch", "fp8_gemm", "fp8"])
    p.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto")
    p.add_argument("--profile", metavar="DIR", help="trace 3 steps of each variant under DIR")
    p.add_argument("--hlo-dir", metavar="DIR", help="with --profile: write each compiled HLO")
    p.add_argument("--top-ops", type=int, default=16)
    p.add_argument("--read-trace", metavar="DIR", help="read a trace; run nothing")
    p.add_argument("--hlo", metavar="FILE", help="--read-trace: the traced executable's HLO")
    p.add_argument("--steps", type=int, default=1, help="--read-trace: traced calls in it")
    return bench.parse(p, argv, cpu_devices=8, small=dict(
        d_model=128, layers=2, heads=4, d_ff=128, experts=8, fp8_block_size=32, batch=16,
        seq_len=64, ceiling_n=512), full=dict(d_model=2048, layers=8, heads=16, d_ff=1408,
                                              experts=16, fp8_block_size=128, batch=64,
                                              seq_len=1024, ceiling_n=8192))


def model_config(a, variant: str) -> lm_model.LMConfig:
    wire, (g, dg, wg), (pg, pdg, pwg) = VARIANTS[variant]
    return lm_model.LMConfig(
        vocab_size=a.vocab, d_model=a.d_model, num_layers=a.layers, num_heads=a.heads,
        d_ff=a.d_ff, num_experts=a.experts, top_k=a.top_k,
        capacity_factor=a.capacity_factor if a.capacity_factor > 0 else None,
        dispatch_dtype=wire, expert_gemm_dtype=g, expert_dgrad_dtype=dg, expert_wgrad_dtype=wg,
        proj_gemm_dtype=pg, proj_dgrad_dtype=pdg, proj_wgrad_dtype=pwg, attention=a.attention,
        fp8_block_size=a.fp8_block_size, dtype="bfloat16")


def make_step(graphdef):
    def loss_fn(model, batch):
        logits, aux = model(batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        n = len(model.blocks)
        return ce + 0.01 * aux["load_balance_loss"] / n + 1e-3 * aux["router_z_loss"] / n, ce

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        (_, ce), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), ce

    return step


def steps(step, state, batch, n):
    times, ce = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        state, ce = jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - t0)
    return state, ce, times


def bench_variant(variant: str, a, mesh, rate: float) -> dict:
    cfg = model_config(a, variant)
    tx = (optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.01) if a.optimizer == "adamw" else
          muon_jax.muon(0.02, weight_decay=0.01, adamw=muon_jax.AdamWOptions(learning_rate=3e-4),
                        sharding=muon_jax.ShardingOptions(mesh)))
    model, optimizer = lm_model.create_sharded(cfg, tx, mesh=mesh, seed=a.seed)
    graphdef, state = nnx.split((model, optimizer))
    del model, optimizer
    step = make_step(graphdef)
    tokens = np.random.default_rng(a.seed).integers(0, a.vocab, (a.batch, a.seq_len + 1))
    batch = jax.device_put(jnp.asarray(tokens, jnp.int32), NamedSharding(mesh, P(AXES, None)))
    row = {"variant": variant, "attention": cfg.attention_impl(), "optimizer": a.optimizer}
    with jax.set_mesh(mesh):
        state, _, _ = steps(step, state, batch, 1 + a.warmup)
        state, ce, times = steps(step, state, batch, a.iters)
        if a.profile:
            row.update(profile(step, state, batch, a, variant))
    sec, ntok = float(np.median(times)), a.batch * a.seq_len
    flops = lm_model.train_flops_per_token(cfg, a.seq_len) * ntok
    counts = lm_model.param_counts(cfg)
    return row | dict(params_total=counts["total"], params_active=counts["active"],
                      step_ms=sec * 1e3,
                      tokens_per_s=ntok / sec, flops_per_step=flops, loss=float(ce),
                      mfu=flops / (sec * mesh.devices.size * rate))


def profile(step, state, batch, a, variant) -> dict:
    """Exposed collectives and device time per region of 3 traced steps (the executable's
    HLO from JAX's cache: lowering reads the live arguments' types and consumes nothing)."""
    trace_dir = os.path.join(a.profile, variant)
    try:
        with jax.profiler.trace(trace_dir):
            steps(step, state, batch, 3)
        from xla_comm.trace import exposed_comm_fraction
        ov = exposed_comm_fraction(trace_dir)
        hlo = step.lower(state, batch).compile().as_text()
        if a.hlo_dir:
            Path(a.hlo_dir).mkdir(parents=True, exist_ok=True)
            (Path(a.hlo_dir) / f"{variant}.hlo.txt").write_text(hlo)
        regions, kernel_regions = bench.lm_regions()
        bd = breakdown.op_breakdown(trace_dir, hlo, steps=3, top=a.top_ops,
                                    rules=bench.moe_rules(), regions=regions,
                                    kernel_regions=kernel_regions)
        return {"overlap": {k: v for k, v in ov.items() if k != "source"}, "breakdown": bd}
    except Exception as err:  # noqa: BLE001  (the timings stand either way)
        return {"overlap": {"exposed_fraction": None, "reason": f"profiler: {err!r}"[:2000]}}


def read_trace(a) -> dict:
    """``--read-trace``: a trace's exposed collectives, or its breakdown with ``--hlo``."""
    from xla_comm.trace import exposed_comm_fraction

    out = {}
    if a.hlo:
        regions, kernel_regions = bench.lm_regions()
        out["breakdown"] = breakdown.op_breakdown(
            a.read_trace, Path(a.hlo).read_text(), steps=a.steps, rules=bench.moe_rules(),
            regions=regions, kernel_regions=kernel_regions)
        print(breakdown.format_table({"trace": out["breakdown"]}))
        print(breakdown.format_regions({"trace": out["breakdown"]}))
    else:
        out["overlap"] = exposed_comm_fraction(a.read_trace)
        print(json.dumps(out["overlap"], indent=2))
    return out


def summarize(report) -> None:
    by = {r["variant"]: r for r in report["steps"]}
    report["lm_step_by_variant"] = {v: {k: r[k] for k in ("step_ms", "tokens_per_s", "mfu")}
                                    for v, r in by.items()}
    fp8 = [by[v] for v in FP8_GEMMS if v in by]
    if "bf16" in by and fp8:
        best = min(fp8, key=lambda r: r["step_ms"])
        report["lm_step_fp8_speedup"] = by["bf16"]["step_ms"] / best["step_ms"]
        report["lm_step_fp8_variant"] = best["variant"]
    bench.print_table(report["steps"], ["variant", "step_ms", "tokens_per_s", "mfu", "loss"])
    bds = {v: r["breakdown"] for v, r in by.items() if "us_per_region" in r.get("breakdown", {})}
    if bds:
        print(breakdown.format_regions(bds))


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.read_trace:
        return read_trace(a)
    mesh = bench.line_mesh(AXES)
    if a.experts % mesh.devices.size or a.batch % mesh.devices.size:
        raise SystemExit("--experts and --batch must be multiples of the device count")
    report = dict(benchmark="lm_step", env=bench.env(), settings=bench.settings(a), steps=[],
                  errors={}, flops="6*active_params*tokens + 12*layers*d_model*seq*tokens")
    bench.ceilings(report, a.ceiling_n, a.small)
    report["ceiling"], report["ceiling_fp8"] = report["ceilings"]
    for v in a.variants:
        try:
            report["steps"].append(bench_variant(v, a, mesh, report["dense_bf16_tflops"] * 1e12))
            print(f"{v}: {report['steps'][-1]['step_ms']:.2f} ms", flush=True)
        except Exception as err:  # noqa: BLE001  (one variant failing must not lose the rest)
            report["errors"][v] = repr(err)[:2000]
            print(f"{v}: FAILED {err!r}"[:800], flush=True)
        bench.write_json(a.out, report)
    summarize(report)
    bench.write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
