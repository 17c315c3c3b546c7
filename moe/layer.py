"""The Mixture-of-Experts layer: router, expert-parallel dispatch, SwiGLU experts, combine.

:func:`moe_apply` is the functional core (pure function of arrays and static options);
:class:`MoE` is the Flax NNX shell that owns the parameters and the balancing bias, and
:func:`moe_linen` exposes it to Linen through ``flax.nnx.bridge``.

Layout: tokens ``[batch, seq, d_model]`` are flattened and split over every axis of the mesh
(the batch axes and the expert axis: all devices are data parallel for the router and the
shared experts); experts are split over the expert axis. Inside ``jax.shard_map``: dispatch
(``moe.dispatch``), local experts (``moe.gated_experts``), combine (``moe.combine``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe import experts as _experts
from moe import routing as _routing
from moe.dispatch import combine, dispatch
from moe.options import MoEOptions

__all__ = ["BalancingBias", "MoE", "moe_apply", "moe_linen"]


@nnx.register_variable_name("balancing_bias", overwrite=True)  # Linen collection name
class BalancingBias(nnx.Variable):
    """Aux-loss-free balancing bias (DeepSeek-V3): changes expert selection, never trained."""


def _resolve_mesh(mesh):
    if mesh is not None:
        return mesh
    ambient = jax.sharding.get_abstract_mesh()
    return None if ambient.empty else ambient


def _explicit(mesh) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _reshard(a: jax.Array, mesh, spec: P) -> jax.Array:
    """Puts ``a`` on ``spec``: ``reshard`` on Explicit meshes, a constraint on Auto ones."""
    sharding = jax.sharding.NamedSharding(mesh, spec)
    if _explicit(mesh):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


def _global_router_stats(r: _routing.Routing, opts: MoEOptions, all_axes, total_tokens: int):
    """Load-balancing and z losses over *all* tokens, from per-device partial sums."""
    e, k = opts.router.num_experts, opts.router.top_k
    counts = jax.lax.psum(r.tokens_per_expert, all_axes)
    probs = _routing.balance_probs(r.scores, opts.router.score_fn)
    p_mean = jax.lax.psum(probs.sum(0), all_axes) / total_tokens
    f = counts.astype(jnp.float32) / (total_tokens * k)
    lb = e * jnp.sum(jax.lax.stop_gradient(f) * p_mean)
    lse = jax.nn.logsumexp(r.logits, axis=-1)
    z = jax.lax.psum(jnp.sum(lse**2), all_axes) / total_tokens
    return counts, lb, z


def _local_experts(ex, group_sizes, w_gate_up, w_down, opts: MoEOptions) -> jax.Array:
    """The local experts on the layout ``dispatch`` produced (padded ``[E, C, d]`` or ragged)."""
    eo = opts.experts
    kw = dict(gemm_dtype=eo.gemm_dtype, dgrad_dtype=eo.dgrad_dtype, save_z=eo.save_z,
              wgrad_dtype=eo.wgrad_dtype, block_size=opts.fp8_block_size)
    wgu, wd = w_gate_up, w_down
    if ex.ndim == 3 and eo.backend in ("ragged_dot", "pallas", "mosaic"):  # 2-D GEMMs
        e_local, c, d = ex.shape
        full = jnp.full((e_local,), c, dtype=jnp.int32)
        return _experts.gated_experts(
            ex.reshape(e_local * c, d), full, wgu, wd, backend=eo.backend, **kw
        ).reshape(e_local, c, -1)
    # The dense layout interleaves padding per source (row p * C + r), so its valid rows are
    # not a prefix: run every row (padding rows are zero and give zero outputs).
    sizes = None if ex.ndim == 3 else group_sizes
    return _experts.gated_experts(ex, sizes, wgu, wd, backend=eo.backend, **kw)


def _local_moe(x, router_kernel, bias, w_gate_up, w_down, *, opts: MoEOptions, all_axes,
               total_tokens: int):
    """Per-device body: route, dispatch, local SwiGLU experts, combine."""
    # Router and expert banks are replicated over some axes; mark them varying there so that
    # autodiff sums their gradients over those axes (the transpose of pcast is a psum).
    do = opts.dispatch
    others = tuple(a for a in all_axes if a != do.expert_axis)
    if others:
        w_gate_up = jax.lax.pcast(w_gate_up, others, to="varying")
        w_down = jax.lax.pcast(w_down, others, to="varying")
    router_kernel = jax.lax.pcast(router_kernel, tuple(all_axes), to="varying")
    with jax.named_scope("moe_router"):
        r = _routing.route(x, router_kernel, bias, config=opts.router)
        counts, lb, z = _global_router_stats(r, opts, all_axes, total_tokens)
    ex, group_sizes, plan = dispatch(
        x,
        r.expert_ids,
        num_experts=opts.router.num_experts,
        axis_name=do.expert_axis,
        transport=do.transport,
        capacity_factor=do.capacity_factor,
        dispatch_dtype=do.dispatch_dtype,
        block_size=opts.fp8_block_size,
        wire_kernels=do.wire_kernels,
    )
    ey = _local_experts(ex, group_sizes, w_gate_up, w_down, opts)
    y = combine(ey, r.weights, plan, combine_grad_dtype=do.combine_grad_dtype)
    dropped = jax.lax.psum(plan.dropped, all_axes)
    return y.astype(x.dtype), (lb, z, counts, dropped)


def _check_call(x, router_kernel, w_down, opts: MoEOptions, mesh) -> None:
    """The shape checks of one :func:`moe_apply` call (the options were checked already)."""
    if x.ndim != 3:
        raise ValueError(
            f"x must be [batch, seq, d_model], got shape {x.shape}; reshape tokens to rank 3."
        )
    b, s, d = x.shape
    if b * s == 0:
        raise ValueError(
            f"x has shape {x.shape}: a batch with no tokens; pass at least one token per device "
            "(skip the layer for empty batches)."
        )
    num_experts = opts.router.num_experts
    if router_kernel.shape != (d, num_experts):
        raise ValueError(
            f"router_kernel has shape {router_kernel.shape}, expected (d_model, num_experts) = "
            f"({d}, {num_experts}); x's last axis must equal the layer's d_model."
        )
    opts.check(d_model=d, d_ff=w_down.shape[1], mesh=mesh)
    axes = opts.token_axes(mesh)
    n_dev = math.prod(mesh.shape[a] for a in axes)
    if (b * s) % n_dev:
        raise ValueError(
            f"x has batch * seq = {b * s} tokens, which must be divisible by the {n_dev} "
            f"devices of the mesh axes {axes} they are split over; change the batch or "
            f"sequence length (or pass batch_axes= fewer axes)."
        )


def _shared_experts(tokens: jax.Array, shared, dtype) -> jax.Array:
    """The always-on shared experts: one SwiGLU over every token."""
    gu, dn = shared
    with jax.named_scope("moe_shared_experts"):
        zs = jnp.einsum("td,df->tf", tokens, gu.astype(dtype))
        g, u = jnp.split(zs, 2, axis=-1)
        return jnp.einsum("tf,fd->td", jax.nn.silu(g) * u, dn.astype(dtype))


def moe_apply(
    x: jax.Array,
    router_kernel: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    bias: jax.Array | None = None,
    shared: tuple[jax.Array, jax.Array] | None = None,
    *,
    opts: MoEOptions,
    mesh=None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Applies an expert-parallel MoE layer: ``y = sum_k w_k * E_{e_k}(x) (+ shared(x))``.

    ``E_e(x) = (silu(x Wg_e) * (x Wu_e)) Wd_e`` with ``[Wg_e | Wu_e] = w_gate_up[e]``; the
    router is ``moe.routing.route``; dropped slots (dense transport over capacity) contribute 0
    and are counted in ``aux['dropped_tokens']``.

    Args:
      x: ``[batch, seq, d_model]`` activations (their dtype is the compute dtype).
      router_kernel: ``[d_model, E]``.
      w_gate_up: ``[E, d_model, 2 * d_ff]`` (gate columns first).
      w_down: ``[E, d_ff, d_model]``.
      bias: balancing bias ``[E]`` or None.
      shared: ``(gate_up [d_model, 2 * d_shared], down [d_shared, d_model])`` of the shared
        experts, or None.
      opts: :class:`moe.MoEOptions`.
      mesh: a ``jax.sharding.Mesh``; None uses the ambient mesh (``jax.set_mesh``) or, with
        none, one device.

    Returns:
      ``(y, aux)``: ``y`` like ``x``; ``aux`` with ``load_balance_loss``, ``router_z_loss``,
      ``tokens_per_expert`` (int32 ``[E]``, all tokens) and ``dropped_tokens`` (int32).

    Example:
      >>> opts = MoEOptions.create(4, 2)
      >>> k = jax.random.split(jax.random.key(0), 3)
      >>> y, aux = moe_apply(jnp.ones((2, 4, 16)), jax.random.normal(k[0], (16, 4)),
      ...                    jax.random.normal(k[1], (4, 16, 16)) * 0.1,
      ...                    jax.random.normal(k[2], (4, 8, 16)) * 0.1, opts=opts)
      >>> y.shape, int(aux["tokens_per_expert"].sum())
      ((2, 4, 16), 16)

    References:
      Shazeer et al. (2017), GShard (2020), Switch Transformer (2021); DeepSeek-V3 (2024).
    """
    mesh = _resolve_mesh(mesh)
    if mesh is None:
        mesh = jax.make_mesh((1,), (opts.dispatch.expert_axis,), devices=jax.devices()[:1])
    _check_call(x, router_kernel, w_down, opts, mesh)
    b, s, d = x.shape
    axes = opts.token_axes(mesh)
    tokens = x.reshape(b * s, d)
    tok_spec = P(axes)
    w_spec = P(opts.dispatch.expert_axis, None, None)
    out_spec = jax.typeof(tokens).sharding.spec if _explicit(mesh) else None
    tokens = _reshard(tokens, mesh, tok_spec)
    w_gate_up, w_down = _reshard(w_gate_up, mesh, w_spec), _reshard(w_down, mesh, w_spec)
    if bias is None:
        bias = jnp.zeros((opts.router.num_experts,), jnp.float32)
    all_axes = tuple(mesh.axis_names)
    body = jax.shard_map(
        lambda xt, wr, bb, wgu, wd: _local_moe(
            xt, wr, bb, wgu, wd, opts=opts, all_axes=all_axes, total_tokens=b * s
        ),
        mesh=mesh,
        in_specs=(tok_spec, P(), P(), w_spec, w_spec),
        out_specs=(tok_spec, (P(), P(), P(), P())),
    )
    y, (lb, z, counts, dropped) = body(tokens, router_kernel, bias, w_gate_up, w_down)
    if shared is not None:
        y = y + _shared_experts(tokens, shared, x.dtype)
    aux = {
        "load_balance_loss": lb,
        "router_z_loss": z,
        "tokens_per_expert": counts,
        "dropped_tokens": dropped,
    }
    if out_spec is not None:  # Explicit mesh: give y back the tokens' sharding
        y = _reshard(y, mesh, out_spec)
    return y.reshape(b, s, d).astype(x.dtype), aux


