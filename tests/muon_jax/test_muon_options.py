"""optax.contrib.muon's options on muon_jax.muon, each against optax on the same inputs (f32
Newton-Schulz, rtol 1e-5), unsharded and on 8 devices; and the porting traps, now errors or
optax's behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import _muon as optax_muon

import muon_jax
from muon_jax import optax_compat

RNG = np.random.default_rng(3)
PARAMS = {"w1": jnp.asarray(RNG.standard_normal((16, 24)), jnp.float32),
          "w2": jnp.asarray(RNG.standard_normal((24, 16)), jnp.float32),
          "b": jnp.asarray(RNG.standard_normal((16,)), jnp.float32)}
GRADS = [jax.tree.map(lambda x: jnp.asarray(RNG.standard_normal(x.shape), x.dtype), PARAMS)
         for _ in range(3)]
# Two Newton-Schulz steps, passed to ours and to optax alike: the options' plumbing is the
# point here, not the iteration (test_orthogonalize, test_gram_ns and test_optax_port prove
# it); fewer unrolled steps shrink every compiled update program.
NS = dict(ns_steps=2)


def _ours(lr=1e-2, *, preconditioning="frobenius", adaptive=False, consistent_rms=None,
          adam_eps_root=0.0, adam_nesterov=False, adam_mu_dtype=None, **kw):
    """optax's defaults and option names, spelled for muon_jax.muon (its routing: 2-D leaves
    to Muon, here w1 and w2)."""
    return muon_jax.muon(
        lr, shape_scaling="spectral" if consistent_rms is None else consistent_rms,
        newton_schulz=muon_jax.NewtonSchulzOptions(
            dtype=jnp.float32, preconditioning=preconditioning, adaptive=adaptive),
        adamw=muon_jax.AdamWOptions(b2=0.999, weight_decay=0.0, eps_root=adam_eps_root,
                                    nesterov=adam_nesterov, mu_dtype=adam_mu_dtype), **kw)


def _run(tx, params=PARAMS, grads=GRADS):
    state, out = tx.init(params), []
    update = jax.jit(tx.update)
    for g in grads:
        u, state = update(g, state, params)
        out.append(u)
    return out


def _close(got, want, rtol=1e-5, atol=1e-6):
    for a, b in zip(got, want, strict=True):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                             rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("kw", [
    dict(preconditioning="aol"), dict(preconditioning="schatten"),
    dict(preconditioning="spectral"), dict(adaptive=True), dict(consistent_rms=0.35),
    dict(ns_coeffs="dion"), dict(ns_steps=np.int32(4)), dict(adam_eps_root=1e-6),
    dict(weight_decay=0.1, weight_decay_mask={"w1": True, "w2": False, "b": True}),
    dict(mu_dtype=jnp.bfloat16),
], ids=["aol", "schatten", "spectral", "adaptive", "consistent_rms", "dion", "ns_steps_array",
        "adam_eps_root", "weight_decay_mask", "mu_dtype"])
def test_each_option_matches_optax(kw):
    if "ns_coeffs" not in kw and "ns_steps" not in kw:  # dion: its 5 per-step triples
        kw = {**NS, **kw}
    ref = optax_muon.muon(1e-2, nesterov=False, **kw)
    ours_kw = dict(kw)
    if "mu_dtype" in kw:  # optax's mu_dtype is Muon's and AdamW's momentum dtype
        ours_kw["adam_mu_dtype"] = kw["mu_dtype"]
    if "ns_coeffs" in kw:
        ours_kw["ns_coeffs"] = "dion"
    ours = _ours(1e-2, nesterov=False, **ours_kw)
    rtol = 1e-2 if "mu_dtype" in kw else 1e-5  # bf16 momentum, rounded alike
    _close(_run(ours), _run(ref), rtol=rtol, atol=1e-5 if rtol > 1e-5 else 1e-6)


def test_nesterov_adamw_part_is_nadamw_when_asked():
    """optax's nesterov=True makes its AdamW part NAdamW: adam_nesterov=True gives that."""
    ref = optax_muon.muon(1e-2, **NS)
    ours = _ours(1e-2, adam_nesterov=True, **NS)
    want = _run(ref)
    _close(_run(ours), want)
    plain = _run(_ours(1e-2, **NS))
    assert not np.allclose(plain[-1]["b"], want[-1]["b"])  # the default: plain AdamW


