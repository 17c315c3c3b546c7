"""examples/train_lm.py as 2 processes (4 CPU devices each, jax.distributed over 127.0.0.1,
gloo) against 1 process of 8 devices: the same run, checkpoints that move between process
counts, and a lost process that stops the other with an error naming it.

Each process builds only its rows of the global batch, process 0 alone writes the metrics,
plot and summary, and every process writes its shards of the checkpoints.
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from _paths import ROOT, compile_flags

EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

import lm_metrics  # noqa: E402
import train_lm  # noqa: E402

TINY = ["--d-model", "64", "--layers", "1", "--heads", "2", "--d-ff", "32", "--experts", "4",
        "--batch", "8", "--seq-len", "16", "--eval-batches", "1", "--max-corpus-mb", "0.5",
        "--fp8-block-size", "16", "--warmup", "2", "--no-progress", "--eval-every", "3",
        "--ckpt-every", "3", "--steps", "6"]
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(flags, n=2, init_timeout=120) -> list[subprocess.Popen]:
    """``n`` trainer processes; the device count per process comes from --num-processes."""
    # The device count per process comes from --num-processes; the session's compile
    # settings stay (the one-process reference runs in this process under them).
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["XLA_FLAGS"] = compile_flags()
    port = str(_free_port())
    return [subprocess.Popen(
        [sys.executable, str(EXAMPLES / "train_lm.py"), *TINY, *flags,
         "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(n),
         "--process-id", str(i), "--init-timeout", str(init_timeout)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(n)]


def _wait(procs, timeout=TIMEOUT_S) -> list[str]:
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:  # never leave a worker waiting on its peer
            if p.poll() is None:
                p.kill()
                p.communicate()
    return logs


def _run2(flags) -> list[str]:
    procs = _start(flags)
    logs = _wait(procs)
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{logs[i][-3000:]}"
    return logs


def _losses(out: pathlib.Path) -> dict:
    recs = lm_metrics.read_metrics(out / "metrics.jsonl")
    return {name: [(r["step"], r["train_loss"]) for r in recs if r["optimizer"] == name]
            for name in ("muon", "adamw")}


def _final(out: pathlib.Path) -> dict:
    results = json.loads((out / "summary.json").read_text())["results"]
    return {k: v["final_val_loss"] for k, v in results.items()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: both optimizers, 6 steps, one process of 8 devices."""
    out = tmp_path_factory.mktemp("one") / "run"
    assert train_lm.main([*TINY, "--optimizer", "both", "--out", str(out)]) == 0
    return out


def _close_losses(got: dict, want: dict) -> None:
    """The same steps, the same train losses up to f32 rounding: gloo's sums across processes
    round differently from the in-process ones, and a few steps of routing and Muon amplify
    that to about 2e-4 (the final validation losses too)."""
    for name in want:
        assert [s for s, _ in got[name]] == [s for s, _ in want[name]], name
        np.testing.assert_allclose([v for _, v in got[name]], [v for _, v in want[name]],
                                   rtol=1e-3, err_msg=name)


def test_two_processes_train_the_one_process_run_and_move_checkpoints(one_process, tmp_path):
    """One run moved twice: 1 process trains steps 1-2 and stops at its checkpoint, 2
    processes resume it (1 -> 2), train steps 3-4 and stop at theirs, 1 process resumes that
    (2 -> 1) and finishes. It ends as the uninterrupted one-process run; the 2-process leg
    writes its outputs from process 0 alone."""
    want = _losses(one_process)
    out = tmp_path / "run"
    assert train_lm.main([*TINY, "--optimizer", "both", "--stop-after", "2", "--out",
                          str(out)]) == 0
    logs = _run2(["--optimizer", "both", "--resume", "--stop-after", "4", "--out", str(out),
                  "--process-logs"])
    assert "[muon] resumed at step 2" in logs[0]
    assert "2 processes (coordinator 127.0.0.1:" in logs[0]
    assert "muon: stopped at step 4 of 6" in logs[0]
    assert "validation loss" not in logs[1]  # process 0 reports, writes the outputs
    assert json.loads((out / "summary.json").read_text())["processes"] == 2
    assert sorted(p.name for p in (out / "logs").iterdir()) == [
        "process_0.alive", "process_0.log", "process_1.alive", "process_1.log"]
    for i in (0, 1):  # each supervisor's last heartbeat says its worker finished
        assert json.loads((out / "logs" / f"process_{i}.alive").read_text())["state"] == "done"
    assert train_lm.main([*TINY, "--optimizer", "both", "--resume", "--out", str(out)]) == 0
    _close_losses(_losses(out), want)
    got, ref = _final(out), _final(one_process)
    for name in ref:  # gloo vs in-process sums: f32 rounding apart, which Muon's bf16
        # Newton-Schulz amplifies (AdamW's runs agree to the bit; Muon's by ~2e-4)
        assert abs(got[name] - ref[name]) / ref[name] <= 5e-4, (name, got, ref)


