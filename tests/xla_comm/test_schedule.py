"""xla_comm.schedule: the replayed schedule counts exposed communication in time.

HLO text fixtures in the form XLA:GPU prints scheduled modules (async start/done pairs, the
generic async-start wrapping, cuBLAS and Mosaic GPU custom calls, fusions, loops and
conditionals), checked against hand-computed times; then a compiled CPU program end to end.
"""

import jax
import jax.numpy as jnp
import pytest

from xla_comm import costs, hlo, schedule

# 1 GFLOP/s, 2 for FP8, 1 GB/s of HBM (so 1 byte = 1 ns), 1 GB/s links; no fixed costs.
HW = schedule.Hardware(gemm_tflops=1e-3, fp8_gemm_tflops=2e-3, hbm_GBps=1.0, link_GBps=1.0,
                       inter_host_GBps=0.25, latency_us=0.0, launch_us=0.0)


def _module(body: str, params: str = "p: f32[1000], q: f32[1000]", n: int = 2) -> str:
    return f"""HloModule m, num_partitions={n}
ENTRY %main ({params}) -> f32[1000] {{
  %p = f32[1000]{{0}} parameter(0)
  %q = f32[1000]{{0}} parameter(1)
{body}
}}"""


def test_compute_between_start_and_done_hides_the_transfer():
    """An all-to-all of 4000 B over 2 devices sends 2000 B: 2 us at 1 GB/s. Two adds of 12000
    B (two operands, one result) take 12 us each, so one add hides it all."""
    text = _module("""
  %s = f32[1000]{0} all-to-all-start(%p), replica_groups={{0,1}}, dimensions={0}
  %a = f32[1000]{0} add(%q, %q)
  %d = f32[1000]{0} all-to-all-done(%s)
  ROOT %b = f32[1000]{0} add(%d, %a)""")
    rep = schedule.schedule_report(text, HW)
    (w,) = rep.windows
    assert (w.is_async, w.bytes_sent, w.ops, w.gemms) == (True, 2000.0, 1, 0)
    assert w.transfer_us == pytest.approx(2.0) and w.covered_us == pytest.approx(12.0)
    assert w.exposed_us == 0.0 and rep.exposed_fraction == 0.0
    assert rep.step_us == pytest.approx(24.0) and rep.compute_us == pytest.approx(24.0)


def test_nothing_between_start_and_done_is_all_exposed_and_sync_ones_are_too():
    text = _module("""
  %s = f32[1000]{0} all-gather-start(%p), replica_groups={{0,1}}, dimensions={0}
  %d = f32[1000]{0} all-gather-done(%s)
  %r = f32[1000]{0} all-reduce(%d), replica_groups={{0,1}}, to_apply=%add
  ROOT %b = f32[1000]{0} add(%r, %q)""")
    rep = schedule.schedule_report(text, HW)
    ag, ar = rep.windows
    assert (ag.kind, ag.exposed_us, ar.kind, ar.is_async) == ("all-gather", 2.0, "all-reduce",
                                                              False)
    assert ar.exposed_us == ar.transfer_us == pytest.approx(4.0)  # 2 (N-1)/N x 4000 B
    assert rep.exposed_fraction == 1.0 and rep.step_us == pytest.approx(2 + 4 + 12)


def test_the_floor_is_what_no_order_can_hide():
    """20 us of transfer against 1.2 us of compute: whatever the order, 18.8 us stay exposed."""
    text = """HloModule m, num_partitions=2
ENTRY %main (p: f32[10000], q: f32[100]) -> (f32[10000], f32[100]) {
  %p = f32[10000]{0} parameter(0)
  %q = f32[100]{0} parameter(1)
  %s = f32[10000]{0} all-to-all-start(%p), replica_groups={{0,1}}, dimensions={0}
  %a = f32[100]{0} add(%q, %q)
  %d = f32[10000]{0} all-to-all-done(%s)
  ROOT %t = (f32[10000]{0}, f32[100]{0}) tuple(%d, %a)
}"""
    rep = schedule.schedule_report(text, HW)
    assert rep.collective_us == pytest.approx(20.0) and rep.compute_us == pytest.approx(1.2)
    assert rep.exposed_floor_fraction == pytest.approx(18.8 / 20.0)
    assert rep.exposed_fraction >= rep.exposed_floor_fraction
    assert rep.summary()["exposed_floor_fraction"] == pytest.approx(0.94)


