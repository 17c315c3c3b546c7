"""Pallas grouped GEMMs (accel_kernels.gmm.triton) and
gated_experts(gemm_implementation='triton'), in interpret mode.

On CPU the kernels run through Pallas interpret mode (the same kernel code, executed as XLA
ops). That they also lower to Triton for a GPU is checked by exporting for 'cuda' here, without
a GPU; compiling and timing them needs one (benchmarks/gmm.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cuda_export import (
    TRITON_CALL,
    TRITON_DEPRECATED,
    cuda_mesh,
    export_for_cuda,
    loops_outside_scans,
)
from _meshes import make_mesh
from jax.sharding import PartitionSpec as P

from accel_kernels import vma
from accel_kernels.gmm import triton as gp
from moe import experts as experts_mod
from moe.experts import gated_experts

M, K, N, G = 96, 64, 48, 4
GS = np.array([30, 0, 41, 13], np.int32)  # an empty group, boundaries inside tiles, 12 pad rows
TILES = gp.Tiling(block_m=16, block_n=16, block_k=16, group_m=2)

# These tests lower the Triton kernels on purpose: GPUs before Hopper run them.
pytestmark = pytest.mark.filterwarnings(TRITON_DEPRECATED)


def _data(dtype, seed=0, m=M, k=K, n=N, g=G):
    r = np.random.default_rng(seed)
    lhs = r.standard_normal((m, k)).astype(np.float32)
    rhs = r.standard_normal((g, k, n)).astype(np.float32)
    dy = r.standard_normal((m, n)).astype(np.float32)
    return tuple(jnp.asarray(a, dtype) for a in (lhs, rhs, dy))


def _offsets(gs):
    return np.concatenate([[0], np.cumsum(gs)])


def _ref_gmm(lhs, rhs, gs):
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    off = _offsets(gs)
    for g in range(len(gs)):
        out[off[g] : off[g + 1]] = lhs[off[g] : off[g + 1]] @ rhs[g]
    return out


def _ref_tgmm(lhs, dy, gs):
    lhs, dy = np.asarray(lhs, np.float64), np.asarray(dy, np.float64)
    off = _offsets(gs)
    return np.stack([lhs[off[g] : off[g + 1]].T @ dy[off[g] : off[g + 1]] for g in range(len(gs))])


def _close(got, want, rtol):
    """Max error relative to the largest reference entry (entry-wise for f32, norm-wise bf16)."""
    got = np.asarray(got, np.float64)
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    assert err <= rtol, f"max rel err {err:.3g} > {rtol}"


@functools.cache
def _kernels_fn():
    """gmm, gmm(transpose_rhs) and tgmm at TILES in one jitted program (eagerly, every op
    around the interpreted kernels would compile its own program); one compile per dtype."""

    def run(lhs, rhs, dy, gs):
        return (gp.gmm(lhs, rhs, gs, tiling=TILES),
                gp.gmm(dy, rhs, gs, transpose_rhs=True, tiling=TILES),
                gp.tgmm(lhs, dy, gs, out_dtype=jnp.float32, tiling=TILES))

    return jax.jit(run)


@functools.cache
def _kernel_outputs(dtype):
    lhs, rhs, dy = _data(dtype)
    return (lhs, rhs, dy), _kernels_fn()(lhs, rhs, dy, jnp.asarray(GS))


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_gmm_matches_reference(dtype, rtol):
    (lhs, rhs, _), (out, _, _) = _kernel_outputs(dtype)
    assert out.shape == (M, N) and out.dtype == dtype
    want = _ref_gmm(lhs, rhs, GS)
    _close(out, want, rtol)
    assert np.all(np.asarray(out)[GS.sum() :] == 0)  # padding rows are exactly zero


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_gmm_transposed_rhs_matches_reference(dtype, rtol):
    (_, rhs, dy), (_, out, _) = _kernel_outputs(dtype)  # dy [M, N] @ rhs[g]^T -> [M, K]
    assert out.shape == (M, K)
    _close(out, _ref_gmm(dy, np.swapaxes(np.asarray(rhs, np.float32), 1, 2), GS), rtol)
    assert np.all(np.asarray(out)[GS.sum() :] == 0)


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_tgmm_matches_reference(dtype, rtol):
    (lhs, _, dy), (_, _, out) = _kernel_outputs(dtype)
    assert out.shape == (G, K, N) and out.dtype == jnp.float32
    _close(out, _ref_tgmm(lhs, dy, GS), rtol)
    assert np.all(np.asarray(out)[1] == 0)  # the empty group


def test_tgmm_ignores_padding_rows():
    lhs, rhs, dy = _data(jnp.float32)
    tail = slice(int(GS.sum()), None)
    noisy_lhs = np.asarray(lhs).copy()
    noisy_lhs[tail] = 1e30
    noisy_dy = np.asarray(dy).copy()
    noisy_dy[tail] = np.nan
    *_, out = _kernels_fn()(jnp.asarray(noisy_lhs), rhs, jnp.asarray(noisy_dy), jnp.asarray(GS))
    _close(out, _ref_tgmm(lhs, dy, GS), 1e-5)


def test_unaligned_shapes_and_default_tiles():
    """Dims that are not tile multiples are zero-padded; default (128-row) tiles."""
    m, k, n = 90, 40, 24
    gs = np.array([7, 50, 0, 33], np.int32)  # sums to m: no padding rows
    lhs, rhs, dy = _data(jnp.float32, seed=1, m=m, k=k, n=n)

    @jax.jit  # the five calls in one program (eagerly every op compiles its own)
    def run(lhs, rhs, dy, gs):
        return (gp.gmm(lhs, rhs, gs, tiling=TILES), gp.gmm(lhs, rhs, gs),
                gp.gmm(dy, rhs, gs, transpose_rhs=True, tiling=TILES),  # [m, k]
                gp.tgmm(lhs, dy, gs, tiling=TILES), gp.tgmm(lhs, dy, gs))

    fwd, fwd_default, got_t, wgrad, wgrad_default = run(lhs, rhs, dy, jnp.asarray(gs))
    _close(fwd, _ref_gmm(lhs, rhs, gs), 1e-5)
    _close(fwd_default, _ref_gmm(lhs, rhs, gs), 1e-5)
    _close(got_t, _ref_gmm(dy, np.swapaxes(np.asarray(rhs), 1, 2), gs), 1e-5)
    _close(wgrad, _ref_tgmm(lhs, dy, gs), 1e-5)
    _close(wgrad_default, _ref_tgmm(lhs, dy, gs), 1e-5)


def test_jit_and_traced_group_sizes():
    """One jitted program (the one above) for every group-size vector: the sizes are traced."""
    lhs, rhs, dy = _data(jnp.float32)
    f = _kernels_fn()
    for gs in (GS, np.array([0, 0, 96, 0], np.int32), np.zeros(4, np.int32)):
        out, _, _ = f(lhs, rhs, dy, jnp.asarray(gs))
        np.testing.assert_allclose(out, _ref_gmm(lhs, rhs, gs), 1e-5, 1e-4)


_work_tiles = jax.jit(gp.work_tiles, static_argnums=(1, 2))  # one program for every seed


@pytest.mark.parametrize("seed", range(6))
def test_work_tiles_cover_every_row_once(seed):
    r = np.random.default_rng(seed)
    m, bm, g = 160, 16, 5
    gs = r.multinomial(int(r.integers(0, m + 1)), np.ones(g) / g).astype(np.int32)
    gs[r.integers(0, g)] = 0
    grp, tile, lo, hi = (np.asarray(a) for a in _work_tiles(jnp.asarray(gs), m, bm))
    assert grp.shape == (m // bm + g,)
    owner = np.full(m, -1)
    off = _offsets(gs)
    for gi, t, a, b in zip(grp, tile, lo, hi, strict=True):
        assert t * bm <= a <= b <= (t + 1) * bm
        assert np.all(owner[a:b] == -1)  # no row written twice
        owner[a:b] = gi
    want = np.full(m, g)  # padding rows: the zero pseudo-group
    for gi in range(g):
        want[off[gi] : off[gi + 1]] = gi
    np.testing.assert_array_equal(owner, want)


def test_bad_arguments_raise():
    lhs, rhs, dy = _data(jnp.float32)
    with pytest.raises(ValueError, match="block_m"):
        gp.Tiling(block_m=48)
    with pytest.raises(ValueError, match="num_warps"):
        gp.Tiling(num_warps=0)
    with pytest.raises(ValueError, match="shapes disagree"):
        gp.gmm(lhs, rhs, jnp.asarray(GS), transpose_rhs=True)
    with pytest.raises(ValueError, match="tgmm takes"):
        gp.tgmm(lhs, dy[:10], jnp.asarray(GS))


def test_refuses_tpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    lhs, rhs, _ = _data(jnp.float32)
    with pytest.raises(ValueError, match="implementation='xla'"):
        # traced, not run: the ops before the refusal would each compile eagerly
        jax.jit(gp.gmm)(lhs, rhs, jnp.asarray(GS))
    x = jnp.ones((8, 64))
    w_gu, w_d = jnp.ones((2, 64, 64)), jnp.ones((2, 32, 64))
    with pytest.raises(ValueError, match="gemm_implementation='triton' needs an NVIDIA GPU"):
        gated_experts(x, jnp.array([4, 4]), w_gu, w_d, gemm_implementation="triton")


# ----------------------------------------------------------------------------------------------
# gated_experts(gemm_implementation='triton') against gemm_implementation='xla' (ragged_dot)
# ----------------------------------------------------------------------------------------------

R, D, F, E = 96, 64, 32, 4


def _expert_inputs(dtype):
    r = np.random.default_rng(3)
    x = r.standard_normal((R, D))
    w_gu = r.standard_normal((E, D, 2 * F)) / np.sqrt(D)
    w_d = r.standard_normal((E, F, D)) / np.sqrt(F)
    ct = r.standard_normal((R, D))
    return tuple(jnp.asarray(a, dtype) for a in (x, w_gu, w_d, ct))


@functools.cache
def _experts_fn(backend, **opts):
    def loss(x, w_gu, w_d, ct):
        y = gated_experts(x, jnp.asarray(GS), w_gu, w_d, gemm_implementation=backend, **opts)
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _compare(dtype, rtol, **opts):
    args = _expert_inputs(dtype)
    (_, y), grads = _experts_fn("triton", **opts)(*args)
    (_, y_ref), grads_ref = _experts_fn("xla", **opts)(*args)
    for name, got, want in zip(
        ("y", "dx", "dw_gate_up", "dw_down"), (y, *grads), (y_ref, *grads_ref), strict=True
    ):
        assert got.dtype == want.dtype, name
        want = np.asarray(want, np.float64)
        err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
        assert err <= rtol, f"{name}: max rel err {err:.3g} > {rtol}"
    assert np.all(np.asarray(y)[GS.sum() :] == 0)
    assert np.all(np.asarray(grads[0])[GS.sum() :] == 0)
    assert np.all(np.asarray(grads[1])[1] == 0) and np.all(np.asarray(grads[2])[1] == 0)


def test_gated_experts_pallas_f32_matches_ragged_dot():
    _compare(jnp.float32, 1e-5)


def test_gated_experts_pallas_bf16_matches_ragged_dot():
    _compare(jnp.bfloat16, 2e-2)


def test_gated_experts_pallas_fp8_and_recompute_match_ragged_dot():
    # FP8 is emulated before the kernel (quantize-dequantize), identically for both backends.
    _compare(
        jnp.bfloat16,
        2e-2,
        gemm_dtype="fp8",
        save_z="recompute",
        wgrad_dtype="fp8",
        block_size=8,
    )


def test_gated_experts_pallas_needs_ragged_x():
    x = jnp.ones((E, 8, D))
    w_gu, w_d = jnp.ones((E, D, 2 * F)), jnp.ones((E, F, D))
    with pytest.raises(ValueError, match="gemm_implementation='triton' takes x as"):
        gated_experts(x, None, w_gu, w_d, gemm_implementation="triton")
    assert experts_mod.auto_implementation(2) == "xla"  # CPU: auto is unchanged


# ----------------------------------------------------------------------------------------------
# Inside jax.shard_map (check_vma=True): the pallas_call declares its outputs' varying mesh axes
# (the union of its operands'), and interpret mode runs unchecked (accel_kernels.vma.varying_axes).
# Every device owns its own groups; tiny shapes (interpret mode is slow).
# ----------------------------------------------------------------------------------------------

N_DEV, SM, SG = 8, 32, 3  # devices, rows and groups per device


def _sharded(mesh, spec, *arrays):
    return tuple(jax.device_put(a, jax.NamedSharding(mesh, spec)) for a in arrays)


def _shard_data(seed=5):
    """Per-device blocks stacked along axis 0: lhs [8*SM, K], rhs [8*SG, K, N], dy, gs."""
    r = np.random.default_rng(seed)
    lhs, rhs, dy = _data(jnp.float32, seed=seed, m=N_DEV * SM, k=32, n=16, g=N_DEV * SG)
    gs = np.stack(
        [r.multinomial(r.integers(SM // 2, SM + 1), np.ones(SG) / SG) for _ in range(N_DEV)]
    ).astype(np.int32)
    gs[::3, 1] = 0  # empty groups; most shards also have padding rows
    return lhs, rhs, dy, gs.reshape(-1)


def _per_shard(ref, *arrays, gs):
    """``ref`` applied to every device's block (rows of SM, groups of SG), concatenated."""
    outs = []
    for i in range(N_DEV):
        blocks = [np.asarray(a)[i * len(a) // N_DEV : (i + 1) * len(a) // N_DEV] for a in arrays]
        outs.append(ref(*blocks, gs[i * SG : (i + 1) * SG]))
    return np.concatenate(outs)


def test_gmm_and_tgmm_inside_shard_map():
    mesh = make_mesh((N_DEV,))
    lhs, rhs, dy, gs = _shard_data()
    e = P("expert")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=e, out_specs=e)  # check_vma=True
    def local(lhs, rhs, dy, gs):
        return (
            gp.gmm(lhs, rhs, gs, tiling=TILES),
            gp.gmm(dy, rhs, gs, transpose_rhs=True, tiling=TILES),
            gp.tgmm(lhs, dy, gs, tiling=TILES),
        )

    out, out_t, out_w = local(*_sharded(mesh, e, lhs, rhs, dy, jnp.asarray(gs)))
    _close(out, _per_shard(_ref_gmm, lhs, rhs, gs=gs), 1e-5)
    rhs_t = np.swapaxes(np.asarray(rhs), 1, 2)
    _close(out_t, _per_shard(_ref_gmm, dy, rhs_t, gs=gs), 1e-5)
    _close(out_w, _per_shard(_ref_tgmm, lhs, dy, gs=gs), 1e-5)
    # Padding rows of every shard are exactly zero.
    rows = np.asarray(out).reshape(N_DEV, SM, -1)
    for i, n in enumerate(gs.reshape(N_DEV, SG).sum(1)):
        assert np.all(rows[i, n:] == 0)


def test_gmm_inside_shard_map_with_replicated_operands():
    """Operands of different varying axes (rows sharded, weights and sizes replicated), on a
    2-D mesh; the results must be typed varying over the rows' axes."""
    mesh = make_mesh((2, 4))
    lhs, rhs, dy, gs = _shard_data(seed=6)
    rhs, gs = rhs[:SG], gs[:SG]
    rows = P(("data", "expert"))

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(rows, P(), P(), rows),
        out_specs=(rows, P(("data", "expert"), None, None)),
    )
    def local(lhs, rhs, gs, dy):
        out = gp.gmm(lhs, rhs, gs, tiling=TILES)
        assert vma.varying_axes(out) == {"data", "expert"}
        return out, gp.tgmm(lhs, dy, gs, tiling=TILES)

    out, out_w = local(
        *_sharded(mesh, rows, lhs), jnp.asarray(rhs), jnp.asarray(gs), *_sharded(mesh, rows, dy)
    )
    _close(out, _per_shard(_ref_gmm, lhs, np.tile(rhs, (N_DEV, 1, 1)), gs=np.tile(gs, N_DEV)), 1e-5)
    _close(out_w, _per_shard(_ref_tgmm, lhs, dy, gs=np.tile(gs, N_DEV)), 1e-5)