def test_a_lost_process_stops_the_other_with_an_error_naming_it(tmp_path, capsys):
    """Process 1 killed mid-run: process 0 exits non-zero within --init-timeout + 60 s, naming
    process 1; a --resume then continues from the last committed checkpoint."""
    out, timeout = tmp_path / "run", 10
    flags = ["--optimizer", "muon", "--out", str(out), "--steps", "400", "--ckpt-every", "4",
             "--eval-every", "1000"]
    procs = _start(flags, init_timeout=timeout)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline and (not metrics.exists() or len(
            metrics.read_text().splitlines()) < 13):
        assert all(p.poll() is None for p in procs), _wait(procs)
        time.sleep(0.5)
    procs[1].kill()
    killed_at = time.time()
    try:
        log0 = procs[0].communicate(timeout=timeout + 60)[0]
    finally:
        _wait(procs, timeout=5)
    assert time.time() - killed_at <= timeout + 60
    assert procs[0].returncode != 0
    named = r"unhealthy \(stopped sending heartbeats\):\s*1\b|lost a process: process 1 "
    assert re.search(named, log0), log0[-3000:]
    steps = sorted(int(p.name) for p in (out / "ckpt" / "muon").iterdir() if p.name.isdigit())
    # Committed checkpoints survive the crash (the one of step 12 may still have been in
    # flight: asynchronous saves commit later).
    assert steps and steps[-1] >= 8, steps
    # One process resumes (checkpoints move between process counts: the test above), which
    # costs half the CPU of two processes compiling the same step.
    capsys.readouterr()
    assert train_lm.main([*TINY, *flags[:-4], "--resume", "--steps", str(steps[-1] + 2),
                          "--eval-every", "1000"]) == 0
    assert f"[muon] resumed at step {steps[-1]}" in capsys.readouterr().out
    recs = [r for r in lm_metrics.read_metrics(metrics) if r["optimizer"] == "muon"]
    assert [r["step"] for r in recs] == list(range(1, steps[-1] + 3))  # nothing lost, no gap


def test_supervisor_names_the_process_that_stopped_first(tmp_path, monkeypatch):
    """The heartbeats a supervisor reads after its worker failed: a stale one (killed) comes
    before one that failed after this worker, a missing one is reported as unseen, a live
    one is not lost."""
    import lm_supervise

    monkeypatch.setattr(lm_supervise, "STALE_S", 0.2)
    monkeypatch.setattr(lm_supervise, "HEARTBEAT_S", 0.0)
    (tmp_path / "logs").mkdir()
    now = time.time()
    beats = {1: {"time": now - 5, "state": "running"},
             2: {"time": now + 0.1, "state": "failed: its worker was killed by SIGABRT"},
             3: {"time": now + 10, "state": "running"}}  # still beating
    for p, rec in beats.items():
        lm_supervise.heartbeat_path(tmp_path, p).write_text(json.dumps(rec))
    stopped, unseen = lm_supervise.lost_peers(tmp_path, 0, 5, failed_at=now)
    assert [p for _, p, _ in stopped] == [1, 2]
    assert "stopped sending heartbeats" in stopped[0][2]
    assert unseen == [4]
