"""Plumbing shared by the benchmark scripts: command line, simulated devices, timing, group
sizes, accuracy against a reference, JSON. A library (no command line of its own).

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
import numpy as np


def cli(description: str, *, cpu_devices: int = 2,
        parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """A parser (or ``parser``) with ``description`` kept as written, ``--small`` and
    ``--cpu-devices``."""
    p = parser or argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CPU sizes, simulated devices")
    p.add_argument("--cpu-devices", type=int, default=cpu_devices,
                   help="simulated devices with --small")
    return p


def part_args(argv, description: str, parts: dict[str, tuple[str, Callable, Callable]],
              default: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Parse ``argv`` for a script of several parts, chosen by ``--part``.

    ``parts`` maps each name to ``(summary, add_args(parser), finish(parser, args) -> args)``;
    the parser of the chosen part (``default`` if none) has ``description``, then that part's
    summary, and only that part's options (``--part NAME --help`` lists them).
    Returns ``(parser, args)``; ``args.part`` is the part's name.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--part", choices=list(parts), default=default)
    part = pre.parse_known_args(argv)[0].part
    summary, add_args, finish = parts[part]
    p = argparse.ArgumentParser(
        description=f"{description}\n\noptions of --part {part}: {summary}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=list(parts), default=default,
                   help=f"what to measure (default {default}; --part NAME --help: its options)")
    add_args(p)
    return p, finish(p, p.parse_args(argv))


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


def per_call_seconds(fn: Callable, args, warmup: int, iters: int, inner: int = 3) -> float:
    """Median seconds per call of ``fn(*args)``, each timed sample ``inner`` back-to-back calls
    blocked once (so launch gaps between calls are not counted)."""
    def calls(*xs):
        return [fn(*xs) for _ in range(inner)]
    return median_seconds(calls, args, warmup, iters)[0] / inner


def interleaved_seconds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list]:
    """Wall seconds of each ``fn()`` of ``fns`` timed interleaved: one call of each per round,
    each blocked until ready, so clock or link drift during the run hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
    return times


def group_sizes(routing: str, tokens: int, groups: int, s: float = 1.0,
                align: int = 1) -> np.ndarray:
    """Tokens per group (multiples of ``align``, int32) summing to ``tokens``: ``'balanced'``
    (equal) or ``'zipf'`` (``p_i ~ 1 / i^s``); the first group takes the remainder."""
    if routing == "balanced":
        p = np.full(groups, 1.0 / groups)
    elif routing == "zipf":
        p = 1.0 / np.arange(1, groups + 1) ** s
        p /= p.sum()
    else:
        raise ValueError(f"routing={routing!r}; use 'balanced' or 'zipf'.")
    sizes = np.floor(p * tokens / align).astype(np.int64) * align
    sizes[0] += tokens - sizes.sum()
    return sizes.astype(np.int32)


def y_and_grads(loss: Callable, *args, argnums=(0, 1, 2)):
    """``(y, *d loss / d args[argnums])`` of a ``loss`` returning ``(value, y)``."""
    (_, y), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*args)
    return (y, *grads)


def leaf_errors(got, want) -> list[tuple[float, float]]:
    """``(cosine, relative RMS error)`` of every leaf of ``got`` against ``want``."""
    out = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64).ravel(), np.asarray(w, np.float64).ravel()
        out.append((float(g @ w / max(np.linalg.norm(g) * np.linalg.norm(w), 1e-30)),
                    float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))))
    return out


def accuracy(got, want) -> dict:
    """Worst cosine and relative RMS error over the leaves of ``got`` against ``want``."""
    cos, rel = zip(*leaf_errors(got, want), strict=True)
    return {"worst_cos_vs_bf16": min(cos), "worst_rel_rms_vs_bf16": max(rel)}


def max_rel_err(got, want) -> float:
    """``max |got - want| / max |want|`` (in float64)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def padded_layout(x, sizes: np.ndarray, capacity: int):
    """Rows ``x [T, d]`` grouped by ``sizes`` into the capacity-padded ``[E, capacity, d]``
    layout (rows past an expert's capacity dropped, padding rows zero)."""
    kept = np.minimum(sizes, capacity)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    c = np.arange(capacity)[None, :]
    src = np.where(c < kept[:, None], starts[:, None] + c, x.shape[0])  # T: out of range
    return jnp.take(x, jnp.asarray(src), axis=0, mode="fill", fill_value=0)


def experts_step(backend: str, group_sizes, **opts) -> Callable:
    """Jitted ``(x, w_gate_up, w_down, ct) -> (y, dx, dw_gate_up, dw_down)`` of
    ``moe.experts.gated_experts(x, group_sizes, ..., backend=backend, **opts)`` and the
    gradients of ``sum(y * ct)``. ``y`` is an output: with only the gradients of this linear
    loss, XLA would drop the forward down GEMM (the cotangent of y is ct, whatever y is)."""
    from moe.experts import gated_experts

    def loss(x, wgu, wd, ct):
        y = gated_experts(x, group_sizes, wgu, wd, backend=backend, **opts)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    return jax.jit(lambda *args: y_and_grads(loss, *args))


def record(report: dict, section: str, entry: dict) -> None:
    """Append ``entry`` to ``report[section]``, rewrite ``report['out']`` and print it."""
    report.setdefault(section, []).append(entry)
    write_json(report["out"], report)
    keys = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in entry.items() if k not in ("options", "group_sizes", "breakdown"))
    print(f"[{section}] {keys}", flush=True)


def ceilings(report: dict, a: argparse.Namespace) -> None:
    """The dense bf16 and FP8 ``a.ceiling_n``-cube matmul ceilings (`dense_ceiling`), each
    sample 3 back-to-back calls (1 with ``a.small``): ``report['dense_{bf16,fp8}_tflops']``
    and rows under ``report['ceilings']``."""
    for dtype in ("bf16", "fp8"):
        c = dense_ceiling(a.ceiling_n, a.warmup, a.iters, seed=1, inner=1 if a.small else 3,
                          dtype=dtype)
        report[f"dense_{dtype}_tflops"] = c["tflops"]
        record(report, "ceilings", {"name": f"dense_{dtype}", "n": c["n"],
                                    "ms": c["seconds"] * 1e3, "tflops": c["tflops"]})


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

