"""moe.MoE (NNX) and moe_linen against a dense one-device MoE written as plain einsums.

The reference below reads the layer's own params and routes with its RouterConfig, then does
everything else on one device in f32: router scores, (group-limited, biased) top-k, weights,
every expert on every token, the weighted sum, shared experts, and both auxiliary losses.
Comparisons ("close") are per leaf: |a - r| <= rtol * (|r| + max|r|); FP8 paths use cosine
and relative RMS error (cosine >= 0.99, relative RMS < 0.1).
"""

import dataclasses
import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _meshes import make_mesh
from flax import nnx
from jax.sharding import PartitionSpec as P

import moe
import muon_jax
from accel_kernels.gmm import api as gmm_api

E, K = 8, 2  # experts, top-k
B, S = 4, 16  # 64 tokens: 8 per device on 8 devices
D, F = 32, 16  # f32 / bf16 shapes
DQ, FQ, BLOCK = 128, 128, 32  # FP8 shapes: multiples of fp8_block_size
HI = jax.lax.Precision.HIGHEST
LB_COEF, Z_COEF = 0.1, 0.01  # objective = sum(y * ct) + LB_COEF * lb + Z_COEF * z

# (mesh shape ('data', 'expert'), axis types): expert-parallel sizes 1, 2, 4, 8, Explicit
# and Auto meshes.
MESHES = [((8, 1), "explicit"), ((4, 2), "auto"), ((2, 4), "explicit"), ((1, 8), "auto")]


# ----------------------------------------------------------------------------- helpers


def layer(d=D, f=F, mesh_spec=((2, 4), "explicit"), seed=0, dtype=jnp.float32, **kw):
    mesh = make_mesh(mesh_spec[0], axis_type=mesh_spec[1]) if mesh_spec is not None else None
    return moe.MoE(d, f, options=moe.MoEOptions.create(E, K, **kw), mesh=mesh, dtype=dtype,
                   rngs=nnx.Rngs(seed))


def inputs(d=D, b=B, s=S, seed=1):
    kx, kc = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (b, s, d), jnp.float32), jax.random.normal(kc, (b, s, d))


def params_of(model):
    """The layer's variables as one-device numpy arrays (params and the balancing bias)."""
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def objective(y, lb, z, ct):
    return jnp.sum(y.astype(jnp.float32) * ct) + LB_COEF * lb + Z_COEF * z


