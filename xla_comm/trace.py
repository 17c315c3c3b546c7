"""Read `jax.profiler` traces: their files, kernel events, and exposed collective time.


``jax.profiler.trace(dir)`` writes ``dir/plugins/profile/<run>/<host>.trace.json.gz`` (Chrome
trace events; ``perfetto_trace.json.gz`` is the same without metadata) and
``<host>.xplane.pb``. On GPU each device is a process (plane) named ``/device:GPU:<i>...``
whose lines include one per CUDA stream (``Stream #<n>(...)``) carrying the kernels, plus
derived lines (``XLA Ops``, ``XLA Modules``, ``Steps``, ...) that repeat the same time at op
level.

Overlap (`exposed_comm_fraction`). For each device, collective kernels are those whose name
matches ``collective_pattern`` (default ``nccl``, case-insensitive), memory copies/sets are
neither, every other stream kernel is compute. With ``C`` = union of collective intervals and
``K`` = union of compute intervals, ``exposed = |C \\ K|`` is collective time during which no
compute kernel runs on any stream of that device, and ``hidden_fraction = 1 - exposed / |C|``.
An NCCL kernel's duration includes waiting for its peers, so "collective time" is the time a
collective kernel occupies a stream, not wire time.

Where the device time goes, per op category and named-scope region, is `xla_comm.breakdown`.

Example:
  >>> interval_union([(0, 2), (1, 3), (5, 6)])
  [(0, 3), (5, 6)]
"""

from __future__ import annotations

import gzip
import json
import os
import re
import warnings
from collections.abc import Iterable
from pathlib import Path

__all__ = ["exposed_comm_fraction", "find_trace_files", "interval_union", "load_kernel_events",
           "op_events", "trace_steps"]

# ----------------------------------------------------------------------------- trace files

DEFAULT_COLLECTIVE = r"nccl"
# Op-level names of collectives, used only where a device has no stream lines (e.g. TPU).
OP_COLLECTIVE = r"nccl|all-to-all|all-reduce|all-gather|reduce-scatter|collective-permute|" \
    r"ragged-all-to-all|send|recv"
_COPY = re.compile(r"^\s*(memcpy|memset|cuMemcpy|cuMemset)", re.IGNORECASE)
_STREAM = re.compile(r"^\s*stream\b", re.IGNORECASE)
_OP_LINE = "XLA Ops"

Interval = tuple[float, float]


def find_trace_files(trace_dir: str | os.PathLike) -> tuple[str, list[Path]]:
    """The trace files of the newest profile run under ``trace_dir``.

    Args:
      trace_dir: a ``jax.profiler.trace`` directory, a run folder inside it, or one file.

    Returns:
      ``(format, files)``: format ``'json'`` (``*.trace.json.gz`` / ``*.trace.json``, else
      ``perfetto_trace.json.gz``) or ``'xplane'`` (``*.xplane.pb``); ``('none', [])`` if
      there is none.
    """
    p = Path(trace_dir)
    if p.is_file():
        return ("xplane" if p.name.endswith(".xplane.pb") else "json"), [p]
    if not p.is_dir():
        return "none", []
    candidates = [f for pat in ("*.trace.json.gz", "*.trace.json", "perfetto_trace.json.gz",
                                "*.xplane.pb") for f in p.rglob(pat)]
    if not candidates:
        return "none", []
    newest = max({f.parent for f in candidates}, key=lambda d: max(
        f.stat().st_mtime for f in candidates if f.parent == d))
    in_run = [f for f in candidates if f.parent == newest]
    for pats, fmt in ((("*.trace.json.gz", "*.trace.json"), "json"),
                      (("perfetto_trace.json.gz",), "json"), (("*.xplane.pb",), "xplane")):
        files = sorted({f for f in in_run if any(f.match(pt) for pt in pats)})
        if files:
            return fmt, files
    return "none", []


