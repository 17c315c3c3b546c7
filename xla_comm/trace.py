"""Read `jax.profiler` traces: exposed collective time, and device time per op category.

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

Breakdown (`op_breakdown`). Every kernel (GPU) or thunk (CPU) event names the HLO instruction
it runs (the ``hlo_op`` stat of the XPlane events; failing that, the kernel name, which XLA
derives from the instruction name). The compiled HLO text of the same executable says what
each instruction is: its opcode, what a fusion contains, the custom call's target / Pallas
kernel name, and the ``jax.named_scope`` path in its ``op_name`` metadata. The event time is
summed per category, first rule that matches:

  exchange        collectives (all-to-all, ragged-all-to-all, all-gather, all-reduce,
                  collective-permute, reduce-scatter, send/recv), NCCL / ragged-all-to-all
                  kernels
  sort            sort (or a fusion holding one; cub radix sort custom calls)
  gemm            dot / convolution (fused too), cuBLAS / cuBLASLt / Triton GEMM custom
                  calls, the Pallas grouped GEMMs (``gmm``, ``gmm_t``, ``tgmm``)
  combine         anything else under the ``combine`` scopes (weighted sums over k, the
                  router gradient, the combine gradient's send rows)
  gather_scatter  anything else under ``dispatch_exchange`` (send rows, expert layout, the
                  dispatch backward's sums), the Pallas wire kernels, and other gathers /
                  scatters / dynamic slices
  plan            anything else under ``dispatch_plan`` (index arithmetic on T*k ints)
  router          anything else under ``moe_router``
  experts_other   anything else under the ``experts_*`` scopes (SwiGLU, masks, casts)
  memcpy          device copies / memsets (e.g. a conditional's predicate read back)
  other           the rest

Optionally (``regions=``) it also sums the time per *region*: ordered ``{label: regex}``
searched in each instruction's named-scope path, its ``op_name``; the first label that matches
wins, else `REST`. A fusion without metadata takes the op_name nearest its called
computation's root, i.e. of what it outputs (XLA fuses producers into their consumer, so the
computation's first op_name, which the category rules fall back to, may be a producer's from
another scope). An op_name that XLA merged (``prefix/(a:b:...)``, e.g. the combined
all-reduce of the gradients) gets the region most of its parts get. An instruction with no
scope at all (XLA drops the metadata of some rewritten dots and of many fusions) takes the
first region that matches the scope of one of its operands, or, if no operand has a scope, of
one of its users. JAX writes the scopes of autodiff passes with the transform around the
first scope inside it: ``jit(step)/jvp(attention)/...`` (forward),
``jit(step)/transpose(jvp(attention))/...`` (backward),
``jit(step)/transpose(jvp())/shard_map/experts_down_wgrad/...``; a custom_vjp's backward may
carry its own scopes without the ``jit(step)/`` prefix (``moe_router/reduce_sum``). So a scope
is matched as a path component, bounded by ``/``, ``(`` or ``)``. Region and category together
split e.g. the experts' time into GEMMs and the rest (quantization, casts). `LM_REGIONS`
suits the train step of examples/lm_model.py (benchmarks/lm_step_bench.py).

Example:
  >>> kernel_category("ncclDevKernel_SendRecv"), kernel_category("gmm_bf16_mosaic_gpu_kernel")
  ('exchange', 'gemm')
  >>> interval_union([(0, 2), (1, 3), (5, 6)])
  [(0, 3), (5, 6)]
"""

from __future__ import annotations

import gzip
import json
import os
import re
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["CATEGORIES", "LM_KERNEL_REGIONS", "LM_REGIONS", "REST", "categorize_hlo",
           "exposed_comm_fraction", "find_trace_files", "format_regions", "format_table",
           "hlo_regions", "interval_union", "kernel_category", "kernel_region",
           "load_kernel_events", "op_breakdown", "trace_steps"]

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


# ----------------------------------------------------------------------------- categories

CATEGORIES = ("exchange", "sort", "gemm", "combine", "gather_scatter", "plan", "router",
              "experts_other", "memcpy", "other")
REST = "rest"  # the region of what no region's pattern matches