def ref_routing(x, params, cfg):
    """(ids, weights, scores, logits) of the documented router, in plain jnp."""
    e = cfg.num_experts
    logits = jnp.einsum("td,de->te", x, params["router_kernel"], precision=HI)
    if cfg.score_fn == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = jax.lax.stop_gradient(scores) + params["balancing_bias"]
    g, tg = cfg.num_groups, cfg.topk_groups
    if tg is not None and tg < g:  # keep the tg groups with the largest top-2 sums
        group_score = jnp.sort(choice.reshape(-1, g, e // g), axis=-1)[..., -2:].sum(-1)
        group_rank = jnp.argsort(jnp.argsort(-group_score, axis=-1), axis=-1)
        keep = jnp.repeat(group_rank < tg, e // g, axis=-1)
        choice = jnp.where(keep, choice, -jnp.inf)
    ids = jax.lax.top_k(choice, cfg.top_k)[1]
    w = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.renormalize:
        w = w / w.sum(-1, keepdims=True)
    return ids, w * cfg.routed_scaling, scores, logits


def reference(params, x, cfg, kept=None, quantize=None):
    """Dense one-device MoE: y [T, d], load-balance loss, z loss, tokens per expert.

    ``kept`` (bool [T, k]) zeroes dropped slots; ``quantize(a, axis)`` (if given) rounds the
    forward GEMM operands as an FP8 GEMM does (x, h per row; weights along their fan-in).
    """
    q = quantize or (lambda a, axis: a)
    e = cfg.num_experts
    ids, w, scores, logits = ref_routing(x, params, cfg)
    if kept is not None:
        w = jnp.where(kept, w, 0.0)
    xq = q(x, -1)
    z = jnp.einsum("td,edf->tef", xq, q(params["w_gate_up"], 1), precision=HI)
    gate, up = jnp.split(z, 2, axis=-1)
    h = q(jax.nn.silu(gate) * up, -1)
    y_all = jnp.einsum("tef,efd->ted", h, q(params["w_down"], 1), precision=HI)
    y = jnp.einsum("tk,tkd->td", w, jnp.take_along_axis(y_all, ids[:, :, None], axis=1))
    if "shared_gate_up" in params:
        zs = jnp.einsum("td,df->tf", x, params["shared_gate_up"], precision=HI)
        gs, us = jnp.split(zs, 2, axis=-1)
        y = y + jnp.einsum("tf,fd->td", jax.nn.silu(gs) * us, params["shared_down"], precision=HI)
    counts = jax.nn.one_hot(ids, e, dtype=jnp.int32).sum((0, 1))
    probs = scores / scores.sum(-1, keepdims=True)
    lb = e * jnp.sum(counts / (x.shape[0] * cfg.top_k) * probs.mean(0))
    zl = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return y, lb, zl, counts


@functools.partial(jax.jit, static_argnames=("cfg", "quantize"))
def ref_step(params, x, ct, cfg, kept=None, quantize=None):
    """y [b, s, d], aux, grads of (trainable params, x) of the objective, in f32."""
    bias = params["balancing_bias"]
    train = {k: v for k, v in params.items() if k != "balancing_bias"}

    def loss(train, x):
        y, lb, zl, counts = reference({**train, "balancing_bias": bias},
                                      x.reshape(-1, x.shape[-1]), cfg, kept, quantize)
        y = y.reshape(x.shape)
        return objective(y, lb, zl, ct), (y, dict(load_balance_loss=lb, router_z_loss=zl,
                                                 tokens_per_expert=counts))

    (_, (y, aux)), (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(train, x)
    return y, aux, gp, gx


@nnx.jit
def layer_step(model, x, ct):
    """The layer's y, aux, grads of (params, x) of the objective."""

    def loss(model, x):
        y, aux = model(x)
        return objective(y, aux["load_balance_loss"], aux["router_z_loss"], ct), (y, aux)

    (_, (y, aux)), (gm, gx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
    return y, aux, gm, gx


def run_both(model, x, ct, kept=None, quantize=None):
    """(layer, reference) results as numpy trees {'y', 'x', <param>: grad} + the layers' aux."""
    params = params_of(model)
    y, aux, gm, gx = layer_step(model, x, ct)
    got = {"y": y, "x": gx, **nnx.to_pure_dict(gm)}
    ry, raux, gp, rgx = ref_step(params, np.asarray(x), np.asarray(ct), model.options.router,
                                 kept, quantize)
    want = {"y": ry, "x": rgx, **gp}
    assert set(got) == set(want), (set(got), set(want))
    assert y.dtype == model.dtype and y.shape == x.shape
    as_np = lambda t: jax.tree.map(lambda a: np.asarray(a, np.float32), t)
    return as_np(got), as_np(want), jax.tree.map(np.asarray, aux), jax.tree.map(np.asarray, raux)


def assert_close(got, want, rtol):
    """Per leaf: |got - want| <= rtol * (|want| + max|want|)."""
    for name in want:
        scale = float(np.max(np.abs(want[name])))
        chex.assert_trees_all_close(got[name], want[name], rtol=rtol, atol=rtol * scale,
                                    custom_message=name)


def fp8_metrics(a, r):
    a, r = np.ravel(a).astype(np.float64), np.ravel(r).astype(np.float64)
    cos = a @ r / (np.linalg.norm(a) * np.linalg.norm(r))
    return cos, np.linalg.norm(a - r) / np.linalg.norm(r)


def assert_fp8_close(got, want, label):
    for name in want:
        cos, rel = fp8_metrics(got[name], want[name])
        print(f"{label} {name:15s} cosine {cos:.5f} rel-RMS {rel:.4f}")
        assert cos >= 0.99 and rel < 0.1, (label, name, cos, rel)


def assert_aux(aux, raux, kept=None):
    """The losses and counts of the reference; ``kept`` (bool [T, k], None: all) the slots
    the capacity kept: ``dropped_slots`` counts the others, ``dropped_tokens`` their tokens."""
    chex.assert_trees_all_close(aux["load_balance_loss"], raux["load_balance_loss"], rtol=1e-5)
    chex.assert_trees_all_close(aux["router_z_loss"], raux["router_z_loss"], rtol=1e-5)
    np.testing.assert_array_equal(aux["tokens_per_expert"], raux["tokens_per_expert"])
    lost = np.zeros((1, 1), bool) if kept is None else ~kept
    assert int(aux["dropped_slots"]) == int(lost.sum())
    assert int(aux["dropped_tokens"]) == int(lost.any(axis=1).sum())


# ----------------------------------------------------------------------------- 1. exactness


@functools.cache
def _f32_run(mesh_spec, transport):
    """run_both of the f32 layer with the default (XLA on the CPU) GEMMs: computed once for
    test_f32_matches_reference and the Pallas test that compares against it."""
    return run_both(layer(mesh_spec=mesh_spec, transport=transport), *inputs())


@pytest.mark.parametrize("transport", ["dense", "ragged"])
@pytest.mark.parametrize("mesh_spec", MESHES, ids=lambda m: f"{m[0][0]}x{m[0][1]}-{m[1]}")
def test_f32_matches_reference(mesh_spec, transport):
    got, want, aux, raux = _f32_run(mesh_spec, transport)
    assert got["w_gate_up"].shape == (E, D, 2 * F)
    assert_close(got, want, rtol=1e-5)
    assert_aux(aux, raux)


@pytest.mark.parametrize("mesh_spec,transport", [(MESHES[2], "dense"), (MESHES[3], "ragged")])
def test_bf16_matches_reference(mesh_spec, transport):
    model = layer(mesh_spec=mesh_spec, transport=transport, dtype=jnp.bfloat16)
    x, ct = inputs()
    got, want, _, _ = run_both(model, x, ct)  # checks y.dtype == bfloat16
    assert_close(got, want, rtol=2e-2)


FP8_OPTIONS = {
    "dispatch": dict(dispatch_dtype="fp8"),
    "combine_grad": dict(combine_grad_dtype="fp8"),
    "gemm": dict(gemm_dtype="fp8"),
    "save_z": dict(save_z="fp8"),
    "wgrad": dict(wgrad_dtype="fp8"),
    "all": dict(dispatch_dtype="fp8", combine_grad_dtype="fp8", gemm_dtype="fp8",
                save_z="fp8", wgrad_dtype="fp8"),
}
# (option, mesh, transport, (d_model, d_ff)): save_z needs only 2 * d_ff, wgrad no multiple.
FP8_CASES = [
    ("dispatch", MESHES[2], "dense", (DQ, FQ)),
    ("combine_grad", MESHES[1], "ragged", (DQ, FQ)),
    ("gemm", MESHES[2], "ragged", (DQ, FQ)),
    ("save_z", MESHES[3], "dense", (D, 64)),
    ("wgrad", MESHES[1], "dense", (D, F)),
    ("all", MESHES[3], "ragged", (DQ, FQ)),
]


@pytest.mark.parametrize("option,mesh_spec,transport,dims", FP8_CASES,
                         ids=[f"{o}-{t}-ep{m[0][1]}" for o, m, t, _ in FP8_CASES])
def test_fp8_matches_reference(option, mesh_spec, transport, dims):
    model = layer(*dims, mesh_spec=mesh_spec, transport=transport, dtype=jnp.bfloat16,
                  fp8_block_size=BLOCK, **FP8_OPTIONS[option])
    x, ct = inputs(dims[0])
    got, want, aux, raux = run_both(model, x, ct)
    assert_fp8_close(got, want, option)
    np.testing.assert_array_equal(aux["tokens_per_expert"], raux["tokens_per_expert"])


# ----------------------------------------------------------------------------- 2. save_z


def _layer_vjp(model, x):
    """y and the vjp of the whole layer (params, x) -> y; the vjp's leaves are the residuals
    the backward keeps."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p, rest)(x)[0])
    return jax.vjp(fwd, params, x)


def test_save_z_recompute_equals_bf16_and_saves_bytes():
    x, ct = inputs(DQ)
    kw = dict(mesh_spec=MESHES[2], dtype=jnp.bfloat16, fp8_block_size=BLOCK)
    models = {s: layer(DQ, FQ, save_z=s, **kw) for s in ("bf16", "fp8", "recompute")}
    vjps = {s: _layer_vjp(m, x) for s, m in models.items()}
    y_ref, vjp_ref = vjps["bf16"]
    y_rec, vjp_rec = vjps["recompute"]
    ct = ct.astype(jnp.bfloat16)
    same = lambda a, b: chex.assert_trees_all_equal(*(jax.tree.map(np.asarray, t) for t in (a, b)))
    same(y_rec, y_ref)
    same(vjp_rec(ct), vjp_ref(ct))  # gradients of every param and of x

    total = {}
    for s in models:
        leaves = jax.tree.leaves(vjps[s][1])
        total[s] = sum(leaf.nbytes for leaf in leaves)
        shapes = ", ".join(f"{leaf.dtype}{list(leaf.shape)}" for leaf in leaves)
        print(f"layer save_z={s:9s} residuals {total[s]:>9,d} B  [{shapes}]")
    z_bf16, z_fp8 = total["bf16"] - total["recompute"], total["fp8"] - total["recompute"]
    # z per device is [E_local, P * C, 2 * d_ff]: C = 16 (dropless: T_local rounded up to 8).
    z_expected = E * 4 * 16 * 2 * FQ * 2
    print(f"layer z bytes: bf16 {z_bf16:,d} (expected {z_expected:,d}), fp8 {z_fp8:,d} "
          f"(ratio {z_fp8 / z_bf16:.4f})")
    assert total["recompute"] < total["fp8"] < total["bf16"]
    assert z_bf16 == z_expected
    assert 0.49 <= z_fp8 / z_bf16 <= 0.52  # e4m3 data + one E8M0 byte per 32 channels


# ----------------------------------------------------------------------------- 3. FP8 + step


def _fp8_round(a, axis):
    """FP8 e4m3 round trip in blocks of BLOCK along ``axis`` (the GEMM's contraction axis)."""
    moved = jnp.moveaxis(a, axis, -1)
    out = moe.dequantize(moe.quantize(moved, block_size=BLOCK), dtype=jnp.float32)
    return jnp.moveaxis(out, -1, axis)


def test_fp8_gemm_uses_the_new_weights_after_a_step():
    model = layer(DQ, FQ, mesh_spec=MESHES[2], gemm_dtype="fp8", fp8_block_size=BLOCK)
    x, ct = inputs(DQ)
    optimizer = nnx.Optimizer(model, optax.sgd(5e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, ct):
        grads = nnx.grad(lambda m: jnp.sum(m(x)[0] * ct))(model)
        optimizer.update(model, grads)

    forward = nnx.jit(lambda m, x: m(x)[0])
    old = params_of(model)
    y_old = np.asarray(forward(model, x))
    train_step(model, optimizer, x, ct)
    new = params_of(model)
    y_new = np.asarray(forward(model, x))

    cfg = model.options.router
    ref_q = jax.jit(lambda p: reference(p, x.reshape(-1, DQ), cfg, quantize=_fp8_round)[0])
    r_old, r_new = (np.asarray(ref_q(p)).reshape(x.shape) for p in (old, new))
    moved = np.linalg.norm(new["w_gate_up"] - old["w_gate_up"]) / np.linalg.norm(old["w_gate_up"])
    err_new, err_old = fp8_metrics(y_new, r_new)[1], fp8_metrics(y_new, r_old)[1]
    print(f"weights moved {moved:.3f} (rel); y vs fp8-ref(new) {err_new:.2e}, "
          f"vs fp8-ref(old) {err_old:.2e}; before the step vs fp8-ref(old) "
          f"{fp8_metrics(y_old, r_old)[1]:.2e}")
    assert moved > 0.02
    assert fp8_metrics(y_old, r_old)[1] < 1e-3
    assert err_new < 1e-3 and err_old > 30 * err_new


# ----------------------------------------------------------------------------- 4. variants


ROUTER_CASES = {
    "shared": dict(num_shared_experts=2),
    "sigmoid": dict(score_fn="sigmoid", renormalize=True, routed_scaling=2.5),
    "groups": dict(num_groups=4, topk_groups=2),
}


@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_router_variants_match_reference(case):
    transport = "ragged" if case == "groups" else "dense"
    model = layer(mesh_spec=MESHES[2], transport=transport, **ROUTER_CASES[case])
    x, ct = inputs()
    got, want, aux, raux = run_both(model, x, ct)
    assert_close(got, want, rtol=1e-5)
    assert_aux(aux, raux)
    params, flat = params_of(model), np.asarray(x).reshape(-1, D)
    if case == "shared":
        assert got["shared_gate_up"].shape == (D, 2 * 2 * F)
        assert np.abs(got["shared_down"]).max() > 0
    if case == "sigmoid":  # renormalized weights sum to routed_scaling
        w = ref_routing(flat, params, model.options.router)[1]
        np.testing.assert_allclose(np.asarray(w).sum(-1), 2.5, rtol=1e-5)
    if case == "groups":  # the group limit changes some tokens' experts
        free = moe.RouterConfig(E, K)
        ids_g = np.asarray(ref_routing(flat, params, model.options.router)[0])
        ids_free = np.asarray(ref_routing(flat, params, free)[0])
        assert (np.sort(ids_g, -1) != np.sort(ids_free, -1)).any(axis=-1).sum() > 0
        groups = ids_g // (E // 4)
        assert all(len(set(row)) <= 2 for row in groups.tolist())


def test_balancing_bias_moves_load_and_changes_selection_only():
    model = layer(mesh_spec=MESHES[1], transport="dense")
    x, ct = inputs(b=8, s=32)  # 256 tokens

    @nnx.jit
    def balance_step(model, x):
        _, aux = model(x)
        model.update_balancing_bias(aux["tokens_per_expert"], 2e-3)
        return aux["tokens_per_expert"]

    loads = [np.asarray(balance_step(model, x)) for _ in range(30)]
    spread = [int(c.max() - c.min()) for c in loads]
    print("max - min load per step:", spread)
    assert spread[-1] < spread[0] / 2
    bias = np.asarray(model.balancing_bias[...])
    assert np.abs(bias).max() > 0
    # Against the reference with this bias: the bias changes the selection (counts differ
    # from the unbiased routing) but the weights stay the unbiased scores (y, grads match).
    got, want, aux, raux = run_both(model, x, ct)
    assert_close(got, want, rtol=1e-5)
    assert_aux(aux, raux)
    assert "balancing_bias" not in got  # not trained
    unbiased = {**params_of(model), "balancing_bias": np.zeros(E, np.float32)}
    ids0 = ref_routing(np.asarray(x).reshape(-1, D), unbiased, model.options.router)[0]
    counts0 = np.bincount(np.asarray(ids0).ravel(), minlength=E)
    assert (counts0 != aux["tokens_per_expert"]).any()


# ----------------------------------------------------------------------------- auto transport


def as_if_on_hopper(monkeypatch):
    """gemm_implementation='auto' answers as on a Hopper GPU: 'mosaic' for ragged x (emulated
    on CPU)."""
    monkeypatch.setattr(gmm_api, "auto_implementation", lambda ndim: "mosaic" if ndim == 2
                        else "xla")


def test_auto_transport_is_dropless_only_on_one_hopper_expert_group(monkeypatch):
    assert moe.auto_transport(1) == "dense" and moe.auto_transport(8) == "dense"  # CPU
    as_if_on_hopper(monkeypatch)
    assert moe.auto_transport(1) == "dropless"
    assert moe.auto_transport(2) == "dense"


def test_auto_on_one_hopper_device_runs_dropless_mosaic_and_matches_reference(monkeypatch):
    """What 'auto' runs on one H200 (dropless transport, Mosaic experts, here emulated by
    XLA on CPU): every slot kept even at a capacity factor that would drop, f32 close."""
    as_if_on_hopper(monkeypatch)
    model = layer(mesh_spec=MESHES[0], capacity_factor=0.5)
    x, ct = inputs()
    got, want, aux, raux = run_both(model, x, ct)
    assert_close(got, want, rtol=1e-5)
    assert_aux(aux, raux)


# ----------------------------------------------------------------------------- capacity


def test_capacity_drops_follow_the_documented_rule():
    cf, mesh_spec = 0.5, MESHES[2]
    model = layer(mesh_spec=mesh_spec, transport="dense", capacity_factor=cf)
    x, ct = inputs(b=8, s=64)  # 512 tokens, 64 per device
    n_dev = math.prod(mesh_spec[0])
    t_local = 8 * 64 // n_dev
    cap = -(-min(math.ceil(cf * t_local * K / E), t_local) // 8) * 8  # round up to 8
    ids = np.asarray(ref_routing(np.asarray(x).reshape(-1, D), params_of(model),
                                 model.options.router)[0])
    kept = np.zeros(ids.shape, bool)
    for dev in range(n_dev):  # tokens are split in contiguous blocks over ('data', 'expert')
        seen = np.zeros(E, int)
        for t in range(dev * t_local, (dev + 1) * t_local):
            for j in range(K):  # slots in (token, k) order; the first C per expert are kept
                kept[t, j] = seen[ids[t, j]] < cap
                seen[ids[t, j]] += 1
    n_dropped = int((~kept).sum())
    print(f"capacity {cap} per (device, expert): {n_dropped} of {ids.size} slots dropped")
    # some tokens lose one of their two slots, others both: slots and tokens differ
    assert 0 < int((~kept).any(1).sum()) < n_dropped
    got, want, aux, raux = run_both(model, x, ct, kept=kept)
    assert_close(got, want, rtol=1e-5)
    assert_aux(aux, raux, kept=kept)


def test_ambient_mesh_and_sharded_input():
    """mesh=None under jax.set_mesh: params and y keep their shardings; values match."""
    mesh = make_mesh((2, 4))
    x, ct = inputs()
    with jax.set_mesh(mesh):
        model = moe.MoE(D, F, options=moe.MoEOptions.create(E, K, transport="ragged"),
                        rngs=nnx.Rngs(0))
        assert model.w_gate_up[...].sharding.spec == P("expert", None, None)
        xs = jax.device_put(x, P("data"))
        got, want, aux, raux = run_both(model, xs, ct)
        y = layer_step(model, xs, ct)[0]
    assert y.sharding.spec == P("data", None, None)
    assert_close(got, want, rtol=1e-5)
    assert_aux(aux, raux)


# ----------------------------------------------------------------------------- 5. errors


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: layer(48, F, mesh_spec=None, dispatch_dtype="fp8", fp8_block_size=BLOCK),
         r"d_model \(for dispatch_dtype='fp8'\) = 48 must be a positive multiple of the FP8 "
         r"block size 32; pad it to a multiple of 32"),
        (lambda: layer(D, 40, mesh_spec=None, save_z="fp8", fp8_block_size=BLOCK),
         r"2 \* d_ff \(for save_z='fp8'\) = 80 must be"),
        (lambda: layer(mesh_spec=None, fp8_block_size=0), r"fp8_block_size must be a positive"),
        (lambda: layer(mesh_spec=MESHES[2], expert_axis="model"),
         r"expert_axis='model' is not an axis of the mesh.*pass expert_axis="),
    ],
    ids=["d_model-fp8-block", "save_z-fp8-block", "block-size", "missing-expert-axis"],
)
def test_construction_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_call_errors():
    model = layer(mesh_spec=MESHES[2])
    x, _ = inputs()
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, d_model\].*reshape"):
        model(x.reshape(-1, D))
    with pytest.raises(ValueError, match=r"d_model"):
        model(x[..., :16])


# ----------------------------------------------------------------------------- 6. training


def test_trains_with_muon_under_nnx_jit_and_optimizer():
    model = layer(mesh_spec=MESHES[1], transport="dense")
    x, _ = inputs()
    target = jnp.tanh(x[..., ::-1])
    params = nnx.state(model, nnx.Param)
    mask = muon_jax.default_muon_mask(nnx.to_pure_dict(params))
    assert mask["w_gate_up"] and mask["w_down"]  # expert banks: Muon's matrices
    shardings = jax.tree.map(lambda a: a.sharding, nnx.to_pure_dict(params))
    f32 = muon_jax.NewtonSchulzOptions(dtype=jnp.float32)  # to compare with orthogonalize
    optimizer = nnx.Optimizer(model, muon_jax.muon(0.05, newton_schulz=f32), wrt=nnx.Param)

    def loss(model):
        y, aux = model(x)
        return jnp.mean((y - target) ** 2) + 1e-2 * aux["load_balance_loss"]

    @nnx.jit
    def train_step(model, optimizer, x):
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    def halves(bank):  # [E, d, 2f] -> the 2E matrices [d, f] of the gate and up halves
        return np.asarray(bank).reshape(E, D, 2, F).transpose(0, 2, 1, 3).reshape(2 * E, D, F)

    w0 = np.asarray(model.w_gate_up[...])
    grad = nnx.jit(nnx.grad(loss))(model)["w_gate_up"][...]
    losses = [float(train_step(model, optimizer, x))]
    # First step: each expert's gate and up halves are updated apart (muon_jax reads the MoE
    # layer's view: 2E matrices [d, f]), each by lr * 0.2 * sqrt(max(d, f)) times Newton-Schulz
    # of its gradient (the first momentum is a multiple of the gradient).
    step = (w0 - np.asarray(model.w_gate_up[...])) / (0.05 * 0.2 * math.sqrt(max(D, F)))
    want = muon_jax.orthogonalize(halves(grad), dtype=jnp.float32)
    np.testing.assert_allclose(halves(step), want, atol=1e-4)  # entries O(0.1)
    losses += [float(train_step(model, optimizer, x)) for _ in range(5)]
    print("muon losses:", [f"{v:.4f}" for v in losses])
    assert losses[-1] < 0.9 * losses[0]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))
    after = jax.tree.map(lambda a: a.sharding, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    for name, sharding in shardings.items():
        assert after[name].is_equivalent_to(sharding, 3 if name != "router_kernel" else 2), name


# ----------------------------------------------------------------------------- 7. Linen


def test_linen_wrapper_matches_nnx():
    mesh = make_mesh((4, 2))  # Explicit: a jitted init that creates sharded values
    x, ct = inputs()  # needs the mesh as context
    lin = moe.moe_linen(D, F, options=moe.MoEOptions.create(E, K, transport="ragged"), mesh=mesh)
    with jax.set_mesh(mesh):
        variables = nn.unbox(jax.jit(lin.init)(jax.random.key(3), x))
    assert variables["params"]["w_gate_up"].sharding.spec == P("expert", None, None)
    assert set(variables) == {"params", "balancing_bias"}
    model = moe.MoE(D, F, options=moe.MoEOptions.create(E, K, transport="ragged"), mesh=mesh,
                    rngs=nnx.Rngs(0))
    for name, value in variables["params"].items():  # copy the Linen params over
        getattr(model, name)[...] = value
    y_nnx, aux_nnx, gm, _ = layer_step(model, x, ct)

    @jax.jit
    def linen_step(variables, x):
        def loss(params):
            y, aux = lin.apply({**variables, "params": params}, x)
            return objective(y, aux["load_balance_loss"], aux["router_z_loss"], ct), (y, aux)

        return jax.grad(loss, has_aux=True)(variables["params"])

    grads, (y, aux) = linen_step(variables, x)
    chex.assert_trees_all_close(np.asarray(y), np.asarray(y_nnx), rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, aux), jax.tree.map(np.asarray, aux_nnx))
    chex.assert_trees_all_close(jax.tree.map(np.asarray, grads),
                                jax.tree.map(np.asarray, nnx.to_pure_dict(gm)),
                                rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- 7. pallas


@pytest.mark.parametrize(
    "mesh_spec,transport",
    [(MESHES[2], "ragged"), (MESHES[3], "dense")],
    ids=["ragged-2x4-explicit", "dense-1x8-auto"],
)
def test_pallas_backend_matches_other_backends_inside_the_layer(mesh_spec, transport):
    """gemm_implementation='triton' (interpreted on CPU) inside the layer's shard_map: y, aux
    and every gradient equal those of the XLA implementations in f32 (the default GEMMs of
    test_f32_matches_reference, which are XLA's on the CPU)."""
    x, ct = inputs()
    model = layer(mesh_spec=mesh_spec, transport=transport, gemm_implementation="triton")
    y, aux, gm, gx = layer_step(model, x, ct)
    got = {"y": np.asarray(y), "x": np.asarray(gx),
           **jax.tree.map(np.asarray, nnx.to_pure_dict(gm))}
    aux = jax.tree.map(np.asarray, aux)
    resolved = moe.MoEOptions.create(E, K, transport=transport).resolve(
        B * S, D, F, mesh=make_mesh(mesh_spec[0], axis_type=mesh_spec[1]))
    assert resolved.experts.gemm_implementation == "xla"
    want, _, raux, _ = _f32_run(mesh_spec, transport)  # the XLA layer's own y, grads, aux
    assert set(got) == set(want)
    assert_close(got, want, rtol=1e-5)
    assert_aux(aux, raux)


def test_pallas_backend_refused_on_tpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="gemm_implementation='triton' needs an NVIDIA GPU or "
                       "the CPU"):
        moe.MoE(64, 32, options=moe.MoEOptions.create(8, 2, gemm_implementation="triton"),
                rngs=nnx.Rngs(0))


@functools.cache
def _mosaic_dropless_grads(expert_devices: int, aligned_dispatch: bool, dispatch_dtype):
    """Layer outputs and gradients on the 'mosaic' experts (XLA-emulated here) over the
    dropless transport, the dispatch writing the 128-aligned layout or the experts gathering
    plain ragged rows into it (`moe.experts._aligned_call`)."""
    e, k, d, f, t = 8, 2, 128, 64, 96
    keys = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(keys[0], (expert_devices, t, d), jnp.bfloat16)
    router = jax.random.normal(keys[1], (d, e), jnp.float32) * 0.5
    wgu = (jax.random.normal(keys[2], (e, d, 2 * f)) * d**-0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(keys[3], (e, f, d)) * f**-0.5).astype(jnp.bfloat16)
    opts = moe.MoEOptions.create(e, k, transport="dropless", gemm_implementation="mosaic",
                                 dispatch_dtype=dispatch_dtype)
    mesh = make_mesh((1, expert_devices))

    def loss(x, router, wgu, wd):
        y, _ = moe.moe_apply(x, router, wgu, wd, options=opts, mesh=mesh)
        return jnp.sum(y.astype(jnp.float32) ** 2), y

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    real = moe.MoEOptions.resolve
    try:
        if not aligned_dispatch:  # the plain layout: the experts gather it into the aligned one
            moe.MoEOptions.resolve = lambda *a, **kw: dataclasses.replace(
                real(*a, **kw), group_alignment=None)
        return fn(x, router, wgu, wd)
    finally:
        moe.MoEOptions.resolve = real


@pytest.mark.parametrize("devices,wire", [(1, None), (2, "fp8")])
def test_dropless_dispatch_writes_the_mosaic_layout(devices, wire):
    """On 'mosaic' experts the dropless dispatch writes the 128-aligned layout itself: the
    same outputs and gradients, bit for bit, as gathering the plain rows into it and back."""
    got = _mosaic_dropless_grads(devices, True, wire)
    want = _mosaic_dropless_grads(devices, False, wire)
    mesh = make_mesh((1, 1))
    assert moe.MoEOptions.create(8, 2, transport="dropless", gemm_implementation="mosaic").resolve(
        64, 128, 64, mesh=mesh).group_alignment == 128
    assert moe.MoEOptions.create(8, 2, transport="dropless", gemm_implementation="xla").resolve(
        64, 128, 64, mesh=mesh).group_alignment is None
    assert float(jnp.abs(got[0][1]).max()) > 0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
