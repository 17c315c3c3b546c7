"""scale_by_muon / muon against optax.contrib, routing, NNX training and error messages."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import muon_jax
from muon_jax import MuonDimensionNumbers as MDN
from muon_jax import newton_schulz
from muon_jax.matrices import path_str

# The stacks here are plain arrays meant as batches of matrices: the default view is right.
pytestmark = pytest.mark.filterwarnings("ignore:muon_jax. no layer gives the matrix view")

F32 = muon_jax.NewtonSchulzOptions(dtype=jnp.float32)
# Few Newton-Schulz steps, on both sides, where scaling, routing, masks or views are the point,
# not the iteration (test_orthogonalize, test_gram_ns and test_optax_port prove it, and
# test_scale_by_muon_matches_optax keeps optax's 5): they shrink the compiled update programs.
NS = dict(ns_steps=1)

# Leaves of odd shapes: wide, tall, square, tiny, a stack [L, m, n], a conv kernel, and a leaf
# whose reduction axis comes after its output axis.
SHAPES = {
    "wide": (6, 10),
    "tall": (10, 6),
    "square": (8, 8),
    "row": (1, 7),
    "tiny": (3, 2),
    "stacked": (3, 5, 7),
    "conv": (3, 3, 4, 8),
    "swapped": (5, 3, 4),
}
DIMS = {  # optax needs dimension numbers for every leaf; ours defaults 2-D leaves (None)
    "stacked": MDN(reduction_axis=1, output_axis=2),
    "conv": MDN(reduction_axis=(0, 1, 2), output_axis=3),
    "swapped": MDN(reduction_axis=2, output_axis=0),
}
STEPS = 5
# An explicit per-step schedule (optax's 'dion' preset). Polar Express is compared through
# orthogonalize's bands instead: its first step (|b| ~ 23) amplifies float32 rounding so much
# that optax itself, vmapped vs per matrix, differs by 2e-5 on a 1x7 leaf.
DION_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


def _optax_dims():
    return {k: DIMS.get(k, MDN()) for k in SHAPES}


def _our_dims():
    return {k: DIMS.get(k) for k in SHAPES}


def _normal(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _grads(seed=0, steps=STEPS):
    rng = np.random.default_rng(seed)
    return {k: _normal(rng, (steps, *shape)) for k, shape in SHAPES.items()}


def _run(tx, grads):
    """Updates of `tx` over a scan of gradient steps (one compile per transform)."""
    params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:]), grads)

    def body(state, g):
        u, state = tx.update(g, state, params)
        return state, u

    return jax.jit(lambda g: jax.lax.scan(body, tx.init(params), g)[1])(grads)


def _fan(shape, dims):
    dims = dims or MDN(len(shape) - 2, len(shape) - 1)
    red = (dims.reduction_axis,) if isinstance(dims.reduction_axis, int) else dims.reduction_axis
    out = (dims.output_axis,) if isinstance(dims.output_axis, int) else dims.output_axis
    return math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)


def _scaled(updates, factor):
    return {k: u * factor(*_fan(SHAPES[k], DIMS.get(k))) for k, u in updates.items()}


@pytest.mark.parametrize(
    "ns_coeffs,beta,eps,nesterov,shape_scaling",
    [
        ("jordan", 0.95, 1e-8, True, None),
        (DION_COEFFS, 0.9, 1e-7, False, "spectral"),
    ],
    ids=["jordan-nesterov", "per_step-plain-spectral"],
)
def test_scale_by_muon_matches_optax(ns_coeffs, beta, eps, nesterov, shape_scaling):
    coeffs = newton_schulz.resolve_ns_coeffs(ns_coeffs, 5)
    ours = muon_jax.scale_by_muon(
        ns_coeffs, 5, beta, eps, nesterov=nesterov, newton_schulz=F32,
        shape_scaling=shape_scaling, dimension_numbers=_our_dims(),
    )
    ref = optax.contrib.scale_by_muon(
        coeffs if ns_coeffs != "jordan" else coeffs[0], 5, beta, eps, nesterov=nesterov,
        weight_dimension_numbers=_optax_dims(),
    )
    grads = _grads()
    got, want = _run(ours, grads), _run(ref, grads)
    if shape_scaling == "spectral":  # optax's rule, applied by optax.contrib.muon after NS
        want = _scaled(want, lambda fan_in, fan_out: math.sqrt(max(1.0, fan_out / fan_in)))
    # Entries are O(0.1..1); atol 1e-5 is rtol 1e-5 at the matrix's scale, for entries that
    # cancel to near zero (batched vs vmapped matmuls round differently).
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_equal_shapes(got, grads)


def test_rms_match_scaling_mu_dtype_and_callable_dims():
    keys = ("row", "stacked", "conv")
    dims_fn = lambda p: {k: DIMS.get(k) for k in p}  # dimension numbers from a callable
    tx = muon_jax.scale_by_muon(newton_schulz=F32, shape_scaling="rms_match", **NS,
                                mu_dtype=jnp.bfloat16, dimension_numbers=dims_fn)
    plain = muon_jax.scale_by_muon(newton_schulz=F32, shape_scaling=None, **NS,
                                   mu_dtype=jnp.bfloat16, dimension_numbers=dims_fn)
    grads = {k: g[0] for k, g in _grads(1, steps=1).items() if k in keys}
    state = tx.init(jax.tree.map(jnp.zeros_like, grads))
    assert all(m.dtype == jnp.bfloat16 for m in jax.tree.leaves(state.mu))

    @jax.jit
    def both(g, state):
        return tx.update(g, state), plain.update(g, state)[0]

    (got, new_state), want = both(grads, state)
    want = _scaled(want, lambda m, n: 0.2 * math.sqrt(max(m, n)))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(m.dtype == jnp.bfloat16 for m in jax.tree.leaves(new_state.mu))
    assert int(new_state.count) == 1


def test_masked_and_none_leaves_pass_through():
    tx = muon_jax.scale_by_muon(newton_schulz=F32, **NS)
    params = {"w": jnp.ones((4, 6)), "skip": optax.MaskedNode(), "none": None}
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(  # one program (eager, each op compiles its own)
        {"w": jnp.ones((4, 6)), "skip": optax.MaskedNode(), "none": None}, state)
    assert isinstance(updates["skip"], optax.MaskedNode) and updates["none"] is None
    chex.assert_shape(updates["w"], (4, 6))


# ----------------------------------------------------------------------------- muon composition


def _routing_tree():
    z = jnp.zeros
    return {
        "embed": {"embedding": z((16, 8))},
        "lm_head": {"kernel": z((8, 16))},
        "mlp": {"kernel": z((8, 12)), "bias": z((12,))},
        "layers": {"attn": z((3, 8, 8)), "norm": {"scale": z((3, 8))}},
        "wpe": z((4, 8)),
        "gain": z(()),
        "steps": jnp.zeros((4, 4), jnp.int32),
    }


DEFAULT_ROUTE = {
    "embed": {"embedding": False},
    "lm_head": {"kernel": False},
    "mlp": {"kernel": True, "bias": False},
    "layers": {"attn": True, "norm": {"scale": False}},
    "wpe": False,
    "gain": False,
    "steps": False,
}


def _muon_leaves(opt_state):
    """Param paths whose momentum lives in the 'muon' partition of an optimizer state."""
    found = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        p = path_str(path)
        if "inner_states/muon/" in p and "/mu/" in p:
            found.add(p.split("/mu/", 1)[1].removesuffix("/value"))
    return found


def _paths_where(mask):
    return {path_str(p) for p, v in jax.tree_util.tree_flatten_with_path(mask)[0] if v}


def test_default_routing_on_dict_tree():
    params = _routing_tree()
    assert muon_jax.default_muon_mask(params) == DEFAULT_ROUTE
    state = muon_jax.muon(0.1, muon_mask=None).init(
        {k: v for k, v in params.items() if k != "steps"}  # AdamW cannot take int leaves
    )
    assert _muon_leaves(state) == {"mlp/kernel", "layers/attn"}


def test_muon_mu_dtype_sets_muon_momentum_only():
    params = {k: v for k, v in _routing_tree().items() if k != "steps"}
    state = muon_jax.muon(0.1, mu_dtype=jnp.bfloat16).init(params)
    muon_mu = state.inner_states["muon"].inner_state[0].mu
    adam_mu = state.inner_states["adamw"].inner_state[0].mu
    assert {x.dtype for x in jax.tree.leaves(muon_mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam_mu)} == {jnp.dtype(jnp.float32)}


def test_dimension_numbers_route_to_muon():
    params = {"embed": jnp.zeros((3, 4, 5)), "w": jnp.zeros((4, 4))}
    dims = {"embed": MDN(reduction_axis=(0, 1), output_axis=2), "w": None}
    mask = muon_jax.default_muon_mask(params, dimension_numbers=dims)
    assert mask == {"embed": True, "w": True}


def test_user_mask_overrides_default():
    params = {k: v for k, v in _routing_tree().items() if k != "steps"}
    tree_mask = {  # a prefix tree: one flag for a whole subtree
        "embed": True, "lm_head": False, "mlp": False, "layers": {"attn": False,
        "norm": False}, "wpe": True, "gain": False,
    }
    assert _muon_leaves(muon_jax.muon(0.1, muon_mask=tree_mask).init(params)) == {
        "embed/embedding", "wpe"}
    by_rank = lambda p: jax.tree.map(lambda x: x.ndim == 3, p)
    assert _muon_leaves(muon_jax.muon(0.1, muon_mask=by_rank).init(params)) == {"layers/attn"}


def _flat(tree):
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_muon_equals_its_reference_composition():
    """Muon leaves: -lr_t (0.2 sqrt(max(m, n)) O + wd W), O from optax.contrib; rest: adamw."""
    float_leaves = {k: v for k, v in _routing_tree().items() if k != "steps"}
    params = jax.tree.map(lambda v: v + 0.5, float_leaves)
    lr = optax.linear_schedule(0.05, 0.01, 3)
    wd = 0.1
    tx = muon_jax.muon(lr, weight_decay=wd, newton_schulz=F32, **NS,
                       adamw=muon_jax.AdamWOptions(learning_rate=0.003, b2=0.99))
    muon_dims = {"mlp/kernel": MDN(0, 1), "layers/attn": MDN(1, 2)}
    ref_muon = optax.contrib.scale_by_muon(weight_dimension_numbers=muon_dims, **NS)
    ref_adam = optax.adamw(0.003, b1=0.9, b2=0.99, eps=1e-8, weight_decay=wd)
    flat_p = _flat(params)
    pm = {k: v for k, v in flat_p.items() if k in muon_dims}
    pa = {k: v for k, v in flat_p.items() if k not in muon_dims}
    rng = np.random.default_rng(3)
    grads_seq = [jax.tree.map(lambda x: _normal(rng, x.shape), params) for _ in range(3)]

    def run(grads_seq):
        state, sm, sa = tx.init(params), ref_muon.init(pm), ref_adam.init(pa)
        out = []
        for step, grads in enumerate(grads_seq):
            got, state = tx.update(grads, state, params)
            g = _flat(grads)
            o, sm = ref_muon.update({k: g[k] for k in pm}, sm)
            want = {k: -lr(step) * (0.2 * math.sqrt(max(p.shape[-2:])) * o[k] + wd * p)
                    for k, p in pm.items()}
            a, sa = ref_adam.update({k: g[k] for k in pa}, sa, pa)
            out.append((_flat(got), want | a))
        return out

    for got, want in jax.jit(run)(grads_seq):
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- NNX training


class TinyLM(nnx.Module):
    """Embedding -> two hidden matrices -> LayerNorm -> head; predicts (3 t + 1) mod V."""

    def __init__(self, vocab: int, width: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(jax.nn.gelu(self.up(h)))
        return self.head(self.norm(h))


def _loss(model, tokens, targets):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit
def _train_step(model, optimizer, tokens, targets):
    loss, grads = nnx.value_and_grad(_loss)(model, tokens, targets)
    optimizer.update(model, grads)
    return loss


def test_trains_nnx_model_in_chain():
    vocab = 32
    model = TinyLM(vocab, 16, rngs=nnx.Rngs(0))
    mask = muon_jax.default_muon_mask(nnx.state(model, nnx.Param))
    assert _paths_where(mask) == {"up/kernel/value", "down/kernel/value"}
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        muon_jax.muon(optax.cosine_decay_schedule(0.02, 50), weight_decay=0.01,
                      adamw=muon_jax.AdamWOptions(learning_rate=0.01)),
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    assert _muon_leaves(nnx.state(optimizer.opt_state)) == {"up/kernel", "down/kernel"}
    tokens = jnp.arange(vocab)
    targets = (3 * tokens + 1) % vocab
    losses = [float(_train_step(model, optimizer, tokens, targets)) for _ in range(50)]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.25 * losses[0], losses[::10]


# ----------------------------------------------------------------------------- errors


def test_non_float_leaf_names_path_and_fix():
    tx = muon_jax.scale_by_muon()
    with pytest.raises(ValueError, match=r"'block/ids'.*int32.*muon_mask"):
        tx.init({"block": {"ids": jnp.zeros((4, 4), jnp.int32)}})
    forced = muon_jax.muon(0.1, muon_mask=lambda p: jax.tree.map(lambda _: True, p))
    with pytest.raises(ValueError, match=r"'steps'.*muon_mask"):
        forced.init({"steps": jnp.zeros((2, 2), jnp.int32), "w": jnp.zeros((2, 2))})


def test_vector_leaf_names_path_and_fix():
    with pytest.raises(ValueError, match=r"'b'.*rank >= 2.*AdamW"):
        muon_jax.scale_by_muon().init({"b": jnp.zeros(3)})


@pytest.mark.parametrize(
    "dims,match",
    [
        (MDN(reduction_axis=0, output_axis=3), r"'w'.*output_axis 3 does not fit.*rank 3"),
        (MDN(reduction_axis=(0, 1), output_axis=1), r"'w'.*disjoint"),
    ],
)
def test_dimension_numbers_that_do_not_fit(dims, match):
    with pytest.raises(ValueError, match=match):
        muon_jax.scale_by_muon(dimension_numbers={"w": dims}).init({"w": jnp.zeros((2, 3, 4))})


def test_dimension_numbers_tree_must_match_params():
    tx = muon_jax.scale_by_muon(dimension_numbers={"other": MDN()})
    with pytest.raises(ValueError, match="dimension_numbers must be a tree"):
        tx.init({"w": jnp.zeros((2, 3))})


def test_mask_leaves_must_be_bools():
    tx = muon_jax.muon(0.1, muon_mask=lambda p: jax.tree.map(lambda x: x.ndim, p))
    with pytest.raises(TypeError, match="muon_mask leaves must be Python bools"):
        tx.init({"w": jnp.zeros((2, 2))})


def test_one_dimension_numbers_for_the_tree_is_a_view_of_the_muon_leaves_only():
    """The README's torch-layout advice on a tree with a bias and an embedding: the mask sends
    both to AdamW and they are never checked against the dimension numbers; the matrix gets
    the torch-layout view (its update equals Muon's on the transposed matrix)."""
    dn = muon_jax.MuonDimensionNumbers(reduction_axis=1, output_axis=0)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
              "b": jnp.zeros(8), "embed": jnp.ones((16, 4))}
    assert muon_jax.default_muon_mask(params, dimension_numbers=dn) == {
        "b": False, "embed": False, "w": True}
    tx = muon_jax.muon(0.02, dimension_numbers=dn, newton_schulz=F32, **NS)
    grads = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in params.items()}
    ref_tx = muon_jax.muon(0.02, newton_schulz=F32, **NS)
    flipped = {"w": params["w"].T}

    @jax.jit  # both updates in one program (eager, each op compiles its own)
    def both(grads):
        updates, _ = tx.update(grads, tx.init(params), params)
        ref, _ = ref_tx.update({"w": grads["w"].T}, ref_tx.init(flipped), flipped)
        return updates, ref

    updates, ref = both(grads)
    np.testing.assert_allclose(np.asarray(updates["w"]), np.asarray(ref["w"]).T, rtol=1e-5,
                               atol=1e-7)
    # A tree entry of its own still routes that leaf to Muon, and a misfit is named.
    with pytest.raises(ValueError, match="params leaf 'b': reduction_axis 1 does not fit"):
        muon_jax.muon(0.02, dimension_numbers={"w": dn, "b": dn, "embed": None}).init(params)
