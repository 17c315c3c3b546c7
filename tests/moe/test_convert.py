"""moe.convert: transformers MoE blocks -> moe.MoE, checked against numpy blocks written here.

Each test builds one block's parameters in the layout its transformers model documents
(state-dict keys, torch ``Linear`` weights ``[out, in]``), converts them, loads them into a
``moe.MoE`` and compares the layer's output with a numpy (float64) implementation of that
family's block, written from transformers' modeling code: router, top-k, weights, experts,
biases, shared experts.
"""

import re

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


def test_deepseek_v3_routing_is_node_limited_over_hosts():
    """DeepSeek-V3's groups one per host (4 hosts of 2 devices, topk_group 1): through the
    two-stage exchange the converted layer still equals the block, each token's experts lie
    on one host, and the exchange's first stage carries one column per token."""
    rng = np.random.default_rng(11)
    block, cfg, _ = make_block("deepseek_v3", rng)
    cfg = {**cfg, "topk_group": 1}
    params, opts = moe.convert.from_transformers(
        "deepseek_v3", block, cfg, transport="dense", expert_axis=("host", "expert"),
        host_axis="host", return_routing=True)
    mesh = jax.make_mesh((4, 2), ("host", "expert"))
    assert opts.resolve(T, D, F, mesh=mesh).host_slots == 1
    layer = moe.MoE(D, F, options=opts, mesh=mesh, rngs=nnx.Rngs(0))
    moe.convert.load(layer, params)
    x = rng.normal(size=(2, T // 2, D))
    y, aux = nnx.jit(lambda m, x: m(x))(layer, x.astype(np.float32))
    want = deepseek_block(block, x.reshape(-1, D), cfg).reshape(x.shape)
    chex.assert_trees_all_close(np.asarray(y, np.float64), want, rtol=1e-5,
                                atol=1e-5 * np.abs(want).max())
    hosts = np.asarray(aux["expert_ids"]) // (E // 4)
    assert np.all(hosts.min(-1) == hosts.max(-1)) and int(aux["dropped_slots"]) == 0


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
    ("missing expert", r"holds experts \[0, 1, 2, 3, 4, 5, 6\]"),
    ("shape", r"'experts.3.w2.weight' has shape \(16, 4\); expected \(16, 8\)"),
    ("load", r"the model has no variable 'router_bias'"),
    ("load missing", r"params lack \['w_down'\]"),
])
def test_errors_name_the_key(case, match):
    rng = np.random.default_rng(0)
    block, cfg, _ = make_block("mixtral", rng)
    convert = moe.convert.from_transformers
    with pytest.raises(ValueError, match=match):
        if case == "missing expert":
            convert("mixtral", {k: v for k, v in block.items() if ".7." not in k}, cfg)
        elif case == "shape":
            convert("mixtral", {**block, "experts.3.w2.weight": np.ones((D, 4))}, cfg)
        else:
            params, opts = convert("mixtral", block, cfg)
            layer = moe.MoE(D, F, options=opts, rngs=nnx.Rngs(0))
            if case == "load":
                params = {**params, "router_bias": np.zeros(E)}
            else:
                params = {k: v for k, v in params.items() if k != "w_down"}
            moe.convert.load(layer, params)


# ------------------------------------------------------------------- config spellings


def _spelled(cfg, key, spelling):
    """``cfg`` with ``key``'s value (whatever spelling held it) under ``spelling`` only."""
    value = next(cfg[s] for s in key.spellings if s in cfg)
    return {k: v for k, v in cfg.items() if k not in key.spellings} | {spelling: value}


SPELLINGS = [(family, name, s) for family, keys in moe.convert.CONFIG_KEYS.items()
             for name, key in keys.items() for s in key.spellings if len(key.spellings) > 1]


def test_every_family_has_a_spelling_table():
    assert set(moe.convert.CONFIG_KEYS) == set(moe.convert.FAMILIES)
    for keys in moe.convert.CONFIG_KEYS.values():
        assert keys["num_experts"].required and keys["top_k"].required


@pytest.mark.parametrize("family,name,spelling", SPELLINGS)
def test_each_spelling_reads_the_same(family, name, spelling):
    """transformers 4.x and 5.x names (``to_dict()`` keys, ``attribute_map`` aliases) of one
    value give the same options: e.g. Qwen3-MoE's ``num_experts`` / ``num_local_experts``."""
    block, cfg, _ = make_block(family, np.random.default_rng(0))
    _, want = moe.convert.from_transformers(family, block, cfg)
    key = moe.convert.CONFIG_KEYS[family][name]
    _, got = moe.convert.from_transformers(family, block, _spelled(cfg, key, spelling))
    assert got == want


