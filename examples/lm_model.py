"""A small decoder-only transformer in Flax NNX whose feed-forward layers are ``moe.MoE``.

RMSNorm, rotary causal attention, MoE feed-forward (SwiGLU experts, expert parallel over
the mesh's expert axis), tied or untied byte head. Parameter names follow what
``muon_jax.default_muon_mask`` expects: ``embed`` and ``lm_head`` go to AdamW, the hidden
matrices and expert banks to Muon.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accel_kernels
import moe


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Model size and MoE options."""

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 128
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = 2.0
    dispatch_dtype: str = "bf16"
    fp8_block_size: int = 32
    expert_gemm_dtype: str = "bf16"  # forward expert GEMMs: 'bf16' (compute dtype) or 'fp8'
    expert_dgrad_dtype: str | None = None  # data-gradient GEMMs; None: as expert_gemm_dtype
    expert_wgrad_dtype: str | None = None  # weight-gradient GEMMs; None: as expert_gemm_dtype
    # Attention's QKV and output projections (moe.fp8_dense when 'fp8'), same three fields:
    proj_gemm_dtype: str = "bf16"
    proj_dgrad_dtype: str | None = None
    proj_wgrad_dtype: str | None = None
    attention: str = "auto"  # 'xla' (einsums), 'cudnn' (fused flash attention) or 'auto'
    tie_embeddings: bool = False
    rope_base: float = 10000.0
    dtype: str = "float32"
    # Independent token streams each layer runs one after another (1: the whole batch at once);
    # see TransformerLM.__call__.
    micro_batches: int = 1
    overlap_chunks: int | str = "auto"  # the MoE layers' DispatchOptions.overlap_chunks

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}."
            )
        if (self.d_model // self.num_heads) % 2:
            raise ValueError("d_model // num_heads must be even for rotary embeddings.")
        for name in ("proj_gemm_dtype", "proj_dgrad_dtype", "proj_wgrad_dtype"):
            if getattr(self, name) not in ("bf16", "fp8", None):
                raise ValueError(f"{name} must be 'bf16' or 'fp8', got {getattr(self, name)!r}.")
        if self.proj_gemm_dtype is None:
            raise ValueError("proj_gemm_dtype must be 'bf16' or 'fp8', got None.")
        if self.proj_gemm_dtype == "bf16" and "fp8" in (self.proj_dgrad_dtype,
                                                        self.proj_wgrad_dtype):
            raise ValueError("FP8 projection gradients need proj_gemm_dtype='fp8' (the "
                             "projections run through moe.fp8_dense, whose forward is FP8).")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or (
                self.micro_batches < 1):
            raise ValueError(f"micro_batches must be an int >= 1, got {self.micro_batches!r}.")
        if self.attention not in ("auto", "xla", "cudnn"):
            raise ValueError(f"attention must be 'auto', 'xla' or 'cudnn', got "
                             f"{self.attention!r}.")

    def attention_impl(self) -> str:
        """The attention kernel: 'cudnn' (fused flash attention) for ``attention='auto'`` on
        NVIDIA GPUs with a 16-bit compute dtype and head dim <= 128, else 'xla'."""
        if self.attention != "auto":
            return self.attention
        head_dim = self.d_model // self.num_heads
        gpu = accel_kernels.target_platform() == "gpu"  # or the GPU a CPU compiles for
        half = jnp.dtype(self.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        return "cudnn" if gpu and half and head_dim <= 128 and head_dim % 8 == 0 else "xla"


def param_counts(cfg: LMConfig) -> dict[str, int]:
    """Parameter counts: ``total``, and ``active`` (matrices a token multiplies by).

    ``active`` counts attention, routers, ``top_k`` of the experts and the head (the tied
    embedding when ``tie_embeddings``); the embedding lookup and norm scales are not matmuls.
    """
    d, f, e, v = cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.vocab_size
    attn, router, expert = 4 * d * d, d * e, 3 * d * f
    head = v * d
    total = cfg.num_layers * (attn + router + e * expert + 2 * d) + d + v * d
    total += 0 if cfg.tie_embeddings else head
    active = cfg.num_layers * (attn + router + cfg.top_k * expert) + head
    return {"total": total, "active": active}


def train_flops_per_token(cfg: LMConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * active + 12 * layers * d_model * seq_len``.

    The second term is attention's ``QK^T`` and ``PV`` (forward and backward, the full square
    the einsum computes), as in PaLM's MFU; capacity padding and dropped slots are ignored.
    """
    return 6.0 * param_counts(cfg)["active"] + 12.0 * cfg.num_layers * cfg.d_model * seq_len


def rotary(x: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding on [batch, seq, heads, head_dim] (Su et al., 2021)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal cuDNN attention of ``[batch, seq, heads, head_dim]`` operands. On Explicit mesh
    axes it runs per batch shard (``shard_map``): the cuDNN call has no sharding rule, so its
    result would be typed replicated and lose the batch split the backward pass needs (a
    reduced weight's gradient is a sum over the batch's shards)."""
    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    sharding = jax.typeof(q).sharding
    if not moe.meshes.is_explicit(sharding.mesh):
        return attend(q, k, v)
    spec = sharding.spec
    return jax.shard_map(attend, mesh=sharding.mesh, in_specs=(spec,) * 3, out_specs=spec)(
        q, k, v)


class Attention(nnx.Module):
    """Causal multi-head self-attention with rotary embeddings."""

    def __init__(self, cfg: LMConfig, *, mesh=None, rngs: nnx.Rngs):
        self.num_heads, self.rope_base, self.mesh = cfg.num_heads, cfg.rope_base, mesh
        self.impl = cfg.attention_impl()
        self.fp8 = None
        if cfg.proj_gemm_dtype == "fp8":  # moe.fp8_dense options of the two projections
            self.fp8 = dict(dgrad_dtype=cfg.proj_dgrad_dtype or "fp8",
                            wgrad_dtype=cfg.proj_wgrad_dtype or "fp8")
        dt = jnp.dtype(cfg.dtype)
        init = nnx.initializers.normal(cfg.d_model**-0.5)
        self.qkv = nnx.Linear(
            cfg.d_model, 3 * cfg.d_model, use_bias=False, kernel_init=init, dtype=dt, rngs=rngs
        )
        self.out = nnx.Linear(
            cfg.d_model, cfg.d_model, use_bias=False, kernel_init=init, dtype=dt, rngs=rngs
        )

    def matrix_views(self) -> dict[str, tuple[int, int, int]]:
        """The fused QKV kernel ``[d, 3 d]`` holds three maps (for ``muon_jax``, which then
        orthogonalizes q, k and v apart, as if they were stored apart)."""
        return {"qkv.kernel": (0, 1, 3)}

    def _project(self, linear: nnx.Linear, x: jax.Array) -> jax.Array:
        if self.fp8 is None:
            return linear(x)
        return moe.fp8_dense(x.astype(linear.dtype), linear.kernel[...], mesh=self.mesh,
                             **self.fp8)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        h = self.num_heads
        q, k, v = jnp.split(self._project(self.qkv, x).reshape(b, s, 3 * h, d // h), 3, axis=2)
        q, k = rotary(q, self.rope_base), rotary(k, self.rope_base)
        with jax.named_scope("attention"):
            if self.impl == "cudnn":
                y = cudnn_attention(q, k, v).reshape(b, s, d)
            else:
                logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / (d // h) ** 0.5
                mask = jnp.tril(jnp.ones((s, s), dtype=bool))
                probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1).astype(v.dtype)
                y = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        return self._project(self.out, y)


class Block(nnx.Module):
    """Pre-norm transformer block: attention then an MoE feed-forward layer."""

    def __init__(self, cfg: LMConfig, *, mesh, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.attn = Attention(cfg, mesh=mesh, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        options = moe.MoEOptions.create(
            cfg.num_experts,
            cfg.top_k,
            expert_axis="expert",
            capacity_factor=cfg.capacity_factor,
            dispatch_dtype=cfg.dispatch_dtype,
            fp8_block_size=cfg.fp8_block_size,
            gemm_dtype=cfg.expert_gemm_dtype,
            dgrad_dtype=cfg.expert_dgrad_dtype or cfg.expert_gemm_dtype,
            wgrad_dtype=cfg.expert_wgrad_dtype or cfg.expert_gemm_dtype,
            overlap_chunks=cfg.overlap_chunks,
        )
        self.moe = moe.MoE(cfg.d_model, cfg.d_ff, options=options, mesh=mesh,
                           dtype=jnp.dtype(cfg.dtype), rngs=rngs)

    def __call__(self, x: jax.Array):
        x = x + self.attn(self.attn_norm(x))
        y, aux = self.moe(self.ffn_norm(x))
        return x + y, aux


class TransformerLM(nnx.Module):
    """Byte-level decoder-only transformer with MoE feed-forward layers."""

    def __init__(self, cfg: LMConfig, *, mesh=None, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            embedding_init=nnx.initializers.normal(1.0),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, mesh=mesh, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Linear(
                cfg.d_model,
                cfg.vocab_size,
                use_bias=False,
                kernel_init=nnx.initializers.normal(cfg.d_model**-0.5),
                rngs=rngs,
            )

    def __call__(self, tokens: jax.Array):
        """Returns f32 logits [batch, seq, vocab] and the summed MoE auxiliary outputs.

        With ``cfg.micro_batches = n > 1`` the batch runs as ``n`` token streams (sequences
        ``j, j + n, j + 2n, ...`` form stream ``j``, so a batch split over devices in blocks
        leaves every device its own share of each stream: no data moves) that go through each
        layer one after another and meet only at the head. Nothing ties one stream's layer to
        another's, so XLA's scheduler can run one stream's expert exchange (dispatch and
        combine all-to-alls) under another stream's attention and expert GEMMs, forward and
        backward: the overlap that DeepSeek-V3 gets from two micro-batches. The math is the
        batch's, except that the MoE load-balancing and z losses are means over each stream
        (averaged over streams), not over the whole batch, and a capacity limit applies to
        each stream's tokens.
        """
        n = self.cfg.micro_batches
        b = tokens.shape[0]
        if b % n:
            raise ValueError(f"batch {b} is not a multiple of micro_batches={n}; pass a batch "
                             "of whole micro-batches or lower micro_batches.")
        sharding = jax.typeof(tokens).sharding
        if moe.meshes.is_explicit(sharding.mesh):
            # Explicit axes (train_lm --muon-reduce-dtype bfloat16): the gather's output
            # sharding is not inferred, so name it (the tokens', features replicated).
            x = self.embed(tokens, out_sharding=P(*sharding.spec, None))
        else:
            x = self.embed(tokens)
        x = x.astype(jnp.dtype(self.cfg.dtype))
        streams = [x] if n == 1 else [x.reshape(b // n, n, *x.shape[1:])[:, j] for j in range(n)]
        aux_sum = None
        for block in self.blocks:
            for j in range(n):
                streams[j], aux = block(streams[j])
                aux_sum = aux if aux_sum is None else jax.tree.map(jnp.add, aux_sum, aux)
        x = streams[0] if n == 1 else jnp.stack(streams, axis=1).reshape(x.shape)
        if n > 1:  # the losses are means per stream: their mean over the streams
            aux_sum = {k: v / n if k in ("load_balance_loss", "router_z_loss") else v
                       for k, v in aux_sum.items()}
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32), aux_sum


def create_sharded(cfg: LMConfig, tx: optax.GradientTransformation, *, mesh: jax.sharding.Mesh,
                   seed: int = 0) -> tuple[TransformerLM, nnx.Optimizer]:
    """A `TransformerLM` and its `nnx.Optimizer` (over ``nnx.Param``), placed on ``mesh``.

    The model is initialized inside ``jit`` with its shardings as ``out_shardings``: every
    device computes its own shards and nothing is built on one device and then scattered, so
    the same code runs in one process and in several (``jax.distributed``)."""
    with jax.set_mesh(mesh):
        graphdef, abstract = nnx.split(nnx.eval_shape(
            lambda: TransformerLM(cfg, mesh=mesh, rngs=nnx.Rngs(seed))))
        shardings = jax.tree.map(
            lambda s: NamedSharding(mesh, s if s is not None else P()),
            nnx.get_partition_spec(abstract), is_leaf=lambda x: isinstance(x, P) or x is None)
        state = jax.jit(lambda: nnx.split(TransformerLM(cfg, mesh=mesh,
                                                        rngs=nnx.Rngs(seed)))[1],
                        out_shardings=shardings)()
        model = nnx.merge(graphdef, state)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return model, optimizer
