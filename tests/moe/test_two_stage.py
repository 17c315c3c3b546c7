"""The exchange past one host (``DispatchOptions.host_axis``) does not change the math.

On 8 simulated CPU devices as 2 hosts x 4 (mesh ``('host', 'expert')``, the expert axis both),
the two-stage layer's output and every gradient (tokens, router, expert banks) equal the one-
stage layer's (f32, rtol 1e-5): dense and dropless, bf16 and FP8 wires, chunked, with group-
limited routing aligned to the hosts, and with the dropless overflow pass. Its compiled
program sends fewer bytes across hosts; ``host_axis='auto'`` on one process keeps the one-stage
program as it was; ``'auto'`` finds the host axis from the devices' processes.
"""

import functools
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _meshes import make_mesh

import moe
from moe.options import resolve_host_axis, two_stage_pays
from xla_comm import schedule

E, K, D, F = 8, 2, 64, 32
AXES = ("host", "expert")


def _params(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {"router": jax.random.normal(k[0], (D, E)),
            "wgu": jax.random.normal(k[1], (E, D, 2 * F)) * 0.2,
            "wd": jax.random.normal(k[2], (E, F, D)) * 0.2}


def _options(host_axis, chunks, options):
    return moe.MoEOptions.create(E, options.pop("top_k", K), expert_axis=AXES,
                                 host_axis=host_axis, overlap_chunks=chunks, fp8_block_size=32,
                                 **options)


@functools.cache
def _compiled(host_axis, chunks, items):
    mesh = make_mesh((2, 4), AXES)
    opts = _options(host_axis, chunks, dict(items))

    def loss(x, p, ct):
        y, aux = moe.moe_apply(x, p["router"], p["wgu"], p["wd"], options=opts, mesh=mesh)
        return jnp.sum(y * ct) + aux["load_balance_loss"], (y, aux)

    x = jax.ShapeDtypeStruct((4, 32, D), jnp.float32)
    p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _params())
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)).lower(
        x, p, x).compile()


def _run(host_axis, chunks, items, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed + 1))
    x = jax.random.normal(k1, (4, 32, D))
    ct = jax.random.normal(k2, (4, 32, D))
    (_, (y, aux)), grads = _compiled(host_axis, chunks, items)(x, _params(seed), ct)
    return jax.tree.map(np.asarray, (y, aux, grads))


