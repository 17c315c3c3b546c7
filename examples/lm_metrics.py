"""What a run of examples/train_lm.py recorded: its metrics, the clock of training, the plot.

``metrics.jsonl`` holds one record per step and optimizer (``step``, ``train_loss``,
``step_s``, ``load_balance_loss``, and ``val_loss`` at evaluations). These functions read it,
measure training time without compilation (:func:`train_seconds`), find when Muon reaches
AdamW's final loss (:func:`time_to_adamw_loss`; :func:`adamw_loss_race`: whether that is worth
reporting) and draw ``loss.png`` (:func:`plot`). Nothing here imports JAX, so the trainer can
use it before JAX starts.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np


def read_metrics(path: pathlib.Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (one per step; ``[]`` if the file is missing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_seconds(records: list[dict]) -> np.ndarray:
    """Training time up to each record of one optimizer: the cumulative sum of ``step_s``.

    Evaluation and checkpoints are outside ``step_s``; a step that compiled (the first of each
    process) counts as the median of the others, so the clock measures training, not
    compilation.
    """
    t = np.array([r["step_s"] for r in records], dtype=np.float64)
    warm = [r["step_s"] for r in records if not r.get("compiles")]
    for i, r in enumerate(records):
        if r.get("compiles") and warm:
            t[i] = float(np.median(warm))
    return np.cumsum(t)


def time_to_loss(records: list[dict], target: float) -> float | None:
    """Training seconds (:func:`train_seconds`) at the first evaluation with validation loss
    ``<= target``; ``None`` if none reaches it. Evaluations are ``--eval-every`` steps apart,
    so this is an upper bound by up to that many steps' time (:func:`time_to_loss_bracket`
    gives the lower end)."""
    bracket = time_to_loss_bracket(records, target)
    return None if bracket is None else bracket[1]


def time_to_loss_bracket(records: list[dict], target: float) -> tuple[float, float] | None:
    """``(after, by)``: the loss first reached ``target`` after ``after`` training seconds (the
    last evaluation still above it; 0 if none came before) and by ``by`` (the first at or
    below it); ``None`` if none reaches it.

    >>> recs = [{"step_s": 1.0, "val_loss": 3.0}, {"step_s": 1.0},
    ...         {"step_s": 1.0, "val_loss": 1.0}]
    >>> time_to_loss_bracket(recs, 2.0), time_to_loss_bracket(recs, 0.5)
    ((1.0, 3.0), None)
    """
    clock = train_seconds(records)
    after = 0.0
    for r, t in zip(records, clock, strict=True):
        if "val_loss" not in r:
            continue
        if r["val_loss"] <= target:
            return after, float(t)
        after = float(t)
    return None


def time_to_adamw_loss(records: list[dict]) -> dict | None:
    """When Muon first reaches AdamW's final validation loss, absolute and as a fraction of
    AdamW's training time, at the first evaluation that shows it (``..._s``, ``..._fraction``)
    and at the evaluation before it (``..._after_s``, ``..._fraction_after``: the crossing lies
    between); ``None`` unless both optimizers ran."""
    by = {n: [r for r in records if r["optimizer"] == n] for n in ("muon", "adamw")}
    if not by["muon"] or not by["adamw"]:
        return None
    vals = [r["val_loss"] for r in by["adamw"] if "val_loss" in r]
    if not vals:
        return None
    adamw_s = float(train_seconds(by["adamw"])[-1])
    after, t = time_to_loss_bracket(by["muon"], vals[-1]) or (None, None)
    return {"adamw_final_val_loss": vals[-1], "adamw_train_s": adamw_s,
            "muon_train_s": float(train_seconds(by["muon"])[-1]),
            "muon_time_to_adamw_final_loss_s": t,
            "muon_time_to_adamw_final_loss_fraction": None if t is None else t / adamw_s,
            "muon_time_to_adamw_final_loss_after_s": after,
            "muon_time_to_adamw_final_loss_fraction_after":
                None if after is None else after / adamw_s}


def adamw_loss_race(records: list[dict]) -> tuple[dict | None, str | None]:
    """The race to report, :func:`time_to_adamw_loss`, or ``None`` and a sentence saying why
    there is none (``(None, None)`` unless both optimizers ran with evaluations).

    A crossing is timed only between two of Muon's evaluations: the last still above AdamW's
    final validation loss and the first at or below it. When Muon's first evaluation is
    already there (with evaluations far apart, e.g. ``--steps`` below ``--eval-every``, it is
    Muon's last one) the bracket would run from 0 s to that evaluation and time nothing.
    """
    race = time_to_adamw_loss(records)
    if race is None:
        return None, None
    target = race["adamw_final_val_loss"]
    muon = [r for r in records if r["optimizer"] == "muon"]
    if race["muon_time_to_adamw_final_loss_s"] is None:
        return None, (f"Muon did not reach AdamW's final validation loss ({target:.4f}) at any "
                      "evaluation: no time to reach it to report.")
    first = next(r for r in muon if "val_loss" in r)
    if first["val_loss"] <= target:
        return None, (f"Muon's first evaluation (step {first['step']}) had already reached "
                      f"AdamW's final validation loss ({target:.4f}), so the time it took is not "
                      "measured (evaluate more often with --eval-every to time it).")
    return race, None


def plot(records: list[dict], path: pathlib.Path) -> None:
    """Train (smoothed) and validation loss against steps and validation loss against training
    seconds (:func:`train_seconds`), zoomed past the first steps; load balance and step time
    below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((ax, ax_t), (ax_lb, ax_st)) = plt.subplots(
        2, 2, figsize=(12, 6), sharex="col", gridspec_kw={"height_ratios": [3, 1]})
    finals = []
    for i, name in enumerate(sorted({r["optimizer"] for r in records})):
        rs = [r for r in records if r["optimizer"] == name]
        steps = np.array([r["step"] for r in rs])
        clock = train_seconds(rs) if all("step_s" in r for r in rs) else None
        k = max(1, len(rs) // 30)
        smooth = lambda v, k=k: np.convolve(np.asarray(v), np.ones(k) / k, mode="valid")
        color = f"C{i}"
        train = [r["train_loss"] for r in rs]
        ax.plot(steps[k - 1:], smooth(train), color=color, alpha=0.6, label=f"{name} train")
        vs = [(r["step"], r["val_loss"]) for r in rs if "val_loss" in r]
        if vs:
            ax.plot(*zip(*vs, strict=True), "o-", color=color, label=f"{name} validation")
            finals.append(vs[-1][1])
        ax_lb.plot(steps[k - 1:], smooth([r["load_balance_loss"] for r in rs]), color=color,
                   label=name)
        if clock is not None:
            tv = [(t, r["val_loss"]) for r, t in zip(rs, clock, strict=True) if "val_loss" in r]
            if tv:
                ax_t.plot(*zip(*tv, strict=True), "o-", color=color, label=f"{name} validation")
            warm = [(t, 1e3 * r["step_s"]) for r, t in zip(rs, clock, strict=True)
                    if not r.get("compiles")]
            if warm:
                ax_st.plot(*zip(*warm, strict=True), color=color, alpha=0.7, label=name)
    if finals:  # the first steps (loss ~5.5) would flatten everything after them
        ax.set_ylim(top=2.0 * max(finals))
        ax_t.set_ylim(top=2.0 * max(finals))
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title("Byte-level MoE LM on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend()
    ax_t.set_title("validation loss against training time")
    ax_t.grid(alpha=0.3)
    if ax_t.lines:  # runs without step times (or without evaluations) leave it empty
        ax_t.legend()
    ax_lb.set_xlabel("step")
    ax_lb.set_ylabel("load balance\n(1 = uniform)")
    ax_lb.grid(alpha=0.3)
    ax_st.set_xlabel("training seconds (compilation and evaluation excluded)")
    ax_st.set_ylabel("step time (ms)")
    ax_st.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
