"""The row-wise and column-wise FP8 quantizations in XLA ops: the reference every kernel
implementation (`accel_kernels.quant.triton`, `accel_kernels.quant.mosaic`) gives the same bytes
as, and what runs where no kernel does.

One power-of-two scale per row (``moe.fp8.quantize`` with ``block_size`` = the row), from
the integer scale arithmetic of :func:`moe.fp8.scales_from_amax_bits` and
round-to-nearest-even casts. :func:`scale_and_cast` and :func:`row_amax_bits` are elementwise
and row reductions only, so the Triton kernels share them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from accel_kernels import fp8
from accel_kernels.activations import GatedActivation

F8 = jnp.float8_e4m3fn
_ABS = 0x7FFFFFFF


def abs_bits(x: jax.Array) -> jax.Array:
    """int32 bits of ``|x|`` (f32): integer order is magnitude order, NaN above inf."""
    return lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(_ABS)


def scale_and_cast(parts, amax_bits):
    """Each f32 ``[bm, w]`` of ``parts`` as e4m3 with its row's power-of-two scale, and that
    scale (f32 ``[bm]``; NaN for a row holding a NaN or an infinity)."""
    byte, inv = fp8.scales_from_amax_bits(amax_bits)
    qs = [jnp.clip(p * inv[:, None], -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(F8) for p in parts]
    return qs, fp8.scale_from_byte(byte)


def row_amax_bits(*parts) -> jax.Array:
    """int32 bits of the largest ``|x|`` of each row across the f32 pieces ``parts``."""
    amax = None
    for p in parts:
        m = jnp.max(abs_bits(p), axis=-1)
        amax = m if amax is None else jnp.maximum(amax, m)
    return amax


def on_rows(fn, x, *rest):
    """``fn`` on ``x [..., K]`` (and ``rest``, sharing its leading axes) with the leading axes
    flattened into one row axis; every output's leading axis is unflattened back."""
    lead = x.shape[:-1]
    flat = [a.reshape(-1, *a.shape[len(lead):]) for a in (x, *rest)]
    return jax.tree.map(lambda o: o.reshape(*lead, *o.shape[1:]), fn(*flat))


def cast_rows(*parts):
    """:func:`scale_and_cast` of f32 row pieces ``[..., w]`` by their joint row maxima."""
    return on_rows(lambda *p: scale_and_cast(list(p), row_amax_bits(*p)), *parts)


def gated_grad_outputs(z: jax.Array, dh: jax.Array, out_dtype) -> list:
    """``(shape, dtype)`` of each output of a gated-gradient quantization kernel (``dz`` if
    ``out_dtype`` is given, then e4m3 ``dz`` and its row scales), after checking that ``dh``
    is ``[M, F']`` with ``F' >= F`` for ``z [M, 2F]``."""
    m, two_f = z.shape
    f = two_f // 2
    if dh.ndim != 2 or dh.shape[0] != m or dh.shape[1] < f:
        raise ValueError(f"dh must be [M, F'] with M = {m} and F' >= F = {f} for z {z.shape}, "
                         f"got {dh.shape}.")
    outs = [((m, two_f), F8), ((m,), jnp.float32)]
    return outs if out_dtype is None else [((m, two_f), jnp.dtype(out_dtype)), *outs]


def quantize_rows_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row-wise e4m3 quantization in XLA ops (any shape ``[..., K]``): ``(q [..., K], scale
    f32 [...])``, ``scale = 2^ceil(log2(amax / 448))`` per row,
    ``q = e4m3(clip(x / scale, -448, 448))``.

    Example:
      >>> q, s = quantize_rows_reference(jnp.full((2, 256), 3.0))
      >>> q.dtype, s.tolist()
      (dtype(float8_e4m3fn), [0.0078125, 0.0078125])
    """
    (q,), s = cast_rows(x.astype(jnp.float32))
    return q, s


def gated_quantize_rows_reference(z: jax.Array, act: GatedActivation):
    """``act(z)`` (``z [..., 2F]``, gate then up columns) quantized row-wise in XLA ops:
    `accel_kernels.quant.triton.gated_quantize_rows`' bytes."""
    g, u = jnp.split(z, 2, axis=-1)
    return quantize_rows_reference(act.apply_parts(g, u))


def gated_grad_quantize_rows_reference(z: jax.Array, dh: jax.Array, act: GatedActivation,
                                       out_dtype):
    """The activation's backward ``dz = act'(z) dh`` in ``out_dtype`` and quantized row-wise,
    in XLA ops: `accel_kernels.quant.triton.gated_grad_quantize_rows`' results (``dh`` may be
    wider than ``F``; ``out_dtype`` None: only ``(q, scale)``)."""
    g, u = jnp.split(z, 2, axis=-1)
    dg, du = act.grad_parts(g, u, dh[..., :g.shape[-1]])
    (qg, qu), s = cast_rows(dg, du)
    q = jnp.concatenate([qg, qu], axis=-1)
    if out_dtype is None:
        return q, s
    return jnp.concatenate([dg, du], axis=-1).astype(out_dtype), q, s


def quantize_cols_t_reference(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Column-wise e4m3 quantization written transposed, in XLA ops: ``a [..., M, N] ->
    (q [..., N, M], scale f32 [..., N])``, one power-of-two scale per column."""
    return quantize_rows_reference(jnp.swapaxes(a, -1, -2))


def quantize_cols_t_and_rows_reference(a: jax.Array):
    """Both FP8 copies of a weight in XLA ops: ``(quantize_cols_t_reference(a),
    quantize_rows_reference(a))``."""
    return quantize_cols_t_reference(a), quantize_rows_reference(a)
