"""Exposed communication of 8-, 16- and 64-GPU steps, predicted from their compiled schedules.

Compiles (without running) programs for virtual topologies of the local GPU kind
(`xla_comm.schedule.topology_mesh`: ``1x8x1`` is 8 GPUs of one host, ``2x8x1`` and ``8x8x1``
two and eight such hosts), with XLA's overlap options, and replays each schedule with
`xla_comm.schedule.schedule_report` (compute at rates measured in this run, transfers at
``--link-gbps`` per GPU within a host and ``--inter-host-gbps`` across hosts):

* the MoE layer's train step (forward + backward, FP8 wires, capacity 1.25) at EP=8, shape
  set A (8192 tokens per device, d 2048, d_ff 1024, 32 experts, top-2) and B (d 4096, d_ff
  2048, 64 experts, top-8), dense and dropless, for each ``--chunks`` count of
  ``overlap_chunks``; A's per-device work (8192 tokens, 4 local experts: 64 experts over 16
  GPUs, 256 over 64) also over 16 GPUs (2 hosts; the expert axis across both, or within each
  host with the hosts data parallel) and 64 (8 hosts);
* sharded Muon on 8 GPUs, the 1.6B set of ``benchmarks/muon_step.py`` (f32 params), with the
  updates gathered in f32 and in bf16 (and with ``--muon-reduce-dtypes f32,bf16`` the bf16
  gathers after bf16 reduce-scatters), for each ``--muon-chunk-bytes`` value of ``chunk_bytes``
  (0: the library default, one collective per stack and direction);
* ``examples/train_lm.py``'s step with its GPU preset on meshes (1, 8) and (2, 4), as the
  trainer runs it: with ``--latency-model`` (standing in for the trainer's ``--pgle``) its MoE
  layers in ``train_lm.PGLE_OVERLAP_CHUNKS`` chunks.

On the one real GPU it also times the MoE layer at shape A's per-device work (EP=1, the 4
local experts' worth: 4 experts, 8192 tokens) unchunked and in 2 chunks (interleaved
medians), and checks the compute side of the model against it: ``compute_model_error`` =
predicted / measured - 1 of that program's step time.

Writes ``--out`` (JSON: the summary keys first, every case's summary under ``cases``) and,
with ``--hlo-dir``, every compiled module's text (gzip), so the report can be replayed later
on a CPU (``python -c "from xla_comm import schedule; ..."``).

Usage:
  python benchmarks/schedule_report.py --out OUT/schedule8.json
  python benchmarks/schedule_report.py --small   # CPU: 8 simulated devices stand in
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

from _schedule_cli import (  # the script's folder is on the path
    HEADLINE,
    grouped_rows,
    parse_args,
    summarize,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MEASURED_LINK_GBPS = 153.0  # all_to_all per GPU between two H200s of one host (BENCHMARKS.md)


@dataclasses.dataclass(frozen=True)
class MoeShape:
    tokens: int  # per device
    d_model: int
    d_ff: int
    experts: int
    top_k: int


PAYLOAD_BYTES = 64 * 1024
"""All-to-alls sending at least this many bytes per device are a layer's payload exchanges."""
SHAPES = {"A": MoeShape(8192, 2048, 1024, 32, 2), "B": MoeShape(8192, 4096, 2048, 64, 8)}
SMALL_SHAPES = {"A": MoeShape(512, 256, 128, 16, 2), "B": MoeShape(512, 512, 256, 16, 4)}


