"""examples/lr_sweep.py: table, plot, summary and reuse of runs, at a tiny size.

(examples/ is on the path for train_lm, as in tests/examples/test_train_lm.py; the sweep itself runs
as ``python examples/lr_sweep.py``.) The sweeps call the script's ``main`` in this process, as
tests/examples/test_train_lm.py calls the trainer's: a fresh interpreter per command would only
repeat the imports. The script as a command still runs here: each ``--jobs`` grid point trains in
a child ``lr_sweep.py``, and a bad flag's one-line error is read from the command's stderr."""

import contextlib
import io
import json
import math
import os
import subprocess
import sys

from _paths import ROOT

ROOT = ROOT
sys.path.insert(0, str(ROOT / "examples"))

import lm_metrics  # noqa: E402
import lr_sweep  # noqa: E402  (examples/lr_sweep.py)
import train_lm  # noqa: E402  (examples/train_lm.py)

# tests/examples/test_train_lm.py's TINY with its --steps 4 (the schedule's length and the
# learning rate are compiled into a step): the grid's default points train the programs that
# file's runs of both optimizers compile, shared through the session's compilation cache.
TINY = [
    "--d-model", "64", "--layers", "1", "--heads", "2", "--d-ff", "32", "--experts", "4",
    "--batch", "8", "--seq-len", "16", "--eval-batches", "1", "--max-corpus-mb", "0.5",
    "--fp8-block-size", "16", "--warmup", "2", "--steps", "4", "--no-progress",
]


