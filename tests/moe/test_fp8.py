"""moe.fp8: bit-exact E8M0 packing (against ml_dtypes), round-trip error, edge cases, errors."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from accel_kernels.fp8 import (
    E8M0_PAD,
    Fp8Array,
    dequantize,
    pack_e8m0,
    quantize,
    scale_exponents,
    unpack_e8m0,
    wire_nbytes,
)

_quantize = jax.jit(quantize, static_argnames="block_size")
_dequantize = jax.jit(dequantize, static_argnames="dtype")


def _reference(x: np.ndarray, block_size: int):
    """numpy + ml_dtypes: (e4m3 data bytes, packed int32 scale words)."""
    x = x.astype(np.float32)
    lead, h = x.shape[:-1], x.shape[-1]
    xb = x.reshape(*lead, h // block_size, block_size).astype(np.float64)
    amax = np.maximum(np.abs(xb).max(-1), 448.0 * 2.0**-126)
    scale = 2.0 ** np.ceil(np.log2(amax / 448.0))
    data = np.clip(xb / scale[..., None], -448, 448).astype(np.float32)
    data = data.astype(ml_dtypes.float8_e4m3fn).reshape(x.shape)
    e8m0 = scale.astype(ml_dtypes.float8_e8m0fnu)
    np.testing.assert_array_equal(e8m0.astype(np.float64), scale)  # exact powers of two
    b = np.ascontiguousarray(e8m0).view(np.uint8).reshape(*lead, h // (4 * block_size), 4)
    words = np.ascontiguousarray(b).view("<i4")[..., 0]
    return data.view(np.uint8), words


def _rel_rms(y, x, axis=None):
    y, x = np.asarray(y, np.float64), np.asarray(x, np.float64)
    return np.sqrt(np.mean((y - x) ** 2, axis=axis) / np.mean(x**2, axis=axis))


@pytest.mark.parametrize("block_size,shape", [(128, (3, 5, 1024)), (32, (7, 256))])
def test_bit_identical_to_ml_dtypes_reference(block_size, shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= 10.0 ** rng.uniform(-6, 6, size=(*shape[:-1], shape[-1] // block_size, 1)).repeat(
        block_size, -1
    ).reshape(shape)
    q = _quantize(jnp.asarray(x), block_size=block_size)
    assert isinstance(q, Fp8Array) and q.block_size == block_size
    chex.assert_shape(q.data, shape)
    chex.assert_shape(q.scales, (*shape[:-1], shape[-1] // (4 * block_size)))
    assert q.data.dtype == jnp.float8_e4m3fn and q.scales.dtype == jnp.int32
    data_bytes, words = _reference(x, block_size)
    np.testing.assert_array_equal(np.asarray(q.scales), words)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data_bytes)


def test_pack_unpack_layout_matches_little_endian_e8m0_bytes():
    rng = np.random.default_rng(1)
    b = rng.integers(0, 256, size=(4, 3, 16), dtype=np.uint8)
    words = jax.jit(pack_e8m0)(jnp.asarray(b))
    expected = np.ascontiguousarray(b).view("<i4")  # byte j of word w = block 4w+j
    np.testing.assert_array_equal(np.asarray(words), expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(unpack_e8m0)(words)), b)
    assert int(pack_e8m0(jnp.array([1, 2, 3, 0x84], jnp.uint8))[0]) == np.int32(-0x7BFCFDFF)


def test_scales_are_tight_powers_of_two():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((16, 512)) * 10.0 ** rng.uniform(-20, 20, (16, 1))).astype(np.float32)
    q = _quantize(jnp.asarray(x))
    b = np.asarray(unpack_e8m0(q.scales))
    scale = b.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    np.testing.assert_array_equal(np.log2(scale), np.asarray(scale_exponents(q)))
    amax = np.abs(x.reshape(16, 4, 128)).max(-1).astype(np.float64)
    assert np.all(amax <= 448.0 * scale) and np.all(amax > 224.0 * scale)  # ceil, not larger
    assert np.all(b != 0xFF)


def test_round_trip_error_gaussian_and_many_decades():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        y = _dequantize(_quantize(jnp.asarray(x, dtype)), dtype=jnp.float32)
        assert _rel_rms(y, jnp.asarray(x, dtype).astype(jnp.float32)) < 0.04
    spread = x * (10.0 ** np.linspace(-35, 35, 64, dtype=np.float64))[:, None].astype(np.float32)
    y = _dequantize(_quantize(jnp.asarray(spread)), dtype=jnp.float32)
    chex.assert_tree_all_finite(y)
    assert np.all(_rel_rms(y, spread, axis=-1) < 0.04)
    assert _dequantize(_quantize(jnp.asarray(x)), dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_edge_cases_zero_denormal_huge_nan_inf():
    tiny = np.float32(1e-40)  # float32 denormal
    rows = np.stack(
        [
            np.zeros(512, np.float32),
            np.full(512, tiny, np.float32),
            np.full(512, 1e38, np.float32),
            np.full(512, -np.finfo(np.float32).max, np.float32),
        ]
    )
    bad = np.ones((2, 512), np.float32)
    bad[0, 130] = np.nan
    bad[1, 300] = -np.inf
    x = np.concatenate([rows, bad])
    q = _quantize(jnp.asarray(x))
    exps = np.asarray(scale_exponents(q))
    y32 = np.asarray(_dequantize(q, dtype=jnp.float32))
    y16 = np.asarray(_dequantize(q, dtype=jnp.bfloat16)).astype(np.float32)
    for y in (y32, y16):
        assert np.all(np.isfinite(y[:4]))
        np.testing.assert_array_equal(y[:2], 0.0)
        assert np.all(np.abs(y[2] / x[2] - 1) <= 2.0**-4)  # half an e4m3 ulp
        assert np.all(y[3] < -3e38)
    np.testing.assert_array_equal(exps[0], -126)
    np.testing.assert_array_equal(exps[1], -126)
    assert np.all(np.isfinite(np.asarray(q.data[:4]).astype(np.float32)))
    # a NaN/inf poisons exactly its own block (byte 0xFF), never a finite value
    b = np.asarray(unpack_e8m0(q.scales))
    np.testing.assert_array_equal(b[4:] == 0xFF, [[0, 1, 0, 0], [0, 0, 1, 0]])
    for y in (y32, y16):
        assert np.all(np.isnan(y[4, 128:256])) and np.all(np.isnan(y[5, 256:384]))
        np.testing.assert_array_equal(y[4, :128], 1.0)
        np.testing.assert_array_equal(y[5, 384:], 1.0)


def test_vmap_and_shard_map_match_plain_call():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((8, 4, 512)), jnp.bfloat16)
    q = _quantize(x)
    qv = jax.jit(jax.vmap(quantize))(x)
    chex.assert_trees_all_equal(qv, q)

    mesh = jax.make_mesh((8,), ("ep",))
    specs = jax.tree.map(lambda _: P("ep"), q)  # a spec tree mirrors the Fp8Array pytree
    assert isinstance(specs, Fp8Array)
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("ep")))
    qs = jax.jit(jax.shard_map(quantize, mesh=mesh, in_specs=P("ep"), out_specs=specs))(xs)
    chex.assert_trees_all_equal(qs, q)
    assert wire_nbytes(q) == x.size + 4 * (x.size // 512)
    assert wire_nbytes(jax.eval_shape(quantize, x)) == wire_nbytes(q)


def test_not_differentiable_but_custom_vjp_works():
    x = jnp.linspace(-2.0, 2.0, 512)

    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jit(jax.grad(lambda x: dequantize(quantize(x), jnp.float32).sum()))(x)

    @jax.custom_vjp
    def fp8_roundtrip(x):
        return dequantize(quantize(x), jnp.float32)

    fp8_roundtrip.defvjp(lambda x: (fp8_roundtrip(x), None), lambda _, g: (g,))
    g = jax.jit(jax.grad(lambda x: (fp8_roundtrip(x) * x).sum()))(x)
    chex.assert_trees_all_close(g, x + fp8_roundtrip(x))


@pytest.mark.parametrize(
    "shape,block_size,err,match",
    [
        ((4, 100), 128, ValueError, "multiple of the FP8 block size 128"),
        ((4, 200), 64, ValueError, "pad it to a multiple of 64"),
        ((4, 0), 128, ValueError, "x.shape"),
        ((), 128, ValueError, "at least one axis"),
        ((4, 512), 0, ValueError, "block_size must be positive"),
        ((4, 512), 128.0, TypeError, "block_size"),
    ],
)
def test_bad_arguments_raise(shape, block_size, err, match):
    with pytest.raises(err, match=match):
        quantize(jnp.zeros(shape), block_size=block_size)


def test_bad_dtypes_raise():
    with pytest.raises(TypeError, match="x must be"):
        quantize(jnp.zeros((2, 512), jnp.int32))
    with pytest.raises(TypeError, match="scale_bytes"):
        pack_e8m0(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_e8m0(jnp.zeros((6,), jnp.uint8))
    with pytest.raises(TypeError, match="Fp8Array"):
        dequantize(jnp.zeros((2, 512)))


@pytest.mark.parametrize("width", [128, 256, 384, 768, 896, 1280])
def test_any_block_aligned_width(width):
    """Widths that leave the last int32 scale word partly empty: the unused byte slots hold
    E8M0_PAD, the data and used scales equal those of the same rows padded to whole words."""
    nblocks = width // 128

    @jax.jit  # one program per width (called eagerly, every op compiled its own)
    def run():
        x = jax.random.normal(jax.random.key(width), (5, width)) * 3.0
        q = quantize(x, block_size=128)
        padded = quantize(jnp.pad(x, ((0, 0), (0, (-width) % 512))), block_size=128)
        return (x, q, padded.data[:, :width], unpack_e8m0(q.scales),
                unpack_e8m0(padded.scales), dequantize(q, jnp.float32))

    x, q, padded_data, got, padded_scales, y = jax.tree.map(np.asarray, run())
    assert q.scales.shape == (5, -(-nblocks // 4)) and q.block_size == 128
    np.testing.assert_array_equal(q.data.view(np.uint8), padded_data.view(np.uint8))
    np.testing.assert_array_equal(got[:, :nblocks], padded_scales[:, :nblocks])
    assert np.all(got[:, nblocks:] == E8M0_PAD)
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2))
    assert float(rel) < 0.04
