"""moe: an expert-parallel Mixture-of-Experts layer for Flax NNX with an FP8 wire format.

Functional core: ``moe.fp8`` (e4m3 + packed E8M0 block scales, :mod:`accel_kernels.fp8`),
:mod:`moe.routing`
(top-k router, balancing), :mod:`moe.dispatch` (expert-parallel all-to-all dispatch/combine and
the typed plans), :mod:`moe.experts` (gated grouped GEMMs and their custom VJP),
:mod:`moe.fp8_dense` (FP8 dense projections), :mod:`moe.activations` (SiLU, GELU, GPT-OSS's
clamped SwiGLU); :mod:`accel_kernels` (one registry per operation: grouped GEMMs, FP8
quantization, the wire; XLA, Triton and Mosaic GPU implementations); options:
:mod:`moe.options`; shell: :class:`moe.MoE` (NNX) and :func:`moe.moe_linen` (Linen via
``flax.nnx.bridge``); :mod:`moe.convert` loads transformers' MoE blocks (Mixtral,
Qwen2/3-MoE, DeepSeek-V3, GPT-OSS). docs/architecture.md draws the layout.
"""

from accel_kernels import activations, fp8
from accel_kernels.activations import GatedActivation
from accel_kernels.fp8 import Fp8Array, dequantize, quantize
from moe import convert, options, routing
from moe.dispatch import DispatchPlan, combine, dispatch
from moe.experts import gated_experts
from moe.fp8_dense import fp8_dense
from moe.layer import moe_apply
from moe.linen import moe_linen
from moe.module import BalancingBias, MoE
from moe.options import (
    DispatchOptions,
    ExpertOptions,
    MoEOptions,
    ResolvedOptions,
    auto_overlap_chunks,
    auto_transport,
)
from moe.routing import RouterConfig, Routing, route, update_balancing_bias

__all__ = [
    "BalancingBias",
    "DispatchOptions",
    "DispatchPlan",
    "ExpertOptions",
    "Fp8Array",
    "GatedActivation",
    "MoE",
    "MoEOptions",
    "ResolvedOptions",
    "RouterConfig",
    "Routing",
    "activations",
    "auto_overlap_chunks",
    "auto_transport",
    "combine",
    "convert",
    "dequantize",
    "dispatch",
    "fp8",
    "fp8_dense",
    "gated_experts",
    "moe_apply",
    "moe_linen",
    "options",
    "quantize",
    "route",
    "routing",
    "update_balancing_bias",
]
