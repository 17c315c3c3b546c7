"""Benchmark one full training step of the MoE language model (examples/lm_model.py).

Step = forward, backward (cross-entropy + 0.01 load-balancing + 1e-3 router z-loss, as in
examples/train_lm.py) and the optimizer update (``muon_jax.muon(..., mesh=)``: Muon for hidden
matrices and AdamW for the rest; or ``--optimizer adamw``), jitted over the split NNX state with
the state donated. Mesh ('data', 'expert') = (1, n_devices);
bf16 compute, f32 params; attention ``--attention`` (auto: cuDNN's fused flash attention on
NVIDIA GPUs, XLA's einsums elsewhere). Variants (``--variants``): ``bf16`` (bf16 wire and
GEMMs), ``fp8_dispatch`` (FP8 wire), ``fp8_gemm`` (FP8 wire, FP8 forward and data-gradient
expert GEMMs, bf16 weight gradients: the trainer's ``--fp8-gemms forward_dgrad``), ``fp8`` (FP8
wire and all expert GEMMs in FP8), ``fp8_proj_fd`` / ``fp8_proj`` (``fp8`` plus attention's QKV
and output projections through ``moe.fp8_dense``: forward and data gradient in FP8 / all three
GEMMs in FP8; the trainer's ``--fp8-projections forward_dgrad`` / ``all``).
``lm_step_fp8_speedup`` = bf16 step time / the fastest FP8-GEMM variant (named in
``lm_step_fp8_variant``); ``lm_step_fp8_experts_speedup`` the same over the variants with FP8
expert GEMMs only (``fp8_gemm``, ``fp8``).

MFU = (6 * active_params * tokens + attention FLOPs) / (step time x n_devices x dense rate),
the dense rate being a bf16 8192^3 matmul on one device timed in the same run (the FP8 one,
``ceiling_fp8``, is timed too).
active_params: every matrix except the embedding lookup, with the expert banks scaled by
top_k / num_experts (router, attention, lm_head counted in full); attention FLOPs
12 * layers * d_model * seq per token (QK^T and PV, forward + backward, the full square,
PaLM's convention, though the cuDNN kernel skips the masked half). Dropped slots and
capacity padding are not subtracted.

``--profile DIR`` traces ``--profile-steps`` steps of each variant into DIR/<variant> and
stores, per variant, how much collective time the trace leaves exposed (``overlap``;
`xla_comm.trace.exposed_comm_fraction`) and where the device time goes (``breakdown``: the
`xla_comm.breakdown.op_breakdown` of the trace with the step's compiled HLO,
regions ``LM_REGIONS``: optimizer, attention (QK^T, softmax, PV), shared_experts, experts (the
expert GEMMs forward / dgrad / wgrad and their quantization), dispatch_combine (router,
dispatch plan and exchange, combine), moe_other (the rest of the MoE layer's shard_map: SwiGLU,
masks, casts) and rest (dense projections, LM head, norms, embedding, loss, the all-reduce of
the replicated weights' gradients), each split by op category, e.g. GEMM vs not). Kernels
the trace ties to no HLO instruction (on GPU, jax 0.11: Mosaic GPU and cuBLAS kernels) are
placed by name (``LM_KERNEL_REGIONS``: the Mosaic GPU and ``fp8_*`` kernels are the experts';
cuBLAS GEMMs stay in rest, named in ``unmatched_kernels``). It prints a
table of ms per step per region (summed over devices) and the experts' split by category. A
profiler failure keeps the timings (``reason``).

Usage:
  python benchmarks/lm_step_bench.py                  # GPU: d 2048, 8 layers, E16 k2, 64x1024
  python benchmarks/lm_step_bench.py --small          # CPU, 8 simulated devices
  python benchmarks/lm_step_bench.py --profile /tmp/lm_trace --out r.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lm_model  # noqa: E402  (examples/lm_model.py)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from bench_util import (  # noqa: E402
    cli,
    dense_ceiling,
    env_info,
    fill_defaults,
    force_cpu_devices,
    line_mesh,
    write_json,
)
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import muon_jax  # noqa: E402
from xla_comm.breakdown import (  # noqa: E402
    LM_KERNEL_REGIONS,
    LM_REGIONS,
    format_regions,
    op_breakdown,
)
from xla_comm.trace import exposed_comm_fraction  # noqa: E402

AXES = ("data", "expert")
_BF16, _FWD_DGRAD, _ALL = ("bf16",) * 3, ("fp8", "fp8", "bf16"), ("fp8",) * 3
VARIANTS = {  # name: (dispatch wire, expert GEMMs, attention projection GEMMs), the GEMM
    # precisions as (forward, dgrad, wgrad)
    "bf16": ("bf16", _BF16, _BF16),
    "fp8_dispatch": ("fp8", _BF16, _BF16),
    "fp8_gemm": ("fp8", _FWD_DGRAD, _BF16),
    "fp8": ("fp8", _ALL, _BF16),
    "fp8_proj_fd": ("fp8", _ALL, _FWD_DGRAD),
    "fp8_proj": ("fp8", _ALL, _ALL),
}
FP8_GEMM_VARIANTS = ("fp8_gemm", "fp8", "fp8_proj_fd", "fp8_proj")



DESCRIPTION = """\
One full train step of examples/lm_model.py's MoE LM (forward, backward, muon_jax.muon or
AdamW update) over all devices, per variant (bf16, fp8_dispatch, fp8_gemm, fp8, fp8_proj_fd,
fp8_proj): step time, tokens/s and MFU against a dense bf16 matmul; with --profile, exposed
collectives and device time per region / op category. Default d_model 2048, 8 layers, E 16
top-2, batch 64x1024 (--small: CPU, 8 devices, d 128, 2 layers, 16x64). JSON (--out, default
benchmarks/results/lm_step_bench.json): steps, ceiling, ceiling_fp8, lm_step_fp8_speedup,
lm_step_fp8_variant, lm_step_fp8_experts_speedup, errors."""


def parse_args(argv=None) -> argparse.Namespace:
    p = cli(DESCRIPTION, cpu_devices=8)
    p.add_argument("--d-model", type=int, help="2048; small 128")
    p.add_argument("--layers", type=int, help="8; small 2")
    p.add_argument("--heads", type=int, help="16; small 4")
    p.add_argument("--d-ff", type=int, help="1408; small 128")
    p.add_argument("--experts", type=int, help="16; small 8")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25, help="<= 0: dropless")
    p.add_argument("--fp8-block-size", type=int, help="128; small 32")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, help="global sequences (64; small 16)")
    p.add_argument("--seq-len", type=int, help="1024; small 64")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS),
                   default=["bf16", "fp8_dispatch", "fp8_gemm", "fp8"],
                   help="what to run (see above)")
    p.add_argument("--optimizer", choices=("muon", "adamw"), default="muon")
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                   help="attention kernel (lm_model.LMConfig.attention; auto: cudnn on GPUs)")
    p.add_argument("--ceiling-n", type=int, help="dense matmul size (8192; small 512)")
    p.add_argument("--warmup", type=int, help="3; small 1")
    p.add_argument("--iters", type=int, help="10; small 2")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace a few steps of each variant under DIR/<variant>; report the "
                        "exposed collective time and the time per region / op category")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top-ops", type=int, default=16,
                   help="with --profile: how many of the costliest instructions to list")
    p.add_argument("--hlo-dir", default=None, metavar="DIR",
                   help="with --profile: write each variant's compiled HLO text here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results" / "lm_step_bench.json"),
                   help="JSON path ('' to skip)")
    return fill_defaults(
        p.parse_args(argv),
        small=dict(d_model=128, layers=2, heads=4, d_ff=128, experts=8, fp8_block_size=32,
                   batch=16, seq_len=64, ceiling_n=512, warmup=1, iters=2),
        full=dict(d_model=2048, layers=8, heads=16, d_ff=1408, experts=16, fp8_block_size=128,
                  batch=64, seq_len=1024, ceiling_n=8192, warmup=3, iters=10))


def model_config(a, variant: str) -> lm_model.LMConfig:
    wire, (gemm, dgrad, wgrad), (p_gemm, p_dgrad, p_wgrad) = VARIANTS[variant]
    return lm_model.LMConfig(
        vocab_size=a.vocab, d_model=a.d_model, num_layers=a.layers, num_heads=a.heads,
        d_ff=a.d_ff, num_experts=a.experts, top_k=a.top_k,
        capacity_factor=a.capacity_factor if a.capacity_factor > 0 else None,
        dispatch_dtype=wire, expert_gemm_dtype=gemm, expert_dgrad_dtype=dgrad,
        expert_wgrad_dtype=wgrad, proj_gemm_dtype=p_gemm, proj_dgrad_dtype=p_dgrad,
        proj_wgrad_dtype=p_wgrad, attention=a.attention, fp8_block_size=a.fp8_block_size,
        dtype="bfloat16")


def make_tx(a, mesh):
    if a.optimizer == "adamw":
        return optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.01)
    return muon_jax.muon(0.02, weight_decay=0.01, adamw=muon_jax.AdamWOptions(learning_rate=3e-4),
                         sharding=muon_jax.ShardingOptions(mesh))


def active_params(model, cfg) -> dict:
    """Matrix params by role; expert banks scaled by top_k / num_experts in 'active'."""
    total = active = 0
    by_role: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        size = int(np.prod(leaf.shape))
        total += size
        if len(leaf.shape) < 2:
            role, act = "vector", 0
        elif "embed" in name:
            role, act = "embedding", size if cfg.tie_embeddings else 0  # tied: also the head
        elif "w_gate_up" in name or "w_down" in name:
            role, act = "experts", size * cfg.top_k / cfg.num_experts
        elif "router" in name:
            role, act = "router", size
        else:
            role, act = ("lm_head" if "lm_head" in name else "dense"), size
        by_role[role] = by_role.get(role, 0) + size
        active += act
    return {"total": total, "active": active, "by_role": by_role}


def loss_fn(model, batch):
    logits, aux = model(batch[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    n = len(model.blocks)
    loss = ce + 0.01 * aux["load_balance_loss"] / n + 1e-3 * aux["router_z_loss"] / n
    return loss, (ce, aux["dropped_slots"])


def make_step(graphdef):
    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        (_, (ce, dropped)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), (ce, dropped)

    return step


def run_steps(step, state, batch, n):
    times, out = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        state, out = step(state, batch)
        jax.block_until_ready((state, out))
        times.append(time.perf_counter() - t0)
    return state, out, times


def step_breakdown(step, state, batch, trace_dir: str, steps: int, top: int = 16,
                   hlo_out: str | None = None) -> dict:
    """``op_breakdown`` (regions ``LM_REGIONS``) of the ``steps`` traced calls of ``step`` in
    ``trace_dir``, or ``{"reason": ...}``. Call under the mesh the step ran under, with live
    arguments of the traced types and shardings (lowering reads nothing else and consumes
    nothing); JAX's compilation cache then returns the executable the trace ran (no second
    compile), whose HLO names the traced instructions. ``top``: instructions listed;
    ``hlo_out``: a path to write that HLO text to."""
    try:
        hlo = step.lower(state, batch).compile().as_text()
        if hlo_out:
            Path(hlo_out).parent.mkdir(parents=True, exist_ok=True)
            Path(hlo_out).write_text(hlo)
        return op_breakdown(trace_dir, hlo, steps=steps, top=top, regions=LM_REGIONS,
                            kernel_regions=LM_KERNEL_REGIONS)
    except Exception as err:  # noqa: BLE001  (the timings are kept either way)
        return {"reason": f"breakdown failed: {err!r}"[:2000]}


def bench_variant(variant: str, a, mesh, ceiling) -> dict:
    n_dev = mesh.devices.size
    cfg = model_config(a, variant)
    model, optimizer = lm_model.create_sharded(cfg, make_tx(a, mesh), mesh=mesh,
                                               seed=a.seed)
    counts = active_params(model, cfg)
    graphdef, state = nnx.split((model, optimizer))
    del model, optimizer
    step = make_step(graphdef)
    rng = np.random.default_rng(a.seed)
    tokens = rng.integers(0, a.vocab, size=(a.batch, a.seq_len + 1), dtype=np.int32)
    batch = jax.device_put(jnp.asarray(tokens), NamedSharding(mesh, P(AXES, None)))
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        state, _, _ = run_steps(step, state, batch, 1)
        first = time.perf_counter() - t0
        state, _, _ = run_steps(step, state, batch, a.warmup)
        state, (ce, dropped), times = run_steps(step, state, batch, a.iters)
        sec = float(np.median(times))
        overlap = breakdown = None
        if a.profile:
            trace_dir = os.path.join(a.profile, variant)
            traced = False
            try:
                with jax.profiler.trace(trace_dir):
                    state, _, _ = run_steps(step, state, batch, a.profile_steps)
                traced = True
                overlap = exposed_comm_fraction(trace_dir)
                overlap.pop("source", None)
                overlap["trace_dir"] = trace_dir
            except Exception as err:
                overlap = {"exposed_fraction": None, "reason": f"profiler failed: {err!r}"}
            hlo_out = (os.path.join(a.hlo_dir, f"{variant}.hlo.txt") if a.hlo_dir else None)
            breakdown = (step_breakdown(step, state, batch, trace_dir, a.profile_steps,
                                        a.top_ops, hlo_out)
                         if traced else {"reason": overlap["reason"]})
    ntok = a.batch * a.seq_len
    attn = 12.0 * a.layers * a.d_model * a.seq_len * ntok
    flops = 6.0 * counts["active"] * ntok + attn
    slots = ntok * a.top_k * a.layers
    gemm_names = ("forward", "dgrad", "wgrad")
    row = dict(variant=variant, fp8_dispatch=VARIANTS[variant][0] == "fp8",
               expert_gemm_dtypes=dict(zip(gemm_names, VARIANTS[variant][1], strict=True)),
               projection_gemm_dtypes=dict(zip(gemm_names, VARIANTS[variant][2], strict=True)),
               attention=cfg.attention_impl(),
               optimizer=a.optimizer, muon_sharded=a.optimizer == "muon",
               params_total=counts["total"], params_active=counts["active"],
               params_by_role=counts["by_role"], tokens_per_step=ntok,
               step_seconds=sec, step_ms=sec * 1e3, times_s=times, first_call_s=first,
               tokens_per_s=ntok / sec, flops_per_step=flops, attention_flops=attn,
               mfu=flops / (sec * n_dev * ceiling["tflops"] * 1e12),
               loss=float(ce), dropped_frac=int(dropped) / slots)
    if overlap is not None:
        row["overlap"] = overlap
    if breakdown is not None:
        row["breakdown"] = breakdown
    del state
    return row


def main(a) -> dict:
    mesh = line_mesh(AXES)
    n = mesh.devices.size
    if a.experts % n or a.batch % n:
        raise SystemExit(f"--experts {a.experts} and --batch {a.batch} must be multiples of the "
                         f"{n} devices")
    report = dict(benchmark="lm_train_step", env=env_info(),
                  settings={k: v for k, v in vars(a).items() if k != "out"},
                  mesh={"data": 1, "expert": n}, muon_sharded_available=True,
                  flops_formula="6*active_params*tokens + 12*layers*d_model*seq*tokens",
                  steps=[], errors={})
    report["ceiling"] = dense_ceiling(a.ceiling_n, a.warmup, max(a.iters, 5))
    report["ceiling_fp8"] = dense_ceiling(a.ceiling_n, a.warmup, max(a.iters, 5), dtype="fp8")
    print(f"ceilings: {report['ceiling']['tflops']:.2f} TFLOP/s per device (bf16), "
          f"{report['ceiling_fp8']['tflops']:.2f} (FP8)", flush=True)
    write_json(a.out, report)
    for v in a.variants:
        try:
            row = bench_variant(v, a, mesh, report["ceiling"])
        except Exception as err:
            report["errors"][v] = repr(err)[:2000]
            print(f"{v}: FAILED {err!r}"[:800], flush=True)
            continue
        report["steps"].append(row)
        ov = row.get("overlap", {}).get("exposed_fraction")
        print(f"{row['variant']:20s} step {row['step_ms']:9.2f} ms  {row['tokens_per_s']:11.0f} "
              f"tok/s  MFU {row['mfu']:.3f}  dropped {row['dropped_frac']:.4f}  loss "
              f"{row['loss']:.3f}  first call {row['first_call_s']:.1f} s"
              + (f"  exposed comm {ov:.3f}" if ov is not None else ""), flush=True)
        bd = row.get("breakdown")
        if bd is not None:
            print(format_regions({v: bd}) if "us_per_region" in bd
                  else f"{v}: no breakdown ({bd.get('reason')})", flush=True)
        write_json(a.out, report)
    e, c = report["env"], report["ceiling"]
    print(f"\nLM train step on {n}x {e['device_kind']} ({e['backend']}), jax {e['jax']}: "
          f"d_model {a.d_model}, {a.layers} layers, {a.heads} heads, E {a.experts} top-{a.top_k}"
          f" d_ff {a.d_ff}, batch {a.batch}x{a.seq_len}, optimizer {a.optimizer}"
          f"{' (sharded)' if a.optimizer == 'muon' else ''}")
    if report["steps"]:
        r0 = report["steps"][0]
        print(f"params {r0['params_total'] / 1e6:.1f} M total, {r0['params_active'] / 1e6:.1f} M "
              f"active; dense ceiling {c['tflops']:.2f} TFLOP/s per device")
    hdr = f"{'variant':20s} {'step ms':>9s} {'tok/s':>11s} {'MFU':>7s} {'dropped':>8s}"
    print(hdr + "\n" + "-" * len(hdr))
    for r in report["steps"]:
        print(f"{r['variant']:20s} {r['step_ms']:9.2f} {r['tokens_per_s']:11.0f} "
              f"{r['mfu']:7.3f} {r['dropped_frac']:8.4f}")
    by = {r["variant"]: r for r in report["steps"]}
    fp8 = [by[v] for v in FP8_GEMM_VARIANTS if v in by]
    if "bf16" in by and fp8:
        best = min(fp8, key=lambda r: r["step_seconds"])
        report["lm_step_fp8_speedup"] = by["bf16"]["step_seconds"] / best["step_seconds"]
        report["lm_step_fp8_variant"] = best["variant"]
        experts = [r for r in fp8 if r["variant"] in ("fp8_gemm", "fp8")]
        if experts:
            report["lm_step_fp8_experts_speedup"] = by["bf16"]["step_seconds"] / min(
                r["step_seconds"] for r in experts)
        print(f"lm_step_fp8_speedup (bf16 / {best['variant']}: FP8 wire + FP8 GEMMs): "
              f"{report['lm_step_fp8_speedup']:.3f}")
    bds = {r["variant"]: r["breakdown"] for r in report["steps"]
           if "us_per_region" in r.get("breakdown", {})}
    if len(bds) > 1:
        print("\ndevice time per region (summed over devices; xla_comm.breakdown):")
        print(format_regions(bds))
    write_json(a.out, report)
    if a.out:
        print(f"wrote {a.out}")
    return report


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.small:
        force_cpu_devices(ARGS.cpu_devices)
    main(ARGS)
