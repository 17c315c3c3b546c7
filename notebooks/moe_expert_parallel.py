# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Expert-parallel MoE with an FP8 wire format
#
# `moe.MoE` is a Mixture-of-Experts feed-forward layer for Flax NNX: a top-k router, SwiGLU
# experts split over the devices of an `expert` mesh axis, and token dispatch / combine by
# `all_to_all`, optionally with the tokens on the wire as FP8 (e4m3 values with power-of-two
# block scales). This notebook runs the layer on a `(data, expert) = (2, 4)` mesh, takes the FP8
# wire format apart, balances the router, and counts dispatch bytes in the compiled HLO. It runs
# on CPU in about a minute.

# %% [markdown]
# ## Setup
#
# The notebook needs this repository's package, `muon-jax-moe` (`muon_jax`, `moe`,
# `xla_comm`; it is not on PyPI). The next cell installs it when it is missing: from the
# repository checkout the notebook sits in (a parent folder, or a folder next to the notebook),
# else from a `muon_jax_moe-*.whl` wheel next to the notebook. Run from a clone where
# `pip install -e .` was done, it installs nothing.
#
# On Colab: open this notebook (*File > Upload notebook*, or from your copy of the repository on
# GitHub), then give the runtime the package in one of two ways before running the cell:
# upload a zip of the repository in the *Files* panel and run `!unzip -q muon-jax-moe.zip`, or
# build a wheel in a clone (`pip wheel --no-deps . -w dist`) and upload
# `dist/muon_jax_moe-*.whl`. On a TPU runtime, read the last section first.

# %%
import importlib
import importlib.util
import pathlib
import subprocess
import sys

if importlib.util.find_spec("xla_comm") is None:  # install this repository's package
    here = pathlib.Path.cwd()
    found = [p for p in [here, *here.parents, *here.glob("*/")] if (p / "xla_comm").is_dir()]
    source = found[0] if found else next(iter(here.glob("muon_jax_moe-*.whl")), None)
    if source is None:
        raise RuntimeError(f"no checkout or wheel of muon-jax-moe found from {here}: see above")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", str(source)], check=True)
    importlib.invalidate_caches()

# %% [markdown]
# JAX sees a single CPU device by default. The flag below splits the host CPU into 8
# simulated devices so that the mesh code runs on any machine. It must be set before
# JAX is imported, and it only affects the CPU platform: with 8 or more accelerator
# devices (e.g. a TPU with 8 cores) those are used; with fewer (one GPU, a one-chip TPU)
# the notebook falls back to the 8 CPU devices.

# %%
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

# %%
import re

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe

devices = jax.devices()
if len(devices) < 8:  # e.g. one Colab GPU: use the 8 simulated CPU devices instead
    devices = jax.devices("cpu")
devices = devices[:8]
print(f"jax {jax.__version__}: {len(devices)} {devices[0].platform} devices")

# %% [markdown]
# ## 1. The MoE layer on a `(data, expert)` mesh
#
# The 8 devices form a `2 x 4` mesh. `moe.MoE` splits its 8 experts over the `expert`
# axis (2 experts per device) and keeps the router replicated; the tokens are split
# over all 8 devices. The options live in one `moe.MoEOptions`; `dispatch_dtype='fp8'`
# sends tokens to their experts as FP8.

# %%
mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=devices)
options = moe.MoEOptions.create(8, 2, dispatch_dtype="fp8")  # 8 experts, top-2
layer = moe.MoE(512, 256, options=options, mesh=mesh, rngs=nnx.Rngs(0))

for path, p in nnx.state(layer, nnx.Param).flat_state():
    a = p[...]
    print(f"{path[0]:14s} {str(a.shape):15s} {str(a.sharding.spec):26s} "
          f"per device {a.sharding.shard_shape(a.shape)}")

# %% [markdown]
# A forward and backward pass under `nnx.jit`, with a toy loss (the mean square of the
# output plus the router's load-balancing loss). The layer returns `(y, aux)`; `aux`
# holds the load-balancing and z losses, the tokens routed to each expert and the
# number of dropped token slots (none here: the default dispatch is dropless).

# %%
x = jax.random.normal(jax.random.key(1), (8, 64, 512))  # [batch, seq, d_model]
x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))  # 1 row per device


@nnx.jit
def loss_and_grads(layer, x):
    def loss_fn(layer):
        y, aux = layer(x)
        return jnp.mean(y**2) + 0.01 * aux["load_balance_loss"], aux

    return nnx.value_and_grad(loss_fn, has_aux=True)(layer)


