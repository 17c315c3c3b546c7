"""Gram Newton-Schulz: accuracy against the exact polar factor, the failure restarts prevent,
the symmetric products, FLOP counts, and the sharded optimizer running it."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_jax
from muon_jax.newton_schulz import (
    GramOptions,
    ns_flops,
    resolve_ns_method,
    resolve_symmetric_blocks,
)
from muon_jax.symmetric import symmetric_matmul

# Wide and tall, from just past the FLOP break-even (1.5) to 10x.
SHAPES = [(48, 80), (80, 48), (32, 112), (24, 240)]
CONDS = [1e1, 1e3, 1e6]


def _with_condition(m, n, cond, seed):
    """U diag(s) V^T with singular values log-spaced from 1 down to 1 / cond."""
    rng = np.random.default_rng(seed)
    p = min(m, n)
    u, _ = np.linalg.qr(rng.standard_normal((m, p)))
    v, _ = np.linalg.qr(rng.standard_normal((n, p)))
    return (u * np.geomspace(1.0, 1.0 / cond, p)) @ v.T


def _gradient_like(m, n, seed):
    """A low-rank signal plus noise with a power-law tail: the spectrum of a momentum matrix."""
    rng = np.random.default_rng(seed)
    p = min(m, n)
    u, _ = np.linalg.qr(rng.standard_normal((m, p)))
    v, _ = np.linalg.qr(rng.standard_normal((n, p)))
    s = np.arange(1, p + 1, dtype=np.float64) ** -1.5
    return (u * s) @ v.T + 1e-3 * rng.standard_normal((m, n))


def _polar(x):
    u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
    return u @ vt


@functools.cache
def _orth(method, restarts=(2,), ns_coeffs="jordan", ns_steps=5, gram_dtype=None,
          blocks=1, dtype=jnp.bfloat16):
    gram = GramOptions(restarts=restarts, dtype=gram_dtype)
    return jax.jit(functools.partial(muon_jax.orthogonalize, method=method, gram=gram,
                                     ns_coeffs=ns_coeffs, ns_steps=ns_steps, dtype=dtype,
                                     symmetric_blocks=blocks))


def _err(fn, x):
    o = np.asarray(fn(jnp.asarray(x, jnp.float32)), np.float64)
    want = _polar(x)
    return np.linalg.norm(o - want) / np.linalg.norm(want)


def _inputs():
    for m, n in SHAPES:
        for cond in CONDS:
            yield f"{m}x{n}-cond{cond:g}", _with_condition(m, n, cond, seed=m + n)
        yield f"{m}x{n}-gradient", _gradient_like(m, n, seed=m * n)


@pytest.mark.parametrize("blocks", [1, 3])
def test_gram_is_as_close_to_the_polar_factor_as_standard(blocks):
    """Within 1.1x of standard Newton-Schulz's distance to the exact (float64 SVD) polar factor,
    both with bf16 operands: the distance is mostly Jordan's band, the same for both forms."""
    for name, x in _inputs():
        std = _err(_orth("standard"), x)
        gram = _err(_orth("gram", blocks=blocks), x)
        assert gram <= 1.1 * std, (name, gram, std)


def test_gram_equals_standard_in_float32():
    x = np.stack([_with_condition(24, 64, 1e2, seed=s) for s in range(3)])
    std = _orth("standard", dtype=jnp.float32)(jnp.asarray(x, jnp.float32))
    # The segment's product Q = alpha I + W is ~ 12x larger than the result it gives after
    # two steps, so float32 rounding shows about that much more than in the standard form;
    # restarting after every step is the standard form.
    for restarts, atol in [((2,), 5e-5), ((1, 2, 3, 4), 2e-6)]:
        got = _orth("gram", restarts=restarts, dtype=jnp.float32)(jnp.asarray(x, jnp.float32))
        chex.assert_trees_all_close(got, std, atol=atol)


def test_without_restarts_or_in_bf16_the_gram_form_goes_wrong():
    """The failures the defaults prevent: naive Gram (no restart) loses the small singular
    directions (R squares the condition number), and bf16 operands for the accumulated
    polynomial put its large-range rounding on the large ones."""
    x = _with_condition(48, 160, 1e3, seed=0)
    std = _err(_orth("standard"), x)
    assert _err(_orth("gram"), x) <= 1.1 * std
    assert _err(_orth("gram", restarts=()), x) > 2 * std
    assert _err(_orth("gram", gram_dtype=jnp.bfloat16), x) > 1.5 * std


