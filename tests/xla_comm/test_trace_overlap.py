"""xla_comm.trace's exposed-collective figures on small synthetic jax.profiler-style traces (no
GPU needed), and ``benchmarks/lm_step.py --read-trace``, its command line, on one of them."""

import gzip
import json
import os
import subprocess
import sys
import time

import pytest
from _paths import ROOT

from xla_comm.trace import exposed_comm_fraction, interval_union

ROOT = ROOT


def _meta(pid, name, tid=None):
    ev = {"ph": "M", "pid": pid, "name": "process_name" if tid is None else "thread_name",
          "args": {"name": name}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def _x(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def _write(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as fh:
        json.dump({"displayTimeUnit": "ns", "metadata": {}, "traceEvents": events}, fh)


def synthetic_events():
    """GPU0: compute stream + NCCL stream; GPU1: NCCL fully exposed; host and derived lines."""
    ev = [
        _meta(1, "/host:CPU"), _meta(1, "python", tid=1),
        _meta(2, "/device:GPU:0 NVIDIA H200"), _meta(2, "Stream #7(Compute)", tid=7),
        _meta(2, "Stream #20(Nccl)", tid=20), _meta(2, "XLA Ops", tid=100),
        _meta(3, "/device:GPU:1 NVIDIA H200"), _meta(3, "Stream #7(Compute)", tid=7),
        _meta(3, "Stream #20(Nccl)", tid=20),
    ]
    # host events (even named nccl) are ignored
    ev.append(_x(1, 1, "ncclGroupEnd", 0, 1000))
    # GPU0 compute: [0,10) [10,30) [50,60); memcpy [60,100) is not compute
    ev += [_x(2, 7, "gemm_fusion_1", 0, 10), _x(2, 7, "loop_fusion", 10, 20),
           _x(2, 7, "cutlass_gemm", 50, 10), _x(2, 7, "MemcpyD2D", 60, 40)]
    # GPU0 collectives: [20,40) half hidden, [55,75) 5 hidden, [80,90) exposed
    ev += [_x(2, 20, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 20, 20),
           _x(2, 20, "ncclKernel_AllReduce_RING_LL_Sum_bf16", 55, 20),
           _x(2, 20, "ncclDevKernel_SendRecv", 80, 10)]
    # derived op line repeats time at op level and must be ignored
    ev.append(_x(2, 100, "all-to-all-start.1", 0, 100))
    # GPU1: one collective [0, 40), compute [40, 50) -> fully exposed
    ev += [_x(3, 20, "ncclDevKernel_SendRecv", 0, 40), _x(3, 7, "fusion.2", 40, 10)]
    return ev


def test_interval_union():
    assert interval_union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    assert interval_union([]) == []


def test_exposed_fraction_from_profile_dir(tmp_path):
    _write(tmp_path / "plugins" / "profile" / "2025_01_01" / "host.trace.json.gz",
           synthetic_events())
    r = exposed_comm_fraction(tmp_path)
    g0, g1 = r["devices"]["/device:GPU:0 NVIDIA H200"], r["devices"]["/device:GPU:1 NVIDIA H200"]
    assert g0["collective_us"] == pytest.approx(50.0)
    assert g0["compute_us"] == pytest.approx(40.0)
    assert g0["exposed_collective_us"] == pytest.approx(10 + 15 + 10)
    assert g0["n_collective_kernels"] == 3 and g0["n_compute_kernels"] == 3
    assert g0["hidden_fraction"] == pytest.approx(15 / 50)
    assert g1["exposed_fraction"] == pytest.approx(1.0)
    assert r["collective_us"] == pytest.approx(90.0)
    assert r["exposed_collective_us"] == pytest.approx(75.0)
    assert r["exposed_fraction"] == pytest.approx(75 / 90)
    assert r["hidden_fraction"] == pytest.approx(15 / 90)
    assert r["format"] == "json" and "reason" not in r


def test_newest_run_and_single_file(tmp_path):
    old = tmp_path / "plugins" / "profile" / "old" / "h.trace.json.gz"
    _write(old, [_meta(2, "/device:GPU:0"), _meta(2, "Stream #1", tid=1),
                 _x(2, 1, "nccl_all", 0, 10)])
    os.utime(old, (time.time() - 100, time.time() - 100))
    new = tmp_path / "plugins" / "profile" / "new" / "h.trace.json.gz"
    _write(new, synthetic_events())
    assert exposed_comm_fraction(tmp_path)["collective_us"] == pytest.approx(90.0)
    single = exposed_comm_fraction(old)
    assert single["exposed_fraction"] == pytest.approx(1.0)


def test_custom_pattern_and_no_collectives(tmp_path):
    _write(tmp_path / "t.trace.json.gz", synthetic_events())
    r = exposed_comm_fraction(tmp_path / "t.trace.json.gz", collective_pattern="loop_fusion")
    assert r["devices"]["/device:GPU:0 NVIDIA H200"]["collective_us"] == pytest.approx(20.0)
    # a CPU-only trace: no device processes
    _write(tmp_path / "cpu" / "c.trace.json.gz",
           [_meta(1, "/host:CPU"), _meta(1, "python", tid=1), _x(1, 1, "f", 0, 5)])
    r = exposed_comm_fraction(tmp_path / "cpu")
    assert r["exposed_fraction"] is None and "no kernel events" in r["reason"]
    r = exposed_comm_fraction(tmp_path / "missing")
    assert r["exposed_fraction"] is None and "no trace files" in r["reason"]


def test_op_level_fallback(tmp_path):
    """A device with only an 'XLA Ops' line (e.g. TPU): collectives by op name."""
    _write(tmp_path / "t.trace.json.gz", [
        _meta(5, "/device:TPU:0"), _meta(5, "XLA Ops", tid=1),
        _x(5, 1, "all-to-all.3", 0, 10), _x(5, 1, "fusion.1", 5, 10),
    ])
    d = exposed_comm_fraction(tmp_path)["devices"]["/device:TPU:0"]
    assert d["level"] == "op" and d["exposed_collective_us"] == pytest.approx(5.0)


def test_command_line_prints_the_overlap(tmp_path):
    """``python benchmarks/lm_step.py --read-trace TRACE_DIR`` (no HLO file): the library's
    figures as JSON."""
    _write(tmp_path / "plugins" / "profile" / "run" / "h.trace.json.gz", synthetic_events())
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    script = str(ROOT / "benchmarks" / "lm_step.py")
    res = subprocess.run([sys.executable, script, "--read-trace", str(tmp_path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout) == json.loads(json.dumps(exposed_comm_fraction(tmp_path)))
    assert json.loads(res.stdout)["exposed_fraction"] == pytest.approx(75 / 90)
