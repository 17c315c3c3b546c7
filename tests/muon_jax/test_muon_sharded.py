"""Sharded (ZeRO-1 owner-compute) Muon on 8 CPU devices: exactness, shardings, memory, work,
communication parity with data-parallel AdamW, wrappers, and errors."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_jax
from muon_jax import ShardingOptions, loss_scale, newton_schulz, owner_plan, owners
from xla_comm import hlo

# The stacks here are plain arrays meant as batches of matrices: the default view is right.
pytestmark = pytest.mark.filterwarnings("ignore:muon_jax. no layer gives the matrix view")

SHAPES = {  # >= 6 distinct matrix shapes, stack counts not divisible by the axis sizes
    "w1": (16, 32),
    "w2": (3, 16, 32),  # joins w1: K = 4
    "w3": (32, 16),
    "w4": (5, 24, 40),
    "w5": (8, 8),
    "w6": (2, 40, 24),
    "w7": (12, 20),
    "w8": (8, 16, 32),  # scanned layers, sharded along L on some meshes
    "w9": (16, 32),  # bf16 param, f32 momentum: its own stack
}
CASES = {  # mesh shape, axis names, axis type, param shardings
    "8-explicit-fsdp": ((8,), ("d",), AxisType.Explicit,
                        {"w3": P("d", None), "w8": P("d")}),
    "2x4-auto-tp": ((2, 4), ("data", "model"), AxisType.Auto,
                    {"w1": P(None, "model"), "w6": P(None, None, "model"),
                     "w8": P("data", None, "model")}),
    "4x2-explicit-mixed": ((4, 2), ("data", "model"), AxisType.Explicit,
                           {"w3": P(("data", "model"), None), "w4": P(None, "model"),
                            "w8": P("data")}),
}
F32 = muon_jax.NewtonSchulzOptions(dtype=jnp.float32)
# One Newton-Schulz step on both sides: these tests prove sharding, layouts and communication,
# not the iteration (test_orthogonalize, test_gram_ns and test_optax_port prove it); fewer
# unrolled steps shrink every compiled update program.
NS = dict(ns_steps=1)
F32_TX = dict(newton_schulz=F32, mu_dtype=jnp.float32, **NS)


def _random_tree(seed, shapes=SHAPES):
    """Host arrays (numpy RNG: no per-shape compilations); w9 is bf16."""
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s, np.float32).astype(jnp.bfloat16 if k == "w9" else np.float32)
            for k, s in shapes.items()}


def _make_params(mesh, specs):
    return {k: jax.device_put(x, NamedSharding(mesh, specs.get(k, P())))
            for k, x in _random_tree(0).items()}


def _init(tx, params, axis_type=AxisType.Explicit):
    """Explicit axes: a jitted init (one program; eager, the sharded init compiles one per op
    and stack); Auto axes: eager (a traced init there needs param_specs)."""
    return (jax.jit(tx.init) if axis_type == AxisType.Explicit else tx.init)(params)


@pytest.fixture(scope="module")
def reference_updates():
    """Five steps of unsharded scale_by_muon on the host trees (shared by all meshes)."""
    tx = muon_jax.scale_by_muon(**F32_TX)
    update, state, out = jax.jit(tx.update), tx.init(_random_tree(0)), []
    for step in range(5):
        updates, state = update(_random_tree(100 + step), state)
        out.append(jax.tree.map(lambda x: np.asarray(x, np.float32), updates))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_equals_unsharded_shardings_and_memory(case, reference_updates):
    shape, names, axis_type, specs = CASES[case]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
    params = _make_params(mesh, specs)
    tx = muon_jax.scale_by_muon(**F32_TX, sharding=ShardingOptions(mesh))
    state = _init(tx, params, axis_type)
    assert isinstance(state, muon_jax.ShardedMuonState)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    update = jax.jit(tx.update)
    for step, ref in enumerate(reference_updates):
        grads = {k: jax.device_put(g, params[k].sharding)
                 for k, g in _random_tree(100 + step).items()}
        updates, state = update(grads, state)
        for k, u in updates.items():
            assert u.sharding.is_equivalent_to(params[k].sharding, u.ndim), (k, u.sharding)
            # f32 1e-5: the Newton-Schulz step carries the sharded program's own fusion and
            # reduction order (jax 0.12's XLA:CPU reorders more), a few 1e-6 off
            tol = dict(rtol=2e-2, atol=2e-2) if k == "w9" else dict(rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(u, np.float32), ref[k], **tol, err_msg=k)
        for now, before in zip(jax.tree.leaves(state), jax.tree.leaves(state_shardings),
                               strict=True):
            assert now.sharding.is_equivalent_to(before, now.ndim), (now.sharding, before)
    # Momentum memory per device: total / N + at most one padded matrix per stack.
    n = state.plan.num_shards
    total = sum(math.prod(s) * 4 for s in SHAPES.values())
    slack = sum(s.m * s.n * 4 for s in state.plan.stacks)
    per_device: dict = {}
    for mu, stack in zip(state.mu, state.plan.stacks, strict=True):
        assert mu.dtype == jnp.float32
        for shard in mu.addressable_shards:
            assert shard.data.shape == (stack.k_owner, stack.m, stack.n)
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    assert len(per_device) == 8
    assert max(per_device.values()) <= total / n + slack, (per_device, total / n, slack)


@pytest.mark.parametrize("policy", ["slice", "scatter"])
def test_owner_round_trip_both_replicated_grad_policies(policy):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    specs = {"w1": P(None, "model"), "w8": P("data", None, "model")}
    params = {k: v for k, v in _make_params(mesh, specs).items() if k != "w9"}
    leaves = jax.tree.leaves(params)
    entries = [(k, v.shape, v.dtype, owner_plan.param_spec(v)) for k, v in params.items()]
    plan = owner_plan.plan_owners(entries, [None] * len(leaves), mesh=mesh,
                                  replicated_grads=policy)

    def f(xs):
        owned = owners.to_owners(xs, plan)
        doubled = owners.owner_map(lambda s, b, c: (2 * b[0],), plan, [(o,) for o in owned])
        return owners.from_owners([d[0] for d in doubled], plan)

    out = jax.jit(f)(leaves)
    for x, y in zip(leaves, out, strict=True):
        np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(x))
        assert y.sharding.is_equivalent_to(x.sharding, x.ndim)


@pytest.mark.parametrize("policy", ["slice", "scatter"])
def test_unreduced_round_trip_on_2d_mesh_both_policies(policy):
    """Gradients unreduced over 'data' only, stacks split over ('data', 'model'): the owner
    blocks hold the reduced sums (reduce-scatter over 'data', slice over 'model')."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(11)
    params = jax.device_put({"a": rng.standard_normal((16, 32)).astype(np.float32),
                             "b": rng.standard_normal((3, 8, 8)).astype(np.float32)},
                            NamedSharding(mesh, P()))
    x = jax.device_put(rng.standard_normal((4, 16)).astype(np.float32),
                       NamedSharding(mesh, P("data")))
    entries = [(k, v.shape, v.dtype, P()) for k, v in params.items()]
    plan = owner_plan.plan_owners(entries, [None, None], mesh=mesh, replicated_grads=policy)

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["a"])) + jnp.sum(jnp.tanh(x[:, :8] @ p["b"]))

    @jax.jit
    def f(p, x):
        g = jax.grad(loss)(muon_jax.reduced_view(p, "data"), x)
        owned = owners.to_owners([g["a"], g["b"]], plan)
        return owners.from_owners(owned, plan), [muon_jax.reduce_unreduced(g[k]) for k in "ab"]

    (back_a, back_b), (want_a, want_b) = f(params, x)
    assert "reduce-scatter" in f.lower(params, x).compile().as_text()
    np.testing.assert_allclose(np.asarray(back_a), np.asarray(want_a), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(back_b), np.asarray(want_b), rtol=1e-5, atol=1e-6)


