"""The ``phases`` part of benchmarks/dispatch_bench.py (a library, no command line).

Each phase of expert-parallel dispatch / combine (dense transport; and dropless) timed alone,
its own ``jax.jit(jax.shard_map(...))`` fed the real intermediate arrays of the phase before:
plan, quantize, gather, all_to_all, recv, combine, backward, whole, dropless, and the
split-axis layout experiment (see benchmarks/dispatch_bench.py's ``--part phases --help``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _dispatch_harness import (
    AXIS,
    Phases,
    finish,
    make_inputs,
    make_mesh,
    rebuild_plan,
    smap,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accel_kernels import fp8
from accel_kernels.wire import api as wire_api
from accel_kernels.wire import triton as wire_triton
from moe.dispatch import collectives, combine, dispatch
from moe.dispatch.movement import back_row, sum_slots
from moe.dispatch.plan import dropless_buckets
from moe.dispatch.plan_build import dense_plan


def old_plan(ids, kw):
    """The previous plan: stable key/index argsort, rank by gathers, row scatter (dense)."""
    t, k = ids.shape
    s, e, c = t * k, kw["num_experts"], kw["capacity"]
    flat = ids.reshape(s).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(s, dtype=jnp.int32) - starts[flat[order]]
    row_sorted = jnp.where(rank < c, flat[order] * c + rank, e * c)
    slot_row = jnp.zeros((s,), jnp.int32).at[order].set(row_sorted)
    r = jnp.arange(c, dtype=jnp.int32)[None, :]
    src = jnp.minimum(starts[:, None] + r, s - 1)
    send_slot = jnp.where(r < counts[:, None], order[src], s).reshape(e * c)
    recv = jax.lax.all_to_all(counts, AXIS, 0, 0, tiled=True)
    return send_slot, slot_row.reshape(t, k), recv


def onehot_plan(ids, kw):
    """Sort-free alternative: rank = exclusive cumsum of the one-hot [E, S] along S; the rows
    by arithmetic; each row's slot by one scatter (dense)."""
    t, k = ids.shape
    s, e, c = t * k, kw["num_experts"], kw["capacity"]
    flat = ids.reshape(s).astype(jnp.int32)
    onehot = (jnp.arange(e, dtype=jnp.int32)[:, None] == flat[None, :]).astype(jnp.int32)
    csum = jnp.cumsum(onehot, axis=1)
    counts = csum[:, -1]
    rank = jnp.sum(csum * onehot, axis=0) - 1
    slot_row = jnp.where(rank < c, flat * c + rank, e * c)
    send_slot = jnp.full((e * c,), s, jnp.int32).at[slot_row].set(
        jnp.arange(s, dtype=jnp.int32), mode="drop", unique_indices=True)
    recv = jax.lax.all_to_all(counts, AXIS, 0, 0, tiled=True)
    return send_slot, slot_row.reshape(t, k), recv


def plan_phases(ph: Phases, ids):
    """The plan: the library's, the previous one and a sort-free one (checked equal)."""
    t, k, d, e, c, el, bs, n_rows, fp8_row, n_dev = ph.dims
    mesh, kw, bench, call = ph.mesh, ph.kw, ph.bench, ph.call
    plan_fn = smap(mesh, lambda ids: (lambda pl: (pl.send_slot, pl.slot_row))(
        dense_plan(ids, **kw)), 1, (P(AXIS), P(AXIS)))
    bench("plan (packed-key sort)", "plan", "-", plan_fn, (ids,))
    bench("plan before (stable argsort)", "plan", "-",
          smap(mesh, lambda ids: old_plan(ids, kw), 1, (P(AXIS), P(AXIS), P(AXIS))), (ids,))
    bench("alt: plan by one-hot cumsum (no sort)", "plan", "-",
          smap(mesh, lambda ids: onehot_plan(ids, kw), 1, (P(AXIS), P(AXIS), P(AXIS))), (ids,))
    send_slot, slot_row = call("plan (packed-key sort)", "-", plan_fn, ids)
    for name, fn, row in (("before", old_plan, "plan before (stable argsort)"),
                          ("onehot", onehot_plan, "alt: plan by one-hot cumsum (no sort)")):
        ref = call(row, "-", smap(mesh, lambda ids, fn=fn: fn(ids, kw), 1,
                                  (P(AXIS), P(AXIS), P(AXIS))), ids)
        same = bool(np.array_equal(np.asarray(ref[0]), np.asarray(send_slot))
                    and np.array_equal(np.asarray(ref[1]), np.asarray(slot_row)))
        ph.report["derived"][f"plan_{name}_equals_library"] = same
    kept_slots = int(np.sum(np.asarray(slot_row) < n_rows))
    ph.report["derived"]["kept_slots_per_device"] = kept_slots / n_dev
    return send_slot, slot_row


