"""Read collectives out of HLO text: kind, bytes, group size, ring cost, loop, overlap.

`analyze_collectives(compiled)` parses the text of `jax.jit(f).lower(*args).compile()` (a
scheduled HLO module; or the pre-optimization HLO of a `Lowered`, which is what JAX hands XLA)
and returns a `CollectiveReport`: one `Collective` per communication op (synchronous
`all-reduce(...)` or an async `*-start`/`*-done` pair, in either the sugared form
`all-gather-start` or the generic `async-start(..., calls=%wrapped)`), each with

- `kind`: all-reduce, reduce-scatter, all-gather, all-to-all, ragged-all-to-all,
  collective-permute or collective-broadcast;
- `buffer_bytes`: the full (unsharded, larger) buffer: the all-reduce buffer, the input of a
  reduce-scatter, the output of an all-gather, the all-to-all buffer, the permuted buffer, the
  larger of a ragged all-to-all's input and output buffers;
- `group_size` N from `replica_groups` in every form XLA prints (`replica_group_size`);
- `ring_bytes`: bytes each device sends under the ring algorithm,
  all-reduce 2(N-1)/N B, reduce-scatter / all-gather / all-to-all (N-1)/N B, permute B;
- `computation` and `in_while_loop`: whether its computation is reachable from a while
  loop's body or condition (e.g. the Newton-Schulz `fori_loop`);
- for async ops, `overlapped`: the compute ops the scheduler placed between start and done.

`parse_hlo` exposes the parsed module (computations of `Instruction`s) for other summaries.

Byte counts are those of the module; note that XLA:CPU promotes bf16 collectives (all-reduce,
reduce-scatter, all-gather, all-to-all) to f32 when compiling, so on CPU their compiled bytes
double. Collectives in while loops count once per iteration when XLA knows the trip count
(`executions`).

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
from typing import Any, Literal, get_args

from xla_comm.parse import (
    HloModule,
    Instruction,
    array_nbytes,
    array_shapes,
    hlo_text,
    parse_hlo,
    shape_nbytes,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "CollectiveReport",
    "HloModule",
    "Instruction",
    "analyze_collectives",
    "array_nbytes",
    "base_kind",
    "count_outside_branches",
    "hlo_text",
    "parse_hlo",
    "replica_group_size",
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
COLLECTIVE_KINDS: tuple[str, ...] = get_args(CollectiveKind)

# Opcodes that do no compute of their own: not counted as overlapped work.
_NON_COMPUTE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "add-dependency", "opt-barrier", "async-start", "async-update", "async-done",
    "partition-id", "replica-id",
})
_CALLEE_RE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_LOOP_PART_RE = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_ASYNC_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
# replica_groups forms: {{0,1},{2,3}} or {} (lists), [G,N]<=[dims]T(perm) (iota), and
# mesh['a'=2,'b'=4] {'b'} or mesh[...], device_ids=(...) {'a':(1)2} (mesh axes).
_LIST_GROUPS_RE = re.compile(r"replica_groups=\{(\{[^}]*\})?")
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_MESH_GROUPS_RE = re.compile(r"replica_groups=(?:maximal_)?mesh\[([^\]]*)\].*?\s\{([^}]*)\}")
_MESH_AXIS_RE = re.compile(r"'?([^'=,]+?)'?=(\d+)")
_AXIS_REF_RE = re.compile(r"^'?(.+?)'?(?::\((\d+)\)(\d+))?$")
_PAIRS_RE = re.compile(r"source_target_pairs=\{(.*?)\}\}")

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

    Example:
      >>> from xla_comm.hlo import analyze_collectives
      >>> text = '''HloModule m, num_partitions=4
      ... ENTRY %main (p: f32[8]) -> f32[8] {
      ...   %p = f32[8]{0} parameter(0)
      ...   ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
      ... }'''
      >>> (c,) = analyze_collectives(text)
      >>> c.kind, c.shape_str(), c.buffer_bytes, c.group_size, c.ring_bytes  # 2 (N-1)/N * 32
      ('all-reduce', 'f32[8]', 32, 4, 48.0)
    """

    name: str
    kind: CollectiveKind
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
    def bare(self) -> bool:
        """True when no op sits in its window: synchronous, or async with no compute between
        start and done. (An op in the window need not hide it: `xla_comm.schedule` counts
        the time it covers.)"""
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

    Example:
      >>> from xla_comm.hlo import analyze_collectives
      >>> text = '''HloModule m, num_partitions=2
      ... ENTRY %main (p: bf16[4,8]) -> bf16[8,8] {
      ...   %p = bf16[4,8]{1,0} parameter(0)
      ...   %a2a = bf16[4,8]{1,0} all-to-all(%p), replica_groups={{0,1}}, dimensions={0}
      ...   ROOT %ag = bf16[8,8]{1,0} all-gather(%a2a), replica_groups={{0,1}}, dimensions={0}
      ... }'''
      >>> rep = analyze_collectives(text)
      >>> len(rep), rep.counts(), rep.ring_bytes, rep.bare_fraction  # (N-1)/N * (64 + 128)
      (2, {'all-to-all': 1, 'all-gather': 1}, 96.0, 1.0)
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
    def bare_ring_bytes(self) -> float:
        """Ring bytes of collectives with no compute scheduled under them (`Collective.bare`)."""
        return float(sum(c.ring_bytes * c.executions for c in self.collectives if c.bare))

    @property
    def bare_fraction(self) -> float:
        """Share of the ring bytes in bare windows (0 when nothing is sent). A structural
        count: how much of the communication a schedule hides in *time* is
        `xla_comm.schedule.schedule_report`'s ``exposed_fraction``."""
        total = self.ring_bytes
        return self.bare_ring_bytes / total if total else 0.0

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
            f"{self.ring_bytes:,.0f}; in bare windows {self.bare_fraction:.1%}; "
            f"in while loops: {len(self.in_while_loop)}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()



