"""Newton-Schulz on the symmetric-tile kernel (``symmetric_blocks='tiles'``), on the CPU.

There :func:`muon_jax.symmetric.symmetric_tiles_matmul` is the kernel's emulation (the full
product's upper triangle, mirrored as the kernel mirrors it; the unmirrored kernel's skipped
tiles are NaN): it must equal the full product for products that are symmetric, padding
included; Newton-Schulz on it must match plain matmuls to bf16 rounding and be as close to the
exact polar factor; ``'auto'`` must take it (and the Gram form with it) only where the module's
constants say; and on a Hopper target it lowers to the kernel, mirroring included, with no
mirror pass after it.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cuda_export import export_for_cuda, kernel_calls

import muon_jax
from accel_kernels import platform
from accel_kernels.symmetric import api as symmetric_api
from accel_kernels.symmetric import mosaic as mosaic_symmetric
from muon_jax.newton_schulz import (
    AUTO_GRAM_MIN_ASPECT,
    AUTO_SYMMETRIC_BLOCKS,
    AUTO_TILES_MIN_SIDE,
    ns_flops,
    resolve_ns_method,
    resolve_symmetric_blocks,
)
from muon_jax.symmetric import TILES_DTYPES, mirror_upper, symmetric_tiles_matmul

BF16, F32 = jnp.bfloat16, jnp.float32
HOPPER, AMPERE = (9, 0), (8, 0)
S = jax.ShapeDtypeStruct


def _ints(rng, shape):
    """Entries in {-1, 0, 1}: exact in bf16, and so are their f32-accumulated products."""
    return jnp.asarray(rng.integers(-1, 2, size=shape), BF16)


def _upper(c):
    """The symmetric matrix with ``c``'s upper triangle (NumPy, for the expected values)."""
    c = np.asarray(c)
    return np.triu(c) + np.swapaxes(np.triu(c, 1), -1, -2)


# ----------------------------------------------------------------------------------------------
# symmetric_tiles_matmul and mirror_upper
# ----------------------------------------------------------------------------------------------


def test_mirror_upper_reads_only_the_upper_triangle():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 5, 5)).astype(np.float32)
    sym = a + np.swapaxes(a, -1, -2)
    nan_below = np.where(np.tril(np.ones((5, 5), bool), -1), np.nan, sym)
    got = jax.jit(mirror_upper)(jnp.asarray(nan_below))
    chex.assert_trees_all_equal(got, jnp.asarray(sym))
    assert not jnp.isnan(got).any()
    chex.assert_trees_all_equal(mirror_upper(jnp.asarray(a)), jnp.asarray(_upper(a)))


@pytest.mark.parametrize("shape", [(3, 200, 40), (300, 70), (2, 512, 64)])
def test_gram_product_equals_the_full_product(shape):
    """``X X^T`` with bf16 operands, f32 result: p and r padded (200 -> 256, 40 -> 64; 300 ->
    512, where the kernel skips tiles), a batch dimension, or none."""

    @jax.jit  # input, product and reference in one program (eager: one per op)
    def products():
        x = jax.random.normal(jax.random.key(shape[-1]), shape).astype(BF16)
        got = symmetric_tiles_matmul(x, x, preferred_element_type=F32)
        return got, jnp.matmul(x, x.mT, preferred_element_type=F32)

    got, want = products()
    chex.assert_shape(got, (*shape[:-1], shape[-2]))
    got = np.asarray(got)
    assert got.dtype == F32 and not np.isnan(got).any()
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-4)
    chex.assert_trees_all_equal(got, np.swapaxes(got, -1, -2))  # exactly symmetric


@pytest.mark.parametrize("shape", [(2, 200, 40), (300, 70)])
def test_polynomial_products_equal_the_full_product_exactly(shape):
    """``A B`` for ``B = X X^T`` and ``A = B + 3 I`` (commuting, so ``A B`` is symmetric), on
    integers that bf16 holds exactly: the result is the exact product, in f32 and bf16."""
    rng = np.random.default_rng(1)
    x = _ints(rng, shape)

    @jax.jit  # the products and their operands in one program (eager: one per op)
    def products(x):
        b = jnp.matmul(x, x.mT, preferred_element_type=F32)
        a = b + 3 * jnp.eye(shape[-2])
        got = symmetric_tiles_matmul(a, b, dtype=BF16, preferred_element_type=F32)
        return a, b, got, symmetric_tiles_matmul(x, x)

    a, b, got, small = products(x)
    want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    chex.assert_trees_all_equal(got, jnp.asarray(want, F32))
    # default result dtype: the operands'
    assert small.dtype == BF16
    chex.assert_trees_all_equal(small, np.asarray(b).astype(BF16))


