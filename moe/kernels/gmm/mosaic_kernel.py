"""Grouped GEMMs in Pallas Mosaic GPU (Hopper wgmma): ``gmm`` (forward, dgrad), ``tgmm`` (wgrad).

Both take rows grouped by expert in the *tile-aligned* ragged layout: every group's size is a
multiple of the row tile (``group_alignment``, 128 by default), so a row tile (``gmm``) or a
contraction tile (``tgmm``) never straddles two groups. :func:`align_groups` gives that layout
for any ragged input; the layer's dispatch produces it directly. Rows past ``sum(group_sizes)``
are padding.

* ``gmm(lhs [M, K], rhs, group_sizes) -> [M, N]``: ``out[rows of g] = lhs[rows of g] @ W_g``
  with ``rhs`` either ``[G, K, N]`` (``W_g = rhs[g]``) or ``[G, N, K]`` (``rhs_k_major=True``,
  ``W_g = rhs[g]^T``). FP8 operands need ``rhs_k_major=True`` (FP8 wgmma reads both operands
  K-major).
* ``tgmm(a, b, group_sizes) -> [G, N1, N2]``: ``out[g] = a_g^T @ b_g`` over the rows of group
  ``g``, with ``a [M, N1]``, ``b [M, N2]``, or K-major copies ``a [N1, M]``, ``b [N2, M]``
  (``k_major=True``; required for FP8).

Each kernel is persistent (one CTA per SM walks a list of output tiles) and warp-specialized:
a memory warpgroup streams ``[tile_m, tile_k]`` / ``[tile_k, 2 tile_n]`` blocks into shared
memory with TMA, two compute warpgroups each own ``tile_n`` columns of the CTA tile and
accumulate in registers with ``wgmma`` (f32), and the epilogue stores through shared memory
with TMA. A padding tile (``gmm``) or an empty group (``tgmm``) stores zeros without loading
anything. Operands must be multiples of the tiles (the callers pad).

These kernels lower only for NVIDIA Hopper GPUs (``sm_90a``). Off GPU, :mod:`moe.experts`
uses the same arithmetic through XLA (``reference`` functions here), which is how the tests
check it on CPU; CI lowers the kernels for CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from moe.kernels import lowering, vma
from moe.kernels.gmm.base import GROUP_ALIGNMENT, group_ends  # noqa: F401 - the layout it takes
from moe.kernels.tiling import check_fields, count, tile_size

try:  # Mosaic GPU ships with jax; keep CPU-only imports safe.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    MOSAIC_IMPORT_ERROR: str | None = None
except Exception as e:  # pragma: no cover - depends on the installed jax
    pl = plgpu = None
    MOSAIC_IMPORT_ERROR = f"{type(e).__name__}: {e}"


H100_SMS = 132


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
    """Tile sizes of one grouped GEMM kernel.

    Each compute warpgroup owns a ``[tile_m, tile_n]`` accumulator; the CTA tile is
    ``[tile_m, 2 * tile_n]``. ``tile_k``: contraction step (64 bf16 / 128 FP8 elements are
    128-byte rows). ``stages``: shared-memory pipeline depth. ``epi_m``/``epi_n``: epilogue
    store tile. ``snake_width``: output tiles per band of the space-filling tile order.
    """

    tile_m: int = tile_size(128, 8)
    tile_n: int = tile_size(128, 8)
    tile_k: int = tile_size(64, 8)
    stages: int = count(4, minimum=2)
    epi_m: int = tile_size(64, 8)
    epi_n: int = tile_size(64, 8)
    snake_width: int = count(8)

    def __post_init__(self):
        check_fields(self)
        if self.tile_m % self.epi_m or self.tile_n % self.epi_n:
            raise ValueError("MosaicTiling: epi_m / epi_n must divide tile_m / tile_n.")


def default_tiling(dtype, out_dtype=jnp.bfloat16) -> MosaicTiling:
    """The default tiling for operands of ``dtype``: 128-byte contraction rows, and one
    pipeline stage fewer when the epilogue stores f32 (shared memory is 227 KiB)."""
    stages = 4 if jnp.dtype(out_dtype).itemsize <= 2 else 3
    return MosaicTiling(tile_k=128 // jnp.dtype(dtype).itemsize, stages=stages)


def _num_sms() -> int:
    try:  # pragma: no cover - GPU only
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(dev.core_count)
    except Exception:  # pragma: no cover
        pass
    return H100_SMS


def smem_transforms(minor_elems: int, dtype) -> tuple:
    """Tiling + swizzle of a shared-memory block whose minor dimension has ``minor_elems``."""
    bits = minor_elems * jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(bits)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def transposed(ref):
    """A transposed view of a 2-D shared-memory ref (the API moved between jax versions)."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return plgpu.transpose_ref(ref, (1, 0))  # pragma: no cover - older jax


