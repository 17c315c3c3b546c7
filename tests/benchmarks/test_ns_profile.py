"""benchmarks/ns_profile.py on the CPU at small shapes: the traced ops join the compiled
program, so the GEMMs' FLOPs add up to Newton-Schulz's count and the categories to the total."""

import json
import math
import sys

from _paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import ns_profile  # noqa: E402

from muon_jax import newton_schulz  # noqa: E402


def test_ns_profile_small_accounts_for_every_gemm_flop(tmp_path, capsys):
    out = tmp_path / "ns_profile.json"
    report = ns_profile.main(["--small", "--calls", "1", "--top", "3", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "ns_profile"
    # the stacks scale_by_muon forms from 2 layers of d 64 / f 176, wide orientation inside
    assert sorted(map(tuple, report["stacks"])) == [(2, 176, 64), (4, 64, 176), (8, 64, 64)]
    ns = report["ns"]
    assert set(ns["by_category_us"]) == set(ns_profile.CATEGORIES)
    assert math.isclose(sum(ns["by_category_us"].values()), ns["total_us"])
    assert ns["total_us"] > 0 and report["ns_seconds"] > 0
    gemm_flops = sum(r["flops"] for r in ns["ops"].values() if r["category"] == "gemm")
    want = sum(k * newton_schulz.ns_flops(m, n, 5) for k, m, n in report["stacks"])
    assert gemm_flops == want  # plain standard form on the CPU: every product traced once
    assert "== Newton-Schulz:" in capsys.readouterr().out


def test_categories():
    assert ns_profile.category("custom-call.3", True) == "gemm"
    assert ns_profile.category("input_transpose_fusion.12", False) == "transpose"
    assert ns_profile.category("loop_add_convert_fusion", False) == "elementwise"
    assert ns_profile.category("copy.4", False) == "other"
