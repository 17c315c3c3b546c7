"""moe.experts.gated_experts against a per-expert loop of plain einsums (autodiff'd).

Both layouts (ragged [R, d] with ragged_dot and with 'mosaic', whose Hopper kernels run as
their XLA emulation on CPU behind the same aligned-layout plumbing; padded [E, C, d] with
einsum) carry uneven groups, an empty group and padding rows filled with garbage, which must
give y = 0 and no gradient. Compiled functions are cached per option set so each compiles once.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from accel_kernels import fp8
from accel_kernels.gmm import api as gmm_api
from moe.experts import gated_experts

# d_model, d_ff: multiples of 128 (save_z='fp8' blocks) and of the FP8 GEMM's 256-column
# tile; no larger, as the size is not the point and the emulated GEMMs run on the CPU
E, D, F = 4, 256, 256
GROUPS = (50, 0, 97, 60)  # uneven, one empty expert
R = 256  # ragged rows; rows past sum(GROUPS) = 207 are padding
C = 112  # padded capacity >= max(GROUPS)
# Cases by the GEMMs they run: 'xla' on ragged rows (ragged_dot) and on padded slots (einsum).
BACKENDS = ("ragged_dot", "mosaic", "einsum")
RAGGED = ("ragged_dot", "mosaic")
IMPLEMENTATION = {"ragged_dot": "xla", "einsum": "xla"}
HI = jax.lax.Precision.HIGHEST
# padded x [E, C, d] on the 'mosaic' kernels (slots as rows, C rounded up to 128 rows)
PADDED_MOSAIC = {"padded_mosaic": "mosaic"}


def _data():
    rng = np.random.default_rng(0)
    real = rng.standard_normal((sum(GROUPS), D)).astype(np.float32)
    x_rag = rng.standard_normal((R, D)).astype(np.float32) * 50.0  # garbage padding
    x_rag[: sum(GROUPS)] = real
    x_pad = rng.standard_normal((E, C, D)).astype(np.float32) * 50.0
    start = 0
    for e, n in enumerate(GROUPS):
        x_pad[e, :n] = real[start : start + n]
        start += n
    w_gu = rng.standard_normal((E, D, 2 * F)).astype(np.float32) / np.sqrt(D)
    w_d = rng.standard_normal((E, F, D)).astype(np.float32) / np.sqrt(F)
    return {
        "ragged_dot": (x_rag, rng.standard_normal((R, D)).astype(np.float32)),
        "einsum": (x_pad, rng.standard_normal((E, C, D)).astype(np.float32)),
        "w": (w_gu, w_d),
    }


DATA = _data()
GS = np.asarray(GROUPS, np.int32)


def _inputs(backend, dtype):
    x, ct = DATA["ragged_dot" if backend in RAGGED else "einsum"]
    w_gu, w_d = DATA["w"]
    return tuple(jnp.asarray(a, dtype) for a in (x, w_gu, w_d, ct))


def _rows(backend):
    """(expert, index expression) of the real rows of each group in the given layout."""
    out, start = [], 0
    for e, n in enumerate(GROUPS):
        out.append((e, np.s_[start : start + n] if backend in RAGGED else np.s_[e, :n]))
        start += n
    return out


def _reference(backend, x, w_gu, w_d, *, quant=None):
    """Per-expert dense einsums in f32 on the real rows; zeros on padding rows.

    quant(a, axis) optionally rounds a GEMM operand to FP8 as the FP8 forward does: one
    power-of-two scale per row of x and h, per output column (along the contraction axis) of
    the weights.
    """
    q = quant or (lambda a, axis: a)
    x, w_gu, w_d = (a.astype(jnp.float32) for a in (x, w_gu, w_d))
    y = jnp.zeros_like(x)
    for e, idx in _rows(backend):
        xe = q(x[idx], -1)
        z = jnp.einsum("td,df->tf", xe, q(w_gu[e], 0), precision=HI)
        h = q(jax.nn.silu(z[:, :F]) * z[:, F:], -1)
        y = y.at[idx].set(jnp.einsum("tf,fd->td", h, q(w_d[e], 0), precision=HI))
    return y


def _y_and_grads(fn):
    def run(x, w_gu, w_d, ct):
        y, vjp = jax.vjp(fn, x, w_gu, w_d)
        return y, vjp(ct.astype(y.dtype))

    return jax.jit(run)


@functools.cache
def _experts_run(backend, **opts):
    backend = PADDED_MOSAIC.get(backend, backend)
    backend = IMPLEMENTATION.get(backend, backend)
    fn = lambda x, w_gu, w_d: gated_experts(  # noqa: E731
        x, jnp.asarray(GS), w_gu, w_d, gemm_implementation=backend, **opts)
    return _y_and_grads(fn)


def _reference_run(backend):
    """The reference depends on the layout only: the ragged backends share one program, the
    padded ones another."""
    return _layout_reference_run("ragged_dot" if backend in RAGGED else "einsum")


@functools.cache
def _layout_reference_run(backend):
    return _y_and_grads(functools.partial(_reference, backend))


def _f32(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)


def _cos_and_rel_rms(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    return cos, np.linalg.norm(a - b) / np.linalg.norm(b)


def _assert_close(got, want, rtol, atol_of="rms"):
    """Elementwise rtol, with atol = rtol * RMS(want) (or * max|want|) for entries near zero."""
    for g, w in zip(jax.tree.leaves(_f32(got)), jax.tree.leaves(_f32(want)), strict=True):
        scale = np.sqrt(np.mean(np.square(w))) if atol_of == "rms" else np.max(np.abs(w))
        chex.assert_trees_all_close(g, w, rtol=rtol, atol=rtol * float(scale) + 1e-30)


def _padding_is_zero(backend, y, dx):
    mask = np.ones(y.shape[:-1], bool)
    for _, idx in _rows(backend):
        mask[idx] = False
    assert np.all(np.asarray(y, np.float32)[mask] == 0)
    assert np.all(np.asarray(dx, np.float32)[mask] == 0)


@pytest.mark.parametrize("backend", (*BACKENDS, *PADDED_MOSAIC))
def test_f32_matches_reference(backend):
    args = _inputs(backend, jnp.float32)
    y, grads = _experts_run(backend)(*args)
    y_ref, grads_ref = _reference_run(backend)(*args)
    chex.assert_trees_all_equal_dtypes((y, grads), (y_ref, grads_ref))
    _assert_close((y, grads), (y_ref, grads_ref), rtol=1e-5)
    _padding_is_zero(backend, y, grads[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_matches_reference(backend):
    args = _inputs(backend, jnp.bfloat16)
    y, grads = _experts_run(backend)(*args)
    chex.assert_trees_all_equal_dtypes((y, grads), (args[0], args[:3]))
    y_ref, grads_ref = _reference_run(backend)(*(a.astype(jnp.float32) for a in args))
    # bf16 z/h/dz roundings: within 2e-2 elementwise, entries near zero within 2e-2 * max
    _assert_close((y, grads), (y_ref, grads_ref), rtol=2e-2, atol_of="max")
    for g, w in zip(jax.tree.leaves((y, grads)), jax.tree.leaves((y_ref, grads_ref)), strict=True):
        assert _cos_and_rel_rms(g, w)[1] < 2e-2
    _padding_is_zero(backend, y, grads[0])


FP8_OPTIONS = {
    "gemm": {"gemm_dtype": "fp8"},
    "dgrad": {"dgrad_dtype": "fp8"},
    "save_z": {"save_z": "fp8"},
    "wgrad": {"wgrad_dtype": "fp8"},
    "all": {"gemm_dtype": "fp8", "dgrad_dtype": "fp8", "save_z": "fp8", "wgrad_dtype": "fp8"},
}


@pytest.mark.parametrize("backend,option", [
    *((b, o) for b in BACKENDS for o in FP8_OPTIONS),
    # padded x on 'mosaic' runs the same custom VJP as ragged 'mosaic': all FP8 only
    *(("padded_mosaic", o) for o in ("all",)),
])
def test_fp8_options_close_to_reference(backend, option):
    args = _inputs(backend, jnp.bfloat16)
    got = _experts_run(backend, **FP8_OPTIONS[option])(*args)
    want = _reference_run(backend)(*(a.astype(jnp.float32) for a in args))
    chex.assert_tree_all_finite(got)
    names = ("y", "dx", "dw_gate_up", "dw_down")
    for name, g, w in zip(names, *map(jax.tree.leaves, (got, want)), strict=True):
        cos, rel = _cos_and_rel_rms(g, w)
        print(f"{backend} fp8 {option:7s} {name:11s} cos={cos:.5f} rel_rms={rel:.4f}")
        assert cos >= 0.996, (name, cos)
        assert rel <= 0.09, (name, rel)
    _padding_is_zero(backend, got[0], got[1][0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_recompute_equals_saved_z(backend):
    args = _inputs(backend, jnp.bfloat16)
    saved = _experts_run(backend)(*args)
    recomputed = _experts_run(backend, save_z="recompute")(*args)
    chex.assert_trees_all_close(_f32(recomputed), _f32(saved), rtol=0, atol=0)


def test_recompute_equals_saved_z_with_fp8_gemms():
    args = _inputs("ragged_dot", jnp.bfloat16)
    saved = _experts_run("ragged_dot", gemm_dtype="fp8")(*args)
    recomputed = _experts_run("ragged_dot", gemm_dtype="fp8", save_z="recompute")(*args)
    chex.assert_trees_all_close(_f32(recomputed), _f32(saved), rtol=0, atol=0)


def _residual_bytes(backend, save_z):
    x, w_gu, w_d, _ = _inputs(backend, jnp.bfloat16)
    fn = jax.jit(
        lambda x, a, b: gated_experts(x, jnp.asarray(GS), a, b,
                                      gemm_implementation=IMPLEMENTATION.get(backend, backend),
                                      save_z=save_z)
    )
    # what the backward keeps: the custom_vjp's residuals, the leaves of the VJP function
    # (their shapes and dtypes: traced abstractly, nothing compiled or run)
    leaves = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], x, w_gu, w_d))
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves), leaves


@pytest.mark.parametrize("backend", BACKENDS)
def test_saved_residual_bytes(backend):
    total = {s: _residual_bytes(backend, s) for s in ("bf16", "fp8", "recompute")}
    rows = {"ragged_dot": R, "einsum": E * C,
            "mosaic": gmm_api.aligned_rows(R, E, gmm_api.GROUP_ALIGNMENT)}[backend]
    z_bf16 = rows * 2 * F * 2
    z_fp8 = {s: total[s][0] - total["recompute"][0] for s in ("bf16", "fp8")}
    for s, (nbytes, leaves) in total.items():
        shapes = ", ".join(f"{leaf.dtype}{list(leaf.shape)}" for leaf in leaves)
        print(f"{backend} save_z={s:9s} residuals {nbytes:>9,d} B  [{shapes}]")
    print(
        f"{backend} z bytes: bf16 {z_fp8['bf16']:,d}, fp8 {z_fp8['fp8']:,d} "
        f"(ratio {z_fp8['fp8'] / z_fp8['bf16']:.4f})"
    )
    assert total["recompute"][0] < total["fp8"][0] < total["bf16"][0]
    assert z_fp8["bf16"] == z_bf16  # the only difference is z itself, [rows, 2*d_ff] bf16
    assert not any(leaf.shape[-1] == 2 * F for leaf in total["recompute"][1]
                   if len(leaf.shape) == 2)
    assert 0.49 <= z_fp8["fp8"] / z_fp8["bf16"] <= 0.51  # (1 + 1/128) / 2: data + scales


def _quant_round(a, axis):
    """FP8 rounding with one power-of-two scale per 1-D slice along ``axis``."""
    moved = jnp.moveaxis(a, axis, -1)
    q = fp8.quantize(moved, block_size=moved.shape[-1])
    return jnp.moveaxis(fp8.dequantize(q, jnp.float32), -1, axis)


def test_fp8_weights_come_from_current_params():
    backend = "ragged_dot"
    x, w_gu, w_d, ct = _inputs(backend, jnp.float32)
    run = _experts_run(backend, gemm_dtype="fp8")
    y_old, (_, g_gu, g_d) = run(x, w_gu, w_d, ct)

    params = (w_gu, w_d)
    opt = optax.sgd(0.5)

    @jax.jit  # one program for the optimizer step (eager, each op would compile its own)
    def sgd_step(params, grads):
        updates, _ = opt.update(grads, opt.init(params), params)
        return optax.apply_updates(params, updates)

    w_gu_new, w_d_new = sgd_step(params, (g_gu, g_d))

    y_new, _ = run(x, w_gu_new, w_d_new, ct)  # same compiled function, new params
    ref = jax.jit(functools.partial(_reference, backend, quant=_quant_round))
    ref_new, ref_old = ref(x, w_gu_new, w_d_new), ref(x, w_gu, w_d)
    _, rel_old = _cos_and_rel_rms(ref_new, ref_old)
    assert rel_old > 0.1, rel_old  # the step moves the output well beyond the tolerance below
    _assert_close(y_new, ref_new, rtol=1e-4)
    _assert_close(y_old, ref_old, rtol=1e-4)
    assert _cos_and_rel_rms(y_new, ref_old)[1] > 0.1


def test_padded_without_group_sizes_uses_every_row():
    x, w_gu, w_d, _ = _inputs("einsum", jnp.float32)
    full = jnp.full((E,), C, jnp.int32)
    f = jax.jit(lambda x, gs: gated_experts(x, gs, w_gu, w_d))
    y = f(x, None)
    chex.assert_trees_all_close(y, f(x, full), rtol=0, atol=0)
    assert bool(jnp.all(y[0, -1] != 0))  # a row that GS would mask is computed here


def _small(d=D, f=F, e=E, rows=8):
    x = jnp.ones((rows, d), jnp.float32)
    return x, jnp.zeros((e,), jnp.int32), jnp.ones((e, d, 2 * f)), jnp.ones((e, f, d))


@pytest.mark.parametrize(
    "case, kwargs, match",
    [
        ("d_ff_z", {"save_z": "fp8"}, r"2\*d_ff"),
        ("gs_len", {}, "group_sizes"),
        ("gs_none", {}, "group_sizes"),
        ("x_rank1", {}, "x has rank"),
        ("x_rank4", {}, "x has rank"),
        ("x_d_model", {}, "w_gate_up"),
        ("w_down", {}, "w_down"),
        ("w_gate_up_odd", {}, "w_gate_up"),
        ("w_rank", {}, "w_gate_up"),
        ("padded_experts", {}, "expert slots"),
        ("unknown_implementation", {"gemm_implementation": "cutlass"}, "gemm_implementation"),
        ("implementation_rank", {"gemm_implementation": "triton"},
         "gemm_implementation='triton' takes x as"),
        ("gemm_dtype", {"gemm_dtype": "fp16"}, "gemm_dtype"),
        ("save_z", {"save_z": "f32"}, "save_z"),
        ("wgrad_dtype", {"wgrad_dtype": "int8"}, "wgrad_dtype"),
        ("dgrad_dtype", {"dgrad_dtype": "e5m2"}, "dgrad_dtype"),
        ("block_size", {"save_z": "fp8", "block_size": 0}, "block_size"),
        ("alignment", {"group_alignment": 0}, "group_alignment"),
    ],
)
def test_bad_inputs_raise_value_error(case, kwargs, match):
    x, gs, w_gu, w_d = _small()
    if case == "d_ff_z":
        x, gs, w_gu, w_d = _small(f=96)
    elif case == "gs_len":
        gs = jnp.zeros((E + 1,), jnp.int32)
    elif case == "gs_none":
        gs = None
    elif case == "x_rank1":
        x = x[0]
    elif case == "x_rank4":
        x = x[None, None]
    elif case == "x_d_model":
        x = x[:, :-1]
    elif case == "w_down":
        w_d = w_d[:, :-1]
    elif case == "w_gate_up_odd":
        w_gu = w_gu[..., :-1]
    elif case == "w_rank":
        w_gu = w_gu[0]
    elif case == "padded_experts":
        x = jnp.ones((E + 1, 4, D))
    elif case == "implementation_rank":  # padded slots for a kernel of ragged rows
        x, gs = jnp.ones((E, 4, D)), None
    with pytest.raises(ValueError, match=match):
        gated_experts(x, gs, w_gu, w_d, **kwargs)


def test_non_integer_group_sizes_raise_type_error():
    x, gs, w_gu, w_d = _small()
    with pytest.raises(TypeError, match="group_sizes"):
        gated_experts(x, gs.astype(jnp.float32), w_gu, w_d)
