"""Non-finite values: a NaN in one gradient shard is caught and the step skipped without a trace
(optax.apply_if_finite and muon_jax.loss_scale.dynamic_loss_scale around sharded Muon); an
inf token through FP8 dispatch never becomes a finite wrong value.
"""

import functools
import math

import _tiny_moe as tm
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import moe
from muon_jax import loss_scale

MESH = (2, 4)
# Poison targets (flag value -> leaf): one element, so only the device holding that shard sees
# a NaN. 1: expert 5 of block 0's w_gate_up (Muon, sharded over 'expert'); 2: block 1's proj
# kernel (Muon, replicated: one owner device orthogonalizes it); 3: the head (AdamW).
TARGETS = {1: ("[0]", "w_gate_up", (5, 3, 7)), 2: ("[1]", "proj", (2, 9)),
           3: ("", "head", (4, 1))}


def _poison(grads, flag):
    def f(path, g):
        key = jax.tree_util.keystr(path)
        for value, (block, name, idx) in TARGETS.items():
            if name in key and (not block or f"['blocks']{block}" in key):
                g = g.at[idx].set(jnp.where(flag == value, jnp.nan, g[idx]))
        return g

    return jax.tree_util.tree_map_with_path(f, grads)


def _setup(wrap, **step_kw):
    mesh = tm.make_mesh(MESH)
    tx = wrap(tm.make_tx(mesh))
    graphdef, params, bias, opt_state, tx = tm.build(mesh, tx=tx)
    step = tm.make_step(graphdef, tx, poison=_poison, **step_kw)
    with jax.set_mesh(mesh):
        for i in range(2):  # some momentum first
            params, bias, opt_state, _ = step(params, bias, opt_state, tm.tokens(i, 0, mesh), 0)
    return mesh, step, (params, bias, opt_state)


def _check_skip_then_resume(mesh, step, state, flags):
    params, bias, opt_state = state
    with jax.set_mesh(mesh):
        batch2, batch3 = tm.tokens(2, 0, mesh), tm.tokens(3, 0, mesh)
        # Uninterrupted reference: the step after the (skipped) bad one, from the same state.
        ref_p, _, ref_o, ref_loss = step(params, bias, opt_state, batch3, 0)
        for flag in flags:
            p1, _, o1, loss = step(params, bias, opt_state, batch2, flag)
            assert np.isfinite(loss)  # the forward pass is fine; only a gradient shard is bad
            chex.assert_trees_all_equal(p1, params)  # bitwise: nothing moved
            chex.assert_trees_all_equal(o1.inner_state, opt_state.inner_state)
            yield o1
            # The next finite step proceeds as if the bad step never happened.
            p2, _, o2, loss2 = step(p1, bias, o1, batch3, 0)
            assert loss2 == ref_loss
            chex.assert_trees_all_equal(p2, ref_p)
            chex.assert_trees_all_equal(o2.inner_state, ref_o.inner_state)
            chex.assert_tree_all_finite(p2)


def test_apply_if_finite_skips_nan_in_one_gradient_shard():
    mesh, step, state = _setup(lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=3))
    opt_state = state[2]
    seen = 0
    for o1 in _check_skip_then_resume(mesh, step, state, TARGETS):
        assert int(o1.notfinite_count) == 1 and not bool(o1.last_finite)
        assert int(o1.total_notfinite) == int(opt_state.total_notfinite) + 1
        seen += 1
    assert seen == len(TARGETS)


def test_dynamic_loss_scale_skips_nan_and_lowers_scale():
    mesh, step, state = _setup(
        lambda tx: loss_scale.dynamic_loss_scale(tx, init_scale=2.0**12, growth_interval=1000),
        scale_loss=loss_scale.scale_loss,
    )
    opt_state = state[2]
    assert float(opt_state.scale) == 2.0**12 and int(opt_state.good_steps) == 2
    seen = 0
    for o1 in _check_skip_then_resume(mesh, step, state, TARGETS):
        assert float(o1.scale) == 2.0**11  # backoff 0.5
        assert int(o1.skipped) == 1 and int(o1.good_steps) == 0
        seen += 1
    assert seen == len(TARGETS)


# ----------------------------------------------------------------------------- FP8 dispatch

D, F, E, K, BLOCK = 64, 32, 8, 2, 16  # FP8 needs d_model % (4 * BLOCK) == 0
T_ALL = 64
BAD_ROW, BAD_COL = 11, 5  # one token, one channel; block 0 of that row holds it


