"""The Mosaic GPU row kernels (`accel_kernels.quant.mosaic`, `accel_kernels.wire.mosaic`) on
the CPU.

They run only on a Hopper GPU (``benchmarks/quant_bench.py``, at 8b11414: their bytes, speed
with the Triton kernels and XLA there). Here: they lower for CUDA on both supported shapes and
dtypes, the expert layer picks them (or Triton, or XLA) by shape and platform, off GPU the
dispatch gives the reference bytes, the activations' traceable sigmoid matches
``jax.nn.sigmoid``, and the trace breakdown (`xla_comm.breakdown`) tells the new kernels' names
apart.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cuda_export import TRITON_DEPRECATED, export_for_cuda, gemm_calls, kernel_calls

from accel_kernels import mosaic_gpu, registry
from accel_kernels.activations import GatedActivation
from accel_kernels.platform import prefer_mosaic_gpu
from accel_kernels.quant import api as qp
from accel_kernels.quant import mosaic as qm
from accel_kernels.quant import xla as quant_xla
from accel_kernels.wire import mosaic as wm

S = jax.ShapeDtypeStruct
F8 = jnp.float8_e4m3fn
BF16 = jnp.bfloat16


def _one_call(text: str, name: str) -> str:
    calls = kernel_calls(text, name)
    assert len(calls) == 1, (name, len(calls))
    assert "_mgpu" in calls[0] and "@mosaic_gpu" in calls[0], calls[0][:200]
    return calls[0]


@pytest.mark.parametrize("width,dtype", [(1408, BF16), (128, jnp.float32), (6144, BF16)])
def test_quantize_rows_lowers_with_its_shapes(width, dtype):
    """Widths that take 4- and 8-element lane vectors (bf16 and f32 rows); outputs as the
    Triton kernel's. With jax >= 0.12 the lowering also checks every global store against the
    transfer planner's rules (whole sectors, >= 4 bytes per thread)."""
    x = S((64, width), dtype)
    out = jax.eval_shape(qm.quantize_rows, x)
    assert (out[0].shape, out[0].dtype, out[1].shape) == ((64, width), F8, (64,))
    _one_call(export_for_cuda(qm.quantize_rows, x), "fp8_quantize_rows")


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh", "clamped_swiglu"])
def test_gated_kernels_lower_for_every_activation(kind):
    """The forward and backward activation kernels (sigmoid, erf, tanh-form GELU, clamps), the
    backward reading a padded ``dh`` and with or without the bf16 ``dz``."""
    act = GatedActivation(kind)
    z, dh = S((128, 2 * 1408), BF16), S((128, 1536), BF16)

    def fn(z, dh):
        return (qm.gated_quantize_rows(z, act), qm.gated_grad_quantize_rows(z, dh, act),
                qm.gated_grad_quantize_rows(z, dh, act, out_dtype=None))

    h, (dz, q, s), (q2, s2) = jax.eval_shape(fn, z, dh)
    chex.assert_shape([h[0], dz, q, q2, s], [(128, 1408), (128, 2816), (128, 2816),
                                             (128, 2816), (128,)])
    assert dz.dtype == BF16 and q.dtype == q2.dtype == F8
    text = export_for_cuda(fn, z, dh)
    _one_call(text, "fp8_gated_quantize_rows")
    assert len(kernel_calls(text, "fp8_gated_grad_quantize_rows")) == 2


def test_wire_rows_lower_for_cuda():
    local = functools.partial(wm.gather_local_rows_quantized, block_size=256)
    weighted = functools.partial(wm.gather_weighted_rows_quantized, top_k=2)
    x, idx = S((512, 2048), BF16), S((1024,), jnp.int32)
    q, s = jax.eval_shape(local, x, idx)
    assert (q.shape, q.dtype, s.shape) == ((1024, 2048), F8, (1024,))
    text = export_for_cuda(lambda x, i, w: (local(x, i), weighted(x, w, i)), x, idx,
                           S((1024,), jnp.float32))
    call = _one_call(text, "wire_local_rows_fp8")
    # 2-D rows in and out: no reshape between the kernel and what reads its rows.
    assert "tensor<1024x2048xf8E4M3FN>" in call
    _one_call(text, "wire_weighted_rows_fp8")


