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

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from moe import experts as _experts
from moe import routing as _routing
from moe._transport import WireKernels
from moe.dispatch import Transport, WireDtype, combine, dispatch
from moe.experts import Backend, GemmDtype, SaveZ, WgradDtype

__all__ = ["BalancingBias", "MoE", "MoEOptions", "moe_apply", "moe_linen"]


@nnx.register_variable_name("balancing_bias", overwrite=True)  # Linen collection name
class BalancingBias(nnx.Variable):
    """Aux-loss-free balancing bias (DeepSeek-V3): changes expert selection, never trained."""


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """Static options of :func:`moe_apply` (hashable, so they can be ``jit``-static).

    Attributes:
      router: the :class:`moe.routing.RouterConfig`.
      expert_axis: mesh axis the experts are split over.
      batch_axes: mesh axes the tokens are split over besides ``expert_axis``; ``None``: every
        other axis of the mesh.
      transport: dispatch transport (``'auto'`` = ``'dense'``: see ``moe.dispatch``).
      capacity_factor: dense transport capacity factor; ``None`` is dropless.
      dispatch_dtype: wire format of the tokens (``None``: activation dtype, ``'bf16'``,
        ``'fp8'``).
      combine_grad_dtype: wire format of the combine gradient.
      backend: grouped-GEMM backend of ``moe.gated_experts`` (``'auto'`` follows the layout:
        ``'einsum'`` for the dense transport; for the ragged one ``'pallas'`` on NVIDIA GPUs,
        ``'ragged_dot'`` elsewhere). ``'pallas'``
        works with both transports (the dense layout's capacity slots become ragged groups of
        ``C`` rows); it is compiled through Triton on GPUs and interpreted, slowly, on CPU.
      gemm_dtype, save_z, wgrad_dtype: expert precision/memory options (``moe.gated_experts``).
      fp8_block_size: channels per FP8 scale (wire and GEMMs).
      wire_kernels: who encodes / lays out the dispatched rows (``moe.dispatch``): ``'auto'``
        (Pallas kernels on NVIDIA GPUs, XLA elsewhere), ``'xla'`` or ``'pallas'``.
    """

    router: _routing.RouterConfig
    expert_axis: str = "expert"
    batch_axes: tuple[str, ...] | None = None
    transport: Transport = "auto"
    capacity_factor: float | None = None
    dispatch_dtype: WireDtype = None
    combine_grad_dtype: WireDtype = None
    backend: Backend = "auto"
    gemm_dtype: GemmDtype = "bf16"
    save_z: SaveZ = "bf16"
    wgrad_dtype: WgradDtype = "bf16"
    fp8_block_size: int = 128
    wire_kernels: WireKernels = "auto"


def _resolve_mesh(mesh):
    if mesh is not None:
        return mesh
    ambient = jax.sharding.get_abstract_mesh()
    return None if ambient.empty else ambient


def _token_axes(mesh, opts: MoEOptions) -> tuple[str, ...]:
    names = tuple(mesh.axis_names)
    if opts.expert_axis not in names:
        raise ValueError(
            f"expert_axis={opts.expert_axis!r} is not an axis of the mesh {names}; pass "
            f"expert_axis= one of them (or build the mesh with an {opts.expert_axis!r} axis)."
        )
    batch = opts.batch_axes
    if batch is None:
        batch = tuple(a for a in names if a != opts.expert_axis)
    for a in batch:
        if a not in names:
            raise ValueError(f"batch_axes names {a!r}, which is not an axis of the mesh {names}.")
    return (*batch, opts.expert_axis)


def _explicit(mesh) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _reshard(a: jax.Array, mesh, spec: P) -> jax.Array:
    """Puts ``a`` on ``spec``: ``reshard`` on Explicit meshes, a constraint on Auto ones."""
    sharding = jax.sharding.NamedSharding(mesh, spec)
    if _explicit(mesh):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


def _check_backend(opts: MoEOptions) -> None:
    """backend='pallas' needs Pallas and a GPU (or the CPU, interpreted): say so up front."""
    if opts.backend == "pallas":
        _experts._check_pallas_platform()


