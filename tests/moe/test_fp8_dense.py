"""moe.fp8_dense: ``x @ kernel`` on e4m3 operands, its custom VJP, sharding and CUDA lowering.

Accuracy against an f32 reference (FP8 GEMMs at the FP8 bar, bf16 GEMMs at bf16 tolerance) on
a row count the 'mosaic' path pads; exactness of the rowwise recipe on inputs whose every
quantization is exact; the shard_map path against the single-device one; the GEMMs lowered
for CUDA as Mosaic GPU calls on f8E4M3FN operands; FP8 weights made from the params of each
step; bad inputs. Compiled functions are cached per option set so each compiles once.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cuda_export import (
    cuda_mesh,
    export_for_cuda,
    gemm_calls,
    kernel_names,
)
from _meshes import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe
from xla_comm.lowered import widened_fp8

K, N = 128, 256
LEAD = (3, 100)  # 300 rows: not a multiple of the 'mosaic' path's 128-row tiles
BACKENDS = ("mosaic", "xla")  # 'mosaic': its XLA emulation on CPU
DTYPES = ("fp8", "bf16")
HI = jax.lax.Precision.HIGHEST
F8 = "f8E4M3FN"


def _data(lead=LEAD, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32) / np.sqrt(K)
    ct = rng.standard_normal((*lead, N)).astype(np.float32)
    return x, w, ct


def _y_and_grads(fn):
    """jit of ``(x, w, ct) -> (y, (dx, dw))`` with the cotangent ``ct`` (cast to y's dtype)."""
    def run(x, w, ct):
        y, vjp = jax.vjp(fn, x, w)
        return y, vjp(ct.astype(y.dtype))

    return jax.jit(run)


@functools.cache
def _dense_run(backend="xla", dgrad_dtype="fp8", wgrad_dtype="bf16", mesh=None,
               token_axes=None):
    return _y_and_grads(functools.partial(
        moe.fp8_dense, gemm_implementation=backend, dgrad_dtype=dgrad_dtype,
        wgrad_dtype=wgrad_dtype, mesh=mesh, token_axes=token_axes))


@functools.cache
def _reference_run():
    """The f32 product (bf16 inputs are exact in f32) and its autodiff gradients."""
    return _y_and_grads(lambda x, w: jnp.matmul(x.astype(jnp.float32), w, precision=HI))


def _f32(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)


def _cos_and_rel_rms(a, b):
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    return cos, np.linalg.norm(a - b) / np.linalg.norm(b)


def _assert_close(got, want, rtol):
    """Elementwise rtol, with atol = rtol * RMS(want) for entries near zero."""
    for g, w in zip(jax.tree.leaves(_f32(got)), jax.tree.leaves(_f32(want)), strict=True):
        scale = np.sqrt(np.mean(np.square(w)))
        chex.assert_trees_all_close(g, w, rtol=rtol, atol=rtol * float(scale) + 1e-30)


# ----------------------------------------------------------------------------------------------
# Accuracy and exactness.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wgrad_dtype", DTYPES)
@pytest.mark.parametrize("dgrad_dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_close_to_reference(backend, dgrad_dtype, wgrad_dtype):
    """bf16 x, f32 kernel: y and the FP8 gradients at the FP8 bar (cosine >= 0.99, relative RMS
    < 0.1), a bf16 GEMM's gradient at bf16 tolerance; dtypes and shapes of the inputs."""
    x, w, ct = _data()
    x, ct = jnp.asarray(x, jnp.bfloat16), jnp.asarray(ct, jnp.bfloat16)
    got = _dense_run(backend, dgrad_dtype, wgrad_dtype)(x, w, ct)
    want = _reference_run()(x, w, ct)
    chex.assert_tree_all_finite(got)
    y, (dx, dw) = got
    chex.assert_shape((y, dx, dw), ((*LEAD, N), (*LEAD, K), (K, N)))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    fp8 = {"y": True, "dx": dgrad_dtype == "fp8", "dw": wgrad_dtype == "fp8"}
    for (name, is_fp8), g, r in zip(fp8.items(), *map(jax.tree.leaves, (got, want)), strict=True):
        cos, rel = _cos_and_rel_rms(g, r)
        if is_fp8:
            assert cos >= 0.99 and rel < 0.1, (name, cos, rel)
            assert rel > 1e-3, (name, rel)  # really rounded to FP8
        else:  # bf16 operands, f32 accumulation
            assert rel < 2e-2, (name, rel)
            _assert_close(g, r, rtol=2e-2)


def _exact_data(lead=LEAD, seed=0):
    """Integers in [-15, 15] times a power of two per row (x, ct) or per column (w), within a
    range of 2^4: every rowwise/per-channel e4m3 quantization of them is exact."""
    rng = np.random.default_rng(seed)

    def ints(shape, scale_axis):
        a = rng.integers(-15, 16, shape).astype(np.float32)
        pow_shape = [1] * len(shape)
        pow_shape[scale_axis] = shape[scale_axis]
        return a * np.exp2(rng.integers(-2, 3, pow_shape)).astype(np.float32)

    x = ints((*lead, K), len(lead) - 1).reshape(*lead, K)
    w = ints((K, N), 1)
    ct = ints((*lead, N), len(lead) - 1)
    return x, w, ct


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_when_quantization_is_exact(backend):
    """f32 x, every GEMM in FP8: y, dx and dkernel equal the f64 products exactly."""
    x, w, ct = _exact_data()
    y, (dx, dw) = _dense_run(backend, "fp8", "fp8")(x, w, ct)
    x64, w64, ct64 = (a.astype(np.float64) for a in (x, w, ct))
    want = (x64 @ w64, ct64 @ w64.T, x64.reshape(-1, K).T @ ct64.reshape(-1, N))
    assert all(np.all(np.abs(a) < 2.0**24) for a in want)  # exact in f32 too
    chex.assert_trees_all_close(_f32((y, dx, dw)), _f32(want), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Sharded rows.
# ----------------------------------------------------------------------------------------------

SHARDED_LEAD = (8, 48)  # 384 rows: 48 per device on 8, 192 on 2 (padded to 128-row tiles)


def _rows_spec(token_axes):
    axes = ("data", "expert") if token_axes is None else token_axes
    return P(axes if isinstance(axes, str) else tuple(axes))


@pytest.mark.parametrize("backend,token_axes,axis_type", [
    ("mosaic", None, "explicit"),
    ("xla", None, "auto"),
    ("mosaic", "data", "auto"),
    ("xla", ("expert",), "explicit"),
])
def test_sharded_equals_unsharded(backend, token_axes, axis_type):
    """Rows split over the mesh: y and dx as on one device (rowwise scales are per row),
    dkernel up to the order of its f32 sum over the shards. On Explicit axes x comes split as
    ``token_axes`` (see test_explicit_mesh_reshards_x_and_kernel)."""
    mesh = make_mesh((2, 4), axis_type=axis_type)
    x, w, ct = _data(SHARDED_LEAD, seed=1)
    sharded_x = jax.device_put(x, NamedSharding(mesh, _rows_spec(token_axes)))
    got = _dense_run(backend, mesh=mesh, token_axes=token_axes)(sharded_x, w, ct)
    want = _dense_run(backend)(x, w, ct)
    chex.assert_tree_all_finite(got)
    (y, (dx, dw)), (y1, (dx1, dw1)) = got, want
    assert y.sharding.spec[0] == _rows_spec(token_axes)[0], y.sharding
    chex.assert_trees_all_close(_f32((y, dx)), _f32((y1, dx1)), rtol=1e-6, atol=0)
    _assert_close(dw, dw1, rtol=1e-5)


def test_sharded_fp8_wgrad_close_to_reference():
    """An FP8 weight gradient per shard (its channels scaled over that shard's rows: not the
    unsharded one's bytes), summed over the shards: at the FP8 bar."""
    mesh = make_mesh((2, 4), axis_type="auto")
    x, w, ct = _data(SHARDED_LEAD, seed=1)
    got = _dense_run("mosaic", "fp8", "fp8", mesh=mesh)(x, w, ct)
    want = _reference_run()(x, w, ct)
    for name, g, r in zip(("y", "dx", "dw"), *map(jax.tree.leaves, (got, want)), strict=True):
        cos, rel = _cos_and_rel_rms(g, r)
        assert cos >= 0.99 and rel < 0.1, (name, cos, rel)


def test_ambient_mesh():
    """mesh=None under ``jax.set_mesh``: the rows are split over the ambient mesh."""
    mesh = make_mesh((2, 4), axis_type="auto")
    x, w, ct = _data(SHARDED_LEAD, seed=1)
    with jax.set_mesh(mesh):
        got = _dense_run("xla")(x, w, ct)
    assert got[0].sharding.spec[0] == ("data", "expert"), got[0].sharding
    want = _dense_run("xla", mesh=mesh)(x, w, ct)
    chex.assert_trees_all_close(_f32(got), _f32(want), rtol=0, atol=0)


@pytest.mark.parametrize("operand", ["x", "kernel"])
def test_explicit_mesh_reshards_x_and_kernel(operand):
    """On Explicit axes, a replicated x or a sharded kernel (e.g. an FSDP param) is put on the
    layout the GEMMs need, as on Auto axes (the MoE layer does this with ``_mesh.reshard``)."""
    mesh = make_mesh((2, 4))
    x, w, ct = _data(SHARDED_LEAD, seed=1)
    if operand == "x":  # replicated rows
        args = (x, w)
    else:  # rows as token_axes, kernel split over its output channels
        args = (jax.device_put(x, NamedSharding(mesh, P(("data", "expert")))),
                jax.device_put(w, NamedSharding(mesh, P(None, "expert"))))
    got = _dense_run("xla", mesh=mesh)(*args, ct)
    want = _dense_run("xla")(x, w, ct)
    chex.assert_trees_all_close(_f32(got[0]), _f32(want[0]), rtol=1e-6, atol=0)


def test_inside_shard_map_runs_per_device():
    """Called inside a user's ``shard_map`` with mesh=None: the rows are that device's."""
    mesh = make_mesh((8,), ("data",), axis_type="auto")
    x, w, _ = _data(SHARDED_LEAD, seed=1)
    x = x.reshape(-1, K)
    f = jax.jit(jax.shard_map(lambda x, w: moe.fp8_dense(x, w, gemm_implementation="xla"),
                              mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))
    want = jax.jit(functools.partial(moe.fp8_dense, gemm_implementation="xla"))(x, w)
    chex.assert_trees_all_close(_f32(f(x, w)), _f32(want), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------
# Lowering for CUDA.
# ----------------------------------------------------------------------------------------------


@functools.cache
def _grad_text(wgrad_dtype: str, sharded: bool = False) -> str:
    def loss(x, w):
        y = moe.fp8_dense(x, w, gemm_implementation="mosaic", dgrad_dtype="fp8",
                          wgrad_dtype=wgrad_dtype, mesh=mesh)
        return jnp.sum(y.astype(jnp.float32))

    S = jax.ShapeDtypeStruct
    if sharded:
        mesh = cuda_mesh((2, 4), ("data", "expert"))
        x = S((8, 128, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P(("data", "expert"))))
        w = S((256, 512), jnp.float32, sharding=NamedSharding(mesh, P()))
    else:
        mesh = None
        x, w = S((2, 128, 256), jnp.bfloat16), S((256, 512), jnp.float32)
    # value_and_grad: with jax.grad alone the forward GEMM is dead code (the custom VJP's
    # residuals are x and the kernel, not y)
    return export_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), x, w)


def _operand_types(line: str) -> list[str]:
    """The operand tensor types of one StableHLO op line (``: (a, b) -> c``)."""
    sig = re.search(r":\s*\(([^()]*)\)\s*->", line)
    assert sig, line[-300:]
    return re.findall(r"tensor<[^>]*>", sig.group(1))


def _mosaic_gemm_operands(text: str) -> list[list[str]]:
    """The matrix operand types (not the f32 scales, nor the i32 group sizes) of each Mosaic
    GPU GEMM call."""
    return [[t for t in _operand_types(line) if not re.search(r"x(f32|i32)>$", t)]
            for line in gemm_calls(text)]


def _quantize_kernels(text: str) -> list[str]:
    """Names of the quantization kernels (Triton or Mosaic GPU calls) in an exported module."""
    return kernel_names(text, r"fp8_\w*(?:quantize|amax)\w*")


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True])
def test_all_fp8_gemms_are_mosaic_calls(sharded):
    """Forward, dgrad and wgrad: three Mosaic GPU kernels on e4m3 operands, quantized by the
    Pallas kernels (x and dy per row; the kernel's two copies, per output and per input
    channel, from two passes over it; the weight gradient reads x's and dy's e4m3 rows,
    transposed by XLA with no second quantization), no e4m3 value widened."""
    text = _grad_text("fp8", sharded)
    operands = _mosaic_gemm_operands(text)
    assert len(operands) == 3, operands
    for matrices in operands:
        assert len(matrices) == 2 and all(t.endswith(f"x{F8}>") for t in matrices), matrices
    assert widened_fp8(text) == []
    want = ["fp8_quantize_rows"] * 2 + ["fp8_weight_amax", "fp8_weight_quantize"]
    assert _quantize_kernels(text) == sorted(want), _quantize_kernels(text)


