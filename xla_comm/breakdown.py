"""Device time of a traced executable per op category and named-scope region.

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
  gemm            dot / convolution (fused too), cuBLAS / cuBLASLt / Triton GEMM custom calls
  (the caller's)  ``rules``: ordered `Rule` s, each a category and a regex over one field of
                  the instruction (its named-scope path, its Pallas kernel's name, or its
                  opcodes): a program's own scopes and kernels (e.g. a layer's ``combine``
                  scope, or its grouped-GEMM kernels as ``gemm``)
  gather_scatter  other gathers / scatters / dynamic slices
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
is matched as a path component, bounded by ``/``, ``(`` or ``)`` (:func:`scope_regex`). Region
and category together split e.g. a layer's time into GEMMs and the rest (quantization,
casts). The scope names, kernel names and regions are the caller's: this module knows no
program's.

The events come from `xla_comm.trace.op_events`.

Example:
  >>> rules = [Rule("gemm", "kernel", r"^t?gmm")]
  >>> kernel_category("ncclDevKernel_SendRecv"), kernel_category("gmm_bf16_kernel", rules)
  ('exchange', 'gemm')
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from xla_comm import parse, trace

__all__ = ["CATEGORIES", "REST", "Rule", "categories", "categorize_hlo", "format_regions",
           "format_table", "hlo_regions", "kernel_category", "kernel_region", "op_breakdown",
           "scope_regex"]

# ----------------------------------------------------------------------------- categories

CATEGORIES = ("exchange", "sort", "gemm", "gather_scatter", "memcpy", "other")
"""The categories every breakdown has; a caller's `Rule` s add theirs after ``gemm``."""
REST = "rest"  # the region of what no region's pattern matches


class Rule(NamedTuple):
    """A category for the instructions whose ``field`` matches ``pattern`` (a regex, searched):
    ``'scope'`` the named-scope path (``op_name``), ``'kernel'`` the Pallas kernel's name (also
    for trace events that name no instruction), ``'op'`` the opcodes it runs (a fusion's
    too)."""

    category: str
    field: Literal["scope", "kernel", "op"]
    pattern: str


def categories(rules: Sequence[Rule] = ()) -> tuple[str, ...]:
    """The categories of a breakdown with ``rules``, in table order.

    >>> categories([Rule("combine", "scope", "/combine"), Rule("gemm", "kernel", "^gmm")])
    ('exchange', 'sort', 'gemm', 'combine', 'gather_scatter', 'memcpy', 'other')
    """
    extra = [r.category for r in rules if r.category not in CATEGORIES]
    return (*CATEGORIES[:3], *dict.fromkeys(extra), *CATEGORIES[3:])


def scope_regex(*names: str) -> str:
    """A regex matching any of ``names`` (regexes) as one component of a named-scope path:
    bounded by the start / end, ``/``, or the parentheses of a transform (``jvp(attention)``).

    >>> import re
    >>> bool(re.search(scope_regex("experts"), "jit(f)/transpose(jvp(experts))/dot"))
    True
    """
    return r"(?:^|[/(])(?:" + "|".join(names) + r")(?:[/)]|$)"


_COLLECTIVES = {"all-to-all", "ragged-all-to-all", "all-gather", "all-reduce",
                "collective-permute", "reduce-scatter", "send", "recv", "all-gather-start",
                "all-gather-done", "all-reduce-start", "all-reduce-done", "all-to-all-start",
                "all-to-all-done", "collective-permute-start", "collective-permute-done",
                "send-done", "recv-done", "ragged-all-to-all-start", "ragged-all-to-all-done"}