def test_collectives_share_one_stream():
    """Two transfers of 2 us started together under 3 us of compute: the second waits for
    the first (ends at 4 us), so 1 us of it is exposed though 3 us of compute sit in its
    window."""
    text = _module("""
  %s1 = f32[1000]{0} all-to-all-start(%p), replica_groups={{0,1}}, dimensions={0}
  %s2 = f32[1000]{0} all-to-all-start(%q), replica_groups={{0,1}}, dimensions={0}
  %n = f32[1000]{0} negate(%q)
  %d1 = f32[1000]{0} all-to-all-done(%s1)
  %d2 = f32[1000]{0} all-to-all-done(%s2)
  ROOT %b = f32[1000]{0} add(%d1, %d2)""")
    hw = schedule.Hardware(gemm_tflops=1e-3, fp8_gemm_tflops=2e-3, hbm_GBps=8000 / 3 / 1e3,
                           link_GBps=1.0, inter_host_GBps=1.0, latency_us=0.0,
                           launch_us=0.0)  # negate: 3 us
    w1, w2 = schedule.schedule_report(text, hw).windows
    assert w1.exposed_us == 0.0 and w2.covered_us == pytest.approx(3.0)
    assert w2.exposed_us == pytest.approx(1.0)


def _hosts_module(body: str) -> str:
    """16 devices, 2 hosts of 8 (`HW`'s devices_per_host): ``[2,8]<=[16]`` groups within a
    host, ``[8,2]<=[2,8]T(1,0)`` one device per host, ``[1,16]<=[16]`` both."""
    return f"""HloModule m, num_partitions=16
ENTRY %main (p: f32[1000], q: f32[1000]) -> f32[1000] {{
  %p = f32[1000]{{0}} parameter(0)
  %q = f32[1000]{{0}} parameter(1)
{body}
}}"""


INTRA, INTER, BOTH = ("replica_groups=[2,8]<=[16]", "replica_groups=[8,2]<=[2,8]T(1,0)",
                      "replica_groups=[1,16]<=[16]")


def test_a_collective_takes_the_links_its_group_reaches():
    c = hlo.Collective("a", "all-to-all", True, ("f32",), ((1000,),), 4000, 8, 3500.0, "main",
                       False)
    assert costs.collective_links(c, INTRA, 16, 8) == ("intra_host",)
    assert costs.collective_links(c, INTER, 16, 8) == ("inter_host",)
    assert costs.collective_links(c, BOTH, 16, 8) == ("intra_host", "inter_host")
    assert costs.collective_links(c, "replica_groups={{0},{1}}", 2, 8) == ()


def test_one_collective_in_flight_replays_on_one_stream():
    """Each -start after the previous -done (XLA's default of one collective in flight): the
    links change nothing, and the times are those of one communication stream. Across hosts
    (8 us: 2000 B at 0.25 GB/s) under one add (12 us), then a synchronous all-reduce within a
    host (7 us: 2 x 7/8 x 4000 B, all exposed), then an all-to-all over both hosts
    (max(1500 B / 1 GB/s, 2000 B / 0.25 GB/s) = 8 us) with nothing under it."""
    text = _hosts_module(f"""
  %s1 = f32[1000]{{0}} all-to-all-start(%p), {INTER}, dimensions={{0}}
  %a = f32[1000]{{0}} add(%q, %q)
  %d1 = f32[1000]{{0}} all-to-all-done(%s1)
  %r = f32[1000]{{0}} all-reduce(%d1), {INTRA}, to_apply=%add
  %s2 = f32[1000]{{0}} all-to-all-start(%r), {BOTH}, dimensions={{0}}
  %d2 = f32[1000]{{0}} all-to-all-done(%s2)
  ROOT %b = f32[1000]{{0}} add(%d2, %a)""")
    rep = schedule.schedule_report(text, HW)
    a2a, ar, both = rep.windows
    assert rep.max_in_flight == 1
    assert [w.links for w in rep.windows] == [("inter_host",), ("intra_host",),
                                              ("intra_host", "inter_host")]
    assert (a2a.transfer_us, a2a.covered_us, a2a.exposed_us) == pytest.approx((8.0, 12.0, 0.0))
    assert (ar.transfer_us, ar.exposed_us) == pytest.approx((7.0, 7.0))
    assert (both.transfer_us, both.exposed_us) == pytest.approx((8.0, 8.0))
    assert rep.step_us == pytest.approx(12 + 7 + 8 + 12)
    assert rep.exposed_fraction == pytest.approx(15.0 / 23.0)
    assert rep.link_us == pytest.approx({"inter_host": 16.0, "intra_host": 15.0})
    # One collective after another: 23 us of them, under 24 us of compute, could all hide.
    assert rep.exposed_floor_fraction == 0.0