def kernel_name(kind: str, dtype, n_groups: int) -> str:
    """The name a GEMM kernel carries in traces and lowered modules: ``gmm_fp8``,
    ``tgmm_bf16``; with one group (a dense GEMM, as `moe.fp8_dense` runs) ``dense_gmm_fp8``."""
    name = jnp.dtype(dtype).name
    bits = "fp8" if jnp.dtype(dtype).itemsize == 1 else {"bfloat16": "bf16"}.get(name, name)
    return f"{'dense_' if n_groups == 1 else ''}{kind}_{bits}"


AVOID = "backend='ragged_dot' (ragged layouts) or 'einsum' (padded)"
"""What keeps the layer off these GEMMs (for `moe.kernels.lowering.check_kernel_lowers`)."""


def persistent_kernel(body, out_shape: tuple[int, ...], out_dtype, varying: frozenset, name: str,
                      *, avoid: str = AVOID):
    """``body`` as a persistent kernel named ``name``: one CTA per SM, each of three
    warpgroups ("wg"). Called on its operands, it first checks that it lowers on this jax
    (`moe.kernels.lowering.check_kernel_lowers`, a no-op on the tested versions; ``avoid``:
    the option its error names)."""

    def named(*refs):
        body(*refs)

    named.__name__ = name

    def kernel(varying):
        return plgpu.kernel(
            named,
            out_type=vma.out_struct(out_shape, out_dtype, varying),
            grid=(_num_sms(),),
            grid_names=("sm",),
            num_threads=3,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(
                lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        )

    def call(*operands):
        lowering.check_kernel_lowers(name, kernel(frozenset()), operands, avoid=avoid)
        return kernel(varying)(*operands)

    return call


def _idx_required() -> bool:
    try:
        idx = inspect.signature(plgpu.load).parameters.get("idx")
    except (TypeError, ValueError, AttributeError):  # pragma: no cover
        return True
    return idx is not None and idx.default is inspect.Parameter.empty


_LOAD_IDX_REQUIRED = plgpu is not None and _idx_required()


def load(ref, *, layout, optimized: bool = True) -> jax.Array:
    """``plgpu.load`` of a whole ref view in ``layout``: jax <= 0.10 takes the index as a
    positional argument, jax 0.11 deprecates it (index the ref with ``.at`` instead)."""
    if _LOAD_IDX_REQUIRED:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)


