"""xla_comm.latency: the modeled latency profile XLA's scheduler reads, and the second compile."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np

from xla_comm import costs, latency

HW = costs.Hardware(gemm_tflops=1.0, fp8_gemm_tflops=2.0, hbm_GBps=1000.0, link_GBps=1.0,
                    inter_host_GBps=1.0, latency_us=0.0, launch_us=0.0)

# An async all-to-all, a fusion whose body must stay out of the profile, and names the
# scheduler knew by another name (metadata scheduling_name).
TEXT = """HloModule m, num_partitions=2

%fused (a: f32[512,512]) -> f32[512,512] {
  %a = f32[512,512]{1,0} parameter(0)
  ROOT %inner.7 = f32[512,512]{1,0} exponential(%a)
}

ENTRY %main (p: f32[512,512], q: f32[512,512]) -> f32[512,512] {
  %p = f32[512,512]{1,0} parameter(0)
  %q = f32[512,512]{1,0} parameter(1)
  %s = f32[512,512]{1,0} all-to-all-start(%p), replica_groups={{0,1}}, dimensions={0}, metadata={scheduling_name="all-to-all-start.3"}
  %d = f32[512,512]{1,0} dot(%q, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %f = f32[512,512]{1,0} fusion(%q), kind=kLoop, calls=%fused
  %r = f32[512,512]{1,0} all-to-all-done(%s)
  ROOT %o = f32[512,512]{1,0} add(%r, %d)
}"""


def _costs(profile: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'costs \{ name: "([^"]+)" cost_us: ([\d.]+) \}', profile)}


def test_profile_holds_modeled_times_under_scheduled_names():
    got = _costs(latency.latency_profile(TEXT, HW))
    # the collective: its transfer time (512 KiB at 1 GB/s), under the name it was scheduled by
    assert got["all-to-all-start.3"] == 524.288
    assert "s" not in got
    # a GEMM at 1 TFLOP/s: 2 * 512^3 FLOPs
    assert abs(got["d"] - 2 * 512**3 / 1e12 * 1e6) < 1e-2
    # the fusion as one op (1 MiB read and 1 MiB written at 1 TB/s); nothing of its body
    assert abs(got["f"] - 2 * 512 * 512 * 4 / 1e12 * 1e6) < 1e-2
    assert "inner.7" not in got and "a" not in got
    assert set(got) == {"all-to-all-start.3", "d", "f", "o"}


def test_compile_modeled_runs_the_same_program():
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    step = jax.shard_map(lambda x: jax.lax.all_to_all(x @ x.T, "d", 0, 0, tiled=True),
                         mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d"))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(n * 16, 16)), jnp.float32)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("d")))
    modeled = latency.compile_modeled(jax.jit(step).lower(x), HW)
    assert "all-to-all" in modeled.profile
    chex.assert_trees_all_close(modeled.compiled(x), modeled.default(x), rtol=1e-6)
    chex.assert_trees_all_close(modeled.compiled(x), jax.jit(step)(x), rtol=1e-6)
