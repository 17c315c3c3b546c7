"""Queries on a lowered program's StableHLO text: which Pallas kernels it calls, loops left
outside scans, and FP8 values widened to a wider type.

``jax.jit(f).lower(...).as_text()`` or ``jax.export`` give the text; these read it as text (no
MLIR bindings), so a test or a benchmark can check what a program does on a GPU while
running on a CPU (lower it for CUDA: the kernels become custom calls).
"""

from __future__ import annotations

import re

__all__ = ["F8E4M3", "MOSAIC_GPU_CALLS", "TRITON_CALL", "kernel_calls", "kernel_lines",
           "kernel_names", "loops_outside_scans", "widened_fp8"]

TRITON_CALL = "__gpu$xla.gpu.triton"
"""The custom-call target of a Pallas Triton kernel."""

MOSAIC_GPU_CALLS = ("mosaic_gpu", "mosaic_gpu_v2")
"""The custom-call targets of a Pallas Mosaic GPU kernel (jax's older and newer)."""

F8E4M3 = "f8E4M3FN"
_NUMBERED = r"(?:_\d+)?"  # jax >= 0.11 numbers a Mosaic GPU module's symbol: name_17
_DEF = re.compile(r"^\s*(%[\w.]+)(?::\d+)?\s*=\s*([\w.\"]+)")


def kernel_lines(text: str) -> list[str]:
    """The custom-call lines of Triton and Mosaic GPU kernels in ``text``.

    Example:
      >>> kernel_lines('%0 = stablehlo.custom_call @mosaic_gpu(%a) {x}\\n%1 = stablehlo.add')
      ['%0 = stablehlo.custom_call @mosaic_gpu(%a) {x}']
    """
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line
            and (TRITON_CALL in line or any(f"@{c}(" in line for c in MOSAIC_GPU_CALLS))]


def _named(pattern: str) -> re.Pattern:
    # Triton: ``name = "..."`` in the backend config; Mosaic GPU: a NUL-delimited symbol of the
    # serialized module.
    return re.compile(rf'(?:"|\\00)({pattern}){_NUMBERED}(?:"|\\00)')


def kernel_calls(text: str, pattern: str) -> list[str]:
    """The kernel custom-call lines whose kernel name matches ``pattern`` (a regex for the
    whole name; a Mosaic GPU module's numbering suffix is allowed).

    Example:
      >>> line = '%0 = stablehlo.custom_call @mosaic_gpu(%a) {cfg = "\\\\00gmm_fp8_3\\\\00"}'
      >>> len(kernel_calls(line, "gmm_fp8")), len(kernel_calls(line, "tgmm_.*"))
      (1, 0)
    """
    pat = _named(pattern)
    return [line for line in kernel_lines(text) if pat.search(line)]


def kernel_names(text: str, pattern: str) -> list[str]:
    """Sorted names (numbering dropped) of the kernels whose name matches ``pattern``, one per
    call.

    Example:
      >>> line = '%0 = stablehlo.custom_call @mosaic_gpu(%a) {cfg = "\\\\00gmm_fp8_3\\\\00"}'
      >>> kernel_names(line, r"t?gmm_\\w+?")
      ['gmm_fp8']
    """
    pat = _named(pattern)
    return sorted(m.group(1) for line in kernel_lines(text) if (m := pat.search(line)))


def loops_outside_scans(text: str) -> int:
    """``stablehlo.while`` ops of a lowered module outside ``chlo.scan`` decompositions.

    An interpreted Pallas kernel lowers to such a loop; since jax 0.11 ``jnp.cumsum`` lowers for
    CUDA to a ``chlo.scan`` whose private ``@chlo.scan.impl_*`` function holds a while loop too.

    Example:
      >>> loops_outside_scans("func.func @main() {\\n stablehlo.while\\n}")
      1
    """
    funcs = re.split(r"^\s*func\.func ", text, flags=re.MULTILINE)
    return sum(f.count("stablehlo.while") for f in funcs if "@chlo.scan." not in f.split("(")[0])


def _uses(lines: list[str], at: int) -> list[tuple[int, str]]:
    """The lines after ``lines[at]`` that use the SSA value it defines, up to the next line
    that defines that name again (MLIR restarts numbering in isolated regions: shard_map
    bodies, private functions)."""
    name = _DEF.match(lines[at]).group(1)
    token = re.compile(re.escape(name) + r"(?![\w#:])")
    out = []
    for i in range(at + 1, len(lines)):
        m = _DEF.match(lines[i])
        if m and m.group(1) == name:
            break
        if token.search(lines[i].split("=", 1)[1] if m else lines[i]):
            out.append((i, lines[i]))
    return out


def widened_fp8(text: str) -> list[str]:
    """The converts of e4m3 values to a wider type whose results are kept (stripped lines).

    A widening ``stablehlo.convert`` is allowed only when it feeds ``stablehlo.multiply`` ops
    whose results feed only converts back to e4m3: a rescaling by a power of two that XLA
    fuses, writing no wide copy. Any other widening is returned.

    Example:
      >>> kept = ('%0 = stablehlo.convert %a : (tensor<4xf8E4M3FN>) -> tensor<4xf32>\\n'
      ...         '%1 = stablehlo.add %0, %0 : tensor<4xf32>')
      >>> widened_fp8(kept)
      ['%0 = stablehlo.convert %a : (tensor<4xf8E4M3FN>) -> tensor<4xf32>']
    """
    widen = re.compile(rf"stablehlo\.convert .*\(tensor<[^>]*x{F8E4M3}>\) -> tensor<[^>]*>")
    narrow = re.compile(rf"stablehlo\.convert .*-> tensor<[^>]*x{F8E4M3}>")
    lines = text.splitlines()
    kept = []
    for at, line in enumerate(lines):
        if not widen.search(line):
            continue
        for i, use in _uses(lines, at):
            if not ("stablehlo.multiply" in use
                    and all(narrow.search(u) for _, u in _uses(lines, i))):
                kept.append(line.strip())
                break
    return kept
