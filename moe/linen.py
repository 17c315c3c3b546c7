"""The Mixture-of-Experts layer for Flax Linen: :class:`moe.MoE` through ``flax.nnx.bridge``."""

from __future__ import annotations

from moe.module import MoE
from moe.options import MoEOptions

__all__ = ["moe_linen"]


def moe_linen(d_model: int, d_ff: int, *, options: MoEOptions, mesh=None, **kwargs):
    """The :class:`MoE` layer as a Linen module, through ``flax.nnx.bridge.to_linen``.

    Takes :class:`MoE`'s arguments except ``rngs``; the Linen module's ``init`` / ``apply``
    carry the params in the ``'params'`` collection and the balancing bias in
    ``'balancing_bias'`` (``flax.linen.unbox`` them for plain arrays). With a mesh of Explicit
    axes, run a jitted ``init`` inside ``jax.set_mesh(mesh)``: JAX places newly created
    explicitly sharded values only under a mesh context.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from moe import MoEOptions, moe_linen
      >>> layer = moe_linen(16, 8, options=MoEOptions.create(4, 2))
      >>> x = jnp.ones((2, 4, 16))
      >>> variables = jax.jit(layer.init)(jax.random.key(0), x)
      >>> y, aux = jax.jit(layer.apply)(variables, x)
      >>> y.shape, sorted(variables)
      ((2, 4, 16), ['balancing_bias', 'params'])
    """
    from flax.nnx import bridge

    return bridge.to_linen(MoE, d_model, d_ff, options=options, mesh=mesh, **kwargs)
