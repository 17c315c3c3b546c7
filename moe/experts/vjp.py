"""The gated experts' custom VJP: forward and hand-written backward on one layout.

:func:`experts` runs ``y = act(x @ W_gu) @ W_d`` per group of rows (ragged ``[R, d]`` with
group sizes, or padded ``[E, C, d]``) on one implementation of `accel_kernels.gmm.api`, each
of its six GEMMs at the precision its :class:`Call`'s options ask for (`moe.experts.fp8_gemm`),
and keeps for the backward what ``save_z`` says. `moe.experts.run_experts` brings other
layouts (plain ragged rows for the aligned kernels, padded slots as rows) to this one; the
options reach it resolved, as the caller passed them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from accel_kernels import fp8
from accel_kernels.gmm import api as gmm_api
from accel_kernels.quant import api as quant_api
from moe.experts import fp8_gemm
from moe.options import ExpertOptions

__all__ = ["Call", "backward", "experts", "experts_chained", "forward"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Call:
    """The static options of one experts call (hashable: the custom_vjp's nondiff arg): the
    caller's resolved :class:`moe.ExpertOptions`, as it is, and what the layout adds to it."""

    experts: ExpertOptions  # gemm_implementation resolved (never 'auto')
    fp8_block_size: int  # channels per scale of save_z='fp8'
    mask_rows: bool  # False only for padded x without group_sizes (every row is real)


def _gemms(call: Call, a) -> gmm_api.GroupedGemms:
    """The GEMMs of the resolved implementation for the token operand ``a`` (an array, or an FP8
    pair whose first leaf is the payload in the token layout)."""
    return gmm_api.gemms(call.experts.gemm_implementation, jax.tree.leaves(a)[0].ndim)


def _matmul(call: Call, precision: str, a, w, gs, out_dtype):
    return fp8_gemm.forward(_gemms(call, a), precision, a, w, gs, out_dtype)


def _matmul_t(call: Call, a, w, gs, out_dtype, *, trim: bool = True):
    return fp8_gemm.dgrad(_gemms(call, a), call.experts.dgrad_dtype, a, w, gs, out_dtype,
                           trim=trim)


def _wgrad(call: Call, a, g, gs, out_dtype, acc=None):
    return fp8_gemm.wgrad(_gemms(call, a), call.experts.wgrad_dtype, a, g, gs, out_dtype, acc)


def _gate_up(call: Call, x, gs: jax.Array, w_gate_up: jax.Array,
             b_gate_up: jax.Array | None, dtype) -> jax.Array:
    """z = x @ W_gate_up (+ b_gate_up) per expert, rounded to the compute dtype (the
    saved/recomputed z); ``x`` may be its row-quantized pair for an FP8 GEMM."""
    with jax.named_scope("experts_gate_up"):
        z = _matmul(call, call.experts.gemm_dtype, x, w_gate_up, gs, dtype)
    if b_gate_up is None:
        return z
    return (z.astype(jnp.float32) + _bias_rows(b_gate_up, gs, z.shape)).astype(z.dtype)


def _bias_rows(b: jax.Array, gs: jax.Array, shape) -> jax.Array:
    """The per-expert bias ``b [E, N]`` of every row, f32: ragged rows get their group's row
    (0 past ``sum(gs)``), padded ``[E, C, N]`` rows broadcast their expert's."""
    b = b.astype(jnp.float32)
    if len(shape) == 3:
        return b[:, None, :]
    rows = gmm_api.group_of_rows(gmm_api.sizes_of(gs), shape[0])
    return jnp.take(b, rows, axis=0, mode="fill", fill_value=0)


def _bias_grad(dz: jax.Array, gs: jax.Array, out_dtype) -> jax.Array:
    """Per-expert sums of ``dz`` over the rows (the bias gradient); padding rows carry 0."""
    dz = dz.astype(jnp.float32)
    if dz.ndim == 3:
        return dz.sum(axis=1).astype(out_dtype)
    gs = gmm_api.sizes_of(gs)
    rows = gmm_api.group_of_rows(gs, dz.shape[0])
    return jax.ops.segment_sum(dz, rows, num_segments=gs.shape[0]).astype(out_dtype)


def _mask_rows(call: Call, a: jax.Array, gs: jax.Array) -> jax.Array:
    """Zero the padding rows of a token operand (ragged: index >= sum(gs); padded: c >= gs[e]).

    The Mosaic kernels neither read those rows nor write anything but zeros for them (whole
    padding tiles), so on CUDA the 'mosaic' implementation skips the copy; its XLA emulation
    (``ragged_dot``, elsewhere) masks.
    """
    if not call.mask_rows:
        return a

    def mask(a, gs):
        if a.ndim == 2:
            valid = (jnp.arange(a.shape[0]) < jnp.sum(gs))[:, None]
        else:
            valid = (jnp.arange(a.shape[1])[None, :] < gs[:, None])[..., None]
        return jnp.where(valid, a, jnp.zeros((), a.dtype))

    if call.experts.gemm_implementation == "mosaic":
        return jax.lax.platform_dependent(a, gs, cuda=lambda a, gs: a, default=mask)
    return mask(a, gs)


def _forward(call: Call, x, gs, w_gate_up, w_down, b_gate_up, x_q, w_q=None):
    """Returns (y, z, x_in, h): x_in and h as the two GEMMs took them (the masked x, and
    ``act(z)``; their row-quantized pairs for FP8 GEMMs: ``x_q`` if given, which must equal
    ``rows(masked x)``). ``w_q``: the weights' forward FP8 copies if made elsewhere
    (`moe.experts.fp8_gemm.weights`). Padding rows of x are zeroed, so they give y = 0 on every
    implementation (without ``b_gate_up``; ``gated_experts`` zeroes them when there are biases)."""
    x = _mask_rows(call, x, gs)
    if call.experts.gemm_dtype != "fp8":
        x_in = x
    else:
        x_in = fp8_gemm.rows(x) if x_q is None else x_q
    w_gu, w_d = (w_gate_up, w_down) if w_q is None else w_q
    z = _gate_up(call, x_in, gs, w_gu, b_gate_up, x.dtype)
    if call.experts.gemm_dtype == "fp8":  # h quantized as it is computed (one read of z)
        h = quant_api.gated_rows(z, call.experts.activation)
    else:
        h = call.experts.activation.apply(z).astype(x.dtype)
    with jax.named_scope("experts_down"):
        y = _matmul(call, call.experts.gemm_dtype, h, w_d, gs, x.dtype)
    return y, z, x_in, h


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def experts(call: Call, x, gs, w_gate_up, w_down, b_gate_up, x_q=None) -> jax.Array:
    """``x_q``: x's row-quantized pair made elsewhere (from the FP8 wire), or None; it takes
    no gradient (x does). When only FP8 GEMMs read x, XLA drops the computation of x."""
    return _forward(call, x, gs, w_gate_up, w_down, b_gate_up, x_q)[0]


def forward(call: Call, x, gs, w_gate_up, w_down, b_gate_up, x_q=None):
    """``(y, residuals)``: ``experts``' forward and what :func:`backward` reads."""
    return _experts_fwd(call, x, gs, w_gate_up, w_down, b_gate_up, x_q)


def _experts_fwd(call: Call, x, gs, w_gate_up, w_down, b_gate_up, x_q=None):
    # FP8 forward and data-gradient GEMMs: both FP8 copies of each weight from two passes
    # over it, the data gradient's kept for the backward (one byte per weight, which a
    # memory-saving save_z='recompute' does not spend: its backward quantizes again).
    w_q = w_dgrad = None
    experts = call.experts
    if experts.gemm_dtype == experts.dgrad_dtype == "fp8" and experts.save_z != "recompute":
        (gu_f, gu_d), (d_f, d_d) = fp8_gemm.weights(w_gate_up), fp8_gemm.weights(w_down)
        w_q, w_dgrad = (gu_f, d_f), (gu_d, d_d)
    y, z, x_in, h = _forward(call, x, gs, w_gate_up, w_down, b_gate_up, x_q, w_q)
    if call.experts.save_z == "recompute":
        z_saved = None
    elif call.experts.save_z == "fp8":
        z_saved = fp8.quantize(z, block_size=call.fp8_block_size)
    else:
        z_saved = z
    # With FP8 forward and weight-gradient GEMMs the backward reads x and h only as the e4m3
    # rows the forward made: keep those (one byte per element) instead of x, and h's rather
    # than recomputing them from z (unless nothing of z is kept either).
    fp8_only = call.experts.gemm_dtype == call.experts.wgrad_dtype == "fp8"
    x_saved = x_in if fp8_only else x
    h_saved = h if fp8_only and call.experts.save_z != "recompute" else None
    return y, (x_saved, gs, w_gate_up, w_down, b_gate_up, z_saved, h_saved, w_dgrad)


def _experts_bwd(call: Call, res, dy):
    return backward(call, res, dy, dy.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def experts_chained(call: Call, x, gs, w_gate_up, w_down, b_gate_up, x_q=None):
    """``(experts(...), w_gate_up, w_down)``: the weights pass through, so that a later call
    (the layer's next chunk) takes them from here and their cotangent comes back into this
    call's backward, whose weight-gradient GEMMs add it to their own (in the kernel where the
    implementation's does: `accel_kernels.gmm.base.GroupedGemms.accumulates`) instead of XLA adding
    the two banks afterwards."""
    return experts(call, x, gs, w_gate_up, w_down, b_gate_up, x_q), w_gate_up, w_down


def _chained_fwd(call: Call, x, gs, w_gate_up, w_down, b_gate_up, x_q=None):
    y, res = _experts_fwd(call, x, gs, w_gate_up, w_down, b_gate_up, x_q)
    return (y, w_gate_up, w_down), res


def _chained_bwd(call: Call, res, cts):
    dy, d_gate_up, d_down = cts
    return backward(call, res, dy, dy.dtype, acc=(d_gate_up, d_down))


experts_chained.defvjp(_chained_fwd, _chained_bwd)


def backward(call: Call, res, dy, dtype, dy_q=None, acc=None):
    """The backward from :func:`forward`'s residuals ``res`` and y's cotangent ``dy`` (of
    ``dtype``, y's), or with FP8 data- and weight-gradient GEMMs only its row-quantized pair
    ``dy_q`` (``dy`` None; zero on padding rows), made where ``dy`` is gathered
    (`moe.experts.fused_combine`). ``acc``: None, or ``(d_gate_up, d_down)`` that the weight
    gradients are added to (:func:`experts_chained`). Returns the cotangents of ``experts``'
    arguments."""
    acc_gate_up, acc_down = (None, None) if acc is None else acc
    x, gs, w_gate_up, w_down, b_gate_up, z_saved, h, w_dgrad = res
    w_gu_t, w_d_t = (w_gate_up, w_down) if w_dgrad is None else w_dgrad
    if not isinstance(x, tuple):
        x = _mask_rows(call, x, gs)  # x is saved as passed in (no copy), masked again here
    if call.experts.save_z == "recompute":
        z = _gate_up(call, x, gs, w_gate_up, b_gate_up, dtype)
    elif call.experts.save_z == "fp8":
        z = fp8.dequantize(z_saved, dtype=dtype)
    else:
        z = z_saved
    fp8_dgrad, fp8_wgrad = call.experts.dgrad_dtype == "fp8", call.experts.wgrad_dtype == "fp8"
    # The Pallas kernel makes dz from dh (gated_grad_rows): it reads the FP8 GEMM's result
    # as the kernel wrote it, zero columns past d_ff included (slicing them off would be a
    # copy of dh), and in the compute dtype when it writes only dz's e4m3 rows (rounding dh
    # to bf16 is 2^-9 of a value that is then rounded to e4m3's 2^-4).
    dz_kernel = fp8_dgrad and b_gate_up is None
    dh_dtype = dtype if dz_kernel and fp8_wgrad else jnp.float32
    if dy_q is None:
        dy = _mask_rows(call, dy.astype(dtype), gs)
        dy_q = fp8_gemm.rows_if(fp8_dgrad or fp8_wgrad, dy)
    elif not fp8_dgrad or not fp8_wgrad:
        raise ValueError("dy_q: only FP8 data- and weight-gradient GEMMs read dy as e4m3 rows "
                         "alone.")
    with jax.named_scope("experts_down_dgrad"):
        dh = _matmul_t(call, dy_q if fp8_dgrad else dy, w_d_t, gs, dh_dtype,
                       trim=not dz_kernel)
    # h for the weight gradient: the forward's e4m3 rows, or recomputed from z (quantized in
    # the same read for an FP8 GEMM).
    if h is None and fp8_wgrad:
        h = quant_api.gated_rows(z, call.experts.activation)
    elif h is None:
        h = call.experts.activation.apply(z).astype(dtype)
    with jax.named_scope("experts_down_wgrad"):
        dw_down = _wgrad(call, h, dy_q if fp8_wgrad else dy, gs, w_down.dtype, acc_down)
    if dz_kernel:
        # dz quantized (and in the compute dtype if a bf16 GEMM reads it) from one read of z
        # and dh.
        if fp8_wgrad:
            dz, dz_q = None, quant_api.gated_grad_rows(z, dh, call.experts.activation, None)
        else:
            dz, *dz_q = quant_api.gated_grad_rows(z, dh, call.experts.activation, dtype)
            dz_q = tuple(dz_q)
    else:
        dz32 = call.experts.activation.grad(z, dh)
        dz = dz32.astype(dtype)
        dz_q = fp8_gemm.rows_if(fp8_dgrad or fp8_wgrad, dz)
    with jax.named_scope("experts_gate_up_dgrad"):
        dx = _matmul_t(call, dz_q if fp8_dgrad else dz, w_gu_t, gs, dtype)
    with jax.named_scope("experts_gate_up_wgrad"):
        dw_gate_up = _wgrad(call, x, dz_q if fp8_wgrad else dz, gs, w_gate_up.dtype,
                            acc_gate_up)
    return (
        dx,  # zero on padding rows: dy is masked, so dz is zero there
        None,
        dw_gate_up,
        dw_down,
        None if b_gate_up is None else _bias_grad(dz32, gs, b_gate_up.dtype),
        None,  # x_q: x's copy, whose gradient is dx
    )


experts.defvjp(_experts_fwd, _experts_bwd)
