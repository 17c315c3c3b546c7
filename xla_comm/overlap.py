"""XLA flags that let async collectives overlap compute on GPU, and a safe way to set them.

XLA reads `XLA_FLAGS` once, when the first backend is created, so the flags must be in the
environment before any JAX computation runs (or in the environment of a fresh process).
`overlap_flags()` returns the recommended set; `enable_overlap()` appends them to
`os.environ['XLA_FLAGS']` and refuses (ValueError) once a backend exists. Check the effect with
`xla_comm.schedule.schedule_report(compiled, hardware).exposed_fraction` (time the compute
stream waits for collectives, under a cost and a link model) on the GPU.

The flags (all verified to parse in jaxlib 0.10.2 and 0.11.2; an unknown flag aborts XLA at
startup):
  --xla_gpu_enable_latency_hiding_scheduler=true   schedule compute between start and done
  --xla_gpu_all_reduce_combine_threshold_bytes=B    combine small collectives into buckets of
  --xla_gpu_all_gather_combine_threshold_bytes=B    up to B bytes (fewer launches, better
  --xla_gpu_reduce_scatter_combine_threshold_bytes=B   bandwidth; too large delays overlap)
  --xla_gpu_enable_highest_priority_async_stream=true  collectives on a high-priority stream
  --xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}=true  (pipelined=True)
     move collectives of scanned layers across loop iterations.
  --xla_gpu_experimental_parallel_collective_overlap_limit=N  (parallel_collectives=N > 1)
     let the scheduler keep N async collectives in flight at once instead of one: a pipelined
     MoE layer then runs chunk i+1's dispatch and chunk i-1's combine under chunk i's GEMMs.
     Their transfers still share the links (the schedule replay queues them on one link).

References:
  XLA latency-hiding scheduler and GPU flag guidance (openxla.org/xla/flags_guidance,
    openxla.org/xla/gpu_optimization_levels); JAX "GPU performance tips".
  Rajbhandari et al., "ZeRO" (2020): sharded optimizer communication that overlap hides.
"""

from __future__ import annotations

import os

import jax

__all__ = ["backend_initialized", "enable_overlap", "overlap_compiler_options", "overlap_flags"]


def overlap_flags(
    combine_threshold_bytes: int = 64 * 1024 * 1024,
    *,
    pipelined: bool = False,
    high_priority_stream: bool = True,
    parallel_collectives: int = 1,
) -> tuple[str, ...]:
    """The recommended XLA:GPU flags for overlapping async collectives with compute.

    Args:
      combine_threshold_bytes: bucket size for the all-reduce / all-gather / reduce-scatter
        combiners (bytes, > 0).
      pipelined: also pipeline data-parallel collectives across while-loop iterations
        (helps scanned layers; increases HLO size and compile time).
      high_priority_stream: run collectives on the highest-priority async stream.
      parallel_collectives: async collectives the latency-hiding scheduler may keep in flight
        at once (XLA's default: 1, each window closes before the next opens).

    Returns:
      A tuple of `--flag=value` strings.

    Example:
      >>> " ".join(overlap_flags(32 << 20))  # doctest: +ELLIPSIS
      '--xla_gpu_enable_latency_hiding_scheduler=true ...'

    References:
      XLA latency-hiding scheduler (openxla.org/xla/flags_guidance).
    """
    if int(combine_threshold_bytes) <= 0:
        raise ValueError(
            f"overlap_flags: combine_threshold_bytes={combine_threshold_bytes} must be a "
            "positive byte count, e.g. 64 * 1024 * 1024."
        )
    n = parallel_collectives
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"overlap_flags: parallel_collectives={n!r} must be an int >= 1 (1: "
                         "XLA's default, one async collective in flight).")
    b = int(combine_threshold_bytes)
    flags = [
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        f"--xla_gpu_all_reduce_combine_threshold_bytes={b}",
        f"--xla_gpu_all_gather_combine_threshold_bytes={b}",
        f"--xla_gpu_reduce_scatter_combine_threshold_bytes={b}",
    ]
    if high_priority_stream:
        flags.append("--xla_gpu_enable_highest_priority_async_stream=true")
    if pipelined:
        flags += [
            "--xla_gpu_enable_pipelined_all_gather=true",
            "--xla_gpu_enable_pipelined_reduce_scatter=true",
            "--xla_gpu_enable_pipelined_all_reduce=true",
        ]
    if n > 1:
        flags.append(f"--xla_gpu_experimental_parallel_collective_overlap_limit={n}")
    return tuple(flags)


