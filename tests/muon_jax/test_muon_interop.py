"""PyTorch conventions (bias_correction=False, 'spectral_unclamped'), the params' shardings kept
on Auto and Explicit meshes, a global-norm clip for unreduced gradients, and a TPU export."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_jax
from muon_jax import ShardingOptions

# The stacks here are plain arrays meant as batches of matrices: the default view is right.
pytestmark = pytest.mark.filterwarnings("ignore:muon_jax. no layer gives the matrix view")

F32 = muon_jax.NewtonSchulzOptions(dtype=jnp.float32)
# One Newton-Schulz step on both sides where the point is conventions on a mesh, shardings,
# scaling or the clip, not the iteration (test_orthogonalize, test_gram_ns and
# test_optax_port prove it): fewer unrolled steps shrink every compiled update program.
NS = dict(ns_steps=1)

# ----------------------------------------------------------------------------- torch.optim.Muon

# Flax kernels [in, out]; torch keeps the same matrices as Linear weights [out, in].
KERNELS = {"up": (16, 40), "down": (40, 16), "square": (24, 24)}
JORDAN = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's default ns_coefficients
ADJUST = {  # torch adjust_lr_fn -> ratio(A, B) of a weight [A, B] = [out, in]
    "original": lambda a, b: math.sqrt(max(1, a / b)),
    "spectral_unclamped": lambda a, b: math.sqrt(a / b),
    "match_rms_adamw": lambda a, b: 0.2 * math.sqrt(max(a, b)),
}
SCALING = {"original": "spectral", "spectral_unclamped": "spectral_unclamped",
           "match_rms_adamw": "rms_match"}


def _torch_newton_schulz(g, steps=5, eps=1e-7):
    """torch's _zeropower_via_newtonschulz in float64 numpy."""
    a, b, c = JORDAN
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / max(np.linalg.norm(x), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def _torch_muon(weights, grads_seq, *, lr, weight_decay, momentum, nesterov, adjust_lr_fn,
                ns_steps=5):
    """torch.optim.Muon's step on [out, in] weights, transcribed: EMA momentum, no bias
    correction, decoupled weight decay with the unadjusted lr."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    buf = {k: np.zeros_like(v) for k, v in w.items()}
    out = []
    for grads in grads_seq:
        for k, g in grads.items():
            buf[k] = momentum * buf[k] + (1 - momentum) * g  # buf.lerp_(grad, 1 - momentum)
            update = (1 - momentum) * g + momentum * buf[k] if nesterov else buf[k]
            o = _torch_newton_schulz(update, ns_steps)
            w[k] = w[k] * (1 - lr * weight_decay) - lr * ADJUST[adjust_lr_fn](*w[k].shape) * o
        out.append(dict(w))
    return out


def _flax_run(tx, kernels, grads_seq, place=lambda tree: tree):
    """Kernels after each step of ``tx`` (one jitted step; a jitted init: one program, not
    one per op)."""
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(g, s, p)))
    params, out = place(kernels), []
    state = jax.jit(tx.init)(params)
    for grads in grads_seq:
        params, state = step(params, state, place(grads))
        out.append(jax.tree.map(np.asarray, params))
    return out


def _torch_problem(steps=4):
    rng = np.random.default_rng(0)
    kernels = {k: rng.standard_normal(s).astype(np.float32) for k, s in KERNELS.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in KERNELS.items()}
             for _ in range(steps)]
    return kernels, grads


def _torch_tx(adjust_lr_fn, nesterov, **kw):
    return muon_jax.muon(0.05, ns_coeffs=JORDAN, beta=0.9, eps=1e-7, weight_decay=0.1,
                         nesterov=nesterov, shape_scaling=SCALING[adjust_lr_fn],
                         newton_schulz=F32, muon_mask=lambda p: jax.tree.map(lambda _: True, p),
                         **kw)


@pytest.mark.parametrize("adjust_lr_fn,nesterov",
                         [("original", True), ("spectral_unclamped", False)])
def test_bias_correction_false_reproduces_torch_muon(adjust_lr_fn, nesterov):
    kernels, grads = _torch_problem()
    ref = _torch_muon({k: v.T for k, v in kernels.items()},
                      [{k: g.T for k, g in gs.items()} for gs in grads], lr=0.05,
                      weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                      adjust_lr_fn=adjust_lr_fn)
    ref = [{k: w.T for k, w in r.items()} for r in ref]  # back to [in, out]
    got = _flax_run(_torch_tx(adjust_lr_fn, nesterov, bias_correction=False), kernels, grads)
    chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)
    if nesterov:  # optax's bias-corrected Nesterov momentum is another update
        corrected = _flax_run(_torch_tx(adjust_lr_fn, nesterov), kernels, grads)
        assert max(np.abs(c[k] - r[k]).max() for c, r in zip(corrected, ref, strict=True)
                   for k in KERNELS) > 1e-3


@pytest.mark.parametrize("shape,names,specs,adjust_lr_fn", [
    ((8,), ("d",), {}, "match_rms_adamw"),
    ((2, 4), ("data", "model"), {"up": P("data", "model"), "down": P(None, "model")},
     "spectral_unclamped"),
])
def test_torch_conventions_on_a_mesh(shape, names, specs, adjust_lr_fn):
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    kernels, grads = _torch_problem(steps=3)
    ref = _torch_muon({k: v.T for k, v in kernels.items()},
                      [{k: g.T for k, g in gs.items()} for gs in grads], lr=0.05,
                      weight_decay=0.1, momentum=0.9, nesterov=True, adjust_lr_fn=adjust_lr_fn,
                      **NS)

    def place(tree):
        return {k: jax.device_put(x, NamedSharding(mesh, specs.get(k, P())))
                for k, x in tree.items()}

    tx = _torch_tx(adjust_lr_fn, True, bias_correction=False, sharding=ShardingOptions(mesh),
                   **NS)
    got = _flax_run(tx, kernels, grads, place)
    chex.assert_trees_all_close(got, [{k: w.T for k, w in r.items()} for r in ref],
                                rtol=1e-5, atol=1e-5)


def test_spectral_unclamped_scales_tall_and_wide_matrices():
    g = {"wide": jnp.asarray(np.random.default_rng(1).standard_normal((4, 16)), jnp.float32),
         "tall": jnp.asarray(np.random.default_rng(2).standard_normal((16, 4)), jnp.float32)}

    def direction(scaling):
        tx = muon_jax.scale_by_muon(newton_schulz=F32, shape_scaling=scaling, **NS)
        return jax.jit(tx.update)(g, tx.init(g))[0]

    plain, clamped, unclamped = (direction(s) for s in (None, "spectral", "spectral_unclamped"))
    chex.assert_trees_all_close(unclamped["wide"], 2.0 * plain["wide"], rtol=1e-6)
    chex.assert_trees_all_close(unclamped["tall"], 0.5 * plain["tall"], rtol=1e-6)
    chex.assert_trees_all_close(clamped["tall"], plain["tall"], rtol=1e-6)


# ----------------------------------------------------------------------------- shardings

SHARD_SHAPES = {"dp": (16, 32), "fsdp": (16, 32), "stack": (8, 16, 32), "tp": (16, 32),
                "two_d": (16, 32), "bias": (32,)}
SHARDING_CASES = {  # mesh shape, axis names, shard_axes, param specs (DP, FSDP, TP, 2-D)
    "8-fsdp": ((8,), ("data",), ("data",),
               {"dp": P(), "fsdp": P("data", None), "stack": P("data")}),
    "2x4": ((2, 4), ("data", "model"), None,
            {"dp": P(), "fsdp": P("data", None), "stack": P("data", None, "model"),
             "tp": P(None, "model"), "two_d": P("data", "model")}),
}


def _spec_dims(spec, ndim):
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


@functools.cache
def _all_leaves_problem():
    """Host params and gradients of every leaf, and their unsharded muon updates (one program
    for all cases: Muon's and AdamW's updates are per leaf, so a case's leaves update as they
    do in the whole tree)."""
    rng = np.random.default_rng(0)
    host = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHARD_SHAPES.items()}
    grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHARD_SHAPES.items()}
    tx = muon_jax.muon(0.1, newton_schulz=F32, **NS)
    ref = jax.tree.map(np.asarray, jax.jit(tx.update)(grads, tx.init(host), host)[0])
    return host, grads, ref


def _sharding_problem(case):
    """Host params and gradients of a case's leaves, and their unsharded updates."""
    keys = [k for k in SHARD_SHAPES if k in SHARDING_CASES[case][3] or k == "bias"]
    host, grads, ref = _all_leaves_problem()
    return ({k: host[k] for k in keys}, {k: grads[k] for k in keys}, {k: ref[k] for k in keys})


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("case", list(SHARDING_CASES))
def test_updates_keep_param_shardings(case, axis_type):
    """Jitted init (with param_specs on Auto axes): the jitted updates carry each param's
    sharding (and, on Explicit axes, its typed sharding) and equal the unsharded ones. (An
    eager init's updates keep the params' shardings in test_muon_sharded's
    test_sharded_equals_unsharded_shardings_and_memory.)"""
    shape, names, shard_axes, specs = SHARDING_CASES[case]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
    host, grads_host, ref = _sharding_problem(case)
    specs = {k: specs.get(k, P()) for k in host}

    def place(tree):
        return {k: jax.device_put(x, NamedSharding(mesh, specs[k])) for k, x in tree.items()}

    params, grads = place(host), place(grads_host)
    auto = axis_type == AxisType.Auto
    tx = muon_jax.muon(0.1, newton_schulz=F32, **NS, sharding=ShardingOptions(
        mesh, shard_axes, param_specs=specs if auto else None))
    typed = {}

    @jax.jit
    def update(g, state, p):
        u, _ = tx.update(g, state, p)
        typed.update({k: jax.typeof(x).sharding.spec for k, x in u.items()})
        return u

    updates = update(grads, jax.jit(tx.init)(params), params)
    for k, u in updates.items():
        want = _spec_dims(specs[k], u.ndim)
        assert _spec_dims(u.sharding.spec, u.ndim) == want, (k, u.sharding.spec)
        if not auto:
            assert _spec_dims(typed[k], u.ndim) == want, (k, typed[k])
        np.testing.assert_allclose(np.asarray(u), ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_traced_init_on_auto_axes_needs_param_specs():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params = {"w": jax.device_put(np.ones((16, 32), np.float32),
                                  NamedSharding(mesh, P("data", None)))}
    with pytest.raises(ValueError, match=r"'w' is traced .*Auto.*param_specs="):
        jax.jit(muon_jax.scale_by_muon(sharding=ShardingOptions(mesh)).init)(params)
    with pytest.raises(ValueError, match=r"'w' is sharded .*param_specs gives"):
        muon_jax.scale_by_muon(sharding=ShardingOptions(mesh, param_specs=P())).init(params)
    tx = muon_jax.scale_by_muon(sharding=ShardingOptions(mesh, param_specs={"w": P("data")}))
    for state in (jax.jit(tx.init)(params), tx.init({"w": np.ones((16, 32), np.float32)})):
        assert state.plan.leaves[0].spec == (("data",), ())  # traced, or host data


# ----------------------------------------------------------------------------- global-norm clip


def test_clip_by_global_norm_equals_optax_on_ordinary_gradients():
    rng = np.random.default_rng(4)
    grads = {"w": rng.standard_normal((8, 16)).astype(np.float32),
             "b": rng.standard_normal(16).astype(np.float32), "none": None}
    for max_norm in (0.5, 100.0):  # clipped, untouched
        ours, theirs = muon_jax.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
        got = jax.jit(ours.update)(grads, ours.init(grads))[0]
        want = jax.jit(theirs.update)(grads, theirs.init(grads))[0]
        chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
        assert got["none"] is None


def _mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w_in"] + params["b"])
    h = jnp.tanh(jnp.einsum("bi,lio->blo", h, params["w_stack"]).sum(1))
    return jnp.mean((h @ params["w_out"] - y) ** 2)


def test_clip_by_global_norm_on_reduced_view_gradients():
    """In front of sharded Muon with unreduced gradients: the clip equals optax's on the
    all-reduced gradients (norm and clipped values), and Muon still reduce-scatters."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(5)
    shapes = {"w_in": (8, 16), "b": (16,), "w_stack": (4, 16, 16), "w_out": (16, 8)}
    host = {k: (0.5 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    batch = (rng.standard_normal((32, 8)).astype(np.float32),
             rng.standard_normal((32, 8)).astype(np.float32))
    params = jax.device_put(host, NamedSharding(mesh, P()))
    sharded_batch = jax.device_put(batch, NamedSharding(mesh, P("d")))

    muon = muon_jax.muon(0.02, newton_schulz=F32, **NS, sharding=ShardingOptions(mesh))
    state = jax.jit(muon.init)(params)  # Explicit axes: one program, not one per op

    @jax.jit
    def step(p, state, batch, max_norm):  # clipped gradients (all-reduced to compare), updates
        grads = jax.grad(_mlp_loss)(muon_jax.reduced_view(p, "d"), batch)
        assert muon_jax.dp.unreduced_axes(grads["w_in"]) == {"d"}
        clip = muon_jax.clip_by_global_norm(max_norm)
        clipped, _ = clip.update(grads, clip.init(p))
        assert muon_jax.dp.unreduced_axes(clipped["w_in"]) == {"d"}
        updates = muon.update(clipped, state, p)[0]
        return jax.tree.map(muon_jax.reduce_unreduced, clipped), updates

    @jax.jit
    def reference(p, batch, max_norm):  # optax's clip on the all-reduced gradients
        clip = optax.clip_by_global_norm(max_norm)
        muon_ref = muon_jax.muon(0.02, newton_schulz=F32, **NS)
        clipped, _ = clip.update(jax.grad(_mlp_loss)(p, batch), clip.init(p))
        return clipped, muon_ref.update(clipped, muon_ref.init(p), p)[0]

    assert "reduce-scatter" in step.lower(params, state, sharded_batch, 1.0).compile().as_text()
    norm = float(jax.jit(lambda p, b: optax.tree.norm(jax.grad(_mlp_loss)(p, b)))(host, batch))
    for max_norm in (0.1 * norm, 10.0 * norm):  # clipped, untouched
        got = step(params, state, sharded_batch, max_norm)
        want = reference(host, batch, max_norm)
        chex.assert_trees_all_close(jax.tree.map(np.asarray, got), want, rtol=1e-4, atol=1e-6)
        got_norm = np.sqrt(sum(np.sum(np.asarray(g) ** 2) for g in got[0].values()))
        assert abs(got_norm - min(max_norm, norm)) < 1e-4 * norm


# ----------------------------------------------------------------------------- TPU lowering


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("shape,names", [((8,), ("data",)), ((2, 4), ("data", "model"))])
def test_sharded_step_exports_for_tpu(shape, names, axis_type):
    """A jitted train step (global-norm clip + sharded Muon) exported for TPU on an abstract
    TPU mesh: the TPU policies (all-to-all entry of replicated gradients) and any TPU-only
    lowering failure show on CPU. On Explicit axes the gradients are unreduced (reduced view)."""
    tpu = AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")
    mesh = AbstractMesh(shape, names, axis_types=(axis_type,) * len(names), abstract_device=tpu)
    specs = {"w_in": P(), "b": P(), "w_stack": P("data"), "w_out": P(None, names[-1])}
    shapes = {"w_in": (8, 16), "b": (16,), "w_stack": (8, 16, 16), "w_out": (16, 8)}
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, specs[k]))
              for k, s in shapes.items()}
    batch_sharding = NamedSharding(mesh, P("data"))
    batch = (jax.ShapeDtypeStruct((32, 8), jnp.float32, sharding=batch_sharding),) * 2
    explicit = axis_type == AxisType.Explicit
    tx = optax.chain(muon_jax.clip_by_global_norm(1.0),
                     muon_jax.muon(0.02, **NS, sharding=ShardingOptions(mesh, param_specs=specs)))

    def loss(p, batch):
        if explicit:  # FSDP on Explicit axes: the model gathers the sharded weights it uses
            p = {k: jax.sharding.reshard(v, NamedSharding(mesh, P()))
                 if k in ("w_stack", "w_out") else v
                 for k, v in p.items()}
        return _mlp_loss(p, batch)

    def step(p, state, batch):
        view = muon_jax.reduced_view(p, "data", muon_mask={**{k: False for k in p},
                                                           "w_in": True}) if explicit else p
        grads = jax.grad(loss)(view, batch)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    state = jax.eval_shape(tx.init, params)
    exported = export.export(jax.jit(step), platforms=("tpu",))(params, state, batch)
    text = exported.mlir_module()
    assert exported.platforms == ("tpu",) and exported.nr_devices == 8
    assert "stablehlo.all_to_all" in text and "stablehlo.all_gather" in text
    assert ("stablehlo.reduce_scatter" in text) == explicit
