"""benchmarks/layer.py --small end to end (CPU, the session's 8 devices): the transports under
balanced and Zipf routing, the summary keys, the FP8 layer keys (the eager call: through the
runner, tests/benchmarks/test_benchmarks_report.py); and
xla_comm.breakdown's op breakdown on a real trace."""

import sys

import jax
import jax.numpy as jnp
import pytest
from _paths import ROOT
from jax.sharding import PartitionSpec as P

import moe
from xla_comm.breakdown import (
    REST,
    categories,
    categorize_hlo,
    format_regions,
    format_table,
    hlo_regions,
    kernel_category,
    kernel_region,
    op_breakdown,
)

sys.path.insert(0, str(ROOT / "benchmarks"))

import layer  # noqa: E402  (benchmarks/layer.py)
from _lib import bench  # noqa: E402

RULES = bench.moe_rules()
CATEGORIES = categories(RULES)
LM_REGIONS, LM_KERNEL_REGIONS = bench.lm_regions()


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
    cats = categorize_hlo(compiled.as_text(), RULES)
    assert {"sort", "exchange", "combine", "gather_scatter"} <= set(cats.values())
    assert {n for n, c in cats.items() if c is None} and all(
        c in CATEGORIES for c in cats.values() if c is not None)
    jax.block_until_ready(compiled(x, ids, w))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            jax.block_until_ready(compiled(x, ids, w))
    assert set(categorize_hlo(compiled.as_text()).values()) <= {None, *categories()}
    bd = op_breakdown(tmp_path, compiled.as_text(), steps=2, rules=RULES)
    us = bd["us_per_step"]
    assert bd["total_us_per_step"] > 0 and us["exchange"] > 0 and us["sort"] > 0, bd
    assert abs(sum(bd["fraction"].values()) - 1.0) < 1e-6
    assert all(c is not None for _, c, _ in bd["top_ops"])
    assert "us_per_region" not in bd
    rb = op_breakdown(tmp_path, compiled.as_text(), steps=2, rules=RULES, regions={
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
    assert categorize_hlo(_HLO, RULES)["f"] == "other"
    assert regions["d"] == "experts"  # no scope: operands combine/... and experts_down
    assert regions["wq"] == "experts" and regions["g"] == "dispatch_combine"
    assert regions["m"] == regions["u"] == "optimizer"  # outside jvp / transpose
    assert regions["ar"] == REST  # 2 of 3 merged parts are no region's
    assert regions["k"] == "dispatch_combine"  # a custom_vjp's path without the jit prefix
    assert regions["o"] == "moe_other"
    # No scope and no operands: the first region of its users' scopes (all-to-all, dot, fusion)
    assert regions["x"] == "attention"


@pytest.mark.slow
def test_layer_small_writes_the_summary_keys(tmp_path):
    """Dense capacity and dropless layers, both routings, traced: the keys the report reads."""
    out = tmp_path / "r.json"
    r = layer.main(["--small", "--variants", "dense_einsum_bf16", "dropless_bf16",
                    "--profile", str(tmp_path / "traces"), "--out", str(out)])
    assert out.exists() and not r["errors"], r["errors"]
    assert {row["variant"] for row in r["layer"]} == {
        "dense_einsum_bf16", "dense_einsum_bf16_zipf", "dropless_bf16", "dropless_bf16_zipf"}
    zipf = r["routing"]["zipf"]
    assert zipf["l1_error"] < 0.15 and zipf["max_over_mean"] > 3.0, zipf
    tag = f"{jax.device_count()}cpu"
    for key in (f"dropless_over_capacity_time_{tag}", f"dropless_over_capacity_time_{tag}_zipf",
                f"dropless_layer_mfu_{tag}", f"capacity_layer_ms_{tag}"):
        assert r[key] > 0, key
    assert r[f"dropless_dropped_slots_{tag}"] == r[f"dropless_dropped_slots_{tag}_zipf"] == 0
    assert r[f"capacity_dropped_frac_{tag}_zipf"] > 0.05  # capacity 1.25 drops under Zipf
    assert r["moe_layer_mfu_by_variant"]["dropless_bf16"] > 0
    bd = next(row for row in r["layer"] if row["variant"] == "dropless_bf16")["breakdown"]
    assert bd["us_per_step"]["exchange"] > 0 and bd["us_per_step"]["gemm"] > 0, bd


@pytest.mark.slow
def test_layer_small_fp8_preset():
    """The FP8 preset's keys. (The eager call, ``layer.py --small --eager``, runs as the
    benchmark runner runs it: test_benchmarks_report.py's
    test_the_runner_runs_a_benchmark_and_its_run_is_adoptable.)"""
    r = layer.main(["--small", "--preset", "fp8", "--routing", "balanced"])
    tag = f"{jax.device_count()}cpu"
    assert not r["errors"], r["errors"]
    for k in ("bf16", "fp8"):
        for transport in ("dense", "dropless"):
            assert r[f"moe_layer_{k}_mfu_{tag}_{transport}"] > 0


def test_trace_breakdown_names():
    """Mosaic GPU kernels show in traces as ``<name>_mosaic_gpu_kernel``: the grouped GEMMs
    are GEMMs in the experts region, the dense projections' GEMMs GEMMs elsewhere, the row
    kernels not GEMMs."""
    sfx = "_mosaic_gpu_kernel"
    assert kernel_category("gmm_fp8" + sfx, RULES) == "gemm"
    assert kernel_category("dense_tgmm_fp8" + sfx, RULES) == "gemm"
    assert kernel_category("gmm_fp8" + sfx) == "other"  # the library knows no kernel of ours
    assert kernel_category("fp8_quantize_rows_mgpu" + sfx, RULES) == "other"
    assert kernel_region("tgmm_bf16" + sfx, LM_KERNEL_REGIONS) == "experts"
    assert kernel_region("fp8_gated_quantize_rows_mgpu" + sfx, LM_KERNEL_REGIONS) == "experts"
    assert kernel_region("dense_gmm_fp8" + sfx, LM_KERNEL_REGIONS) == REST
    assert kernel_region("wire_local_rows_fp8_mgpu" + sfx, LM_KERNEL_REGIONS) != REST
