"""benchmarks/vs_transformers.py's plumbing without torch: the shapes, the weights both
frameworks read, moe's side timed and checked at tiny sizes, the record's keys; and, where
torch is missing, the one line that says so."""

import importlib.util
import math
import sys

import numpy as np
import pytest
from _paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import vs_transformers as vt  # noqa: E402  (benchmarks/vs_transformers.py)

HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


def test_the_shapes_of_the_comparison():
    assert vt.SHAPES["qwen3_30b_a3b"][:5] == (16384, 2048, 768, 128, 8)
    assert vt.SHAPES["mixtral_8x7b"][:5] == (8192, 4096, 14336, 8, 2)
    assert vt.SHAPES["ep8_shard"][:5] == (8192, 2048, 1024, 4, 2)
    t, d, f, e, k, _ = vt.SHAPES["unaligned"]
    assert (t, e, k) == (16384, 128, 4) and d % 16 == f % 16 == 0 and d % 128 and f % 128
    assert vt.SHAPES["aligned"][1:3] == (d // 128 * 128, f // 128 * 128)
    assert set(vt.SMALL) == set(vt.SHAPES)


def test_both_frameworks_read_the_same_weights():
    shape = vt.SMALL["mixtral_8x7b"]
    w = vt.block_weights(shape, 0)
    assert w["experts.gate_up_proj"].shape == (8, 2 * 96, 64)  # transformers 5's fused layout
    params, _ = vt.moe_side("mixtral_8x7b", shape, w, type("A", (), {"small": True}))
    np.testing.assert_array_equal(params["w_gate_up"].transpose(0, 2, 1),
                                  w["experts.gate_up_proj"])
    np.testing.assert_array_equal(params["router_kernel"].T, w["gate.weight"])


@pytest.mark.slow
def test_moe_side_is_checked_timed_and_summarized(tmp_path):
    out = tmp_path / "vt.json"
    r = vt.main(["--small", "--moe-only", "--shapes", "ep8_shard", "--transports",
                 "dropless,dense", "--out", str(out)])
    checks = r["checks"]["ep8_shard"]
    assert checks["moe_bf16_dense"]["ok"] and checks["moe_fp8_all_dropless"]["ok"], checks
    rows = {row["variant"]: row for row in r["rows"]}
    assert set(rows) == {"moe_bf16_dropless", "moe_fp8_all_dropless", "moe_bf16_dense",
                         "moe_fp8_all_dense"} and all(row["ok"] for row in rows.values())
    assert rows["moe_bf16_dense"]["capacity_factor"] >= 1  # nothing dropped: the same work
    assert r["bf16_mfu_ep8_shard"] == rows["moe_bf16_dropless"]["mfu"] > 0
    assert r["device"] and r["commit"] and out.exists()


def test_summary_keys_from_timed_rows():
    rows = [{"shape": s, "variant": v, "ms": ms, "mfu": 1 / ms}
            for s in ("qwen3_30b_a3b", "unaligned", "aligned")
            for v, ms in (("hf_eager", 8.0), ("hf_compiled", 6.0), ("moe_bf16_dropless", 3.0),
                          ("moe_fp8_all_dropless", 2.0), ("moe_bf16_dense", 4.0))]
    rows[7]["ms"], rows[7]["mfu"] = 4.0, 0.25  # unaligned bf16 dropless
    s = vt.summarize(rows + [{"shape": "aligned", "variant": "hf_eager", "ok": False}])
    assert s["bf16_over_best_hf_qwen3_30b_a3b"] == 2.0 and s["fp8_over_best_hf_aligned"] == 3.0
    assert s["bf16_dense_over_best_hf_qwen3_30b_a3b"] == 1.5
    assert "fp8_dense_over_best_hf_qwen3_30b_a3b" not in s
    assert math.isclose(s["unaligned_mfu_over_aligned"], 0.25 / (1 / 3))
    assert s["bf16_mfu_aligned"] == 1 / 3


@pytest.mark.skipif(HAVE_TORCH, reason="torch and transformers are installed here")
def test_without_torch_it_says_so_and_exits(capsys):
    # The script's main in this process (as the tests above): a command would only add an
    # interpreter and the imports before the same exit.
    with pytest.raises(SystemExit) as exit_:
        vt.main(["--small"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "needs torch and transformers" in err
    assert len(err.strip().splitlines()) == 1, err
