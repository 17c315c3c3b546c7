"""The cost and link models of `xla_comm.schedule`: how long one HLO instruction computes and
how long one collective transfers on a GPU, from its shapes and a few measured rates.

* compute: a dot, convolution, cuBLAS GEMM, a fusion holding dots, or a Mosaic GPU GEMM
  (``custom-call`` whose shapes read as a grouped GEMM) takes ``max(FLOPs / GEMM rate, bytes /
  HBM bandwidth)`` (the FP8 rate when both operands are 8-bit; a kernel under a
  `TILES_SCOPE` named scope, that share of the FLOPs); everything else ``bytes / HBM
  bandwidth``, bytes being the operands read plus the results written. An operand that only
  feeds a gather, slice or dynamic-slice inside a fusion counts as what is read of it (at most
  the result's size); an in-place ``dynamic-update-slice`` moves its update only; an async
  ``fusion-start`` costs its fusion. Each launch adds `Hardware.launch_us`.
* transfer = latency + bytes each device sends / bandwidth. Bytes are `xla_comm.hlo`'s ring
  bytes ((N-1)/N of the buffer for all-to-all, all-gather and reduce-scatter, 2(N-1)/N for
  all-reduce). A group inside one host moves at `Hardware.link_GBps` per GPU; a group that
  spans hosts sends the share addressed to other hosts at `Hardware.inter_host_GBps` (the two
  links run at once, so the slower share sets the time; ring collectives, whose every step
  crosses a host boundary somewhere, run at the inter-host rate).
* links (`collective_links`): a collective occupies, for its whole transfer, the links its
  group reaches: ``'intra_host'`` (the host's GPU-to-GPU links) when a peer shares its host,
  ``'inter_host'`` (the GPU's network link) when a peer is on another host; so a group within
  one host takes the first, a group of one device per host the second, any other group that
  spans hosts both.

Example:
  >>> mod = hlo.parse_hlo('''HloModule m
  ... ENTRY %main (x: f32[1024,256]) -> f32[1024,256] {
  ...   %x = f32[1024,256]{1,0} parameter(0)
  ...   ROOT %e = f32[1024,256]{1,0} exponential(%x)
  ... }''')
  >>> hw = Hardware(gemm_tflops=600, fp8_gemm_tflops=1200, hbm_GBps=1000, link_GBps=150,
  ...               inter_host_GBps=50, launch_us=2.0)
  >>> cost = instruction_cost(mod.computations["main"][1], mod)  # 1 MiB read, 1 MiB written
  >>> cost.bytes, round(cost.time_us(hw), 1)  # 2 MiB at 1 TB/s, plus one launch
  (2097152, 4.1)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence

from xla_comm import hlo, parse

__all__ = [
    "TILES_SCOPE",
    "Cost",
    "GroupedRows",
    "Hardware",
    "collective_attrs",
    "collective_links",
    "cross_host_bytes",
    "instruction_cost",
    "op_cost",
    "replica_groups",
    "transfer_us",
]

@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    """The rates of the cost model (per GPU).

    Every rate is the caller's: measure it on the machine modeled (a large dense matmul, a large
    copy, an all_to_all between GPUs of one host and of two hosts).

    Attributes:
      gemm_tflops: dense bf16 GEMM rate.
      fp8_gemm_tflops: dense FP8 GEMM rate.
      hbm_GBps: memory bandwidth, bytes read plus written per second (a large copy).
      link_GBps: bytes a GPU sends per second to GPUs of its own host in a collective.
      inter_host_GBps: bytes a GPU sends per second to other hosts.
      devices_per_host: GPUs per host (device ``d`` is on host ``d // devices_per_host``).
      latency_us: fixed time of one collective (launch and synchronization).
      launch_us: fixed time of one kernel launch on the compute stream.

    Example:
      >>> Hardware(gemm_tflops=650, fp8_gemm_tflops=1150, hbm_GBps=4300, link_GBps=150,
      ...          inter_host_GBps=50).devices_per_host
      8
    """

    gemm_tflops: float
    fp8_gemm_tflops: float
    hbm_GBps: float
    link_GBps: float
    inter_host_GBps: float
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


# ----------------------------------------------------------------------------- cost model

_NO_COST = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                      "after-all", "add-dependency", "opt-barrier", "partition-id",
                      "replica-id", "async-update", "copy-start", "copy-done", "fusion-done"})
_GATHERS = frozenset({"gather", "dynamic-slice", "slice"})
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
_DOT_DIMS_RE = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_BACKEND_RE = re.compile(r"backend_config=(\{.*\})")
_MESH_GROUPS_RE = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](,\s*device_ids=[^{]*)?\s*\{([^}]*)\}")
_MESH_AXIS_RE = re.compile(r"'([^']+)'=(\d+)")
TILES_SCOPE = "tiles_{written}_of_{total}"
"""The ``jax.named_scope`` by which a kernel that computes ``written`` of its product's
``total`` output tiles (e.g. the upper triangle of a symmetric product) tells the cost model
its share: a custom call whose ``op_name`` holds it is charged that share of its GEMM FLOPs."""
GroupedRows = int | Mapping[str, int] | None
"""The token rows a Mosaic grouped GEMM computes at most: one count for all of them, or by
named scope, ``{scope: rows}``: the first scope found in a GEMM's ``op_name`` gives its rows
(``''`` matches every op), e.g. a pass that takes a known share of a chunk's slots; None (or
no scope found): the static rows."""
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


def _rows_of(ins: hlo.Instruction, grouped_rows: GroupedRows) -> int | None:
    """The row cap of ``ins`` under ``grouped_rows`` (`GroupedRows`)."""
    if not isinstance(grouped_rows, Mapping):
        return grouped_rows
    m = _OP_NAME_RE.search(ins.attrs)
    name = m.group(1) if m else ""
    return next((r for scope, r in grouped_rows.items() if scope in name), None)


_TILES_RE = re.compile(r'op_name="[^"]*\btiles_(\d+)_of_(\d+)\b')


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return parse.array_shapes(shape)


def _bytes(shape: str) -> int:
    return parse.shape_nbytes(_arrays(shape))


def _is_8bit(shape: str) -> bool:
    arrays = _arrays(shape)
    return bool(arrays) and all(hlo.array_nbytes(dt, (1,)) == 1 and dt not in ("pred",)
                                for dt, _ in arrays)


@dataclasses.dataclass(frozen=True)
class Cost:
    """What the cost model charges one instruction: FLOPs (at the FP8 rate when ``fp8``),
    bytes moved through HBM, whether it is a GEMM, and its kernel launches."""

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


def _grouped_gemm_flops(operands: list[tuple[int, ...]], out: tuple[int, ...],
                        rows: int | None = None) -> float:
    """A Mosaic GPU grouped GEMM's FLOPs from its shapes, or 0 if they do not read as one:
    ``gmm``: ``[M, K] x [G, K, N] (or [G, N, K]) -> [M, N]``; ``tgmm``: ``a [R, N1] (or [N1,
    R]), b [R, N2] (or [N2, R]) -> [G, N1, N2]``; a plain ``[M, K] x [K, N] -> [M, N]``; a
    batch of ``A B^T`` products, ``[B, M, K] x [B, N, K] -> [B, M, N]`` (the symmetric-tile
    kernel's form; no row cap: its rows are not tokens).
    ``rows`` caps the token rows (M, R) computed: the kernels skip row tiles past each group's
    filled rows, so a layout sized for the worst case costs what is filled."""
    mats = [s for s in operands if len(s) >= 2]
    if len(out) == 3 and len(mats) >= 2 and len(mats[0]) == 3 and len(mats[1]) == 3:
        (ba, m, k), (bb, n, k2) = mats[0], mats[1]
        if ba == bb == out[0] and (m, n) == out[1:] and k == k2:
            return 2.0 * ba * m * n * k
        return 0.0
    if len(out) == 2 and len(mats) >= 2:
        m, n = out
        a, b = mats[0], mats[1]
        if len(a) == 2 and a[0] == m and (b[-1] == n or (len(b) == 3 and b[1] == n)):
            return 2.0 * min(m, rows or m) * n * a[1]
    if len(out) == 3 and len(mats) >= 2:
        _, n1, n2 = out
        a, b = mats[0], mats[1]
        if len(a) == 2 and len(b) == 2 and n1 in a and n2 in b:
            r = a[0] if a[1] == n1 else a[1]  # the shared (token) axis
            return 2.0 * min(r, rows or r) * n1 * n2
    return 0.0


def _fusion_cost(ins, mod: hlo.HloModule, table) -> Cost:
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
        return Cost(bytes=moved, launches=1)
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
    return Cost(flops=flops, fp8=fp8, bytes=read + _bytes(ins.shape), gemm=flops > 0,
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
    c = instruction_cost(ins, mod, table)
    return float(c.flops), float(c.bytes), c.fp8, c.gemm


def instruction_cost(ins: hlo.Instruction, mod: hlo.HloModule,
                     table: dict[str, hlo.Instruction] | None = None, *,
                     grouped_rows: GroupedRows = None) -> Cost:
    """The `Cost` of one instruction (control flow, collectives and ops that move nothing:
    zero); ``table`` maps names to instructions (built from ``mod`` when None);
    ``grouped_rows``: the token rows a Mosaic grouped GEMM computes at most (the rows the
    routing fills; None: all its static rows; by named scope: `GroupedRows`)."""
    table = table if table is not None else {i.name: i for i in mod.instructions()}
    op = ins.opcode
    if op in _NO_COST or hlo.base_kind(op)[0] is not None or op in (
            "async-start", "async-done", "while", "conditional", "call"):
        return Cost()
    operands = [table[o] for o in ins.operands if o in table]
    read = sum(_bytes(o.shape) for o in operands)
    moved = read + _bytes(ins.shape)
    if op in ("fusion", "fusion-start"):  # an async fusion costs its work where it starts
        return _fusion_cost(ins, mod, table)
    if op == "dynamic-update-slice":  # in place: the update is read and written
        update = operands[1] if len(operands) > 1 else None
        return Cost(bytes=2 * _bytes(update.shape) if update is not None else 0, launches=1)
    if op in ("dot", "convolution"):
        fp8 = len(operands) >= 2 and all(_is_8bit(o.shape) for o in operands[:2])
        return Cost(flops=_dot_flops(ins, table), fp8=fp8, bytes=moved, gemm=True,
                     launches=1)
    if op == "custom-call":
        m = _TARGET_RE.search(ins.attrs)
        target = m.group(1) if m else ""
        mats = [o.shape for o in operands if _arrays(o.shape) and len(_arrays(o.shape)[0][1]) >= 2]
        fp8 = len(mats) >= 2 and all(_is_8bit(s) for s in mats[:2])
        if target in _GEMM_TARGETS or target.startswith("__cublas"):
            return Cost(flops=_gemm_flops_from_config(ins, table), fp8=fp8, bytes=moved,
                         gemm=True, launches=1)
        out = _arrays(ins.shape)
        if out:
            flops = _grouped_gemm_flops([a[1] for o in operands for a in _arrays(o.shape)[:1]],
                                        out[0][1], _rows_of(ins, grouped_rows))
            share = _TILES_RE.search(ins.attrs)
            if share:  # a kernel that computes only some output tiles says which share
                flops *= int(share.group(1)) / max(int(share.group(2)), 1)
            if flops:
                return Cost(flops=flops, fp8=fp8, bytes=moved, gemm=True, launches=1)
        return Cost(bytes=moved, launches=1)
    if op in _GATHERS:
        return Cost(bytes=2 * _bytes(ins.shape), launches=1)
    return Cost(bytes=moved, launches=1)


# ----------------------------------------------------------------------------- link model


def replica_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """The device ids of each replica group of a collective, from its attribute text: list
    form ``{{0,1},{2,3}}``, ``{}`` (all devices), iota form ``[G,N]<=[dims]T(perm)`` and mesh
    axes ``mesh['a'=2,'b'=4] {'b'}`` (devices numbered in the mesh's row-major order; a group
    per index of the axes not named); permutes give their pairs' devices as one group. None
    for a form it does not read (a mesh with explicit device ids or sub-axes).

    Example:
      >>> replica_groups("replica_groups=[2,4]<=[4,2]T(1,0)", 8)
      [[0, 2, 4, 6], [1, 3, 5, 7]]
      >>> replica_groups("replica_groups={{0,1},{2,3}}", 4)
      [[0, 1], [2, 3]]
      >>> replica_groups("replica_groups=mesh['a'=2,'b'=4] {'a'}, dimensions={0}", 8)
      [[0, 4], [1, 5], [2, 6], [3, 7]]
    """
    m = _MESH_GROUPS_RE.search(attrs)
    if m:
        if m.group(2) is not None:  # explicit device ids
            return None
        axes = [(name, int(size)) for name, size in _MESH_AXIS_RE.findall(m.group(1))]
        names = [n for n, _ in axes]
        refs = [r.strip().strip("'") for r in m.group(3).split(",") if r.strip()]
        if any(r not in names for r in refs):  # sub-axes ('a':(1)2) and the like
            return None
        sizes = dict(axes)
        strides = {n: math.prod(s for _, s in axes[i + 1:]) for i, (n, _) in enumerate(axes)}
        rest = [n for n in names if n not in refs]
        return [[sum(o[i] * strides[n] for i, n in enumerate(rest))
                 + sum(g[j] * strides[n] for j, n in enumerate(refs))
                 for g in _ndindex([sizes[n] for n in refs])]
                for o in _ndindex([sizes[n] for n in rest])]
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


def _first_group(c: hlo.Collective, attrs: str, num_devices: int,
                 devices_per_host: int) -> list[int]:
    """The devices of ``c``'s first replica group (without groups in ``attrs``: its size from
    device 0, within one host as far as it fits)."""
    groups = replica_groups(attrs, num_devices)
    return groups[0] if groups else list(range(min(c.group_size, devices_per_host)))


def transfer_us(c: hlo.Collective, attrs: str, num_devices: int, hw: Hardware
                ) -> tuple[float, int]:
    """(transfer time in us, hosts spanned) of one collective under the link model; ``attrs``:
    the attribute text holding its replica groups (`collective_attrs`)."""
    members = _first_group(c, attrs, num_devices, hw.devices_per_host)
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



INTRA_HOST, INTER_HOST = "intra_host", "inter_host"


def collective_links(c: hlo.Collective, attrs: str, num_devices: int,
                     devices_per_host: int) -> tuple[str, ...]:
    """The links one collective occupies while it transfers (``attrs``: as for
    :func:`transfer_us`): ``'intra_host'`` when a peer of its group shares the first member's
    host (the GPU-to-GPU links within a host), ``'inter_host'`` when a peer sits on another
    host (the network); none for a group of one device.

    Example:
      >>> c = hlo.Collective("a2a", "all-to-all", True, ("u8",), ((8192,),), 8192, 8, 7168.0,
      ...                    "main", False)
      >>> collective_links(c, "replica_groups={{0,1,2,3}}", 8, 4)  # one host
      ('intra_host',)
      >>> collective_links(c, "replica_groups={{0,4},{1,5},{2,6},{3,7}}", 8, 4)  # one per host
      ('inter_host',)
      >>> collective_links(c, "replica_groups={{0,1,2,3,4,5,6,7}}", 8, 4)  # both
      ('intra_host', 'inter_host')
    """
    members = _first_group(c, attrs, num_devices, devices_per_host)
    me = members[0] // devices_per_host
    same = sum(d // devices_per_host == me for d in members) - 1
    away = len(members) - 1 - same
    return (*((INTRA_HOST,) if same else ()), *((INTER_HOST,) if away else ()))


def cross_host_bytes(c: hlo.Collective, attrs: str, num_devices: int,
                     devices_per_host: int) -> float:
    """Bytes each device sends to other hosts in one collective (of its ring bytes): an
    all-to-all's share addressed to devices of other hosts, the whole of any other collective
    whose group spans hosts, 0 within a host (``attrs``: as for :func:`transfer_us`).

    Example:
      >>> c = hlo.Collective("a2a", "all-to-all", True, ("u8",), ((8192,),), 8192, 8, 7168.0,
      ...                    "main", False)
      >>> cross_host_bytes(c, "replica_groups={{0,1,2,3,4,5,6,7}}", 8, 4)  # 4 of 7 peers away
      4096.0
    """
    members = _first_group(c, attrs, num_devices, devices_per_host)
    me, others = members[0] // devices_per_host, len(members) - 1
    away = sum(d // devices_per_host != me for d in members)
    if not others or not away:
        return 0.0
    if c.kind in ("all-to-all", "ragged-all-to-all"):
        return c.ring_bytes * away / others
    return float(c.ring_bytes)


def collective_attrs(mod: hlo.HloModule, colls: Sequence[hlo.Collective],
                     table: dict[str, hlo.Instruction] | None = None) -> dict[str, str]:
    """Per collective (by its start's name) the attribute text holding its replica groups: an
    ``async-start``'s wrapped collective's, else its own (``table``: names to instructions,
    built from ``mod`` when None)."""
    table = table if table is not None else {ins.name: ins for ins in mod.instructions()}
    attrs: dict[str, str] = {}
    for c in colls:
        ins = table[c.name]
        if ins.opcode == "async-start":  # the wrapped collective holds the groups
            for callee in _CALLS_RE.findall(ins.attrs):
                for inner in mod.computations.get(callee, ()):
                    if hlo.base_kind(inner.opcode)[0] is not None:
                        attrs[c.name] = inner.attrs
        attrs.setdefault(c.name, ins.attrs)
    return attrs

