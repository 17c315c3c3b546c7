"""One suite every wire-kernel implementation of `accel_kernels.wire.api` runs: each gather with
``implementation`` 'auto', 'xla', 'triton' (interpreted on the CPU) and 'mosaic' (XLA where
not lowered for CUDA; its kernels lower for CUDA in test_wire_mosaic.py) gives XLA's bytes, with
repeated and out-of-range indices; a kernel named for a width it does not take is refused. Also
the deprecated 'pallas'."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from accel_kernels.quant import xla as quant_xla
from accel_kernels.wire import api
from moe.options import DispatchOptions

KERNELS = ["auto", "xla", "triton", "mosaic"]
D, BS = 512, 128
INDEX = jnp.array([5, 0, 2, 3, 23, 24, 99, 5], jnp.int32)


@functools.partial(jax.jit, static_argnums=0)  # one program, not one per op
def _rows(t=24):
    """Rows with per-row magnitudes from 2^-130 to 2^60, a zero row, an inf and a NaN."""
    k1, k2 = jax.random.split(jax.random.key(3))
    mag = jnp.exp2(jax.random.randint(k1, (t, 1), -130, 60).astype(jnp.float32))
    x = (jax.random.normal(k2, (t, D), jnp.float32) * mag).astype(jnp.bfloat16)
    return x.at[2].set(0).at[3, 7].set(jnp.inf).at[4, 300].set(jnp.nan)


def _same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        g, w = np.asarray(g), np.asarray(w)
        if g.dtype.kind not in "iu":
            g, w = g.astype(np.float32), w.astype(np.float32)
        np.testing.assert_array_equal(g, w)  # NaNs in the same places


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("wire", ["fp8", "bf16"])
def test_gather_rows_and_gather_decode(kernels, wire):
    codec = "fp8" if wire == "fp8" else jnp.dtype(jnp.bfloat16)
    kw = dict(wire=codec, width=D, block_size=BS, out_dtype=jnp.bfloat16)

    @jax.jit  # the gathers and their XLA references in one program (eagerly one per op)
    def run(x, index):
        want = api.gather_rows(x, index, wire=codec, block_size=BS, implementation="xla")
        got = api.gather_rows(x, index, wire=codec, block_size=BS, implementation=kernels)
        buf = api.encode_rows(x, wire=codec, block_size=BS)
        return ((got, want), (api.gather_decode(buf, index, implementation=kernels, **kw),
                              api.gather_decode(buf, index, implementation="xla", **kw)))

    for got, want in run(_rows(), INDEX):
        _same(got, want)


@pytest.mark.parametrize("kernels", KERNELS)
def test_row_quantized_gathers(kernels):
    w = jax.random.uniform(jax.random.key(1), (48,))
    slot = jnp.array([0, 47, 5, 48, 13], jnp.int32)
    kw = dict(top_k=2, wire_dtype=jnp.bfloat16)

    @jax.jit  # the gathers and their XLA references in one program (eagerly one per op)
    def run(x, index, w, slot):
        wire = api.encode_rows(x, wire="fp8", block_size=BS)
        want = quant_xla.quantize_rows_reference(api.gather_decode(
            wire, index, wire="fp8", width=D, block_size=BS, out_dtype=jnp.float32,
            implementation="xla"))
        return ((api.gather_rows_quantized(wire, index, width=D, block_size=BS,
                                           implementation=kernels), want),
                (api.gather_local_rows_quantized(x, index, block_size=BS,
                                                 implementation=kernels), want),
                (api.gather_weighted_rows_quantized(x, w, slot, implementation=kernels, **kw),
                 api.gather_weighted_rows_quantized(x, w, slot, implementation="xla", **kw)))

    for got, want in run(_rows(), INDEX, w, slot):
        _same(got, want)


def test_names_and_the_deprecated_pallas():
    with pytest.raises(ValueError, match="wire_implementation='cuda' is not supported"):
        DispatchOptions(wire_implementation="cuda")
    with pytest.raises(ValueError, match="implementation='cuda' is not supported"):
        api.gather_rows(_rows(), INDEX, wire="fp8", block_size=BS, implementation="cuda")
    with pytest.warns(DeprecationWarning, match="'pallas' is deprecated; use 'triton'"):
        assert DispatchOptions(wire_implementation="pallas").wire_implementation == "triton"


def test_an_explicit_kernel_that_does_not_take_the_width_is_refused():
    x = _rows()[:, :96]  # 96 channels: neither the Triton (power of two) nor the Mosaic gathers
    for kernels in ("triton", "mosaic"):
        with pytest.raises(ValueError, match=f"implementation='{kernels}' does not take"):
            api.gather_rows(x, INDEX, wire="fp8", block_size=32, implementation=kernels)
    want = api.gather_rows(x, INDEX, wire="fp8", block_size=32, implementation="xla")
    _same(api.gather_rows(x, INDEX, wire="fp8", block_size=32, implementation="auto"), want)
