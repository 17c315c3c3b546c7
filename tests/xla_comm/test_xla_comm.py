"""xla_comm.hlo reads kinds, bytes, group sizes, ring costs, loops and overlap from HLO text."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from _paths import ROOT
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from xla_comm import hlo, overlap


@pytest.fixture(scope="module")
def report_1d():
    """psum / all_gather / psum_scatter / all_to_all / ppermute of an f32[8, 16] shard."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))

    def f(x):
        return (
            jax.lax.psum(x, "d"),
            jax.lax.all_gather(x, "d", tiled=True),
            jax.lax.psum_scatter(x, "d", scatter_dimension=0, tiled=True),
            jax.lax.all_to_all(x, "d", 0, 0, tiled=True),
            jax.lax.ppermute(x, "d", [(i, (i + 1) % 8) for i in range(8)]),
        )

    g = jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=(P("d"),) * 5)
    x = jax.device_put(jnp.ones((64, 16), jnp.float32), NamedSharding(mesh, P("d")))
    return hlo.analyze_collectives(jax.jit(g).lower(x).compile())


def test_kinds_bytes_and_ring_costs(report_1d):
    rep = report_1d
    print(rep.table())
    assert rep.counts() == {
        "all-reduce": 1, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1,
        "collective-permute": 1,
    }
    shard = 8 * 16 * 4  # bytes of one f32[8, 16] shard
    (ar,) = rep.of_kind("all-reduce")
    (ag,) = rep.of_kind("all-gather")
    (rs,) = rep.of_kind("reduce-scatter")
    (a2a,) = rep.of_kind("all-to-all")
    (cp,) = rep.of_kind("collective-permute")
    assert (ar.buffer_bytes, ar.group_size, ar.ring_bytes) == (shard, 8, 2 * 7 / 8 * shard)
    assert ag.shapes == ((64, 16),) and ag.dtypes == ("f32",)
    assert (ag.buffer_bytes, ag.ring_bytes) == (8 * shard, 7 * shard)
    assert (rs.buffer_bytes, rs.ring_bytes) == (shard, 7 / 8 * shard)
    assert (a2a.buffer_bytes, a2a.ring_bytes) == (shard, 7 / 8 * shard)
    assert (cp.buffer_bytes, cp.ring_bytes) == (shard, shard)
    assert rep.ring_bytes == pytest.approx(sum(c.ring_bytes for c in rep))
    assert not rep.in_while_loop and all(not c.is_async for c in rep)
    assert rep.bare_fraction == 1.0


def test_group_sizes_on_2d_mesh_and_while_loop_flag():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)

    def f(x):
        y = jax.lax.psum_scatter(x, "a", scatter_dimension=0, tiled=True)
        z = jax.lax.fori_loop(0, 3, lambda i, c: jax.lax.psum(c, "b") * 0.5 + c, x)
        return y, z

    spec = P(("a", "b"))
    g = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=(spec, spec))
    x = jax.device_put(jnp.ones((64, 16), jnp.float32), NamedSharding(mesh, spec))
    rep = hlo.analyze_collectives(jax.jit(g).lower(x).compile().as_text())
    (rs,) = rep.of_kind("reduce-scatter")
    (ar,) = rep.of_kind("all-reduce")
    assert (rs.group_size, rs.in_while_loop) == (2, False)
    assert rs.ring_bytes == pytest.approx(0.5 * 8 * 16 * 4)
    assert (ar.group_size, ar.in_while_loop, ar.executions) == (4, True, 3)
    assert rep.in_while_loop == (ar,)
    assert rep.ring_bytes == pytest.approx(rs.ring_bytes + 3 * ar.ring_bytes)
    assert "LOOP x3" in rep.table()


