"""Parse HLO text into computations and instructions (the module `xla_comm.hlo` reads).

`parse_hlo` reads the text of a compiled or lowered JAX stage (`hlo_text`) into an
`HloModule`: computation name -> its `Instruction`s in text order, which in a compiled module
is the schedule order. `array_nbytes` / `array_shapes` / `shape_nbytes` give the bytes of the
shapes it prints. `xla_comm.hlo` re-exports `HloModule`, `Instruction`, `hlo_text`,
`parse_hlo` and `array_nbytes`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["HloModule", "Instruction", "array_nbytes", "array_shapes", "hlo_text", "parse_hlo",
           "shape_nbytes", "split_balanced"]

_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fnuz": 8,
    "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4,
}
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# Compiled text has "name (params) -> result {"; lowered (pre-optimization) text "name {".
_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")

@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction, as `parse_hlo` reads it.

    Attributes:
      name: the instruction's name (without `%`).
      shape: its result shape text, e.g. `f32[8,16]{1,0}` or a tuple `(f32[8], s32[])`.
      opcode: e.g. `fusion`, `all-gather-start`, `async-start`.
      operands: names of its operands.
      attrs: the text after the operand list (`replica_groups=..., to_apply=...`).
      computation: name of the computation holding it.
      index: position in that computation (the schedule order in compiled text).
      root: whether it is its computation's ``ROOT``.

    Example:
      >>> from xla_comm.hlo import parse_hlo
      >>> text = '''HloModule m
      ... ENTRY %main (x: f32[4,8], w: f32[8,2]) -> f32[4,2] {
      ...   %x = f32[4,8]{1,0} parameter(0)
      ...   %w = f32[8,2]{1,0} parameter(1)
      ...   ROOT %y = f32[4,2]{1,0} dot(%x, %w), lhs_contracting_dims={1}
      ... }'''
      >>> ins = parse_hlo(text).computations["main"][2]
      >>> ins.name, ins.shape, ins.opcode, ins.operands, ins.index, ins.attrs, ins.root
      ('y', 'f32[4,2]{1,0}', 'dot', ('x', 'w'), 2, ', lhs_contracting_dims={1}', True)
    """

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    computation: str
    index: int
    root: bool = False


@dataclasses.dataclass(frozen=True)
class HloModule:
    """A parsed HLO module: its computations' instructions in text (schedule) order.

    Attributes:
      computations: computation name -> its instructions.
      entry: name of the ENTRY computation (None when the text has none).
      num_partitions: the module's `num_partitions` (1 when absent).
      num_devices: `num_partitions * replica_count`.

    Example:
      >>> from xla_comm.hlo import parse_hlo
      >>> text = '''HloModule m, replica_count=2, num_partitions=4
      ... %add (a: f32[], b: f32[]) -> f32[] {
      ...   %a = f32[] parameter(0)
      ...   %b = f32[] parameter(1)
      ...   ROOT %s = f32[] add(%a, %b)
      ... }
      ... ENTRY %main (p: f32[8]) -> f32[8] {
      ...   %p = f32[8]{0} parameter(0)
      ...   ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
      ... }'''
      >>> mod = parse_hlo(text)
      >>> mod.entry, list(mod.computations), mod.num_partitions, mod.num_devices
      ('main', ['add', 'main'], 4, 8)
    """

    computations: dict[str, tuple[Instruction, ...]]
    entry: str | None
    num_partitions: int = 1
    num_devices: int = 1

    def instructions(self) -> Iterator[Instruction]:
        """Every instruction of every computation."""
        for body in self.computations.values():
            yield from body


def hlo_text(compiled_or_text: Any) -> str:
    """The HLO text of a compiled or lowered JAX stage (or the string itself).

    Args:
      compiled_or_text: HLO text, a compiled stage (`jax.jit(f).lower(*a).compile()`: the
        optimized, scheduled module) or a lowered stage (`jax.jit(f).lower(*a)`, also
        `nnx.jit`'s: the pre-optimization HLO that JAX hands to XLA, i.e. what any backend
        is asked to run before XLA's own rewrites).

    Returns:
      The HLO module text.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
      >>> hlo_text(lowered).startswith("HloModule")
      True
    """
    if isinstance(compiled_or_text, str):
        return compiled_or_text
    if hasattr(compiled_or_text, "compile") and hasattr(compiled_or_text, "as_text"):
        return compiled_or_text.as_text(dialect="hlo")  # a lowered stage (jax or nnx.jit)
    if hasattr(compiled_or_text, "as_text"):
        text = compiled_or_text.as_text()
        if isinstance(text, str):
            return text
    raise TypeError(
        f"hlo_text: expected HLO text or a compiled stage with .as_text(), got "
        f"{type(compiled_or_text).__name__}; pass jax.jit(f).lower(*args).compile()."
    )