def _scaled(acc, row_scale, col_scale, smem, bars, wg):
    """``acc * row_scale[:, None] * col_scale[None, :]`` on a WGMMA accumulator (scales via TMA)."""
    rs_smem, cs_smem = smem
    plgpu.copy_gmem_to_smem(row_scale, rs_smem.at[wg], bars.at[2 * wg])
    plgpu.copy_gmem_to_smem(col_scale, cs_smem.at[wg], bars.at[2 * wg + 1])
    plgpu.barrier_wait(bars.at[2 * wg])
    plgpu.barrier_wait(bars.at[2 * wg + 1])
    rs = load(rs_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
    cs = load(cs_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
    return (acc * lax.broadcast_in_dim(rs, acc.shape, [0])
            * lax.broadcast_in_dim(cs, acc.shape, [1]))


def _epilogue(acc, out_smem, out_tile, wg, cfg: MosaicTiling, prior=None):
    """Store a compute warpgroup's ``[tile_m, tile_n]`` accumulator into ``out_tile``; with
    ``prior`` (the same tile of an existing output, and the warpgroup's barrier), store
    ``acc + prior`` instead."""
    if prior is None:
        acc = acc.astype(out_smem.dtype)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    per_row = cfg.tile_n // cfg.epi_n
    for i in range(cfg.tile_m // cfg.epi_m):
        for j in range(per_row):
            rows = slice(i * cfg.epi_m, (i + 1) * cfg.epi_m)
            cols = slice(j * cfg.epi_n, (j + 1) * cfg.epi_n)
            slot = (i * per_row + j) % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            part = acc[rows, cols]
            if prior is not None:
                # The slot's last store has been read out (the wait above): the prior block
                # comes in through it, is added in f32 registers and leaves the same way.
                prior_tile, bar = prior
                plgpu.copy_gmem_to_smem(prior_tile.at[rows, cols], out_smem.at[wg, slot], bar)
                plgpu.barrier_wait(bar)
                before = load(out_smem.at[wg, slot], layout=plgpu.Layout.WGMMA,
                              optimized=False)
                part = (part + before.astype(part.dtype)).astype(out_smem.dtype)
            out_smem[wg, slot] = part
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_tile.at[rows, cols])


def _out_smem(out_dtype, cfg: MosaicTiling):
    return plgpu.SMEM((2, 2, cfg.epi_m, cfg.epi_n), out_dtype,
                      transforms=smem_transforms(cfg.epi_n, out_dtype))


def _zero_tile(out_smem, out_tile, wg, cfg: MosaicTiling, prior=None):
    """Compute warpgroups store a zero ``[tile_m, tile_n]`` tile, or with ``prior`` a copy of
    the prior tile (the memory one idles)."""

    @pl.when(wg < 2)
    def _():
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n)))
        def _(acc_ref):
            _epilogue(acc_ref[...], out_smem, out_tile, wg, cfg, prior)


def k_block(shape: tuple[int, int], k_axis: int, transforms) -> Any:
    """A shared-memory block of ``shape`` that steps along its ``k_axis`` (the contraction)."""
    index = (lambda kk: (0, kk)) if k_axis == 1 else (lambda kk: (kk, 0))
    return plgpu.BlockSpec(shape, index, transforms=transforms, memory_space=plgpu.SMEM)


def warp_pipeline(body, compute_context, steps, in_specs, cfg: MosaicTiling):
    """The warp-specialized pipeline over ``steps`` contraction tiles: a memory warpgroup
    streams ``in_specs`` blocks to two compute warpgroups."""
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=40,
        in_specs=in_specs,
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=cfg.stages,
        compute_context=compute_context,
    )


class TileScope(NamedTuple):
    """What every output tile of a kernel uses: its warpgroup's index and the shared memory
    (``prior_bars``: one barrier per compute warpgroup for the prior output's blocks, when
    the kernel accumulates into one)."""

    wg: jax.Array
    allocs: Any
    out_smem: Any
    scale_smem: Any
    scale_bars: Any
    prior_bars: Any = None

    def prior(self, prior_tile):
        """``(prior_tile, this warpgroup's barrier)`` for the epilogue (None: no prior)."""
        return None if prior_tile is None else (prior_tile, self.prior_bars.at[self.wg])


def for_each_tile(loop_shape, alloc_steps, in_specs, alloc_refs, out_dtype, cfg: MosaicTiling,
                   scaled: bool, tile, *, accumulate: bool = False):
    """``tile(index, scope)`` for every index of ``loop_shape``, persistently over the SMs,
    with the pipeline's and the epilogue's shared memory allocated once; then wait for the
    last stores."""

    def ignore(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        allocs=warp_pipeline(ignore, ignore, alloc_steps, in_specs,
                             cfg).get_allocations(*alloc_refs),
        out_smem=_out_smem(out_dtype, cfg),
        scale_smem=(plgpu.SMEM((2, cfg.tile_m), jnp.float32),
                    plgpu.SMEM((2, cfg.tile_n), jnp.float32)) if scaled else None,
        scale_bars=plgpu.Barrier(num_barriers=4) if scaled else None,
        prior_bars=plgpu.Barrier(num_barriers=2) if accumulate else None,
        collective_axes="wg",
    )
    def _scope(allocs, out_smem, scale_smem, scale_bars, prior_bars):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop(loop_shape, collective_axes="sm")
        def _tiles(info):
            tile(info.index, TileScope(wg, allocs, out_smem, scale_smem, scale_bars,
                                       prior_bars))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def tile_context(scope: TileScope, out_tile, scale_refs, cfg: MosaicTiling, prior_tile=None):
    """The compute warpgroups' context: accumulate the pipeline in f32 registers, multiply by
    ``scale_refs()`` (row and column scale refs; None: unscaled), add ``prior_tile`` (a ref,
    or None), store into ``out_tile``."""

    def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n)))
        def _(acc_ref):
            eval_pipeline(acc_ref)
            acc = acc_ref[...]
            if scale_refs is not None:
                acc = _scaled(acc, *scale_refs(), scope.scale_smem, scope.scale_bars, scope.wg)
            _epilogue(acc, scope.out_smem, out_tile, scope.wg, cfg, scope.prior(prior_tile))

    return compute_context


