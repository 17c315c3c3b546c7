"""Pipelined expert parallelism (``DispatchOptions.overlap_chunks``) does not change the math.

With nothing dropped, the chunked layer's output and every gradient (tokens, router, expert
banks, shared experts) equal the unchunked layer's on 8 simulated CPU devices (f32, rtol 1e-5),
for the dense and dropless transports and the bf16 and FP8 wires; a token count that does not
split into the chunks is padded exactly; a capacity limit applies per chunk; each chunk
runs its own exchanges (the compiled program holds a chunk's worth of all-to-alls per chunk);
and the first chunk's local pass (``local_first``) changes none of it.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _meshes import make_mesh

import moe
from moe.dispatch import dispatch_buckets, split_first_bucket
from xla_comm.hlo import analyze_collectives, count_outside_branches

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


def _grad_fn(mesh_shape, chunks, **options):
    """The jitted gradient program, one per (mesh, chunks, options) whatever the keywords'
    order: the tests that share a program compile it once."""
    return _cached_grad_fn(mesh_shape, chunks, tuple(sorted(options.items())))


@functools.cache
def _cached_grad_fn(mesh_shape, chunks, items):
    mesh = make_mesh(mesh_shape)
    opts = moe.MoEOptions.create(E, K, overlap_chunks=chunks, fp8_block_size=32, **dict(items))

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
    # the 'mosaic' GEMMs (their XLA emulation on the CPU) add the next chunk's weight
    # gradient in the weight-gradient GEMM itself
    ((2, 4), dict(transport="dense", gemm_implementation="mosaic"), 4),
    ((1, 8), dict(transport="dropless", gemm_implementation="mosaic"), 2),
]


@pytest.mark.parametrize("mesh_shape,options,chunks", CASES,
                         ids=["dense", "dense-fp8", "dropless", "dropless-fp8", "dense-mosaic",
                              "dropless-mosaic"])
def test_chunked_layer_equals_the_unchunked_one(mesh_shape, options, chunks):
    one = _run(mesh_shape, 1, **options)
    many = _run(mesh_shape, chunks, **options)
    assert int(one[1]["dropped_slots"]) == int(many[1]["dropped_slots"]) == 0
    chex.assert_trees_all_close(many, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh_shape,options,chunks", [CASES[0], CASES[3]],
                         ids=["dense", "dropless-fp8"])
def test_local_first_equals_the_exchanged_pass(mesh_shape, options, chunks):
    """``local_first`` (the first chunk's own-expert slots through the local experts with no
    exchange) gives the layer's output and gradients of the all-exchanged layer (its
    default); with E_local = 1 < top_k on the (1, 8) mesh the local pass keeps one column
    per token."""
    ref = _run(mesh_shape, chunks, **options)
    local = _run(mesh_shape, chunks, local_first=True, **options)
    chex.assert_trees_all_close(local, ref, rtol=1e-5, atol=1e-5)


def test_local_first_keeps_the_exchange_capacity():
    """With a capacity limit that drops slots, the local pass keeps exactly the slots of
    this device's own experts that the exchange would keep (the same ``C`` per (source,
    expert)): the same drops, outputs and gradients."""
    x = jax.random.normal(jax.random.key(5), (1, 8 * 64, D))
    ct = jax.random.normal(jax.random.key(6), x.shape)
    p = _params(shared=False)
    opts = dict(capacity_factor=1.0, transport="dense")
    (_, (y, aux)), g = _grad_fn((1, 8), 4, **opts)(x, p, ct)
    (_, (y2, aux2)), g2 = _grad_fn((1, 8), 4, local_first=True, **opts)(x, p, ct)
    assert int(aux["dropped_slots"]) > 0
    for count in ("dropped_slots", "dropped_tokens"):  # the local pass's drops are counted too
        assert int(aux2[count]) == int(aux[count]), count
    chex.assert_trees_all_close((y2, g2), (y, g), rtol=1e-5, atol=1e-5)


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
    assert int(aux["dropped_slots"]) > 0
    # device i's chunk c: tokens [i * 64 + c * 16, ... + 16); the global chunk c is all of them
    parts = x.reshape(8, chunks, per_device // chunks, D)
    y_parts = np.asarray(y).reshape(8, chunks, per_device // chunks, D)
    dropped = np.zeros(2, int)  # slots, tokens
    for c in range(chunks):
        xc = parts[:, c].reshape(1, -1, D)
        (_, (yc, auxc)), _ = _grad_fn((1, 8), 1, **opts)(xc, p, jnp.zeros_like(xc))
        np.testing.assert_allclose(y_parts[:, c], np.asarray(yc).reshape(8, -1, D),
                                   rtol=1e-5, atol=1e-5)
        dropped += [int(auxc["dropped_slots"]), int(auxc["dropped_tokens"])]
    assert dropped.tolist() == [int(aux["dropped_slots"]), int(aux["dropped_tokens"])]


def test_each_chunk_runs_its_own_exchanges():
    """Compiled for 8 CPU devices: the dense layer's forward + backward holds four payload
    all-to-alls per chunk (dispatch and combine, each forward and backward), while the chunks'
    dispatch plans are built in one batched pass: as many sorts and count exchanges as the
    unchunked layer's. With ``local_first`` the first chunk's own-expert pass exchanges
    nothing: the same all-to-alls."""
    # the (2, 4) programs of test_chunked_layer_equals_the_unchunked_one[dense] and
    # test_local_first_equals_the_exchanged_pass[dense]: compiled once for all three
    x = jnp.zeros((4, 32, D))
    counts, gathers, sorts = {}, {}, {}
    for chunks in (1, 2):
        fn = _grad_fn((2, 4), chunks, transport="dense")
        compiled = fn.lower(x, _params(), x).compile()
        rep = analyze_collectives(compiled)
        payload = [c for c in rep.of_kind("all-to-all") if c.buffer_bytes >= 16 * D]
        counts[chunks] = len(payload)
        gathers[chunks] = len(rep.of_kind("all-gather"))  # the plans' count exchanges
        sorts[chunks] = sum(" sort(" in line and "dispatch_plan" in line
                            for line in compiled.as_text().splitlines())
    assert counts[2] == 2 * counts[1] and counts[1] >= 4, counts
    assert gathers[2] == gathers[1] >= 1 and sorts[2] == sorts[1] == 1, (gathers, sorts)
    compiled = _grad_fn((2, 4), 2, local_first=True, transport="dense").lower(
        x, _params(), x).compile()
    rep = analyze_collectives(compiled)
    assert len([c for c in rep.of_kind("all-to-all") if c.buffer_bytes >= 16 * D]) == counts[2]


def test_chunks_accumulate_the_weight_gradients_in_the_kernel():
    """Lowered for CUDA ('mosaic' GEMMs, bf16, dense transport): the unchunked layer's
    backward adds no expert bank; the 2-chunk one adds none either (its first chunk's
    weight-gradient kernels start from the second chunk's), where summing the chunks'
    gradients adds each bank once; so does the first chunk's local pass (``local_first``).
    (The pipelined dropless layer's overflow pass, a conditional of its own, still adds its
    gradient to the chunks'.)"""
    transport = "dense"
    from _cuda_export import cuda_mesh, export_for_cuda

    e_local, d, f = 4, 256, 128
    mesh = cuda_mesh((1, 2), ("data", "expert"))
    bank_types = (f"tensor<{e_local}x{d}x{2 * f}xbf16>", f"tensor<{e_local}x{f}x{d}xbf16>")

    def bank_adds(chunks, local_first=False):
        opts = moe.MoEOptions.create(2 * e_local, K, transport=transport,
                                     gemm_implementation="mosaic", overlap_chunks=chunks,
                                     local_first=local_first)

        def loss(x, router, w_gate_up, w_down):
            y, _ = moe.moe_apply(x, router, w_gate_up, w_down, options=opts, mesh=mesh)
            return jnp.sum(y.astype(jnp.float32))

        def sds(shape, dtype, spec):
            return jax.ShapeDtypeStruct(shape, dtype,
                                        sharding=jax.sharding.NamedSharding(mesh, spec))

        P = jax.sharding.PartitionSpec
        text = export_for_cuda(
            jax.grad(loss, argnums=(2, 3)), sds((2, 2048, d), jnp.bfloat16, P("expert")),
            sds((d, 2 * e_local), jnp.float32, P()),
            sds((2 * e_local, d, 2 * f), jnp.bfloat16, P("expert")),
            sds((2 * e_local, f, d), jnp.bfloat16, P("expert")))
        return sum(1 for ln in text.splitlines()
                   if "stablehlo.add" in ln and any(f": {t} " in ln for t in bank_types))

    assert bank_adds(1) == 0
    assert bank_adds(2) == 0
    assert bank_adds(2, local_first=True) == 0  # the local pass chains the banks on too


def test_overlap_chunks_is_validated():
    with pytest.raises(ValueError, match="overlap_chunks must be 'auto' or an int >= 1"):
        moe.DispatchOptions(overlap_chunks=0)
    with pytest.raises(TypeError, match="local_first must be True or False"):
        moe.DispatchOptions(local_first="yes")
    assert moe.auto_overlap_chunks(1, 1 << 20, "dropless") == 1
    assert moe.auto_overlap_chunks(8, 1 << 20, "dropless") == moe.options.OVERLAP_CHUNKS["dropless"]


def _skewed(tokens, seed, towards, strength):
    """Tokens with a shared component along the router's column ``towards``: the larger
    ``strength``, the more of them pick that expert."""
    x = jax.random.normal(jax.random.key(seed + 1), (*tokens, D))
    col = _params(0)["router"][:, towards]
    return x + strength * col / jnp.linalg.norm(col)


@functools.partial(jax.jit, static_argnames=("first_bucket", "devices", "chunks"))
def _overflows(x, router, first_bucket, devices=8, chunks=2):
    """Whether some (device, chunk) source sends a device more slots than the first bucket
    (top-k of the router logits; mesh (1, 8): device i holds the i-th block of tokens).
    Jitted: one program for every case, not one per eager op."""
    ids = jax.lax.top_k(x.reshape(-1, D) @ router, K)[1]
    return jnp.stack([split_first_bucket(
        part, num_experts=E, axis_size=8, first_bucket=first_bucket).overflows
        for part in ids.reshape(devices * chunks, -1, K)]).any()


# One compiled program per wire and chunk count serves every skew: the data alone decides
# whether the overflow pass runs (the first bucket, 16 rows for a chunk's 32 tokens, is the
# same for the default capacity factor 1.25 as for 2.0).
@pytest.mark.parametrize("skew,wire", [
    (0.0, "bf16"), (0.5, "bf16"), (1.0, "bf16"), (3.0, "bf16"), (1.0, "fp8")],
    ids=["first-bucket", "overflow-8", "overflow-16", "overflow-64", "overflow-16-fp8"])
def test_pipelined_dropless_sends_overflow_in_its_own_pass(skew, wire):
    """The pipelined dropless layer splits each chunk's slots at the first exchange bucket
    (``moe.pipeline``): with every pair within it, and with tokens skewed towards one expert
    so that some pair holds more slots than the first bucket (the overflow pass then runs on
    8, 16 or all 64 tokens per device, the last in two passes of a chunk's 32), output and
    every gradient equal the unchunked layer's (f32, 1e-5 of each leaf's largest value: 512
    tokens summed in another order), with the bf16 and the FP8 wire."""
    tokens, opts = (4, 128), dict(transport="dropless")
    if wire == "fp8":
        opts.update(dispatch_dtype="fp8", combine_grad_dtype="fp8")
    buckets = dispatch_buckets(32, K, num_experts=E, axis_size=8,
                               options=moe.DispatchOptions(**opts))
    assert len(buckets) > 1  # 2 chunks of 32 tokens per device: the layer splits
    x = _skewed(tokens, 3, 7, skew)
    ct = jax.random.normal(jax.random.key(5), (*tokens, D))
    p = _params(0)
    assert bool(_overflows(x, p["router"], buckets[0])) == (skew > 0)
    one = _grad_fn((1, 8), 1, **opts)(x, p, ct)
    many = _grad_fn((1, 8), 2, **opts)(x, p, ct)
    one, many = (jax.tree.map(np.asarray, t) for t in (one, many))  # no eager programs
    scale = jax.tree.map(lambda a: max(float(np.max(np.abs(a))), 1.0), one)
    chex.assert_trees_all_close(jax.tree.map(lambda a, s: a / s, many, scale),
                                jax.tree.map(lambda a, s: a / s, one, scale),
                                rtol=1e-5, atol=1e-5)


def test_pipelined_dropless_exchanges_sit_in_no_conditional():
    """Compiled for 8 CPU devices (2 chunks that split): each chunk's four payload exchanges
    (dispatch, combine, and their backward passes) lie outside every conditional, and the
    step holds two top-level conditionals, the overflow pass's forward and backward (a
    chunk's own bucket switches would add four per chunk); the overflow pass's exchanges sit
    in their branches."""
    x = jnp.zeros((4, 128, D))
    fn = _grad_fn((1, 8), 2, transport="dropless")  # the program the test above runs
    text = fn.lower(x, _params(), x).compile().as_text()
    payload = [c for c in analyze_collectives(text).of_kind("all-to-all")
               if c.buffer_bytes >= 16 * D]
    assert count_outside_branches(text, "all-to-all") == 4 * 2
    assert count_outside_branches(text, "conditional") == 2
    assert len(payload) > 4 * 2  # the overflow pass's, inside its branches