_GATHERS = {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"}
_CONTAINERS = {"conditional", "while", "call", "async-start", "async-done"}
_CALLS = re.compile(r"calls=\{?%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# XLA's combiners (e.g. of the gradients' all-reduces) name the merged op "prefix/(a:b:...)".
_MERGED = re.compile(r"^(.*?/)?\((.+:.+)\)$")
_KERNEL_NAME = re.compile(r'\\?"name\\?"\s*:\s*\\?"([\w.\-]+)')
_GEMM_TARGET = re.compile(r"cublas|gemm|matmul|cudnn\$conv", re.IGNORECASE)
_MEMCPY = re.compile(r"^\s*(memcpy|memset|cumemcpy|cumemset)", re.IGNORECASE)
# Kernel-name fallbacks (no hlo_op stat and no matching instruction).
_NAME_RULES = (
    ("exchange", re.compile(r"nccl|all_?to_?all|all_?gather|all_?reduce|collective|"
                            r"ragged", re.IGNORECASE)),
    ("sort", re.compile(r"sort", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|xmma|cutlass|nvjet|sm\d+_.*mma|matmul|dot", re.IGNORECASE)),
    ("memcpy", re.compile(r"^\s*(memcpy|memset|cumem)", re.IGNORECASE)),
    ("gather_scatter", re.compile(r"gather|scatter|dynamic_slice|dynamic_update",
                                  re.IGNORECASE)),
)


def kernel_category(name: str, rules: Sequence[Rule] = ()) -> str:
    """The category of a kernel that names no HLO instruction, from its name alone: the first
    of ``rules`` on ``'kernel'`` that matches, else the generic name rules.

    Args:
      name: the kernel (event) name.
      rules: the caller's rules (only ``'kernel'`` ones apply).

    Returns:
      A category (``"other"`` if no rule matches).
    """
    own = next((r.category for r in rules if r.field == "kernel"
                and re.search(r.pattern, name)), None)
    return own or next((c for c, rx in _NAME_RULES if rx.search(name)), "other")


def kernel_region(name: str, kernel_regions: Mapping[str, str] | None) -> str:
    """The region of a kernel that names no HLO instruction, from its name alone.

    Args:
      name: the kernel (event) name.
      kernel_regions: ordered ``{label: regex}`` over kernel names, or None.

    Returns:
      The first label whose regex matches ``name``, else `REST`.
    """
    return next((lb for lb, rx in (kernel_regions or {}).items() if re.search(rx, name)), REST)


def _parse(hlo_text: str):
    """``(instructions, closure, scope_of, out_scope_of)``: name -> `parse.Instruction` for
    every instruction; ``closure(computation)`` -> the opcodes it and what it calls hold;
    ``scope_of(computation)`` -> the op_name of its root (else of its first instruction that
    has one); ``out_scope_of(computation)`` -> the op_name nearest its root (the root's, else
    the first found walking back from the root through operands; else ``scope_of``'s)."""
    mod = parse.parse_hlo(hlo_text)
    insts = {ins.name: ins for ins in mod.instructions()}

    def op_name(ins) -> str | None:
        m = _OP_NAME.search(ins.attrs)
        return m.group(1) if m else None

    def closure(comp, seen=None):  # opcodes of a computation and what it calls (fusions)
        seen = seen or set()
        if comp in seen:
            return set()
        seen.add(comp)
        body = mod.computations.get(comp, ())
        ops = {ins.opcode for ins in body}
        for c in {c for ins in body for c in _CALLS.findall(ins.attrs)}:
            ops |= closure(c, seen)
        return ops

    def scope_of(comp):
        named = [(ins.root, op_name(ins)) for ins in mod.computations.get(comp, ())
                 if op_name(ins)]
        return next((n for root, n in named if root), named[0][1] if named else "")

    def out_scope_of(comp):  # breadth first from the root, back through the operands
        todo = [ins.name for ins in mod.computations.get(comp, ()) if ins.root]
        seen = set()
        while todo:
            name = todo.pop(0)
            if name in seen or name not in insts:
                continue
            seen.add(name)
            if op_name(insts[name]):
                return op_name(insts[name])
            todo += list(insts[name].operands)
        return scope_of(comp)

    return insts, closure, scope_of, out_scope_of


def _category(ops: set[str], opcode: str, target: str, kernel: str, scope: str,
              rules: Sequence[Rule]) -> str | None:
    """The category of one instruction (the module docstring's rules, in order)."""
    if opcode in _CONTAINERS:
        return None  # its own event (CPU) spans the events of what it runs
    if ops & _COLLECTIVES or "nccl" in target.lower():
        return "exchange"
    if "sort" in ops or "sort" in target.lower():
        return "sort"
    if ops & {"dot", "convolution"} or _GEMM_TARGET.search(target):
        return "gemm"
    fields = {"scope": [scope], "kernel": [kernel] if kernel else [], "op": sorted(ops)}
    for r in rules:
        if any(re.search(r.pattern, v) for v in fields[r.field]):
            return r.category
    if ops & _GATHERS:
        return "gather_scatter"
    if opcode in ("copy-start", "copy-done"):
        return "memcpy"
    return "other"


def _classify(hlo_text: str, rules: Sequence[Rule] = ()) -> tuple[
        dict[str, tuple[str | None, str]], dict[str, list[str]]]:
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
    for name, ins in insts.items():
        opcode, rest = ins.opcode, ins.attrs
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
        out[name] = (_category(ops, opcode, target, kernel, scope, rules), path)
        operands[name] = list(ins.operands)
    return out, operands


def categorize_hlo(hlo_text: str, rules: Sequence[Rule] = ()) -> dict[str, str | None]:
    """The op category of every instruction of a compiled module.

    Args:
      hlo_text: ``compiled.as_text()`` (the rules are those of the module docstring).
      rules: the caller's category rules.

    Returns:
      ``{instruction name: category}``; None for control flow (conditional, while, call),
      whose work is counted in the instructions it runs.
    """
    return {name: cat for name, (cat, _) in _classify(hlo_text, rules)[0].items()}


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


def op_breakdown(trace_dir, hlo_text: str, *, steps: int = 1, top: int = 12,
                 rules: Sequence[Rule] = (), regions: Mapping[str, str] | None = None,
                 kernel_regions: Mapping[str, str] | None = None) -> dict:
    """Device time per category (and per scope, and the top instructions) of one executable.

    Args:
      trace_dir: the ``jax.profiler.trace`` directory (newest run inside is read).
      hlo_text: ``compiled.as_text()`` of the executable that the trace ran.
      steps: how many calls the trace holds (times are divided by it).
      top: how many of the most expensive instructions to list.
      rules: the caller's category rules (`Rule`; module docstring).
      regions: optional ordered ``{label: regex}`` over the named-scope paths (module
        docstring).
      kernel_regions: optional ordered ``{label: regex}`` over the kernel names of events
        that name no known instruction; unmatched ones go to `REST`.

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
    info, operands = _classify(hlo_text, rules)
    cats = {name: cat for name, (cat, _) in info.items()}
    names = categories(rules)
    reg = _assign_regions(info, operands, regions) if regions is not None else None
    norm = {k.replace(".", "_").replace("-", "_"): k for k in cats}
    m = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.MULTILINE)
    module = m.group(1) if m else None
    per_cat = dict.fromkeys(names, 0.0)
    labels = [*(regions or {}), *([] if REST in (regions or {}) else [REST])]
    per_region = dict.fromkeys(labels, 0.0)
    per_region_cat: dict[str, dict[str, float]] = {lb: defaultdict(float) for lb in labels}
    per_op: dict[str, float] = defaultdict(float)
    unmatched: dict[str, float] = defaultdict(float)
    devices = set()
    for dev, _line, name, op, mod, us in trace.op_events(trace_dir):
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
            cat = kernel_category(name, rules)
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
            lb: {c: per_region_cat[lb][c] / steps for c in names if per_region_cat[lb][c]}
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
    for c in dict.fromkeys(c for lb in labels for c in rows[lb]["us_per_step"]):
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
