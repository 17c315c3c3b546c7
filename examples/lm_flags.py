"""The trainer's command line (examples/train_lm.py): its flags, presets and their checks.

`parse_args` reads the flags, fills what a flag leaves unset from the ``--preset`` and the
learning-rate rule (`default_lrs`), and raises `UsageError` (one line, no traceback) for a bad
flag or combination. Nothing here imports JAX (or anything heavy): the trainer checks its
command line before JAX starts, so a bad flag is reported in a fraction of a second.
"""

from __future__ import annotations

import argparse
import difflib
import pathlib

from lm_cluster import add_process_flags, process_flags_error

DESCRIPTION = "Train a byte-level MoE language model with sharded Muon (and/or AdamW) on real text."

MESH_AXES = ("data", "expert")
OPTIMIZERS = ("muon", "adamw", "both")
NS_METHODS = ("auto", "standard", "gram")
"""``--ns-method`` choices: ``muon_jax.newton_schulz.NS_METHODS``, spelled out here so that the
flags are checked without importing JAX (a test keeps the two equal)."""
KEEP_CHECKPOINTS = 2
"""Checkpoints kept per run by default (the newest ones; ``--keep-checkpoints``)."""

PRESETS: dict[str, dict] = {
    # 2 CPU cores, 8 simulated devices.
    "cpu": dict(steps=300, batch=32, seq_len=128, d_model=128, layers=2, heads=4, d_ff=128,
                experts=8, top_k=2, fp8_block_size=32, dtype="float32"),
    # One H200 (or any GPU with >= 40 GB): ~70M active of ~430M params, 64k tokens a step.
    "gpu": dict(steps=300, batch=64, seq_len=1024, d_model=1024, layers=8, heads=8, d_ff=1024,
                experts=16, top_k=2, fp8_block_size=128, dtype="bfloat16"),
}
"""Model, batch and step count per ``--preset``; an explicit flag overrides its entry."""

FP8_GEMMS: dict[str, tuple[str, str, str]] = {  # recipe: forward, dgrad, wgrad GEMM dtypes
    "none": ("bf16", "bf16", "bf16"),
    "forward": ("fp8", "bf16", "bf16"),
    "forward_dgrad": ("fp8", "fp8", "bf16"),
    "all": ("fp8", "fp8", "fp8"),
}
"""``--fp8-gemms`` / ``--fp8-projections`` recipes: which expert / attention-projection GEMMs
take FP8 operands ('bf16': the compute dtype)."""

class UsageError(ValueError):
    """A bad flag: reported as one line, without a traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line, exit status 2
        raise UsageError(message)

    def unknown(self, extra: list[str]) -> UsageError:
        """The error for arguments no flag takes: the first of them, the flag it most likely
        meant, and where the flags are listed."""
        word = extra[0]
        if not word.startswith("-"):
            return UsageError(f"unexpected argument {word!r} (the trainer takes flags only; "
                              "train_lm.py --help lists them).")
        name = word.split("=", 1)[0]
        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        close = difflib.get_close_matches(name.replace("_", "-"), flags, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        return UsageError(f"unknown flag {name} ({hint}train_lm.py --help lists the flags).")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` except where the default is ``None`` (set by the preset/rule)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)



def _symmetric_blocks(value: str):
    """``--ns-symmetric-blocks``: 'auto', 'tiles' or an int >= 1."""
    if value in ("auto", "tiles"):
        return value
    try:
        blocks = int(value)
    except ValueError:
        blocks = 0
    if blocks < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'tiles' or an int >= 1, got "
                                         f"{value!r}")
    return blocks


def _chunk_bytes(value: str):
    """``--muon-chunk-bytes``: 'auto' or an int >= 0."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a byte count >= 0 (0: one "
                                         f"collective per stack), got {value!r}")
    return n


def _preset_help(name: str, what: str = "") -> str:
    vals = ", ".join(f"{p} {PRESETS[p][name]}" for p in PRESETS)
    return f"{what}{'; ' if what else ''}default from --preset ({vals})"