_ASYNC_HLO = """HloModule m, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%wrapped_rs (p: bf16[64,32]) -> bf16[16,32] {
  %p = bf16[64,32]{1,0} parameter(0)
  ROOT %rs = bf16[16,32]{1,0} reduce-scatter(%p), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[8,128], b: bf16[64,32]) -> (f32[64,128], bf16[16,32], f32[8,128]) {
  %a = f32[8,128]{1,0} parameter(0)
  %b = bf16[64,32]{1,0} parameter(1)
  %ag-start = (f32[8,128]{1,0}, f32[64,128]{1,0}) all-gather-start(f32[8,128]{1,0} %a), channel_id=1, replica_groups={}, dimensions={0}
  %rs-start = ((bf16[64,32]{1,0}), bf16[16,32]{1,0}, s32[]) async-start(%b), calls=%wrapped_rs
  %fusion.1 = f32[8,128]{1,0} fusion(%a), kind=kLoop, calls=%add
  %gte = f32[8,128]{1,0} get-tuple-element(%ag-start), index=0
  %ag-done = f32[64,128]{1,0} all-gather-done(%ag-start)
  %rs-done = bf16[16,32]{1,0} async-done(%rs-start)
  %ar-start = f32[8,128]{1,0} all-reduce-start(%fusion.1), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %ar-done = f32[8,128]{1,0} all-reduce-done(%ar-start)
  ROOT %t = (f32[64,128]{1,0}, bf16[16,32]{1,0}, f32[8,128]{1,0}) tuple(%ag-done, %rs-done, %ar-done)
}
"""  # noqa: E501


def test_async_pairs_and_overlap_from_text():
    rep = hlo.analyze_collectives(_ASYNC_HLO)
    assert rep.counts() == {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1}
    (ag,) = rep.of_kind("all-gather")
    (rs,) = rep.of_kind("reduce-scatter")
    (ar,) = rep.of_kind("all-reduce")
    assert all(c.is_async for c in rep)
    assert (ag.done_name, ag.group_size, ag.buffer_bytes) == ("ag-done", 8, 64 * 128 * 4)
    assert ag.overlapped == (("fusion", "fusion.1"),) and not ag.bare
    assert (rs.done_name, rs.group_size, rs.dtypes) == ("rs-done", 4, ("bf16",))
    assert rs.ring_bytes == pytest.approx(3 / 4 * 64 * 32 * 2)
    assert rs.overlapped == (("fusion", "fusion.1"),)
    assert (ar.group_size, ar.overlapped, ar.bare) == (2, (), True)
    assert rep.bare_ring_bytes == pytest.approx(ar.ring_bytes)


def test_hlo_text_rejects_other_objects():
    with pytest.raises(TypeError, match="compile"):
        hlo.hlo_text(3)