def _check_fp8(d_model: int, d_ff: int, opts: MoEOptions) -> None:
    """The FP8 options' shape rules (those of ``moe.dispatch`` and ``moe.gated_experts``),
    checked up front so the error names the layer's arguments."""
    bs = opts.fp8_block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"fp8_block_size must be a positive int, got {bs!r}; use 128.")
    width = 4 * bs
    uses = []  # (name, size, option): FP8-quantized feature axes (four scales per int32 word)
    for option in ("dispatch_dtype", "combine_grad_dtype"):
        if getattr(opts, option) == "fp8":
            uses.append(("d_model", d_model, option))
    if opts.gemm_dtype == "fp8":
        uses += [("d_model", d_model, "gemm_dtype"), ("d_ff", d_ff, "gemm_dtype")]
    if opts.save_z == "fp8":
        uses.append(("2 * d_ff", 2 * d_ff, "save_z"))  # z is [rows, 2 * d_ff]
    # wgrad_dtype='fp8' blocks run along the token axis, which is zero-padded: no rule.
    for name, value, option in uses:
        if value % width:
            raise ValueError(
                f"{name}={value} must be a multiple of 4 * fp8_block_size = {width} for "
                f"{option}='fp8'; choose a d_model / d_ff that makes it one, a smaller "
                f"fp8_block_size (4 * fp8_block_size dividing {value}), or {option}='bf16'."
            )


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


