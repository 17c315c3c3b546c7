"""Are dispatch and combine right, and how fast do they move tokens between the GPUs?

``moe.dispatch`` -> experts -> ``moe.combine``, expert parallel over all devices (a 1-D 'expert'
mesh). ``--part check`` (default): :func:`checks` (the dropless and ragged transports against
the dense one, bf16 and FP8 wires, balanced and skewed routing, through experts that scale each
row by its expert id so misrouting shows), :func:`timings` per transport and wire (GB/s per GPU
of the (P-1)/P of the payload that leaves it), the all_to_all alone, and :func:`ab`: dense
dispatch with the bf16 and the FP8 wire timed interleaved, the FP8 / bf16 headline. ``--part
layer``: dispatch -> combine on the layer benchmark's tokens, router and routings.

    python3 benchmarks/dispatch.py --out dispatch.json     # 2+ GPUs (one GPU sends nothing)
    python3 benchmarks/dispatch.py --small [--part layer]  # CPU, 2 simulated devices

JSON: ``checks``, ``timings``, ``all_to_all``, ``dispatch_ab`` and :func:`main_check`'s summary
keys; ``--part layer``: ``dispatch_combine``, ``dispatch_combine_ab`` and ``routing``.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from _lib import bench
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe
from accel_kernels import fp8
from moe.dispatch import collectives
from xla_comm import hlo

MEASURES = ("moe/", "accel_kernels/")
AXIS = "expert"
EXCHANGES = ("all-to-all", "ragged-all-to-all")


def parse_args(argv=None):
    p = bench.parser(__doc__)
    p.add_argument("--part", choices=("check", "layer"), default="check")
    p.add_argument("--tokens", type=int, help="tokens per device (16384; small 64)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--check-tokens", type=int, help="tokens per device of the checks (2048)")
    p.add_argument("--ab-rounds", type=int, help="interleaved rounds of the A/B (60; small 5)")
    p.add_argument("--routing", default="balanced,zipf", help="--part layer")
    return bench.parse(p, argv, small=dict(tokens=64, d_model=256, fp8_block_size=32,
                                           check_tokens=32, ab_rounds=5),
                       full=dict(tokens=16384, d_model=4096, fp8_block_size=128,
                                 check_tokens=2048, ab_rounds=60))


def inputs(mesh, tokens, a, seed):
    """Random tokens, distinct top-k expert ids from random logits, their softmax weights and
    a cotangent, ``tokens`` per device, sharded over the expert axis: ``(x, ids, w, ct)``."""
    ks, n = jax.random.split(jax.random.key(seed), 3), mesh.devices.size

    def make():
        x = bench.normal(ks[0], (n * tokens, a.d_model))
        w, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (n * tokens, a.experts))),
                               a.top_k)
        return x, ids.astype(jnp.int32), w, bench.normal(ks[2], (n * tokens, a.d_model))

    return jax.jit(make, out_shardings=(NamedSharding(mesh, P(AXIS)),) * 4)()


def scale_experts(ex, sizes, experts):
    """'Experts' that scale each row by (1 + its global expert id) / E, so misrouting shows."""
    el = sizes.shape[0]
    first = jax.lax.axis_index(AXIS) * el
    if ex.ndim == 3:
        return ex * ((1.0 + first + jnp.arange(el)) / experts)[:, None, None].astype(ex.dtype)
    row_e = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(ex.shape[0]), side="right")
    return ex * ((1.0 + first + jnp.minimum(row_e, el - 1)) / experts)[:, None].astype(ex.dtype)


def pipeline(mesh, spec, a, *, transport, wire, cf=None, impl="auto", scale=False, kernels="auto"):
    """Jitted ``disp(x, ids)``, ``fwd(x, ids, w)``, ``full(...) -> (y, expert_x, sizes,
    dropped)``, ``grad(x, ids, w, ct) -> (dx, dw)`` and ``bucket(x, ids)`` (dropless)."""
    def disp(x, ids):
        return moe.dispatch(x, ids, num_experts=a.experts, axis_name=AXIS, transport=transport,
                            capacity_factor=cf, dispatch_dtype=wire, wire_implementation=kernels,
                            block_size=a.fp8_block_size, exchange_implementation=impl)

    def local(x, ids, w):
        ex, sizes, plan = disp(x, ids)
        ey = scale_experts(ex, sizes, a.experts) if scale else ex
        return moe.combine(ey, w, plan, combine_grad_dtype=wire), ex, sizes, plan.dropped[None]

    def smap(fn, n_in, n_out=1):
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * n_in,
                             out_specs=spec if n_out == 1 else (spec,) * n_out)

    f = smap(lambda x, ids, w: local(x, ids, w)[0], 3)
    grad = jax.grad(lambda x, ids, w, ct: jnp.sum(f(x, ids, w).astype(jnp.float32)
                                                  * ct.astype(jnp.float32)), argnums=(0, 2))
    bucket = smap(lambda x, ids: disp(x, ids)[2].bucket[None], 2)
    return SimpleNamespace(disp=jax.jit(smap(lambda x, ids: disp(x, ids)[0], 2)), fwd=jax.jit(f),
                           full=jax.jit(smap(local, 3, 4)), grad=jax.jit(grad),
                           bucket=jax.jit(bucket))


def payload_bytes(lowered, branch: int | None = None) -> int:
    """Bytes of the payload exchanges (arrays of 2+ dims; the 1-D count exchange left out) of
    a lowered program; ``branch``: only that ``lax.switch`` branch's (the dropless bucket)."""
    text = hlo.hlo_text(lowered)
    total = 0
    for c in hlo.analyze_collectives(lowered).of_kind(*EXCHANGES):
        line = next((ln for ln in text.splitlines() if f"{c.name} =" in ln), "")
        b = re.search(r"/branch_(\d+)_fun/", line)
        if branch is not None and b and int(b.group(1)) != branch:
            continue
        total += sum(hlo.array_nbytes(dt, s) for dt, s in zip(c.dtypes, c.shapes, strict=True)
                     if len(s) >= 2)
    return total