def _json_events(path: Path):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs: dict = {}
    threads: dict = {}
    for ev in events:
        if ev.get("ph") != "M":
            continue
        name = (ev.get("args") or {}).get("name")
        if ev.get("name") == "process_name":
            procs[ev.get("pid")] = name
        elif ev.get("name") == "thread_name":
            threads[(ev.get("pid"), ev.get("tid"))] = name
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        pid = ev.get("pid")
        start = float(ev["ts"])
        yield (str(procs.get(pid, pid)), str(threads.get((pid, ev.get("tid")), ev.get("tid"))),
               str(ev.get("name", "")), start, start + float(ev["dur"]))


def _xplane_events(path: Path):
    from jax.profiler import ProfileData  # public since jax 0.4.3x

    data = ProfileData.from_file(str(path))
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                start = ev.start_ns / 1e3
                yield plane.name, line.name, ev.name, start, start + ev.duration_ns / 1e3


def load_kernel_events(trace_dir: str | os.PathLike, device_prefix: str = "/device:"):
    """The events of the device processes (planes) of the newest run under ``trace_dir``.

    Args:
      trace_dir: as for `find_trace_files`.
      device_prefix: process (plane) name prefix of devices.

    Returns:
      ``(format, files, {device: {line: [(name, start_us, end_us), ...]}})``.
    """
    fmt, files = find_trace_files(trace_dir)
    reader = _xplane_events if fmt == "xplane" else _json_events
    out: dict[str, dict[str, list]] = {}
    for f in files:
        for proc, line, name, s, e in reader(f):
            if not proc.startswith(device_prefix):
                continue
            out.setdefault(proc, {}).setdefault(line, []).append((name, s, e))
    return fmt, files, out


# ----------------------------------------------------------------------------- overlap