def test_no_collective_in_newton_schulz_and_no_repeated_work():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    shapes = {"a": (8, 32, 64), "b": (16, 64, 32), "c": (8, 48, 48)}
    params = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    grads = _random_tree(1, shapes)
    tx = muon_jax.scale_by_muon(ns_steps=5, sharding=ShardingOptions(mesh))
    state = tx.init(params)
    compiled = jax.jit(tx.update).lower(grads, state).compile()
    rep = hlo.analyze_collectives(compiled)
    print(rep.table())
    assert rep.in_while_loop == ()
    assert rep.kinds == {"all-gather"} and len(rep) == len(state.plan.stacks)
    flops = compiled.cost_analysis()["flops"]
    ns_total = sum(s[0] * newton_schulz.ns_flops(s[1], s[2], 5) for s in shapes.values())
    elementwise = 100 * sum(math.prod(s) for s in shapes.values()) / 8
    plain = muon_jax.scale_by_muon(ns_steps=5)
    dense = jax.jit(plain.update).lower(grads, plain.init(params)).compile()
    print(f"per-device flops {flops:.3e}; NS total / N {ns_total / 8:.3e}; "
          f"unsharded {dense.cost_analysis()['flops']:.3e}")
    assert flops <= 1.15 * ns_total / 8 + elementwise
    assert flops >= ns_total / 8  # every device does its own share


