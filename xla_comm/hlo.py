"""Read collectives out of compiled HLO text: kind, bytes, group size, ring cost, loop, overlap.

`analyze_collectives(text)` parses the text of `jax.jit(f).lower(*args).compile().as_text()`
(a scheduled HLO module) and returns a `CollectiveReport`: one `Collective` per communication
op (synchronous `all-reduce(...)` or an async `*-start`/`*-done` pair, in either the sugared
form `all-gather-start` or the generic `async-start(..., calls=%wrapped)`), each with

- `kind`: all-reduce, reduce-scatter, all-gather, all-to-all, ragged-all-to-all,
  collective-permute or collective-broadcast;
- `buffer_bytes`: the full (unsharded, larger) buffer: the all-reduce buffer, the input of a
  reduce-scatter, the output of an all-gather, the all-to-all buffer, the permuted buffer;
- `group_size` N from `replica_groups` (explicit `{{..}}` lists, iota `[G,N]<=[..]` lists, or
  `{}` meaning all devices);
- `ring_bytes`: bytes each device sends under the ring algorithm,
  all-reduce 2(N-1)/N B, reduce-scatter / all-gather / all-to-all (N-1)/N B, permute B;
- `computation` and `in_while_loop`: whether its computation is reachable from a while
  loop's body or condition (e.g. the Newton-Schulz `fori_loop`);
- for async ops, `overlapped`: the compute ops the scheduler placed between start and done.

Byte counts are those of the compiled module; note that XLA:CPU promotes bf16 collectives
(all-reduce, reduce-scatter, all-gather) to f32, so on CPU their bytes double. Collectives in
while loops count once per iteration when XLA knows the trip count (`executions`).

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models" (2020): reduce-scatter + all-gather moves the bytes of one all-reduce.
  XLA latency-hiding scheduler (openxla.org/xla, GPU flags guidance): async collectives
    overlap compute scheduled between their start and done.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any, Literal

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "CollectiveReport",
    "analyze_collectives",
    "hlo_text",
]

CollectiveKind = Literal[
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
]
COLLECTIVE_KINDS: tuple[str, ...] = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)

_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fnuz": 8,
    "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4,
}
# Opcodes that do no compute of their own: not counted as overlapped work.
_NON_COMPUTE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "add-dependency", "opt-barrier", "async-start", "async-update", "async-done",
    "partition-id", "replica-id",
})
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# Compiled text has "name (params) -> result {"; lowered (pre-optimization) text "name {".
_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One communication op of a compiled module (an async start/done pair counts once).

    Attributes:
      name: HLO name of the op (the `-start` op for async pairs).
      kind: one of `COLLECTIVE_KINDS`.
      is_async: True for a start/done pair.
      dtypes: element types of the full buffer, e.g. ('f32',).
      shapes: shapes of the full buffer's arrays.
      buffer_bytes: bytes of the full (unsharded, larger) buffer.
      group_size: N, devices per replica group (for permutes: devices in the pairs).
      ring_bytes: bytes each device sends under the ring algorithm.
      computation: name of the HLO computation holding the op.
      in_while_loop: the computation is reachable from a while loop body or condition.
      done_name: name of the matching `-done` op, or None.
      overlapped: (opcode, name) of compute ops scheduled between start and done.
      executions: times it runs per call: the product of the enclosing loops' known trip
        counts (XLA's ``known_trip_count``; a loop without one counts once).
    """

    name: str
    kind: str
    is_async: bool
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    buffer_bytes: int
    group_size: int
    ring_bytes: float
    computation: str
    in_while_loop: bool
    done_name: str | None = None
    overlapped: tuple[tuple[str, str], ...] = ()
    executions: int = 1

    @property
    def exposed(self) -> bool:
        """True when nothing can hide it: synchronous, or async with no compute in between."""
        return not self.overlapped

    def shape_str(self) -> str:
        """Compact `dtype[dims]` text of the buffer; repeated arrays as `(... x k)`."""
        pairs = zip(self.dtypes, self.shapes, strict=True)
        parts = [f"{d}[{','.join(map(str, s))}]" for d, s in pairs]
        if len(parts) > 1 and len(set(parts)) == 1:
            return f"({parts[0]} x{len(parts)})"
        return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
    """All collectives of a compiled module, with totals and a printable table.

    Attributes:
      collectives: the collectives in module text order.
      num_partitions: the module's `num_partitions` (1 when absent).
    """

    collectives: tuple[Collective, ...]
    num_partitions: int = 1

    def __len__(self) -> int:
        return len(self.collectives)

    def __iter__(self):
        return iter(self.collectives)

    def of_kind(self, *kinds: str) -> tuple[Collective, ...]:
        """The collectives whose kind is one of `kinds`."""
        return tuple(c for c in self.collectives if c.kind in kinds)

    @property
    def kinds(self) -> frozenset[str]:
        """Set of kinds present."""
        return frozenset(c.kind for c in self.collectives)

    def counts(self) -> dict[str, int]:
        """Number of collectives per kind."""
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    def ring_bytes_by_kind(self) -> dict[str, float]:
        """Per-device ring bytes per kind (times loop trip counts)."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.ring_bytes * c.executions
        return out

    @property
    def ring_bytes(self) -> float:
        """Total bytes each device sends per call (ring algorithm, times loop trip counts)."""
        return float(sum(c.ring_bytes * c.executions for c in self.collectives))

    @property
    def in_while_loop(self) -> tuple[Collective, ...]:
        """Collectives that live inside a while loop (body, condition or their callees)."""
        return tuple(c for c in self.collectives if c.in_while_loop)

    @property
    def exposed_ring_bytes(self) -> float:
        """Ring bytes of collectives with no compute scheduled under them."""
        return float(sum(c.ring_bytes * c.executions for c in self.collectives if c.exposed))

    @property
    def exposed_fraction(self) -> float:
        """HLO-based estimate of the exposed share of communication bytes (0 when none)."""
        total = self.ring_bytes
        return self.exposed_ring_bytes / total if total else 0.0

    def table(self) -> str:
        """A fixed-width text table, one row per collective, then totals."""
        head = ("kind", "async", "buffer", "bytes", "N", "ring B/dev", "computation", "loop",
                "overlap ops")  # loop: "LOOP xT" with T executions per call
        rows = [head]
        for c in self.collectives:
            rows.append((
                c.kind, "y" if c.is_async else "n", c.shape_str(), f"{c.buffer_bytes:,}",
                str(c.group_size), f"{c.ring_bytes:,.0f}", c.computation,
                f"LOOP x{c.executions}" if c.in_while_loop else "",
                str(len(c.overlapped)) if c.is_async else "-",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = [
            "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts().items())) or "none"
        lines.append(
            f"total: {len(self)} collectives ({counts}); ring bytes/device "
            f"{self.ring_bytes:,.0f}; exposed {self.exposed_fraction:.1%}; "
            f"in while loops: {len(self.in_while_loop)}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str
    index: int


def hlo_text(compiled_or_text: Any) -> str:
    """The HLO text of a `jax.stages.Compiled` (or the string itself).

    Args:
      compiled_or_text: a compiled stage (`jax.jit(f).lower(*a).compile()`) or its text.

    Returns:
      The scheduled HLO module text.
    """
    if isinstance(compiled_or_text, str):
        return compiled_or_text
    if hasattr(compiled_or_text, "as_text"):
        text = compiled_or_text.as_text()
        if isinstance(text, str):
            return text
    raise TypeError(
        f"hlo_text: expected HLO text or a compiled stage with .as_text(), got "
        f"{type(compiled_or_text).__name__}; pass jax.jit(f).lower(*args).compile()."
    )


def _split_balanced(s: str, start: int) -> int:
    """Index just past the parenthesis group opening at s[start]."""
    depth = 0
    for i in range(start, len(s)):
        ch = s[i]
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(s)


def _parse_instr(rest: str) -> tuple[str, str, list[str], str] | None:
    """(shape, opcode, operands, attrs) from the text after `name = `."""
    rest = rest.strip()
    if rest.startswith("("):
        end = _split_balanced(rest, 0)
    else:
        m = re.match(r"\S+", rest)
        if m is None:
            return None
        end = m.end()
    shape, tail = rest[:end], rest[end:].lstrip()
    m = re.match(r"([\w\-]+)\(", tail)
    if m is None:
        return None
    opcode = m.group(1)
    close = _split_balanced(tail, m.end() - 1)
    inner = tail[m.end(): close - 1]
    operands = []
    depth, part = 0, ""
    for ch in inner + ",":
        if ch == "," and depth == 0:
            tok = part.strip().split()
            if tok:
                operands.append(tok[-1].lstrip("%"))
            part = ""
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        part += ch
    return shape, opcode, operands, tail[close:]


def _parse_module(text: str) -> tuple[dict[str, list[_Instr]], dict[str, _Instr]]:
    comps: dict[str, list[_Instr]] = {}
    table: dict[str, _Instr] = {}
    current: str | None = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER_RE.match(line)
            if m and not _INSTR_RE.match(line):
                current = m.group(2)
                comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        parsed = _parse_instr(m.group(3))
        if parsed is None:
            continue
        shape, opcode, operands, attrs = parsed
        ins = _Instr(m.group(2), shape, opcode, operands, attrs, current, len(comps[current]))
        comps[current].append(ins)
        table[ins.name] = ins
    return comps, table


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dt, dims in _ARRAY_RE.findall(shape):
        if dt in _DTYPE_BITS:
            out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def _nbytes(arrays: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    total = 0
    for dt, dims in arrays:
        n = 1
        for d in dims:
            n *= d
        total += (n * _DTYPE_BITS[dt] + 7) // 8
    return total


def _callees(attrs: str) -> list[str]:
    out = []
    for _, val in _CALLEE_RE.findall(attrs):
        out.extend(re.findall(r"%?([\w.\-]+)", val.strip("{}")))
    return out


def _group_size(attrs: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{(\{[^}]*\})", attrs)
    if m:
        return len([t for t in m.group(1).strip("{}").split(",") if t.strip()])
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return len(set(re.findall(r"\d+", m.group(1))))
    return num_devices


def _ring_bytes(kind: str, buffer_bytes: int, n: int) -> float:
    if kind in ("collective-permute", "collective-broadcast"):
        return float(buffer_bytes)
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * buffer_bytes
    return (n - 1) / n * buffer_bytes


def _executions(comps: dict[str, list[_Instr]]) -> dict[str, int]:
    """Runs per call of each computation: product of enclosing known loop trip counts."""
    called = {c for body in comps.values() for ins in body for c in _callees(ins.attrs)}
    roots = [c for c in comps if c not in called]
    mult: dict[str, int] = {}
    stack = [(c, 1) for c in roots]
    while stack:
        c, k = stack.pop()
        if c not in comps or mult.get(c, 0) >= k:
            continue
        mult[c] = k
        for ins in comps[c]:
            trips = 1
            if ins.opcode == "while":
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
                trips = int(m.group(1)) if m else 1
            loop_parts = set(re.findall(r"\b(?:body|condition)=%?([\w.\-]+)", ins.attrs))
            for callee in _callees(ins.attrs):
                stack.append((callee, k * trips if callee in loop_parts else k))
    return mult


def _base_kind(opcode: str) -> tuple[str | None, str]:
    """(kind, role) for an opcode; role is 'sync', 'start', 'done' or ''."""
    if opcode in COLLECTIVE_KINDS:
        return opcode, "sync"
    for suffix, role in (("-start", "start"), ("-done", "done")):
        if opcode.endswith(suffix) and opcode[: -len(suffix)] in COLLECTIVE_KINDS:
            return opcode[: -len(suffix)], role
    return None, ""


def analyze_collectives(compiled_or_text: Any) -> CollectiveReport:
    """Parse the collectives of a compiled (scheduled) HLO module.

    ring_bytes = 2(N-1)/N B (all-reduce), (N-1)/N B (reduce-scatter, all-gather, all-to-all,
    B the full buffer), B (collective-permute).

    Args:
      compiled_or_text: `jax.jit(f).lower(*args).compile()` or its `.as_text()`.

    Returns:
      A `CollectiveReport`.

    Example:
      >>> rep = analyze_collectives(jax.jit(step).lower(params, batch).compile())
      >>> assert not rep.in_while_loop, rep.table()

    References:
      ZeRO (Rajbhandari et al., 2020); XLA latency-hiding scheduler (openxla.org/xla).
    """
    text = hlo_text(compiled_or_text)
    m = re.search(r"num_partitions=(\d+)", text)
    num_partitions = int(m.group(1)) if m else 1
    m = re.search(r"replica_count=(\d+)", text)
    num_devices = num_partitions * (int(m.group(1)) if m else 1)
    comps, table = _parse_module(text)

    # Computations reachable from while loops, and computations wrapped by async-start.
    edges = {c: [x for ins in body for x in _callees(ins.attrs)] for c, body in comps.items()}
    loop_roots: list[str] = []
    wrapped: set[str] = set()
    for body in comps.values():
        for ins in body:
            if ins.opcode == "while":
                loop_roots += re.findall(r"\b(?:body|condition)=%?([\w.\-]+)", ins.attrs)
            elif ins.opcode == "async-start":
                wrapped.update(re.findall(r"\bcalls=%?([\w.\-]+)", ins.attrs))
    in_loop: set[str] = set()
    stack = list(loop_roots)
    while stack:
        c = stack.pop()
        if c in in_loop or c not in comps:
            continue
        in_loop.add(c)
        stack.extend(edges.get(c, []))
    executions = _executions(comps)

    users: dict[str, list[_Instr]] = {}
    for ins in table.values():
        for op in ins.operands:
            users.setdefault(op, []).append(ins)

    def find_done(start: _Instr) -> _Instr | None:
        frontier = [start]
        seen = set()
        while frontier:
            cur = frontier.pop()
            for u in users.get(cur.name, []):
                if u.name in seen:
                    continue
                seen.add(u.name)
                if u.opcode == "async-done" or _base_kind(u.opcode)[1] == "done":
                    return u
                if u.opcode == "async-update":
                    frontier.append(u)
        return None

    found: list[Collective] = []
    for cname, body in comps.items():
        if cname in wrapped:
            continue
        for ins in body:
            kind, role = _base_kind(ins.opcode)
            inner = ins
            if ins.opcode == "async-start":
                callee = re.findall(r"\bcalls=%?([\w.\-]+)", ins.attrs)
                cands = [i for c in callee for i in comps.get(c, [])
                         if _base_kind(i.opcode)[1] == "sync"]
                if not cands:
                    continue
                inner, kind, role = cands[0], cands[0].opcode, "start"
            if kind is None or role not in ("sync", "start"):
                continue
            done = find_done(ins) if role == "start" else None
            operands = [table[o] for o in ins.operands if o in table]
            in_arrays = [a for o in operands for a in _arrays(o.shape)]
            if done is not None:
                out_arrays = _arrays(done.shape)
            elif role == "sync":
                out_arrays = _arrays(ins.shape)
            else:
                out_arrays = in_arrays
            if not in_arrays:
                in_arrays = out_arrays
            n_in, n_out = _nbytes(in_arrays), _nbytes(out_arrays)
            full = out_arrays if n_out >= n_in else in_arrays
            n = _group_size(inner.attrs, num_devices)
            buffer_bytes = max(n_in, n_out)
            overlapped: tuple[tuple[str, str], ...] = ()
            if done is not None and done.computation == cname:
                between = body[ins.index + 1: done.index]
                overlapped = tuple(
                    (b.opcode, b.name) for b in between
                    if b.opcode not in _NON_COMPUTE and _base_kind(b.opcode)[0] is None
                )
            found.append(Collective(
                name=ins.name,
                kind=kind,
                is_async=role == "start",
                dtypes=tuple(a[0] for a in full),
                shapes=tuple(a[1] for a in full),
                buffer_bytes=buffer_bytes,
                group_size=n,
                ring_bytes=_ring_bytes(kind, buffer_bytes, n),
                computation=cname,
                in_while_loop=cname in in_loop,
                done_name=done.name if done is not None else None,
                overlapped=overlapped,
                executions=executions.get(cname, 1),
            ))
    return CollectiveReport(tuple(found), num_partitions)