def test_a_non_symmetric_product_becomes_its_upper_triangle_mirrored():
    """What the docstring warns of, and what shows the emulation: every element on or above the
    diagonal is the product's, every one below its mirror image (p = 384: padded to 512, two
    tiles skipped)."""
    rng = np.random.default_rng(2)
    u, w = _ints(rng, (2, 384, 50)), _ints(rng, (2, 384, 50))
    full = np.einsum("bik,bjk->bij", np.asarray(u, np.float64), np.asarray(w, np.float64))
    got = jax.jit(functools.partial(symmetric_tiles_matmul, preferred_element_type=F32))(u, w)
    chex.assert_trees_all_equal(got, jnp.asarray(_upper(full), F32))


def test_the_emulation_leaves_the_kernels_skipped_tiles_nan():
    """Unmirrored (``upper_product``), the CPU result is NaN on exactly the tiles the kernel's
    tile list (`upper_tile_map`) leaves out: a result that read them would show it."""
    p = 512
    x = jnp.ones((p, 64), BF16)
    got = np.asarray(symmetric_api.upper_product(x, x, out_dtype=F32, implementation="mosaic"))
    mi, ni = mosaic_symmetric.upper_tile_map(p, 128, 256)
    written = np.zeros((p, p), bool)
    for m, n in zip(mi.tolist(), ni.tolist(), strict=True):
        written[m * 128:(m + 1) * 128, n * 256:(n + 1) * 256] = True
    assert (~written).any()
    np.testing.assert_array_equal(np.isnan(got), ~written)
    assert (got[written] == 64).all()


@pytest.mark.parametrize("implementation", ["mosaic", "xla"])
def test_symmetric_product_is_the_upper_product_mirrored(implementation):
    """The mirrored kernel's contract, emulated: ``mirror_upper(upper_product(u, w))`` to the
    bit, on a product that is not symmetric (so the mirror shows), p = 300 padded to 512."""
    rng = np.random.default_rng(3)
    u, w = _ints(rng, (2, 300, 50)), _ints(rng, (2, 300, 50))
    kw = dict(out_dtype=F32, implementation=implementation)
    got = symmetric_api.symmetric_product(u, w, **kw)
    chex.assert_trees_all_equal(got, mirror_upper(symmetric_api.upper_product(u, w, **kw)))
    full = np.einsum("bik,bjk->bij", np.asarray(u, np.float64), np.asarray(w, np.float64))
    chex.assert_trees_all_equal(got, jnp.asarray(_upper(full), F32))


def test_symmetric_tiles_matmul_refuses_what_the_kernel_cannot_take():
    x = jnp.ones((4, 3))
    with pytest.raises(ValueError, match=r"operands of one dtype in \('bfloat16', 'float16'\), "
                                         r"got float32 and float32; pass dtype=jnp.bfloat16"):
        symmetric_tiles_matmul(x, x)
    with pytest.raises(ValueError, match="got bfloat16 and float16"):
        symmetric_tiles_matmul(x.astype(BF16), x.astype(jnp.float16))
    with pytest.raises(ValueError, match=r"one shape \[..., p, r\]; got \(4, 3\) and \(3, 4\)"):
        symmetric_tiles_matmul(x.astype(BF16), x.T.astype(BF16))
    # a GPU before Hopper: no kernel, no emulation
    with platform.compiling_for_cuda(AMPERE), pytest.raises(
            ValueError, match="needs an NVIDIA Hopper GPU.*take symmetric_matmul"):
        symmetric_tiles_matmul(x, x, dtype=BF16)
    assert TILES_DTYPES == mosaic_symmetric.DTYPES


