"""The symmetric-product registry: ``u w^T`` for products known to be symmetric, from the tiles
on and above the diagonal, with one ``implementation`` argument (`accel_kernels.registry`).

* ``'xla'``: the full product (every tile), on any platform;
* ``'mosaic'``: the Pallas Mosaic GPU kernel (`accel_kernels.symmetric.mosaic`) on Hopper
  GPUs, which computes only the ``[tile_m, 2 tile_n]`` output tiles that touch the upper
  triangle; lowered for the CPU, its XLA emulation: for :func:`upper_product`, the full product
  with the tiles the kernel does not write set to NaN, so a consumer that read them would show
  it; for :func:`symmetric_product` (the kernel mirroring its tiles itself), the full product's
  upper triangle mirrored, as the kernel builds it;
* ``'auto'``: ``'mosaic'`` on Hopper GPUs, ``'xla'`` elsewhere.

Operands the kernel's tiles do not divide are padded with zeros (zero rows add zero rows and
columns to the product), which costs a copy of both operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from accel_kernels import registry
from accel_kernels.platform import cuda_capability, target_platform

__all__ = ["DTYPES", "IMPLEMENTATIONS", "mirror_upper", "symmetric_product", "tile_share",
           "upper_product"]

IMPLEMENTATIONS = registry.Registry("symmetric", {"mosaic": "accel_kernels.symmetric.mosaic"})

DTYPES = ("bfloat16", "float16")
"""Operand dtypes of the ``'mosaic'`` kernel (16-bit wgmma operands, f32 accumulation)."""


def mirror_upper(c: jax.Array) -> jax.Array:
    r"""The symmetric matrix whose upper triangle (diagonal included) is ``c``'s.

    .. math::
      S_{ij} = c_{ij} \ (i \le j), \qquad S_{ij} = c_{ji} \ (i > j) .

    Reads nothing below ``c``'s diagonal, so those entries may be undefined (the tiles
    :func:`upper_product` leaves unwritten). One elementwise pass.

    Args:
      c: ``[..., p, p]``.

    Returns:
      ``[..., p, p]``, symmetric.

    >>> import jax.numpy as jnp
    >>> mirror_upper(jnp.array([[1., 2.], [jnp.nan, 3.]])).tolist()
    [[1.0, 2.0], [2.0, 3.0]]
    """
    i = jnp.arange(c.shape[-1])
    return jnp.where(i[:, None] <= i[None, :], c, jnp.swapaxes(c, -1, -2))


def tile_share(p: int, implementation: str = "mosaic") -> tuple[int, int]:
    """``(computed, total)`` output tiles of a ``[p, p]`` product: the kernel's share for
    ``'mosaic'`` (``p`` padded as it pads it; about half for large ``p``), ``(1, 1)`` for
    ``'xla'``. For cost models (FLOP counts of a symmetric product).

    >>> tile_share(4096), tile_share(4096, "xla")
    ((272, 512), (1, 1))
    """
    if registry.canonical(implementation) == "xla":
        return 1, 1
    return IMPLEMENTATIONS.module("mosaic").upper_tile_share(p)


def upper_product(u: jax.Array, w: jax.Array, *, out_dtype: DTypeLike | None = None,
                  implementation: registry.Implementation = "auto") -> jax.Array:
    r"""``u @ w^T`` on and above the diagonal, for products known to be symmetric.

    .. math::
      C_{ij} = \sum_k u_{ik} w_{jk} \quad (i \le j);

    below the diagonal ``C`` is undefined where the kernel runs (NaN in its CPU emulation):
    mirror it (:func:`mirror_upper`) for the symmetric product, or take
    :func:`symmetric_product`, whose kernel writes the mirror itself.

    Args:
      u: ``[..., p, r]``.
      w: ``[..., p, r]``, the same shape (``w = u`` for ``u u^T``).
      out_dtype: result dtype (default: the operands'); accumulation is f32.
      implementation: ``'auto'``, ``'xla'`` or ``'mosaic'`` (module docstring); ``'mosaic'``
        needs operands of one dtype in :data:`DTYPES`.

    Returns:
      ``[..., p, p]`` in ``out_dtype``.

    Raises:
      ValueError: ``'mosaic'`` with other operand dtypes, or on a platform other than a Hopper
        GPU or the CPU (naming ``implementation``).

    >>> x = jnp.arange(6.0).reshape(2, 3)
    >>> upper_product(x, x, implementation="xla").tolist()
    [[5.0, 14.0], [14.0, 50.0]]
    """
    return _product(u, w, out_dtype, implementation, mirror=False)


def symmetric_product(u: jax.Array, w: jax.Array, *, out_dtype: DTypeLike | None = None,
                      implementation: registry.Implementation = "auto") -> jax.Array:
    r"""``u @ w^T``'s upper triangle mirrored, for products known to be symmetric: one kernel,
    no pass after it.

    .. math::
      S_{ij} = \sum_k u_{ik} w_{jk} \ (i \le j), \qquad S_{ij} = S_{ji} \ (i > j) .

    Where the kernel runs it computes the tiles of :func:`upper_product` and stores each one
    also transposed below the diagonal; everywhere the result is
    ``mirror_upper(upper_product(u, w))``, exactly symmetric (a non-symmetric ``u w^T``
    silently becomes the symmetric matrix with its upper triangle).

    Args:
      u: ``[..., p, r]``.
      w: ``[..., p, r]``, the same shape (``w = u`` for ``u u^T``).
      out_dtype: result dtype (default: the operands'); accumulation is f32.
      implementation: ``'auto'``, ``'xla'`` or ``'mosaic'`` (module docstring); ``'mosaic'``
        needs operands of one dtype in :data:`DTYPES`.

    Returns:
      ``[..., p, p]`` in ``out_dtype``, symmetric.

    Raises:
      ValueError: ``'mosaic'`` with other operand dtypes, or on a platform other than a Hopper
        GPU or the CPU (naming ``implementation``).

    >>> u, w = jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.array([[1.0, 2.0], [3.0, 4.0]])
    >>> symmetric_product(u, w, implementation="xla").tolist()  # u w^T is not symmetric
    [[1.0, 3.0], [3.0, 4.0]]
    """
    return _product(u, w, out_dtype, implementation, mirror=True)


def _product(u, w, out_dtype, implementation, *, mirror: bool) -> jax.Array:
    """:func:`upper_product` (``mirror`` False) or :func:`symmetric_product` (True)."""
    if u.ndim < 2 or u.shape != w.shape:
        raise ValueError(f"u and w must be of one shape [..., p, r]; got {u.shape} and "
                         f"{w.shape}.")
    implementation = registry.canonical(implementation, allowed=("auto", "xla", "mosaic"))
    out_dtype = jnp.dtype(out_dtype or u.dtype)
    cc = cuda_capability()
    hopper = target_platform() == "gpu" and cc is not None and cc[0] == 9
    if implementation == "auto":
        implementation = "mosaic" if hopper and jnp.dtype(u.dtype).name in DTYPES else "xla"
    if implementation == "xla":
        out = jnp.einsum("...ik,...jk->...ij", u, w, preferred_element_type=jnp.float32)
        out = out.astype(out_dtype)
        return mirror_upper(out) if mirror else out
    registry.check_available("mosaic")
    if u.dtype != w.dtype or jnp.dtype(u.dtype).name not in DTYPES:
        raise ValueError(f"implementation='mosaic' needs operands of one dtype in {DTYPES}, got "
                         f"{u.dtype} and {w.dtype}; cast them or use implementation='xla'.")
    kernel = IMPLEMENTATIONS.module("mosaic")
    *batch, p, r = u.shape
    pp, rp = kernel.padded_size(p, r, u.dtype)

    def pad(x):
        x = x.reshape((-1, p, r))
        return jnp.pad(x, ((0, 0), (0, pp - p), (0, rp - r))) if (pp, rp) != (p, r) else x

    u3, w3 = pad(u), pad(w)
    if hopper:
        out = kernel.symmetric_upper(u3, w3, out_dtype=out_dtype, mirror=mirror)
    else:
        full = kernel.symmetric_upper_reference(u3, w3, out_dtype=out_dtype)
        if mirror:  # the kernel's contract: every element below the diagonal is its mirror
            out = mirror_upper(full)
        else:  # the kernel's contract: tiles it does not write are undefined (NaN here)
            out = jnp.where(np.asarray(kernel.upper_tile_mask(pp, u.dtype)), full, jnp.nan)
    return out[:, :p, :p].reshape((*batch, p, p))
