"""One-pass row-wise FP8 quantization of the expert GEMMs' token operands (Pallas Triton).

The FP8 expert GEMMs (`moe.experts`) read every token operand as e4m3 with one power-of-two
scale per row (``moe.fp8.quantize`` with ``block_size`` = the row). XLA splits that into a
row-maximum reduction and a second pass that scales and converts, and where the operand is
itself computed (``h = act(z)``, ``dz = act'(z) dh``) each pass recomputes it from its
inputs, so the quantization passes read the operand (or its inputs) twice. These kernels do
each in one pass, a block of rows per program, the whole row in registers:

* :func:`quantize_rows`: ``x [M, K] -> (e4m3 [M, K], scale f32 [M])``;
* :func:`gated_quantize_rows`: ``z [M, 2F] -> (e4m3(act(z)) [M, F], scale [M])``, the SwiGLU
  (or other gated activation) and its quantization in one read of ``z``;
* :func:`gated_grad_quantize_rows`: ``(z [M, 2F], dh [M, F]) -> (dz [M, 2F], e4m3(dz),
  scale)``, the activation's backward giving ``dz`` in the compute dtype (for a bf16 weight
  gradient) and quantized (for the FP8 data gradient) from one read of ``z`` and ``dh``.

The bytes equal the XLA references of `accel_kernels.quant.xla` (the same integer scale
arithmetic, :func:`moe.fp8.scales_from_amax_bits`, and round-to-nearest-even casts), which is
what runs off NVIDIA GPUs and what the tests compare the kernels against in interpret mode;
`accel_kernels.quant.api` chooses between them.
Row widths (``K``, ``F``) must be multiples of 16 (:func:`supported`); a row is loaded as its
power-of-two pieces (Triton block shapes: 1408 = 1024 + 256 + 128).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from accel_kernels import fp8, triton_gpu
from accel_kernels.activations import GatedActivation
from accel_kernels.quant import xla as quant_xla
from accel_kernels.quant.xla import abs_bits, row_amax_bits, scale_and_cast
from accel_kernels.triton_gpu import PALLAS_IMPORT_ERROR, pl
from accel_kernels.triton_gpu import plgpu as _plgpu

F8 = jnp.float8_e4m3fn
_ELEMS_PER_PROGRAM = 8192  # row elements per program (x bf16: 16 KiB read)


def supported(width: int) -> bool:
    """Whether rows of ``width`` channels can use these kernels (a multiple of 16)."""
    return PALLAS_IMPORT_ERROR is None and width >= 16 and width % 16 == 0


def _chunks(width: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of the power-of-two pieces of a row (Triton block shapes): its
    binary decomposition, largest first (1408 = 1024 + 256 + 128)."""
    out, off = [], 0
    for bit in reversed(range(width.bit_length())):
        if width >> bit & 1:
            out.append((off, 1 << bit))
            off += 1 << bit
    return out


# ----------------------------------------------------------------------------------------------
# Kernels: grid over row blocks, the whole row of a block in registers.
# ----------------------------------------------------------------------------------------------


def _rows(i, bm):
    return pl.ds(pl.multiple_of(i * bm, bm), bm)


def _load(ref, rows, start, width):
    """The row block's ``width`` channels from ``start``, as power-of-two f32 pieces."""
    return [_plgpu.load(ref.at[rows, pl.ds(start + off, size)]).astype(jnp.float32)
            for off, size in _chunks(width)]


def _store(ref, rows, start, width, pieces):
    for (off, size), piece in zip(_chunks(width), pieces, strict=True):
        _plgpu.store(ref.at[rows, pl.ds(start + off, size)], piece.astype(ref.dtype))


def _quantize_kernel(x_ref, q_ref, s_ref, *, bm, width):
    rows = _rows(pl.program_id(0), bm)
    x = _load(x_ref, rows, 0, width)
    q, s = scale_and_cast(x, row_amax_bits(*x))
    _store(q_ref, rows, 0, width, q)
    _plgpu.store(s_ref.at[rows], s)


def _gated_kernel(z_ref, q_ref, s_ref, *, bm, width, act):
    rows = _rows(pl.program_id(0), bm)
    h = [act.apply_parts(g, u) for g, u in zip(_load(z_ref, rows, 0, width),
                                                _load(z_ref, rows, width, width), strict=True)]
    q, s = scale_and_cast(h, row_amax_bits(*h))
    _store(q_ref, rows, 0, width, q)
    _plgpu.store(s_ref.at[rows], s)