# ----------------------------------------------------------------------------------------------
# gmm
# ----------------------------------------------------------------------------------------------


def _gmm_body(tile_group, a_gmem, b_gmem, *rest, cfg: MosaicTiling, rhs_k_major: bool,
              num_groups: int, scaled: bool):
    row_s, col_s, out_gmem = rest if scaled else (None, None, rest[0])
    m, k = a_gmem.shape
    n = out_gmem.shape[1]
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = 2 * tn
    m_iters, n_iters, k_iters = m // tm, n // cta_n, k // tk
    in_t = smem_transforms(tk, a_gmem.dtype)
    b_t = in_t if rhs_k_major else smem_transforms(cta_n, b_gmem.dtype)
    b_spec = k_block((cta_n, tk), 1, b_t) if rhs_k_major else k_block((tk, cta_n), 0, b_t)
    in_specs = [k_block((tm, tk), 1, in_t), b_spec]

    def tile(index, scope: TileScope):
        (lin,) = index
        mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, cfg.snake_width)
        g = tile_group[mi]
        m_sl = pl.ds(mi * tm, tm)
        n_sl = pl.ds(ni * cta_n, cta_n)
        wg_n = pl.ds(scope.wg * tn, tn)
        out_tile = out_gmem.at[m_sl, n_sl].at[:, wg_n]

        def scale_refs():
            gc = jnp.minimum(g, num_groups - 1)
            return row_s.at[m_sl], col_s.at[gc, n_sl].at[wg_n]

        compute_context = tile_context(scope, out_tile, scale_refs if scaled else None, cfg)

        def mma(idxs, a_smem, b_smem, acc_ref):
            del idxs
            b = transposed(b_smem.at[wg_n, :]) if rhs_k_major else b_smem.at[:, wg_n]
            plgpu.wgmma(acc_ref, a_smem, b)
            plgpu.wgmma_wait(0)
            return acc_ref

        @pl.when(g < num_groups)
        def _():
            gc = jnp.minimum(g, num_groups - 1)
            b_rows = b_gmem.at[gc, n_sl, :] if rhs_k_major else b_gmem.at[gc, :, n_sl]
            pipeline = warp_pipeline(mma, compute_context, k_iters, in_specs, cfg)
            pipeline(a_gmem.at[m_sl, :], b_rows, allocations=scope.allocs)

        @pl.when(g >= num_groups)
        def _():
            _zero_tile(scope.out_smem, out_tile, scope.wg, cfg)

    for_each_tile((m_iters * n_iters,), k_iters, in_specs, (a_gmem, b_gmem.at[0]),
                   out_gmem.dtype, cfg, scaled, tile)


