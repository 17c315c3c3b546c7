"""What the pipelined MoE layer's chunks cost on one GPU, by op category and by kernel.

The EP=8 layer's per-device work (``benchmarks/schedule_report.py``'s shape A: 8192 tokens,
d 2048, d_ff 1024, the 4 local experts, top-2, FP8 dispatch) run on one GPU with
``overlap_chunks`` 1, 2 and 4: nothing is sent, so every microsecond a chunked step takes
over the unchunked one is the chunking's own cost, the figure
``chunked_over_unchunked_1gpu`` of the schedule report (target <= 1.05). Each program is
timed (interleaved medians), then traced once with ``jax.profiler``; the trace is split by
`xla_comm.breakdown.op_breakdown` into op categories and named-scope regions, and the
kernels whose total time changes most between 1 and 2 chunks are listed.

Usage (on the GPU):
  python benchmarks/chunk_cost.py --out OUT/chunk_cost.json [--chunks 1,2,4]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_util import median_seconds  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe  # noqa: E402
from xla_comm import breakdown, trace  # noqa: E402

# Regions of the layer's step by named scope: the expert GEMMs split by kind, so that a
# chunking cost in the weight gradients (summed over chunks) shows apart from the data path.
REGIONS = {"experts_wgrad": breakdown.scope_regex(r"experts_\w+_wgrad"),
           **{k: breakdown.LM_REGIONS[k] for k in ("experts", "dispatch_combine", "moe_other")}}
# Mosaic GPU kernels name no HLO instruction in a trace: the weight-gradient GEMMs by name.
KERNEL_REGIONS = {"experts_wgrad": r"^tgmm", **breakdown.LM_KERNEL_REGIONS}


def _commit() -> str:
    f = ROOT / "COMMIT"
    return f.read_text().strip() if f.exists() else "unknown"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--chunks", default="1,2,4")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--transport", default="auto")
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    chunk_list = [int(c) for c in a.chunks.split(",")]
    t0 = time.perf_counter()
    mesh = jax.make_mesh((1, 1), ("data", "expert"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    k = jax.random.split(jax.random.key(0), 5)
    e, d, f = a.experts, a.d_model, a.d_ff
    args = (jax.random.normal(k[0], (1, a.tokens, d), jnp.bfloat16),
            jax.random.normal(k[1], (d, e), jnp.float32),
            (jax.random.normal(k[2], (e, d, 2 * f)) * 0.02).astype(jnp.bfloat16),
            (jax.random.normal(k[3], (e, f, d)) * 0.02).astype(jnp.bfloat16),
            jax.random.normal(k[4], (1, a.tokens, d), jnp.float32))
    args = jax.device_put(args, NamedSharding(mesh, P()))
    fns, hlo = {}, {}
    for c in chunk_list:
        o = moe.MoEOptions.create(e, a.top_k, dispatch_dtype="fp8", combine_grad_dtype="fp8",
                                  overlap_chunks=c, transport=a.transport)

        def loss(x, router, wgu, wd, ct, o=o):
            y, aux = moe.moe_apply(x, router, wgu, wd, options=o, mesh=mesh)
            return jnp.sum(y.astype(jnp.float32) * ct) + 0.01 * aux["load_balance_loss"]

        fns[c] = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()
        hlo[c] = fns[c].as_text()
    times = {c: [] for c in chunk_list}
    for c in chunk_list:
        jax.block_until_ready(fns[c](*args))
    for _ in range(a.rounds):
        for c in chunk_list:
            times[c].append(median_seconds(fns[c], args, 1, 3)[0])
    med = {c: float(np.median(v)) for c, v in times.items()}
    report = {"benchmark": "chunk_cost", "commit": _commit(),
              "env": {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__},
              "shape": vars(a) | {"out": None}, "step_ms": {c: med[c] * 1e3 for c in med},
              "over_unchunked": {c: med[c] / med[chunk_list[0]] for c in med}, "cases": {}}
    kernels = {}
    for c in chunk_list:
        with tempfile.TemporaryDirectory() as tdir:
            steps = 5
            with jax.profiler.trace(tdir):
                for _ in range(steps):
                    jax.block_until_ready(fns[c](*args))
            br = breakdown.op_breakdown(tdir, hlo[c], steps=steps, top=25, regions=REGIONS,
                                        kernel_regions=KERNEL_REGIONS)
            per_kernel = collections.defaultdict(float)
            count = collections.Counter()
            for _dev, _line, name, _op, _mod, us in trace.op_events(tdir):
                # fusions are numbered per program: compare them by kind
                base = re.sub(r"\.\d+$", "", name.split("(")[0])
                per_kernel[base] += us / steps
                count[base] += 1
        kernels[c] = per_kernel
        report["cases"][str(c)] = {"breakdown": br, "kernel_count": sum(count.values()) / steps}
        print(f"[{time.perf_counter() - t0:5.0f}s] chunks {c}: {med[c] * 1e3:.3f} ms "
              f"({med[c] / med[chunk_list[0]]:.3f}x); device {br['total_us_per_step']:.0f} us, "
              f"{sum(count.values()) / steps:.0f} ops", flush=True)
        print("   categories:", {k: round(v) for k, v in br["us_per_step"].items() if v})
        print("   regions:", {k: round(v) for k, v in br.get("us_per_region", {}).items() if v})
    if 1 in kernels and 2 in kernels:
        names = set(kernels[1]) | set(kernels[2])
        diff = sorted(((kernels[2].get(n, 0) - kernels[1].get(n, 0), n) for n in names),
                      reverse=True)
        report["kernel_diff_2_minus_1_us"] = [(n, round(dv, 2), round(kernels[1].get(n, 0), 2),
                                               round(kernels[2].get(n, 0), 2))
                                              for dv, n in diff[:40] + diff[-10:]]
        print("kernel time, 2 chunks - 1 (us): largest increases")
        for n, dv, v1, v2 in report["kernel_diff_2_minus_1_us"][:25]:
            print(f"   {dv:+8.1f}  {v1:8.1f} -> {v2:8.1f}  {n[:90]}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    for c in chunk_list:
        (out.parent / f"chunk_cost_hlo_{c}.txt").write_text(hlo[c])
    return report


if __name__ == "__main__":
    main()