DP_SHAPES = {"embed": (16, 32), "w_up": (8, 32, 64), "w_down": (8, 64, 32), "bias": (8, 64),
             "head": (32, 8)}  # Muon: the scanned w_up / w_down stacks; AdamW: the rest


def _dp_loss(params, batch):
    x, y = batch
    h = x @ params["embed"]

    def layer(h, p):
        w_up, w_down, b = p
        return h + jnp.tanh(h @ w_up + b) @ w_down, None

    h, _ = jax.lax.scan(layer, h, (params["w_up"], params["w_down"], params["bias"]))
    return jnp.mean((h @ params["head"] - y) ** 2)


def _dp_step(tx, *, loss=_dp_loss, view_axes=None, scaled=False):
    """A jitted data-parallel train step: grad (optionally w.r.t. a reduced view), update, apply."""

    def step(params, state, batch):
        view = muon_jax.reduced_view(params, view_axes) if view_axes else params

        def objective(p):
            value = loss(p, batch)
            return loss_scale.scale_loss(value, state) if scaled else value

        grads = jax.grad(objective)(view)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step)


@pytest.fixture(scope="module")
def dp_setup():
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(7)
    host = {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in DP_SHAPES.items()}
    params = jax.device_put(host, NamedSharding(mesh, P()))
    batch = (rng.standard_normal((64, 16)).astype(np.float32),
             rng.standard_normal((64, 8)).astype(np.float32))
    batch = jax.device_put(batch, NamedSharding(mesh, P("d")))
    return mesh, host, params, batch


def _ring_bytes(step, *args):
    rep = hlo.analyze_collectives(step.lower(*args).compile())
    return rep, rep.ring_bytes


def test_dp_step_communication_parity_with_adamw(dp_setup):
    mesh, host, params, batch = dp_setup
    tx = muon_jax.muon(0.02, newton_schulz=F32, **NS, sharding=ShardingOptions(mesh))
    state = _init(tx, params)
    muon_step = _dp_step(tx, view_axes="d")
    adamw = optax.adamw(1e-3)
    adamw_state = adamw.init(params)
    rep_m, muon_bytes = _ring_bytes(muon_step, params, state, batch)
    rep_a, adamw_bytes = _ring_bytes(_dp_step(adamw), params, adamw_state, batch)
    _, plain_bytes = _ring_bytes(_dp_step(tx), params, state, batch)
    print(f"\nring bytes/device per DP step: sharded Muon (unreduced grads) {muon_bytes:,.0f}; "
          f"AdamW {adamw_bytes:,.0f}; ratio {muon_bytes / adamw_bytes:.3f}; sharded Muon on "
          f"replicated grads (all-reduce + all-gather) {plain_bytes:,.0f}")
    print(rep_m.table())
    assert rep_m.counts().get("reduce-scatter", 0) >= 1
    assert muon_bytes <= 1.1 * adamw_bytes
    # The same step is exact: equal to unsharded muon on the reduced gradient.
    new_params, _ = muon_step(params, state, batch)
    ref_tx = muon_jax.muon(0.02, newton_schulz=F32, **NS)
    host_batch = jax.tree.map(np.asarray, batch)
    grads = jax.jit(jax.grad(_dp_loss))(host, host_batch)
    ref_updates, _ = jax.jit(ref_tx.update)(grads, ref_tx.init(host), host)
    ref = optax.apply_updates(host, ref_updates)
    for k in DP_SHAPES:
        assert new_params[k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim)
        np.testing.assert_allclose(np.asarray(new_params[k]), np.asarray(ref[k]),
                                   rtol=1e-5, atol=1e-6, err_msg=k)


