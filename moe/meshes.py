"""The mesh an MoE call runs on, and placing arrays on it (Explicit or Auto axes)."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["is_explicit", "reshard", "resolve"]


def resolve(mesh):
    """``mesh``, else the ambient (``jax.set_mesh``) mesh, else None."""
    if mesh is not None:
        return mesh
    ambient = jax.sharding.get_abstract_mesh()
    return None if ambient.empty else ambient


def is_explicit(mesh) -> bool:
    """Whether any axis of ``mesh`` is Explicit."""
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def reshard(a: jax.Array, mesh, spec: P) -> jax.Array:
    """Puts ``a`` on ``spec``: ``reshard`` on Explicit meshes, a constraint on Auto ones."""
    sharding = jax.sharding.NamedSharding(mesh, spec)
    if is_explicit(mesh):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)