# ----------------------------------------------------------------------------------------------
# orthogonalize with symmetric_blocks='tiles'
# ----------------------------------------------------------------------------------------------


def _with_condition(shape, cond, seed):
    """A batch of U diag(s) V^T with singular values log-spaced from 1 down to 1 / cond."""
    rng = np.random.default_rng(seed)
    *batch, m, n = shape
    p = min(m, n)
    out = []
    for _ in range(int(np.prod(batch, dtype=int))):
        u, _ = np.linalg.qr(rng.standard_normal((m, p)))
        v, _ = np.linalg.qr(rng.standard_normal((n, p)))
        out.append((u * np.geomspace(1.0, 1.0 / cond, p)) @ v.T)
    return np.stack(out).reshape(shape).astype(np.float32)


def _polar_distance(o, x):
    """Relative Frobenius distance to the exact polar factor (float64 SVD)."""
    u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
    want = u @ vt
    return np.linalg.norm(np.asarray(o, np.float64) - want) / np.linalg.norm(want)


@functools.cache
def _orth(method, blocks, preconditioning="frobenius"):
    return jax.jit(functools.partial(muon_jax.orthogonalize, method=method, dtype=BF16,
                                     symmetric_blocks=blocks, preconditioning=preconditioning))


@pytest.mark.parametrize("shape,method,preconditioning", [
    ((2, 64, 64), "standard", "frobenius"),  # square
    ((2, 64, 64), "gram", "frobenius"),
    ((48, 160), "standard", "frobenius"),  # wide
    ((48, 160), "gram", "frobenius"),
    ((2, 160, 48), "standard", "frobenius"),  # tall: runs on the transpose
    ((2, 160, 48), "gram", "frobenius"),
    ((48, 160), "standard", "aol"),  # the first step's own Gram matrix
])
def test_tiles_match_plain_matmuls_and_the_polar_factor(shape, method, preconditioning):
    """Against symmetric_blocks=1: the same to bf16 rounding (about 3% relative Frobenius,
    orthogonalize's docstring) and within 1.1x of its distance to the exact polar factor."""
    x = _with_condition(shape, 10.0, seed=sum(shape))
    tiles = np.asarray(_orth(method, "tiles", preconditioning)(x))
    plain = np.asarray(_orth(method, 1, preconditioning)(x))
    assert tiles.shape == x.shape and tiles.dtype == np.float32
    assert np.isfinite(tiles).all()
    chex.assert_trees_all_close(tiles, plain, atol=5e-2)
    assert np.linalg.norm(tiles - plain) <= 5e-2 * np.linalg.norm(plain)
    d_tiles, d_plain = _polar_distance(tiles, x), _polar_distance(plain, x)
    assert d_tiles <= 1.1 * d_plain, (d_tiles, d_plain)


def test_explicit_tiles_need_16_bit_real_operands():
    x = jnp.ones((2, 8, 16))
    with pytest.raises(ValueError, match=r"symmetric_blocks='tiles' needs 16-bit real matmul "
                                         r"operands .*got dtype=float32"):
        muon_jax.orthogonalize(x, dtype=F32, symmetric_blocks="tiles")
    with pytest.raises(ValueError, match="symmetric_blocks='tiles' needs 16-bit"):
        muon_jax.orthogonalize(x.astype(jnp.complex64), symmetric_blocks="tiles")


# ----------------------------------------------------------------------------------------------
# 'auto': where the tiles (and the Gram form with them) are taken
# ----------------------------------------------------------------------------------------------


