"""HLO helpers shared by the tests: which collectives sit outside every conditional."""

import re

from xla_comm import hlo

_BRANCHES_RE = re.compile(r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation="
                          r"%?([\w.\-]+))")
_CALLS_RE = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")


def outside_branches(text: str, opcode: str) -> int:
    """``opcode`` instructions (async halves once) outside every conditional's branches and
    what those branches call."""
    mod = hlo.parse_hlo(text)
    stack = [name.strip().lstrip("%") for ins in mod.instructions() if ins.opcode == "conditional"
             for group in _BRANCHES_RE.findall(ins.attrs) for part in group if part
             for name in part.split(",")]
    inside: set[str] = set()
    while stack:
        c = stack.pop()
        if c not in inside and c in mod.computations:
            inside.add(c)
            stack.extend(x for i in mod.computations[c] for x in _CALLS_RE.findall(i.attrs))
    return sum(ins.opcode.removesuffix("-start") == opcode
               for c, body in mod.computations.items() if c not in inside for ins in body)
