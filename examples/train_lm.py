"""Train a byte-level MoE language model with sharded Muon (and/or AdamW) on real text.

The text is the source of Python's own standard library, split into train and validation
by file. The model is a small decoder-only transformer whose feed-forward layers are
``moe.MoE`` (experts sharded over the mesh's ``expert`` axis, optional FP8 dispatch); the
optimizer is ``muon_jax.muon`` with its state sharded ZeRO-1 style over every mesh axis.

Run (CPU, 8 simulated devices as a ('data', 'expert') = (2, 4) mesh)::

    python examples/train_lm.py                      # Muon vs AdamW, ~5 minutes on 2 cores
    python examples/train_lm.py --preset gpu         # one GPU: ~4.5 minutes on an H200
    python examples/train_lm.py --optimizer muon --steps 500 --out runs/long
    python examples/train_lm.py --out runs/x --resume  # continue from the last checkpoint

Several processes (``jax.distributed``; here 2 on one machine, 4 CPU devices each)::

    A="--coordinator-address 127.0.0.1:8476 --num-processes 2"
    python examples/train_lm.py $A --process-id 0 & python examples/train_lm.py $A --process-id 1

Outputs in ``--out``: ``metrics.jsonl``, ``loss.png``, ``summary.json`` and orbax
checkpoints under ``ckpt/<optimizer>/``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time

CPU_DEVICES = 8
"""Simulated CPU devices of a run, split over its processes (the default mesh stays (2, 4))."""

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import lm_checkpoint  # noqa: E402
from lm_cluster import cluster_environment, init_distributed, processes_from  # noqa: E402

# The flags live in lm_flags.py; the trainer's own names for them stay importable from here.
from lm_flags import (  # noqa: E402, F401
    FP8_GEMMS,
    MESH_AXES,
    OPTIMIZERS,
    PRESETS,
    UsageError,
    default_lrs,
    parse_args,
)


def checked_args(argv=None):
    """The flags of ``argv`` (:func:`parse_args`), checked against the checkpoints under
    ``--out`` (``lm_checkpoint.check_checkpoints``); raises :class:`UsageError`. Imports
    nothing heavy, so a bad command line is reported before JAX loads."""
    args = parse_args(argv)
    lm_checkpoint.check_checkpoints(args)
    return args


def usage_error(e: UsageError) -> int:
    """Reports a bad command line in one line; the exit status (2)."""
    print(f"train_lm.py: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:  # before JAX and the rest load (seconds on a cold start): main() checks again
        checked_args(sys.argv[1:])
    except UsageError as err:
        sys.exit(usage_error(err))

# Before JAX initializes: give the CPU backend its share of 8 devices (harmless on GPU/TPU,
# where the accelerator is the default backend and these CPU devices go unused).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
        f"{max(1, CPU_DEVICES // processes_from(sys.argv[1:]))}"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import lm_data  # noqa: E402
import lm_metrics  # noqa: E402
import lm_model  # noqa: E402
import lm_supervise  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from lm_schedule import (  # noqa: E402, F401
    PGLE_OVERLAP_CHUNKS,
    PGLE_PROFILING_RUNS,
    configure_pgle,
    resolve_overlap_chunks,
    use_pgle,
)

import muon_jax  # noqa: E402

PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100", 989.0), ("H200", 989.0), ("H800", 989.0), ("B200", 2250.0), ("A100", 312.0),
    ("L40S", 362.0), ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0),
    ("TPU v5", 459.0), ("TPU v6 lite", 918.0), ("TPU v6e", 918.0),
)
"""Dense bf16 peak TFLOP/s per device, matched as substrings of ``device_kind`` in order."""


def build_mesh(spec: str | None, *, explicit: bool = False) -> jax.sharding.Mesh:
    """A ('data', 'expert') mesh over the available devices; ``explicit``: Explicit axes (the
    sharding types that let Muon's gradients arrive unreduced, ``--muon-reduce-dtype``)."""
    devices = jax.devices()
    n = len(devices)
    if spec is None:
        shape = (2, n // 2) if jax.default_backend() == "cpu" and n % 2 == 0 else (1, n)
    else:
        try:
            shape = tuple(int(s) for s in spec.split(","))
        except ValueError:
            raise UsageError(
                f"--mesh must look like 'data,expert' (e.g. 2,4), got {spec!r}.") from None
        if len(shape) != 2 or min(shape) < 1:
            raise UsageError(f"--mesh needs two positive sizes 'data,expert', got {spec!r}.")
    if math.prod(shape) != n:
        raise UsageError(
            f"--mesh {shape[0]},{shape[1]} needs {math.prod(shape)} devices but {n} are "
            f"available ({jax.default_backend()}); choose sizes whose product is {n}."
        )
    if explicit:
        # Reduced / unreduced types (muon_jax.reduced_view) exist on Explicit axes only.
        types = (jax.sharding.AxisType.Explicit,) * len(MESH_AXES)
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    # Auto axes: XLA's partitioner places the dense parts; the MoE layer and Muon are explicit
    # about their own layouts (shard_map), so nothing else needs Explicit sharding types.
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


def fp8_gemm_config(recipe: str, *, projections: str = "none") -> dict[str, str]:
    """``LMConfig`` GEMM fields for an ``--fp8-gemms`` (experts) and ``--fp8-projections``
    (attention) recipe (see ``FP8_GEMMS``)."""
    fields = {}
    for prefix, name in (("expert", recipe), ("proj", projections)):
        gemm, dgrad, wgrad = FP8_GEMMS[name]
        fields.update({f"{prefix}_gemm_dtype": gemm, f"{prefix}_dgrad_dtype": dgrad,
                       f"{prefix}_wgrad_dtype": wgrad})
    return fields


def model_config(args, mesh: jax.sharding.Mesh | None = None) -> lm_model.LMConfig:
    """The model of ``args``; with ``mesh``, ``overlap_chunks`` resolved as the run will use
    it (:func:`resolve_overlap_chunks`, under the PGLE setting :func:`setup` made)."""
    chunks = args.overlap_chunks if mesh is None else resolve_overlap_chunks(
        args, mesh, pgle=bool(jax.config.jax_enable_pgle))
    return lm_model.LMConfig(
        d_model=args.d_model,
        num_layers=args.layers,
        num_heads=args.heads,
        d_ff=args.d_ff,
        num_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor if args.capacity_factor > 0 else None,
        dispatch_dtype="fp8" if args.fp8_dispatch else "bf16",
        **fp8_gemm_config(args.fp8_gemms, projections=args.fp8_projections),
        attention=args.attention,
        fp8_block_size=args.fp8_block_size,
        tie_embeddings=args.tie_embeddings,
        dtype=args.dtype,
        micro_batches=args.micro_batches,
        overlap_chunks=chunks,
    )


def peak_tflops(args) -> float | None:
    """``--peak-tflops``, else the device kind's dense bf16 peak; ``None`` when unknown (CPU)."""
    if args.peak_tflops is not None:
        return args.peak_tflops
    if jax.default_backend() == "cpu":
        return None
    kind = jax.devices()[0].device_kind
    return next((tf for name, tf in PEAK_TFLOPS if name.lower() in kind.lower()), None)


def router_on_adamw(params):
    """``default_muon_mask`` with every MoE router kernel moved to AdamW."""
    mask = muon_jax.default_muon_mask(params)
    is_router = lambda path: any("router" in str(getattr(k, "key", k)) for k in path)
    return jax.tree_util.tree_map_with_path(lambda path, f: f and not is_router(path), mask)


def muon_adam_lr(args) -> float:
    """The learning rate of the Muon run's AdamW part: ``--muon-adam-lr``, else ``--lr``."""
    return args.lr if args.muon_adam_lr is None else args.muon_adam_lr


def make_tx(name: str, args, mesh, param_specs=None) -> optax.GradientTransformation:
    """Muon (hidden matrices, ZeRO-1 sharded) + AdamW for the rest, or plain AdamW;
    ``param_specs``: the params' specs for Muon's owner plan when ``init`` is traced on an
    Auto mesh (``muon_jax.ShardingOptions``), else read from the params."""

    def schedule(peak):
        warmup = min(args.warmup, args.steps // 2)
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, warmup, max(args.steps, warmup + 1), end_value=0.1 * peak
        )

    if name == "adamw":
        return optax.adamw(schedule(args.adam_lr), b1=0.9, b2=0.95, weight_decay=args.weight_decay)
    return muon_jax.muon(
        schedule(args.lr),
        weight_decay=args.weight_decay,
        muon_mask=router_on_adamw if args.router_optimizer == "adamw" else None,
        adamw=muon_jax.AdamWOptions(learning_rate=schedule(muon_adam_lr(args))),
        newton_schulz=muon_jax.NewtonSchulzOptions(method=args.ns_method,
                                                   symmetric_blocks=args.ns_symmetric_blocks),
        sharding=muon_jax.ShardingOptions(
            mesh,
            param_specs=param_specs,
            chunk_bytes=muon_chunk_bytes(args, mesh),
            gather_dtype={"auto": "auto", "float32": None}.get(args.muon_gather_dtype,
                                                               jnp.bfloat16),
            reduce_dtype=jnp.bfloat16 if unreduced_grads(args) else None),
    )


def muon_chunk_bytes(args, mesh) -> int | None:
    """``--muon-chunk-bytes`` resolved for ``mesh`` (``muon_jax.ShardingOptions``'
    ``chunk_bytes``; None: one collective per stack). ``auto``: where the batch is split over
    several 'data' devices, the bytes of one layer's expert banks (f32 params; their matrices
    form the largest stack, in layer order), so each chunk is one layer and moves as soon as
    the backward pass has produced that layer's gradients; else None."""
    value = getattr(args, "muon_chunk_bytes", 0)
    if value == "auto":
        if mesh.shape["data"] == 1:
            return None
        return 3 * args.experts * args.d_model * args.d_ff * 4  # gate, up and down, f32
    return value or None


def unreduced_grads(args) -> bool:
    """Whether Muon's gradients reach it unreduced (``--muon-reduce-dtype bfloat16``): an
    Explicit mesh, :func:`train_step_unreduced`, and Muon sums them in bf16 itself."""
    return getattr(args, "muon_reduce_dtype", "float32") != "float32"


def reduced_muon_view(params, router_optimizer: str):
    """``params`` with Muon's matrices cast to ``reduced`` (``muon_jax.reduced_view``, free)
    over the mesh axes the batch is split over and the leaf is not: their gradients come
    unreduced, per-device partial sums that sharded Muon reduce-scatters itself.

    The batch is split over both axes, so a replicated matrix (attention) is viewed reduced
    over ('data', 'expert') and an expert bank (sharded over 'expert') over 'data'. The MoE
    router kernels stay as they are (their gradients all-reduced by XLA, in f32): ``moe``
    hands them to its ``shard_map`` as ``P()``, which refuses a reduced input."""
    mask = (router_on_adamw if router_optimizer == "adamw" else muon_jax.default_muon_mask)(
        params)
    is_router = lambda path: any("router" in str(getattr(k, "key", k)) for k in path)
    axes_of = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        spec = jax.typeof(x).sharding.spec
        used = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
        axes_of[path] = tuple(a for a in MESH_AXES if a not in used)
    for axes in sorted(set(axes_of.values())):
        if not axes:
            continue
        pick = jax.tree_util.tree_map_with_path(
            lambda path, flag, axes=axes: bool(flag) and not is_router(path)
            and axes_of[path] == axes, mask)
        params = muon_jax.reduced_view(params, axes, muon_mask=pick)
    return params


def create(name: str, args, mesh):
    """Model and optimizer with params and state placed on the mesh."""
    return lm_model.create_sharded(model_config(args, mesh), make_tx(name, args, mesh), mesh=mesh,
                                   seed=args.seed)


def loss_terms(model, batch, aux_w, z_w):
    logits, aux = model(batch[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    n_layers = len(model.blocks)
    lb = aux["load_balance_loss"] / n_layers
    zl = aux["router_z_loss"] / n_layers
    return ce + aux_w * lb + z_w * zl, (ce, lb, aux["dropped_tokens"])


@nnx.jit(static_argnums=(3, 4))
def train_step(model, optimizer, batch, aux_w, z_w):
    grad_fn = nnx.value_and_grad(loss_terms, has_aux=True)
    (_, (ce, lb, dropped)), grads = grad_fn(model, batch, aux_w, z_w)
    optimizer.update(model, grads)
    return {"loss": ce, "load_balance_loss": lb, "dropped_tokens": dropped}


@nnx.jit(static_argnums=(3, 4, 5))
def train_step_unreduced(model, optimizer, batch, aux_w, z_w, router_optimizer):
    """:func:`train_step` differentiating w.r.t. :func:`reduced_muon_view` of the params
    (Explicit mesh): Muon's gradients reach ``optimizer`` unreduced and it sums them in its
    ``reduce_dtype``; the rest are all-reduced in the backward pass as before."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        m = nnx.merge(graphdef, p, rest)
        value, aux = loss_terms(m, batch, aux_w, z_w)
        return value, (aux, nnx.state(m, nnx.Not(nnx.Param)))

    (_, ((ce, lb, dropped), rest)), grads = jax.value_and_grad(loss, has_aux=True)(
        reduced_muon_view(params, router_optimizer))
    nnx.update(model, rest)  # whatever the forward changed besides the params (as nnx's grad)
    optimizer.update(model, grads)
    return {"loss": ce, "load_balance_loss": lb, "dropped_tokens": dropped}


@nnx.jit
def eval_step(model, batch):
    logits, _ = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def evaluate(model, batches, put) -> float:
    """Mean validation loss over ``batches`` (host arrays placed by ``put``)."""
    return float(np.mean([_host(eval_step(model, put(b))) for b in batches]))


def _host(x) -> float:
    """A replicated scalar as a Python float on any process (a multi-process array is not
    fully addressable, so ``float`` of it is refused)."""
    if getattr(x, "is_fully_addressable", True):
        return float(x)
    return float(np.asarray(x.addressable_shards[0].data))


def _batch_putter(mesh, corpus_stream, args):
    """``put(step)``: the global batch of ``step`` placed on the mesh, each process building
    only the rows its devices hold (``lm_data.batch_rows``: the same rows for any process
    count)."""
    sharding = NamedSharding(mesh, P(MESH_AXES, None))
    shape = (args.batch, args.seq_len + 1)

    def put(step):
        return jax.make_array_from_callback(shape, sharding, lambda idx: lm_data.batch_rows(
            corpus_stream, args.batch, args.seq_len, seed=args.seed, step=step, rows=idx[0]))

    return put


def train_one(name, args, mesh, corpus, out: pathlib.Path, metrics_file) -> dict:
    """Trains one optimizer's run; returns its final figures (losses, throughput, MFU)."""
    t_start = time.perf_counter()
    model, optimizer = create(name, args, mesh)
    data_sharding = NamedSharding(mesh, P(MESH_AXES, None))
    main_process = jax.process_index() == 0

    def put(b):  # a batch every process holds whole (validation): each places its rows
        return jax.make_array_from_callback(b.shape, data_sharding, lambda idx: b[idx])

    put_train = _batch_putter(mesh, corpus.train, args)
    val = lm_data.eval_batches(corpus.val, args.batch, args.seq_len, args.eval_batches)
    ckpt = out / "ckpt" / name
    mngr = (lm_checkpoint.manager(ckpt, args.keep_checkpoints)
            if args.ckpt_every or args.resume else None)
    start = 0
    if args.resume:
        start = lm_checkpoint.restore(mngr, model, optimizer)
        if main_process:
            print(lm_checkpoint.resume_message(name, mngr, start, mesh))
    if start >= args.steps and main_process:
        print(f"[{name}] checkpoint at step {start} already reaches --steps {args.steps}.")
    record = lm_checkpoint.settings(name, args)
    save = ((lambda s: lm_checkpoint.save(mngr, s, model, optimizer, mesh, record))
            if args.ckpt_every else None)
    tokens_per_step = args.batch * args.seq_len
    flops_per_step = lm_model.train_flops_per_token(model_config(args), args.seq_len) * (
        tokens_per_step)
    peak = peak_tflops(args)
    peak_total = peak * 1e12 * mesh.devices.size if peak else None
    bar = None
    if not args.no_progress and main_process:
        from tqdm.auto import tqdm

        bar = tqdm(total=args.steps, initial=start, desc=name, unit="step", dynamic_ncols=True)
    last, step_times = {}, []
    # Steps that compile: the first, and under PGLE the profiled ones and the recompile after.
    warm_steps = 1 + (jax.config.jax_pgle_profiling_runs + 1 if jax.config.jax_enable_pgle
                      else 0)
    with jax.set_mesh(mesh):
        for step in range(start + 1, args.steps + 1):
            t0 = time.perf_counter()
            batch = put_train(step)
            if unreduced_grads(args):
                m = train_step_unreduced(model, optimizer, batch, args.aux_loss, args.z_loss,
                                         args.router_optimizer)
            else:
                m = train_step(model, optimizer, batch, args.aux_loss, args.z_loss)
            rec = {"optimizer": name, "step": step, "train_loss": _host(m["loss"]),
                   "load_balance_loss": _host(m["load_balance_loss"]),
                   "dropped_tokens": int(_host(m["dropped_tokens"]))}
            dt = time.perf_counter() - t0  # the step alone: no evaluation or checkpoint
            step_times.append(dt)
            if not math.isfinite(rec["train_loss"]):
                raise FloatingPointError(f"[{name}] loss became {rec['train_loss']} at step {step}")
            rec["step_s"] = dt
            if step - start <= warm_steps:
                rec["compiles"] = True  # compilation (or PGLE's profiling) included
            rec["tokens_per_s"] = tokens_per_step / max(dt, 1e-9)
            if step % args.eval_every == 0 or step == args.steps:
                rec["val_loss"] = evaluate(model, val, put)
                rec["val_bits_per_byte"] = rec["val_loss"] / math.log(2)
            if metrics_file is not None:
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
            if save and (step % args.ckpt_every == 0 or step == args.steps):
                save(step)
            last = rec
            if args.stop_after is not None and step >= args.stop_after:
                if save and step % args.ckpt_every and step != args.steps:
                    save(step)
                break
            if bar is not None:
                recent = step_times[warm_steps:][-20:] or step_times
                tok_s = tokens_per_step * len(recent) / sum(recent)
                mfu = f"{flops_per_step / tokens_per_step * tok_s / peak_total:.3f}" if (
                    peak_total) else "n/a"
                bar.update(1)
                bar.set_postfix(loss=f"{rec['train_loss']:.3f}", tok_s=f"{tok_s:.0f}", mfu=mfu)
    if mngr is not None:
        mngr.wait_until_finished()
        mngr.close()
    if bar is not None:
        bar.close()
    if "val_loss" not in last:
        with jax.set_mesh(mesh):
            last["val_loss"] = evaluate(model, val, put)
        last["val_bits_per_byte"] = last["val_loss"] / math.log(2)
    timed = step_times[warm_steps:]  # without the steps that compile
    tok_s = tokens_per_step * len(timed) / sum(timed) if timed else None
    return {
        "final_val_loss": last["val_loss"],
        "final_val_bits_per_byte": last["val_bits_per_byte"],
        "final_train_loss": last.get("train_loss"),
        "steps": args.steps,
        "steps_run": len(step_times),
        "last_step": last.get("step", start),
        "stopped_early": last.get("step", start) < args.steps,
        "tokens": tokens_per_step * args.steps,
        "lr": args.lr if name == "muon" else args.adam_lr,
        "adam_part_lr": muon_adam_lr(args) if name == "muon" else None,
        "tokens_per_s": tok_s,
        "flops_per_token": flops_per_step / tokens_per_step,
        "peak_tflops_per_device": peak,
        "mfu": flops_per_step / tokens_per_step * tok_s / peak_total if (
            tok_s and peak_total) else None,
        "first_step_s": step_times[0] if step_times else None,
        "wall_s": time.perf_counter() - t_start,
    }


def setup(args) -> tuple[jax.sharding.Mesh, lm_data.Corpus]:
    """The mesh and the corpus for ``args``; raises :class:`UsageError` on flags that clash."""
    mesh = build_mesh(args.mesh, explicit=unreduced_grads(args))
    n_dev = mesh.devices.size
    if args.batch % n_dev:
        raise UsageError(
            f"--batch {args.batch} must be divisible by the {n_dev} devices of the "
            f"('data', 'expert') mesh {tuple(mesh.devices.shape)}: the batch is split over both."
        )
    if args.experts % mesh.shape["expert"]:
        raise UsageError(
            f"--experts {args.experts} must be divisible by the expert axis size "
            f"{mesh.shape['expert']} (set --mesh or --experts)."
        )
    configure_pgle(args.pgle, devices=n_dev)  # before the first compile
    corpus = lm_data.load_stdlib_corpus(
        max_bytes=int(args.max_corpus_mb * (1 << 20)) if args.max_corpus_mb > 0 else None
    )
    return mesh, corpus


def describe(args, mesh, corpus) -> str:
    """Two lines: mesh, corpus, model size and the resolved learning rates."""
    counts = lm_model.param_counts(model_config(args))
    peak = peak_tflops(args)
    lrs = []  # only the runs this invocation trains
    if args.optimizer in ("muon", "both"):
        lrs.append(f"Muon run {args.lr:.3g} (AdamW part {muon_adam_lr(args):.3g}, router on "
                   f"{args.router_optimizer})")
    if args.optimizer in ("adamw", "both"):
        lrs.append(f"AdamW run {args.adam_lr:.3g}")
    return (
        f"mesh {dict(mesh.shape)} on {jax.default_backend()}; corpus "
        f"{corpus.train.size / 1e6:.1f} MB train ({corpus.num_train_files} files), "
        f"{corpus.val.size / 1e6:.2f} MB val ({corpus.num_val_files} files) from {corpus.root}\n"
        f"preset {args.preset}: d_model {args.d_model}, {args.layers} layers, {args.experts} "
        f"experts top-{args.top_k} ({counts['total'] / 1e6:.1f}M params, "
        f"{counts['active'] / 1e6:.1f}M active), batch {args.batch} x {args.seq_len}, "
        f"{args.steps} steps, {args.dtype}, dispatch {'fp8' if args.fp8_dispatch else 'bf16'}, "
        f"FP8 GEMMs {args.fp8_gemms}, projections {args.fp8_projections}; peak lr: "
        + "; ".join(lrs) + "; peak "
        f"{f'{peak:g} TFLOP/s per device' if peak else 'unknown (MFU n/a)'}"
    )


class _Tee:
    """Writes to a stream and a log file (``--process-logs``)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.log.write(text)
        self.log.flush()
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def main(argv=None) -> int:
    try:
        args = checked_args(argv)
    except UsageError as e:
        return usage_error(e)
    multi = args.coordinator_address is not None or cluster_environment() is not None
    if multi and lm_supervise.WORKER_ENV not in os.environ and (
            not jax.distributed.is_initialized()):
        # This process becomes a supervisor of itself: see lm_supervise for why.
        return lm_supervise.supervise(str(pathlib.Path(__file__).resolve()),
                                      list(sys.argv[1:] if argv is None else argv),
                                      pathlib.Path(args.out), log=args.process_logs)
    if lm_supervise.WORKER_ENV in os.environ:
        lm_supervise.watch_parent()
    try:
        joined = init_distributed(args)
    except Exception as e:  # unreachable coordinator, timeout: one line, not a C++ trace
        print(f"train_lm.py: error: jax.distributed could not start ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else e}); check --coordinator-address and "
              f"that all {args.num_processes or '?'} processes started within --init-timeout "
              f"{args.init_timeout} s.", file=sys.stderr)
        return 1
    if joined is not None:
        lm_supervise.report_identity(jax.process_index(), jax.process_count())
    out = pathlib.Path(args.out)
    if args.process_logs:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        log = (out / "logs" / f"process_{jax.process_index()}.log").open("a")
        sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
    try:
        mesh, corpus = setup(args)
    except UsageError as e:
        return usage_error(e)
    main_process = jax.process_index() == 0
    out.mkdir(parents=True, exist_ok=True)
    if main_process:
        print(describe(args, mesh, corpus) + (
            f"\n{jax.process_count()} processes ({joined}), {jax.local_device_count()} "
            "devices each" if jax.process_count() > 1 else ""), flush=True)
    names = lm_checkpoint.run_names(args)
    metrics_path = out / "metrics.jsonl"
    kept = lm_metrics.read_metrics(metrics_path) if args.resume and main_process else []
    results = {}
    t0 = time.perf_counter()
    with (metrics_path.open("w") if main_process else open(os.devnull, "w")) as f:
        for name in names:
            resume_step = 0
            if args.resume:
                resume_step = max(lm_checkpoint.saved_steps(out / "ckpt" / name), default=0)
            for r in kept:  # keep the history up to the checkpoint we resume from
                if r["optimizer"] == name and r["step"] <= resume_step:
                    f.write(json.dumps(r) + "\n")
            try:
                results[name] = train_one(name, args, mesh, corpus, out, f)
            except UsageError as e:  # a checkpoint from before settings.json that does not fit
                return usage_error(e)
    if not main_process:  # process 0 writes the metrics, the plot and the summary
        return 0
    records = lm_metrics.read_metrics(metrics_path)
    lm_metrics.plot(records, out / "loss.png")
    finished = len(results) == 2 and not any(r["stopped_early"] for r in results.values())
    race, no_race = lm_metrics.adamw_loss_race(records) if finished else (None, None)
    summary = {"args": vars(args), "mesh": dict(mesh.shape), "backend": jax.default_backend(),
               "processes": jax.process_count(),
               "device_kind": jax.devices()[0].device_kind,
               "params": lm_model.param_counts(model_config(args)),
               "pgle": bool(jax.config.jax_enable_pgle),
               "overlap_chunks": model_config(args, mesh).overlap_chunks,
               "wall_s": time.perf_counter() - t0, "results": results,
               "time_to_adamw_final_loss": race, "time_to_adamw_final_loss_note": no_race}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for name, r in results.items():
        mfu = f"MFU {r['mfu']:.3f}" if r["mfu"] is not None else "MFU n/a"
        tok_s = f"{r['tokens_per_s']:.0f} tokens/s" if r["tokens_per_s"] else "tokens/s n/a"
        where = "final" if not r["stopped_early"] else (
            f"stopped at step {r['last_step']} of {args.steps}; continue with --resume;")
        print(f"{name:>6}: {where} validation loss {r['final_val_loss']:.4f} nats/byte = "
              f"{r['final_val_bits_per_byte']:.4f} bits/byte ({tok_s}, {mfu}, "
              f"{r['wall_s']:.0f} s)")
    if finished:
        d = results["adamw"]["final_val_loss"] - results["muon"]["final_val_loss"]
        print(f"Muon {'beats' if d > 0 else 'trails'} AdamW by {abs(d):.4f} nats/byte at "
              f"{args.steps} steps.")
        if no_race:
            print(no_race)
        elif race:
            print(f"Muon reached AdamW's final validation loss between "
                  f"{race['muon_time_to_adamw_final_loss_after_s']:.3g} and "
                  f"{race['muon_time_to_adamw_final_loss_s']:.3g} s of training (evaluations "
                  f"{args.eval_every} step{'s' if args.eval_every > 1 else ''} apart), "
                  f"{race['muon_time_to_adamw_final_loss_fraction_after']:.2f}-"
                  f"{race['muon_time_to_adamw_final_loss_fraction']:.2f}x AdamW's "
                  f"{race['adamw_train_s']:.3g} s.")
    print(f"wrote {metrics_path}, {out / 'loss.png'}, {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
