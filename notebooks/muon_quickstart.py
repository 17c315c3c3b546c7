# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Muon quickstart: sharded Muon in Optax + Flax NNX
#
# Muon updates each hidden weight matrix with its *orthogonalized* momentum (Newton-Schulz
# iterations push all singular values towards 1); embeddings, the output head, biases and norms
# keep AdamW. `muon_jax.muon` is an Optax transform that does both. Given a `mesh`, it shards
# its state ZeRO-1 style: matrices of equal shape are stacked, the stack is split over the
# data-parallel devices, and each device keeps the momentum of, and orthogonalizes, only its
# own matrices.
#
# This notebook trains a small MLP data-parallel on 8 devices with sharded Muon, shows where
# the optimizer state lives, and compares Muon with AdamW. It runs on CPU in about a minute.

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

# %% [markdown]
# ## 1. A data-parallel mesh
#
# One mesh axis, `data`, over the 8 devices: every device holds a copy of the
# parameters and an eighth of each batch.

# %%
import jax
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_jax

devices = jax.devices()
if len(devices) < 8:  # e.g. one Colab GPU: use the 8 simulated CPU devices instead
    devices = jax.devices("cpu")
devices = devices[:8]
print(f"jax {jax.__version__}: {len(devices)} {devices[0].platform} devices")

# %%
# Auto axes: XLA places the model's arrays; Muon is explicit about its own layout.
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                     devices=devices)
print(mesh)

# %% [markdown]
# ## 2. Task and model
#
# A synthetic task: given two tokens `a, b` in `[0, 64)`, predict `(a * b + a) mod 64`.
# The model embeds both tokens, projects them to width 64 and runs seven residual
# `64 x 64` layers, a LayerNorm and an output head. Batches are split over `data` with
# `device_put`.

# %%
VOCAB, EMBED, WIDTH, DEPTH = 64, 32, 64, 7


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
        self.proj = nnx.Linear(2 * EMBED, WIDTH, rngs=rngs)
        self.hidden = nnx.List(
            [nnx.Linear(WIDTH, WIDTH, rngs=rngs) for _ in range(DEPTH)]
        )
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):  # tokens: int [batch, 2]
        h = self.proj(self.embed(tokens).reshape(tokens.shape[0], -1))
        for layer in self.hidden:
            h = h + jax.nn.gelu(layer(h))
        return self.head(self.norm(h))


def make_batch(key, batch_size=512):
    tokens = jax.random.randint(key, (batch_size, 2), 0, VOCAB)
    target = (tokens[:, 0] * tokens[:, 1] + tokens[:, 0]) % VOCAB
    data = NamedSharding(mesh, P("data"))  # split the batch over the devices
    return jax.device_put(tokens, data), jax.device_put(target, data)


def loss_fn(model, tokens, target):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()


# %% [markdown]
# ## 3. Muon in `optax.chain` and `nnx.Optimizer`
#
# `muon_jax.muon(learning_rate, ..., sharding=muon_jax.ShardingOptions(mesh))` is an
# ordinary Optax transform, so it composes with gradient clipping and goes into
# `nnx.Optimizer` like AdamW would. With the default `shape_scaling='rms_match'`, Muon's
# updates have AdamW's RMS, so one learning rate and weight decay serve both halves.
# `nnx.Optimizer` hands it the model's own variables, so each kernel's matrix view comes
# from its layer (here `nnx.Linear`: `[in, out]`).

# %%
STEPS = 300
schedule = optax.warmup_cosine_decay_schedule(0.0, 0.02, STEPS // 10, STEPS)

with jax.set_mesh(mesh):  # parameters are created replicated on the mesh
    model = MLP(rngs=nnx.Rngs(0))
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        muon_jax.muon(schedule, weight_decay=0.01, sharding=muon_jax.ShardingOptions(mesh)),
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

# %% [markdown]
# `muon_jax.default_muon_mask` decides which leaves Muon updates: float matrices whose
# path does not name an embedding, head, bias or norm. Everything else goes to AdamW.

# %%
params = nnx.state(model, nnx.Param)
mask = muon_jax.default_muon_mask(params)
for (path, p), on_muon in zip(params.flat_state(), jax.tree.leaves(mask), strict=True):
    name = "/".join(map(str, path))
    print(f"{name:18s} {str(p.shape):9s} -> {'Muon' if on_muon else 'AdamW'}")

# %% [markdown]
# ## 4. Where the sharded state lives
#
# The eight `64 x 64` Muon kernels (the projection and the seven hidden layers) form one
# momentum stack `[8, 64, 64]`, split over `data`: each device stores the momentum of,
# and runs Newton-Schulz on, one whole matrix. (Matrices of another shape would form
# another stack, padded to a multiple of 8.) AdamW's moments for the remaining small
# leaves stay replicated.

# %%
is_muon_state = lambda s: isinstance(s, muon_jax.ShardedMuonState)
muon_state = next(s for s in jax.tree.leaves(optimizer.opt_state, is_leaf=is_muon_state)
                  if is_muon_state(s))
plan = muon_state.plan  # the owner plan: which matrices share a stack, who owns which rows
for stack, mu in zip(plan.stacks, muon_state.mu, strict=True):
    mu = mu[...]
    local = mu.addressable_shards[0].data  # device 0's part
    names = [plan.leaves[i].path.removesuffix("/value") for i in stack.leaves]
    print(f"momentum stack {mu.dtype}{list(mu.shape)}, sharding {mu.sharding.spec}")
    print(f"  holds {names}")
    print(f"  device 0 stores {list(local.shape)}: {local.nbytes:,} of {mu.nbytes:,} bytes")

state = jax.tree.leaves(optimizer.opt_state)
per_device = sum(x.addressable_shards[0].data.nbytes for x in state)
print(f"whole optimizer state: {per_device:,} bytes per device; "
      f"{sum(x.nbytes for x in state):,} bytes if every device kept all of it")

# %% [markdown]
# ## 5. The train step and what it communicates
#
# The train step is plain NNX: `nnx.value_and_grad`, then `optimizer.update`. Under
# `nnx.jit` XLA compiles the whole step, so `xla_comm.hlo` can list the collectives
# of the compiled program and their bytes.

# %%
from xla_comm import hlo


@nnx.jit
def train_step(model, optimizer, tokens, target):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, target)
    optimizer.update(model, grads)
    return loss


