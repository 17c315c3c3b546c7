"""Top-k MoE router: scores, (group-limited) expert selection, weights and auxiliary losses.

Pure functions on arrays:

    logits  = x @ router_kernel (+ router_bias)          (float32)
    scores  = softmax(logits) or sigmoid(logits)
    experts = top_k(scores + bias)                        (bias: selection only)
    weights = routed_scaling * scores[experts] (/ sum, if renormalize)

The bias is DeepSeek-V3's auxiliary-loss-free balancing term: it is not trained by gradients
but moved by :func:`update_balancing_bias` from the observed expert loads. The optional
``router_bias`` (GPT-OSS) is an ordinary trained bias of the logits.

Load-balancing loss convention: ``load_balance_loss = E * sum_e f_e * P_e`` with ``f_e`` the
fraction of the ``T * k`` routing slots sent to expert ``e`` (so ``sum_e f_e = 1``) and ``P_e``
the mean router probability of ``e``. transformers' ``load_balancing_loss_func`` (Mixtral,
Qwen-MoE, ...) normalizes the one-hot selections per choice instead (each of the ``k`` rows
sums to 1), so on the same routing its value is ``top_k`` times ours: multiply
``router_aux_loss_coef`` by ``top_k`` to use a transformers coefficient here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

__all__ = ["RouterConfig", "Routing", "global_losses", "route", "update_balancing_bias"]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Static router options (hashable, so it can be a ``jit`` static argument).

    Attributes:
      num_experts: number of routed experts ``E``.
      top_k: experts per token ``k``.
      routed_scaling: factor applied to the routing weights (DeepSeek-V3 uses 2.5).
      num_groups: split the experts into this many equal groups for group-limited routing;
        1 disables it.
      topk_groups: keep this many best groups per token (``None``: all groups).
      score_fn: ``'softmax'`` or ``'sigmoid'`` of the logits.
      renormalize: divide the ``k`` selected scores by their sum before scaling.
      stop_score_gradient: treat the logits (hence scores, weights and both auxiliary losses)
        as constants: the router kernel gets an exact zero gradient and the backward pass
        holds no router matmul. The losses are then metrics only.
      router_bias: the layer owns a trained bias ``[E]`` of the logits (GPT-OSS).
      router_jitter_noise: ``eps > 0`` multiplies the layer's input by noise drawn uniformly
        from ``[1 - eps, 1 + eps]`` per element in training (Mixtral's
        ``router_jitter_noise``); never in eval mode (:class:`moe.MoE` ``.eval()``).
      jitter_input: who sees the jittered input: ``'all'`` (router and experts, as
        transformers' Mixtral block, which scales its input in place) or ``'router'`` (the
        router only, as Switch Transformer).
      return_routing: add each token's ``expert_ids`` (int32 ``[batch, seq, k]``, -1 for
        masked tokens) and combine ``expert_weights`` (f32, 0 for masked tokens) to the
        layer's ``aux``.

    Example:
      >>> from moe import RouterConfig
      >>> config = RouterConfig(8, 2, num_groups=4, topk_groups=2, score_fn="sigmoid")
      >>> config.num_experts, config.top_k, hash(config) == hash(RouterConfig(8, 2, num_groups=4,
      ...     topk_groups=2, score_fn="sigmoid"))
      (8, 2, True)
    """

    num_experts: int
    top_k: int
    routed_scaling: float = 1.0
    num_groups: int = 1
    topk_groups: int | None = None
    _: dataclasses.KW_ONLY
    score_fn: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    stop_score_gradient: bool = False
    router_bias: bool = False
    router_jitter_noise: float = 0.0
    jitter_input: Literal["all", "router"] = "all"
    return_routing: bool = False

    def __post_init__(self):
        e, k, g = self.num_experts, self.top_k, self.num_groups
        if not _is_int(e) or e < 1:
            raise ValueError(f"num_experts must be a positive int, got {e!r}.")
        if not _is_int(k) or not 1 <= k <= e:
            raise ValueError(
                f"top_k must be an int in [1, num_experts={e}], got {k!r}; lower top_k or add "
                "experts."
            )
        if not _is_int(g) or g < 1 or e % g != 0:
            raise ValueError(
                f"num_groups must be a positive int dividing num_experts={e}, got {g!r}; use "
                "num_groups=1 to disable group-limited routing."
            )
        tg = self.topk_groups
        if tg is not None and (not _is_int(tg) or not 1 <= tg <= g):
            raise ValueError(
                f"topk_groups must be None or an int in [1, num_groups={g}], got {tg!r}."
            )
        if tg is not None and tg * (e // g) < k:
            raise ValueError(
                f"topk_groups * experts per group = {tg} * {e // g} < top_k = {k}: the kept "
                "groups hold too few experts; raise topk_groups or lower top_k."
            )
        if self.score_fn not in ("softmax", "sigmoid"):
            raise ValueError(f"score_fn must be 'softmax' or 'sigmoid', got {self.score_fn!r}; "
                             "'sigmoid' is DeepSeek-V3's.")
        rs = self.routed_scaling
        if (isinstance(rs, bool) or not isinstance(rs, (int, float)) or not 0 < rs < math.inf):
            raise ValueError(
                f"routed_scaling must be a positive finite number, got {rs!r}; 1.0 leaves the "
                "weights as they are."
            )
        for name in ("renormalize", "stop_score_gradient", "router_bias", "return_routing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        eps = self.router_jitter_noise
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            raise ValueError(f"router_jitter_noise must be a number in [0, 1), got {eps!r}.")
        if self.jitter_input not in ("all", "router"):
            raise ValueError(
                f"jitter_input must be 'all' or 'router', got {self.jitter_input!r}."
            )


class Routing(NamedTuple):
    """Result of :func:`route` for tokens ``x[..., d_model]``.

    Attributes:
      expert_ids: int32 ``[..., k]``, selected experts, best (by biased score) first.
      weights: float32 ``[..., k]``, combine weights of those experts.
      scores: float32 ``[..., E]``, ``softmax``/``sigmoid`` of the logits (no bias).
      logits: float32 ``[..., E]``.
      tokens_per_expert: int32 ``[E]``, token slots routed to each expert (over all tokens).
      load_balance_loss: float32 scalar, Switch-Transformer balancing loss.
      router_z_loss: float32 scalar, ST-MoE z-loss.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from moe import RouterConfig, route
      >>> r = jax.jit(lambda x, w: route(x, w, config=RouterConfig(4, 2)))(jnp.ones((3, 8)),
      ...                                                                jnp.eye(8, 4))
      >>> r.expert_ids.shape, r.scores.shape, r.tokens_per_expert.tolist()
      ((3, 2), (3, 4), [3, 3, 0, 0])
    """

    expert_ids: jax.Array
    weights: jax.Array
    scores: jax.Array
    logits: jax.Array
    tokens_per_expert: jax.Array
    load_balance_loss: jax.Array
    router_z_loss: jax.Array


def _group_limited_mask(choice: jax.Array, num_groups: int, topk_groups: int) -> jax.Array:
    """Bool ``[..., E]``: experts in the ``topk_groups`` groups with the largest top-2 sums."""
    *lead, e = choice.shape
    grouped = choice.reshape(*lead, num_groups, e // num_groups)
    top2 = jax.lax.top_k(grouped, min(2, e // num_groups))[0]
    group_score = jnp.sum(top2, axis=-1)
    kept = jax.lax.top_k(group_score, topk_groups)[1]
    group_mask = jnp.any(kept[..., :, None] == jnp.arange(num_groups), axis=-2)
    return jnp.repeat(group_mask, e // num_groups, axis=-1)


def balance_probs(scores: jax.Array, score_fn: str) -> jax.Array:
    """The ``P`` of the load-balancing loss: ``scores`` normalized to sum 1 over experts.

    Softmax scores already sum to 1; sigmoid scores are divided by their sum.

    Example:
      >>> import jax.numpy as jnp
      >>> balance_probs(jnp.array([[0.5, 0.5, 1.0]]), "sigmoid").tolist()
      [[0.25, 0.25, 0.5]]
    """
    if score_fn == "softmax":
        return scores
    denom = scores.sum(-1, keepdims=True)
    return scores / jnp.where(denom > 0, denom, 1.0)


def _check_route_args(x, router_kernel, bias, config, router_bias, token_mask) -> jax.Array:
    """Validates :func:`route`'s arguments; returns the balancing bias as f32, no gradient."""
    if not isinstance(config, RouterConfig):
        raise TypeError(f"config must be a RouterConfig, got {type(config).__name__}.")
    e = config.num_experts
    if router_kernel.ndim != 2 or router_kernel.shape[1] != e:
        raise ValueError(
            f"router_kernel must have shape [d_model, num_experts={e}], got "
            f"{router_kernel.shape}; match config.num_experts to the kernel."
        )
    if x.ndim < 1 or x.shape[-1] != router_kernel.shape[0]:
        raise ValueError(
            f"x must have shape [..., d_model={router_kernel.shape[0]}] to match "
            f"router_kernel, got {x.shape}."
        )
    bias = jnp.zeros((e,), jnp.float32) if bias is None else jnp.asarray(bias)
    if bias.shape != (e,):
        raise ValueError(
            f"bias must have shape [num_experts] = ({e},), got {bias.shape}; pass None for "
            "no balancing bias."
        )
    if router_bias is not None and jnp.shape(router_bias) != (e,):
        raise ValueError(
            f"router_bias must have shape [num_experts] = ({e},), got {jnp.shape(router_bias)}."
        )
    if token_mask is not None and jnp.shape(token_mask) != x.shape[:-1]:
        raise ValueError(
            f"token_mask must have shape x.shape[:-1] = {x.shape[:-1]}, got "
            f"{jnp.shape(token_mask)}; pass one bool per token (False: padding)."
        )
    return jax.lax.stop_gradient(bias.astype(jnp.float32))


def _select(scores: jax.Array, bias: jax.Array, config: RouterConfig) -> jax.Array:
    """int32 ``[..., k]``: top-k of the biased scores (within the kept groups)."""
    choice = jax.lax.stop_gradient(scores) + bias
    tg = config.topk_groups
    if config.num_groups > 1 and tg is not None and tg < config.num_groups:
        mask = _group_limited_mask(choice, config.num_groups, tg)
        choice = jnp.where(mask, choice, -jnp.inf)
    return jax.lax.top_k(choice, config.top_k)[1].astype(jnp.int32)


def _weights(logits, scores, expert_ids, config: RouterConfig) -> jax.Array:
    """The combine weights: the unbiased scores of the chosen experts (renormalized, scaled)."""
    if config.renormalize and config.score_fn == "softmax":
        # softmax(l)[ids] / sum(softmax(l)[ids]) = softmax(l[ids]): the same weights, defined
        # (with finite gradients) when every selected score underflows to 0, as happens when
        # the balancing bias selects experts far below a token's top logit.
        weights = jax.nn.softmax(jnp.take_along_axis(logits, expert_ids, axis=-1), axis=-1)
    else:
        weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if config.renormalize and config.score_fn != "softmax":
        denom = jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights / jnp.where(denom > 0, denom, 1.0)
    return weights * jnp.float32(config.routed_scaling)


def _aux_losses(logits, probs, expert_ids, keep, e: int, k: int):
    """``(tokens_per_expert, load_balance_loss, router_z_loss)`` over the kept tokens."""
    # A one-hot sum rather than bincount: a reduction partitions under every mesh type
    # (bincount's scatter needs an ambient mesh when the ids are Explicit-sharded).
    one_hot = ((expert_ids[..., None] == jnp.arange(e, dtype=expert_ids.dtype))
               & keep[..., None, None])
    tokens_per_expert = jnp.sum(one_hot.reshape(-1, e), axis=0, dtype=jnp.int32)
    num_tokens = jnp.maximum(jnp.sum(keep, dtype=jnp.float32), 1.0)
    f = tokens_per_expert.astype(jnp.float32) / (num_tokens * k)
    p = jnp.sum(jnp.where(keep[..., None], probs, 0.0).reshape(-1, e), axis=0) / num_tokens
    lse = jnp.where(keep, jax.nn.logsumexp(logits, axis=-1), 0.0)
    return tokens_per_expert, e * jnp.sum(f * p), jnp.sum(lse**2) / num_tokens


def route(
    x: ArrayLike,
    router_kernel: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    config: RouterConfig,
    router_bias: ArrayLike | None = None,
    token_mask: ArrayLike | None = None,
) -> Routing:
    """Route tokens to their top-k experts and compute the auxiliary router losses.

    ``logits = x @ W (+ router_bias)`` (float32, full precision); ``s = softmax(logits)`` or
    ``sigmoid(logits)``; with group-limited routing, only experts of the ``topk_groups`` groups
    with the largest sum of their top-2 biased scores ``s + b`` compete (as DeepSeek-V3);
    ``ids = top_k(s + b)``; ``w = routed_scaling * s[ids] / (sum s[ids] if renormalize)``.
    Losses over all ``T`` tokens: ``load_balance_loss = E * sum_e f_e * P_e`` with ``f_e`` the
    fraction of the ``T*k`` slots sent to ``e`` and ``P_e`` the mean of ``s`` normalized to sum
    1 over experts (``s`` itself for softmax); ``router_z_loss = mean(logsumexp(logits)^2)``.
    The bias only changes the selection; it gets no gradient. Under ``shard_map`` the counts
    and losses cover the local tokens. transformers' load-balancing loss is ``top_k`` times
    this one on the same routing (see the module docstring).

    With ``token_mask``, masked tokens (False) get weights 0 and count nowhere: ``T`` is the
    number of unmasked tokens in ``f``, ``P`` and the z-loss (both losses are 0 when no
    token is unmasked); their ``expert_ids`` are still their top-k.

    Args:
      x: tokens ``[..., d_model]``.
      router_kernel: ``[d_model, num_experts]``.
      bias: balancing bias ``[num_experts]`` (default zeros), see :func:`update_balancing_bias`.
      config: a :class:`RouterConfig`.
      router_bias: trained bias of the logits ``[num_experts]`` (GPT-OSS), or None.
      token_mask: bool ``x.shape[:-1]``, False for padding tokens; None: every token counts.

    Returns:
      A :class:`Routing`.

    Raises:
      ValueError: shapes of ``x``, ``router_kernel`` or ``bias`` do not match ``config``.

    Example:
      >>> import jax.numpy as jnp
      >>> config = RouterConfig(num_experts=4, top_k=2)
      >>> r = route(jnp.ones((3, 8)), jnp.eye(8, 4), config=config)
      >>> r.expert_ids.shape, r.weights.shape, float(r.weights.sum(-1)[0])
      ((3, 2), (3, 2), 1.0)

    References:
      DeepSeek-V3 technical report (sigmoid scores, group-limited routing, auxiliary-loss-free
      bias); Switch Transformer (load-balancing loss); ST-MoE (router z-loss).
    """
    x, router_kernel = jnp.asarray(x), jnp.asarray(router_kernel)
    bias = _check_route_args(x, router_kernel, bias, config, router_bias, token_mask)
    e = config.num_experts
    with jax.named_scope("router_logits"):
        logits = jnp.matmul(
            x.astype(jnp.float32),
            router_kernel.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        if router_bias is not None:
            logits = logits + jnp.asarray(router_bias).astype(jnp.float32)
    if config.stop_score_gradient:
        logits = jax.lax.stop_gradient(logits)
    if config.score_fn == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    expert_ids = _select(scores, bias, config)
    keep = jnp.ones(x.shape[:-1], bool) if token_mask is None else jnp.asarray(token_mask, bool)
    weights = _weights(logits, scores, expert_ids, config)
    if token_mask is not None:
        weights = jnp.where(keep[..., None], weights, 0.0)
    tokens_per_expert, load_balance_loss, router_z_loss = _aux_losses(
        logits, balance_probs(scores, config.score_fn), expert_ids, keep, e, config.top_k)
    return Routing(
        expert_ids=expert_ids,
        weights=weights,
        scores=scores,
        logits=logits,
        tokens_per_expert=tokens_per_expert,
        load_balance_loss=load_balance_loss,
        router_z_loss=router_z_loss,
    )


def global_losses(r: Routing, config: RouterConfig, axes: tuple[str, ...], total_tokens: int,
                  mask: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router's counts and losses over *all* (unmasked) tokens, summed over the mesh
    ``axes`` from each device's :func:`route` of its tokens (inside ``jax.shard_map``).

    ``load_balance_loss = E * sum_e f_e * P_e`` and ``router_z_loss = mean(logsumexp(logits)^2)``
    as :func:`route` defines them, their sums taken over every device (``psum``) and divided by
    the unmasked token count (``total_tokens`` without a mask).

    Args:
      r: this device's :class:`Routing`.
      config: the router's options.
      axes: the mesh axes to sum over (the MoE layer's: every axis of its mesh).
      total_tokens: tokens over all devices.
      mask: bool ``[T]``, False for masked tokens (they count nowhere), or None.

    Returns:
      ``(tokens_per_expert int32 [E], load_balance_loss, router_z_loss)``.

    Example:
      >>> # inside jax.shard_map: counts, lb, z = global_losses(r, config, ('expert',), T, None)
    """
    e, k = config.num_experts, config.top_k
    counts = jax.lax.psum(r.tokens_per_expert, axes)  # route() counts unmasked tokens only
    probs = balance_probs(r.scores, config.score_fn)
    lse2 = jax.nn.logsumexp(r.logits, axis=-1) ** 2
    if mask is None:
        n = jnp.float32(total_tokens)
    else:
        n = jnp.maximum(jax.lax.psum(jnp.sum(mask, dtype=jnp.float32), axes), 1.0)
        probs = jnp.where(mask[:, None], probs, 0.0)
        lse2 = jnp.where(mask, lse2, 0.0)
    p_mean = jax.lax.psum(probs.sum(0), axes) / n
    f = counts.astype(jnp.float32) / (n * k)
    lb = e * jnp.sum(jax.lax.stop_gradient(f) * p_mean)
    z = jax.lax.psum(jnp.sum(lse2), axes) / n
    return counts, lb, z


def update_balancing_bias(
    bias: ArrayLike, tokens_per_expert: ArrayLike, rate: float = 1e-3
) -> jax.Array:
    """One auxiliary-loss-free balancing step: raise the bias of underloaded experts.

    ``bias' = bias + rate * sign(mean(load) - load)``, with ``load = tokens_per_expert``
    (sum it over data-parallel shards first for a global update).

    Args:
      bias: float ``[E]``, current balancing bias.
      tokens_per_expert: ``[E]`` token slots per expert, e.g. ``Routing.tokens_per_expert``.
      rate: bias update speed (DeepSeek-V3: 1e-3).

    Returns:
      float32 ``[E]`` updated bias.

    Example:
      >>> import jax.numpy as jnp
      >>> update_balancing_bias(jnp.zeros(3), jnp.array([6, 2, 1]), 0.5).tolist()
      [-0.5, 0.5, 0.5]

    References:
      DeepSeek-V3 technical report, auxiliary-loss-free load balancing (bias update speed).
    """
    bias, load = jnp.asarray(bias), jnp.asarray(tokens_per_expert)
    if bias.ndim != 1 or load.shape != bias.shape:
        raise ValueError(
            f"bias and tokens_per_expert must both have shape [num_experts], got "
            f"{bias.shape} and {load.shape}; pass Routing.tokens_per_expert."
        )
    load = load.astype(jnp.float32)
    return bias.astype(jnp.float32) + jnp.float32(rate) * jnp.sign(jnp.mean(load) - load)
