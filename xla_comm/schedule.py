"""How much of a compiled program's communication its schedule hides, in time, not in ops.

`schedule_report(compiled, hardware)` replays the scheduled HLO of a compiled step (XLA's
order of instructions, async collectives as ``*-start`` / ``*-done`` pairs) on a compute
stream that runs one instruction after another for the time the cost model gives it, and on
two links, within a host and between hosts, each of which carries one collective at a time.
A collective starts when it is issued and every link it occupies is free
(`xla_comm.costs.collective_links`: a group within one host takes the host's links, a group of
one device per host the network, any other group that spans hosts both), and transfers for
its time under the link model. Collectives on the same link run one after another in issue
order; collectives on different links run at once, which happens only where the schedule
keeps them in flight together (a ``-start`` issued before an earlier one's ``-done``: XLA
schedules that only when compiled to keep several collectives in flight,
``xla_comm.overlap``'s ``parallel_collectives``, and runs such collectives on streams of their
own). A schedule that keeps one collective in flight therefore replays as on a single
communication stream. A ``-done`` that is reached before its transfer has finished stalls the
compute stream; a synchronous collective stalls it for its whole transfer. What the compute
stream waits is *exposed* communication; the report gives it per collective and summed over
the step (`ScheduleReport.exposed_fraction` = exposed time / collective time).

The models (`xla_comm.costs`, all parameters of `Hardware`): each instruction computes for
``max(FLOPs / GEMM rate, bytes / HBM bandwidth)`` plus a launch, each collective transfers for
a latency plus its ring bytes over the link (within a host, or across hosts), and holds each
link it occupies for all of that time (a transfer alone on a link does not speed up, and two
on one link do not share it). A while loop
costs its body times its known trip count, a conditional its first branch (the balanced case
of the dropless transport; a boolean conditional's false branch, index 0 of the `jax.lax.cond`
it came from; `branch` picks another), a call its callee.

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
  ...               inter_host_GBps=1.0, latency_us=0.0, launch_us=0.0)
  >>> rep = schedule_report(text, hw)
  >>> (w,) = rep.windows
  >>> round(w.transfer_us), round(w.covered_us), round(w.exposed_us)  # 512 KiB at 1 GB/s
  (524, 268, 256)
  >>> round(rep.exposed_fraction, 2)
  0.49

References:
  XLA latency-hiding scheduler (openxla.org/xla): async collectives overlap the compute
    scheduled between their start and done; the flag
    ``--xla_gpu_experimental_parallel_collective_overlap_limit`` bounds how many it keeps
    in flight.
  NCCL: collectives of one communicator run one after another on their stream.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from xla_comm import costs, hlo
from xla_comm.costs import (
    Hardware,
    op_cost,
    replica_groups,
)

__all__ = [
    "Hardware",
    "ScheduleReport",
    "Window",
    "op_cost",
    "replica_groups",
    "schedule_report",
    "topology_mesh",
]


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
      transfer_us: its transfer time on its links.
      covered_us: compute time the schedule placed between its start and done.
      exposed_us: time the compute stream waited for it.
      ops: compute ops between start and done; gemms: of them GEMMs.
      executions: times it runs per step (loop trip counts).
      conditional: it lies in a conditional branch (runs only when that branch is taken).
      cross_host_bytes: of ``bytes_sent``, the bytes addressed to other hosts
        (`xla_comm.costs.cross_host_bytes`).
      links: the links it occupies (`xla_comm.costs.collective_links`).
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
    cross_host_bytes: float = 0.0
    links: tuple[str, ...] = ()

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
      max_in_flight: the most collectives the schedule has in flight at once (an async
        one from its ``-start`` to its ``-done``).
    """

    windows: tuple[Window, ...]
    step_us: float
    compute_us: float
    hardware: Hardware
    num_devices: int = 1
    max_in_flight: int = 1

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

    @property
    def link_us(self) -> dict[str, float]:
        """Per link, the summed transfer time of the collectives that occupy it."""
        out: dict[str, float] = {}
        for w in self.windows:
            for link in w.links:
                out[link] = out.get(link, 0.0) + w.transfer_us * w.executions
        return out

    @property
    def exposed_floor_fraction(self) -> float:
        """``max(0, communication - compute) / collective``: the least exposed fraction any
        order of this step's work reaches with at most as many collectives in flight as this
        schedule keeps (exposed = step - compute, and the step lasts at least its
        communication). With one in flight the communication is every collective one after
        another (``collective_us``); with more, the busiest link's share (`link_us`)."""
        coll = self.collective_us
        comm = coll if self.max_in_flight <= 1 else max(self.link_us.values(), default=coll)
        return max(0.0, comm - self.compute_us) / coll if coll else 0.0

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
            "exposed_floor_fraction": self.exposed_floor_fraction,  # of the whole step
            "bytes_sent": sum(w.bytes_sent * w.executions for w in ws),
            "cross_host_bytes": sum(w.cross_host_bytes * w.executions for w in ws),
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



