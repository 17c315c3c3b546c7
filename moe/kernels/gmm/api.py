"""The grouped-GEMM registry: one :class:`~moe.kernels.gmm.base.GroupedGemms` per
implementation, chosen by platform and token layout (``'auto'``) or by name.

* ``'ragged_dot'``: ``jax.lax.ragged_dot_general`` on ragged rows ``[R, K]`` (any platform);
* ``'einsum'``: batched einsums on capacity-padded rows ``[E, C, K]`` (any platform);
* ``'triton'``: the Pallas Triton kernels (NVIDIA GPUs; interpreted on the CPU, for tests);
* ``'mosaic'``: the Pallas Mosaic GPU kernels (Hopper; their XLA emulation on the CPU), on
  ragged rows or padded slots run as rows, in the tile-aligned layout.

The old name ``'pallas'`` of ``'triton'`` is still accepted, with a DeprecationWarning
(:func:`canonical_backend`).
"""

from __future__ import annotations

import typing
import warnings
from typing import Literal

from moe.kernels.gmm import mosaic, triton, xla
from moe.kernels.gmm.base import (
    GROUP_ALIGNMENT,
    GroupedGemms,
    RowGroups,
    align_map,
    aligned_rows,
    group_of_rows,
    sizes_of,
    split_groups,
)
from moe.kernels.platform import cuda_capability, target_platform

__all__ = ["GROUP_ALIGNMENT", "IMPLEMENTATIONS", "Backend", "GroupedGemms", "RowGroups",
           "align_map", "aligned_rows", "auto_backend", "canonical_backend",
           "check_backend_available", "group_of_rows", "resolve", "sizes_of", "split_groups"]

Backend = Literal["auto", "ragged_dot", "einsum", "triton", "mosaic"]
_BACKENDS: tuple[str, ...] = typing.get_args(Backend)

IMPLEMENTATIONS: dict[str, GroupedGemms] = {
    "ragged_dot": xla.RAGGED_DOT,
    "einsum": xla.EINSUM,
    "triton": triton.TRITON,
    "mosaic": mosaic.MOSAIC,
}


def canonical_backend(name: str) -> str:
    """``name``, with the deprecated ``'pallas'`` spelled ``'triton'`` (and a warning).

    Example:
      >>> canonical_backend("mosaic")
      'mosaic'
    """
    if name == "pallas":
        warnings.warn("backend 'pallas' is deprecated; use 'triton'", DeprecationWarning,
                      stacklevel=3)
        return "triton"
    return name


def auto_backend(x_ndim: int) -> str:
    """The backend ``'auto'`` picks for x of rank ``x_ndim`` on the default platform.

    Hopper GPUs (compute capability 9.x): 'mosaic' for both layouts (padded x as rows, faster
    than the 'einsum' GEMMs in bf16 and FP8: BENCHMARKS.md, Grouped GEMM). Other NVIDIA GPUs:
    'einsum' for padded x, 'triton' for ragged x. Elsewhere (CPU, TPU): 'einsum' and
    'ragged_dot'.

    Example:
      >>> auto_backend(3), auto_backend(2)  # on the CPU
      ('einsum', 'ragged_dot')
    """
    cc = cuda_capability()
    if cc is not None and cc[0] == 9:
        return "mosaic"
    if x_ndim == 3:
        return "einsum"
    return "ragged_dot" if cc is None else "triton"


def resolve(backend: str, x_ndim: int) -> str:
    """The implementation that runs ``backend`` on x of rank ``x_ndim``: ``'auto'`` resolved
    (:func:`auto_backend`), an explicit one checked against the layout and the platform.

    Args:
      backend: one of :data:`Backend` (or the deprecated ``'pallas'``).
      x_ndim: 2 (ragged ``[R, d_model]``) or 3 (padded ``[E, C, d_model]``).

    Returns:
      A key of :data:`IMPLEMENTATIONS`.

    Example:
      >>> resolve("auto", 2), resolve("mosaic", 3)  # on the CPU
      ('ragged_dot', 'mosaic')
    """
    backend = canonical_backend(backend)
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; use one of {_BACKENDS}.")
    if x_ndim not in (2, 3):
        raise ValueError(
            f"x has rank {x_ndim}; pass x as [R, d_model] (rows grouped by expert, "
            "backend='mosaic', 'triton' or 'ragged_dot') or [E, C, d_model] (capacity-padded, "
            "backend='einsum')."
        )
    if backend == "auto":
        return auto_backend(x_ndim)
    want = IMPLEMENTATIONS[backend].x_ndim
    if want != x_ndim and not (backend == "mosaic" and x_ndim == 3):
        layout = "[R, d_model]" if want == 2 else "[E, C, d_model]"
        raise ValueError(
            f"backend={backend!r} takes x as {layout} but x has rank {x_ndim}; "
            "use backend='auto' or reshape x."
        )
    check_backend_available(backend)
    return backend


def check_backend_available(backend: Backend) -> None:
    """ValueError unless ``backend`` can run on the default platform.

    ``'triton'`` runs compiled on NVIDIA GPUs and interpreted (slowly) on CPU; ``'mosaic'``
    runs its kernels on Hopper GPUs and their XLA emulation on CPU (for tests); the other
    backends run everywhere.

    Example:
      >>> check_backend_available("mosaic")  # passes on the CPU (XLA emulation)
    """
    backend = canonical_backend(backend)
    if backend == "triton":
        try:
            triton.check_platform()
        except ValueError as e:
            raise ValueError(
                f"backend='triton' is unavailable: {e} (or 'einsum' with capacity-padded x)."
            ) from None
    if backend == "mosaic":
        cc = cuda_capability()
        if target_platform() not in ("cpu", "gpu") or (cc is not None and cc[0] != 9):
            raise ValueError(
                "backend='mosaic' needs an NVIDIA Hopper GPU (wgmma; compute capability 9.x) "
                f"or the CPU (emulated), not {target_platform()!r} / {cc}; use "
                "backend='auto'."
            )
