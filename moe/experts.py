"""Gated (SwiGLU) expert GEMMs over tokens grouped by local expert, with a hand-written backward.

`gated_experts` runs every local expert's ``y = (silu(x @ Wg) * (x @ Wu)) @ Wd`` on the expert
inputs that `moe.dispatch` produces, in one of two layouts:

- ragged ``x [R, d_model]`` with ``group_sizes [E]`` (rows grouped by expert, rows past
  ``sum(group_sizes)`` are padding), computed with `jax.lax.ragged_dot_general`;
- padded ``x [E, C, d_model]`` (rows ``c >= group_sizes[e]`` are padding), computed with batched
  einsums, which XLA turns into one large batched GEMM;
- ragged ``x [R, d_model]`` again with backend='pallas': grouped-GEMM kernels written in Pallas
  (`moe._gmm_pallas`, Triton lowering on GPU; interpreted, slowly, on CPU) that pad each group
  only to the row-tile size instead of every group to the largest one.

The backward is a `jax.custom_vjp` whose dgrad and wgrad GEMMs are written out, so what is
kept for it (the SonicMoE options: ``z`` in bf16, ``z`` in FP8, or nothing and recompute) and
the precision of each GEMM are under the caller's control.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from moe import _gmm_pallas, fp8

Backend = Literal["auto", "ragged_dot", "einsum", "pallas"]
GemmDtype = Literal["bf16", "fp8"]
SaveZ = Literal["bf16", "fp8", "recompute"]
WgradDtype = Literal["bf16", "fp8"]

_GEMM_DTYPES = ("bf16", "fp8")
_SAVE_Z = ("bf16", "fp8", "recompute")


# ----------------------------------------------------------------------------------------------
# Grouped-GEMM backends. Each provides the three GEMMs of a grouped linear layer
# ``out[rows of e] = a[rows of e] @ w[e]``, accumulating in f32 and returning ``out_dtype``:
#   fwd(a [..., k], w [E, k, n], gs, out_dtype)   -> [..., n]   (forward)
#   dgrad(g [..., n], w [E, k, n], gs, out_dtype) -> [..., k]   (g @ w[e]^T, input gradient)
#   wgrad(a [..., k], g [..., n], gs, out_dtype)  -> [E, k, n]  (a_e^T @ g_e, weight gradient)
# A GPU kernel backend is one more entry in `_BACKENDS` (and in the `Backend` literal).
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _GroupedGemms:
    """The three grouped GEMMs of one backend, and the layout of the token rows it expects."""

    x_ndim: int  # rank of the token operand: 2 = ragged [R, k], 3 = padded [E, C, k]
    token_axis: int  # axis of the token operand that indexes tokens (wgrad contraction)
    fwd: Callable[..., jax.Array]
    dgrad: Callable[..., jax.Array]
    wgrad: Callable[..., jax.Array]


def _ragged_dn(contract, ragged, group) -> lax.RaggedDotDimensionNumbers:
    return lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(contract, ([], [])),
        lhs_ragged_dimensions=ragged,
        rhs_group_dimensions=group,
    )


# [R, k] x [E, k, n] -> [R, n]: rows ragged, one weight per group.
_RAGGED_FWD = _ragged_dn(([1], [1]), [0], [0])
# [R, n] x [E, k, n] -> [R, k]: contract the weight's output axis (w^T without a transpose).
_RAGGED_DGRAD = _ragged_dn(([1], [2]), [0], [0])
# [R, k] x [R, n] -> [E, k, n]: the ragged axis is contracted, giving one result per group.
_RAGGED_WGRAD = _ragged_dn(([0], [0]), [0], [])


def _ragged_fwd(a: jax.Array, w: jax.Array, gs: jax.Array, out_dtype) -> jax.Array:
    out = lax.ragged_dot_general(a, w, gs, _RAGGED_FWD, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _ragged_dgrad(g: jax.Array, w: jax.Array, gs: jax.Array, out_dtype) -> jax.Array:
    out = lax.ragged_dot_general(g, w, gs, _RAGGED_DGRAD, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _ragged_wgrad(a: jax.Array, g: jax.Array, gs: jax.Array, out_dtype) -> jax.Array:
    out = lax.ragged_dot_general(a, g, gs, _RAGGED_WGRAD, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _einsum_fwd(a: jax.Array, w: jax.Array, gs: jax.Array, out_dtype) -> jax.Array:
    del gs  # padding rows are zero (masked by the caller), so they add nothing
    return jnp.einsum("eck,ekn->ecn", a, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _einsum_dgrad(g: jax.Array, w: jax.Array, gs: jax.Array, out_dtype) -> jax.Array:
    del gs
    return jnp.einsum("ecn,ekn->eck", g, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _einsum_wgrad(a: jax.Array, g: jax.Array, gs: jax.Array, out_dtype) -> jax.Array:
    del gs
    return jnp.einsum("eck,ecn->ekn", a, g, preferred_element_type=jnp.float32).astype(out_dtype)


# Pallas grouped GEMMs (f32 accumulation inside the kernel, ``out_dtype`` stored directly).
# Pallas interpret mode (slow; for tests) when lowered for CPU, Triton when lowered for GPU.
def _pallas_fwd(a: jax.Array, w: jax.Array, gs: jax.Array, out_dtype) -> jax.Array:
    return _gmm_pallas.gmm(a, w, gs, out_dtype=out_dtype)


def _pallas_dgrad(g: jax.Array, w: jax.Array, gs: jax.Array, out_dtype) -> jax.Array:
    return _gmm_pallas.gmm(g, w, gs, transpose_rhs=True, out_dtype=out_dtype)


def _pallas_wgrad(a: jax.Array, g: jax.Array, gs: jax.Array, out_dtype) -> jax.Array:
    return _gmm_pallas.tgmm(a, g, gs, out_dtype=out_dtype)


_BACKENDS: dict[str, _GroupedGemms] = {
    "ragged_dot": _GroupedGemms(2, 0, _ragged_fwd, _ragged_dgrad, _ragged_wgrad),
    "einsum": _GroupedGemms(3, 1, _einsum_fwd, _einsum_dgrad, _einsum_wgrad),
    "pallas": _GroupedGemms(2, 0, _pallas_fwd, _pallas_dgrad, _pallas_wgrad),
}
_AUTO_BACKEND = {2: "ragged_dot", 3: "einsum"}  # by the rank of x


# ----------------------------------------------------------------------------------------------
# FP8 operands. Every FP8 GEMM operand is block-quantized along the GEMM's contraction axis
# with `moe.fp8.quantize` (E8M0 scales, blocks of `block_size`), then dequantized for the GEMM.
# The dequantized values are e4m3 values times powers of two, exact in bf16/f32, and the GEMM
# accumulates in f32, so this is the arithmetic of an FP8 GEMM with per-block scaling
# (DeepSeek-V3), on every backend; an FP8-kernel backend consumes the same blocks directly.
# ----------------------------------------------------------------------------------------------


def _fp8_round(a: jax.Array, *, axis: int, block_size: int, dtype: jnp.dtype) -> jax.Array:
    """Quantize ``a`` to FP8 in blocks along ``axis`` and dequantize it to ``dtype``.

    ``axis`` is padded with zeros up to a multiple of ``4 * block_size`` (four scales per
    packed word) when needed; zero padding does not change any block's amax.
    """
    moved = jnp.moveaxis(a, axis, -1)
    n = moved.shape[-1]
    quantum = 4 * block_size
    pad = (-n) % quantum
    if pad:
        moved = jnp.pad(moved, [(0, 0)] * (moved.ndim - 1) + [(0, pad)])
    out = fp8.dequantize(fp8.quantize(moved, block_size=block_size), dtype=dtype)
    if pad:
        out = out[..., :n]
    return jnp.moveaxis(out, -1, axis)


@dataclasses.dataclass(frozen=True)
class _Opts:
    """Static options of one `gated_experts` call (hashable: the custom_vjp's nondiff arg)."""

    backend: str
    gemm_dtype: str
    save_z: str
    wgrad_dtype: str
    block_size: int
    mask_rows: bool  # False only for padded x without group_sizes (every row is real)


def _weight_operand(w: jax.Array, opts: _Opts, dtype: jnp.dtype) -> jax.Array:
    """Forward GEMM weight ``[E, k, n]``: FP8 per output column, blocks along ``k``, if asked."""
    if opts.gemm_dtype == "fp8":
        return _fp8_round(w, axis=1, block_size=opts.block_size, dtype=dtype)
    return w.astype(dtype)


def _act_operand(a: jax.Array, opts: _Opts) -> jax.Array:
    """Forward GEMM activation ``[..., k]``: FP8 per row, blocks of 1 x block_size, if asked."""
    if opts.gemm_dtype == "fp8":
        return _fp8_round(a, axis=-1, block_size=opts.block_size, dtype=a.dtype)
    return a


def _wgrad_operand(a: jax.Array, opts: _Opts) -> jax.Array:
    """Weight-gradient GEMM operand: FP8 in blocks along the token (contraction) axis."""
    if opts.wgrad_dtype == "fp8":
        axis = _BACKENDS[opts.backend].token_axis
        return _fp8_round(a, axis=axis, block_size=opts.block_size, dtype=a.dtype)
    return a


def _gate_up(opts: _Opts, x: jax.Array, gs: jax.Array, w_gate_up: jax.Array) -> jax.Array:
    """z = x @ W_gate_up per expert, rounded to the compute dtype (the saved/recomputed z)."""
    ops = _BACKENDS[opts.backend]
    a = _act_operand(x, opts)
    w = _weight_operand(w_gate_up, opts, x.dtype)
    with jax.named_scope("experts_gate_up"):
        return ops.fwd(a, w, gs, x.dtype)


def _swiglu(z: jax.Array) -> jax.Array:
    """h = silu(z_gate) * z_up in f32, z = [z_gate | z_up] along the last axis."""
    zg, zu = jnp.split(z.astype(jnp.float32), 2, axis=-1)
    return jax.nn.silu(zg) * zu


def _swiglu_bwd(z: jax.Array, dh: jax.Array) -> jax.Array:
    """dz from dh: dz_gate = dh * z_up * silu'(z_gate), dz_up = dh * silu(z_gate), in f32."""
    zg, zu = jnp.split(z.astype(jnp.float32), 2, axis=-1)
    sig = jax.nn.sigmoid(zg)
    dzg = dh * zu * (sig * (1.0 + zg * (1.0 - sig)))
    dzu = dh * (zg * sig)
    return jnp.concatenate([dzg, dzu], axis=-1)


def _mask_rows(opts: _Opts, a: jax.Array, gs: jax.Array) -> jax.Array:
    """Zero the padding rows of a token operand (ragged: index >= sum(gs); padded: c >= gs[e]).

    The mask is rebuilt from ``gs`` wherever it is needed, so it is never a saved residual.
    """
    if not opts.mask_rows:
        return a
    if a.ndim == 2:
        valid = (jnp.arange(a.shape[0]) < jnp.sum(gs))[:, None]
    else:
        valid = (jnp.arange(a.shape[1])[None, :] < gs[:, None])[..., None]
    return jnp.where(valid, a, jnp.zeros((), a.dtype))


def _forward(opts: _Opts, x, gs, w_gate_up, w_down) -> tuple[jax.Array, jax.Array]:
    """Returns (y, z)."""
    ops = _BACKENDS[opts.backend]
    x = _mask_rows(opts, x, gs)
    z = _gate_up(opts, x, gs, w_gate_up)
    h = _act_operand(_swiglu(z).astype(x.dtype), opts)
    w = _weight_operand(w_down, opts, x.dtype)
    with jax.named_scope("experts_down"):
        y = ops.fwd(h, w, gs, x.dtype)
    return _mask_rows(opts, y, gs), z


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _experts(opts: _Opts, x, gs, w_gate_up, w_down) -> jax.Array:
    return _forward(opts, x, gs, w_gate_up, w_down)[0]


def _experts_fwd(opts: _Opts, x, gs, w_gate_up, w_down):
    y, z = _forward(opts, x, gs, w_gate_up, w_down)
    if opts.save_z == "recompute":
        z_saved = None
    elif opts.save_z == "fp8":
        z_saved = fp8.quantize(z, block_size=opts.block_size)
    else:
        z_saved = z
    return y, (x, gs, w_gate_up, w_down, z_saved)


def _experts_bwd(opts: _Opts, res, dy):
    x, gs, w_gate_up, w_down, z_saved = res
    ops = _BACKENDS[opts.backend]
    dtype = x.dtype
    x = _mask_rows(opts, x, gs)  # x is saved as passed in (no copy), masked again here
    if opts.save_z == "recompute":
        z = _gate_up(opts, x, gs, w_gate_up)
    elif opts.save_z == "fp8":
        z = fp8.dequantize(z_saved, dtype=dtype)
    else:
        z = z_saved
    h = _swiglu(z).astype(dtype)
    dy = _mask_rows(opts, dy.astype(dtype), gs)
    with jax.named_scope("experts_down_dgrad"):
        dh = ops.dgrad(dy, w_down.astype(dtype), gs, jnp.float32)
    with jax.named_scope("experts_down_wgrad"):
        dw_down = ops.wgrad(_wgrad_operand(h, opts), _wgrad_operand(dy, opts), gs, w_down.dtype)
    dz = _swiglu_bwd(z, dh).astype(dtype)
    with jax.named_scope("experts_gate_up_dgrad"):
        dx = ops.dgrad(dz, w_gate_up.astype(dtype), gs, x.dtype)
    with jax.named_scope("experts_gate_up_wgrad"):
        dw_gate_up = ops.wgrad(
            _wgrad_operand(x, opts), _wgrad_operand(dz, opts), gs, w_gate_up.dtype
        )
    return (
        dx,  # zero on padding rows: dy is masked, so dz is zero there
        None,
        dw_gate_up,
        dw_down,
    )


_experts.defvjp(_experts_fwd, _experts_bwd)


# ----------------------------------------------------------------------------------------------
# Validation and the public entry point.
# ----------------------------------------------------------------------------------------------


def _check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; use one of {allowed}.")


def _on_cuda() -> bool:
    """Whether the default backend is an NVIDIA GPU (where the Triton kernels were measured)."""
    if jax.default_backend() != "gpu":
        return False
    try:  # pragma: no cover - GPU only
        return "cuda" in jax.devices()[0].client.platform_version.lower()
    except Exception:  # pragma: no cover - GPU only
        return False


def _resolve_backend(backend: str, x_ndim: int) -> str:
    _check_choice("backend", backend, ("auto", *_BACKENDS))
    if x_ndim not in (2, 3):
        raise ValueError(
            f"x has rank {x_ndim}; pass x as [R, d_model] (rows grouped by expert, "
            "backend='ragged_dot' or 'pallas') or [E, C, d_model] (capacity-padded, "
            "backend='einsum')."
        )
    if backend == "auto":
        # Measured on 2x H200 (BENCHMARKS.md): for the ragged layout the Pallas kernels ran at
        # 0.74-0.77 of the dense matmul rate against 0.15 for XLA's ragged_dot, and the dropless
        # expert-parallel layer fwd+bwd took 38 ms with them against 134 ms. Elsewhere (CPU:
        # interpreted; TPU, ROCm: not measured) ragged_dot.
        if x_ndim == 2 and _on_cuda():
            return "pallas"
        return _AUTO_BACKEND[x_ndim]
    want = _BACKENDS[backend].x_ndim
    if want != x_ndim:
        layout = "[R, d_model]" if want == 2 else "[E, C, d_model]"
        raise ValueError(
            f"backend={backend!r} takes x as {layout} but x has rank {x_ndim}; "
            "use backend='auto' or reshape x."
        )
    if backend == "pallas":
        _check_pallas_platform()
    return backend


def _check_pallas_platform() -> None:
    """backend='pallas' runs compiled on GPUs (Triton) and interpreted (slowly) on CPU only."""
    try:
        _gmm_pallas.check_platform()
    except ValueError as e:
        raise ValueError(
            f"backend='pallas' is unavailable: {e} (or 'einsum' with capacity-padded x)."
        ) from None


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


def _check_fp8_dims(opts: _Opts, d_model: int, d_ff: int) -> None:
    if not isinstance(opts.block_size, int) or opts.block_size <= 0:
        raise ValueError(f"block_size={opts.block_size!r}; pass a positive int such as 128.")
    quantum = 4 * opts.block_size
    needs = []
    if opts.gemm_dtype == "fp8":
        needs += [("d_model", d_model, "gemm_dtype"), ("d_ff", d_ff, "gemm_dtype")]
    if opts.save_z == "fp8":
        needs += [("2*d_ff", 2 * d_ff, "save_z")]
    for name, size, option in needs:
        if size % quantum:
            raise ValueError(
                f"{name}={size} is not a multiple of 4*block_size={quantum} (FP8 blocks of "
                f"{opts.block_size}, four scales per int32 word) needed by {option}='fp8'; "
                f"pad {name} to a multiple of {quantum}, pass a smaller block_size, or use "
                f"{option}='bf16'."
            )


def gated_experts(
    x: jax.Array,
    group_sizes: jax.Array | None,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    backend: Backend = "auto",
    gemm_dtype: GemmDtype = "bf16",
    save_z: SaveZ = "bf16",
    wgrad_dtype: WgradDtype = "bf16",
    block_size: int = 128,
) -> jax.Array:
    """SwiGLU experts over tokens grouped by local expert, with a hand-written backward.

    For the rows of expert e:  z = x @ W_gu[e];  h = silu(z[:, :d_ff]) * z[:, d_ff:];
    y = h @ W_d[e].  Padding rows (ragged: index >= sum(group_sizes); padded: c >=
    group_sizes[e]) give y = 0 and receive zero gradient. GEMMs accumulate in f32; the compute
    dtype is ``x.dtype`` (weights are cast to it), gradients come back in each input's dtype.
    The backward is explicit: dgrad ``dz @ W^T`` and wgrad ``x_e^T @ dz_e`` GEMMs per expert
    (``ragged_dot_general`` with a contracted ragged axis for the ragged layout, einsums for
    the padded one, `moe._gmm_pallas` ``gmm``/``tgmm`` kernels for 'pallas'); ``group_sizes``
    gets no gradient.

    Args:
      x: expert inputs, ragged ``[R, d_model]`` (rows grouped by expert, as the 'ragged'
        dispatch gives) or padded ``[E, C, d_model]`` (as the 'dense' dispatch gives).
      group_sizes: int32 ``[E]`` real rows per local expert. Required for ragged x; may be
        None for padded x (all C rows real).
      w_gate_up: ``[E, d_model, 2*d_ff]``; columns ``[:d_ff]`` gate, ``[d_ff:]`` up.
      w_down: ``[E, d_ff, d_model]``.
      backend: 'ragged_dot' (2-D x, `jax.lax.ragged_dot_general`), 'einsum' (3-D x, batched
        einsum), 'pallas' (2-D x, Pallas grouped-GEMM kernels: each expert's rows padded only
        to the 128-row tile, so skewed routing costs no padding; compiled through Triton on
        GPU, run in Pallas interpret mode when lowered for CPU, which is slow and meant for
        tests; ValueError on TPU; works inside ``jax.shard_map``, as in `moe.MoE`), or
        'auto' (by the rank of x: 'einsum' for 3-D; for 2-D 'pallas' on NVIDIA GPUs,
        measured at 0.74-0.77 of the dense rate against 0.15 for 'ragged_dot' on H200, and
        'ragged_dot' elsewhere). FP8 options work with every backend: operands are
        quantized and dequantized before the GEMM.
      gemm_dtype: 'fp8' feeds the two forward GEMMs FP8 operands: activations (x and h) per
        row in 1 x block_size blocks; weights quantized inside every call from the params
        passed in (nothing is cached), per output column in blocks of block_size along the
        contraction axis (d_model for W_gu, d_ff for W_d). Scales are E8M0 (`moe.fp8`). The
        dgrad GEMMs use the unquantized weights in the compute dtype.
      save_z: what the backward keeps of z (SonicMoE): 'bf16' keeps z unquantized in the
        compute dtype (bf16 for bf16 activations); 'fp8' keeps z as `moe.fp8` blocks of
        block_size per row (about half the bytes); 'recompute' keeps no z and recomputes
        x @ W_gu (with the forward's precision) in the backward.
      wgrad_dtype: 'fp8' feeds the two weight-gradient GEMMs FP8 operands, blocks of
        block_size along the token axis (their contraction axis; zero-padded to whole blocks).
      block_size: FP8 block length; FP8-quantized feature axes must be multiples of
        4 * block_size.

    Returns:
      y with the shape and dtype of x.

    Example:
      >>> E, d, f = 4, 512, 512
      >>> x = jnp.ones((64, d), jnp.bfloat16)
      >>> gs = jnp.array([16, 0, 40, 8], jnp.int32)
      >>> w_gu = jnp.full((E, d, 2 * f), 0.01, jnp.bfloat16)
      >>> w_d = jnp.full((E, f, d), 0.01, jnp.bfloat16)
      >>> gated_experts(x, gs, w_gu, w_d, gemm_dtype="fp8", save_z="recompute").shape
      (64, 512)

    References:
      SonicMoE (Guo et al., 2025), "SonicMoE: Accelerating MoE with IO and Tile-aware
      Optimizations": saving z instead of h, FP8 z, recomputation in the backward.
      DeepSeek-AI (2024), "DeepSeek-V3 Technical Report", Sec. 3.3 (FP8 training): 1 x 128
      activation blocks, per-block weight scales, f32 accumulation.
    """
    for name, value, allowed in (
        ("gemm_dtype", gemm_dtype, _GEMM_DTYPES),
        ("save_z", save_z, _SAVE_Z),
        ("wgrad_dtype", wgrad_dtype, _GEMM_DTYPES),
    ):
        _check_choice(name, value, allowed)
    resolved = _resolve_backend(backend, x.ndim)
    _check_shapes(x, group_sizes, w_gate_up, w_down)
    opts = _Opts(resolved, gemm_dtype, save_z, wgrad_dtype, block_size, group_sizes is not None)
    _check_fp8_dims(opts, w_gate_up.shape[1], w_down.shape[1])
    if group_sizes is None:
        group_sizes = jnp.full((x.shape[0],), x.shape[1], jnp.int32)
    return _experts(opts, x, group_sizes.astype(jnp.int32), w_gate_up, w_down)
