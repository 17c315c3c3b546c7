"""The two-stage exchange's per-stage capacity and its dropless split, on 8 simulated CPU
devices as 2 hosts x 4.

The capacity rule (``moe.dispatch.plan.two_stage_sizes``, ``moe.dispatch.plan_build
.two_stage_plan``) is pinned against a loop over the slots: stage 1 keeps, per (source device,
destination host), the first ``C_1`` tokens with a slot there (token order); stage 2 keeps,
per (forwarding device, expert), the first ``C_2`` slots of the rows it holds, in (source
host, token, slot) order. The dropless split (``split_two_stage``) never gives a stage more
rows than its one bucket.
"""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from _meshes import make_mesh
from jax.sharding import PartitionSpec as P

import moe
from moe.dispatch import combine, dispatch_apply
from moe.dispatch.plan import TwoStageSizes, two_stage_sizes
from moe.dispatch.plan_build import split_two_stage

H, L, E, K, T, D = 2, 4, 16, 4, 16, 8
AXES = ("host", "local")


def _ids(seed: int, skew: float = 0.0) -> np.ndarray:
    """Distinct expert ids ``[P * T, K]`` (``skew`` > 0 favours the low experts)."""
    rng = np.random.default_rng(seed)
    p = np.exp(-skew * np.arange(E))
    return np.stack([rng.choice(E, K, replace=False, p=p / p.sum())
                     for _ in range(H * L * T)]).astype(np.int32)


def _reference_kept(ids: np.ndarray, c1: int, c2: int) -> np.ndarray:
    """bool ``[P, T, K]``: the slots the two stages keep, by the rule in the docstring."""
    ids = ids.reshape(H * L, T, K)
    per_host = E // H
    sent = np.zeros((H * L, T, H), bool)
    for d in range(H * L):
        count = [0] * H
        for t in range(T):
            for h in sorted({int(e) // per_host for e in ids[d, t]}):
                sent[d, t, h] = count[h] < c1
                count[h] += 1
    kept = np.zeros(ids.shape, bool)
    for h_dst in range(H):
        for local in range(L):
            count = collections.Counter()
            for h_src in range(H):
                d = h_src * L + local
                for t in range(T):
                    for j in range(K):
                        e = int(ids[d, t, j])
                        if e // per_host == h_dst and sent[d, t, h_dst]:
                            kept[d, t, j] = count[e] < c2
                            count[e] += 1
    return kept


@functools.cache
def _dense_fn(cf: float):
    mesh = make_mesh((H, L), AXES, axis_type="auto")
    options = moe.DispatchOptions(expert_axis=AXES, host_axis="host", transport="dense",
                                  capacity_factor=cf, capacity_multiple=1)
    e_local = E // (H * L)

    def body(x, ids, w):
        d = dispatch_apply(x, ids, num_experts=E, options=options)
        first = jax.lax.axis_index(AXES) * e_local
        scale = (first + jnp.arange(e_local) + 1).astype(x.dtype)[:, None, None]
        y = combine(d.expert_x * scale, w, d.plan)
        return y, d.plan.kept, d.plan.dropped[None]

    spec = P(AXES)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec),
                                 out_specs=(spec, spec, spec)))


def test_dense_capacity_applies_per_stage():
    cf = 0.5
    sizes = two_stage_sizes("dense", T, K, min(K, H), E, H, H * L, cf, multiple=1)
    assert sizes == TwoStageSizes(8, 4)  # C_1 = ceil(0.5 * 16 * 2 / 2), C_2 = 0.5 * 2*16*4/16
    ids = _ids(0, skew=0.15)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(H * L * T, D)).astype(np.float32)
    w = rng.uniform(size=(H * L * T, K)).astype(np.float32)
    y, kept, dropped = jax.tree.map(np.asarray, _dense_fn(cf)(x, ids, w))
    want_kept = _reference_kept(ids, *sizes).reshape(-1, K)
    assert 0 < (~want_kept).sum() < want_kept.size  # both stages drop some (not all)
    np.testing.assert_array_equal(kept, want_kept)
    assert int(dropped.sum()) == int((~want_kept).sum())
    want = np.sum(np.where(want_kept, w * (ids + 1), 0.0), axis=1)[:, None] * x
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


@functools.cache
def _split_fn(sizes: TwoStageSizes):
    mesh = make_mesh((H, L), AXES, axis_type="auto")

    def body(ids):
        s = split_two_stage(ids, num_experts=E, axis_size=H * L, host_axis="host", sizes=sizes)
        return s.first_ids, s.overflow_ids, s.overflows[None]

    spec = P(AXES)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec)))


def test_dropless_split_fits_each_stage_bucket():
    sizes = TwoStageSizes(6, 5)
    ids = _ids(2, skew=0.3)
    ids[::7, 0] = E  # some masked slots: in neither part
    first, over, flags = map(np.asarray, _split_fn(sizes)(ids))
    routed = ids < E
    np.testing.assert_array_equal(np.where(first < E, first, over), np.where(routed, ids, E))
    assert not np.any((first < E) & (over < E))
    assert flags.any() and (over < E).any()
    first = first.reshape(H * L, T, K)
    per_host, e_local = E // H, E // (H * L)
    for d in range(H * L):  # stage 1: tokens per (source, host)
        hosts = first[d] // per_host
        for h in range(H):
            assert np.sum(np.any(hosts == h, axis=1)) <= sizes.first
        np.testing.assert_array_equal(flags[d], np.any(over.reshape(H * L, T, K)[d] < E))
    for local in range(L):  # stage 2: slots per (forwarding device, destination)
        rows = first[[h * L + local for h in range(H)]]
        dest = rows[rows < E] // e_local
        assert np.bincount(dest, minlength=H * L).max() <= sizes.second
