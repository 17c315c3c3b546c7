"""Read a jax.profiler trace: where the device time goes, and the collective time left exposed.

A command line over `xla_comm.breakdown` and `xla_comm.trace` (the library modules the
benchmarks and tests import):

    python benchmarks/trace_breakdown.py TRACE_DIR HLO_FILE [STEPS]   # op breakdown
    python benchmarks/trace_breakdown.py TRACE_DIR                    # exposed collectives
    python benchmarks/trace_breakdown.py TRACE_DIR HLO_FILE --overlap # both

With ``HLO_FILE`` (``compiled.as_text()`` of the executable the trace ran, e.g. written by
``lm_step_bench.py --hlo-dir``) it prints `xla_comm.breakdown.op_breakdown` of the trace: a table
per op category, one per region of `xla_comm.breakdown.LM_REGIONS`, and the JSON. Without it, or
with ``--overlap``, it prints `xla_comm.trace.exposed_comm_fraction` as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DESCRIPTION = """\
Reads one jax.profiler trace (the newest run under TRACE_DIR; nothing is run or timed). With
HLO_FILE (the compiled HLO text of the traced executable): device time per op category
(exchange, sort, gemm, combine, ...) and per LM region (xla_comm.breakdown.LM_REGIONS), summed over
devices and divided by STEPS, printed as tables and JSON. Without HLO_FILE, or with --overlap:
the collective (NCCL) time not hidden under compute, per device, as JSON. Writes no file."""


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir", help="a jax.profiler.trace directory, run folder or file")
    p.add_argument("hlo_file", nargs="?", help="compiled HLO text of the traced executable")
    p.add_argument("steps", nargs="?", type=int, default=1,
                   help="traced calls (times are divided by it; default 1)")
    p.add_argument("--overlap", action="store_true",
                   help="also print the exposed-collective figures")
    a = p.parse_args(argv)
    from xla_comm import breakdown, trace

    out = {}
    if a.hlo_file:
        res = breakdown.op_breakdown(a.trace_dir, Path(a.hlo_file).read_text(), steps=a.steps,
                                     regions=breakdown.LM_REGIONS,
                                     kernel_regions=breakdown.LM_KERNEL_REGIONS)
        print(breakdown.format_table({"trace": res}))
        print(breakdown.format_regions({"trace": res}))
        print(json.dumps(res, indent=2))
        out["breakdown"] = res
    if a.overlap or not a.hlo_file:
        out["overlap"] = trace.exposed_comm_fraction(a.trace_dir)
        print(json.dumps(out["overlap"], indent=2))
    return out


if __name__ == "__main__":
    main()
