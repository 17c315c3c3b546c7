"""The Mosaic GPU wire kernels (`accel_kernels.wire.mosaic`: ``gather_encode``, ``gather_decode``,
``gather_rows_quantized``) on the CPU.

They run only on a Hopper GPU (``benchmarks/quant_bench.py``, at 8b11414: their bytes, speed
with the Triton kernels and XLA there). Here: they lower for CUDA with the Triton kernels'
output types; the wire's call sites (`accel_kernels.wire.api.gather_rows`, the expert layouts of
`moe.dispatch.movement`, `moe.experts.fp8_gemm.rows_from_wire`) pick them, Triton or XLA by
width and platform, and off GPU give the reference bytes; and their arithmetic, run by Pallas'
Mosaic GPU interpreter (layouts ignored), gives the XLA wire's bytes.
"""

import functools
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cuda_export import TRITON_DEPRECATED, cuda_mesh, export_for_cuda, kernel_calls
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accel_kernels import mosaic_gpu, registry
from accel_kernels.platform import prefer_mosaic_gpu
from accel_kernels.quant import xla as quant_xla
from accel_kernels.wire import api as wire_api
from accel_kernels.wire import mosaic as wm
from accel_kernels.wire import triton as wp
from moe import dispatch
from moe.dispatch import movement
from moe.experts import fp8_gemm

S = jax.ShapeDtypeStruct
F8, BF16, F32, U32, I32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, jnp.uint32, jnp.int32
NAMES = ("wire_gather_encode", "wire_gather_decode", "wire_gather_rows_fp8")


def _wire_width(width: int, block: int) -> int:
    return width // 4 + -(-width // (4 * block))


def _kernel(text: str, name: str) -> str | None:
    """``None`` (no kernel ``name``), ``'mosaic'`` or ``'triton'`` (one call)."""
    calls = kernel_calls(text, name)
    if not calls:
        return None
    assert len(calls) == 1, (name, len(calls))
    mosaic = "_mgpu" in calls[0]
    assert mosaic == ("@mosaic_gpu" in calls[0]), calls[0][:200]
    return "mosaic" if mosaic else "triton"


@functools.partial(jax.jit, static_argnums=(0, 1, 2))  # one program per shape, not one per op
def _rows(t: int, d: int, dtype=BF16) -> jax.Array:
    """Rows with per-row magnitudes from 2^-130 to 2^60, a zero row, an inf and a NaN."""
    k1, k2 = jax.random.split(jax.random.key(3))
    mag = jnp.exp2(jax.random.randint(k1, (t, 1), -130, 60).astype(F32))
    x = (jax.random.normal(k2, (t, d), F32) * mag).astype(dtype)
    return x.at[2].set(0).at[3, 7].set(jnp.inf).at[4, 100].set(jnp.nan)


INDEX = jnp.array([5, 0, 2, 3, 4, 11, -1, 12, 99, 5], I32)  # repeats, out of range (T = 12)


def _take(buf, index):
    return jnp.take(buf, jnp.where(index < 0, buf.shape[0], index), axis=0, mode="fill",
                    fill_value=0)


def _fp8_kernels(width: int, block: int):
    enc = functools.partial(wm.gather_encode, fp8_wire=True, block_size=block)
    dec = functools.partial(wm.gather_decode, width=width, fp8_wire=True, block_size=block)
    rows = functools.partial(wm.gather_rows_quantized, width=width, block_size=block)
    return enc, dec, rows


# ----------------------------------------------------------------------------------------------
# The kernels lower for CUDA with the Triton kernels' outputs.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width,block,dtype", [(512, 128, BF16), (1536, 128, F32),
                                               (2048, 256, BF16)])
def test_fp8_kernels_lower_with_their_shapes(width, block, dtype):
    """One scale word per row (512), three (1536: no Triton kernel), blocks of 256."""
    rows, idx = S((64, width), dtype), S((48,), I32)
    wire = S((64, _wire_width(width, block)), U32)
    enc, dec, quant = _fp8_kernels(width, block)
    got = jax.eval_shape(lambda r, w, i: (enc(r, i), dec(w, i), quant(w, i)), rows, wire, idx)
    want = ((48, wire.shape[1]), U32), ((48, width), BF16), (((48, width), F8), ((48,), F32))
    assert jax.tree.map(lambda o: (o.shape, o.dtype), got) == want
    triton = jax.eval_shape(
        lambda r, w, i: (wp.gather_encode(r, i, fp8_wire=True, block_size=block),
                         wp.gather_decode(w, i, width=width, fp8_wire=True, block_size=block),
                         wp.gather_rows_quantized(w, i, width=width, block_size=block)),
        rows, wire, idx)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, triton)
    text = export_for_cuda(lambda r, w, i: (enc(r, i), dec(w, i), quant(w, i)), rows, wire, idx)
    assert [_kernel(text, n) for n in NAMES] == ["mosaic"] * 3
    # 2-D rows out: no reshape between the kernel and what reads its rows.
    assert f"tensor<48x{width}xf8E4M3FN>" in kernel_calls(text, "wire_gather_rows_fp8")[0]