def test_collectives_in_flight_together_overlap_only_on_different_links():
    """Two -starts before their -dones (as XLA schedules with several collectives in flight).
    Across hosts (8 us) beside within a host (3.5 us: 7/8 of 4000 B): both start at 0, and
    the second ends under the first. Two across hosts, or one over both hosts beside one
    within a host, share a link: the second starts when the first ends."""
    def pair(first, second):
        text = _hosts_module(f"""
  %s1 = f32[1000]{{0}} all-to-all-start(%p), {first}, dimensions={{0}}
  %s2 = f32[1000]{{0}} all-to-all-start(%q), {second}, dimensions={{0}}
  %d1 = f32[1000]{{0}} all-to-all-done(%s1)
  %d2 = f32[1000]{{0}} all-to-all-done(%s2)
  ROOT %b = f32[1000]{{0}} add(%d1, %d2)""")
        rep = schedule.schedule_report(text, HW)
        return rep, [(w.transfer_us, w.exposed_us) for w in rep.windows]

    rep, times = pair(INTER, INTRA)
    assert rep.max_in_flight == 2
    assert times == pytest.approx([(8.0, 8.0), (3.5, 0.0)])  # beside each other
    assert rep.step_us == pytest.approx(8.0 + 12.0)
    rep, times = pair(INTER, INTER)
    assert times == pytest.approx([(8.0, 8.0), (8.0, 8.0)])  # one after the other
    assert rep.step_us == pytest.approx(16.0 + 12.0)
    rep, times = pair(BOTH, INTRA)
    assert times == pytest.approx([(8.0, 8.0), (3.5, 3.5)])  # behind the one over both
    # The floor with two in flight: the busiest link's time (here 8 + 8 us across hosts, no
    # compute to hide it under) rather than every transfer one after another.
    rep, _ = pair(INTER, INTER)
    assert rep.exposed_floor_fraction == pytest.approx((16.0 - 12.0) / 16.0)
    rep, _ = pair(INTER, INTRA)
    assert rep.link_us == pytest.approx({"inter_host": 8.0, "intra_host": 3.5})
    assert rep.exposed_floor_fraction == pytest.approx(0.0)


