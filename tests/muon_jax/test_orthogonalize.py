"""Newton-Schulz orthogonalization: documented singular-value bands, precision, batching."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import muon_jax
from muon_jax.newton_schulz import (
    JORDAN_COEFFS,
    POLAR_EXPRESS_COEFFS,
    ns_flops,
    resolve_ns_coeffs,
)

M, N = 24, 40  # one wide shape for the band tests; tall inputs are covered by transposition


@functools.cache
def _orth(ns_coeffs, ns_steps, dtype):
    return jax.jit(
        functools.partial(muon_jax.orthogonalize, ns_coeffs=ns_coeffs, ns_steps=ns_steps,
                          dtype=dtype)
    )


def _with_spectrum(rng, s, m, n):
    """Random U diag(s) V^T; returns the matrix and its singular vectors."""
    u, _ = np.linalg.qr(rng.standard_normal((m, m)))
    v, _ = np.linalg.qr(rng.standard_normal((n, n)))
    k = min(m, n)
    return (u[:, :k] * s) @ v[:, :k].T, u[:, :k], v[:, :k]


def _band_inputs():
    """A Gaussian matrix and an ill-conditioned one (singular values 1 .. 1e-6), with SVDs."""
    rng = np.random.default_rng(0)
    g = rng.standard_normal((M, N))
    u, s, vt = np.linalg.svd(g, full_matrices=False)
    ill, u2, v2 = _with_spectrum(rng, np.geomspace(1.0, 1e-6, M), M, N)
    s2 = np.geomspace(1.0, 1e-6, M)
    return np.stack([g, ill]), [(u, s, vt.T), (u2, s2, v2)]


# (schedule, ns_steps, tau, lo, hi, cap): the bands stated in orthogonalize's docstring.
DOCUMENTED_BANDS = [
    ("jordan", 5, 1e-2, 0.68, 1.14, 1.21),
    ("polar_express", 5, 1e-3, 0.84, 1.13, 1.13),
    ("polar_express", 8, 1e-3, 0.999, 1.001, 1.001),
]


@pytest.mark.parametrize("dtype,slack", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("schedule,steps,tau,lo,hi,cap", DOCUMENTED_BANDS)
def test_singular_values_in_documented_band(schedule, steps, tau, lo, hi, cap, dtype, slack):
    x, svds = _band_inputs()
    out = np.asarray(_orth(schedule, steps, dtype)(jnp.asarray(x, jnp.float32)), np.float64)
    for o, (u, s, v) in zip(out, svds, strict=True):
        # O = U p(S) V^T: the image of each input singular pair is u_i^T O v_i.
        mapped = np.einsum("mi,mn,ni->i", u, o, v)
        big = s >= tau * np.linalg.norm(s)
        assert big.sum() >= 2  # the band is checked on a real range of singular values
        assert mapped[big].min() >= lo - slack, (mapped[big].min(), lo)
        assert mapped[big].max() <= hi + slack, (mapped[big].max(), hi)
        assert np.all(mapped[~big] >= -slack)
        assert np.linalg.svd(o, compute_uv=False).max() <= cap + slack


def test_bf16_close_to_f32():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, M, N)), jnp.float32)
    for schedule in ("jordan", "polar_express"):
        ref = _orth(schedule, 5, jnp.float32)(x)
        got = _orth(schedule, 5, jnp.bfloat16)(x)
        chex.assert_trees_all_equal_dtypes(got, x)
        rel = jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)
        assert rel < 5e-2, (schedule, float(rel))


@pytest.mark.parametrize("schedule,steps", [("jordan", 5), ("jordan", 15), ("polar_express", 12)])
def test_bf16_iteration_stays_finite_at_any_scale_and_length(schedule, steps):
    """The narrow-operand iteration (bf16 Gram matrix and polynomial): inputs scaled by 1e-4
    or 1e12, and long schedules, stay finite and as close to the float32 iteration as
    unscaled ones (bf16 rounding alone; Jordan's never converges, so long runs differ more)."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((M, N)), jnp.float32)
    got = _orth(schedule, steps, jnp.bfloat16)(jnp.stack([x * 1e-4, x, x * 1e12]))
    chex.assert_tree_all_finite(got)
    f32 = _orth(schedule, steps, jnp.float32)(x)
    for g in got:
        assert jnp.linalg.norm(g - f32) / jnp.linalg.norm(f32) < 0.1


def test_batched_equals_per_matrix_and_tall_equals_transposed_wide():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, M, N)), jnp.float32)
    f = _orth("jordan", 5, jnp.float32)
    batched = f(x)
    chex.assert_shape(batched, x.shape)
    per_matrix = jnp.stack([jnp.stack([f(x[i, j]) for j in range(3)]) for i in range(2)])
    chex.assert_trees_all_close(batched, per_matrix, rtol=1e-5, atol=1e-6)
    tall = f(jnp.swapaxes(x, -1, -2))
    chex.assert_trees_all_close(tall, jnp.swapaxes(batched, -1, -2), rtol=1e-5, atol=1e-6)