@pytest.mark.parametrize("width,dtype,out", [(768, BF16, BF16), (1024, F32, BF16),
                                             (128, F32, F32)])
def test_float_wire_kernels_lower(width, dtype, out):
    """The float wire's copies (a cast on the way; 4-, 8- and 16-byte lane vectors, the
    narrowest store 4 bytes per thread as jax >= 0.12 requires)."""
    rows, idx = S((64, width), dtype), S((48,), I32)
    enc = functools.partial(wm.gather_encode, fp8_wire=False, out_dtype=out)
    dec = functools.partial(wm.gather_decode, width=width, fp8_wire=False, out_dtype=out)
    got = jax.eval_shape(lambda r, i: (enc(r, i), dec(r, i)), rows, idx)
    assert [(o.shape, o.dtype) for o in got] == [((48, width), out)] * 2
    text = export_for_cuda(lambda r, i: (enc(r, i), dec(r, i)), rows, idx)
    assert [_kernel(text, n) for n in NAMES[:2]] == ["mosaic"] * 2


def test_supported_widths_and_refusals():
    assert wm.wire_supported(4096, fp8_wire=True) and wm.wire_supported(1536, fp8_wire=True)
    assert wm.wire_supported(2048, fp8_wire=True, block_size=256)
    assert not wm.wire_supported(256, fp8_wire=True)  # less than one scale word
    assert not wm.wire_supported(768, fp8_wire=True)  # 6 blocks: a part-filled scale word
    assert not wm.wire_supported(1024, fp8_wire=True, block_size=64)
    assert wm.wire_supported(768, fp8_wire=False) and not wm.wire_supported(96, fp8_wire=False)
    # bf16 rows of 384: 96 channels per warp, a 1-element (2-byte) lane vector; f32 ones fit.
    assert not wm.wire_supported(384, fp8_wire=False)
    assert wm.wire_supported(384, fp8_wire=False, itemsizes=(4, 4))
    with pytest.raises(ValueError, match="wire.triton"):
        wm.gather_encode(jnp.zeros((4, 256)), jnp.zeros((2,), I32), fp8_wire=True)
    with pytest.raises(ValueError, match="wire rows"):
        wm.gather_decode(jnp.zeros((4, 128), U32), jnp.zeros((2,), I32), width=512,
                         fp8_wire=True)


# ----------------------------------------------------------------------------------------------
# The call sites: on Hopper Mosaic GPU where it fits, else XLA (before Hopper Triton); the
# reference bytes on CPU.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wire,width,want", [
    ("fp8", 1536, "mosaic"), ("fp8", 256, None), ("fp8", 768, None),
    ("bf16", 512, "mosaic"), ("bf16", 384, None), ("bf16", 64, None)])
def test_gather_rows_dispatch(wire, width, want):
    """`accel_kernels.wire.api.gather_rows` (the send buffers' gather + encode)."""
    assert prefer_mosaic_gpu()  # no GPU here: CUDA lowering picks Mosaic GPU
    codec = "fp8" if wire == "fp8" else jnp.dtype(BF16)
    fn = functools.partial(wire_api.gather_rows, wire=codec, block_size=128, implementation="auto")
    text = export_for_cuda(fn, S((12, width), F32), S(INDEX.shape, I32))
    assert _kernel(text, "wire_gather_encode") == want
    x = _rows(12, width, F32)
    # the call site and the reference in one program (eagerly every op compiles its own)
    chex.assert_trees_all_equal(*jax.jit(lambda x, i: (
        fn(x, i), wire_api.gather_rows(x, i, wire=codec, block_size=128)))(x, INDEX))


@pytest.mark.filterwarnings(TRITON_DEPRECATED)
@pytest.mark.parametrize("wire,width,want", [("fp8", 2048, "triton"), ("fp8", 256, "triton"),
                                             ("bf16", 64, "triton"), ("bf16", 96, None)])
def test_gather_rows_dispatch_before_hopper(monkeypatch, wire, width, want):
    """On an NVIDIA GPU older than Hopper the Triton kernels run (no Mosaic GPU there)."""
    monkeypatch.setattr(registry, "prefer_mosaic_gpu", lambda: False)
    jax.clear_caches()  # the choice is made while tracing: no trace from a Hopper test
    codec = "fp8" if wire == "fp8" else jnp.dtype(BF16)
    fn = functools.partial(wire_api.gather_rows, wire=codec, block_size=128, implementation="auto")
    text = export_for_cuda(fn, S((12, width), F32), S(INDEX.shape, I32))
    jax.clear_caches()
    assert _kernel(text, "wire_gather_encode") == want