(loss, aux), grads = loss_and_grads(layer, x)
print(f"loss {float(loss):.4f}")
for k, v in aux.items():
    print(f"  {k}: {v}")
for path, g in nnx.state(grads).flat_state():
    print(f"grad {path[0]:14s} {str(g[...].shape):15s} {g[...].sharding.spec}")

# %% [markdown]
# ## 2. The FP8 wire format, taken apart
#
# Each row is cut into blocks of 128 channels. A block's scale is a power of two,
# `2^ceil(log2(amax / 448))` (448 is e4m3's largest value); the payload is
# `e4m3(x / scale)`. The scale travels as its E8M0 byte (the exponent plus 127), and
# four bytes are packed little-endian into one int32 word: block `j` in byte `j`.
# Below, one row whose four blocks have very different magnitudes.

# %%
magnitudes = jnp.repeat(jnp.array([0.01, 1.0, 30.0, 1000.0]), 128)
t = jax.random.normal(jax.random.key(2), (1, 512)) * magnitudes
q = moe.fp8.quantize(t, block_size=128)

print("payload:", q.data.dtype, q.data.shape)
print("scales: ", q.scales.dtype, q.scales.shape)
print("first 4 payload values of each block:")
for b in range(4):
    print(f"  block {b}:", q.data[0, 128 * b: 128 * b + 4].astype(jnp.float32).tolist())
word = int(q.scales[0, 0]) & 0xFFFFFFFF  # as unsigned 32 bits
print(f"scale word: {word:#010x}")

# %% [markdown]
# `moe.fp8.unpack_e8m0` splits the word into its bytes; byte `b` means the scale
# `2^(b - 127)`. Multiplying each block's payload by its scale is exactly
# `moe.fp8.dequantize`. e4m3 keeps 3 mantissa bits, so rounding changes a value by at
# most 1/16 of its magnitude: the error is below 1/16 of the block's largest value,
# and much less on average.

# %%
scale_bytes = moe.fp8.unpack_e8m0(q.scales)  # uint8 [1, 4]
scales = 2.0 ** (scale_bytes.astype(jnp.float32) - 127)
print("E8M0 bytes:", scale_bytes[0].tolist(), "-> scales:", scales[0].tolist())

blocks = q.data.astype(jnp.float32).reshape(1, 4, 128)  # [row, block, channel]
decoded = (blocks * scales[..., None]).reshape(1, 512)
y = moe.fp8.dequantize(q, jnp.float32)
print("hand decode == moe.fp8.dequantize:", bool(jnp.array_equal(decoded, y)))

err = jnp.abs(y - t).reshape(4, 128)
amax = jnp.abs(t).reshape(4, 128).max(-1)
print("max error / block amax: ", "  ".join(f"{e:.4f}" for e in err.max(-1) / amax))
print("mean error / block amax:", "  ".join(f"{e:.4f}" for e in err.mean(-1) / amax))
print(f"wire bytes: FP8 {moe.fp8.wire_nbytes(q)} vs bf16 {t.size * 2}")

# %% [markdown]
# ## 3. Routing histogram and aux-loss-free balancing
#
# `aux['tokens_per_expert']` counts the token slots routed to each expert. Inputs that
# share a common direction (as real activations do) skew the router towards a few
# experts. `MoE.update_balancing_bias` applies DeepSeek-V3's auxiliary-loss-free fix:
# it nudges a per-expert bias up for underloaded experts and down for overloaded ones.
# The bias only changes which experts are selected, not the combine weights, and it is
# not trained by gradients.

# %%
shift = jax.random.normal(jax.random.key(3), (512,))
x_skewed = jax.device_put(x + shift, NamedSharding(mesh, P(("data", "expert"))))
tokens_per_expert = nnx.jit(lambda layer, x: layer(x)[1]["tokens_per_expert"])

before = tokens_per_expert(layer, x_skewed)
for _ in range(40):
    layer.update_balancing_bias(tokens_per_expert(layer, x_skewed), rate=0.01)
after = tokens_per_expert(layer, x_skewed)
print("before:", before.tolist())
print("after: ", after.tolist())
print("bias:  ", "  ".join(f"{b:+.2f}" for b in layer.balancing_bias[...]))

fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
for ax, counts, title in [(axes[0], before, "before"),
                          (axes[1], after, "after 40 bias updates")]:
    ax.bar(np.arange(8), np.asarray(counts))
    ax.axhline(x.shape[0] * x.shape[1] * 2 / 8, color="k", ls="--", lw=1,
               label="balanced")
    ax.set(title=title, xlabel="expert", xticks=np.arange(8))
