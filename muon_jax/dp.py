"""Data-parallel gradients that reach sharded Muon unreduced, so it can reduce-scatter them.

With replicated params, ``jax.grad`` all-reduces each data-parallel gradient inside the
backward pass (the partitioner places it in the weight-gradient dot), before any optimizer sees
it. Differentiating with respect to a *reduced view* of the Muon matrices (a free cast on an
Explicit mesh) leaves those gradients as per-device partial sums (type ``{U: axes}``); sharded
Muon then moves them to their owners with one reduce-scatter per stack, and with the all-gather
of the updates the step moves the bytes of one all-reduce, like data-parallel AdamW.

Transforms that run before Muon must accept unreduced arrays: :func:`clip_by_global_norm`
replaces ``optax.clip_by_global_norm`` (which has no unreduced rule for ``square``), and
:func:`reduce_unreduced` all-reduces a leaf for anything nonlinear.

References:
  JAX "Autodiff and sharding" (reduced / unreduced types). Rajbhandari et al., "ZeRO" (2020).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from muon_jax import masking, matrices

__all__ = [
    "clip_by_global_norm",
    "reduce_unreduced",
    "reduced_view",
    "scale",
    "unreduced_axes",
]


def unreduced_axes(x: Any) -> frozenset[str]:
    """The mesh axes ``x`` is unreduced over (empty for ordinary arrays and non-arrays).

    >>> unreduced_axes(jnp.ones(3))
    frozenset()
    """
    try:
        return frozenset(jax.typeof(x).sharding.spec.unreduced)
    except (AttributeError, TypeError):
        return frozenset()


def _used_axes(spec: P) -> set[str]:
    """Mesh axes that shard some dim of ``spec``."""
    return {a for e in spec.partitions if e is not None
            for a in ((e,) if isinstance(e, str) else e)}


def reduced_view(
    params: Any,
    axes: str | Sequence[str],
    *,
    muon_mask: masking.MaskLike | None = None,
    dimension_numbers: matrices.DimNumsLike = None,
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

    >>> from jax.sharding import AxisType
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',), axis_types=(AxisType.Explicit,))
    >>> params = jax.device_put({'w': jnp.ones((4, 4)), 'b': jnp.ones(4)},
    ...                         NamedSharding(mesh, P()))
    >>> x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P('data')))
    >>> loss = lambda p, x: jnp.sum(jnp.tanh(x @ p['w'] + p['b']))
    >>> g = jax.jit(lambda p, x: jax.grad(loss)(reduced_view(p, 'data'), x))(params, x)
    >>> sorted(unreduced_axes(g['w'])), sorted(unreduced_axes(g['b']))
    (['data'], [])

    References:
      JAX "Autodiff and sharding"; ZeRO (Rajbhandari et al., 2020).
    """
    axes_set = frozenset((axes,) if isinstance(axes, str) else axes)
    flags = masking.resolve_muon_mask(muon_mask, params, dimension_numbers=dimension_numbers)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for (path, x), flag in zip(flat, flags, strict=True):
        if not flag:
            out.append(x)
            continue
        sharding = jax.typeof(x).sharding
        used = _used_axes(sharding.spec)
        if used & axes_set:
            raise ValueError(
                f"reduced_view: leaf {matrices.path_str(path)!r} is sharded over mesh axes "
                f"{sorted(used & axes_set)}; only params replicated over {sorted(axes_set)} "
                "can be viewed as reduced (leave FSDP-sharded params as they are)."
            )
        target = P(*sharding.spec.partitions, reduced=axes_set | set(sharding.spec.reduced))
        out.append(jax.sharding.reshard(x, NamedSharding(sharding.mesh, target)))
    return jax.tree.unflatten(treedef, out)


def reduce_unreduced(x: Any) -> Any:
    """All-reduce an array that is unreduced over mesh axes (identity for anything else).

    Args:
      x: an array, possibly of type ``{U: axes}``.

    Returns:
      ``x`` with the same spec minus ``unreduced`` (one all-reduce when it had any).

    >>> float(reduce_unreduced(jnp.ones(3)).sum())  # ordinary arrays pass through
    3.0

    References:
      JAX "Autodiff and sharding" (unreduced types).
    """
    if not unreduced_axes(x):
        return x
    sharding = jax.typeof(x).sharding
    spec = P(*sharding.spec.partitions, reduced=sharding.spec.reduced)
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, spec))


