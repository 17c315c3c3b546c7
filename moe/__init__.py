"""moe: an expert-parallel Mixture-of-Experts layer for Flax NNX with an FP8 wire format.

Functional core: :mod:`moe.fp8` (e4m3 + packed E8M0 block scales), :mod:`moe.routing`
(top-k router, balancing), :mod:`moe.dispatch` (expert-parallel all-to-all dispatch/combine),
:mod:`moe.experts` (SwiGLU grouped GEMMs); shell: :class:`moe.MoE` (NNX) and
:func:`moe.moe_linen` (Linen via ``flax.nnx.bridge``).
"""

from moe import fp8, routing
from moe.dispatch import DispatchPlan, combine, dense_capacity, dispatch, ragged_rows
from moe.experts import gated_experts
from moe.fp8 import Fp8Array, dequantize, pack_e8m0, quantize, unpack_e8m0
from moe.layer import BalancingBias, MoE, MoEOptions, moe_apply, moe_linen
from moe.routing import RouterConfig, Routing, route, update_balancing_bias

__all__ = [
    "BalancingBias",
    "DispatchPlan",
    "Fp8Array",
    "MoE",
    "MoEOptions",
    "RouterConfig",
    "Routing",
    "combine",
    "dense_capacity",
    "dequantize",
    "dispatch",
    "fp8",
    "gated_experts",
    "moe_apply",
    "moe_linen",
    "pack_e8m0",
    "quantize",
    "ragged_rows",
    "route",
    "routing",
    "unpack_e8m0",
    "update_balancing_bias",
]
