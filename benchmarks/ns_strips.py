"""Newton-Schulz with symmetric row strips against every tile, by matrix size, on one device.

For each side ``m`` (the Gram matrix's) and aspect ``n / m``, a bank of ``[B, m, n]`` bf16
matrices (``B`` so that every size does about the same FLOPs) goes through
``muon_jax.orthogonalize`` (standard form, Jordan's 5 steps) with ``symmetric_blocks`` 1, 2
and 4; each variant's median seconds (per call over back-to-back calls), and its ratio to the
plain one's. The strips skip half the tiles of the ``[m, m]`` products but cut them into
several smaller GEMMs: ``muon_jax.newton_schulz.AUTO_SYMMETRIC_MIN_SIDE`` is where they start
to win, read off this table.

Usage:
  python benchmarks/ns_strips.py --out ns_strips.json       # GPU
  python benchmarks/ns_strips.py --small                    # CPU, small sides
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

DESCRIPTION = __doc__.split("\n\n")[0] + """

JSON (--out): rows of side, aspect, batch, seconds per variant, ratio to plain; the dense
bf16 matmul ceiling measured in the same run."""


def main(argv=None) -> dict:
    from bench_util import cli, dense_ceiling, env_info, per_call_seconds, write_json

    p = cli(DESCRIPTION)
    p.add_argument("--sides", default=None, help="comma-separated m (default 512..4096; "
                   "small: 64,128)")
    p.add_argument("--aspects", default="1,2.75", help="n / m values")
    p.add_argument("--blocks", default="1,2,4",
                   help="variants: row strips (an int) or tiles (the symmetric-tile kernel), "
                        "each with an optional gram: prefix (the Gram form)")
    p.add_argument("--gflop", type=float, default=None,
                   help="FLOPs per call of the plain form, in GFLOP (default 4000; small 2)")
    p.add_argument("--batches", default=None,
                   help="comma-separated bank sizes B to run at every size (default: one, from "
                        "--gflop)")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    import muon_jax
    from muon_jax.newton_schulz import ns_flops

    sides = [int(s) for s in (a.sides or ("64,128" if a.small else
                                          "512,1024,1536,2048,3072,4096")).split(",")]
    blocks = a.blocks.split(",")  # each [gram:](int | tiles)

    def variant(name):
        method, _, b = name.rpartition(":")
        return dict(method=method or "standard", symmetric_blocks=b if b == "tiles" else int(b))

    budget = (a.gflop or (2.0 if a.small else 4000.0)) * 1e9
    t0 = time.perf_counter()
    report = {"benchmark": "ns_strips", "env": env_info(), "config": vars(a), "rows": [],
              "ceiling": dense_ceiling(256 if a.small else 8192, 2, 5)}
    print(f"ceiling: dense bf16 {report['ceiling']['tflops']:.0f} TFLOP/s", flush=True)
    print(f"{'m':>5} {'n':>6} {'batch':>5} " + " ".join(f"{f'blocks {b}':>10}" for b in blocks)
          + "   ratio to 1", flush=True)

    if any(b.endswith("tiles") for b in blocks):
        report["tiles_check"] = check_tiles(jax, jnp, muon_jax, sides)

    def row(m, n, batch):
        x = jax.random.normal(jax.random.key(m + n), (batch, m, n), jnp.float32)
        secs = {}
        for b in blocks:
            fn = jax.jit(lambda x, b=b: muon_jax.orthogonalize(x, **variant(b)))
            secs[b] = per_call_seconds(fn, (x,), 2, a.iters)
        ratio = {b: secs[b] / secs[blocks[0]] for b in blocks}
        report["rows"].append({"m": m, "n": n, "batch": batch,
                               "seconds": {str(b): s for b, s in secs.items()},
                               "ratio_to_plain": {str(b): r for b, r in ratio.items()}})
        print(f"{m:5d} {n:6d} {batch:5d} "
              + " ".join(f"{1e3 * secs[b]:8.2f}ms" for b in blocks) + "   "
              + " ".join(f"{ratio[b]:.3f}" for b in blocks), flush=True)
        write_json(a.out, report)

    for m in sides:
        for aspect in (float(v) for v in a.aspects.split(",")):
            n = int(round(m * aspect))
            per = ns_flops(m, n, 5, symmetric_blocks=1)
            for batch in ([int(v) for v in a.batches.split(",")] if a.batches
                          else [max(1, int(budget // per))]):
                row(m, n, batch)
    report["seconds"] = time.perf_counter() - t0
    write_json(a.out, report)
    return report


def check_tiles(jax, jnp, muon_jax, sides) -> list[dict]:
    """The symmetric-tile kernel against XLA's full product (f32 out, relative max error on
    the whole mirrored matrix), and Newton-Schulz with it against plain matmuls (relative
    Frobenius difference, next to plain bf16's own difference from float32 NS); then the
    product alone: seconds of the kernel and its mirror against one XLA matmul."""
    from bench_util import per_call_seconds

    from muon_jax.symmetric import symmetric_tiles_matmul

    rows = []
    for m in sides:
        for n, dt in ((m * 2, jnp.bfloat16), (m + 64, jnp.float16)):
            x = jax.random.normal(jax.random.key(m), (3, m, n), jnp.float32).astype(dt)
            got = jax.jit(lambda x: symmetric_tiles_matmul(
                x, x, preferred_element_type=jnp.float32))(x)
            want = jnp.matmul(x, jnp.swapaxes(x, -1, -2), preferred_element_type=jnp.float32)
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            g = x.astype(jnp.float32)
            f32 = muon_jax.orthogonalize(g, dtype=jnp.float32, symmetric_blocks=1)
            plain = jax.jit(lambda g: muon_jax.orthogonalize(g, symmetric_blocks=1))(g)
            tiles = jax.jit(lambda g: muon_jax.orthogonalize(g, symmetric_blocks="tiles"))(g)

            def rel(a, b):
                return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

            xb = x.astype(jnp.bfloat16)
            kern = jax.jit(lambda x: symmetric_tiles_matmul(x, x))
            xla = jax.jit(lambda x: jnp.matmul(x, jnp.swapaxes(x, -1, -2),
                                               preferred_element_type=jnp.float32
                                               ).astype(x.dtype))
            t_k = per_call_seconds(kern, (xb,), 2, 7)
            t_x = per_call_seconds(xla, (xb,), 2, 7)
            rows.append({"m": m, "n": n, "dtype": jnp.dtype(dt).name, "product_rel_max_err": err,
                         "ns_tiles_vs_plain": rel(tiles, plain), "ns_plain_vs_f32": rel(plain, f32),
                         "ns_tiles_vs_f32": rel(tiles, f32), "product_seconds_tiles": t_k,
                         "product_seconds_xla": t_x, "product_ratio": t_k / t_x})
            print(f"tiles check m {m} n {n} {jnp.dtype(dt).name}: product err {err:.1e}; NS "
                  f"tiles-plain {rows[-1]['ns_tiles_vs_plain']:.4f}, plain-f32 "
                  f"{rows[-1]['ns_plain_vs_f32']:.4f}, tiles-f32 {rows[-1]['ns_tiles_vs_f32']:.4f};"
                  f" X X^T {1e3 * t_k:.3f} ms vs XLA {1e3 * t_x:.3f} ms ({t_k / t_x:.3f})",
                  flush=True)
    return rows


if __name__ == "__main__":
    main()
