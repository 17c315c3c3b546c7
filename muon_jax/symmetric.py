"""Products known to be symmetric (or Hermitian), computed one block triangle at a time.

Gram Newton-Schulz (:mod:`muon_jax.newton_schulz`) spends most of its work on products whose
result is symmetric: ``X X^T`` and products of polynomials in one Gram matrix, which commute.
Such a product needs only the tiles on and above the diagonal; the rest is the mirror image.
:func:`symmetric_matmul` is the XLA form of that idea: ``u``'s rows in ``blocks`` strips, strip
``i`` multiplied only by the columns of ``v`` from its own diagonal block on, then mirrored.
With ``k`` strips it computes ``(k + 1) / (2 k)`` of the tiles (``k = 1``: a plain matmul).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from accel_kernels.symmetric import api as symmetric_api
from accel_kernels.symmetric.api import mirror_upper

__all__ = ["TILES_DTYPES", "mirror_upper", "symmetric_matmul", "symmetric_tiles_matmul"]


def symmetric_matmul(
    u: jax.Array,
    v: jax.Array,
    *,
    blocks: int = 1,
    dtype: jax.typing.DTypeLike | None = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
    r"""``u @ v`` for operands whose product is known to be Hermitian, from one block triangle.

    With ``u`` split into ``k = blocks`` row strips ``u_i`` (rows ``[s_i, s_{i+1})``) the
    product's strip ``i`` is computed only from column ``s_i`` on, and the lower blocks are
    the conjugate transpose of the upper ones:

    .. math::
      C_{i, j} = u_i v_{:, j} \quad (j \ge i), \qquad C_{j, i} = C_{i, j}^H .

    Blocks off the diagonal mirror each other exactly; the diagonal blocks are as computed. The
    result equals ``u @ v`` when that is Hermitian, up to rounding. Nothing checks that it is:
    a non-Hermitian product silently becomes the Hermitian matrix with the same upper block
    triangle.

    Args:
      u: ``[..., p, r]``.
      v: ``[..., r, p]``.
      blocks: number of row strips ``k >= 1``; ``p`` need not divide evenly (the last strip
        is shorter). More strips skip more tiles but make smaller matmuls.
      dtype: cast both operands to this dtype first (``None``: as given).
      preferred_element_type: result / accumulation dtype of the matmuls.

    Returns:
      ``[..., p, p]``, Hermitian.

    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.key(0), (6, 4))
    >>> bool(jnp.allclose(symmetric_matmul(x, x.T, blocks=3), x @ x.T, atol=1e-5))
    True
    """
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"blocks must be an int >= 1, got {blocks!r}; 1 is a plain matmul.")
    if u.ndim < 2 or v.ndim < 2 or u.shape[-1] != v.shape[-2] or u.shape[-2] != v.shape[-1]:
        raise ValueError(f"symmetric_matmul needs u [..., p, r] and v [..., r, p]; got "
                         f"{u.shape} and {v.shape}.")
    if dtype is not None:
        u, v = u.astype(dtype), v.astype(dtype)

    def mm(a, b):
        return jnp.matmul(a, b, preferred_element_type=preferred_element_type)

    p = u.shape[-2]
    k = min(blocks, p)
    if k == 1:
        return mm(u, v)
    edges = [round(i * p / k) for i in range(k + 1)]
    strips = []
    for i in range(k):
        lo, hi = edges[i], edges[i + 1]
        with jax.named_scope(f"symmetric_strip{i}"):
            part = mm(u[..., lo:hi, :], v[..., :, lo:])  # [.., hi - lo, p - lo]
        strips.append(jnp.pad(part, [(0, 0)] * (part.ndim - 1) + [(lo, 0)]))
    upper = jnp.concatenate(strips, axis=-2)  # upper block triangle, zeros below it
    # Mirror: below the diagonal blocks take the transpose of the blocks above. A mask on
    # block indices (not on the element triangle) keeps each diagonal block as computed.
    block_of = jnp.searchsorted(jnp.asarray(edges[1:]), jnp.arange(p), side="right")
    below = block_of[:, None] > block_of[None, :]
    lower = jnp.swapaxes(upper, -1, -2)
    if jnp.iscomplexobj(lower):
        lower = lower.conj()
    return jnp.where(below, lower, upper)


TILES_DTYPES = symmetric_api.DTYPES
"""Operand dtypes of :func:`symmetric_tiles_matmul` (the kernel's 16-bit wgmma operands)."""


def symmetric_tiles_matmul(
    u: jax.Array,
    w: jax.Array,
    *,
    dtype: jax.typing.DTypeLike | None = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
    r"""``u @ w^T`` for operands whose product is known to be symmetric, from a GPU kernel that
    computes only the tiles on and above the diagonal and writes each one mirrored too.

    .. math::
      C = \mathrm{mirror}\big(\mathrm{upper\ tiles\ of\ } u w^T\big), \qquad
      C = u w^T \text{ when that is symmetric.}

    Both operands are given as rows (``w``, not ``w^T``): ``X X^T`` is
    ``symmetric_tiles_matmul(x, x)`` and, for a symmetric ``B``, ``A B`` is
    ``symmetric_tiles_matmul(a, b)``. On NVIDIA Hopper GPUs this is the Pallas Mosaic GPU
    kernel of :func:`accel_kernels.symmetric.api.symmetric_product`, which skips the output
    tiles wholly below the diagonal (about half of them) and stores each tile it computes also
    transposed below the diagonal, so no mirroring pass follows it. On the CPU it is that
    kernel's XLA emulation: the full product's upper triangle mirrored (:func:`mirror_upper`).
    Either way the result is exactly symmetric.
    Nothing checks that the product is symmetric: a non-symmetric one silently becomes the
    symmetric matrix with the same upper triangle.

    ``p`` and ``r`` that do not fit the kernel's tiles (``p % 256``, ``r % 64`` for 16-bit
    operands) are padded with zeros (zero rows add zero rows and columns to the product),
    which costs a copy of both operands.

    Args:
      u: ``[..., p, r]``.
      w: ``[..., p, r]``.
      dtype: cast both operands to this dtype first (None: as given); it must be one of
        :data:`TILES_DTYPES`.
      preferred_element_type: result dtype (default: the operands'); accumulation is f32.

    Returns:
      ``[..., p, p]``, symmetric.

    Raises:
      ValueError: operands that are not 16-bit floats, or a platform other than a Hopper GPU
        or the CPU.

    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.key(0), (300, 70)).astype(jnp.bfloat16)
    >>> c = symmetric_tiles_matmul(x, x, preferred_element_type=jnp.float32)
    >>> bool(jnp.allclose(c, jnp.matmul(x, x.T, preferred_element_type=jnp.float32),
    ...                   rtol=1e-5, atol=1e-4))
    True
    """
    if dtype is not None:
        u, w = u.astype(dtype), w.astype(dtype)
    if u.dtype != w.dtype or jnp.dtype(u.dtype).name not in TILES_DTYPES:
        raise ValueError(f"symmetric_tiles_matmul needs operands of one dtype in {TILES_DTYPES}, "
                         f"got {u.dtype} and {w.dtype}; pass dtype=jnp.bfloat16 (or use "
                         "symmetric_matmul, which takes any dtype).")
    if u.ndim < 2 or u.shape != w.shape:
        raise ValueError(f"symmetric_tiles_matmul needs u and w of one shape [..., p, r]; got "
                         f"{u.shape} and {w.shape}.")
    try:
        return symmetric_api.symmetric_product(u, w, out_dtype=preferred_element_type,
                                               implementation="mosaic")
    except ValueError as e:
        raise ValueError(f"symmetric_tiles_matmul: {e} (symmetric_blocks=1 or more strips "
                         "take symmetric_matmul, which runs anywhere).") from None
