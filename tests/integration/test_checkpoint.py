"""Orbax checkpoints of params, sharded Muon state and MoE balancing biases, across meshes.

One run per mesh ((8,), (2, 4), (4, 2)): 5 steps, save params + biases +
``muon_jax.portable.portable_state(opt_state)`` with ``ocp.StandardCheckpointer``, 5 more
steps (the uninterrupted reference). Restores use abstract targets
(``jax.ShapeDtypeStruct`` with the *destination* mesh's shardings, from
``portable_target``), so orbax reads every shard straight onto its device, and
``restore_state`` moves the momentum into the destination's owner stacks with collectives;
nothing is assembled on one device. Raw owner stacks (mesh-specific) are caught by
``check_state``.
"""

import math

import _tiny_moe as tm
import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_jax
from muon_jax import matrices, portable

MESHES = [(8,), (2, 4), (4, 2)]
CROSS = [((8,), (2, 4)), ((8,), (4, 2)), ((2, 4), (8,)), ((4, 2), (8,))]
STEPS = 5
# f32 across meshes: reduction orders differ, so values near 0 move by ulps (1e-6 seen).
TOL = dict(rtol=1e-5, atol=1e-5)

# One jit each, shared by every mesh (the static owner plan keys the cache).
to_portable = jax.jit(portable.portable_state)
from_portable = jax.jit(portable.restore_state)