def replica_group_size(attrs: str, num_devices: int) -> int:
    """Devices per replica group of a collective, from its attribute text.

    Reads every form XLA prints: lists `replica_groups={{0,1},{2,3}}` (N = 2), all devices
    `replica_groups={}` (N = `num_devices`), iota `replica_groups=[4,2]<=[8]` or
    `[4,2]<=[2,4]T(1,0)` (`[groups, N]`), mesh axes `replica_groups=mesh['a'=2,'b'=4] {'b'}`
    (N = product of the named axes' sizes, a sub-axis `'a':(1)2` counting its size), and for
    permutes `source_target_pairs={{0,1},{1,0}}` (N = distinct devices in the pairs).

    Args:
      attrs: the collective's attribute text (`Instruction.attrs`).
      num_devices: devices of the module (used by `{}` and when no group is given).

    Returns:
      N.

    Example:
      >>> replica_group_size("replica_groups=mesh['a'=2,'b'=4] {'b'}, to_apply=%add", 8)
      4
      >>> replica_group_size("replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}", 8)
      4
    """
    m = _MESH_GROUPS_RE.search(attrs)
    if m:
        sizes = {name: int(size) for name, size in _MESH_AXIS_RE.findall(m.group(1))}
        n = 1
        for ref in filter(None, (a.strip() for a in m.group(2).split(","))):
            name, _, sub = _AXIS_REF_RE.match(ref).groups()
            n *= int(sub) if sub else sizes[name]
        return n
    m = _IOTA_GROUPS_RE.search(attrs)
    if m:
        return int(m.group(2))
    m = _LIST_GROUPS_RE.search(attrs)
    if m:
        first = m.group(1)
        return len(first.strip("{}").split(",")) if first and first != "{}" else num_devices
    m = _PAIRS_RE.search(attrs)
    if m:
        return len(set(re.findall(r"\d+", m.group(1))))
    return num_devices


def _callees(attrs: str) -> list[str]:
    out = []
    for _, val in _CALLEE_RE.findall(attrs):
        out.extend(re.findall(r"%?([\w.\-]+)", val.strip("{}")))
    return out


_BRANCH_RE = re.compile(r"\b(?:branch_computations|true_computation|false_computation)="
                        r"(\{[^}]*\}|%?[\w.\-]+)")