axes[0].set_ylabel("token slots")
axes[1].legend()
plt.show()

# %% [markdown]
# ## 4. Dispatch bytes, bf16 vs FP8, read from the HLO
#
# The same layer in bf16, once with bf16 and once with FP8 on the dispatch wire. We
# lower and compile its forward pass and list every `all-to-all` with its per-device
# buffer, with `xla_comm.hlo.analyze_collectives`. *Emitted* is the HLO JAX hands to XLA
# (what a GPU or TPU sends); *compiled* is what XLA:CPU runs, and XLA:CPU widens bf16
# collectives to f32, so on CPU the compiled bf16 buffers double. FP8 travels as 32-bit
# words: each row's 512 e4m3 bytes and its 4 scale bytes (one int32 scale word) are packed
# into one `u32[129]` row, 516 bytes, the same in both.

# %%
from xla_comm import hlo

x16 = x.astype(jnp.bfloat16)
for wire in ["bf16", "fp8"]:
    layer16 = moe.MoE(512, 256, options=options.replace(dispatch_dtype=wire), mesh=mesh,
                      dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    lowered = nnx.jit(lambda layer, x: layer(x)[0]).lower(layer16, x16)
    for stage, program in [("emitted", lowered), ("compiled", lowered.compile())]:
        for c in hlo.analyze_collectives(program).of_kind("all-to-all"):
            print(f"{wire:5s} {stage:9s} {c.buffer_bytes:9,d} B  {c.shape_str()}")

# %% [markdown]
# Reading the list, per layer: the `s32[8]` all-to-all exchanges per-expert token counts
# (32 bytes; this forward pass never reads them, so XLA drops it when compiling). Then
# dispatch: per device, 512 token slots of 512 channels (4 destinations x 2 local
# experts x 64 slots, the dropless worst case), 524,288 bytes in bf16 and 264,192 in
# FP8, a ratio of `(1 + 1/128) / 2 = 0.504`. Last, combine returns the expert outputs
# in the activation dtype (bf16) in both layers; `combine_grad_dtype='fp8'` would put
# the backward pass's combine gradient, which travels in the dispatch direction, on
# FP8 as well.

# %% [markdown]
# ## On a Colab TPU
#
# Choose a TPU runtime, then, before the setup cell: `!pip install -U "jax[tpu]>=0.10"` (the
# package needs jax >= 0.10 and pip must keep the TPU build of jaxlib), and restart the
# session if jax had been imported already. With 8 or more TPU devices the mesh above is
# built from them; with fewer (a one-chip runtime) the notebook keeps its 8 simulated CPU
# devices.
#
# What the `'auto'` options of `moe.MoE` pick on a TPU (each call resolves them once,
# `MoEOptions.resolve`):
#
# - `transport='auto'` is `'dense'` on a TPU (capacity-padded `all_to_all`); it picks
#   `'dropless'` only on one Hopper GPU.
# - `gemm_implementation='auto'` (expert GEMMs) is `'xla'`: batched einsums for the dense
#   layout, `ragged_dot` for the ragged one. The `'triton'` grouped GEMM is written for NVIDIA
#   GPUs (Triton) and refuses other accelerators.
# - `wire_implementation='auto'` encodes, gathers and decodes the wire rows with XLA ops; the
#   Pallas wire kernels run only when lowered for CUDA. FP8 dispatch works: the rows travel as
#   `uint32` words, which any backend's `all_to_all` moves.
# - `exchange_implementation='auto'` (with `transport='ragged'`) is XLA's native
#   `ragged_all_to_all`, chosen from `jax.default_backend()` when the layer is traced; on CPU
#   it is emulated.
#
# None of this has been timed on a TPU here. The cell below lowers this notebook's FP8 layer
# for TPU on whatever machine runs it and lists its collectives and custom calls.

# %%
graphdef, params = nnx.split(layer16)
forward = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x)[0])
for_tpu = forward.trace(params, x16).lower(lowering_platforms=("tpu",))
print(f"running on {jax.default_backend()}; lowered for TPU:")
print(hlo.analyze_collectives(for_tpu).table())
custom_calls = sorted(set(re.findall(r"custom_call @([\w$.]+)", for_tpu.as_text())))
print("custom calls:", custom_calls or "none (XLA ops only: einsum experts, XLA wire)")
