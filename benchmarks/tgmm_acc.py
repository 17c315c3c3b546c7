"""The weight-gradient kernel adding an existing output (``tgmm(acc=...)``): checked and timed.

The pipelined MoE layer's chunks chain their expert banks so that, in the backward, one
chunk's weight-gradient GEMMs start from the next chunk's result instead of XLA adding the
two banks (`moe.experts.vjp.experts_chained`). This script checks that on the device it runs
on (the Mosaic GPU kernel on a Hopper GPU, its XLA emulation elsewhere):

- ``kernel``: ``tgmm(a, b, gs, acc=acc)`` against ``acc + a_g^T b_g`` computed in f32 by XLA,
  for a bf16 output and an FP8 (scaled) one, with an empty group (which must return ``acc``);
  relative RMS error and the empty group's exactness;
- ``timing``: at the chunk-cost layer's banks (4 experts, ``[2048, 2048]`` and
  ``[1024, 2048]``, one chunk's 8192 rows), the median seconds of ``tgmm`` alone, ``tgmm``
  then an XLA add of ``acc``, and ``tgmm(acc=)`` (interleaved rounds);
- ``layer``: the MoE layer's gradients with 2 chunks (chained) against 1 chunk (relative RMS
  error per leaf, bf16).

Usage:
  python benchmarks/tgmm_acc.py --out OUT/tgmm_acc.json       # GPU
  python benchmarks/tgmm_acc.py --small                       # CPU (emulation), small shapes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_util import interleaved_seconds  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe  # noqa: E402
from accel_kernels.gmm import mosaic  # noqa: E402


def _rel_rms(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2)) / max(np.sqrt(np.mean(want ** 2)), 1e-30))


def _reference(a, b, sizes, acc, scales=None):
    """``acc + a_g^T b_g`` (times the scales) in f32 by XLA, group by group."""
    out, start = [], 0
    for n in sizes:
        prod = jnp.einsum("rk,rn->kn", a[start:start + n].astype(jnp.float32),
                          b[start:start + n].astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
        if scales is not None:
            prod = prod * scales[0][:, None] * scales[1][None, :]
        out.append(prod)
        start += n
    return jnp.stack(out) + acc.astype(jnp.float32)


def kernel_check(rows: int, n1: int, n2: int) -> dict:
    """bf16 and FP8-scaled ``tgmm(acc=)`` against the f32 reference; groups of ``rows / 2``,
    0 and ``rows / 2`` rows."""
    k = jax.random.split(jax.random.key(0), 5)
    sizes = (rows // 2, 0, rows // 2)
    gs = jnp.asarray(sizes, jnp.int32)
    a = jax.random.normal(k[0], (rows, n1), jnp.float32)
    b = jax.random.normal(k[1], (rows, n2), jnp.float32)
    acc = (jax.random.normal(k[2], (3, n1, n2)) * 8).astype(jnp.bfloat16)
    out = {}
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    got = jax.jit(lambda a, b, gs, acc: mosaic.tgmm(a, b, gs, k_major=False,
                                                    out_dtype=jnp.bfloat16, acc=acc))(
        a16, b16, gs, acc)
    out["bf16"] = {"rel_rms": _rel_rms(got, _reference(a16, b16, sizes, acc)),
                   "empty_group_exact": bool(jnp.all(got[1] == acc[1]))}
    a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
    s_a = jax.random.uniform(k[3], (n1,), minval=0.5, maxval=2.0)
    s_b = jax.random.uniform(k[4], (n2,), minval=0.5, maxval=2.0)
    got = jax.jit(lambda a, b, gs, s_a, s_b, acc: mosaic.tgmm(
        a.T, b.T, gs, s_a, s_b, k_major=True, out_dtype=jnp.bfloat16, acc=acc))(
        a8, b8, gs, s_a, s_b, acc)
    out["fp8"] = {"rel_rms": _rel_rms(got, _reference(a8, b8, sizes, acc, (s_a, s_b))),
                  "empty_group_exact": bool(jnp.all(got[1] == acc[1]))}
    return out


def timing(experts: int, rows: int, banks: dict[str, tuple[int, int]], rounds: int) -> dict:
    """Median seconds of ``tgmm``, ``tgmm`` + add and ``tgmm(acc=)`` per bank shape."""
    out = {}
    for name, (n1, n2) in banks.items():
        k = jax.random.split(jax.random.key(1), 3)
        a = jax.random.normal(k[0], (rows, n1), jnp.bfloat16)
        b = jax.random.normal(k[1], (rows, n2), jnp.bfloat16)
        acc = jax.random.normal(k[2], (experts, n1, n2), jnp.bfloat16)
        gs = jnp.full((experts,), rows // experts, jnp.int32)

        def plain(a, b, gs):
            return mosaic.tgmm(a, b, gs, k_major=False, out_dtype=jnp.bfloat16)

        fns = {"tgmm": jax.jit(plain),
               "tgmm_then_add": jax.jit(lambda a, b, gs, acc: plain(a, b, gs) + acc),
               "tgmm_acc": jax.jit(lambda a, b, gs, acc: mosaic.tgmm(
                   a, b, gs, k_major=False, out_dtype=jnp.bfloat16, acc=acc))}
        args = {"tgmm": (a, b, gs), "tgmm_then_add": (a, b, gs, acc),
                "tgmm_acc": (a, b, gs, acc)}
        for key, fn in fns.items():
            jax.block_until_ready(fn(*args[key]))
        times = interleaved_seconds({key: (lambda f=fn, x=args[key]: f(*x))
                                     for key, fn in fns.items()}, rounds)
        med = {key: float(np.median(v)) for key, v in times.items()}
        out[name] = {"shape": [experts, n1, n2], "rows": rows,
                     "us": {key: v * 1e6 for key, v in med.items()},
                     "acc_over_then_add": med["tgmm_acc"] / med["tgmm_then_add"],
                     "acc_over_tgmm": med["tgmm_acc"] / med["tgmm"]}
    return out


def layer_check(tokens: int, d: int, f: int, experts: int) -> dict:
    """The layer's gradients with 2 chunks (chained banks) against 1 chunk, at EP=1."""
    mesh = jax.make_mesh((1, 1), ("data", "expert"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    k = jax.random.split(jax.random.key(2), 5)
    args = (jax.random.normal(k[0], (1, tokens, d), jnp.bfloat16),
            jax.random.normal(k[1], (d, experts), jnp.float32),
            (jax.random.normal(k[2], (experts, d, 2 * f)) * 0.02).astype(jnp.bfloat16),
            (jax.random.normal(k[3], (experts, f, d)) * 0.02).astype(jnp.bfloat16),
            jax.random.normal(k[4], (1, tokens, d), jnp.float32))
    args = jax.device_put(args, NamedSharding(mesh, P()))
    grads = {}
    for c in (1, 2):
        o = moe.MoEOptions.create(experts, 2, dispatch_dtype="fp8", overlap_chunks=c)

        def loss(x, router, wgu, wd, ct, o=o):
            y, _ = moe.moe_apply(x, router, wgu, wd, options=o, mesh=mesh)
            return jnp.sum(y.astype(jnp.float32) * ct)

        grads[c] = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    names = ("x", "router", "w_gate_up", "w_down")
    return {n: _rel_rms(g2, g1) for n, g2, g1 in zip(names, grads[2], grads[1], strict=True)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="CPU-sized shapes")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    if a.small:
        kshape, rows, banks, layer = (256, 128, 256), 512, {"small": (128, 256)}, (256, 128, 64)
    else:  # the chunk-cost layer: 8192 tokens, top-2, 2 chunks -> 8192 rows per chunk
        kshape, rows = (1024, 256, 512), 8192
        banks, layer = {"gate_up": (2048, 2048), "down": (1024, 2048)}, (8192, 2048, 1024)
    report = {"benchmark": "tgmm_acc",
              "env": {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                      "jax": jax.__version__},
              "kernel": kernel_check(*kshape),
              "timing": timing(4, rows, banks, a.rounds),
              "layer_2_chunks_vs_1_rel_rms": layer_check(*layer, 4)}
    report["seconds"] = time.perf_counter() - t0
    print(json.dumps({k: report[k] for k in ("kernel", "layer_2_chunks_vs_1_rel_rms")}, indent=1))
    for name, t in report["timing"].items():
        print(f"{name} {t['shape']}: " + ", ".join(f"{k} {v:.1f} us" for k, v in t["us"].items())
              + f"; acc / (tgmm + add) {t['acc_over_then_add']:.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
