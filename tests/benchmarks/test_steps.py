"""benchmarks/dispatch.py, muon_step.py, lm_step.py and schedule8.py at their --small sizes on
CPU: the checks they make, the keys the report reads, and reading a trace back."""

import json
import math
import os
import subprocess
import sys

import jax
import pytest
from _paths import ROOT, compile_flags

sys.path.insert(0, str(ROOT / "benchmarks"))

import lm_step  # noqa: E402  (benchmarks/lm_step.py)
import muon_step  # noqa: E402
import schedule8  # noqa: E402


def _script(name: str, *args: str, devices: int = 2) -> subprocess.CompletedProcess:
    """The script as a command, on its own ``devices`` simulated CPU devices."""
    env = os.environ | {"XLA_FLAGS": compile_flags(), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), "--small",
                           "--cpu-devices", str(devices), *args], cwd=ROOT, timeout=900,
                          env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_dispatch_checks_the_transports_then_times_them(tmp_path):
    out = tmp_path / "d.json"
    res = _script("dispatch.py", "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert len(r["checks"]) == 8 and all(c["ok"] for c in r["checks"].values())
    assert {(t["transport"], t["wire"]) for t in r["timings"]} == {
        (t, w) for t in ("dense", "dropless", "ragged") for w in ("bf16", "fp8")}
    assert r["fp8_over_bf16_dispatch_time"] > 0 and r["dispatch_combine_GBps_per_gpu"] > 0
    assert set(r["all_to_all"]) == {"bf16", "fp8"}


@pytest.mark.slow
def test_muon_step_variants_and_the_limit():
    # One layer (small: 4): Muon stacks the layers' same-shape matrices, so one layer has the
    # same stacks and collectives (3 reduce-scatters, 3 all-gathers) in about half the
    # compile time of four.
    r = muon_step.main(["--small", "--variants", "muon,muon_chunked,ns", "--param-dtypes",
                        "f32,bf16", "--layers", "1"])
    f32 = r["f32_params"]
    assert f32["chunking_ring_bytes_equal"] and f32["muon_jax_default"]["counts"]
    assert r["muon_step_over_limit"] == f32["muon_step_over_limit"] > 0
    assert r["bf16_params_muon_step_seconds"] == r["bf16_params"]["muon_step_seconds"]
    assert f32["ns_owner_share"]["flops"] > 0 and f32["model"]["params"] > 0


@pytest.mark.slow
def test_lm_step_variants_profile_and_the_trace_read_back(tmp_path, capsys):
    # One layer (small: 2) holds every region the breakdown reads; a second one adds compile
    # time, not regions.
    r = lm_step.main(["--small", "--variants", "bf16", "fp8", "--layers", "1", "--profile",
                      str(tmp_path / "p"), "--hlo-dir", str(tmp_path / "h")])
    assert not r["errors"] and r["lm_step_fp8_variant"] == "fp8"
    bf16 = r["lm_step_by_variant"]["bf16"]
    assert bf16["mfu"] > 0 and math.isclose(r["lm_step_fp8_speedup"], bf16["step_ms"]
                                            / r["lm_step_by_variant"]["fp8"]["step_ms"])
    bd = r["steps"][0]["breakdown"]
    assert bd["us_per_region"]["experts"] > 0 and bd["us_per_step"]["gemm"] > 0
    back = lm_step.main(["--read-trace", str(tmp_path / "p" / "bf16"), "--hlo",
                         str(tmp_path / "h" / "bf16.hlo.txt"), "--steps", "3"])
    assert back["breakdown"]["us_per_region"].keys() == bd["us_per_region"].keys()


@pytest.mark.slow
def test_schedule8_replays_a_compiled_case_and_summarizes(tmp_path):
    out = tmp_path / "s.json"
    r = schedule8.main(["--small", "--only", "moe8,gpu1", "--chunks", "1", "--default-chunks",
                        "1", "--hlo-dir", str(tmp_path / "hlo"), "--out", str(out)])
    case = r["cases"]["moe_ep8_A_dense_chunks1"]
    assert 0 <= r["moe_ep8_exposed_fraction"] <= 1 and case["all"]["step_us"] > 0
    assert r["chunked_over_unchunked_1gpu"] > 0 and "gpu1_layer" in r["cases"]
    assert r["targets"]["moe_ep8_exposed_fraction"] == "<= 0.15"
    again = schedule8.main(["--small", "--only", "moe8", "--chunks", "1", "--default-chunks",
                            "1", "--replay", str(tmp_path / "hlo"), "--rates", "1,1,1"])
    assert again["cases"]["moe_ep8_A_dense_chunks1"]["replayed"]
    assert schedule8.summarize(json.loads(out.read_text()), {"dense": 1, "dropless": 1})[
        "moe_ep8_exposed_fraction"] == r["moe_ep8_exposed_fraction"]


def test_grouped_rows_of_a_local_first_chunk():
    assert schedule8.grouped_rows(8192, 2, 2) == 8192
    assert schedule8.grouped_rows(8192, 2, 2, 8, True)["moe_local_first"] == 1024
    assert jax.device_count() == 8  # the session's devices: the in-process runs above use them
