"""Collective transports for expert-parallel token exchange (used inside ``jax.shard_map``).

The exchanges, pure functions on per-device arrays (the wire codec and the gathers that
build and read the rows they move are `accel_kernels.wire.api`'s):

* ``dense_exchange``: a tiled ``jax.lax.all_to_all`` of a destination-major buffer;
* ``ragged_exchange``: ``jax.lax.ragged_all_to_all`` on GPU/TPU and, where XLA does not
  implement it (CPU), an emulation with identical semantics built from ``all_gather`` and
  gathers (correct, not fast).

References: DeepEP (FP8 dispatch with UE8M0 scales); MaxText's ragged MoE
(``ragged_all_to_all`` + ``ragged_dot``).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from moe.options import resolve_exchange_implementation

AxisName = str | tuple[str, ...]

# The rule that decides the exchange's 'auto' lives with the options it resolves; this is the
# name the dispatch benchmarks import it by.
resolve_ragged_impl = resolve_exchange_implementation


class TokenRows(NamedTuple):
    """The FP8 dispatch's rows when nothing is sent (one device on the expert axis): layout
    row ``r`` carries token ``index[r]`` of ``tokens`` (a zero row where out of range). It
    stands in for the wire rows that would be written and read back by the same device; an
    FP8 GEMM quantizes its rows from it as from those wire rows (the same bytes,
    :func:`accel_kernels.wire.api.gather_local_rows_quantized`)."""

    tokens: jax.Array  # float [T, H]
    index: jax.Array  # int32 [R]


def dense_exchange(buf: jax.Array, axis_name: AxisName, *, axis: int = 0) -> jax.Array:
    """Tiled all-to-all on ``axis``: block ``p`` of it goes to device ``p``, and the blocks
    that arrive are concatenated along it in source order. No collective (``buf`` itself) when
    ``axis_name`` has one device.

    ``out[p] = buf_on_device_p[me]`` with ``buf`` viewed as ``[P, N/P, ...]`` along ``axis``.

    Args:
      buf: ``P * n`` rows along ``axis``, destination-major (``P`` = size of ``axis_name``).
      axis_name: the mesh axis (or axes) to exchange over.
      axis: the axis to split and concatenate.

    Returns:
      ``buf``'s shape, source-major along ``axis``.

    Example:
      >>> # inside jax.shard_map over 'expert': dense_exchange(buf, 'expert')

    References:
      GShard / Switch Transformer capacity-padded all-to-all dispatch.
    """
    if jax.lax.axis_size(axis_name) == 1:
        return buf
    return jax.lax.all_to_all(buf, axis_name, axis, axis, tiled=True)


def _ragged_all_to_all_emulated(
    operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
    output_offsets: jax.Array, *, axis_name: AxisName,
) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` from ``all_gather`` + gathers (see :func:`ragged_exchange`)."""
    p = jax.lax.axis_size(axis_name)
    n, m, k = operand.shape[0], output.shape[0], input_offsets.shape[0]
    spd = k // p  # slices per destination
    me = jax.lax.axis_index(axis_name)
    all_rows = jax.lax.all_gather(operand, axis_name, axis=0, tiled=True)  # [P*N, ...]
    meta = jnp.stack([input_offsets, send_sizes, output_offsets]).astype(jnp.int32)
    meta = jax.lax.all_gather(meta, axis_name, axis=0)  # [P, 3, K]
    mine = jax.lax.dynamic_slice_in_dim(meta, me * spd, spd, axis=2)  # [P, 3, spd]
    io, ss, oo = mine[:, 0, :, None], mine[:, 1, :, None], mine[:, 2, :, None]
    r = jnp.arange(n, dtype=jnp.int32)
    src = jnp.arange(p, dtype=jnp.int32)[:, None, None] * n + io + r  # [P, spd, N]
    dst = jnp.where(r < ss, oo + r, m)  # out-of-range -> dropped by the scatter
    row_src = jnp.full((m,), -1, jnp.int32).at[dst.reshape(-1)].set(src.reshape(-1), mode="drop")
    got = jnp.take(all_rows, jnp.maximum(row_src, 0), axis=0)
    keep = (row_src >= 0).reshape((m,) + (1,) * (output.ndim - 1))
    return jnp.where(keep, got, output)


def ragged_exchange(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: AxisName,
    implementation: Literal["native", "emulated"],
) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` (``implementation='native'``) or its emulation
    (``'emulated'``).

    Slice ``i`` of sender ``s`` (``operand[input_offsets[i] : +send_sizes[i]]``) lands on device
    ``i // (K / P)`` at ``output[output_offsets[i] : +send_sizes[i]]``; rows nobody writes keep
    ``output``'s value. The emulation (any backend) all-gathers every operand, so it is for
    tests and CPU only; it ignores ``recv_sizes`` (implied by the senders' ``send_sizes``).
    The native op types its result like ``output``, so under ``shard_map``'s varying-axes
    checks ``output`` must vary over the operand's mesh axes: build it with
    ``jnp.zeros_like(operand, shape=...)``, not ``jnp.zeros``.

    Args:
      operand: ``[N, ...]`` rows to send.
      output: ``[M, ...]`` initial receive buffer.
      input_offsets, send_sizes, output_offsets, recv_sizes: int ``[K]``, ``K`` a multiple of
        the axis size ``P``, as for ``jax.lax.ragged_all_to_all``.
      axis_name: the mesh axis (or axes).
      implementation: from :func:`moe.options.resolve_exchange_implementation`.

    Returns:
      ``output`` with received slices written.

    Example:
      >>> # inside shard_map: ragged_exchange(..., axis_name='expert',
      >>> #                                  implementation='native')

    References:
      ``jax.lax.ragged_all_to_all`` docstring; MaxText ragged MoE dispatch.
    """
    if implementation == "native":
        # GPU/TPU only (XLA:CPU lacks the op; CI lowers it, benchmarks/dispatch.py runs it
        # on GPUs and checks it equals the emulation bit for bit).
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes,
                                         output_offsets, recv_sizes, axis_name=axis_name)
    return _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes,
                                       output_offsets, axis_name=axis_name)
