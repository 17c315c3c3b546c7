"""Supervision of one process of a multi-process trainer run: a lost peer is named, not guessed.

When a process of a ``jax.distributed`` CPU run dies, the others usually do not get jax's
heartbeat error: their next gloo collective receives a broken message and aborts the whole
interpreter from C++ (``terminate called ... gloo::EnforceNotMet``), which no Python code
survives to explain. So each trainer process runs as two: this supervisor, which stays in
Python, and the worker (the trainer itself, started again with ``WORKER_ENV`` set). The
supervisor writes a heartbeat file under ``OUT/logs/`` once a second; when its worker fails,
it reads the other processes' heartbeats and names the process that stopped first. The
heartbeats need ``--out`` on storage every process sees, as the checkpoints do; without it
the message says so and lists the candidates.

A worker whose supervisor dies (the process killed, the host lost) exits within a second
(``watch_parent``), so no orphan keeps the run's collectives waiting.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

WORKER_ENV = "TRAIN_LM_WORKER"
"""Set in the worker's environment: its supervisor's pid."""
ID_ENV = "TRAIN_LM_ID_FILE"
"""Where the worker writes ``{"process": i, "processes": n}`` once jax.distributed is up."""
HEARTBEAT_S = 1.0
STALE_S = 4.0
"""A heartbeat older than this means its supervisor stopped."""


def heartbeat_path(out: pathlib.Path, process: int) -> pathlib.Path:
    return out / "logs" / f"process_{process}.alive"


def _write(path: pathlib.Path, record: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)  # atomic: a reader never sees half a record


def _read(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def watch_parent() -> None:
    """In the worker: exit as soon as the supervisor that started it is gone."""
    parent = int(os.environ[WORKER_ENV])

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch-supervisor").start()


def report_identity(process: int, processes: int) -> None:
    """In the worker: tell the supervisor which process of how many it is."""
    if os.environ.get(ID_ENV):
        _write(pathlib.Path(os.environ[ID_ENV]), {"process": process, "processes": processes})


def _how(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with {rc}"


def lost_peers(out: pathlib.Path, me: int, processes: int, failed_at: float
               ) -> tuple[list[tuple[float, int, str]], list[int]]:
    """The other processes that stopped, earliest first, as (time, process, how), and those
    whose heartbeat was never visible. Waits ``STALE_S`` so that a peer killed at the same
    moment as this worker failed has time to look stale."""
    time.sleep(STALE_S + HEARTBEAT_S)
    stopped, unseen = [], []
    now = time.time()
    for p in range(processes):
        if p == me:
            continue
        rec = _read(heartbeat_path(out, p))
        if rec is None:
            unseen.append(p)
        elif rec["state"] != "running":
            stopped.append((rec["time"], p, rec["state"]))
        elif now - rec["time"] > STALE_S:
            stopped.append((rec["time"], p, f"stopped sending heartbeats "
                                           f"{now - rec['time']:.0f} s ago"))
    return sorted(stopped), unseen


def supervise(script: str, argv: list[str], out: pathlib.Path, *, log: bool = False) -> int:
    """Runs ``script argv`` as this process's worker and explains how it ended (on stderr,
    and with ``log`` also in ``OUT/logs/process_<id>.log``, where the worker logs)."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    id_file = out / "logs" / f"worker_{os.getpid()}.id"
    id_file.unlink(missing_ok=True)
    env = {**os.environ, WORKER_ENV: str(os.getpid()), ID_ENV: str(id_file)}
    worker = subprocess.Popen([sys.executable, script, *argv], env=env)
    identity: dict = {}
    stop = threading.Event()
    signalled = []

    def forward(signum, _frame):  # a launcher's SIGTERM / Ctrl-C goes to the worker
        signalled.append(signum)
        worker.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)

    def beat():
        while not stop.is_set():
            if not identity and id_file.exists():
                identity.update(_read(id_file) or {})
            if identity:
                _write(heartbeat_path(out, identity["process"]),
                       {"time": time.time(), "state": "running", "pid": os.getpid()})
            stop.wait(HEARTBEAT_S)

    threading.Thread(target=beat, daemon=True, name="heartbeat").start()
    rc = worker.wait()
    failed_at = time.time()
    stop.set()
    if not identity:
        identity.update(_read(id_file) or {})
    id_file.unlink(missing_ok=True)
    if not identity:  # the worker failed before joining the run: it said why itself
        return rc
    me, n = identity["process"], identity["processes"]
    state = "done" if rc == 0 else f"failed: its worker {_how(rc)}"
    _write(heartbeat_path(out, me), {"time": failed_at, "state": state, "pid": os.getpid()})
    if rc == 0 or signalled:
        return rc
    stopped, unseen = lost_peers(out, me, n, failed_at)

    def say(text):
        print(text, file=sys.stderr, flush=True)
        if log:
            with (out / "logs" / f"process_{me}.log").open("a") as f:
                f.write(text + "\n")

    if stopped:
        t, first, how = stopped[0]
        why = (f"process {first} stopped first ({how}, {failed_at - t:+.1f} s before this "
               "worker)" if t <= failed_at else f"process {first} stopped too ({how})")
        also = ", ".join(f"process {p}" for _, p, _ in stopped[1:])
        say(f"train_lm.py: error: process {me}'s worker {_how(rc)}: the run lost a process: "
            f"{why}" + (f"; also stopped: {also}" if also else "")
            + ". Nothing past the last checkpoint was committed; restart every process with "
            "--resume.")
    else:
        say(f"train_lm.py: error: process {me}'s worker {_how(rc)} and no other process was "
            "seen to stop" + (f" (no heartbeat visible from processes {unseen} under "
                              f"{out / 'logs'}: is --out shared storage?)" if unseen else "")
            + "; see each process's output. Restart every process with --resume.")
    return rc if rc > 0 else 1
