"""benchmarks/ns_step_bound.py: its spectral model is muon_jax's iteration, its floor holds for
concrete schedules, and it rules out 3 quintic steps at the 1.1x accuracy bound."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from _paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import ns_step_bound as nsb  # noqa: E402

import muon_jax  # noqa: E402


def _spectrum_matrix(s, m=48, n=80, seed=0):
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((m, len(s))))
    v, _ = np.linalg.qr(rng.standard_normal((n, len(s))))
    return (u * s) @ v.T


def test_the_spectral_model_is_the_iteration():
    """error() on the singular values = orthogonalize's f32 distance to U V^T (eps aside)."""
    s = np.geomspace(1, 1e-3, 48)
    x = _spectrum_matrix(s)
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    for coeffs, steps, schedule in (("jordan", 5, [nsb.JORDAN] * 5),
                                    (nsb.greedy_schedule(3e-3, 4), 4,
                                     nsb.greedy_schedule(3e-3, 4))):
        got = jax.jit(lambda g, c=coeffs, t=steps: muon_jax.orthogonalize(
            g, ns_coeffs=c, ns_steps=t, dtype=jnp.float32, method="standard",
            symmetric_blocks=1))(jnp.asarray(x, jnp.float32))
        want = np.linalg.norm(np.asarray(got, np.float64) - u @ vt) / np.sqrt(len(s))
        np.testing.assert_allclose(nsb.error(schedule, s), want, rtol=2e-3)


def test_the_floor_holds_for_concrete_schedules():
    """No schedule beats the floor at its own bound (its max over [0, 1])."""
    grid = np.linspace(0, 1, 200001)
    for steps, schedule in ((5, [nsb.JORDAN] * 5), (4, nsb.greedy_schedule(3e-3, 4)),
                            (3, nsb.greedy_schedule(1e-2, 3))):
        bound = float(np.max(np.abs(nsb.compose(schedule, grid))))
        for s in (np.geomspace(1, 1e-3, 500), np.geomspace(1, 1e-6, 500),
                  np.arange(1, 501.0) ** -1.5):
            assert nsb.error(schedule, s) >= nsb.floor(s, steps, bound) - 1e-12


def test_three_steps_cannot_meet_the_accuracy_bound():
    """On the accuracy benchmark's cond-1000 spectrum (muon_speed.py builds it from
    orthonormal factors: these are its singular values), any 3-step quintic schedule bounded
    by 2 on [0, 1] is > 1.1x Jordan's 5 steps; 4 steps are not ruled out."""
    s = np.geomspace(1, 1e-3, 1024)
    ref = nsb.error([nsb.JORDAN] * 5, s)
    assert nsb.floor(s, 3, 2.0) / ref > 1.1
    assert nsb.floor(s, 4, 1.2) / ref < 1.0
