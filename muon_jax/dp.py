"""Data-parallel gradients that reach sharded Muon unreduced, so it can reduce-scatter them.

With replicated params, ``jax.grad`` all-reduces each data-parallel gradient inside the
backward pass (the partitioner places it in the weight-gradient dot), before any optimizer sees
it. Differentiating with respect to a *reduced view* of the Muon matrices (a free cast on an
Explicit mesh) leaves those gradients as per-device partial sums (type ``{U: axes}``); sharded
Muon then moves them to their owners with one reduce-scatter per stack, and with the all-gather
of the updates the step moves the bytes of one all-reduce, like data-parallel AdamW.

References:
  JAX "Autodiff and sharding" (reduced / unreduced types). Rajbhandari et al., "ZeRO" (2020).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_jax import _dims, _masking

__all__ = ["reduce_unreduced", "reduced_view"]


def _parts(spec: P) -> tuple[Any, ...]:
    return tuple(spec.partitions)


def reduced_view(
    params: Any,
    axes: str | Sequence[str],
    *,
    muon_mask: _masking.MaskLike | None = None,
    dimension_numbers: _dims.DimNumsLike = None,
) -> Any:
    """Cast Muon's params to ``reduced`` over ``axes`` (free): their gradients come unreduced.

    Use it inside the differentiated call:
    ``grads = jax.grad(loss)(reduced_view(params, 'data'), batch)``. Only leaves routed to Muon
    (``muon_mask``, default :func:`muon_jax.default_muon_mask`) are cast: matrices feed matmuls,
    which accept reduced operands, while biases and norms added to batch-sharded activations
    must stay replicated (their gradients are all-reduced as usual). Explicit mesh axes only.

    Args:
      params: a tree of arrays, replicated over ``axes`` on an Explicit mesh.
      axes: the data-parallel mesh axes.
      muon_mask: which leaves to cast, as in :func:`muon_jax.muon` (None: the default rule).
      dimension_numbers: as in :func:`muon_jax.muon` (for the default rule).

    Returns:
      The same values; Muon leaves typed ``{R: axes}``.

    Raises:
      ValueError: naming the leaf and axis when a cast leaf is sharded over one of ``axes``.

    Example:
      >>> g = jax.grad(loss)(reduced_view(params, 'data'), batch)  # Muon leaves: {U: data}

    References:
      JAX "Autodiff and sharding"; ZeRO (Rajbhandari et al., 2020).
    """
    axes_set = frozenset((axes,) if isinstance(axes, str) else axes)
    flags = _masking.resolve_muon_mask(muon_mask, params, dimension_numbers=dimension_numbers)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for (path, x), flag in zip(flat, flags, strict=True):
        if not flag:
            out.append(x)
            continue
        sharding = jax.typeof(x).sharding
        parts = _parts(sharding.spec)
        used = {a for e in parts if e is not None for a in ((e,) if isinstance(e, str) else e)}
        if used & axes_set:
            raise ValueError(
                f"reduced_view: leaf {_dims.path_str(path)!r} is sharded over mesh axes "
                f"{sorted(used & axes_set)}; only params replicated over {sorted(axes_set)} "
                "can be viewed as reduced (leave FSDP-sharded params as they are)."
            )
        target = P(*parts, reduced=axes_set | set(sharding.spec.reduced))
        out.append(jax.sharding.reshard(x, NamedSharding(sharding.mesh, target)))
    return jax.tree.unflatten(treedef, out)


def reduce_unreduced(x: Any) -> Any:
    """All-reduce an array that is unreduced over mesh axes (identity for anything else).

    Args:
      x: an array, possibly of type ``{U: axes}``.

    Returns:
      ``x`` with the same spec minus ``unreduced`` (one all-reduce when it had any).

    Example:
      >>> grads = jax.tree.map(reduce_unreduced, grads)  # before a nonlinear transform

    References:
      JAX "Autodiff and sharding" (unreduced types).
    """
    try:
        sharding = jax.typeof(x).sharding
        unreduced = sharding.spec.unreduced
    except (AttributeError, TypeError):
        return x
    if not unreduced:
        return x
    spec = P(*_parts(sharding.spec), reduced=sharding.spec.reduced)
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, spec))