def test_polar_express_is_why_auto_keeps_per_step_schedules_standard():
    x = _with_condition(48, 160, 1e3, seed=1)
    std = _err(_orth("standard", ns_coeffs="polar_express", ns_steps=8), x)
    gram = _err(_orth("gram", restarts=(2, 4, 6), ns_coeffs="polar_express", ns_steps=8), x)
    assert gram > 1.1 * std
    assert resolve_ns_method("auto", 64, 256, jnp.bfloat16, single_triple=False) == "standard"


def test_auto_rule():
    assert resolve_ns_method("gram", 8, 8, jnp.float32) == "gram"
    assert resolve_ns_method("standard", 8, 64, jnp.bfloat16) == "standard"
    # auto takes the Gram form only with the symmetric-tile kernel, where it measured faster
    assert resolve_ns_method("auto", 8, 64, jnp.bfloat16) == "standard"
    assert resolve_ns_method("auto", 8, 64, jnp.bfloat16, symmetric_blocks="tiles") == "gram"
    with pytest.raises(ValueError, match="ns_method='fast' is not supported"):
        resolve_ns_method("fast", 8, 8, jnp.float32)
    with pytest.raises(ValueError, match="restarts must be step numbers"):
        GramOptions(restarts=(0,))
    with pytest.raises(ValueError, match="symmetric_blocks must be an int >= 1, 'auto' or 'tiles'"):
        muon_jax.orthogonalize(jnp.ones((2, 4)), symmetric_blocks=0)
    with pytest.raises(ValueError, match="symmetric_blocks must be an int"):
        muon_jax.NewtonSchulzOptions(symmetric_blocks="all")
    assert resolve_symmetric_blocks("auto", "cpu") == 1
    assert resolve_symmetric_blocks("auto", "gpu") == 4
    # on a GPU the strips only for banks of large matrices (AUTO_SYMMETRIC_MIN_WORK)
    for shape, want in (((8, 4096, 4096), 4), ((32, 11264, 4096), 4), ((32, 2048, 5632), 4),
                        ((4096, 4096), 1), ((32, 2048, 2048), 1), ((512, 1024, 1024), 1)):
        assert resolve_symmetric_blocks("auto", "gpu", shape=shape) == want, shape
        assert resolve_symmetric_blocks("auto", "cpu", shape=shape) == 1
    with pytest.raises(TypeError, match="gram must be a muon_jax.newton_schulz.GramOptions"):
        muon_jax.orthogonalize(jnp.ones((2, 4)), gram=(2,))
    with pytest.raises(ValueError, match="method='x'"):
        muon_jax.NewtonSchulzOptions(method="x")


@pytest.mark.parametrize("blocks", [2, 3, 5])
def test_symmetric_matmul_equals_matmul(blocks):
    rng = np.random.default_rng(blocks)
    x = jnp.asarray(rng.standard_normal((2, 11, 7)), jnp.float32)  # 11 rows: uneven strips
    a = jnp.asarray(rng.standard_normal((6, 6)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((5, 3)) + 1j * rng.standard_normal((5, 3)), jnp.complex64)

    @jax.jit  # the three products and their references in one program (eager: one per op)
    def products(x, a, c):
        a = a @ a.T
        return ((symmetric_matmul(x, x.mT, blocks=blocks), x @ x.mT),
                (symmetric_matmul(a, a @ a, blocks=blocks), a @ a @ a),
                (symmetric_matmul(c, c.conj().T, blocks=blocks), c @ c.conj().T))

    (got, want), (got_a, want_a), (got_c, want_c) = products(x, a, c)
    chex.assert_trees_all_close(got, want, atol=1e-5)
    got = np.asarray(got)
    np.testing.assert_array_equal(got, np.swapaxes(got, -1, -2))  # exactly symmetric
    chex.assert_trees_all_close(got_a, want_a, rtol=1e-5, atol=1e-4)
    chex.assert_trees_all_close(got_c, want_c, atol=1e-5)
    with pytest.raises(ValueError, match="blocks must be an int >= 1"):
        symmetric_matmul(x, x.mT, blocks=0)


@pytest.mark.parametrize("blocks", [1, 4])
def test_ns_flops_gram_matches_compiled_cost(blocks):
    m, n, steps = 32, 96, 5
    flops = ns_flops(n, m, steps, method="gram", symmetric_blocks=blocks)
    k, p, q = 2, m, n  # default restarts (2,): two segments
    dense = 4 * k * p * p * q + (8 * steps - 6 * k) * p**3
    assert (flops == dense) if blocks == 1 else (flops < dense)
    assert ns_flops(m, n, steps, method="gram") < ns_flops(m, n, steps)  # n > 1.5 m
    assert ns_flops(m, m, steps, method="gram") > ns_flops(m, m, steps)  # square: standard
    def compiled_flops(blocks):
        fn = _orth("gram", blocks=blocks, dtype=jnp.float32)
        cost = fn.lower(jnp.zeros((n, m))).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list | tuple) else cost)["flops"]

    if blocks == 1:
        assert flops <= compiled_flops(1) <= 1.1 * flops, (flops, compiled_flops(1))
    else:  # the skipped tiles are really skipped (the mirroring adds elementwise work)
        assert flops <= compiled_flops(blocks) < compiled_flops(1) * (blocks + 3) / (2 * blocks)


