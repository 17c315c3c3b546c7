"""The trainer's --muon-reduce-dtype: Muon's gradients arrive unreduced (a reduced view of its
matrices on an Explicit mesh) and Muon sums them in bf16; float32 keeps the Auto-mesh step."""

import sys

import jax
import numpy as np
import pytest
from _paths import ROOT
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(ROOT / "examples"))

import train_lm  # noqa: E402

import muon_jax  # noqa: E402

# As test_train_lm.TINY, Muon only.
TINY = [
    "--d-model", "64", "--layers", "1", "--heads", "2", "--d-ff", "32", "--experts", "4",
    "--batch", "8", "--seq-len", "16", "--eval-batches", "1", "--max-corpus-mb", "0.5",
    "--fp8-block-size", "16", "--warmup", "2", "--no-progress", "--optimizer", "muon",
]


def _one_step(reduce_dtype: str):
    """Loss, Muon-mask, params before and after, and the gradients' unreduced axes, of one
    step on a fixed batch."""
    args = train_lm.parse_args([*TINY, "--muon-reduce-dtype", reduce_dtype, "--steps", "1"])
    mesh = train_lm.build_mesh(None, explicit=train_lm.unreduced_grads(args))
    model, optimizer = train_lm.create("muon", args, mesh)
    tokens = np.random.default_rng(0).integers(0, 256, (8, 17), dtype=np.int32)
    batch = jax.device_put(tokens, NamedSharding(mesh, P(train_lm.MESH_AXES, None)))
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    with jax.set_mesh(mesh):
        if train_lm.unreduced_grads(args):
            m = train_lm.train_step_unreduced(model, optimizer, batch, args.aux_loss,
                                              args.z_loss, args.router_optimizer)
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)

            def grads(p, rest, batch):  # the step's gradients, as Muon receives them
                loss = lambda q: train_lm.loss_terms(nnx.merge(graphdef, q, rest), batch,
                                                     args.aux_loss, args.z_loss)[0]
                return jax.grad(loss)(train_lm.reduced_muon_view(p, args.router_optimizer))

            unreduced = jax.tree.map(lambda x: ",".join(sorted(muon_jax.dp.unreduced_axes(x))),
                                     nnx.to_pure_dict(jax.eval_shape(grads, params, rest, batch)))
        else:
            m = train_lm.train_step(model, optimizer, batch, args.aux_loss, args.z_loss)
            unreduced = None
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    mask = nnx.to_pure_dict(muon_jax.default_muon_mask(nnx.state(model, nnx.Param)))
    return float(m["loss"]), mask, before, after, unreduced


@pytest.fixture(scope="module")
def both():
    return {dt: _one_step(dt) for dt in ("float32", "bfloat16")}


def test_bf16_reduce_matches_f32_step(both):
    loss32, mask, before32, after32, none = both["float32"]
    loss16, _, before16, after16, _ = both["bfloat16"]
    assert none is None
    # The forward is the same computation on the same init (up to an ulp, below): only where
    # the gradients are summed changes, after the loss.
    print(f"first-step loss f32 {loss32!r}, bf16 {loss16!r}")
    assert loss16 == pytest.approx(loss32, rel=1e-6)
    flat = lambda t: dict(jax.tree_util.tree_leaves_with_path(t))
    mask, b32, b16 = flat(mask), flat(before32), flat(before16)
    for path, new32 in flat(after32).items():
        # The same init up to an ulp: the init program compiles differently on an Explicit
        # mesh (w_down's normal draws differ in the last bit).
        np.testing.assert_allclose(b16[path], b32[path], rtol=2.5e-7, atol=0)
        d32, d16 = new32 - b32[path], flat(after16)[path] - b16[path]
        err = np.linalg.norm(d16 - d32) / np.linalg.norm(d32)
        # Muon's matrices: each device's partial sum rounds to bf16 (2^-9 relative) before
        # the sum, where the partials (8 for attention, 2 for expert banks) partly cancel,
        # and Newton-Schulz (bf16 matmuls) turns that into a few percent of the update: 8
        # devices of cancelling partials moved muon_jax's own test step by about 5%
        # (tests/muon_jax/test_muon_sharded.py). AdamW's leaves are all-reduced in f32 in
        # both runs (only the summation order may differ).
        tol = 0.1 if mask[path] else 1e-4
        print(f"{jax.tree_util.keystr(path)}: relative update difference {err:.2e}")
        assert err < tol, (jax.tree_util.keystr(path), err)


def test_bf16_reduce_gradients_arrive_unreduced(both):
    unreduced = jax.tree_util.tree_leaves_with_path(both["bfloat16"][4])
    by_name = {jax.tree_util.keystr(p): axes for p, axes in unreduced}
    assert len(by_name) == 10, by_name
    for name, axes in by_name.items():
        if "attn']['qkv" in name or "attn']['out" in name:  # replicated: batch over both axes
            assert axes == "data,expert", name
        elif "w_gate_up" in name or "w_down" in name:  # sharded over 'expert'
            assert axes == "data", name
        else:  # router kernels (moe's shard_map takes them replicated) and AdamW's leaves
            assert axes == "", name


def test_bf16_reduce_needs_muon(capsys):
    for opt in ("adamw", "both"):
        assert train_lm.main([*TINY, "--optimizer", opt, "--muon-reduce-dtype", "bfloat16",
                              "--out", "/nonexistent/never-written"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "needs --optimizer muon" in err, err


def test_bf16_reduce_trains_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert train_lm.main([*TINY, "--muon-reduce-dtype", "bfloat16", "--steps", "2",
                          "--ckpt-every", "0", "--out", str(out)]) == 0
    assert "validation loss" in capsys.readouterr().out