compiled = train_step.lower(model, optimizer, *make_batch(jax.random.key(0))).compile()
for c in hlo.analyze_collectives(compiled):
    print(f"{c.kind:10s} {len(c.shapes):2d} arrays {c.buffer_bytes:9,d} bytes  "
          f"(ring bytes per device {c.ring_bytes:9,.0f})")


# %% [markdown]
# Two collectives: one all-reduce that sums every gradient over the 8 devices (the
# data-parallel sum, as with AdamW), and one all-gather of the `[8, 64, 64]` stack of
# Muon updates, each device contributing its own matrix's update. In between, each
# device slices out its matrix and runs momentum and Newton-Schulz on it with no
# communication at all. This is XLA:CPU's program; on GPU/TPU the list can differ
# (there XLA can turn the all-reduce and the slice into a reduce-scatter).
#
# ## 6. Muon vs AdamW
#
# We train the model from the same initialization once with Muon (+ AdamW for the
# other leaves) and once with AdamW alone, with the same schedule, clipping and weight
# decay; each learning rate is the best of a small sweep (0.005 to 0.05).

# %%
def train(model, optimizer, steps=STEPS):
    key, losses = jax.random.key(1), []
    for _ in range(steps):
        key, sub = jax.random.split(key)
        losses.append(train_step(model, optimizer, *make_batch(sub)))
    return np.asarray(jax.device_get(losses))


muon_losses = train(model, optimizer)

with jax.set_mesh(mesh):
    adamw_model = MLP(rngs=nnx.Rngs(0))
    adamw_tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 0.01, STEPS // 10, STEPS),
            b1=0.9, b2=0.95, weight_decay=0.01,
        ),
    )
    adamw_optimizer = nnx.Optimizer(adamw_model, adamw_tx, wrt=nnx.Param)
adamw_losses = train(adamw_model, adamw_optimizer)
print(f"mean loss of the last 20 steps: Muon {muon_losses[-20:].mean():.3f}, "
      f"AdamW {adamw_losses[-20:].mean():.3f}")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(adamw_losses, label="AdamW (lr 0.01)", alpha=0.8)
ax.plot(muon_losses, label="Muon + AdamW (lr 0.02)", alpha=0.8)
ax.set(xlabel="step", ylabel="training loss", yscale="log",
       title="(a * b + a) mod 64, 8-device data parallel")
ax.legend()
plt.show()

# %% [markdown]
# ## Next steps
#
# - `muon_jax.ShardingOptions(mesh, shard_axes=...)` picks the mesh axes the stacks are
#   split over (default: all axes of the mesh).
# - The README's "Muon on Flax models" lists the view each Flax layer's kernel gets
#   (attention, convolutions, layer stacks, `moe.MoE`'s expert banks).
# - `examples/quickstart.py` is a one-device version of this recipe as a script;
#   `examples/train_lm.py` trains a small MoE language model with sharded Muon.
# - `moe_expert_parallel.ipynb` shows the expert-parallel MoE layer.

# %% [markdown]
# ## On a Colab TPU
#
# Choose a TPU runtime, then, before the setup cell: `!pip install -U "jax[tpu]>=0.10"` (the
# package needs jax >= 0.10 and pip must keep the TPU build of jaxlib), and restart the
# session if jax had been imported already. With 8 or more TPU devices the mesh above is
# built from them; with fewer (a one-chip runtime) the notebook keeps its 8 simulated CPU
# devices.
#
# `muon_jax` has no TPU-specific kernels: Newton-Schulz is plain matmuls (in bf16 by default,
# `NewtonSchulzOptions(dtype=)`). One choice follows the mesh's platform: on GPU and TPU
# meshes the gradients of replicated params are moved to their owners as an all-reduce
# followed by a slice, which
# XLA:GPU/TPU turn into a reduce-scatter (XLA:CPU does not, so on CPU Muon slices the
# all-reduced gradients itself). This has not been timed on a TPU here; the cell below prints
# what the compiled step of section 5 communicates on the mesh this notebook ran on.

# %%
platform = mesh.devices.flat[0].platform
kinds = hlo.analyze_collectives(compiled).counts()
print(f"mesh of {mesh.devices.size} {platform} devices ({mesh.devices.flat[0].device_kind}); "
      f"the compiled train step runs {kinds}")