def test_zero_matrix_maps_to_zero_and_dtype_is_kept():
    z = _orth("polar_express", 5, jnp.bfloat16)(jnp.zeros((M, N), jnp.bfloat16))
    chex.assert_trees_all_equal(z, jnp.zeros((M, N), jnp.bfloat16))


def test_resolve_schedules():
    assert resolve_ns_coeffs("jordan", 3) == (JORDAN_COEFFS,) * 3
    pe = resolve_ns_coeffs("polar_express", 10)
    a0, b0, c0 = 8.28721201814563, -23.595886519098837, 17.300387312530933
    np.testing.assert_allclose(pe[0], (a0 / 1.01, b0 / 1.01**3, c0 / 1.01**5), rtol=1e-15)
    assert pe[7:] == ((1.875, -1.25, 0.375),) * 3  # last step unscaled, then repeated
    assert pe[:5] == POLAR_EXPRESS_COEFFS[:5]
    custom = ((3.0, -3.0, 1.0), (2.0, -1.5, 0.5))
    assert resolve_ns_coeffs(custom, 2) == custom
    # Explicit per-step triples must number ns_steps: optax runs all T triples whatever
    # ns_steps >= T says and refuses ns_steps < T, so either guess surprises someone.
    for steps in (1, 3):
        with pytest.raises(ValueError, match=f"2 per-step triples but ns_steps={steps}"):
            resolve_ns_coeffs(custom, steps)
    assert resolve_ns_coeffs((1, 2, 3), 2) == ((1.0, 2.0, 3.0),) * 2
    assert resolve_ns_coeffs("standard", 2) == resolve_ns_coeffs("jordan", 2)
    assert resolve_ns_coeffs("dion", 5) == muon_jax.newton_schulz.DION_COEFFS
    assert resolve_ns_coeffs("jordan", np.int32(3)) == (JORDAN_COEFFS,) * 3  # 0-d ints too


def test_ns_flops_matches_compiled_cost():
    m, n, steps = 32, 64, 5
    flops = ns_flops(n, m, steps)  # tall input: the count uses the wide orientation
    assert flops == steps * (4 * m * m * n + 2 * m**3)
    compiled = _orth("jordan", steps, jnp.float32).lower(jnp.zeros((n, m))).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    assert flops <= cost["flops"] <= 1.1 * flops, (flops, cost["flops"])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(ns_coeffs="newton"), "Unknown ns_coeffs schedule 'newton'.*jordan"),
        (dict(ns_steps=0), "ns_steps must be >= 1"),
        (dict(ns_coeffs=((1.0, 2.0),)), r"shape \(3,\) or \(T, 3\)"),
    ],
)
def test_bad_schedule_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        muon_jax.orthogonalize(jnp.ones((2, 3)), **kwargs)


def test_bad_input_raises():
    with pytest.raises(TypeError, match="ns_steps must be a Python int"):
        muon_jax.orthogonalize(jnp.ones((2, 3)), ns_steps=2.0)
    with pytest.raises(ValueError, match=r"shape \[..., m, n\].*AdamW"):
        muon_jax.orthogonalize(jnp.ones((3,)))
    with pytest.raises(TypeError, match="float or complex array"):
        muon_jax.orthogonalize(jnp.ones((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="preconditioning='newton' is not supported"):
        muon_jax.orthogonalize(jnp.ones((2, 3)), preconditioning="newton")


def test_traced_schedules_run_as_a_loop_with_the_unrolled_result():
    """optax.inject_hyperparams traces ns_steps (and array coefficients): the steps then run
    in a fori_loop over a coefficient table, step t taking row min(t, T - 1), as unrolled."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((3, 8, 12)), jnp.float32)
    f32 = functools.partial(muon_jax.orthogonalize, dtype=jnp.float32)
    for coeffs, steps, pre in (("polar_express", 9, "frobenius"), ("jordan", 5, "aol")):
        got = jax.jit(lambda t, c=coeffs, p=pre: f32(x, ns_coeffs=c, ns_steps=t,
                                                     preconditioning=p))(steps)
        want = f32(x, ns_coeffs=coeffs, ns_steps=steps, preconditioning=pre)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    dion = np.asarray(muon_jax.newton_schulz.DION_COEFFS, np.float32)  # traced per-step rows
    got = jax.jit(lambda c: f32(x, ns_coeffs=c, ns_steps=5))(dion)
    chex.assert_trees_all_close(got, f32(x, ns_coeffs="dion", ns_steps=5), rtol=1e-5,
                                atol=1e-6)
    with pytest.raises(ValueError, match="method='gram' needs a concrete ns_steps"):
        jax.jit(lambda t: f32(x, ns_steps=t, method="gram"))(5)