@pytest.mark.slow
def test_bf16_wgrad_is_a_bf16_mosaic_call():
    text = _grad_text("bf16")
    operands = _mosaic_gemm_operands(text)
    assert len(operands) == 3, operands
    fp8 = [m for m in operands if len(m) == 2 and all(t.endswith(f"x{F8}>") for t in m)]
    bf16 = [m for m in operands if len(m) == 2 and all(t.endswith("xbf16>") for t in m)]
    assert (len(fp8), len(bf16)) == (2, 1), operands
    assert widened_fp8(text) == []


# ----------------------------------------------------------------------------------------------
# Training: FP8 weights from the current params.
# ----------------------------------------------------------------------------------------------


def test_fp8_weights_come_from_current_params():
    x, w, ct = _data()
    x = jnp.asarray(x, jnp.bfloat16)
    opt = optax.sgd(64.0)
    dense = functools.partial(moe.fp8_dense, gemm_implementation="mosaic")

    def loss_fn(params):
        y = dense(x, params["kernel"])
        return jnp.mean(y.astype(jnp.float32) * ct), y

    @jax.jit
    def step(params, opt_state):
        (loss, y), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (loss, y), optax.apply_updates(params, updates), opt_state

    params = {"kernel": jnp.asarray(w)}
    (loss0, y0), params1, state = step(params, opt.init(params))
    (loss1, y1), params2, _ = step(params1, state)
    fresh = jax.jit(loss_fn)
    for (loss, y), p in (((loss0, y0), params), ((loss1, y1), params1)):
        loss_ref, y_ref = fresh(p)
        chex.assert_trees_all_close(_f32(y), _f32(y_ref), rtol=0, atol=0)
        chex.assert_trees_all_close(loss, loss_ref, rtol=1e-6)
    _, rel = _cos_and_rel_rms(y1, y0)
    assert rel > 0.1, rel  # the step moved the output well beyond FP8 rounding
    assert float(loss1) < float(loss0)
    assert not np.allclose(params2["kernel"], params1["kernel"])


