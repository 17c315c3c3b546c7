"""The trainer (examples/train_lm.py): outputs, exact resume, and one-line errors for bad flags."""

import json
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import train_lm  # noqa: E402

# A tiny configuration: seconds per run on 8 simulated CPU devices.
TINY = [
    "--d-model", "64", "--layers", "1", "--heads", "2", "--d-ff", "32", "--experts", "4",
    "--batch", "8", "--seq-len", "16", "--eval-batches", "1", "--max-corpus-mb", "0.5",
    "--fp8-block-size", "16", "--warmup", "2", "--no-progress",
]


def _losses(out: pathlib.Path, name: str) -> list[tuple[int, float]]:
    recs = train_lm.read_metrics(out / "metrics.jsonl")
    return [(r["step"], r["train_loss"]) for r in recs if r["optimizer"] == name]


def test_trainer_writes_metrics_plot_and_summary(tmp_path, capsys):
    out = tmp_path / "run"
    rc = train_lm.main([*TINY, "--optimizer", "both", "--steps", "4", "--eval-every", "2",
                        "--ckpt-every", "2", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "bits/byte" in text and ("beats" in text or "trails" in text)
    recs = train_lm.read_metrics(out / "metrics.jsonl")
    assert {r["optimizer"] for r in recs} == {"muon", "adamw"}
    assert [r["step"] for r in recs if r["optimizer"] == "muon"] == [1, 2, 3, 4]
    assert all(r["train_loss"] > 0 and r["tokens_per_s"] > 0 for r in recs)
    assert any("val_loss" in r for r in recs)
    png = (out / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["results"]) == {"muon", "adamw"}
    assert summary["mesh"] == {"data": 2, "expert": 4}


def test_resume_continues_exactly(tmp_path):
    """2 x N steps with a restart in between equal N + N uninterrupted (same losses)."""
    common = [*TINY, "--optimizer", "muon", "--fp8-dispatch", "--eval-every", "100",
              "--ckpt-every", "3"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert train_lm.main([*common, "--steps", "6", "--out", str(full)]) == 0
    # First half: a run whose schedule is the 6-step one, stopped at its step-3 checkpoint.
    assert train_lm.main([*common, "--steps", "6", "--stop-after", "3", "--out", str(split)]) == 0
    assert [s for s, _ in _losses(split, "muon")] == [1, 2, 3]
    assert train_lm.main([*common, "--steps", "6", "--resume", "--out", str(split)]) == 0
    assert _losses(split, "muon") == _losses(full, "muon")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--optimizer", "sgd"], "--optimizer must be one of"),
        (["--mesh", "3,3"], "--mesh 3,3 needs 9 devices"),
        (["--batch", "12"], "--batch 12 must be divisible by the 8 devices"),
        (["--experts", "6"], "--experts 6 must be divisible by the expert axis size 4"),
        (["--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_bad_flags_one_line(flags, needle, capsys):
    assert train_lm.main([*TINY, *flags, "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert needle in err and "Traceback" not in err


def test_bad_flag_from_the_command_line_is_one_line():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_lm.py"), "--optimizer", "lion"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "--optimizer must be one of" in lines[0], proc.stderr
