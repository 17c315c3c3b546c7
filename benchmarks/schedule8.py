"""How much communication do 8-, 16- and 64-GPU steps leave exposed? (Compiled, not run.)

Compiles programs for virtual topologies of a GPU (``xla_comm.schedule.topology_mesh``:
``1x8x1`` is 8 GPUs of one host, ``2x8x1`` / ``8x8x1`` two / eight such hosts; with
``--target-config`` on a machine with no GPU at all) and replays each compiled schedule with
``xla_comm.schedule.schedule_report``: compute at rates measured on a GPU, transfers at
``--link-gbps`` per GPU within a host and ``--inter-host-gbps`` across. Exposed = the time
compute waits for collectives, over their time. With ``--latency-model`` (default off CPU)
each step compiles twice: on XLA's own latency estimates (kept as ``xla_estimates``), then with
the modeled times handed to XLA's scheduler (``xla_comm.latency``). Cases (``--only``):

* ``moe8`` / ``moe8b``: the MoE layer's train step (FP8 wires, capacity 1.25) at EP=8, shape A
  (8192 tokens per device, d 2048, d_ff 1024, 32 experts, top-2) / B (d 4096, d_ff 2048, 64
  experts, top-8), dense and dropless, per ``--chunks`` count of ``overlap_chunks``; the loss
  is ``sum(y ct)`` (``--loss linear``), which leaves the layer's output dead (the two-stage
  combine's return across hosts is compiled away, and the output gradient is known before
  the forward runs); ``--loss square``, ``0.5 sum(y^2 ct)``, uses it as a next layer would;
* ``moe16`` / ``moe64``: A's per-device work over 16 GPUs (2 hosts; also with the expert axis
  within a host and the hosts data parallel) and 64 (8 hosts), with the one-stage exchange and
  the two-stage one (``DispatchOptions.host_axis``: across hosts once per token, then within
  the host), dense, 2 chunks;
* ``ds16`` / ``ds64``: DeepSeek-V3's per-device work (4 local experts at EP=64, 256 in all,
  d 7168, d_ff 2048, top-8 limited to 4 of 8 host-aligned groups, 8192 tokens, FP8 wires) at
  EP=64 (8 hosts) and the same work at EP=16 (2 hosts, 16 experts per device), one-stage and
  two-stage side by side, dense, 2 chunks; their bytes across hosts per step come from the
  compiled programs (``xla_comm.costs.cross_host_bytes``);
* ``muon``: sharded Muon on 8 GPUs, the 1.6B set of ``benchmarks/muon_step.py`` (f32 params),
  updates gathered in f32 and in bf16 (``--muon-reduce-dtypes``: also bf16 reduce-scatters), per
  ``--muon-chunk-bytes``;
* ``train``: ``examples/train_lm.py``'s GPU-preset step at the preset's per-device batch
  (64 x 1024 tokens) on ``--train-meshes`` (expert-parallel (1, 8) and (2, 4), data-parallel
  (8, 1) and (4, 2)), as its ``--pgle`` runs it (``--train-variants``: micro-batches x
  chunks), with Muon (the trainer's defaults and ``--train-flags``) and with AdamW; each
  records ``backward_order``: which reduce-scatters and all-gathers start before the backward
  pass's last GEMM;
* ``gpu1``: on a real GPU, the layer at A's per-device work (EP=1, 4 experts) unchunked and in
  2 chunks, timed interleaved, and the compute model checked against it.

    python3 benchmarks/schedule8.py --out schedule8.json                   # on one GPU
    python3 benchmarks/schedule8.py --target-config benchmarks/targets/h100.txtpb \\
        --rates 659.3,1170.2,1999.1 --hlo-dir HLO --out schedule8.json       # on a CPU
    python3 benchmarks/schedule8.py --replay HLO --rates-from gpu1.json --out s.json
    python3 benchmarks/schedule8.py --small                  # CPU, 8 simulated devices

JSON: the headline keys first (``moe_ep8_exposed_fraction``, ``..._dropless_...``,
``muon_dp8_exposed_fraction``, ``..._exposed_floor``, ``train_step_ep8_exposed_fraction``,
``train_step_dp8_exposed_fraction``, ``train_step_dp8_muon_over_adamw_step``,
``train_step_4x2_exposed_fraction``, ``moe_ep16/64_...``, the
two-stage keys ``moe_ep16/64_two_stage_exposed_fraction`` and ``..._one_stage_...`` beside them,
``moe_ep64_two_stage_step_over_one_stage``, ``moe_ep16/64_cross_host_bytes_ratio``, shape A's
``moe_ep16/64_A_two_stage_...``; the ``..._xla_estimates``; ``targets``, ``met``), then
``cases`` (each program's summary),
``hardware``; ``--hlo-dir``: every compiled module (gzip), which ``--replay`` reads back.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import re
import tarfile
import time
import traceback
import types
from pathlib import Path

from _lib import bench

MEASURES = ("moe/", "muon_jax/", "xla_comm/", "examples/", "accel_kernels/", "benchmarks/targets/")
MEASURED_LINK_GBPS = 153.0  # all_to_all per GPU between two H200s of one host (BENCHMARKS.md)


@dataclasses.dataclass(frozen=True)
class MoeShape:
    tokens: int  # per device
    d_model: int
    d_ff: int
    experts: int
    top_k: int
    num_groups: int = 1  # group-limited routing (the groups aligned to the hosts)
    topk_groups: int | None = None


PAYLOAD_BYTES = 64 * 1024  # all-to-alls of at least this many bytes per device: payloads
SHAPES = {"A": MoeShape(8192, 2048, 1024, 32, 2), "B": MoeShape(8192, 4096, 2048, 64, 8),
          "D": MoeShape(8192, 7168, 2048, 256, 8, 8, 4)}  # D: DeepSeek-V3's, 256 experts
SMALL_SHAPES = {"A": MoeShape(512, 256, 128, 16, 2), "B": MoeShape(512, 512, 256, 16, 4),
                "D": MoeShape(512, 256, 128, 32, 4, 4, 1)}
TARGETS = {"moe_ep8_exposed_fraction": 0.15, "moe_ep8_dropless_exposed_fraction": 0.15,
           "moe_ep8_B_exposed_fraction": 0.15, "moe_ep8_B_dropless_exposed_fraction": 0.15,
           "muon_dp8_exposed_fraction": 0.10, "train_step_ep8_exposed_fraction": 0.20,
           "chunked_over_unchunked_1gpu": 1.05,
           "moe_ep16_cross_host_bytes_ratio": 0.6, "moe_ep64_cross_host_bytes_ratio": 0.6,
           "moe_ep64_two_stage_exposed_fraction": 0.25,
           "moe_ep64_two_stage_step_over_one_stage": 0.75,
           "moe_ep16_two_stage_exposed_fraction": 0.15,
           "moe_ep16_A_two_stage_step_over_one_stage": 1.0,
           "moe_ep64_A_two_stage_step_over_one_stage": 1.0,
           "train_step_dp8_exposed_fraction": 0.10, "train_step_dp8_muon_over_adamw_step": 1.05,
           "train_step_4x2_exposed_fraction": 0.10, "muon_dp8_exposed_over_floor": 0.05}
GROUPS = "moe8,moe8b,muon,train,moe16,moe64,ds16,ds64,gpu1"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--small", action="store_true", help="CPU, 8 simulated devices")
    add("--out", default=None)
    add("--only", default=GROUPS, help=f"case groups: {GROUPS}")
    add("--chunks", default="1,2,4", help="overlap_chunks of the EP=8 A cases")
    add("--default-chunks", type=int, help="chunks the headline keys are for (the layer's)")
    add("--local-first", default="off", help="off and/or on: the layer's local_first")
    add("--train-variants", default="1,2", help="micro-batches[xCHUNKS] of the train cases")
    add("--train-meshes", default="1x8,2x4,8x1,4x2", help="('data', 'expert') meshes of them")
    add("--train-optimizers", default="muon,adamw", help="muon and/or adamw train steps")
    add("--train-batch", type=int, default=0,
        help="sequences per train step (0: the GPU preset's per device, 512 on 8)")
    add("--train-flags", default="", help="trainer flags of the Muon train cases, e.g. "
        "'--muon-reduce-dtype bfloat16 --muon-chunk-bytes 201326592'")
    add("--muon-chunk-bytes", default="0,1", help="chunk_bytes of the Muon cases (0: default)")
    add("--muon-reduce-dtypes", default="f32", help="f32 and/or bf16 reduce-scatters")
    add("--muon-gather-dtypes", default="f32,bf16", help="f32 and/or bf16 update gathers")
    add("--link-gbps", type=float, help="per GPU within a host (default: xla_comm.schedule's)")
    add("--inter-host-gbps", type=float, default=50.0)
    add("--parallel-collectives", type=int, default=1, help="async collectives in flight")
    add("--loss", choices=("linear", "square"), default="linear",
        help="the layer cases' loss: sum(y ct) (the records') or 0.5 sum(y^2 ct) (the "
        "output used, as a next layer uses it)")
    add("--latency-model", action=argparse.BooleanOptionalAction, default=None)
    add("--budget", type=float, default=500.0, help="seconds; later cases are skipped")
    add("--target-config", metavar="TXTPB", help="compile for the GPU this describes")
    add("--rates", metavar="BF16,FP8,HBM", help="TFLOP/s, TFLOP/s, GB/s instead of measuring")
    add("--rates-from", metavar="JSON", help="the rates and gpu1 figures of a GPU run")
    add("--hlo-dir", help="write every compiled module here (gzip)")
    add("--hlo-tar", help="and pack them into this tar (15 MiB at most, smallest first)")
    add("--replay", help="a folder or tar of modules (--hlo-dir): replayed, not compiled")
    add("--summarize", metavar="JSON", help="recompute the headline keys of a report")
    add("--write-target-config", metavar="TXTPB", help="write the local GPU's and exit")
    a = p.parse_args(argv)
    if a.latency_model is None:
        a.latency_model = not a.small
    if a.small:
        bench.simulate_cpu(8)
    return a


def grouped_rows(tokens: int, chunks: int, top_k: int, devices: int = 1, local_first: bool = False):
    """The rows a chunk's grouped GEMMs compute under balanced routing, which the replay
    charges (not the worst-case layout's); with ``local_first`` the first chunk's local pass
    takes 1 / devices of them (by named scope, ``xla_comm.costs.GroupedRows``)."""
    rows = tokens // chunks * top_k
    if not local_first:
        return rows
    return {"moe_local_first": rows // devices, "moe_chunk0/": rows - rows // devices, "": rows}


class Run:
    """One run's settings, rates, report and case bookkeeping."""

    def __init__(self, a, defaults: dict, argv=None):
        import jax

        from xla_comm import overlap
        self.a, self.defaults, self.t0 = a, defaults, time.perf_counter()
        self.shapes = SMALL_SHAPES if a.small else SHAPES
        self.report = {"benchmark": "schedule8", "env": bench.env(), "cases": {}, "skipped": [],
                       "errors": {}, "target_config": a.target_config,
                       "latency_model": a.latency_model,
                       "parallel_collectives": a.parallel_collectives, "loss": a.loss,
                       "commit": bench.commit(), "date": time.strftime("%Y-%m-%d"),
                       "command": " ".join(["python3 benchmarks/schedule8.py", *(argv or [])])}
        self.hlo_dir = Path(a.hlo_dir) if a.hlo_dir else None
        if self.hlo_dir:
            self.hlo_dir.mkdir(parents=True, exist_ok=True)
        self.target_text = Path(a.target_config).read_text() if a.target_config else None
        self.opts = None if a.small else overlap.overlap_compiler_options(
            parallel_collectives=a.parallel_collectives)
        self.extra: dict[str, dict] = {}  # each case's description, for a replay of it
        self.replay = read_modules(a.replay) if a.replay else {}
        self.report["replayed"] = sorted(self.replay)
        self.hw = self.hardware()
        self.gpu = jax.default_backend() == "gpu"

    def hardware(self):
        """``schedule.Hardware`` at the rates measured here, given, or of an earlier GPU run."""
        from xla_comm import schedule
        a, rep = self.a, self.report
        if a.rates_from:
            device = json.loads(Path(a.rates_from).read_text())
            h = device["hardware"]
            bf16, fp8, hbm = h["gemm_tflops"], h["fp8_gemm_tflops"], h["hbm_GBps"]
            rep["rates_source"] = f"measured by the run in {Path(a.rates_from).name}"
            rep["device_run"] = {k: device.get(k) for k in ("env", "commit", "date", "command")}
            for k in ("chunked_over_unchunked_1gpu", "compute_model_error"):
                if k in device:
                    rep[k] = device[k]
            if "gpu1_layer" in device.get("cases", {}):
                rep["cases"]["gpu1_layer"] = device["cases"]["gpu1_layer"]
        elif a.rates:
            bf16, fp8, hbm = (float(v) for v in a.rates.split(","))
            rep["rates_source"] = "--rates"
        else:
            bf16, fp8, hbm = measure_rates(a.small)
            rep["rates_source"] = "measured in this run"
        rep["link_GBps_assumed"] = a.link_gbps or MEASURED_LINK_GBPS
        hw = schedule.Hardware(gemm_tflops=bf16, fp8_gemm_tflops=fp8, hbm_GBps=hbm,
                               link_GBps=a.link_gbps or MEASURED_LINK_GBPS,
                               inter_host_GBps=a.inter_host_gbps,
                               devices_per_host=4 if a.small else 8)
        rep["hardware"] = dataclasses.asdict(hw)
        rep["link_source"] = "--link-gbps" if a.link_gbps else (
            "MEASURED_LINK_GBPS: all_to_all on 2x H200, jax 0.11.2")
        return hw

    def target(self):
        """Where compiled for a GPU described by a target config, the layer's 'auto' kernel
        choices are that GPU's, not those of the CPU this runs on."""
        if self.target_text is None:
            return contextlib.nullcontext()
        import accel_kernels
        cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", self.target_text)
        major = re.search(r"major:\s*(\d+)", cc.group(1)) if cc else None
        if major is None:
            raise SystemExit(f"{self.a.target_config}: no cuda_compute_capability major")
        minor = re.search(r"minor:\s*(\d+)", cc.group(1))
        return accel_kernels.compiling_for_cuda(
            (int(major.group(1)), int(minor.group(1)) if minor else 0))

    def mesh(self, topology: str, shape, names, explicit=True):
        import jax
        import numpy as np

        from xla_comm import schedule
        if self.a.small:
            devs = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
            kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
            return jax.sharding.Mesh(devs, names, axis_types=(kind,) * len(shape))
        return schedule.topology_mesh(topology, shape, names, explicit=explicit,
                                      target_config=self.target_text)

    def build(self, lowered, rows=None):
        """The compiled step the report reads (with --latency-model: compiled again on the
        modeled latencies, the first compile kept beside it)."""
        from xla_comm import latency
        if not self.a.latency_model:
            return bench.compile_with(lowered, self.opts)[0]
        return latency.compile_modeled(lowered, self.hw, compiler_options=self.opts,
                                       grouped_rows=rows)

    def summaries(self, compiled, rows):
        from xla_comm import schedule
        rep = schedule.schedule_report(compiled, self.hw, grouped_rows=rows)
        return {"all": rep.summary(), "all_to_all": rep.summary(("all-to-all",)),
                "payload_all_to_all": rep.summary(("all-to-all",), min_bytes=PAYLOAD_BYTES)}

    def record(self, name, compiled, extra):
        from xla_comm import latency
        first = None
        if isinstance(compiled, latency.Modeled):
            compiled, first = compiled.compiled, compiled.default
        rows = extra.get("grouped_rows")
        out = {**self.summaries(compiled, rows), **extra}
        if name.startswith("train_step"):
            out["backward_order"] = backward_order(compiled)
        if first is not None:
            out["xla_estimates"] = self.summaries(first, rows)
            self.write_hlo(f"{name}.xla_estimates", first)
        self.report["cases"][name] = out
        self.write_hlo(name, compiled)
        pa = out["payload_all_to_all"]
        print(f"[{time.perf_counter() - self.t0:5.0f}s] {name}: exposed "
              f"{out['all']['exposed_fraction']:.3f} of {out['all']['collective_us']:.0f} us "
              f"(payload all-to-alls with GEMMs {pa['windows_with_gemm']}/{pa['windows']}); "
              f"step {out['all']['step_us']:.0f} us", flush=True)
        self.save()

    def case(self, name, compile_fn, extra):
        """Compile (or replay) and record one case; errors and the time budget recorded."""
        self.extra[name] = extra
        if name in self.replay:
            return self.record(name, self.replay[name], extra | {"replayed": True})
        if time.perf_counter() - self.t0 > self.a.budget:
            return self.report["skipped"].append(name)
        try:
            with self.target():
                self.record(name, compile_fn(), extra)
        except Exception as err:  # noqa: BLE001  (record and go on)
            self.report["errors"][name] = f"{type(err).__name__}: {err}"[:3000]
            traceback.print_exc()

    def write_hlo(self, name, compiled):
        if self.hlo_dir:
            with gzip.open(self.hlo_dir / f"{name}.hlo.gz", "wt") as f:
                f.write(compiled if isinstance(compiled, str) else compiled.as_text())

    def save(self):
        """The report so far, summary keys included, and the modules packed: a run cut short
        keeps everything up to its last case."""
        if self.hlo_dir and self.a.hlo_tar:
            total = 0
            with tarfile.open(self.a.hlo_tar, "w") as tar:
                for f in sorted(self.hlo_dir.glob("*.hlo.gz"), key=lambda f: f.stat().st_size):
                    if total + f.stat().st_size > 15 * 2**20:
                        break
                    tar.add(f, arcname=f.name)
                    total += f.stat().st_size
        bench.write_json(self.a.out, summarize(self.report, self.defaults))


def read_modules(src: str) -> dict[str, str]:
    """``{case: HLO text}`` of a folder or tar of ``NAME.hlo.gz`` modules."""
    src = Path(src)
    if src.is_dir():
        files = {f.name: f.read_bytes() for f in src.glob("*.hlo.gz")}
    else:
        with tarfile.open(src) as tar:
            files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()
                     if m.name.endswith(".hlo.gz")}
    return {k.removesuffix(".hlo.gz"): gzip.decompress(v).decode() for k, v in files.items()}


