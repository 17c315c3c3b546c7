"""benchmarks/moe_layer_bench.py --small end to end (CPU), and xla_comm.breakdown's op breakdown on
a real trace."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from _paths import ROOT
from jax.sharding import PartitionSpec as P

import moe
from xla_comm.breakdown import (
    CATEGORIES,
    LM_REGIONS,
    REST,
    categorize_hlo,
    format_regions,
    format_table,
    hlo_regions,
    op_breakdown,
)

ROOT = ROOT


def test_op_breakdown_of_a_dropless_dispatch_combine(tmp_path):
    """A traced CPU step of dispatch -> combine (EP 2, dropless, fwd+bwd): its time lands in
    the sort, exchange, combine and gather/scatter categories, none in control flow."""
    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    spec = P("expert")

    def local(x, ids, w):
        ex, _, plan = moe.dispatch(x, ids, num_experts=8, axis_name="expert",
                                   transport="dropless")
        return moe.combine(ex * 2.0, w, plan)

    f = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    step = jax.jit(jax.grad(lambda x, ids, w: jnp.sum(f(x, ids, w) ** 2), argnums=(0, 2)))
    x = jax.random.normal(jax.random.key(0), (64, 32))
    ids = jnp.stack([jnp.arange(64) % 8, (jnp.arange(64) + 3) % 8], axis=1).astype(jnp.int32)
    w = jnp.full((64, 2), 0.5)
    compiled = step.lower(x, ids, w).compile()
    cats = categorize_hlo(compiled.as_text())
    assert {"sort", "exchange", "combine", "gather_scatter"} <= set(cats.values())
    assert {n for n, c in cats.items() if c is None} and all(
        c in CATEGORIES for c in cats.values() if c is not None)
    jax.block_until_ready(compiled(x, ids, w))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            jax.block_until_ready(compiled(x, ids, w))
    bd = op_breakdown(tmp_path, compiled.as_text(), steps=2)
    us = bd["us_per_step"]
    assert bd["total_us_per_step"] > 0 and us["exchange"] > 0 and us["sort"] > 0, bd
    assert abs(sum(bd["fraction"].values()) - 1.0) < 1e-6
    assert all(c is not None for _, c, _ in bd["top_ops"])
    assert "us_per_region" not in bd
    rb = op_breakdown(tmp_path, compiled.as_text(), steps=2, regions={
        "dispatch": r"dispatch_\w+", "combine": r"combine"})
    reg, total = rb["us_per_region"], rb["total_us_per_step"]
    assert list(reg) == ["dispatch", "combine", REST] and reg["dispatch"] > 0, reg
    assert reg["combine"] > 0 and abs(sum(reg.values()) - total) < 1e-6 * total, reg
    assert abs(sum(sum(c.values()) for c in rb["us_per_region_category"].values()) - total) \
        < 1e-6 * total
    assert rb["us_per_region_category"]["dispatch"].get("sort", 0) > 0, rb
    assert all(len(t) == 4 and t[3] in reg for t in rb["top_ops"])
    # The printed tables: a row per category (per region), the ms per step of the breakdown.
    table = format_table({"step": bd}).splitlines()
    assert [ln.split()[0] for ln in table[2:]] == [*CATEGORIES, "total"]
    assert f"{us['exchange'] / 1e3:10.3f} ms" in table[2 + CATEGORIES.index("exchange")]
    regs = format_regions({"step": rb}, detail=("dispatch",)).splitlines()
    assert [ln.split()[0] for ln in regs[3:6]] == ["dispatch", "combine", REST]
    assert f"{reg['dispatch'] / 1e3:13.3f}" in regs[3] and regs[6].startswith("total")
    assert regs[-1].startswith("dispatch (step), ms/step: ") and "sort" in regs[-1]


_HLO = """HloModule jit_step, is_scheduled=true

%fused_a (p0: f32[8,8], p1: f32[8,8]) -> f32[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  %t = f32[8,8]{1,0} transpose(%p0), dimensions={1,0}, \
metadata={op_name="jit(step)/transpose(jvp(attention))/bqhd,bkhd->bhqk/transpose"}
  %c = f32[8,8]{1,0} add(%t, %p1), metadata={op_name="jit(step)/transpose(jvp())/concatenate"}
  ROOT %r = f32[8,8]{1,0} convert(%c)
}