def _check_mesh(args) -> None:
    """``--mesh``'s form, and what a given mesh asks of ``--batch`` and ``--experts`` (its
    device count is checked once JAX has started: ``train_lm.build_mesh``)."""
    try:
        shape = tuple(int(s) for s in args.mesh.split(","))
    except ValueError:
        raise UsageError(
            f"--mesh must look like 'data,expert' (e.g. 2,4), got {args.mesh!r}.") from None
    if len(shape) != 2 or min(shape) < 1:
        raise UsageError(f"--mesh needs two positive sizes 'data,expert', got {args.mesh!r}.")
    if args.batch % (shape[0] * shape[1]):
        raise UsageError(
            f"--batch {args.batch} must be divisible by the {shape[0] * shape[1]} devices of "
            f"--mesh {args.mesh}: the batch is split over both axes.")
    if args.experts % shape[1]:
        raise UsageError(f"--experts {args.experts} must be divisible by the expert axis size "
                         f"{shape[1]} of --mesh {args.mesh} (set --mesh or --experts).")


def default_lrs(d_model: int) -> tuple[float, float]:
    """The default peak learning rates ``(muon_lr, adam_lr)`` for a model of width ``d_model``.

    ``muon_lr = 0.02 * min(1, 128 / d_model)`` and ``adam_lr = 6e-3 * min(1, 128 / d_model)``:
    both scale as 1 / width from the CPU default (d_model 128), and both go through the
    optima measured by 300-step sweeps of the two presets (BENCHMARKS.md). CPU preset: Muon
    best at 0.02 of {0.01, 0.02, 0.04}, AdamW at 6e-3 of {1.5e-3, 3e-3, 6e-3, 1.2e-2}. GPU
    preset (d_model 1024, one H200): AdamW best at 7.5e-4 of {3.75e-4, 7.5e-4, 1.5e-3, 3e-3},
    Muon's 2.5e-3 within 0.006 nats/byte of its best, 5e-3, of {1.25e-3, 2.5e-3, 5e-3}; a
    width-independent Muon 0.02 stalled there. The presets also differ in depth, batch and
    sequence length, so this is a rule through two measured points, not a width-only law;
    other sizes are interpolated.
    """
    shrink = min(1.0, 128 / d_model)
    return 0.02 * shrink, 6e-3 * shrink


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(description=DESCRIPTION, formatter_class=_HelpFormatter)
    p.add_argument("--preset", choices=tuple(PRESETS), default="cpu",
                   help="model, batch and steps for a 2-core CPU or one GPU; flags override")
    p.add_argument("--optimizer", default="both", help="muon | adamw | both")
    p.add_argument("--steps", type=int, help=_preset_help("steps"))
    p.add_argument("--batch", type=int, help=_preset_help("batch", "global batch (sequences)"))
    p.add_argument("--seq-len", type=int, help=_preset_help("seq_len"))
    p.add_argument("--d-model", type=int, help=_preset_help("d_model"))
    p.add_argument("--layers", type=int, help=_preset_help("layers"))
    p.add_argument("--heads", type=int, help=_preset_help("heads"))
    p.add_argument("--d-ff", type=int, help=_preset_help("d_ff", "expert hidden width"))
    p.add_argument("--experts", type=int, help=_preset_help("experts"))
    p.add_argument("--top-k", type=int, help=_preset_help("top_k"))
    p.add_argument("--capacity-factor", type=float, default=2.0,
                   help="expert capacity over the balanced share: the drop limit of the dense "
                        "transport, the first bucket of the dropless one (which the layer's "
                        "transport='auto' runs on one Hopper GPU); <= 0: C = all tokens")
    p.add_argument("--fp8-dispatch", action=argparse.BooleanOptionalAction, default=True,
                   help="FP8 e4m3 tokens on the expert all-to-all (default on)")
    p.add_argument("--fp8-gemms", choices=tuple(FP8_GEMMS), default="none",
                   help="expert GEMMs on FP8 operands (rowwise scales): none; forward; "
                        "forward_dgrad (+ data gradients); all (+ weight gradients, the fastest "
                        "measured on one H200)")
    p.add_argument("--fp8-projections", choices=tuple(FP8_GEMMS), default="none",
                   help="attention's QKV and output projections on FP8 operands (moe.fp8_dense, "
                        "rowwise scales), the same recipes as --fp8-gemms")
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"), default="auto",
                   help="attention kernel: cudnn (fused flash attention), xla (einsums) or auto "
                        "(cudnn on NVIDIA GPUs in bf16)")
    p.add_argument("--fp8-block-size", type=int, help=_preset_help("fp8_block_size"))
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help=_preset_help("dtype", "compute dtype (params stay float32)"))
    p.add_argument("--tie-embeddings", action="store_true", help="share the embedding and head")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="token streams each layer runs in turn, so that one stream's expert "
                        "exchange can run under another's attention and GEMMs (lm_model's "
                        "micro_batches; for an expert axis of several devices)")
    p.add_argument("--overlap-chunks", default="auto",
                   help="chunks each MoE layer pipelines its exchange in (moe's "
                        "DispatchOptions.overlap_chunks: an int or auto)")
    p.add_argument("--pgle", choices=("auto", "on", "off"), default="auto",
                   help="JAX's profile-guided latency estimation (jax_enable_pgle): the first "
                        "steps are profiled and the step is compiled again with the measured "
                        "times, so XLA's scheduler sees how long each exchange takes and hides "
                        "it; auto: on for a GPU run of one process over several devices")
    p.add_argument("--lr", type=float, help="the Muon run's peak learning rate, shared by its "
                   "hidden matrices and its AdamW part (embeddings, head, norms); default: "
                   "0.02 * min(1, 128 / d_model)")
    p.add_argument("--adam-lr", type=float, help="the AdamW run's peak learning rate; default: "
                   "6e-3 * min(1, 128 / d_model)")
    p.add_argument("--muon-adam-lr", type=float, help="the Muon run's AdamW part, if not --lr")
    p.add_argument("--router-optimizer", choices=("muon", "adamw"), default="muon",
                   help="which optimizer trains the MoE router kernels in the Muon run (muon ended "
                        "lower on both presets: BENCHMARKS.md)")
    p.add_argument("--muon-gather-dtype", choices=("auto", "float32", "bfloat16"),
                   default="auto",
                   help="dtype Muon's updates travel back from their owner devices in "
                        "(muon_jax.muon's gather_dtype; auto: bfloat16 for float32 params "
                        "after 16-bit Newton-Schulz, half the bytes of float32)")
    p.add_argument("--muon-reduce-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype Muon's data-parallel gradients are summed in. float32: XLA "
                        "all-reduces every gradient in the backward pass, as for AdamW. "
                        "bfloat16 (--optimizer muon only): an Explicit mesh, and the step "
                        "differentiates w.r.t. muon_jax.reduced_view of Muon's matrices "
                        "(router kernels excepted), so their gradients arrive unreduced and "
                        "Muon reduce-scatters them to their owners in bf16 (muon_jax.muon's "
                        "reduce_dtype; half the bytes)")
    p.add_argument("--muon-chunk-bytes", type=_chunk_bytes, default="auto",
                   help="bytes of one of Muon's owner collectives (muon_jax.ShardingOptions' "
                        "chunk_bytes; 0: one per stack of same-shape matrices). A chunk holds "
                        "consecutive matrices of its stack, so with one layer's matrices per "
                        "chunk its gradients' reduction, Newton-Schulz and gather wait only "
                        "for that layer and run under the backward pass of the layers before "
                        "it. auto: one layer's expert banks when the batch is split over "
                        "several 'data' devices, else 0")
    p.add_argument("--ns-method", choices=NS_METHODS,
                   default="auto",
                   help="Muon's Newton-Schulz: standard, its Gram form, or auto (standard "
                        "today; muon_jax.muon's ns_method)")
    p.add_argument("--ns-symmetric-blocks", type=_symmetric_blocks, default="auto",
                   help="Newton-Schulz's symmetric products: auto, an int >= 1 of row strips "
                        "(1 computing every tile), or tiles (the symmetric-tile GPU kernel; "
                        "muon_jax.muon's ns_symmetric_blocks)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="decoupled, both optimizers")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then cosine")
    p.add_argument("--aux-loss", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--z-loss", type=float, default=1e-3, help="router z-loss weight")
    p.add_argument("--mesh", default=None, help="'data,expert' sizes, e.g. 2,4 (default: "
                   "2,4 on CPU; 1,<all devices> on GPU/TPU)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak TFLOP/s per device for MFU (default: by device kind, "
                   "e.g. 989 on H100/H200; none on CPU, where MFU is n/a)")
    p.add_argument("--eval-every", type=int, default=50, help="validation every N steps")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches")
    p.add_argument("--ckpt-every", type=int, default=100, help="0: no checkpoints")
    p.add_argument("--keep-checkpoints", type=int, default=KEEP_CHECKPOINTS,
                   help="checkpoints kept per optimizer, the newest ones (0: keep all)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (with a checkpoint) after this step; the learning-rate schedule "
                   "still spans --steps, so --resume later continues the same run")
    p.add_argument("--seed", type=int, default=0, help="init and batch order")
    add_process_flags(p)
    p.add_argument("--process-logs", action="store_true",
                   help="also write each process's output to OUT/logs/process_<id>.log")
    p.add_argument("--max-corpus-mb", type=float, default=16.0, help="<= 0: all")
    p.add_argument("--out", default="runs/train_lm", help="output directory")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    args, extra = p.parse_known_args(argv)
    if extra:
        raise p.unknown(extra)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.optimizer not in OPTIMIZERS:
        raise UsageError(
            f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {args.optimizer!r}."
        )
    if args.muon_reduce_dtype != "float32" and args.optimizer != "muon":
        raise UsageError(
            f"--muon-reduce-dtype {args.muon_reduce_dtype} needs --optimizer muon (got "
            f"{args.optimizer}): it changes how Muon's gradients are summed, and the run then "
            "uses an Explicit mesh that the AdamW run does not."
        )
    for name in ("steps", "batch", "seq_len", "d_model", "layers", "heads", "d_ff", "experts",
                 "top_k", "micro_batches", "fp8_block_size", "eval_every", "eval_batches"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0 steps, got {args.warmup}.")
    if args.stop_after is not None and args.stop_after < 1:
        raise UsageError(f"--stop-after must be a step >= 1, got {args.stop_after}.")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise UsageError(f"--peak-tflops must be > 0, got {args.peak_tflops:g}.")
    if args.d_model % args.heads or (args.d_model // args.heads) % 2:
        raise UsageError(f"--d-model {args.d_model} must split into --heads {args.heads} heads of "
                         "an even width (rotary embeddings); choose --heads dividing "
                         f"{args.d_model} with an even quotient.")
    if args.fp8_dispatch and args.d_model % args.fp8_block_size:
        raise UsageError(
            f"--d-model {args.d_model} must be a multiple of --fp8-block-size "
            f"({args.fp8_block_size}) with FP8 dispatch; or pass --no-fp8-dispatch."
        )
    if args.mesh is not None:
        _check_mesh(args)
    if pathlib.Path(args.out).exists() and not pathlib.Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a file; pass a directory (it is created).")
    if args.overlap_chunks != "auto":
        try:
            args.overlap_chunks = int(args.overlap_chunks)
        except ValueError:
            raise UsageError(f"--overlap-chunks must be an int >= 1 or 'auto', got "
                             f"{args.overlap_chunks!r}.") from None
        if args.overlap_chunks < 1:
            raise UsageError(f"--overlap-chunks must be >= 1, got {args.overlap_chunks}.")
    if args.batch % args.micro_batches:
        raise UsageError(f"--batch ({args.batch}) must be a multiple of --micro-batches "
                         f"({args.micro_batches}).")
    if args.top_k > args.experts:
        raise UsageError(f"--top-k ({args.top_k}) cannot exceed --experts ({args.experts}).")
    if (error := process_flags_error(args)) is not None:
        raise UsageError(error)
    if args.keep_checkpoints < 0:
        raise UsageError(f"--keep-checkpoints must be >= 0 (0 keeps all), got "
                         f"{args.keep_checkpoints}.")
    if args.ckpt_every < 0:
        raise UsageError(f"--ckpt-every must be >= 0 (0: no checkpoints), got {args.ckpt_every}.")
    muon_lr, adam_lr = default_lrs(args.d_model)
    args.lr = muon_lr if args.lr is None else args.lr
    args.adam_lr = adam_lr if args.adam_lr is None else args.adam_lr
    return args
