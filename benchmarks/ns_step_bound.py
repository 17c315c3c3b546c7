"""How few Newton-Schulz steps can match Jordan's five: an exact-arithmetic floor.

Newton-Schulz maps each singular value on its own: after Frobenius normalization
``x_i = s_i / ||s||_2``, ``T`` steps of odd quintics give ``g(x_i)`` with ``g`` an odd
polynomial of degree ``5^T``, and the relative Frobenius distance to the polar factor is
``sqrt(mean_i (g(x_i) - 1)^2)`` (exact arithmetic; bf16 operands move it by about 1%).
If ``g`` stays within ``[-B, B]`` on ``[-1, 1]`` (Jordan's 5 steps peak at 1.20),
Bernstein's inequality ``|g'(t)| <= 5^T B / sqrt(1 - t^2)`` gives
``g(x) <= min(B, 5^T B arcsin(x))``: whatever the coefficients, a singular value far below
``1 / 5^T`` cannot reach 1, so

    error >= sqrt(mean_i max(0, 1 - min(B, 5^T B arcsin(x_i)))^2).

Against Jordan's 5 steps (slope ``3.4445^5 ~ 484`` at 0), 3 steps (``125 B``) lose on
ill-conditioned matrices whatever their coefficients; 4 steps are not ruled out by the
floor, and the schedules below show what the known constructions give. This script
prints, for the spectra of ``benchmarks/muon_speed.py``'s accuracy matrices, Jordan's
error, the floor's ratio to it for ``T`` steps and several ``B``, and the ratio of greedy
minimax schedules (each step the odd quintic closest to 1 in max norm on the interval the
previous steps left, started from ``[tau, 1]``: the Polar Express construction) with
``T`` steps.

Usage:
  python benchmarks/ns_step_bound.py [--steps 3,4] [--bounds 1.2,1.5,2] [--out F.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

JORDAN = (3.4445, -4.7750, 2.0315)


def compose(schedule, x: np.ndarray) -> np.ndarray:
    """``p_T(... p_1(x))`` for per-step quintic coefficients ``(a, b, c)``."""
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    return x


def normalized(s: np.ndarray) -> np.ndarray:
    """Singular values as Newton-Schulz starts from them (Frobenius normalization)."""
    s = np.asarray(s, np.float64)
    return s / np.sqrt(np.sum(s**2))


def error(schedule, s: np.ndarray) -> float:
    """Relative Frobenius distance to the polar factor after ``schedule`` (exact arithmetic)."""
    return float(np.sqrt(np.mean((compose(schedule, normalized(s)) - 1.0) ** 2)))


def floor(s: np.ndarray, steps: int, bound: float) -> float:
    """The least error any ``steps``-step odd-quintic schedule bounded by ``bound`` on
    ``[0, 1]`` can reach on singular values ``s`` (Bernstein's inequality, above).

    >>> round(floor(np.ones(4), 3, 1.2), 6)  # x = 0.5: the floor allows reaching 1
    0.0
    """
    x = normalized(s)
    reach = np.minimum(bound, 5.0**steps * bound * np.arcsin(np.minimum(x, 1.0)))
    return float(np.sqrt(np.mean(np.maximum(0.0, 1.0 - reach) ** 2)))


def minimax_quintic(lo: float, hi: float, points: int = 2000) -> tuple[float, float, float]:
    """The odd quintic ``a x + b x^3 + c x^5`` closest to 1 in max norm on ``[lo, hi]``
    (a linear program on a grid, geometric and linear points)."""
    from scipy.optimize import linprog

    x = np.concatenate([np.geomspace(lo, hi, points), np.linspace(lo, hi, points)])
    basis = np.stack([x, x**3, x**5], axis=1)
    ones = np.ones((len(x), 1))
    # minimize t subject to |1 - basis @ coef| <= t
    a_ub = np.block([[-basis, -ones], [basis, -ones]])
    b_ub = np.concatenate([-np.ones(len(x)), np.ones(len(x))])
    res = linprog([0, 0, 0, 1], A_ub=a_ub, b_ub=b_ub, bounds=[(None, None)] * 3 + [(0, None)])
    if not res.success:  # pragma: no cover
        raise RuntimeError(f"minimax_quintic({lo}, {hi}): {res.message}")
    return tuple(float(v) for v in res.x[:3])


@functools.cache
def greedy_schedule(tau: float, steps: int) -> tuple[tuple[float, float, float], ...]:
    """``steps`` greedy minimax quintics from ``[tau, 1]``: each maps the interval the last
    one left as close to 1 as a quintic can (the Polar Express construction, no safety
    factor)."""
    lo, hi, out = tau, 1.0, []
    for _ in range(steps):
        coef = minimax_quintic(lo, hi)
        y = compose([coef], np.geomspace(lo, hi, 20000))
        lo, hi = float(y.min()), float(y.max())
        out.append(coef)
    return tuple(out)


def spectra(small: bool = False) -> dict[str, np.ndarray]:
    """The singular values of ``muon_speed.py``'s accuracy matrices of its first shape (the
    spectra, not the aspect ratios, decide the error)."""
    from muon_speed import accuracy_matrices

    out = {}
    for name, m in accuracy_matrices(small):
        if out and name.partition(" ")[0] != next(iter(out)).partition(" ")[0]:
            break  # the next shape: its spectra are these again
        out[name] = np.linalg.svd(m, compute_uv=False)
    return out


def report(steps=(3, 4), bounds=(1.2, 1.5, 2.0), taus=(1e-2, 3e-3, 1e-3),
           small: bool = False) -> dict:
    """Per spectrum: Jordan's error, the floor's ratio to it, the greedy schedules' ratios;
    and per ``(steps, bound)`` the worst floor ratio (> 1.1: no such schedule meets the
    accuracy bound of 1.1x Jordan's error)."""
    rows, worst_floor, worst_greedy = [], {}, {}
    schedules = {(t, tau): greedy_schedule(tau, t) for t in steps for tau in taus}
    for name, s in spectra(small).items():
        ref = error([JORDAN] * 5, s)
        row = {"spectrum": name, "jordan5_error": ref, "floor_ratio": {}, "greedy_ratio": {}}
        for t in steps:
            for b in bounds:
                key = f"T{t}_B{b:g}"
                row["floor_ratio"][key] = floor(s, t, b) / ref
                worst_floor[key] = max(worst_floor.get(key, 0.0), row["floor_ratio"][key])
            for tau in taus:
                key = f"T{t}_tau{tau:g}"
                row["greedy_ratio"][key] = error(schedules[t, tau], s) / ref
                worst_greedy[key] = max(worst_greedy.get(key, 0.0), row["greedy_ratio"][key])
        rows.append(row)
    return {"rows": rows, "worst_floor_ratio": worst_floor,
            "worst_greedy_ratio": worst_greedy,
            "greedy_schedules": {f"T{t}_tau{tau:g}": c for (t, tau), c in schedules.items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="3,4")
    p.add_argument("--bounds", default="1.2,1.5,2")
    p.add_argument("--taus", default="1e-2,3e-3,1e-3")
    p.add_argument("--small", action="store_true", help="64-row matrices (fast)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    r = report(tuple(int(v) for v in a.steps.split(",")),
               tuple(float(v) for v in a.bounds.split(",")),
               tuple(float(v) for v in a.taus.split(",")), a.small)
    for row in r["rows"]:
        cells = [f"{k} {v:.3f}" for k, v in {**row["floor_ratio"], **row["greedy_ratio"]}.items()]
        print(f"{row['spectrum']:28s} jordan5 {row['jordan5_error']:.3f} | " + " ".join(cells))
    print("worst floor ratio:", {k: round(v, 3) for k, v in r["worst_floor_ratio"].items()})
    print("worst greedy ratio:", {k: round(v, 3) for k, v in r["worst_greedy_ratio"].items()})
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1))
    return r


if __name__ == "__main__":
    main()