ENTRY %main (x: f32[8,8], w: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %wq = f32[8,8]{1,0} convert(%w), \
metadata={op_name="jit(step)/jvp()/shard_map/experts_down/convert_element_type"}
  %g = f32[8,8]{1,0} all-to-all(%x), dimensions={0}, \
metadata={op_name="jit(step)/transpose(jvp())/shard_map/combine/all_to_all"}
  %d = f32[8,8]{1,0} dot(%g, %wq), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %s = f32[8,8]{1,0} dot(%d, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}, \
metadata={op_name="jit(step)/transpose(jvp(attention))/bhqk,bkhd->bqhd/dot_general"}
  %f = f32[8,8]{1,0} fusion(%s, %x), kind=kLoop, calls=%fused_a
  %m = f32[8,8]{1,0} multiply(%f, %f), metadata={op_name="jit(step)/muon_owner_step/shard_map/mul"}
  %u = f32[8,8]{1,0} sqrt(%m), metadata={op_name="jit(step)/sqrt"}
  %ar = f32[8,8]{1,0} all-reduce(%u), to_apply=%fused_a, metadata={op_name=\
"jit(step)/(transpose(jvp())/dot_general:transpose(jvp())/shard_map/psum:transpose(jvp())/x)"}
  %k = f32[8,8]{1,0} add(%ar, %ar), metadata={op_name="moe_router/reduce_sum"}
  ROOT %o = f32[8,8]{1,0} add(%k, %u), metadata={op_name="jit(step)/jvp()/shard_map/mul"}
}
"""


def test_hlo_regions_of_the_lm_scopes():
    """LM_REGIONS on hand-written HLO: autodiff paths, a fusion's scope nearest its root, an
    unscoped dot taking the first region of its operands' scopes (else its users'), XLA's
    merged op_names (the region most parts match)."""
    regions = hlo_regions(_HLO, LM_REGIONS)
    assert regions["s"] == "attention"  # transpose(jvp(attention))
    assert regions["f"] == REST  # the root's nearest scope, not the producer's (attention)
    assert categorize_hlo(_HLO)["f"] == "other"
    assert regions["d"] == "experts"  # no scope: operands combine/... and experts_down
    assert regions["wq"] == "experts" and regions["g"] == "dispatch_combine"
    assert regions["m"] == regions["u"] == "optimizer"  # outside jvp / transpose
    assert regions["ar"] == REST  # 2 of 3 merged parts are no region's
    assert regions["k"] == "dispatch_combine"  # a custom_vjp's path without the jit prefix
    assert regions["o"] == "moe_other"
    # No scope and no operands: the first region of its users' scopes (all-to-all, dot, fusion)
    assert regions["x"] == "attention"


@pytest.mark.slow
def test_moe_layer_bench_small_writes_the_dropless_keys(tmp_path):
    """The --small run (2 CPU devices): dense capacity and dropless layers under balanced and
    Zipf routing, dispatch+combine timings, the op breakdown, and the summary keys."""
    out, summary = tmp_path / "r.json", tmp_path / "dropless.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "moe_layer_bench.py"), "--small",
           "--variants", "dense_einsum_bf16", "dropless_bf16", "--out", str(out),
           "--dropless-out", str(summary)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report, s = json.loads(out.read_text()), json.loads(summary.read_text())
    assert not report["errors"], report["errors"]
    assert {r["variant"] for r in report["layer"]} == {
        "dense_einsum_bf16", "dense_einsum_bf16_zipf", "dropless_bf16", "dropless_bf16_zipf"}
    zipf = report["routing"]["zipf"]
    assert zipf["l1_error"] < 0.15 and zipf["max_over_mean"] > 3.0, zipf
    for key in ("dropless_over_capacity_time_2cpu", "dropless_over_capacity_time_2cpu_zipf",
                "dropless_dispatch_combine_over_dense_2cpu", "dropless_layer_mfu_2cpu"):
        assert s[key] > 0, key
    assert s["dropless_dropped_slots_2cpu"] == s["dropless_dropped_slots_2cpu_zipf"] == 0
    assert s["capacity_dropped_frac_2cpu_zipf"] > 0.05  # capacity 1.25 drops under Zipf
    bd = s["breakdown"]["dropless_bf16"]
    assert bd["us_per_step"]["exchange"] > 0 and bd["us_per_step"]["gemm"] > 0, bd