def tile_groups(group_sizes: jax.Array, m: int, tile_m: int,
                live_rows: jax.Array | None = None) -> jax.Array:
    """int32 ``[m // tile_m]``: the group of each row tile (``G`` for padding tiles).

    Assumes every group size is a multiple of ``tile_m`` (the aligned layout). With
    ``live_rows [G]``, a tile of group ``g`` that starts at or past its first ``live_rows[g]``
    rows is a padding tile too.
    """
    n_groups = group_sizes.shape[0]
    ends = group_ends(group_sizes)
    starts = jnp.arange(m // tile_m, dtype=jnp.int32) * tile_m
    g = jnp.minimum(jnp.searchsorted(ends, starts, side="right", method="compare_all"),
                    n_groups).astype(jnp.int32)
    if live_rows is None:
        return g
    gc = jnp.minimum(g, n_groups - 1)
    offset = starts - (ends[gc] - jnp.maximum(group_sizes.astype(jnp.int32), 0)[gc])
    return jnp.where(offset < live_rows.astype(jnp.int32)[gc], g, n_groups).astype(jnp.int32)


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    rhs_k_major: bool = False,
    out_dtype: DTypeLike | None = None,
    tiling: MosaicTiling | None = None,
    varying: frozenset = frozenset(),
    row_scale: jax.Array | None = None,
    col_scale: jax.Array | None = None,
    live_rows: jax.Array | None = None,
) -> jax.Array:
    """Grouped GEMM on the tile-aligned layout: ``out[rows of g] = lhs[rows of g] @ W_g``.

    ``W_g = rhs[g]`` (``rhs [G, K, N]``) or ``rhs[g]^T`` (``rhs [G, N, K]``,
    ``rhs_k_major=True``). ``M``, ``K``, ``N`` must be multiples of ``tile_m``, ``tile_k``,
    ``2 * tile_n``; every group size a multiple of ``tile_m``. Rows past ``sum(group_sizes)``
    come out zero. Accumulation is f32; ``out_dtype`` defaults to bf16 for FP8 operands.
    ``varying``: mesh axes the output varies over inside a check_vma ``shard_map``.
    ``row_scale [M]`` and ``col_scale [G, N]`` (f32, both or neither) multiply the f32
    accumulator in the epilogue: ``out[r, n] = acc[r, n] * row_scale[r] * col_scale[g, n]``
    (FP8 operands' dequantization scales, applied before the output cast).
    ``live_rows [G]`` (optional): only the first ``live_rows[g]`` rows of group ``g`` may be
    nonzero; its row tiles past them are not computed and come out zero (what the zero rows
    would give), e.g. the empty slots of a capacity-padded layout.
    """
    if out_dtype is None:
        out_dtype = jnp.bfloat16 if jnp.dtype(lhs.dtype).itemsize == 1 else lhs.dtype
    cfg = tiling or default_tiling(lhs.dtype, out_dtype)
    m, k = lhs.shape
    n_groups = rhs.shape[0]
    n = rhs.shape[1] if rhs_k_major else rhs.shape[2]
    k2 = rhs.shape[2] if rhs_k_major else rhs.shape[1]
    if k2 != k or group_sizes.shape != (n_groups,):
        raise ValueError(f"gmm shapes disagree: lhs {lhs.shape}, rhs {rhs.shape} "
                         f"(rhs_k_major={rhs_k_major}), group_sizes {group_sizes.shape}.")
    if m % cfg.tile_m or k % cfg.tile_k or n % (2 * cfg.tile_n):
        raise ValueError(f"gmm needs M % {cfg.tile_m}, K % {cfg.tile_k}, N % {2 * cfg.tile_n} "
                         f"== 0; got M={m}, K={k}, N={n}.")
    if jnp.dtype(lhs.dtype).itemsize == 1 and not rhs_k_major:
        raise ValueError("FP8 gmm needs the weights K-major ([G, N, K], rhs_k_major=True).")
    scaled = row_scale is not None
    if scaled != (col_scale is not None):
        raise ValueError("gmm: pass row_scale and col_scale together (or neither).")
    if scaled and (row_scale.shape != (m,) or col_scale.shape != (n_groups, n)):
        raise ValueError(f"gmm: row_scale must be [{m}] and col_scale [{n_groups}, {n}]; got "
                         f"{row_scale.shape}, {col_scale.shape}.")
    body = functools.partial(_gmm_body, cfg=cfg, rhs_k_major=rhs_k_major, num_groups=n_groups,
                             scaled=scaled)
    kernel = persistent_kernel(body, (m, n), out_dtype, varying,
                               kernel_name("gmm", lhs.dtype, n_groups))
    scales = (row_scale.astype(jnp.float32), col_scale.astype(jnp.float32)) if scaled else ()
    out = kernel(tile_groups(group_sizes, m, cfg.tile_m, live_rows), lhs, rhs, *scales)
    return vma.as_varying(out, varying)


