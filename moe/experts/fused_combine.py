"""The gated experts and the combine as one custom VJP, where nothing is sent.

With one device on the expert axis, the combine's backward builds the experts' output
gradient in their layout, ``dy[r] = w[s] * g[s // k]`` for the slot ``s`` of row ``r`` (``g``
the token gradients, ``w`` the routing weights), and the experts' backward reads it only as
the e4m3 rows of its FP8 data- and weight-gradient GEMMs. As two custom VJPs, ``dy`` is written
in the compute dtype, then read again to quantize it. Held in one custom VJP,
:func:`experts_combine` makes the e4m3 rows from the token gradients in one pass
(`moe.experts.fp8_gemm.rows_from_weighted`; the same bytes), and ``dy`` is never written. The
forward is the experts' (`moe.experts.vjp`), then the combine's (`moe.dispatch.movement`).
"""

from __future__ import annotations

import functools

import jax

from moe.dispatch import movement
from moe.dispatch.plan import DispatchPlan, RaggedLayoutPlan
from moe.experts import fp8_gemm
from moe.experts import vjp as experts_vjp
from moe.options import WireDtype

__all__ = ["applies", "experts_combine"]


def applies(call: experts_vjp.Call, plan: DispatchPlan, grad_wire: WireDtype) -> bool:
    """Whether :func:`experts_combine` can run this call: one device on the expert axis (the
    layout's rows are the send buffer's, ragged), FP8 data- and weight-gradient GEMMs, and
    combine's gradient on a float wire (an FP8 wire rounds it per block first)."""
    return (plan.axis_size == 1 and isinstance(plan, RaggedLayoutPlan)
            and call.experts.dgrad_dtype == call.experts.wgrad_dtype == "fp8"
            and grad_wire != "fp8")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def experts_combine(call: experts_vjp.Call, grad_wire: WireDtype, x, gs, w_gate_up, w_down,
                    x_q, weights, plan: DispatchPlan):
    """``combine(experts(x), weights, plan)`` (no biases): the tokens' outputs ``[T, d]``."""
    return _fwd(call, grad_wire, x, gs, w_gate_up, w_down, x_q, weights, plan)[0]


def _fwd(call, grad_wire, x, gs, w_gate_up, w_down, x_q, weights, plan):
    ey, res_e = experts_vjp.forward(call, x, gs, w_gate_up, w_down, None, x_q)
    y, res_c = movement.combine_rows_forward(ey, weights, plan, grad_wire)
    return y, (res_e, res_c)


def _bwd(call, grad_wire, res, g):
    res_e, res_c = res
    weights, plan = res_c.weights, res_c.plan
    d_weights = movement.combine_weights_grad(res_c, g)
    with jax.named_scope("combine_grad_rows_fp8"):
        dy_q = fp8_gemm.rows_from_weighted(
            g, weights.reshape(-1), plan.send_slot, top_k=plan.top_k,
            wire_dtype=movement.grad_wire_dtype(grad_wire, res_c))
    dx, _, dw_gate_up, dw_down, _, _ = experts_vjp.backward(call, res_e, None,
                                                             res_c.rows.dtype, dy_q)
    return dx, None, dw_gate_up, dw_down, None, d_weights, None


experts_combine.defvjp(_fwd, _bwd)