def _dispatch_layer(x, ids, w, wgu, wd):
    """dispatch (FP8 wire) -> SwiGLU experts (padded einsum) -> combine, in shard_map."""
    ex, _, plan = moe.dispatch(x, ids, num_experts=E, axis_name="expert",
                               dispatch_dtype="fp8", block_size=BLOCK)
    h = jnp.einsum("ecd,edf->ecf", ex.astype(jnp.float32), wgu)
    g, u = jnp.split(h, 2, axis=-1)
    ey = jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, wd)
    return moe.combine(ey, w, plan, combine_grad_dtype="fp8")


@functools.cache
def _fp8_case():
    """One compiled fwd+bwd of dispatch/experts/combine on 8 devices, its inputs and clean
    outputs (shared by the parametrizations below)."""
    mesh = Mesh(np.array(jax.devices()), ("expert",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T_ALL, D)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(T_ALL)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.2, 0.8, (T_ALL, K)), jnp.float32)
    wgu = jnp.asarray(rng.standard_normal((E, D, 2 * F)) / math.sqrt(D), jnp.float32)
    wd = jnp.asarray(rng.standard_normal((E, F, D)) / math.sqrt(F), jnp.float32)
    tok = P("expert")
    layer = jax.shard_map(_dispatch_layer, mesh=mesh, in_specs=(tok, tok, tok, tok, tok),
                          out_specs=tok)

    @jax.jit
    def fwd_bwd(x, ct):
        y, vjp = jax.vjp(lambda x: layer(x, ids, w, wgu, wd), x)
        return y, vjp(ct)[0]

    ct = jnp.ones((T_ALL, D), jnp.float32)
    y0, dx0 = fwd_bwd(x, ct)
    chex.assert_tree_all_finite((y0, dx0))
    return fwd_bwd, x, ct, np.asarray(y0), np.asarray(dx0)


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan], ids=["inf", "-inf", "nan"])
def test_fp8_dispatch_keeps_nonfinite_token_nonfinite(bad):
    """Router weights finite, one token holds +-inf/NaN in one channel: its FP8 block gets the
    E8M0 NaN scale, so its output row (through the experts' matmuls) is non-finite, never a
    saturated finite value; every other token's output is bitwise unchanged. Backward: a
    non-finite entry in one token's output cotangent (sent back as FP8 too, combine_grad_dtype
    ='fp8') makes that token's dx non-finite and leaves the other tokens' dx bitwise as is."""
    fwd_bwd, x, ct, y0, dx0 = _fp8_case()
    others = np.arange(T_ALL) != BAD_ROW
    y, _ = fwd_bwd(x.at[BAD_ROW, BAD_COL].set(bad), ct)
    y = np.asarray(y)
    assert not np.isfinite(y[BAD_ROW]).any(), y[BAD_ROW]
    np.testing.assert_array_equal(y[others], y0[others])
    _, dx = fwd_bwd(x, ct.at[BAD_ROW, BAD_COL].set(bad))
    dx = np.asarray(dx)
    assert not np.isfinite(dx[BAD_ROW]).any(), dx[BAD_ROW]
    np.testing.assert_array_equal(dx[others], dx0[others])


def test_moe_layer_with_fp8_dispatch_inf_token():
    """Through moe.MoE (dispatch_dtype='fp8'): the inf token's output row is non-finite (its
    router logits are non-finite too), the other tokens' outputs are bitwise those of the clean
    batch, and the auxiliary router losses turn NaN, so a loss built on them is non-finite
    and apply_if_finite / loss scaling skip the step instead of training on a wrong value."""
    mesh = tm.make_mesh(MESH)
    layer = moe.MoE(D, F, options=moe.MoEOptions.create(E, K, dispatch_dtype="fp8",
                                                      fp8_block_size=BLOCK),
                    mesh=mesh, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 16, D))
    f = nnx.jit(lambda m, x: m(x))
    with jax.set_mesh(mesh):
        y0, aux0 = f(layer, x)
        y, aux = f(layer, x.at[1, 5, BAD_COL].set(jnp.inf))
    y, y0 = np.asarray(y).reshape(-1, D), np.asarray(y0).reshape(-1, D)
    bad = 1 * 16 + 5
    assert not np.isfinite(y[bad]).any()
    others = np.arange(y.shape[0]) != bad
    np.testing.assert_array_equal(y[others], y0[others])
    assert np.isfinite(float(aux0["load_balance_loss"]))
    assert not np.isfinite(float(aux["load_balance_loss"]))
    assert not np.isfinite(float(aux["router_z_loss"]))
    assert int(aux["tokens_per_expert"].sum()) == 4 * 16 * K  # every slot still counted