def _gated_grad_kernel(z_ref, dh_ref, *out_refs, bm, width, act):
    *dz_ref, q_ref, s_ref = out_refs  # dz_ref: [] when only the FP8 copy is wanted
    rows = _rows(pl.program_id(0), bm)
    parts = [act.grad_parts(g, u, dh) for g, u, dh in zip(
        _load(z_ref, rows, 0, width), _load(z_ref, rows, width, width),
        _load(dh_ref, rows, 0, width), strict=True)]
    dg, du = [p[0] for p in parts], [p[1] for p in parts]
    q, s = scale_and_cast(dg + du, row_amax_bits(*dg, *du))
    n = len(dg)
    for start, d, qq in ((0, dg, q[:n]), (width, du, q[n:])):
        if dz_ref:
            _store(dz_ref[0], rows, start, width, d)
        _store(q_ref, rows, start, width, qq)
    _plgpu.store(s_ref.at[rows], s)


def block_rows(m: int, width: int) -> int:
    """Rows per program: ``8192 / width`` rounded down to a power of two (at least 1), halved
    until it divides ``m``."""
    bm = 1 << max(0, (_ELEMS_PER_PROGRAM // width).bit_length() - 1)
    while m % bm:
        bm //= 2
    return bm


def _launch(kernel, operands, outs, *, m, width, interpret, name, **kw):
    """``kernel`` over ``m // bm`` programs of ``bm`` rows (:func:`block_rows`)."""
    bm = block_rows(m, width)
    return triton_gpu.launch(functools.partial(kernel, bm=bm, width=width, **kw), operands, outs,
                             grid=m // bm, name=name, interpret=interpret,
                             num_warps=4 if bm * width <= 4096 else 8)


def _check(x: jax.Array, width: int, what: str) -> None:
    if x.ndim != 2 or not supported(width):
        raise ValueError(f"{what} must be 2-D with a row width that is a multiple of 16 for the "
                         f"Pallas quantization kernels, got shape {x.shape}; use the "
                         "references of accel_kernels.quant.xla for other shapes.")


def quantize_rows(x: jax.Array, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Row-wise e4m3 quantization in one pass: ``(q [M, K], scale f32 [M])``.

    ``scale = 2^ceil(log2(amax / 448))`` per row (``moe.fp8.quantize`` with one block per
    row), ``q = e4m3(clip(x / scale, -448, 448))``; ``x ~= q * scale[:, None]``.

    Args:
      x: float ``[M, K]``, ``K`` a multiple of 16.
      interpret: Pallas interpret mode (any backend, slow).

    Returns:
      ``(q float8_e4m3fn [M, K], scale float32 [M])``.

    Example:
      >>> q, s = quantize_rows(jnp.full((2, 256), 3.0), interpret=True)
      >>> q.dtype, s.tolist()
      (dtype(float8_e4m3fn), [0.0078125, 0.0078125])
    """
    m, k = x.shape
    _check(x, k, "x")
    return _launch(_quantize_kernel, (x,), (((m, k), F8), ((m,), jnp.float32)), m=m,
                   width=k, interpret=interpret, name="fp8_quantize_rows")


def gated_quantize_rows(z: jax.Array, act: GatedActivation, *,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``h = act(z)`` quantized row-wise, one read of ``z``: ``(q [M, F], scale [M])``.

    Args:
      z: float ``[M, 2F]`` (gate columns then up columns), ``F`` a multiple of 16.
      act: the gated activation.
      interpret: Pallas interpret mode.

    Returns:
      As :func:`quantize_rows` for ``act.apply(z)`` (computed in f32, not rounded first).

    Example:
      >>> q, s = gated_quantize_rows(jnp.ones((2, 64)), GatedActivation("silu"),
      ...                            interpret=True)
      >>> q.shape, s.shape
      ((2, 32), (2,))
    """
    m, two_f = z.shape
    _check(z, two_f // 2, "z")
    f = two_f // 2
    return _launch(_gated_kernel, (z,), (((m, f), F8), ((m,), jnp.float32)), m=m, width=f,
                   interpret=interpret, name="fp8_gated_quantize_rows", act=act)


def gated_grad_quantize_rows(z: jax.Array, dh: jax.Array, act: GatedActivation, *,
                             out_dtype=jnp.bfloat16, interpret: bool = False):
    """The activation's backward ``dz = act'(z) dh`` in ``out_dtype`` and quantized row-wise.

    One read of ``z`` and ``dh``; ``dz`` is computed in f32, then cast (the first output) and
    quantized from f32 (the second and third), so the FP8 copy is not rounded twice.

    Args:
      z: float ``[M, 2F]``, ``F`` a multiple of 16.
      dh: float ``[M, F']``, ``F' >= F``: the cotangent of ``h = act(z)`` in its first ``F``
        columns (the rest, e.g. a GEMM kernel's padding, is not read).
      act: the gated activation.
      out_dtype: dtype of the unquantized ``dz``; None: only the quantized copy (when no
        GEMM reads ``dz`` in a wide type).
      interpret: Pallas interpret mode.

    Returns:
      ``(dz out_dtype [M, 2F], q float8_e4m3fn [M, 2F], scale float32 [M])``; ``(q, scale)``
      if ``out_dtype`` is None.

    Example:
      >>> dz, q, s = gated_grad_quantize_rows(jnp.ones((2, 64)), jnp.ones((2, 32)),
      ...                                     GatedActivation("silu"), interpret=True)
      >>> dz.shape, q.dtype, s.shape
      ((2, 64), dtype(float8_e4m3fn), (2,))
    """
    m, two_f = z.shape
    f = two_f // 2
    _check(z, f, "z")
    outs = quant_xla.gated_grad_outputs(z, dh, out_dtype)
    return _launch(_gated_grad_kernel, (z, dh), outs, m=m, width=f, interpret=interpret,
                   name="fp8_gated_grad_quantize_rows", act=act)


# ----------------------------------------------------------------------------------------------
# Column-wise quantization into the transposed (K-major) layout: the weights for the forward
# GEMM.
# ----------------------------------------------------------------------------------------------

COL_TILE = (64, 64)  # (rows, columns) of a program's tile in both passes


def cols_supported(m: int, n: int) -> bool:
    """Whether ``[..., m, n]`` fits the column kernels' tiles."""
    bm, bn = COL_TILE
    return PALLAS_IMPORT_ERROR is None and m % bm == 0 and n % bn == 0


def _tile(b, i, j, bm, bn):
    return b, pl.ds(pl.multiple_of(i * bm, bm), bm), pl.ds(pl.multiple_of(j * bn, bn), bn)


def _col_amax_kernel(a_ref, o_ref, *, bm, bn):
    b, rows, cols = _tile(*(pl.program_id(i) for i in range(3)), bm, bn)
    x = _plgpu.load(a_ref.at[b, rows, cols]).astype(jnp.float32)
    _plgpu.store(o_ref.at[b, pl.program_id(1), cols], jnp.max(abs_bits(x), axis=0))


def _cols_t_kernel(a_ref, bits_ref, q_ref, *, bm, bn):
    b, rows, cols = _tile(*(pl.program_id(i) for i in range(3)), bm, bn)
    x = _plgpu.load(a_ref.at[b, rows, cols]).astype(jnp.float32)
    _, inv = fp8.scales_from_amax_bits(_plgpu.load(bits_ref.at[b, cols]))
    q = jnp.clip(x * inv[None, :], -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(F8)
    _plgpu.store(q_ref.at[b, cols, rows], q.T)


def _scale_of(bits: jax.Array) -> jax.Array:
    """The f32 power-of-two scales of blocks whose ``|amax|`` has int32 bits ``bits``."""
    return fp8.scale_from_byte(fp8.scales_from_amax_bits(bits)[0])


def _tile_passes(a: jax.Array, passes, *, interpret: bool, reference: str):
    """``passes(call, a)`` over ``a [B, M, N]``'s ``COL_TILE`` tiles: ``call(kernel, name,
    out, *ops)`` launches ``kernel`` with one program per tile and output ``out``, a
    ``(shape, dtype)`` or a tuple of them (interpreted where asked)."""
    if a.ndim != 3 or not cols_supported(*a.shape[1:]):
        raise ValueError(f"a must be [B, M, N] with M and N multiples of {COL_TILE}, got "
                         f"{a.shape}; use {reference} for other shapes.")
    nb, m, n = a.shape
    bm, bn = COL_TILE

    def call(kernel, name, out, *ops):
        several = isinstance(out[1], tuple)
        got = triton_gpu.launch(functools.partial(kernel, bm=bm, bn=bn), ops,
                                out if several else (out,), grid=(nb, m // bm, n // bn),
                                name=name, interpret=interpret, num_warps=4)
        return got if several else got[0]

    return passes(call, a)


def quantize_cols_t(a: jax.Array, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Column-wise e4m3 quantization written transposed: ``(q [B, N, M], scale f32 [B, N])``.

    ``q[b] = e4m3(a[b]^T / scale[b][:, None])`` with one power-of-two scale per column of
    ``a[b]`` (over its ``M`` rows): the K-major copy a FP8 GEMM contracting ``M`` reads
    (``moe.fp8.quantize(swapaxes(a, 1, 2), block_size=M)``, the same bytes). Two passes over
    ``a``, each tile-parallel: the column maxima of every ``[64, 64]`` tile, then the scaled,
    cast and transposed tiles, at a higher bandwidth than XLA's transpose fusion and column
    reduction reach on these bytes.

    Args:
      a: float ``[B, M, N]``, ``M`` and ``N`` multiples of 64.
      interpret: Pallas interpret mode.

    Returns:
      ``(q float8_e4m3fn [B, N, M], scale float32 [B, N])``.

    Example:
      >>> q, s = quantize_cols_t(jnp.ones((1, 64, 128)).at[0, 3, 5].set(8.0), interpret=True)
      >>> q.shape, float(s[0, 5]), float(s[0, 0])
      ((1, 128, 64), 0.03125, 0.00390625)
    """
    def passes(call, a):
        nb, m, n = a.shape
        part = call(_col_amax_kernel, "fp8_col_amax", ((nb, m // COL_TILE[0], n), jnp.int32), a)
        bits = jnp.max(part, axis=1)
        q = call(_cols_t_kernel, "fp8_quantize_cols_t", ((nb, n, m), F8), a, bits)
        return q, _scale_of(bits)

    return _tile_passes(a, passes, interpret=interpret,
                        reference="accel_kernels.quant.xla.quantize_cols_t_reference")


def _both_amax_kernel(a_ref, col_ref, row_ref, *, bm, bn):
    b, rows, cols = _tile(*(pl.program_id(i) for i in range(3)), bm, bn)
    bits = abs_bits(_plgpu.load(a_ref.at[b, rows, cols]).astype(jnp.float32))
    _plgpu.store(col_ref.at[b, pl.program_id(1), cols], jnp.max(bits, axis=0))
    _plgpu.store(row_ref.at[b, rows, pl.program_id(2)], jnp.max(bits, axis=1))


def _both_kernel(a_ref, col_bits_ref, row_bits_ref, qt_ref, q_ref, *, bm, bn):
    b, rows, cols = _tile(*(pl.program_id(i) for i in range(3)), bm, bn)
    x = _plgpu.load(a_ref.at[b, rows, cols]).astype(jnp.float32)
    _, inv_c = fp8.scales_from_amax_bits(_plgpu.load(col_bits_ref.at[b, cols]))
    _, inv_r = fp8.scales_from_amax_bits(_plgpu.load(row_bits_ref.at[b, rows]))
    qt = jnp.clip(x * inv_c[None, :], -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(F8)
    _plgpu.store(qt_ref.at[b, cols, rows], qt.T)
    q = jnp.clip(x * inv_r[:, None], -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(F8)
    _plgpu.store(q_ref.at[b, rows, cols], q)


def quantize_cols_t_and_rows(a: jax.Array, *, interpret: bool = False):
    """Both FP8 copies of a weight from two passes over it: :func:`quantize_cols_t` (one
    scale per column, written transposed) and :func:`quantize_rows` (one scale per row).

    A weight ``W [E, K, N]`` is read by the forward GEMM contracting ``K`` (K-major copy, a
    scale per output channel) and by the data-gradient GEMM contracting ``N`` (row copy, a
    scale per ``K`` row). Made apart, they take three reads of ``W`` (the column maxima, the
    column pass, the row pass); here the first pass takes every tile's column and row maxima
    and the second writes both copies from one read of each tile. The bytes equal the two
    functions'.

    Args:
      a: float ``[B, M, N]``, ``M`` and ``N`` multiples of 64.
      interpret: Pallas interpret mode.

    Returns:
      ``((q_t float8_e4m3fn [B, N, M], scale f32 [B, N]), (q float8_e4m3fn [B, M, N],
      scale f32 [B, M]))``.

    Example:
      >>> (qt, sc), (q, sr) = quantize_cols_t_and_rows(
      ...     jnp.ones((1, 64, 128)).at[0, 3, 5].set(8.0), interpret=True)
      >>> qt.shape, q.shape, float(sc[0, 5]), float(sr[0, 3]), float(sr[0, 0])
      ((1, 128, 64), (1, 64, 128), 0.03125, 0.03125, 0.00390625)
    """
    def passes(call, a):
        nb, m, n = a.shape
        bm, bn = COL_TILE
        col, row = call(_both_amax_kernel, "fp8_weight_amax",
                        (((nb, m // bm, n), jnp.int32), ((nb, m, n // bn), jnp.int32)), a)
        col_bits, row_bits = jnp.max(col, axis=1), jnp.max(row, axis=2)
        qt, q = call(_both_kernel, "fp8_weight_quantize", (((nb, n, m), F8), ((nb, m, n), F8)),
                     a, col_bits, row_bits)
        return (qt, _scale_of(col_bits)), (q, _scale_of(row_bits))

    return _tile_passes(a, passes, interpret=interpret,
                        reference="accel_kernels.quant.xla.quantize_cols_t_and_rows_reference")
