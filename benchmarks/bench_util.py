"""Plumbing shared by the benchmark scripts: command line, simulated devices, timing, JSON.

Importing this module imports JAX but does not start its backend, so a script may call
`force_cpu_devices` after the import (before its first `jax.devices()`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def cli(doc: str, *, cpu_devices: int = 2) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with ``--small`` and ``--cpu-devices``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--small", action="store_true", help="CPU sizes, simulated devices")
    p.add_argument("--cpu-devices", type=int, default=cpu_devices,
                   help="simulated devices with --small")
    return p


def add_routing_args(p: argparse.ArgumentParser, *, tokens: str, d_model: str) -> None:
    """``--tokens`` / ``--d-model`` (defaults filled later) and ``--experts`` / ``--top-k`` /
    ``--capacity-factor``; ``tokens`` and ``d_model`` are the help texts (their defaults)."""
    p.add_argument("--tokens", type=int, help=f"tokens per device ({tokens})")
    p.add_argument("--d-model", type=int, help=f"d_model ({d_model})")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="dense transport's capacity factor")


def fill_defaults(a: argparse.Namespace, *, small: dict, full: dict) -> argparse.Namespace:
    """Set each option left at None to its ``small`` (with ``--small``) or ``full`` value."""
    for k, v in (small if a.small else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def force_cpu_devices(n: int = 8) -> None:
    """Simulate ``n`` CPU devices (call before JAX initializes its backend)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def line_mesh(axes: tuple[str, str] = ("data", "expert")) -> jax.sharding.Mesh:
    """Mesh (1, all devices) over ``axes``, Auto axis types."""
    n = len(jax.devices())
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((1, n), axes, axis_types=auto, devices=jax.devices())


def median_seconds(fn: Callable, args, warmup: int, iters: int) -> tuple[float, list[float]]:
    """Median wall time of ``fn(*args)`` after ``warmup`` calls; each call blocked until ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def dense_ceiling(n: int, warmup: int, iters: int, seed: int = 123, inner: int = 5, *,
                  dtype: str = "bf16") -> dict:
    """Dense [n, n] @ [n, n] on device 0, f32 accumulation, bf16 out: TFLOP/s per device.

    ``dtype='bf16'``: bf16 operands; ``'fp8'``: float8_e4m3fn operands, the second one K-major
    (what FP8 tensor cores read; on Hopper XLA emits cuBLASLt's FP8 GEMM). Each timed sample
    is ``inner`` back-to-back calls, blocked once; the median sample / inner.
    """
    dev = jax.devices()[0]
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.device_put(jax.random.normal(ka, (n, n), jnp.bfloat16), dev)
    b = jax.device_put(jax.random.normal(kb, (n, n), jnp.bfloat16), dev)
    contract = ((1,), (0,))
    if dtype == "fp8":
        a, b, contract = a.astype(jnp.float8_e4m3fn), b.T.astype(jnp.float8_e4m3fn), ((1,), (1,))

    @jax.jit
    def mm(a, b):
        out = jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)
        return out.astype(jnp.bfloat16)

    def calls(a, b):  # back-to-back calls per sample: launch latency is not counted
        return [mm(a, b) for _ in range(inner)]

    sec, _ = median_seconds(calls, (a, b), warmup, iters)
    sec /= inner
    return {"name": f"dense_{dtype}_matmul_{n}^3", "n": n, "seconds": sec,
            "calls_per_sample": inner, "tflops": 2.0 * n**3 / sec / 1e12}


def compile_with(lowered, opts: dict | None):
    """``lowered.compile(compiler_options=opts)``, dropping options this XLA does not know.

    Returns ``(compiled, dropped)``; ``dropped`` lists the option names XLA refused (XLA names
    an unknown option in its error message), so a report can say what was really applied.
    """
    opts, dropped = dict(opts or {}), []
    while True:
        try:
            return (lowered.compile(compiler_options=opts) if opts else lowered.compile(),
                    dropped)
        except Exception as err:
            bad = [k for k in opts if k in str(err)]
            if not bad:
                raise
            dropped.append(bad[0])
            opts.pop(bad[0])


def env_info() -> dict:
    """Backend, device kind and count, JAX and Python versions."""
    devs = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devs[0].device_kind,
            "n_devices": len(devs), "jax": jax.__version__,
            "python": platform.python_version()}


def write_json(path: str | None, report: dict) -> None:
    """Write ``report`` atomically (so a timeout mid-run leaves the last complete version)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    os.replace(tmp, path)

