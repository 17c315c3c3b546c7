"""The Mixture-of-Experts layer's functional core: router, expert-parallel dispatch, gated
experts, combine.

:func:`moe_apply` is a pure function of arrays and static options; :class:`moe.MoE`
(``moe.module``) is the Flax NNX shell that owns the parameters and the balancing bias, and
:func:`moe.moe_linen` (``moe.linen``) exposes it to Linen through ``flax.nnx.bridge``.

A call checks its arrays, resolves its :class:`moe.MoEOptions` once against its mesh and
shapes (:meth:`moe.MoEOptions.resolve`: every ``'auto'`` decided, the options validated) and
hands the :class:`moe.options.ResolvedOptions` down unchanged: to the per-device body, the
chunks' plans (`moe.dispatch.plan_build.chunk_plans`), the chunks (`moe.pipeline`), the
dispatch and the experts, down to the kernels.

Layout: tokens ``[batch, seq, d_model]`` are flattened and split over every axis of the mesh
(the batch axes and the expert axis: all devices are data parallel for the router and the
shared experts); experts are split over the expert axis. Inside ``jax.shard_map``: routing
(``moe.routing``), the chunks' plans, then per chunk dispatch (``moe.dispatch``), local
experts (``moe.experts``) and combine.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from moe import meshes
from moe import pipeline as _pipeline
from moe import routing as _routing
from moe.dispatch import plan_build
from moe.dispatch.plan import layer_sizes
from moe.experts import Banks
from moe.options import MoEOptions, ResolvedOptions

__all__ = ["moe_apply"]


class LocalInputs(NamedTuple):
    """The optional per-call inputs that cross into the layer's ``shard_map`` (None: absent;
    the in_specs mirror it with None in the same places)."""

    mask: jax.Array | None = None  # bool [T]: False for masked (padding) tokens
    noise: jax.Array | None = None  # f32 [T, d]: the router's jitter multipliers
    router_bias: jax.Array | None = None  # [E]
    shared: tuple[jax.Array, jax.Array] | None = None  # shared experts (gate_up, down)
    shared_gate: jax.Array | None = None  # [d, 1]
    expert_bias: tuple[jax.Array, jax.Array] | None = None  # (b_gate_up, b_down) banks


def _vary(router_kernel, w_gate_up, w_down, extra: LocalInputs, *, expert_axes, all_axes):
    """``(router_kernel, banks, extra)`` typed as varying over the mesh axes they are
    replicated over (the router and the shared experts: all; the banks: all but the expert
    axis), so that autodiff sums their gradients over those axes (the transpose of
    ``pcast`` is a ``psum``)."""
    def vary(a, axes):
        return None if a is None else jax.tree.map(
            lambda leaf: jax.lax.pcast(leaf, axes, to="varying"), a)

    others = tuple(a for a in all_axes if a not in expert_axes)
    banks = Banks(w_gate_up, w_down, extra.expert_bias)
    if others:
        banks = Banks(*(vary(a, others) for a in banks))
    everywhere = tuple(all_axes)
    return vary(router_kernel, everywhere), banks, extra._replace(
        router_bias=vary(extra.router_bias, everywhere), shared=vary(extra.shared, everywhere),
        shared_gate=vary(extra.shared_gate, everywhere))


def _local_moe(x, router_kernel, bias, w_gate_up, w_down, extra: LocalInputs,
               options: ResolvedOptions, all_axes, total_tokens: int):
    """Per-device body: route, plan the chunks, run them (dispatch, local experts, combine;
    masked slots go to no expert) and the shared experts on every token."""
    router_kernel, banks, extra = _vary(router_kernel, w_gate_up, w_down, extra,
                                        expert_axes=options.dispatch.expert_axes,
                                        all_axes=all_axes)
    mask = extra.mask
    x_router = x if extra.noise is None else (x * extra.noise).astype(x.dtype)
    with jax.named_scope("moe_router"):
        r = _routing.route(x_router, router_kernel, bias, config=options.router,
                           router_bias=extra.router_bias, token_mask=mask)
        counts, lb, z = _routing.global_losses(r, options.router, all_axes, total_tokens, mask)
    slots, dispatch = options.num_slots, options.dispatch
    ids = r.expert_ids if mask is None else jnp.where(mask[:, None], r.expert_ids, slots)
    sizes = layer_sizes(options, x.shape[0] // dispatch.overlap_chunks, ids.shape[1])
    plans = plan_build.chunk_plans(ids, options, sizes, x_dtype=x.dtype)
    out = _pipeline.run_chunks(x, r.weights, banks, plans, options, shared=extra.shared,
                               shared_gate=extra.shared_gate, mask=mask)
    dropped = jax.lax.psum(out.dropped, all_axes)
    dropped_tokens = jax.lax.psum(jnp.sum(jnp.any(out.lost, axis=1), dtype=jnp.int32), all_axes)
    routing = {}
    if options.router.return_routing:
        keep = True if mask is None else mask[:, None]
        routing = {"expert_ids": jnp.where(keep, r.expert_ids, -1),
                   "expert_weights": jnp.where(keep, r.weights, 0.0)}
    return out.y, (lb, z, counts, dropped, dropped_tokens), routing


def _check_optional(name: str, value, want_shape, enabled: bool, option: str) -> None:
    """ValueError unless ``value`` is given exactly when ``option`` is on, with its shape."""
    if enabled and value is None:
        raise ValueError(f"{option}=True needs {name}; pass {name}= (the MoE module does).")
    if not enabled and value is not None:
        raise ValueError(f"{name} was passed but {option}=False; set {option}=True in the "
                         "options or drop the argument.")
    if value is not None and tuple(jnp.shape(value)) != tuple(want_shape):
        raise ValueError(f"{name} has shape {tuple(jnp.shape(value))}; expected "
                         f"{tuple(want_shape)}.")


def _check_array(name: str, value, *, ndim: int | None = None, floating: bool = True) -> None:
    """TypeError / ValueError naming ``name`` unless ``value`` is an array (of a floating
    dtype, of rank ``ndim``)."""
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be a jax or numpy array, got {type(value).__name__}; "
                        "pass jnp.asarray(...).")
    if floating and not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {value.dtype}; "
                        f"cast it, e.g. {name}.astype(jnp.float32).")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {value.shape}.")


def _check_arrays(x, router_kernel, w_gate_up, w_down, num_experts: int) -> None:
    """The checks of :func:`moe_apply`'s required arrays against each other and the expert
    count."""
    _check_array("x", x)
    if x.ndim != 3:
        raise ValueError(
            f"x must be [batch, seq, d_model], got shape {x.shape}; reshape tokens to rank 3."
        )
    b, s, d = x.shape
    if b * s == 0:
        raise ValueError(
            f"x has shape {x.shape}: a batch with no tokens; pass at least one token "
            "(skip the layer for empty batches)."
        )
    _check_array("router_kernel", router_kernel)
    if router_kernel.shape != (d, num_experts):
        raise ValueError(
            f"router_kernel has shape {router_kernel.shape}, expected (d_model, num_experts) = "
            f"({d}, {num_experts}); x's last axis must equal the layer's d_model."
        )
    _check_array("w_gate_up", w_gate_up, ndim=3)
    e, d_in, two_f = w_gate_up.shape
    if (e, d_in) != (num_experts, d) or two_f % 2:
        raise ValueError(
            f"w_gate_up has shape {w_gate_up.shape}, expected [num_experts, d_model, 2 * d_ff] "
            f"= ({num_experts}, {d}, 2 * d_ff) (gate columns, then up columns)."
        )
    _check_array("w_down", w_down, ndim=3)
    if w_down.shape != (num_experts, two_f // 2, d):
        raise ValueError(
            f"w_down has shape {w_down.shape}, expected [num_experts, d_ff, d_model] = "
            f"{(num_experts, two_f // 2, d)} (d_ff from w_gate_up {w_gate_up.shape})."
        )


def _check_optional_inputs(x, w_down, options: MoEOptions, optional: dict) -> None:
    """The checks of :func:`moe_apply`'s optional inputs: each given exactly when its option
    is on, with its shape (the options are checked by :meth:`moe.MoEOptions.resolve`)."""
    b, s, d = x.shape
    num_experts, experts = options.router.num_experts, options.experts
    bias = optional["bias"]
    if bias is not None:
        _check_array("bias", bias)
        if bias.shape != (num_experts,):
            raise ValueError(f"bias must have shape [num_experts] = ({num_experts},), got "
                             f"{bias.shape} (the balancing bias; None: zeros).")
    _check_optional("router_bias", optional["router_bias"], (num_experts,),
                    options.router.router_bias, "router_bias")
    eb = optional["expert_bias"]
    if eb is None and experts.expert_bias:
        raise ValueError("expert_bias=True in the options needs the expert_bias= argument, "
                         "(b_gate_up [E, 2 * d_ff], b_down [E, d_model]); pass it (moe.MoE "
                         "does) or set expert_bias=False.")
    if eb is not None and (not isinstance(eb, (tuple, list)) or len(eb) != 2):
        raise ValueError("expert_bias must be a pair (b_gate_up [E, 2 * d_ff], b_down [E, "
                         "d_model]).")
    _check_optional("expert_bias[0] (b_gate_up)", None if eb is None else eb[0],
                    (num_experts, 2 * w_down.shape[1]), experts.expert_bias, "expert_bias")
    _check_optional("expert_bias[1] (b_down)", None if eb is None else eb[1],
                    (num_experts, d), experts.expert_bias, "expert_bias")
    shared = optional["shared"]
    if shared is not None:
        if not isinstance(shared, (tuple, list)) or len(shared) != 2:
            raise ValueError(f"shared must be a pair (gate_up [d_model, 2 * d_shared], down "
                             f"[d_shared, d_model]), got {type(shared).__name__}.")
        gu, dn = shared
        _check_array("shared[0] (gate_up)", gu, ndim=2)
        _check_array("shared[1] (down)", dn, ndim=2)
        if gu.shape[0] != d or gu.shape[1] % 2 or dn.shape != (gu.shape[1] // 2, d):
            raise ValueError(f"shared has shapes {gu.shape} and {dn.shape}; expected gate_up "
                             f"[d_model, 2 * d_shared] = ({d}, 2 * d_shared) and down "
                             f"[d_shared, d_model].")
    if optional["shared_gate"] is not None and shared is None:
        raise ValueError("shared_gate gates the shared experts; pass shared= too.")
    _check_optional("shared_gate", optional["shared_gate"], (d, 1), experts.shared_expert_gate,
                    "shared_expert_gate")
    mask = optional["token_mask"]
    if mask is not None:
        _check_array("token_mask", mask, floating=False)
        if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
            raise TypeError(f"token_mask must be a bool array (False: a padding token), got "
                            f"dtype {mask.dtype}; pass mask.astype(bool).")
        if tuple(mask.shape) != (b, s):
            raise ValueError(f"token_mask has shape {tuple(mask.shape)}; it must be "
                             f"[batch, seq] = {(b, s)} (False: a padding token).")
    key = optional["jitter_key"]
    if key is not None and not (
            isinstance(key, jax.Array) and (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
                                            or key.dtype == jnp.uint32 and key.ndim == 1)):
        raise TypeError(f"jitter_key must be a PRNG key such as jax.random.key(0), got "
                        f"{key!r}.")



def _pad_rows(a: jax.Array, rows: int, value=0) -> jax.Array:
    """``a`` with ``rows`` rows of ``value`` appended along axis 0 (no-op for 0)."""
    if not rows:
        return a
    return jnp.concatenate([a, jnp.full((rows, *a.shape[1:]), value, a.dtype)], axis=0)


def _unpad_rows(a: jax.Array, rows: int, mesh) -> jax.Array:
    """The first ``rows`` rows of ``a`` (on Explicit meshes gathered first: a slice that does
    not split evenly over the devices is not defined there)."""
    if meshes.is_explicit(mesh):
        a = meshes.reshard(a, mesh, P())
    return a[:rows]


def _placed_inputs(x, w_gate_up, w_down, inputs: dict, options: ResolvedOptions, mesh,
                   t_pad: int):
    """``(tokens [t_pad, d], w_gate_up, w_down, extra, specs)``: the call's arrays as the
    layer's ``shard_map`` takes them. The tokens flattened, jittered, padded with masked tokens
    to ``t_pad`` and split over the token axes (their mask and noise with them); the banks
    padded to ``num_slots`` experts (zeros, never routed to) and split over the expert axis;
    the router bias and the shared experts replicated. ``extra`` (a :class:`LocalInputs`,
    ``specs`` its specs) holds the optional ones."""
    b, s, d = x.shape
    t, router = b * s, options.router
    tokens = x.reshape(t, d)
    mask = inputs["token_mask"]
    mask = None if mask is None else jnp.asarray(mask).reshape(t).astype(bool)
    noise = None
    if inputs["jitter_key"] is not None and router.router_jitter_noise > 0:
        eps = router.router_jitter_noise
        noise = jax.random.uniform(inputs["jitter_key"], (t, d), jnp.float32, 1.0 - eps,
                                   1.0 + eps)
        if router.jitter_input == "all":
            tokens, noise = (tokens * noise).astype(x.dtype), None
    if t_pad != t:  # pad with masked tokens
        mask = _pad_rows(jnp.ones((t,), bool) if mask is None else mask, t_pad - t, False)
        tokens = _pad_rows(tokens, t_pad - t)
        noise = None if noise is None else _pad_rows(noise, t_pad - t, 1.0)
    banks = [w_gate_up, w_down]
    if inputs["expert_bias"] is not None:
        banks += [jnp.asarray(a) for a in inputs["expert_bias"]]
    banks = [_pad_rows(a, options.num_slots - router.num_experts) for a in banks]
    tok_spec, axis = P(options.token_axes), options.dispatch.expert_axis
    tokens = meshes.reshard(tokens, mesh, tok_spec)
    banks = [meshes.reshard(a, mesh, P(axis, *(None,) * (a.ndim - 1))) for a in banks]
    extra, specs = LocalInputs(), LocalInputs()
    if mask is not None:
        mask = meshes.reshard(mask, mesh, tok_spec)
        tokens = jnp.where(mask[:, None], tokens, jnp.zeros((), tokens.dtype))
        extra, specs = extra._replace(mask=mask), specs._replace(mask=tok_spec)
    if noise is not None:
        extra = extra._replace(noise=meshes.reshard(noise, mesh, tok_spec))
        specs = specs._replace(noise=tok_spec)
    if inputs["router_bias"] is not None:
        extra = extra._replace(router_bias=inputs["router_bias"])
        specs = specs._replace(router_bias=P())
    if inputs["shared"] is not None:  # computed per device, where it can hide a dispatch
        extra = extra._replace(shared=tuple(inputs["shared"]))
        specs = specs._replace(shared=(P(), P()))
        if inputs["shared_gate"] is not None:
            extra = extra._replace(shared_gate=inputs["shared_gate"])
            specs = specs._replace(shared_gate=P())
    if len(banks) > 2:
        extra = extra._replace(expert_bias=tuple(banks[2:]))
        specs = specs._replace(expert_bias=(P(axis, None), P(axis, None)))
    return tokens, banks[0], banks[1], extra, specs


def _options_argument(options: MoEOptions | None, opts: MoEOptions | None) -> MoEOptions:
    """``options``, or the deprecated ``opts=`` spelling of it (with a DeprecationWarning)."""
    if opts is not None:
        if options is not None:
            raise TypeError("moe_apply got both options= and opts=; pass options= only.")
        warnings.warn("moe_apply(opts=...) is deprecated; pass options=... (the same "
                      "MoEOptions).", DeprecationWarning, stacklevel=3)
        options = opts
    if not isinstance(options, MoEOptions):
        raise TypeError(f"options must be a moe.MoEOptions, got {type(options).__name__}; build "
                        "it with moe.MoEOptions.create(num_experts, top_k, ...).")
    return options


def moe_apply(
    x: jax.Array,
    router_kernel: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    bias: jax.Array | None = None,
    shared: tuple[jax.Array, jax.Array] | None = None,
    *,
    options: MoEOptions | None = None,
    mesh=None,
    router_bias: jax.Array | None = None,
    expert_bias: tuple[jax.Array, jax.Array] | None = None,
    shared_gate: jax.Array | None = None,
    token_mask: jax.Array | None = None,
    jitter_key: jax.Array | None = None,
    opts: MoEOptions | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Applies an expert-parallel MoE layer: ``y = sum_k w_k * E_{e_k}(x) (+ shared(x))``.

    ``E_e(x) = act(x Wgu_e + bgu_e) Wd_e + bd_e`` with ``act([g | u]) = silu(g) * u`` by
    default (``options.experts.activation``; biases only with ``expert_bias``); the router is
    ``moe.routing.route``; the shared experts ``S(x) = act(x Wgu_s) Wd_s``, times
    ``sigmoid(x w_g)`` with ``shared_gate``. Dropped slots (dense transport over capacity)
    contribute 0; ``aux['dropped_slots']`` counts them and ``aux['dropped_tokens']`` the
    tokens that lost at least one of their ``k`` slots.

    Tokens masked out by ``token_mask`` are routed nowhere: they take no capacity, count in no
    ``tokens_per_expert`` or loss, get ``y = 0`` and pass no gradient (their values, even
    NaN, do not matter). Token counts that do not split evenly over the devices are padded
    with such masked tokens internally, and an expert count that does not split over the
    expert axis with experts that no token is routed to (zero weights, zero gradients, not in
    ``tokens_per_expert``); the results are the same as on one device.

    Args:
      x: ``[batch, seq, d_model]`` activations (their dtype is the compute dtype).
      router_kernel: ``[d_model, E]``.
      w_gate_up: ``[E, d_model, 2 * d_ff]`` (gate columns first).
      w_down: ``[E, d_ff, d_model]``.
      bias: balancing bias ``[E]`` or None.
      shared: ``(gate_up [d_model, 2 * d_shared], down [d_shared, d_model])`` of the shared
        experts, or None.
      options: :class:`moe.MoEOptions` (required).
      mesh: a ``jax.sharding.Mesh``; None uses the ambient mesh (``jax.set_mesh``) or, with
        none, one device.
      router_bias: trained logit bias ``[E]`` (with ``options.router.router_bias``).
      expert_bias: ``(b_gate_up [E, 2 * d_ff], b_down [E, d_model])`` (with
        ``options.experts.expert_bias``).
      shared_gate: ``[d_model, 1]`` (with ``options.experts.shared_expert_gate``).
      token_mask: bool ``[batch, seq]``, False for padding tokens; None: all tokens count.
      jitter_key: a PRNG key: with ``options.router.router_jitter_noise = eps > 0`` the tokens
        are multiplied by ``jax.random.uniform(jitter_key, (batch * seq, d_model), float32,
        1 - eps, 1 + eps)`` (reshaped like ``x``) for the router, or for the router and the
        experts (``jitter_input='all'``). None: no jitter (eval).

    Returns:
      ``(y, aux)``: ``y`` like ``x``; ``aux`` with ``load_balance_loss``, ``router_z_loss``,
      ``tokens_per_expert`` (int32 ``[E]``, all tokens), ``dropped_slots`` (int32: routing
      slots, ``k`` per token, that the capacity dropped) and ``dropped_tokens`` (int32: tokens
      with at least one slot dropped; ``dropped_tokens <= dropped_slots <= k *
      dropped_tokens``), and
      with ``options.router.return_routing`` ``expert_ids`` (int32 ``[batch, seq, k]``, -1 for
      masked tokens) and ``expert_weights`` (f32 ``[batch, seq, k]``, 0 for masked tokens).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from moe import MoEOptions, moe_apply
      >>> k = jax.random.split(jax.random.key(0), 3)
      >>> params = (jax.random.normal(k[0], (16, 4)),  # router [d_model, E]
      ...           jax.random.normal(k[1], (4, 16, 16)) * 0.1,  # w_gate_up [E, d_model, 2 d_ff]
      ...           jax.random.normal(k[2], (4, 8, 16)) * 0.1)  # w_down [E, d_ff, d_model]
      >>> apply = jax.jit(lambda x, p: moe_apply(x, *p, options=MoEOptions.create(4, 2)))
      >>> y, aux = apply(jnp.ones((2, 4, 16)), params)
      >>> y.shape, int(aux["tokens_per_expert"].sum())
      ((2, 4, 16), 16)

    References:
      Shazeer et al. (2017), GShard (2020), Switch Transformer (2021); DeepSeek-V3 (2024).
    """
    options = _options_argument(options, opts)
    mesh = meshes.resolve(mesh)
    if mesh is None:
        axes = options.dispatch.expert_axes
        mesh = jax.make_mesh((1,) * len(axes), axes, devices=jax.devices()[:1])
    inputs = dict(bias=bias, router_bias=router_bias, expert_bias=expert_bias, shared=shared,
                  shared_gate=shared_gate, token_mask=token_mask, jitter_key=jitter_key)
    _check_arrays(x, router_kernel, w_gate_up, w_down, options.router.num_experts)
    _check_optional_inputs(x, w_down, options, inputs)
    b, s, d = x.shape
    t = b * s
    options = options.resolve(t, d, w_down.shape[1], mesh=mesh,
                              token_bytes=jnp.dtype(x.dtype).itemsize)
    axes, chunks = options.token_axes, options.dispatch.overlap_chunks
    n_dev = math.prod(mesh.shape[a] for a in axes)
    t_pad = -(-t // (n_dev * chunks)) * (n_dev * chunks)  # whole chunks on every device
    tok_spec = P(axes)
    out_spec = jax.typeof(x.reshape(t, d)).sharding.spec if meshes.is_explicit(mesh) else None
    tokens, w_gate_up, w_down, extra, specs = _placed_inputs(x, w_gate_up, w_down, inputs,
                                                             options, mesh, t_pad)
    if bias is None:
        bias = jnp.zeros((options.router.num_experts,), jnp.float32)
    all_axes = tuple(mesh.axis_names)
    w_spec = P(options.dispatch.expert_axis, None, None)
    routing_specs = ({"expert_ids": tok_spec, "expert_weights": tok_spec}
                     if options.router.return_routing else {})
    body = jax.shard_map(
        lambda xt, wr, bb, wgu, wd, ex: _local_moe(xt, wr, bb, wgu, wd, ex, options, all_axes, t),
        mesh=mesh,
        in_specs=(tok_spec, P(), P(), w_spec, w_spec, specs),
        out_specs=(tok_spec, (P(), P(), P(), P(), P()), routing_specs),
    )
    y, (lb, z, counts, dropped_slots, dropped_tokens), routing = body(
        tokens, router_kernel, bias, w_gate_up, w_down, extra)
    aux = {
        "load_balance_loss": lb,
        "router_z_loss": z,
        "tokens_per_expert": counts,
        "dropped_slots": dropped_slots,
        "dropped_tokens": dropped_tokens,
    }
    if t_pad != t:
        y = _unpad_rows(y, t, mesh)
        routing = {k: _unpad_rows(v, t, mesh) for k, v in routing.items()}
    if out_spec is not None:  # Explicit mesh: give y (and routing) back the tokens' sharding
        y = meshes.reshard(y, mesh, out_spec)
        routing = {k: meshes.reshard(v, mesh, out_spec) for k, v in routing.items()}
    for name, value in routing.items():
        aux[name] = value.reshape(b, s, -1)
    return y.reshape(b, s, d).astype(x.dtype), aux
