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