def _script_env() -> dict[str, str]:
    """What a sweep script started from here runs with, over the test session's environment:
    the session's XLA flags (its compile settings) but for the CPU device count, which the
    script sets up itself before JAX starts (the children's mesh is checked below)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return {"XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}


def sweep(*argv, timeout=600):
    """``python examples/lr_sweep.py ARGV``: (exit status, stdout, stderr)."""
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "lr_sweep.py"), *argv],
                         cwd=ROOT, env={**os.environ, **_script_env()}, capture_output=True,
                         text=True, timeout=timeout)
    return res.returncode, res.stdout, res.stderr


def sweep_here(monkeypatch, *argv):
    """``lr_sweep.main(ARGV)`` in this process, its child processes (``--jobs``) started with
    the environment :func:`sweep` gives the script: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with monkeypatch.context() as m:
        for k, v in _script_env().items():
            m.setenv(k, v)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = lr_sweep.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_sweep_cpu_tiny(tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    default_muon, default_adam = train_lm.default_lrs(64)
    # Muon: the trainer's default and one more; AdamW: its default only (3 tiny runs).
    argv = [*TINY, "--muon-lrs", f"{default_muon / 4}", "--adam-lrs", f"{default_adam}",
            "--out", str(out)]
    code, text, err = sweep_here(monkeypatch, *argv)
    assert code == 0, text[-2000:] + err[-2000:]
    doc = json.loads((out / "lr_sweep.json").read_text())
    runs = doc["runs"]
    assert sorted((r["optimizer"], r["lr"]) for r in runs) == sorted(
        [("muon", default_muon / 4), ("muon", default_muon), ("adamw", default_adam)])
    for r in runs:
        assert r["steps"] == 4 and r["tokens"] == 4 * 8 * 16 and r["preset"] == "cpu"
        assert math.isfinite(r["final_val_loss"]) and r["wall_s"] > 0
        # Each row's loss is the last validation record of its own run.
        recs = lm_metrics.read_metrics(out / "runs" / f"{r['optimizer']}_lr{r['lr']:.3g}"
                                       / "metrics.jsonl")
        assert [x["step"] for x in recs] == [1, 2, 3, 4]
        assert recs[-1]["val_loss"] == r["final_val_loss"]
    # The reuse key: every setting of the trainer but the learning rate and the optimizer.
    cfg = {k: v for k, v in vars(train_lm.parse_args([*TINY, "--out", str(out)])).items()}
    for r in runs:
        assert r["config"]["seed"] == cfg["seed"] and r["config"]["d_model"] == 64
        assert not {"lr", "adam_lr", "optimizer", "out"} & r["config"].keys()
    s = doc["summary"]
    by = {(r["optimizer"], r["lr"]): r["final_val_loss"] for r in runs}
    for name, default in (("muon", default_muon), ("adamw", default_adam)):
        mine = {lr: v for (o, lr), v in by.items() if o == name}
        assert s[f"cpu_{name}_default_lr"] == default
        assert s[f"cpu_{name}_default_val_loss"] == by[(name, default)]
        assert s[f"cpu_{name}_best_val_loss"] == min(mine.values())
        assert by[(name, s[f"cpu_{name}_best_lr"])] == min(mine.values())
    assert math.isclose(s["cpu_muon_default_minus_adamw_best"],
                        s["cpu_muon_default_val_loss"] - s["cpu_adamw_best_val_loss"])
    png = (out / "lr_sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "val loss" in text and "default" in text and "cpu_muon_best_val_loss" in text

    # The same command again reuses every run (nothing is trained: the rows are unchanged).
    code, text, _ = sweep_here(monkeypatch, *argv)
    assert code == 0 and text.count("reused from") == 3
    assert json.loads((out / "lr_sweep.json").read_text())["runs"] == runs

    # A sweep split over commands keeps one table: an AdamW-only grid keeps the Muon rows.
    code, text, _ = sweep_here(monkeypatch, *TINY, "--optimizers", "adamw", "--adam-lrs",
                               f"{default_adam}", "--no-defaults", "--out", str(out))
    assert code == 0 and text.count("reused from") == 1
    kept = json.loads((out / "lr_sweep.json").read_text())
    assert sorted(map(json.dumps, kept["runs"])) == sorted(map(json.dumps, runs))
    assert kept["summary"] == s

    # --jobs 2: two new AdamW points train at once in child processes (logs and their own
    # JSON under points/); the parent merges their rows with the kept ones into one table.
    new_lrs = [default_adam / 2, default_adam * 2]
    code, text, _ = sweep_here(monkeypatch, *TINY, "--optimizers", "adamw", "--jobs", "2",
                               "--no-defaults", "--adam-lrs", ",".join(map(repr, new_lrs)),
                               "--out", str(out))
    assert code == 0
    assert "2 grid points at a time" in text and "2 runs sharing the devices" in text
    merged = json.loads((out / "lr_sweep.json").read_text())
    assert merged["backend"] == "cpu" and merged["mesh"] == {"data": 2, "expert": 4}
    fresh = [r for r in merged["runs"] if r.get("jobs") == 2]
    assert sorted(r["lr"] for r in fresh) == sorted(new_lrs)
    assert sorted(map(json.dumps, [r for r in merged["runs"] if "jobs" not in r])) == sorted(
        map(json.dumps, runs))
    adam_config = next(r["config"] for r in runs if r["optimizer"] == "adamw")
    for r in fresh:
        point = out / "points" / f"adamw_lr{r['lr']:.3g}"
        assert (point / "log.txt").exists() and math.isfinite(r["final_val_loss"])
        recs = lm_metrics.read_metrics(point / "runs" / f"adamw_lr{r['lr']:.3g}" / "metrics.jsonl")
        assert recs[-1]["val_loss"] == r["final_val_loss"]
        # A child's reuse key is the parent's: same settings, its own lr.
        assert r["optimizer"] == "adamw" and r["config"] == adam_config
    assert merged["summary"]["cpu_adamw_best_val_loss"] == min(
        r["final_val_loss"] for r in merged["runs"] if r["optimizer"] == "adamw")

    # Other settings (here --seed) are other runs: none is reused, and none kept (checked
    # with --dry-run, which trains and writes nothing).
    code, text, _ = sweep_here(monkeypatch, *TINY, "--seed", "1", "--muon-lrs",
                               f"{default_muon / 4}", "--adam-lrs", f"{default_adam}",
                               "--dry-run", "--out", str(out))
    assert code == 0 and "would be reused" not in text and "kept from" not in text
    assert f"{len(merged['runs'])} run(s) in" in text and "would be left out" in text
    assert text.count("would be trained") == 3
    assert "3 to train, 0 reused, 0 kept, 5 left out; nothing trained or written" in text
    assert json.loads((out / "lr_sweep.json").read_text()) == merged


def test_sweep_bad_grid_is_one_line(monkeypatch):
    # As the script: the one line is all a user sees on stderr (nothing from the imports).
    code, _, err = sweep(*TINY, "--muon-lrs", "0.01,abc", "--out", "/nonexistent/x", timeout=120)
    err = err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--muon-lrs must be comma-separated" in err
    code, _, err = sweep_here(monkeypatch, *TINY, "--jobs", "0", "--out", "/nonexistent/x")
    assert code == 2 and "--jobs must be >= 1, got 0" in err