@pytest.mark.parametrize("family,v4,v5", [
    ("qwen3_moe", {"num_experts": E}, {"num_local_experts": E}),
    ("qwen2_moe", {"num_experts": E}, {"num_local_experts": E}),
    ("mixtral", {"num_local_experts": E}, {"num_experts": E}),
    ("deepseek_v3", {"n_routed_experts": E}, {"num_local_experts": E}),
    ("gpt_oss", {"num_local_experts": E, "num_experts_per_tok": K},
     {"num_experts": E, "experts_per_token": K}),
])
def test_the_dicts_of_both_transformers_versions_as_written(family, v4, v5):
    """Literal dicts: the expert count as transformers 4 writes it and as transformers 5's
    ``to_dict()`` (or its ``attribute_map``) does."""
    block, cfg, _ = make_block(family, np.random.default_rng(0))
    rest = {k: v for k, v in cfg.items() if k not in {*v4, *v5, "num_experts",
                                                      "num_local_experts", "n_routed_experts"}}
    _, a = moe.convert.from_transformers(family, block, {**rest, **v4})
    _, b = moe.convert.from_transformers(family, block, {**rest, **v5})
    assert a == b and a.router.num_experts == E and a.router.top_k == K


REQUIRED = [(family, name) for family, keys in moe.convert.CONFIG_KEYS.items()
            for name, key in keys.items() if key.required]


@pytest.mark.parametrize("family,name", REQUIRED)
def test_a_missing_required_value_is_named_with_its_spellings(family, name):
    block, cfg, _ = make_block(family, np.random.default_rng(0))
    key = moe.convert.CONFIG_KEYS[family][name]
    spellings = " or ".join(repr(s) for s in key.spellings)
    with pytest.raises(ValueError, match=f"config lacks {re.escape(spellings)}, which a "
                                         f"{family} block needs"):
        moe.convert.from_transformers(family, block, {k: v for k, v in cfg.items()
                                                      if k not in key.spellings})


def test_missing_values_take_transformers_defaults():
    rng = np.random.default_rng(0)
    block, cfg, _ = make_block("deepseek_v3", rng)
    bare = {k: cfg[k] for k in ("n_routed_experts", "num_experts_per_tok", "n_group",
                                "topk_group")}
    _, opts = moe.convert.from_transformers("deepseek_v3", block, bare)
    r = opts.router
    assert (r.score_fn, r.renormalize, r.routed_scaling) == ("sigmoid", True, 2.5)
    assert opts.experts.num_shared_experts == 1
    block, cfg, _ = make_block("gpt_oss", rng)
    _, opts = moe.convert.from_transformers("gpt_oss", block, {"num_local_experts": E,
                                                               "experts_per_token": K})
    assert opts.experts.activation == moe.GatedActivation("clamped_swiglu", 1.702, 7.0)
    block, cfg, _ = make_block("qwen3_moe", rng)
    _, opts = moe.convert.from_transformers("qwen3_moe", block, {"num_local_experts": E,
                                                                 "num_experts_per_tok": K})
    assert not opts.router.renormalize and opts.experts.activation.kind == "silu"


def test_deepseek_groups_none_means_no_group_limit():
    block, cfg, _ = make_block("deepseek_v3", np.random.default_rng(0))
    _, opts = moe.convert.from_transformers("deepseek_v3", block,
                                            {**cfg, "n_group": None, "topk_group": None})
    assert (opts.router.num_groups, opts.router.topk_groups) == (1, None)


_CONFIG_CLASSES = {"mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig",
                   "qwen3_moe": "Qwen3MoeConfig", "deepseek_v3": "DeepseekV3Config",
                   "gpt_oss": "GptOssConfig"}


def _hf_config(family, cfg):
    """The installed transformers' config class of ``family``, built from ``cfg`` (skips the
    test where transformers or that class is absent; no torch needed)."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is optional: its config classes are checked where "
        "it is installed")
    cls = getattr(transformers, _CONFIG_CLASSES[family], None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {_CONFIG_CLASSES[family]}")
    return cls(**cfg)  # keys the class lacks (scoring_func, ...) are kept as attributes


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_installed_transformers_configs_convert(family):
    """The config object and its ``to_dict()`` (transformers 5 writes e.g. Qwen3-MoE's
    ``num_local_experts``) give the options of the literal dict."""
    block, cfg, _ = make_block(family, np.random.default_rng(0))
    hf = _hf_config(family, cfg)
    _, want = moe.convert.from_transformers(family, block, cfg)
    for config in (hf, hf.to_dict()):
        _, got = moe.convert.from_transformers(family, block, config)
        assert got == want


@pytest.mark.parametrize("family", list(FAMILIES))
def test_defaults_are_the_installed_transformers_defaults(family):
    transformers = pytest.importorskip("transformers", reason="transformers is optional")
    cls = getattr(transformers, _CONFIG_CLASSES[family], None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {_CONFIG_CLASSES[family]}")
    hf = cls()
    for name, key in moe.convert.CONFIG_KEYS[family].items():
        if not key.required and hasattr(hf, key.spellings[0]):
            assert getattr(hf, key.spellings[0]) == key.default, (family, name)
