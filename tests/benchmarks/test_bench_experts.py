"""benchmarks/gmm.py and benchmarks/experts.py on CPU at their small sizes (the Mosaic kernels
emulated, Triton interpreted): rows checked against references, the keys the report reads,
accuracy, the op breakdown, and bad options."""

import math
import sys

import pytest
from _paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import experts  # noqa: E402  (benchmarks/experts.py)
import gmm  # noqa: E402  (benchmarks/gmm.py)


def test_gmm_rows_are_checked_then_timed(tmp_path):
    r = gmm.main(["--small", "--routings", "balanced", "--out", str(tmp_path / "g.json")])
    rows = {(g["kernel"], g["op"]): g for g in r["gmm"]}
    assert len(rows) == 16 and all(g.get("ok") for g in rows.values()), r["gmm"]
    assert {c["name"] for c in r["ceilings"]} == {"dense_bf16", "dense_fp8"}
    assert math.isclose(r["fp8_gmm_over_bf16_rate"], rows[("mosaic_fp8", "fwd")]["tflops"]
                        / rows[("triton_bf16", "fwd")]["tflops"], rel_tol=1e-9)
    assert rows[("einsum_fp8", "wgrad")]["rel_err"] < 1e-2


@pytest.mark.slow
def test_experts_rows_with_breakdown(tmp_path):
    r = experts.main(["--small", "--cases", "ragged_mosaic_balanced", "--recipes",
                      "bf16,fp8_gemm_dgrad", "--breakdown", "--out", str(tmp_path / "e.json")])
    assert r["benchmark"] == "experts_experts" and r["settings"]["small"] is True
    assert r["dense_bf16_tflops"] > 0 and r["dense_fp8_tflops"] > 0
    rows = {e["recipe"]: e for e in r["experts"]}
    assert set(rows) == {"bf16", "fp8_gemm_dgrad"}
    fp8 = rows["fp8_gemm_dgrad"]
    # The FP8 recipe is checked against the bf16 row of the same inputs (issue 13's bar).
    assert fp8["worst_cos_vs_bf16"] >= 0.996 and fp8["worst_rel_rms_vs_bf16"] <= 0.09
    assert "worst_cos_vs_bf16" not in rows["bf16"]
    assert math.isclose(r["experts_fp8_speedup_ragged"], rows["bf16"]["ms"] / fp8["ms"],
                        rel_tol=1e-9)
    assert r["experts_fp8_speedup_ragged_recipe"] == "fp8_gemm_dgrad (mosaic)"
    for row in rows.values():
        bd = row["breakdown"]
        assert bd["total_us_per_step"] > 0 and bd["us_per_step"]["gemm"] > 0
        assert bd["top_ops"] and all(us > 0 for _, _, us in bd["top_ops"])
    assert r["bf16_rate_over_dense"]["ragged_mosaic_balanced"] > 0


def test_fp8_dense_projection_rows():
    r = experts.main(["--small", "--part", "dense"])
    by = {e["recipe"]: e for e in r["dense"]}
    assert set(by) == {"bf16", "forward", "forward_dgrad", "all"}
    assert all(by[k]["worst_cos_vs_bf16"] > 0.99 for k in ("forward", "forward_dgrad", "all"))


def test_bad_case_is_rejected(capsys):
    # The script's main in this process (as the tests above): a command would only add an
    # interpreter and the imports (17 s on a loaded 2-core machine) before the same argparse
    # error.
    with pytest.raises(SystemExit) as exit_:
        experts.main(["--cases", "ragged_skewed"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--cases must name only" in err, err[-2000:]
