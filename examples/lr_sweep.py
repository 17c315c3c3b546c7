"""Learning-rate sweep of examples/train_lm.py: final validation loss against lr, per optimizer.

Every run is one call of ``train_lm.train_one`` with the trainer's own flags, so a sweep point
is exactly the run ``train_lm.py --optimizer muon|adamw --lr/--adam-lr X`` would make: same
model, batches, schedule, steps and tokens. For Muon the grid is ``--lr`` (shared by the
hidden matrices and the AdamW part, unless ``--muon-adam-lr`` pins the latter); for AdamW it is
``--adam-lr``. The
trainer's default learning rates (its width rule) are added to each grid unless
``--no-defaults``, so the summary can compare default against default and best against best.

Usage::

    python examples/lr_sweep.py --out runs/sweep                      # CPU preset
    python examples/lr_sweep.py --preset gpu --muon-lrs 1e-3,3e-3,8e-3 \\
        --adam-lrs 1e-3,2e-3,4e-3 --steps 300 --out $OUT                 # one GPU

Any other flag goes to the trainer (e.g. ``--d-model 256 --layers 4 --batch 16``).
``--dry-run`` prints which grid points the same command would reuse, keep or train (and how
many rows of ``lr_sweep.json`` have other settings), and trains and writes nothing.

Outputs in ``--out``: ``lr_sweep.json`` (``runs``: one row per run with the final validation
loss, lr, optimizer, steps, tokens, preset and wall time; ``summary``: ``<preset>_muon_default_
val_loss``, ``<preset>_muon_best_val_loss``, the AdamW pair and the learning rates behind
them), ``lr_sweep.png`` (final validation loss against lr, log x, one line per optimizer) and
``runs/<optimizer>_lr<lr>/metrics.jsonl``. The JSON is rewritten after every run. Runs already
in it with the same settings are not run again and are kept (also those outside this grid), so
a sweep cut short (e.g. by a time limit) continues when the same command is run again with the
same ``--out``, and a sweep may be split over several commands (``--optimizers muon``, then
``--optimizers adamw``) into one table. Runs with other settings are dropped from it.

``--jobs N`` trains up to N grid points at once, each in its own process (``lr_sweep.py`` on one
point, output in ``<out>/points/``), all on the same devices. For models too small to fill a GPU
this overlaps one run's compilation and host work (the trainer syncs every step) with another's
training; the losses are those of the serial runs, but each row's tokens/s and wall time are
then shared-device figures (the row's ``jobs`` says so). Unless ``XLA_PYTHON_CLIENT_MEM_FRACTION``
or ``XLA_PYTHON_CLIENT_PREALLOCATE`` is set, each process preallocates 0.9 / N of the GPU memory.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import math
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import train_lm  # noqa: E402  (examples/train_lm.py; sets up 8 CPU devices before JAX starts)

# Trainer settings that do not change what a run computes (left out of the reuse key).
_NOT_IN_KEY = ("out", "no_progress", "resume", "stop_after", "ckpt_every", "optimizer", "lr",
               "adam_lr", "peak_tflops", "eval_every", "pgle")  # pgle: the schedule, not the math


def _lrs(text: str | None, flag: str) -> list[float] | None:
    if text is None:
        return None
    try:
        lrs = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise train_lm.UsageError(
            f"{flag} must be comma-separated numbers like 1e-3,3e-3, got {text!r}.") from None
    if not lrs or min(lrs) <= 0:
        raise train_lm.UsageError(f"{flag} needs positive learning rates, got {text!r}.")
    return lrs



DESCRIPTION = """\
Learning-rate sweep of examples/train_lm.py: final validation loss against the peak lr, per
optimizer (Muon: --lr grid; AdamW: --adam-lr grid), every point one train_lm run with the
trainer's flags (any other flag goes to the trainer; default its CPU preset; grids default to
the trainer's default lr x 0.5, 1, 2). Writes in --out: lr_sweep.json (runs; summary:
<preset>_{muon,adamw}_{default,best}_val_loss, best lrs, differences), lr_sweep.png and
runs/<optimizer>_lr<lr>/metrics.jsonl; points already in lr_sweep.json with the same settings
are reused. --dry-run prints what would be reused or trained, and trains and writes nothing."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the option help, the description as written."""


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """The sweep's own flags and the trainer's (everything else, parsed by train_lm)."""
    p = argparse.ArgumentParser(description=DESCRIPTION, allow_abbrev=False,
                                formatter_class=_Formatter)
    p.add_argument("--muon-lrs", help="Muon --lr grid, e.g. 1e-3,3e-3 (default: the trainer's "
                   "default x 0.5, 1, 2)")
    p.add_argument("--adam-lrs", help="AdamW --adam-lr grid (default: default x 0.5, 1, 2)")
    p.add_argument("--optimizers", default="muon,adamw", help="which grids to run")
    p.add_argument("--defaults", action=argparse.BooleanOptionalAction, default=True,
                   help="add the trainer's default learning rates to each grid")
    p.add_argument("--jobs", type=int, default=1,
                   help="grid points trained at once, one process each, sharing the devices")
    p.add_argument("--out", default="runs/lr_sweep", help="output directory")
    p.add_argument("--dry-run", action="store_true",
                   help="print which grid points would be reused or trained; train nothing")
    sweep, rest = p.parse_known_args(argv)
    sweep.trainer_argv = rest
    if sweep.jobs < 1:
        raise train_lm.UsageError(f"--jobs must be >= 1, got {sweep.jobs}.")
    trainer = train_lm.parse_args([*rest, "--out", sweep.out])
    trainer.ckpt_every = 0  # sweep points are not resumed
    sweep.optimizers = [s.strip() for s in sweep.optimizers.split(",") if s.strip()]
    if not sweep.optimizers or set(sweep.optimizers) - {"muon", "adamw"}:
        raise train_lm.UsageError(
            f"--optimizers must list muon and/or adamw, got {','.join(sweep.optimizers)!r}.")
    return sweep, trainer