def test_unsupported_shapes_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="multiple of 128"):
        qm.quantize_rows(jnp.zeros((8, 96)))
    with pytest.raises(ValueError, match="rows a multiple of 4"):
        qm.quantize_rows(jnp.zeros((6, 128)))
    with pytest.raises(ValueError, match="wire.triton"):
        wm.gather_local_rows_quantized(jnp.zeros((4, 384)), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="block_size=64"):
        wm.gather_local_rows_quantized(jnp.zeros((4, 2048)), jnp.zeros((2,), jnp.int32),
                                       block_size=64)


@pytest.fixture
def before_hopper(monkeypatch):
    """Kernel choices as on an NVIDIA GPU older than Hopper (no Mosaic GPU): Triton."""

    monkeypatch.setattr(registry, "prefer_mosaic_gpu", lambda: False)
    jax.clear_caches()  # the choice is made while tracing: no trace from a Hopper test
    yield
    jax.clear_caches()


@functools.partial(jax.jit, static_argnums=0)
def _rows_and_reference(shape):
    """``qp.rows`` lowered for the CPU and the XLA reference on the same values, one program
    (eagerly every reference op compiles its own)."""
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(BF16) * 5
    return qp.rows(x), quant_xla.quantize_rows_reference(x)


@pytest.mark.parametrize("shape,want", [((64, 256), "mosaic"), ((2, 8, 256), "mosaic"),
                                        ((64, 1408), "mosaic"), ((64, 96), "xla"),
                                        ((6, 128), "xla"), ((64, 8), "xla")])
def test_row_dispatch_by_shape(shape, want):
    """Lowered for CUDA on Hopper: Mosaic GPU where it fits (rows % 4, width % 128), else XLA
    (never Triton); lowered for the CPU: the reference bytes, whatever the shape."""
    assert prefer_mosaic_gpu()  # no GPU here: CUDA lowering picks Mosaic GPU
    text = export_for_cuda(qp.rows, S(shape, BF16))
    calls = kernel_calls(text, "fp8_quantize_rows")
    if want == "xla":
        assert not calls
    else:
        assert len(calls) == 1 and "_mgpu" in calls[0]
    chex.assert_trees_all_equal(*_rows_and_reference(shape))


@pytest.mark.filterwarnings(TRITON_DEPRECATED)
@pytest.mark.parametrize("shape,want", [((64, 256), "triton"), ((6, 64), "triton"),
                                        ((64, 8), "xla")])
def test_row_dispatch_before_hopper(before_hopper, shape, want):
    """Before Hopper: Triton where the width is a multiple of 16, else XLA."""
    calls = kernel_calls(export_for_cuda(qp.rows, S(shape, BF16)), "fp8_quantize_rows")
    assert len(calls) == (want == "triton") and not any("_mgpu" in c for c in calls)


def test_gemm_kernels_carry_their_names():
    """The Mosaic GPU GEMMs are named by kind, dtype and whether grouped, so traces and the
    lowering tests tell them from the row kernels."""
    from accel_kernels import mosaic_tiles
    from accel_kernels.gmm import mosaic_kernel as gmm_mosaic

    assert mosaic_tiles.kernel_name("gmm", F8, 16) == "gmm_fp8"
    assert mosaic_tiles.kernel_name("tgmm", BF16, 1) == "dense_tgmm_bf16"
    text = export_for_cuda(lambda a, b, g: gmm_mosaic.gmm(a, b, g), S((256, 256), BF16),
                           S((2, 256, 256), BF16), S((2,), jnp.int32))
    assert len(gemm_calls(text)) == 1 and "gmm_bf16" in gemm_calls(text)[0]


