"""The options of the MoE layer: one frozen object with a router, a dispatch and an experts part.

:class:`MoEOptions` holds every static choice of :func:`moe.moe_apply` / :class:`moe.MoE`:

* ``router``: a :class:`moe.routing.RouterConfig` (expert count, ``top_k``, scores, groups);
* ``dispatch``: a :class:`DispatchOptions` (mesh axes, transport, capacity, wire formats);
* ``experts``: an :class:`ExpertOptions` (grouped-GEMM backend, precision, what is saved);
* ``fp8_block_size``: channels per FP8 scale, shared by the wire and the experts.

All parts are frozen and hashable (they are ``jit``-static). :meth:`MoEOptions.create` and
:meth:`MoEOptions.replace` take flat keyword names and route each to its part, so a variant is
one call: ``opts.replace(transport='ragged', gemm_dtype='fp8')``. :meth:`MoEOptions.check` is
the single validation pass of the options against a layer's widths and mesh.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal

import jax

from accel_kernels import fp8, registry
from accel_kernels.activations import GatedActivation
from moe.routing import RouterConfig

__all__ = ["DispatchOptions", "ExpertOptions", "MoEOptions"]

# The one definition of every enum-like option; the allowed values are read off these types
# (:func:`choices`), so a new value is added here and nowhere else.
Transport = Literal["auto", "dense", "dropless", "ragged"]
RaggedImpl = Literal["auto", "native", "emulated"]
WireDtype = Literal["bf16", "fp8"] | None
GemmDtype = Literal["bf16", "fp8"]
SaveZ = Literal["bf16", "fp8", "recompute"]
WireKernels = registry.Implementation
Backend = registry.Implementation


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchOptions:
    """How tokens travel to their experts and back (:func:`moe.dispatch`, :func:`moe.combine`).

    Attributes:
      expert_axis: mesh axis the experts are split over.
      batch_axes: mesh axes the tokens are split over besides ``expert_axis``; ``None``: every
        other axis of the mesh.
      transport: ``'dense'`` (capacity-padded ``all_to_all``, drops overflow), ``'dropless'``
        (bucketed ``all_to_all``, never drops), ``'ragged'`` (``ragged_all_to_all``) or
        ``'auto'`` (:func:`moe.auto_transport`: dropless on one Hopper GPU, dense otherwise).
      capacity_factor: dense: the capacity factor (``None``: dropless, ``C = T``);
        dropless: the first exchange bucket's factor over the balanced share.
      dispatch_dtype: wire format of the tokens: ``None`` (activation dtype), ``'bf16'`` or
        ``'fp8'`` (e4m3 + packed E8M0 block scales).
      combine_grad_dtype: wire format of the combine gradient (same choices).
      wire_kernels: who encodes and lays out the dispatched rows: ``'auto'`` (Pallas kernels on
        NVIDIA GPUs, XLA elsewhere), ``'xla'``, ``'triton'`` or ``'mosaic'``
        (`accel_kernels.wire.api`; the old ``'pallas'`` warns).
      capacity_multiple: the dense capacity and the dropless buckets are rounded up to a
        multiple of it (8 keeps GPU tiles aligned).
      ragged_impl: ``'ragged'`` only: ``'auto'`` (``ragged_all_to_all`` where XLA has it,
        GPU and TPU; emulated elsewhere), ``'native'`` or ``'emulated'``.
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
        computes the emptied self block, and in the 8-GPU schedules the other chunks'
        routing already covered the first dispatch, so it made the modeled step longer
        (docs/benchmark_log.md, Overlap). For steps whose first dispatch stays exposed
        (one chunk, exchanges between hosts). No effect with one device on the expert axis.
        A capacity limit keeps its meaning: the same ``C`` rows per (source, expert).

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
    wire_kernels: WireKernels = "auto"
    overlap_chunks: int | Literal["auto"] = "auto"
    capacity_multiple: int = 8
    ragged_impl: RaggedImpl = "auto"
    local_first: bool = False

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
        check_choice("transport", self.transport, Transport)
        check_choice("dispatch_dtype", self.dispatch_dtype, WireDtype)
        check_choice("combine_grad_dtype", self.combine_grad_dtype, WireDtype)
        object.__setattr__(self, "wire_kernels",
                           registry.canonical(self.wire_kernels, "wire_kernels"))
        check_choice("ragged_impl", self.ragged_impl, RaggedImpl)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertOptions:
    """How the local experts compute (:func:`moe.gated_experts`), and the shared experts.

    Attributes:
      backend: the grouped GEMMs' implementation (`accel_kernels.gmm.api`): ``'auto'`` (by
        layout and platform), ``'xla'``, ``'triton'`` or ``'mosaic'`` (the old ``'einsum'``
        and ``'ragged_dot'`` mean ``'xla'``, with a DeprecationWarning).
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
      >>> opts = ExpertOptions(gemm_dtype="fp8", save_z="recompute", activation="gelu")
      >>> opts.backend, opts.activation.kind
      ('auto', 'gelu')
    """

    backend: Backend = "auto"
    gemm_dtype: GemmDtype = "bf16"
    dgrad_dtype: GemmDtype = "bf16"
    save_z: SaveZ = "bf16"
    wgrad_dtype: GemmDtype = "bf16"
    num_shared_experts: int = 0
    activation: GatedActivation | str = "silu"
    expert_bias: bool = False
    shared_expert_gate: bool = False

    def __post_init__(self):
        object.__setattr__(self, "backend", registry.canonical(self.backend, "backend"))
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
      >>> opts = MoEOptions.create(8, 2, dispatch_dtype="fp8", save_z="recompute")
      >>> opts.dispatch.dispatch_dtype, opts.experts.save_z, opts.router.top_k
      ('fp8', 'recompute', 2)
      >>> opts.replace(transport="ragged").dispatch.transport
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
        ``ExpertOptions``) or ``fp8_block_size``; defaults elsewhere.
        """
        return cls(router=RouterConfig(num_experts, top_k)).replace(**options)

    def replace(self, **changes: Any) -> MoEOptions:
        """A copy with the named fields changed, each routed to the part that owns it."""
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
        """The one validation pass of these options against a layer's widths and mesh.

        Raises:
          ValueError: a width the FP8 options quantize is not block-aligned, or the mesh lacks
            ``expert_axis`` or a batch axis. (``num_experts`` need not divide the expert axis:
            the layer pads the banks with experts the router never selects.)
          TypeError: ``mesh`` is not a mesh.
        """
        for name, value in (("d_model", d_model), ("d_ff", d_ff)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        for name, width, option in self.fp8_widths(d_model, d_ff):
            fp8.check_width(width, self.fp8_block_size, what=f"{name} (for {option}='fp8')")
        if self.experts.backend in ("triton", "mosaic"):
            registry.check_available(self.experts.backend, "backend")
        if mesh is not None:
            if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
                raise TypeError(f"mesh must be a jax.sharding.Mesh (or None: the ambient "
                                f"jax.set_mesh mesh), got {type(mesh).__name__} {mesh!r}; build "
                                "one with jax.make_mesh.")
            self.token_axes(mesh)

    def token_axes(self, mesh: Any) -> tuple[str, ...]:
        """The mesh axes the tokens are split over: the batch axes, then ``expert_axis``."""
        names = tuple(mesh.axis_names)
        axis = self.dispatch.expert_axis
        if axis not in names:
            raise ValueError(
                f"expert_axis={axis!r} is not an axis of the mesh {names}; pass expert_axis= "
                f"one of them (or build the mesh with an {axis!r} axis)."
            )
        batch = self.dispatch.batch_axes
        if batch is None:
            batch = tuple(a for a in names if a != axis)
        for a in batch:
            if a not in names:
                raise ValueError(
                    f"batch_axes names {a!r}, which is not an axis of the mesh {names}."
                )
        return (*batch, axis)
