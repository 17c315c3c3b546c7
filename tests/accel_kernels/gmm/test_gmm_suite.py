"""One suite every grouped-GEMM implementation of `accel_kernels.gmm.api` runs: each of its
five GEMMs against 'xla' on ragged rows (``jax.lax.ragged_dot``, the reference) on the CPU, where
'triton' runs interpreted and 'mosaic' its XLA emulation; both lower for CUDA in
test_gmm_triton.py and test_fp8_lowering.py. Also the registry's choices and the deprecated
spellings."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from accel_kernels.gmm import api

E, K, N = 2, 128, 128
GS = jnp.array([128, 128], jnp.int32)  # aligned: every implementation takes it
R = 256
F8 = jnp.float8_e4m3fn


@functools.partial(jax.jit, static_argnums=0)  # one program, not one per op
def _data(dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 4)
    a = jax.random.normal(ks[0], (R, K), jnp.float32).astype(dtype)
    w = jax.random.normal(ks[1], (E, K, N), jnp.float32).astype(dtype)
    g = jax.random.normal(ks[2], (R, N), jnp.float32).astype(dtype)
    return a, w, g


# (implementation, rank of its token operand): 'xla' on ragged rows and on padded slots
CASES = [("xla", 2), ("xla", 3), ("triton", 2), ("mosaic", 2)]


def _as_impl(ndim, x):
    """Ragged rows [R, k] as the layout of rank ``ndim`` (padded [E, C, k] for 3)."""
    return x.reshape(E, R // E, x.shape[-1]) if ndim == 3 else x


def _from_impl(ndim, y):
    return y.reshape(R, y.shape[-1]) if y.ndim == 3 and y.shape[0] == E and ndim == 3 else y


REF = api.gemms("xla", 2)


@pytest.mark.parametrize("name,ndim", CASES)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_bf16_gemms_match_ragged_dot(name, ndim, dtype, tol):
    ops = api.gemms(name, ndim)

    @jax.jit  # the three GEMMs and their references in one program (eagerly one per op)
    def run(a, w, g):
        got = [_from_impl(ndim, ops.fwd(_as_impl(ndim, a), w, GS, jnp.float32)),
               _from_impl(ndim, ops.dgrad(_as_impl(ndim, g), w, GS, jnp.float32)),
               ops.wgrad(_as_impl(ndim, a), _as_impl(ndim, g), GS, jnp.float32)]
        want = [REF.fwd(a, w, GS, jnp.float32), REF.dgrad(g, w, GS, jnp.float32),
                REF.wgrad(a, g, GS, jnp.float32)]
        return got, want

    got, want = run(*_data(dtype))
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol * 16)


@pytest.mark.parametrize("name,ndim", CASES)
def test_fp8_gemms_match_ragged_dot(name, ndim):
    ops = api.gemms(name, ndim)

    @jax.jit  # the two GEMMs and their references in one program (eagerly one per op)
    def run(a, w, g):
        aq, bq = a.astype(F8), jnp.swapaxes(w, 1, 2).astype(F8)  # K-major weight [E, N, K]
        s_a, s_b = jnp.full((R,), 0.5), jnp.full((E, N), 2.0)
        got = _from_impl(ndim, ops.mm8(_as_impl(ndim, aq), bq, GS, jnp.float32,
                                       _as_impl(ndim, s_a[:, None])[..., 0], s_b))
        want = REF.mm8(aq, bq, GS, jnp.float32, s_a, s_b)
        at, gt = a.T.astype(F8), g.T.astype(F8)
        if ops.x_ndim == 3:
            at3, gt3 = (jnp.swapaxes(_as_impl(ndim, x), 1, 2).astype(F8) for x in (a, g))
            got_t = ops.tmm8(at3, gt3, GS, jnp.float32, jnp.full((E, K), 0.5),
                             jnp.full((E, N), 2.0))
        else:
            got_t = ops.tmm8(at, gt, GS, jnp.float32, jnp.full((K,), 0.5), jnp.full((N,), 2.0))
        want_t = REF.tmm8(at, gt, GS, jnp.float32, jnp.full((K,), 0.5), jnp.full((N,), 2.0))
        return (got, want), (got_t, want_t)

    for got, want in run(*_data()):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_registry_choices_on_cpu():
    assert set(api.IMPLEMENTATIONS.modules) == {"xla", "triton", "mosaic"}
    assert (api.resolve("auto", 2), api.resolve("auto", 3)) == ("xla", "xla")
    assert api.resolve("mosaic", 3) == "mosaic"
    assert api.gemms("xla", 2).x_ndim == 2 and api.gemms("xla", 3).x_ndim == 3
    with pytest.raises(ValueError, match="implementation='triton' takes x as"):
        api.resolve("triton", 3)
    with pytest.raises(ValueError, match="implementation='cutlass' is not supported"):
        api.resolve("cutlass", 2)


@pytest.mark.parametrize("old,new", [("pallas", "triton"), ("ragged_dot", "xla"),
                                     ("einsum", "xla")])
def test_old_spellings_are_deprecated(old, new):
    with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated; use '{new}'"):
        assert api.resolve(old, 2) == new
    from moe.options import ExpertOptions

    with pytest.warns(DeprecationWarning):
        assert ExpertOptions(gemm_implementation=old).gemm_implementation == new
