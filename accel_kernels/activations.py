"""Gated expert activations: ``h = act(z)`` for ``z = [z_gate | z_up]``, with exact derivatives.

:class:`GatedActivation` is the static (hashable) choice of the experts' nonlinearity; its
:meth:`~GatedActivation.apply` gives ``h`` and :meth:`~GatedActivation.grad` the hand-written
``dz`` that :func:`moe.gated_experts`' custom backward uses. Kinds, with ``g = z_gate`` and
``u = z_up``:

* ``'silu'`` (SwiGLU; Mixtral, Qwen, DeepSeek): ``h = silu(g) * u``;
* ``'gelu'`` (GeGLU, exact erf GELU; transformers' ``hidden_act='gelu'``):
  ``h = g * Phi(g) * u``;
* ``'gelu_tanh'`` (GeGLU, tanh approximation; ``'gelu_pytorch_tanh'`` / ``'gelu_new'``):
  ``h = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u``;
* ``'clamped_swiglu'`` (GPT-OSS): ``g' = min(g, limit)``, ``u' = clip(u, -limit, limit)``,
  ``h = (u' + 1) * g' * sigmoid(alpha * g')`` (defaults ``alpha = 1.702``, ``limit = 7``). The
  clamps pass no gradient outside their range (as ``torch.clamp``: the bounds are inside).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

__all__ = ["GatedActivation"]

Kind = Literal["silu", "gelu", "gelu_tanh", "clamped_swiglu"]


@jax.custom_jvp
def _erf(x: jax.Array) -> jax.Array:
    """``jax.lax.erf`` with its derivative ``2 / sqrt(pi) exp(-x^2)`` written out.

    jax 0.12 differentiates ``erf`` through a ``polynomial`` primitive whose coefficients are
    not marked as varying over ``shard_map``'s manual axes, so ``jax.grad`` of an exact GELU
    inside ``shard_map`` (the shared experts' autodiff backward) fails its type check. The
    rule below uses only ``exp``, and equals jax's on every version.
    """
    return jax.lax.erf(x)


@_erf.defjvp
def _erf_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return _erf(x), (2.0 / math.sqrt(math.pi)) * jnp.exp(-x * x) * dx
_KINDS = ("silu", "gelu", "gelu_tanh", "clamped_swiglu")
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """The gated nonlinearity of the experts (hashable, ``jit``-static).

    Attributes:
      kind: ``'silu'``, ``'gelu'``, ``'gelu_tanh'`` or ``'clamped_swiglu'`` (see the module
        docstring for each formula).
      alpha: ``'clamped_swiglu'`` only: the sigmoid's slope (GPT-OSS: 1.702).
      limit: ``'clamped_swiglu'`` only: the clamp bound (GPT-OSS: ``swiglu_limit`` = 7.0).

    Example:
      >>> act = GatedActivation("clamped_swiglu", alpha=1.702, limit=7.0)
      >>> z = jnp.array([[9.0, -1.0, 0.5, 8.0]])  # gate [9, -1], up [0.5, 8]
      >>> [round(v, 3) for v in act.apply(z)[0].tolist()]  # gate 9 -> 7, up 8 -> 7
      [10.5, -1.234]
    """

    kind: Kind = "silu"
    alpha: float | None = None
    limit: float | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"activation kind={self.kind!r} is not supported; use one of "
                             f"{_KINDS}.")
        if self.kind == "clamped_swiglu":
            alpha = 1.702 if self.alpha is None else self.alpha
            limit = 7.0 if self.limit is None else self.limit
            for name, v in (("alpha", alpha), ("limit", limit)):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                    raise ValueError(f"clamped_swiglu {name} must be a positive number, got "
                                     f"{v!r}.")
            object.__setattr__(self, "alpha", float(alpha))
            object.__setattr__(self, "limit", float(limit))
        elif self.alpha is not None or self.limit is not None:
            raise ValueError(f"alpha and limit apply to kind='clamped_swiglu' only, not "
                             f"{self.kind!r}; leave them None.")

    @classmethod
    def of(cls, value: GatedActivation | str) -> GatedActivation:
        """``value`` itself, or the activation of that kind with its default parameters."""
        if isinstance(value, GatedActivation):
            return value
        if isinstance(value, str):
            return cls(value)
        raise TypeError(f"activation must be a GatedActivation or one of {_KINDS}, got "
                        f"{type(value).__name__}.")

    def apply(self, z: jax.Array) -> jax.Array:
        """``h [..., f]`` in f32 from ``z [..., 2f] = [z_gate | z_up]``."""
        g, u = jnp.split(z, 2, axis=-1)
        return self.apply_parts(g, u, erf=_erf)  # differentiable under shard_map

    def grad(self, z: jax.Array, dh: jax.Array) -> jax.Array:
        """``dz [..., 2f]`` in f32: the exact vector-Jacobian product of :meth:`apply`."""
        g, u = jnp.split(z, 2, axis=-1)
        return jnp.concatenate(self.grad_parts(g, u, dh), axis=-1)

    def apply_parts(self, g: jax.Array, u: jax.Array, *,
                    sigmoid: Callable[[jax.Array], jax.Array] = jax.nn.sigmoid,
                    erf: Callable[[jax.Array], jax.Array] = jax.lax.erf) -> jax.Array:
        """:meth:`apply` on the two halves ``g = z_gate``, ``u = z_up`` (f32 result).

        Elementwise only, so kernels that load the halves separately (the fused FP8
        quantization of `accel_kernels.quant.api` and `accel_kernels.quant.mosaic`) share this code.
        ``sigmoid``: how the logistic function is computed (a kernel backend without a
        ``logistic`` rule passes ``1 / (1 + exp(-x))``); ``erf`` likewise (kernels take
        ``jax.lax.erf``, which they can lower; :meth:`apply` a differentiable one).
        """
        g, u = g.astype(jnp.float32), u.astype(jnp.float32)
        if self.kind == "clamped_swiglu":
            g = jnp.minimum(g, self.limit)
            u = jnp.clip(u, -self.limit, self.limit)
            return (u + 1.0) * (g * sigmoid(self.alpha * g))
        return self._act(g, sigmoid, erf) * u

    def grad_parts(self, g: jax.Array, u: jax.Array, dh: jax.Array, *,
                   sigmoid: Callable[[jax.Array], jax.Array] = jax.nn.sigmoid,
                   ) -> tuple[jax.Array, jax.Array]:
        """:meth:`grad` as its two halves ``(dz_gate, dz_up)`` (f32), elementwise only
        (``sigmoid`` as in :meth:`apply_parts`)."""
        g, u = g.astype(jnp.float32), u.astype(jnp.float32)
        dh = dh.astype(jnp.float32)
        if self.kind == "clamped_swiglu":
            gc = jnp.minimum(g, self.limit)
            uc = jnp.clip(u, -self.limit, self.limit)
            sig = sigmoid(self.alpha * gc)
            glu = gc * sig
            dglu = sig * (1.0 + self.alpha * gc * (1.0 - sig))
            dg = jnp.where(g <= self.limit, dh * (uc + 1.0) * dglu, 0.0)
            du = jnp.where(jnp.abs(u) <= self.limit, dh * glu, 0.0)
            return dg, du
        return dh * u * self._dact(g, sigmoid), dh * self._act(g, sigmoid)

    def _act(self, g: jax.Array, sigmoid=jax.nn.sigmoid, erf=jax.lax.erf) -> jax.Array:
        """The gate nonlinearity ``a(g)`` of the product kinds."""
        if self.kind == "silu":
            return g * sigmoid(g)  # jax.nn.silu
        if self.kind == "gelu":
            return 0.5 * g * (1.0 + erf(g * (1.0 / math.sqrt(2.0))))
        return g * sigmoid(2.0 * _GELU_C * (g + _GELU_A * g**3))  # 0.5 (1 + tanh)

    def _dact(self, g: jax.Array, sigmoid=jax.nn.sigmoid) -> jax.Array:
        """``a'(g)``."""
        if self.kind == "silu":
            sig = sigmoid(g)
            return sig * (1.0 + g * (1.0 - sig))
        if self.kind == "gelu":
            cdf = 0.5 * (1.0 + jax.lax.erf(g * (1.0 / math.sqrt(2.0))))
            pdf = jnp.exp(-0.5 * g * g) * (1.0 / math.sqrt(2.0 * math.pi))
            return cdf + g * pdf
        # 0.5 (1 + tanh(v)) = sigmoid(2 v): accurate in the tails, where 1 + tanh cancels.
        sig = sigmoid(2.0 * _GELU_C * (g + _GELU_A * g**3))
        return sig + g * sig * (1.0 - sig) * 2.0 * _GELU_C * (1.0 + 3 * _GELU_A * g * g)