def grids(sweep, trainer) -> dict[str, list[float]]:
    """Learning rates per optimizer (sorted), with the trainer's defaults added if asked."""
    defaults = {"muon": trainer.lr, "adamw": trainer.adam_lr}
    given = {"muon": _lrs(sweep.muon_lrs, "--muon-lrs"),
             "adamw": _lrs(sweep.adam_lrs, "--adam-lrs")}
    out = {}
    for name in sweep.optimizers:
        lrs = given[name] or [defaults[name] * f for f in (0.5, 1.0, 2.0)]
        if sweep.defaults and not any(math.isclose(x, defaults[name]) for x in lrs):
            lrs.append(defaults[name])
        out[name] = sorted(set(lrs))
    return out


def run_key(name: str, lr: float, args) -> dict:
    """What makes two runs the same run: the optimizer, its lr and every setting that counts."""
    skip = _NOT_IN_KEY + (("router_optimizer", "muon_adam_lr") if name == "adamw" else ())
    cfg = {k: v for k, v in sorted(vars(args).items()) if k not in skip}
    return {"optimizer": name, "lr": lr, "config": cfg}


def with_lr(trainer, name: str, lr: float):
    """A copy of the trainer's settings with ``name``'s learning rate set to ``lr``."""
    args = copy.copy(trainer)
    if name == "muon":
        args.lr = lr
    else:
        args.adam_lr = lr
    return args


