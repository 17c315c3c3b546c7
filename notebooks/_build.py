"""Writes the Colab notebooks in this folder (without outputs). Run from anywhere:

    python3 notebooks/_build.py

Edit the cells here, not in the .ipynb files, then regenerate. ``REPO`` is a placeholder
GitHub org/repo for the "Open in Colab" badges and the install cells; change it to the real
one and regenerate.
"""

from __future__ import annotations

import pathlib
import textwrap

import nbformat
from nbformat import v4

REPO = "muon-jax/muon-jax-moe"  # placeholder org/repo: replace with the published repository
HERE = pathlib.Path(__file__).resolve().parent


def md(text: str):
    return v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
    return v4.new_code_cell(textwrap.dedent(text).strip())


def header(name: str, title: str, intro: str) -> list:
    badge = (
        f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"(https://colab.research.google.com/github/{REPO}/blob/main/notebooks/{name})"
    )
    return [
        md(f"# {title}\n\n{badge}\n\n{textwrap.dedent(intro).strip()}"),
        code(f"""
            # On Colab (or any fresh machine), install the library first:
            # !pip install -q "muon-jax-moe @ git+https://github.com/{REPO}"
        """),
        md("""
            JAX sees a single CPU device by default. The flag below splits the host CPU into 8
            simulated devices so that the mesh code runs on any machine. It must be set before
            JAX is imported, and it only affects the CPU platform: on a Colab TPU with 8 cores
            the TPU is used; with fewer accelerators (e.g. one GPU) the notebook falls back to
            the 8 CPU devices.
        """),
        code("""
            import os

            os.environ["XLA_FLAGS"] = (
                os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
            )
        """),
    ]


def devices_cell(imports: str) -> object:
    return code(imports.strip() + """

devices = jax.devices()
if len(devices) < 8:  # e.g. one Colab GPU: use the 8 simulated CPU devices instead
    devices = jax.devices("cpu")
devices = devices[:8]
print(f"jax {jax.__version__}: {len(devices)} {devices[0].platform} devices")""")


# ----------------------------------------------------------------------------- Muon

MUON_INTRO = """
Muon updates each hidden weight matrix with its *orthogonalized* momentum (Newton-Schulz
iterations push all singular values towards 1); embeddings, the output head, biases and norms
keep AdamW. `muon_jax.muon` is an Optax transform that does both. Given a `mesh`, it shards
its state ZeRO-1 style: matrices of equal shape are stacked, the stack is split over the
data-parallel devices, and each device keeps the momentum of, and orthogonalizes, only its
own matrices.

This notebook trains a small MLP data-parallel on 8 devices with sharded Muon, shows where
the optimizer state lives, and compares Muon with AdamW. It runs on CPU in about a minute.
"""


MUON_STATE_CELL = """
is_muon_state = lambda s: isinstance(s, muon_jax.ShardedMuonState)
muon_state = next(s for s in jax.tree.leaves(optimizer.opt_state, is_leaf=is_muon_state)
                  if is_muon_state(s))
layout = muon_state.layout
for stack, mu in zip(layout.stacks, muon_state.mu, strict=True):
    mu = mu[...]
    local = mu.addressable_shards[0].data  # device 0's part
    names = [layout.leaves[i].path.removesuffix("/value") for i in stack.leaves]
    print(f"momentum stack {mu.dtype}{list(mu.shape)}, sharding {mu.sharding.spec}")
    print(f"  holds {names}")
    print(f"  device 0 stores {list(local.shape)}: {local.nbytes:,} of {mu.nbytes:,} bytes")

state = jax.tree.leaves(optimizer.opt_state)
per_device = sum(x.addressable_shards[0].data.nbytes for x in state)
print(f"whole optimizer state: {per_device:,} bytes per device; "
      f"{sum(x.nbytes for x in state):,} bytes if every device kept all of it")
"""


