"""Dynamic loss scaling as an Optax wrapper that never changes which collectives run.

The train step multiplies the loss by the current scale (:func:`scale_loss`); the wrapper
unscales the gradients, runs the inner transform on every step (one code path), and then keeps
or discards its result: when any update is non-finite the step is skipped (zero updates, the
inner state kept bitwise) and the scale shrinks; after ``growth_interval`` finite steps it grows.

Finiteness is read from the inner transform's *updates*, not the raw gradients: a NaN/Inf
gradient makes Muon's momentum and Newton-Schulz output (and AdamW's moments) non-finite, and
the updates are reduced arrays even when the gradients arrive unreduced (sharded Muon's
reduce-scatter path), where `optax.apply_if_finite` cannot test them.

References:
  Micikevicius et al., "Mixed Precision Training" (2018): dynamic loss scaling.
  Rajbhandari et al., "ZeRO" (2020): the reduce-scatter this wrapper must not bypass.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from muon_jax import dp

__all__ = ["DynamicScaleState", "dynamic_loss_scale", "scale_loss"]


class DynamicScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scale`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from muon_jax.loss_scale import dynamic_loss_scale
      >>> state = dynamic_loss_scale(optax.sgd(0.1), init_scale=2.0**10).init(jnp.ones(2))
      >>> float(state.scale), int(state.good_steps), int(state.skipped)
      (1024.0, 0, 0)
    """

    scale: jax.Array  # f32 scalar: the loss is multiplied by it
    good_steps: jax.Array  # int32: finite steps since the last change of scale
    skipped: jax.Array  # int32: total skipped (non-finite) steps
    inner_state: optax.OptState


def _all_finite(tree: Any) -> jax.Array:
    """Whether every inexact leaf of ``tree`` is finite (a replicated bool scalar)."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "dtype")]
    flags = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    init_scale: float = 2.0**15,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
) -> optax.GradientTransformationExtraArgs:
    r"""Wrap ``inner`` with dynamic loss scaling; non-finite steps are skipped.

    .. math::
      u, s' = \mathrm{inner}(g / S, s); \quad
      \text{finite}(u) \Rightarrow (u, s', S \cdot \gamma^{[n \ge T]}), \quad
      \text{else} \Rightarrow (0, s, \max(S \beta, S_{min})).

    Args:
      inner: the wrapped transform (e.g. ``muon_jax.muon(...)``).
      init_scale: initial loss scale ``S``.
      growth_factor: ``gamma``, applied after ``growth_interval`` finite steps in a row.
      backoff_factor: ``beta`` in (0, 1), applied on a non-finite step.
      growth_interval: ``T``, finite steps between growths.
      min_scale: lower bound of the scale.

    Returns:
      A transform with state :class:`DynamicScaleState`; the train step must differentiate
      ``scale_loss(loss, state)``.

    >>> tx = dynamic_loss_scale(optax.sgd(0.5), init_scale=8.0)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grads = jax.grad(lambda p: scale_loss(jnp.sum(p['w'] ** 2), state))(params)
    >>> updates, state = tx.update(grads, state, params)  # gradients unscaled by 1/8
    >>> updates['w'].tolist(), float(state.scale)
    ([-1.0, -1.0], 8.0)

    References:
      Micikevicius et al., "Mixed Precision Training" (2018).
    """
    if not (0.0 < backoff_factor < 1.0) or growth_factor < 1.0:
        raise ValueError(
            f"dynamic_loss_scale: need 0 < backoff_factor < 1 and growth_factor >= 1, got "
            f"backoff_factor={backoff_factor}, growth_factor={growth_factor}."
        )
    if growth_interval < 1 or not (0 < init_scale < math.inf) or not (0 < min_scale < math.inf):
        raise ValueError(
            f"dynamic_loss_scale: growth_interval={growth_interval} must be >= 1 and "
            f"init_scale={init_scale}, min_scale={min_scale} finite and positive."
        )
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return DynamicScaleState(
            scale=jnp.asarray(init_scale, jnp.float32),
            good_steps=jnp.zeros([], jnp.int32),
            skipped=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        inv = 1.0 / state.scale
        grads = jax.tree.map(lambda g: dp.scale(g, inv), updates)
        new_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
        finite = _all_finite(new_updates)
        out = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        inner_state = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old), new_inner, state.inner_state
        )
        good = jnp.where(finite, state.good_steps + 1, 0)
        grow = good >= growth_interval
        scale = jnp.where(
            finite,
            jnp.where(grow, state.scale * growth_factor, state.scale),
            jnp.maximum(state.scale * backoff_factor, min_scale),
        )
        return out, DynamicScaleState(
            scale=scale.astype(jnp.float32),
            good_steps=jnp.where(grow, 0, good).astype(jnp.int32),
            skipped=(state.skipped + (~finite).astype(jnp.int32)).astype(jnp.int32),
            inner_state=inner_state,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_loss(loss: jax.Array, state: DynamicScaleState) -> jax.Array:
    """The loss times the current scale (differentiate this in the train step).

    Args:
      loss: the scalar loss.
      state: the :class:`DynamicScaleState` of :func:`dynamic_loss_scale`.

    Returns:
      ``loss * state.scale`` in the loss's dtype.

    >>> state = dynamic_loss_scale(optax.sgd(0.1), init_scale=4.0).init({'w': jnp.ones(2)})
    >>> float(scale_loss(jnp.float32(0.5), state))
    2.0

    References:
      Micikevicius et al., "Mixed Precision Training" (2018).
    """
    if not isinstance(state, DynamicScaleState):
        raise ValueError(
            f"scale_loss: state must be the DynamicScaleState of dynamic_loss_scale, got "
            f"{type(state).__name__}; pass the wrapper's own state."
        )
    return loss * state.scale.astype(loss.dtype)