def count_outside_branches(hlo: str | HloModule, opcode: str) -> int:
    r"""``opcode`` instructions (an async pair counted once, by its start) outside every
    conditional's branches and what those branches call: the ones that run on every step.

    Args:
      hlo: HLO text (``compiled.as_text()``) or a parsed module.
      opcode: e.g. ``'all-to-all'`` (its ``-start`` half counts too) or ``'conditional'``.

    Returns:
      The count.

    Example:
      >>> text = (
      ...     "HloModule m\n\nb {\n  p = f32[2] parameter(0)\n"
      ...     "  a = f32[2] all-to-all(p), dimensions={0}\n}\n\n"
      ...     "ENTRY e {\n  i = s32[] parameter(0)\n  x = f32[2] parameter(1)\n"
      ...     "  y = f32[2] all-to-all(x), dimensions={0}\n"
      ...     "  c = f32[2] conditional(i, y), branch_computations={b}\n}\n")
      >>> count_outside_branches(text, "all-to-all")
      1
    """
    mod = hlo if isinstance(hlo, HloModule) else parse_hlo(hlo)
    stack = [name for ins in mod.instructions() if ins.opcode == "conditional"
             for val in _BRANCH_RE.findall(ins.attrs)
             for name in re.findall(r"%?([\w.\-]+)", val.strip("{}"))]
    inside: set[str] = set()
    while stack:
        c = stack.pop()
        if c not in inside and c in mod.computations:
            inside.add(c)
            stack.extend(x for i in mod.computations[c] for x in _callees(i.attrs))
    return sum(ins.opcode.removesuffix("-start") == opcode
               for c, body in mod.computations.items() if c not in inside for ins in body)


def _ring_bytes(kind: str, buffer_bytes: int, n: int) -> float:
    if kind in ("collective-permute", "collective-broadcast"):
        return float(buffer_bytes)
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * buffer_bytes
    return (n - 1) / n * buffer_bytes


def _executions(mod: HloModule) -> dict[str, int]:
    """Runs per call of each computation: product of enclosing known loop trip counts."""
    called = {c for ins in mod.instructions() for c in _callees(ins.attrs)}
    mult: dict[str, int] = {}
    stack = [(c, 1) for c in mod.computations if c not in called]
    while stack:
        c, k = stack.pop()
        if c not in mod.computations or mult.get(c, 0) >= k:
            continue
        mult[c] = k
        for ins in mod.computations[c]:
            trips = 1
            if ins.opcode == "while":
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
                trips = int(m.group(1)) if m else 1
            loop_parts = set(_LOOP_PART_RE.findall(ins.attrs))
            for callee in _callees(ins.attrs):
                stack.append((callee, k * trips if callee in loop_parts else k))
    return mult


def _loop_computations(mod: HloModule) -> set[str]:
    """Computations reachable from a while loop's body or condition."""
    stack = [c for ins in mod.instructions() if ins.opcode == "while"
             for c in _LOOP_PART_RE.findall(ins.attrs)]
    seen: set[str] = set()
    while stack:
        c = stack.pop()
        if c in seen or c not in mod.computations:
            continue
        seen.add(c)
        stack.extend(x for ins in mod.computations[c] for x in _callees(ins.attrs))
    return seen


def base_kind(opcode: str) -> tuple[str | None, str]:
    """``(kind, role)`` of an opcode: its collective kind (None: not a collective) and role,
    ``'sync'``, ``'start'``, ``'done'`` or ``''``.

    Example:
      >>> base_kind("all-gather-start"), base_kind("fusion")
      (('all-gather', 'start'), (None, ''))
    """
    if opcode in COLLECTIVE_KINDS:
        return opcode, "sync"
    for suffix, role in (("-start", "start"), ("-done", "done")):
        if opcode.endswith(suffix) and opcode[: -len(suffix)] in COLLECTIVE_KINDS:
            return opcode[: -len(suffix)], role
    return None, ""


def _collective_op(mod: HloModule, ins: Instruction) -> tuple[Instruction, str, str] | None:
    """(op holding the attributes, kind, 'sync' | 'start') if `ins` starts a collective."""
    if ins.opcode == "async-start":
        wrapped = [i for c in _ASYNC_CALLS_RE.findall(ins.attrs)
                   for i in mod.computations.get(c, ()) if base_kind(i.opcode)[1] == "sync"]
        return (wrapped[0], wrapped[0].opcode, "start") if wrapped else None
    kind, role = base_kind(ins.opcode)
    return (ins, kind, role) if kind is not None and role in ("sync", "start") else None


def _users(instructions: Iterable[Instruction]) -> dict[str, list[Instruction]]:
    """Instruction name -> the instructions that take it as an operand."""
    users: dict[str, list[Instruction]] = {}
    for ins in instructions:
        for op in ins.operands:
            users.setdefault(op, []).append(ins)
    return users