def muon_notebook() -> list:
    return [
        *header("muon_quickstart.ipynb", "Muon quickstart: sharded Muon in Optax + Flax NNX",
                MUON_INTRO),
        md("""
            ## 1. A data-parallel mesh

            One mesh axis, `data`, over the 8 devices: every device holds a copy of the
            parameters and an eighth of each batch.
        """),
        devices_cell("""
import jax
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_jax
"""),
        code("""
            # Auto axes: XLA places the model's arrays; Muon is explicit about its own layout.
            mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                                 devices=devices)
            print(mesh)
        """),
        md("""
            ## 2. Task and model

            A synthetic task: given two tokens `a, b` in `[0, 64)`, predict `(a * b + a) mod 64`.
            The model embeds both tokens, projects them to width 64 and runs seven residual
            `64 x 64` layers, a LayerNorm and an output head. Batches are split over `data` with
            `device_put`.
        """),
        code("""
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
        """),
        md("""
            ## 3. Muon in `optax.chain` and `nnx.Optimizer`

            `muon_jax.muon(learning_rate, ..., mesh=mesh)` is an ordinary Optax transform, so it
            composes with gradient clipping and goes into `nnx.Optimizer` like AdamW would. With
            the default `shape_scaling='rms_match'`, Muon's updates have AdamW's RMS, so one
            learning rate and weight decay serve both halves.
        """),
        code("""
            STEPS = 300
            schedule = optax.warmup_cosine_decay_schedule(0.0, 0.02, STEPS // 10, STEPS)

            with jax.set_mesh(mesh):  # parameters are created replicated on the mesh
                model = MLP(rngs=nnx.Rngs(0))
                tx = optax.chain(
                    optax.clip_by_global_norm(1.0),
                    muon_jax.muon(schedule, weight_decay=0.01, mesh=mesh),
                )
                optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        """),
        md("""
            `muon_jax.default_muon_mask` decides which leaves Muon updates: float matrices whose
            path does not name an embedding, head, bias or norm. Everything else goes to AdamW.
        """),
        code("""
            params = nnx.state(model, nnx.Param)
            mask = muon_jax.default_muon_mask(params)
            for (path, p), on_muon in zip(params.flat_state(), jax.tree.leaves(mask), strict=True):
                name = "/".join(map(str, path))
                print(f"{name:18s} {str(p.shape):9s} -> {'Muon' if on_muon else 'AdamW'}")
        """),
        md("""
            ## 4. Where the sharded state lives

            The eight `64 x 64` Muon kernels (the projection and the seven hidden layers) form one
            momentum stack `[8, 64, 64]`, split over `data`: each device stores the momentum of,
            and runs Newton-Schulz on, one whole matrix. (Matrices of another shape would form
            another stack, padded to a multiple of 8.) AdamW's moments for the remaining small
            leaves stay replicated.
        """),
        code(MUON_STATE_CELL),
        md("""
            ## 5. The train step and what it communicates

            The train step is plain NNX: `nnx.value_and_grad`, then `optimizer.update`. Under
            `nnx.jit` XLA compiles the whole step, so `muon_jax.hlo` can list the collectives
            of the compiled program and their bytes.
        """),
        code("""
            from muon_jax import hlo


            @nnx.jit
            def train_step(model, optimizer, tokens, target):
                loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, target)
                optimizer.update(model, grads)
                return loss


            compiled = train_step.lower(model, optimizer, *make_batch(jax.random.key(0))).compile()
            for c in hlo.analyze_collectives(compiled):
                print(f"{c.kind:10s} {len(c.shapes):2d} arrays {c.buffer_bytes:9,d} bytes  "
                      f"(ring bytes per device {c.ring_bytes:9,.0f})")
        """),
        md("""
            Two collectives: one all-reduce that sums every gradient over the 8 devices (the
            data-parallel sum, as with AdamW), and one all-gather of the `[8, 64, 64]` stack of
            Muon updates, each device contributing its own matrix's update. In between, each
            device slices out its matrix and runs momentum and Newton-Schulz on it with no
            communication at all. This is XLA:CPU's program; on GPU/TPU the list can differ
            (there XLA can turn the all-reduce and the slice into a reduce-scatter).

            ## 6. Muon vs AdamW

            We train the model from the same initialization once with Muon (+ AdamW for the
            other leaves) and once with AdamW alone, with the same schedule, clipping and weight
            decay; each learning rate is the best of a small sweep (0.005 to 0.05).
        """),
        code("""
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
        """),
        code("""
            fig, ax = plt.subplots(figsize=(7, 4))
            ax.plot(adamw_losses, label="AdamW (lr 0.01)", alpha=0.8)
            ax.plot(muon_losses, label="Muon + AdamW (lr 0.02)", alpha=0.8)
            ax.set(xlabel="step", ylabel="training loss", yscale="log",
                   title="(a * b + a) mod 64, 8-device data parallel")
            ax.legend()
            plt.show()
        """),
        md("""
            ## Next steps

            - `muon_jax.muon(..., shard_axes=...)` picks the mesh axes the stacks are split over
              (default: all axes of the mesh).
            - `examples/quickstart.py` is a one-device version of this recipe as a script;
              `examples/train_lm.py` trains a small MoE language model with sharded Muon.
            - `moe_expert_parallel.ipynb` shows the expert-parallel MoE layer.
        """),
    ]




