"""FP8 quantization passes of the expert GEMMs' operands: XLA against the one-pass kernels.

The FP8 expert GEMMs read e4m3 operands with one power-of-two scale per row. Each row is
quantized (row maximum, scale, cast) before its GEMM: ``x`` and ``dy`` as given, ``h = act(z)``
after the gate_up GEMM, ``dz = act'(z) dh`` in the backward. This script times each of those
passes in XLA (the ``*_reference`` functions of `accel_kernels.quant.api`, what the layer ran before
the kernels) and with the one-pass Pallas kernels of `accel_kernels.quant.api`, on random
(never zero)
inputs, medians after warm-up (each sample ten back-to-back calls). It also times the two ways
of making a weight-gradient operand's K-major FP8 copy: column-wise quantization of the bf16
rows (``quantize_cols_t``, two passes) and, what the layer does now, the e4m3 rows written
transposed with a power of two per row (``transpose_rows``, `moe.experts.fp8_gemm.scaled_t`: XLA's
rescale-and-transpose fusion, one byte read and written per element; measured with the
multipliers passed in, it was one kernel on an H200). It checks that both give the
same bytes, counts the kernels each compiled function launches, and reports the rate in GB/s of
the bytes a single pass must move (read the inputs once, write the outputs once), next to the
copy ceiling measured in the same run (``x -> x * 2`` in bf16).

Three cases compare several ways to the same bytes: a weight's two FP8 copies (the column
and row kernels apart, three reads of the weight, or `quantize_cols_t_and_rows`, two);
the FP8 dispatch's e4m3 GEMM rows when nothing is sent (wire rows written by
``gather_encode`` and read by ``gather_rows_quantized``, or one pass from the tokens,
``gather_local_rows_quantized``); the combine gradient's rows in the expert layout (gathered
and weighted in bf16, then ``quantize_rows``, or one pass, ``gather_weighted_rows_quantized``);
a weight-gradient operand's plain transpose (XLA's, or its rescaling transpose by
``2^-0``); and, on a GPU, each row kernel in XLA, Pallas Triton (`accel_kernels.quant.api`) and
Pallas Mosaic GPU (`accel_kernels.quant.mosaic`), the two gathers' Mosaic GPU twins
(`accel_kernels.wire.mosaic`), the token wire's kernels (gather + encode, gather + decode, gather +
re-quantize; ``wire_*``) and the weights' column (and row) tile passes in all three. Where bytes
differ from the first implementation, a row says how much (``agreement``: the activations'
``exp`` may round differently per backend).

Usage:
  python benchmarks/quant_bench.py --out quant.json     # one GPU
  python benchmarks/quant_bench.py --only 'weight|rows_' # some cases (a regex on the name)
  python benchmarks/quant_bench.py --small              # CPU plumbing check (interpret mode)
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_util  # noqa: E402

from accel_kernels.activations import GatedActivation  # noqa: E402
from accel_kernels.quant import triton as qt  # noqa: E402
from accel_kernels.quant import xla as qx  # noqa: E402
from accel_kernels.wire import api as wire_api  # noqa: E402
from accel_kernels.wire import triton as wire_triton  # noqa: E402
from moe.experts import fp8_gemm
from moe.experts.fp8_gemm import scaled_t  # noqa: E402


def kernels_launched(compiled) -> int:
    """Fusions, custom calls and other kernels in a compiled module's entry computation."""
    text = compiled.as_text()
    entry = text[text.index("ENTRY"):]
    body = entry[:entry.index("\n}")]
    return len(re.findall(r"\s(?:fusion|custom-call|convert|reduce|copy)\(", body))


def timed(fn, args, a, inner: int = 10) -> float:
    """Median seconds per call, each sample ``inner`` back-to-back calls (no launch gaps)."""
    def calls(*xs):
        return [fn(*xs) for _ in range(inner)]
    return bench_util.median_seconds(calls, args, a.warmup, a.iters)[0] / inner


def same_bytes(a, b) -> bool:
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        u, v = np.asarray(u), np.asarray(v)
        if u.dtype == jnp.float8_e4m3fn:
            u, v = u.view(np.uint8), v.view(np.uint8)
        if not np.array_equal(u, v, equal_nan=True):
            return False
    return True