# ----------------------------------------------------------------------------------------------
# Bad inputs.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,error,match", [
    ("kernel_k", ValueError, "kernel"),
    ("kernel_rank", ValueError, "kernel"),
    ("dgrad_dtype", ValueError, "dgrad_dtype"),
    ("wgrad_dtype", ValueError, "wgrad_dtype"),
    ("gemm_implementation", ValueError, "gemm_implementation"),
    ("token_axis", ValueError, "token_axes"),
    ("rows", ValueError, "token_axes"),
    ("int_x", TypeError, "floating"),
])
def test_bad_inputs_raise(case, error, match):
    x, w = jnp.ones((12, K), jnp.bfloat16), jnp.ones((K, N))
    kw = {}
    if case == "kernel_k":
        w = jnp.ones((K + 16, N))
    elif case == "kernel_rank":
        w = jnp.ones((1, K, N))
    elif case in ("dgrad_dtype", "wgrad_dtype"):
        kw = {case: "fp16"}
    elif case == "gemm_implementation":
        kw = {"gemm_implementation": "cutlass"}
    elif case == "token_axis":
        kw = {"mesh": make_mesh((2, 4)), "token_axes": ("data", "model")}
    elif case == "rows":  # 12 rows over 8 shards
        kw = {"mesh": make_mesh((2, 4))}
    elif case == "int_x":
        x = jnp.ones((12, K), jnp.int32)
    with pytest.raises(error, match=match):
        jax.jit(functools.partial(moe.fp8_dense, **kw))(x, w)