def _scope(*names: str) -> str:
    """A regex matching any of ``names`` (regexes) as one component of a named-scope path:
    bounded by the start / end, ``/``, or the parentheses of a transform (``jvp(attention)``)."""
    return r"(?:^|[/(])(?:" + "|".join(names) + r")(?:[/)]|$)"


# The regions of the LM train step (examples/lm_model.py + moe + muon_jax; see
# benchmarks/lm_step_bench.py), first match wins. The optimizer update runs outside
# value_and_grad, so its ops carry no jvp / transpose in their path: ``jit(step)/mul``,
# ``jit(step)/sqrt`` (optax's AdamW), ``jit(step)/jit(entry)/shard_map/...`` and
# ``jit(step)/jit(exit_fn)/shard_map/...`` (muon_jax.owners' moves to and from the owners),
# ``jit(step)/muon_owner_step/...`` (Newton-Schulz). The MoE layer's per-device body is a
# shard_map: what of it no named scope claims (the SwiGLU between the expert GEMMs, masks,
# casts, the aux-loss psums) is ``moe_other``. ``rest``: the dense projections (qkv / out, the
# LM head), norms, embedding, rotary, loss, and the (combined) all-reduce of the replicated
# weights' gradients (most of its merged op_name's parts are dense dot_generals).
LM_REGIONS: dict[str, str] = {
    "optimizer": _scope("muon_owner_step", r"jit\(entry\)", r"jit\(exit_fn\)")
                 + r"|^p?jit\([^/()]*\)/(?!.*(?:jvp|transpose)\()",
    "attention": _scope("attention"),
    "shared_experts": _scope("moe_shared_experts"),
    "experts": _scope(r"experts_\w+"),
    "dispatch_combine": _scope(r"dispatch_\w+", r"combine\w*", "moe_router", "router_logits"),
    "moe_other": _scope("shard_map"),
}
# Events that name no HLO instruction (on GPU: Mosaic GPU and cuBLAS kernels, seen with
# jax 0.11) by kernel name. Mosaic GPU kernels appear as ``<name>_mosaic_gpu_kernel``: the
# expert GEMMs (moe._gmm_mosaic) as ``gmm_*`` / ``tgmm_*``, ``fp8_*`` quantize their operands
# (Triton or Mosaic GPU, ``*_mgpu``; fp8_dense's row kernels carry the same names). The dense
# FP8 projections' GEMMs (``dense_gmm_*``, moe.fp8_dense) and cuBLAS kernels (dense
# projections, attention dots, Newton-Schulz) stay in ``rest``. ``anonymous_*``: the GEMMs of
# trees before the kernels were named (then the projections' ones were counted here too).
LM_KERNEL_REGIONS: dict[str, str] = {
    "experts": r"^anonymous_mosaic_gpu_kernel|^fp8_|^gmm|^tgmm",
    "dispatch_combine": r"^wire_",
}
_COLLECTIVES = {"all-to-all", "ragged-all-to-all", "all-gather", "all-reduce",
                "collective-permute", "reduce-scatter", "send", "recv", "all-gather-start",
                "all-gather-done", "all-reduce-start", "all-reduce-done", "all-to-all-start",
                "all-to-all-done", "collective-permute-start", "collective-permute-done",
                "send-done", "recv-done", "ragged-all-to-all-start", "ragged-all-to-all-done"}