def checks(a, mesh, native: bool) -> dict:
    """Every transport against the dense one: expert inputs, group sizes, outputs, gradients;
    the dropless and native ragged exchanges bit for bit with the emulated one."""
    x, ids, w, ct = inputs(mesh, a.check_tokens, a, a.seed + 1)
    el = a.experts // mesh.devices.size
    skewed = jax.jit(lambda i: (i % el).at[:, 1:].set((i[:, :1] % el + jnp.arange(
        1, a.top_k)) % el) if el >= a.top_k else i, out_shardings=ids.sharding)(ids)
    cases = [("dense", "emulated"), ("dropless", "emulated"), ("ragged", "emulated")] + (
        [("ragged", "native")] if native else [])
    built = {(w, t, i): pipeline(mesh, P(AXIS), a, transport=t, wire=w, impl=i, scale=True)
             for w in ("bf16", "fp8") for t, i in cases}
    results = {}
    for routing, route in (("balanced", ids), ("skewed", skewed)):
        for wire in ("bf16", "fp8"):
            outs = {}
            for t, impl in cases:
                fns = built[(wire, t, impl)]
                y, ex, sizes, dropped = fns.full(x, route, w)
                dx, dw = fns.grad(x, route, w, ct)
                outs[(t, impl)] = dict(y=y, ex=ex, sizes=sizes, dx=dx, dw=dw,
                                       dropped=int(dropped.sum()))
            results.update(compare(outs, wire, routing))
    print(f"checks: {sum(r['ok'] for r in results.values())}/{len(results)} OK"
          + ("" if native else f" (no native ragged_all_to_all on {jax.default_backend()})"))
    return results


def compare(outs, wire, routing) -> dict:
    ref, emu, res = outs[("dense", "emulated")], outs[("ragged", "emulated")], {}
    for key, o in outs.items():
        if key == ("dense", "emulated"):
            continue
        err = {k: float(jnp.max(jnp.abs(o[k].astype(jnp.float32) - ref[k].astype(jnp.float32))))
               for k in ("y", "dx", "dw")}
        ok = o["dropped"] == 0 and np.array_equal(o["sizes"], ref["sizes"]) and all(
            v <= 1e-3 * float(jnp.max(jnp.abs(ref[k].astype(jnp.float32))))
            for k, v in err.items())
        bitwise = None
        if key != ("ragged", "emulated"):  # the same data movement as the emulation
            bitwise = all(np.array_equal(np.asarray(o[k], np.float32),
                                         np.asarray(emu[k], np.float32))
                          for k in ("ex", "sizes", "y", "dx", "dw"))
            ok = ok and bitwise
        name = f"{key[0]}[{key[1] if key[0] == 'ragged' else 'all_to_all'}] vs dense, " \
               f"wire={wire}, {routing}"
        res[name] = dict(ok=bool(ok), max_abs_err=err, bitwise_equal_emulated_ragged=bitwise)
    return res


