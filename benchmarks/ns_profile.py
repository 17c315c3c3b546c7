"""Where Newton-Schulz's device time goes: one profiled run of Muon's orthogonalization per op.

Orthogonalizes the stacks that `muon_jax.scale_by_muon` forms from `muon_step.py`'s parameter
set on one device (f32 in, bf16 out, as that step's ``ns`` variant runs them), traces a few
calls with ``jax.profiler`` and joins each traced kernel to its HLO instruction in the compiled
program (`xla_comm.breakdown.op_breakdown`), whose cost `xla_comm.costs.op_cost` gives (FLOPs
of GEMMs and of the symmetric-tile kernel, bytes of everything else). Prints the device time
per call by category:

- ``gemm``: cuBLAS / XLA GEMMs and the symmetric-tile kernel (``tiles_W_of_T`` scope),
- ``transpose``: fusions XLA emits with a transposed operand read (``input_transpose_fusion``):
  the mirroring of symmetric products (`muon_jax.symmetric.mirror_upper`), alone or fused into
  the elementwise pass that consumes the product,
- ``elementwise``: the other fusions (casts, the ``a X + B X`` update, the Gram form's
  combinations),
- ``other``: everything else (copies, small reductions),

then the slowest ops with their achieved TFLOP/s and GB/s. Command buffers are turned off
(``--xla_gpu_enable_command_buffer=``) so that the trace shows kernels rather than one graph
launch.

Usage:
  python benchmarks/ns_profile.py --out ns_profile.json          # GPU: the 1.62B set
  python benchmarks/ns_profile.py --small                        # CPU: 2 layers, d 64 / 176
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

CATEGORIES = ("gemm", "transpose", "elementwise", "other")


def category(op: str, gemm: bool) -> str:
    """The category of traced op ``op`` (an HLO instruction name); ``gemm``: the cost model
    charges it FLOPs.

    >>> category("input_transpose_fusion.3", False), category("loop_convert_fusion", False)
    ('transpose', 'elementwise')
    """
    if gemm:
        return "gemm"
    if "transpose_fusion" in op:
        return "transpose"
    return "elementwise" if "fusion" in op else "other"


def summarize(trace_dir: str, hlo_text: str, calls: int) -> dict:
    """Device time per call of each instruction of ``hlo_text`` in the trace under
    ``trace_dir`` (`xla_comm.breakdown.op_breakdown`'s join; kernels that name no instruction
    count as ``other``), with the cost model's FLOPs and bytes, and the totals per category."""
    from xla_comm import breakdown, costs, parse

    mod = parse.parse_hlo(hlo_text)
    table = {i.name: i for i in mod.instructions()}
    joined = breakdown.op_breakdown(trace_dir, hlo_text, steps=calls, top=len(table))
    rows, totals = {}, dict.fromkeys(CATEGORIES, 0.0)
    for op, _, us in joined["top_ops"]:
        flops, nbytes, _, gemm = costs.op_cost(table[op], mod, table)
        cat = category(op, gemm)
        totals[cat] += us
        rows[op] = {"us": us, "category": cat, "flops": flops, "bytes": nbytes,
                    "tflops": flops / us / 1e6 if us else 0.0,
                    "GBps": nbytes / us / 1e3 if us else 0.0}
    for name, us in joined["unmatched_kernels"].items():
        totals["other"] += us
        rows[name] = {"us": us, "category": "other", "flops": 0.0, "bytes": 0.0,
                      "tflops": 0.0, "GBps": 0.0}
    rows = dict(sorted(rows.items(), key=lambda kv: -kv[1]["us"]))
    return {"total_us": sum(totals.values()), "by_category_us": totals, "ops": rows}


def print_summary(label: str, s: dict, top: int) -> None:
    """A short table: totals per category, then the ``top`` slowest ops."""
    total = s["total_us"]
    print(f"== {label}: {total / 1e3:.2f} ms of device time per call, {len(s['ops'])} ops")
    print("   " + "  ".join(f"{c} {v / 1e3:.2f} ms ({v / total:.0%})"
                           for c, v in s["by_category_us"].items() if total))
    for op, r in list(s["ops"].items())[:top]:
        print(f"   {r['us']:9.1f} us  {r['category']:11s} {op[:38]:38s} "
              f"{r['tflops']:6.1f} TF/s {r['GBps']:6.0f} GB/s")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CPU: 2 layers, d 64, f 176")
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--ns-coeffs", default="jordan",
                   help="a schedule name of muon_jax.newton_schulz.SCHEDULES, or per-step "
                        "triples as JSON ([[a, b, c], ...], one per step)")
    p.add_argument("--calls", type=int, default=3, help="traced calls")
    p.add_argument("--top", type=int, default=20, help="slowest ops printed")
    p.add_argument("--hlo-out", help="write the compiled Newton-Schulz program's HLO here")
    p.add_argument("--out", help="JSON file")
    a = p.parse_args(argv)
    if a.small:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_command_buffer=").strip()

    import jax
    import jax.numpy as jnp
    from bench_util import env_info, median_seconds, write_json
    from jax.sharding import AxisType

    import muon_jax
    from muon_jax.newton_schulz import SCHEDULES

    layers, d, f = (2, 64, 176) if a.small else (8, 4096, 11008)
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_gate": (d, f),
              "w_up": (d, f), "w_down": (f, d)}
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:1])
    params = {f"layer_{i}": {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
              for i in range(layers)}
    with jax.set_mesh(mesh):
        plan = muon_jax.scale_by_muon(sharding=muon_jax.ShardingOptions(mesh)).init(params).plan
    del params
    stacks = [(s.k_owner, s.m, s.n) for s in plan.stacks]
    keys = jax.random.split(jax.random.key(0), len(stacks))
    xs = [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, stacks, strict=True)]
    coeffs = a.ns_coeffs if a.ns_coeffs in SCHEDULES else json.loads(a.ns_coeffs)
    fn = jax.jit(lambda xs: [muon_jax.orthogonalize(x, ns_steps=a.ns_steps, ns_coeffs=coeffs)
                             .astype(jnp.bfloat16) for x in xs])
    compiled = fn.lower(xs).compile()
    hlo_text = compiled.as_text()
    if a.hlo_out:
        Path(a.hlo_out).write_text(hlo_text)
    seconds, _ = median_seconds(compiled, (xs,), 2, 7)
    with tempfile.TemporaryDirectory() as tmp:
        jax.block_until_ready(compiled(xs))
        with jax.profiler.trace(tmp):
            for _ in range(a.calls):
                jax.block_until_ready(compiled(xs))
        ns = summarize(tmp, hlo_text, a.calls)
    report = {"benchmark": "ns_profile", "env": env_info(), "config": vars(a),
              "stacks": stacks, "ns_seconds": seconds, "ns": ns}
    print(f"stacks {stacks}: {seconds * 1e3:.2f} ms per call (median wall)")
    print_summary("Newton-Schulz", ns, a.top)
    write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