def test_gemm_costs_flops_and_the_fp8_rate():
    """A [100, 50] x [50, 200] dot: 2 MFLOP, 2 ms at 1 GFLOP/s (its 70 KB take 70 us); as a cuBLAS
    custom call reading its dimensions from the backend config; as a Mosaic GPU grouped GEMM
    ([M, K] x [G, N, K]); and in FP8 at twice the rate."""
    mod = hlo.parse_hlo("""HloModule m
ENTRY %main (a: bf16[100,50], b: bf16[50,200], w: bf16[4,200,50], a8: f8e4m3fn[100,50], b8: f8e4m3fn[4,200,50], t: s32[8]) -> bf16[100,200] {
  %a = bf16[100,50]{1,0} parameter(0)
  %b = bf16[50,200]{1,0} parameter(1)
  %w = bf16[4,200,50]{2,1,0} parameter(2)
  %a8 = f8e4m3fn[100,50]{1,0} parameter(3)
  %b8 = f8e4m3fn[4,200,50]{2,1,0} parameter(4)
  %t = s32[8]{0} parameter(5)
  %dot = bf16[100,200]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %gemm = (bf16[100,200]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %gmm = bf16[100,200]{1,0} custom-call(%t, %a, %w), custom_call_target="mosaic_gpu_v2"
  %gmm8 = bf16[100,200]{1,0} custom-call(%t, %a8, %b8), custom_call_target="mosaic_gpu_v2"
  %quant = f8e4m3fn[100,50]{1,0} custom-call(%a), custom_call_target="mosaic_gpu_v2"
  ROOT %r = bf16[100,200]{1,0} add(%dot, %gmm)
}""")
    body = {i.name: i for i in mod.computations["main"]}
    flops = 2 * 100 * 200 * 50
    for name in ("dot", "gemm", "gmm"):
        f, _, fp8, gemm = schedule.op_cost(body[name], mod)
        assert (f, fp8, gemm) == (flops, False, True), name
    assert schedule.op_cost(body["gmm8"], mod)[:3:2] == (flops, True)
    assert schedule.op_cost(body["quant"], mod) == (0.0, 10000.0 + 5000.0, False, False)
    t = costs.instruction_cost(body["dot"], mod, body).time_us(HW)
    assert t == pytest.approx(max(flops / 1e3, (10000 + 20000 + 40000) / 1e3))


def test_grouped_gemms_cost_the_rows_the_routing_fills():
    """grouped_rows caps the token rows of Mosaic grouped GEMMs (gmm's M, tgmm's shared R):
    their kernels skip row tiles past each group's filled rows; other GEMMs are unaffected."""
    text = """HloModule m
ENTRY %main (a: bf16[100,50], w: bf16[4,200,50], c: bf16[100,200], b: bf16[50,200], t: s32[8]) -> bf16[100,200] {
  %a = bf16[100,50]{1,0} parameter(0)
  %w = bf16[4,200,50]{2,1,0} parameter(1)
  %c = bf16[100,200]{1,0} parameter(2)
  %b = bf16[50,200]{1,0} parameter(3)
  %t = s32[8]{0} parameter(4)
  %gmm = bf16[100,200]{1,0} custom-call(%t, %a, %w), custom_call_target="mosaic_gpu_v2"
  %tgmm = bf16[4,50,200]{2,1,0} custom-call(%t, %a, %c), custom_call_target="mosaic_gpu_v2"
  ROOT %dot = bf16[100,200]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}"""
    mod = hlo.parse_hlo(text)
    body = {i.name: i for i in mod.computations["main"]}
    flops = 2 * 100 * 200 * 50
    for name in ("gmm", "tgmm", "dot"):
        assert costs.instruction_cost(body[name], mod, body).flops == flops, name
    assert costs.instruction_cost(body["gmm"], mod, body, grouped_rows=25).flops == flops / 4
    assert costs.instruction_cost(body["tgmm"], mod, body, grouped_rows=25).flops == flops / 4
    assert costs.instruction_cost(body["gmm"], mod, body, grouped_rows=1000).flops == flops
    assert costs.instruction_cost(body["dot"], mod, body, grouped_rows=25).flops == flops
    hw = schedule.Hardware(gemm_tflops=1e-6, fp8_gemm_tflops=2e-6, hbm_GBps=1e6, link_GBps=1.0,
                           inter_host_GBps=1.0, launch_us=0.0)
    full = schedule.schedule_report(text, hw).compute_us  # 3 GEMMs of 2 MFLOP at 1 MFLOP/s
    capped = schedule.schedule_report(text, hw, grouped_rows=25).compute_us
    assert full == pytest.approx(3 * flops) and capped == pytest.approx(1.5 * flops)


