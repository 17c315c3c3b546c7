"""Varying-axes types for kernels called inside ``jax.shard_map(check_vma=True)``.

Inside such a ``shard_map`` every value's type names the mesh axes it varies over (its
varying manual axes, "vma"), and a kernel call (``pallas_call``, ``plgpu.kernel``) must declare
those of its outputs: the union of the operands' axes (:func:`out_struct`). A compiled kernel
is traced with the types stripped, so that declaration is all it needs. Pallas interpret mode
is not: it evaluates the kernel's jaxpr with jax ops on the typed operands, and ops that mix
the varying blocks with the grid's invariant program ids fail the check. :func:`unchecked`
runs such a call in a nested ``shard_map`` over no new axes with ``check_vma=False`` (lowered
inline, no op of its own) on untyped copies, and types its result back as varying (``pcast``,
no work at run time). jax 0.12.1 refuses a ``shard_map`` over no new axes; there the call
runs under the flag such a ``shard_map`` would set (an internal of jax, the one place this
package reads one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

__all__ = ["as_varying", "out_struct", "unchecked", "varying_axes", "varying_of"]


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` is typed as varying over (empty outside a check_vma shard_map)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # pragma: no cover - older jax


def varying_of(*args) -> frozenset:
    """The union of :func:`varying_axes` over ``args``."""
    return frozenset().union(*map(varying_axes, args))


def out_struct(shape, dtype, varying: frozenset) -> jax.ShapeDtypeStruct:
    """A kernel output type, varying over ``varying``."""
    mat_type = getattr(jax.sharding, "ManualAxisType", None)
    if mat_type is not None:  # jax >= 0.10
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat_type(varying=varying))
    try:  # pragma: no cover - older jax
        return jax.ShapeDtypeStruct(shape, dtype, vma=varying)
    except TypeError:  # pragma: no cover - jax without varying-axes types
        return jax.ShapeDtypeStruct(shape, dtype)


def as_varying(x: jax.Array, varying: frozenset) -> jax.Array:
    """``x`` typed varying over ``varying`` (no run-time work); a kernel whose output type
    ignores the declared axes (``plgpu.kernel``) gets them this way."""
    missing = tuple(sorted(varying - varying_axes(x), key=str))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # pragma: no cover - older jax


def _untyped(x: jax.Array) -> jax.Array:
    """``x`` without its varying-axes type (``x - 0`` is exact, -0.0 and NaN included)."""
    return lax.sub(x, jnp.zeros((), x.dtype))


def unchecked(fn, varying: frozenset, *args):
    """``fn(*args)`` traced and lowered with check_vma=False, its results (a pytree) typed
    ``varying``."""
    if not varying:  # not inside a check_vma shard_map, or nothing varies
        return fn(*args)
    mesh = jax.sharding.get_abstract_mesh()
    nested = jax.shard_map(
        lambda *a: fn(*map(_untyped, a)),
        mesh=mesh,
        in_specs=(P(),) * len(args),
        out_specs=P(),
        # The axes that are manual already (only those: not the Auto ones of a partly manual
        # shard_map): no new manual axes, so the body is lowered inline, no op of its own.
        axis_names=frozenset(mesh.manual_axes),
        check_vma=False,
    )
    try:
        out = nested(*args)
    except ValueError as err:
        # jax >= 0.12.1 refuses a shard_map that makes no axis manual; the flag that
        # shard_map(check_vma=False) sets for its body is then set directly.
        if "at least one mesh axis name to go manual" not in str(err):
            raise
        from jax._src import config as jax_config  # noqa: PLC0415 - only on that path
        with jax_config._check_vma(False):
            out = fn(*map(_untyped, args))
    return jax.tree.map(lambda o: as_varying(o, varying), out)