def _local_moe(x, router_kernel, bias, w_gate_up, w_down, *, opts: MoEOptions, all_axes,
               total_tokens: int):
    """Per-device body: route, dispatch, local SwiGLU experts, combine."""
    # Router and expert banks are replicated over some axes; mark them varying there so that
    # autodiff sums their gradients over those axes (the transpose of pcast is a psum).
    others = tuple(a for a in all_axes if a != opts.expert_axis)
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
        axis_name=opts.expert_axis,
        transport=opts.transport,
        capacity_factor=opts.capacity_factor,
        dispatch_dtype=opts.dispatch_dtype,
        block_size=opts.fp8_block_size,
        wire_kernels=opts.wire_kernels,
    )
    expert_kw = dict(gemm_dtype=opts.gemm_dtype, save_z=opts.save_z,
                     wgrad_dtype=opts.wgrad_dtype, block_size=opts.fp8_block_size)
    wgu, wd = w_gate_up.astype(ex.dtype), w_down.astype(ex.dtype)
    if ex.ndim == 3 and opts.backend in ("ragged_dot", "pallas"):  # dense layout, 2-D GEMMs
        e_local, c, d = ex.shape
        full = jnp.full((e_local,), c, dtype=jnp.int32)
        ey = _experts.gated_experts(
            ex.reshape(e_local * c, d), full, wgu, wd, backend=opts.backend, **expert_kw
        ).reshape(e_local, c, -1)
    else:
        # The dense layout interleaves padding per source (row p * C + r), so its valid rows
        # are not a prefix: run every row (padding rows are zero and give zero outputs).
        sizes = None if ex.ndim == 3 else group_sizes
        ey = _experts.gated_experts(ex, sizes, wgu, wd, backend=opts.backend, **expert_kw)
    y = combine(ey, r.weights, plan, combine_grad_dtype=opts.combine_grad_dtype)
    dropped = jax.lax.psum(plan.dropped, all_axes)
    return y.astype(x.dtype), (lb, z, counts, dropped)


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
      opts: :class:`MoEOptions`.
      mesh: a ``jax.sharding.Mesh``; None uses the ambient mesh (``jax.set_mesh``) or, with
        none, one device.

    Returns:
      ``(y, aux)``: ``y`` like ``x``; ``aux`` with ``load_balance_loss``, ``router_z_loss``,
      ``tokens_per_expert`` (int32 ``[E]``, all tokens) and ``dropped_tokens`` (int32).
    """
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
    d_ff = w_down.shape[1]
    _check_fp8(d, d_ff, opts)
    _check_backend(opts)
    mesh = _resolve_mesh(mesh)
    if mesh is None:
        mesh = jax.make_mesh((1,), (opts.expert_axis,), devices=jax.devices()[:1])
    axes = _token_axes(mesh, opts)
    n_dev = math.prod(mesh.shape[a] for a in axes)
    ep = mesh.shape[opts.expert_axis]
    if num_experts % ep:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the size {ep} of expert_axis "
            f"{opts.expert_axis!r}; choose num_experts a multiple of {ep} or a smaller axis."
        )
    if (b * s) % n_dev:
        raise ValueError(
            f"x has batch * seq = {b * s} tokens, which must be divisible by the {n_dev} "
            f"devices of the mesh axes {axes} they are split over; change the batch or "
            f"sequence length (or pass batch_axes= fewer axes)."
        )

    tokens = x.reshape(b * s, d)
    tok_spec = P(axes)
    w_spec = P(opts.expert_axis, None, None)
    out_spec = jax.typeof(tokens).sharding.spec if _explicit(mesh) else None
    tokens = _reshard(tokens, mesh, tok_spec)
    w_gate_up, w_down = _reshard(w_gate_up, mesh, w_spec), _reshard(w_down, mesh, w_spec)
    bias = jnp.zeros((num_experts,), jnp.float32) if bias is None else bias
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
        gu, dn = shared
        with jax.named_scope("moe_shared_experts"):
            zs = jnp.einsum("td,df->tf", tokens, gu.astype(x.dtype))
            g, u = jnp.split(zs, 2, axis=-1)
            y = y + jnp.einsum("tf,fd->td", jax.nn.silu(g) * u, dn.astype(x.dtype))
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

    ``y = sum_{j<k} w_j(x) * E_{e_j}(x) + sum_s S_s(x)`` where the router picks ``e_j`` by
    ``top_k(score(x W_r) + bias)``, ``E_e(x) = (silu(x Wg_e) * (x Wu_e)) Wd_e`` and ``S_s`` are
    always-on shared experts (DeepSeekMoE). Experts are split over ``expert_axis`` of the mesh
    and tokens over every mesh axis; tokens travel to their experts by ``all_to_all`` (optionally
    as FP8 e4m3 with E8M0 block scales).

    Args:
      d_model: model width.
      d_ff: hidden width of one expert.
      num_experts: routed experts ``E``.
      top_k: experts per token.
      mesh: mesh (default: the ambient ``jax.set_mesh`` mesh, else one device).
      expert_axis: mesh axis the experts are split over.
      batch_axes: other mesh axes the tokens are split over (default: all other axes).
      score_fn, renormalize, routed_scaling, num_groups, topk_groups, stop_score_gradient:
        router options (``moe.routing.RouterConfig``).
      transport, capacity_factor, dispatch_dtype, combine_grad_dtype: dispatch options
        (``moe.dispatch``).
      backend, gemm_dtype, save_z, wgrad_dtype: expert options (``moe.gated_experts``).
      fp8_block_size: channels per FP8 scale.
      wire_kernels: who encodes / lays out dispatched rows (see :class:`MoEOptions`).
      num_shared_experts: always-on experts, fused into one SwiGLU of width
        ``num_shared_experts * d_ff``.
      dtype: compute dtype; param_dtype: parameter dtype.
      rngs: ``nnx.Rngs`` (keyword-only).

    Example:
      >>> layer = MoE(512, 256, 8, 2, rngs=nnx.Rngs(0))
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
        num_experts: int,
        top_k: int,
        *,
        mesh=None,
        expert_axis: str = "expert",
        batch_axes: Sequence[str] | None = None,
        score_fn: Literal["softmax", "sigmoid"] = "softmax",
        renormalize: bool = True,
        routed_scaling: float = 1.0,
        num_groups: int = 1,
        topk_groups: int | None = None,
        stop_score_gradient: bool = False,
        transport: Transport = "auto",
        capacity_factor: float | None = None,
        dispatch_dtype: WireDtype = None,
        combine_grad_dtype: WireDtype = None,
        backend: Backend = "auto",
        gemm_dtype: GemmDtype = "bf16",
        save_z: SaveZ = "bf16",
        wgrad_dtype: WgradDtype = "bf16",
        fp8_block_size: int = 128,
        wire_kernels: WireKernels = "auto",
        num_shared_experts: int = 0,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        for name, v in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts),
                        ("top_k", top_k)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        if num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {num_shared_experts}.")
        self.mesh = mesh
        self.dtype = dtype
        self.opts = MoEOptions(
            router=_routing.RouterConfig(
                num_experts, top_k, routed_scaling, num_groups, topk_groups,
                score_fn=score_fn, renormalize=renormalize,
                stop_score_gradient=stop_score_gradient,
            ),
            expert_axis=expert_axis,
            batch_axes=None if batch_axes is None else tuple(batch_axes),
            transport=transport,
            capacity_factor=capacity_factor,
            dispatch_dtype=dispatch_dtype,
            combine_grad_dtype=combine_grad_dtype,
            backend=backend,
            gemm_dtype=gemm_dtype,
            save_z=save_z,
            wgrad_dtype=wgrad_dtype,
            fp8_block_size=fp8_block_size,
            wire_kernels=wire_kernels,
        )
        _check_fp8(d_model, d_ff, self.opts)
        _check_backend(self.opts)
        resolved = _resolve_mesh(mesh)
        if resolved is not None:
            _token_axes(resolved, self.opts)
            ep = resolved.shape[expert_axis]
            if num_experts % ep:
                raise ValueError(
                    f"num_experts={num_experts} is not divisible by the size {ep} of expert_axis "
                    f"{expert_axis!r}; choose num_experts a multiple of {ep}."
                )
        # With an explicit mesh, place the values here (``reshard`` / a sharding constraint):
        # ``jax.set_mesh`` is refused under a trace, and ``moe_linen`` builds the module inside
        # ``apply``, often under ``jax.jit``. With only an ambient mesh, flax places them.
        eager = mesh is None and resolved is not None

        def place(value, sharding):
            if mesh is not None:
                value = _reshard(value, mesh, P(*sharding))
            return value

        def param(key, shape, fan_in, sharding):
            value = jax.random.normal(key, shape, param_dtype) * fan_in**-0.5
            return nnx.Param(place(value, sharding), out_sharding=sharding,
                             eager_sharding=eager)

        self.router_kernel = param(rngs.params(), (d_model, num_experts), d_model, (None, None))
        self.w_gate_up = param(rngs.params(), (num_experts, d_model, 2 * d_ff), d_model,
                               (expert_axis, None, None))
        self.w_down = param(rngs.params(), (num_experts, d_ff, d_model), d_ff,
                            (expert_axis, None, None))
        if num_shared_experts:
            f = num_shared_experts * d_ff
            self.shared_gate_up = param(rngs.params(), (d_model, 2 * f), d_model, (None, None))
            self.shared_down = param(rngs.params(), (f, d_model), f, (None, None))
        else:
            self.shared_gate_up = self.shared_down = None
        self.balancing_bias = BalancingBias(
            place(jnp.zeros((num_experts,), jnp.float32), (None,)), out_sharding=(None,),
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


def moe_linen(*args, **kwargs):
    """The :class:`MoE` layer as a Linen module, through ``flax.nnx.bridge.to_linen``.

    Takes :class:`MoE`'s arguments except ``rngs``; the Linen module's ``init`` / ``apply``
    carry the params in the ``'params'`` collection and the balancing bias in
    ``'balancing_bias'`` (``flax.linen.unbox`` them for plain arrays). With a mesh of Explicit
    axes, run a jitted ``init`` inside ``jax.set_mesh(mesh)``: JAX places newly created
    explicitly sharded values only under a mesh context.

    Example:
      >>> layer = moe_linen(512, 256, 8, 2)
      >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 4, 512)))
      >>> y, aux = layer.apply(variables, jnp.ones((2, 4, 512)))
    """
    from flax.nnx import bridge

    return bridge.to_linen(MoE, *args, **kwargs)
