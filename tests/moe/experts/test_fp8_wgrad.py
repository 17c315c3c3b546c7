"""FP8 weight gradients (`moe.experts.fp8_gemm.wgrad`): ``dW_e = a_e^T g_e`` from the row-quantized
operands, written K-major with the row scales' product folded into ``g``'s payload relative to
its maximum ``P`` (per leading index), against plain einsums in float64.

Where every value and every product of row scales is exactly representable (small integers
times powers of two, the row scale products within 2^6 of each other) nothing is rounded and
the FP8 result equals the f32 one bit for bit; elsewhere it stays within FP8's row-wise
accuracy. All on the CPU's XLA paths (the references of the Pallas kernels, the Mosaic GEMMs'
emulation)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from accel_kernels.gmm import api as gmm_api
from accel_kernels.quant import xla as quant_xla
from moe.experts import fp8_gemm

GS = np.array([16, 0, 32, 16], np.int32)  # an empty group; 16 padding rows of zeros follow
ROWS, K, N = 80, 32, 48


@functools.cache
def _wgrad(backend: str):
    """The FP8 weight gradient of the GEMMs ``backend`` names: 'ragged_dot' and 'einsum' are
    the 'xla' implementation's on ragged rows and on padded slots."""
    layout = {"ragged_dot": ("xla", 2), "einsum": ("xla", 3)}
    ops = gmm_api.gemms(*layout.get(backend, (backend, 2)))
    return jax.jit(lambda a, g, gs: fp8_gemm.wgrad(ops, "fp8", a, g, gs, jnp.float32))


_operands = jax.jit(fp8_gemm.wgrad_operands)
_rows = jax.jit(fp8_gemm.rows)
BF16 = jnp.bfloat16  # numpy arrays of it (ml_dtypes): inputs are built without eager JAX ops


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _ragged_reference(a, g, gs):
    """``a_e^T g_e`` per group of ragged rows, float64 (rows past ``sum(gs)`` ignored)."""
    ends = np.cumsum(gs)
    rows = np.arange(a.shape[0])
    member = (rows[None, :] >= (ends - gs)[:, None]) & (rows[None, :] < ends[:, None])
    return np.einsum("er,rk,rn->ekn", member.astype(np.float64), _f64(a), _f64(g))


def _padded_reference(a, g):
    return np.einsum("eck,ecn->ekn", _f64(a), _f64(g))


def _exact_rows(rng, shape, exps):
    """bf16 small integers (|i| <= 7) times ``2^exps`` per row: exact in e4m3 after the
    row-wise scaling, and so is every product and f32 sum of them here."""
    ints = rng.integers(-7, 8, shape)
    return (ints * np.ldexp(1.0, exps)[..., None]).astype(BF16)


def _ragged_exact(seed=0, offset=0):
    """Ragged ``a [ROWS, K]``, ``g [ROWS, N]``: row exponents in [0, 3] (a) and [-3, 0] (g),
    times ``2^offset`` each; a zero row in group 0 (a) and in group 2 (g), group 3's g all
    zero, the padding rows zero."""
    rng = np.random.default_rng(seed)
    a = _exact_rows(rng, (ROWS, K), rng.integers(0, 4, ROWS) + offset)
    g = _exact_rows(rng, (ROWS, N), rng.integers(-3, 1, ROWS) + offset)
    real = int(GS.sum())
    a[3] = a[real:] = 0
    g[20] = g[48:] = 0
    return a, g


