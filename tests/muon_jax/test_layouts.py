"""Muon on Flax's own layers: each kernel's matrix view comes from its layer (the NNX module
graph, Linen's auto-named paths, moe's bank names) with no user code, and the update of each
kernel is the SVD polar factor of its true reshaping, unsharded and sharded. Default views of
rank >= 3 leaves warn, naming the leaf; vectors stored as matrices go to AdamW."""

import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe
import muon_jax
from muon_jax import MuonDimensionNumbers as MDN
from muon_jax import SplitDimensionNumbers as Split
from muon_jax.matrices import is_dim_nums_leaf, path_str

# beta = 0 without Nesterov: the direction is Newton-Schulz of the gradient itself; Polar
# Express's 10 float32 steps put every singular value in [0.999, 1.001] (orthogonalize's
# bands), so the update is the polar factor to about 1e-3.
EXACT = dict(ns_coeffs="polar_express", ns_steps=10, beta=0.0, nesterov=False,
             shape_scaling=None, newton_schulz=muon_jax.NewtonSchulzOptions(dtype=jnp.float32))
POLAR_TOL = 2e-3


class Zoo(nnx.Module):
    """One layer of each kind, as Flax builds them."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(8, 12, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8,
                                           decode=False, rngs=rngs)
        self.ein = nnx.Einsum("btd,dnh->btnh", (8, 2, 4), rngs=rngs)
        self.conv = nnx.Conv(3, 6, kernel_size=(3, 3), rngs=rngs)
        self.gconv = nnx.Conv(4, 6, kernel_size=(2, 2), feature_group_count=2, rngs=rngs)
        self.stack = nnx.vmap(lambda r: nnx.Linear(8, 12, rngs=r))(rngs.split(3))
        self.moe = moe.MoE(8, 6, options=moe.MoEOptions.create(4, 2), mesh=None, rngs=rngs)
        self.gate = nnx.Linear(8, 1, use_bias=False, rngs=rngs)  # a vector: AdamW


# Each kernel's true matrices, as a [B, m, n] reshaping of an array of its shape.
TRUE = {
    "lin/kernel": lambda g: g[None],
    "attn/query/kernel": lambda g: g.reshape(1, 8, 8),  # [d, heads, head_dim]: one map
    "attn/key/kernel": lambda g: g.reshape(1, 8, 8),
    "attn/value/kernel": lambda g: g.reshape(1, 8, 8),
    "attn/out/kernel": lambda g: g.reshape(1, 8, 8),  # [heads, head_dim, d]
    "ein/kernel": lambda g: g.reshape(1, 8, 8),  # 'btd,dnh->btnh': d in, (n, h) out
    "conv/kernel": lambda g: g.reshape(1, 27, 6),  # [kh, kw, c_in, c_out]
    "gconv/kernel": lambda g: g.reshape(8, 2, 3).transpose(1, 0, 2),  # one per group
    "stack/kernel": lambda g: g,  # nnx.vmap: 3 layers
    "moe/w_gate_up": lambda g: g.reshape(4, 8, 2, 6).transpose(0, 2, 1, 3).reshape(8, 8, 6),
    "moe/w_down": lambda g: g,
    "moe/router_kernel": lambda g: g[None],
}


def _zoo(module=Zoo, seed=0):
    """The module as Flax builds it (its layers, shapes and metadata), with host-RNG values:
    Flax's eager initializers would compile a program per initializer and shape, and Muon's
    updates here (weight decay 0) depend on the gradients only."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: module(nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), state)
    return nnx.merge(graphdef, state)


def _polar(a):
    u, _, vt = np.linalg.svd(a, full_matrices=False)
    return u @ vt


def _flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_dim_nums_leaf)[0]
    return {path_str(p).removesuffix("/value"): x for p, x in leaves}


def _check_polar(updates, grads, keys):
    """Each kernel's update is minus the polar factor of its gradient's true matrices."""
    u, g = _flat(updates), _flat(grads)
    for k in keys:
        got = TRUE[k](-np.asarray(u[k], np.float64))
        want = np.stack([_polar(m) for m in TRUE[k](np.asarray(g[k], np.float64))])
        np.testing.assert_allclose(got, want, atol=POLAR_TOL, err_msg=k)