_GATHERS = {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"}
_CONTAINERS = {"conditional", "while", "call", "async-start", "async-done"}
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INST = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"calls=\{?%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# XLA's combiners (e.g. of the gradients' all-reduces) name the merged op "prefix/(a:b:...)".
_MERGED = re.compile(r"^(.*?/)?\((.+:.+)\)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_KERNEL_NAME = re.compile(r'\\?"name\\?"\s*:\s*\\?"([\w.\-]+)')
_GEMM_TARGET = re.compile(r"cublas|gemm|matmul|cudnn\$conv", re.IGNORECASE)
_GEMM_KERNEL = re.compile(r"^(gmm|gmm_t|tgmm)$")
_WIRE_KERNEL = re.compile(r"^wire_gather")
_MEMCPY = re.compile(r"^\s*(memcpy|memset|cumemcpy|cumemset)", re.IGNORECASE)
# Kernel-name fallbacks (no hlo_op stat and no matching instruction).
_NAME_RULES = (
    ("exchange", re.compile(r"nccl|all_?to_?all|all_?gather|all_?reduce|collective|"
                            r"ragged", re.IGNORECASE)),
    ("sort", re.compile(r"sort", re.IGNORECASE)),
    # This library's Mosaic GPU GEMMs: ``(dense_)(t)gmm_<dtype>_mosaic_gpu_kernel`` (anonymous
    # in trees before they were named); its Mosaic GPU row kernels (``fp8_*``) are not GEMMs.
    ("gemm", re.compile(r"gemm|xmma|cutlass|nvjet|sm\d+_.*mma|^(dense_)?t?gmm|matmul|dot|"
                        r"^anonymous_mosaic_gpu_kernel", re.IGNORECASE)),
    ("memcpy", re.compile(r"^\s*(memcpy|memset|cumem)", re.IGNORECASE)),
    ("gather_scatter", re.compile(r"gather|scatter|dynamic_slice|dynamic_update",
                                  re.IGNORECASE)),
)


def kernel_category(name: str) -> str:
    """The category of a kernel that names no HLO instruction, from its name alone.

    Args:
      name: the kernel (event) name.

    Returns:
      One of `CATEGORIES` (``"other"`` if no name rule matches).
    """
    return next((c for c, rx in _NAME_RULES if rx.search(name)), "other")


def kernel_region(name: str, kernel_regions: Mapping[str, str] | None) -> str:
    """The region of a kernel that names no HLO instruction, from its name alone.

    Args:
      name: the kernel (event) name.
      kernel_regions: ordered ``{label: regex}`` over kernel names (e.g.
        `LM_KERNEL_REGIONS`), or None.

    Returns:
      The first label whose regex matches ``name``, else `REST`.
    """
    return next((lb for lb, rx in (kernel_regions or {}).items() if re.search(rx, name)), REST)


def _parse(hlo_text: str):
    """``(instructions, closure, scope_of, out_scope_of)``: name -> (opcode, rest of line) for
    every instruction; ``closure(computation)`` -> the opcodes it and what it calls hold;
    ``scope_of(computation)`` -> the op_name of its root (else of its first instruction that
    has one); ``out_scope_of(computation)`` -> the op_name nearest its root (the root's, else
    the first found walking back from the root through operands; else ``scope_of``'s)."""
    insts: dict[str, tuple[str, str]] = {}
    comp_ops: dict[str, set[str]] = defaultdict(set)
    comp_calls: dict[str, set[str]] = defaultdict(set)
    comp_scope: dict[str, str] = {}
    comp_root: dict[str, str] = {}
    current = None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m:
            current = m.group(1)
            continue
        m = _INST.match(line)
        if not m or current is None:
            continue
        name, opcode, rest = m.group(1), m.group(3), m.group(4)
        insts[name] = (opcode, rest)
        comp_ops[current].add(opcode)
        for c in _CALLS.findall(rest):
            comp_calls[current].add(c)
        is_root = line.lstrip().startswith("ROOT")
        if is_root:
            comp_root[current] = name
        scope = _OP_NAME.search(rest)
        if scope and (current not in comp_scope or is_root):
            comp_scope[current] = scope.group(1)

    def closure(comp, seen=None):  # opcodes of a computation and what it calls (fusions)
        seen = seen or set()
        if comp in seen:
            return set()
        seen.add(comp)
        ops = set(comp_ops.get(comp, ()))
        for c in comp_calls.get(comp, ()):
            ops |= closure(c, seen)
        return ops

    def scope_of(comp):
        return comp_scope.get(comp, "")

    def out_scope_of(comp):  # breadth first from the root, back through the operands
        todo, seen = [comp_root.get(comp)], set()
        while todo:
            name = todo.pop(0)
            if name is None or name in seen or name not in insts:
                continue
            seen.add(name)
            m = _OP_NAME.search(insts[name][1])
            if m:
                return m.group(1)
            todo += _operands(insts[name][1])
        return scope_of(comp)

    return insts, closure, scope_of, out_scope_of


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction (``rest``: its line after ``opcode(``)."""
    return _OPERAND.findall(rest.split(")", 1)[0])


def _classify(hlo_text: str) -> tuple[dict[str, tuple[str | None, str]],
                                      dict[str, list[str]]]:
    """``({instruction: (category, scope)}, {instruction: operand names})`` for every
    instruction of a compiled module's HLO text. ``category``: the rules of the module
    docstring, None for control flow (conditional, while, call), whose work is counted in the
    instructions it runs. ``scope``: the instruction's ``op_name`` ("" if none); a fusion
    without one takes the op_name nearest its called computation's root (what it outputs:
    XLA fuses producers into their consumer, so the first op_name of the computation may be a
    producer's from another scope). The categories keep their rules' own fallback (the root's
    op_name, else the computation's first)."""
    insts, closure, scope_of, out_scope_of = _parse(hlo_text)
    out, operands = {}, {}
    for name, (opcode, rest) in insts.items():
        ops = {opcode}
        m = _OP_NAME.search(rest)
        scope = path = m.group(1) if m else ""
        if opcode == "fusion":
            for c in _CALLS.findall(rest):
                ops |= closure(c)
                scope = scope or scope_of(c)  # fusions may carry no metadata themselves
                path = path or out_scope_of(c)
        target = (_TARGET.search(rest) or [None, ""])[1] if opcode == "custom-call" else ""
        kernel = (_KERNEL_NAME.search(rest) or [None, ""])[1] if opcode == "custom-call" else ""
        if opcode in _CONTAINERS:
            cat = None  # its own event (CPU) spans the events of what it runs
        elif ops & _COLLECTIVES or "nccl" in target.lower():
            cat = "exchange"
        elif "sort" in ops or "sort" in target.lower():
            cat = "sort"
        elif ops & {"dot", "convolution"} or _GEMM_TARGET.search(target) \
                or _GEMM_KERNEL.match(kernel):
            cat = "gemm"
        elif "/combine" in scope:
            cat = "combine"
        elif "dispatch_exchange" in scope or _WIRE_KERNEL.match(kernel) or ops & _GATHERS:
            cat = "gather_scatter"
        elif "dispatch_plan" in scope:
            cat = "plan"
        elif "moe_router" in scope:
            cat = "router"
        elif "/experts_" in scope:
            cat = "experts_other"
        elif opcode in ("copy-start", "copy-done"):
            cat = "memcpy"
        else:
            cat = "other"
        out[name] = (cat, path)
        operands[name] = _operands(rest)
    return out, operands


def categorize_hlo(hlo_text: str) -> dict[str, str | None]:
    """The op category of every instruction of a compiled module.

    Args:
      hlo_text: ``compiled.as_text()`` (the rules are those of the module docstring).

    Returns:
      ``{instruction name: category}``; None for control flow (conditional, while, call),
      whose work is counted in the instructions it runs.
    """
    return {name: cat for name, (cat, _) in _classify(hlo_text)[0].items()}


def _assign_regions(info: dict[str, tuple[str | None, str]], operands: dict[str, list[str]],
                    regions: Mapping[str, str]) -> dict[str, str]:
    """``{instruction: region label}`` (see the module docstring)."""
    rules = [(label, re.compile(rx)) for label, rx in regions.items()]

    def first(scopes):
        return next((lb for lb, rx in rules if any(rx.search(sc) for sc in scopes)), REST)

    def of(scope):
        m = _MERGED.match(scope)
        if not m:
            return first((scope,))
        votes = Counter(first(((m.group(1) or "") + part,)) for part in m.group(2).split(":"))
        return max(votes, key=lambda lb: (votes[lb], -labels.index(lb)))

    labels = [*regions, REST]

    users: dict[str, list[str]] = defaultdict(list)
    for name, ops in operands.items():
        for o in ops:
            users[o].append(name)
    out = {}
    for name, (_, scope) in info.items():
        if scope:
            out[name] = of(scope)
            continue
        near = [info[o][1] for o in operands.get(name, ()) if o in info and info[o][1]]
        near = near or [info[u][1] for u in users.get(name, ()) if info[u][1]]
        out[name] = first(near)
    return out


def hlo_regions(hlo_text: str, regions: Mapping[str, str]) -> dict[str, str]:
    """The region of every instruction of a compiled module, from its named-scope path.

    Args:
      hlo_text: ``compiled.as_text()``.
      regions: ordered ``{label: regex}`` searched in the instruction's named-scope path
        (the module docstring says which path), first match wins.

    Returns:
      ``{instruction name: region label}``, `REST` where no regex matches.
    """
    return _assign_regions(*_classify(hlo_text), regions)


def _has_stream_events(plane) -> bool:
    return any(line.name.lower().startswith("stream") and next(iter(line.events), None)
               is not None for line in plane.lines)


def _events(trace_dir):
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


def op_breakdown(trace_dir, hlo_text: str, *, steps: int = 1, top: int = 12,
                 regions: Mapping[str, str] | None = None,
                 kernel_regions: Mapping[str, str] | None = None) -> dict:
    """Device time per category (and per scope, and the top instructions) of one executable.

    Args:
      trace_dir: the ``jax.profiler.trace`` directory (newest run inside is read).
      hlo_text: ``compiled.as_text()`` of the executable that the trace ran.
      steps: how many calls the trace holds (times are divided by it).
      top: how many of the most expensive instructions to list.
      regions: optional ordered ``{label: regex}`` over the named-scope paths (module
        docstring; e.g. `LM_REGIONS`).
      kernel_regions: optional ordered ``{label: regex}`` over the kernel names of events
        that name no known instruction (e.g. `LM_KERNEL_REGIONS`); unmatched ones go to
        `REST`.

    Returns:
      dict: ``us_per_step`` {category: microseconds per step, summed over devices},
      ``fraction`` {category: share of the total}, ``total_us_per_step``, ``n_devices``,
      ``top_ops`` [(instruction, category, us per step)], ``unmatched_kernels`` (events of no
      known instruction, categorized by kernel name), ``module``. With ``regions`` also
      ``us_per_region`` {label: us per step} (the labels in order, then ``"rest"``, which also
      gets the events of no known instruction), ``region_fraction`` {label: share} and
      ``us_per_region_category`` {label: {category: us per step}} (nonzero ones only), and
      each ``top_ops`` entry gets its region as a fourth element.
    """
    info, operands = _classify(hlo_text)
    cats = {name: cat for name, (cat, _) in info.items()}
    reg = _assign_regions(info, operands, regions) if regions is not None else None
    norm = {k.replace(".", "_").replace("-", "_"): k for k in cats}
    m = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.MULTILINE)
    module = m.group(1) if m else None
    per_cat = dict.fromkeys(CATEGORIES, 0.0)
    labels = [*(regions or {}), *([] if REST in (regions or {}) else [REST])]
    per_region = dict.fromkeys(labels, 0.0)
    per_region_cat: dict[str, dict[str, float]] = {lb: defaultdict(float) for lb in labels}
    per_op: dict[str, float] = defaultdict(float)
    unmatched: dict[str, float] = defaultdict(float)
    devices = set()
    for dev, _line, name, op, mod, us in _events(trace_dir):
        if mod is not None and module is not None and not (
                str(mod).startswith(module) or module.startswith(str(mod))):
            continue  # another executable (e.g. the input setup)
        inst = op if op in cats else norm.get(re.sub(r"[.\-]", "_", name.split("(")[0]))
        if _MEMCPY.match(name):  # e.g. a conditional's predicate read back: its own category
            cat = "memcpy"
        elif inst is not None:
            cat = cats[inst]
            if cat is None:
                continue
            per_op[inst] += us
        else:
            cat = kernel_category(name)
            unmatched[name] += us
        per_cat[cat] += us
        if reg is not None:
            region = reg[inst] if inst is not None else kernel_region(name, kernel_regions)
            per_region[region] += us
            per_region_cat[region][cat] += us
        devices.add(dev)
    total = sum(per_cat.values())
    steps = max(steps, 1)
    out = {
        "module": module,
        "n_devices": len(devices),
        "total_us_per_step": total / steps,
        "us_per_step": {c: v / steps for c, v in per_cat.items()},
        "fraction": {c: (v / total if total else None) for c, v in per_cat.items()},
        "top_ops": [(k, cats[k], v / steps, *(() if reg is None else (reg[k],)))
                    for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])[:top]],
        "unmatched_kernels": {k: v / steps for k, v in
                              sorted(unmatched.items(), key=lambda kv: -kv[1])[:top]},
    }
    if reg is not None:
        out["us_per_region"] = {lb: v / steps for lb, v in per_region.items()}
        out["region_fraction"] = {lb: (v / total if total else None)
                                  for lb, v in per_region.items()}
        out["us_per_region_category"] = {
            lb: {c: per_region_cat[lb][c] / steps for c in CATEGORIES if per_region_cat[lb][c]}
            for lb in labels}
    return out


def format_table(rows: dict[str, dict]) -> str:
    """A text table of `op_breakdown` results, one column each.

    Args:
      rows: ``{label: op_breakdown(...)}``.

    Returns:
      The table: per category ms per step summed over devices and its share, then the total.
    """
    labels = list(rows)
    head = f"{'category':16s}" + "".join(f"{lb[:24]:>26s}" for lb in labels)
    lines = [head, "-" * len(head)]
    for c in CATEGORIES:
        cells = []
        for lb in labels:
            b = rows[lb]
            f = b["fraction"][c]
            share = "-" if f is None else f"{f:5.1%}"
            cells.append(f"{b['us_per_step'][c] / 1e3:10.3f} ms ({share:>6s})")
        lines.append(f"{c:16s}" + "".join(f"{s:>26s}" for s in cells))
    lines.append(f"{'total':16s}" + "".join(
        f"{rows[lb]['total_us_per_step'] / 1e3:10.3f} ms{'':>11s}" for lb in labels))
    return "\n".join(lines)


def format_regions(rows: dict[str, dict], detail: tuple[str, ...] = ("experts",)) -> str:
    """A text table of ``op_breakdown(..., regions=...)`` results, one column group each.

    Args:
      rows: ``{label: op_breakdown(..., regions=...)}``.
      detail: regions whose ms per category are listed below the table.

    Returns:
      The table: per region ms per step summed over devices, its share, and how much of it is
      GEMMs and collectives; then, for each region in ``detail``, its ms per category.
    """
    labels = list(rows)
    regions = list(dict.fromkeys(r for b in rows.values() for r in b["us_per_region"]))
    w = 40
    head = f"{'region':18s}" + "".join(f"{lb[:w - 2]:>{w}s}" for lb in labels)
    sub = f"{'':18s}" + f"{'ms/step':>13s} {'share':>7s} {'gemm':>7s} {'exchange':>10s}" \
        * len(labels)
    lines = [head, sub, "-" * len(head)]

    def cell(b, r):
        us = b["us_per_region"].get(r, 0.0)
        f = b["region_fraction"].get(r)
        split = b["us_per_region_category"].get(r, {})
        share = "-" if f is None else f"{f:6.1%}"
        return (f"{us / 1e3:13.3f} {share:>7s} {split.get('gemm', 0.0) / 1e3:7.3f} "
                f"{split.get('exchange', 0.0) / 1e3:10.3f}")

    for r in regions:
        lines.append(f"{r:18s}" + "".join(f"{cell(rows[lb], r):>{w}s}" for lb in labels))
    lines.append(f"{'total':18s}" + "".join(
        f"{rows[lb]['total_us_per_step'] / 1e3:13.3f}{'':{w - 13}s}" for lb in labels))
    for r in detail:
        for lb in labels:
            split = rows[lb]["us_per_region_category"].get(r)
            if split is None:
                continue
            parts = ", ".join(f"{c} {us / 1e3:.3f}" for c, us in
                              sorted(split.items(), key=lambda kv: -kv[1]))
            lines.append(f"{r} ({lb}), ms/step: {parts or '-'}")
    return "\n".join(line.rstrip() for line in lines)
