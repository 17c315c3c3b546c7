"""FP8 dense projections: ``y = x @ W`` with e4m3 operands on the tensor cores.

The dense counterpart of the expert layer's FP8 GEMMs, for a model's other linear layers (an
attention block's QKV and output projections, a dense MLP): the same recipe and kernels as
`moe.gated_experts` (`moe.experts.fp8_gemm`), on one group of rows. ``x`` is quantized per
row (token) and ``W`` per output channel along the contraction axis, with power-of-two (E8M0)
scales; the GEMM runs on the e4m3 payloads with f32 accumulation and applies the exact scales to its
result (torchao's float8 "rowwise" recipe). ``W``'s FP8 copies are made from the param passed in, on
every call, in the K-major layout each GEMM reads: never stale after an optimizer step.

The backward is a `jax.custom_vjp`: the data gradient ``dx = dy @ W^T`` in FP8 or bf16
(``dgrad_dtype``; ``dy`` per row, ``W`` per input channel) and the weight gradient
``dW = x^T @ dy`` in bf16 or FP8 (``wgrad_dtype``; the e4m3 rows of ``x`` and ``dy`` that the
other two GEMMs read, written transposed with their row scales folded into ``dy``'s,
`moe.experts.fp8_gemm`).
bf16 weight gradients are the default, as torchao's rowwise recipe keeps them in high precision.

On Hopper GPUs the GEMMs are the Pallas Mosaic GPU wgmma kernels of
`accel_kernels.gmm.mosaic_kernel`
(scales
in their epilogue) and the quantization passes `accel_kernels.quant.api`'s one-pass kernels; on CPU
(tests) their XLA emulation computes the same products.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from accel_kernels import registry, vma
from accel_kernels.gmm import api as gmm_api
from accel_kernels.tiling import pad_to
from moe import meshes
from moe.experts import fp8_gemm
from moe.options import GemmDtype, GemmImplementation, check_choice, renamed_keywords

__all__ = ["fp8_dense"]


@dataclasses.dataclass(frozen=True)
class _DenseOptions:
    """Static options of one `fp8_dense` call (the custom_vjp's nondiff arg)."""

    gemm_implementation: str  # resolved: never 'auto'
    dgrad_dtype: str
    wgrad_dtype: str


def _rows(m: int) -> jax.Array:
    """One group of ``m`` rows: the dense GEMM as a grouped GEMM."""
    return jnp.full((1,), m, jnp.int32)


def _forward(options: _DenseOptions, x: jax.Array, w):
    """``(y, x's e4m3 rows)``; ``w``: the kernel as one group, ``[1, K, N]``, or its forward
    FP8 copy (`moe.experts.fp8_gemm.weights`)."""
    x_q = fp8_gemm.rows(x)
    with jax.named_scope("fp8_dense"):
        y = fp8_gemm.forward(gmm_api.gemms(options.gemm_implementation, 2), "fp8", x_q, w,
                             _rows(x.shape[0]), x.dtype)
    return y, x_q


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dense(options: _DenseOptions, x: jax.Array, w: jax.Array) -> jax.Array:
    return _forward(options, x, w[None])[0]


def _dense_fwd(options: _DenseOptions, x, w):
    # An FP8 data gradient: both FP8 copies of w from two passes over it, the data
    # gradient's kept for the backward (one byte per weight).
    w_fwd = w_dgrad = w[None]
    if options.dgrad_dtype == "fp8":
        w_fwd, w_dgrad = fp8_gemm.weights(w_fwd)
    y, x_q = _forward(options, x, w_fwd)
    # An FP8 weight gradient reads x's e4m3 rows (one byte per element): keep those, not x.
    return y, (x_q if options.wgrad_dtype == "fp8" else x, w, w_dgrad)


def _dense_bwd(options: _DenseOptions, res, dy):
    x, w, w_dgrad = res
    ops, gs = gmm_api.gemms(options.gemm_implementation, 2), _rows(dy.shape[0])
    dtype = dy.dtype  # y's dtype: x's
    fp8_dgrad, fp8_wgrad = options.dgrad_dtype == "fp8", options.wgrad_dtype == "fp8"
    dy_q = fp8_gemm.rows_if(fp8_dgrad or fp8_wgrad, dy)
    with jax.named_scope("fp8_dense_dgrad"):
        dx = fp8_gemm.dgrad(ops, options.dgrad_dtype, dy_q if fp8_dgrad else dy, w_dgrad, gs,
                            dtype)
    with jax.named_scope("fp8_dense_wgrad"):
        dw = fp8_gemm.wgrad(ops, options.wgrad_dtype, x, dy_q if fp8_wgrad else dy, gs,
                            w.dtype)[0]
    return dx, dw


_dense.defvjp(_dense_fwd, _dense_bwd)


def _local(options: _DenseOptions, x: jax.Array, w: jax.Array) -> jax.Array:
    """One device's rows (``x [M, K]``); rows padded to the kernels' row tiles if needed."""
    w = vma.as_varying(w, vma.varying_of(x))  # its gradient is summed over the row shards
    m = x.shape[0]
    if gmm_api.gemms(options.gemm_implementation, 2).aligned and m % gmm_api.GROUP_ALIGNMENT:
        return _dense(options, pad_to(x, 0, gmm_api.GROUP_ALIGNMENT), w)[:m]
    return _dense(options, x, w)


def fp8_dense(
    x: jax.Array,
    kernel: jax.Array,
    *,
    dgrad_dtype: GemmDtype = "fp8",
    wgrad_dtype: GemmDtype = "bf16",
    gemm_implementation: GemmImplementation = "auto",
    mesh: jax.sharding.Mesh | None = None,
    token_axes: str | tuple[str, ...] | None = None,
    **renamed: Any,
) -> jax.Array:
    """``x @ kernel`` with both operands in FP8 (e4m3) on the tensor cores.

    ``y[t, n] = (sum_k q(x)[t, k] q(W)[n, k]) * s_x[t] * s_W[n]`` with ``q`` the e4m3 payloads
    of ``x`` quantized per row and ``W = kernel`` per output channel (power-of-two scales
    ``s``), accumulated in f32, returned in ``x.dtype``. Gradients: ``dx`` in FP8
    (``dgrad_dtype='fp8'``) or the compute dtype, ``dkernel`` in ``kernel.dtype`` from a bf16
    (default) or FP8 (``wgrad_dtype='fp8'``) GEMM.

    Args:
      x: ``[..., K]`` activations in the compute dtype (bf16 on GPUs).
      kernel: ``[K, N]`` weight (e.g. ``nnx.Linear.kernel``; f32 params are quantized
        directly, with no bf16 copy).
      dgrad_dtype: precision of the data-gradient GEMM, 'fp8' or 'bf16' (the compute dtype).
      wgrad_dtype: precision of the weight-gradient GEMM, 'bf16' or 'fp8'.
      gemm_implementation: the GEMM kernels, an `accel_kernels.registry.Implementation`:
        'auto' ('mosaic' on Hopper GPUs, 'triton' on other NVIDIA GPUs, 'xla' elsewhere) or
        one of those (formerly ``backend``).
      mesh: the mesh ``x``'s rows are split over (None: the ambient ``jax.set_mesh`` mesh, or
        none). With a mesh the GEMMs run per device in a ``jax.shard_map``: ``x``'s rows
        split over ``token_axes``, ``kernel`` replicated (both moved there if they are not)
        and its gradient summed over the row shards. Inside a ``shard_map`` (mesh axes
        manual already), ``x`` is the calling device's rows and the GEMMs run on them.
      token_axes: the mesh axes ``x``'s rows (all axes but the last, flattened) are split
        over; None: every axis of ``mesh``.
      **renamed: ``backend``, the former name of ``gemm_implementation`` (a
        ``DeprecationWarning``).

    Returns:
      ``[..., N]`` in ``x.dtype``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from moe import fp8_dense
      >>> x = jax.random.normal(jax.random.key(0), (4, 64, 128), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (128, 256)) * 128**-0.5
      >>> y = jax.jit(fp8_dense)(x, w)
      >>> y.shape, y.dtype
      ((4, 64, 256), dtype(bfloat16))
      >>> ref = x.astype(jnp.float32) @ w
      >>> bool(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref) < 0.1)
      True

    References:
      Micikevicius et al. (2022), "FP8 Formats for Deep Learning"; torchao float8 training,
      the "rowwise" and "rowwise_with_gw_hp" recipes.
    """
    check_choice("dgrad_dtype", dgrad_dtype, GemmDtype)
    check_choice("wgrad_dtype", wgrad_dtype, GemmDtype)
    gemm_implementation = registry.canonical(renamed_keywords(
        "fp8_dense", renamed, gemm_implementation=gemm_implementation)["gemm_implementation"],
        "gemm_implementation")
    for name, a in (("x", x), ("kernel", kernel)):
        if not isinstance(a, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a jax or numpy array, got {type(a).__name__}; "
                            "pass jnp.asarray(...).")
    if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh,
                                                  jax.sharding.AbstractMesh)):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__} "
                        f"{mesh!r}.")
    if token_axes is not None and not (isinstance(token_axes, str) or (
            isinstance(token_axes, (tuple, list)) and all(isinstance(a, str)
                                                          for a in token_axes))):
        raise TypeError(f"token_axes must be None, a mesh axis name or a tuple of names, got "
                        f"{token_axes!r}.")
    if kernel.ndim != 2 or x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            f"kernel must be [K, N] with K = x.shape[-1]; got x {x.shape} and kernel "
            f"{kernel.shape}."
        )
    if not jnp.issubdtype(x.dtype, jnp.floating) or not jnp.issubdtype(kernel.dtype,
                                                                        jnp.floating):
        raise TypeError(f"x and kernel must be floating point, got {x.dtype} and "
                        f"{kernel.dtype}.")
    options = _DenseOptions(gmm_api.resolve(gemm_implementation, 2, "gemm_implementation"),
                            dgrad_dtype, wgrad_dtype)
    lead, (k, n) = x.shape[:-1], kernel.shape
    x2 = x.reshape(-1, k)
    mesh = meshes.resolve(mesh)
    if (mesh is None or math.prod(mesh.shape.values()) == 1
            or getattr(mesh, "manual_axes", ())):  # inside a shard_map: x is this device's
        return _local(options, x2, kernel).reshape(*lead, n)
    axes = tuple(mesh.axis_names) if token_axes is None else (
        (token_axes,) if isinstance(token_axes, str) else tuple(token_axes))
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(f"token_axes names {a!r}, not an axis of the mesh "
                             f"{tuple(mesh.axis_names)}.")
    shards = math.prod(mesh.shape[a] for a in axes)
    if x2.shape[0] % shards:
        raise ValueError(
            f"x has {x2.shape[0]} rows, not divisible by the {shards} shards of "
            f"token_axes={axes}; pad the batch or pass token_axes= fewer axes."
        )
    out_spec = jax.typeof(x2).sharding.spec if meshes.is_explicit(mesh) else None
    rows = P(axes, None)
    y = jax.shard_map(functools.partial(_local, options), mesh=mesh, in_specs=(rows, P()),
                      out_specs=rows)(meshes.reshard(x2, mesh, rows),
                                      meshes.reshard(kernel, mesh, P()))
    if out_spec is not None:  # Explicit axes: y's rows sharded as x's were
        y = meshes.reshard(y, mesh, P(*out_spec[:1], None))
    return y.reshape(*lead, n)
