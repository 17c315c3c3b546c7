"""The MoE layer called eagerly (outside any jit) against the same layer under nnx.jit.

Times ``y, aux = layer(x)`` as a user's script would call it: the first eager call (which
compiles the layer's functional core), the next ones (medians), and the same call inside
``nnx.jit`` after its own compilation. The layer compiles itself once per options, mesh and
shapes (`moe.module`), so the second eager call should be within 3x the jitted one.

Usage:
  python benchmarks/eager_layer.py --out eager.json        # this machine's devices
  python benchmarks/eager_layer.py --small                  # CPU, 8 simulated devices
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))



DESCRIPTION = """\
Times the MoE layer (moe.MoE) called eagerly, outside any jit, as a user script would: the
first call (it compiles the layer's functional core), the median of the next --iters, and the
same call under nnx.jit. Default 8192 tokens, d_model 1024, d_ff 512, 16 experts on a GPU (CPU
or --small, 8 simulated devices: 128 tokens, 64/32, 8 experts). JSON (--out, none by default):
first_eager_s, eager_s, jit_first_s, jit_s, eager_over_jit (target <= 3)."""


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CPU, 8 simulated devices")
    p.add_argument("--tokens", type=int, default=None, help="batch x seq (128; GPU 8192)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import bench_util

    if a.small:
        bench_util.force_cpu_devices(8)
    import jax
    from flax import nnx

    import moe

    tokens = a.tokens or (128 if a.small or jax.default_backend() == "cpu" else 8192)
    d, f, e = (64, 32, 8) if tokens <= 1024 else (1024, 512, 16)
    mesh = jax.make_mesh((1, jax.device_count()), ("data", "expert"))
    layer = moe.MoE(d, f, options=moe.MoEOptions.create(e, 2), mesh=mesh, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (jax.device_count(), tokens // jax.device_count(), d))

    def timed(fn):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        return time.perf_counter() - t0

    first = timed(layer)
    eager = statistics.median(timed(layer) for _ in range(a.iters))
    jitted = nnx.jit(lambda m, x: m(x))
    jit_first = timed(lambda x: jitted(layer, x))
    jit = statistics.median(timed(lambda x: jitted(layer, x)) for _ in range(a.iters))
    report = {"benchmark": "eager_layer", "env": bench_util.env_info(), "tokens": tokens,
              "d_model": d, "d_ff": f, "experts": e, "first_eager_s": first,
              "eager_s": eager, "jit_first_s": jit_first, "jit_s": jit,
              "eager_over_jit": eager / jit, "target": "eager_over_jit <= 3"}
    bench_util.write_json(a.out, report)
    print(f"first eager call {first:.3f} s, then {eager * 1e3:.2f} ms; nnx.jit {jit * 1e3:.2f} ms "
          f"(first {jit_first:.3f} s): eager / jit = {eager / jit:.2f}")
    return report


if __name__ == "__main__":
    main()
