"""Pallas Mosaic GPU plumbing every kernel family here shares: the guarded import, loads across
jax versions, launching a grid of one-warpgroup CTAs, register layouts of rows, and e4m3 with
power-of-two scales computed in registers.

The kernels of `accel_kernels.gmm`, `accel_kernels.symmetric`, `accel_kernels.quant` and
`accel_kernels.wire` are written on these; the wgmma tile pipeline of the GEMM-like kernels is
`accel_kernels.mosaic_tiles`. Nothing here runs off an NVIDIA Hopper GPU: the registries lower
these kernels only for CUDA and take XLA paths elsewhere, and on a jax where the Mosaic GPU
import fails :data:`MOSAIC_IMPORT_ERROR` says why and every kernel reports itself unsupported.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax

from accel_kernels import fp8, lowering, vma

try:  # Mosaic GPU ships with jax; keep CPU-only imports safe.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    MOSAIC_IMPORT_ERROR: str | None = None
except Exception as e:  # pragma: no cover - depends on the installed jax
    pl = plgpu = None
    MOSAIC_IMPORT_ERROR = f"{type(e).__name__}: {e}"

F8 = jnp.float8_e4m3fn
WARPS = 4
"""Warps of a warpgroup: a row kernel's CTA holds one row per warp."""

DEFAULT_SMS = 132
"""SMs of a Hopper SXM part: the persistent kernels' grid when no GPU is present to ask (a
program compiled on a CPU for a GPU target)."""

_ABS = 0x7FFFFFFF


def num_sms() -> int:
    """Streaming multiprocessors of the default GPU, or :data:`DEFAULT_SMS` without one."""
    try:  # pragma: no cover - GPU only
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(dev.core_count)
    except Exception:  # pragma: no cover
        pass
    return DEFAULT_SMS


def smem_transforms(minor_elems: int, dtype) -> tuple:
    """Tiling + swizzle of a shared-memory block whose minor dimension has ``minor_elems``."""
    bits = minor_elems * jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(bits)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def transposed(ref):
    """A transposed view of a 2-D shared-memory ref (the API moved between jax versions)."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return plgpu.transpose_ref(ref, (1, 0))  # pragma: no cover - older jax


def _idx_required() -> bool:
    try:
        idx = inspect.signature(plgpu.load).parameters.get("idx")
    except (TypeError, ValueError, AttributeError):  # pragma: no cover
        return True
    return idx is not None and idx.default is inspect.Parameter.empty


_LOAD_IDX_REQUIRED = plgpu is not None and _idx_required()


def load(ref, *, layout, optimized: bool = True) -> jax.Array:
    """``plgpu.load`` of a whole ref view in ``layout``: jax <= 0.10 takes the index as a
    positional argument, jax 0.11 deprecates it (index the ref with ``.at`` instead)."""
    if _LOAD_IDX_REQUIRED:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def load_raw(ref, layout) -> jax.Array:
    """Registers of a global-memory ``ref`` view in ``layout``, in its own dtype (integer bits
    stay bits); unoptimized, as row kernels' strided views need."""
    return load(ref, layout=layout, optimized=False)


def load_f32(ref, layout) -> jax.Array:
    """:func:`load_raw` as f32."""
    return load_raw(ref, layout).astype(jnp.float32)


def ds(start, size):
    """``pl.ds(start, size)``, a traced ``start`` marked a multiple of ``size``."""
    if not isinstance(start, int):
        start = pl.multiple_of(start, size)
    return pl.ds(start, size)


def vector_length(width: int, itemsize: int) -> int:
    """Elements per lane vector: up to 16 bytes of the input, dividing ``width / 32``."""
    vec = 16 // itemsize
    while width % (32 * vec):
        vec //= 2
    return vec


def row_layout(vec: int):
    """``[rows, width]`` registers: warp ``w`` holds rows ``w mod 4``, lane ``l`` the ``vec``
    columns at ``32 vec j + vec l`` for every ``j``."""
    return plgpu.Layout.TILED(plgpu.Tiling(((WARPS, 32 * vec), (vec,))),
                              warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)