def gather_phases(ph: Phases, x, send_slot):
    """Quantize the T tokens once, then build the send buffer (bf16 rows, FP8 words)."""
    t, k, d, e, c, el, bs, n_rows, fp8_row, n_dev = ph.dims
    mesh, bench, call = ph.mesh, ph.bench, ph.call
    enc = smap(mesh, lambda x: wire_api.encode_rows(x, wire="fp8", block_size=bs), 1)
    bench("quantize T tokens -> e4m3+scales", "quantize", "fp8", enc, (x,))
    xq = call("quantize T tokens -> e4m3+scales", "fp8", enc, x)


    def gather(rows, send_slot):
        return jnp.take(rows, send_slot // k, axis=0, mode="fill", fill_value=0)

    g = smap(mesh, gather, 2)
    bench("gather send buffer (bf16 rows)", "gather", "bf16", g, (x, send_slot))
    bench("gather send buffer (fp8 words)", "gather", "fp8", g, (xq, send_slot))
    xq8 = jax.jit(lambda q: jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(
        q.shape[0], -1))(xq)  # the same bytes as uint8 (the wire's element type before)
    bench("before: gather send buffer (fp8 as uint8)", "gather", "fp8", g, (xq8, send_slot))
    bench("alt: gather bf16 then quantize E*C rows", "gather", "fp8",
          smap(mesh, lambda x, s: wire_api.encode_rows(gather(x, s), wire="fp8",
                                                          block_size=bs), 2),
          (x, send_slot))
    bench("quantize T + gather bytes (library)", "gather", "fp8",
          smap(mesh, lambda x, s: wire_api.gather_rows(x, s // k, wire="fp8",
                                                         block_size=bs), 2), (x, send_slot))

    def amax_fused(x, s):
        tok = s // k
        r = jnp.take(x, tok, axis=0, mode="fill", fill_value=0)
        amax = jnp.take(fp8.block_amax(x, bs), tok, axis=0, mode="fill", fill_value=0)
        return wire_api.pack_fp8_words(fp8.quantize_with_amax(r, amax, bs))

    bench("alt: amax of T rows + gather-quantize fused", "gather", "fp8",
          smap(mesh, amax_fused, 2), (x, send_slot), note="padding rows: scale byte 1, not 0")
    for wire in ("bf16", "fp8"):  # the Pallas kernel: gather + encode in one pass
        codec = "fp8" if wire == "fp8" else jnp.dtype(jnp.bfloat16)
        kern = smap(mesh, lambda x, s, codec=codec: wire_api.gather_rows(
            x, s // k, wire=codec, block_size=bs, kernels="auto"), 2)
        bench("gather+encode, one pass (pallas kernel)", "gather", wire, kern, (x, send_slot))
        lib = smap(mesh, lambda x, s, codec=codec: wire_api.gather_rows(
            x, s // k, wire=codec, block_size=bs, kernels="xla"), 2)
        ph.report["derived"][f"pallas_gather_encode_equals_xla_{wire}"] = bool(jnp.all(
            call("gather+encode, one pass (pallas kernel)", wire, kern, x, send_slot)
            == lib(x, send_slot)))
    send_bf16 = call("gather send buffer (bf16 rows)", "bf16", g, x, send_slot)
    send_fp8 = call("gather send buffer (fp8 words)", "fp8", g, xq, send_slot)
    return send_bf16, send_fp8


def exchange_phases(ph: Phases, send_bf16, send_fp8):
    """The all_to_all alone, bf16 and FP8 payloads."""
    t, k, d, e, c, el, bs, n_rows, fp8_row, n_dev = ph.dims
    mesh, bench, call = ph.mesh, ph.bench, ph.call
    bf16_buf, fp8_buf, dp_bf16, dp_fp8 = ph.buffers
    a2a = smap(mesh, lambda b: collectives.dense_exchange(b, AXIS), 1)
    bench("all_to_all alone", "all_to_all", "bf16", a2a, (send_bf16,),
          buffer_bytes=bf16_buf, deepep_bytes=dp_bf16)
    bench("all_to_all alone", "all_to_all", "fp8", a2a, (send_fp8,),
          buffer_bytes=fp8_buf, deepep_bytes=dp_fp8)
    send_fp8_u8 = jax.jit(lambda q: jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(
        q.shape[0], -1))(send_fp8)
    bench("before: all_to_all alone (fp8 as uint8)", "all_to_all", "fp8", a2a, (send_fp8_u8,),
          buffer_bytes=fp8_buf, deepep_bytes=dp_fp8)
    del send_fp8_u8
    recv_bf16 = call("all_to_all alone", "bf16", a2a, send_bf16)
    recv_fp8 = call("all_to_all alone", "fp8", a2a, send_fp8)
    return recv_bf16, recv_fp8


def recv_phases(ph: Phases, recv_bf16, recv_fp8):
    """Received buffer -> expert layout (transpose; FP8: dequantize too)."""
    t, k, d, e, c, el, bs, n_rows, fp8_row, n_dev = ph.dims
    mesh, bench, call = ph.mesh, ph.bench, ph.call
    def to_layout(r):
        return r.reshape(n_dev, el, c, -1).transpose(1, 0, 2, 3).reshape(el, n_dev * c, -1)

    bench("recv -> expert layout (transpose)", "recv", "bf16", smap(mesh, to_layout, 1),
          (recv_bf16,))
    deq = smap(mesh, lambda r: to_layout(wire_api.decode_rows(
        r, wire="fp8", width=d, block_size=bs, out_dtype=jnp.bfloat16)), 1)
    bench("dequantize -> expert layout", "recv", "fp8", deq, (recv_fp8,))
    bench("dequantize only (no layout)", "recv", "fp8", smap(mesh, lambda r: (
        wire_api.decode_rows(r, wire="fp8", width=d, block_size=bs, out_dtype=jnp.bfloat16)), 1),
        (recv_fp8,))
    # the Pallas kernel: expert-layout row (l, q, r) read from received row (q, l, r), decoded
    perm = (jnp.arange(n_dev)[None, :, None] * (el * c) + jnp.arange(el)[:, None, None] * c
            + jnp.arange(c)[None, None, :]).reshape(-1).astype(jnp.int32)
    for wire, recv in (("bf16", recv_bf16), ("fp8", recv_fp8)):
        kern = smap(mesh, lambda r, wire=wire: wire_triton.gather_decode(
            r, perm, width=d, fp8_wire=wire == "fp8", block_size=bs, out_dtype=jnp.bfloat16,
            interpret=jax.default_backend() == "cpu").reshape(el, n_dev * c, d), 1)
        bench("decode -> expert layout, one pass (pallas kernel)", "recv", wire, kern, (recv,))
        ref = (smap(mesh, to_layout, 1) if wire == "bf16" else deq)(recv)
        got = call("decode -> expert layout, one pass (pallas kernel)", wire, kern, recv)
        ph.report["derived"][f"pallas_decode_equals_xla_{wire}"] = bool(jnp.all(
            (got == ref) | (jnp.isnan(got) & jnp.isnan(ref))))
    expert_x = call("recv -> expert layout (transpose)", "bf16", smap(mesh, to_layout, 1),
                    recv_bf16)
    return expert_x


def combine_phases(ph: Phases, expert_x, back, send_slot, slot_row, w):
    """The bf16 all_to_all back and the un-permute + weight + sum over k."""
    t, k, d, e, c, el, bs, n_rows, fp8_row, n_dev = ph.dims
    mesh, kw, bench = ph.mesh, ph.kw, ph.bench
    bf16_buf, fp8_buf, dp_bf16, dp_fp8 = ph.buffers
    def send_layout(ey):
        return ey.reshape(el, n_dev, c, d).transpose(1, 0, 2, 3).reshape(-1, d)

    bench("before: expert layout -> send layout (transpose)", "combine", "bf16",
          smap(mesh, send_layout, 1), (expert_x,))
    bench("before: transpose + all_to_all back", "combine", "bf16",
          smap(mesh, lambda ey: collectives.dense_exchange(send_layout(ey), AXIS), 1),
          (expert_x,), buffer_bytes=bf16_buf)
    bench("all_to_all back, split on the layout's axis 1 (library)", "combine", "bf16",
          smap(mesh, lambda ey: jax.lax.all_to_all(ey, AXIS, 1, 1, tiled=True), 1),
          (expert_x,), buffer_bytes=bf16_buf)

    def unpermute(back, send_slot, slot_row, w):
        plan = rebuild_plan(send_slot, slot_row, kw)
        return sum_slots(back, lambda j: back_row(plan, j), plan.top_k,
                          w.astype(jnp.float32)).astype(jnp.bfloat16)

    bench("un-permute + weight + sum_k (fused)", "combine", "bf16",
          smap(mesh, unpermute, 4), (back, send_slot, slot_row, w))

    def unpermute_old(back, slot_row, w):
        slots = jnp.take(back, slot_row.reshape(-1), axis=0, mode="fill", fill_value=0)
        slots = slots.reshape(t, k, d)
        y = jnp.einsum("tk,tkd->td", w.astype(jnp.float32), slots.astype(jnp.float32))
        return y.astype(jnp.bfloat16)

    bench("before: gather [T,k,d] + einsum", "combine", "bf16",
          smap(mesh, unpermute_old, 3), (back, slot_row, w))


def backward_phases(ph: Phases, back, dy, w, send_slot, slot_row):
    """Combine's gradient send buffer and the router gradient."""
    t, k, d, e, c, el, bs, n_rows, fp8_row, n_dev = ph.dims
    mesh, kw, bench, call = ph.mesh, ph.kw, ph.bench, ph.call
    for wire in ("bf16", "fp8"):
        codec = "fp8" if wire == "fp8" else jnp.dtype(jnp.bfloat16)

        def grad_send(dy, w, send_slot, codec=codec):
            return wire_api.gather_weighted_rows(dy, w.reshape(-1), send_slot, top_k=k,
                                                   wire=codec, block_size=bs)

        def grad_send_before(dy, w, send_slot, codec=codec):
            g = (w.astype(jnp.float32)[:, :, None]
                 * dy.astype(jnp.float32)[:, None, :]).reshape(-1, d)
            return wire_api.gather_rows(g, send_slot, wire=codec, block_size=bs)

        sec = bench("combine-grad send buffer (w*dy in the gather)", "backward", wire,
                    smap(mesh, grad_send, 3), (dy, w, send_slot))
        bench("before: w*dy [T*k,d], encode, gather", "backward", wire,
              smap(mesh, grad_send_before, 3), (dy, w, send_slot))
        if sec is not None and wire == "fp8":
            same = np.array_equal(
                np.asarray(call("combine-grad send buffer (w*dy in the gather)", wire,
                                smap(mesh, grad_send, 3), dy, w, send_slot)),
                np.asarray(call("before: w*dy [T*k,d], encode, gather", wire,
                                smap(mesh, grad_send_before, 3), dy, w, send_slot)))
            ph.report["derived"]["fp8_grad_send_bytes_equal_before"] = bool(same)

    def router_grad(back, send_slot, slot_row, dy):
        plan = rebuild_plan(send_slot, slot_row, kw)
        dy32 = dy.astype(jnp.float32)
        return jnp.stack([jnp.sum(dy32 * jnp.take(back, slot_row[:, j], axis=0, mode="fill",
                                                  fill_value=0).astype(jnp.float32), -1)
                          for j in range(plan.top_k)], axis=1)

    bench("router grad <dy, slot rows>", "backward", "bf16",
          smap(mesh, router_grad, 4), (back, send_slot, slot_row, dy))


def whole_phases(ph: Phases, x, ids, w, dy) -> dict:
    """Public dispatch / combine, fwd and fwd+bwd, Pallas and XLA wire paths; seconds by key."""
    t, k, d, e, c, el, bs, n_rows, fp8_row, n_dev = ph.dims
    mesh, bench = ph.mesh, ph.bench
    bf16_buf, fp8_buf, dp_bf16, dp_fp8 = ph.buffers
    cf = ph.a.capacity_factor
    res = {}
    for kernels in ("auto", "xla"):
        tag = "" if kernels == "auto" else " [xla wire]"
        for wire in ("bf16", "fp8"):
            buf = bf16_buf if wire == "bf16" else fp8_buf
            dp = dp_bf16 if wire == "bf16" else dp_fp8

            def disp(x, ids, wire=wire, kernels=kernels):
                return dispatch(x, ids, num_experts=e, axis_name=AXIS, transport="dense",
                                capacity_factor=cf, dispatch_dtype=wire, block_size=bs,
                                wire_kernels=kernels)[0]

            sec = bench("dispatch (public API -> expert_x)" + tag, "whole", wire,
                        smap(mesh, disp, 2), (x, ids), buffer_bytes=buf, deepep_bytes=dp)
            res[("dispatch" + tag, wire)] = sec

            def dc(x, ids, w, wire=wire, barrier=False, kernels=kernels):
                ex, _, plan = dispatch(x, ids, num_experts=e, axis_name=AXIS,
                                       transport="dense", capacity_factor=cf,
                                       dispatch_dtype=wire, block_size=bs,
                                       wire_kernels=kernels)
                if barrier:
                    ex = jax.lax.optimization_barrier(ex)
                return combine(ex, w, plan, combine_grad_dtype=wire)

            both = buf + bf16_buf  # dispatch payload + bf16 return
            res[("dc" + tag, wire)] = bench(
                "dispatch+combine fwd (identity experts)" + tag, "whole", wire,
                smap(mesh, dc, 3), (x, ids, w), buffer_bytes=both, deepep_bytes=dp + dp_bf16)
            if kernels == "xla":
                continue
            bench("dispatch+combine fwd (expert_x materialized)", "whole", wire,
                  smap(mesh, lambda x, ids, w, wire=wire: dc(x, ids, w, wire, True), 3),
                  (x, ids, w), buffer_bytes=both, deepep_bytes=dp + dp_bf16)
            fdc = jax.shard_map(dc, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))
            grad = jax.jit(jax.grad(lambda x, ids, w, dy, fdc=fdc: jnp.sum(
                fdc(x, ids, w).astype(jnp.float32) * dy.astype(jnp.float32)), argnums=(0, 2)))
            bench("dispatch+combine fwd+bwd", "whole", wire, grad, (x, ids, w, dy),
                  buffer_bytes=2 * both, deepep_bytes=2 * (dp + dp_bf16),
                  note="4 all_to_alls: dispatch, return, grad dispatch (wire), grad return "
                       "(bf16)")
    return res


def dropless_phases(ph: Phases, x, ids, w, dy, res: dict) -> None:
    """The same for transport='dropless' (bucketed all_to_all); adds to ``res``."""
    t, k, d, e, c, el, bs, n_rows, fp8_row, n_dev = ph.dims
    mesh, bench = ph.mesh, ph.bench
    bf16_buf, fp8_buf, dp_bf16, dp_fp8 = ph.buffers
    cf = ph.a.capacity_factor
    for wire in ("bf16", "fp8"):
        def ddisp(x, ids, wire=wire):
            return dispatch(x, ids, num_experts=e, axis_name=AXIS, transport="dropless",
                            capacity_factor=cf, dispatch_dtype=wire, block_size=bs)

        bucket = smap(mesh, lambda x, ids: ddisp(x, ids)[2].bucket[None], 2)(x, ids)
        rows_c = dropless_buckets(t, k, e, n_dev, cf)[int(np.max(np.asarray(bucket)))]
        buf = n_dev * rows_c * (2 * d if wire == "bf16" else fp8_row)
        ph.report["derived"][f"dropless_bucket_rows_{wire}"] = rows_c
        res[("dropless dispatch", wire)] = bench(
            "dropless dispatch (public API -> expert_x)", "dropless", wire,
            smap(mesh, lambda x, ids, f=ddisp: f(x, ids)[0], 2), (x, ids), buffer_bytes=buf,
            deepep_bytes=dp_bf16 if wire == "bf16" else dp_fp8)

        def ddc(x, ids, w, f=ddisp, wire=wire):
            ex, _, plan = f(x, ids)
            return combine(jax.lax.optimization_barrier(ex), w, plan, combine_grad_dtype=wire)

        both = buf + n_dev * rows_c * 2 * d
        bench("dropless dispatch+combine fwd (materialized)", "dropless", wire,
              smap(mesh, ddc, 3), (x, ids, w), buffer_bytes=both)
        fddc = jax.shard_map(ddc, mesh=mesh, in_specs=(P(AXIS),) * 3, out_specs=P(AXIS))
        bench("dropless dispatch+combine fwd+bwd", "dropless", wire,
              jax.jit(jax.grad(lambda x, ids, w, dy, f=fddc: jnp.sum(
                  f(x, ids, w).astype(jnp.float32) * dy.astype(jnp.float32)), argnums=(0, 2))),
              (x, ids, w, dy), buffer_bytes=2 * both)


def layout_experiment(ph: Phases, x, ids, w) -> None:
    """Split-axis-1 exchanges vs the library on a pipeline with small dot experts."""
    t, k, d, e, c, el, bs, n_rows, fp8_row, n_dev = ph.dims
    mesh, kw, bench, call = ph.mesh, ph.kw, ph.bench, ph.call
    bf16_buf, fp8_buf, dp_bf16, dp_fp8 = ph.buffers
    # XLA:GPU lays an all-to-all out with its split axis major, so the send gather can write
    # that layout and a consumer that accepts it, e.g. a dot, may skip the transpose copy.
    cf, f_mid = ph.a.capacity_factor, 128
    kw1, kw2 = jax.random.split(jax.random.key(ph.a.seed + 1))
    w_in = jax.device_put(
        jax.random.normal(kw1, (e, d, f_mid), jnp.float32).astype(jnp.bfloat16) * d**-0.5,
        NamedSharding(mesh, P(AXIS)))
    w_out = jax.device_put(
        jax.random.normal(kw2, (e, f_mid, d), jnp.float32).astype(jnp.bfloat16) * f_mid**-0.5,
        NamedSharding(mesh, P(AXIS)))

    def experts(ex, w_in, w_out):
        h = jnp.einsum("ecd,edf->ecf", ex, w_in)
        return jnp.einsum("ecf,efd->ecd", h, w_out)

    for wire in ("bf16", "fp8"):
        def lib(x, ids, w, w_in, w_out, wire=wire):
            ex, _, plan = dispatch(x, ids, num_experts=e, axis_name=AXIS, transport="dense",
                                   capacity_factor=cf, dispatch_dtype=wire, block_size=bs)
            return combine(experts(ex, w_in, w_out), w, plan)

        def alt(x, ids, w, w_in, w_out, wire=wire):
            plan = dense_plan(ids, **kw)
            idx = (plan.send_slot // k).reshape(n_dev, el, c).transpose(1, 0, 2)
            idx = idx.reshape(el, n_dev * c)
            rows = x if wire == "bf16" else wire_api.encode_rows(x, wire="fp8",
                                                                   block_size=bs)
            send = jnp.take(rows, idx, axis=0, mode="fill", fill_value=0)  # [el, P*C, W]
            recv = jax.lax.all_to_all(send, AXIS, 1, 1, tiled=True)
            ex = recv if wire == "bf16" else wire_api.decode_rows(
                recv, wire="fp8", width=d, block_size=bs, out_dtype=jnp.bfloat16)
            back = jax.lax.all_to_all(experts(ex, w_in, w_out), AXIS, 1, 1, tiled=True)
            sr = plan.slot_row  # e * C + r, or E * C if dropped
            ge, r = sr // c, sr % c
            li = jnp.where(sr < n_rows, ge % el, el)  # out of range -> fill 0
            col = (ge // el) * c + r
            y = None
            for j in range(k):
                term = back.at[li[:, j], col[:, j]].get(mode="fill", fill_value=0)
                term = w[:, j, None] * term.astype(jnp.float32)
                y = term if y is None else y + term
            return y.astype(jnp.bfloat16)

        both = (bf16_buf if wire == "bf16" else fp8_buf) + bf16_buf
        args = (x, ids, w, w_in, w_out)
        bench("dispatch+dot experts+combine (library)", "layout", wire, smap(mesh, lib, 5),
              args, buffer_bytes=both)
        bench("same, split-axis-1 exchanges (experiment)", "layout", wire,
              smap(mesh, alt, 5), args, buffer_bytes=both)
        if wire == "bf16":
            y_lib = call("dispatch+dot experts+combine (library)", wire,
                         smap(mesh, lib, 5), *args).astype(jnp.float32)
            y_alt = call("same, split-axis-1 exchanges (experiment)", wire,
                         smap(mesh, alt, 5), *args).astype(jnp.float32)
            ph.report["derived"]["split_axis_experiment_max_abs_diff"] = float(
                jnp.max(jnp.abs(y_lib - y_alt)))


def run_phases(a) -> dict:
    """Every phase in order; the report with its summary (``finish``)."""
    mesh = make_mesh()
    n_dev = mesh.devices.size
    if a.experts % n_dev:
        raise SystemExit(f"--experts {a.experts} must be a multiple of the {n_dev} devices")
    if a.d_model % a.block_size:
        raise SystemExit(f"--d-model must be a multiple of --block-size = {a.block_size}")
    x, ids, w, dy = make_inputs(mesh, a.tokens, a.d_model, a.experts, a.top_k, a.seed)
    ph = Phases(a, mesh, ids)
    send_slot, slot_row = plan_phases(ph, ids)
    send_bf16, send_fp8 = gather_phases(ph, x, send_slot)
    recv_bf16, recv_fp8 = exchange_phases(ph, send_bf16, send_fp8)
    expert_x = recv_phases(ph, recv_bf16, recv_fp8)
    back = recv_bf16  # same shape/dtype as the combine all_to_all's result
    combine_phases(ph, expert_x, back, send_slot, slot_row, w)
    backward_phases(ph, back, dy, w, send_slot, slot_row)
    res = whole_phases(ph, x, ids, w, dy)
    dropless_phases(ph, x, ids, w, dy, res)
    if not a.no_experiment:
        layout_experiment(ph, x, ids, w)
    return finish(ph.report, res)


