"""The grouped GEMMs in XLA: 'ragged_dot' (ragged rows, ``jax.lax.ragged_dot_general``),
'einsum' (capacity-padded rows, batched einsums that XLA turns into one large batched GEMM)
and the emulation of the Mosaic GPU kernels that runs where they are not lowered for CUDA.

The GEMMs' interface is `accel_kernels.gmm.base`'s :class:`~accel_kernels.gmm.base.GroupedGemms`.
The FP8 products run on the e4m3 payloads upcast to bf16 (exact) and are scaled in XLA.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from accel_kernels.gmm.base import (
    GroupedGemms,
    scale_rows,
    scale_wgrad,
    scaled_mm8,
    scaled_tmm8,
    upcast,
)
from accel_kernels.tiling import pad_to


def _dn(contract, ragged, group) -> lax.RaggedDotDimensionNumbers:
    return lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(contract, ([], [])),
        lhs_ragged_dimensions=ragged,
        rhs_group_dimensions=group,
    )


RAGGED_FWD = _dn(([1], [1]), [0], [0])  # [R, k] x [E, k, n] -> [R, n]
RAGGED_KMAJOR = _dn(([1], [2]), [0], [0])  # [R, n] x [E, k, n] -> [R, k] (w^T, no copy)
RAGGED_WGRAD = _dn(([0], [0]), [0], [])  # [R, k] x [R, n] -> [E, k, n]


def ragged(a, b, gs, dn, out_dtype):
    """``jax.lax.ragged_dot_general(a, b, gs, dn)`` accumulated in f32, cast to ``out_dtype``."""
    out = lax.ragged_dot_general(a, b, gs, dn, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


RAGGED_DOT = GroupedGemms(
    2,
    fwd=lambda a, w, gs, dt: ragged(a, w, gs, RAGGED_FWD, dt),
    dgrad=lambda g, w, gs, dt: ragged(g, w, gs, RAGGED_KMAJOR, dt),
    wgrad=lambda a, g, gs, dt: ragged(a, g, gs, RAGGED_WGRAD, dt),
    mm8=scaled_mm8(lambda a, b, gs, dt: ragged(upcast(a), upcast(b), gs, RAGGED_KMAJOR, dt)),
    tmm8=scaled_tmm8(lambda at, bt, gs: ragged(upcast(at).T, upcast(bt).T, gs, RAGGED_WGRAD,
                                               jnp.float32)),
)


def _es(spec, a, b, dt):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(dt)


EINSUM = GroupedGemms(
    3,
    fwd=lambda a, w, gs, dt: _es("eck,ekn->ecn", a, w, dt),
    dgrad=lambda g, w, gs, dt: _es("ecn,ekn->eck", g, w, dt),
    wgrad=lambda a, g, gs, dt: _es("eck,ecn->ekn", a, g, dt),
    # XLA emits FP8 tensor-core GEMMs for these on Hopper (both operands K-major).
    mm8=scaled_mm8(lambda a, b, gs, dt: jnp.einsum("eck,enk->ecn", a, b,
                                                   preferred_element_type=dt)),
    tmm8=scaled_tmm8(lambda at, bt, gs: jnp.einsum("ekc,enc->ekn", at, bt,
                                                   preferred_element_type=jnp.float32)),
)


def emulated_gmm(a, b, gs, live, *scales, k_major: bool, out_dtype, width: int):
    """The Mosaic GPU ``gmm``'s result in XLA: ``a @ b[g]`` (``b [G, K, N]``) or ``a @ b[g]^T``
    (``b [G, N, K]``, ``k_major``), times ``scales = (s_a [R], s_b [G, N])`` if given, zero
    columns appended up to ``width``."""
    del live  # the rows past it are zero: computing them gives the kernel's zeros
    dn = RAGGED_KMAJOR if k_major else RAGGED_FWD
    if not scales:
        return pad_to(ragged(a, b, gs, dn, out_dtype), 1, width)
    raw = ragged(upcast(a), upcast(b), gs, dn, jnp.float32)
    return pad_to(scale_rows(raw, *scales, gs, out_dtype), 1, width)


def emulated_tgmm(a, b, gs, live, *scales, k_major: bool, out_dtype):
    """The Mosaic GPU ``tgmm``'s result in XLA: per-group ``a_g^T @ b_g`` (``a [R, N1]``,
    ``b [R, N2]``, or K-major ``[N1, R]``, ``[N2, R]``), times ``scales`` if given."""
    del live
    if k_major:
        a, b = a.T, b.T
    if not scales:
        return ragged(a, b, gs, RAGGED_WGRAD, out_dtype)
    raw = ragged(upcast(a), upcast(b), gs, RAGGED_WGRAD, jnp.float32)
    return scale_wgrad(raw, *scales, out_dtype)


