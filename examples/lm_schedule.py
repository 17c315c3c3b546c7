"""How the trainer's step is scheduled (examples/train_lm.py): JAX's profile-guided latency
estimation (``--pgle``) and the MoE layers' chunk count that goes with it.

XLA's latency-hiding scheduler places each async collective by its own estimate of the
transfer time, which for the expert all-to-alls is far below what the links take, so it puts
little compute under them. With ``jax_enable_pgle`` JAX profiles the first steps and compiles
the step again with the measured times, and the exchanges get hidden (BENCHMARKS.md, Overlap).
"""

from __future__ import annotations

import jax

import moe

PGLE_PROFILING_RUNS = 3
"""Steps JAX profiles before it compiles the step again with the measured times (--pgle)."""
PGLE_OVERLAP_CHUNKS = 4
"""The MoE layers' chunk count under --pgle when the expert axis spans several devices (and
each chunk keeps ``moe.options.MIN_CHUNK_TOKENS`` tokens). Scheduled on XLA's own latency
estimates, 4 chunks made this trainer's 8-GPU step longer than the layer's default of 2; on
the measured (here: modeled) transfer times they hid more of the exchange at an equal or
shorter step (docs/benchmark_log.md, Overlap)."""


def use_pgle(choice: str, *, backend: str, devices: int, processes: int) -> bool:
    """Whether a run turns on JAX's profile-guided latency estimation (``--pgle``): JAX then
    profiles the first :data:`PGLE_PROFILING_RUNS` steps and compiles the step again with the
    measured times. ``'auto'`` turns it on for a GPU run of one process over several devices:
    with one device there is nothing to hide, and each process of a multi-process run would
    profile (and schedule) on its own.

    >>> use_pgle("auto", backend="gpu", devices=8, processes=1)
    True
    >>> use_pgle("auto", backend="cpu", devices=8, processes=1)
    False
    """
    if choice != "auto":
        return choice == "on"
    return backend == "gpu" and devices > 1 and processes == 1


def resolve_overlap_chunks(args, mesh: jax.sharding.Mesh, pgle: bool) -> int | str:
    """The MoE layers' ``overlap_chunks`` for a run: ``--overlap-chunks``, or with ``auto``
    the layer's own choice, except :data:`PGLE_OVERLAP_CHUNKS` under PGLE (see there)."""
    if args.overlap_chunks != "auto" or not pgle:
        return args.overlap_chunks
    ep = mesh.shape["expert"]
    tokens = args.batch * args.seq_len // mesh.devices.size // args.micro_batches
    transport = moe.auto_transport(ep)
    if (moe.auto_overlap_chunks(ep, tokens, transport) == 1 or transport != "dense"
            or tokens < PGLE_OVERLAP_CHUNKS * moe.options.MIN_CHUNK_TOKENS):
        return args.overlap_chunks
    return PGLE_OVERLAP_CHUNKS


def configure_pgle(choice: str, *, devices: int) -> bool:
    """Sets ``jax_enable_pgle`` for a run (before its first compile) and returns it.

    ``'on'`` / ``'off'`` override ``JAX_ENABLE_PGLE``; ``'auto'`` turns it on where
    :func:`use_pgle` says and otherwise leaves it as the environment says. The trainer's flags
    keep the choice as given (a sweep's run key compares them); the resolved state lives in
    ``jax.config``.
    """
    if use_pgle(choice, backend=jax.default_backend(), devices=devices,
                processes=jax.process_count()):
        jax.config.update("jax_enable_pgle", True)
        jax.config.update("jax_pgle_profiling_runs", PGLE_PROFILING_RUNS)
    elif choice == "off":
        jax.config.update("jax_enable_pgle", False)
    return bool(jax.config.jax_enable_pgle)