# ----------------------------------------------------------------------------- the replay


_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                          r"false_computation=%?([\w.\-]+)")
_LOOP_RE = re.compile(r"\b(body|condition)=%?([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass
class _Replay:
    mod: hlo.HloModule
    hw: Hardware
    table: dict[str, hlo.Instruction]
    collectives: dict[str, tuple[hlo.Collective, str]]  # start name -> (collective, attrs)
    branch: int
    grouped_rows: costs.GroupedRows = None
    windows: list[Window] = dataclasses.field(default_factory=list)
    compute_us: float = 0.0
    max_in_flight: int = 0
    started: dict[str, tuple] = dataclasses.field(default_factory=dict)  # (coll, hosts, ex, cond)

    def run(self, comp: str, *, executions: int = 1, conditional: bool = False
            ) -> tuple[float, dict[str, float]]:
        """Replays ``comp``; returns its time and when each link frees up, both relative to
        its start (every link free at its start)."""
        t = 0.0
        free: dict[str, float] = {}  # link -> when its last collective ends
        pending: dict[str, tuple[float, float, float, int, int]] = {}
        by_done = {c.done_name: name for name, (c, _) in self.collectives.items()
                   if c.done_name and c.computation == comp}
        for ins in self.mod.computations.get(comp, ()):
            if ins.name in self.collectives and self.collectives[ins.name][0].computation == comp:
                coll, attrs = self.collectives[ins.name]
                xfer, hosts = costs.transfer_us(coll, attrs, self.mod.num_devices, self.hw)
                links = costs.collective_links(coll, attrs, self.mod.num_devices,
                                               self.hw.devices_per_host)
                # It starts when issued and every link it takes is free: behind the earlier
                # collectives on those links, beside those on others (only ones still in
                # flight can be: a passed -done waited for its transfer's end).
                end = max([t, *(free.get(link, 0.0) for link in links)]) + xfer
                free.update(dict.fromkeys(links, end))
                self.max_in_flight = max(self.max_in_flight, len(pending) + 1)
                if coll.is_async:
                    pending[ins.name] = (end, xfer, t, 0, 0)
                    self.started[ins.name] = (coll, hosts, executions, conditional, links)
                else:
                    stall = end - t
                    self.windows.append(Window(ins.name, coll.kind, False, comp,
                                               coll.ring_bytes, hosts, xfer, 0.0, stall, 0, 0,
                                               executions, conditional,
                                               self._away(coll, attrs), links))
                    t = end
                continue
            if ins.name in by_done and by_done[ins.name] in pending:
                start = by_done[ins.name]
                end, xfer, t0, n_ops, n_gemms = pending.pop(start)
                coll, hosts, ex, cond, links = self.started[start]
                stall = max(0.0, end - t)
                covered = t - t0
                self.windows.append(Window(start, coll.kind, True, comp, coll.ring_bytes,
                                           hosts, xfer, covered, stall, n_ops, n_gemms, ex,
                                           cond, self._away(coll, self.collectives[start][1]),
                                           links))
                t = max(t, end)
                continue
            dt, gemm = self._cost(ins, executions, conditional)
            if dt:
                for k, (end, xfer, t0, n_ops, n_gemms) in pending.items():
                    pending[k] = (end, xfer, t0, n_ops + 1, n_gemms + int(gemm))
            t += dt
        return t, free

    def _away(self, coll: hlo.Collective, attrs: str) -> float:
        return costs.cross_host_bytes(coll, attrs, self.mod.num_devices,
                                      self.hw.devices_per_host)

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
            # A boolean conditional counts as branch 0 = false, 1 = true: the index that
            # jax.lax.cond lowers to (XLA:GPU rewrites a two-branch index conditional into
            # this form, so the numbering must survive it).
            names = ([b.strip().lstrip("%") for b in m.group(1).split(",")] if m.group(1)
                     else [m.group(3), m.group(2)])
            take = names[min(self.branch, len(names) - 1)]
            dt, _ = self.run(take, executions=executions, conditional=True)
            return dt, False
        if ins.opcode == "call":
            callee = re.search(r"\bto_apply=%?([\w.\-]+)", ins.attrs)
            if callee:
                dt, _ = self.run(callee.group(1), executions=executions,
                                 conditional=conditional)
                return dt, False
        c = costs.instruction_cost(ins, self.mod, self.table, grouped_rows=self.grouped_rows)
        dt = c.time_us(self.hw)
        self.compute_us += dt * executions
        return dt, c.gemm


def schedule_report(compiled_or_text: Any, hardware: Hardware, *, branch: int = 0,
                    grouped_rows: costs.GroupedRows = None) -> ScheduleReport:
    """Replay a compiled step's schedule and report its exposed communication, in time.

    The compute stream runs the schedule's instructions in order; each collective transfers
    on the links it occupies (within a host, between hosts, or both:
    `xla_comm.costs.collective_links`) once it is issued and they are free, so collectives
    sharing a link run one after another and collectives on different links run at once
    where the schedule keeps them in flight together (a ``-start`` before an earlier
    ``-done``, as XLA schedules when compiled to keep several collectives in flight). With one
    collective in flight at a time this is one communication stream. A ``-done`` reached
    before its transfer ends, and a synchronous collective, stall the compute stream: that
    wait is the exposed time.

    Args:
      compiled_or_text: ``jax.jit(f).lower(*args).compile()`` (its scheduled HLO) or HLO text.
      hardware: the rates of the cost and link models.
      branch: which branch of each conditional runs (0: the first, the dropless transport's
        balanced case; a boolean conditional numbers its branches as ``jax.lax.cond`` does,
        0 false, 1 true).
      grouped_rows: the token rows each Mosaic grouped GEMM computes at most, e.g. a chunk's
        ``tokens * top_k`` for balanced routing (its kernels skip the row tiles past each
        group's filled rows, and the dropless layout is sized for every row going to one
        device); None charges their static rows; a ``{named scope: rows}`` mapping gives
        each pass its own (`xla_comm.costs.GroupedRows`).

    Returns:
      A `ScheduleReport`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> hw = Hardware(gemm_tflops=600, fp8_gemm_tflops=1200, hbm_GBps=4000, link_GBps=150,
      ...               inter_host_GBps=50)
      >>> rep = schedule_report(jax.jit(lambda x: x @ x).lower(jnp.ones((64, 64))).compile(), hw)
      >>> rep.windows, rep.exposed_fraction, rep.compute_us > 0
      ((), 0.0, True)

    References:
      XLA latency-hiding scheduler (openxla.org/xla).
    """
    mod = hlo.parse_hlo(compiled_or_text)
    colls = hlo.analyze_collectives(hlo.hlo_text(compiled_or_text))
    table = {ins.name: ins for ins in mod.instructions()}
    attrs = costs.collective_attrs(mod, colls, table)
    replay = _Replay(mod, hardware, table, {c.name: (c, attrs[c.name]) for c in colls},
                     branch, grouped_rows)
    entry = mod.entry or next(iter(mod.computations), None)
    step = replay.run(entry)[0] if entry else 0.0
    return ScheduleReport(tuple(replay.windows), step, replay.compute_us, hardware,
                          mod.num_devices, max(replay.max_in_flight, 1))


# ----------------------------------------------------------------------------- topologies


def topology_mesh(topology: str, axis_shape: Sequence[int], axis_names: Sequence[str], *,
                  platform: str = "cuda", explicit: bool = True,
                  target_config: str | None = None):
    """A mesh over the devices of a virtual topology, for compiling (not running) a program
    for more devices than this machine has, or on a machine with no GPU at all.

    ``jax.experimental.topologies.get_topology_desc(platform=..., topology="1x8x1")`` gives 8
    GPUs of one host, ``"2x8x1"`` two hosts of 8, ``"8x8x1"`` eight; place inputs on the
    mesh with ``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))`` and
    ``jax.jit(f).lower(*structs).compile()``. The GPUs are of the local kind, or, with
    ``target_config``, of the kind that text describes: then only the platform's plugin is
    needed (``jax[cuda13]`` on a CPU-only machine), not a GPU, and XLA compiles as it would
    for that GPU (without autotuning, which needs the device: GEMMs keep their default
    kernels). ``benchmarks/schedule8.py --write-target-config`` reads one off a
    machine that has the GPU.

    Args:
      topology: the topology string.
      axis_shape: the mesh's shape (its product: the topology's device count).
      axis_names: the mesh's axis names.
      platform: ``'cuda'``.
      explicit: Explicit axis types (else Auto).
      target_config: a ``GpuTargetConfigProto`` in text format, or None for the local GPU.

    Returns:
      A ``jax.sharding.Mesh``.
    """
    import jax  # noqa: PLC0415 - the report itself needs no jax
    import numpy as np  # noqa: PLC0415
    from jax.experimental import topologies  # noqa: PLC0415

    kw = {} if target_config is None else {"target_config": target_config}
    topo = topologies.get_topology_desc(platform=platform, topology=topology, **kw)
    devices = np.array(topo.devices)
    if devices.size != math.prod(axis_shape):
        raise ValueError(f"topology {topology!r} has {devices.size} devices; axis_shape "
                         f"{tuple(axis_shape)} has {math.prod(axis_shape)}.")
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.sharding.Mesh(devices.reshape(tuple(axis_shape)), tuple(axis_names),
                             axis_types=(kind,) * len(axis_shape))

