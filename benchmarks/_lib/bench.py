"""The benchmark scripts' plumbing: command line, simulated CPU devices, timing, ceilings,
routing, accuracy, JSON, the printed table. Importing it imports JAX without starting its
backend, so a script may still simulate CPU devices (:func:`parse`) first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from _lib import ROOT

LIBRARY = ("moe", "muon_jax", "xla_comm", "examples", "accel_kernels")
"""The source folders the benchmarks measure (a run's ``env.dirty`` says if any had edits)."""


# Record labels of the XLA grouped GEMMs of the two token layouts: (implementation, x rank).
GEMM_LABELS = {"einsum": ("xla", 3), "ragged_dot": ("xla", 2)}


def implementation(label: str) -> str:
    return GEMM_LABELS.get(label, (label,))[0]


def parser(doc: str, paragraphs: int = 1) -> argparse.ArgumentParser:
    """A parser described by the first ``paragraphs`` of a script's docstring, with ``--small``,
    ``--cpu-devices``, ``--warmup``, ``--iters``, ``--seed`` and ``--out``."""
    p = argparse.ArgumentParser(description="\n\n".join(doc.split("\n\n")[:paragraphs]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true",
                   help="CPU plumbing run at tiny sizes on simulated devices (numbers mean "
                        "nothing)")
    p.add_argument("--cpu-devices", type=int, default=None, help="simulated devices (--small)")
    p.add_argument("--warmup", type=int, help="untimed calls first")
    p.add_argument("--iters", type=int, help="timed calls (or interleaved rounds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="JSON path ('' to write none)")
    return p


def parse(p: argparse.ArgumentParser, argv, *, small: dict, full: dict,
          cpu_devices: int = 2) -> argparse.Namespace:
    """Parse ``argv``; options left unset take their ``small`` (``--small``) or ``full`` value
    (a key of ``full`` that ``p`` has no option for gets one, its help those two values). With
    ``--small``, JAX runs on ``--cpu-devices`` simulated CPU devices."""
    defined = vars(p.parse_known_args([])[0])
    for k, v in full.items():
        if k not in defined:
            p.add_argument(f"--{k.replace('_', '-')}", type=type(v),
                           help=f"{v}; small {small.get(k, v)}")
    a = p.parse_args(argv)
    for k, v in (small if a.small else full).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.warmup is None:
        a.warmup = 1 if a.small else 3
    if a.iters is None:
        a.iters = 2 if a.small else 10
    if a.small:
        simulate_cpu(a.cpu_devices or cpu_devices)
    return a


def simulate_cpu(n: int) -> None:
    """Run JAX on ``n`` simulated CPU devices (before its backend starts)."""
    jax.config.update("jax_platforms", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"


def settings(a: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(a).items() if k != "out"}


def git(*args: str, tree=ROOT) -> str | None:
    """``git -C tree ARGS``'s output, or None where git fails or is missing."""
    try:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def commit(tree=ROOT) -> str:
    """A tree's commit: a ``COMMIT`` file (an exported copy), else ``git rev-parse`` (where
    the tree has its own ``.git``: an export inside a checkout is not that checkout)."""
    if (tree / "COMMIT").exists():
        return (tree / "COMMIT").read_text().strip()
    if not (tree / ".git").exists():
        return "unknown"
    return git("rev-parse", "--short=7", "HEAD", tree=tree) or "unknown"


def dirty() -> bool | None:
    """Whether the measured folders (:data:`LIBRARY`) have uncommitted edits (None: no git)."""
    out = git("status", "--porcelain", "--", *LIBRARY)
    return None if out is None else bool(out)


def env() -> dict:
    """Backend, device kind and count, versions, and the commit of the tree that ran."""
    devs = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devs[0].device_kind,
            "n_devices": len(devs), "jax": jax.__version__, "python": platform.python_version(),
            "commit": commit(), "dirty": dirty(), "date": time.strftime("%Y-%m-%d"),
            "argv": ["python3", *sys.argv]}


def library_root():
    """The tree whose packages this process imports (another tree's under an A/B run's
    ``PYTHONPATH``): its ``examples/`` go with them."""
    import importlib.util
    import pathlib

    return pathlib.Path(importlib.util.find_spec("moe").origin).parents[1]


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def write_json(path: str | None, report: dict) -> None:
    """Write ``report`` atomically (a run cut short keeps its last complete version)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.tmp", "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    os.replace(f"{path}.tmp", path)


def print_table(rows: list[dict], cols: list[str], fmt: str = "{:.4g}") -> None:
    """``rows`` as an aligned text table of the columns ``cols`` (numbers through ``fmt``)."""
    def cell(v):
        return fmt.format(v) if isinstance(v, float) else "-" if v is None else str(v)

    body = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(cols, *body, strict=True)]
    for line in [cols, ["-" * w for w in widths], *body]:
        print("  ".join(x.rjust(w) if i else x.ljust(w)
                        for i, (x, w) in enumerate(zip(line, widths, strict=True))))


def median_seconds(fn: Callable, args, warmup: int, iters: int, inner: int = 1) -> float:
    """Median seconds per call of ``fn(*args)`` after ``warmup`` calls; each timed sample is
    ``inner`` back-to-back calls blocked once (launch gaps between calls not counted)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(inner)])
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, *, inner: int = 1,
                warmup: int = 1, sync: Callable[[object], object] = jax.block_until_ready
                ) -> dict[str, list[float]]:
    """Seconds per call of each ``fn()``, timed A B A B: one sample of each per round (``inner``
    calls, then ``sync``), so drift during the run hits every side alike."""
    for fn in fns.values():
        for _ in range(warmup):
            sync(fn())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            sync([fn() for _ in range(inner)])
            times[k].append((time.perf_counter() - t0) / inner)
    return times


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in times.items()}