def scale(x: jax.Array, s: jax.typing.ArrayLike) -> jax.Array:
    """``x * s`` for a replicated scalar ``s``, also where ``x`` is unreduced.

    An unreduced ``x`` is multiplied by ``s`` cast to ``reduced`` over the same axes (a free
    cast), so every partial sum is scaled and the product stays unreduced.

    Args:
      x: an array (possibly unreduced).
      s: a scalar.

    Returns:
      ``x * s`` in ``x``'s dtype and sharding type.

    >>> scale(jnp.ones(2), 0.5).tolist()
    [0.5, 0.5]
    """
    u = unreduced_axes(x)
    s = jnp.asarray(s).astype(x.dtype)
    if u:
        s = jax.sharding.reshard(s, NamedSharding(jax.typeof(x).sharding.mesh, P(reduced=u)))
    return x * s


def _unreduced_sq_norm(leaves: Sequence[jax.Array]) -> jax.Array:
    """Squared norm of summed unreduced leaves: one reduce-scatter, then a scalar all-reduce."""
    sharding = jax.typeof(leaves[0]).sharding
    mesh, u = sharding.mesh, tuple(a for a in sharding.mesh.axis_names
                                   if a in sharding.spec.unreduced)
    specs = [jax.typeof(x).sharding.spec for x in leaves]
    summed = tuple(a for a in mesh.axis_names
                   if a in u or a in _used_axes(specs[0]))
    n = math.prod(mesh.shape[a] for a in u)

    def body(*xs):
        flat = jnp.concatenate([x.reshape(-1) for x in xs])
        # A zero of flat's type as padding value: jax >= 0.12 requires pad's operand and value
        # to be unreduced over the same axes (older jax accepts any value).
        flat = jnp.pad(flat, (0, -flat.size % n), constant_values=jnp.zeros_like(flat, shape=()))
        piece = jax.lax.psum_scatter(flat, u, tiled=True).astype(jnp.float32)
        return jax.lax.psum(jnp.sum(jnp.square(piece)), summed)

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=P())(*leaves)


def _global_sq_norm(leaves: Sequence[Any]) -> jax.Array:
    """Squared global norm of ``leaves``; unreduced ones count with their reduced values."""
    ordinary = [x for x in leaves if not unreduced_axes(x)]
    total = optax.tree.norm(ordinary, squared=True)
    groups: dict[Any, list[jax.Array]] = {}
    for x in leaves:
        if unreduced_axes(x):
            sharding = jax.typeof(x).sharding
            key = (sharding.mesh, unreduced_axes(x), frozenset(_used_axes(sharding.spec)),
                   jnp.dtype(x.dtype))
            groups.setdefault(key, []).append(x)
    for group in groups.values():
        total = total + _unreduced_sq_norm(group)
    return total


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    r"""Clip updates to a maximum global norm, also when they arrive unreduced.

    .. math::
      g_\ell \leftarrow g_\ell \cdot \min\Big(1, \frac{c}{\|g\|}\Big), \qquad
      \|g\|^2 = \sum_\ell \|g_\ell\|_F^2 .

    On ordinary arrays this is ``optax.clip_by_global_norm(max_norm)``. A leaf unreduced over
    mesh axes (from :func:`reduced_view`) counts with the norm of its sum: the unreduced leaves
    are reduce-scattered together for the norm (one collective moving their bytes, half an
    all-reduce) and stay unreduced after clipping, so sharded Muon still takes them by its own
    reduce-scatter. ``optax.clip_by_global_norm`` fails on them ("unreduced rule for square is
    not implemented").

    Args:
      max_norm: the maximum global norm ``c``.

    Returns:
      An ``optax.GradientTransformation`` (stateless), to chain in front of Muon.

    >>> import optax
    >>> tx = clip_by_global_norm(1.0)
    >>> updates, _ = tx.update({'w': jnp.full((2, 2), 3.0)}, tx.init(None))
    >>> float(optax.tree.norm(updates))
    1.0

    References:
      Pascanu et al., `On the difficulty of training recurrent neural networks
      <https://arxiv.org/abs/1211.5063>`_, 2013.
    """

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        g_norm = jnp.sqrt(_global_sq_norm(leaves))
        trigger = g_norm < max_norm
        factor = jnp.where(trigger, 1.0, max_norm / g_norm)

        def clip(t):
            if unreduced_axes(t):
                return scale(t, factor)
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.unflatten(treedef, [clip(t) for t in leaves]), state

    return optax.GradientTransformation(lambda params: optax.ClipByGlobalNormState(), update_fn)
