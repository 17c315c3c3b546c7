"""One suite every FP8 quantization implementation of `accel_kernels.quant.api` runs: each entry
point with ``implementation`` 'auto', 'xla', 'triton' (interpreted on the CPU) and 'mosaic'
(the XLA reference where not lowered for CUDA; its kernels lower for CUDA in
test_quant_mosaic.py) gives the XLA reference's bytes, on shapes that fit every kernel, with
leading axes. Explicit kernels refuse shapes they do not take."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from accel_kernels.activations import GatedActivation
from accel_kernels.quant import api, xla

IMPLS = ["auto", "xla", "triton", "mosaic"]
_rows_reference = jax.jit(xla.quantize_rows_reference)  # one program, not one per op
ACT = GatedActivation("silu")


@functools.partial(jax.jit, static_argnums=(0, 1))  # one program per shape, not one per op
def _x(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


def _same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                      np.asarray(w.astype(jnp.float32)))


@pytest.mark.parametrize("impl", IMPLS)
def test_rows(impl):
    x = _x((2, 4, 256)).at[0, 1, 3].set(jnp.inf)
    _same(api.rows(x, implementation=impl), _rows_reference(x))  # the implementation eagerly


@pytest.mark.parametrize("impl", IMPLS)
def test_gated_rows(impl):
    z = _x((8, 256))
    # jitted, kernel and reference in one program (test_rows calls each implementation eagerly)
    _same(*jax.jit(lambda z: (api.gated_rows(z, ACT, implementation=impl),
                              xla.gated_quantize_rows_reference(z, ACT)))(z))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, None])
def test_gated_grad_rows(impl, out_dtype):
    z, dh = _x((8, 256)), _x((8, 128), seed=1)
    # jitted, kernel and reference in one program (test_rows calls each implementation eagerly)
    _same(*jax.jit(lambda z, dh: (
        api.gated_grad_rows(z, dh, ACT, out_dtype, implementation=impl),
        xla.gated_grad_quantize_rows_reference(z, dh, ACT, out_dtype)))(z, dh))


@pytest.mark.parametrize("impl", IMPLS)
def test_cols_t_and_rows(impl):
    """A weight's K-major column copy and its row copy (NaN columns and rows, a zero column,
    rows of very different magnitudes), one at a time and from the two-pass kernel."""

    @jax.jit  # kernels and references in one program (test_rows calls each eagerly)
    def run():
        a = jax.random.normal(jax.random.key(4), (2, 128, 256), jnp.float32)
        a = a * jnp.exp(jax.random.normal(jax.random.key(5), (2, 128, 1)) * 4)
        a = a.at[0, 5, 7].set(jnp.nan).at[1, :, 3].set(0)
        return ((api.cols_t(a, implementation=impl), xla.quantize_cols_t_reference(a)),
                (api.cols_t_and_rows(a, implementation=impl),
                 xla.quantize_cols_t_and_rows_reference(a)))

    for got, want in run():
        _same(got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_inside_jit(impl):
    x = _x((8, 128))
    _same(jax.jit(lambda x: api.rows(x, implementation=impl))(x), _rows_reference(x))


def test_explicit_kernels_refuse_shapes_they_do_not_take():
    with pytest.raises(ValueError, match="implementation='mosaic'"):
        api.rows(_x((8, 96)), implementation="mosaic")
    with pytest.raises(ValueError, match="implementation='triton'"):
        api.rows(_x((8, 40)), implementation="triton")
    with pytest.raises(ValueError, match="implementation='mosaic'"):
        api.cols_t(_x((1, 64, 64)), implementation="mosaic")
    with pytest.raises(ValueError, match="implementation='triton'"):
        api.cols_t_and_rows(_x((1, 64, 100)), implementation="triton")
    with pytest.raises(ValueError, match="implementation='cuda' is not supported"):
        api.rows(_x((8, 128)), implementation="cuda")
    # 'auto' takes any shape (the reference where no kernel fits).
    _same(*jax.jit(lambda x: (api.rows(x), xla.quantize_rows_reference(x)))(_x((8, 40))))