def test_grouped_rows_by_named_scope():
    """A ``{scope: rows}`` mapping caps each grouped GEMM by the first scope its op_name
    holds ('' matches any): a local pass and the exchanged rest of a chunk each cost their
    share; a GEMM that no scope matches costs its static rows."""
    text = """HloModule m
ENTRY %main (a: bf16[100,50], w: bf16[4,200,50], t: s32[8]) -> bf16[100,200] {
  %a = bf16[100,50]{1,0} parameter(0)
  %w = bf16[4,200,50]{2,1,0} parameter(1)
  %t = s32[8]{0} parameter(2)
  %loc = bf16[100,200]{1,0} custom-call(%t, %a, %w), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/moe_chunk0/moe_local_first/gmm"}
  %rem = bf16[100,200]{1,0} custom-call(%t, %a, %w), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/moe_chunk0/gmm"}
  ROOT %next = bf16[100,200]{1,0} custom-call(%t, %a, %w), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/moe_chunk1/gmm"}
}"""
    mod = hlo.parse_hlo(text)
    body = {i.name: i for i in mod.computations["main"]}
    per_row = 2 * 200 * 50
    rows = {"moe_local_first": 10, "moe_chunk0/": 90, "": 100}
    got = {n: costs.instruction_cost(body[n], mod, body, grouped_rows=rows).flops
           for n in ("loc", "rem", "next")}
    assert got == {"loc": 10 * per_row, "rem": 90 * per_row, "next": 100 * per_row}
    only = {"moe_local_first": 10}  # no default: the others keep their static rows
    assert costs.instruction_cost(body["rem"], mod, body, grouped_rows=only).flops \
        == 100 * per_row


def test_batched_kernel_costs_its_product_and_the_tile_share_its_scope_names():
    """A custom call [B, M, K] x [B, N, K] -> [B, M, N] (the symmetric-tile kernel's form) is a
    GEMM of 2 B M N K FLOPs; under a tiles_W_of_T named scope, W / T of them; grouped_rows
    (token rows) does not cap it."""
    text = """HloModule m
ENTRY %main (u: f16[2,256,64], t: s32[3]) -> f32[2,256,256] {
  %u = f16[2,256,64]{2,1,0} parameter(0)
  %t = s32[3]{0} parameter(1)
  %full = f32[2,256,256]{2,1,0} custom-call(%t, %t, %u, %u), custom_call_target="mosaic_gpu_v2"
  ROOT %upper = f32[2,256,256]{2,1,0} custom-call(%t, %t, %u, %u), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/tiles_3_of_4/symmetric_upper_f16/mpmd_map"}
}"""
    mod = hlo.parse_hlo(text)
    body = {i.name: i for i in mod.computations["main"]}
    flops = 2 * 2 * 256 * 256 * 64
    full = costs.instruction_cost(body["full"], mod, body)
    assert (full.flops, full.gemm) == (flops, True)
    assert costs.instruction_cost(body["upper"], mod, body).flops == flops * 3 / 4
    assert costs.instruction_cost(body["full"], mod, body, grouped_rows=8).flops == flops
    assert costs.TILES_SCOPE.format(written=3, total=4) == "tiles_3_of_4"


def test_fusion_charges_its_dots_and_only_what_a_gather_reads():
    mod = hlo.parse_hlo("""HloModule m
%fused_gather (p0: f32[100000,10], p1: s32[50]) -> f32[50,10] {
  %p0 = f32[100000,10]{1,0} parameter(0)
  %p1 = s32[50]{0} parameter(1)
  ROOT %g = f32[50,10]{1,0} gather(%p0, %p1), offset_dims={1}, slice_sizes={1,10}
}
%fused_dot (p0: f32[64,32], p1: f32[32,16]) -> f32[64,16] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %p1 = f32[32,16]{1,0} parameter(1)
  %d = f32[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %e = f32[64,16]{1,0} exponential(%d)
}
ENTRY %main (t: f32[100000,10], i: s32[50], x: f32[64,32], w: f32[32,16]) -> f32[50,10] {
  %t = f32[100000,10]{1,0} parameter(0)
  %i = s32[50]{0} parameter(1)
  %x = f32[64,32]{1,0} parameter(2)
  %w = f32[32,16]{1,0} parameter(3)
  %f1 = f32[50,10]{1,0} fusion(%t, %i), kind=kLoop, calls=%fused_gather
  %f2 = f32[64,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  ROOT %r = f32[50,10]{1,0} copy(%f1)
}""")
    body = {i.name: i for i in mod.computations["main"]}
    # read: 2000 B of the table (not 4 MB), 200 B of indices; written 2000 B
    assert schedule.op_cost(body["f1"], mod) == (0.0, 4200.0, False, False)
    assert schedule.op_cost(body["f2"], mod)[0] == 2 * 64 * 16 * 32


