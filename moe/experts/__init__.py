"""Gated (SwiGLU) expert GEMMs over tokens grouped by local expert, with a hand-written backward.

`gated_experts` runs every local expert's ``y = (silu(x @ Wg) * (x @ Wu)) @ Wd`` (or another
gated activation of `moe.activations`, optionally with biases) on the expert inputs that
`moe.dispatch` produces, in one of two layouts:

- ragged ``x [R, d_model]`` with ``group_sizes [E]`` (rows grouped by expert, rows past
  ``sum(group_sizes)`` are padding): ``gemm_implementation`` 'mosaic' (Pallas Mosaic GPU
  wgmma kernels for Hopper, `accel_kernels.gmm.mosaic`), 'triton' (Pallas Triton kernels,
  `accel_kernels.gmm.triton`) or 'xla' (`jax.lax.ragged_dot_general`);
- padded ``x [E, C, d_model]`` (rows ``c >= group_sizes[e]`` are padding): 'xla', batched
  einsums that XLA turns into one large batched GEMM, or 'mosaic', the ragged kernels on the
  slots as rows (``C`` rounded up to 128 per expert, padding slots zeroed).

Three entries: :func:`gated_experts` (flat keywords), :func:`experts_apply` (an
:class:`moe.ExpertOptions`; both check their arguments and decide the implementation for the
layout) and :func:`run_experts`, which they and the MoE layer's chunks call with options
already resolved.

FP8 GEMMs consume ``float8_e4m3fn`` operands on the tensor cores (no dequantized copy): each
operand is quantized along its contraction axis with one power-of-two (E8M0) scale per row
(tokens) or per output channel (weights), the GEMM runs on the FP8 payloads, and the scales,
exact powers of two, multiply its f32-accumulated result (torchao's float8 "rowwise" recipe;
DeepSeek-V3's 1 x 128 blocks would need a per-block promotion inside the kernel). Weights are
quantized on every call from the params passed in, in the K-major layout their GEMM reads.
On NVIDIA GPUs the quantization passes are the one-pass Pallas kernels of `accel_kernels.quant.api`:
``h = act(z)`` is quantized as it is computed, and ``dz`` comes out of the activation's
backward both in the compute dtype and quantized; elsewhere the same bytes come from XLA.

The backward is a `jax.custom_vjp` (`moe.experts.vjp`) whose dgrad and wgrad GEMMs are
written out, so what is kept for it (the SonicMoE options: ``z`` in bf16, ``z`` in FP8, or
nothing and recompute) and the precision of each GEMM (``gemm_dtype``, ``dgrad_dtype``,
``wgrad_dtype``) are the caller's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from accel_kernels import fp8
from accel_kernels.activations import GatedActivation
from accel_kernels.gmm import api as gmm_api
from accel_kernels.gmm.api import auto_implementation
from moe.dispatch import DispatchPlan, WireRows, collectives, movement
from moe.experts import fp8_gemm, fused_combine
from moe.experts.vjp import Call
from moe.experts.vjp import experts as _experts
from moe.experts.vjp import experts_chained as _experts_chained
from moe.options import (
    ExpertOptions,
    GemmDtype,
    GemmImplementation,
    SaveZ,
    WireDtype,
    check_group_alignment,
    renamed_keywords,
)

__all__ = ["Banks", "CombineArgs", "WireRows", "auto_implementation", "experts_apply",
           "gated_experts", "run_experts", "shared_experts"]


class Banks(NamedTuple):
    """One device's expert weights.

    Attributes:
      w_gate_up: ``[E_local, d, 2 f]``.
      w_down: ``[E_local, f, d]``.
      bias: ``(b_gate_up [E_local, 2 f], b_down [E_local, d])`` or None.
    """

    w_gate_up: jax.Array
    w_down: jax.Array
    bias: tuple[jax.Array, jax.Array] | None = None


class CombineArgs(NamedTuple):
    """What :func:`experts_apply` combines the experts' outputs with (:func:`moe.combine`'s
    arguments): it then returns the tokens' outputs."""

    weights: jax.Array  # [T, k] routing weights
    plan: DispatchPlan  # the dispatch's plan
    grad_dtype: WireDtype  # combine_grad_dtype: the wire of the combine's gradient