# ----------------------------------------------------------------------------------------------
# tgmm
# ----------------------------------------------------------------------------------------------


def _tgmm_body(start_tile, num_tiles, a_gmem, b_gmem, *rest, cfg: MosaicTiling,
               k_major: bool, scaled: bool, accumulate: bool):
    rest = list(rest)
    out_gmem = rest.pop()
    prior_gmem = rest.pop() if accumulate else None
    row_s, col_s = rest if scaled else (None, None)
    n_groups, n1, n2 = out_gmem.shape
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = 2 * tn
    rows = a_gmem.shape[1] if k_major else a_gmem.shape[0]
    m_iters, n_iters = n1 // tm, n2 // cta_n
    if k_major:
        a_t = b_t = smem_transforms(tk, a_gmem.dtype)
        in_specs = [k_block((tm, tk), 1, a_t), k_block((cta_n, tk), 1, b_t)]
    else:
        a_t = smem_transforms(tm, a_gmem.dtype)
        b_t = smem_transforms(cta_n, b_gmem.dtype)
        in_specs = [k_block((tk, tm), 0, a_t), k_block((tk, cta_n), 0, b_t)]

    def tile(index, scope: TileScope):
        g, lin = index
        mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, cfg.snake_width)
        steps = num_tiles[g]
        tok = pl.ds(pl.multiple_of(start_tile[g] * tk, tk), rows)
        m_sl = pl.ds(mi * tm, tm)
        n_sl = pl.ds(ni * cta_n, cta_n)
        wg_n = pl.ds(scope.wg * tn, tn)
        out_tile = out_gmem.at[g, m_sl, n_sl].at[:, wg_n]
        prior_tile = None if prior_gmem is None else prior_gmem.at[g, m_sl, n_sl].at[:, wg_n]

        def scale_refs():
            return row_s.at[m_sl], col_s.at[n_sl].at[wg_n]

        compute_context = tile_context(scope, out_tile, scale_refs if scaled else None, cfg,
                                       prior_tile)

        def mma(idxs, a_smem, b_smem, acc_ref):
            del idxs
            if k_major:
                plgpu.wgmma(acc_ref, a_smem, transposed(b_smem.at[wg_n, :]))
            else:
                plgpu.wgmma(acc_ref, transposed(a_smem), b_smem.at[:, wg_n])
            plgpu.wgmma_wait(0)
            return acc_ref

        @pl.when(steps > 0)
        def _():
            if k_major:
                a_rows, b_rows = a_gmem.at[m_sl, tok], b_gmem.at[n_sl, tok]
            else:
                a_rows, b_rows = a_gmem.at[tok, m_sl], b_gmem.at[tok, n_sl]
            pipeline = warp_pipeline(mma, compute_context, steps, in_specs, cfg)
            pipeline(a_rows, b_rows, allocations=scope.allocs)

        @pl.when(steps == 0)
        def _():  # scales do not change a zero; a prior output is copied
            _zero_tile(scope.out_smem, out_tile, scope.wg, cfg, scope.prior(prior_tile))

    for_each_tile((n_groups, m_iters * n_iters), 2 * cfg.stages, in_specs, (a_gmem, b_gmem),
                   out_gmem.dtype, cfg, scaled, tile, accumulate=accumulate)


