"""Grouped GEMMs in Pallas (Triton lowering): ``gmm`` (forward, dgrad) and ``tgmm`` (wgrad).

Rows of ``lhs [M, K]`` are grouped by expert: group ``g`` owns rows
``[sum(gs[:g]), sum(gs[:g+1]))``; rows past ``sum(gs)`` are padding.

``gmm`` (``out[rows of g] = lhs[rows of g] @ rhs[g]``) runs one program per (work tile, column
tile). A *work tile* is one (group, row tile) pair whose row ranges intersect: groups are not
padded to the tile size; a row tile that straddles a group boundary is computed once per group
it touches, each time storing only that group's rows (masked store). The work-tile table
(group id, row tile, first row, end row) is built on the device from ``group_sizes`` by a few
small jnp ops, passed to the kernel as int32 arrays and read as scalars at the top of every
program (the Triton analogue of megablox's scalar prefetch). The padding rows form one more
pseudo-group whose tiles store zeros without a K loop, so every output row is written exactly
once and no memset is needed. There are at most ``cdiv(M, block_m) + G`` work tiles; unused
table entries are no-op programs. Programs are ordered in bands of ``group_m`` work tiles
(the Triton tutorial's L2 swizzle), so a band's ``lhs`` rows and the current ``rhs[g]`` column
tile stay in L2.

``gmm(..., transpose_rhs=True)`` multiplies by ``rhs[g]^T`` (dgrad ``dy @ W[g]^T`` with ``W``
``[G, K, N]``) by loading ``[block_n, block_k]`` tiles of ``rhs[g]`` and contracting their last
axis: no transposed copy of the weight bank exists.

``tgmm`` (``out[g] = lhs_g^T @ dy_g``) runs one program per (group, K tile, N tile); each loops
over its group's row tiles only (masked loads zero the rows of neighbouring groups), so an
empty group costs one store of zeros and a skewed group its own rows. Groups are launched
largest first, so the longest programs do not form the tail.

Operands are padded with zeros to multiples of the tile sizes when they are not (a copy; the
usual model sizes need none), so every load and store is in bounds and interpret mode computes
exactly what the compiled kernel does. Accumulation is f32; the output dtype is an argument.
Indices are int32: ``M * K``, ``M * N`` and ``G * K * N`` must stay below 2**31.

``interpret=None`` picks Pallas interpret mode when lowering for CPU (through
`jax.lax.platform_dependent`, so it follows the platform being lowered for, not the process's
default backend): the kernel then runs as ordinary, slow XLA ops, which is how the tests check
it on CPU. Lowered for a GPU it compiles through Triton. TPUs are refused (ValueError).

Both work inside ``jax.shard_map`` with ``check_vma=True`` (as in `moe.MoE`): the outputs are
typed as varying over the union of the operands' varying mesh axes (`accel_kernels.vma`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from accel_kernels import vma
from accel_kernels.gmm.base import GroupedGemms, scaled_mm8, scaled_tmm8
from accel_kernels.tiling import check_fields, count, pad_to, tile_size
from accel_kernels.triton_gpu import PALLAS_IMPORT_ERROR, TritonParams, pl, plgpu


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Tile sizes and Triton launch parameters of one grouped GEMM.

    gmm: the output tile is ``[block_m, block_n]``, the contraction step ``block_k``.
    tgmm: the output tile is ``[block_k, block_n]`` of ``out[g]``, the contraction (token
    rows) step ``block_m``. Tile sizes must be powers of two >= 16 (Triton ``dot``).
    ``group_m``: work tiles (gmm) / K tiles (tgmm) per L2 swizzle band.
    """

    block_m: int = tile_size(128, 16)
    block_n: int = tile_size(128, 16)
    block_k: int = tile_size(64, 16)
    num_warps: int = count(8)
    num_stages: int = count(4)
    group_m: int = count(8)

    def __post_init__(self):
        check_fields(self)


