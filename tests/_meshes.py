"""The tests' device meshes, shared by the test files, tests/_tiny_moe.py and the multi-process
worker (imported as a top-level module: pytest puts tests/ on sys.path, the worker does too)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import jax
from jax.sharding import AxisType

_AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


@functools.cache
def make_mesh(shape: tuple[int, ...], names: Sequence[str] | None = None, *,
              axis_type: Literal["explicit", "auto"] = "explicit") -> jax.sharding.Mesh:
    """A mesh over the first prod(shape) devices, every axis ``axis_type``; ``names`` defaults
    to the MoE layer's: (n,) -> ('expert',), (a, b) -> ('data', 'expert')."""
    if names is None:
        names = ("expert",) if len(shape) == 1 else ("data", "expert")
    types = (_AXIS_TYPES[axis_type],) * len(shape)
    return jax.make_mesh(shape, tuple(names), axis_types=types)
