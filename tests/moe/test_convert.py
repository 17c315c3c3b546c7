"""moe.convert: transformers MoE blocks -> moe.MoE, checked against numpy blocks written here.

Each test builds one block's parameters in the layout its transformers model documents
(state-dict keys, torch ``Linear`` weights ``[out, in]``), converts them, loads them into a
``moe.MoE`` and compares the layer's output with a numpy (float64) implementation of that
family's block, written from transformers' modeling code: router, top-k, weights, experts,
biases, shared experts.
"""

import chex
import jax
import numpy as np
import pytest
from flax import nnx

import moe

E, K, D, F = 8, 2, 16, 8
T = 16  # tokens (2 x 8)


def silu(a):
    return a / (1.0 + np.exp(-a))


def sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def softmax(a):
    a = np.exp(a - a.max(-1, keepdims=True))
    return a / a.sum(-1, keepdims=True)


def topk(a, k):
    return np.argsort(-a, axis=-1, kind="stable")[..., :k]


def mlp(x, gate, up, down):
    """A torch-layout gated MLP: ``down(silu(gate(x)) * up(x))``, weights ``[out, in]``."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def combine(x, ids, w, expert):
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            y[t] += w[t, j] * expert(int(ids[t, j]), x[t : t + 1])[0]
    return y


def rand(rng, *shape, scale=0.4):
    return rng.normal(size=shape) * scale


def per_expert(rng, names, prefix="experts"):
    g, u, dn = names
    out = {}
    for i in range(E):
        out[f"{prefix}.{i}.{g}.weight"] = rand(rng, F, D)
        out[f"{prefix}.{i}.{u}.weight"] = rand(rng, F, D)
        out[f"{prefix}.{i}.{dn}.weight"] = rand(rng, D, F)
    return out


# --------------------------------------------------------------------------- the families


def mixtral_block(p, x, top_k=K):
    probs = softmax(x @ p["gate.weight"].T)
    ids = topk(probs, top_k)
    w = np.take_along_axis(probs, ids, -1)
    w /= w.sum(-1, keepdims=True)
    return combine(x, ids, w, lambda e, xt: mlp(
        xt, p[f"experts.{e}.w1.weight"], p[f"experts.{e}.w3.weight"], p[f"experts.{e}.w2.weight"]))


def qwen_block(p, x, norm_topk_prob, shared):
    probs = softmax(x @ p["gate.weight"].T)
    ids = topk(probs, K)
    w = np.take_along_axis(probs, ids, -1)
    if norm_topk_prob:
        w /= w.sum(-1, keepdims=True)
    y = combine(x, ids, w, lambda e, xt: mlp(xt, *(p[f"experts.{e}.{n}.weight"] for n in (
        "gate_proj", "up_proj", "down_proj"))))
    if shared:  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x)
        s = mlp(x, *(p[f"shared_expert.{n}.weight"] for n in ("gate_proj", "up_proj",
                                                             "down_proj")))
        y += sigmoid(x @ p["shared_expert_gate.weight"].T) * s
    return y


def deepseek_block(p, x, cfg):
    scores = sigmoid(x @ p["gate.weight"].T)
    choice = scores + p["gate.e_score_correction_bias"]
    g = cfg["n_group"]
    group_scores = np.sort(choice.reshape(-1, g, E // g), -1)[..., -2:].sum(-1)
    keep = np.zeros_like(group_scores, bool)
    np.put_along_axis(keep, topk(group_scores, cfg["topk_group"]), True, -1)
    choice = np.where(np.repeat(keep, E // g, -1), choice, 0.0)  # masked_fill(~mask, 0.0)
    ids = topk(choice, K)
    w = np.take_along_axis(scores, ids, -1)
    w = w / (w.sum(-1, keepdims=True) + 1e-20) * cfg["routed_scaling_factor"]
    y = combine(x, ids, w, lambda e, xt: mlp(xt, *(p[f"experts.{e}.{n}.weight"] for n in (
        "gate_proj", "up_proj", "down_proj"))))
    return y + mlp(x, *(p[f"shared_experts.{n}.weight"] for n in ("gate_proj", "up_proj",
                                                                 "down_proj")))


def gpt_oss_block(p, x, limit, alpha=1.702):
    logits = x @ p["router.weight"].T + p["router.bias"]
    ids = topk(logits, K)
    w = softmax(np.take_along_axis(logits, ids, -1))

    def expert(e, xt):
        gate_up = xt @ p["experts.gate_up_proj"][e] + p["experts.gate_up_proj_bias"][e]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = np.minimum(gate, limit)
        up = np.clip(up, -limit, limit)
        glu = gate * sigmoid(gate * alpha)
        return ((up + 1) * glu) @ p["experts.down_proj"][e] + p["experts.down_proj_bias"][e]

    return combine(x, ids, w, expert)


def make_block(family, rng):
    """(state dict of one block, config values, numpy block function)."""
    if family == "mixtral":
        p = {"gate.weight": rand(rng, E, D), **per_expert(rng, ("w1", "w3", "w2"))}
        cfg = {"num_local_experts": E, "num_experts_per_tok": K, "hidden_act": "silu",
               "router_jitter_noise": 0.0, "intermediate_size": F}
        return p, cfg, lambda x: mixtral_block(p, x)
    names = ("gate_proj", "up_proj", "down_proj")
    if family in ("qwen3_moe", "qwen2_moe"):
        p = {"gate.weight": rand(rng, E, D), **per_expert(rng, names)}
        shared = family == "qwen2_moe"
        cfg = {"num_experts": E, "num_experts_per_tok": K, "norm_topk_prob": not shared,
               "hidden_act": "silu", "moe_intermediate_size": F}
        if shared:
            for n, shape in zip(names, [(2 * F, D), (2 * F, D), (D, 2 * F)], strict=True):
                p[f"shared_expert.{n}.weight"] = rand(rng, *shape)
            p["shared_expert_gate.weight"] = rand(rng, 1, D)
            cfg["shared_expert_intermediate_size"] = 2 * F
        return p, cfg, lambda x: qwen_block(p, x, cfg["norm_topk_prob"], shared)
    if family == "deepseek_v3":
        p = {"gate.weight": rand(rng, E, D),
             "gate.e_score_correction_bias": rand(rng, E, scale=0.05), **per_expert(rng, names)}
        for n, shape in zip(names, [(F, D), (F, D), (D, F)], strict=True):
            p[f"shared_experts.{n}.weight"] = rand(rng, *shape)
        cfg = {"n_routed_experts": E, "num_experts_per_tok": K, "n_group": 4, "topk_group": 2,
               "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
               "scoring_func": "sigmoid", "hidden_act": "silu", "moe_intermediate_size": F}
        return p, cfg, lambda x: deepseek_block(p, x, cfg)
    limit = 0.6  # small, so that the clamps act on these small weights
    p = {"router.weight": rand(rng, E, D), "router.bias": rand(rng, E),
         "experts.gate_up_proj": rand(rng, E, D, 2 * F),
         "experts.gate_up_proj_bias": rand(rng, E, 2 * F),
         "experts.down_proj": rand(rng, E, F, D), "experts.down_proj_bias": rand(rng, E, D)}
    cfg = {"num_local_experts": E, "num_experts_per_tok": K, "swiglu_limit": limit,
           "hidden_act": "silu", "intermediate_size": F}
    return p, cfg, lambda x: gpt_oss_block(p, x, limit)


FAMILIES = {  # family -> (mesh shape or None, transport)
    "mixtral": (None, "dense"),
    "qwen3_moe": (None, "ragged"),
    "qwen2_moe": (None, "dense"),
    "deepseek_v3": ((2, 4), "ragged"),
    "gpt_oss": ((4, 2), "dense"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_matches_the_family_block(family):
    rng = np.random.default_rng(list(FAMILIES).index(family))
    block, cfg, block_fn = make_block(family, rng)
    prefix = "model.layers.1.mlp."
    state = {prefix + k: v for k, v in block.items()} | {"model.norm.weight": np.ones(D)}
    params, opts = moe.convert.from_transformers(family, state, cfg, prefix=prefix,
                                                 transport=FAMILIES[family][1])
    shape = FAMILIES[family][0]
    mesh = None if shape is None else jax.make_mesh(shape, ("data", "expert"))
    layer = moe.MoE(D, F, options=opts, mesh=mesh, rngs=nnx.Rngs(0))
    moe.convert.load(layer, params)
    x = rng.normal(size=(2, T // 2, D))
    y, aux = nnx.jit(lambda m, x: m(x))(layer, x.astype(np.float32))
    want = block_fn(x.reshape(-1, D)).reshape(x.shape)
    scale = np.abs(want).max()
    chex.assert_trees_all_close(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5 * scale)
    assert int(aux["tokens_per_expert"].sum()) == T * K
    if family == "gpt_oss":
        gu = block["experts.gate_up_proj"]
        np.testing.assert_array_equal(params["w_gate_up"][..., :F], gu[..., ::2])
        assert opts.experts.activation == moe.GatedActivation("clamped_swiglu", 1.702, 0.6)


def test_fused_layout_equals_per_expert_layout():
    """transformers 5 stores Mixtral / Qwen / DeepSeek experts fused: gate_up_proj [E, 2f, d]
    (gate rows first) and down_proj [E, d, f]; both layouts convert to the same params."""
    rng = np.random.default_rng(7)
    block, cfg, _ = make_block("mixtral", rng)
    fused = {"gate.weight": block["gate.weight"],
             "experts.gate_up_proj": np.stack([np.concatenate(
                 [block[f"experts.{i}.w1.weight"], block[f"experts.{i}.w3.weight"]]) for i in
                 range(E)]),
             "experts.down_proj": np.stack([block[f"experts.{i}.w2.weight"] for i in range(E)])}
    a, opts_a = moe.convert.from_transformers("mixtral", block, cfg)
    b, opts_b = moe.convert.from_transformers("mixtral", fused, cfg)
    chex.assert_trees_all_equal(a, b)
    assert opts_a == opts_b


def test_options_follow_the_config():
    rng = np.random.default_rng(3)
    block, cfg, _ = make_block("mixtral", rng)
    _, opts = moe.convert.from_transformers("mixtral", block, {**cfg, "router_jitter_noise": 0.1,
                                                                "hidden_act": "gelu"})
    assert opts.router.router_jitter_noise == 0.1 and opts.experts.activation.kind == "gelu"
    block, cfg, _ = make_block("deepseek_v3", rng)
    params, opts = moe.convert.from_transformers("deepseek_v3", block, cfg, dispatch_dtype="bf16")
    r = opts.router
    assert (r.score_fn, r.num_groups, r.topk_groups, r.routed_scaling) == ("sigmoid", 4, 2, 2.5)
    assert opts.experts.num_shared_experts == 1 and opts.dispatch.dispatch_dtype == "bf16"
    np.testing.assert_array_equal(params["balancing_bias"], block["gate.e_score_correction_bias"])


@pytest.mark.parametrize("case,match", [
    ("family", "family='llama' is not supported"),
    ("missing expert", r"holds experts \[0, 1, 2, 3, 4, 5, 6\]"),
    ("shape", r"'experts.3.w2.weight' has shape \(16, 4\); expected \(16, 8\)"),
    ("config", "config lacks 'num_local_experts'"),
    ("load", r"the model has no variable 'router_bias'"),
    ("load missing", r"params lack \['w_down'\]"),
])
def test_errors_name_the_key(case, match):
    rng = np.random.default_rng(0)
    block, cfg, _ = make_block("mixtral", rng)
    convert = moe.convert.from_transformers
    with pytest.raises(ValueError, match=match):
        if case == "family":
            convert("llama", block, cfg)
        elif case == "missing expert":
            convert("mixtral", {k: v for k, v in block.items() if ".7." not in k}, cfg)
        elif case == "shape":
            convert("mixtral", {**block, "experts.3.w2.weight": np.ones((D, 4))}, cfg)
        elif case == "config":
            convert("mixtral", block, {"num_experts_per_tok": K})
        else:
            params, opts = convert("mixtral", block, cfg)
            layer = moe.MoE(D, F, options=opts, rngs=nnx.Rngs(0))
            if case == "load":
                params = {**params, "router_bias": np.zeros(E)}
            else:
                params = {k: v for k, v in params.items() if k != "w_down"}
            moe.convert.load(layer, params)