def sigmoid(x: jax.Array) -> jax.Array:
    """The logistic function from ``exp`` (Mosaic GPU has no ``logistic`` rule)."""
    return 1.0 / (1.0 + jnp.exp(-x))


def abs_bits(x: jax.Array) -> jax.Array:
    """int32 bits of ``|x|`` (f32): integer order is magnitude order, NaN above inf."""
    return lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(_ABS)


def broadcast(v: jax.Array, shape: tuple[int, ...], layout) -> jax.Array:
    """``v`` (``[shape[0]]`` or a scalar) broadcast over ``shape`` in ``layout``."""
    return plgpu.layout_cast(lax.broadcast_in_dim(v, shape, [0] if v.ndim else []), layout)


def scaled_e4m3(parts, layout, *, axes: tuple[int, ...] = (1,)):
    """``parts`` (f32, one shape) as e4m3 with one power-of-two scale per maximum over
    ``axes`` (``(1,)``: per row of ``[rows, w]``; ``(0, 1)``: one for all), joint over the
    parts, and those scales (f32): the bytes of :func:`accel_kernels.fp8.quantize` on the
    same blocks."""
    amax = None
    for p in parts:
        m = abs_bits(p)
        for ax in sorted(axes, reverse=True):
            m = jnp.max(m, axis=ax)
        amax = m if amax is None else jnp.maximum(amax, m)
    byte, inv = fp8.scales_from_amax_bits(amax)
    inv = broadcast(inv, parts[0].shape, layout)
    qs = [jnp.clip(p * inv, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(F8) for p in parts]
    return qs, fp8.scale_from_byte(byte)


def store_small(value: jax.Array, dst, smem) -> None:
    """``dst[...] = value`` for a small vector (a CTA's per-row scales or maxima) through the
    SMEM scratch ``smem`` and a TMA copy.

    A direct store would write a few words per warp, not whole 32-byte sectors, which jax's
    transfer planner rejects (jax >= 0.12); a TMA copy needs only 16-byte multiples.
    """
    smem[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def call_kernel(body, operands, outs, *, name: str, avoid: str, varying: frozenset,
                **kernel_args) -> tuple[jax.Array, ...]:
    """``body`` as a ``plgpu.kernel`` named ``name`` (its name in traces and lowered modules)
    called on ``operands``; ``outs``: ``(shape, dtype)`` of each output, varying over the mesh
    axes ``varying`` inside a check_vma ``shard_map``; ``kernel_args``: the grid, scratch and
    compiler parameters of ``plgpu.kernel``. It first checks that the kernel lowers on this jax
    (:func:`accel_kernels.lowering.check_kernel_lowers`, a no-op on the tested versions),
    naming ``avoid``, the option that keeps callers off it, if it does not."""

    def named(*refs):
        body(*refs)

    named.__name__ = name

    def kernel(varying):
        return plgpu.kernel(
            named, out_type=tuple(vma.out_struct(s, d, varying) for s, d in outs),
            **kernel_args)

    lowering.check_kernel_lowers(name, kernel(frozenset()), operands, avoid=avoid)
    out = kernel(varying)(*operands)
    return tuple(vma.as_varying(o, varying) for o in out)


def launch(body, operands, outs, *, grid: int | tuple[int, ...], name: str, avoid: str,
           grid_names: tuple[str, ...] = ("rows",), scratch=()) -> tuple[jax.Array, ...]:
    """``body`` over ``grid`` one-warpgroup CTAs (``lax.axis_index(grid_names[i])``) in lane
    semantics (:func:`call_kernel`); ``scratch``: SMEM scratch types, passed to ``body`` after
    the outputs."""
    return call_kernel(
        body, operands, outs, name=name, avoid=avoid, varying=vma.varying_of(*operands),
        scratch_types=tuple(scratch), grid=grid if isinstance(grid, tuple) else (grid,),
        grid_names=grid_names,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