def interval_union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of ``[start, end)`` intervals.

    Args:
      intervals: ``(start, end)`` pairs; empty ones (``end <= start``) are dropped.

    Returns:
      The union as a sorted list of disjoint ``(start, end)`` pairs.
    """
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _measure(union: list[Interval]) -> float:
    return sum(e - s for s, e in union)


def _subtract_measure(a: list[Interval], b: list[Interval]) -> float:
    """|A \\ B| for disjoint sorted unions A and B."""
    total, j = 0.0, 0
    for s, e in a:
        covered = 0.0
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            covered += min(e, b[k][1]) - max(s, b[k][0])
            k += 1
        total += (e - s) - covered
    return total


def exposed_comm_fraction(
    trace_dir: str | os.PathLike,
    *,
    collective_pattern: str = DEFAULT_COLLECTIVE,
    device_prefix: str = "/device:",
) -> dict:
    """Collective time not overlapped by compute, from a jax.profiler trace directory.

    Args:
      trace_dir: the directory given to ``jax.profiler.trace`` / ``start_trace`` (the newest
        run under it is read), a run folder, or one trace file.
      collective_pattern: regex (case-insensitive) naming collective kernels.
      device_prefix: process (plane) name prefix of devices.

    Returns:
      dict with ``exposed_fraction`` (exposed / collective time, summed over devices; None when
      there are no collective kernels, with ``reason``), ``hidden_fraction``,
      ``collective_us``, ``exposed_collective_us``, ``compute_us``, ``span_us`` (sums over
      devices), ``exposed_over_span``, per-device figures under ``devices``, ``source``,
      ``format``.
    """
    coll_re = re.compile(collective_pattern, re.IGNORECASE)
    op_coll_re = re.compile(collective_pattern + "|" + OP_COLLECTIVE, re.IGNORECASE)
    try:
        fmt, files, devices = load_kernel_events(trace_dir, device_prefix)
    except Exception as err:  # unreadable trace: report, don't crash a benchmark
        return {"exposed_fraction": None, "hidden_fraction": None, "devices": {},
                "reason": f"could not read trace under {trace_dir}: {err!r}"}
    result: dict = {"source": [str(f) for f in files], "format": fmt, "devices": {}}
    totals = dict(collective_us=0.0, exposed_collective_us=0.0, compute_us=0.0, span_us=0.0)
    for dev, lines in sorted(devices.items()):
        streams = {ln: evs for ln, evs in lines.items() if _STREAM.match(ln)}
        level, pattern = "kernel", coll_re
        if not streams and _OP_LINE in lines:  # no stream lines: fall back to op level
            streams, level, pattern = {_OP_LINE: lines[_OP_LINE]}, "op", op_coll_re
        coll, comp, n_coll, n_comp = [], [], 0, 0
        for evs in streams.values():
            for name, s, e in evs:
                if pattern.search(name):
                    coll.append((s, e))
                    n_coll += 1
                elif not _COPY.match(name):
                    comp.append((s, e))
                    n_comp += 1
        if not coll and not comp:
            continue
        cu, ku = interval_union(coll), interval_union(comp)
        both = interval_union(coll + comp)
        c_t, k_t = _measure(cu), _measure(ku)
        exposed = _subtract_measure(cu, ku)
        span = both[-1][1] - both[0][0] if both else 0.0
        result["devices"][dev] = dict(
            level=level, n_collective_kernels=n_coll, n_compute_kernels=n_comp,
            collective_us=c_t, compute_us=k_t, exposed_collective_us=exposed, span_us=span,
            busy_us=_measure(both),
            exposed_fraction=exposed / c_t if c_t > 0 else None,
            hidden_fraction=1 - exposed / c_t if c_t > 0 else None,
        )
        for k in totals:
            totals[k] += result["devices"][dev][k]
    result.update(totals)
    c = totals["collective_us"]
    result["exposed_fraction"] = totals["exposed_collective_us"] / c if c > 0 else None
    result["hidden_fraction"] = 1 - result["exposed_fraction"] if c > 0 else None
    span = totals["span_us"]
    result["exposed_over_span"] = totals["exposed_collective_us"] / span if span > 0 else None
    if fmt == "none":
        result["reason"] = f"no trace files under {trace_dir}"
    elif not result["devices"]:
        result["reason"] = (f"no kernel events on '{device_prefix}*' processes (CPU backend "
                            "traces have none)")
    elif c == 0:
        result["reason"] = f"no kernels matching {collective_pattern!r} on any device stream"
    return result


def _has_stream_events(plane) -> bool:
    return any(line.name.lower().startswith("stream") and next(iter(line.events), None)
               is not None for line in plane.lines)


def op_events(trace_dir) -> list[tuple]:
    """``[(device, line, name, hlo_op or None, hlo_module or None, duration_us)]`` of the
    newest XPlane under ``trace_dir``: GPU stream lines of ``/device:*`` planes, or (no
    device plane with stream events: CPU) every host event that names an HLO op."""
    from jax.profiler import ProfileData

    fmt, files = find_trace_files(trace_dir)
    if fmt != "xplane":
        files = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    out = []
    for f in files:
        data = ProfileData.from_file(str(f))
        planes = list(data.planes)
        # A GPU's plane can be present and empty when the program ran on the CPU (a GPU
        # machine with JAX_PLATFORMS=cpu): only planes with stream events count.
        devices = [p for p in planes if p.name.startswith("/device:") and _has_stream_events(p)]
        for plane in devices or planes:
            for line in plane.lines:
                if devices and not line.name.lower().startswith("stream"):
                    continue
                for ev in line.events:
                    try:
                        with warnings.catch_warnings():  # the profiler binding's SWIG types
                            warnings.simplefilter("ignore", DeprecationWarning)
                            stats = dict(ev.stats)
                    except Exception:  # stats are best effort
                        stats = {}
                    op = stats.get("hlo_op")
                    if not devices and op is None:
                        continue
                    out.append((plane.name, line.name, ev.name, op, stats.get("hlo_module"),
                                ev.duration_ns / 1e3))
    return out


def trace_steps(step, args, trace_dir: str, steps: int) -> str | None:
    """Run ``step(*args)`` once, then ``steps`` times under ``jax.profiler.trace``.

    Args:
      step: a callable (e.g. a compiled executable).
      args: its arguments.
      trace_dir: where ``jax.profiler.trace`` writes.
      steps: how many traced calls.

    Returns:
      None, or why the profiler failed (the caller keeps its timings either way).
    """
    import jax

    jax.block_until_ready(step(*args))
    try:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                jax.block_until_ready(step(*args))
    except Exception as err:  # noqa: BLE001
        return f"profiler failed: {err!r}"
    return None
