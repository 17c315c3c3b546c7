"""The grouped-GEMM registry: one :class:`~accel_kernels.gmm.base.GroupedGemms` per
implementation, chosen by one ``implementation`` argument (the registry's pattern,
`accel_kernels.registry`), by platform and token layout for ``'auto'``.

* ``'xla'``: ``jax.lax.ragged_dot_general`` on ragged rows ``[R, K]``, batched einsums on
  capacity-padded rows ``[E, C, K]`` (any platform; the old names ``'ragged_dot'`` and
  ``'einsum'`` of the two);
* ``'triton'``: the Pallas Triton kernels (NVIDIA GPUs; interpreted on the CPU, for tests) on
  ragged rows;
* ``'mosaic'``: the Pallas Mosaic GPU kernels (Hopper; their XLA emulation on the CPU), on
  ragged rows or padded slots run as rows, in the tile-aligned layout.

``'auto'`` (:func:`auto_implementation`): ``'mosaic'`` on Hopper, before Hopper ``'triton'``
for ragged rows and ``'xla'`` for padded ones, ``'xla'`` elsewhere.
"""

from __future__ import annotations

from accel_kernels import registry
from accel_kernels.gmm.base import (
    GROUP_ALIGNMENT,
    GroupedGemms,
    RowGroups,
    align_map,
    aligned_rows,
    group_of_rows,
    sizes_of,
    split_groups,
)
from accel_kernels.platform import cuda_capability
from accel_kernels.registry import Implementation

__all__ = ["GROUP_ALIGNMENT", "IMPLEMENTATIONS", "GroupedGemms", "Implementation", "RowGroups",
           "align_map", "aligned_rows", "auto_implementation", "gemms", "group_of_rows",
           "resolve", "sizes_of", "split_groups"]

IMPLEMENTATIONS = registry.Registry("gmm", {
    "xla": "accel_kernels.gmm.xla",
    "triton": "accel_kernels.gmm.triton",
    "mosaic": "accel_kernels.gmm.mosaic",
})

_ROWS = {"triton": 2}  # the token layouts (rank of x) an implementation takes; others: both


def auto_implementation(x_ndim: int) -> str:
    """The implementation ``'auto'`` picks for x of rank ``x_ndim`` on the target platform.

    Hopper GPUs (compute capability 9.x): ``'mosaic'`` for both layouts (padded x as rows).
    Other NVIDIA GPUs: ``'xla'`` for padded x (one batched GEMM), ``'triton'`` for ragged x.
    Elsewhere (CPU, TPU): ``'xla'``.

    Example:
      >>> auto_implementation(3), auto_implementation(2)  # on the CPU
      ('xla', 'xla')
    """
    cc = cuda_capability()
    if cc is not None and cc[0] == 9:
        return "mosaic"
    if x_ndim == 3 or cc is None:
        return "xla"
    return "triton"


def resolve(implementation: str, x_ndim: int, argument: str = "implementation") -> str:
    """The implementation that runs ``implementation`` on x of rank ``x_ndim``: ``'auto'``
    resolved (:func:`auto_implementation`), an explicit one checked against the layout and the
    platform (a ``ValueError`` naming ``argument`` otherwise).

    Args:
      implementation: one of :data:`accel_kernels.registry.Implementation` (or an old
        spelling, with a ``DeprecationWarning``).
      x_ndim: 2 (ragged ``[R, d_model]``) or 3 (padded ``[E, C, d_model]``).
      argument: the argument an error names.

    Returns:
      ``'xla'``, ``'triton'`` or ``'mosaic'``.

    Example:
      >>> resolve("auto", 2), resolve("mosaic", 3)  # on the CPU
      ('xla', 'mosaic')
    """
    implementation = registry.canonical(implementation, argument)
    if x_ndim not in (2, 3):
        raise ValueError(
            f"x has rank {x_ndim}; pass x as [R, d_model] (rows grouped by expert) or "
            "[E, C, d_model] (capacity-padded).")
    if implementation == "auto":
        return auto_implementation(x_ndim)
    if _ROWS.get(implementation, x_ndim) != x_ndim:
        raise ValueError(
            f"{argument}={implementation!r} takes x as [R, d_model] but x has rank {x_ndim}; "
            f"use {argument}='auto', 'xla' or 'mosaic', or reshape x.")
    registry.check_available(implementation, argument)
    return implementation


def gemms(implementation: str, x_ndim: int) -> GroupedGemms:
    """The GEMMs of a resolved ``implementation`` (:func:`resolve`) for x of rank ``x_ndim``.

    Example:
      >>> gemms("xla", 3).x_ndim, gemms("mosaic", 2).aligned
      (3, True)
    """
    module = IMPLEMENTATIONS.module(implementation)
    if implementation == "xla":
        return module.RAGGED_DOT if x_ndim == 2 else module.EINSUM
    return module.GEMMS