def test_sharded_muon_runs_gram_on_each_owner():
    """Owner compute with the Gram form: the same updates as unsharded Muon with it."""
    mesh = jax.make_mesh((8,), ("d",))
    rng = np.random.default_rng(0)
    shapes = {"a": (3, 16, 48), "b": (40, 16), "c": (5, 24, 24)}  # tall, wide stack, square
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
             for _ in range(2)]
    kw = dict(newton_schulz=muon_jax.NewtonSchulzOptions(dtype=jnp.float32, method="gram"),
              mu_dtype=jnp.float32, dimension_numbers=muon_jax.MuonDimensionNumbers(-2, -1))
    ref_tx = muon_jax.scale_by_muon(**kw)
    tx = muon_jax.scale_by_muon(**kw, sharding=muon_jax.ShardingOptions(mesh))
    ref_state, state = ref_tx.init(params), jax.jit(tx.init)(  # Explicit: one init program
        {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in params.items()})
    ref_update, update = jax.jit(ref_tx.update), jax.jit(tx.update)
    for g in grads:
        want, ref_state = ref_update(g, ref_state)
        got, state = update({k: jax.device_put(v, NamedSharding(mesh, P()))
                             for k, v in g.items()}, state)
        # atol: the Gram form's float32 rounding (test_gram_equals_standard_in_float32), which
        # differently batched matmuls on the owners round differently.
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-4)
    f32 = muon_jax.NewtonSchulzOptions(dtype=jnp.float32)
    std, _ = jax.jit(muon_jax.scale_by_muon(newton_schulz=f32).update)(
        grads[0], ref_tx.init(params))
    chex.assert_trees_all_close(std, jax.jit(ref_tx.update)(grads[0], ref_tx.init(params))[0],
                                atol=1e-4)  # and Gram equals standard in float32


@pytest.mark.parametrize("blocks", [1, 4])
def test_ns_flops_standard_matches_compiled_cost(blocks):
    m, n, steps = 32, 96, 5
    flops = ns_flops(m, n, steps, symmetric_blocks=blocks)
    dense = steps * (4 * m * m * n + 2 * m**3)
    assert (flops == dense) if blocks == 1 else (flops < dense)

    def compiled_flops(blocks):
        fn = _orth("standard", blocks=blocks, dtype=jnp.float32)
        cost = fn.lower(jnp.zeros((m, n))).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list | tuple) else cost)["flops"]

    if blocks == 1:
        assert flops <= compiled_flops(1) <= 1.1 * flops, (flops, compiled_flops(1))
    else:
        assert flops <= compiled_flops(blocks) < compiled_flops(1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_standard_symmetric_blocks_keep_the_result(dtype):
    """Row strips change which tiles are computed, not the math: f32 equals the plain form to
    rounding; with bf16 operands both are as far from the exact polar factor (within 1.1x)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 40, 112)).astype(np.float32)  # 40 rows: uneven strips of 4
    plain, strips = _orth("standard", blocks=1, dtype=dtype), _orth("standard", blocks=4,
                                                                     dtype=dtype)
    if dtype == jnp.float32:
        chex.assert_trees_all_close(strips(x), plain(x), rtol=1e-5, atol=1e-5)
        tall = np.swapaxes(x, -1, -2)  # m > n runs on the transpose
        chex.assert_trees_all_close(strips(tall), plain(tall), rtol=1e-5, atol=1e-5)
    else:
        assert _err(strips, x) <= 1.1 * _err(plain, x), (_err(strips, x), _err(plain, x))