@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh", "clamped_swiglu"])
def test_traceable_sigmoid_matches_jax_nn(kind):
    """The kernels' ``1 / (1 + exp(-x))`` gives the activation and its gradient as
    ``jax.nn.sigmoid`` does (f32, to rounding)."""
    act = GatedActivation(kind)
    k = jax.random.split(jax.random.key(1), 3)
    g, u, dh = (jax.random.normal(key, (256,)) * 6 for key in k)

    @jax.jit  # both sigmoids in one program (eagerly every op compiles its own)
    def parts(g, u, dh):
        return (act.apply_parts(g, u, sigmoid=mosaic_gpu.sigmoid), act.apply_parts(g, u),
                act.grad_parts(g, u, dh, sigmoid=mosaic_gpu.sigmoid), act.grad_parts(g, u, dh),
                act.apply_parts(g * 30, u, sigmoid=mosaic_gpu.sigmoid))

    h, h_ref, d, d_ref, h_big = parts(g, u, dh)
    chex.assert_trees_all_close(h, h_ref, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(d, d_ref, rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(h_big)).all()


@pytest.mark.parametrize("shape", [(2, 1408, 2816), (1, 64, 128)])
def test_weight_kernels_lower_with_their_shapes(shape):
    """Both weight passes (the tiles' maxima, then the copies written through SMEM) lower for
    CUDA, two Mosaic GPU calls each, with the Triton kernels' outputs."""
    a = S(shape, jnp.float32)
    (qt, sc), (q, sr) = jax.eval_shape(qm.quantize_cols_t_and_rows, a)
    b, m, n = shape
    chex.assert_shape([qt, sc, q, sr], [(b, n, m), (b, n), (b, m, n), (b, m)])
    assert qt.dtype == q.dtype == F8
    text = export_for_cuda(qm.quantize_cols_t_and_rows, a)
    _one_call(text, "fp8_weight_amax")
    _one_call(text, "fp8_weight_quantize")
    text = export_for_cuda(qm.quantize_cols_t, a)
    _one_call(text, "fp8_col_amax")
    assert "tensor<" + f"{b}x{n}x{m}xf8E4M3FN>" in _one_call(text, "fp8_quantize_cols_t")
    with pytest.raises(ValueError, match="multiples of"):
        qm.quantize_cols_t(jnp.zeros((1, 64, 192)))


@functools.partial(jax.jit, static_argnums=0)
def _weights_and_reference(shape):
    """``qp.cols_t_and_rows`` lowered for the CPU and the XLA reference, one program."""
    a = jax.random.normal(jax.random.key(2), shape, jnp.float32) * 3
    return qp.cols_t_and_rows(a), quant_xla.quantize_cols_t_and_rows_reference(a)


@pytest.mark.parametrize("shape,want", [((3, 128, 256), "mosaic"), ((256, 384), "mosaic"),
                                        ((2, 64, 192), "xla"), ((2, 48, 128), "xla")])
def test_weight_dispatch_by_shape(shape, want):
    """Lowered for CUDA on Hopper: the weights' two passes in Mosaic GPU where the [64, 128]
    tiles fit, else XLA; lowered for the CPU: the reference bytes."""
    text = export_for_cuda(qp.cols_t_and_rows, S(shape, jnp.float32))
    calls = kernel_calls(text, "fp8_weight_quantize")
    if want == "xla":
        assert not calls
    else:
        assert len(calls) == 1 and "_mgpu" in calls[0]
    chex.assert_trees_all_equal(*_weights_and_reference(shape))


@pytest.mark.filterwarnings(TRITON_DEPRECATED)
def test_weight_dispatch_before_hopper(before_hopper):
    """Before Hopper: Triton's [64, 64] tiles, where Mosaic GPU's [64, 128] would not fit."""
    calls = kernel_calls(export_for_cuda(qp.cols_t_and_rows, S((2, 64, 192), jnp.float32)),
                         "fp8_weight_quantize")
    assert len(calls) == 1 and "_mgpu" not in calls[0]

# ----------------------------------------------------------------------------------------------
# The kernels' arithmetic in Pallas' Mosaic GPU interpreter (layouts dropped): the XLA bytes,
# the scales' and maxima's SMEM + TMA stores included.
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def interpret(monkeypatch):
    """Runs `accel_kernels.quant.mosaic`'s kernels in the Mosaic GPU interpreter: register layouts
    dropped (``layout_cast`` and layout loads become plain reads). This checks the arithmetic
    and what each store writes where, not the layouts (the CUDA lowerings above do)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode
    except ImportError:  # pragma: no cover - depends on the installed jax
        pytest.skip("no Mosaic GPU interpret mode in this jax")

    monkeypatch.setattr(mosaic_gpu.plgpu, "layout_cast", lambda x, layout: x)
    monkeypatch.setattr(mosaic_gpu, "load", lambda ref, layout, optimized=True: ref[...])

    def run(fn, *args):
        with force_gpu_interpret_mode():  # jitted: the ops around the kernel in one program
            return jax.tree.map(np.asarray, jax.jit(fn)(*args))

    return run


def _bytes(tree):
    return [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(tree)]


def _spread(shape, seed):
    """Values whose rows (and columns) span magnitudes 2^-20 .. 2^20, one zero row."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, shape, jnp.float32)
    mag = jnp.exp2(jax.random.randint(k2, shape[:-1] + (1,), -20, 21).astype(jnp.float32))
    return (x * mag).at[..., 1, :].set(0.0)


def test_row_kernels_interpreted_give_the_xla_bytes(interpret):
    act = GatedActivation("silu")
    x = _spread((8, 256), 0).astype(BF16)
    chex.assert_trees_all_equal(_bytes(interpret(qm.quantize_rows, x)),
                                _bytes(quant_xla.quantize_rows_reference(x)))
    z, dh = _spread((8, 512), 1).astype(BF16), _spread((8, 384), 2).astype(BF16)
    chex.assert_trees_all_equal(
        _bytes(interpret(functools.partial(qm.gated_quantize_rows, act=act), z)),
        _bytes(quant_xla.gated_quantize_rows_reference(z, act)))
    got = interpret(functools.partial(qm.gated_grad_quantize_rows, act=act), z, dh)
    want = quant_xla.gated_grad_quantize_rows_reference(z, dh, act, jnp.bfloat16)
    # dz in bf16 to rounding of the traced sigmoid; its e4m3 rows and scales as the reference.
    chex.assert_trees_all_close(got[0].astype(np.float32), want[0].astype(jnp.float32),
                                rtol=1e-2, atol=1e-30)
    np.testing.assert_array_equal(got[2], np.asarray(want[2]))


def test_weight_kernels_interpreted_give_the_xla_bytes(interpret):
    if jax.__version_info__ < (0, 11):
        pytest.skip("jax 0.10's Mosaic GPU interpreter has no ref transposes")
    a = _spread((2, 128, 256), 3)
    chex.assert_trees_all_equal(_bytes(interpret(qm.quantize_cols_t_and_rows, a)),
                                _bytes(quant_xla.quantize_cols_t_and_rows_reference(a)))
    chex.assert_trees_all_equal(_bytes(interpret(qm.quantize_cols_t, a)),
                                _bytes(quant_xla.quantize_cols_t_reference(a)))


def test_a_kernel_that_does_not_lower_on_an_untested_jax_names_the_fix(monkeypatch):
    """On a jax outside the tested range each kernel is lowered once at first use; a failure
    is a KernelLoweringError naming the kernel, the jax version and the avoiding option."""
    from accel_kernels import lowering

    assert lowering.is_tested()  # CI's versions
    monkeypatch.setattr(lowering, "_installed_is_tested", lambda: False)
    monkeypatch.setattr(lowering, "_LOWERED", {})
    x = S((64, 256), BF16)
    jax.eval_shape(qm.quantize_rows, x)  # lowers here: fine
    assert any(name == "fp8_quantize_rows_mgpu" for name, _ in lowering._LOWERED)

    def broken(*args, **kwargs):
        raise NotImplementedError("a planner this jax does not have")

    monkeypatch.setattr(lowering.jax.export, "export", broken)
    with pytest.raises(lowering.KernelLoweringError,
                       match=r"wire_gather_encode_mgpu does not lower on jax "
                             r".*wire_implementation='xla'"):
        jax.eval_shape(functools.partial(wm.gather_encode, fp8_wire=True), S((8, 512), BF16),
                       S((8,), jnp.int32))
    jax.eval_shape(qm.quantize_rows, x)  # lowered before: not again
