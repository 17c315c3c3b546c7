"""A/B of one benchmark command on two source trees, alternating, in one run.

Runs ``python SCRIPT ARGS --out X.json`` in the base tree (``--base``, e.g. an export of the
last commit) and in this tree, ``--rounds`` times, alternating which side goes first in each
round (base, new; new, base; ...) so that drift hits both alike. Every number of the JSONs
whose key path ends in a time (``ms``, ``*_ms``, ``*_ms_*``, ``ms_*``) is collected; per path
the medians of both sides and ``new / base`` are reported (below 1: the new tree is faster),
with their geometric mean and the worst path. Writes ``--out`` (with every run's JSON under
``runs``) and prints a table.

Usage:
  git archive HEAD | tar -x -C /tmp/base   # or any other tree to compare against
  python benchmarks/ab_trees.py --base /tmp/base --rounds 2 --out ab.json -- \\
      benchmarks/experts_bench.py --part fp8 --only ceilings,layer --layer-transports dropless
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def _is_time(path: str) -> bool:
    last = path.rsplit(".", 1)[-1]
    return last == "ms" or last.endswith("_ms") or "_ms_" in last or last.startswith("ms_")


def flatten(obj, prefix: str = "") -> dict[str, float]:
    """``{"a.b.0.c": x}`` for every number of a JSON value (lists indexed; a list entry with
    ``case``/``impl``/``layout``/``backend``/``routing``/``transport``/``variant``/``recipe``
    fields is named by them instead of its index, so rows match across runs).

    Example:
      >>> flatten({"layer": [{"variant": "fp8", "ms": 2.0}], "n": 3})
      {'layer.fp8.ms': 2.0, 'n': 3.0}
    """
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            name = str(i)
            if isinstance(v, dict):
                parts = [str(v[f]) for f in ("case", "impl", "layout", "backend", "routing",
                                              "transport", "variant", "recipe") if f in v]
                name = "/".join(parts) or name
            out.update(flatten(v, f"{prefix}{name}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool) and math.isfinite(obj):
        out[prefix[:-1]] = float(obj)
    return out


def compare(base: list[dict], new: list[dict]) -> dict:
    """Per time path: medians of both sides and ``new / base``; their geometric mean."""
    paths = sorted(set.intersection(*(set(flatten(r)) for r in base + new)))
    rows = {}
    for p in filter(_is_time, paths):
        b = statistics.median(flatten(r)[p] for r in base)
        n = statistics.median(flatten(r)[p] for r in new)
        if b > 0 and n > 0:
            rows[p] = {"base_ms": b, "new_ms": n, "new_over_base": n / b}
    ratios = [r["new_over_base"] for r in rows.values()]
    summary = {"paths": len(rows)}
    if ratios:
        worst = max(rows, key=lambda p: rows[p]["new_over_base"])
        summary.update(geomean_new_over_base=math.exp(statistics.fmean(map(math.log, ratios))),
                       worst_path=worst, worst_new_over_base=rows[worst]["new_over_base"])
    return {"rows": rows, "summary": summary}


def _run(tree: Path, script: str, args: list[str], out: Path, timeout: float) -> dict | None:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(tree / script), *args, "--out", str(out)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, timeout=timeout, capture_output=True,
                              text=True)
        print(proc.stdout[-1500:], proc.stderr[-800:] if proc.returncode else "", flush=True)
        ok = proc.returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
        print(f"timed out after {timeout:.0f}s", flush=True)
    print(f"--- {tree.name or tree}: {'ok' if ok else 'FAILED'} in {time.time() - t0:.0f}s",
          flush=True)
    return json.loads(out.read_text()) if ok and out.exists() else None



DESCRIPTION = """\
Runs one benchmark command (after --) alternately in a base source tree (--base) and in this
one, --rounds times (which side goes first alternates, so drift hits both alike), measuring
nothing itself: for every time in their JSONs (keys ending in ms) the medians of both sides and
new / base, their geometric mean and the worst path. Writes --out (JSON: command, base, rounds,
rows, summary, env, runs: every run's JSON) and prints a table."""


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the tree to compare against")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300, help="seconds per benchmark run")
    p.add_argument("--budget", type=float, default=None,
                   help="stop starting rounds once this many seconds have passed")
    p.add_argument("--out", default=None)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the benchmark after --, e.g. -- benchmarks/experts_bench.py --part fp8 "
                "--only layer")
    trees = {"base": Path(a.base).resolve(), "new": _ROOT}
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            if a.budget is not None and i and time.time() - start > a.budget:
                print(f"budget of {a.budget:.0f}s used: {i} round(s)", flush=True)
                break
            for side in (("base", "new") if i % 2 == 0 else ("new", "base")):
                got = _run(trees[side], cmd[0], cmd[1:], Path(tmp) / f"{side}{i}.json",
                           a.timeout)
                if got is not None:
                    runs[side].append(got)
    result = {"command": cmd, "base": str(a.base), "rounds": [len(runs["base"]),
                                                              len(runs["new"])]}
    result["runs"] = runs  # every JSON as written, for the fields that are not times
    if runs["base"] and runs["new"]:
        result.update(compare(runs["base"], runs["new"]))
        result["env"] = runs["new"][0].get("env")
        for path, r in result["rows"].items():
            print(f"{path:70s} {r['base_ms']:9.3f} {r['new_ms']:9.3f} {r['new_over_base']:6.3f}")
        print(json.dumps(result["summary"]))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