# Defaults for Hopper-class GPUs in bf16, the fastest of a sweep of tile sizes on expert
# shapes. A group boundary inside a 128-row tile costs one extra tile of work, so at
# most G extra tiles per GEMM. Read at trace time: assigning these retunes later traces.
GMM_TILING = Tiling(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
TGMM_TILING = Tiling(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_platform() -> None:
    """ValueError unless Pallas imports and the default backend is a GPU or the CPU."""
    if PALLAS_IMPORT_ERROR is not None:
        raise ValueError(
            f"the Pallas grouped GEMM needs jax.experimental.pallas, which failed to import "
            f"({PALLAS_IMPORT_ERROR})."
        )
    platform = jax.default_backend()
    if platform not in ("cpu", "gpu", "cuda", "rocm"):
        raise ValueError(
            f"the Pallas grouped GEMM is a GPU (Triton) kernel, interpreted on CPU for tests; "
            f"the default backend is {platform!r}. Use implementation='xla' there."
        )


def _per_platform(call, interpret: bool | None, *args):
    """``call(interpret, varying, *args)``: interpreted when lowered for CPU if ``interpret``
    is None. ``varying``: the union of the operands' varying mesh axes (`accel_kernels.vma`)."""
    check_platform()
    varying = vma.varying_of(*args)

    def run(interp: bool, *operands):
        if interp:
            return vma.unchecked(functools.partial(call, True, varying), varying, *operands)
        return call(False, varying, *operands)

    if interpret is not None:
        return run(bool(interpret), *args)
    return lax.platform_dependent(
        *args,
        cpu=functools.partial(run, True),
        # GPU only: the compiled Triton kernel. CI lowers it for CUDA
        # (tests/accel_kernels/gmm/test_gmm_triton.py); benchmarks/experts_bench.py runs it on
        # GPUs against ragged_dot before timing it.
        default=functools.partial(run, False),
    )


def _group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Row ranges [start, end) of each group, clamped to [0, m]."""
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), m).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def work_tiles(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, ...]:
    """The gmm work-tile table for ``m`` rows (a multiple of ``block_m``).

    Returns int32 ``(group, row_tile, lo, hi)``, each ``[cdiv(m, block_m) + G]``: work tile
    ``i`` computes rows ``[lo, hi)`` of row tile ``row_tile`` with ``rhs[group]``; ``group ==
    G`` stores zeros (the padding rows past ``sum(group_sizes)``, and unused entries, for which
    ``lo == hi``).
    """
    n_groups = group_sizes.shape[0]
    starts, ends = _group_bounds(group_sizes, m)
    # The padding rows are group G.
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    first = starts // block_m
    counts = jnp.where(ends > starts, (ends + block_m - 1) // block_m - first, 0)
    csum = jnp.cumsum(counts)
    n_work = _cdiv(m, block_m) + n_groups  # >= sum(counts): G boundaries add <= G tiles
    i = jnp.arange(n_work, dtype=jnp.int32)
    grp = jnp.searchsorted(csum, i, side="right", method="compare_all")  # no while loop
    grp = jnp.minimum(grp, n_groups).astype(jnp.int32)
    valid = i < csum[-1]
    tile = first[grp] + i - (csum[grp] - counts[grp])
    lo = jnp.maximum(starts[grp], tile * block_m)
    hi = jnp.minimum(ends[grp], (tile + 1) * block_m)
    zero = jnp.zeros_like(i)
    return (
        jnp.where(valid, grp, n_groups).astype(jnp.int32),
        jnp.where(valid, tile, zero).astype(jnp.int32),
        jnp.where(valid, lo, zero).astype(jnp.int32),
        jnp.where(valid, hi, zero).astype(jnp.int32),
    )


def _swizzle(pid, n_rows: int, n_cols: int, group_m: int):
    """Program id -> (row, col) in bands of ``group_m`` rows, column-major within a band."""
    # Operands are non-negative: truncating lax.div/rem (no floor-division fix-ups).
    per_band = group_m * n_cols
    first = lax.div(pid, per_band) * group_m
    size = jnp.minimum(n_rows - first, group_m)
    local = lax.rem(pid, per_band)
    return first + lax.rem(local, size), lax.div(local, size)


def _cost(flops: int, a: jax.Array, b: jax.Array, out_size: int, out_dtype):
    """The cost of a GEMM that reads ``a`` and ``b`` once and writes ``out_size`` elements."""
    return pl.CostEstimate(
        flops=flops,
        transcendentals=0,
        bytes_accessed=int(
            a.size * a.dtype.itemsize + b.size * b.dtype.itemsize + out_size * out_dtype.itemsize
        ),
    )


def _compiler_params(tiling: Tiling):
    return TritonParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)


# ----------------------------------------------------------------------------------------------
# gmm
# ----------------------------------------------------------------------------------------------


def _gmm_kernel(
    grp_ref, tile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref,
    *, n_groups, n_work, n_cols, n_k, tiling, transpose_rhs, compute_dtype,
):  # fmt: skip
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    w, j = _swizzle(pl.program_id(0), n_work, n_cols, tiling.group_m)
    g = grp_ref[w]
    row0 = pl.multiple_of(tile_ref[w] * bm, bm)
    col0 = pl.multiple_of(j * bn, bn)
    rows = row0 + jnp.arange(bm, dtype=jnp.int32)
    keep = (rows >= lo_ref[w]) & (rows < hi_ref[w])
    g_load = jnp.minimum(g, n_groups - 1)  # group n_groups (padding) loads nothing
    # (1, 1): contract the last axis of both (rhs tile [bn, bk] = rhs[g]^T tile).
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

    def step(kk, acc):
        k0 = pl.multiple_of(kk * bk, bk)
        a = plgpu.load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)])
        if transpose_rhs:
            b = plgpu.load(rhs_ref.at[g_load, pl.ds(col0, bn), pl.ds(k0, bk)])
        else:
            b = plgpu.load(rhs_ref.at[g_load, pl.ds(k0, bk), pl.ds(col0, bn)])
        a = a.astype(compute_dtype)
        b = b.astype(compute_dtype)
        return acc + lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    # A static trip count (Triton rejects the mixed bound types of a traced one). Tiles of the
    # padding group compute a throwaway product and store zeros.
    acc = lax.fori_loop(0, n_k, step, jnp.zeros((bm, bn), jnp.float32))
    acc = jnp.where(g < n_groups, acc, 0.0)
    plgpu.store(
        out_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)],
        acc.astype(out_ref.dtype),
        mask=jnp.broadcast_to(keep[:, None], (bm, bn)),
    )


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    out_dtype=None,
    tiling: Tiling | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Grouped GEMM: ``out[rows of g] = lhs[rows of g] @ rhs[g]`` (``rhs[g]^T`` if transposed).

    Args:
      lhs: ``[M, K]``, rows grouped by group (group g: rows ``sum(gs[:g])`` to
        ``sum(gs[:g+1])``); rows past ``sum(group_sizes)`` give zero output rows.
      rhs: ``[G, K, N]``, or ``[G, N, K]`` with ``transpose_rhs=True``.
      group_sizes: int ``[G]``, rows per group (sum <= M).
      transpose_rhs: multiply by ``rhs[g]^T`` without materializing the transpose.
      out_dtype: output dtype (default ``lhs.dtype``); accumulation is f32.
      tiling: `Tiling` (default `GMM_TILING`).
      interpret: force Pallas interpret mode on/off; None: on when lowered for CPU.

    Returns:
      ``[M, N]``.
    """
    tiling = tiling or GMM_TILING
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(
            f"gmm takes lhs [M, K], rhs [G, K, N], group_sizes [G]; got {lhs.shape}, "
            f"{rhs.shape}, {group_sizes.shape}."
        )
    n_groups = rhs.shape[0]
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    m, k = lhs.shape
    n = rhs.shape[n_axis]
    if rhs.shape[k_axis] != k or group_sizes.shape[0] != n_groups:
        raise ValueError(
            f"gmm shapes disagree: lhs {lhs.shape}, rhs {rhs.shape} "
            f"(transpose_rhs={transpose_rhs}), group_sizes {group_sizes.shape}."
        )
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    if k == 0 or n_groups == 0:
        return jnp.zeros((m, n), out_dtype)
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    lhs_p = pad_to(pad_to(lhs, 0, bm), 1, bk)
    rhs_p = pad_to(pad_to(rhs, k_axis, bk), n_axis, bn)
    mp, kp = lhs_p.shape
    np_ = rhs_p.shape[n_axis]
    grp, tile, lo, hi = work_tiles(group_sizes, m, bm)
    n_work, n_cols = grp.shape[0], np_ // bn
    kernel = functools.partial(
        _gmm_kernel,
        n_groups=n_groups,
        n_work=n_work,
        n_cols=n_cols,
        n_k=kp // bk,
        tiling=tiling,
        transpose_rhs=transpose_rhs,
        compute_dtype=jnp.promote_types(lhs.dtype, rhs.dtype),
    )
    cost = _cost(2 * m * k * n, lhs, rhs, m * n, out_dtype)

    def call(interp, varying, *operands):
        return pl.pallas_call(
            kernel,
            out_shape=vma.out_struct((mp, np_), out_dtype, varying),
            grid=(n_work * n_cols,),
            interpret=interp,
            compiler_params=None if interp else _compiler_params(tiling),
            name="gmm_t" if transpose_rhs else "gmm",
            cost_estimate=cost,
        )(*operands)

    out = _per_platform(call, interpret, grp, tile, lo, hi, lhs_p, rhs_p)
    if (mp, np_) != (m, n):
        out = out[:m, :n]
    return out


# ----------------------------------------------------------------------------------------------
# tgmm
# ----------------------------------------------------------------------------------------------


def _tgmm_kernel(
    order_ref, start_ref, end_ref, lhs_ref, dy_ref, out_ref,
    *, n_ktiles, n_ntiles, tiling, compute_dtype,
):  # fmt: skip
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    pid = pl.program_id(0)
    per_group = n_ktiles * n_ntiles
    gi = lax.div(pid, per_group)
    kt, nt = _swizzle(lax.rem(pid, per_group), n_ktiles, n_ntiles, tiling.group_m)
    g = order_ref[gi]
    start, end = start_ref[g], end_ref[g]
    k0 = pl.multiple_of(kt * bk, bk)
    n0 = pl.multiple_of(nt * bn, bn)
    first = lax.div(start, bm)
    trips = jnp.where(end > start, lax.div(end + bm - 1, bm) - first, 0)

    def step(i, acc):
        row0 = pl.multiple_of((first + i) * bm, bm)
        rows = row0 + jnp.arange(bm, dtype=jnp.int32)
        keep = ((rows >= start) & (rows < end))[:, None]
        a = plgpu.load(
            lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)],
            mask=jnp.broadcast_to(keep, (bm, bk)),
            other=0,
        )
        b = plgpu.load(
            dy_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)],
            mask=jnp.broadcast_to(keep, (bm, bn)),
            other=0,
        )
        a = a.astype(compute_dtype)
        b = b.astype(compute_dtype)
        # a^T @ b: contract the row axis of both.
        return acc + lax.dot_general(
            a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    # Static bound (see _gmm_kernel); iterations past this group's row tiles are skipped.
    max_trips = _cdiv(lhs_ref.shape[0], bm)
    acc = lax.fori_loop(
        0, max_trips,
        lambda i, a: lax.cond(i < trips, lambda b: step(i, b), lambda b: b, a),
        jnp.zeros((bk, bn), jnp.float32),
    )
    plgpu.store(out_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)], acc.astype(out_ref.dtype))


