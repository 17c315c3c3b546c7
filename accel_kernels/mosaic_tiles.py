"""The wgmma tile pipeline of the Mosaic GPU GEMM-like kernels (the grouped GEMMs of
`accel_kernels.gmm`, the symmetric product of `accel_kernels.symmetric`): tile sizes, a
persistent kernel over the SMs, the warp-specialized pipeline and the epilogue.

A kernel is persistent (one CTA per SM walks a list of output tiles, :func:`for_each_tile`)
and warp-specialized (:func:`warp_pipeline`): a memory warpgroup streams ``[tile_m, tile_k]`` /
``[tile_k, 2 tile_n]`` blocks into shared memory with TMA, two compute warpgroups each own
``tile_n`` columns of the CTA tile and accumulate in registers with ``wgmma`` (f32), and the
epilogue (:func:`epilogue`) stores through shared memory with TMA, optionally scaled by row
and column scales (FP8) or added to a prior output (accumulation). Only the tile bodies differ
between kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from accel_kernels import mosaic_gpu as mg
from accel_kernels.mosaic_gpu import pl, plgpu
from accel_kernels.tiling import check_fields, count, tile_size


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


def kernel_name(kind: str, dtype, n_groups: int) -> str:
    """The name a GEMM kernel carries in traces and lowered modules: ``gmm_fp8``,
    ``tgmm_bf16``; with one group (a dense GEMM, as `moe.fp8_dense` runs) ``dense_gmm_fp8``."""
    name = jnp.dtype(dtype).name
    bits = "fp8" if jnp.dtype(dtype).itemsize == 1 else {"bfloat16": "bf16"}.get(name, name)
    return f"{'dense_' if n_groups == 1 else ''}{kind}_{bits}"


AVOID = "backend='ragged_dot' (ragged layouts) or 'einsum' (padded)"
"""What keeps the layer off these GEMMs (for `accel_kernels.lowering.check_kernel_lowers`)."""


def persistent_kernel(body, out_shape: tuple[int, ...], out_dtype, varying: frozenset, name: str,
                      *, avoid: str = AVOID):
    """``body`` as a persistent kernel named ``name``: one CTA per SM, each of three
    warpgroups ("wg"); called on its operands it gives the one output (see
    :func:`accel_kernels.mosaic_gpu.call_kernel`; ``avoid``: the option its error names)."""

    def call(*operands):
        return mg.call_kernel(
            body, operands, [(out_shape, out_dtype)], name=name, avoid=avoid, varying=varying,
            grid=(mg.num_sms(),), grid_names=("sm",), num_threads=3, thread_name="wg",
            compiler_params=plgpu.CompilerParams(
                lowering_semantics=plgpu.LoweringSemantics.Warpgroup))[0]

    return call


def scaled(acc, row_scale, col_scale, smem, bars, wg):
    """``acc * row_scale[:, None] * col_scale[None, :]`` on a WGMMA accumulator (scales via TMA)."""
    rs_smem, cs_smem = smem
    plgpu.copy_gmem_to_smem(row_scale, rs_smem.at[wg], bars.at[2 * wg])
    plgpu.copy_gmem_to_smem(col_scale, cs_smem.at[wg], bars.at[2 * wg + 1])
    plgpu.barrier_wait(bars.at[2 * wg])
    plgpu.barrier_wait(bars.at[2 * wg + 1])
    rs = mg.load(rs_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
    cs = mg.load(cs_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
    return (acc * lax.broadcast_in_dim(rs, acc.shape, [0])
            * lax.broadcast_in_dim(cs, acc.shape, [1]))


def epilogue(acc, out_smem, out_tile, wg, cfg: MosaicTiling, prior=None):
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
                before = mg.load(out_smem.at[wg, slot], layout=plgpu.Layout.WGMMA,
                              optimized=False)
                part = (part + before.astype(part.dtype)).astype(out_smem.dtype)
            out_smem[wg, slot] = part
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_tile.at[rows, cols])


def epilogue_smem(out_dtype, cfg: MosaicTiling):
    return plgpu.SMEM((2, 2, cfg.epi_m, cfg.epi_n), out_dtype,
                      transforms=mg.smem_transforms(cfg.epi_n, out_dtype))


def zero_tile(out_smem, out_tile, wg, cfg: MosaicTiling, prior=None):
    """Compute warpgroups store a zero ``[tile_m, tile_n]`` tile, or with ``prior`` a copy of
    the prior tile (the memory one idles)."""

    @pl.when(wg < 2)
    def _():
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n)))
        def _(acc_ref):
            epilogue(acc_ref[...], out_smem, out_tile, wg, cfg, prior)


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
        out_smem=epilogue_smem(out_dtype, cfg),
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


def tile_context(scope: TileScope, out_tile, scale_refs, cfg: MosaicTiling, prior_tile=None,
                 *, store=None):
    """The compute warpgroups' context: accumulate the pipeline in f32 registers, multiply by
    ``scale_refs()`` (row and column scale refs; None: unscaled), add ``prior_tile`` (a ref,
    or None), store into ``out_tile``; ``store(acc)``, if given, stores the accumulator in
    place of :func:`epilogue` (``out_tile`` and ``prior_tile`` then unused)."""

    def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n)))
        def _(acc_ref):
            eval_pipeline(acc_ref)
            acc = acc_ref[...]
            if scale_refs is not None:
                acc = scaled(acc, *scale_refs(), scope.scale_smem, scope.scale_bars, scope.wg)
            if store is not None:
                store(acc)
            else:
                epilogue(acc, scope.out_smem, out_tile, scope.wg, cfg, scope.prior(prior_tile))

    return compute_context


# ----------------------------------------------------------------------------------------------