CASES = {
    # the second chunk's FP8 exchange through both stages; the first chunk's local pass
    # (local_first) keeps its own-host slots out of them
    "dense-fp8-local-first": (2, dict(transport="dense", dispatch_dtype="fp8",
                                      combine_grad_dtype="fp8", local_first=True)),
    # a small first bucket: the slots past either stage's bucket take the overflow pass
    "dropless-bf16-overflow": (1, dict(transport="dropless", dispatch_dtype="bf16",
                                       combine_grad_dtype="bf16", capacity_factor=0.3)),
    # node-limited: 2 groups (one per host), each token within 1 of them; top-3
    "dropless-fp8-node-limited": (2, dict(transport="dropless", dispatch_dtype="fp8",
                                          combine_grad_dtype="fp8", num_groups=2,
                                          topk_groups=1, top_k=3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_two_stage_layer_equals_the_one_stage_one(name):
    chunks, options = CASES[name]
    items = tuple(sorted(options.items()))
    one = _run(None, chunks, items)
    two = _run("host", chunks, items)
    assert int(one[1]["dropped_slots"]) == int(two[1]["dropped_slots"]) == 0
    chex.assert_trees_all_close(two, one, rtol=1e-5, atol=1e-5)


_HW = schedule.Hardware(gemm_tflops=600, fp8_gemm_tflops=1200, hbm_GBps=2000, link_GBps=150,
                        inter_host_GBps=50, devices_per_host=4)


def _cross_host_bytes(compiled) -> float:
    """The all-to-alls' bytes to other hosts per device and step (a step that overflows no
    bucket: the replay's first branch of each conditional)."""
    return schedule.schedule_report(compiled, _HW).summary(("all-to-all",))["cross_host_bytes"]


def test_two_stage_sends_fewer_bytes_across_hosts():
    """Top-3 limited to one of the 2 hosts: a token crosses once where 3 slots did (the
    exchanges' bytes; the counts, weights and ids add a little)."""
    chunks, options = CASES["dropless-fp8-node-limited"]
    items = tuple(sorted(options.items()))
    one, two = (_cross_host_bytes(_compiled(h, chunks, items)) for h in (None, "host"))
    assert 0 < two < 0.6 * one


def test_auto_on_one_process_keeps_the_one_stage_program():
    mesh = make_mesh((2, 4), AXES)
    x = jax.ShapeDtypeStruct((4, 32, D), jnp.float32)
    p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _params())

    def text(host_axis):
        opts = _options(host_axis, 2, dict(transport="dense", dispatch_dtype="fp8"))
        return jax.jit(lambda x, p: moe.moe_apply(x, p["router"], p["wgu"], p["wd"],
                                                  options=opts, mesh=mesh)).lower(x, p).as_text()

    assert text("auto") == text(None)


def _fake_mesh(process_of):
    """A mesh-like object of 2 x 4 devices whose process is ``process_of(host, local)``."""
    devices = np.array([[types.SimpleNamespace(process_index=process_of(h, i))
                         for i in range(4)] for h in range(2)])
    return types.SimpleNamespace(devices=devices, axis_names=AXES,
                                 shape={"host": 2, "expert": 4})


def test_auto_finds_the_axis_that_crosses_processes():
    options = moe.DispatchOptions(expert_axis=AXES)
    assert resolve_host_axis(options, _fake_mesh(lambda h, i: h), "dense") == "host"
    assert resolve_host_axis(options, _fake_mesh(lambda h, i: i), "dense") is None
    assert resolve_host_axis(options, _fake_mesh(lambda h, i: h), "ragged") is None
    # 'auto' takes two stages only where they send fewer rows across hosts: a token's
    # slots reach fewer hosts than top_k (3 slots, 2 hosts) but not top-2 on 2 hosts.
    fake = _fake_mesh(lambda h, i: h)
    assert resolve_host_axis(options, fake, "dense", moe.RouterConfig(8, 3), 8) == "host"
    assert resolve_host_axis(options, fake, "dense", moe.RouterConfig(8, 2), 8) is None
    named = moe.DispatchOptions(expert_axis=AXES, host_axis="host")
    assert resolve_host_axis(named, _fake_mesh(lambda h, i: 0), "dense") == "host"
    with pytest.raises(ValueError, match="first name of expert_axis"):
        moe.DispatchOptions(expert_axis=AXES, host_axis="expert")


def test_auto_takes_two_stages_only_where_the_first_sends_fewer_bytes_across_hosts(
        monkeypatch):
    """Per token and training step, a first-stage row crosses as the wire row, the host's sum,
    the output gradient and the input gradient's sum (three in the tokens' dtype) where a
    one-stage slot's crosses as two wire rows and two in the tokens' dtype: fewer rows
    (``k_1 < k``) pay only while they outweigh that."""
    fp8 = moe.DispatchOptions(expert_axis=AXES, dispatch_dtype="fp8", combine_grad_dtype="fp8")
    # DeepSeek-V3, d 7168: a one-stage slot 2 x 7224 + 2 x 14336 = 43120 B; a first-stage row
    # 7224 + 3 x 14336 + 12 x 8 = 50328 B. 4 rows for 8 slots pay; 7 do not.
    assert two_stage_pays(8, 4, 7168, fp8) and not two_stage_pays(8, 7, 7168, fp8)
    assert two_stage_pays(8, 6, 7168, fp8)  # 301968 < 344960
    # Shape A: top-2 reaching 2 hosts sends as many rows, each heavier.
    assert not two_stage_pays(2, 2, 2048, fp8)
    # With the tokens' dtype on the wire every pass weighs the same: fewer rows pay.
    plain = moe.DispatchOptions(expert_axis=AXES)
    assert two_stage_pays(8, 7, 7168, plain) and not two_stage_pays(8, 8, 7168, plain)
    assert not two_stage_pays(8, 7, 7168, fp8, token_bytes=4)
    fake = _fake_mesh(lambda h, i: h)
    top3, top2 = moe.RouterConfig(8, 3), moe.RouterConfig(8, 2)
    assert resolve_host_axis(fp8, fake, "dense", top3, 8, d_model=256) == "host"
    assert resolve_host_axis(fp8, fake, "dense", top2, 8, d_model=256) is None
    # The layer's resolution weighs its own widths (here on a mesh whose rows are 2 "hosts").
    monkeypatch.setattr(moe.options, "device_hosts", lambda mesh: np.repeat([[0], [1]], 4, 1))
    mesh = make_mesh((2, 4), AXES)
    for k, two in ((3, True), (2, False)):
        opts = moe.MoEOptions.create(8, k, expert_axis=AXES, transport="dense",
                                     dispatch_dtype="fp8", combine_grad_dtype="fp8",
                                     fp8_block_size=32)
        assert opts.resolve(64, 256, 128, mesh=mesh).two_stage is two