def test_loops_conditionals_and_the_generic_async_form():
    """A loop body's all-to-all (generic async-start wrapping, known trip count 3) counts 3
    times; a conditional runs its first branch unless told otherwise (a boolean one: false)."""
    text = """HloModule m, num_partitions=2
%wrapped (a: f32[1000]) -> f32[1000] {
  %a = f32[1000]{0} parameter(0)
  ROOT %x = f32[1000]{0} all-to-all(%a), replica_groups={{0,1}}, dimensions={0}
}
%body (s: f32[1000]) -> f32[1000] {
  %s = f32[1000]{0} parameter(0)
  %st = ((f32[1000]{0}), f32[1000]{0}) async-start(%s), calls=%wrapped
  %dn = f32[1000]{0} async-done(%st)
  ROOT %o = f32[1000]{0} add(%dn, %s)
}
%cond (s: f32[1000]) -> pred[] {
  %s = f32[1000]{0} parameter(0)
  ROOT %c = pred[] constant(true)
}
%b0 (z: f32[1000]) -> f32[1000] {
  %z = f32[1000]{0} parameter(0)
  ROOT %n = f32[1000]{0} negate(%z)
}
%b1 (z: f32[1000]) -> f32[1000] {
  %z = f32[1000]{0} parameter(0)
  ROOT %r = f32[1000]{0} all-reduce(%z), replica_groups={{0,1}}, to_apply=%b0
}
ENTRY %main (p: f32[1000], i: s32[]) -> f32[1000] {
  %p = f32[1000]{0} parameter(0)
  %i = s32[] parameter(1)
  %w = f32[1000]{0} while(%p), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %k = f32[1000]{0} conditional(%i, %w, %w), branch_computations={%b0, %b1}
}"""
    rep = schedule.schedule_report(text, HW)
    (w,) = rep.windows
    assert (w.kind, w.executions, w.computation, w.exposed_us) == ("all-to-all", 3, "body",
                                                                   2.0)
    assert rep.collective_us == pytest.approx(6.0)
    assert rep.step_us == pytest.approx(3 * (2.0 + 12.0) + 8.0)
    other = schedule.schedule_report(text, HW, branch=1)
    assert [x.kind for x in other.windows] == ["all-to-all", "all-reduce"]
    assert other.windows[1].conditional
    # A boolean conditional (XLA:GPU's form of a two-branch jax.lax.cond) numbers its branches
    # as the cond's index does: 0 is the false branch, here the one without the all-reduce.
    boolean = text.replace("%i = s32[] parameter(1)", "%i = pred[] parameter(1)").replace(
        "branch_computations={%b0, %b1}", "true_computation=%b1, false_computation=%b0")
    assert [x.kind for x in schedule.schedule_report(boolean, HW).windows] == ["all-to-all"]
    assert [x.kind for x in schedule.schedule_report(boolean, HW, branch=1).windows] == [
        "all-to-all", "all-reduce"]


def test_the_link_model_sends_other_hosts_share_at_the_inter_host_rate():
    """An all-to-all over 16 devices, 2 hosts of 8: of the 15/16 of 16000 B sent, 7/15 stay in
    the host (7 us at 1 GB/s) and 8/15 cross (8 us at 0.25 GB/s: 32 us, the longer)."""
    text = _module("""
  %s = f32[4000]{0} all-to-all-start(%big), replica_groups=[1,16]<=[16], dimensions={0}
  %d = f32[4000]{0} all-to-all-done(%s)
  ROOT %o = f32[1000]{0} slice(%d), slice={[0:1000]}""",
                   params="p: f32[1000], q: f32[1000], big: f32[4000]", n=16)
    text = text.replace("  %q = f32[1000]{0} parameter(1)\n",
                        "  %q = f32[1000]{0} parameter(1)\n  %big = f32[4000]{0} parameter(2)\n")
    (w,) = schedule.schedule_report(text, HW).windows
    assert w.hosts == 2 and w.transfer_us == pytest.approx(32.0)
    one_host = schedule.Hardware(**{**HW.__dict__, "devices_per_host": 16})
    (w1,) = schedule.schedule_report(text, one_host).windows
    assert w1.hosts == 1 and w1.transfer_us == pytest.approx(15.0)