def summarize(rows: list[dict], defaults: dict[str, float], preset: str) -> dict:
    """Default-vs-default and best-vs-best figures, keyed ``<preset>_<optimizer>_...``."""
    out: dict = {}
    for name in ("muon", "adamw"):
        mine = sorted((r for r in rows if r["optimizer"] == name), key=lambda r: r["lr"])
        if not mine:
            continue
        ok = [r for r in mine if r["final_val_loss"] is not None]
        out[f"{preset}_{name}_lrs"] = [r["lr"] for r in mine]
        out[f"{preset}_{name}_default_lr"] = defaults[name]
        dflt = [r for r in mine if math.isclose(r["lr"], defaults[name])]
        if dflt:
            out[f"{preset}_{name}_default_val_loss"] = dflt[0]["final_val_loss"]
        if ok:
            best = min(ok, key=lambda r: r["final_val_loss"])
            out[f"{preset}_{name}_best_val_loss"] = best["final_val_loss"]
            out[f"{preset}_{name}_best_lr"] = best["lr"]
    m, a = (out.get(f"{preset}_muon_default_val_loss"), out.get(f"{preset}_adamw_default_val_loss"))
    ab = out.get(f"{preset}_adamw_best_val_loss")
    if m is not None and a is not None:
        out[f"{preset}_muon_default_minus_adamw_default"] = m - a
    if m is not None and ab is not None:
        out[f"{preset}_muon_default_minus_adamw_best"] = m - ab
    if rows:
        out["steps"], out["tokens"] = rows[0]["steps"], rows[0]["tokens"]
    return out


def plot(rows: list[dict], defaults: dict[str, float], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    finite = [r["final_val_loss"] for r in rows if r["final_val_loss"] is not None]
    top = max(finite) * 1.05 if finite else 1.0
    for i, name in enumerate(("muon", "adamw")):
        mine = sorted((r for r in rows if r["optimizer"] == name), key=lambda r: r["lr"])
        if not mine:
            continue
        ok = [r for r in mine if r["final_val_loss"] is not None]
        color = f"C{i}"
        ax.plot([r["lr"] for r in ok], [r["final_val_loss"] for r in ok], "o-", color=color,
                label=f"{name} (lr = {'--lr' if name == 'muon' else '--adam-lr'})")
        bad = [r["lr"] for r in mine if r["final_val_loss"] is None]
        if bad:
            ax.plot(bad, [top] * len(bad), "x", color=color, markersize=9, label=f"{name} diverged")
        d = [r for r in ok if math.isclose(r["lr"], defaults[name])]
        if d:
            ax.plot([d[0]["lr"]], [d[0]["final_val_loss"]], "s", color=color, markersize=11,
                    markerfacecolor="none", label=f"{name} default")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final validation loss (nats / byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[dict], defaults: dict[str, float]) -> str:
    lines = [f"{'optimizer':>9} {'lr':>9} {'val loss':>9} {'bits/byte':>9} {'tok/s':>9} "
             f"{'wall s':>7}"]
    for r in sorted(rows, key=lambda r: (r["optimizer"], r["lr"])):
        v = r["final_val_loss"]
        mark = "  default" if math.isclose(r["lr"], defaults[r["optimizer"]]) else ""
        if r.get("jobs", 1) > 1:
            mark += f"  (tok/s, wall: {r['jobs']} runs sharing the devices)"
        tok = f"{r['tokens_per_s']:9.0f}" if r.get("tokens_per_s") else f"{'-':>9}"
        lines.append(
            f"{r['optimizer']:>9} {r['lr']:9.2e} "
            + (f"{v:9.4f} {v / math.log(2):9.4f}" if v is not None else f"{'diverged':>9} {'':>9}")
            + f" {tok} {r['wall_s']:7.1f}{mark}")
    return "\n".join(lines)


def _point_env(jobs: int) -> dict[str, str]:
    """A grid point's environment: its share of the GPU memory unless the user chose one."""
    env = dict(os.environ)
    if not {"XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"} & env.keys():
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / jobs:.3f}"
    return env


