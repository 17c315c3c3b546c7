"""benchmarks/tgmm_acc.py on the CPU (the kernels' XLA emulation) at small shapes: the kernel
check, the timing rows and the layer's 2-chunk-against-1 gradients."""

import json
import sys

from _paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import tgmm_acc  # noqa: E402


def test_tgmm_acc_small_checks_times_and_compares_the_layer(tmp_path):
    out = tmp_path / "tgmm_acc.json"
    report = tgmm_acc.main(["--small", "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "tgmm_acc"
    for k in ("bf16", "fp8"):
        assert report["kernel"][k]["empty_group_exact"]
    assert report["kernel"]["bf16"]["rel_rms"] < 5e-3  # one bf16 rounding of the sum
    assert report["kernel"]["fp8"]["rel_rms"] < 5e-3
    t = report["timing"]["small"]["us"]
    assert set(t) == {"tgmm", "tgmm_then_add", "tgmm_acc"} and min(t.values()) > 0
    # bf16 layer: chunks change only the summation order (and bf16 roundings)
    assert max(report["layer_2_chunks_vs_1_rel_rms"].values()) < 2e-2