# ----------------------------------------------------------------------------- MoE

MOE_INTRO = """
`moe.MoE` is a Mixture-of-Experts feed-forward layer for Flax NNX: a top-k router, SwiGLU
experts split over the devices of an `expert` mesh axis, and token dispatch / combine by
`all_to_all`, optionally with the tokens on the wire as FP8 (e4m3 values with power-of-two
block scales). This notebook runs the layer on a `(data, expert) = (2, 4)` mesh, takes the FP8
wire format apart, balances the router, and counts dispatch bytes in the compiled HLO. It runs
on CPU in about a minute.
"""


def moe_notebook() -> list:
    return [
        *header("moe_expert_parallel.ipynb", "Expert-parallel MoE with an FP8 wire format",
                MOE_INTRO),
        devices_cell("""
import math
import re

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe
"""),
        md("""
            ## 1. The MoE layer on a `(data, expert)` mesh

            The 8 devices form a `2 x 4` mesh. `moe.MoE` splits its 8 experts over the `expert`
            axis (2 experts per device) and keeps the router replicated; the tokens are split
            over all 8 devices. `dispatch_dtype='fp8'` sends tokens to their experts as FP8.
        """),
        code("""
            mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=devices)
            layer = moe.MoE(d_model=512, d_ff=256, num_experts=8, top_k=2, mesh=mesh,
                            dispatch_dtype="fp8", rngs=nnx.Rngs(0))

            for path, p in nnx.state(layer, nnx.Param).flat_state():
                a = p[...]
                print(f"{path[0]:14s} {str(a.shape):15s} {str(a.sharding.spec):26s} "
                      f"per device {a.sharding.shard_shape(a.shape)}")
        """),
        md("""
            A forward and backward pass under `nnx.jit`, with a toy loss (the mean square of the
            output plus the router's load-balancing loss). The layer returns `(y, aux)`; `aux`
            holds the load-balancing and z losses, the tokens routed to each expert and the
            number of dropped token slots (none here: the default dispatch is dropless).
        """),
        code("""
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
        """),
        md("""
            ## 2. The FP8 wire format, taken apart

            Each row is cut into blocks of 128 channels. A block's scale is a power of two,
            `2^ceil(log2(amax / 448))` (448 is e4m3's largest value); the payload is
            `e4m3(x / scale)`. The scale travels as its E8M0 byte (the exponent plus 127), and
            four bytes are packed little-endian into one int32 word: block `j` in byte `j`.
            Below, one row whose four blocks have very different magnitudes.
        """),
        code("""
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
        """),
        md("""
            `moe.fp8.unpack_e8m0` splits the word into its bytes; byte `b` means the scale
            `2^(b - 127)`. Multiplying each block's payload by its scale is exactly
            `moe.fp8.dequantize`. e4m3 keeps 3 mantissa bits, so rounding changes a value by at
            most 1/16 of its magnitude: the error is below 1/16 of the block's largest value,
            and much less on average.
        """),
        code("""
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
        """),
        md("""
            ## 3. Routing histogram and aux-loss-free balancing

            `aux['tokens_per_expert']` counts the token slots routed to each expert. Inputs that
            share a common direction (as real activations do) skew the router towards a few
            experts. `MoE.update_balancing_bias` applies DeepSeek-V3's auxiliary-loss-free fix:
            it nudges a per-expert bias up for underloaded experts and down for overloaded ones.
            The bias only changes which experts are selected, not the combine weights, and it is
            not trained by gradients.
        """),
        code("""
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
        """),
        md("""
            ## 4. Dispatch bytes, bf16 vs FP8, read from the HLO

            The same layer in bf16, once with bf16 and once with FP8 on the dispatch wire. We
            lower and compile its forward pass and list every `all-to-all` with its per-device
            buffer. *Emitted* is the HLO JAX hands to XLA (what a GPU or TPU sends); *compiled*
            is what XLA:CPU runs, and XLA:CPU widens bf16 collectives to f32, so on CPU the
            compiled bf16 buffers double. FP8 travels as bytes (e4m3 payload and scale words
            fused into one `u8` buffer per row: 512 + 4 bytes) and is the same in both.
        """),
        code("""
            NBYTES = {"f8e4m3fn": 1, "u8": 1, "s8": 1, "bf16": 2, "f16": 2,
                      "f32": 4, "s32": 4, "u32": 4}


            def all_to_alls(hlo_text):
                \"\"\"[(buffer type, bytes)] of each all-to-all in HLO text (per device).\"\"\"
                ops = []
                for line in hlo_text.splitlines():
                    m = re.search(r"=\\s*(.*?)\\s+all-to-all(?:-start)?\\(", line)
                    if m:
                        arrays = re.findall(r"(\\w+)\\[([\\d,]*)\\]", m.group(1))
                        nbytes = sum(NBYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
                                     for dt, dims in arrays)
                        ops.append((re.sub(r"\\{[\\d,]*\\}", "", m.group(1)), nbytes))
                return ops


            x16 = x.astype(jnp.bfloat16)
            for wire in ["bf16", "fp8"]:
                layer16 = moe.MoE(d_model=512, d_ff=256, num_experts=8, top_k=2, mesh=mesh,
                                  dtype=jnp.bfloat16, dispatch_dtype=wire, rngs=nnx.Rngs(0))
                lowered = nnx.jit(lambda layer, x: layer(x)[0]).lower(layer16, x16)
                for stage, text in [("emitted", lowered.as_text(dialect="hlo")),
                                    ("compiled", lowered.compile().as_text())]:
                    for buffer, nbytes in all_to_alls(text):
                        print(f"{wire:5s} {stage:9s} {nbytes:9,d} B  {buffer}")
        """),
        md("""
            Reading the list, per layer: the `s32[8]` all-to-all exchanges per-expert token counts
            (32 bytes; this forward pass never reads them, so XLA drops it when compiling). Then
            dispatch: per device, 512 token slots of 512 channels (4 destinations x 2 local
            experts x 64 slots, the dropless worst case), 524,288 bytes in bf16 and 264,192 in
            FP8, a ratio of `(1 + 1/128) / 2 = 0.504`. Last, combine returns the expert outputs
            in the activation dtype (bf16) in both layers; `combine_grad_dtype='fp8'` would put
            the backward pass's combine gradient, which travels in the dispatch direction, on
            FP8 as well.
        """),
    ]


def write(name: str, cells: list) -> None:
    nb = v4.new_notebook(cells=cells)
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
    }
    nbformat.validate(nb)
    path = HERE / name
    # Stable cell ids, so regenerating an unchanged notebook gives an identical file.
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    nbformat.write(nb, path)
    print(f"wrote {path.relative_to(HERE.parent)} ({len(cells)} cells)")


if __name__ == "__main__":
    write("muon_quickstart.ipynb", muon_notebook())
    write("moe_expert_parallel.ipynb", moe_notebook())