def overlap_compiler_options(
    combine_threshold_bytes: int = 64 * 1024 * 1024,
    *,
    pipelined: bool = False,
    high_priority_stream: bool = True,
    parallel_collectives: int = 1,
) -> dict[str, bool | int]:
    """`overlap_flags` as per-compilation options (no restart, no XLA_FLAGS).

    For ``jax.jit(f).lower(*args).compile(compiler_options=...)``: the same debug options,
    applied to one executable, so a process can compile with and without them.

    Args:
      combine_threshold_bytes, pipelined, high_priority_stream, parallel_collectives: as in
        `overlap_flags`.

    Returns:
      A dict of XLA debug-option names to bool / int values.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones(4)
      >>> compiled = jax.jit(jnp.sin).lower(x).compile(
      ...     compiler_options=overlap_compiler_options())
      >>> overlap_compiler_options(1 << 20)["xla_gpu_all_gather_combine_threshold_bytes"]
      1048576

    References:
      XLA latency-hiding scheduler (openxla.org/xla/flags_guidance).
    """
    out: dict[str, bool | int] = {}
    for flag in overlap_flags(
        combine_threshold_bytes, pipelined=pipelined, high_priority_stream=high_priority_stream,
        parallel_collectives=parallel_collectives,
    ):
        name, value = flag.lstrip("-").split("=", 1)
        out[name] = value == "true" if value in ("true", "false") else int(value)
    return out


def backend_initialized() -> bool:
    """Whether a JAX backend already exists (so XLA_FLAGS changes would be ignored).

    Probes the public `jax_num_cpu_devices` option, whose validator rejects a changed value
    once backends are initialized; the value is restored when no backend exists yet.

    Returns:
      True when a backend has been created in this process.

    Example:
      >>> _ = jax.devices()
      >>> backend_initialized()
      True

    References:
      JAX configuration options (`jax_num_cpu_devices`).
    """
    old = jax.config.jax_num_cpu_devices
    probe = old + 1 if old >= 0 else 1
    try:
        jax.config.update("jax_num_cpu_devices", probe)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", old)
    return False


def enable_overlap(
    combine_threshold_bytes: int = 64 * 1024 * 1024,
    *,
    pipelined: bool = False,
    high_priority_stream: bool = True,
    parallel_collectives: int = 1,
) -> str:
    """Append `overlap_flags(...)` to `os.environ['XLA_FLAGS']`; call before any JAX work.

    Flags already present in XLA_FLAGS (same name) are left as the user set them.

    Args:
      combine_threshold_bytes, pipelined, high_priority_stream, parallel_collectives: as in
        `overlap_flags`.

    Returns:
      The new value of XLA_FLAGS.

    Raises:
      ValueError: a JAX backend is already initialized (XLA has read its flags); call this
        at the top of the script, or set XLA_FLAGS in the environment of a new process.

    Example:
      First thing in a script: ``from xla_comm import overlap; overlap.enable_overlap()``.
      Once JAX has a backend it refuses:

      >>> _ = jax.devices()
      >>> enable_overlap()  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: enable_overlap: the JAX backend is already initialized, ...

    References:
      XLA latency-hiding scheduler (openxla.org/xla/flags_guidance).
    """
    flags = overlap_flags(
        combine_threshold_bytes, pipelined=pipelined, high_priority_stream=high_priority_stream,
        parallel_collectives=parallel_collectives,
    )
    if backend_initialized():
        raise ValueError(
            "enable_overlap: the JAX backend is already initialized, so XLA has read "
            "XLA_FLAGS and new flags would be ignored. Call xla_comm.overlap.enable_overlap() "
            "before any JAX computation (right after import), or start a new process with "
            f"XLA_FLAGS='{' '.join(flags)}'."
        )
    current = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in current}
    added = [f for f in flags if f.split("=", 1)[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(current + added)
    return os.environ["XLA_FLAGS"]