def _find_done(start: Instruction, users: dict[str, list[Instruction]]) -> Instruction | None:
    """The `-done` / `async-done` that ends `start` (through any `async-update`s)."""
    frontier, seen = [start], set()
    while frontier:
        for u in users.get(frontier.pop().name, ()):
            if u.name in seen:
                continue
            seen.add(u.name)
            if u.opcode == "async-done" or base_kind(u.opcode)[1] == "done":
                return u
            if u.opcode == "async-update":
                frontier.append(u)
    return None


def _full_buffer(
    ins: Instruction, kind: str, role: str, done: Instruction | None,
    table: dict[str, Instruction],
) -> tuple[list[tuple[str, tuple[int, ...]]], int]:
    """(arrays, bytes) of the full buffer: the larger of the op's input and output."""
    operands = [table[o] for o in ins.operands if o in table]
    if kind == "ragged-all-to-all":
        operands = operands[:1]  # the data; the rest are the output buffer and offsets
    in_arrays = [a for o in operands for a in array_shapes(o.shape)]
    if done is not None:
        out_arrays = array_shapes(done.shape)
    elif role == "sync":
        out_arrays = array_shapes(ins.shape)
    else:
        out_arrays = in_arrays
    in_arrays = in_arrays or out_arrays
    n_in, n_out = shape_nbytes(in_arrays), shape_nbytes(out_arrays)
    return (out_arrays, n_out) if n_out >= n_in else (in_arrays, n_in)


def _overlapped(
    body: tuple[Instruction, ...], start: Instruction, done: Instruction | None
) -> tuple[tuple[str, str], ...]:
    """(opcode, name) of compute ops scheduled between `start` and its `done`."""
    if done is None or done.computation != start.computation:
        return ()
    return tuple(
        (b.opcode, b.name) for b in body[start.index + 1: done.index]
        if b.opcode not in _NON_COMPUTE and base_kind(b.opcode)[0] is None
    )


def analyze_collectives(compiled_or_text: Any) -> CollectiveReport:
    """Parse the collectives of an HLO module (compiled and scheduled, or lowered).

    ring_bytes = 2(N-1)/N B (all-reduce), (N-1)/N B (reduce-scatter, all-gather, all-to-all,
    B the full buffer), B (collective-permute).

    Args:
      compiled_or_text: `jax.jit(f).lower(*args).compile()`, `jax.jit(f).lower(*args)` or
        HLO text.

    Returns:
      A `CollectiveReport`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((jax.device_count(),), ("d",),
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"),
      ...                   out_specs=P())
      >>> rep = analyze_collectives(jax.jit(f).lower(jnp.ones(8 * jax.device_count())))
      >>> [(c.kind, c.buffer_bytes, c.group_size == jax.device_count()) for c in rep]
      [('all-reduce', 32, True)]

    References:
      ZeRO (Rajbhandari et al., 2020); XLA latency-hiding scheduler (openxla.org/xla).
    """
    mod = parse_hlo(compiled_or_text)
    in_loop, executions = _loop_computations(mod), _executions(mod)
    wrapped = {c for ins in mod.instructions() if ins.opcode == "async-start"
               for c in _ASYNC_CALLS_RE.findall(ins.attrs)}
    table = {ins.name: ins for ins in mod.instructions()}
    users = _users(table.values())
    found = []
    for cname, body in mod.computations.items():
        if cname in wrapped:  # counted at its async-start
            continue
        for ins in body:
            op = _collective_op(mod, ins)
            if op is None:
                continue
            inner, kind, role = op
            done = _find_done(ins, users) if role == "start" else None
            arrays, nbytes = _full_buffer(ins, kind, role, done, table)
            n = replica_group_size(inner.attrs, mod.num_devices)
            found.append(Collective(
                name=ins.name, kind=kind, is_async=role == "start",
                dtypes=tuple(a[0] for a in arrays), shapes=tuple(a[1] for a in arrays),
                buffer_bytes=nbytes, group_size=n, ring_bytes=_ring_bytes(kind, nbytes, n),
                computation=cname, in_while_loop=cname in in_loop,
                done_name=done.name if done is not None else None,
                overlapped=_overlapped(body, ins, done), executions=executions.get(cname, 1),
            ))
    return CollectiveReport(tuple(found), mod.num_partitions)