def _abstract(tree):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _leaves(tree):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _muon(opt_state):
    return opt_state.inner_states["muon"].inner_state[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per mesh: step fn, state after 5 steps, checkpoint paths, losses/state after 10."""
    ckpt = ocp.StandardCheckpointer()
    out = {}
    for shape in MESHES:
        mesh = tm.make_mesh(shape)
        graphdef, params, bias, opt_state, tx = tm.build(mesh)
        step_fn = tm.make_step(graphdef, tx)
        state5, losses5 = tm.run(mesh, STEPS, state=(graphdef, params, bias, opt_state, tx),
                                 step_fn=step_fn)
        _, p5, b5, o5, _ = state5
        port5 = jax.block_until_ready(to_portable(o5))
        name = "x".join(map(str, shape))
        path = tmp_path_factory.mktemp("ckpt") / name
        ckpt.save(path, {"params": p5, "bias": b5, "opt_state": port5})
        raw_path = tmp_path_factory.mktemp("raw") / name  # what check_state guards against
        ckpt.save(raw_path, {"opt_state": o5, "rows": portable.plan_fingerprint(o5)})
        ckpt.wait_until_finished()
        state10, losses10 = tm.run(mesh, STEPS, start=STEPS, state=state5, step_fn=step_fn)
        out[shape] = dict(mesh=mesh, step_fn=step_fn, state5=state5, port5=port5, path=path,
                          raw_path=raw_path, losses=np.concatenate([losses5, losses10]),
                          state10=state10)
    ckpt.close()
    return out


_RESTORED = {}


def _restore(runs, src, dst):
    """Restore src's checkpoint onto dst's mesh (targets: dst's shardings), then put the Muon
    momentum into dst's owner stacks. Cached: several tests look at one restore."""
    if (src, dst) not in _RESTORED:
        _, p5, b5, o5, _ = runs[dst]["state5"]
        target = {"params": _abstract(p5), "bias": _abstract(b5),
                  "opt_state": portable.portable_target(o5)}
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(runs[src]["path"], target)
        opt_state = jax.block_until_ready(from_portable(restored["opt_state"], o5))
        _RESTORED[src, dst] = restored, target, opt_state
    return _RESTORED[src, dst]


def _resume(runs, dst, restored, opt_state):
    graphdef, *_, tx = runs[dst]["state5"]
    state = (graphdef, restored["params"], restored["bias"], opt_state, tx)
    return tm.run(runs[dst]["mesh"], STEPS, start=STEPS, state=state,
                  step_fn=runs[dst]["step_fn"])


def _assert_in_place(x, sharding, devices, path):
    """``x`` has ``sharding``; every device of the mesh holds exactly its per-device shard."""
    assert x.sharding.is_equivalent_to(sharding, x.ndim), (path, x.sharding, sharding)
    per_device = sharding.shard_shape(x.shape)
    assert {s.device for s in x.addressable_shards} == devices, path
    for s in x.addressable_shards:
        assert s.data.shape == per_device, (path, s.data.shape, per_device)
    return math.prod(per_device) < math.prod(x.shape)


def test_state_holds_sharded_muon_momentum_and_trained_bias(runs):
    """The run holds what it should: Muon momentum in owner stacks split 8 ways (1/8 per
    device), its portable form sharded like the params, balancing biases moved away from 0."""
    _, params, bias, opt_state, _ = runs[(2, 4)]["state5"]
    muon_state = _muon(opt_state)
    assert len(muon_state.mu) >= 2
    for mu in muon_state.mu:
        shard = mu.sharding.shard_shape(mu.shape)
        assert shard[0] * 8 == mu.shape[0], (mu.shape, mu.sharding)
    port = _muon(runs[(2, 4)]["port5"])
    assert isinstance(port, portable.PortableMuonState)
    by_path = {matrices.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    for mu, leaf in zip(port.mu, muon_state.plan.leaves, strict=True):
        x = by_path[leaf.path]
        assert mu.shape == x.shape, leaf.path
        assert mu.sharding.is_equivalent_to(x.sharding, x.ndim), (leaf.path, mu.sharding)
    for b in jax.tree.leaves(bias):
        assert np.abs(np.asarray(b)).max() > 0


def test_portable_form_is_the_owner_stacks_reordered(runs):
    """On every mesh (and with a chunked plan), owner row g of a stack is matrix
    ``plan_fingerprint[g]`` of the portable momentum (zero for padding), the round trip
    is bitwise, and the portable form is the same on every mesh up to f32 rounding."""
    for shape in MESHES:
        o5, port = runs[shape]["state5"][3], runs[shape]["port5"]
        state = _muon(o5)
        mats = [mat for m, leaf in zip(_muon(port).mu, state.plan.leaves, strict=True)
                for mat in np.asarray(matrices.to_matrices(jnp.asarray(np.asarray(m)),
                                                        leaf.view))]
        (rows,) = portable.plan_fingerprint(o5)
        for stack, r in zip(state.mu, rows, strict=True):
            stack = np.asarray(stack)
            np.testing.assert_array_equal(
                stack[r >= 0], np.stack([mats[i] for i in r[r >= 0]]), err_msg=str(shape))
            assert not stack[r < 0].any()
        chex.assert_trees_all_equal(from_portable(port, o5), o5, custom_message=str(shape))
        chex.assert_trees_all_close(port, runs[(8,)]["port5"], **TOL, custom_message=str(shape))
    # A plan with several chunks per stack (moved by chunk, stored by stack).
    run = runs[(2, 4)]
    chunked = muon_jax.muon(0.02, sharding=muon_jax.ShardingOptions(
        run["mesh"], chunk_bytes=1)).init(run["state5"][1])
    assert any(len(s.chunks) > 1 for s in _muon(chunked).plan.stacks)
    back = jax.block_until_ready(from_portable(run["port5"], chunked))
    chex.assert_trees_all_equal(to_portable(back), run["port5"])


# One test item per property (not per mesh): under pytest-xdist, items of this module that land
# on two workers would build the (expensive) module fixture twice.


def test_resume_on_same_mesh_is_bitwise(runs):
    for shape in MESHES:
        restored, _, opt_state = _restore(runs, shape, shape)
        (_, params, bias, opt_state, _), losses = _resume(runs, shape, restored, opt_state)
        ref = runs[shape]
        np.testing.assert_array_equal(losses, ref["losses"][STEPS:], err_msg=str(shape))
        _, p10, b10, o10, _ = ref["state10"]
        chex.assert_trees_all_equal(params, p10, custom_message=str(shape))
        chex.assert_trees_all_equal(bias, b10, custom_message=str(shape))
        chex.assert_trees_all_equal(opt_state, o10, custom_message=str(shape))


def test_restore_onto_new_mesh_reads_shards_in_place(runs):
    for src, dst in CROSS:
        _check_restored_shards(runs, src, dst)


def _check_restored_shards(runs, src, dst):
    """Every restored leaf has the destination sharding; each device holds only its shard
    (per-device shape), the values are the saved ones; so do the owner stacks after
    ``restore_state``."""
    restored, target, opt_state = _restore(runs, src, dst)
    devices = set(runs[dst]["mesh"].devices.flat)
    saved = {"params": runs[src]["state5"][1], "bias": runs[src]["state5"][2],
             "opt_state": runs[src]["port5"]}
    saved_leaves = dict(_leaves(saved))
    n_sharded = 0
    for (key, x), t in zip(_leaves(restored), jax.tree.leaves(target), strict=True):
        path = f"{src}->{dst} {key}"
        assert x.shape == t.shape, path
        n_sharded += _assert_in_place(x, t.sharding, devices, path)
        # The saved global value is preserved (gathered here only to compare).
        np.testing.assert_array_equal(
            np.asarray(x), np.asarray(saved_leaves[key]), err_msg=path)
    assert n_sharded >= 6  # expert banks and their momentum are split
    template = _muon(runs[dst]["state5"][3])
    for x, t in zip(_muon(opt_state).mu, template.mu, strict=True):
        assert _assert_in_place(x, t.sharding, devices, f"{src}->{dst} owner stack")


def test_resume_across_meshes_matches_uninterrupted(runs):
    for src, dst in CROSS:
        _check_resume_across(runs, src, dst)


def _check_resume_across(runs, src, dst):
    """After restoring src's step-5 checkpoint on dst, the state equals dst's own step-5
    state (runs agree across meshes up to f32 rounding) and 5 further steps match src's
    uninterrupted run."""
    restored, _, opt_state = _restore(runs, src, dst)
    _, p5, b5, o5, _ = runs[dst]["state5"]
    msg = f"{src} -> {dst}"
    chex.assert_trees_all_close(restored["params"], p5, **TOL, custom_message=msg)
    chex.assert_trees_all_close(restored["bias"], b5, **TOL, custom_message=msg)
    chex.assert_trees_all_close(opt_state, o5, **TOL, custom_message=f"Muon state {msg}")
    (_, params, bias, _, _), losses = _resume(runs, dst, restored, opt_state)
    np.testing.assert_allclose(losses, runs[src]["losses"][STEPS:], **TOL, err_msg=msg)
    _, p10, b10, _, _ = runs[src]["state10"]
    chex.assert_trees_all_close(params, p10, **TOL, custom_message=msg)
    chex.assert_trees_all_close(bias, b10, **TOL, custom_message=msg)


def test_raw_owner_stacks_on_another_mesh_are_caught(runs):
    """Raw owner stacks of (8,) restored onto (2, 4) give momenta to the wrong experts (the bug
    the portable form fixes); check_state says so, naming the stack. Same mesh passes."""
    for src, dst in [((8,), (8,)), ((8,), (2, 4))]:
        o5 = runs[dst]["state5"][3]
        target = {"opt_state": _abstract(o5), "rows": portable.plan_fingerprint(o5)}
        with ocp.StandardCheckpointer() as ckpt:
            raw = ckpt.restore(runs[src]["raw_path"], target)
        if src == dst:
            portable.check_state(raw["opt_state"], raw["rows"])
            continue
        with pytest.raises(ValueError, match=r"stack \d .*w_down.*portable_state"):
            portable.check_state(raw["opt_state"], raw["rows"])
        # The raw momentum is indeed misplaced: far from dst's own step-5 momentum.
        mu, ref = _muon(raw["opt_state"]).mu, _muon(o5).mu
        assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                   for a, b in zip(mu, ref, strict=True)) > 1e-3


class _Banks(nnx.Module):
    """Two expert banks sharded over 'expert' (one stack, two leaves: the mesh-dependent
    order) and a replicated matrix."""

    def __init__(self, mesh, rngs):
        def param(shape, spec):
            x = nnx.initializers.normal(0.1)(rngs.params(), shape)
            return nnx.Param(jax.device_put(x, NamedSharding(mesh, spec)))

        self.a = param((8, 16, 16), P("expert"))
        self.b = param((8, 16, 16), P("expert"))
        self.w = param((16, 16), P())


def _optimizer(shape):
    mesh = tm.make_mesh(shape)
    model = _Banks(mesh, nnx.Rngs(0))
    tx = muon_jax.muon(0.02, newton_schulz=muon_jax.NewtonSchulzOptions(dtype=jnp.float32),
                       sharding=muon_jax.ShardingOptions(mesh))
    return mesh, model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def test_nnx_optimizer_state_moves_between_meshes():
    """portable_state / restore_state work on an ``nnx.Optimizer``'s ``opt_state`` (leaves
    wrapped in ``OptState`` variables) and on its pure form; the momentum survives
    (8,) -> (2, 4) exactly (data movement only)."""
    mesh8, model8, opt8 = _optimizer((8,))
    grads = jax.tree.map(lambda x: jnp.cos(3.0 * x), nnx.state(model8, nnx.Param))
    with jax.set_mesh(mesh8):
        nnx.jit(lambda opt, model, g: opt.update(model, g))(opt8, model8, grads)
        port = to_portable(opt8.opt_state)
        port_pure = to_portable(nnx.as_pure(opt8.opt_state))
    chex.assert_trees_all_equal(nnx.as_pure(port), port_pure)
    mesh24, _, opt24 = _optimizer((2, 4))
    with jax.set_mesh(mesh24):
        new = from_portable(port_pure, nnx.as_pure(opt24.opt_state))
        nnx.update(opt24.opt_state, nnx.state(new))
        wrapped = from_portable(port, opt24.opt_state)
        back = to_portable(nnx.as_pure(opt24.opt_state))
    chex.assert_trees_all_equal(nnx.as_pure(wrapped), nnx.as_pure(opt24.opt_state))
    chex.assert_trees_all_equal(back, port_pure)
    mus = _muon(nnx.as_pure(opt24.opt_state)).mu
    assert any(m.sharding.spec == P(("expert", "data")) for m in mus)
    with pytest.raises(ValueError, match="stack"):
        portable.check_state(nnx.as_pure(opt24.opt_state),
                             portable.plan_fingerprint(nnx.as_pure(opt8.opt_state)))


def test_misuse_is_reported(runs):
    """Wrong trees, other models and tampered fingerprints raise ValueError with the fix."""
    o5 = runs[(8,)]["state5"][3]
    state = _muon(o5)
    port = _muon(runs[(8,)]["port5"])
    with pytest.raises(ValueError, match="portable tree holds ShardedMuonState"):
        portable.restore_state(o5, o5)
    with pytest.raises(ValueError, match="portable momentum leaves"):
        portable.restore_state(port._replace(mu=port.mu[:-1]), state)
    bad = jax.ShapeDtypeStruct((3, 4), jnp.float32)
    with pytest.raises(ValueError, match=f"{state.plan.leaves[0].path}.*shape"):
        portable.restore_state(port._replace(mu=(bad, *port.mu[1:])), state)
    with pytest.raises(ValueError, match="momentum stacks"):
        portable.portable_state(state._replace(mu=state.mu[:-1]))
    with pytest.raises(TypeError, match="one-array wrapper"):
        portable.portable_state(state._replace(mu=((state.mu[0], state.mu[1]),)))
    (rows,) = portable.plan_fingerprint(o5)
    with pytest.raises(ValueError, match="sharded Muon states"):
        portable.check_state(o5, ())
    with pytest.raises(ValueError, match="stacks"):
        portable.check_state(o5, (rows[:-1],))
    with pytest.raises(ValueError, match="saved rows"):
        portable.check_state(o5, ((rows[0][:4], *rows[1:]),))
    tampered = rows[0].copy()
    tampered[[0, -1]] = [10**6, 5]  # beyond every leaf; a matrix where padding belongs
    with pytest.raises(ValueError, match=r"row 0 holds matrix 1000000 .* but .*router"):
        portable.check_state(o5, ((tampered, *rows[1:]),))
    tampered[0] = rows[0][0]
    with pytest.raises(ValueError, match=r"row 7 holds .*w_down/value\[4\] .* but padding"):
        portable.check_state(o5, ((tampered, *rows[1:]),))