def timings(a, mesh, native: bool) -> list[dict]:
    """Dispatch alone, dispatch -> combine fwd and fwd + bwd, bytes and GB/s, per pair."""
    x, ids, w, ct = inputs(mesh, a.tokens, a, a.seed)
    n, rows = mesh.devices.size, []
    for transport in ("dense", "dropless", "ragged"):
        for wire in ("bf16", "fp8"):
            fns = pipeline(mesh, P(AXIS), a, transport=transport, wire=wire,
                           cf=a.capacity_factor if transport == "dense" else None,
                           impl="native" if native else "emulated")
            branch = int(np.max(fns.bucket(x, ids))) if transport == "dropless" else None
            disp_b = payload_bytes(fns.disp.lower(x, ids), branch)
            fwd_b = payload_bytes(fns.fwd.lower(x, ids, w), branch)
            t = {k: bench.median_seconds(f, args, a.warmup, a.iters) for k, f, args in (
                ("disp", fns.disp, (x, ids)), ("fwd", fns.fwd, (x, ids, w)),
                ("grad", fns.grad, (x, ids, w, ct)))}
            rows.append(dict(
                transport=transport, wire=wire, dispatch_fwd_ms=t["disp"] * 1e3,
                fwd_ms=t["fwd"] * 1e3, fwd_bwd_ms=t["grad"] * 1e3,
                dispatch_payload_mb=disp_b / 2**20,
                dispatch_GBps_remote=(n - 1) / n * disp_b / t["disp"] / 1e9,
                fwd_GBps_remote=(n - 1) / n * fwd_b / t["fwd"] / 1e9))
    bench.print_table(rows, list(rows[0]))
    return rows


def all_to_all(a, mesh) -> dict:
    """The dense payload all_to_all alone: E*C rows per device of bf16 (2d bytes) and of FP8
    wire rows (d bytes of e4m3 + the packed E8M0 scales)."""
    n = mesh.devices.size
    c = math.ceil(a.capacity_factor * a.tokens * a.top_k / a.experts)
    out = {}
    for wire, width in (("bf16", 2 * a.d_model),
                        ("fp8", a.d_model + 4 * fp8.num_scale_words(a.d_model, a.fp8_block_size))):
        rows = a.experts * c
        buf = jax.jit(lambda rows=rows, width=width: jnp.ones((n * rows, width), jnp.uint8),
                      out_shardings=NamedSharding(mesh, P(AXIS)))()
        f = jax.jit(jax.shard_map(lambda b: collectives.dense_exchange(b, AXIS), mesh=mesh,
                                  in_specs=P(AXIS), out_specs=P(AXIS)))
        sec = bench.median_seconds(f, (buf,), a.warmup, a.iters)
        out[wire] = {"ms": sec * 1e3, "buffer_mb": rows * width / 2**20,
                     "GBps_remote": (n - 1) / n * rows * width / sec / 1e9}
    print(f"all_to_all alone: {out}")
    return out


def ab(a, mesh) -> dict:
    """Dense dispatch, bf16 against FP8 wire, timed interleaved, per wire path."""
    x, ids, _, _ = inputs(mesh, a.tokens, a, a.seed)
    out = {}
    for config in ("auto", "xla"):
        fns = {w: pipeline(mesh, P(AXIS), a, transport="dense", wire=w, cf=a.capacity_factor,
                           kernels=config).disp for w in ("bf16", "fp8")}
        t = bench.interleaved({w: (lambda f=f: f(x, ids)) for w, f in fns.items()},
                              a.ab_rounds, warmup=a.warmup)
        med = bench.medians(t)
        out[config] = dict(rounds=a.ab_rounds, bf16_ms=med["bf16"] * 1e3, fp8_ms=med["fp8"] * 1e3,
                           ratio_of_medians=med["fp8"] / med["bf16"])
        print(f"A/B dense dispatch, wire kernels {config}: FP8 / bf16 "
              f"{out[config]['ratio_of_medians']:.3f}", flush=True)
    return out


