"""The one pattern every kernel family here follows (after tokamax's ``ops/*/api.py``).

Each family (`accel_kernels.gmm`, `accel_kernels.quant`, `accel_kernels.wire`,
`accel_kernels.symmetric`) has an ``api.py`` whose functions take one argument,
``implementation``, one of :data:`Implementation`, and a map of those names to the modules that
implement them (``xla.py``, ``triton.py``, ``mosaic.py``), imported on first use, so importing
a family (or the packages above it) loads no Pallas backend. One rule decides what runs
(:func:`run`):

* ``'xla'``: the XLA reference, on every platform;
* ``'auto'``: lowered for CUDA, the platform's kernel where it takes the operands (Mosaic GPU
  on Hopper, :func:`accel_kernels.platform.prefer_mosaic_gpu`; Triton before Hopper), the XLA
  reference for operands it does not take and on every other platform;
* ``'triton'`` / ``'mosaic'``: that kernel, refused with a ``ValueError`` naming the argument
  when it does not take the operands or the target is neither a CPU nor an NVIDIA GPU it runs
  on (Mosaic GPU: Hopper); lowered for the CPU, Triton runs interpreted and Mosaic GPU gives
  way to its XLA reference (both for tests).

Old spellings (``'pallas'`` for ``'triton'``; ``'ragged_dot'`` and ``'einsum'``, the XLA
grouped GEMMs of the two token layouts, for ``'xla'``) are mapped by :func:`canonical`, the one
deprecation shim, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import typing
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Literal

from jax import lax

from accel_kernels.platform import cuda_capability, prefer_mosaic_gpu, target_platform

Implementation = Literal["auto", "xla", "triton", "mosaic"]
IMPLEMENTATIONS: tuple[str, ...] = typing.get_args(Implementation)

DEPRECATED: Mapping[str, str] = {"pallas": "triton", "ragged_dot": "xla", "einsum": "xla"}
"""Old spellings and the implementation each now names."""


def canonical(value: Any, argument: str = "implementation",
              allowed: tuple[str, ...] = IMPLEMENTATIONS) -> str:
    """``value`` checked against ``allowed``, an old spelling (:data:`DEPRECATED`) mapped to
    its name with a ``DeprecationWarning``; a ``ValueError`` naming ``argument`` otherwise.

    Example:
      >>> canonical("mosaic")
      'mosaic'
      >>> canonical("cuda", "wire_implementation")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: wire_implementation='cuda' is not supported; use one of ('auto', 'xla', ...
    """
    if isinstance(value, str) and value in DEPRECATED:
        new = DEPRECATED[value]
        warnings.warn(f"{argument}={value!r} is deprecated; use {new!r}", DeprecationWarning,
                      stacklevel=3)
        value = new
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{argument}={value!r} is not supported; use one of {allowed} ('auto' "
                         "picks the platform's kernel where it takes the operands).")
    return value


class Registry:
    """One family's map of implementation names to their modules, imported on first use.

    Example:
      >>> r = Registry("demo", {"xla": "accel_kernels.tiling"})
      >>> r.module("xla").__name__
      'accel_kernels.tiling'
    """

    def __init__(self, family: str, modules: Mapping[str, str]):
        self.family = family
        self.modules = dict(modules)

    def module(self, name: str) -> ModuleType:
        """The module implementing ``name`` (imported now if it was not yet)."""
        return importlib.import_module(self.modules[name])


@dataclasses.dataclass(frozen=True)
class Kernels:
    """One call's implementations of an operation.

    ``xla(*args)`` runs anywhere; ``mosaic(*args)`` and ``triton(interpret, *args)`` are the
    kernels, ``None`` where they do not take the call's operands (``mosaic_needs`` /
    ``triton_needs``: what they would need, for the refusal).
    """

    xla: Callable[..., Any]
    mosaic: Callable[..., Any] | None = None
    triton: Callable[..., Any] | None = None
    mosaic_needs: str = ""
    triton_needs: str = ""


def check_available(implementation: str, argument: str = "implementation") -> None:
    """``ValueError`` naming ``argument`` unless the kernel ``implementation`` names can run
    where programs are compiled for (:mod:`accel_kernels.platform`): Triton on NVIDIA GPUs and
    the CPU (interpreted), Mosaic GPU on Hopper GPUs and the CPU (its XLA reference).

    Example:
      >>> check_available("mosaic")  # on the CPU
    """
    platform, cc = target_platform(), cuda_capability()
    hopper = platform == "gpu" and cc is not None and cc[0] == 9
    if implementation == "mosaic" and not (platform == "cpu" or hopper):
        raise ValueError(f"{argument}='mosaic' needs an NVIDIA Hopper GPU (compute capability "
                         f"9.x) or the CPU, not {platform!r} / {cc}; use 'auto'.")
    if implementation == "triton" and platform not in ("cpu", "gpu"):
        raise ValueError(f"{argument}='triton' needs an NVIDIA GPU or the CPU (interpreted), "
                         f"not {platform!r}; use 'auto'.")


def run(kernels: Kernels, args: tuple, implementation: str, *,
        argument: str = "implementation", shape: tuple[int, ...] = ()) -> Any:
    """``args`` through the implementation the one rule (module docstring) picks.

    Args:
      kernels: the call's implementations.
      args: their operands.
      implementation: one of :data:`Implementation` (already :func:`canonical`).
      argument: the argument a refusal names.
      shape: the operands' shape a refusal quotes.

    Returns:
      What the chosen implementation returns (through ``lax.platform_dependent`` where the
      choice depends on the platform the program is lowered for).

    Example:
      >>> import jax.numpy as jnp
      >>> k = Kernels(xla=lambda x: x + 1, mosaic=None, mosaic_needs="rows of 128")
      >>> run(k, (jnp.ones(2),), "auto").tolist()
      [2.0, 2.0]
      >>> run(k, (jnp.ones(2),), "mosaic", shape=(2,))  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: implementation='mosaic' does not take operands of shape (2,) (rows of 128)...
    """
    if implementation == "xla":
        return kernels.xla(*args)
    if implementation == "auto":
        if prefer_mosaic_gpu():
            compiled = kernels.mosaic
        else:
            compiled = None if kernels.triton is None else functools.partial(kernels.triton,
                                                                              False)
        if compiled is None:
            return kernels.xla(*args)
        return lax.platform_dependent(*args, cuda=compiled, default=kernels.xla)
    check_available(implementation, argument)
    kernel = kernels.mosaic if implementation == "mosaic" else kernels.triton
    if kernel is None:
        needs = kernels.mosaic_needs if implementation == "mosaic" else kernels.triton_needs
        raise ValueError(f"{argument}={implementation!r} does not take operands of shape "
                         f"{tuple(shape)} ({needs}); use 'auto' or 'xla'.")
    if implementation == "mosaic":
        return lax.platform_dependent(*args, cuda=kernel, default=kernels.xla)
    if implementation == "triton":
        return lax.platform_dependent(*args, cpu=functools.partial(kernel, True),
                                      default=functools.partial(kernel, False))
    raise ValueError(f"{argument}={implementation!r} is not supported; use one of "
                     f"{IMPLEMENTATIONS}.")