def run_point_process(sweep, name: str, lr: float, out: pathlib.Path) -> tuple[dict, dict]:
    """Trains one grid point in a child ``lr_sweep.py``; returns its row and its JSON document."""
    point = out / "points" / f"{name}_lr{lr:.3g}"
    point.mkdir(parents=True, exist_ok=True)
    grid = "--muon-lrs" if name == "muon" else "--adam-lrs"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *sweep.trainer_argv,
           "--optimizers", name, grid, repr(lr), "--no-defaults", "--jobs", "1",
           "--out", str(point)]
    with (point / "log.txt").open("w") as log_file:
        code = subprocess.run(cmd, env=_point_env(sweep.jobs), stdout=log_file,
                              stderr=subprocess.STDOUT, check=False).returncode
    if code:
        raise RuntimeError(f"exit status {code}; see {point / 'log.txt'}")
    doc = json.loads((point / "lr_sweep.json").read_text())
    row = next(r for r in doc["runs"] if r["optimizer"] == name and r["lr"] == lr)
    return {**row, "jobs": sweep.jobs}, doc


def train_point(name, lr, args, key, out: pathlib.Path, mesh, corpus, preset, log) -> dict:
    """Trains one grid point in this process; returns its row (loss None if it diverged)."""
    run_dir = out / "runs" / f"{name}_lr{lr:.3g}"
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with (run_dir / "metrics.jsonl").open("w") as f:
        try:
            res = train_lm.train_one(name, args, mesh, corpus, run_dir, f)
        except FloatingPointError as err:
            log(f"[{name} lr {lr:.3g}] diverged: {err}")
            res = {"final_val_loss": None, "tokens_per_s": None, "mfu": None,
                   "steps": args.steps, "tokens": args.steps * args.batch * args.seq_len}
    return {**key, "final_val_loss": res["final_val_loss"], "steps": res["steps"],
            "tokens": res["tokens"], "tokens_per_s": res["tokens_per_s"], "mfu": res["mfu"],
            "preset": preset, "wall_s": time.perf_counter() - t0}


def plan_runs(sweep, trainer, old: list[dict]):
    """What a sweep does with the rows ``old`` of its ``lr_sweep.json``: ``(kept, reused, todo,
    dropped)``: rows of this sweep's settings outside its grid (kept in the table), rows of
    grid points run before with the same settings (reused), ``(optimizer, lr, args, key)`` of
    the grid points to train (after every reusable one, so a sweep cut short keeps them all),
    and how many rows had other settings (left out)."""
    grid_lrs = grids(sweep, trainer)
    kept, reused, todo, dropped = [], [], [], 0
    for r in old:  # earlier points of this sweep (same settings) that this grid leaves out
        same = run_key(r["optimizer"], r["lr"], with_lr(trainer, r["optimizer"], r["lr"]))
        if {k: r.get(k) for k in same} != same:
            dropped += 1
        elif same["lr"] not in grid_lrs.get(r["optimizer"], ()):
            kept.append(r)
    for name, lrs in grid_lrs.items():
        for lr in lrs:
            args = with_lr(trainer, name, lr)
            key = run_key(name, lr, args)
            prev = [r for r in old if {k: r.get(k) for k in key} == key]
            if prev:
                reused.append(prev[0])
            else:
                todo.append((name, lr, args, key))
    return kept, reused, todo, dropped


def dry_run(sweep, trainer) -> None:
    """Print what the sweep would reuse, keep, leave out and train; train and write nothing."""
    path = pathlib.Path(sweep.out) / "lr_sweep.json"
    old = json.loads(path.read_text()).get("runs", []) if path.exists() else []
    kept, reused, todo, dropped = plan_runs(sweep, trainer, old)
    if dropped:
        print(f"{dropped} run(s) in {path} have other settings: they would be left out")
    for r in kept:
        print(f"[{r['optimizer']} lr {r['lr']:.3g}] kept from {path} (outside this grid)")
    for r in reused:
        print(f"[{r['optimizer']} lr {r['lr']:.3g}] would be reused from {path}")
    for name, lr, _, _ in todo:
        print(f"[{name} lr {lr:.3g}] would be trained")
    print(f"dry run: {len(todo)} to train, {len(reused)} reused, {len(kept)} kept, {dropped} "
          "left out; nothing trained or written")