def dense_ceiling(n: int, warmup: int, iters: int, *, dtype: str = "bf16", inner: int = 3) -> dict:
    """A dense ``[n, n] @ [n, n]`` on device 0 (f32 accumulation, bf16 out), the rate MFU is
    measured against; ``dtype='fp8'``: e4m3 operands, the second K-major (as FP8 cores read)."""
    ka, kb = jax.random.split(jax.random.key(1))
    dev = jax.devices()[0]
    a = jax.device_put(jax.random.normal(ka, (n, n), jnp.bfloat16), dev)
    b = jax.device_put(jax.random.normal(kb, (n, n), jnp.bfloat16), dev)
    contract = ((1,), (0,))
    if dtype == "fp8":
        a, b, contract = a.astype(jnp.float8_e4m3fn), b.T.astype(jnp.float8_e4m3fn), ((1,), (1,))
    mm = jax.jit(lambda a, b: jax.lax.dot_general(
        a, b, (contract, ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    sec = median_seconds(mm, (a, b), warmup, iters, inner)
    return {"name": f"dense_{dtype}", "n": n, "ms": sec * 1e3, "tflops": 2.0 * n**3 / sec / 1e12}


def ceilings(report: dict, n: int, small: bool, dtypes=("bf16", "fp8")) -> dict:
    """The dense ceilings of this process: ``report['ceilings']`` rows and
    ``report['dense_{bf16,fp8}_tflops']``; returns ``report``."""
    report["ceilings"] = []
    for dtype in dtypes:
        c = dense_ceiling(n, 1 if small else 3, 2 if small else 10, dtype=dtype,
                          inner=1 if small else 3)
        report["ceilings"].append(c)
        report[f"dense_{dtype}_tflops"] = c["tflops"]
        print(f"ceiling {dtype}: {c['tflops']:.1f} TFLOP/s ({n}^3)", flush=True)
    return report


def compile_with(lowered, opts: dict | None):
    """``(lowered.compile(opts), dropped)``: options this XLA refuses (it names them in its
    error) are dropped and listed, so a report says what was applied."""
    opts, dropped = dict(opts or {}), []
    while True:
        try:
            return (lowered.compile(compiler_options=opts) if opts else lowered.compile(), dropped)
        except Exception as err:
            bad = [k for k in opts if k in str(err)]
            if not bad:
                raise
            dropped.append(bad[0])
            opts.pop(bad[0])


def group_sizes(routing: str, tokens: int, groups: int, s: float = 1.0,
                align: int = 1) -> np.ndarray:
    """Rows per group summing to ``tokens`` (multiples of ``align``): ``'balanced'``, or
    ``'zipf'`` (share of group i ~ 1 / i^s); the first group takes the remainder."""
    if routing not in ("balanced", "zipf"):
        raise ValueError(f"routing={routing!r}; use 'balanced' or 'zipf'.")
    p = np.full(groups, 1.0) if routing == "balanced" else 1.0 / np.arange(1, groups + 1) ** s
    sizes = np.floor(p / p.sum() * tokens / align).astype(np.int64) * align
    sizes[0] += tokens - sizes.sum()
    return sizes.astype(np.int32)


def normal(key, shape, scale: float = 1.0, dtype=jnp.bfloat16):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def padded(x, sizes: np.ndarray):
    """The rows of ``x``, in groups of ``sizes``, as ``[E, C, d]`` (C the largest; zero fill)."""
    c = int(sizes.max())
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    idx = np.where(np.arange(c) < sizes[:, None], starts[:, None] + np.arange(c), len(x))
    return jnp.take(x, jnp.asarray(idx), axis=0, mode="fill", fill_value=0)


def fwd_bwd(f: Callable, n: int) -> Callable:
    """Jitted ``(*xs, ct) -> (y, gradients of sum(y * ct) w.r.t. the first n xs)``, y = f(*xs)."""
    def loss(*xs):
        y = f(*xs[:-1])
        return jnp.sum(y.astype(jnp.float32) * xs[-1].astype(jnp.float32)), y

    return jax.jit(lambda *xs: (lambda r: (r[0][1], *r[1]))(
        jax.value_and_grad(loss, argnums=tuple(range(n)), has_aux=True)(*xs)))


def line_mesh(axes=("data", "expert"), devices=None) -> jax.sharding.Mesh:
    """Mesh ``(1, devices)`` over ``axes`` (Auto axis types; default: every device)."""
    devices = devices or jax.devices()
    return jax.make_mesh((1, len(devices)), axes, axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devices)


def accuracy(got, want) -> dict:
    """Worst cosine and relative RMS error over the leaves of ``got`` against ``want``."""
    cos, rel = [], []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64).ravel(), np.asarray(w, np.float64).ravel()
        nw = max(np.linalg.norm(w), 1e-30)
        cos.append(float(g @ w / max(np.linalg.norm(g) * nw, 1e-30)))
        rel.append(float(np.linalg.norm(g - w) / nw))
    return {"worst_cos_vs_bf16": min(cos), "worst_rel_rms_vs_bf16": max(rel)}


def max_rel_err(got, want) -> float:
    """``max |got - want| / max |want|`` in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def layer_data(mesh, tokens: int, d: int, e: int, f: int | None, seed: int) -> dict:
    """The MoE layer's inputs on ``mesh`` (tokens over every axis, expert banks over 'expert'):
    ``x``, ``ct`` [n, tokens, d] bf16, the f32 router kernel and, with ``f``, the banks."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n, ks = mesh.devices.size, jax.random.split(jax.random.key(seed), 5)
    tok, wsp = P(tuple(mesh.axis_names), None, None), P("expert", None, None)

    def put(fn, spec):
        return jax.jit(fn, out_shardings=NamedSharding(mesh, spec))()

    data = {"x": put(lambda: normal(ks[0], (n, tokens, d)), tok),
            "ct": put(lambda: normal(ks[1], (n, tokens, d)), tok),
            "router_kernel": put(lambda: normal(ks[2], (d, e), d**-0.5, jnp.float32), P())}
    if f:
        data["w_gate_up"] = put(lambda: normal(ks[3], (e, d, 2 * f), d**-0.5), wsp)
        data["w_down"] = put(lambda: normal(ks[4], (e, f, d), f**-0.5), wsp)
    return data


def routings(data, experts: int, top_k: int, names, zipf_s: float = 1.0) -> tuple[dict, dict]:
    """``({routing: balancing bias [E]}, {routing: achieved expert shares})``: ``'balanced'``
    (zero bias) and ``'zipf'`` (a bias, which changes the selection only, giving expert i a
    share ~ 1 / (i + 1)^s of these tokens)."""
    import moe

    cfg = moe.RouterConfig(experts, top_k)
    x = data["x"].reshape(-1, data["x"].shape[-1])
    shares = jax.jit(lambda b: moe.route(x, data["router_kernel"], b, config=cfg)
                     .tokens_per_expert / (x.shape[0] * top_k))
    biases, stats = {}, {}
    for name in names:
        bias = np.zeros(experts, np.float32)
        if name == "zipf":
            target = 1.0 / np.arange(1, experts + 1) ** zipf_s
            bias = _calibrate(shares, target / target.sum())
        got = np.asarray(shares(jnp.asarray(bias)))
        biases[name] = bias
        stats[name] = {"shares": [round(float(v), 5) for v in got],
                       "max_over_mean": float(got.max() * got.size)}
        if name == "zipf":
            stats[name]["l1_error"] = float(np.abs(got - target / target.sum()).sum())
    return biases, stats


def _calibrate(shares: Callable, target: np.ndarray, iters: int = 400) -> np.ndarray:
    """The least-L1-error bias the aux-loss-free balancing rule aimed at ``target`` reaches
    (``bias += step * sign(target - share)``, the step decaying from 0.05 to 1e-4)."""
    bias = np.zeros(target.size, np.float32)
    best, best_err, step = bias, np.inf, 0.05
    for _ in range(iters):
        got = np.asarray(shares(jnp.asarray(bias)))
        err = float(np.abs(got - target).sum())
        if err < best_err:
            best, best_err = bias.copy(), err
        bias = bias + step * np.sign(target - got).astype(np.float32)
        step *= (1e-4 / 0.05) ** (1.0 / iters)
    return best


def moe_rules():
    """The MoE layer's scopes and kernels as breakdown categories, first match wins."""
    from xla_comm.breakdown import Rule as R

    gathers = r"^(gather|scatter|dynamic-slice|dynamic-update-slice)$"
    return (R("gemm", "kernel", r"^(gmm|gmm_t|tgmm)$"), R("combine", "scope", "/combine"),
            R("gather_scatter", "scope", "dispatch_exchange"),
            R("gather_scatter", "kernel", r"^wire_gather"), R("gather_scatter", "op", gathers),
            R("plan", "scope", "dispatch_plan"), R("router", "scope", "moe_router"),
            R("experts_other", "scope", "/experts_"),  # then unmatched trace events by name:
            R("gemm", "kernel", r"^(dense_)?t?gmm|^anonymous_mosaic_gpu_kernel"))


def lm_regions() -> tuple[dict[str, str], dict[str, str]]:
    """``(regions, kernel_regions)`` of the LM train step: the optimizer runs outside
    value_and_grad (no jvp / transpose in its paths; muon_jax's owner moves and Newton-Schulz
    by their scopes); what no scope of the MoE layer's shard_map claims is ``moe_other``."""
    from xla_comm.breakdown import scope_regex as sr

    return ({"optimizer": sr("muon_owner_step", r"jit\(entry\)", r"jit\(exit_fn\)")
             + r"|^p?jit\([^/()]*\)/(?!.*(?:jvp|transpose)\()",
             "attention": sr("attention"), "shared_experts": sr("moe_shared_experts"),
             "experts": sr(r"experts_\w+"),
             "dispatch_combine": sr(r"dispatch_\w+", r"combine\w*", "moe_router", "router_logits"),
             "moe_other": sr("shard_map")},
            {"experts": r"^anonymous_mosaic_gpu_kernel|^fp8_|^gmm|^tgmm",
             "dispatch_combine": r"^wire_"})


def trace_profile(step, args, trace_dir: str, steps: int, hlo: bool = True, **kw) -> dict:
    """Exposed collective time (and, with ``hlo``, the op breakdown) of ``steps`` traced
    calls of the compiled ``step``; ``{'reason': ...}`` where the profiler fails."""
    from xla_comm.breakdown import op_breakdown
    from xla_comm.trace import exposed_comm_fraction, trace_steps

    err = trace_steps(step, args, trace_dir, steps)
    if err:
        return {"reason": err}
    out = {"overlap": {k: v for k, v in exposed_comm_fraction(trace_dir).items()
                       if k not in ("source", "devices")}}
    if hlo:
        try:
            out["breakdown"] = op_breakdown(trace_dir, step.as_text(), steps=steps,
                                            rules=kw.pop("rules", moe_rules()), **kw)
        except Exception as e:  # noqa: BLE001  (the timings stand whatever the trace holds)
            out["breakdown"] = {"reason": repr(e)[:1000]}
    return out