def contraction_tiles(group_sizes: jax.Array, rows: int, tile_k: int,
                      live_rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(first tile, number of tiles)`` int32 ``[G]`` of each group's contraction in
    :func:`tgmm`: its rows in ``tile_k`` tiles (the aligned layout), clipped to ``rows`` and,
    with ``live_rows``, to the tiles holding the group's first ``live_rows[g]`` rows."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(group_ends(sizes), rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    num_tiles = (ends - starts) // tile_k
    if live_rows is not None:
        live = jnp.maximum(live_rows.astype(jnp.int32), 0)
        num_tiles = jnp.minimum(num_tiles, -(-live // tile_k))
    return (starts // tile_k).astype(jnp.int32), num_tiles.astype(jnp.int32)


def tgmm(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    *,
    k_major: bool = False,
    out_dtype: DTypeLike = jnp.float32,
    tiling: MosaicTiling | None = None,
    varying: frozenset = frozenset(),
    row_scale: jax.Array | None = None,
    col_scale: jax.Array | None = None,
    live_rows: jax.Array | None = None,
    acc: jax.Array | None = None,
) -> jax.Array:
    """Per-group ``a_g^T @ b_g`` on the tile-aligned layout: ``[G, N1, N2]``, plus ``acc``.

    ``a [M, N1]``, ``b [M, N2]`` (rows grouped by ``group_sizes``), or their K-major copies
    ``a [N1, M]``, ``b [N2, M]`` with ``k_major=True`` (required for FP8). Group sizes must
    be multiples of ``tile_k``; ``N1 % tile_m == 0`` and ``N2 % (2 * tile_n) == 0``. An empty
    group gives zeros. Accumulation is f32. ``varying``: as in :func:`gmm`. ``row_scale
    [N1]`` and ``col_scale [N2]`` (f32, both or neither) multiply the accumulator in the
    epilogue: ``out[g, i, j] = acc[g, i, j] * row_scale[i] * col_scale[j]``.
    ``live_rows [G]`` (optional): as in :func:`gmm`; the contraction stops after the tiles
    holding group ``g``'s first ``live_rows[g]`` rows (the rest are zero in ``a`` or ``b``).
    ``acc [G, N1, N2]`` in ``out_dtype`` (optional): added in the epilogue (after the
    scales), ``out = acc + a_g^T @ b_g``; an empty group gives ``acc[g]``. One kernel reads it
    where an add after the kernel would read both outputs and write a third: the weight
    gradients of several token chunks accumulate this way.
    """
    cfg = tiling or default_tiling(a.dtype, out_dtype)
    n1, rows = (a.shape if k_major else a.shape[::-1])
    n2, rows_b = (b.shape if k_major else b.shape[::-1])
    if rows != rows_b:
        raise ValueError(f"tgmm operands disagree: a {a.shape}, b {b.shape} (k_major={k_major}).")
    if n1 % cfg.tile_m or n2 % (2 * cfg.tile_n) or rows % cfg.tile_k:
        raise ValueError(f"tgmm needs N1 % {cfg.tile_m}, N2 % {2 * cfg.tile_n}, M % "
                         f"{cfg.tile_k} == 0; got N1={n1}, N2={n2}, M={rows}.")
    if jnp.dtype(a.dtype).itemsize == 1 and not k_major:
        raise ValueError("FP8 tgmm needs K-major operands (k_major=True).")
    n_groups = group_sizes.shape[0]
    start_tile, num_tiles = contraction_tiles(group_sizes, rows, cfg.tile_k, live_rows)
    scaled = row_scale is not None
    if scaled != (col_scale is not None):
        raise ValueError("tgmm: pass row_scale and col_scale together (or neither).")
    if scaled and (row_scale.shape != (n1,) or col_scale.shape != (n2,)):
        raise ValueError(f"tgmm: row_scale must be [{n1}] and col_scale [{n2}]; got "
                         f"{row_scale.shape}, {col_scale.shape}.")
    accumulate = acc is not None
    if accumulate and (acc.shape != (n_groups, n1, n2) or acc.dtype != jnp.dtype(out_dtype)):
        raise ValueError(f"tgmm: acc must be [{n_groups}, {n1}, {n2}] {jnp.dtype(out_dtype)} "
                         f"(the output's shape and dtype); got {acc.shape} {acc.dtype}.")
    body = functools.partial(_tgmm_body, cfg=cfg, k_major=k_major, scaled=scaled,
                             accumulate=accumulate)
    kernel = persistent_kernel(body, (n_groups, n1, n2), out_dtype, varying,
                     kernel_name("tgmm", a.dtype, n_groups))
    scales = (row_scale.astype(jnp.float32), col_scale.astype(jnp.float32)) if scaled else ()
    prior = (acc,) if accumulate else ()
    return vma.as_varying(kernel(start_tile, num_tiles, a, b, *scales, *prior), varying)