def test_auto_blocks_take_the_tiles_on_hopper_for_large_gram_sides():
    big, small = AUTO_TILES_MIN_SIDE, AUTO_TILES_MIN_SIDE // 2
    shapes = [(8, big, big), (big, 4 * big), (4 * big, big), (32, small, 4 * big), (small, small)]
    for shape in shapes:
        large = min(shape[-2:]) >= AUTO_TILES_MIN_SIDE
        got = resolve_symmetric_blocks("auto", "gpu", shape=shape, capability=HOPPER)
        assert got == ("tiles" if large else 1), shape
        # elsewhere: the row strips' rule (AUTO_SYMMETRIC_BLOCKS), never the kernel
        strips = resolve_symmetric_blocks("auto", "gpu", shape=shape)
        assert strips in (1, AUTO_SYMMETRIC_BLOCKS["gpu"])
        assert resolve_symmetric_blocks("auto", "gpu", shape=shape, capability=AMPERE) == strips
        assert resolve_symmetric_blocks("auto", "cpu", shape=shape) == 1
        assert resolve_symmetric_blocks("auto", shape=shape) == 1  # this CPU process
        with platform.compiling_for_cuda(HOPPER):  # a declared Hopper target
            assert resolve_symmetric_blocks("auto", shape=shape) == got
        with platform.compiling_for_cuda(AMPERE):
            assert resolve_symmetric_blocks("auto", shape=shape) == strips
    assert resolve_symmetric_blocks("auto", "gpu", capability=HOPPER) == "tiles"  # any shape
    assert resolve_symmetric_blocks("tiles", "cpu") == "tiles"  # explicit: as given
    with pytest.raises(ValueError, match="my_blocks must be an int >= 1, 'auto' or 'tiles'"):
        resolve_symmetric_blocks("tile", name="my_blocks")


def test_auto_method_takes_the_gram_form_for_wide_16_bit_banks_on_the_tiles():
    m = 1024
    wide = int(np.ceil(AUTO_GRAM_MIN_ASPECT * m))
    for dtype in (BF16, jnp.float16):
        assert resolve_ns_method("auto", m, wide, dtype, symmetric_blocks="tiles") == "gram"
        assert resolve_ns_method("auto", wide, m, dtype, symmetric_blocks="tiles") == "gram"
        assert resolve_ns_method("auto", m, m, dtype, symmetric_blocks="tiles") == "standard"
        assert resolve_ns_method("auto", m, wide - 1, dtype, symmetric_blocks="tiles") == \
            "standard"
    # not without the kernel, not in float32, not for per-step schedules
    for blocks in (1, AUTO_SYMMETRIC_BLOCKS["gpu"]):
        assert resolve_ns_method("auto", m, wide, BF16, symmetric_blocks=blocks) == "standard"
    assert resolve_ns_method("auto", m, wide, F32, symmetric_blocks="tiles") == "standard"
    assert resolve_ns_method("auto", m, wide, BF16, symmetric_blocks="tiles",
                             single_triple=False) == "standard"
    assert resolve_ns_method("standard", m, wide, BF16, symmetric_blocks="tiles") == "standard"
    assert resolve_ns_method("gram", m, m, BF16, symmetric_blocks="tiles") == "gram"


