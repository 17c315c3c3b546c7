"""examples/moe_hosts.py: one stage against two on a ('host', 'expert') mesh, in one process.

The 8 simulated CPU devices as 2 "hosts" of 4: the script checks that both exchanges give the
same outputs and gradients before timing them, and reads from each compiled program the bytes
sent to other hosts (top-4 kept within one of the 2 host groups: each token crosses at most
once, where its 4 slots did). Across processes (one per "host", ``--coordinator-address``) it
runs the same code; the trainer's multi-process test covers joining them.
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import moe_hosts  # noqa: E402


def test_two_stages_give_the_values_of_one_and_send_fewer_bytes_across_hosts(tmp_path, capsys):
    out = tmp_path / "hosts.json"
    report = moe_hosts.main(["--hosts", "2", "--rounds", "1", "--out", str(out)])
    assert report["same_values"] and report["mesh"] == {"host": 2, "expert": 4}
    assert 0 < report["cross_host_bytes_ratio"] < 0.3
    assert report["one-stage"]["median_ms"] > 0 and report["two-stage"]["median_ms"] > 0
    assert json.loads(out.read_text())["cross_host_bytes_ratio"] == report[
        "cross_host_bytes_ratio"]
    printed = capsys.readouterr().out
    assert "outputs and gradients agree" in printed and "two-stage / one-stage" in printed


def test_a_host_count_that_does_not_divide_the_devices_is_refused():
    with pytest.raises(SystemExit, match="--hosts 3 must divide the 8 devices"):
        moe_hosts.main(["--hosts", "3"])
