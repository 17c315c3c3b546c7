"""Helpers shared by the parts of benchmarks/dispatch_bench.py (a library, no command line).

The expert mesh and its sharded random inputs, jitted dispatch -> combine functions (forward,
forward + backward, dispatch alone, the dropless bucket taken), and the harness of the
``phases`` part: the dense plan's arguments, :class:`Phases` (compile, time and record one
phase, with its compiled HLO's summary), and that report's summary and table.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from bench_util import env_info, median_seconds, write_json
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from accel_kernels import fp8
from moe.dispatch import combine, dispatch
from moe.dispatch.plan import DensePlan, dense_capacity
from xla_comm import hlo

AXIS = "expert"


# ----------------------------------------------------------------------------- setup


def make_mesh():
    """A 1-D mesh ``('expert',)`` over all devices."""
    return Mesh(np.array(jax.devices()), (AXIS,))


def smap(mesh, fn, n_in, out_specs=None):
    """``jit(shard_map(fn))`` with ``n_in`` inputs and the outputs sharded over the expert axis."""
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS),) * n_in,
                                 out_specs=P(AXIS) if out_specs is None else out_specs))


def make_inputs(mesh, tokens, d, experts, k, seed):
    """Random tokens ``x``, distinct top-k expert ids from random logits, their softmax weights
    and a random cotangent, ``tokens`` per device, all sharded over the expert axis (as the
    per-device arrays of a real step are): ``(x, ids, w, ct)``."""
    kx, kl, kc = jax.random.split(jax.random.key(seed), 3)
    n = mesh.devices.size

    def make():
        x = jax.random.normal(kx, (n * tokens, d), jnp.float32).astype(jnp.bfloat16)
        logits = jax.random.normal(kl, (n * tokens, experts), jnp.float32)
        w, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        ct = jax.random.normal(kc, (n * tokens, d), jnp.float32).astype(jnp.bfloat16)
        return x, ids.astype(jnp.int32), w, ct

    sh = NamedSharding(mesh, P(AXIS))
    return jax.jit(make, out_shardings=(sh, sh, sh, sh))()


def expert_scale(ex, sizes, num_experts):
    """'Experts' that scale rows by (1 + global expert id) / E, so misrouting shows."""
    el = sizes.shape[0]
    first = jax.lax.axis_index(AXIS) * el
    if ex.ndim == 3:  # dense layout
        s = (1.0 + first + jnp.arange(el)) / num_experts
        return ex * s[:, None, None].astype(ex.dtype)
    row_e = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(ex.shape[0]), side="right")
    s = (1.0 + first + jnp.minimum(row_e, el - 1)) / num_experts
    return ex * s[:, None].astype(ex.dtype)


def dispatch_fns(mesh, spec, *, transport, wire, experts, capacity_factor, block_size=128,
                 impl="auto", scale=False):
    """Jitted dispatch -> experts -> combine over ``mesh`` (tokens sharded as ``spec``).

    Experts: identity, or with ``scale`` :func:`expert_scale`. The combine gradient takes the
    dispatch wire (``combine_grad_dtype=wire``). Returns a namespace of ``fwd(x, ids, w) -> y``,
    ``full(x, ids, w) -> (y, expert_x, group_sizes, dropped)``, ``grad(x, ids, w, ct) -> (dx,
    dw)`` of ``sum(y * ct)``, ``disp(x, ids) -> expert_x`` (dispatch alone) and
    ``bucket_rows(x, ids) -> (bucket index per device, rows per bucket)`` (dropless).
    """

    def disp(x, ids):
        return dispatch(x, ids, num_experts=experts, axis_name=AXIS, transport=transport,
                        capacity_factor=capacity_factor, dispatch_dtype=wire,
                        block_size=block_size, ragged_impl=impl)

    def local_all(x, ids, w):
        ex, sizes, plan = disp(x, ids)
        ey = expert_scale(ex, sizes, experts) if scale else ex
        return combine(ey, w, plan, combine_grad_dtype=wire), ex, sizes, plan.dropped[None]

    f = jax.shard_map(lambda x, ids, w: local_all(x, ids, w)[0], mesh=mesh,
                      in_specs=(spec, spec, spec), out_specs=spec)
    full = jax.jit(jax.shard_map(local_all, mesh=mesh, in_specs=(spec, spec, spec),
                                 out_specs=(spec, spec, spec, spec)))
    grad = jax.jit(jax.grad(lambda x, ids, w, ct: jnp.sum(
        f(x, ids, w).astype(jnp.float32) * ct.astype(jnp.float32)), argnums=(0, 2)))
    only = jax.jit(jax.shard_map(lambda x, ids: disp(x, ids)[0], mesh=mesh,
                                 in_specs=(spec, spec), out_specs=spec))

    def bucket_rows(x, ids):
        holder = {}

        def body(x, ids):
            plan = disp(x, ids)[2]
            holder["caps"] = plan.buckets
            return plan.bucket[None]

        idx = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec),
                                    out_specs=spec))(x, ids)
        return np.asarray(idx), holder["caps"]

    return SimpleNamespace(fwd=jax.jit(f), full=full, grad=grad, disp=only,
                           bucket_rows=bucket_rows)


# ----------------------------------------------------------------------------- HLO summary

_OPS = ("sort", "gather", "scatter", "all-to-all", "transpose", "copy", "dot",
        "concatenate", "reduce")
_SKIP = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}


def hlo_summary(compiled) -> dict:
    """Cost-analysis bytes, top-level kernel count and op counts of a compiled executable."""
    mod = hlo.parse_hlo(compiled)
    ops = dict.fromkeys(_OPS, 0)
    for ins in mod.instructions():
        base = ins.opcode.removesuffix("-start")
        if base in ops and not ins.opcode.endswith("-done"):
            ops[base] += 1
    kernels = sum(1 for ins in mod.computations.get(mod.entry, ())
                  if ins.opcode not in _SKIP and not ins.opcode.endswith("-done"))
    try:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        nbytes = float(ca.get("bytes accessed", float("nan")))
    except Exception:  # cost analysis is best effort (not every backend reports it)
        nbytes = float("nan")
    return {"bytes_accessed_mb": nbytes / 2**20, "top_level_ops": kernels, "ops": ops}


# ----------------------------------------------------------------------------- phases


def plan_kwargs(a, n_dev):
    cap = dense_capacity(a.tokens, a.top_k, a.experts, a.capacity_factor)
    return dict(num_experts=a.experts, axis_name=AXIS, axis_size=n_dev, capacity=cap,
                x_dtype="bfloat16", block_size=a.block_size)


def rebuild_plan(send_slot, slot_row, kw) -> DensePlan:
    """A DensePlan around per-device send_slot / slot_row, for combine phases."""
    z = jnp.zeros((), jnp.int32)
    e = kw["num_experts"]
    return DensePlan(
        send_slot=send_slot, slot_row=slot_row, send_counts=jnp.zeros((e,), jnp.int32),
        recv_counts=jnp.zeros((kw["axis_size"], e // kw["axis_size"]), jnp.int32),
        group_sizes=jnp.zeros((e // kw["axis_size"],), jnp.int32), dropped=z,
        num_experts=e, axis_name=AXIS, axis_size=kw["axis_size"], x_dtype=kw["x_dtype"],
        block_size=kw["block_size"], wire_kernels="xla", capacity=kw["capacity"])


def deepep_rows_per_device(ids: np.ndarray, n_dev: int, experts: int) -> float:
    """Rows per device DeepEP would receive: distinct (token, destination rank) pairs."""
    owner = ids // (experts // n_dev)
    distinct = sum(np.any(owner == r, axis=1).sum() for r in range(n_dev))
    return distinct / n_dev


class Phases:
    """One run's mesh, sizes and report; `bench` compiles, times and records one phase."""

    def __init__(self, a, mesh, ids):
        self.a, self.mesh = a, mesh
        n_dev = mesh.devices.size
        self.kw = kw = plan_kwargs(a, n_dev)
        t, k, d, e, c = a.tokens, a.top_k, a.d_model, a.experts, kw["capacity"]
        n_rows, fp8_row = e * c, d + 4 * fp8.num_scale_words(d, a.block_size)
        self.dims = (t, k, d, e, c, e // n_dev, a.block_size, n_rows, fp8_row, n_dev)
        deepep_rows = deepep_rows_per_device(np.asarray(ids), n_dev, e)
        self.buffers = (n_rows * 2 * d, n_rows * fp8_row, deepep_rows * 2 * d,
                        deepep_rows * fp8_row)
        self.report = dict(
            benchmark="dispatch_phases", env=env_info(),
            settings={kk: v for kk, v in vars(a).items() if kk not in ("out", "part")},
            derived=dict(devices=n_dev, capacity=c, send_rows=n_rows, slots=t * k,
                         fp8_row_bytes=fp8_row, bf16_row_bytes=2 * d,
                         deepep_rows_per_device=deepep_rows),
            bytes_definitions=dict(
                buffer="all_to_all operand bytes per device: E*C rows x row bytes, capacity "
                       "padding and the self chunk included",
                remote="(P-1)/P x buffer: bytes leaving the GPU (moe_layer_bench's GB/s)",
                deepep="DeepEP GB/s (NVL): rows received per rank, one per (token, "
                       "destination rank), self included, no padding, x row bytes (bf16 2d; "
                       "FP8 here d + 4 ceil(d / (4 block_size)))",
            ),
            phases=[], errors={},
        )
        self.exe = {}  # (name, wire) -> compiled executable, reused for the next phase's inputs

    def call(self, name, wire, fn, *args):
        """Run a benchmarked phase again (its compiled executable; ``fn`` if it failed)."""
        return self.exe.get((name, wire), fn)(*args)

    def bench(self, name, group, wire, fn, args, *, buffer_bytes=None, deepep_bytes=None,
              note=""):
        """Compile and time ``fn(*args)``; append its row (None if it failed) and save."""
        a, n_dev = self.a, self.dims[-1]
        try:
            t0 = time.perf_counter()
            compiled = self.exe[(name, wire)] = fn.lower(*args).compile()
            compile_s = time.perf_counter() - t0
            sec, _ = median_seconds(compiled, args, a.warmup, a.iters)
        except Exception as err:  # one phase failing must not lose the others
            self.report["errors"][name] = repr(err)[:1500]
            print(f"{name}: FAILED {err!r}"[:400], flush=True)
            return None
        row = dict(phase=name, group=group, wire=wire, ms=sec * 1e3, compile_s=compile_s,
                   note=note)
        if buffer_bytes is not None:
            remote = buffer_bytes * (n_dev - 1) / n_dev
            row.update(buffer_mb=buffer_bytes / 2**20, remote_mb=remote / 2**20,
                       GBps_buffer=buffer_bytes / sec / 1e9,
                       GBps_remote=remote / sec / 1e9)
        if deepep_bytes is not None:
            row.update(deepep_mb=deepep_bytes / 2**20, GBps_deepep=deepep_bytes / sec / 1e9)
        if not a.no_hlo:
            row["hlo"] = hlo_summary(compiled)
        self.report["phases"].append(row)
        gb = (f"  {row['GBps_buffer']:7.1f} GB/s buf {row['GBps_remote']:7.1f} remote"
              if buffer_bytes is not None else "")
        print(f"{group:9s} {name:44s} {wire:5s} {row['ms']:9.3f} ms{gb}", flush=True)
        write_json(a.out, self.report)
        return sec


def finish(report, res):
    """``report`` with its summary: FP8 / bf16 time of the whole dispatch (+ combine) phases."""
    ratios = {}
    for key, name in (("dispatch", "dispatch"), ("dc", "dispatch_combine_fwd"),
                      ("dispatch [xla wire]", "dispatch_xla_wire"),
                      ("dc [xla wire]", "dispatch_combine_fwd_xla_wire")):
        b, f8 = res.get((key, "bf16")), res.get((key, "fp8"))
        if b and f8:
            ratios[f"fp8_over_bf16_{name}_time"] = f8 / b
    report["summary"] = ratios
    return report


def print_table(report):
    """The ``phases`` report as a table."""
    d = report["derived"]
    s = report["settings"]
    e = report["env"]
    print(f"\n{e['n_devices']}x {e['device_kind']} ({e['backend']}), jax {e['jax']}: "
          f"tokens/device {s['tokens']}, d_model {s['d_model']}, E {s['experts']}, "
          f"top-{s['top_k']}, capacity factor {s['capacity_factor']} -> C {d['capacity']}, "
          f"{d['send_rows']} send rows/device, DeepEP-count rows/device "
          f"{d['deepep_rows_per_device']:.0f}")
    hdr = (f"{'group':9s} {'phase':46s} {'wire':5s} {'ms':>8s} {'buf MB':>8s} "
           f"{'GB/s buf':>8s} {'GB/s rem':>8s} {'GB/s DeepEP':>11s} {'HLO MB':>8s} {'ops':>4s}")
    print(hdr + "\n" + "-" * len(hdr))
    for r in report["phases"]:
        def f(key, fmt="8.1f", r=r):
            v = r.get(key)
            return format(v, fmt) if v is not None else "-".rjust(int(fmt.split(".")[0]))
        h = r.get("hlo", {})
        hb = h.get("bytes_accessed_mb")
        print(f"{r['group']:9s} {r['phase']:46s} {r['wire']:5s} {r['ms']:8.3f} "
              f"{f('buffer_mb')} {f('GBps_buffer')} {f('GBps_remote')} "
              f"{f('GBps_deepep', '11.1f')} "
              f"{'-' if hb is None or math.isnan(hb) else format(hb, '8.1f'):>8s} "
              f"{h.get('top_level_ops', '-'):>4}")
    for k_, v in report.get("summary", {}).items():
        print(f"{k_}: {v:.3f}")
    print("GB/s buf = all_to_all operand bytes/device (padding + self chunk incl.) / time; "
          "GB/s rem = (P-1)/P of that (bytes leaving the GPU; moe_layer_bench's figure); "
          "GB/s DeepEP = one row per (token, dest rank), self incl., no padding / time.")
