"""How a multi-process trainer run finds its processes: the process count a command line or
cluster asks for (read before JAX starts), the cluster environment ``jax.distributed`` can
bootstrap from, and joining the processes (``train_lm.py --coordinator-address``, SLURM,
Open MPI, a Kubernetes indexed Job, a TPU pod).
"""

from __future__ import annotations

import argparse
import os

_CLUSTER_ENV = {"SLURM_NTASKS": "SLURM", "OMPI_COMM_WORLD_SIZE": "Open MPI",
                "JAX_COORDINATOR_ADDRESS": "JAX_COORDINATOR_ADDRESS",
                "TPU_WORKER_HOSTNAMES": "a TPU pod"}


def add_process_flags(p: argparse.ArgumentParser) -> None:
    """The flags that join the processes of a run (:func:`init_distributed` reads them)."""
    p.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="jax.distributed: the coordinator (process 0's host and a free port); "
                        "with --num-processes and --process-id. Without them a cluster "
                        "environment (SLURM, Open MPI, a Kubernetes indexed Job, a TPU pod) is "
                        "detected, else one process")
    p.add_argument("--num-processes", type=int, default=None, help="jax.distributed: processes")
    p.add_argument("--process-id", type=int, default=None, help="jax.distributed: this one's id")
    p.add_argument("--init-timeout", type=int, default=300,
                   help="seconds to wait for every process at start, and without a heartbeat "
                        "from one before every other exits with an error naming it")


def process_flags_error(args: argparse.Namespace) -> str | None:
    """What is wrong with :func:`add_process_flags`' values, or None."""
    given = [args.coordinator_address, args.num_processes, args.process_id]
    if any(v is not None for v in given) and any(v is None for v in given):
        return ("--coordinator-address, --num-processes and --process-id go together "
                "(or give none of them: a cluster environment is detected).")
    if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        return f"--process-id must be in [0, {args.num_processes}), got {args.process_id}."
    if args.init_timeout < 1:
        return f"--init-timeout must be >= 1 second, got {args.init_timeout}."
    return None


def processes_from(argv: list[str]) -> int:
    """The process count a command line (or a cluster's environment) asks for, read before
    JAX starts (the trainer then gives each process its share of the simulated CPU devices)."""
    for i, a in enumerate(argv):
        if a.startswith("--num-processes"):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            return int(value) if value.isdigit() and int(value) > 0 else 1
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    return 1


def cluster_environment() -> str | None:
    """The multi-process launcher jax.distributed would bootstrap from, or None."""
    found = [name for var, name in _CLUSTER_ENV.items() if os.environ.get(var)]
    # Any pod sees KUBERNETES_SERVICE_HOST; only an indexed Job (JobSet) is a cluster of
    # trainer processes jax can bootstrap (it also needs the `kubernetes` package).
    if os.environ.get("KUBERNETES_SERVICE_HOST") and "JOB_COMPLETION_INDEX" in os.environ:
        found.append("Kubernetes")
    if not found or (os.environ.get("SLURM_NTASKS", "2") == "1" and found == ["SLURM"]):
        return None
    return found[0]


def init_distributed(args) -> str | None:
    """Joins the processes of a multi-process run (``jax.distributed``): from the flags, else
    from a cluster environment jax detects (SLURM, Open MPI, a Kubernetes indexed Job, a
    TPU pod); returns how, or None for one process. A process that cannot reach the
    coordinator within ``--init-timeout`` seconds, or loses another one's heartbeat that
    long, exits with jax's error naming the process (``heartbeat_timeout_seconds``); a peer
    lost mid-collective is named by this process's supervisor (``lm_supervise``)."""
    # Imported here, not at the top: the trainer calls processes_from before JAX starts.
    import jax

    if jax.distributed.is_initialized():
        return "already initialized"
    timeouts = dict(initialization_timeout=args.init_timeout,
                    heartbeat_timeout_seconds=args.init_timeout)
    if args.coordinator_address is not None:
        how = f"coordinator {args.coordinator_address}"
        kw = dict(coordinator_address=args.coordinator_address,
                  num_processes=args.num_processes, process_id=args.process_id)
    else:
        found = cluster_environment()
        if found is None:
            return None
        how, kw = f"{found} environment", {}
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU runs across processes
    jax.distributed.initialize(**kw, **timeouts)
    jax_minor = tuple(int(v) for v in jax.__version__.split(".")[:2])
    if (jax.default_backend() == "cpu" and jax_minor >= (0, 12)
            and jax.config.jax_compilation_cache_dir):
        # jax 0.12's CPU processes hang in the first step when their programs come from the
        # persistent compilation cache (a cold cache runs; the next run, all hits, stalls
        # after Gloo connects: tests/examples/test_train_lm_multiprocess.py), so such runs
        # compile instead.
        jax.config.update("jax_enable_compilation_cache", False)
        how += "; persistent compilation cache off (jax >= 0.12 on CPU)"
    return how