def test_replica_groups_forms():
    assert schedule.replica_groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
    assert schedule.replica_groups("replica_groups=[4,2]<=[8]", 8) == [[0, 1], [2, 3], [4, 5],
                                                                        [6, 7]]
    assert schedule.replica_groups("source_target_pairs={{0,1},{1,0}}", 2) == [[0, 1]]
    assert schedule.replica_groups("dimensions={0}", 2) is None


def test_hardware_is_validated():
    with pytest.raises(ValueError, match="Hardware.link_GBps must be a positive number"):
        schedule.Hardware(gemm_tflops=1, fp8_gemm_tflops=1, hbm_GBps=1, link_GBps=0,
                          inter_host_GBps=1)


def test_a_compiled_program_replays():
    """A compiled 8-device CPU program (XLA:CPU's collectives are synchronous: all exposed)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.shard_map(lambda x: jax.lax.all_to_all(x @ x.T, "d", 0, 0, tiled=True), mesh=mesh,
                      in_specs=jax.P("d"), out_specs=jax.P("d"))
    compiled = jax.jit(f).lower(jnp.ones((8 * 64, 64))).compile()
    rep = schedule.schedule_report(compiled, HW)
    kinds = [w.kind for w in rep.windows]
    assert kinds == ["all-to-all"] and rep.exposed_fraction == pytest.approx(1.0)
    assert rep.compute_us > 0 and "exposed" in rep.table()
    assert rep.summary()["windows"] == 1


def test_in_place_updates_and_async_fusions_move_only_the_update():
    """A dynamic-update-slice fusion (or bare op) writes its update into the buffer in place:
    2 x 4000 B, not the 4 MB buffer; an async fusion-start costs its fusion, its done
    nothing; a fusion reading a static slice of an operand reads the slice."""
    mod = hlo.parse_hlo("""HloModule m
%fused_dus (p0: f32[1000,1000], p1: f32[1,1000]) -> f32[1000,1000] {
  %p0 = f32[1000,1000]{1,0} parameter(0)
  %p1 = f32[1,1000]{1,0} parameter(1)
  %c = s32[] constant(3)
  %z = s32[] constant(0)
  ROOT %d = f32[1000,1000]{1,0} dynamic-update-slice(%p0, %p1, %c, %z)
}
%fused_slice (p0: f32[1000,1000]) -> f32[1,1000] {
  %p0 = f32[1000,1000]{1,0} parameter(0)
  ROOT %s = f32[1,1000]{1,0} slice(%p0), slice={[3:4], [0:1000]}
}
ENTRY %main (b: f32[1000,1000], u: f32[1,1000]) -> f32[1000,1000] {
  %b = f32[1000,1000]{1,0} parameter(0)
  %u = f32[1,1000]{1,0} parameter(1)
  %c = s32[] constant(3)
  %z = s32[] constant(0)
  %f = f32[1000,1000]{1,0} fusion(%b, %u), kind=kLoop, calls=%fused_dus
  %fs = ((f32[1000,1000]{1,0}, f32[1,1000]{1,0}), f32[1000,1000]{1,0}, u32[]) fusion-start(%f, %u), kind=kLoop, calls=%fused_dus
  %fd = f32[1000,1000]{1,0} fusion-done(%fs)
  %sl = f32[1,1000]{1,0} fusion(%fd), kind=kLoop, calls=%fused_slice
  ROOT %d = f32[1000,1000]{1,0} dynamic-update-slice(%fd, %sl, %c, %z)
}""")
    body = {i.name: i for i in mod.computations["main"]}
    for name in ("f", "fs", "d"):
        assert schedule.op_cost(body[name], mod)[1] == 8000.0, name
    assert schedule.op_cost(body["fd"], mod) == (0.0, 0.0, False, False)
    assert schedule.op_cost(body["sl"], mod)[1] == 8000.0
