"""Pipelined expert parallelism (``DispatchOptions.overlap_chunks``) does not change the math.

With nothing dropped, the chunked layer's output and every gradient (tokens, router, expert
banks, shared experts) equal the unchunked layer's on 8 simulated CPU devices (f32, rtol 1e-5),
for the dense and dropless transports and the bf16 and FP8 wires; a token count that does not
split into the chunks is padded exactly; a capacity limit applies per chunk; and each chunk
runs its own exchanges (the compiled program holds a chunk's worth of all-to-alls per chunk).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _meshes import make_mesh

import moe
from xla_comm.hlo import analyze_collectives

E, K, D, F, F_SHARED = 8, 2, 64, 32, 32


def _params(seed=0, shared=True):
    k = jax.random.split(jax.random.key(seed), 5)
    p = {"router": jax.random.normal(k[0], (D, E)),
         "wgu": jax.random.normal(k[1], (E, D, 2 * F)) * 0.2,
         "wd": jax.random.normal(k[2], (E, F, D)) * 0.2}
    if shared:
        p["shared"] = (jax.random.normal(k[3], (D, 2 * F_SHARED)) * 0.2,
                       jax.random.normal(k[4], (F_SHARED, D)) * 0.2)
    return p


@functools.cache
def _grad_fn(mesh_shape, chunks, **options):
    mesh = make_mesh(mesh_shape)
    opts = moe.MoEOptions.create(E, K, overlap_chunks=chunks, fp8_block_size=32, **options)

    def loss(x, p, ct):
        y, aux = moe.moe_apply(x, p["router"], p["wgu"], p["wd"], shared=p.get("shared"),
                               options=opts, mesh=mesh)
        return jnp.sum(y * ct) + aux["load_balance_loss"], (y, aux)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _run(mesh_shape, chunks, tokens=(4, 32), seed=0, **options):
    k1, k2 = jax.random.split(jax.random.key(seed + 1))
    x = jax.random.normal(k1, (*tokens, D))
    ct = jax.random.normal(k2, (*tokens, D))
    (_, (y, aux)), grads = _grad_fn(mesh_shape, chunks, **options)(x, _params(seed), ct)
    return jax.tree.map(np.asarray, (y, aux, grads))


CASES = [
    ((2, 4), dict(transport="dense"), 2),
    ((1, 8), dict(transport="dense", dispatch_dtype="fp8", combine_grad_dtype="fp8"), 4),
    ((2, 4), dict(transport="dropless"), 4),
    ((1, 8), dict(transport="dropless", dispatch_dtype="fp8", combine_grad_dtype="fp8"), 2),
]


@pytest.mark.parametrize("mesh_shape,options,chunks", CASES,
                         ids=["dense", "dense-fp8", "dropless", "dropless-fp8"])
def test_chunked_layer_equals_the_unchunked_one(mesh_shape, options, chunks):
    one = _run(mesh_shape, 1, **options)
    many = _run(mesh_shape, chunks, **options)
    assert int(one[1]["dropped_tokens"]) == int(many[1]["dropped_tokens"]) == 0
    chex.assert_trees_all_close(many, one, rtol=1e-5, atol=1e-5)


def test_a_token_count_that_does_not_split_is_padded_exactly():
    """60 tokens over 8 devices and 4 chunks: padded with masked tokens to 64."""
    one = _run((2, 4), 1, tokens=(3, 20), transport="dense")
    many = _run((2, 4), 4, tokens=(3, 20), transport="dense")
    assert many[0].shape == (3, 20, D)
    chex.assert_trees_all_close(many, one, rtol=1e-5, atol=1e-5)
    assert int(np.sum(many[1]["tokens_per_expert"])) == 60 * K


def test_capacity_applies_per_chunk():
    """With a capacity limit, chunk ``c`` of every device is dispatched as the unchunked layer
    would dispatch those tokens alone (capacity from the chunk's tokens): the chunked output
    equals the unchunked layer's on each chunk, and the drops add up."""
    chunks, per_device = 4, 64
    x = jax.random.normal(jax.random.key(5), (1, 8 * per_device, D))
    ct = jnp.zeros_like(x)
    p = _params(shared=False)
    opts = dict(capacity_factor=1.0, transport="dense")
    (_, (y, aux)), _ = _grad_fn((1, 8), chunks, **opts)(x, p, ct)
    assert int(aux["dropped_tokens"]) > 0
    # device i's chunk c: tokens [i * 64 + c * 16, ... + 16); the global chunk c is all of them
    parts = x.reshape(8, chunks, per_device // chunks, D)
    y_parts = np.asarray(y).reshape(8, chunks, per_device // chunks, D)
    dropped = 0
    for c in range(chunks):
        xc = parts[:, c].reshape(1, -1, D)
        (_, (yc, auxc)), _ = _grad_fn((1, 8), 1, **opts)(xc, p, jnp.zeros_like(xc))
        np.testing.assert_allclose(y_parts[:, c], np.asarray(yc).reshape(8, -1, D),
                                   rtol=1e-5, atol=1e-5)
        dropped += int(auxc["dropped_tokens"])
    assert dropped == int(aux["dropped_tokens"])


def test_each_chunk_runs_its_own_exchanges():
    """Compiled for 8 CPU devices: the dense layer's forward + backward holds four payload
    all-to-alls per chunk (dispatch and combine, each forward and backward)."""
    x = jnp.zeros((4, 32, D))
    counts = {}
    for chunks in (1, 2):
        fn = _grad_fn((1, 8), chunks, transport="dense")
        rep = analyze_collectives(fn.lower(x, _params(), x).compile())
        payload = [c for c in rep.of_kind("all-to-all") if c.buffer_bytes >= 16 * D]
        counts[chunks] = len(payload)
    assert counts[2] == 2 * counts[1] and counts[1] >= 4, counts


def test_overlap_chunks_is_validated():
    with pytest.raises(ValueError, match="overlap_chunks must be 'auto' or an int >= 1"):
        moe.DispatchOptions(overlap_chunks=0)
    assert moe.auto_overlap_chunks(1, 1 << 20, "dropless") == 1
    assert moe.auto_overlap_chunks(8, 1 << 20, "dropless") == moe.layer.OVERLAP_CHUNKS["dropless"]
