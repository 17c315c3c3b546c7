"""The options of the MoE layer: what a user chooses, and what one call resolves that to.

:class:`MoEOptions` holds every static choice of :func:`moe.moe_apply` / :class:`moe.MoE`:

* ``router``: a :class:`moe.routing.RouterConfig` (expert count, ``top_k``, scores, groups);
* ``dispatch``: a :class:`DispatchOptions` (mesh axes, transport, capacity, wire formats);
* ``experts``: an :class:`ExpertOptions` (grouped-GEMM implementation, precision, what is
  saved);
* ``fp8_block_size``: channels per FP8 scale, shared by the wire and the experts.

All parts are frozen and hashable (they are ``jit``-static). :meth:`MoEOptions.create` and
:meth:`MoEOptions.replace` take flat keyword names and route each to its part, so a variant is
one call: ``options.replace(transport='ragged', gemm_dtype='fp8')``.

:meth:`MoEOptions.resolve` is the one validation pass of the options against a call (its
mesh, token count and widths) and decides every ``'auto'`` of it at once: the
:class:`ResolvedOptions` it returns is what the layer's per-device body, the dispatch and the
experts read, unchanged, down to the kernels.

The kernel choices are named like the kernel layer's argument (`accel_kernels.registry`):
``gemm_implementation`` (the grouped GEMMs), ``wire_implementation`` (the wire kernels) and
``exchange_implementation`` (``ragged_all_to_all``, native or emulated). Their former names,
``backend``, ``wire_kernels`` and ``ragged_impl``, are still taken where flat keywords are
(:meth:`MoEOptions.create` / :meth:`~MoEOptions.replace`, :func:`moe.gated_experts`,
:func:`moe.fp8_dense`, :func:`moe.dispatch`), through one shim, :func:`renamed_keywords`,
which maps them with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import jax
import numpy as np

from accel_kernels import fp8, platform, registry
from accel_kernels.activations import GatedActivation
from accel_kernels.gmm import api as gmm_api
from moe.routing import RouterConfig

__all__ = ["DispatchOptions", "ExpertOptions", "MoEOptions", "ResolvedOptions",
           "auto_overlap_chunks", "auto_transport", "hosts_per_token", "renamed_keywords",
           "resolve_host_axis", "two_stage_pays"]

# The one definition of every enum-like option; the allowed values are read off these types
# (:func:`choices`), so a new value is added here and nowhere else.
Transport = Literal["auto", "dense", "dropless", "ragged"]
ExchangeImplementation = Literal["auto", "native", "emulated"]
WireDtype = Literal["bf16", "fp8"] | None
GemmDtype = Literal["bf16", "fp8"]
SaveZ = Literal["bf16", "fp8", "recompute"]
WireImplementation = registry.Implementation
GemmImplementation = registry.Implementation

RENAMED: Mapping[str, str] = {"backend": "gemm_implementation",
                              "wire_kernels": "wire_implementation",
                              "ragged_impl": "exchange_implementation"}
"""The former keyword names of the kernel choices, and the name each now has."""


def renamed_keywords(where: str, keywords: Mapping[str, Any], **current: Any) -> dict[str, Any]:
    """The one deprecation shim of the renamed kernel choices (:data:`RENAMED`).

    ``keywords`` with each former name replaced by its new one, with a ``DeprecationWarning``
    naming ``where``. Given ``current`` (a function's own keyword-only arguments under their
    new names), every key of ``keywords`` must be a former name, and the result is ``current``
    updated from them.

    Args:
      where: the function the keywords were passed to, for the messages.
      keywords: keyword arguments as passed.
      **current: the new names' values as passed (each renamed option defaults to ``'auto'``).

    Returns:
      The keywords under their new names.

    Raises:
      TypeError: a former name and its new one are both given, or (with ``current``) a
        keyword that ``where`` does not take.

    Example:
      >>> import warnings
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore")
      ...     renamed_keywords("f", {"backend": "xla", "top_k": 2})
      {'gemm_implementation': 'xla', 'top_k': 2}
    """
    out = dict(current)
    for name, value in keywords.items():
        new = RENAMED.get(name)
        if new is None:
            if current:
                raise TypeError(f"{where}() got an unexpected keyword argument {name!r}.")
            out[name] = value
            continue
        if new in keywords or out.get(new, "auto") != "auto":
            raise TypeError(f"{where}() got both {name}= and {new}=; pass {new}= only.")
        warnings.warn(f"{where}({name}=...) is deprecated; pass {new}=... (the same values).",
                      DeprecationWarning, stacklevel=3)
        out[new] = value
    return out


def choices(tp: Any) -> tuple:
    """The values an option type allows: a ``Literal``, or a union of them and ``None``.

    Example:
      >>> choices(WireDtype)
      ('bf16', 'fp8', None)
    """
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    out: tuple = ()
    for arg in typing.get_args(tp):
        out += (None,) if arg is type(None) else choices(arg)
    return out


def check_choice(name: str, value: Any, allowed: Any) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``allowed`` (a tuple, or an
    option type whose :func:`choices` are allowed).

    Example:
      >>> check_choice("save_z", "fp16", SaveZ)
      Traceback (most recent call last):
      ...
      ValueError: save_z='fp16' is not supported; use one of ('bf16', 'fp8', 'recompute').
    """
    if not isinstance(allowed, tuple):
        allowed = choices(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; use one of {allowed}.")


def check_group_alignment(value: Any) -> None:
    """ValueError unless ``value`` (a ``group_alignment``) is None or a positive int.

    Example:
      >>> check_group_alignment(0)
      Traceback (most recent call last):
      ...
      ValueError: group_alignment must be None or a positive int, got 0.
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ValueError(f"group_alignment must be None or a positive int, got {value!r}.")


def check_wire_width(width: int, block_size: int, *, what: str) -> None:
    """ValueError naming ``what`` unless the FP8 wire can carry rows of ``width`` channels: a
    multiple of the block size (`accel_kernels.fp8.check_width`) and of 4 (e4m3 bytes travel
    four to a 32-bit word).

    Example:
      >>> check_wire_width(6, 2, what="d_model")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: d_model = 6 must be a multiple of 4 for the FP8 wire ...
    """
    fp8.check_width(width, block_size, what=what)
    if width % 4:
        raise ValueError(
            f"{what} = {width} must be a multiple of 4 for the FP8 wire (e4m3 bytes travel four "
            "to a 32-bit word); pad it, or use the bf16 wire."
        )


def resolve_exchange_implementation(
        implementation: ExchangeImplementation) -> Literal["native", "emulated"]:
    """The ``ragged_all_to_all`` that runs: ``'auto'`` is XLA's own where XLA implements it
    (GPU and TPU, by the target platform, `accel_kernels.platform.target_platform`), an
    emulation elsewhere (XLA:CPU lacks the op).

    Example:
      >>> resolve_exchange_implementation("emulated"), resolve_exchange_implementation("auto")
      ('emulated', 'emulated')
    """
    check_choice("exchange_implementation", implementation, ExchangeImplementation)
    if implementation != "auto":
        return implementation
    native = platform.target_platform() in ("gpu", "cuda", "rocm", "tpu")
    return "native" if native else "emulated"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchOptions:
    """How tokens travel to their experts and back (:func:`moe.dispatch`, :func:`moe.combine`).

    Attributes:
      expert_axis: mesh axis the experts are split over, or a tuple of axes (device ``i`` of
        the expert axis is the row-major index over them, e.g. ``('host', 'local')``).
      batch_axes: mesh axes the tokens are split over besides ``expert_axis``; ``None``: every
        other axis of the mesh.
      transport: ``'dense'`` (capacity-padded ``all_to_all``, drops overflow), ``'dropless'``
        (bucketed ``all_to_all``, never drops), ``'ragged'`` (``ragged_all_to_all``) or
        ``'auto'`` (:func:`moe.auto_transport`: dropless on one Hopper GPU, dense otherwise).
      capacity_factor: dense: the capacity factor (``None``: dropless, ``C = T``);
        dropless: the first exchange bucket's factor over the balanced share (``None``:
        :data:`moe.dispatch.plan.DROPLESS_CAPACITY_FACTOR`).
      dispatch_dtype: wire format of the tokens: ``None`` (activation dtype), ``'bf16'`` or
        ``'fp8'`` (e4m3 + packed E8M0 block scales).
      combine_grad_dtype: wire format of the combine gradient (same choices).
      wire_implementation: who encodes and lays out the dispatched rows: ``'auto'`` (Pallas
        kernels on NVIDIA GPUs, XLA elsewhere), ``'xla'``, ``'triton'`` or ``'mosaic'``
        (`accel_kernels.wire.api`; the old ``'pallas'`` warns). Formerly ``wire_kernels``.
      capacity_multiple: the dense capacity and the dropless buckets are rounded up to a
        multiple of it (8 keeps GPU tiles aligned).
      exchange_implementation: ``'ragged'`` only: ``'auto'`` (``ragged_all_to_all`` where XLA
        has it, GPU and TPU; emulated elsewhere), ``'native'`` or ``'emulated'``. Formerly
        ``ragged_impl``.
      overlap_chunks: pipelined expert parallelism: each device's tokens are split into this
        many chunks that are dispatched, computed and combined one after another, so that
        one chunk's exchanges can run while another chunk's expert GEMMs compute (XLA's
        async collectives place them so; forward and backward). ``'auto'``:
        :func:`moe.auto_overlap_chunks` (1 with one device on the expert axis, where nothing
        is sent, and for small batches). Token counts that do not split into the chunks are
        padded with masked tokens. With nothing dropped the results equal the unchunked
        layer's; a capacity limit applies per chunk (``C`` from the chunk's tokens), so a
        chunk that overloads an expert drops slots that a whole-batch capacity might have
        kept. Dropless with several chunks: the chunks send each pair's first bucket, and the
        slots past it go in one overflow pass after them, on the steps that have any
        (``moe.pipeline``).
      local_first: the first chunk's slots that this device's own experts take skip the
        exchange: they go through the local experts while the chunk's exchange is in
        flight, the only expert GEMMs that can run under a step's first dispatch (the
        chunk's output is the sum of the two passes, each rounded to the tokens' dtype).
        Off by default: the local pass is sized for every slot being local (its passes
        over the chunk's tokens cost about what its GEMMs do), the dense layout still
        computes the emptied self block, and where the other chunks' routing already covers
        the first dispatch it makes the step longer. For steps whose first dispatch stays
        exposed (one chunk, exchanges between hosts). No effect with one device on the expert
        axis. A capacity limit keeps its meaning: the same ``C`` rows per (source, expert).
      host_axis: the exchange past one host (``moe.dispatch.movement``, two stages). The
        mesh axis that crosses hosts, the first name of a tuple ``expert_axis`` (e.g.
        ``'host'`` of ``('host', 'local')``): each token goes once to each host holding one of
        its experts (to the device with its own local index there), carrying which of its
        slots live there, and that device forwards it to the host's devices; combine sums a
        host's expert outputs before they cross back. ``None``: one exchange over the whole
        expert axis. ``'auto'`` (the layer's; the flat ``moe.dispatch`` functions read it as
        None): the first axis of a tuple ``expert_axis`` when the mesh's devices along it sit
        in different processes (``Device.process_index``, and ``slice_index`` where the
        platform has it) while those along the other expert axes share one, and only when
        its first stage sends fewer bytes across hosts per token than one stage would
        (:func:`two_stage_pays`: a token's slots must reach clearly fewer hosts than
        ``top_k``, :func:`hosts_per_token`, as with node-limited routing): else the second
        stage only adds a hop, so None. One host (or a single-process mesh) keeps the
        one-stage exchange.

    Example:
      >>> from moe import DispatchOptions
      >>> DispatchOptions(transport="dense", capacity_factor=1.25).dispatch_dtype is None
      True
      >>> DispatchOptions(transport="ragged", capacity_factor=1.25)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: capacity_factor applies to transport='dense' ...
    """

    expert_axis: str = "expert"
    batch_axes: tuple[str, ...] | None = None
    transport: Transport = "auto"
    capacity_factor: float | None = None
    dispatch_dtype: WireDtype = None
    combine_grad_dtype: WireDtype = None
    wire_implementation: WireImplementation = "auto"
    overlap_chunks: int | Literal["auto"] = "auto"
    capacity_multiple: int = 8
    exchange_implementation: ExchangeImplementation = "auto"
    local_first: bool = False
    host_axis: str | None | Literal["auto"] = "auto"

    def __post_init__(self):
        ba = self.batch_axes
        if isinstance(ba, str):  # one axis name
            ba = (ba,)
        elif ba is not None and isinstance(ba, (list, tuple)):
            ba = tuple(ba)
        if ba is not None and not (isinstance(ba, tuple) and all(isinstance(a, str) for a in ba)):
            raise TypeError(f"batch_axes must be None or a tuple of mesh axis names, got "
                            f"{self.batch_axes!r}; e.g. batch_axes=('data',).")
        object.__setattr__(self, "batch_axes", ba)
        ea = self.expert_axis
        if not (isinstance(ea, str) or isinstance(ea, tuple)
                and all(isinstance(a, str) for a in ea)):
            raise TypeError(f"expert_axis must be a mesh axis name (or a tuple of names), got "
                            f"{ea!r}; e.g. expert_axis='expert'.")
        if isinstance(ea, tuple) and len(ea) == 1:
            object.__setattr__(self, "expert_axis", ea[0])
        ha = self.host_axis
        if ha not in (None, "auto") and (not isinstance(ha, str) or ha != self.expert_axes[0]):
            raise ValueError(
                f"host_axis={ha!r} must be None, 'auto' or the first name of expert_axis="
                f"{ea!r}: order the expert axes host first, e.g. expert_axis=('host', 'local') "
                "with host_axis='host'.")
        check_choice("transport", self.transport, Transport)
        check_choice("dispatch_dtype", self.dispatch_dtype, WireDtype)
        check_choice("combine_grad_dtype", self.combine_grad_dtype, WireDtype)
        object.__setattr__(self, "wire_implementation",
                           registry.canonical(self.wire_implementation, "wire_implementation"))
        check_choice("exchange_implementation", self.exchange_implementation,
                     ExchangeImplementation)
        m = self.capacity_multiple
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"capacity_multiple must be an int >= 1, got {m!r}.")
        n = self.overlap_chunks
        if n != "auto" and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"overlap_chunks must be 'auto' or an int >= 1, got {n!r}; 1 "
                             "turns the pipelining off.")
        if not isinstance(self.local_first, bool):
            raise TypeError(f"local_first must be True or False, got {self.local_first!r}.")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float))):
            raise TypeError(f"capacity_factor must be a float or None, got {cf!r}.")
        if cf is not None and not 0 < cf < math.inf:
            raise ValueError(f"capacity_factor must be a finite number > 0 or None, got {cf!r}; "
                             "None: no drop limit.")
        if cf is not None and self.transport == "ragged":
            raise ValueError(
                "capacity_factor applies to transport='dense' (a drop limit) and 'dropless' "
                "(the first exchange bucket); 'ragged' has none: pass capacity_factor=None, "
                "or transport='dense' or 'dropless'."
            )
        if self.host_axis not in (None, "auto") and self.transport == "ragged":
            raise ValueError(f"host_axis={self.host_axis!r} (the two-stage exchange) runs the "
                             "'dense' and 'dropless' transports, got transport='ragged'; pass "
                             "host_axis=None with 'ragged'.")

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """``expert_axis`` as a tuple of mesh axis names."""
        ea = self.expert_axis
        return (ea,) if isinstance(ea, str) else tuple(ea)

    @property
    def local_axes(self) -> tuple[str, ...]:
        """The expert axes within one host when ``host_axis`` names one: the others."""
        return self.expert_axes[1:]


def hosts_per_token(router: RouterConfig, num_slots: int, hosts: int) -> int:
    """The most hosts the ``top_k`` slots of one token can reach: the first stage's columns
    of the two-stage exchange (``DispatchOptions.host_axis``).

    Host ``h`` holds expert slots ``[h S / H, (h + 1) S / H)`` (``S = num_slots``, ``H =
    hosts``: the devices of the expert axis host-major, each its ``S / P`` slots). Without a
    group limit a token's slots reach ``min(top_k, H)`` hosts. Group-limited routing
    (``num_groups`` / ``topk_groups``, DeepSeek-V3's ``n_group`` / ``topk_group``) keeps a
    token within ``topk_groups`` groups, so within the hosts those groups span: with the
    groups aligned to the hosts (``num_groups`` a multiple of ``H``, no padded experts) at
    most ``topk_groups`` hosts, the node-limited routing of DeepSeek-V3.

    Args:
      router: the router's options.
      num_slots: expert slots (``num_experts`` padded to the expert axis).
      hosts: devices on the host axis.

    Returns:
      ``min(top_k, H, the most hosts topk_groups groups span)``.

    Example:
      >>> ds3 = RouterConfig(256, 8, num_groups=8, topk_groups=4)  # DeepSeek-V3's routing
      >>> hosts_per_token(ds3, 256, 8), hosts_per_token(ds3, 256, 2)
      (4, 2)
      >>> hosts_per_token(RouterConfig(64, 2), 64, 8)
      2
    """
    bound = min(router.top_k, hosts)
    g, tg = router.num_groups, router.topk_groups
    if hosts > 1 and g > 1 and tg is not None and tg < g:
        per, per_host = router.num_experts // g, num_slots // hosts
        spans = sorted(len({e // per_host for e in range(i * per, (i + 1) * per)})
                       for i in range(g))
        bound = min(bound, sum(spans[-tg:]))
    return bound


def _wire_row_bytes(dtype: WireDtype, d_model: int, token_bytes: int, block_size: int) -> int:
    """Bytes of one row of ``d_model`` channels on a wire of ``dtype`` (``None``: the tokens'
    dtype, ``token_bytes`` per channel): FP8 e4m3 bytes plus E8M0 scales packed four per
    32-bit word."""
    if dtype == "fp8":
        return d_model + 4 * fp8.num_scale_words(d_model, block_size)
    return d_model * (2 if dtype == "bf16" else token_bytes)


def two_stage_pays(top_k: int, host_slots: int, d_model: int, dispatch: DispatchOptions, *,
                   token_bytes: int = 2, block_size: int = 128) -> bool:
    """Whether the two-stage exchange sends fewer bytes across hosts per token than the
    one-stage one, over a training step (forward and backward).

    Per token, the one-stage exchange sends one row per slot, ``k = top_k`` of them, and each
    crosses four times: the dispatched row (``dispatch_dtype``'s wire), the expert's output
    back (the tokens' dtype), the combine's gradient (``combine_grad_dtype``'s wire) and the
    dispatch's gradient (the tokens' dtype). The first stage of the two-stage exchange sends
    one row per host the token reaches, at most ``k_1 = host_slots`` of them, and each
    crosses as the dispatched row (the same wire, with its ``k`` slot ids and routing weights,
    4 bytes each), the host's summed output (tokens' dtype), the output gradient (tokens'
    dtype: it is weighted per slot only after it crossed) and the host's summed input
    gradient (tokens' dtype), and the weights' gradient comes back (4 bytes a slot). Both
    send the same share of their rows to other hosts, ``(H - 1) / H``, and pad them by the
    same capacity factor, so the two-stage exchange pays when::

        k_1 (wire_dispatch + 3 t + 12 k) < k (wire_dispatch + wire_combine_grad + 2 t)

    with ``t = token_bytes * d_model`` and a wire row's bytes its dtype's. Having more slots
    than hosts (``k_1 < k``) is not enough: with FP8 wires and bf16 tokens a first-stage row
    weighs about 7/6 of a one-stage slot's, so ``k_1`` must stay below about 6/7 of ``k``.
    The condition is necessary, not sufficient: the second stage moves every slot again
    within the host, on the faster links there (beside the first stage only where XLA keeps
    two collectives in flight), and a dense first stage holds at most ``T`` rows per host,
    which trims its padding when the hosts are few (not counted here).

    Args:
      top_k: slots per token.
      host_slots: the most hosts one token's slots reach (:func:`hosts_per_token`).
      d_model: channels per token.
      dispatch: the wire formats (``dispatch_dtype``, ``combine_grad_dtype``).
      token_bytes: bytes per channel of the tokens (2: bf16).
      block_size: channels per FP8 scale.

    Returns:
      True where the first stage sends fewer bytes across hosts.

    Example:
      >>> fp8 = DispatchOptions(dispatch_dtype="fp8", combine_grad_dtype="fp8")
      >>> two_stage_pays(8, 4, 7168, fp8)  # DeepSeek-V3: top-8 within 4 hosts
      True
      >>> two_stage_pays(8, 7, 7168, fp8), two_stage_pays(2, 2, 2048, fp8)
      (False, False)
    """
    t = token_bytes * d_model
    wire = _wire_row_bytes(dispatch.dispatch_dtype, d_model, token_bytes, block_size)
    grad = _wire_row_bytes(dispatch.combine_grad_dtype, d_model, token_bytes, block_size)
    return host_slots * (wire + 3 * t + 12 * top_k) < top_k * (wire + grad + 2 * t)


def device_hosts(mesh: Any) -> Any:
    """An int array of ``mesh``'s shape: the host of each device (its slice and process
    index), or None for a mesh without devices (``jax.sharding.AbstractMesh``)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):  # it has no devices
        return None
    devices = mesh.devices
    keys = {}
    out = [keys.setdefault((getattr(d, "slice_index", None) or 0, d.process_index), len(keys))
           for d in devices.flat]
    return np.asarray(out).reshape(devices.shape)


def resolve_host_axis(dispatch: DispatchOptions, mesh: Any, transport: str,
                      router: RouterConfig | None = None, num_slots: int = 0, *,
                      d_model: int | None = None, token_bytes: int = 2,
                      block_size: int = 128) -> str | None:
    """The host axis the layer's exchange runs two stages over, or None (one stage).

    ``host_axis`` None, the ``'ragged'`` transport, or a host axis of one device: None. A
    named axis: that axis. ``'auto'``: the first of a tuple ``expert_axis`` when the mesh's
    devices along it are on different hosts (:func:`device_hosts`), those along every other
    expert axis on one, and (given the ``router`` and its ``num_slots``) the first stage
    sends fewer bytes across hosts per token than one stage would: :func:`two_stage_pays`
    with the hosts a token's slots reach (:func:`hosts_per_token`) for rows of ``d_model``
    channels of ``token_bytes`` each (without ``d_model``: fewer rows, a token's slots
    reaching fewer hosts than ``top_k``); else None.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((1, 1), ("host", "local"), devices=jax.devices()[:1])
      >>> options = DispatchOptions(expert_axis=("host", "local"))
      >>> resolve_host_axis(options, mesh, "dense") is None  # one process: one host
      True
    """
    axis = dispatch.host_axis
    if axis is None or transport == "ragged":
        return None
    if axis == "auto":
        axes = dispatch.expert_axes
        hosts = device_hosts(mesh) if len(axes) > 1 else None
        if hosts is None:
            return None
        names = tuple(mesh.axis_names)

        def varies(name):
            i = names.index(name)
            return bool(np.any(hosts != np.take(hosts, [0], axis=i)))

        if not varies(axes[0]) or any(varies(a) for a in axes[1:]):
            return None
        axis = axes[0]
        if router is not None:
            k_1 = hosts_per_token(router, num_slots, mesh.shape[axis])
            if not (k_1 < router.top_k if d_model is None else two_stage_pays(
                    router.top_k, k_1, d_model, dispatch, token_bytes=token_bytes,
                    block_size=block_size)):
                return None  # the first stage would send as much across hosts, or more
    return axis if mesh.shape[axis] > 1 else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertOptions:
    """How the local experts compute (:func:`moe.gated_experts`), and the shared experts.

    Attributes:
      gemm_implementation: the grouped GEMMs' implementation (`accel_kernels.gmm.api`):
        ``'auto'`` (by layout and platform), ``'xla'``, ``'triton'`` or ``'mosaic'`` (the old
        ``'einsum'`` and ``'ragged_dot'`` mean ``'xla'``, with a DeprecationWarning).
        Formerly ``backend``.
      gemm_dtype: precision of the two forward GEMMs, ``'bf16'`` or ``'fp8'`` (e4m3 operands
        on the tensor cores, per-row / per-channel power-of-two scales).
      dgrad_dtype: precision of the two data-gradient GEMMs.
      save_z: what the backward keeps of ``z = x W_gu``: ``'bf16'``, ``'fp8'`` or
        ``'recompute'``.
      wgrad_dtype: precision of the two weight-gradient GEMMs.
      num_shared_experts: always-on experts, fused into one gated MLP of width
        ``num_shared_experts * d_ff`` (DeepSeekMoE).
      activation: the gated activation of the routed and shared experts: a
        :class:`moe.activations.GatedActivation` or its kind, ``'silu'`` (SwiGLU),
        ``'gelu'``, ``'gelu_tanh'`` or ``'clamped_swiglu'`` (GPT-OSS, alpha 1.702, limit 7);
        stored as a ``GatedActivation``.
      expert_bias: the routed experts have biases, ``b_gate_up [E, 2 * d_ff]`` and
        ``b_down [E, d_model]`` (GPT-OSS).
      shared_expert_gate: scale the shared experts' output by ``sigmoid(x @ w_g)``, ``w_g``
        a ``[d_model, 1]`` param (Qwen2-MoE's ``shared_expert_gate``); needs
        ``num_shared_experts >= 1``.

    Example:
      >>> from moe import ExpertOptions
      >>> options = ExpertOptions(gemm_dtype="fp8", save_z="recompute", activation="gelu")
      >>> options.gemm_implementation, options.activation.kind
      ('auto', 'gelu')
    """

    gemm_implementation: GemmImplementation = "auto"
    gemm_dtype: GemmDtype = "bf16"
    dgrad_dtype: GemmDtype = "bf16"
    save_z: SaveZ = "bf16"
    wgrad_dtype: GemmDtype = "bf16"
    num_shared_experts: int = 0
    activation: GatedActivation | str = "silu"
    expert_bias: bool = False
    shared_expert_gate: bool = False

    def __post_init__(self):
        object.__setattr__(self, "gemm_implementation",
                           registry.canonical(self.gemm_implementation, "gemm_implementation"))
        check_choice("gemm_dtype", self.gemm_dtype, GemmDtype)
        check_choice("dgrad_dtype", self.dgrad_dtype, GemmDtype)
        check_choice("save_z", self.save_z, SaveZ)
        check_choice("wgrad_dtype", self.wgrad_dtype, GemmDtype)
        n = self.num_shared_experts
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0, got {n!r}.")
        object.__setattr__(self, "activation", GatedActivation.of(self.activation))
        for name in ("expert_bias", "shared_expert_gate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.shared_expert_gate and not n:
            raise ValueError(
                "shared_expert_gate=True gates the shared experts, but num_shared_experts=0; "
                "pass num_shared_experts >= 1 too."
            )


# The rank of the expert layout each transport's dispatch writes ([E, C, d] or ragged
# [R, d]), and the transports whose dispatch can write it aligned to the experts' kernels.
_EXPERT_LAYOUT = {"dense": 3, "dropless": 2, "ragged": 2}
_ALIGNED_LAYOUT = frozenset({"dropless"})

_PARTS = ("router", "dispatch", "experts")
_PART_TYPES = {"router": RouterConfig, "dispatch": DispatchOptions, "experts": ExpertOptions}


def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "_")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEOptions:
    """Every static option of the MoE layer, in three parts (hashable, ``jit``-static).

    Attributes:
      router: the :class:`moe.routing.RouterConfig` (``num_experts``, ``top_k``, scores).
      dispatch: the :class:`DispatchOptions`.
      experts: the :class:`ExpertOptions`.
      fp8_block_size: channels per FP8 scale (the wire and the experts' FP8 operands).

    Example:
      >>> options = MoEOptions.create(8, 2, dispatch_dtype="fp8", save_z="recompute")
      >>> options.dispatch.dispatch_dtype, options.experts.save_z, options.router.top_k
      ('fp8', 'recompute', 2)
      >>> options.replace(transport="ragged").dispatch.transport
      'ragged'
    """

    router: RouterConfig
    dispatch: DispatchOptions = DispatchOptions()
    experts: ExpertOptions = ExpertOptions()
    fp8_block_size: int = 128

    def __post_init__(self):
        for part in _PARTS:
            value = getattr(self, part)
            if not isinstance(value, _PART_TYPES[part]):
                name = _PART_TYPES[part].__name__
                raise TypeError(
                    f"MoEOptions.{part} must be {'an' if name[0] in 'AEIOU' else 'a'} {name}, "
                    f"got {type(value).__name__}; build it with MoEOptions.create(...)."
                )
        bs = self.fp8_block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"fp8_block_size must be a positive int, got {bs!r}; use 128.")

    @classmethod
    def create(cls, num_experts: int, top_k: int, **options: Any) -> MoEOptions:
        """Options for ``num_experts`` experts, top ``top_k``, from flat keyword names.

        Each keyword is a field of one part (``RouterConfig``, ``DispatchOptions``,
        ``ExpertOptions``) or ``fp8_block_size``; defaults elsewhere. The former names of the
        kernel choices (:data:`RENAMED`) are mapped with a ``DeprecationWarning``.
        """
        options = renamed_keywords("MoEOptions.create", options)
        return cls(router=RouterConfig(num_experts, top_k)).replace(**options)

    def replace(self, **changes: Any) -> MoEOptions:
        """A copy with the named fields changed, each routed to the part that owns it (the
        former names of :data:`RENAMED` mapped with a ``DeprecationWarning``)."""
        changes = renamed_keywords("MoEOptions.replace", changes)
        by_part: dict[str, dict[str, Any]] = {p: {} for p in _PARTS}
        top: dict[str, Any] = {}
        for name, value in changes.items():
            if name in _PARTS or name == "fp8_block_size":
                top[name] = value
                continue
            owner = next((p for p in _PARTS if name in _field_names(_PART_TYPES[p])), None)
            if owner is None:
                known = sorted(n for p in _PARTS for n in _field_names(_PART_TYPES[p]))
                raise TypeError(
                    f"MoEOptions has no option {name!r}; the options are {known} and "
                    "fp8_block_size."
                )
            by_part[owner][name] = value
        parts = {p: dataclasses.replace(top.get(p, getattr(self, p)), **kw)
                 for p, kw in by_part.items()}
        return dataclasses.replace(self, **parts, **{k: v for k, v in top.items()
                                                     if k not in _PARTS})

    def fp8_widths(self, d_model: int, d_ff: int) -> list[tuple[str, int, str]]:
        """``(name, width, option)`` of every feature axis the chosen options quantize to FP8."""
        uses = []
        for option in ("dispatch_dtype", "combine_grad_dtype"):
            if getattr(self.dispatch, option) == "fp8":
                uses.append(("d_model", d_model, option))
        if self.experts.save_z == "fp8":
            uses.append(("2 * d_ff", 2 * d_ff, "save_z"))  # z is [rows, 2 * d_ff]
        return uses

    def check(self, *, d_model: int, d_ff: int, mesh: Any = None) -> None:
        """The validation of these options against a layer's widths and mesh: what
        :meth:`resolve` checks for every call, and :class:`moe.MoE` when it is built.

        Raises:
          ValueError: a width the FP8 options quantize is not block-aligned, an explicit
            kernel cannot run on the target platform, or the mesh lacks ``expert_axis`` or a
            batch axis. (``num_experts`` need not divide the expert axis: the layer pads the
            banks with experts the router never selects.)
          TypeError: ``mesh`` is not a mesh.
        """
        if mesh is not None:
            self.token_axes(mesh)
        self._check_widths(d_model, d_ff)

    def _check_widths(self, d_model: int, d_ff: int) -> None:
        """The widths the FP8 options quantize are block-aligned; an explicit grouped-GEMM
        implementation can run where the program is compiled for."""
        for name, value in (("d_model", d_model), ("d_ff", d_ff)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        for name, width, option in self.fp8_widths(d_model, d_ff):
            check = fp8.check_width if option == "save_z" else check_wire_width
            check(width, self.fp8_block_size, what=f"{name} (for {option}='fp8')")
        if self.experts.gemm_implementation in ("triton", "mosaic"):
            registry.check_available(self.experts.gemm_implementation, "gemm_implementation")

    def token_axes(self, mesh: Any) -> tuple[str, ...]:
        """The mesh axes the tokens are split over: the batch axes, then the expert axes."""
        if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
            raise TypeError(f"mesh must be a jax.sharding.Mesh (or None: the ambient "
                            f"jax.set_mesh mesh), got {type(mesh).__name__} {mesh!r}; build "
                            "one with jax.make_mesh.")
        names = tuple(mesh.axis_names)
        axes = self.dispatch.expert_axes
        for axis in axes:
            if axis not in names:
                given = self.dispatch.expert_axis
                what = f"{given!r} is" if given == axis else f"{given!r} names {axis!r}, which is"
                raise ValueError(
                    f"expert_axis={what} not an axis of the mesh {names}; pass expert_axis= "
                    f"one of them (or build the mesh with an {axis!r} axis)."
                )
        batch = self.dispatch.batch_axes
        if batch is None:
            batch = tuple(a for a in names if a not in axes)
        for a in batch:
            if a not in names:
                raise ValueError(
                    f"batch_axes names {a!r}, which is not an axis of the mesh {names}."
                )
        return (*batch, *axes)

    def resolve(self, num_tokens: int, d_model: int, d_ff: int, *, mesh: Any,
                token_bytes: int = 2) -> ResolvedOptions:
        """These options validated against one call and every ``'auto'`` decided for it.

        The one validation pass of a :func:`moe.moe_apply` call (the checks of :meth:`check`),
        then the decisions: the transport (:func:`auto_transport`), the chunk count
        (:func:`auto_overlap_chunks`), the ``ragged_all_to_all``
        (:func:`resolve_exchange_implementation`), the batch axes, the expert slots
        (``num_experts`` rounded up to the expert axis), the capacity factor per slot, the
        grouped-GEMM implementation for the expert layout the transport gives
        (`accel_kernels.gmm.api.auto_implementation`) and the group alignment of that layout.

        Args:
          num_tokens: tokens of the call (``batch * seq``).
          d_model: the model width.
          d_ff: the hidden width of one expert.
          mesh: the call's mesh.
          token_bytes: bytes per channel of the call's tokens (what ``host_axis='auto'``
            weighs the exchanges' bytes by: :func:`resolve_host_axis`).

        Returns:
          The :class:`ResolvedOptions`.

        Example:
          >>> import jax
          >>> mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
          >>> r = MoEOptions.create(6, 2).resolve(4096, 256, 512, mesh=mesh)
          >>> r.dispatch.transport, r.dispatch.overlap_chunks, r.experts.gemm_implementation
          ('dense', 1, 'xla')
        """
        axes = self.token_axes(mesh)
        expert_axes = self.dispatch.expert_axes
        ep = math.prod(mesh.shape[a] for a in expert_axes)
        devices = math.prod(mesh.shape[a] for a in axes)
        transport = self.dispatch.transport
        if transport == "auto":
            transport = auto_transport(ep)
        e = self.router.num_experts
        slots = -(-e // ep) * ep
        host_axis = resolve_host_axis(self.dispatch, mesh, transport, self.router, slots,
                                      d_model=d_model, token_bytes=token_bytes,
                                      block_size=self.fp8_block_size)
        chunks = self.dispatch.overlap_chunks
        if chunks == "auto":
            chunks = auto_overlap_chunks(ep, -(-num_tokens // devices), transport)
        cf = self.dispatch.capacity_factor  # per real expert: the padded ones take no slots
        if cf is not None and slots != e:
            cf = cf * slots / e
        dispatch = dataclasses.replace(
            self.dispatch, transport=transport, overlap_chunks=chunks,
            batch_axes=axes[:-len(expert_axes)], capacity_factor=cf, host_axis=host_axis,
            exchange_implementation=resolve_exchange_implementation(
                self.dispatch.exchange_implementation))
        hosts = mesh.shape[host_axis] if host_axis else 1
        host_slots = hosts_per_token(self.router, slots, hosts)
        self._check_widths(d_model, d_ff)
        # The layout the experts read: the transport's (capacity-padded [E, C, d] or ragged
        # rows), but rows for kernels that take rows only ('triton': the slots run as rows).
        gemm, ragged = self.experts.gemm_implementation, _EXPERT_LAYOUT[transport] == 2
        experts = dataclasses.replace(self.experts, gemm_implementation=(
            gmm_api.auto_implementation(2 if ragged or gemm == "triton" else 3)
            if gemm == "auto" else gemm))
        # The dropless dispatch writes the layout the experts' kernel reads: no gathers into
        # and out of an aligned copy.
        aligned = (transport in _ALIGNED_LAYOUT
                   and gmm_api.gemms(experts.gemm_implementation, 2).aligned)
        return ResolvedOptions(
            router=self.router, dispatch=dispatch, experts=experts,
            fp8_block_size=self.fp8_block_size, expert_axis_size=ep, num_slots=slots,
            group_alignment=gmm_api.GROUP_ALIGNMENT if aligned else None,
            wire_to_experts=(self.dispatch.dispatch_dtype == self.experts.gemm_dtype == "fp8"
                             and ragged),
            hosts=hosts, host_slots=host_slots)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResolvedOptions:
    """:class:`MoEOptions` decided for one call (:meth:`MoEOptions.resolve`): what the layer's
    per-device body, the dispatch and the experts read, as it is, down to the kernels.

    No choice in it is ``'auto'`` but ``dispatch.wire_implementation``: the wire kernels are
    chosen per gather by the kernel layer's one rule (`accel_kernels.registry`), by the
    gather's row width and by the platform the program is lowered for, so a program lowered
    for a GPU from a CPU process still gets the GPU's kernels.

    Attributes:
      router: as given.
      dispatch: as given, with ``transport``, ``overlap_chunks`` and
        ``exchange_implementation`` decided, ``batch_axes`` the mesh axes the tokens are split
        over besides ``expert_axis``, and ``capacity_factor`` per expert slot.
      experts: as given, with ``gemm_implementation`` decided for the layout the transport
        gives.
      fp8_block_size: as given.
      expert_axis_size: devices on the expert axis.
      num_slots: ``num_experts`` rounded up to a multiple of ``expert_axis_size``: the banks
        are padded with experts that no token is routed to.
      group_alignment: the dropless layout's group alignment, the rows its grouped GEMMs
        take (None: plain ragged rows).
      wire_to_experts: the FP8 wire rows of a ragged layout go to the FP8 expert GEMMs as
        they came (no decoded copy is quantized again).
      hosts: devices on ``dispatch.host_axis`` (1: one-stage exchange).
      host_slots: the most hosts one token's slots reach (:func:`hosts_per_token`): the
        columns of the two-stage exchange's first stage.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
      >>> r = MoEOptions.create(6, 2, transport="dropless").resolve(64, 128, 64, mesh=mesh)
      >>> r.token_axes, r.num_slots, r.group_alignment, r.wire_to_experts
      (('expert',), 6, None, False)
    """

    router: RouterConfig
    dispatch: DispatchOptions
    experts: ExpertOptions
    fp8_block_size: int
    expert_axis_size: int
    num_slots: int
    group_alignment: int | None
    wire_to_experts: bool
    hosts: int = 1
    host_slots: int = 1

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The mesh axes the tokens are split over: the batch axes, then the expert axes."""
        return (*self.dispatch.batch_axes, *self.dispatch.expert_axes)

    @property
    def two_stage(self) -> bool:
        """Whether the exchange runs in two stages (across hosts, then within the host)."""
        return self.dispatch.host_axis is not None


def auto_transport(expert_axis_size: int) -> str:
    """The transport ``transport='auto'`` runs for an expert axis of ``expert_axis_size`` devices.

    ``'dropless'`` when the expert axis has one device and the ragged experts run the Mosaic
    GPU grouped GEMM (``accel_kernels.gmm.api.auto_implementation(2) == 'mosaic'``, Hopper
    GPUs): there nothing crosses a wire, and the dropless layer computes only the real rows
    and drops nothing, where the capacity-padded one computes its padding too. ``'dense'``
    otherwise: between devices the capacity-padded ``all_to_all`` is the faster exchange, and
    the ragged experts of the other kernels are slower than the padded batched GEMM.

    Args:
      expert_axis_size: devices on the layer's ``expert_axis``.

    Returns:
      ``'dropless'`` or ``'dense'``.

    Example:
      >>> import moe
      >>> from accel_kernels.gmm import api as gmm_api
      >>> moe.auto_transport(8)
      'dense'
      >>> moe.auto_transport(1) == ('dropless' if gmm_api.auto_implementation(2) == 'mosaic'
      ...                           else 'dense')
      True
    """
    if expert_axis_size == 1 and gmm_api.auto_implementation(2) == "mosaic":
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
    transport, read off compiled multi-GPU schedules replayed in time
    (``benchmarks/schedule8.py``). Dense: 2 chunks give the shortest step for the layer
    alone and for the trainer's step as XLA schedules it on its own estimates; more chunks
    hide more of the exchange but cost more passes over the tokens. Dropless: with no bucket
    switch between its chunks (``moe.pipeline``) 2 chunks hide as much as more would. The
    ragged transport is not pipelined.

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