def measure_rates(small: bool) -> tuple[float, float, float]:
    """The dense bf16 and FP8 rates and the HBM bandwidth of this process's device."""
    import jax
    import jax.numpy as jnp
    n = 256 if small else 8192
    bf16 = bench.dense_ceiling(n, 2, 5)["tflops"]
    fp8 = bench.dense_ceiling(n, 2, 5, dtype="fp8")["tflops"]
    x = jnp.ones(((1 << 16) if small else (1 << 29),), jnp.bfloat16)
    sec = bench.median_seconds(jax.jit(lambda v: v * 2), (x,), 2, 7)
    return bf16, fp8, 2 * x.size * 2 / sec / 1e9


# ----------------------------------------------------------------------------- the MoE layer


def moe_compiled(run, mesh, s: MoeShape, transport, chunks, local_first=False, host_axis=None):
    """The layer's train step on ``mesh`` (its expert axes: every axis but ``'data'``; with
    ``host_axis`` the two-stage exchange over it)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import moe
    expert_axes = tuple(a for a in mesh.axis_names if a != "data")
    o = moe.MoEOptions.create(s.experts, s.top_k, transport=transport, capacity_factor=1.25,
                              dispatch_dtype="fp8", combine_grad_dtype="fp8",
                              overlap_chunks=chunks, local_first=local_first,
                              expert_axis=expert_axes, host_axis=host_axis,
                              num_groups=s.num_groups, topk_groups=s.topk_groups)
    ndev = int(np.prod(mesh.devices.shape))

    def loss(x, router, wgu, wd, ct):
        y, aux = moe.moe_apply(x, router, wgu, wd, options=o, mesh=mesh)
        y = y.astype(jnp.float32)  # 'linear' leaves y dead, 'square' uses it (see --loss)
        out = 0.5 * jnp.sum(y * y * ct) if run.a.loss == "square" else jnp.sum(y * ct)
        return out + 0.01 * aux["load_balance_loss"]

    def sds(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    tok = P(tuple(mesh.axis_names))
    args = (sds((ndev, s.tokens, s.d_model), jnp.bfloat16, tok),
            sds((s.d_model, s.experts), jnp.float32, P()),
            sds((s.experts, s.d_model, 2 * s.d_ff), jnp.bfloat16, P(expert_axes)),
            sds((s.experts, s.d_ff, s.d_model), jnp.bfloat16, P(expert_axes)),
            sds((ndev, s.tokens, s.d_model), jnp.float32, tok))
    p = int(np.prod([mesh.shape[a] for a in expert_axes]))
    return run.build(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args),
                     grouped_rows(s.tokens, chunks, s.top_k, p, local_first and p > 1))


def moe_cases(run, tag: str, mesh, chunk_list, local_list):
    s = run.shapes[tag]
    for transport in ("dense", "dropless"):
        counts = chunk_list if tag == "A" else sorted({1, run.defaults[transport]})
        for c in counts:
            for lf in (local_list if tag == "A" else [False]):
                name = f"moe_ep8_{tag}_{transport}{'_local_first' if lf else ''}_chunks{c}"
                extra = {"shape": dataclasses.asdict(s), "transport": transport, "chunks": c,
                         "local_first": lf,
                         "grouped_rows": grouped_rows(s.tokens, c, s.top_k, 8, lf)}
                run.case(name, lambda t=transport, c=c, lf=lf: moe_compiled(
                    run, mesh, s, t, c, lf), extra)


def multi_host_cases(run, group, chunk_list, local_list):
    """A's per-device work (4 local experts, 8192 tokens) over 16 or 64 GPUs."""
    topo, ndev = ("2x8x1", 16) if group == "moe16" else ("8x8x1", 64)
    if run.a.small:  # 8 CPU devices as 2 "hosts" of 4 (devices_per_host)
        topo, ndev = "cpu", 8
    mesh = run.mesh(topo, (1, ndev), ("data", "expert"))
    a_shape = run.shapes["A"]
    s = dataclasses.replace(a_shape, experts=a_shape.experts // 8 * ndev)
    for c in sorted({1, run.defaults["dense"], max(chunk_list)}):
        for lf in local_list:
            name = (f"moe_ep{ndev if not run.a.small else group[3:]}_A_dense"
                    f"{'_local_first' if lf else ''}_chunks{c}")
            extra = {"topology": topo, "placement": "expert axis over every host", "chunks": c,
                     "local_first": lf, "shape": dataclasses.asdict(s),
                     "grouped_rows": grouped_rows(s.tokens, c, s.top_k, mesh.shape["expert"], lf)}
            run.case(name, lambda c=c, lf=lf: moe_compiled(run, mesh, s, "dense", c, lf), extra)
    hosts = 2 if run.a.small else ndev // 8
    split = run.mesh(topo, (1, hosts, ndev // hosts), ("data", "host", "expert"))
    two_stage_cases(run, group, split, s, topo)
    if group == "moe16":  # the experts within a host, the hosts data parallel
        mesh2, c = run.mesh(topo, (2, ndev // 2), ("data", "expert")), run.defaults["dense"]
        extra = {"topology": topo, "placement": "expert axis within a host, data across",
                 "chunks": c, "shape": dataclasses.asdict(a_shape),
                 "grouped_rows": grouped_rows(a_shape.tokens, c, a_shape.top_k)}
        run.case(f"moe_ep8x2hosts_A_dense_chunks{c}",
                 lambda: moe_compiled(run, mesh2, a_shape, "dense", c), extra)


def two_stage_cases(run, group, mesh, s: MoeShape, topo, shape_tag="A", stages=("two",)):
    """``s``'s layer on ``mesh`` (``('data', 'host', 'expert')``) with the one- and/or
    two-stage exchange, dense, the layer's default chunks."""
    c = run.defaults["dense"]
    ndev = int(mesh.devices.size)
    for stage in stages:
        name = f"moe_ep{group[-2:]}_{shape_tag}_dense_{stage}_stage_chunks{c}"
        extra = {"topology": topo, "placement": "expert axis ('host', 'expert') over every host",
                 "exchange": f"{stage}-stage", "chunks": c, "shape": dataclasses.asdict(s),
                 "devices": ndev, "grouped_rows": grouped_rows(s.tokens, c, s.top_k)}
        run.case(name, lambda stage=stage: moe_compiled(
            run, mesh, s, "dense", c, host_axis="host" if stage == "two" else None), extra)


def deepseek_cases(run, group):
    """DeepSeek-V3's per-device work at EP=64 (4 local experts, 8 hosts) or the same work at
    EP=16 (16 local experts, 2 hosts), one-stage and two-stage."""
    topo, ndev = ("2x8x1", 16) if group == "ds16" else ("8x8x1", 64)
    hosts, local = ndev // 8, 8
    if run.a.small:  # 8 CPU devices as 2 "hosts" of 4
        topo, hosts, local = "cpu", 2, 4
    mesh = run.mesh(topo, (1, hosts, local), ("data", "host", "expert"))
    two_stage_cases(run, group, mesh, run.shapes["D"], topo, "D", ("one", "two"))


def gpu1(run):
    """The layer at A's per-device work on one real GPU, 1 and 2 chunks, timed interleaved,
    against the replay's prediction of the same programs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import moe
    from xla_comm import schedule
    s = run.shapes["A"]
    e1 = s.experts // 8
    mesh = jax.make_mesh((1, 1), ("data", "expert"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    k = jax.random.split(jax.random.key(0), 5)
    args = jax.device_put((
        bench.normal(k[0], (1, s.tokens, s.d_model)),
        bench.normal(k[1], (s.d_model, e1), 1.0, jnp.float32),
        bench.normal(k[2], (e1, s.d_model, 2 * s.d_ff), 0.02),
        bench.normal(k[3], (e1, s.d_ff, s.d_model), 0.02),
        bench.normal(k[4], (1, s.tokens, s.d_model), 1.0, jnp.float32)), NamedSharding(mesh, P()))
    fns = {}
    for c in (1, 2):
        o = moe.MoEOptions.create(e1, s.top_k, dispatch_dtype="fp8", combine_grad_dtype="fp8",
                                  overlap_chunks=c)

        def loss(x, router, wgu, wd, ct, o=o):
            y, aux = moe.moe_apply(x, router, wgu, wd, options=o, mesh=mesh)
            return jnp.sum(y.astype(jnp.float32) * ct) + 0.01 * aux["load_balance_loss"]

        fns[c] = bench.compile_with(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args),
                                    run.opts)[0]
    med = bench.medians(bench.interleaved({c: (lambda f=f: f(*args)) for c, f in fns.items()},
                                          3 if run.a.small else 15, inner=3, warmup=2))
    pred = {c: schedule.schedule_report(fns[c], run.hw, grouped_rows=grouped_rows(
        s.tokens, c, s.top_k)).step_us * 1e-6 for c in (1, 2)}
    run.report.update(chunked_over_unchunked_1gpu=med[2] / med[1],
                      compute_model_error=pred[1] / med[1] - 1)
    run.report["cases"]["gpu1_layer"] = {
        "shape": dataclasses.asdict(s) | {"experts": e1}, "measured_s": med, "predicted_s": pred,
        "model_error": {c: pred[c] / med[c] - 1 for c in (1, 2)}}
    run.write_hlo("gpu1_layer_chunks1", fns[1])
    print(f"1 GPU: 2 chunks / 1 = {med[2] / med[1]:.3f}; model error "
          f"{pred[1] / med[1] - 1:+.1%}", flush=True)
    run.save()


# ----------------------------------------------------------------------------- sharded Muon


def muon_compiled(run, mesh, gather_dtype, chunk_bytes, reduce_dtype=None):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import muon_jax
    layers, d, f = (2, 128, 352) if run.a.small else (8, 4096, 11008)
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_gate": (d, f),
              "w_up": (d, f), "w_down": (f, d)}
    rep, dsh = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = {f"layer_{i}": {k: jax.ShapeDtypeStruct(v, jnp.float32, sharding=rep)
                             for k, v in shapes.items()} for i in range(layers)}
    ndev = int(np.prod(mesh.devices.shape))
    data = jax.tree.map(lambda p: jax.ShapeDtypeStruct((ndev, *p.shape), jnp.float32,
                                                       sharding=dsh), params)
    tx = muon_jax.muon(0.02, sharding=muon_jax.ShardingOptions(
        mesh, gather_dtype=gather_dtype, chunk_bytes=chunk_bytes or None,
        reduce_dtype=reduce_dtype))
    state = jax.eval_shape(tx.init, params)

    def loss(p, data):
        return sum(jax.tree.leaves(jax.tree.map(lambda w, x: jnp.einsum(
            "dmn,mn->d", x, w, preferred_element_type=jnp.float32, out_sharding=dsh).sum(),
            p, data)))

    def step(p, st, data):
        grads = jax.grad(loss)(muon_jax.reduced_view(p, "data"), data)
        updates, st = tx.update(grads, st, p)
        return optax.apply_updates(p, updates), st

    with jax.set_mesh(mesh):
        return run.build(jax.jit(step).lower(params, state, data))


def muon_cases(run):
    import jax.numpy as jnp
    mesh = run.mesh("1x8x1", (8,), ("data",))
    reduce, gather = (set(getattr(run.a, f"muon_{k}_dtypes").split(","))
                      for k in ("reduce", "gather"))
    if not reduce | gather <= {"f32", "bf16"}:
        raise SystemExit(f"--muon-reduce-dtypes and --muon-gather-dtypes take f32 and/or "
                         f"bf16, got {reduce} and {gather}")
    variants = [(None, "f32", None)] * ("f32" in gather) + [(jnp.bfloat16, "bf16", None)] * (
        "bf16" in gather) + [(jnp.bfloat16, "bf16", jnp.bfloat16)] * ("bf16" in reduce)
    for cb in (int(v) for v in run.a.muon_chunk_bytes.split(",")):
        for gd, label, rd in variants:
            name = (f"muon_dp8_{label}_gather" + ("_bf16_reduce" if rd else "")
                    + (f"_chunk{cb}" if cb else ""))
            run.case(name, lambda gd=gd, cb=cb, rd=rd: muon_compiled(run, mesh, gd, cb, rd),
                     {"gather_dtype": label, "chunk_bytes": cb or None,
                      "reduce_dtype": "bf16" if rd else None})


# ----------------------------------------------------------------------------- the trainer


def train_setup(run, mesh_shape, micro_batches, chunks, optimizer="muon"):
    """The trainer's arguments for a case (``--train-flags`` for Muon's), its chunks
    (``auto``: what ``--pgle`` runs when the step is scheduled on the modeled latencies, else
    the layer's own) and grouped rows. The batch is ``--train-batch`` sequences (default: the
    preset's, 64 on its one GPU, per device)."""
    import shlex

    import numpy as np
    import train_lm

    import moe
    ndev = int(np.prod(mesh_shape))
    preset = ["--preset", "cpu" if run.a.small else "gpu", "--micro-batches", str(micro_batches)]
    batch = run.a.train_batch or train_lm.parse_args(preset).batch * ndev
    preset += ["--batch", str(batch)]
    args = train_lm.parse_args(preset)
    if chunks == "auto":
        mesh = types.SimpleNamespace(shape=dict(zip(train_lm.MESH_AXES, mesh_shape, strict=True)),
                                     devices=np.zeros(mesh_shape))
        chunks = train_lm.resolve_overlap_chunks(args, mesh, pgle=bool(run.a.latency_model))
    tokens = args.batch * args.seq_len // ndev // micro_batches
    c = moe.auto_overlap_chunks(mesh_shape[1], tokens, "dense") if chunks == "auto" else int(chunks)
    argv = [*preset, "--optimizer", optimizer, "--mesh", ",".join(map(str, mesh_shape)),
            "--overlap-chunks", str(chunks)]
    if optimizer == "muon":
        argv += shlex.split(run.a.train_flags)
    return train_lm.parse_args(argv), chunks, grouped_rows(tokens, c, args.top_k)


def abstract_model(mesh, cfg):
    """The trainer's model as ``(graphdef, params, rest)`` of ``jax.ShapeDtypeStruct`` s
    placed on ``mesh`` as ``lm_model.create_sharded`` places them (no arrays: the mesh's
    devices may be virtual)."""
    import jax
    import lm_model
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    abstract = nnx.eval_shape(lambda: lm_model.TransformerLM(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    gdef, params, rest = nnx.split(abstract, nnx.Param, ...)

    def placed(x, spec):
        spec = spec.get_value() if hasattr(spec, "get_value") else getattr(spec, "value", spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
            mesh, spec if isinstance(spec, P) else P()))

    params = jax.tree.map(placed, params, nnx.get_partition_spec(params),
                          is_leaf=lambda v: isinstance(v, nnx.Variable))
    rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, P())), rest)
    return gdef, params, rest


def train_compiled(run, mesh_shape, args, rows):
    """The trainer's step (``train_lm.train_step``, or ``train_step_unreduced`` on an
    Explicit mesh when Muon's gradients arrive unreduced) with its own optimizer
    (``train_lm.make_tx``), lowered on abstract params and compiled."""
    import jax
    import jax.numpy as jnp
    import optax
    import train_lm
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    unreduced = train_lm.unreduced_grads(args)
    mesh = run.mesh("1x8x1", mesh_shape, train_lm.MESH_AXES, explicit=unreduced)  # as the trainer
    with jax.set_mesh(mesh):
        gdef, params, rest = abstract_model(mesh, train_lm.model_config(args))
        tx = train_lm.make_tx(args.optimizer, args, mesh,
                              param_specs=jax.tree.map(lambda x: x.sharding.spec, params))
        state = jax.eval_shape(tx.init, params)
        batch = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32,
                                     sharding=NamedSharding(mesh, P(train_lm.MESH_AXES)))

        def step(params, rest, state, batch):
            view = (train_lm.reduced_muon_view(params, args.router_optimizer) if unreduced
                    else params)
            grads = jax.grad(lambda p: train_lm.loss_terms(
                nnx.merge(gdef, p, rest), batch, args.aux_loss, args.z_loss)[0])(view)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return run.build(jax.jit(step).lower(params, rest, state, batch), rows)


def backward_order(compiled_or_text) -> dict:
    """Where a compiled step's reduce-scatters and all-gathers start in its schedule (the
    entry computation's order) against the backward pass's last GEMM (a GEMM named
    ``transpose(jvp(...))``, the name JAX gives the backward pass; None where there is none):
    per kind, how many there are, how many start ``before`` that GEMM, and the position of the
    ``first``. Gradients reduced as the backward pass produces them, and updates gathered
    while it still runs, start before it.

    Returns:
      ``{'last_backward_gemm': int | None, 'reduce-scatter': {'count', 'before', 'first'},
      'all-gather': {...}}``.
    """
    from xla_comm import costs, hlo
    mod = hlo.parse_hlo(compiled_or_text)
    entry = mod.entry or next(iter(mod.computations))
    order = {ins.name: k for k, ins in enumerate(mod.computations[entry])}
    table = {ins.name: ins for ins in mod.instructions()}
    last = max((order[ins.name] for ins in mod.computations[entry]
                if "transpose(jvp" in ins.attrs
                and costs.instruction_cost(ins, mod, table).gemm), default=None)
    colls = hlo.analyze_collectives(hlo.hlo_text(compiled_or_text))
    out = {"last_backward_gemm": last}
    for kind in ("reduce-scatter", "all-gather"):
        starts = sorted(order[c.name] for c in colls if c.kind == kind and c.name in order)
        out[kind] = {"count": len(starts),
                     "before": sum(last is not None and k < last for k in starts),
                     "first": starts[0] if starts else None}
    return out


def train_cases(run):
    """Per ``--train-meshes`` mesh and ``--train-variants`` variant, the trainer's Muon step
    (``train_step_meshDxE...``) and, per ``--train-optimizers``, its AdamW step (``..._adamw``)."""
    import sys
    sys.path.append(str(bench.library_root() / "examples"))
    optimizers = run.a.train_optimizers.split(",")
    if not set(optimizers) <= {"muon", "adamw"}:
        raise SystemExit(f"--train-optimizers takes muon and/or adamw, got {optimizers}")
    for shape in (tuple(int(n) for n in m.split("x")) for m in run.a.train_meshes.split(",")):
        for v, opt in ((v, o) for v in run.a.train_variants.split(",") for o in optimizers):
            mb, _, ch = v.partition("x")
            mb, ch = int(mb), ch or "auto"
            name = (f"train_step_mesh{shape[0]}x{shape[1]}" + (f"_micro{mb}" if mb > 1 else "")
                    + (f"_chunks{ch}" if ch != "auto" else "")
                    + ("_adamw" if opt == "adamw" else ""))
            args, chunks, rows = train_setup(run, shape, mb, ch, opt)
            run.case(name, lambda s=shape, args=args, rows=rows: train_compiled(
                run, s, args, rows), {"mesh": list(shape), "micro_batches": mb,
                                      "overlap_chunks": chunks, "grouped_rows": rows,
                                      "optimizer": opt, "batch": args.batch,
                                      "flags": run.a.train_flags if opt == "muon" else ""})


# ----------------------------------------------------------------------------- summary


def data_parallel_train(cases: dict) -> dict:
    """The headline keys of the data-parallel train steps (meshes (8, 1) and (4, 2)): the
    exposed share of each Muon step's collective time, and on (8, 1) its step time over AdamW's
    (None for a case not compiled)."""
    def summary(name):
        return cases[name]["all"] if "all" in cases.get(name, {}) else None

    out = {}
    for key, mesh in (("dp8", "8x1"), ("4x2", "4x2")):
        muon, adamw = summary(f"train_step_mesh{mesh}"), summary(f"train_step_mesh{mesh}_adamw")
        out[f"train_step_{key}_exposed_fraction"] = muon and muon["exposed_fraction"]
        out[f"train_step_{key}_adamw_exposed_fraction"] = adamw and adamw["exposed_fraction"]
        out[f"train_step_{key}_muon_over_adamw_step"] = (
            muon["step_us"] / adamw["step_us"] if muon and adamw else None)
    return out


def summarize(report: dict, defaults: dict[str, int]) -> dict:
    """The report with its headline keys first, recomputed from its cases (None for a case
    not compiled), ``targets`` and ``met``."""
    cases = report["cases"]

    def frac(name):
        return cases[name]["all"]["exposed_fraction"] if "all" in cases.get(name, {}) else None

    def floor(name):  # the least exposed share any order of the step's work reaches
        return cases[name]["all"].get("exposed_floor_fraction") if name in cases else None

    def xla(name):  # the compile on XLA's own latency estimates
        c = cases.get(name, {}).get("xla_estimates") or cases.get(f"{name}.xla_estimates")
        return None if c is None else c["all"]["exposed_fraction"]

    dn, dl = defaults["dense"], defaults["dropless"]
    m8, m8d, mu, tr = (f"moe_ep8_A_dense_chunks{dn}", f"moe_ep8_A_dropless_chunks{dl}",
                       "muon_dp8_bf16_gather", "train_step_mesh1x8")
    head = {"moe_ep8_exposed_fraction": frac(m8), "moe_ep8_dropless_exposed_fraction": frac(m8d),
            "moe_ep8_dropless_unchunked_exposed_fraction": frac("moe_ep8_A_dropless_chunks1"),
            "moe_ep8_B_exposed_fraction": frac(f"moe_ep8_B_dense_chunks{dn}"),
            "moe_ep8_B_dropless_exposed_fraction": frac(f"moe_ep8_B_dropless_chunks{dl}")}
    for key, case in (("", mu), ("f32_gather_", "muon_dp8_f32_gather"),
                      ("bf16_reduce_", "muon_dp8_bf16_gather_bf16_reduce")):
        head[f"muon_dp8_{key}exposed_fraction"] = frac(case)
        head[f"muon_dp8_{key}chunked_exposed_fraction"] = frac(f"{case}_chunk1")
        head[f"muon_dp8_{key}exposed_floor"] = floor(case)
    head["muon_dp8_exposed_over_floor"] = (None if frac(mu) is None or floor(mu) is None
                                           else frac(mu) - floor(mu))
    head.update(data_parallel_train(cases))
    head.update({"train_step_ep8_exposed_fraction": frac(tr),
                 "train_step_2x4_exposed_fraction": frac("train_step_mesh2x4"),
                 "moe_ep16_exposed_fraction": frac(f"moe_ep16_A_dense_chunks{dn}"),
                 "moe_ep64_exposed_fraction": frac(f"moe_ep64_A_dense_chunks{dn}"),
                 "train_step_ep8_chunks2_exposed_fraction": frac(f"{tr}_chunks2"),
                 "train_step_ep8_micro2_exposed_fraction": frac(f"{tr}_micro2_chunks2"),
                 "moe_ep8_exposed_fraction_xla_estimates": xla(m8),
                 "moe_ep8_dropless_exposed_fraction_xla_estimates": xla(m8d),
                 "muon_dp8_exposed_fraction_xla_estimates": xla(mu),
                 "train_step_ep8_exposed_fraction_xla_estimates": xla(tr)})
    a2a = [cases[k]["payload_all_to_all"] for k in (m8, m8d) if k in cases]
    head["moe_ep8_windows"] = sum(x["windows"] for x in a2a) if a2a else None
    head["moe_ep8_windows_with_gemm"] = sum(x["windows_with_gemm"] for x in a2a) if a2a else None
    head.update(two_stage_keys(cases, dn, frac))
    lf = {t: f"moe_ep8_A_{t}_local_first_chunks{n}" for t, n in (("dense", dn), ("dropless", dl))}
    if all(k in cases for k in lf.values()):  # the layer with local_first (not its default)
        for t, k in lf.items():
            base = cases.get(f"moe_ep8_A_{t}_chunks{defaults[t]}")
            head[f"moe_ep8_{t}_local_first_exposed_fraction"] = frac(k)
            head[f"moe_ep8_{t}_local_first_step_over_default"] = (
                None if base is None else cases[k]["all"]["step_us"] / base["all"]["step_us"])
    out = {**head, **{k: v for k, v in report.items() if k not in head}}
    out["defaults"] = dict(defaults)
    out["targets"] = {k: f"<= {v}" for k, v in TARGETS.items()} | {
        "moe_ep8_windows_with_gemm": "== moe_ep8_windows"}
    out["met"] = {k: out[k] <= v for k, v in TARGETS.items() if out.get(k) is not None}
    if a2a:
        out["met"]["moe_ep8_windows_with_gemm"] = (head["moe_ep8_windows_with_gemm"]
                                                   == head["moe_ep8_windows"])
    return out


def two_stage_keys(cases: dict, chunks: int, frac) -> dict:
    """The two-stage exchange's headline keys: for DeepSeek-V3's work (``D``) at EP=16 and 64
    the exposed fractions of both exchanges, the step and the all-to-alls' bytes across hosts
    of the two-stage one over the one-stage one; for shape A at EP=16 and 64 the two-stage
    exposed fraction and step over the one-stage cases (``moe_ep16/64_A_dense``)."""
    def ratio(a, b, part, key):
        if a not in cases or b not in cases or not cases[b][part][key]:
            return None
        return cases[a][part][key] / cases[b][part][key]

    out = {}
    for ep in ("16", "64"):
        one, two = (f"moe_ep{ep}_D_dense_{s}_stage_chunks{chunks}" for s in ("one", "two"))
        out[f"moe_ep{ep}_one_stage_exposed_fraction"] = frac(one)
        out[f"moe_ep{ep}_two_stage_exposed_fraction"] = frac(two)
        out[f"moe_ep{ep}_two_stage_step_over_one_stage"] = ratio(two, one, "all", "step_us")
        out[f"moe_ep{ep}_cross_host_bytes_ratio"] = ratio(two, one, "all_to_all",
                                                          "cross_host_bytes")
        a_one, a_two = (f"moe_ep{ep}_A_dense_chunks{chunks}",
                        f"moe_ep{ep}_A_dense_two_stage_chunks{chunks}")
        out[f"moe_ep{ep}_A_two_stage_exposed_fraction"] = frac(a_two)
        out[f"moe_ep{ep}_A_two_stage_step_over_one_stage"] = ratio(a_two, a_one, "all", "step_us")
        out[f"moe_ep{ep}_A_cross_host_bytes_ratio"] = ratio(a_two, a_one, "all_to_all",
                                                            "cross_host_bytes")
    return out


def write_target_config(path: str) -> None:
    from jax._src.lib import _jax  # no public API gives the text (jax 0.10-0.12)
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1")
    text = str(_jax.get_topology_for_devices(topo.devices).target_config)
    Path(path).write_text(f"# GpuTargetConfigProto of {topo.devices[0].device_kind}, written "
                          f"by\n# benchmarks/schedule8.py --write-target-config on that GPU.\n"
                          f"{text}")


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.write_target_config:
        return write_target_config(a.write_target_config) or {}
    import moe
    defaults = {t: a.default_chunks or n for t, n in moe.options.OVERLAP_CHUNKS.items()}
    if a.summarize:
        report = summarize(json.loads(Path(a.summarize).read_text()), defaults)
        bench.write_json(a.out, report)
        return report
    run, groups = Run(a, defaults, argv), set(a.only.split(","))
    chunk_list = [int(c) for c in a.chunks.split(",")]
    local_list = [v == "on" for v in a.local_first.split(",")]
    ep8 = run.mesh("1x8x1", (1, 8), ("data", "expert"))
    if "moe8" in groups:
        moe_cases(run, "A", ep8, chunk_list, local_list)
    if "gpu1" in groups and not a.rates_from:
        if run.gpu or a.small:
            try:
                gpu1(run)
            except Exception as err:  # noqa: BLE001  (record and go on)
                run.report["errors"]["gpu1_layer"] = f"{type(err).__name__}: {err}"[:3000]
        else:
            run.report["skipped"].append("gpu1_layer (no GPU in this process)")
    if "muon" in groups:
        muon_cases(run)
    for group in ("moe16", "moe64"):
        if group in groups:
            multi_host_cases(run, group, chunk_list, local_list)
    for group in ("ds16", "ds64"):
        if group in groups:
            deepseek_cases(run, group)
    if "train" in groups:
        train_cases(run)
    if "moe8b" in groups:  # the second shape set last: the most compile time
        moe_cases(run, "B", ep8, chunk_list, [False])
    for name in sorted(set(run.replay) - set(run.report["cases"])):  # modules no case compiles
        base = run.extra.get(name.removesuffix(".xla_estimates"), {})
        run.record(name, run.replay[name], base | {"replayed": True})
    run.report["elapsed_seconds"] = time.perf_counter() - run.t0
    run.save()
    report = summarize(run.report, defaults)
    print(json.dumps({k: report[k] for k in TARGETS if k in report}, indent=1))
    return report


if __name__ == "__main__":
    main()