class MoE(nnx.Module):
    """Expert-parallel Mixture-of-Experts feed-forward layer (SwiGLU experts, top-k router).

    ``y = sum_{j<k} w_j(x) * E_{e_j}(x) + S(x)`` where the router picks ``e_j`` by
    ``top_k(score(x W_r) + bias)``, ``E_e(x) = (silu(x Wg_e) * (x Wu_e)) Wd_e`` and ``S`` is the
    optional always-on shared expert (DeepSeekMoE). Experts are split over the mesh's expert
    axis and tokens over every mesh axis; tokens travel to their experts by ``all_to_all``
    (optionally as FP8 e4m3 with E8M0 block scales). Every static choice lives in ``options``.

    Args:
      d_model: model width.
      d_ff: hidden width of one expert.
      options: a :class:`moe.MoEOptions` (``moe.MoEOptions.create(num_experts, top_k, ...)``).
      mesh: mesh (default: the ambient ``jax.set_mesh`` mesh, else one device).
      dtype: compute dtype; param_dtype: parameter dtype.
      rngs: ``nnx.Rngs`` (keyword-only).

    Example:
      >>> layer = MoE(512, 256, options=MoEOptions.create(8, 2), rngs=nnx.Rngs(0))
      >>> y, aux = layer(jnp.ones((2, 4, 512)))
      >>> y.shape, aux['tokens_per_expert'].shape
      ((2, 4, 512), (8,))

    References:
      Shazeer et al. 2017; GShard; Switch Transformer; DeepSeekMoE; DeepSeek-V3 (aux-free
      balancing, group-limited routing); DeepEP (FP8 dispatch).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        options: MoEOptions,
        mesh=None,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if not isinstance(options, MoEOptions):
            raise TypeError(
                f"options must be a moe.MoEOptions, got {type(options).__name__}; build it "
                "with moe.MoEOptions.create(num_experts, top_k, ...)."
            )
        options.check(d_model=d_model, d_ff=d_ff, mesh=_resolve_mesh(mesh))
        self.mesh = mesh
        self.dtype = dtype
        self.opts = options
        self._init_params(d_model, d_ff, param_dtype, rngs)

    def _init_params(self, d_model: int, d_ff: int, param_dtype, rngs: nnx.Rngs) -> None:
        """Router, expert banks (split over the expert axis), shared expert, balancing bias."""
        mesh, e = self.mesh, self.opts.router.num_experts
        axis = self.opts.dispatch.expert_axis
        # With an explicit mesh, place the values here (``reshard`` / a sharding constraint):
        # ``jax.set_mesh`` is refused under a trace, and ``moe_linen`` builds the module inside
        # ``apply``, often under ``jax.jit``. With only an ambient mesh, flax places them.
        eager = mesh is None and _resolve_mesh(mesh) is not None

        def place(value, sharding):
            return value if mesh is None else _reshard(value, mesh, P(*sharding))

        def param(key, shape, fan_in, sharding):
            value = jax.random.normal(key, shape, param_dtype) * fan_in**-0.5
            return nnx.Param(place(value, sharding), out_sharding=sharding,
                             eager_sharding=eager)

        self.router_kernel = param(rngs.params(), (d_model, e), d_model, (None, None))
        self.w_gate_up = param(rngs.params(), (e, d_model, 2 * d_ff), d_model, (axis, None, None))
        self.w_down = param(rngs.params(), (e, d_ff, d_model), d_ff, (axis, None, None))
        if self.opts.experts.num_shared_experts:
            f = self.opts.experts.num_shared_experts * d_ff
            self.shared_gate_up = param(rngs.params(), (d_model, 2 * f), d_model, (None, None))
            self.shared_down = param(rngs.params(), (f, d_model), f, (None, None))
        else:
            self.shared_gate_up = self.shared_down = None
        self.balancing_bias = BalancingBias(
            place(jnp.zeros((e,), jnp.float32), (None,)), out_sharding=(None,),
            eager_sharding=eager,
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Returns ``(y, aux)`` for ``x [batch, seq, d_model]``; see :func:`moe_apply`."""
        shared = None
        if self.shared_gate_up is not None:
            shared = (self.shared_gate_up[...], self.shared_down[...])
        return moe_apply(
            jnp.asarray(x).astype(self.dtype),
            self.router_kernel[...],
            self.w_gate_up[...],
            self.w_down[...],
            self.balancing_bias[...],
            shared,
            opts=self.opts,
            mesh=self.mesh,
        )

    def update_balancing_bias(self, tokens_per_expert: jax.Array, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean_load - load)``."""
        self.balancing_bias[...] = _routing.update_balancing_bias(
            self.balancing_bias[...], tokens_per_expert, rate
        )


def moe_linen(d_model: int, d_ff: int, *, options: MoEOptions, mesh=None, **kwargs):
    """The :class:`MoE` layer as a Linen module, through ``flax.nnx.bridge.to_linen``.

    Takes :class:`MoE`'s arguments except ``rngs``; the Linen module's ``init`` / ``apply``
    carry the params in the ``'params'`` collection and the balancing bias in
    ``'balancing_bias'`` (``flax.linen.unbox`` them for plain arrays). With a mesh of Explicit
    axes, run a jitted ``init`` inside ``jax.set_mesh(mesh)``: JAX places newly created
    explicitly sharded values only under a mesh context.

    Example:
      >>> layer = moe_linen(512, 256, options=MoEOptions.create(8, 2))
      >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 4, 512)))
      >>> y, aux = layer.apply(variables, jnp.ones((2, 4, 512)))
    """
    from flax.nnx import bridge

    return bridge.to_linen(MoE, d_model, d_ff, options=options, mesh=mesh, **kwargs)
