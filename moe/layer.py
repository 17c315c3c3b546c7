"""The Mixture-of-Experts layer's functional core: router, expert-parallel dispatch, gated
experts, combine.

:func:`moe_apply` is a pure function of arrays and static options; :class:`moe.MoE`
(``moe.module``) is the Flax NNX shell that owns the parameters and the balancing bias, and
:func:`moe.moe_linen` (``moe.linen``) exposes it to Linen through ``flax.nnx.bridge``.

Layout: tokens ``[batch, seq, d_model]`` are flattened and split over every axis of the mesh
(the batch axes and the expert axis: all devices are data parallel for the router and the
shared experts); experts are split over the expert axis. Inside ``jax.shard_map``: dispatch
(``moe.dispatch``), local experts (``moe.gated_experts``), combine (``moe.combine``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from accel_kernels.gmm import api as gmm_api
from moe import experts as _experts
from moe import meshes
from moe import pipeline as _pipeline
from moe import routing as _routing
from moe.dispatch import dispatch_buckets, plan_dispatch, split_first_bucket
from moe.options import MoEOptions

__all__ = ["auto_overlap_chunks", "auto_transport", "moe_apply"]


def auto_transport(expert_axis_size: int) -> str:
    """The transport ``transport='auto'`` runs for an expert axis of ``expert_axis_size`` devices.

    ``'dropless'`` when the expert axis has one device and the ragged experts run the Mosaic
    GPU grouped GEMM (``experts.auto_implementation(2) == 'mosaic'``, Hopper GPUs): there nothing
    crosses a wire, and the dropless layer, which computes only the real rows, is faster than
    the capacity-padded one, balanced and Zipf-skewed, while dropping nothing (BENCHMARKS.md,
    The MoE layer). ``'dense'`` otherwise: neither the dropless exchange between devices nor the
    ragged experts elsewhere has been measured close to the capacity path.

    Args:
      expert_axis_size: devices on the layer's ``expert_axis``.

    Returns:
      ``'dropless'`` or ``'dense'``.

    Example:
      >>> import jax, moe
      >>> moe.auto_transport(8)
      'dense'
      >>> moe.auto_transport(1) == ('dropless' if moe.experts.auto_implementation(2) == 'mosaic'
      ...                           else 'dense')
      True
    """
    if expert_axis_size == 1 and _experts.auto_implementation(2) == "mosaic":
        return "dropless"
    return "dense"


OVERLAP_CHUNKS = {"dense": 2, "dropless": 2, "ragged": 1}
"""Chunks of the pipelined layer by transport when the expert axis has more than one device
(see :func:`auto_overlap_chunks`)."""
MIN_CHUNK_TOKENS = 1024
"""Fewest tokens per device in a chunk of the pipelined layer: below, a chunk's GEMMs are too
short to hide an exchange behind, and the capacity's rounding per chunk adds padding."""


def auto_overlap_chunks(expert_axis_size: int, tokens_per_device: int,
                        transport: str = "dense") -> int:
    """The chunk count ``overlap_chunks='auto'`` runs.

    1 with one device on the expert axis (nothing is sent, so there is nothing to hide, and
    chunks only add their own cost) and for small batches (fewer than
    :data:`MIN_CHUNK_TOKENS` tokens per device per chunk); else :data:`OVERLAP_CHUNKS` of the
    transport, read off 8-GPU schedules compiled on one GPU and replayed in time
    (``benchmarks/schedule8.py``; docs/benchmark_log.md, Overlap). Dense: 2 chunks model
    the shortest step for the layer alone and for the trainer's step
    (``examples/train_lm.py``'s GPU preset) as XLA schedules it on its own estimates; 4 hide
    more of the trainer's exchange but cost more passes, and only with a latency profile
    (``xla_comm.latency``) does their step come out shorter. Dropless: with no bucket switch
    between its chunks (``moe.pipeline``) 2 chunks hide as much as 4 and take the shorter
    step. The ragged transport is not pipelined.

    Args:
      expert_axis_size: devices on the layer's ``expert_axis``.
      tokens_per_device: tokens each device holds.
      transport: the layer's transport (``'auto'`` resolved).

    Returns:
      The chunk count.

    Example:
      >>> import moe
      >>> moe.auto_overlap_chunks(1, 8192, "dropless"), moe.auto_overlap_chunks(8, 64, "dropless")
      (1, 1)
      >>> moe.auto_overlap_chunks(8, 8192, "dropless"), moe.auto_overlap_chunks(8, 8192, "dense")
      (2, 2)
    """
    chunks = OVERLAP_CHUNKS.get(transport, 1)
    if expert_axis_size == 1 or tokens_per_device < chunks * MIN_CHUNK_TOKENS:
        return 1
    return chunks