def _aligned(x, gs, align=128):
    """Ragged rows ``x`` in the tile-aligned layout of 'mosaic' (each group from a multiple of
    ``align`` rows, zeros between) and one more tile of padding rows."""
    out, start = [], 0
    for n in (*gs, 1):
        blk = np.zeros((-(-n // align) * align, x.shape[1]), x.dtype)
        blk[:n] = x[start:start + n]
        out.append(blk)
        start += n
    return np.concatenate(out)


def _group_slices():
    ends = np.cumsum(GS)
    return [slice(int(e - s), int(e)) for s, e in zip(GS, ends, strict=True)]


@pytest.mark.parametrize("backend", ["ragged_dot", "mosaic"])
def test_exact_operands_give_the_f32_result(backend):
    """'mosaic' (its XLA emulation on the CPU) on the aligned layout: groups of 128 rows of
    which the first ``GS`` are live."""
    a, g = _ragged_exact()
    want = _ragged_reference(a, g, GS)
    if backend == "mosaic":
        a, g = _aligned(a, GS), _aligned(g, GS)
        gs = gmm_api.RowGroups(np.array([128, 0, 128, 128], np.int32), GS)
    else:
        gs = GS
    got = _wgrad(backend)(a, g, gs)
    chex.assert_shape(got, (len(GS), K, N))
    assert got.dtype == jnp.float32
    assert np.abs(want[[0, 2]]).max() > 100 and np.count_nonzero(want[0]) > 0.9 * K * N
    chex.assert_trees_all_equal(np.asarray(got), want.astype(np.float32))
    assert not np.asarray(got)[[1, 3]].any()  # the empty group and the zero-g group
    # the operands tmm8 reads: K-major payloads, the epilogue's P as two powers of two
    a_t, g_t, s_a, s_g = _operands(a, g)
    chex.assert_shape((a_t, g_t, s_a, s_g), [(K, len(a)), (N, len(a)), (K,), (N,)])
    assert a_t.dtype == g_t.dtype == jnp.float8_e4m3fn
    for s in (np.asarray(s_a), np.asarray(s_g)):
        assert (s == s[0]).all() and np.log2(s[0]).is_integer()


def test_padded_layout_has_one_scale_per_expert():
    """'einsum' ``[E, C, K]``: ``P`` per expert, so experts 2^60 apart in their row-scale
    products are each still exact (one shared ``P`` would flush the small one to zero)."""
    rng = np.random.default_rng(1)
    e, c = 3, 32
    offset = np.array([-20, 10, 0])[:, None]  # a and g of expert e both times 2^offset[e]
    a = _exact_rows(rng, (e, c, K), rng.integers(0, 4, (e, c)) + offset)
    g = _exact_rows(rng, (e, c, N), rng.integers(-3, 1, (e, c)) + offset)
    a[0, 24:] = g[0, 24:] = g[2] = 0  # expert 0's empty slots; expert 2's g is zero
    got = np.asarray(_wgrad("einsum")(a, g, np.full(e, c, np.int32)))
    want = _padded_reference(a, g)
    chex.assert_shape(got, (e, K, N))
    assert 0 < np.abs(want[0]).max() < 2.0**-25 and np.abs(want[1]).max() > 2.0**20
    chex.assert_trees_all_equal(got, want.astype(np.float32))
    assert not got[2].any()
    _, _, s_a, s_g = _operands(a, g)
    chex.assert_shape((s_a, s_g), [(e, K), (e, N)])
    s_a, s_g = np.asarray(s_a), np.asarray(s_g)
    assert (s_a == s_a[:, :1]).all() and (s_g == s_g[:, :1]).all()
    p = s_a[:, 0].astype(np.float64) * s_g[:, 0]
    assert p[1] / p[0] >= 2.0**55


def test_tiny_products_are_not_flushed():
    """Row-scale products far below f32's normal range (P ~ 2^-230) still give the exact
    gradient, as long as the gradient itself is a normal f32: P is applied as two factors."""
    a = np.full((16, K), 2.0**-60, np.float32)
    g = np.full((16, N), 2.0**-60, np.float32)
    got = np.asarray(_wgrad("ragged_dot")(a, g, np.array([16], np.int32)))
    chex.assert_trees_all_equal(got, np.full((1, K, N), 16 * 2.0**-120, np.float32))


_dequantized = jax.jit(lambda x: (lambda q, s: q.astype(jnp.float32) * s[..., None])(
    *quant_xla.quantize_rows_reference(x)))


def _rel_rms(x, y):
    return np.sqrt(np.mean((x - y) ** 2) / np.mean(y**2))


@pytest.mark.parametrize("seed", [0, 1])
def test_accurate_over_a_wide_range_of_row_magnitudes(seed):
    """Rows of a and g log-uniform over 2^-8 .. 2^8 (products over 2^32): within FP8's
    row-wise accuracy of the f32 result, and within 0.5% of the product of the dequantized
    rows (the rows far below the largest product, whose folded payloads lose bits,
    contribute little)."""
    rng = np.random.default_rng(10 + seed)
    mag = lambda: np.exp2(rng.uniform(-8, 8, (ROWS, 1)))
    a = (rng.standard_normal((ROWS, K)) * mag()).astype(BF16)
    g = (rng.standard_normal((ROWS, N)) * mag()).astype(BF16)
    a[GS.sum():] = g[GS.sum():] = 0
    got = np.asarray(_wgrad("ragged_dot")(a, g, GS), np.float64)
    want = _ragged_reference(a, g, GS)
    rows_q = _ragged_reference(_dequantized(a), _dequantized(g), GS)
    for e in np.flatnonzero(GS):
        x, y = got[e].ravel(), want[e].ravel()
        cos = x @ y / np.linalg.norm(x) / np.linalg.norm(y)
        assert cos >= 0.999 and _rel_rms(x, y) < 0.05, (e, cos, _rel_rms(x, y))
        assert _rel_rms(x, rows_q[e].ravel()) < 5e-3, (e, _rel_rms(x, rows_q[e].ravel()))
    assert not got[1].any()


@pytest.mark.parametrize("operand, value", [("g", np.nan), ("a", np.inf), ("g", -np.inf)])
def test_nonfinite_rows_give_nonfinite_gradients(operand, value):
    """A row holding NaN or inf (NaN scale; an inf's payload alone is a finite 448) makes
    ``P`` NaN: not a finite result. Ragged rows share one ``P`` (every group NaN); padded
    experts have their own (the others stay exact)."""
    a, g = _ragged_exact()
    x = {"a": a.copy(), "g": g.copy()}
    x[operand][22, 5] = value  # group 2
    got = np.asarray(_wgrad("ragged_dot")(x["a"], x["g"], GS))
    assert np.isnan(got).all()

    rng = np.random.default_rng(2)
    a = _exact_rows(rng, (2, 16, K), rng.integers(0, 4, (2, 16)))
    g = _exact_rows(rng, (2, 16, N), rng.integers(-3, 1, (2, 16)))
    x = {"a": a.copy(), "g": g.copy()}
    x[operand][1, 7, 3] = value
    got = np.asarray(_wgrad("einsum")(x["a"], x["g"], np.full(2, 16, np.int32)))
    assert np.isnan(got[1]).all()
    chex.assert_trees_all_equal(got[0], _padded_reference(a, g)[0].astype(np.float32))


def test_zero_rows_and_groups_leave_the_others_alone():
    """Zero rows get the smallest scale (2^-126), so they never set ``P``: with every real
    row tiny (row-scale products ~2^-96) the result is still exact, and bitwise the same as
    without the zero rows and groups."""
    a, g = _ragged_exact(seed=3, offset=-40)
    got = np.asarray(_wgrad("ragged_dot")(a, g, GS))
    want = _ragged_reference(a, g, GS)
    assert 0 < np.abs(want[0]).max() < 2.0**-60
    chex.assert_trees_all_equal(got, want.astype(np.float32))
    # the same rows without the zero group (3), the empty group and the padding
    s0, _, s2, _ = _group_slices()
    sub = np.r_[s0, s2]
    solo = np.asarray(_wgrad("ragged_dot")(a[sub], g[sub], np.array([16, 32], np.int32)))
    chex.assert_trees_all_equal(got[[0, 2]], solo)
    assert not got[[1, 3]].any()


@pytest.mark.parametrize("backend", ["ragged_dot", "einsum"])
def test_quantized_pairs_give_the_same_gradient(backend):
    """``(e4m3, scale)`` pairs, as the forward and data-gradient GEMMs leave them, give the
    bytes of the arrays they came from."""
    a, g = _ragged_exact(seed=4)
    rng = np.random.default_rng(4)
    a = (a.astype(np.float32) * rng.standard_normal((ROWS, K))).astype(BF16)  # inexact
    gs = GS
    if backend == "einsum":
        a, g, gs = a[:64].reshape(4, 16, K), g[:64].reshape(4, 16, N), np.full(4, 16, np.int32)
    fn = _wgrad(backend)
    want = np.asarray(fn(a, g, gs))
    pa, pg = _rows(a), _rows(g)
    chex.assert_shape(pa, [a.shape, a.shape[:-1]])
    for x, y in ((pa, pg), (a, pg)):
        chex.assert_trees_all_equal(np.asarray(fn(x, y, gs)), want)
    ref = _ragged_reference(a, g, gs) if backend != "einsum" else _padded_reference(a, g)
    chex.assert_trees_all_close(want, ref.astype(np.float32), rtol=0.1,
                                atol=0.05 * np.abs(ref).max())


def test_folded_payload_rounds_to_nearest_even():
    """``g_t`` is ``e4m3(q_g * s_a s_g / P)`` transposed: row ``r``'s payload times the power
    of two its scales fall below the largest product, rounded to nearest even where that leaves
    e4m3's normal range (numpy's f32 product cast by ml_dtypes), and ``a_t`` is ``q_a``
    transposed untouched."""
    rng = np.random.default_rng(9)
    rows = 64
    a = (rng.standard_normal((rows, K)) * np.ldexp(1.0, rng.integers(-6, 6, (rows, 1))))
    g = (rng.standard_normal((rows, N)) * np.ldexp(1.0, rng.integers(-6, 6, (rows, 1))))
    a, g = a.astype(np.float32).astype(BF16), g.astype(np.float32).astype(BF16)
    (qa, sa), (qg, sg) = _rows(a), _rows(g)
    a_t, g_t, s_a, s_g = _operands(a, g)
    p = np.asarray(sa, np.float64) * np.asarray(sg)
    mult = (p / p.max()).astype(np.float32)[:, None]
    want = (np.asarray(qg).astype(np.float32) * mult).astype(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(g_t).view(np.uint8), want.T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(a_t).view(np.uint8),
                                  np.asarray(qa).T.view(np.uint8))
    assert float(np.asarray(s_a)[0]) * float(np.asarray(s_g)[0]) == p.max()
    assert mult.min() <= 2.0**-12  # some rows did leave the normal range