def _plan(p: int, c: int, pair_row=None):
    """The fields of a `moe.dispatch.plan.DensePlan` / `DroplessPlan` that the expert layouts
    read."""
    return SimpleNamespace(axis_size=p, num_local_experts=2, capacity=c, pair_width=c,
                           pair_row=pair_row,
                           expert_shape=lambda width: (2, p * c, width))


@pytest.mark.parametrize("wire,width,want", [
    ("fp8", 1024, "mosaic"), ("fp8", 256, None), ("bf16", 512, "mosaic"),
    ("bf16", 384, None), ("bf16", 64, None)])
def test_expert_layout_decode_dispatch(wire, width, want):
    """The received rows decoded into the expert layout, dense (a permutation) and dropless
    (a gather by the plan's pair rows)."""
    w = movement.wire_for(wire, F32, 128, "auto")
    p, c = 2, 4
    pair_row = jnp.array([1, 0, 7, 100, 3, 3, 6, 2, 5, 16, 4, 0, 9, 8, 2, 1], I32)
    dense = functools.partial(movement._dense_to_layout, plan=_plan(p, c), w=w, width=width)
    dropless = functools.partial(movement._pairs_to_layout, plan=_plan(p, c, pair_row), c=c, o=0,
                                 w=w, width=width)
    x = _rows(2 * p * c, width, F32)

    @jax.jit  # both layouts and their references in one program (eagerly one per op)
    def run(x):
        recv = wire_api.encode_rows(x, wire=w.codec, block_size=128)
        ref_dense = (w.decode(recv, width).reshape(p, 2, c, width).transpose(1, 0, 2, 3)
                     .reshape(2, p * c, width))
        return recv, (dense(recv), ref_dense), (dropless(recv),
                                                w.decode(_take(recv, pair_row), width))

    recv, *results = run(x)
    for fn, (got, ref) in zip((dense, dropless), results, strict=True):
        text = export_for_cuda(fn, S(recv.shape, recv.dtype))
        assert _kernel(text, "wire_gather_decode") == want
        chex.assert_trees_all_equal(got, ref)


@pytest.mark.parametrize("width,want", [(1536, "mosaic"), (256, None), (768, None)])
def test_rows_from_wire_dispatch(width, want):
    """`moe.experts.fp8_gemm.rows_from_wire`: the FP8 GEMM's e4m3 rows from received wire rows."""
    fn = functools.partial(fp8_gemm.rows_from_wire, width=width, block_size=128)
    buf = jax.eval_shape(functools.partial(wire_api.encode_rows, wire="fp8", block_size=128),
                         S((12, width), F32))
    text = export_for_cuda(lambda b, i: fn(b, index=i), buf, S(INDEX.shape, I32))
    assert _kernel(text, "wire_gather_rows_fp8") == want

    @jax.jit  # the call site and its reference in one program (eagerly one per op)
    def run(x, i):
        buf = wire_api.encode_rows(x, wire="fp8", block_size=128)
        ref = quant_xla.quantize_rows_reference(wire_api.decode_rows(
            _take(buf, i), wire="fp8", width=width, block_size=128, out_dtype=F32))
        return fn(buf, index=i), ref

    got, ref = run(_rows(12, width, F32), INDEX)
    # Bytes: the NaN row's e4m3 NaNs do not compare equal as values on every numpy.
    chex.assert_trees_all_equal(_bytes(got), _bytes(ref))


def test_dispatch_lowers_with_mosaic_wire_kernels():
    """FP8 dense dispatch inside shard_map (check_vma=True) lowers for CUDA with the Mosaic
    GPU send gather + encode and decode into the expert layout."""
    mesh = cuda_mesh((4,), ("expert",))
    e = P("expert")

    def local(x, ids):
        ex, _, _ = dispatch(x, ids, num_experts=8, axis_name="expert", transport="dense",
                            capacity_factor=1.0, dispatch_dtype="fp8", wire_implementation="auto")
        return ex

    fn = jax.shard_map(local, mesh=mesh, in_specs=(e, e), out_specs=e)
    sds = lambda shape, dtype: S(shape, dtype, sharding=NamedSharding(mesh, e))  # noqa: E731
    text = export_for_cuda(fn, sds((64, 1024), BF16), sds((64, 2), I32))
    assert [_kernel(text, n) for n in NAMES[:2]] == ["mosaic"] * 2


# ----------------------------------------------------------------------------------------------
# The kernels' arithmetic in Pallas' Mosaic GPU interpreter: the XLA wire's bytes.
# ----------------------------------------------------------------------------------------------