@functools.cache
def _sharded_experts_fn(backend):
    """jit(value_and_grad) of gated_experts on a ('data', 'expert') mesh, as the MoE layer
    runs it: tokens (and their group sizes) split over both axes, experts over 'expert' and
    pcast to varying over 'data' (so their gradients are summed over 'data')."""
    mesh = make_mesh((2, 4))
    rows, experts = P(("data", "expert")), P("expert")

    def local(x, gs, w_gu, w_d, ct):
        def loss(x, w_gu, w_d):
            w_gu, w_d = (jax.lax.pcast(w, ("data",), to="varying") for w in (w_gu, w_d))
            y = gated_experts(x, gs, w_gu, w_d, gemm_implementation=backend)
            part = jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))
            return jax.lax.psum(part, ("data", "expert")), y

        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w_gu, w_d)

    fn = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(rows, rows, experts, experts, rows),
            out_specs=((P(), rows), (rows, experts, experts)),
        )
    )

    def call(x, gs, w_gu, w_d, ct):
        x, gs, ct = _sharded(mesh, rows, x, gs, ct)
        return fn(x, gs, *_sharded(mesh, experts, w_gu, w_d), ct)

    return call


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_gated_experts_pallas_inside_shard_map_matches_ragged_dot(dtype, rtol):
    """Forward and backward (gmm, gmm_t dgrad, tgmm wgrad) under shard_map, against ragged_dot
    under the same shard_map. Device (i, j) holds SM rows for the 2 local experts of column j
    (padding rows included), which it shares with device (1 - i, j)."""
    r = np.random.default_rng(8)
    e_local, d, f = 2, 32, 16
    gs = np.stack(
        [
            r.multinomial(r.integers(SM // 2, SM + 1), np.ones(e_local) / e_local)
            for _ in range(N_DEV)
        ]
    ).astype(np.int32)
    gs[::3, 0] = 0  # an empty expert on some devices
    x, w_gu, w_d, ct = (
        jnp.asarray(a, dtype)
        for a in (
            r.standard_normal((N_DEV * SM, d)),
            r.standard_normal((4 * e_local, d, 2 * f)) / np.sqrt(d),
            r.standard_normal((4 * e_local, f, d)) / np.sqrt(f),
            r.standard_normal((N_DEV * SM, d)),
        )
    )
    args = (x, jnp.asarray(gs.reshape(-1)), w_gu, w_d, ct)
    (loss, y), grads = _sharded_experts_fn("triton")(*args)
    (loss_ref, y_ref), grads_ref = _sharded_experts_fn("xla")(*args)
    for name, got, want in zip(
        ("y", "dx", "dw_gate_up", "dw_down"), (y, *grads), (y_ref, *grads_ref), strict=True
    ):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.sharding.spec == want.sharding.spec, name
        _close(got, np.asarray(want, np.float64), rtol)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=10 * rtol)
    y = np.asarray(y, np.float32).reshape(N_DEV, SM, d)
    for i, n in enumerate(gs.sum(1)):
        assert np.all(y[i, n:] == 0)  # every device's padding rows


# ----------------------------------------------------------------------------------------------
# The kernels lower to Triton for CUDA (checked on a CPU-only machine via jax.export).
# ----------------------------------------------------------------------------------------------


def test_gated_experts_pallas_lowers_to_triton_for_cuda():
    x, w_gu, w_d, ct = (
        jnp.zeros((512, 256), jnp.bfloat16),
        jnp.zeros((E, 256, 256), jnp.bfloat16),
        jnp.zeros((E, 128, 256), jnp.bfloat16),
        jnp.zeros((512, 256), jnp.bfloat16),
    )
    gs = jnp.array([200, 0, 150, 100], jnp.int32)

    def step(x, w_gu, w_d, ct, gs):
        def loss(x, w_gu, w_d):
            y = gated_experts(x, gs, w_gu, w_d, gemm_implementation="triton")
            return jnp.sum(y.astype(jnp.float32) * ct)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w_gu, w_d)

    text = export_for_cuda(step, x, w_gu, w_d, ct, gs)
    # fwd 2 gmm, dgrad 2 gmm_t, wgrad 2 tgmm; no interpreter loop left in the GPU module.
    assert text.count(TRITON_CALL) == 6
    assert loops_outside_scans(text) == 0


def test_gated_experts_pallas_lowers_to_triton_inside_shard_map():
    """The compiled path under shard_map(check_vma=True): the out_shape's varying axes are all
    the Triton kernels need (no interpreter, no unchecked nested shard_map)."""
    mesh = cuda_mesh((N_DEV,), ("expert",))
    e = P("expert")

    def step(x, w_gu, w_d, ct, gs):
        def loss(x, w_gu, w_d):
            y = gated_experts(x, gs, w_gu, w_d, gemm_implementation="triton")
            return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * ct), "expert")

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w_gu, w_d)

    fn = jax.shard_map(step, mesh=mesh, in_specs=e, out_specs=(P(), (e, e, e)))
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(
        shape, dtype, sharding=jax.NamedSharding(mesh, e)
    )
    args = (
        sds((N_DEV * 512, 256), jnp.bfloat16),
        sds((N_DEV * E, 256, 256), jnp.bfloat16),
        sds((N_DEV * E, 128, 256), jnp.bfloat16),
        sds((N_DEV * 512, 256), jnp.float32),
        sds((N_DEV * E,), jnp.int32),
    )
    text = export_for_cuda(fn, *args)
    assert text.count(TRITON_CALL) == 6
    assert loops_outside_scans(text) == 0
