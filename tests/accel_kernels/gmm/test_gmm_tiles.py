"""The Mosaic grouped GEMMs' tile maps (`accel_kernels.gmm.mosaic_kernel`), checked row by row
on the
CPU.

The kernels themselves need a Hopper GPU (CI lowers them, tests/moe/test_fp8_lowering.py); which
tiles they compute is plain index arithmetic: every row that may be nonzero (the first
``live_rows[g]`` of group ``g``) must lie in a computed tile of its own group, and a skipped
tile may hold only rows past ``live_rows``.
"""

import jax
import numpy as np
import pytest

from accel_kernels.gmm import mosaic_kernel as gmm_mosaic

TILE = 128
# jitted: one program per call shape (eagerly every op of the index arithmetic compiles its own)
_tile_groups = jax.jit(gmm_mosaic.tile_groups, static_argnums=(1, 2))
_contraction_tiles = jax.jit(gmm_mosaic.contraction_tiles, static_argnums=(1, 2))


def _layout(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 5, size=6) * TILE  # aligned groups, some empty
    live = np.minimum(sizes, rng.integers(0, 5 * TILE, size=6))
    rows = int(sizes.sum()) + 2 * TILE  # padding tiles past the groups
    return sizes.astype(np.int32), live.astype(np.int32), rows


def _group_and_offset(sizes, rows):
    """Per row: its group (G past the groups) and its offset inside the group."""
    ends = np.cumsum(sizes)
    g = np.searchsorted(ends, np.arange(rows), side="right")
    start = np.concatenate([[0], ends])[np.minimum(g, len(sizes))]
    return g, np.arange(rows) - start


@pytest.mark.parametrize("seed", range(4))
def test_gmm_tiles_cover_the_live_rows_and_skip_only_dead_ones(seed):
    sizes, live, rows = _layout(seed)
    tiles = np.asarray(_tile_groups(sizes, rows, TILE, live))
    plain = np.asarray(_tile_groups(sizes, rows, TILE))
    g, off = _group_and_offset(sizes, rows)
    n = len(sizes)
    row_tile = tiles[np.arange(rows) // TILE]
    is_live = (g < n) & (off < live[np.minimum(g, n - 1)])
    np.testing.assert_array_equal(row_tile[is_live], g[is_live])  # computed, right group
    assert np.all(~is_live[row_tile == n])  # a skipped tile holds no live row
    assert np.all((tiles == plain) | (tiles == n))  # live_rows only ever skips
    assert (tiles == n).sum() > (plain == n).sum() or np.all(live == sizes)


@pytest.mark.parametrize("seed", range(4))
def test_tgmm_contraction_covers_the_live_rows_inside_the_group(seed):
    sizes, live, rows = _layout(seed)
    tk = 64
    first, count = map(np.asarray, _contraction_tiles(sizes, rows, tk, live))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    np.testing.assert_array_equal(first * tk, starts)
    assert np.all(count * tk >= live)  # every live row is contracted
    assert np.all(count * tk <= sizes)  # never past the group
    assert np.all(count * tk < live + tk)  # and no whole tile past its live rows
    _, full = map(np.asarray, _contraction_tiles(sizes, rows, tk))
    np.testing.assert_array_equal(full * tk, sizes)