class _RowView:
    """A reshaped ref view, for the interpreter (which has no ref reshapes)."""

    def __init__(self, ref, shape):
        self.ref, self.shape = ref, shape

    def __getitem__(self, idx):
        return self.ref[...].reshape(self.shape)

    def __setitem__(self, idx, value):
        self.ref[...] = value.reshape(self.ref.shape)


@pytest.fixture
def interpret(monkeypatch):
    """Runs `accel_kernels.wire.mosaic`'s kernels in the Mosaic GPU interpreter: register layouts
    dropped (``layout_cast`` and layout loads become plain reads), ref reshapes done on the
    values. So this checks the arithmetic (bit packing, scales, zero rows), not the layouts."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode
    except ImportError:  # pragma: no cover - depends on the installed jax
        pytest.skip("no Mosaic GPU interpret mode in this jax")
    monkeypatch.setattr(mosaic_gpu.plgpu, "layout_cast", lambda x, layout: x)
    monkeypatch.setattr(mosaic_gpu, "load", lambda ref, layout, optimized=True: ref[...])
    monkeypatch.setattr(wm, "_view", _RowView)

    def run(fn, *args):
        with force_gpu_interpret_mode():  # jitted: the ops around the kernel in one program
            return jax.tree.map(np.asarray, jax.jit(fn)(*args))

    return run


def _bytes(tree):
    return [np.asarray(a).view(np.uint8) for a in jax.tree.leaves(tree)]


@pytest.mark.parametrize("width,block", [(512, 128), (1536, 128), (1024, 256)])
def test_fp8_kernels_interpreted_give_the_xla_bytes(interpret, width, block):
    """Rows with zeros, inf, NaN and magnitudes 2^-130 .. 2^60; indices out of range."""
    x = _rows(12, width)
    enc, dec, quant = _fp8_kernels(width, block)

    @jax.jit  # the XLA references in one program (eagerly every op compiles its own)
    def references(x, index):
        ref = wire_api.gather_rows(x, jnp.where(index < 0, 12, index), wire="fp8",
                                   block_size=block)
        buf = wire_api.encode_rows(x, wire="fp8", block_size=block)
        decoded = wire_api.decode_rows(_take(buf, index), wire="fp8", width=width,
                                       block_size=block, out_dtype=BF16)
        rows = quant_xla.quantize_rows_reference(wire_api.decode_rows(
            _take(buf, index), wire="fp8", width=width, block_size=block, out_dtype=F32))
        return ref, buf, decoded, rows

    ref, buf, decoded, rows = references(x, INDEX)
    chex.assert_trees_all_equal(_bytes(interpret(enc, x, INDEX)), _bytes(ref))
    chex.assert_trees_all_equal(_bytes(interpret(dec, buf, INDEX)), _bytes(decoded))
    chex.assert_trees_all_equal(_bytes(interpret(quant, buf, INDEX)), _bytes(rows))


def test_float_kernels_interpreted_give_the_xla_bytes(interpret):
    x = _rows(12, 512, F32)
    enc = functools.partial(wm.gather_encode, fp8_wire=False, out_dtype=BF16)
    dec = functools.partial(wm.gather_decode, width=512, fp8_wire=False, out_dtype=F32)
    ref, ref_dec = jax.jit(lambda x, i: (_take(x.astype(BF16), i),  # one program, not one per op
                                         _take(_take(x.astype(BF16), i), i[::-1]).astype(F32)))(
        x, INDEX)
    chex.assert_trees_all_equal(_bytes(interpret(enc, x, INDEX)), _bytes(ref))
    chex.assert_trees_all_equal(_bytes(interpret(dec, ref, INDEX[::-1])), _bytes(ref_dec))


@pytest.mark.parametrize("r", [10, 9])
def test_local_gathers_interpreted_give_the_xla_bytes(interpret, r):
    """The two gathers where nothing is sent (out-of-range indices and slots, repeats): the
    bytes of `moe.experts.fp8_gemm`'s XLA paths."""
    x = _rows(12, 512, F32)
    index = INDEX[:r]
    got = interpret(functools.partial(wm.gather_local_rows_quantized, block_size=128), x,
                    index)
    w = jax.random.uniform(jax.random.key(4), (24,), F32)
    slot = jnp.array([23, 0, 5, -1, 24, 7, 7, 12, 1, 3], I32)[:r]

    @jax.jit  # the XLA paths on the CPU, in one program (eagerly every op compiles its own)
    def references(x, index, w, slot):
        return (fp8_gemm.rows_from_tokens(x, index, 128),
                fp8_gemm.rows_from_weighted(x, w, slot, top_k=2, wire_dtype=BF16))

    want, want_weighted = references(x, index, w, slot)
    chex.assert_trees_all_equal(_bytes(got), _bytes(want))
    got = interpret(functools.partial(wm.gather_weighted_rows_quantized, top_k=2), x, w, slot)
    chex.assert_trees_all_equal(_bytes(got), _bytes(want_weighted))
