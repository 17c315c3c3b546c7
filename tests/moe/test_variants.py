"""The MoE variants of real model families against a dense one-device reference written here.

Options: expert activations (SiLU, exact and tanh GELU, GPT-OSS's clamped SwiGLU), expert and
router biases, Qwen2-MoE's sigmoid-gated shared expert, Mixtral's router jitter, a token mask,
per-token routing outputs in ``aux``, and token / expert counts that do not split over the
mesh (padded inside the layer). The reference runs every expert on every token in f32 from the
documented formulas; gradients of ``sum(y * ct) + 0.1 * lb + 0.01 * z`` are compared leaf by
leaf (f32: 1e-5 of the leaf's scale).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _meshes import make_mesh
from flax import nnx

import moe

HI = jax.lax.Precision.HIGHEST
D, F = 16, 8
LB_COEF, Z_COEF = 0.1, 0.01
TRAINED = ("router_kernel", "w_gate_up", "w_down", "router_bias", "b_gate_up", "b_down",
           "shared_gate_up", "shared_down", "shared_gate")


def act_ref(z, kind="silu", alpha=None, limit=None):
    """The gated activations from their formulas (plain jnp, differentiated by autodiff)."""
    g, u = jnp.split(z, 2, axis=-1)
    if kind == "silu":
        return g * jax.nn.sigmoid(g) * u
    if kind == "gelu":
        return 0.5 * g * (1.0 + jax.scipy.special.erf(g / np.sqrt(2.0))) * u
    if kind == "gelu_tanh":
        return 0.5 * g * (1.0 + jnp.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    return (u + 1.0) * g * jax.nn.sigmoid(alpha * g)


def reference(p, x, cfg, activation, mask=None, noise=None):
    """Dense MoE over tokens ``x [T, d]`` for the router config ``cfg`` and the experts'
    ``activation``: (y, lb, z-loss, counts, ids, weights)."""
    act = functools.partial(act_ref, kind=activation.kind, alpha=activation.alpha,
                            limit=activation.limit)
    keep = jnp.ones(x.shape[0], bool) if mask is None else mask
    x = jnp.where(keep[:, None], x, 0.0)
    x_router = x
    if noise is not None:
        x_router = x * noise
        if cfg.jitter_input == "all":
            x = x_router
    e = cfg.num_experts
    logits = jnp.einsum("td,de->te", x_router, p["router_kernel"], precision=HI)
    if "router_bias" in p:
        logits = logits + p["router_bias"]
    scores = jax.nn.softmax(logits) if cfg.score_fn == "softmax" else jax.nn.sigmoid(logits)
    choice = jax.lax.stop_gradient(scores) + p["balancing_bias"]
    if cfg.topk_groups is not None and cfg.topk_groups < cfg.num_groups:
        g = cfg.num_groups
        top2 = jnp.sort(choice.reshape(-1, g, e // g), axis=-1)[..., -2:].sum(-1)
        rank = jnp.argsort(jnp.argsort(-top2, axis=-1), axis=-1)
        choice = jnp.where(jnp.repeat(rank < cfg.topk_groups, e // g, axis=-1), choice, -jnp.inf)
    ids = jax.lax.top_k(choice, cfg.top_k)[1]
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.renormalize:
        w = w / w.sum(-1, keepdims=True)
    w = jnp.where(keep[:, None], w * cfg.routed_scaling, 0.0)
    z = jnp.einsum("td,edf->tef", x, p["w_gate_up"], precision=HI)
    if "b_gate_up" in p:
        z = z + p["b_gate_up"]
    y_all = jnp.einsum("tef,efd->ted", act(z), p["w_down"], precision=HI)
    if "b_down" in p:
        y_all = y_all + p["b_down"]
    y = jnp.einsum("tk,tkd->td", w, jnp.take_along_axis(y_all, ids[:, :, None], axis=1))
    if "shared_gate_up" in p:
        hs = act(jnp.einsum("td,df->tf", x, p["shared_gate_up"], precision=HI))
        ys = jnp.einsum("tf,fd->td", hs, p["shared_down"], precision=HI)
        if "shared_gate" in p:
            ys = ys * jax.nn.sigmoid(jnp.einsum("td,do->to", x, p["shared_gate"], precision=HI))
        y = y + jnp.where(keep[:, None], ys, 0.0)
    n = keep.sum()
    counts = (jax.nn.one_hot(ids, e, dtype=jnp.int32) * keep[:, None, None]).sum((0, 1))
    probs = scores / scores.sum(-1, keepdims=True)
    p_mean = jnp.where(keep[:, None], probs, 0.0).sum(0) / n
    lb = e * jnp.sum(counts / (n * cfg.top_k) * p_mean)
    zl = jnp.sum(jnp.where(keep, jax.nn.logsumexp(logits, axis=-1) ** 2, 0.0)) / n
    return y, lb, zl, counts, jnp.where(keep[:, None], ids, -1), w


def params_of(model):
    state = nnx.to_pure_dict(nnx.state(model))
    return {k: np.asarray(v) for k, v in state.items() if k in TRAINED or k == "balancing_bias"}


@functools.partial(jax.jit, static_argnames=("cfg", "activation"))
def ref_step(params, x, ct, mask, noise, cfg, activation):
    """Reference y, aux and grads of (trained params, x). Static on the router config and the
    activation only (all the reference reads), so layers that differ in their transport or
    mesh share one compiled reference."""
    bias = params["balancing_bias"]
    train = {k: v for k, v in params.items() if k != "balancing_bias"}

    def loss(train, x):
        flat = x.reshape(-1, x.shape[-1])
        m = None if mask is None else mask.reshape(-1)
        nz = None if noise is None else noise.reshape(flat.shape)
        y, lb, zl, counts, ids, w = reference({**train, "balancing_bias": bias}, flat, cfg,
                                              activation, m, nz)
        y = y.reshape(x.shape)
        aux = dict(load_balance_loss=lb, router_z_loss=zl, tokens_per_expert=counts,
                   expert_ids=ids.reshape(*x.shape[:2], -1),
                   expert_weights=w.reshape(*x.shape[:2], -1))
        return jnp.sum(y * ct) + LB_COEF * lb + Z_COEF * zl, (y, aux)

    (_, (y, aux)), (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(train, x)
    return y, aux, gp, gx


@nnx.jit
def layer_step(model, x, ct, mask):
    def loss(model, x):
        y, aux = model(x, mask)
        obj = jnp.sum(jnp.where(jnp.isfinite(y), y, 0.0) * ct)
        return obj + LB_COEF * aux["load_balance_loss"] + Z_COEF * aux["router_z_loss"], (y, aux)

    (_, (y, aux)), (gm, gx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
    return y, aux, gm, gx


def assert_close(got, want, rtol=1e-5):
    """Per leaf: |got - want| <= rtol * (|want| + max|want|)."""
    assert set(got) == set(want), (set(got), set(want))
    for name in want:
        w, g = np.asarray(want[name], np.float32), np.asarray(got[name], np.float32)
        chex.assert_trees_all_close(g, w, rtol=rtol, atol=rtol * float(np.abs(w).max()),
                                    custom_message=name)


def check_layer(model, x, mask=None, noise=None, ct_seed=2):
    """The layer's y, aux and gradients equal the reference's; returns the layer's aux."""
    ct = jax.random.normal(jax.random.key(ct_seed), x.shape)
    y, aux, gm, gx = layer_step(model, x, ct, mask)
    x_ref = jnp.where(jnp.isfinite(x), x, 0.0)  # masked tokens may hold NaN; ref zeroes them
    ry, raux, gp, rgx = ref_step(params_of(model), x_ref, ct, mask, noise, model.options.router,
                                 model.options.experts.activation)
    got = {"y": y, "x": gx, **{k: v for k, v in nnx.to_pure_dict(gm).items() if k in TRAINED}}
    assert_close(got, {"y": ry, "x": rgx, **gp})
    assert np.isfinite(np.asarray(gx)).all() and np.isfinite(np.asarray(y)).all()
    chex.assert_trees_all_close(aux["load_balance_loss"], raux["load_balance_loss"], rtol=1e-5)
    chex.assert_trees_all_close(aux["router_z_loss"], raux["router_z_loss"], rtol=1e-5)
    np.testing.assert_array_equal(aux["tokens_per_expert"], raux["tokens_per_expert"])
    if model.options.router.return_routing:
        np.testing.assert_array_equal(aux["expert_ids"], raux["expert_ids"])
        chex.assert_trees_all_close(aux["expert_weights"], raux["expert_weights"], rtol=1e-5,
                                    atol=1e-6)
    return jax.tree.map(np.asarray, aux)


