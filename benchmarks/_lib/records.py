"""The current result files and whether each still describes the tree.

A record (``benchmarks/results/current/NAME.json``, NAME = its ``benchmark``) has the fields of
``REQUIRED`` (``measures``: the source paths it measures; ``results``: the script's JSON) and
optionally ``rerun`` (today's spelling of the command), ``note`` and ``validated_at``: later
checks that its figures hold, each ``{"commit", "how", "ratio"}`` (ratio = new / old time). It
is current while no later commit touched what it measures (``git log COMMIT..HEAD --
MEASURES``), counting from its own commit or from a validation within
``VALIDATION_TOLERANCE`` of 1; else dated. Only committed history counts (:class:`Git`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess

from _lib import ROOT

CURRENT = ROOT / "benchmarks" / "results" / "current"
REQUIRED = ("benchmark", "commit", "date", "hardware", "software", "command", "ceiling",
            "measures", "results")
VALIDATION_TOLERANCE = 0.03  # a validation shows "the same speed" within 3%


def load(directory: pathlib.Path = CURRENT) -> dict:
    """Every current record, validated: name -> record."""
    out = {}
    for p in sorted(directory.glob("*.json")):
        rec = json.loads(p.read_text())
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"{p}: missing {missing}; every current result needs {REQUIRED} "
                             "(python3 benchmarks/report.py --adopt writes them).")
        if rec["benchmark"] != p.stem:
            raise ValueError(f"{p}: 'benchmark' is {rec['benchmark']!r}, the file name says "
                             f"{p.stem!r}.")
        for v in rec.get("validated_at", []):
            if not {"commit", "how", "ratio"} <= v.keys():
                raise ValueError(f"{p}: each validated_at entry needs commit, how and ratio.")
        out[p.stem] = rec
    return out


class NoHistory(RuntimeError):
    """The git history that tells current records from dated ones is not available."""


class Git:
    """``git`` on the repository, refusing (:class:`NoHistory`) where its history is missing."""

    def __init__(self, root: pathlib.Path = ROOT):
        self.root = root
        try:
            shallow = self._git("rev-parse", "--is-shallow-repository")
        except (OSError, subprocess.CalledProcessError) as err:
            raise NoHistory(f"no git history here ({type(err).__name__})") from None
        if shallow == "true":
            raise NoHistory("a shallow clone: the commits after each record are not all here "
                            "(git fetch --unshallow)")

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.root), *args], capture_output=True,
                              text=True, check=True).stdout.strip()

    def known(self, commit: str) -> bool:
        try:
            self._git("cat-file", "-e", f"{commit}^{{commit}}")
            return True
        except subprocess.CalledProcessError:
            return False

    def changes_after(self, commit: str, paths) -> list[str]:
        """Commits after ``commit`` up to HEAD that touch ``paths``, oldest first (short)."""
        out = self._git("rev-list", "--reverse", "--abbrev-commit", f"{commit}..HEAD", "--", *paths)
        return out.split()


@dataclasses.dataclass(frozen=True)
class Status:
    """Whether a record describes the tree: ``current``, or dated since ``first_change``."""

    current: bool
    since: str  # the commit its figures hold at: its own, or its latest valid validation's
    first_change: str | None = None  # the first later commit touching its paths
    changes: int = 0
    reason: str = ""

    def text(self, rec: dict) -> str:
        """One line for the report: where it holds, or why it is dated."""
        paths = ", ".join(f"`{p}`" for p in rec["measures"])
        if self.current:
            return "" if self.since == rec["commit"] else (
                f" Validated at `{self.since}`: {self.reason}.")
        if self.first_change is None:
            return f" **Dated:** {self.reason}."
        return (f" **Dated:** measured at `{self.since}`, before changes to {paths} in "
                f"`{self.first_change}`: history, not a figure of this tree.")


def status(rec: dict, git: Git) -> Status:
    """The record's :class:`Status` (its own commit, or the validation that holds longest)."""
    if not git.known(rec["commit"]):
        return Status(False, rec["commit"], reason=f"measured at `{rec['commit']}`, a commit "
                      "not in this repository's history")
    candidates = [(rec["commit"], "")]
    for v in rec.get("validated_at", []):
        if abs(v["ratio"] - 1) <= v.get("tolerance", VALIDATION_TOLERANCE) and git.known(
                v["commit"]):
            candidates.append((v["commit"], f"{v['how']}, ratio {v['ratio']:.3f}"))
    commit, how, changes = min(((c, h, git.changes_after(c, rec["measures"]))
                                for c, h in candidates), key=lambda t: len(t[2]))
    if not changes:
        return Status(True, commit, reason=how)
    return Status(False, commit, changes[0], len(changes))