def _global_router_stats(r: _routing.Routing, options: MoEOptions, all_axes, total_tokens: int,
                         mask: jax.Array | None):
    """Load-balancing and z losses over *all* (unmasked) tokens, from per-device partial sums."""
    e, k = options.router.num_experts, options.router.top_k
    counts = jax.lax.psum(r.tokens_per_expert, all_axes)  # route() counts unmasked tokens only
    probs = _routing.balance_probs(r.scores, options.router.score_fn)
    lse2 = jax.nn.logsumexp(r.logits, axis=-1) ** 2
    if mask is None:
        n = jnp.float32(total_tokens)
    else:
        n = jnp.maximum(jax.lax.psum(jnp.sum(mask, dtype=jnp.float32), all_axes), 1.0)
        probs = jnp.where(mask[:, None], probs, 0.0)
        lse2 = jnp.where(mask, lse2, 0.0)
    p_mean = jax.lax.psum(probs.sum(0), all_axes) / n
    f = counts.astype(jnp.float32) / (n * k)
    lb = e * jnp.sum(jax.lax.stop_gradient(f) * p_mean)
    z = jax.lax.psum(jnp.sum(lse2), all_axes) / n
    return counts, lb, z


def _group_alignment(options: MoEOptions) -> int | None:
    """The alignment of the expert layout that the dropless dispatch writes: the Mosaic GPU
    kernels' 128-row groups when the experts run them (no gathers into and out of an
    aligned copy), None (plain ragged) otherwise."""
    if options.dispatch.transport != "dropless":
        return None
    backend = options.experts.backend
    if backend == "auto":
        backend = _experts.auto_implementation(2)
    return gmm_api.GROUP_ALIGNMENT if gmm_api.gemms(backend, 2).aligned else None


class LocalInputs(NamedTuple):
    """The optional per-call inputs that cross into the layer's ``shard_map`` (None: absent;
    the in_specs mirror it with None in the same places)."""

    mask: jax.Array | None = None  # bool [T]: False for masked (padding) tokens
    noise: jax.Array | None = None  # f32 [T, d]: the router's jitter multipliers
    router_bias: jax.Array | None = None  # [E]
    shared: tuple[jax.Array, jax.Array] | None = None  # shared experts (gate_up, down)
    shared_gate: jax.Array | None = None  # [d, 1]
    expert_bias: tuple[jax.Array, jax.Array] | None = None  # (b_gate_up, b_down) banks


