"""benchmarks/chunk_cost.py end to end on the CPU at a tiny shape: it times and traces the layer
unchunked and in 2 chunks and splits the traced time into categories and regions."""

import json
import sys

from _paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import chunk_cost  # noqa: E402


def test_chunk_cost_small_writes_the_split(tmp_path):
    out = tmp_path / "chunk_cost.json"
    report = chunk_cost.main(["--out", str(out), "--tokens", "256", "--d-model", "128",
                              "--d-ff", "64", "--chunks", "1,2", "--rounds", "1"])
    saved = json.loads(out.read_text())
    assert saved["over_unchunked"]["1"] == 1.0 and saved["step_ms"]["2"] > 0
    for c in ("1", "2"):
        br = report["cases"][c]["breakdown"]
        assert br["total_us_per_step"] > 0
        # the expert GEMMs and their weight gradients are told apart by named scope
        assert br["us_per_region"]["experts"] > 0 and br["us_per_region"]["experts_wgrad"] > 0
        assert (tmp_path / f"chunk_cost_hlo_{c}.txt").read_text().startswith("HloModule")
    # two chunks run each chunk's data path once more
    assert report["cases"]["2"]["kernel_count"] > report["cases"]["1"]["kernel_count"]
    assert report["kernel_diff_2_minus_1_us"]