def agreement(a, b) -> dict:
    """How far ``b`` is from ``a`` where the bytes differ: the fraction of e4m3 bytes that
    differ, the largest distance in e4m3 codes (adjacent values differ by 1), and the largest
    relative difference of any wider leaf (``dz`` in bf16, the scales)."""
    diff, codes, rel = 0.0, 0, 0.0
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        u, v = np.asarray(u), np.asarray(v)
        if u.dtype == jnp.float8_e4m3fn:
            bu, bv = u.view(np.uint8), v.view(np.uint8)
            diff = max(diff, float(np.mean(bu != bv)))
            sign = lambda c: np.where(c & 0x80, -(c & 0x7F).astype(np.int32),  # noqa: E731
                                      (c & 0x7F).astype(np.int32))
            codes = max(codes, int(np.max(np.abs(sign(bu) - sign(bv)), initial=0)))
        else:
            u, v = u.astype(np.float64), v.astype(np.float64)
            ok = np.isfinite(u) & np.isfinite(v)
            rel = max(rel, float(np.max(np.abs(u - v)[ok] / np.maximum(np.abs(u[ok]), 1e-30),
                                        initial=0.0)))
    return {"fp8_bytes_differing": diff, "max_e4m3_code_distance": codes,
            "max_rel_diff_wide": rel}


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))



