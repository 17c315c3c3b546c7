"""Tile sizes of the grouped-GEMM kernels: checked dataclass fields, and padding to the tiles.

The tiling dataclasses of `accel_kernels.gmm.triton` and `accel_kernels.gmm.mosaic_kernel`
declare each
field with
:func:`tile_size` (a power of two) or :func:`count` (a bounded int) and call
:func:`check_fields` in ``__post_init__``, so one function words every error.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def tile_size(default: int, minimum: int) -> int:
    """A dataclass field holding a power of two >= ``minimum`` (checked by `check_fields`)."""
    return dataclasses.field(default=default, metadata={"minimum": minimum, "power_of_two": True})


def count(default: int, minimum: int = 1) -> int:
    """A dataclass field holding an int >= ``minimum`` (checked by `check_fields`)."""
    return dataclasses.field(default=default,
                             metadata={"minimum": minimum, "power_of_two": False})


def check_fields(obj) -> None:
    """ValueError naming the field unless every `tile_size` / `count` field of ``obj`` holds
    an allowed value.

    Example:
      >>> @dataclasses.dataclass(frozen=True)
      ... class T:
      ...     block: int = tile_size(64, 16)
      ...     warps: int = count(4)
      ...     def __post_init__(self):
      ...         check_fields(self)
      >>> T(block=48)
      Traceback (most recent call last):
      ...
      ValueError: T.block=48; use a power of two >= 16.
    """
    for field in dataclasses.fields(obj):
        if "power_of_two" not in field.metadata:
            continue
        v = getattr(obj, field.name)
        lo, pow2 = field.metadata["minimum"], field.metadata["power_of_two"]
        if not isinstance(v, int) or v < lo or (pow2 and v & (v - 1)):
            kind = "a power of two" if pow2 else "an int"
            raise ValueError(f"{type(obj).__name__}.{field.name}={v!r}; use {kind} >= {lo}.")


def pad_to(a: jax.Array, axis: int, multiple: int) -> jax.Array:
    """``a`` padded with zeros at the end of ``axis`` to a multiple of ``multiple``."""
    pad = (-a.shape[axis]) % multiple
    if not pad:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, pad)
    return jnp.pad(a, widths)