def build(num_experts=8, top_k=2, mesh=((2, 4), "explicit"), seed=0, **options):
    opts = moe.MoEOptions.create(num_experts, top_k, **options)
    mesh = make_mesh(mesh[0], axis_type=mesh[1]) if mesh else None
    return moe.MoE(D, F, options=opts, mesh=mesh, rngs=nnx.Rngs(seed))


def randomize(model, scale=0.3, seed=5):
    """Give every zero-initialized param (biases) random values, so each one matters."""
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    for name in ("router_bias", "b_gate_up", "b_down", "balancing_bias"):
        var = getattr(model, name, None)
        if var is not None:
            value = var[...]
            noise = jax.random.normal(next(keys), value.shape, value.dtype) * scale
            var[...] = jax.device_put(value + noise, value.sharding)


def tokens(b=4, s=8, seed=1):
    return jax.random.normal(jax.random.key(seed), (b, s, D))


# ----------------------------------------------------------------------------- activations


@pytest.mark.parametrize("act", [
    moe.GatedActivation("silu"), moe.GatedActivation("gelu"), moe.GatedActivation("gelu_tanh"),
    moe.GatedActivation("clamped_swiglu", alpha=1.702, limit=1.5)], ids=lambda a: a.kind)
def test_activation_grad_is_the_exact_derivative(act):
    z, got, want, exact_gelu = _activation_and_grads(act)
    assert_close(got, want)
    if act.kind == "clamped_swiglu":  # the clamps were hit on both operands
        g, u = np.split(np.asarray(z), 2, axis=-1)
        assert (g > act.limit).any() and (np.abs(u) > act.limit).any()
    if act.kind == "gelu_tanh":  # the two GELUs differ, so each test pins its own
        assert not np.allclose(got["h"], exact_gelu, atol=1e-5)


