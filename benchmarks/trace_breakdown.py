"""Where a step's device time goes: time per op category from a jax.profiler trace + its HLO.

Every kernel (GPU) or thunk (CPU) event of a ``jax.profiler`` trace names the HLO instruction
it runs (the ``hlo_op`` stat of the XPlane events; failing that, the kernel name, which XLA
derives from the instruction name). The compiled HLO text of the same executable says what
each instruction is: its opcode, what a fusion contains, the custom call's target / Pallas
kernel name, and the ``jax.named_scope`` path in its ``op_name`` metadata. From both this
module sums the event time per category, first rule that matches:

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

    from trace_breakdown import op_breakdown
    op_breakdown(trace_dir, compiled.as_text(), steps=3)

    python benchmarks/trace_breakdown.py TRACE_DIR HLO_TEXT_FILE [STEPS]
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

__all__ = ["CATEGORIES", "categorize_hlo", "op_breakdown"]

CATEGORIES = ("exchange", "sort", "gemm", "combine", "gather_scatter", "plan", "router",
              "experts_other", "memcpy", "other")
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
    # Mosaic GPU kernels carry no name of their own in traces; this library's are the grouped
    # GEMMs (moe._gmm_mosaic).
    ("gemm", re.compile(r"gemm|xmma|cutlass|nvjet|sm\d+_.*mma|^gmm|^tgmm|matmul|dot|"
                        r"mosaic_gpu_kernel", re.IGNORECASE)),
    ("memcpy", re.compile(r"^\s*(memcpy|memset|cumem)", re.IGNORECASE)),
    ("gather_scatter", re.compile(r"gather|scatter|dynamic_slice|dynamic_update",
                                  re.IGNORECASE)),
)


def _parse(hlo_text: str):
    """``(instructions, closure, scope_of)``: name -> (opcode, rest of line) for every
    instruction; ``closure(computation)`` -> the opcodes it and what it calls hold;
    ``scope_of(computation)`` -> the op_name of its root (else of any instruction)."""
    insts: dict[str, tuple[str, str]] = {}
    comp_ops: dict[str, set[str]] = defaultdict(set)
    comp_calls: dict[str, set[str]] = defaultdict(set)
    comp_scope: dict[str, str] = {}
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
        scope = _OP_NAME.search(rest)
        if scope and (current not in comp_scope or line.lstrip().startswith("ROOT")):
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

    return insts, closure, lambda comp: comp_scope.get(comp, "")


def categorize_hlo(hlo_text: str) -> dict[str, str | None]:
    """``{instruction name: category}`` for every instruction of a compiled module's HLO text
    (the rules of the module docstring); None for control flow (conditional, while, call),
    whose work is counted in the instructions it runs."""
    insts, closure, scope_of = _parse(hlo_text)
    out = {}
    for name, (opcode, rest) in insts.items():
        ops = {opcode}
        m = _OP_NAME.search(rest)
        scope = m.group(1) if m else ""
        if opcode == "fusion":
            for c in _CALLS.findall(rest):
                ops |= closure(c)
                scope = scope or scope_of(c)  # fusions may carry no metadata themselves
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
        out[name] = cat
    return out


def _events(trace_dir):
    """``[(device, line, name, hlo_op or None, hlo_module or None, duration_us)]`` of the
    newest XPlane under ``trace_dir``: GPU stream lines of ``/device:*`` planes, or (no
    device planes: CPU) every host event that names an HLO op."""
    from jax.profiler import ProfileData
    from trace_overlap import find_trace_files

    fmt, files = find_trace_files(trace_dir)
    if fmt != "xplane":
        files = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    out = []
    for f in files:
        data = ProfileData.from_file(str(f))
        planes = list(data.planes)
        devices = [p for p in planes if p.name.startswith("/device:")]
        for plane in devices or planes:
            for line in plane.lines:
                if devices and not line.name.lower().startswith("stream"):
                    continue
                for ev in line.events:
                    try:
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
    """Run ``step(*args)`` once, then ``steps`` times under ``jax.profiler.trace(trace_dir)``;
    returns None, or why the profiler failed (the caller keeps its timings either way)."""
    import jax

    jax.block_until_ready(step(*args))
    try:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                jax.block_until_ready(step(*args))
    except Exception as err:  # noqa: BLE001
        return f"profiler failed: {err!r}"
    return None


def op_breakdown(trace_dir, hlo_text: str, *, steps: int = 1, top: int = 12) -> dict:
    """Device time per category (and per scope, and the top instructions) of one executable.

    Args:
      trace_dir: the ``jax.profiler.trace`` directory (newest run inside is read).
      hlo_text: ``compiled.as_text()`` of the executable that the trace ran.
      steps: how many calls the trace holds (times are divided by it).
      top: how many of the most expensive instructions to list.

    Returns:
      dict: ``us_per_step`` {category: microseconds per step, summed over devices},
      ``fraction`` {category: share of the total}, ``total_us_per_step``, ``n_devices``,
      ``top_ops`` [(instruction, category, us per step)], ``unmatched_kernels`` (events of no
      known instruction, categorized by kernel name), ``module``.
    """
    cats = categorize_hlo(hlo_text)
    norm = {k.replace(".", "_").replace("-", "_"): k for k in cats}
    m = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.MULTILINE)
    module = m.group(1) if m else None
    per_cat = dict.fromkeys(CATEGORIES, 0.0)
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
            cat = next((c for c, rx in _NAME_RULES if rx.search(name)), "other")
            unmatched[name] += us
        per_cat[cat] += us
        devices.add(dev)
    total = sum(per_cat.values())
    steps = max(steps, 1)
    return {
        "module": module,
        "n_devices": len(devices),
        "total_us_per_step": total / steps,
        "us_per_step": {c: v / steps for c, v in per_cat.items()},
        "fraction": {c: (v / total if total else None) for c, v in per_cat.items()},
        "top_ops": [(k, cats[k], v / steps) for k, v in
                    sorted(per_op.items(), key=lambda kv: -kv[1])[:top]],
        "unmatched_kernels": {k: v / steps for k, v in
                              sorted(unmatched.items(), key=lambda kv: -kv[1])[:top]},
    }


def format_table(rows: dict[str, dict]) -> str:
    """A text table: one column per breakdown (``{label: op_breakdown(...)}``), ms per step
    summed over devices, and each category's share."""
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


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        raise SystemExit("usage: python benchmarks/trace_breakdown.py TRACE_DIR HLO_FILE [STEPS]")
    res = op_breakdown(sys.argv[1], Path(sys.argv[2]).read_text(),
                       steps=int(sys.argv[3]) if len(sys.argv) == 4 else 1)
    print(format_table({"trace": res}))
    print(json.dumps(res, indent=2))