def test_overlap_flags_and_refusal_after_backend_init():
    flags = overlap.overlap_flags(1 << 20, pipelined=True)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert "--xla_gpu_reduce_scatter_combine_threshold_bytes=1048576" in flags
    assert "--xla_gpu_enable_pipelined_all_gather=true" in flags
    with pytest.raises(ValueError, match="combine_threshold_bytes"):
        overlap.overlap_flags(0)
    assert not any("parallel_collective" in f for f in flags)  # XLA's default: one in flight
    two = overlap.overlap_flags(parallel_collectives=2)
    assert "--xla_gpu_experimental_parallel_collective_overlap_limit=2" in two
    with pytest.raises(ValueError, match="parallel_collectives"):
        overlap.overlap_flags(parallel_collectives=0)
    opts = overlap.overlap_compiler_options(1 << 20, parallel_collectives=2)
    assert opts["xla_gpu_experimental_parallel_collective_overlap_limit"] == 2
    assert opts["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert opts["xla_gpu_all_gather_combine_threshold_bytes"] == 1 << 20
    x = jnp.ones(4)
    compiled = jax.jit(lambda v: v * 2).lower(x).compile(compiler_options=opts)
    assert float(compiled(x)[0]) == 2.0  # XLA accepts every option
    jax.devices()  # the test process has a backend
    before = os.environ.get("XLA_FLAGS")
    with pytest.raises(ValueError, match="already initialized"):
        overlap.enable_overlap()
    assert os.environ.get("XLA_FLAGS") == before


def test_enable_overlap_in_fresh_process_sets_flags_xla_accepts():
    code = (
        "import os; from xla_comm import overlap as o; "
        "o.enable_overlap(pipelined=True, parallel_collectives=2); "
        "import jax; jax.devices(); assert o.backend_initialized(); "
        "print(os.environ['XLA_FLAGS'])"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    root = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out.stdout
    assert "--xla_gpu_experimental_parallel_collective_overlap_limit=2" in out.stdout


def test_lowered_text_is_parsed_too():
    """Pre-optimization HLO (``lower(...).as_text(dialect='hlo')``) has computation headers
    without a ``->`` signature; its collectives are still found (they were silently missed)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"),
                              out_specs=P()))
    lowered = f.lower(jnp.ones(8))
    assert len(hlo.analyze_collectives(lowered.as_text(dialect="hlo"))) == 1
    assert len(hlo.analyze_collectives(lowered.compile())) == 1


@pytest.mark.parametrize(
    "attrs,n",
    [
        ("replica_groups={}, to_apply=%add", 8),
        ("replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add", 2),
        ("replica_groups={{0,4,1,5,2,6,3,7}}, dimensions={0}", 8),
        ("replica_groups=[2,4]<=[8], to_apply=%add", 4),
        ("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 2),
        ("replica_groups=[1,8]<=[8], dimensions={0}", 8),
        ("replica_groups=mesh['a'=2,'b'=4] {'b'}, use_global_device_ids=true", 4),
        ("replica_groups=mesh['a'=2,'b'=4] {'a'}, dimensions={0}", 2),
        ("replica_groups=mesh['a'=2,'b'=4] {'b','a'}, dimensions={0}", 8),
        ("replica_groups=mesh['x'=8] {'x':(1)2}, to_apply=%add", 2),
        ("replica_groups=mesh['x'=8,'y'=2] {'x':(2)4,'y'}, to_apply=%add", 8),
        ("replica_groups=mesh[a=2,b=4], device_ids=(0,2,4,6,1,3,5,7) {b}, to_apply=%add", 4),
        ("replica_groups=mesh['a'=2,'b'=4] {}, to_apply=%add", 1),
        ("source_target_pairs={{0,1},{1,0}}", 2),
        ("channel_id=1, to_apply=%add", 8),
    ],
)
def test_replica_group_size_reads_every_form(attrs, n):
    assert hlo.replica_group_size(attrs, 8) == n


def test_group_sizes_of_a_real_program_match_the_mesh():
    """Whichever replica-group form this jax prints, sizes come out of the mesh axes."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)

    def f(x):
        return (jax.lax.psum(x, "a"), jax.lax.psum(x, "b"), jax.lax.psum(x, ("b", "a")),
                jax.lax.all_gather(x, ("b", "a"), tiled=True))

    spec = P(("a", "b"))
    g = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=(spec,) * 4)
    x = jax.device_put(jnp.ones((64, 16), jnp.float32), NamedSharding(mesh, spec))
    for stage in (jax.jit(g).lower(x), jax.jit(g).lower(x).compile()):
        rep = hlo.analyze_collectives(stage)
        assert sorted(c.group_size for c in rep.of_kind("all-reduce")) == [2, 4, 8], rep.table()
        assert [c.group_size for c in rep.of_kind("all-gather")] == [8], rep.table()


_RAGGED_HLO = """HloModule m, num_partitions=4

ENTRY %main (x: u32[64,129], out: u32[96,129], o: s32[4], s: s32[4], p: s32[4], r: s32[4]) -> u32[96,129] {
  %x = u32[64,129]{1,0} parameter(0)
  %out = u32[96,129]{1,0} parameter(1)
  %o = s32[4]{0} parameter(2)
  %s = s32[4]{0} parameter(3)
  %p = s32[4]{0} parameter(4)
  %r = s32[4]{0} parameter(5)
  ROOT %ra = u32[96,129]{1,0} ragged-all-to-all(%x, %out, %o, %s, %p, %r), replica_groups={{0,1,2,3}}
}
"""  # noqa: E501


def test_ragged_all_to_all_buffer_is_data_not_offsets():
    (c,) = hlo.analyze_collectives(_RAGGED_HLO)
    assert (c.kind, c.dtypes, c.shapes, c.group_size) == (
        "ragged-all-to-all", ("u32",), ((96, 129),), 4)
    assert c.buffer_bytes == hlo.array_nbytes("u32", (96, 129)) == 96 * 129 * 4


def test_parse_hlo_and_array_nbytes():
    mod = hlo.parse_hlo(_ASYNC_HLO)
    assert (mod.entry, mod.num_partitions, mod.num_devices) == ("main", 8, 8)
    assert [i.opcode for i in mod.computations["wrapped_rs"]] == ["parameter", "reduce-scatter"]
    (ag,) = [i for i in mod.instructions() if i.opcode == "all-gather-start"]
    assert (ag.operands, ag.computation) == (("a",), "main")
    assert hlo.array_nbytes("f4e2m1fn", (3,)) == 2 and hlo.array_nbytes("pred", ()) == 1
    with pytest.raises(ValueError, match="dtype='q7'"):
        hlo.array_nbytes("q7", (2,))