def _collectives(rep, min_bytes=64):
    """Multiset of (kind, buffers) of the non-scalar collectives (tuple order ignored)."""
    return sorted((c.kind, tuple(sorted(zip(c.dtypes, c.shapes, strict=True))), c.executions)
                  for c in rep if c.buffer_bytes >= min_bytes)


def _same_arrays(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        for sx, sy in zip(x.addressable_shards, y.addressable_shards, strict=True):
            if not np.array_equal(np.asarray(sx.data), np.asarray(sy.data), equal_nan=True):
                return False
    return True


def test_wrappers_keep_collectives_results_and_skip_bitwise(dp_setup):
    mesh, _, params, batch = dp_setup
    nan_batch = jax.device_put((np.full((64, 16), np.nan, np.float32), np.asarray(batch[1])),
                               NamedSharding(mesh, P("d")))
    def tx():
        return muon_jax.muon(0.02, newton_schulz=F32, **NS, sharding=ShardingOptions(mesh))

    cases = {  # wrapper name: (plain tx, wrapped tx, step kwargs)
        "apply_if_finite": (tx(), optax.apply_if_finite(tx(), 5), {}),
        "dynamic_loss_scale": (
            tx(), loss_scale.dynamic_loss_scale(tx(), init_scale=2.0**10), {"view_axes": "d"}),
    }
    for name, (plain, wrapped, kw) in cases.items():
        plain_step = _dp_step(plain, **kw)
        wrapped_step = _dp_step(wrapped, scaled=name == "dynamic_loss_scale", **kw)
        ps, ws = _init(plain, params), _init(wrapped, params)
        rep_p, _ = _ring_bytes(plain_step, params, ps, batch)
        rep_w, _ = _ring_bytes(wrapped_step, params, ws, batch)
        assert _collectives(rep_p) == _collectives(rep_w), (name, rep_p.table(), rep_w.table())
        p1, p2 = params, params
        for _ in range(2):
            p1, ps = plain_step(p1, ps, batch)
            p2, ws = wrapped_step(p2, ws, batch)
        chex.assert_trees_all_close(p1, p2, rtol=1e-5, atol=1e-5)  # fusion-order rounding
        skipped, ws_after = wrapped_step(p2, ws, nan_batch)
        assert _same_arrays(skipped, p2), name
        assert _same_arrays(ws_after.inner_state, ws.inner_state), name


def test_tied_weight_gets_one_update_from_summed_gradient(dp_setup):
    mesh, _, _, batch = dp_setup
    rng = np.random.default_rng(3)
    host = {"embed": rng.standard_normal((16, 32)).astype(np.float32),
            "w": (0.3 * rng.standard_normal((8, 32, 32))).astype(np.float32)}

    def tied_loss(p, batch, second_use=lambda w: w):  # every w[l] is used twice
        h = batch[0] @ p["embed"]
        for layer in range(8):
            h = jnp.tanh(jnp.tanh(h @ p["w"][layer]) @ second_use(p["w"][layer]))
        return jnp.mean((h[:, :8] - batch[1]) ** 2)

    params = jax.device_put(host, NamedSharding(mesh, P()))
    masked = optax.masked(muon_jax.scale_by_muon(**F32_TX, sharding=ShardingOptions(mesh)),
                          {"embed": False, "w": True})
    step = _dp_step(masked, loss=tied_loss, view_axes="d")
    state = _init(masked, params)
    rep, _ = _ring_bytes(step, params, state, batch)
    assert len(rep.of_kind("reduce-scatter")) == 1 and len(rep.of_kind("all-gather")) == 1
    new = np.asarray(step(params, state, batch)[0]["w"]) - host["w"]
    host_batch = jax.tree.map(np.asarray, batch)
    ref_tx = muon_jax.scale_by_muon(**F32_TX)
    refs = []
    for second_use in (lambda w: w, jax.lax.stop_gradient):  # summed vs first use only
        g = jax.jit(jax.grad(lambda p, b, u=second_use: tied_loss(p, b, u)))(host, host_batch)["w"]
        refs.append(np.asarray(jax.jit(ref_tx.update)({"w": g}, ref_tx.init({"w": g}))[0]["w"]))
    # Gradient summation order differs (reduce-scatter of per-device partial sums).
    np.testing.assert_allclose(new, refs[0], rtol=1e-4, atol=5e-5)
    assert np.abs(new - refs[1]).max() > 100 * np.abs(new - refs[0]).max()


def test_bad_axes_and_unservable_shardings_raise_naming_leaf_and_axis():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params = {"mlp": {"kernel": jax.device_put(np.ones((16, 32), np.float32),
                                               NamedSharding(mesh, P(None, "model")))}}
    with pytest.raises(ValueError, match=r"shard axis 'bogus' is not an axis of the mesh"):
        ShardingOptions(mesh, shard_axes=("data", "bogus"))  # at construction
    with pytest.raises(ValueError, match=r"mlp/kernel.*'model'"):
        muon_jax.muon(0.02, sharding=ShardingOptions(mesh, shard_axes="data")).init(params)
    conv = {"conv": jax.device_put(np.ones((3, 3, 8, 16), np.float32),
                                   NamedSharding(mesh, P(None, None, "data")))}
    dims = muon_jax.MuonDimensionNumbers(reduction_axis=(0, 1, 2), output_axis=3)
    with pytest.raises(ValueError, match=r"conv.*dim 2.*\('data',\)"):
        muon_jax.scale_by_muon(dimension_numbers=dims, sharding=ShardingOptions(mesh)).init(conv)
    explicit = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    w = {"w": jax.device_put(np.ones((16, 32), np.float32), NamedSharding(explicit, P()))}
    tx = muon_jax.scale_by_muon(sharding=ShardingOptions(explicit))
    state = tx.init(w)
    g = {"w": jax.device_put(np.ones((16, 32), np.float32), NamedSharding(explicit, P("d")))}
    with pytest.raises(ValueError, match=r"'w'.*differs"):
        jax.jit(tx.update)(g, state)


def test_state_type_is_decided_at_construction():
    """sharding=None is unsharded even under jax.set_mesh; sharding= shards, eager or jitted
    init."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
    params = {"w": jax.device_put(np.ones((4, 16, 32), np.float32), NamedSharding(mesh, P()))}
    with jax.set_mesh(mesh):
        plain = muon_jax.scale_by_muon().init(params)
        state = muon_jax.scale_by_muon(sharding=ShardingOptions(mesh)).init(params)
        jitted = jax.jit(muon_jax.scale_by_muon(sharding=ShardingOptions(mesh)).init)(params)
        ambient = muon_jax.scale_by_muon(
            sharding=ShardingOptions(jax.sharding.get_abstract_mesh())).init(params)
    assert isinstance(plain, muon_jax.MuonState)
    assert isinstance(state, muon_jax.ShardedMuonState)
    assert state.plan.shard_axes == ("d",) and state.plan.stacks[0].k_owner == 1
    assert jax.tree.structure(jitted) == jax.tree.structure(state)
    assert isinstance(ambient, muon_jax.ShardedMuonState)
    assert ambient.plan.stacks == state.plan.stacks


def test_bf16_update_gathers_halve_their_bytes_and_round_once(dp_setup):
    """``gather_dtype=jnp.bfloat16``: the updates leave their owners as bf16 (the lowered
    program's all-gathers carry bf16; XLA:CPU itself widens bf16 collectives when compiling)
    and arrive as the f32 update rounded to bf16, nothing more."""
    mesh, host, params, batch = dp_setup
    grads = jax.tree.map(lambda x: jax.device_put(np.cos(np.asarray(x) * 3), x.sharding),
                         params)
    out = {}
    for dt in (None, jnp.bfloat16):
        tx = muon_jax.scale_by_muon(newton_schulz=F32, **NS,
                                    sharding=ShardingOptions(mesh, gather_dtype=dt))
        update = jax.jit(tx.update)
        state = _init(tx, params)
        out[dt] = update(grads, state)[0]
        gathers = [c for c in hlo.analyze_collectives(update.lower(grads, state))
                   if c.kind == "all-gather" and c.buffer_bytes >= 64]
        assert gathers and {c.dtypes[0] for c in gathers} == {"bf16" if dt else "f32"}
    for k in DP_SHAPES:
        assert out[jnp.bfloat16][k].dtype == jnp.float32
        assert out[jnp.bfloat16][k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim)
        got, ref = np.asarray(out[jnp.bfloat16][k]), np.asarray(out[None][k])
        # Carried as bf16 ...
        np.testing.assert_array_equal(got.astype(jnp.bfloat16).astype(np.float32), got,
                                      err_msg=k)
        # ... and rounded once, to nearest: within half a bf16 ulp (2^-9 relative) of the f32
        # update. The two programs fuse and reduce differently (jax 0.12's XLA:CPU more so),
        # so their f32 values may differ by up to about 1e-4 relative and an element near a
        # rounding boundary may round either way; truncation or a second rounding would put
        # many elements up to a whole ulp away.
        half_ulp = np.ldexp(np.float32(1), np.frexp(ref)[1] - 9)
        bad = np.abs(got - ref) > half_ulp + 1e-4 * np.abs(ref)
        assert not bad.any(), (k, got[bad], ref[bad], half_ulp[bad])


def test_bf16_reduce_sums_unreduced_gradients_in_bf16(dp_setup):
    """``reduce_dtype=jnp.bfloat16``: unreduced gradients are reduce-scattered as bf16 (the
    lowered program's reduce-scatters carry bf16; XLA:CPU widens them when compiling) and
    the step moves the params as the exact one does up to that rounding; AdamW's leaves are
    untouched. The rounding is of each device's partial sum, and the 8 partials cancel:
    Muon's updates here move by about 0.3% after the one Newton-Schulz step (about 5% after
    five)."""
    mesh, _, params, batch = dp_setup
    deltas, scatters = {}, {}
    for dt in (None, jnp.bfloat16):
        tx = muon_jax.muon(0.02, newton_schulz=F32, **NS, sharding=ShardingOptions(
            mesh, gather_dtype=None, reduce_dtype=dt))
        state = _init(tx, params)
        step = _dp_step(tx, view_axes="d")
        scatters[dt] = {c.dtypes[0] for c in hlo.analyze_collectives(
            step.lower(params, state, batch)) if c.kind == "reduce-scatter"}
        new, _ = step(params, state, batch)
        deltas[dt] = {k: np.asarray(new[k]) - np.asarray(params[k]) for k in DP_SHAPES}
    assert scatters == {None: {"f32"}, jnp.bfloat16: {"bf16"}}
    for k in ("w_up", "w_down"):  # Muon's: rounded sums, then an orthogonalized direction
        got, ref = deltas[jnp.bfloat16][k], deltas[None][k]
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert 0 < err < 0.1, (k, err)
    for k in ("embed", "bias", "head"):  # AdamW's: all-reduced in f32 as before
        np.testing.assert_array_equal(deltas[jnp.bfloat16][k], deltas[None][k], err_msg=k)


@pytest.mark.parametrize("ns_dtype,gathered", [(jnp.bfloat16, "bf16"), (jnp.float32, "f32")])
def test_auto_gathers_bf16_only_after_16_bit_newton_schulz(dp_setup, ns_dtype, gathered):
    """The default ``gather_dtype='auto'``: f32 updates leave their owners as bf16 when
    Newton-Schulz ran in 16-bit matmuls (the update is the one ``gather_dtype=jnp.bfloat16``
    gives), and in f32 after f32 Newton-Schulz (the one ``gather_dtype=None`` gives)."""
    mesh, _, params, _ = dp_setup
    grads = jax.tree.map(lambda x: jax.device_put(np.sin(np.asarray(x) * 5), x.sharding),
                         params)
    ns = muon_jax.NewtonSchulzOptions(dtype=ns_dtype)
    tx = muon_jax.scale_by_muon(newton_schulz=ns, **NS, sharding=ShardingOptions(mesh))
    state = _init(tx, params)
    update = jax.jit(tx.update)
    gathers = [c for c in hlo.analyze_collectives(update.lower(grads, state))
               if c.kind == "all-gather" and c.buffer_bytes >= 64]
    assert gathers and {c.dtypes[0] for c in gathers} == {gathered}
    same = muon_jax.scale_by_muon(newton_schulz=ns, **NS, sharding=ShardingOptions(
        mesh, gather_dtype=jnp.bfloat16 if gathered == "bf16" else None))
    chex.assert_trees_all_close(update(grads, state)[0],
                                jax.jit(same.update)(grads, _init(same, params))[0],
                                rtol=1e-5, atol=1e-6)
