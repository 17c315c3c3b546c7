"""Chunked owner collectives (``chunk_bytes``): same values, same bytes, same state as one chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_jax
from muon_jax import owner_plan
from xla_comm import hlo

# The stacks here are plain arrays meant as batches of matrices: the default view is right.
pytestmark = pytest.mark.filterwarnings("ignore:muon_jax. no layer gives the matrix view")

# One Newton-Schulz step on every side: chunking is the point here, not the iteration
# (test_orthogonalize, test_gram_ns and test_optax_port prove it); fewer unrolled steps
# shrink every compiled update program.
F32_TX = dict(newton_schulz=muon_jax.NewtonSchulzOptions(dtype=jnp.float32), mu_dtype=jnp.float32,
              ns_steps=1)
# Stacks with several matrices per device; 'w*' are 12 separate leaves of one shape (more
# pieces than one concatenate takes), 'a' an FSDP leaf (all-to-all), 'c' a padded stack.
SHAPES = {"a": (24, 16, 32), "c": (20, 8, 8), **{f"w{i}": (16, 32) for i in range(12)}}


def _tree(seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_chunked_equals_unchunked_and_reference_with_same_bytes(axis_type):
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    specs = {"a": P(None, "model"), "w0": P("data")}
    params = {k: jax.device_put(x, NamedSharding(mesh, specs.get(k, P())))
              for k, x in _tree(0).items()}
    grads = [{k: jax.device_put(g, params[k].sharding) for k, g in _tree(10 + i).items()}
             for i in range(2)]
    ref_tx = muon_jax.scale_by_muon(**F32_TX)
    ref_state, refs = ref_tx.init(_tree(0)), []
    for g in grads:
        u, ref_state = jax.jit(ref_tx.update)(jax.tree.map(np.asarray, g), ref_state)
        refs.append(u)
    runs = {}
    for chunk_bytes in (None, 1):  # 1 byte: one matrix per device per chunk
        tx = muon_jax.scale_by_muon(
            **F32_TX, sharding=muon_jax.ShardingOptions(mesh, chunk_bytes=chunk_bytes))
        # Explicit axes: a jitted init (one program; the specs from the traced types); Auto:
        # eager, the specs read from the placed arrays.
        state = (jax.jit(tx.init) if axis_type == AxisType.Explicit else tx.init)(params)
        update = jax.jit(tx.update)
        rep = hlo.analyze_collectives(update.lower(grads[0], state).compile())
        assert rep.in_while_loop == ()
        outs = []
        for g in grads:
            u, state = update(g, state)
            outs.append(u)
        runs[chunk_bytes] = (state, rep, outs)
    (s1, r1, o1), (sc, rc, oc) = runs[None], runs[1]
    assert all(s.chunks == (s.k_owner,) for s in s1.plan.stacks)
    assert any(len(s.chunks) > 1 for s in sc.plan.stacks)
    assert all(sum(s.chunks) == s.k_owner for s in sc.plan.stacks)
    assert len(rc) > len(r1) and rc.ring_bytes == r1.ring_bytes
    for a, b in zip(s1.mu, sc.mu, strict=True):  # same shapes; rows in chunk order
        assert a.shape == b.shape and a.sharding.is_equivalent_to(b.sharding, a.ndim)
    # The same momentum per matrix: the chunks' contiguous ranges only reorder owner rows.
    portable = jax.jit(muon_jax.portable_state)  # one program per plan, not one per op
    for a, b in zip(jax.tree.leaves(portable(s1)), jax.tree.leaves(portable(sc)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    for got_c, got_1, ref in zip(oc, o1, refs, strict=True):
        for k in SHAPES:
            assert got_c[k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim)
            np.testing.assert_allclose(np.asarray(got_c[k]), np.asarray(ref[k]), rtol=1e-5,
                                       atol=1e-5, err_msg=k)
            np.testing.assert_allclose(np.asarray(got_c[k]), np.asarray(got_1[k]), rtol=1e-5,
                                       atol=1e-5, err_msg=k)


def test_chunked_data_parallel_step_reduce_scatters_same_bytes():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    host = {k: v for k, v in _tree(1).items() if k != "a"}
    params = jax.device_put(host, NamedSharding(mesh, P()))
    x = jax.device_put(np.random.default_rng(2).standard_normal((8, 4, 16)).astype(np.float32),
                       NamedSharding(mesh, P("d")))

    def loss(p, x):
        out, total = NamedSharding(mesh, P("d")), 0.0
        for w in p.values():
            if w.ndim == 2:
                y = jnp.einsum("dbi,io->dbo", x, w, out_sharding=out)
            else:
                y = jnp.einsum("dbi,kio->dbko", x[..., :8], w, out_sharding=out)
            total = total + jnp.sum(jnp.tanh(y) ** 2)
        return total

    results = {}
    for chunk_bytes in (None, 1):
        tx = muon_jax.scale_by_muon(
            **F32_TX, sharding=muon_jax.ShardingOptions(mesh, chunk_bytes=chunk_bytes))
        state = jax.jit(tx.init)(params)  # Explicit axes: one program, not one per op

        @jax.jit
        def step(p, state, x, tx=tx):
            g = jax.grad(loss)(muon_jax.reduced_view(p, "d"), x)
            return tx.update(g, state, p)

        rep = hlo.analyze_collectives(step.lower(params, state, x).compile())
        results[chunk_bytes] = (rep, step(params, state, x)[0])
    (r1, u1), (rc, uc) = results[None], results[1]
    assert r1.counts().get("reduce-scatter", 0) >= 1
    assert len(rc.of_kind("reduce-scatter")) > len(r1.of_kind("reduce-scatter"))
    assert rc.ring_bytes == r1.ring_bytes
    for k in host:
        np.testing.assert_allclose(np.asarray(uc[k]), np.asarray(u1[k]), rtol=1e-5, atol=1e-5)


def test_chunk_sizes_and_bad_chunk_bytes():
    assert owner_plan.chunk_sizes(16, 64, 128) == (2,) * 8
    assert owner_plan.chunk_sizes(10, 1, 3) == (2, 2, 3, 3)
    assert owner_plan.chunk_sizes(5, 1, None) == (5,) == owner_plan.chunk_sizes(5, 1, 0)
    assert owner_plan.chunk_sizes(5, 100, 1) == (1,) * 5  # at least one matrix per chunk
    mesh = jax.make_mesh((8,), ("d",))
    for bad in (-1, 1.5, True, "1M"):
        with pytest.raises(ValueError, match="chunk_bytes"):
            muon_jax.ShardingOptions(mesh, chunk_bytes=bad)


def test_chunks_hold_contiguous_matrices():
    """A chunk holds a contiguous range of its stack (so its collectives wait for those leaves
    only, e.g. one layer's gradients), its owners each a block of it; one chunk is the
    unchunked layout."""
    stack = owner_plan.StackPlan(2, 2, np.dtype("float32"), (0,), (), (), 12, 3, (1, 2))
    # 4 owners; chunk 0: rows 0-3 (one each), chunk 1: rows 4-11 (two each).
    assert owner_plan.owner_rows(stack, 4).tolist() == [0, 4, 5, 1, 6, 7, 2, 8, 9, 3, 10, 11]
    assert owner_plan.chunk_pieces(stack, 2, 6, 4) == [(0, 2, 4), (1, 0, 4)]
    one = owner_plan.StackPlan(2, 2, np.dtype("float32"), (0,), (), (), 12, 3, (3,))
    assert owner_plan.owner_rows(one, 4).tolist() == list(range(12))
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    plan = owner_plan.plan_owners([(f"layer{i}", (8, 4, 4), np.float32, P()) for i in range(4)],
                                  [None] * 4, mesh=mesh, chunk_bytes=8 * 4 * 4 * 4)
    (s,) = plan.stacks
    assert s.chunks == (1,) * 4  # one layer's 8 matrices per chunk
    rows = owner_plan.owner_rows(s, 8).reshape(8, 4)  # [owner, chunk]
    assert [sorted(set(rows[:, j] // 8)) for j in range(4)] == [[0], [1], [2], [3]]