def array_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Bytes of an HLO array `dtype[shape]`, e.g. `array_nbytes('bf16', (8, 16))`.

    Sub-byte types round up to whole bytes.

    Args:
      dtype: HLO element type name (`f32`, `bf16`, `f8e4m3fn`, `u32`, `pred`, ...).
      shape: the dimensions.

    Returns:
      ceil(prod(shape) * bits(dtype) / 8).

    Example:
      >>> array_nbytes("bf16", (8, 16))
      256
    """
    if dtype not in _DTYPE_BITS:
        raise ValueError(
            f"array_nbytes: unknown HLO element type dtype={dtype!r}; use one of "
            f"{sorted(_DTYPE_BITS)}."
        )
    return (math.prod(shape) * _DTYPE_BITS[dtype] + 7) // 8


def split_balanced(s: str, start: int) -> int:
    """Index just past the bracket group (``()``, ``[]`` or ``{}``) opening at ``s[start]``.

    Example:
      >>> split_balanced("f(a, (b, c)) + d", 1)
      12
    """
    depth = 0
    for i in range(start, len(s)):
        ch = s[i]
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(s)


def _split_operands(inner: str) -> tuple[str, ...]:
    """Operand names of a top-level comma-separated operand list (types dropped)."""
    operands, depth, part = [], 0, ""
    for ch in inner + ",":
        if ch == "," and depth == 0:
            tok = part.strip().split()
            if tok:
                operands.append(tok[-1].lstrip("%"))
            part = ""
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        part += ch
    return tuple(operands)


def _parse_instr(rest: str) -> tuple[str, str, tuple[str, ...], str] | None:
    """(shape, opcode, operands, attrs) from the text after `name = `."""
    rest = rest.strip()
    if rest.startswith("("):
        end = split_balanced(rest, 0)
    else:
        m = re.match(r"\S+", rest)
        if m is None:
            return None
        end = m.end()
    shape, tail = rest[:end], rest[end:].lstrip()
    m = re.match(r"([\w\-]+)\(", tail)
    if m is None:
        return None
    close = split_balanced(tail, m.end() - 1)
    return shape, m.group(1), _split_operands(tail[m.end(): close - 1]), tail[close:]


def _module_sizes(text: str) -> tuple[int, int]:
    """(num_partitions, num_partitions * replica_count) from the module header."""
    m = re.search(r"num_partitions=(\d+)", text)
    num_partitions = int(m.group(1)) if m else 1
    m = re.search(r"replica_count=(\d+)", text)
    return num_partitions, num_partitions * (int(m.group(1)) if m else 1)


def parse_hlo(compiled_or_text: Any) -> HloModule:
    """Parse HLO module text into its computations and instructions.

    Args:
      compiled_or_text: HLO text, a compiled stage or a lowered stage (see `hlo_text`).

    Returns:
      An `HloModule`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mod = parse_hlo(jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile())
      >>> "multiply" in {ins.opcode for ins in mod.instructions()}
      True
    """
    text = hlo_text(compiled_or_text)
    comps: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER_RE.match(line)
            if m and not _INSTR_RE.match(line):
                current = m.group(2)
                comps[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR_RE.match(line)
        parsed = _parse_instr(m.group(3)) if m else None
        if parsed is None:
            continue
        body = comps[current]
        body.append(Instruction(m.group(2), *parsed, current, len(body), bool(m.group(1))))
    num_partitions, num_devices = _module_sizes(text)
    return HloModule({c: tuple(b) for c, b in comps.items()}, entry, num_partitions, num_devices)


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of each array in an HLO shape text.

    Example:
      >>> array_shapes("(f32[8,16]{1,0}, s32[])")
      [('f32', (8, 16)), ('s32', ())]
    """
    out = []
    for dt, dims in _ARRAY_RE.findall(shape):
        if dt in _DTYPE_BITS:
            out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
    return out


def shape_nbytes(arrays: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of the arrays `array_shapes` gives.

    Example:
      >>> shape_nbytes(array_shapes("(f32[8,16]{1,0}, s32[])"))
      516
    """
    return sum(array_nbytes(dt, dims) for dt, dims in arrays)