# ----------------------------------------------------------------------------------------------
# Validation and the public entry point.
# ----------------------------------------------------------------------------------------------


def _check_shapes(x, group_sizes, w_gate_up, w_down) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x has dtype {x.dtype}; pass floating-point activations (bf16/f32).")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.ndim != 3:
            raise ValueError(f"{name} has shape {w.shape}; it must be a 3-D expert bank [E, ...].")
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise TypeError(f"{name} has dtype {w.dtype}; pass floating-point weights.")
    n_exp, d_model, two_ff = w_gate_up.shape
    if x.shape[-1] != d_model:
        raise ValueError(
            f"w_gate_up has shape {w_gate_up.shape} but x has d_model={x.shape[-1]}; "
            "w_gate_up must be [E, d_model, 2*d_ff] with d_model = x.shape[-1]."
        )
    if two_ff % 2:
        raise ValueError(
            f"w_gate_up has {two_ff} output columns; it must be [E, d_model, 2*d_ff] "
            "(gate columns then up columns), so the last axis must be even."
        )
    if w_down.shape != (n_exp, two_ff // 2, d_model):
        raise ValueError(
            f"w_down has shape {w_down.shape}; with w_gate_up {w_gate_up.shape} it must be "
            f"[E, d_ff, d_model] = {(n_exp, two_ff // 2, d_model)}."
        )
    if x.ndim == 3 and x.shape[0] != n_exp:
        raise ValueError(
            f"x has {x.shape[0]} expert slots (shape {x.shape}) but the weights hold {n_exp} "
            "experts; padded x must be [E, C, d_model] with E = w_gate_up.shape[0]."
        )
    if group_sizes is None:
        if x.ndim == 2:
            raise ValueError(
                "group_sizes is None; ragged x [R, d_model] needs group_sizes int32 [E] "
                "(rows per local expert)."
            )
        return
    if group_sizes.shape != (n_exp,):
        raise ValueError(
            f"group_sizes has shape {group_sizes.shape}; it must be [E] = ({n_exp},), one "
            "row count per local expert (E = w_gate_up.shape[0])."
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(
            f"group_sizes has dtype {group_sizes.dtype}; pass an integer array (int32)."
        )


@jax.custom_vjp
def _permute_rows(x: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """``x[index]`` (out-of-range: zero rows) with the cotangent gathered back by ``inverse``."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _permute_rows_fwd(x, index, inverse):
    return _permute_rows(x, index, inverse), (index, inverse)


def _permute_rows_bwd(res, ct):
    index, inverse = res
    return jnp.take(ct, inverse, axis=0, mode="fill", fill_value=0), None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _wire_rows(x_wire: WireRows, index=None) -> tuple[jax.Array, jax.Array]:
    """The row-quantized pair of x from its FP8 wire rows, gathered by ``index`` first (zero
    rows out of range) if given; the rows may be `moe.dispatch.collectives.TokenRows` (nothing was
    sent: the same bytes from the tokens)."""
    rows, width, block_size = x_wire
    if isinstance(rows, collectives.TokenRows):
        tokens = rows.index
        if index is not None:
            tokens = jnp.take(tokens, index, axis=0, mode="fill", fill_value=-1)
        return fp8_gemm.rows_from_tokens(rows.tokens, tokens, block_size)
    return fp8_gemm.rows_from_wire(rows, width, block_size, index)


def _call(call: Call, x, gs, w_gate_up, w_down, b_gate_up, x_q=None, *, chain: bool):
    """``(y, (w_gate_up, w_down))``: the experts' custom VJP, with the weights passed through
    it when ``chain`` (`moe.experts.vjp.experts_chained`), else as they came."""
    if chain:
        y, w_gate_up, w_down = _experts_chained(call, x, gs, w_gate_up, w_down, b_gate_up, x_q)
        return y, (w_gate_up, w_down)
    return _experts(call, x, gs, w_gate_up, w_down, b_gate_up, x_q), (w_gate_up, w_down)


def _aligned_call(call: Call, x, gs, w_gate_up, w_down, b_gate_up, alignment: int,
                  x_wire=None, *, chain: bool = False):
    """Runs an implementation whose kernels need tile-aligned groups on plain ragged x: rows
    are gathered into the aligned layout and the outputs gathered back (row gathers both
    ways). With ``x_wire`` the FP8 GEMMs read x's rows gathered from its one-byte wire rows
    instead. Returns
    ``(y, weights)`` (:func:`_call`)."""
    src, dst, padded = gmm_api.align_map(gs, x.shape[0], alignment)
    # No mask: src gathers only real rows (padding rows of the aligned layout are filled with
    # zeros) and the cotangent's gather by dst gives zero to x's padding rows.
    x_al = _permute_rows(x, src, dst)
    x_q = None if x_wire is None else _wire_rows(x_wire, src)
    y_al, banks = _call(call, x_al, padded, w_gate_up, w_down, b_gate_up, x_q, chain=chain)
    return _permute_rows(y_al, dst, src), banks


def _padded_on_rows(call: Call, x, gs, w_gate_up, w_down, b_gate_up, *, chain: bool = False):
    """Padded ``x [E, C, d]`` on the ragged-layout 'mosaic' kernels: the slots as rows, ``C``
    (rounded up to the 128-row tile) rows per expert, the padding slots zeroed going in and
    coming out (so their cotangents are zero too). The kernels skip the row tiles past an
    expert's filled slots (`accel_kernels.gmm.api.RowGroups`): an under-filled capacity costs
    only the
    tiles its tokens occupy. Returns ``(y, weights)`` (:func:`_call`)."""
    n_exp, cap, d = x.shape
    cap_al = -(-cap // gmm_api.GROUP_ALIGNMENT) * gmm_api.GROUP_ALIGNMENT
    if cap_al != cap:
        x = jnp.pad(x, ((0, 0), (0, cap_al - cap), (0, 0)))
    full = jnp.full((n_exp,), cap_al, jnp.int32)
    valid, groups = None, full
    if call.mask_rows:
        live = jnp.clip(gs, 0, cap).astype(jnp.int32)
        valid = (jnp.arange(cap_al)[None, :] < live[:, None])[..., None]
        x = jnp.where(valid, x, jnp.zeros((), x.dtype))
        groups = gmm_api.RowGroups(full, live)
    rows = Call(experts=call.experts, fp8_block_size=call.fp8_block_size, mask_rows=False)
    y, banks = _call(rows, x.reshape(n_exp * cap_al, d), groups, w_gate_up, w_down,
                     b_gate_up, chain=chain)
    y = y.reshape(n_exp, cap_al, d)
    if valid is not None:
        y = jnp.where(valid, y, jnp.zeros((), y.dtype))
    return (y[:, :cap] if cap_al != cap else y), banks


def _bias_epilogue(y, b_down, real_gs, layout_gs, *, masked: bool, aligned: bool):
    """``y + b_down[expert of row]`` on real rows and 0 on padding rows (ragged: past the
    groups or, in an aligned layout, between them; padded: ``c >= real_gs[e]``)."""
    if y.ndim == 3:
        valid = jnp.ones(y.shape[:2], bool)
        if masked:
            valid = jnp.arange(y.shape[1])[None, :] < real_gs[:, None]
        rows = None if b_down is None else b_down.astype(jnp.float32)[:, None, :]
    else:
        group = gmm_api.group_of_rows(layout_gs, y.shape[0])
        index = jnp.arange(y.shape[0], dtype=jnp.int32)
        if aligned:
            start = jnp.cumsum(layout_gs) - layout_gs
            first = jnp.take(start, group, mode="fill", fill_value=y.shape[0])
            valid = index - first < jnp.take(real_gs, group, mode="fill", fill_value=0)
        else:
            valid = index < jnp.sum(real_gs)
        rows = None if b_down is None else jnp.take(
            b_down.astype(jnp.float32), group, axis=0, mode="fill", fill_value=0)
    out = y if rows is None else (y.astype(jnp.float32) + rows).astype(y.dtype)
    return jnp.where(valid[..., None], out, jnp.zeros((), y.dtype))


def _check_biases(b_gate_up, b_down, w_gate_up, w_down) -> None:
    n_exp, d_model, two_ff = w_gate_up.shape
    for name, b, want in (("b_gate_up", b_gate_up, (n_exp, two_ff)),
                          ("b_down", b_down, (n_exp, d_model))):
        if b is None:
            continue
        if b.shape != want or not jnp.issubdtype(b.dtype, jnp.floating):
            raise ValueError(
                f"{name} has shape {b.shape} dtype {b.dtype}; it must be a float array "
                f"{list(want)} (one bias row per expert of w_gate_up {w_gate_up.shape})."
            )


def gated_experts(
    x: jax.Array,
    group_sizes: jax.Array | None,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    *,
    activation: GatedActivation | str = "silu",
    gemm_implementation: GemmImplementation = "auto",
    gemm_dtype: GemmDtype = "bf16",
    dgrad_dtype: GemmDtype = "bf16",
    wgrad_dtype: GemmDtype = "bf16",
    save_z: SaveZ = "bf16",
    block_size: int = 128,
    group_alignment: int | None = None,
    **renamed: Any,
) -> jax.Array:
    """Gated (SwiGLU) experts over tokens grouped by local expert, with a hand-written backward.

    For the rows of expert e:  z = x @ W_gu[e] (+ b_gu[e]);  h = act(z[:, :d_ff], z[:, d_ff:])
    (``silu(gate) * up`` by default, see :class:`moe.activations.GatedActivation`);
    y = h @ W_d[e] (+ b_d[e]).  Padding rows (ragged: index >= sum(group_sizes), or between
    the groups of an aligned layout; padded: c >= group_sizes[e]) give y = 0 and receive zero
    gradient. GEMMs accumulate in f32; the compute
    dtype is ``x.dtype`` (weights are cast to it), gradients come back in each input's dtype.
    The backward is explicit: dgrad ``dz @ W^T`` and wgrad ``x_e^T @ dz_e`` GEMMs per expert;
    ``group_sizes`` gets no gradient.

    An FP8 GEMM ``a @ W`` runs on e4m3 payloads: ``a`` with one power-of-two scale per row,
    ``W`` (from the params passed in, every call: nothing is cached) with one per output
    channel, both K-major; ``out = (a_q @ W_q) * s_a[row] * s_W[channel]``, exact scaling of
    the f32-accumulated product. Weight-gradient GEMMs contract the token rows: their
    operands are the e4m3 rows the other GEMMs read (``x``, ``h``, ``dy``, ``dz``) written
    K-major, the product of the two row scales folded into one payload as an exact power of
    two relative to its maximum, which scales the result (`moe.experts.fp8_gemm.wgrad_operands`).

    Args:
      x: expert inputs, ragged ``[R, d_model]`` (rows grouped by expert, as the 'ragged'
        dispatch gives) or padded ``[E, C, d_model]`` (as the 'dense' dispatch gives).
      group_sizes: int32 ``[E]`` real rows per local expert. Required for ragged x; may be
        None for padded x (all C rows real).
      w_gate_up: ``[E, d_model, 2*d_ff]``; columns ``[:d_ff]`` gate, ``[d_ff:]`` up.
      w_down: ``[E, d_ff, d_model]``.
      b_gate_up: optional bias ``[E, 2*d_ff]`` added to z (gate then up, like the columns).
      b_down: optional bias ``[E, d_model]`` added to y.
      activation: a :class:`moe.activations.GatedActivation` or its kind (``'silu'``,
        ``'gelu'``, ``'gelu_tanh'``, ``'clamped_swiglu'`` with GPT-OSS's alpha and limit).
      gemm_implementation: the grouped GEMMs (formerly ``backend``): ragged x: 'mosaic'
        (Pallas Mosaic GPU wgmma kernels, Hopper; XLA-emulated on CPU), 'triton' (Pallas
        Triton kernels, NVIDIA GPUs; interpreted on CPU) or 'xla'
        (`jax.lax.ragged_dot_general`); padded x: 'xla' (batched einsums) or 'mosaic' (the
        slots as rows: ``C`` rounded up to 128 per expert). 'auto' picks by layout and
        platform (:func:`auto_implementation`). All work inside ``jax.shard_map``.
      gemm_dtype: precision of the two forward GEMMs, 'bf16' or 'fp8'.
      dgrad_dtype: precision of the two data-gradient GEMMs (``dy @ W_d^T``,
        ``dz @ W_gu^T``).
      wgrad_dtype: precision of the two weight-gradient GEMMs.
      save_z: what the backward keeps of z (SonicMoE): 'bf16' keeps z unquantized in the
        compute dtype; 'fp8' keeps z as `moe.fp8` blocks of ``block_size`` per row (about
        half the bytes); 'recompute' keeps no z and recomputes x @ W_gu (with the forward's
        precision) in the backward. With FP8 forward and data-gradient GEMMs the forward
        makes both FP8 copies of each weight in two passes and keeps the data gradient's
        (one byte per weight) for the backward, except with 'recompute', whose backward
        quantizes the weights again.
      block_size: FP8 block length of ``save_z='fp8'`` (a multiple of it must be 2 * d_ff).
      group_alignment: None for plain ragged x. An int ``A`` says x is already in the
        A-aligned layout: group g starts at row ``sum(ceil(gs[:g] / A) * A)`` and the rows
        between groups are zero (what ``moe.dispatch`` gives the dropless transport with
        ``group_alignment``; the MoE layer passes 128 to 'mosaic' experts).
        'mosaic' needs 128-aligned groups and aligns plain ragged x itself (two extra row
        gathers each way).
      **renamed: ``backend``, the former name of ``gemm_implementation`` (a
        ``DeprecationWarning``).

    Returns:
      y with the shape and dtype of x.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from moe import gated_experts
      >>> E, d, f = 4, 16, 8
      >>> x = jnp.ones((24, d), jnp.bfloat16)  # rows grouped by expert: 8, 0, 12, 4
      >>> gs = jnp.array([8, 0, 12, 4], jnp.int32)
      >>> w_gu = jnp.full((E, d, 2 * f), 0.1, jnp.bfloat16)
      >>> w_d = jnp.full((E, f, d), 0.1, jnp.bfloat16)
      >>> experts = jax.jit(lambda *a: gated_experts(*a, gemm_dtype="fp8", save_z="recompute"))
      >>> y = experts(x, gs, w_gu, w_d)
      >>> y.shape, y.dtype
      ((24, 16), dtype(bfloat16))

    References:
      SonicMoE (Guo et al., 2025), "SonicMoE: Accelerating MoE with IO and Tile-aware
      Optimizations": saving z instead of h, FP8 z, recomputation in the backward.
      DeepSeek-AI (2024), "DeepSeek-V3 Technical Report", Sec. 3.3 (FP8 training).
      torchao float8 training, "rowwise" scaling recipe (per-row / per-channel scales).
    """
    kernels = renamed_keywords("gated_experts", renamed,
                               gemm_implementation=gemm_implementation)
    options = ExpertOptions(gemm_dtype=gemm_dtype, dgrad_dtype=dgrad_dtype, save_z=save_z,
                            wgrad_dtype=wgrad_dtype, activation=activation, **kernels)
    return experts_apply(x, group_sizes, w_gate_up, w_down, b_gate_up, b_down,
                         options=options, fp8_block_size=block_size,
                         group_alignment=group_alignment)


def experts_apply(x: jax.Array, group_sizes: jax.Array | None, w_gate_up: jax.Array,
                  w_down: jax.Array, b_gate_up: jax.Array | None = None,
                  b_down: jax.Array | None = None, *, options: ExpertOptions,
                  fp8_block_size: int = 128, group_alignment: int | None = None,
                  x_wire: WireRows | None = None, combine: CombineArgs | None = None,
                  chain_weights: bool = False
                  ) -> jax.Array | tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """:func:`gated_experts` with its options as one :class:`moe.ExpertOptions` (the routed-
    expert fields are read, the shared-expert ones are the layer's), optionally reading x's
    FP8 wire rows and combining the outputs.

    Checks its arguments, decides ``options.gemm_implementation`` for x's layout
    (`accel_kernels.gmm.api.resolve`) and runs :func:`run_experts`.

    Args:
      x, group_sizes, w_gate_up, w_down, b_gate_up, b_down: as for :func:`gated_experts`.
      options: grouped-GEMM implementation, precisions, ``save_z`` and activation of the
        routed experts.
      fp8_block_size: channels per FP8 scale (``save_z='fp8'``; the wire rows').
      group_alignment: as for :func:`gated_experts`.
      x_wire: None, or ragged x's FP8 wire rows (`moe.dispatch.dispatch_with_wire`): an FP8
        forward GEMM reads its e4m3 rows from them instead of quantizing x (the same bytes).
      combine: None, or the :class:`CombineArgs` to combine the outputs with
        (:func:`moe.combine`): then the tokens' outputs ``[T, d_model]`` are returned; with
        one device on the expert axis and FP8 gradient GEMMs, experts and combine run as one
        custom VJP (`moe.experts.fused_combine`).
      chain_weights: also return ``(w_gate_up, w_down)`` passed through the call, for the
        next call on other tokens to take (the layer's chunks): their cotangent then comes
        back into this call's backward, whose weight-gradient GEMMs add it to their own (in
        the 'mosaic' kernel itself) instead of XLA adding two banks. The fused-combine path
        passes them through untouched (XLA adds there).

    Returns:
      y like x, or with ``combine`` the tokens' outputs; with ``chain_weights``,
      ``(y, (w_gate_up, w_down))``.

    Example:
      >>> import jax.numpy as jnp
      >>> from moe import ExpertOptions
      >>> from moe.experts import experts_apply
      >>> x, gs = jnp.ones((8, 16), jnp.bfloat16), jnp.array([5, 3], jnp.int32)
      >>> w_gu, w_d = jnp.ones((2, 16, 8), jnp.bfloat16), jnp.ones((2, 4, 16), jnp.bfloat16)
      >>> experts_apply(x, gs, w_gu, w_d, options=ExpertOptions(save_z="recompute")).shape
      (8, 16)
    """
    if not isinstance(options, ExpertOptions):
        raise TypeError(f"options must be a moe.ExpertOptions, got {type(options).__name__}.")
    check_group_alignment(group_alignment)
    resolved = gmm_api.resolve(options.gemm_implementation, x.ndim, "gemm_implementation")
    _check_shapes(x, group_sizes, w_gate_up, w_down)
    _check_biases(b_gate_up, b_down, w_gate_up, w_down)
    if options.save_z == "fp8":
        fp8.check_width(2 * w_down.shape[1], fp8_block_size, what="2*d_ff (for save_z='fp8')")
    if x_wire is not None and (x.ndim != 2 or options.gemm_dtype != "fp8"):
        raise ValueError("x_wire: FP8 wire rows are read by an FP8 forward GEMM of ragged x.")
    if x_wire is not None and x_wire.width != x.shape[-1]:
        raise ValueError(f"x_wire holds rows of {x_wire.width} channels but x has "
                         f"{x.shape[-1]}; pass the wire rows of x.")
    bias = None if b_gate_up is None and b_down is None else (b_gate_up, b_down)
    y, banks = run_experts(
        x, group_sizes, Banks(w_gate_up, w_down, bias),
        dataclasses.replace(options, gemm_implementation=resolved), block_size=fp8_block_size,
        group_alignment=group_alignment, x_wire=x_wire,
        combine=combine, chain=chain_weights)
    return (y, (banks.w_gate_up, banks.w_down)) if chain_weights else y


def run_experts(x: jax.Array, group_sizes: jax.Array | None, banks: Banks,
                options: ExpertOptions, *, block_size: int, group_alignment: int | None,
                x_wire: WireRows | None = None, combine: CombineArgs | None = None,
                chain: bool = False) -> tuple[jax.Array, Banks]:
    """The experts of :func:`experts_apply` on arguments already checked, their options
    resolved: ``options.gemm_implementation`` decided for x's layout (never ``'auto'``;
    ``'triton'`` on padded x runs its slots as rows). The MoE layer's chunks call it with the
    layer's resolved options (`moe.options.ResolvedOptions`).

    Returns:
      ``(y, banks)``: y like x, or with ``combine`` the tokens' outputs; ``banks`` passed
      through the experts' custom VJP when ``chain`` (their cotangent then comes back into
      this call's backward), else as they came.

    Example:
      >>> # inside jax.shard_map, on the layout moe.dispatch produced:
      >>> # y, banks = run_experts(ex, sizes, Banks(w_gu, w_d), options.experts,
      >>> #                        block_size=128, group_alignment=None, chain=True)
    """
    implementation = options.gemm_implementation
    if x.ndim == 3 and implementation == "triton":  # kernels of rows: the slots as rows
        e_local, c, d = x.shape
        full = jnp.full((e_local,), c, dtype=jnp.int32)
        ey, banks = run_experts(x.reshape(e_local * c, d), full, banks, options,
                                block_size=block_size, group_alignment=None, chain=chain)
        ey = ey.reshape(e_local, c, -1)
        if combine is None:
            return ey, banks
        return movement.combine_tokens(ey, combine.weights, combine.plan,
                                       combine.grad_dtype), banks
    aligned = gmm_api.gemms(implementation, x.ndim).aligned  # its kernels take aligned groups
    call = Call(experts=options, fp8_block_size=block_size, mask_rows=group_sizes is not None)
    w_gate_up, w_down = banks.w_gate_up, banks.w_down
    b_gate_up, b_down = banks.bias if banks.bias is not None else (None, None)
    if group_sizes is None:
        group_sizes = jnp.full((x.shape[0],), x.shape[1], jnp.int32)
    group_sizes = real_gs = group_sizes.astype(jnp.int32)
    if x.ndim == 2 and group_alignment is not None:
        group_sizes = -(-jnp.maximum(group_sizes, 0) // group_alignment) * group_alignment
    need = gmm_api.GROUP_ALIGNMENT

    def done(y, weights):
        return y, Banks(*weights, banks.bias) if chain else banks

    if x.ndim == 3 and implementation == "mosaic":
        y, weights = _padded_on_rows(call, x, real_gs, w_gate_up, w_down, b_gate_up,
                                     chain=chain)
    elif aligned and (group_alignment or 1) % need:
        y, weights = _aligned_call(call, x, group_sizes, w_gate_up, w_down, b_gate_up, need,
                                   x_wire, chain=chain)
    else:
        x_q = None if x_wire is None else _wire_rows(x_wire)
        if (combine is not None and banks.bias is None
                and fused_combine.applies(call, combine.plan, combine.grad_dtype)):
            weights = movement.vary_like(combine.weights, x, combine.plan)
            return fused_combine.experts_combine(call, combine.grad_dtype, x, group_sizes,
                                                 w_gate_up, w_down, x_q, weights,
                                                 combine.plan), banks
        y, weights = _call(call, x, group_sizes, w_gate_up, w_down, b_gate_up, x_q,
                           chain=chain)
    if banks.bias is not None:
        y = _bias_epilogue(y, b_down, real_gs, group_sizes, masked=call.mask_rows,
                           aligned=x.ndim == 2 and group_alignment is not None)
    if combine is None:
        return done(y, weights)
    return done(movement.combine_tokens(y, combine.weights, combine.plan, combine.grad_dtype),
                weights)


def shared_experts(tokens: jax.Array, gate_up: jax.Array, down: jax.Array,
                   gate: jax.Array | None, *, activation: GatedActivation) -> jax.Array:
    """The always-on shared experts: one gated MLP over every token, ``S(x) = act(x Wgu_s)
    Wd_s``, times ``sigmoid(x w_g)`` with a ``gate``; in ``tokens``' dtype.

    Args:
      tokens: ``[T, d_model]``.
      gate_up: ``[d_model, 2 * d_shared]`` (gate columns first).
      down: ``[d_shared, d_model]``.
      gate: ``[d_model, 1]`` or None.
      activation: the gated activation.

    Returns:
      ``[T, d_model]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from accel_kernels.activations import GatedActivation
      >>> shared_experts(jnp.ones((2, 4)), jnp.ones((4, 6)), jnp.ones((3, 4)), None,
      ...                activation=GatedActivation.of("silu")).shape
      (2, 4)
    """
    dtype = tokens.dtype
    with jax.named_scope("moe_shared_experts"):
        zs = jnp.einsum("td,df->tf", tokens, gate_up.astype(dtype))
        h = activation.apply(zs).astype(dtype)
        y = jnp.einsum("tf,fd->td", h, down.astype(dtype))
        if gate is not None:
            g = jnp.einsum("td,do->to", tokens, gate.astype(dtype))
            y = (jax.nn.sigmoid(g.astype(jnp.float32)) * y).astype(dtype)
        return y
