"""How much of a compiled program's communication its schedule hides, in time, not in ops.

`schedule_report(compiled, hardware)` replays the scheduled HLO of a compiled step (XLA's
order of instructions, async collectives as ``*-start`` / ``*-done`` pairs) on two streams: a
compute stream that runs one instruction after another for the time the cost model gives it,
and a communication stream that runs one collective after another for its transfer time
under a link model. A ``-done`` that is reached before its transfer has finished stalls the
compute stream; a synchronous collective stalls it for its whole transfer. What the compute
stream waits is *exposed* communication; the report gives it per collective and summed over
the step (`ScheduleReport.exposed_fraction` = exposed time / collective time).

The models, all parameters of `Hardware`:

* transfer = latency + bytes each device sends / bandwidth. Bytes are `xla_comm.hlo`'s ring
  bytes ((N-1)/N of the buffer for all-to-all, all-gather and reduce-scatter, 2(N-1)/N for
  all-reduce). A group inside one host moves at `Hardware.link_GBps` per GPU; a group that
  spans hosts sends the share addressed to other hosts at `Hardware.inter_host_GBps` (the
  two links run at once, so the slower share sets the time; ring collectives, whose every
  step crosses a host boundary somewhere, run at the inter-host rate).
* compute: a dot, convolution, cuBLAS GEMM, a fusion holding dots, or a Mosaic GPU GEMM
  (`custom-call` whose shapes read as a grouped GEMM) takes ``max(FLOPs / GEMM rate, bytes /
  HBM bandwidth)`` (the FP8 rate when both operands are 8-bit); everything else ``bytes /
  HBM bandwidth``, bytes being the operands read plus the results written. An operand that
  only feeds a gather, slice or dynamic-slice inside a fusion counts as what is read of it
  (at most the result's size); an in-place ``dynamic-update-slice`` moves its update only;
  an async ``fusion-start`` costs its fusion. Each launch adds `Hardware.launch_us`. A while
  loop costs its body times its known trip count, a conditional its first branch (the
  balanced case of the dropless transport; `branch` picks another), a call its callee.

The static shapes are all the model sees: a kernel that skips padding rows at run time (the
Mosaic GEMMs on a ragged layout whose padding the routing leaves empty) is charged for them.

Example:
  >>> text = '''HloModule m, num_partitions=2
  ... ENTRY %main (p: f32[512,512], q: f32[512,512]) -> f32[512,512] {
  ...   %p = f32[512,512]{1,0} parameter(0)
  ...   %q = f32[512,512]{1,0} parameter(1)
  ...   %s = f32[512,512]{1,0} all-to-all-start(%p), replica_groups={{0,1}}, dimensions={0}
  ...   %d = f32[512,512]{1,0} dot(%q, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ...   %r = f32[512,512]{1,0} all-to-all-done(%s)
  ...   ROOT %o = f32[512,512]{1,0} add(%r, %d)
  ... }'''
  >>> hw = Hardware(gemm_tflops=1.0, fp8_gemm_tflops=2.0, hbm_GBps=1000.0, link_GBps=1.0,
  ...               latency_us=0.0, launch_us=0.0)
  >>> rep = schedule_report(text, hw)
  >>> (w,) = rep.windows
  >>> round(w.transfer_us), round(w.covered_us), round(w.exposed_us)  # 512 KiB at 1 GB/s
  (524, 268, 256)
  >>> round(rep.exposed_fraction, 2)
  0.49

References:
  XLA latency-hiding scheduler (openxla.org/xla): async collectives overlap the compute
    scheduled between their start and done.
  NCCL: collectives of one communicator run one after another on their stream.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from xla_comm import hlo, parse

__all__ = [
    "Hardware",
    "ScheduleReport",
    "Window",
    "op_cost",
    "replica_groups",
    "schedule_report",
    "topology_mesh",
]

# Default link rate: what all_to_all moves per GPU between two H200s of one host
# (``benchmarks/dispatch_bench.py --part check``; docs/benchmark_log.md, FP8 wire, dispatch
# and combine).
MEASURED_LINK_GBPS = 153.0
INTER_HOST_GBPS = 50.0  # 400 Gb/s InfiniBand per GPU


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """The rates of the cost model (per GPU).

    Attributes:
      gemm_tflops: dense bf16 GEMM rate (measure it: `measure_hardware`).
      fp8_gemm_tflops: dense FP8 GEMM rate.
      hbm_GBps: memory bandwidth, bytes read plus written per second (a large copy).
      link_GBps: bytes a GPU sends per second to GPUs of its own host in a collective
        (default: this repository's 2x H200 all_to_all measurement, `MEASURED_LINK_GBPS`).
      inter_host_GBps: bytes a GPU sends per second to other hosts (400 Gb/s InfiniBand).
      devices_per_host: GPUs per host (device ``d`` is on host ``d // devices_per_host``).
      latency_us: fixed time of one collective (launch and synchronization).
      launch_us: fixed time of one kernel launch on the compute stream.

    Example:
      >>> Hardware(gemm_tflops=650, fp8_gemm_tflops=1150, hbm_GBps=4300).link_GBps
      153.0
    """

    gemm_tflops: float
    fp8_gemm_tflops: float
    hbm_GBps: float
    link_GBps: float = MEASURED_LINK_GBPS
    inter_host_GBps: float = INTER_HOST_GBPS
    devices_per_host: int = 8
    latency_us: float = 10.0
    launch_us: float = 2.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or (
                    f.name not in ("latency_us", "launch_us") and not v > 0):
                raise ValueError(f"Hardware.{f.name} must be a positive number (latency_us "
                                 f"and launch_us >= 0), got {v!r}.")


@dataclasses.dataclass(frozen=True)
class Window:
    """One collective of the replayed schedule.

    Attributes:
      name: its HLO name (the ``-start`` op of an async pair).
      kind: e.g. ``'all-to-all'``.
      is_async: a start/done pair (False: synchronous, all of it exposed).
      computation: the HLO computation holding it.
      bytes_sent: bytes each device sends (ring bytes).
      hosts: hosts its replica group spans (1: within a host).
      transfer_us: its time on the communication stream.
      covered_us: compute time the schedule placed between its start and done.
      exposed_us: time the compute stream waited for it.
      ops: compute ops between start and done; gemms: of them GEMMs.
      executions: times it runs per step (loop trip counts).
      conditional: it lies in a conditional branch (runs only when that branch is taken).
    """

    name: str
    kind: str
    is_async: bool
    computation: str
    bytes_sent: float
    hosts: int
    transfer_us: float
    covered_us: float
    exposed_us: float
    ops: int
    gemms: int
    executions: int = 1
    conditional: bool = False

    @property
    def hidden_fraction(self) -> float:
        """Share of its transfer the compute stream did not wait for."""
        return 1.0 - self.exposed_us / self.transfer_us if self.transfer_us else 1.0


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """The replayed schedule of a step: its collectives and its time.

    Attributes:
      windows: every collective run by the step's path (entry computation, loop bodies,
        the conditional branches taken), in schedule order.
      step_us: the modeled step time (compute plus stalls).
      compute_us: the modeled compute time alone.
      hardware: the `Hardware` used.
      num_devices: devices of the program.
    """

    windows: tuple[Window, ...]
    step_us: float
    compute_us: float
    hardware: Hardware
    num_devices: int = 1

    @property
    def collective_us(self) -> float:
        """Summed transfer time of the collectives run per step."""
        return sum(w.transfer_us * w.executions for w in self.windows)

    @property
    def exposed_us(self) -> float:
        """Summed time the compute stream waited for collectives."""
        return sum(w.exposed_us * w.executions for w in self.windows)

    @property
    def exposed_fraction(self) -> float:
        """Exposed time over collective time (0 when nothing is sent)."""
        return self.exposed_us / self.collective_us if self.collective_us else 0.0

    def of_kind(self, *kinds: str) -> tuple[Window, ...]:
        """The windows of collectives of these kinds."""
        return tuple(w for w in self.windows if w.kind in kinds)

    def summary(self, kinds: Sequence[str] | None = None, *, min_bytes: float = 0.0
                ) -> dict[str, Any]:
        """Totals (of ``kinds`` only, if given, and of collectives sending at least
        ``min_bytes`` per device) as a JSON-ready dict."""
        ws = self.windows if kinds is None else self.of_kind(*kinds)
        ws = tuple(w for w in ws if w.bytes_sent >= min_bytes)
        coll = sum(w.transfer_us * w.executions for w in ws)
        exp = sum(w.exposed_us * w.executions for w in ws)
        return {
            "windows": len(ws), "async_windows": sum(w.is_async for w in ws),
            "windows_with_gemm": sum(w.is_async and w.gemms > 0 for w in ws),
            "collective_us": coll, "exposed_us": exp,
            "exposed_fraction": exp / coll if coll else 0.0,
            "bytes_sent": sum(w.bytes_sent * w.executions for w in ws),
            "step_us": self.step_us, "compute_us": self.compute_us,
        }

    def table(self) -> str:
        """A fixed-width text table, one row per collective, then totals."""
        head = ("kind", "async", "MB/dev", "hosts", "transfer us", "covered us", "exposed us",
                "ops", "gemms", "computation")
        rows = [head] + [(
            w.kind, "y" if w.is_async else "n", f"{w.bytes_sent / 1e6:.2f}", str(w.hosts),
            f"{w.transfer_us:.1f}", f"{w.covered_us:.1f}", f"{w.exposed_us:.1f}", str(w.ops),
            str(w.gemms), w.computation + (f" (x{w.executions})" if w.executions > 1 else ""))
            for w in self.windows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(v.ljust(n) for v, n in zip(r, widths, strict=True)).rstrip()
                 for r in rows]
        lines.insert(1, "  ".join("-" * n for n in widths))
        lines.append(f"step {self.step_us:.1f} us (compute {self.compute_us:.1f}); collectives "
                     f"{self.collective_us:.1f} us, exposed {self.exposed_us:.1f} us "
                     f"({self.exposed_fraction:.1%})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ----------------------------------------------------------------------------- cost model

_NO_COST = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                      "after-all", "add-dependency", "opt-barrier", "partition-id",
                      "replica-id", "async-update", "copy-start", "copy-done", "fusion-done"})
_GATHERS = frozenset({"gather", "dynamic-slice", "slice"})
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
_DOT_DIMS_RE = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                          r"false_computation=%?([\w.\-]+)")
_LOOP_RE = re.compile(r"\b(body|condition)=%?([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BACKEND_RE = re.compile(r"backend_config=(\{.*\})")


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return parse.array_shapes(shape)


def _bytes(shape: str) -> int:
    return parse.shape_nbytes(_arrays(shape))


def _is_8bit(shape: str) -> bool:
    arrays = _arrays(shape)
    return bool(arrays) and all(hlo.array_nbytes(dt, (1,)) == 1 and dt not in ("pred",)
                                for dt, _ in arrays)


@dataclasses.dataclass(frozen=True)
class _Cost:
    flops: float = 0.0
    fp8: bool = False
    bytes: float = 0.0
    gemm: bool = False
    launches: int = 0

    def time_us(self, hw: Hardware) -> float:
        rate = (hw.fp8_gemm_tflops if self.fp8 else hw.gemm_tflops) * 1e12
        t = max(self.flops / rate if self.flops else 0.0, self.bytes / (hw.hbm_GBps * 1e9))
        return t * 1e6 + self.launches * hw.launch_us


def _dot_flops(ins: hlo.Instruction, table: dict[str, hlo.Instruction]) -> float:
    """2 x result elements x contraction size of a ``dot``."""
    lhs = table.get(ins.operands[0]) if ins.operands else None
    out = _arrays(ins.shape)
    if lhs is None or not out:
        return 0.0
    lhs_dims = _arrays(lhs.shape)[0][1]
    m = _DOT_DIMS_RE.search(ins.attrs)
    contract = [int(d) for d in m.group(1).split(",") if d] if m else [len(lhs_dims) - 1]
    k = math.prod(lhs_dims[d] for d in contract)
    return 2.0 * math.prod(out[0][1]) * k


def _gemm_flops_from_config(ins: hlo.Instruction, table) -> float:
    """cuBLAS custom call: FLOPs from its backend config's dot dimensions."""
    lhs = table.get(ins.operands[0]) if ins.operands else None
    m = _BACKEND_RE.search(ins.attrs)
    if lhs is None or m is None:
        return 0.0
    try:
        cfg = json.loads(m.group(1))
        dims = cfg.get("gemm_backend_config", cfg).get("dot_dimension_numbers", {})
        contract = [int(d) for d in dims.get("lhs_contracting_dimensions", [])]
    except (ValueError, AttributeError):
        contract = []
    lhs_dims = _arrays(lhs.shape)[0][1]
    contract = contract or [len(lhs_dims) - 1]
    out = _arrays(ins.shape)[0][1]
    return 2.0 * math.prod(out) * math.prod(lhs_dims[d] for d in contract)


def _grouped_gemm_flops(operands: list[tuple[int, ...]], out: tuple[int, ...]) -> float:
    """A Mosaic GPU grouped GEMM's FLOPs from its shapes, or 0 if they do not read as one:
    ``gmm``: ``[M, K] x [G, K, N] (or [G, N, K]) -> [M, N]``; ``tgmm``: ``a [R, N1] (or [N1,
    R]), b [R, N2] (or [N2, R]) -> [G, N1, N2]``; a plain ``[M, K] x [K, N] -> [M, N]``."""
    mats = [s for s in operands if len(s) >= 2]
    if len(out) == 2 and len(mats) >= 2:
        m, n = out
        a, b = mats[0], mats[1]
        if len(a) == 2 and a[0] == m and (b[-1] == n or (len(b) == 3 and b[1] == n)):
            return 2.0 * m * n * a[1]
    if len(out) == 3 and len(mats) >= 2:
        _, n1, n2 = out
        a, b = mats[0], mats[1]
        if len(a) == 2 and len(b) == 2 and n1 in a and n2 in b:
            return 2.0 * math.prod(a) * n2
    return 0.0


def _fusion_cost(ins, mod: hlo.HloModule, table) -> _Cost:
    """A fusion: its dots' FLOPs, and bytes read (an operand only gathered from counts as the
    gather's result, at most) plus written. A fusion whose root updates a slice of a buffer in
    place (``dynamic-update-slice``) moves the update, not the buffer."""
    called = _CALLS_RE.findall(ins.attrs)
    body = mod.computations.get(called[0], ()) if called else ()
    root = body[-1] if body else None
    if root is not None and root.opcode == "dynamic-update-slice":
        inner = {i.name: i for i in body}
        update = inner.get(root.operands[1]) if len(root.operands) > 1 else None
        moved = 2 * _bytes(update.shape) if update is not None else 0
        return _Cost(bytes=moved, launches=1)
    flops, fp8 = 0.0, False
    inner = {i.name: i for i in body}
    for i in body:
        if i.opcode in ("dot", "convolution"):
            flops += _dot_flops(i, inner)
            ops = [inner[o].shape for o in i.operands[:2] if o in inner]
            fp8 = fp8 or (len(ops) == 2 and all(_is_8bit(s) for s in ops))
    users: dict[str, list[hlo.Instruction]] = {}
    for i in body:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    params = {int(m.group(1)): i for i in body if i.opcode == "parameter"
              for m in [re.match(r"(\d+)", i.operands[0] if i.operands else "")] if m}
    read = 0.0
    for idx, name in enumerate(ins.operands):
        src = table.get(name)
        if src is None:
            continue
        full = _bytes(src.shape)
        p = params.get(idx)
        u = users.get(p.name, []) if p is not None else []
        if u and all(x.opcode in _GATHERS and x.operands[0] == p.name for x in u):
            full = min(full, sum(_bytes(x.shape) for x in u))
        read += full
    return _Cost(flops=flops, fp8=fp8, bytes=read + _bytes(ins.shape), gemm=flops > 0,
                 launches=1)


def op_cost(ins: hlo.Instruction, mod: hlo.HloModule,
            table: dict[str, hlo.Instruction] | None = None) -> tuple[float, float, bool, bool]:
    """``(flops, bytes, fp8, gemm)`` the cost model charges one instruction (control flow,
    collectives and ops that move nothing: zeros).

    Example:
      >>> text = '''HloModule m
      ... ENTRY %main (x: bf16[128,64], w: bf16[64,32]) -> bf16[128,32] {
      ...   %x = bf16[128,64]{1,0} parameter(0)
      ...   %w = bf16[64,32]{1,0} parameter(1)
      ...   ROOT %y = bf16[128,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}
      ... }'''
      >>> mod = hlo.parse_hlo(text)
      >>> op_cost(mod.computations["main"][2], mod)  # 2 * 128 * 32 * 64 FLOPs
      (524288.0, 28672.0, False, True)
    """
    table = table if table is not None else {i.name: i for i in mod.instructions()}
    c = _instr_cost(ins, mod, table)
    return float(c.flops), float(c.bytes), c.fp8, c.gemm


def _instr_cost(ins: hlo.Instruction, mod: hlo.HloModule, table) -> _Cost:
    op = ins.opcode
    if op in _NO_COST or hlo.base_kind(op)[0] is not None or op in (
            "async-start", "async-done", "while", "conditional", "call"):
        return _Cost()
    operands = [table[o] for o in ins.operands if o in table]
    read = sum(_bytes(o.shape) for o in operands)
    moved = read + _bytes(ins.shape)
    if op in ("fusion", "fusion-start"):  # an async fusion costs its work where it starts
        return _fusion_cost(ins, mod, table)
    if op == "dynamic-update-slice":  # in place: the update is read and written
        update = operands[1] if len(operands) > 1 else None
        return _Cost(bytes=2 * _bytes(update.shape) if update is not None else 0, launches=1)
    if op in ("dot", "convolution"):
        fp8 = len(operands) >= 2 and all(_is_8bit(o.shape) for o in operands[:2])
        return _Cost(flops=_dot_flops(ins, table), fp8=fp8, bytes=moved, gemm=True,
                     launches=1)
    if op == "custom-call":
        m = _TARGET_RE.search(ins.attrs)
        target = m.group(1) if m else ""
        mats = [o.shape for o in operands if _arrays(o.shape) and len(_arrays(o.shape)[0][1]) >= 2]
        fp8 = len(mats) >= 2 and all(_is_8bit(s) for s in mats[:2])
        if target in _GEMM_TARGETS or target.startswith("__cublas"):
            return _Cost(flops=_gemm_flops_from_config(ins, table), fp8=fp8, bytes=moved,
                         gemm=True, launches=1)
        out = _arrays(ins.shape)
        if out:
            flops = _grouped_gemm_flops([a[1] for o in operands for a in _arrays(o.shape)[:1]],
                                        out[0][1])
            if flops:
                return _Cost(flops=flops, fp8=fp8, bytes=moved, gemm=True, launches=1)
        return _Cost(bytes=moved, launches=1)
    if op in _GATHERS:
        return _Cost(bytes=2 * _bytes(ins.shape), launches=1)
    return _Cost(bytes=moved, launches=1)


# ----------------------------------------------------------------------------- link model


def replica_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """The device ids of each replica group of a collective, from its attribute text: list
    form ``{{0,1},{2,3}}``, ``{}`` (all devices) and iota form ``[G,N]<=[dims]T(perm)``;
    permutes give their pairs' devices as one group. None for a form it does not read.

    Example:
      >>> replica_groups("replica_groups=[2,4]<=[4,2]T(1,0)", 8)
      [[0, 2, 4, 6], [1, 3, 5, 7]]
      >>> replica_groups("replica_groups={{0,1},{2,3}}", 4)
      [[0, 1], [2, 3]]
    """
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        g, n = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        perm = [int(p) for p in m.group(4).split(",")] if m.group(4) else list(range(len(dims)))
        ids = list(range(math.prod(dims)))
        # transpose the iota laid out as dims by perm, then split into g groups of n
        strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
        out_dims = [dims[p] for p in perm]
        flat = []
        for idx in _ndindex(out_dims):
            flat.append(sum(idx[j] * strides[perm[j]] for j in range(len(perm))))
        ids = flat
        return [ids[i * n:(i + 1) * n] for i in range(g)]
    at = attrs.find("replica_groups={")
    if at >= 0:
        start = at + len("replica_groups=")
        inner = attrs[start + 1:parse.split_balanced(attrs, start) - 1].strip()
        if not inner:
            return [list(range(num_devices))]
        groups = re.findall(r"\{([\d,\s]*)\}", inner)
        if groups:
            return [[int(d) for d in grp.split(",") if d.strip()] for grp in groups]
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        return [sorted({int(d) for d in re.findall(r"\d+", m.group(1))})]
    return None


def _ndindex(dims: Sequence[int]) -> Iterable[tuple[int, ...]]:
    if not dims:
        yield ()
        return
    for i in range(dims[0]):
        for rest in _ndindex(dims[1:]):
            yield (i, *rest)


def _transfer_us(c: hlo.Collective, attrs: str, num_devices: int, hw: Hardware) -> tuple[float,
                                                                                        int]:
    """(transfer time, hosts spanned) of one collective under the link model."""
    groups = replica_groups(attrs, num_devices)
    members = groups[0] if groups else list(range(min(c.group_size, hw.devices_per_host)))
    hosts = {d // hw.devices_per_host for d in members}
    sent = c.ring_bytes
    if not sent:
        return hw.latency_us, len(hosts)
    if len(hosts) <= 1:
        return hw.latency_us + sent / (hw.link_GBps * 1e3), 1
    if c.kind in ("all-to-all", "ragged-all-to-all"):
        me = members[0] // hw.devices_per_host
        same = sum(d // hw.devices_per_host == me for d in members) - 1
        others = len(members) - 1
        inner, outer = sent * same / others, sent * (others - same) / others
        t = max(inner / (hw.link_GBps * 1e3), outer / (hw.inter_host_GBps * 1e3))
        return hw.latency_us + t, len(hosts)
    return hw.latency_us + sent / (hw.inter_host_GBps * 1e3), len(hosts)


# ----------------------------------------------------------------------------- the replay


@dataclasses.dataclass
class _Replay:
    mod: hlo.HloModule
    hw: Hardware
    table: dict[str, hlo.Instruction]
    collectives: dict[str, tuple[hlo.Collective, str]]  # start name -> (collective, attrs)
    branch: int
    windows: list[Window] = dataclasses.field(default_factory=list)
    compute_us: float = 0.0
    started: dict[str, tuple] = dataclasses.field(default_factory=dict)  # (coll, hosts, ex, cond)

    def run(self, comp: str, *, executions: int = 1, conditional: bool = False,
            comm_free: float = 0.0) -> tuple[float, float]:
        """Replays ``comp``; returns (its time, when the comm stream frees up), both relative
        to its start."""
        t = 0.0
        pending: dict[str, tuple[float, float, float, int, int]] = {}
        by_done = {c.done_name: name for name, (c, _) in self.collectives.items()
                   if c.done_name and c.computation == comp}
        for ins in self.mod.computations.get(comp, ()):
            if ins.name in self.collectives and self.collectives[ins.name][0].computation == comp:
                coll, attrs = self.collectives[ins.name]
                xfer, hosts = _transfer_us(coll, attrs, self.mod.num_devices, self.hw)
                begin = max(t, comm_free)
                comm_free = begin + xfer
                if coll.is_async:
                    pending[ins.name] = (comm_free, xfer, t, 0, 0)
                    self.started[ins.name] = (coll, hosts, executions, conditional)
                else:
                    stall = comm_free - t
                    self.windows.append(Window(ins.name, coll.kind, False, comp,
                                               coll.ring_bytes, hosts, xfer, 0.0, stall, 0, 0,
                                               executions, conditional))
                    t = comm_free
                continue
            if ins.name in by_done and by_done[ins.name] in pending:
                start = by_done[ins.name]
                end, xfer, t0, n_ops, n_gemms = pending.pop(start)
                coll, hosts, ex, cond = self.started[start]
                stall = max(0.0, end - t)
                covered = t - t0
                self.windows.append(Window(start, coll.kind, True, comp, coll.ring_bytes,
                                           hosts, xfer, covered, stall, n_ops, n_gemms, ex,
                                           cond))
                t = max(t, end)
                continue
            dt, gemm = self._cost(ins, executions, conditional)
            if dt:
                for k, (end, xfer, t0, n_ops, n_gemms) in pending.items():
                    pending[k] = (end, xfer, t0, n_ops + 1, n_gemms + int(gemm))
            t += dt
        return t, comm_free

    def _cost(self, ins: hlo.Instruction, executions: int, conditional: bool):
        if ins.opcode == "while":
            parts = dict(_LOOP_RE.findall(ins.attrs))
            m = _TRIP_RE.search(ins.attrs)
            trips = int(m.group(1)) if m else 1
            total = 0.0
            for part in ("condition", "body"):
                if part in parts:
                    dt, _ = self.run(parts[part], executions=executions * trips,
                                     conditional=conditional)
                    total += dt * trips
            return total, False
        if ins.opcode == "conditional":
            m = _BRANCHES_RE.search(ins.attrs)
            if m is None:
                return 0.0, False
            names = ([b.strip().lstrip("%") for b in m.group(1).split(",")] if m.group(1)
                     else [m.group(2), m.group(3)])
            take = names[min(self.branch, len(names) - 1)]
            dt, _ = self.run(take, executions=executions, conditional=True)
            return dt, False
        if ins.opcode == "call":
            callee = re.search(r"\bto_apply=%?([\w.\-]+)", ins.attrs)
            if callee:
                dt, _ = self.run(callee.group(1), executions=executions,
                                 conditional=conditional)
                return dt, False
        c = _instr_cost(ins, self.mod, self.table)
        dt = c.time_us(self.hw)
        self.compute_us += dt * executions
        return dt, c.gemm


def schedule_report(compiled_or_text: Any, hardware: Hardware, *, branch: int = 0
                    ) -> ScheduleReport:
    """Replay a compiled step's schedule and report its exposed communication, in time.

    Args:
      compiled_or_text: ``jax.jit(f).lower(*args).compile()`` (its scheduled HLO) or HLO text.
      hardware: the rates of the cost and link models.
      branch: which branch of each conditional runs (0: the first, the dropless transport's
        balanced case).

    Returns:
      A `ScheduleReport`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> hw = Hardware(gemm_tflops=600, fp8_gemm_tflops=1200, hbm_GBps=4000)
      >>> rep = schedule_report(jax.jit(lambda x: x @ x).lower(jnp.ones((64, 64))).compile(), hw)
      >>> rep.windows, rep.exposed_fraction, rep.compute_us > 0
      ((), 0.0, True)

    References:
      XLA latency-hiding scheduler (openxla.org/xla).
    """
    mod = hlo.parse_hlo(compiled_or_text)
    colls = hlo.analyze_collectives(hlo.hlo_text(compiled_or_text))
    table = {ins.name: ins for ins in mod.instructions()}
    attrs = {}
    for c in colls:
        ins = table[c.name]
        if ins.opcode == "async-start":  # the wrapped collective holds the groups
            for callee in _CALLS_RE.findall(ins.attrs):
                for inner in mod.computations.get(callee, ()):
                    if hlo.base_kind(inner.opcode)[0] is not None:
                        attrs[c.name] = inner.attrs
        attrs.setdefault(c.name, ins.attrs)
    replay = _Replay(mod, hardware, table, {c.name: (c, attrs[c.name]) for c in colls},
                     branch)
    entry = mod.entry or next(iter(mod.computations), None)
    step = replay.run(entry)[0] if entry else 0.0
    return ScheduleReport(tuple(replay.windows), step, replay.compute_us, hardware,
                          mod.num_devices)


# ----------------------------------------------------------------------------- topologies


def topology_mesh(topology: str, axis_shape: Sequence[int], axis_names: Sequence[str], *,
                  platform: str = "cuda", explicit: bool = True):
    """A mesh over the devices of a virtual topology of the local accelerator kind, for
    compiling (not running) a program for more devices than this machine has.

    ``jax.experimental.topologies.get_topology_desc(platform=..., topology="1x8x1")`` gives 8
    GPUs of one host, ``"2x8x1"`` two hosts of 8, ``"8x8x1"`` eight; place inputs on the
    mesh with ``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))`` and
    ``jax.jit(f).lower(*structs).compile()``. Needs the platform's plugin (a GPU machine).

    Args:
      topology: the topology string.
      axis_shape: the mesh's shape (its product: the topology's device count).
      axis_names: the mesh's axis names.
      platform: ``'cuda'``.
      explicit: Explicit axis types (else Auto).

    Returns:
      A ``jax.sharding.Mesh``.
    """
    import jax  # noqa: PLC0415 - the report itself needs no jax
    import numpy as np  # noqa: PLC0415
    from jax.experimental import topologies  # noqa: PLC0415

    topo = topologies.get_topology_desc(platform=platform, topology=topology)
    devices = np.array(topo.devices)
    if devices.size != math.prod(axis_shape):
        raise ValueError(f"topology {topology!r} has {devices.size} devices; axis_shape "
                         f"{tuple(axis_shape)} has {math.prod(axis_shape)}.")
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.sharding.Mesh(devices.reshape(tuple(axis_shape)), tuple(axis_names),
                             axis_types=(kind,) * len(axis_shape))