def test_flax_dimension_numbers_reads_each_layer():
    # The views come from the module graph and shapes: an abstract Zoo (no initializers run).
    dims = _flat(muon_jax.flax_dimension_numbers(nnx.eval_shape(lambda: Zoo(nnx.Rngs(0)))))
    assert dims["attn/query/kernel"] == MDN((0,), (1, 2))
    assert dims["attn/out/kernel"] == MDN((0, 1), (2,))
    assert dims["ein/kernel"] == MDN((0,), (1, 2))
    assert dims["conv/kernel"] == MDN((0, 1, 2), 3)
    assert dims["gconv/kernel"] == Split((0, 1, 2), 3, split_axis=3, parts=2)
    assert dims["stack/kernel"] == MDN(1, 2)  # the stack axis: a batch
    assert dims["moe/w_gate_up"] == Split(1, 2, split_axis=2, parts=2)
    assert dims["moe/w_down"] == MDN(1, 2)
    assert dims["lin/bias"] is None
    # A stack axis elsewhere than first (nnx.vmap's out_axes) is found by shape; nnx.scan
    # stacks like nnx.vmap.
    inner = nnx.eval_shape(lambda: nnx.vmap(lambda r: nnx.Linear(8, 12, rngs=r), out_axes=1)(
        nnx.Rngs(0).split(3)))
    assert muon_jax.flax_dimension_numbers(inner)["kernel"] == MDN(0, 2)
    scanned = nnx.eval_shape(lambda: nnx.scan(
        lambda c, r: (c, nnx.Linear(8, 12, rngs=r)), in_axes=(nnx.Carry, 0),
        out_axes=(nnx.Carry, 0))(0, nnx.Rngs(0).split(3))[1])
    assert muon_jax.flax_dimension_numbers(scanned)["kernel"] == MDN(1, 2)


@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "sharded"])
def test_muon_through_nnx_optimizer_is_each_kernels_polar_factor(sharded):
    model = _zoo()
    sharding, place = None, lambda path, x: x
    if sharded:  # replicated params, expert banks split over 'expert' (as moe places them)
        mesh = jax.make_mesh((2, 4), ("data", "expert"))

        def place(path, x):
            bank = path_str(path).startswith(("moe/w_gate_up", "moe/w_down"))
            return jax.device_put(x, NamedSharding(mesh, P("expert") if bank else P()))

        nnx.update(model, jax.tree_util.tree_map_with_path(place, nnx.state(model, nnx.Param)))
        sharding = muon_jax.ShardingOptions(mesh)
    tx = muon_jax.muon(1.0, **EXACT, sharding=sharding)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no guessed view: every kernel's is read
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    muon_state = optimizer.opt_state.inner_states["muon"].inner_state[0]
    adamw_only = {"gate/kernel", "moe/shared_gate"}
    assert not adamw_only & set(_flat(nnx.state(muon_state)))
    rng = np.random.default_rng(0)
    grads = jax.tree_util.tree_map_with_path(
        lambda p, x: place(p, jnp.asarray(rng.standard_normal(x.shape), x.dtype)),
        nnx.state(model, nnx.Param))
    updates = nnx.jit(lambda opt, m, g: opt.update(m, g))(optimizer, model, grads)
    _check_polar(updates, grads, TRUE)
    if sharded:
        assert _flat(updates)["moe/w_gate_up"].sharding.spec[0] == "expert"


class LinenZoo(nn.Module):
    @nn.compact
    def __call__(self, x):  # [batch, time, 8]
        x = nn.MultiHeadDotProductAttention(num_heads=2)(x)
        x = nn.Dense(8)(x)
        return nn.Conv(6, (3,))(x)


def _kernels(tree):
    """The tree without its biases (scale_by_muon takes matrices only)."""
    if isinstance(tree, dict):
        return {k: _kernels(v) for k, v in tree.items() if k != "bias"}
    return tree


def test_linen_params_get_their_views_from_auto_named_paths():
    # Linen's auto-named tree and shapes (no initializers run); values from the host RNG.
    params = jax.eval_shape(lambda: LinenZoo().init(jax.random.key(0), jnp.ones((1, 4, 8))))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), params)
    dims = _flat(muon_jax.flax_dimension_numbers(params))
    assert dims["params/MultiHeadDotProductAttention_0/query/kernel"] == MDN(0, (1, 2))
    assert dims["params/MultiHeadDotProductAttention_0/out/kernel"] == MDN((0, 1), 2)
    assert dims["params/Conv_0/kernel"] == MDN((0, 1), 2)
    assert dims["params/Dense_0/bias"] is None
    kernels = _kernels(params)
    tx = muon_jax.scale_by_muon(**EXACT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every rank-3 kernel's view is read from its path
        state = tx.init(kernels)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), kernels)
    u, g = _flat(jax.jit(tx.update)(grads, state)[0]), _flat(grads)
    for k, shape in (("params/MultiHeadDotProductAttention_0/query/kernel", (8, 8)),
                     ("params/MultiHeadDotProductAttention_0/out/kernel", (8, 8)),
                     ("params/Conv_0/kernel", (24, 6))):
        np.testing.assert_allclose(np.asarray(u[k]).reshape(shape),
                                   _polar(np.asarray(g[k], np.float64).reshape(shape)),
                                   atol=POLAR_TOL, err_msg=k)