def _local_moe(x, router_kernel, bias, w_gate_up, w_down, extra: LocalInputs, *,
               options: MoEOptions, all_axes,
               total_tokens: int, num_slots: int, chunks: int):
    """Per-device body: route, then per chunk dispatch, local experts, combine (masked slots go
    to no expert); the shared experts on every token."""
    # Router and expert banks are replicated over some axes; mark them varying there so that
    # autodiff sums their gradients over those axes (the transpose of pcast is a psum).
    do = options.dispatch
    others = tuple(a for a in all_axes if a != do.expert_axis)
    expert_bias = extra.expert_bias
    if others:
        w_gate_up = jax.lax.pcast(w_gate_up, others, to="varying")
        w_down = jax.lax.pcast(w_down, others, to="varying")
        if expert_bias is not None:
            expert_bias = tuple(jax.lax.pcast(b, others, to="varying") for b in expert_bias)
    router_kernel = jax.lax.pcast(router_kernel, tuple(all_axes), to="varying")
    router_bias = extra.router_bias
    if router_bias is not None:
        router_bias = jax.lax.pcast(router_bias, tuple(all_axes), to="varying")
    mask = extra.mask
    x_router = x if extra.noise is None else (x * extra.noise).astype(x.dtype)
    with jax.named_scope("moe_router"):
        r = _routing.route(x_router, router_kernel, bias, config=options.router,
                           router_bias=router_bias, token_mask=mask)
        counts, lb, z = _global_router_stats(r, options, all_axes, total_tokens, mask)
    ids = r.expert_ids if mask is None else jnp.where(mask[:, None], r.expert_ids, num_slots)
    cf = do.capacity_factor  # per real expert: the padded experts receive no slots
    if cf is not None and num_slots != options.router.num_experts:
        cf = cf * num_slots / options.router.num_experts
    do_chunk = dataclasses.replace(do, capacity_factor=cf)
    # FP8 tokens on a ragged layout go to FP8 expert GEMMs as their wire rows: no decoded
    # bf16 copy is quantized again.
    with_wire = (do.dispatch_dtype == "fp8" and options.experts.gemm_dtype == "fp8"
                 and do.transport in ("dropless", "ragged"))
    align = _group_alignment(options)
    shared = extra.shared
    if shared is not None:
        shared = tuple(jax.lax.pcast(a, tuple(all_axes), to="varying") for a in shared)
    gate = extra.shared_gate
    if gate is not None:
        gate = jax.lax.pcast(gate, tuple(all_axes), to="varying")
    # Pipelined expert parallelism: the chunks are independent until their outputs are
    # concatenated, so XLA's scheduler can run one chunk's async exchanges under another
    # chunk's GEMMs (forward and backward); the shared experts need no exchange and go right
    # after the first dispatch, whose exchange they can cover.
    tc = x.shape[0] // chunks
    banks = _pipeline.Banks(w_gate_up, w_down, expert_bias)
    body = functools.partial(_pipeline.chunk_experts, options=options,
                             dispatch_options=do_chunk, num_experts=num_slots,
                             group_alignment=align, with_wire=with_wire)
    p = jax.lax.axis_size(do.expert_axis)
    buckets = dispatch_buckets(tc, ids.shape[1], num_experts=num_slots, axis_size=p,
                               options=do_chunk)
    # Pipelined dropless: no chunk's exchange may sit in a conditional (moe.pipeline), so the
    # chunks send their first-bucket slots and one overflow pass the rest.
    split = chunks > 1 and len(buckets) > 1
    ys, over_ids, ys_shared, dropped = [], [], None, jnp.zeros((), jnp.int32)
    lost = []  # per chunk: bool [tc, k], slots routed to an expert that the capacity dropped
    overflowing = jnp.zeros((), jnp.int32)  # chunks of this device with slots past c_0
    chunk_ids, first, local_ids = [], None, None
    local_first = do.local_first and p > 1  # with one device nothing is sent anyway
    for c in range(chunks):
        ids_c = ids[c * tc:(c + 1) * tc]
        if c == 0 and local_first:  # its own experts' slots stay here (run_local below)
            local_ids, ids_c = _pipeline.split_local(ids_c, num_experts=num_slots,
                                                     axis_name=do.expert_axis)
        if split:
            s = split_first_bucket(ids_c, num_experts=num_slots, axis_size=p,
                                   first_bucket=buckets[0])
            ids_c, first = s.first_ids, buckets[:1]
            over_ids.append(s.overflow_ids)
            overflowing = overflowing + s.overflows.astype(jnp.int32)
        chunk_ids.append(ids_c)
    plans = [None] * chunks
    if chunks > 1:
        # Every chunk's plan in one batched pass (one sort, one count exchange): the plans
        # depend on the routing alone, and per chunk their small, latency-bound kernels
        # would be paid once more per chunk.
        batched = jax.vmap(functools.partial(
            plan_dispatch, num_experts=num_slots, options=do_chunk, x_dtype=x.dtype,
            fp8_block_size=options.fp8_block_size, group_alignment=align, buckets=first))(
            jnp.stack(chunk_ids))
        plans = [jax.tree.map(lambda a, c=c: a[c], batched) for c in range(chunks)]
    chained = banks
    for c in range(chunks):
        part = slice(c * tc, (c + 1) * tc)
        y_local = lost_local = None
        with jax.named_scope(f"moe_chunk{c}"):  # a profile (or a cost model) tells them apart
            if c == 0 and local_first:
                local = _pipeline.local_first_pass(
                    x[part], local_ids, r.weights[part], chained, options=options,
                    dispatch_options=do_chunk, num_experts=num_slots, group_alignment=align,
                    with_wire=with_wire)
                y_local, chained = local.y, local.banks
                dropped = dropped + local.plan.dropped
                lost_local = (local_ids < num_slots // p) & ~local.plan.kept
            # Each chunk but the last passes the banks on to the next, so that in the
            # backward (chunks in reverse) a chunk's weight-gradient GEMMs start from the
            # later chunks' sum instead of XLA adding one full bank per chunk.
            y_c, plan, chained = body(x[part], chunk_ids[c], r.weights[part], chained,
                                      buckets=first, plan=plans[c], chain=c < chunks - 1)
        if y_local is not None:
            y_c = (y_c.astype(jnp.float32) + y_local.astype(jnp.float32)).astype(x.dtype)
        if c == 0 and shared is not None:
            ys_shared = _shared_experts(x, shared, gate, options, x.dtype)
            if mask is not None:
                ys_shared = jnp.where(mask[:, None], ys_shared, jnp.zeros((), x.dtype))
        ys.append(y_c)
        dropped = dropped + plan.dropped
        lost_c = (chunk_ids[c] < num_slots) & ~plan.kept  # masked / moved-away slots: not lost
        lost.append(lost_c if lost_local is None else lost_c | lost_local)
    y = ys[0] if chunks == 1 else jnp.concatenate(ys, axis=0)
    if split:  # one branch for the expert axis: its collectives run on every device of it
        overflows = jax.lax.pmax(overflowing, do.expert_axis) > 0
        y = y + _pipeline.overflow_experts(
            x, jnp.concatenate(over_ids, axis=0), r.weights, banks, overflows,
            num_experts=num_slots, axis_name=do.expert_axis, max_tokens=tc,
            body=lambda *a: body(*a)[0])
    if ys_shared is not None:
        y = y + ys_shared
    dropped = jax.lax.psum(dropped, all_axes)
    dropped_tokens = jax.lax.psum(
        jnp.sum(jnp.any(jnp.concatenate(lost, axis=0), axis=1), dtype=jnp.int32), all_axes)
    routing = {}
    if options.router.return_routing:
        keep = True if mask is None else mask[:, None]
        routing = {"expert_ids": jnp.where(keep, r.expert_ids, -1),
                   "expert_weights": jnp.where(keep, r.weights, 0.0)}
    return y, (lb, z, counts, dropped, dropped_tokens), routing


def _padded_experts(num_experts: int, ep: int) -> int:
    """``num_experts`` rounded up to a multiple of the expert-axis size ``ep``."""
    return -(-num_experts // ep) * ep


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


def _check_call(x, router_kernel, w_gate_up, w_down, options: MoEOptions, mesh, optional
                ) -> None:
    """The argument checks of one :func:`moe_apply` call (the options were checked already)."""
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
    num_experts = options.router.num_experts
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
    options.check(d_model=d, d_ff=w_down.shape[1], mesh=mesh)
    eo = options.experts
    bias = optional["bias"]
    if bias is not None:
        _check_array("bias", bias)
        if bias.shape != (num_experts,):
            raise ValueError(f"bias must have shape [num_experts] = ({num_experts},), got "
                             f"{bias.shape} (the balancing bias; None: zeros).")
    _check_optional("router_bias", optional["router_bias"], (num_experts,),
                    options.router.router_bias, "router_bias")
    eb = optional["expert_bias"]
    if eb is None and eo.expert_bias:
        raise ValueError("expert_bias=True in the options needs the expert_bias= argument, "
                         "(b_gate_up [E, 2 * d_ff], b_down [E, d_model]); pass it (moe.MoE "
                         "does) or set expert_bias=False.")
    if eb is not None and (not isinstance(eb, (tuple, list)) or len(eb) != 2):
        raise ValueError("expert_bias must be a pair (b_gate_up [E, 2 * d_ff], b_down [E, "
                         "d_model]).")
    _check_optional("expert_bias[0] (b_gate_up)", None if eb is None else eb[0],
                    (num_experts, 2 * w_down.shape[1]), eo.expert_bias, "expert_bias")
    _check_optional("expert_bias[1] (b_down)", None if eb is None else eb[1],
                    (num_experts, d), eo.expert_bias, "expert_bias")
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
    _check_optional("shared_gate", optional["shared_gate"], (d, 1), eo.shared_expert_gate,
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


def _shared_experts(tokens: jax.Array, shared, gate, options: MoEOptions, dtype) -> jax.Array:
    """The always-on shared experts: one gated MLP over every token (optionally scaled by
    ``sigmoid(tokens @ gate)``)."""
    gu, dn = shared
    with jax.named_scope("moe_shared_experts"):
        zs = jnp.einsum("td,df->tf", tokens, gu.astype(dtype))
        h = options.experts.activation.apply(zs).astype(dtype)
        y = jnp.einsum("tf,fd->td", h, dn.astype(dtype))
        if gate is not None:
            g = jnp.einsum("td,do->to", tokens, gate.astype(dtype))
            y = (jax.nn.sigmoid(g.astype(jnp.float32)) * y).astype(dtype)
        return y


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


def _token_inputs(x, token_mask, jitter_key, ro, mesh, tok_spec: P, t_pad: int):
    """``(tokens [t_pad, d], mask, extra, extra_specs)``: x flattened, jittered, padded with
    masked tokens to ``t_pad`` and placed on ``tok_spec``; ``extra`` (a :class:`LocalInputs`,
    ``extra_specs`` its specs) holds the mask / noise."""
    b, s, d = x.shape
    t = b * s
    tokens = x.reshape(t, d)
    mask = None if token_mask is None else jnp.asarray(token_mask).reshape(t).astype(bool)
    noise = None
    if jitter_key is not None and ro.router_jitter_noise > 0:
        eps = ro.router_jitter_noise
        noise = jax.random.uniform(jitter_key, (t, d), jnp.float32, 1.0 - eps, 1.0 + eps)
        if ro.jitter_input == "all":
            tokens, noise = (tokens * noise).astype(x.dtype), None
    if t_pad != t:  # pad with masked tokens
        mask = _pad_rows(jnp.ones((t,), bool) if mask is None else mask, t_pad - t, False)
        tokens = _pad_rows(tokens, t_pad - t)
        noise = None if noise is None else _pad_rows(noise, t_pad - t, 1.0)
    tokens = meshes.reshard(tokens, mesh, tok_spec)
    extra, extra_specs = LocalInputs(), LocalInputs()
    if mask is not None:
        mask = meshes.reshard(mask, mesh, tok_spec)
        tokens = jnp.where(mask[:, None], tokens, jnp.zeros((), tokens.dtype))
        extra, extra_specs = extra._replace(mask=mask), extra_specs._replace(mask=tok_spec)
    if noise is not None:
        extra = extra._replace(noise=meshes.reshard(noise, mesh, tok_spec))
        extra_specs = extra_specs._replace(noise=tok_spec)
    return tokens, mask, extra, extra_specs


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
        mesh = jax.make_mesh((1,), (options.dispatch.expert_axis,), devices=jax.devices()[:1])
    _check_call(x, router_kernel, w_gate_up, w_down, options, mesh, dict(
        bias=bias, router_bias=router_bias, expert_bias=expert_bias, shared=shared,
        shared_gate=shared_gate, token_mask=token_mask, jitter_key=jitter_key))
    ep = mesh.shape[options.dispatch.expert_axis]
    if options.dispatch.transport == "auto":
        options = options.replace(transport=auto_transport(ep))
    b, s, d = x.shape
    t = b * s
    ro, axis = options.router, options.dispatch.expert_axis
    axes = options.token_axes(mesh)
    n_dev = math.prod(mesh.shape[a] for a in axes)
    chunks = options.dispatch.overlap_chunks
    if chunks == "auto":
        chunks = auto_overlap_chunks(ep, -(-t // n_dev), options.dispatch.transport)
    t_pad = -(-t // (n_dev * chunks)) * (n_dev * chunks)  # whole chunks on every device
    e, e_pad = ro.num_experts, _padded_experts(ro.num_experts, mesh.shape[axis])
    tok_spec = P(axes)
    out_spec = jax.typeof(x.reshape(t, d)).sharding.spec if meshes.is_explicit(mesh) else None
    tokens, mask, extra, extra_specs = _token_inputs(x, token_mask, jitter_key, ro, mesh,
                                                     tok_spec, t_pad)
    if router_bias is not None:
        extra = extra._replace(router_bias=router_bias)
        extra_specs = extra_specs._replace(router_bias=P())
    if shared is not None:  # computed per device, inside the map, where it can hide a dispatch
        extra, extra_specs = extra._replace(shared=tuple(shared)), extra_specs._replace(
            shared=(P(), P()))
        if shared_gate is not None:
            extra = extra._replace(shared_gate=shared_gate)
            extra_specs = extra_specs._replace(shared_gate=P())

    def bank(a):  # pad to e_pad experts (zeros, never routed to), then split over the axis
        if e_pad != e:
            a = _pad_rows(a, e_pad - e)
        return meshes.reshard(a, mesh, P(axis, *(None,) * (a.ndim - 1)))

    w_gate_up, w_down = bank(w_gate_up), bank(w_down)
    if expert_bias is not None:
        extra = extra._replace(expert_bias=tuple(bank(jnp.asarray(a)) for a in expert_bias))
        extra_specs = extra_specs._replace(expert_bias=(P(axis, None), P(axis, None)))
    if bias is None:
        bias = jnp.zeros((e,), jnp.float32)
    all_axes = tuple(mesh.axis_names)
    w_spec = P(axis, None, None)
    routing_specs = ({"expert_ids": tok_spec, "expert_weights": tok_spec}
                     if ro.return_routing else {})
    body = jax.shard_map(
        lambda xt, wr, bb, wgu, wd, ex: _local_moe(
            xt, wr, bb, wgu, wd, ex, options=options, all_axes=all_axes, total_tokens=t,
            num_slots=e_pad, chunks=chunks),
        mesh=mesh,
        in_specs=(tok_spec, P(), P(), w_spec, w_spec, extra_specs),
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