def tgmm(
    lhs: jax.Array,
    dy: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype=None,
    tiling: Tiling | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Per-group ``lhs_g^T @ dy_g`` (the weight gradient of `gmm`): ``[G, K, N]``.

    Args:
      lhs: ``[M, K]``, rows grouped as in `gmm`; rows past ``sum(group_sizes)`` are ignored.
      dy: ``[M, N]``, same rows.
      group_sizes: int ``[G]``. An empty group gives a zero ``[K, N]`` block.
      out_dtype: output dtype (default ``lhs.dtype``); accumulation is f32.
      tiling: `Tiling` (default `TGMM_TILING`): output tile ``[block_k, block_n]``, rows
        stepped by ``block_m``.
      interpret: as in `gmm`.
    """
    tiling = tiling or TGMM_TILING
    if lhs.ndim != 2 or dy.ndim != 2 or group_sizes.ndim != 1 or lhs.shape[0] != dy.shape[0]:
        raise ValueError(
            f"tgmm takes lhs [M, K], dy [M, N], group_sizes [G]; got {lhs.shape}, "
            f"{dy.shape}, {group_sizes.shape}."
        )
    m, k = lhs.shape
    n = dy.shape[1]
    n_groups = group_sizes.shape[0]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if m == 0 or k == 0 or n == 0 or n_groups == 0:
        return jnp.zeros((n_groups, k, n), out_dtype)
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    lhs_p = pad_to(pad_to(lhs, 0, bm), 1, bk)
    dy_p = pad_to(pad_to(dy, 0, bm), 1, bn)
    kp, np_ = lhs_p.shape[1], dy_p.shape[1]
    starts, ends = _group_bounds(group_sizes, m)
    order = jnp.argsort(-(ends - starts), stable=True).astype(jnp.int32)  # largest first
    n_ktiles, n_ntiles = kp // bk, np_ // bn
    kernel = functools.partial(
        _tgmm_kernel,
        n_ktiles=n_ktiles,
        n_ntiles=n_ntiles,
        tiling=tiling,
        compute_dtype=jnp.promote_types(lhs.dtype, dy.dtype),
    )
    cost = _cost(2 * m * k * n, lhs, dy, n_groups * k * n, out_dtype)

    def call(interp, varying, *operands):
        return pl.pallas_call(
            kernel,
            out_shape=vma.out_struct((n_groups, kp, np_), out_dtype, varying),
            grid=(n_groups * n_ktiles * n_ntiles,),
            interpret=interp,
            compiler_params=None if interp else _compiler_params(tiling),
            name="tgmm",
            cost_estimate=cost,
        )(*operands)

    out = _per_platform(call, interpret, order, starts, ends, lhs_p, dy_p)
    if (kp, np_) != (k, n):
        out = out[:, :k, :n]
    return out


GEMMS = GroupedGemms(
    2,
    fwd=lambda a, w, gs, dt: gmm(a, w, gs, out_dtype=dt),
    dgrad=lambda g, w, gs, dt: gmm(g, w, gs, transpose_rhs=True, out_dtype=dt),
    wgrad=lambda a, g, gs, dt: tgmm(a, g, gs, out_dtype=dt),
    mm8=scaled_mm8(lambda a, b, gs, dt: gmm(a, b, gs, transpose_rhs=True, out_dtype=dt)),
    tmm8=scaled_tmm8(lambda at, bt, gs: tgmm(at.T, bt.T, gs, out_dtype=jnp.float32)),
)
"""The 'triton' grouped GEMMs: :func:`gmm` and :func:`tgmm`, compiled for GPUs, interpreted
when lowered for CPU; FP8 results scaled in XLA."""