def test_complex_matrices_are_orthogonalized_as_optax_does():
    c = {"w": jnp.asarray(RNG.standard_normal((6, 4)) + 1j * RNG.standard_normal((6, 4)),
                          jnp.complex64)}
    grads = [jax.tree.map(lambda x, i=i: x * (i + 1) + 0.5j, c) for i in range(2)]
    for adaptive in (False, True):
        ref = optax_muon.muon(1e-2, adaptive=adaptive, **NS)
        ours = _ours(1e-2, adaptive=adaptive, **NS)
        _close(_run(ours, c, grads), _run(ref, c, grads))
    assert muon_jax.default_muon_mask(c) == {"w": True}


def test_optax_style_dimension_numbers_route_none_to_adamw():
    """optax's muon_weight_dimension_numbers (optax_compat): None entries mean AdamW (not
    'default view' as in muon_jax.muon's dimension_numbers)."""
    dn = muon_jax.MuonDimensionNumbers(reduction_axis=1, output_axis=0)
    dims = {"w1": dn, "w2": None, "b": None}
    ref = optax_muon.muon(1e-2, muon_weight_dimension_numbers=dims, **NS)
    ours = optax_compat.muon(1e-2, muon_weight_dimension_numbers=dims, **NS)
    _close(_run(ours), _run(ref))
    state = ours.init(PARAMS)
    assert isinstance(state.inner_states["muon"].inner_state[0].mu["w2"], optax.MaskedNode)


def test_per_step_coefficients_that_do_not_match_ns_steps_are_an_error():
    five = optax_muon._DION_NS_COEFFS
    with pytest.raises(ValueError, match="5 per-step triples but ns_steps=7; pass ns_steps=5"):
        muon_jax.muon(1e-2, ns_coeffs=five, ns_steps=7)
    with pytest.raises(ValueError, match="5 per-step triples but ns_steps=3"):
        muon_jax.muon(1e-2, ns_coeffs=five, ns_steps=3)
    # optax_compat keeps optax's rule: all 5 triples run when ns_steps >= 5.
    ref = optax_muon.muon(1e-2, ns_coeffs=five, ns_steps=7)
    _close(_run(optax_compat.muon(1e-2, ns_coeffs=five, ns_steps=7)), _run(ref))


def _direction(sharding=None, *, preconditioning="frobenius", adaptive=False,
               consistent_rms=None):
    return muon_jax.scale_by_muon(
        shape_scaling="spectral" if consistent_rms is None else consistent_rms,
        dimension_numbers=muon_jax.MuonDimensionNumbers(1, 2), sharding=sharding, **NS,
        newton_schulz=muon_jax.NewtonSchulzOptions(dtype=jnp.float32,
                                                   preconditioning=preconditioning,
                                                   adaptive=adaptive))


@pytest.fixture(scope="module")
def mesh8():
    return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.mark.parametrize("kw", [dict(preconditioning="aol"), dict(adaptive=True),
                                dict(consistent_rms=0.35), dict(preconditioning="schatten")],
                         ids=["aol", "adaptive", "consistent_rms", "schatten"])
def test_sharded_muon_takes_the_new_options(mesh8, kw):
    stack = {"w": jnp.asarray(RNG.standard_normal((8, 16, 24)), jnp.float32)}
    grads = [jax.tree.map(lambda x, i=i: x * (i + 1), stack) for i in range(2)]
    placed = jax.device_put(stack, NamedSharding(mesh8, P()))
    ours = _direction(muon_jax.ShardingOptions(mesh8), **kw)
    ref = _direction(**kw)
    state, update = jax.jit(ours.init)(placed), jax.jit(ours.update)  # one init program
    got = []
    for g in grads:
        u, state = update(jax.device_put(g, NamedSharding(mesh8, P())), state)
        got.append(u)
    _close(got, _run(ref, stack, grads))


def test_sharded_muon_orthogonalizes_complex_stacks(mesh8):
    c = {"w": jnp.asarray(RNG.standard_normal((8, 6, 4)) + 1j * RNG.standard_normal((8, 6, 4)),
                          jnp.complex64)}
    placed = jax.device_put(c, NamedSharding(mesh8, P()))
    ours = _direction(muon_jax.ShardingOptions(mesh8), adaptive=True)
    ref = _direction(adaptive=True)
    got, _ = jax.jit(ours.update)(placed, jax.jit(ours.init)(placed))
    _close([got], _run(ref, c, [c]))