@functools.partial(jax.jit, static_argnames="act")
def _activation_and_grads(act):
    """One program per activation: (z, the activation's {h, dz}, autodiff's of the formula,
    the exact GELU's h)."""
    z = jax.random.normal(jax.random.key(0), (64, 2 * 12)) * 2.0  # some beyond the clamp
    dh = jax.random.normal(jax.random.key(1), (64, 12))
    plain = functools.partial(act_ref, kind=act.kind, alpha=act.alpha, limit=act.limit)
    h, vjp = jax.vjp(plain, z)
    return (z, {"h": act.apply(z), "dz": act.grad(z, dh)}, {"h": h, "dz": vjp(dh)[0]},
            moe.GatedActivation("gelu").apply(z))


@pytest.mark.parametrize("layout", ["ragged", "padded", "padded_mosaic", "aligned"])
def test_gated_experts_with_biases_and_activation(layout):
    """gated_experts with b_gate_up, b_down and the clamped SwiGLU: y and every gradient equal
    the per-row formula; padding rows give 0 and pass no gradient. 'padded_mosaic': padded x
    as rows of the Mosaic kernels (with the live-row groups that skip empty tiles on GPU)."""
    e, d, f = 4, 16, 8
    ks = jax.random.split(jax.random.key(3), 6)
    w_gu = jax.random.normal(ks[0], (e, d, 2 * f)) * 0.5
    w_d = jax.random.normal(ks[1], (e, f, d)) * 0.3
    b_gu, b_d = jax.random.normal(ks[2], (e, 2 * f)), jax.random.normal(ks[3], (e, d))
    act = moe.GatedActivation("clamped_swiglu", alpha=1.702, limit=1.0)
    sizes = np.array([5, 0, 7, 3])
    if layout.startswith("padded"):  # [E, C, d], rows c >= sizes[e] are padding
        x = jax.random.normal(ks[4], (e, 8, d))
        expert = np.repeat(np.arange(e)[:, None], 8, axis=1)
        valid = np.arange(8)[None, :] < sizes[:, None]
        kw = {"gemm_implementation": "mosaic"} if layout == "padded_mosaic" else {}
    else:
        align = 8 if layout == "aligned" else 1
        starts = np.concatenate([[0], np.cumsum(-(-sizes // align) * align)])[:-1]
        rows = 32
        x = jax.random.normal(ks[4], (rows, d))
        expert, valid = np.zeros(rows, int), np.zeros(rows, bool)
        for g in range(e):
            expert[starts[g]:starts[g] + sizes[g]] = g
            valid[starts[g]:starts[g] + sizes[g]] = True
        kw = {"group_alignment": align} if layout == "aligned" else {}
    ct = jax.random.normal(ks[5], x.shape)

    def fused(x, w_gu, w_d, b_gu, b_d):
        y = moe.gated_experts(x, jnp.asarray(sizes, jnp.int32), w_gu, w_d, b_gu, b_d,
                              activation=act, save_z="recompute", **kw)
        return jnp.sum(y * ct), y

    def plain(x, w_gu, w_d, b_gu, b_d):
        z = jnp.einsum("...d,...df->...f", x, w_gu[expert], precision=HI) + b_gu[expert]
        h = act_ref(z, act.kind, act.alpha, act.limit)
        y = jnp.einsum("...f,...fd->...d", h, w_d[expert], precision=HI) + b_d[expert]
        y = jnp.where(valid[..., None], y, 0.0)
        return jnp.sum(y * ct), y

    args = (x, w_gu, w_d, b_gu, b_d)
    (_, y), g = jax.jit(jax.value_and_grad(fused, argnums=range(5), has_aux=True))(*args)
    (_, ry), rg = jax.jit(jax.value_and_grad(plain, argnums=range(5), has_aux=True))(*args)
    names = ["y", "x", "w_gate_up", "w_down", "b_gate_up", "b_down"]
    assert_close(dict(zip(names, (y, *g), strict=True)), dict(zip(names, (ry, *rg), strict=True)))
    assert np.all(np.asarray(y)[~valid] == 0) and np.all(np.asarray(g[0])[~valid] == 0)


# ----------------------------------------------------------------------------- layer options


CASES = {
    # GPT-OSS: clamped SwiGLU (a small limit so the clamps act), expert and router biases.
    "gpt_oss": dict(mesh=((2, 4), "explicit"), transport="ragged",
                    activation=moe.GatedActivation("clamped_swiglu", alpha=1.702, limit=0.4),
                    expert_bias=True, router_bias=True, return_routing=True),
    # Qwen2-MoE: sigmoid-gated shared expert; exact GELU on a dense transport.
    "qwen2_shared_gate": dict(mesh=((4, 2), "auto"), transport="dense", activation="gelu",
                              num_shared_experts=2, shared_expert_gate=True, renormalize=False),
    # tanh GELU with DeepSeek-style sigmoid scores and groups, every device an expert device.
    "gelu_tanh_groups": dict(mesh=((1, 8), "auto"), transport="ragged", activation="gelu_tanh",
                             score_fn="sigmoid", routed_scaling=2.5, num_groups=4,
                             topk_groups=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_family_options_match_reference(case):
    kw = dict(CASES[case])
    model = build(**kw)
    randomize(model)
    check_layer(model, tokens())
    names = set(params_of(model))
    if case == "gpt_oss":
        assert {"router_bias", "b_gate_up", "b_down"} <= names and "shared_gate" not in names
        assert model.b_gate_up[...].shape == (8, 2 * F) and model.b_down[...].shape == (8, D)
    if case == "qwen2_shared_gate":
        assert model.shared_gate[...].shape == (D, 1) and "b_gate_up" not in names


def test_default_options_create_no_new_params():
    """Without the new options the state is what it was (checkpoints keep loading)."""
    model = build(mesh=None)
    assert set(nnx.to_pure_dict(nnx.state(model))) == {
        "router_kernel", "w_gate_up", "w_down", "balancing_bias"}


@pytest.mark.parametrize("transport,mesh", [("dense", ((2, 4), "explicit")),
                                            ("ragged", ((4, 2), "auto"))])
def test_token_mask(transport, mesh):
    """Masked tokens (holding NaN) get y = 0 and no gradient, and count in no count or loss;
    with return_routing their ids are -1 and weights 0."""
    model = build(mesh=mesh, transport=transport, num_shared_experts=1, return_routing=True)
    x = tokens()
    mask = jax.random.bernoulli(jax.random.key(7), 0.7, x.shape[:2]).at[0, 0].set(False)
    x = jnp.where(mask[..., None], x, jnp.nan)
    aux = check_layer(model, x, mask)
    ct = jax.random.normal(jax.random.key(2), x.shape)
    y, _, _, gx = layer_step(model, x, ct, mask)
    masked = ~np.asarray(mask)
    assert np.all(np.asarray(y)[masked] == 0) and np.all(np.asarray(gx)[masked] == 0)
    assert aux["tokens_per_expert"].sum() == 2 * int(np.asarray(mask).sum())
    assert np.all(aux["expert_ids"][masked] == -1) and np.all(aux["expert_weights"][masked] == 0)
    assert int(aux["dropped_slots"]) == int(aux["dropped_tokens"]) == 0


@functools.partial(jax.jit, static_argnames=("cfg", "activation"))
def _capacity_reference(p, flat, mask, cfg, activation):
    """One program for the reference pieces of the capacity test: the unmasked tokens' expert
    ids, the masked routing weights, and every expert's output for every token."""
    ids = reference(p, flat, cfg, activation)[4]
    w = reference(p, flat, cfg, activation, mask)[5]
    y_all = jnp.einsum("td,edf->tef", flat, p["w_gate_up"], precision=HI)
    y_all = jnp.einsum("tef,efd->ted", act_ref(y_all), p["w_down"], precision=HI)
    return ids, w, y_all


def test_token_mask_takes_no_capacity():
    """Dense transport with a capacity: masked tokens take no slot, so the slots kept are the
    first C of each (device, expert) among the unmasked tokens only."""
    mesh_spec = ((2, 4), "explicit")
    model = build(mesh=mesh_spec, transport="dense", capacity_factor=0.5)
    b, s = 8, 64  # 512 tokens, 64 per device
    x = tokens(b, s)
    mask = np.asarray(jax.random.bernoulli(jax.random.key(9), 0.6, (b, s)))
    flat = np.asarray(x).reshape(-1, D)
    p = params_of(model)
    ids, w, y_all = map(np.asarray, _capacity_reference(
        p, flat, mask.reshape(-1), model.options.router, model.options.experts.activation))
    t_local, cap = b * s // 8, 8  # ceil(0.5 * 64 * 2 / 8) = 8 (a multiple of 8)
    kept = np.zeros(ids.shape, bool)
    for dev in range(8):
        seen = np.zeros(8, int)
        for t in range(dev * t_local, (dev + 1) * t_local):
            for j in range(2):
                if mask.reshape(-1)[t]:
                    kept[t, j] = seen[ids[t, j]] < cap
                    seen[ids[t, j]] += 1
    lost = ~kept & mask.reshape(-1)[:, None]
    n_dropped = int(lost.sum())
    assert n_dropped > 0
    ct = jax.random.normal(jax.random.key(2), x.shape)
    y, aux, _, _ = layer_step(model, x, ct, jnp.asarray(mask))
    assert int(aux["dropped_slots"]) == n_dropped
    assert int(aux["dropped_tokens"]) == int(lost.any(axis=1).sum())
    # y: the kept slots of the reference (dropped ones contribute nothing).
    want = np.einsum("tk,tkd->td", np.where(kept, w, 0),
                     np.take_along_axis(y_all, ids[:, :, None], axis=1))
    chex.assert_trees_all_close(np.asarray(y).reshape(-1, D), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- jitter


def test_router_jitter_train_and_eval():
    """Training multiplies the input by U(1 - eps, 1 + eps) noise from the 'jitter' stream
    (a new draw per call), eval() and nnx.view(deterministic=True) turn it off."""
    eps = 0.2
    model = build(mesh=((4, 2), "auto"), transport="ragged", router_jitter_noise=eps)
    x = tokens()
    key = nnx.clone(model).jitter_rngs()  # the key the next training call draws
    noise = jax.random.uniform(key, (x.shape[0] * x.shape[1], D), jnp.float32, 1 - eps, 1 + eps)
    check_layer(model, x, noise=noise.reshape(x.shape))  # advances the stream
    # the programs check_layer compiled (eval and train) give the outputs compared below
    ct = jax.random.normal(jax.random.key(2), x.shape)
    forward = lambda m: layer_step(m, x, ct, None)[0]  # noqa: E731
    y1, y2 = forward(model), forward(model)
    assert not np.allclose(y1, y2)  # a fresh draw per call
    model.eval()
    assert model.deterministic
    check_layer(model, x)  # no noise
    y_eval = forward(model)
    model.train()
    np.testing.assert_array_equal(forward(nnx.view(model, deterministic=True)), y_eval)


def test_router_jitter_on_the_router_only():
    eps = 0.3
    model = build(mesh=((2, 4), "explicit"), transport="dense", router_jitter_noise=eps,
                  jitter_input="router", num_shared_experts=1)
    x = tokens()
    key = nnx.clone(model).jitter_rngs()
    noise = jax.random.uniform(key, (x.shape[0] * x.shape[1], D), jnp.float32, 1 - eps, 1 + eps)
    check_layer(model, x, noise=noise.reshape(x.shape))


# ----------------------------------------------------------------------------- uneven sizes


UNEVEN = [(1, "dropless"), (2, "dropless"), (4, "dropless"), (8, "dropless"), (8, "ragged"),
          (4, "dense"), (8, "dense")]


@pytest.mark.parametrize("ep,transport", UNEVEN, ids=[f"ep{e}-{t}" for e, t in UNEVEN])
def test_uneven_tokens_and_experts(ep, transport):
    """15 tokens over 8 devices and 6 experts over expert axes of 1, 2, 4 and 8 devices: padded
    internally, the results are the dense reference's and nothing is dropped."""
    mesh = ((8 // ep, ep), "explicit" if ep in (2, 8) else "auto")
    model = build(num_experts=6, mesh=mesh, transport=transport, return_routing=True)
    split = 6 % ep == 0
    assert model.w_gate_up[...].shape == (6, D, 2 * F)
    assert (model.w_gate_up[...].sharding.spec[0] == "expert") == split
    aux = check_layer(model, tokens(3, 5))
    assert aux["tokens_per_expert"].shape == (6,) and aux["tokens_per_expert"].sum() == 30
    assert int(aux["dropped_slots"]) == int(aux["dropped_tokens"]) == 0