def test_default_views_of_rank_3_leaves_warn_naming_them():
    params = {"w": jnp.ones((3, 4, 5)), "m": jnp.ones((4, 5)), "embed": jnp.ones((2, 4, 5))}
    with pytest.warns(UserWarning, match=r"Muon leaf 'w' \(3, 4, 5\).*dimension_numbers="):
        muon_jax.muon(0.1).init(params)  # 'embed' is AdamW's: not named
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # explicit views (one confirming the default) win
        muon_jax.muon(0.1, dimension_numbers={"w": MDN(-2, -1), "m": None,
                                              "embed": None}).init(params)
        tx = muon_jax.scale_by_muon(dimension_numbers={"w": MDN((0, 1), 2), "m": None})
        state = tx.init({"w": params["w"], "m": params["m"]})
    assert state.views.views[1].m == 12  # 'w' as one [12, 5] matrix, from the init's view


def test_vectors_stored_as_matrices_go_to_adamw():
    params = {"gate": jnp.ones((8, 1)), "row": jnp.ones((1, 8)), "one": jnp.ones((1, 1)),
              "w": jnp.ones((8, 8))}
    assert muon_jax.default_muon_mask(params) == {"gate": False, "one": False, "row": False,
                                                 "w": True}
    state = muon_jax.muon(0.1).init(params)
    mu = state.inner_states["muon"].inner_state[0].mu
    assert [k for k, v in mu.items() if not isinstance(v, optax.MaskedNode)] == ["w"]


def test_split_views_on_a_sharded_fused_axis_are_refused():
    mesh = jax.make_mesh((8,), ("d",))
    w = {"w_gate_up": jax.device_put(jnp.ones((4, 8, 16)), NamedSharding(mesh, P(None, None,
                                                                                 "d")))}
    with pytest.raises(ValueError, match=r"'w_gate_up': dim 2 holds 2 fused matrices"):
        muon_jax.scale_by_muon(sharding=muon_jax.ShardingOptions(mesh)).init(w)


def test_split_dimension_numbers_view_fused_qkv_as_three_matrices():
    rng = np.random.default_rng(2)
    g = {"qkv": jnp.asarray(rng.standard_normal((8, 24)), jnp.float32)}
    tx = muon_jax.scale_by_muon(**EXACT, dimension_numbers=Split(0, 1, split_axis=1, parts=3))
    u = np.asarray(jax.jit(tx.update)(g, tx.init(g))[0]["qkv"])
    for i in range(3):  # q, k and v: each its own polar factor
        part = slice(8 * i, 8 * (i + 1))
        chex.assert_trees_all_close(u[:, part], _polar(np.asarray(g["qkv"])[:, part]),
                                    atol=POLAR_TOL)


class FusedQKV(nnx.Module):
    """A layer declaring that its sublayer's fused kernel holds three maps."""

    def __init__(self, rngs: nnx.Rngs):
        self.qkv = nnx.Linear(8, 24, use_bias=False, rngs=rngs)

    def matrix_views(self):
        return {"qkv.kernel": (0, 1, 3)}


def test_a_layer_declares_its_sublayers_fused_kernel():
    """A declared view (here of a sublayer's kernel, by a dotted name) wins over the
    sublayer's own, through nnx.Optimizer too: q, k and v are each their polar factor."""
    model = _zoo(FusedQKV)
    assert muon_jax.flax_dimension_numbers(model)["qkv"]["kernel"] == Split(
        0, 1, split_axis=1, parts=3)
    opt = nnx.Optimizer(model, muon_jax.muon(1.0, **EXACT), wrt=nnx.Param)
    g = jnp.asarray(np.random.default_rng(1).standard_normal((8, 24)), jnp.float32)

    @nnx.jit  # one program (eager, every op of the update compiles its own)
    def step(opt, model, g):
        grads = nnx.grad(lambda m: jnp.sum(m.qkv.kernel[...] * g))(model)
        return opt.update(model, grads)

    updates = step(opt, model, g)
    got = -np.asarray(updates["qkv"]["kernel"], np.float64).reshape(8, 3, 8).transpose(1, 0, 2)
    want = np.stack([_polar(m) for m in np.asarray(g, np.float64).reshape(8, 3, 8)
                     .transpose(1, 0, 2)])
    np.testing.assert_allclose(got, want, atol=POLAR_TOL)