def main_check(a, mesh) -> dict:
    native = collectives.resolve_ragged_impl("auto") == "native"
    report = {"benchmark": "dispatch", "env": bench.env(), "settings": bench.settings(a)}
    report["checks"] = checks(a, mesh, native)
    report["timings"] = timings(a, mesh, native)
    report["all_to_all"] = all_to_all(a, mesh)
    report["dispatch_ab"] = ab(a, mesh)
    tm = {(r["transport"], r["wire"]): r for r in report["timings"]}
    report.update(
        fp8_over_bf16_dispatch_time=report["dispatch_ab"]["auto"]["ratio_of_medians"],
        fp8_over_bf16_dispatch_time_xla_wire=report["dispatch_ab"]["xla"]["ratio_of_medians"],
        dispatch_combine_GBps_per_gpu=tm[("dense", "bf16")]["fwd_GBps_remote"],
        fp8_over_bf16_ragged_dispatch_time=(tm[("ragged", "fp8")]["dispatch_fwd_ms"]
                                            / tm[("ragged", "bf16")]["dispatch_fwd_ms"]))
    bench.write_json(a.out, report)
    if not all(c["ok"] for c in report["checks"].values()):
        raise SystemExit("a check FAILED: " + ", ".join(
            k for k, c in report["checks"].items() if not c["ok"]))
    return report


def main_layer(a, mesh) -> dict:
    """Dispatch -> combine on the layer benchmark's data and routings."""
    report = {"benchmark": "dispatch_layer", "env": bench.env(), "settings": bench.settings(a)}
    data = bench.layer_data(mesh, a.tokens, a.d_model, a.experts, None, a.seed)
    biases, report["routing"] = bench.routings(data, a.experts, a.top_k, a.routing.split(","))
    spec = P(tuple(mesh.axis_names))
    sh = NamedSharding(mesh, spec)
    x = jax.device_put(data["x"].reshape(-1, a.d_model), sh)
    ct = jax.device_put(data["ct"].reshape(-1, a.d_model), sh)
    cfg = moe.RouterConfig(a.experts, a.top_k)
    rows, steps = [], {}
    for routing, bias in biases.items():
        r = jax.jit(lambda x, b: moe.route(x, data["router_kernel"], b, config=cfg))(
            x, jnp.asarray(bias))
        ids, w = jax.device_put(r.expert_ids.astype(jnp.int32), sh), jax.device_put(r.weights, sh)
        for t, wire in (("dense", "bf16"), ("dense", "fp8"), ("dropless", "bf16"),
                        ("ragged", "bf16")):
            if routing != "balanced" and wire != "bf16":
                continue
            fns = pipeline(mesh, spec, a, transport=t, wire=wire,
                           cf=a.capacity_factor if t == "dense" else None)
            args = (x, ids, w, ct)
            fwd_s = bench.median_seconds(fns.fwd, args[:3], a.warmup, a.iters, 10)
            bwd_s = bench.median_seconds(fns.grad, args, a.warmup, a.iters, 10)
            steps[(t, wire, routing)] = (fns.grad, args)
            rows.append(dict(transport=t, wire=wire, routing=routing, fwd_ms=fwd_s * 1e3,
                             fwd_bwd_ms=bwd_s * 1e3))
    report["dispatch_combine"] = rows
    report["dispatch_combine_ab"] = layer_ab(a, steps, biases)
    bench.print_table(rows, list(rows[0]))
    bench.write_json(a.out, report)
    return report


def layer_ab(a, steps, biases) -> dict:
    out = {}
    for routing in biases:
        pair = {t: steps.get((t, "bf16", routing)) for t in ("dense", "dropless")}
        if None in pair.values():
            continue
        t = bench.medians(bench.interleaved({k: (lambda f=f, x=x: f(*x)) for k, (f, x) in
                                             pair.items()}, max(3, 2 * a.iters), inner=10))
        out[routing] = dict(dense_ms=t["dense"] * 1e3, dropless_ms=t["dropless"] * 1e3,
                            ratio_of_medians=t["dropless"] / t["dense"])
    return out


def main(argv=None) -> dict:
    a = parse_args(argv)
    n = len(jax.devices())
    if a.experts % n:
        raise SystemExit(f"--experts {a.experts} must be a multiple of the {n} devices")
    if a.part == "layer":
        return main_layer(a, bench.line_mesh())
    return main_check(a, jax.sharding.Mesh(np.array(jax.devices()), (AXIS,)))


if __name__ == "__main__":
    main()
