"""A latency profile for XLA's scheduler from the cost and link model: compile, model, compile
again.

XLA's latency-hiding scheduler places each async collective's start and done by its own
estimate of how long the collective takes. For the expert-parallel all-to-alls of a GPU
program that estimate is far below what the links move (in the 8-GPU schedules of
``benchmarks/schedule8.py`` it started one all-to-all right after another, with only
small ops between them): the exchange is async, but the scheduler sees nothing worth hiding.
Given the modeled times it does hide it.

`latency_profile(compiled, hardware)` writes the time `xla_comm.costs` gives every
instruction of a compiled program, and every collective's transfer time, as a
``ProfiledInstructionsProto`` in text form: the profile format of XLA's profile-guided latency
estimator (PGLE), keyed by the name each instruction had when it was scheduled. `compile_modeled`
compiles a lowered program, writes its profile, and compiles it again with the profile
(``xla_gpu_pgle_profile_file_or_directory_path``), so the second schedule is planned with the
link's transfer times.

On a machine that runs the program, JAX's own PGLE (``jax_enable_pgle``) measures such a
profile over the first steps; this one exists before any run, for a topology compiled on
another machine (`xla_comm.schedule.topology_mesh`), and is as right as the model's rates
(``Hardware``: measure them).

Example:
  >>> text = '''HloModule m, num_partitions=2
  ... ENTRY %main (p: f32[512,512]) -> f32[512,512] {
  ...   %p = f32[512,512]{1,0} parameter(0)
  ...   %s = f32[512,512]{1,0} all-to-all-start(%p), replica_groups={{0,1}}, dimensions={0}
  ...   %d = f32[512,512]{1,0} all-to-all-done(%s)
  ...   ROOT %e = f32[512,512]{1,0} exponential(%d), metadata={scheduling_name="exp.1"}
  ... }'''
  >>> hw = costs.Hardware(gemm_tflops=1.0, fp8_gemm_tflops=2.0, hbm_GBps=1000.0, link_GBps=1.0,
  ...                     inter_host_GBps=1.0, latency_us=0.0, launch_us=0.0)
  >>> print(latency_profile(text, hw))  # 512 KiB at 1 GB/s; 2 MiB through HBM at 1 TB/s
  costs { name: "s" cost_us: 524.288 }
  costs { name: "exp.1" cost_us: 2.097 }
  <BLANKLINE>

References:
  XLA latency-hiding scheduler and its profile-guided latency estimator (openxla.org/xla;
    xla/service/profile_guided_latency_estimator.cc).
  JAX, "GPU performance tips": profile-guided latency estimation.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any, NamedTuple

from xla_comm import costs, hlo

__all__ = ["PROFILE_OPTION", "Modeled", "compile_modeled", "latency_profile"]

PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
"""The XLA:GPU option that points the scheduler at a latency profile (a ``.pbtxt`` file)."""

_SCHEDULING_NAME_RE = re.compile(r'scheduling_name="([^"]+)"')
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")


def _scheduled_name(ins: hlo.Instruction) -> str:
    """The name the scheduler knew the instruction by (later passes may rename it; XLA keeps
    that name in the ``scheduling_name`` metadata for PGLE to match)."""
    m = _SCHEDULING_NAME_RE.search(ins.attrs)
    return m.group(1) if m else ins.name


def latency_profile(compiled_or_text: Any, hardware: costs.Hardware, *,
                    grouped_rows: costs.GroupedRows = None) -> str:
    """The modeled time of each instruction of a compiled program, as a PGLE profile.

    One ``costs { name: ... cost_us: ... }`` line per instruction the cost model charges
    (`costs.instruction_cost`, in microseconds on ``hardware``) and per collective (its
    transfer time, `costs.transfer_us`; for an async pair under its start's name, which the
    estimator reads as the latency from start to done). Instructions inside fusions are left
    out: the scheduler sees the fusion.

    Args:
      compiled_or_text: ``jax.jit(f).lower(*args).compile()`` or its HLO text.
      hardware: the rates of the cost and link models.
      grouped_rows: the token rows a grouped GEMM computes at most
        (`xla_comm.schedule.schedule_report`'s argument of that name).

    Returns:
      ``ProfiledInstructionsProto`` text (write it to a ``.pbtxt`` file).
    """
    text = hlo.hlo_text(compiled_or_text)
    mod = hlo.parse_hlo(text)
    table = {ins.name: ins for ins in mod.instructions()}
    colls = hlo.analyze_collectives(text)
    attrs = costs.collective_attrs(mod, colls, table)
    by_start = {c.name: c for c in colls}
    fused = {callee for ins in mod.instructions() if ins.opcode in ("fusion", "fusion-start")
             for callee in _CALLS_RE.findall(ins.attrs)}
    lines = []
    for comp, body in mod.computations.items():
        if comp in fused:
            continue
        for ins in body:
            if ins.name in by_start:
                us, _ = costs.transfer_us(by_start[ins.name], attrs[ins.name], mod.num_devices,
                                          hardware)
            else:
                us = costs.instruction_cost(ins, mod, table,
                                            grouped_rows=grouped_rows).time_us(hardware)
            if us > 0:
                lines.append(f'costs {{ name: "{_scheduled_name(ins)}" cost_us: {us:.3f} }}')
    return "\n".join(lines) + "\n"


class Modeled(NamedTuple):
    """What `compile_modeled` returns: the program scheduled with the modeled latencies, the
    first compile (XLA's own estimates) and the profile that links them."""

    compiled: Any
    default: Any
    profile: str


def compile_modeled(lowered, hardware: costs.Hardware, *,
                    compiler_options: dict[str, Any] | None = None,
                    grouped_rows: costs.GroupedRows = None) -> Modeled:
    """Compile ``lowered`` with XLA's latency estimates, then again with the modeled ones.

    Args:
      lowered: ``jax.jit(f).lower(*args)``.
      hardware: the rates of the cost and link models (`costs.Hardware`).
      compiler_options: further XLA options for both compiles.
      grouped_rows: see `latency_profile`.

    Returns:
      A `Modeled`: ``compiled`` runs (or is read by `xla_comm.schedule.schedule_report`) like
      any compiled program.

    Raises:
      ValueError: when this XLA takes no latency profile (a platform without the
        ``xla_gpu_pgle_profile_file_or_directory_path`` option: GPUs only).
    """
    opts = dict(compiler_options or {})
    default = lowered.compile(compiler_options=opts) if opts else lowered.compile()
    profile = latency_profile(default, hardware, grouped_rows=grouped_rows)
    fd, path = tempfile.mkstemp(suffix=".pbtxt", prefix="xla_comm_latency_")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(profile)
        try:
            compiled = lowered.compile(compiler_options={**opts, PROFILE_OPTION: path})
        except Exception as err:
            if PROFILE_OPTION in str(err):
                raise ValueError(f"this XLA takes no latency profile ({PROFILE_OPTION} is "
                                 "an XLA:GPU option); compile for a GPU or use "
                                 "lowered.compile().") from err
            raise
    finally:
        os.remove(path)
    return Modeled(compiled, default, profile)