DESCRIPTION = """\
The FP8 quantization passes of the expert GEMMs' operands (row quantize, gated activation +
quantize, weight copies, the wire's gather/encode/decode, transposes), XLA against the one-pass
Pallas Triton / Mosaic GPU kernels: ms, GB/s of the bytes one pass must move next to a copy
ceiling, kernels launched, same bytes as XLA. Default 32768 rows, d_model 4096, d_ff 2048, 8
experts (--small: CPU interpret mode, 256 rows, 256/128, 2). JSON (--out): copy_GBps, rows."""


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--rows", type=int, default=None, help="token rows (32768; --small 256)")
    p.add_argument("--d-model", type=int, default=None, help="4096 (--small 256)")
    p.add_argument("--d-ff", type=int, default=None, help="2048 (--small 128)")
    p.add_argument("--experts", type=int, default=None,
                   help="experts of the weight case (8; --small 2)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--only", default=None,
                   help="regex: run only the cases whose name matches (default: all)")
    a = p.parse_args(argv)
    small = {"rows": 256, "d_model": 256, "d_ff": 128, "experts": 2}
    full = {"rows": 32768, "d_model": 4096, "d_ff": 2048, "experts": 8}
    bench_util.fill_defaults(a, small=small, full=full)
    interpret = jax.default_backend() != "gpu"
    act = GatedActivation("silu")
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (a.rows, a.d_model), jnp.bfloat16)
    z = (jax.random.normal(k[1], (a.rows, 2 * a.d_ff), jnp.float32) * 2).astype(jnp.bfloat16)
    dh = jax.random.normal(k[2], (a.rows, a.d_ff), jnp.float32)
    xq = qx.quantize_rows_reference(x)[0]
    shift = jax.random.randint(k[2], (a.rows,), 0, 12)
    cases = {
        "quantize_rows": ((x,), qx.quantize_rows_reference,
                          lambda x: qt.quantize_rows(x, interpret=interpret)),
        "gated_quantize_rows": ((z,), lambda z: qx.gated_quantize_rows_reference(z, act),
                                lambda z: qt.gated_quantize_rows(z, act, interpret=interpret)),
        "gated_grad_quantize_rows": (
            (z, dh), lambda z, dh: qx.gated_grad_quantize_rows_reference(z, dh, act,
                                                                         jnp.bfloat16),
            lambda z, dh: qt.gated_grad_quantize_rows(z, dh, act, interpret=interpret)),
        "gated_grad_quantize_rows_fp8_only": (
            (z, dh), lambda z, dh: qx.gated_grad_quantize_rows_reference(z, dh, act, None),
            lambda z, dh: qt.gated_grad_quantize_rows(z, dh, act, out_dtype=None,
                                                      interpret=interpret)),
        # A weight-gradient operand, before: column-wise quantization of the bf16 rows into
        # the K-major copy (two passes); now: the e4m3 rows written transposed, each row times
        # a power of two (one pass over one byte per element).
        "quantize_cols_t": ((x,), lambda x: qx.quantize_cols_t_reference(x[None]),
                            lambda x: qt.quantize_cols_t(x[None], interpret=interpret)),
        "transpose_rows": ((xq, shift), scaled_t, None),
    }
    # Several implementations each, the first the reference whose bytes the others must give
    # ("same_bytes_as_first").
    t = a.rows // 2
    tokens = x[:t]
    slots = jax.random.permutation(k[0], a.rows)  # k = 2 slots per token, shuffled
    index = (slots // 2).astype(jnp.int32)
    slots = slots.astype(jnp.int32)
    wts = jax.random.uniform(k[2], (a.rows,), jnp.float32)
    w = jax.random.normal(k[1], (a.experts, a.d_model, 2 * a.d_ff), jnp.float32) * 0.02
    block = 128
    multi = {
        # A weight's two FP8 copies (forward: K-major per column; dgrad: per row).
        "weight_copies": ((w,), {
            "xla": qx.quantize_cols_t_and_rows_reference,
            "pallas_separate": lambda w: (qt.quantize_cols_t(w, interpret=interpret), jax.tree.map(
                lambda o: o.reshape(*w.shape[:-1], *o.shape[1:]),
                qt.quantize_rows(w.reshape(-1, w.shape[-1]), interpret=interpret))),
            "pallas": lambda w: qt.quantize_cols_t_and_rows(w, interpret=interpret)}),
        # FP8 dispatch with nothing sent: the GEMM's e4m3 rows from the tokens.
        "local_rows": ((tokens, index), {
            "xla": lambda x, i: fp8_gemm.rows_from_wire(wire_api.gather_rows(
                x, i, wire="fp8", block_size=block), x.shape[-1], block),
            "pallas_wire": lambda x, i: wire_triton.gather_rows_quantized(
                wire_triton.gather_encode(x, i, fp8_wire=True, block_size=block,
                                           interpret=interpret),
                jnp.arange(i.shape[0], dtype=jnp.int32), width=x.shape[-1],
                block_size=block, interpret=interpret),
            "pallas": lambda x, i: wire_triton.gather_local_rows_quantized(
                x, i, block_size=block, interpret=interpret)}),
        # The combine's gradient in the expert layout when nothing is sent, as the FP8
        # GEMMs read it: gathered and weighted (bf16), then quantized, or in one pass.
        "weighted_rows": ((tokens, wts, slots), {
            "xla": lambda g, w, s: fp8_gemm.rows(wire_api.gather_weighted_rows(
                g, w, s, top_k=2, wire=jnp.dtype(jnp.bfloat16), block_size=block)),
            "pallas": lambda g, w, s: wire_triton.gather_weighted_rows_quantized(
                g, w, s, top_k=2, interpret=interpret)}),
        # A weight-gradient operand that takes no rescaling: XLA's plain transpose, or the
        # rescaling transpose by 2^-0 (`moe.experts.fp8_gemm.wgrad_operands`).
        "transpose_plain": ((xq,), {
            "xla": lambda q: jnp.swapaxes(q, 0, 1),
            "xla_zero_shift": lambda q: scaled_t(q, jax.lax.optimization_barrier(
                jnp.zeros(q.shape[:1], jnp.int32)))}),
    }
    if not interpret:  # the row kernels in Triton and in Mosaic GPU (accel_kernels.quant.mosaic)
        from accel_kernels.quant import mosaic as qm
        from accel_kernels.wire import mosaic as wm
        multi["local_rows"][1]["mosaic"] = lambda x, i: wm.gather_local_rows_quantized(
            x, i, block_size=block)
        multi["weighted_rows"][1]["mosaic"] = lambda g, w, s: wm.gather_weighted_rows_quantized(
            g, w, s, top_k=2)
        multi["weight_copies"][1]["mosaic"] = qm.quantize_cols_t_and_rows
        # The token wire's kernels (accel_kernels.wire.mosaic): the send rows' gather + FP8
        # encode, and received FP8 rows gathered (two rows per token) and decoded, or
        # re-quantized per row.
        wire = wire_api.encode_rows(tokens, wire="fp8", block_size=block)
        h = tokens.shape[-1]

        def decode_xla(b, i, dtype):
            return wire_api.decode_rows(jnp.take(b, i, axis=0, mode="fill", fill_value=0),
                                          wire="fp8", width=h, block_size=block, out_dtype=dtype)

        for name, args, xla_fn, kernel in (
                ("wire_encode", (tokens, index),
                 lambda x, i: wire_api.gather_rows(x, i, wire="fp8", block_size=block),
                 lambda m: functools.partial(m.gather_encode, fp8_wire=True, block_size=block)),
                ("wire_encode_bf16", (tokens, index),
                 lambda x, i: wire_api.gather_rows(x, i, wire=jnp.dtype(jnp.bfloat16),
                                                     block_size=block),
                 lambda m: functools.partial(m.gather_encode, fp8_wire=False,
                                             block_size=block, out_dtype=jnp.bfloat16)),
                ("wire_decode", (wire, index), lambda b, i: decode_xla(b, i, jnp.bfloat16),
                 lambda m: functools.partial(m.gather_decode, width=h, fp8_wire=True,
                                             block_size=block)),
                ("wire_rows", (wire, index),
                 lambda b, i: qx.quantize_rows_reference(decode_xla(b, i, jnp.float32)),
                 lambda m: functools.partial(m.gather_rows_quantized, width=h,
                                             block_size=block))):
            multi[name] = (args, {"xla": xla_fn, "triton": kernel(wire_triton),
                                  "mosaic": kernel(wm)})
        multi["weight_cols_t"] = ((w,), {"xla": qx.quantize_cols_t_reference,
                                         "triton": qt.quantize_cols_t,
                                         "mosaic": qm.quantize_cols_t})
        for name, ref_fn, triton_fn, mosaic_fn, args in (
                ("rows_x", qx.quantize_rows_reference, qt.quantize_rows, qm.quantize_rows,
                 (x,)),
                ("rows_gated", lambda z: qx.gated_quantize_rows_reference(z, act),
                 lambda z: qt.gated_quantize_rows(z, act),
                 lambda z: qm.gated_quantize_rows(z, act), (z,)),
                ("rows_gated_grad",
                 lambda z, dh: qx.gated_grad_quantize_rows_reference(z, dh, act, jnp.bfloat16),
                 lambda z, dh: qt.gated_grad_quantize_rows(z, dh, act),
                 lambda z, dh: qm.gated_grad_quantize_rows(z, dh, act), (z, dh)),
                ("rows_gated_grad_fp8_only",
                 lambda z, dh: qx.gated_grad_quantize_rows_reference(z, dh, act, None),
                 lambda z, dh: qt.gated_grad_quantize_rows(z, dh, act, out_dtype=None),
                 lambda z, dh: qm.gated_grad_quantize_rows(z, dh, act, out_dtype=None),
                 (z, dh))):
            multi[name] = (args, {"xla": ref_fn, "triton": triton_fn, "mosaic": mosaic_fn})
    if a.only:
        cases = {n: c for n, c in cases.items() if re.search(a.only, n)}
        multi = {n: c for n, c in multi.items() if re.search(a.only, n)}
    report = {"benchmark": "quant", "env": bench_util.env_info(), "out": a.out,
              "settings": vars(a) | {"interpret": interpret}, "rows": []}
    copy = jax.jit(lambda x: x * 2).lower(x).compile()
    sec = timed(copy, (x,), a)
    report["copy_GBps"] = 2 * nbytes(x) / sec / 1e9
    print(f"copy ceiling: {report['copy_GBps']:.0f} GB/s", flush=True)
    for name, (args, ref_fn, kern_fn) in cases.items():
        outs = {}
        for impl, fn in (("xla", ref_fn), ("pallas", kern_fn)):
            if fn is None:
                continue
            compiled = jax.jit(fn).lower(*args).compile()
            out = jax.block_until_ready(compiled(*args))
            sec = timed(compiled, args, a)
            outs[impl] = out
            moved = nbytes(args) + nbytes(out)
            row = {"case": name, "impl": impl, "ms": sec * 1e3, "one_pass_bytes": moved,
                   "GBps": moved / sec / 1e9, "kernels": kernels_launched(compiled)}
            report["rows"].append(row)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
        if len(outs) < 2:
            continue
        same = same_bytes(outs["xla"][-2:], outs["pallas"][-2:])  # the FP8 payload and scales
        report["rows"][-1]["same_fp8_bytes_as_xla"] = same
        print(f"  {name}: same FP8 bytes as XLA: {same}", flush=True)
        bench_util.write_json(a.out, report)
    for name, (args, impls) in multi.items():
        ref = None
        for impl, fn in impls.items():
            try:
                compiled = jax.jit(fn).lower(*args).compile()
                out = jax.block_until_ready(compiled(*args))
            except Exception as err:  # noqa: BLE001 - record and go on
                report["rows"].append({"case": name, "impl": impl, "error": repr(err)[:2000]})
                print(f"{name} {impl}: {err!r}"[:2000], flush=True)
                continue
            sec = timed(compiled, args, a)
            moved = nbytes(args) + nbytes(out)
            row = {"case": name, "impl": impl, "ms": sec * 1e3, "one_pass_bytes": moved,
                   "GBps": moved / sec / 1e9, "kernels": kernels_launched(compiled)}
            if ref is None:
                ref = out
            else:
                row["same_bytes_as_first"] = same_bytes(ref, out)
                if not row["same_bytes_as_first"]:
                    row |= agreement(ref, out)
            report["rows"].append(row)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
        bench_util.write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