def sweep_runs(sweep, trainer, mesh, corpus, *, log=print) -> dict:
    """Runs (or reuses) every grid point; writes and returns the ``lr_sweep.json`` content.

    With ``sweep.jobs > 1`` the points run in child processes and ``mesh``/``corpus`` (then
    None) are not used: this process never touches the devices.
    """
    out = pathlib.Path(sweep.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "lr_sweep.json"
    prev_doc = json.loads(path.read_text()) if path.exists() else {}
    old = prev_doc.get("runs", [])
    defaults = {"muon": trainer.lr, "adamw": trainer.adam_lr}
    rows: list[dict] = []
    failed: list[str] = []
    if mesh is not None:
        meta = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                "mesh": dict(mesh.shape)}
    else:
        meta = {k: prev_doc.get(k) for k in ("backend", "device_kind", "mesh")}

    def write() -> dict:
        doc = {"preset": trainer.preset, "defaults": defaults, **meta,
               "summary": summarize(rows, defaults, trainer.preset), "runs": rows}
        if failed:
            doc["failed"] = failed
        path.write_text(json.dumps(doc, indent=2))
        return doc

    def done(row: dict) -> None:
        rows.append(row)
        v = row["final_val_loss"]
        log(f"[{row['optimizer']} lr {row['lr']:.3g}] final validation loss "
            f"{'diverged' if v is None else f'{v:.4f}'} ({row['wall_s']:.0f} s)")
        write()

    kept, reused, todo, dropped = plan_runs(sweep, trainer, old)
    rows += kept
    if dropped:
        log(f"{dropped} run(s) in {path} had other settings; they are left out of this table")
    for r in reused:
        rows.append(r)
        log(f"[{r['optimizer']} lr {r['lr']:.3g}] reused from {path}")
    if sweep.jobs > 1:
        with concurrent.futures.ThreadPoolExecutor(sweep.jobs) as pool:
            futures = {pool.submit(run_point_process, sweep, name, lr, out): (name, lr)
                       for name, lr, _, _ in todo}
            for fut in concurrent.futures.as_completed(futures):
                name, lr = futures[fut]
                try:
                    row, child = fut.result()
                except RuntimeError as err:
                    failed.append(f"{name} lr {lr:g}")
                    log(f"[{name} lr {lr:.3g}] failed: {err}")
                    continue
                meta.update({k: child[k] for k in meta})
                done(row)
    else:
        for name, lr, args, key in todo:
            done(train_point(name, lr, args, key, out, mesh, corpus, trainer.preset, log))
    doc = write()
    title = (f"{trainer.preset} preset: d_model {trainer.d_model}, {trainer.layers} layers, "
             f"{trainer.experts} experts, {trainer.batch}x{trainer.seq_len}, {trainer.steps} steps")
    plot(rows, defaults, out / "lr_sweep.png", title)
    return doc


def main(argv=None) -> int:
    try:
        sweep, trainer = parse_args(argv)
        grids(sweep, trainer)  # validate the lists before any work
        if sweep.dry_run:
            dry_run(sweep, trainer)
            return 0
        # With --jobs the children load the corpus and hold the devices; this process does not.
        mesh, corpus = train_lm.setup(trainer) if sweep.jobs == 1 else (None, None)
    except train_lm.UsageError as e:
        print(f"lr_sweep.py: error: {e}", file=sys.stderr)
        return 2
    if mesh is not None:
        print(train_lm.describe(trainer, mesh, corpus), flush=True)
    else:
        print(f"{sweep.jobs} grid points at a time, one process each: logs in "
              f"{pathlib.Path(sweep.out) / 'points'}", flush=True)
    doc = sweep_runs(sweep, trainer, mesh, corpus)
    print(table(doc["runs"], doc["defaults"]))
    print(json.dumps(doc["summary"], indent=2))
    out = pathlib.Path(sweep.out)
    print(f"wrote {out / 'lr_sweep.json'}, {out / 'lr_sweep.png'}")
    if doc.get("failed"):
        print(f"lr_sweep.py: {len(doc['failed'])} point(s) failed: {', '.join(doc['failed'])}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