@pytest.mark.parametrize("p", [128, 256, 1024, 4096])
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_ns_flops_counts_the_kernels_tiles(p, method):
    """The symmetric products count the kernel's share of [128, 256] tiles
    (``upper_tile_map``): all of them up to p = 256, about half for large p."""
    q, steps = 3 * p, 5
    plain = ns_flops(p, q, steps, method=method)
    tiles = ns_flops(p, q, steps, method=method, symmetric_blocks="tiles")
    padded = -(-p // 256) * 256  # what symmetric_tiles_matmul hands the kernel
    kept = len(mosaic_symmetric.upper_tile_map(padded, 128, 256)[0])
    total = (padded // 128) * (padded // 256)
    if method == "standard":
        dense = steps * 2 * p * p * q  # B X, never symmetric
    else:
        dense = 2 * 2 * p * p * q  # Q X, once per segment (default restarts: two)
    assert tiles == dense + (plain - dense) * kept // total
    assert (tiles == plain) if p <= 256 else (tiles < plain)
    assert ns_flops(q, p, steps, method=method, symmetric_blocks="tiles") == tiles


# ----------------------------------------------------------------------------------------------
# On a Hopper target: the symmetric products lower to the kernel
# ----------------------------------------------------------------------------------------------


def _hopper_export(shape, dtype=BF16, steps=4):
    """``orthogonalize`` (``'auto'``) lowered for a declared Hopper target; 4 steps, the fewest
    with a restart and a segment of more than one step: a shorter export."""
    fn = functools.partial(muon_jax.orthogonalize, ns_steps=steps, dtype=dtype)
    with platform.compiling_for_cuda(HOPPER):
        return export_for_cuda(fn, S(shape, F32))


def _kernels(text, bits):
    return len(kernel_calls(text, f"symmetric_full_{bits}"))


@pytest.mark.jax_internals
def test_auto_on_hopper_lowers_the_symmetric_products_to_the_kernel():
    """``'auto'`` for a declared Hopper target: a bank twice as wide as tall runs the Gram form
    with float16 operands, a square one the standard form with bf16 ones; every symmetric
    product is a kernel call (the mirroring kernel) and only ``Q X`` / ``B X`` stay XLA
    matmuls. No mirror pass follows the kernel: neither form holds a transpose or a select
    (``mirror_upper``'s pass, and the Gram form's ``R Z + (R Z)^T``, now ``2 R Z`` of an
    exactly symmetric product). Below AUTO_TILES_MIN_SIDE, or in float32, no kernel."""
    side, steps = AUTO_TILES_MIN_SIDE, 4
    # Gram form, restarts (2,): two segments of 2 steps. Per segment X X^T (1), R R every
    # step (2), W Z all but the first step (1), R Z and Z (R Z) all but the last (2): 6 per
    # segment, 6 + 6 = 12 products. (At 5 steps, segments of 2 and 3: 6 + 10 = 16.)
    gram = _hopper_export((side, int(AUTO_GRAM_MIN_ASPECT * side)))
    assert (_kernels(gram, "f16"), _kernels(gram, "bf16")) == (12, 0)
    assert gram.count("stablehlo.dot_general") == 2  # Q X at each of the two segments' ends
    square = _hopper_export((side, side))  # standard form: X X^T and A (c A + b I) per step
    assert (_kernels(square, "bf16"), _kernels(square, "f16")) == (2 * steps, 0)
    assert square.count("stablehlo.dot_general") == steps  # B X
    for text in (gram, square):  # wide or square: no orientation transpose either
        assert "stablehlo.transpose" not in text and "stablehlo.select" not in text
    for shape, dtype in [((side // 2, 4 * side), BF16), ((side, side), F32)]:
        text = _hopper_export(shape, dtype)
        assert _kernels(text, "bf16") + _kernels(text, "f16") == 0, (shape, dtype)


@pytest.mark.jax_internals
def test_on_hopper_no_mirror_pass_follows_the_kernel():
    """On a Hopper target ``symmetric_tiles_matmul`` is the mirroring kernel's call alone; the
    unmirrored kernel plus ``mirror_upper``, what it was, shows the pass (a transpose and a
    select), so the check in the Newton-Schulz export test would see one."""
    x = S((2, 256, 64), BF16)
    with platform.compiling_for_cuda(HOPPER):
        old = export_for_cuda(lambda x: symmetric_api.mirror_upper(
            symmetric_api.upper_product(x, x, implementation="mosaic")), x)
        new = export_for_cuda(lambda x: symmetric_tiles_matmul(x, x), x)
    assert "stablehlo.transpose" in old and "stablehlo.select" in old
    assert "stablehlo.transpose" not in new and "stablehlo.select" not in new
    assert len(kernel_calls(new, "symmetric_full_bf16")) == 1


def test_auto_on_hopper_leaves_a_float32_gram_form_to_plain_matmuls():
    """``'auto'`` resolves to the kernel from ``dtype`` (bf16), but the Gram form's operands
    are GramOptions.dtype: float32 there is plain matmuls, not the error explicit ``'tiles'``
    gives."""
    x = S((AUTO_TILES_MIN_SIDE, int(AUTO_GRAM_MIN_ASPECT * AUTO_TILES_MIN_SIDE)), F32)
    gram = muon_jax.GramOptions(dtype=F32)
    with platform.compiling_for_cuda(HOPPER):
        for method in ("auto", "gram"):
            out = jax.eval_shape(functools.partial(muon_jax.orthogonalize, method=method,
                                                   gram=gram), x)
            assert out.shape == x.shape
        with pytest.raises(ValueError, match="symmetric_blocks='tiles' needs 16-bit"):
            jax.eval_shape(functools.partial(muon_jax.orthogonalize, method="gram", gram=gram,
                                             symmetric_blocks="tiles"), x)
