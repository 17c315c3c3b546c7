"""Orbax checkpoints of params, sharded Muon state and MoE balancing biases, across meshes.

One run per mesh ((8,), (2, 4), (4, 2)): 5 steps, save with ``ocp.StandardCheckpointer``,
5 more steps (the uninterrupted reference). Restores use abstract targets
(``jax.ShapeDtypeStruct`` with the *destination* mesh's shardings), so orbax reads every
shard straight onto its device; nothing is assembled on one device.
"""

import math

import _tiny_moe as tm
import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

MESHES = [(8,), (2, 4), (4, 2)]
CROSS = [((8,), (2, 4)), ((8,), (4, 2)), ((2, 4), (8,)), ((4, 2), (8,))]
STEPS = 5


def _abstract(tree):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _leaves(tree):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per mesh: step fn, state after 5 steps, checkpoint path, losses/state after 10."""
    ckpt = ocp.StandardCheckpointer()
    out = {}
    for shape in MESHES:
        mesh = tm.make_mesh(shape)
        graphdef, params, bias, opt_state, tx = tm.build(mesh)
        step_fn = tm.make_step(graphdef, tx)
        state5, losses5 = tm.run(mesh, STEPS, state=(graphdef, params, bias, opt_state, tx),
                                 step_fn=step_fn)
        path = tmp_path_factory.mktemp("ckpt") / "x".join(map(str, shape))
        _, p5, b5, o5, _ = state5
        ckpt.save(path, {"params": p5, "bias": b5, "opt_state": o5})
        ckpt.wait_until_finished()
        state10, losses10 = tm.run(mesh, STEPS, start=STEPS, state=state5, step_fn=step_fn)
        out[shape] = dict(mesh=mesh, step_fn=step_fn, state5=state5, path=path,
                          losses=np.concatenate([losses5, losses10]), state10=state10)
    ckpt.close()
    return out


def _restore(runs, src, dst):
    """Restore src's checkpoint onto dst's mesh, with dst's shardings as targets."""
    _, p5, b5, o5, _ = runs[dst]["state5"]
    target = _abstract({"params": p5, "bias": b5, "opt_state": o5})
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(runs[src]["path"], target)
    return restored, target


def _resume(runs, dst, restored):
    graphdef, *_, tx = runs[dst]["state5"]
    state = (graphdef, restored["params"], restored["bias"], restored["opt_state"], tx)
    return tm.run(runs[dst]["mesh"], STEPS, start=STEPS, state=state,
                  step_fn=runs[dst]["step_fn"])


def test_state_holds_sharded_muon_momentum_and_trained_bias(runs):
    """The checkpoint holds what it should: Muon momentum in owner stacks split 8 ways (1/8
    per device), and balancing biases that training moved away from 0."""
    _, params, bias, opt_state, _ = runs[(2, 4)]["state5"]
    muon_state = opt_state.inner_states["muon"].inner_state[0]
    assert len(muon_state.mu) >= 2
    for mu in muon_state.mu:
        shard = mu.sharding.shard_shape(mu.shape)
        assert shard[0] * 8 == mu.shape[0], (mu.shape, mu.sharding)
    for b in jax.tree.leaves(bias):
        assert np.abs(np.asarray(b)).max() > 0


# One test item per property (not per mesh): under pytest-xdist, items of this module that land
# on two workers would build the (expensive) module fixture twice.


def test_resume_on_same_mesh_is_bitwise(runs):
    for shape in MESHES:
        restored, _ = _restore(runs, shape, shape)
        (_, params, bias, opt_state, _), losses = _resume(runs, shape, restored)
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
    (per-device shape), the values are the saved ones."""
    restored, target = _restore(runs, src, dst)
    devices = set(runs[dst]["mesh"].devices.flat)
    saved = dict(zip(("params", "bias", "opt_state"), runs[src]["state5"][1:4], strict=True))
    saved_leaves = dict(_leaves(saved))
    n_sharded = 0
    for (key, x), t in zip(_leaves(restored), jax.tree.leaves(target), strict=True):
        path = f"{src}->{dst} {key}"
        assert x.sharding == t.sharding, (path, x.sharding, t.sharding)
        per_device = t.sharding.shard_shape(t.shape)
        assert {s.device for s in x.addressable_shards} == devices, path
        for s in x.addressable_shards:
            assert s.data.shape == per_device, (path, s.data.shape, per_device)
        n_sharded += math.prod(per_device) < math.prod(t.shape)
        # The saved global value is preserved (gathered here only to compare).
        np.testing.assert_array_equal(
            np.asarray(x), np.asarray(saved_leaves[key]), err_msg=path)
    assert n_sharded >= 6  # expert banks and all Muon momentum stacks are split


@pytest.mark.xfail(
    strict=True,
    reason="muon_jax bug: the owner-stack order of sharded Muon momentum depends on the mesh "
    "(stacks of >= 2 expert-sharded leaves are concatenated per device before the split), so a "
    "checkpoint restored onto another mesh gives momenta to the wrong experts; see report.",
)
def test_resume_across_meshes_matches_uninterrupted(runs):
    for src, dst in CROSS:
        _check_resume_across(runs, src, dst)


def _check_resume_across(runs, src, dst):
    """After restoring src's step-5 checkpoint on dst, the state equals dst's own step-5
    state (runs agree across meshes up to f32 rounding) and 5 further steps match src's
    uninterrupted run."""
    restored, _ = _restore(runs, src, dst)
    _, p5, b5, o5, _ = runs[dst]["state5"]
    tol = dict(rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(restored["params"], p5, **tol)
    chex.assert_trees_all_close(restored["bias"], b5, **tol)
    chex.assert_trees_all_close(restored["opt_state"], o5, **tol,
                                custom_message=f"Muon state restored {src} -> {dst}")
    (_, params, bias, _, _), losses = _resume(runs, dst, restored)
    np.testing.assert_allclose(losses, runs[src]["losses"][STEPS:], **tol)
    _, p10, b10, _, _ = runs[src]["state10"]
    chex.assert_trees_all_close(params, p10, **tol)
    chex.assert_trees_all_close(bias, b10, **tol)
