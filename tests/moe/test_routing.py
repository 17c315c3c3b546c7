"""moe.routing against a float64 numpy reference: scores, selection, weights, losses, bias."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe.routing import RouterConfig, route, update_balancing_bias

T, D, E = 48, 16, 16


def _ref_route(x, w, bias, cfg):
    """Plain numpy (float64) router from the formulas in moe.routing; group score = sum of top-2."""
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if cfg.score_fn == "softmax":
        ex = np.exp(logits - logits.max(-1, keepdims=True))
        scores = ex / ex.sum(-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + np.asarray(bias, np.float64)
    tg = cfg.topk_groups
    if cfg.num_groups > 1 and tg is not None:
        per = E // cfg.num_groups
        grouped = choice.reshape(len(x), cfg.num_groups, per)
        gscore = -np.sort(-grouped, axis=-1)[..., : min(2, per)].sum(-1)
        keep = np.argsort(-gscore, axis=-1, kind="stable")[:, :tg]
        mask = np.zeros_like(gscore, bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, per, -1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, : cfg.top_k]
    wts = np.take_along_axis(scores, ids, -1)
    if cfg.renormalize:
        wts = wts / wts.sum(-1, keepdims=True)
    wts = wts * cfg.routed_scaling
    counts = np.bincount(ids.ravel(), minlength=E)
    probs = scores / scores.sum(-1, keepdims=True)
    lb = E * np.sum(counts / ids.size * probs.mean(0))
    m = logits.max(-1)
    z = np.mean((m + np.log(np.exp(logits - m[:, None]).sum(-1))) ** 2)
    return ids, wts, scores, counts, lb, z


@functools.partial(jax.jit, static_argnames="config")
def _route(x, w, bias, config):
    return route(x, w, bias, config=config)


def _data(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, D)).astype(np.float32)
    w = (scale * rng.standard_normal((D, E)) / np.sqrt(D)).astype(np.float32)
    return x, w


def _check_against_reference(cfg, bias, seed=0):
    x, w = _data(seed)
    r = _route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), cfg)
    ids, wts, scores, counts, lb, z = _ref_route(x, w, bias, cfg)
    chex.assert_shape((r.expert_ids, r.weights), (T, cfg.top_k))
    assert r.expert_ids.dtype == jnp.int32 and r.weights.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(r.expert_ids), ids)
    np.testing.assert_allclose(np.asarray(r.weights), wts, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(r.scores), scores, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(r.tokens_per_expert), counts)
    np.testing.assert_allclose(float(r.load_balance_loss), lb, rtol=1e-5)
    np.testing.assert_allclose(float(r.router_z_loss), z, rtol=1e-5)
    return r, ids


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize,scaling", [(True, 1.0), (False, 2.5)])
def test_matches_reference(score_fn, renormalize, scaling):
    cfg = RouterConfig(E, 3, scaling, score_fn=score_fn, renormalize=renormalize)
    r, _ = _check_against_reference(cfg, np.zeros(E, np.float32))
    s = np.asarray(r.weights).sum(-1)
    if renormalize:
        np.testing.assert_allclose(s, scaling, rtol=1e-6)
    else:  # raw scores at the chosen experts, times the scaling
        raw = np.take_along_axis(np.asarray(r.scores), np.asarray(r.expert_ids), -1)
        np.testing.assert_allclose(np.asarray(r.weights), scaling * raw, rtol=1e-6)


def test_bias_changes_selection_but_not_weights():
    cfg = RouterConfig(E, 2, score_fn="sigmoid", renormalize=False)
    bias = np.zeros(E, np.float32)
    bias[[3, 11]] = [0.8, -0.8]
    r, ids = _check_against_reference(cfg, bias)
    r0 = _route(*map(jnp.asarray, _data()), jnp.zeros(E), cfg)
    assert np.mean(np.asarray(r.expert_ids) == 3) > np.mean(np.asarray(r0.expert_ids) == 3)
    assert not np.any(np.asarray(r.expert_ids) == 11)
    # weights are the unbiased scores at the chosen experts
    chex.assert_trees_all_close(
        r.weights, jnp.take_along_axis(r0.scores, r.expert_ids, axis=-1), rtol=1e-6
    )


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_bias_may_select_experts_whose_scores_underflow(score_fn):
    """The balancing bias can pick experts scoring exactly 0 (logits ~100 below the token's
    top): weights stay defined (softmax: over the selected logits) and gradients finite."""
    cfg = RouterConfig(4, 2, score_fn=score_fn)
    x = jnp.asarray([[1.0, 0.0], [0.0, 1.0]])
    w = jnp.asarray([[120.0, 0.0, -150.0, -200.0], [0.0, 120.0, -150.0, -200.0]])
    bias = jnp.asarray([0.0, 0.0, 2.0, 2.0])  # outweighs any score: experts 2, 3 are chosen
    r = _route(x, w, bias, cfg)  # jitted: eagerly every op compiles its own program
    assert sorted(np.asarray(r.expert_ids[0]).tolist()) == [2, 3]
    chex.assert_tree_all_finite(r.weights)
    if score_fn == "softmax":  # softmax over the chosen logits (-150, -200): [1, 0]
        chex.assert_trees_all_close(np.sort(np.asarray(r.weights), -1),
                                    np.asarray([[0.0, 1.0]] * 2, np.float32), atol=1e-6)

    def loss(w):
        rr = route(x, w, bias, config=cfg)
        return jnp.sum(rr.weights * jnp.asarray([1.0, -2.0])) + rr.load_balance_loss

    chex.assert_tree_all_finite(jax.jit(jax.grad(loss))(w))


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_group_limited_routing(score_fn):
    cfg = RouterConfig(E, 4, 1.0, 4, 2, score_fn=score_fn)
    bias = np.random.default_rng(5).uniform(-0.02, 0.02, E).astype(np.float32)
    r, _ = _check_against_reference(cfg, bias, seed=1)
    groups = np.asarray(r.expert_ids) // (E // 4)
    assert max(len(set(g)) for g in groups) <= 2
    # the restriction is not vacuous: ungrouped routing picks experts outside the kept groups
    free = _route(
        *map(jnp.asarray, _data(1)), jnp.asarray(bias), RouterConfig(E, 4, score_fn=score_fn)
    )
    assert max(len(set(g)) for g in np.asarray(free.expert_ids) // (E // 4)) > 2


def test_leading_axes_and_bf16_input():
    cfg = RouterConfig(E, 2)
    x, w = _data(2)
    r = _route(jnp.asarray(x).reshape(4, T // 4, D), jnp.asarray(w), jnp.zeros(E), cfg)
    r2 = _route(jnp.asarray(x), jnp.asarray(w), jnp.zeros(E), cfg)
    chex.assert_shape(r.expert_ids, (4, T // 4, 2))
    flat = lambda a: np.asarray(a).reshape(-1)  # noqa: E731 (numpy: no program per reshape)
    chex.assert_trees_all_close(jax.tree.map(flat, r), jax.tree.map(flat, r2))
    rb = _route(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.zeros(E), cfg)
    assert rb.logits.dtype == jnp.float32 and rb.weights.dtype == jnp.float32


def _loss(w, x, cfg, target):
    r = route(x, w, config=cfg)
    return jnp.sum(r.weights * target) + r.load_balance_loss + 1e-3 * r.router_z_loss


def test_gradient_flows_only_through_selected_scores():
    cfg = RouterConfig(E, 2, 1.5)
    x, w = map(jnp.asarray, _data(3))
    target = jnp.asarray(np.random.default_rng(3).standard_normal((T, 2)), jnp.float32)
    ids = _route(x, w, jnp.zeros(E), cfg).expert_ids

    def dense(w):  # reference: fixed selection, plain softmax formulas
        logits = x @ w
        s = jax.nn.softmax(logits)
        sel = jnp.take_along_axis(s, ids, -1)
        f = jnp.bincount(ids.ravel(), length=E) / ids.size
        lb = E * jnp.sum(f * s.mean(0))
        z = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
        return jnp.sum(1.5 * sel / sel.sum(-1, keepdims=True) * target) + lb + 1e-3 * z

    g = jax.jit(jax.grad(_loss), static_argnums=2)(w, x, cfg, target)
    chex.assert_trees_all_close(g, jax.jit(jax.grad(dense))(w), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g).max()) > 0


def test_stop_score_gradient_is_exact_zero_without_backward_matmul():
    x, w = map(jnp.asarray, _data(4))
    target = jnp.ones((T, 2), jnp.float32)
    for stop in (False, True):
        cfg = RouterConfig(E, 2, stop_score_gradient=stop)
        grad = jax.jit(jax.grad(_loss), static_argnums=2)
        g = grad(w, x, cfg, target)
        fwd_dots = str(jax.make_jaxpr(_loss, static_argnums=2)(w, x, cfg, target)).count(
            "dot_general"
        )
        grad_dots = str(jax.make_jaxpr(grad, static_argnums=2)(w, x, cfg, target)).count(
            "dot_general"
        )
        assert fwd_dots == 1
        if stop:
            np.testing.assert_array_equal(np.asarray(g), 0.0)
            assert grad_dots == fwd_dots  # only the forward logits matmul
        else:
            assert float(jnp.abs(g).max()) > 0 and grad_dots > fwd_dots


def test_bias_update_balances_skewed_load():
    cfg = RouterConfig(E, 2, score_fn="sigmoid")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((512, D)).astype(np.float32)
    w = (rng.standard_normal((D, E)) / np.sqrt(D)).astype(np.float32)
    x[:, 0], w[0] = 1.0, np.linspace(2.0, -2.0, E)  # every token prefers low expert ids
    x, w = jnp.asarray(x), jnp.asarray(w)

    @jax.jit
    def run(bias):
        def step(b, _):
            r = route(x, w, b, config=cfg)
            return update_balancing_bias(b, r.tokens_per_expert, 0.01), r.tokens_per_expert

        return jax.lax.scan(step, bias, None, length=100)

    bias, loads = run(jnp.zeros(E))
    loads = np.asarray(loads, np.float64)
    cv = loads.std(-1) / loads.mean(-1)
    assert loads[0].max() / loads[0].mean() > 3.0 and cv[0] > 1.0
    assert loads[-20:].max() / loads[0].mean() < 1.3 and cv[-20:].max() < 0.2
    assert float(bias[0]) < 0 < float(bias[-1])  # overloaded down, underloaded up
    np.testing.assert_allclose(
        np.asarray(update_balancing_bias(jnp.zeros(3), jnp.array([6, 2, 1]), 0.5)), [-0.5, 0.5, 0.5]
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_experts=4, top_k=5), "top_k"),
        (dict(num_experts=0, top_k=1), "num_experts"),
        (dict(num_experts=6, top_k=2, num_groups=4), "num_groups"),
        (dict(num_experts=8, top_k=2, num_groups=4, topk_groups=5), "topk_groups"),
        (dict(num_experts=8, top_k=6, num_groups=4, topk_groups=2), "raise topk_groups"),
        (dict(num_experts=8, top_k=2, score_fn="relu"), "score_fn"),
        (dict(num_experts=8, top_k=2, routed_scaling=0.0), "routed_scaling"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**kwargs)


def test_bad_shapes_raise():
    cfg = RouterConfig(E, 2)
    x, w = jnp.zeros((T, D)), jnp.zeros((D, E))
    with pytest.raises(ValueError, match="router_kernel"):
        route(x, jnp.zeros((D, E + 1)), config=cfg)
    with pytest.raises(ValueError, match="x must have shape"):
        route(jnp.zeros((T, D + 1)), w, config=cfg)
    with pytest.raises(ValueError, match="bias"):
        route(x, w, jnp.zeros((E, 1)), config=cfg)
    with pytest.raises(TypeError, match="RouterConfig"):
        route(x, w, config=dict(num_experts=E, top_k=2))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        update_balancing_bias(jnp.zeros(E), jnp.zeros(E - 1), 0.1)
