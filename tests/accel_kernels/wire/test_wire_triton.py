"""The Pallas wire kernels (moe/wire_triton.py) against the XLA wire path, bit for bit.

On CPU the kernels run in Pallas interpret mode; that they also lower to Triton for a GPU is
checked by exporting for 'cuda' (no GPU needed). benchmarks/dispatch_bench.py --part phases
(at 8b11414) timed them on GPUs and checks the compiled kernels' bytes against XLA's there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cuda_export import cuda_mesh, export_for_cuda, loops_outside_scans
from _meshes import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from accel_kernels.wire import triton as wire_triton
from moe import combine, dispatch

D, BS = 512, 128


def _rows(t: int = 24, d: int = D, dtype=jnp.bfloat16) -> jax.Array:
    """Rows with per-row magnitudes from 2^-130 to 2^60, a zero row, an inf and a NaN."""
    k1, k2 = jax.random.split(jax.random.key(3))
    mag = jnp.exp2(jax.random.randint(k1, (t, 1), -130, 60).astype(jnp.float32))
    x = (jax.random.normal(k2, (t, d), jnp.float32) * mag).astype(dtype)
    return x.at[2].set(0).at[3, 7].set(jnp.inf).at[4, 300].set(jnp.nan)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f" or a.dtype == jnp.bfloat16:
        return np.array_equal(a.astype(np.float32), b.astype(np.float32), equal_nan=True)
    return np.array_equal(a, b)


INDEX = jnp.array([5, 0, 2, 3, 4, 23, -1, 24, 99, 5, 11], jnp.int32)  # repeats, out of range


def test_supported_shapes():
    assert wire_triton.supported(4096, fp8_wire=True, block_size=128)
    assert wire_triton.supported(4096, fp8_wire=False)
    assert not wire_triton.supported(5120, fp8_wire=True, block_size=128)  # 40 blocks
    assert not wire_triton.supported(768, fp8_wire=False)
    assert not wire_triton.supported(1536, fp8_wire=True, block_size=128)  # 12 blocks


# ----------------------------------------------------------------------------------------------
# dispatch + combine with the kernels (interpreted) equal the XLA path bit for bit, inside
# shard_map with check_vma=True, forward and backward.
# ----------------------------------------------------------------------------------------------

T_LOCAL, E, K, N_EP = 16, 8, 2, 4
# Tokens per device in the interpreted runs: 8 gives the dropless exchange two buckets (8, 16
# rows per pair; 16 tokens give four), so its program compiles half the bucket branches of
# interpreted kernels and still switches between buckets. The size is not the point here.
T_RUN = 8


def _dispatch_combine_grads(kernels: str, wire: str, transport: str = "dense"):
    mesh = make_mesh((2, N_EP), ("data", "expert"))
    tok = P(("data", "expert"))
    n = 2 * N_EP * T_RUN
    kx, ki, kw, kc = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(kx, (n, D), jnp.float32).astype(jnp.bfloat16)
    ids = jax.vmap(lambda k: jax.random.permutation(k, E)[:K])(jax.random.split(ki, n))
    w = jax.nn.softmax(jax.random.normal(kw, (n, K)), axis=-1)
    ct = jax.random.normal(kc, (n, D), jnp.float32)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, tok))  # noqa: E731

    def local(x, ids, w):
        ex, _, plan = dispatch(x, ids.astype(jnp.int32), num_experts=E, axis_name="expert",
                               transport=transport, capacity_factor=1.0, dispatch_dtype=wire,
                               wire_implementation=kernels)
        return combine(jnp.sin(ex.astype(jnp.float32)).astype(ex.dtype), w, plan,
                       combine_grad_dtype=wire)

    f = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok), out_specs=tok)

    def loss(x, ids, w, ct):
        return jnp.sum(f(x, ids, w).astype(jnp.float32) * ct)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))
    return step(put(x), put(ids), put(w), put(ct))


@pytest.mark.parametrize("wire,transport", [("fp8", "dense"), ("bf16", "dense"),
                                            ("fp8", "dropless")])
def test_dispatch_with_pallas_wire_kernels_equals_xla(wire, transport):
    ref = _dispatch_combine_grads("xla", wire, transport)
    got = _dispatch_combine_grads("triton", wire, transport)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert _same(a, b)


def test_wire_kernels_lower_for_cuda():
    """The compiled kernels (no interpreter) lower for CUDA inside shard_map(check_vma=True):
    the send gather + encode and the decode into the expert layout, both wires (Mosaic GPU
    at this width, `tests/accel_kernels/wire/test_wire_mosaic.py`; Triton where Mosaic GPU does
    not fit)."""
    mesh = cuda_mesh((N_EP,), ("expert",))
    e = P("expert")

    def local(x, ids):
        out = []
        for wire in ("fp8", "bf16"):
            ex, _, _ = dispatch(x, ids, num_experts=E, axis_name="expert", transport="dense",
                                capacity_factor=1.0, dispatch_dtype=wire,
                                wire_implementation="auto")
            out.append(ex.astype(jnp.float32))
        return out[0] + out[1]

    fn = jax.shard_map(local, mesh=mesh, in_specs=(e, e), out_specs=e)
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, e))
    args = (sds((N_EP * T_LOCAL, D), jnp.bfloat16), sds((N_EP * T_LOCAL, K), jnp.int32))
    text = export_for_cuda(fn, *args)
    assert text.count("wire_gather_encode") >= 2 and text.count("wire_gather_decode") >= 2
    assert loops_outside_scans(text) == 0


def test_dropless_lowers_for_cuda_with_wire_kernels():
    """Dropless dispatch + combine, forward and backward, FP8 wire: lowers for CUDA with the
    wire kernels inside the bucket branches (one case per bucket) and no
    ragged_all_to_all; with one device on the expert axis, no collective and no bucket case
    (the module's other cases pick kernels by platform)."""
    cases = {}
    for n_ep in (1, N_EP):
        mesh = cuda_mesh((n_ep,), ("expert",))
        e = P("expert")

        def local(x, ids, w):
            ex, _, plan = dispatch(x, ids, num_experts=E, axis_name="expert",
                                   transport="dropless", dispatch_dtype="fp8",
                                   wire_implementation="auto")
            return combine(jnp.sin(ex), w, plan, combine_grad_dtype="fp8")

        fn = jax.shard_map(local, mesh=mesh, in_specs=(e, e, e), out_specs=e)
        grad = jax.grad(lambda x, ids, w, fn=fn: jnp.sum(fn(x, ids, w).astype(jnp.float32)),
                        argnums=(0, 2))
        sds = lambda shape, dtype, mesh=mesh, e=e: jax.ShapeDtypeStruct(  # noqa: E731
            shape, dtype, sharding=NamedSharding(mesh, e))
        n = n_ep * T_LOCAL
        text = export_for_cuda(grad, sds((n, D), jnp.bfloat16), sds((n, K), jnp.int32),
                               sds((n, K), jnp.float32))
        assert "ragged_all_to_all" not in text
        cases[n_ep] = text.count("stablehlo.case")
        if n_ep > 1:
            assert "all_to_all" in text and cases[n_ep] >= cases[1] + 4, cases
            assert text.count("wire_gather_encode") >= 2, text.count("wire_gather_encode")
            assert text.count("wire_gather_decode") >= 2
        else:
            for op in ("all_to_all", "all_gather", "all_reduce", "collective_permute"):
                assert op not in text, op