def _commit() -> str:
    if (ROOT / "COMMIT").exists():
        return (ROOT / "COMMIT").read_text().strip()
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # no git on the device machine
        return "unknown"


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.latency_model is None:
        a.latency_model = not a.small
    if a.write_target_config:
        from jax._src.lib import _jax  # no public API gives the text (jax 0.10-0.12)
        from jax.experimental import topologies
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1")
        text = str(_jax.get_topology_for_devices(topo.devices).target_config)
        Path(a.write_target_config).write_text(
            f"# GpuTargetConfigProto of {topo.devices[0].device_kind}, written by\n"
            f"# benchmarks/schedule_report.py --write-target-config on that GPU.\n{text}")
        print(f"wrote {a.write_target_config}")
        return {}
    if a.summarize:
        report = json.loads(Path(a.summarize).read_text())
        if "defaults" in report:
            defaults = report["defaults"]
        else:  # a report cut short before its summary: the layer's chunk counts
            sys.path[:0] = [str(ROOT)]
            import moe
            defaults = dict(moe.layer.OVERLAP_CHUNKS)
        if a.default_chunks:
            defaults = {t: a.default_chunks for t in defaults}
        report = summarize(report, defaults)
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({k: report[k] for k in HEADLINE}, indent=1))
        return report
    if a.small:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    sys.path[:0] = [str(ROOT), str(HERE), str(ROOT / "examples")]
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from bench_util import compile_with, dense_ceiling, env_info, median_seconds, write_json
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import moe
    import muon_jax
    from accel_kernels import platform
    from xla_comm import latency, overlap, schedule

    t0 = time.perf_counter()
    groups = set((a.only or "moe8,moe8b,muon,train,moe16,moe64,gpu1").split(","))
    chunk_list = [int(c) for c in a.chunks.split(",")]
    train_list = []  # (micro_batches, overlap_chunks) of the trainer's cases
    for v in a.train_variants.split(","):
        mb, _, ch = v.partition("x")
        train_list.append((int(mb), ch or "auto"))
    defaults = dict(moe.layer.OVERLAP_CHUNKS)  # the layer's chunk counts by transport
    if a.default_chunks:
        defaults = {t: a.default_chunks for t in defaults}
    shapes = SMALL_SHAPES if a.small else SHAPES
    report: dict = {"benchmark": "schedule_report", "env": env_info(), "commit": _commit(),
                    "command": " ".join(["python", "benchmarks/schedule_report.py",
                                         *(argv if argv is not None else sys.argv[1:])]),
                    "date": time.strftime("%Y-%m-%d"), "cases": {}, "skipped": [],
                    "errors": {}}
    hlo_dir = Path(a.hlo_dir) if a.hlo_dir else None
    target_config = Path(a.target_config).read_text() if a.target_config else None
    report["target_config"] = a.target_config
    # Compiled without the GPU, the layer's 'auto' kernel choices must still be that GPU's,
    # not those of the CPU this process runs on.
    target = contextlib.nullcontext  # a fresh context per case
    if target_config is not None:
        cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", target_config)
        major = re.search(r"major:\s*(\d+)", cc.group(1)) if cc else None
        minor = re.search(r"minor:\s*(\d+)", cc.group(1)) if cc else None
        if major is None:
            raise SystemExit(f"{a.target_config}: no cuda_compute_capability major")
        cc = (int(major.group(1)), int(minor.group(1)) if minor else 0)
        target = lambda: platform.compiling_for_cuda(cc)  # noqa: E731
    if hlo_dir:
        hlo_dir.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- the measured rates
    if a.rates_from:  # a GPU run's rates and one-GPU layer, these modules replayed with them
        device = json.loads(Path(a.rates_from).read_text())
        h = device["hardware"]
        bf16, fp8, hbm = h["gemm_tflops"], h["fp8_gemm_tflops"], h["hbm_GBps"]
        report["rates_source"] = f"measured by the run in {Path(a.rates_from).name}"
        report["device_run"] = {k: device.get(k) for k in ("env", "commit", "date", "command")}
        for k in ("chunked_over_unchunked_1gpu", "compute_model_error"):
            if k in device:
                report[k] = device[k]
        if "gpu1_layer" in device.get("cases", {}):
            report["cases"]["gpu1_layer"] = device["cases"]["gpu1_layer"]
        groups.discard("gpu1")
    elif a.rates:
        bf16, fp8, hbm = (float(v) for v in a.rates.split(","))
        report["rates_source"] = "--rates"
    else:
        n = 256 if a.small else 8192
        bf16 = dense_ceiling(n, 2, 5)["tflops"]
        fp8 = dense_ceiling(n, 2, 5, dtype="fp8")["tflops"]
        x = jnp.ones(((1 << 16) if a.small else (1 << 29),), jnp.bfloat16)
        copy = jax.jit(lambda v: v * 2)
        sec, _ = median_seconds(copy, (x,), 2, 7)
        hbm = 2 * x.size * 2 / sec / 1e9
        del x
        report["rates_source"] = "measured in this run"
    hw = schedule.Hardware(gemm_tflops=bf16, fp8_gemm_tflops=fp8, hbm_GBps=hbm,
                           link_GBps=a.link_gbps or MEASURED_LINK_GBPS,
                           inter_host_GBps=a.inter_host_gbps,
                           devices_per_host=4 if a.small else 8)
    report["hardware"] = dataclasses.asdict(hw)
    report["link_GBps_assumed"] = hw.link_GBps
    report["link_source"] = ("MEASURED_LINK_GBPS: all_to_all on 2x H200, "
                             "jax 0.11.2 (BENCHMARKS.md)" if a.link_gbps is None
                             else "--link-gbps")
    print(f"[{time.perf_counter() - t0:5.0f}s] rates: bf16 {bf16:.0f} TF/s, fp8 {fp8:.0f}, "
          f"HBM {hbm:.0f} GB/s; link {hw.link_GBps} GB/s", flush=True)

    opts = None if a.small else overlap.overlap_compiler_options(
        parallel_collectives=a.parallel_collectives)
    report["parallel_collectives"] = a.parallel_collectives
    for kv in a.xla_option:
        k, _, v = kv.partition("=")
        opts = dict(opts or {}, **{k: v})
    report["xla_options"] = a.xla_option
    report["latency_model"] = a.latency_model
    report_extra: dict[str, dict] = {}  # a replayed case's description

    def mesh_for(topology: str, shape, names, explicit=True):
        if a.small:
            devs = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
            kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
            return jax.sharding.Mesh(devs, names, axis_types=(kind,) * len(shape))
        return schedule.topology_mesh(topology, shape, names, explicit=explicit,
                                      target_config=target_config)

    replay: dict[str, str] = {}
    if a.replay:
        import tarfile
        src = Path(a.replay)
        if src.is_dir():
            files = {f.name: f.read_bytes() for f in src.glob("*.hlo.gz")}
        else:
            with tarfile.open(src) as tar:
                files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()
                         if m.name.endswith(".hlo.gz")}
        replay = {k.removesuffix(".hlo.gz"): gzip.decompress(v).decode()
                  for k, v in files.items()}
    report["replayed"] = sorted(replay)

    def save():
        """Write the report so far, summary keys included, and pack the modules written so
        far: a run cut short by a time limit keeps everything up to its last case."""
        if hlo_dir and a.hlo_tar:  # one file to carry home: the smallest modules first
            import tarfile
            files = sorted(hlo_dir.glob("*.hlo.gz"), key=lambda f: f.stat().st_size)
            total = 0
            with tarfile.open(a.hlo_tar, "w") as tar:
                for f in files:
                    if total + f.stat().st_size > 15 * 2**20:
                        break
                    tar.add(f, arcname=f.name)
                    total += f.stat().st_size
            report["hlo_tar"] = {"path": a.hlo_tar, "bytes": total}
        write_json(a.out, summarize(report, defaults))

    def summaries(compiled, rows=None):
        rep = schedule.schedule_report(compiled, hw, grouped_rows=rows)
        return {"all": rep.summary(), "all_to_all": rep.summary(("all-to-all",)),
                # the payload exchanges (the counts' tiny all-to-alls left out)
                "payload_all_to_all": rep.summary(("all-to-all",), min_bytes=PAYLOAD_BYTES)}

    def write_hlo(name, compiled):
        if hlo_dir:
            with gzip.open(hlo_dir / f"{name}.hlo.gz", "wt") as f:
                f.write(compiled if isinstance(compiled, str) else compiled.as_text())

    def build(lowered, rows=None):
        """The compiled step the report reads: with --latency-model, scheduled with the
        modeled latencies (xla_comm.latency; the first compile, on XLA's own estimates, is
        kept beside it)."""
        if not a.latency_model:
            return compile_with(lowered, opts)[0]
        return latency.compile_modeled(lowered, hw, compiler_options=opts, grouped_rows=rows)

    def record(name, compiled, extra=None):
        first = None
        if isinstance(compiled, latency.Modeled):
            compiled, first = compiled.compiled, compiled.default
        rows = (extra or {}).get("grouped_rows")
        out = {**summaries(compiled, rows), **(extra or {})}
        if first is not None:
            out["xla_estimates"] = summaries(first, rows)
            write_hlo(f"{name}.xla_estimates", first)
        report["cases"][name] = out
        write_hlo(name, compiled)
        pa = out["payload_all_to_all"]
        print(f"[{time.perf_counter() - t0:5.0f}s] {name}: exposed "
              f"{out['all']['exposed_fraction']:.3f} of {out['all']['collective_us']:.0f} us "
              f"(payload all-to-alls {pa['exposed_fraction']:.3f}, with GEMMs "
              f"{pa['windows_with_gemm']}/{pa['windows']}); step {out['all']['step_us']:.0f} us",
              flush=True)
        save()
        return out

    def run_case(name, fn):
        if name in replay:  # compiled by an earlier run: replay it with this run's rates
            return record(name, replay[name], report_extra.get(name, {}) | {"replayed": True})
        if time.perf_counter() - t0 > a.budget:
            report["skipped"].append(name)
            return None
        try:
            with target():
                return fn()
        except Exception as err:  # record and go on
            report["errors"][name] = f"{type(err).__name__}: {err}"[:3000]
            traceback.print_exc()
            return None

    # ---------------------------------------------------------------- the MoE layer
    def moe_compiled(mesh, s: MoeShape, transport, chunks, batch_axes=None, local_first=False):
        axes = tuple(mesh.axis_names)
        kw = {} if batch_axes is None else {"batch_axes": batch_axes}
        kw["local_first"] = local_first
        o = moe.MoEOptions.create(s.experts, s.top_k, transport=transport,
                                  capacity_factor=1.25, dispatch_dtype="fp8",
                                  combine_grad_dtype="fp8", overlap_chunks=chunks, **kw)
        ndev = int(np.prod(mesh.devices.shape))

        def loss(x, router, wgu, wd, ct):
            y, aux = moe.moe_apply(x, router, wgu, wd, options=o, mesh=mesh)
            return jnp.sum(y.astype(jnp.float32) * ct) + 0.01 * aux["load_balance_loss"]

        def sds(shape, dtype, spec):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

        tok = P(axes)
        args = (sds((ndev, s.tokens, s.d_model), jnp.bfloat16, tok),
                sds((s.d_model, s.experts), jnp.float32, P()),
                sds((s.experts, s.d_model, 2 * s.d_ff), jnp.bfloat16, P("expert")),
                sds((s.experts, s.d_ff, s.d_model), jnp.bfloat16, P("expert")),
                sds((ndev, s.tokens, s.d_model), jnp.float32, tok))
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        p = mesh.shape["expert"]
        return build(grad.lower(*args),
                     grouped_rows(s.tokens, chunks, s.top_k, p, local_first and p > 1))

    ep8 = mesh_for("1x8x1", (1, 8), ("data", "expert"))

    local_firsts = {"off": (False, ""), "on": (True, "_local_first")}
    local_list = [local_firsts[v] for v in a.local_first.split(",")]

    def moe8(tag):
        for transport in ("dense", "dropless"):
            for c in (chunk_list if tag == "A" else sorted({1, defaults[transport]})):
                for lf, suffix in (local_list if tag == "A" else [local_firsts["off"]]):
                    name = f"moe_ep8_{tag}_{transport}{suffix}_chunks{c}"
                    extra = {"shape": dataclasses.asdict(shapes[tag]), "transport": transport,
                             "chunks": c, "local_first": lf,
                             "grouped_rows": grouped_rows(shapes[tag].tokens, c,
                                                          shapes[tag].top_k, 8, lf)}
                    report_extra[name] = extra
                    run_case(name, lambda s=shapes[tag], t=transport, c=c, lf=lf, name=name,
                             extra=extra: record(name, moe_compiled(ep8, s, t, c,
                                                                    local_first=lf), extra))

    if "moe8" in groups:
        moe8("A")

    # ---------------------------------------------------------------- one real GPU
    if "gpu1" in groups and not a.small and jax.default_backend() != "gpu":
        report["skipped"].append("gpu1_layer (no GPU in this process)")
    elif "gpu1" in groups:
        def gpu1():
            s = shapes["A"]
            e1 = s.experts // 8  # the local experts of one EP=8 device
            dev_mesh = jax.make_mesh((1, 1), ("data", "expert"), devices=jax.devices()[:1],
                                     axis_types=(jax.sharding.AxisType.Explicit,) * 2)
            key = jax.random.split(jax.random.key(0), 5)
            args_ = (jax.random.normal(key[0], (1, s.tokens, s.d_model), jnp.bfloat16),
                     jax.random.normal(key[1], (s.d_model, e1), jnp.float32),
                     (jax.random.normal(key[2], (e1, s.d_model, 2 * s.d_ff)) * 0.02
                      ).astype(jnp.bfloat16),
                     (jax.random.normal(key[3], (e1, s.d_ff, s.d_model)) * 0.02
                      ).astype(jnp.bfloat16),
                     jax.random.normal(key[4], (1, s.tokens, s.d_model), jnp.float32))
            args_ = jax.device_put(args_, NamedSharding(dev_mesh, P()))
            out = {"shape": dataclasses.asdict(s) | {"experts": e1}}
            fns = {}
            for c in (1, 2):
                o = moe.MoEOptions.create(e1, s.top_k, dispatch_dtype="fp8",
                                          combine_grad_dtype="fp8", overlap_chunks=c)

                def loss(x, router, wgu, wd, ct, o=o):
                    y, aux = moe.moe_apply(x, router, wgu, wd, options=o, mesh=dev_mesh)
                    return jnp.sum(y.astype(jnp.float32) * ct) + 0.01 * aux["load_balance_loss"]

                fns[c] = compile_with(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(
                    *args_), opts)[0]
            times = {1: [], 2: []}
            for _ in range(2):  # warm up both
                for c in (1, 2):
                    jax.block_until_ready(fns[c](*args_))
            for _ in range(15 if not a.small else 3):  # interleaved
                for c in (1, 2):
                    sec, _ = median_seconds(fns[c], args_, 0, 3)
                    times[c].append(sec)
            med = {c: float(np.median(v)) for c, v in times.items()}
            pred = {c: schedule.schedule_report(
                fns[c], hw, grouped_rows=grouped_rows(s.tokens, c, s.top_k)).step_us * 1e-6
                for c in (1, 2)}
            out.update(measured_s=med, predicted_s=pred,
                       model_error={c: pred[c] / med[c] - 1 for c in (1, 2)})
            report["chunked_over_unchunked_1gpu"] = med[2] / med[1]
            report["compute_model_error"] = pred[1] / med[1] - 1
            report["cases"]["gpu1_layer"] = out
            if hlo_dir:
                with gzip.open(hlo_dir / "gpu1_layer_chunks1.hlo.gz", "wt") as f:
                    f.write(fns[1].as_text())
            print(f"[{time.perf_counter() - t0:5.0f}s] 1 GPU: chunks 1 {med[1] * 1e3:.3f} ms, "
                  f"2 {med[2] * 1e3:.3f} ms ({med[2] / med[1]:.3f}x); predicted "
                  f"{pred[1] * 1e3:.3f} ms (error {pred[1] / med[1] - 1:+.1%})", flush=True)
            save()

        run_case("gpu1_layer", gpu1)

    # ---------------------------------------------------------------- sharded Muon
    def muon_compiled(mesh, gather_dtype, chunk_bytes, reduce_dtype=None):
        layers, d, f = (2, 128, 352) if a.small else (8, 4096, 11008)
        shapes_ = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_gate": (d, f),
                   "w_up": (d, f), "w_down": (f, d)}
        rep = NamedSharding(mesh, P())
        params = {f"layer_{i}": {k: jax.ShapeDtypeStruct(v, jnp.float32, sharding=rep)
                                 for k, v in shapes_.items()} for i in range(layers)}
        ndev = int(np.prod(mesh.devices.shape))
        dsh = NamedSharding(mesh, P("data"))
        data = jax.tree.map(lambda p: jax.ShapeDtypeStruct((ndev, *p.shape), jnp.float32,
                                                           sharding=dsh), params)
        tx = muon_jax.muon(0.02, sharding=muon_jax.ShardingOptions(
            mesh, gather_dtype=gather_dtype, chunk_bytes=chunk_bytes or None,
            reduce_dtype=reduce_dtype))
        state = jax.eval_shape(tx.init, params)

        def loss(p, data):
            terms = jax.tree.map(lambda w, x: jnp.einsum(
                "dmn,mn->d", x, w, preferred_element_type=jnp.float32,
                out_sharding=dsh).sum(), p, data)
            return sum(jax.tree.leaves(terms))

        def step(p, st, data):
            grads = jax.grad(loss)(muon_jax.reduced_view(p, "data"), data)
            updates, st = tx.update(grads, st, p)
            return optax.apply_updates(p, updates), st

        with jax.set_mesh(mesh):
            return build(jax.jit(step).lower(params, state, data))

    if "muon" in groups:
        dp8 = mesh_for("1x8x1", (8,), ("data",))
        reduce_dtypes = set(a.muon_reduce_dtypes.split(","))
        if not reduce_dtypes <= {"f32", "bf16"}:
            raise SystemExit(f"--muon-reduce-dtypes takes f32 and/or bf16, got "
                             f"{a.muon_reduce_dtypes!r}")
        reduce_bf16 = "bf16" in reduce_dtypes
        variants = [(None, "f32", None), (jnp.bfloat16, "bf16", None)] + (
            [(jnp.bfloat16, "bf16", jnp.bfloat16)] if reduce_bf16 else [])
        for cb in (int(v) for v in a.muon_chunk_bytes.split(",")):
            for gd, label, rd in variants:
                name = (f"muon_dp8_{label}_gather" + ("_bf16_reduce" if rd else "")
                        + (f"_chunk{cb}" if cb else ""))
                extra = {"gather_dtype": label, "chunk_bytes": cb or None,
                         "reduce_dtype": "bf16" if rd else None}
                report_extra[name] = extra
                run_case(name, lambda gd=gd, cb=cb, rd=rd, name=name, extra=extra: record(
                    name, muon_compiled(dp8, gd, cb, rd), extra))

    # ---------------------------------------------------------------- past one host
    for group, topo, ndev in (("moe16", "2x8x1", 16), ("moe64", "8x8x1", 64)):
        if group not in groups:
            continue
        if a.small:  # 8 CPU devices as 2 "hosts" of 4 (Hardware.devices_per_host above)
            topo, ndev = "cpu", 8
        mesh = mesh_for(topo, (1, ndev), ("data", "expert"))
        # A's per-device work at every size (its 4 local experts per device, 8192 tokens), so
        # the programs differ only in where the exchange goes; A itself has too few experts
        # (32) for a 64-device expert axis.
        s_multi = dataclasses.replace(shapes["A"],
                                      experts=shapes["A"].experts // 8 * (8 if a.small else ndev))
        for c in sorted({1, defaults["dense"], max(chunk_list)}):
            for lf, suffix in local_list:
                name = f"moe_ep{ndev if not a.small else group[3:]}_A_dense{suffix}_chunks{c}"
                p_axis = mesh.shape["expert"]
                extra = {"topology": topo, "placement": "expert axis over every host",
                         "chunks": c, "local_first": lf, "shape": dataclasses.asdict(s_multi),
                         "grouped_rows": grouped_rows(s_multi.tokens, c, s_multi.top_k,
                                                      p_axis, lf)}
                report_extra[name] = extra
                run_case(name, lambda mesh=mesh, c=c, name=name, extra=extra, s=s_multi,
                         lf=lf: record(name, moe_compiled(mesh, s, "dense", c, local_first=lf),
                                       extra))
        if group == "moe16":  # experts within a host, the hosts data parallel
            mesh = mesh_for(topo, (2, ndev // 2), ("data", "expert"))
            c = defaults["dense"]
            name = f"moe_ep8x2hosts_A_dense_chunks{c}"
            extra = {"topology": topo, "placement": "expert axis within a host, data across",
                     "chunks": c, "shape": dataclasses.asdict(shapes["A"]),
                     "grouped_rows": grouped_rows(shapes["A"].tokens, c, shapes["A"].top_k)}
            report_extra[name] = extra
            run_case(name, lambda mesh=mesh, c=c, name=name, extra=extra: record(
                name, moe_compiled(mesh, shapes["A"], "dense", c), extra))

    # ---------------------------------------------------------------- the trainer's step
    def train_rows(mesh_shape, micro_batches, chunks):
        """grouped_rows of the trainer's MoE layers (tokens split over every device)."""
        import train_lm

        args = train_lm.parse_args(["--preset", "cpu" if a.small else "gpu",
                                    "--micro-batches", str(micro_batches)])
        tokens = args.batch * args.seq_len // int(np.prod(mesh_shape)) // micro_batches
        c = train_chunks(mesh_shape, micro_batches, chunks)
        c = moe.auto_overlap_chunks(mesh_shape[1], tokens, "dense") if c == "auto" else int(c)
        return grouped_rows(tokens, c, args.top_k)

    def train_chunks(mesh_shape, micro_batches, chunks):
        """The trainer's ``overlap_chunks`` for a case: with ``auto`` what it runs under
        ``--pgle`` when the step is scheduled on the modeled latencies (they stand in for
        PGLE's measured ones), else the layer's own ``auto``."""
        import train_lm

        if chunks != "auto":
            return chunks
        args = train_lm.parse_args(["--preset", "cpu" if a.small else "gpu",
                                    "--micro-batches", str(micro_batches)])
        mesh = types.SimpleNamespace(shape=dict(zip(train_lm.MESH_AXES, mesh_shape, strict=True)),
                                     devices=np.zeros(mesh_shape))
        return train_lm.resolve_overlap_chunks(args, mesh, pgle=bool(a.latency_model))

    def train_compiled(mesh_shape, micro_batches=1, chunks="auto"):
        import lm_model
        import train_lm
        from flax import nnx

        mesh = mesh_for("1x8x1", mesh_shape, train_lm.MESH_AXES, explicit=False)  # as the trainer
        argv_ = ["--preset", "cpu" if a.small else "gpu", "--optimizer", "muon",
                 "--mesh", ",".join(map(str, mesh_shape)), "--micro-batches", str(micro_batches),
                 "--overlap-chunks", str(train_chunks(mesh_shape, micro_batches, chunks))]
        args = train_lm.parse_args(argv_)
        cfg = train_lm.model_config(args)
        with jax.set_mesh(mesh):
            abstract = nnx.eval_shape(lambda: lm_model.TransformerLM(cfg, mesh=mesh,
                                                                      rngs=nnx.Rngs(0)))
            gdef, params, rest = nnx.split(abstract, nnx.Param, ...)
            specs = nnx.get_partition_spec(params)

            def unwrap(v):  # an nnx.Variable holding a PartitionSpec, or the spec
                return v.get_value() if hasattr(v, "get_value") else getattr(v, "value", v)

            def placed(x, spec):
                spec = unwrap(spec)
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
                    mesh, spec if isinstance(spec, P) else P()))

            is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
            params = jax.tree.map(placed, params, specs, is_leaf=is_var)
            rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, P())), rest)
            param_specs = jax.tree.map(lambda x: x.sharding.spec, params)
            tx = muon_jax.muon(0.02, weight_decay=0.01, sharding=muon_jax.ShardingOptions(
                mesh, param_specs=param_specs))
            state = jax.eval_shape(tx.init, params)
            batch = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32,
                                         sharding=NamedSharding(mesh, P(train_lm.MESH_AXES)))

            def step(params, rest, state, batch):
                def loss(p):
                    model = nnx.merge(gdef, p, rest)
                    return train_lm.loss_terms(model, batch, 0.01, 1e-3)[0]

                grads = jax.grad(loss)(params)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            return build(jax.jit(step).lower(params, rest, state, batch),
                         train_rows(mesh_shape, micro_batches, chunks))

    if "train" in groups:
        for shape in ((1, 8), (2, 4)):
            for mb, ch in train_list:
                name = (f"train_step_mesh{shape[0]}x{shape[1]}" + (f"_micro{mb}" if mb > 1 else "")
                        + (f"_chunks{ch}" if ch != "auto" else ""))
                extra = {"mesh": list(shape), "micro_batches": mb,
                         "overlap_chunks": train_chunks(shape, mb, ch),
                         "grouped_rows": train_rows(shape, mb, ch)}
                report_extra[name] = extra
                run_case(name, lambda shape=shape, name=name, mb=mb, ch=ch, extra=extra: record(
                    name, train_compiled(shape, mb, ch), extra))

    if "moe8b" in groups:  # the second shape set last: the most compile time
        moe8("B")

    for name in sorted(set(replay) - set(report["cases"])):  # modules no case here compiles
        # (a first compile on XLA's estimates is replayed like its case: the same grouped rows)
        report_extra.setdefault(name, report_extra.get(name.removesuffix(".xla_estimates"), {}))
        run_case(name, lambda: None)

    # ---------------------------------------------------------------- headline keys
    report["elapsed_seconds"] = time.perf_counter() - t0
    save()
    report = summarize(report, defaults)
    print(json.dumps({k: report[k] for k in HEADLINE}, indent=1))
    return report


if __name__ == "__main__":
    main()
