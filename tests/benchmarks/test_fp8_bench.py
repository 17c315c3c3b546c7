"""``benchmarks/experts_bench.py --part fp8`` (was fp8_bench.py) on CPU at its small size, run as
a script: rows, keys, accuracy and the op breakdown in the JSON it writes; bad options."""

import json
import math
import os
import subprocess
import sys

from _paths import ROOT

ROOT = ROOT
SCRIPT = str(ROOT / "benchmarks" / "experts_bench.py")


def _run(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, SCRIPT, "--part", "fp8", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_experts_rows_with_breakdown(tmp_path):
    out = tmp_path / "fp8.json"
    res = _run("--small", "--only", "experts", "--cases", "ragged_balanced",
               "--recipes", "bf16,fp8_gemm_dgrad", "--breakdown", "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "fp8" and report["settings"]["small"] is True
    assert {c["name"] for c in report["ceilings"]} == {"dense_bf16", "dense_fp8"}
    assert report["dense_bf16_tflops"] > 0 and report["dense_fp8_tflops"] > 0
    assert "gmm" not in report and "layer" not in report  # --only experts (gmm: GPU only)
    rows = {r["recipe"]: r for r in report["experts"]}
    assert len(report["experts"]) == 2 and set(rows) == {"bf16", "fp8_gemm_dgrad"}
    assert all(r["layout"] == "ragged" and r["routing"] == "balanced" for r in rows.values())
    fp8 = rows["fp8_gemm_dgrad"]
    # The FP8 recipe is checked against the bf16 row of the same inputs (issue 13's bar).
    assert fp8["worst_cos_vs_bf16"] >= 0.996 and fp8["worst_rel_rms_vs_bf16"] <= 0.09
    assert "worst_cos_vs_bf16" not in rows["bf16"]
    # The speedup key is the bf16 row's time over the FP8 row's (one backend, one FP8 recipe).
    assert math.isclose(report["experts_fp8_speedup_ragged"],
                        rows["bf16"]["ms"] / fp8["ms"], rel_tol=1e-9)
    assert report["experts_fp8_speedup_ragged_recipe"] == "fp8_gemm_dgrad (mosaic)"
    for r in rows.values():
        bd = r["breakdown"]
        assert bd["total_us_per_step"] > 0 and bd["us_per_step"]["gemm"] > 0
        assert math.isclose(sum(bd["us_per_step"].values()), bd["total_us_per_step"],
                            rel_tol=1e-6)
        assert bd["top_ops"] and all(us > 0 for _, _, us in bd["top_ops"])
    assert "experts_ragged_balanced_fp8_gemm_dgrad" in res.stdout


def test_bad_case_is_rejected():
    res = _run("--cases", "ragged_skewed", timeout=120)
    assert res.returncode == 2 and "--cases must name only" in res.stderr, res.stderr[-2000:]
