"""The decoder-only transformer (GPT-2 / Megatron GPT, Qwen2.5 or Llama) as one per-device function.

Megatron TP layout (Shoeybi et al. 2019, section 3), per block:
  x -> norm -> enter (f / SP all-gather) -> QKV (column-parallel over KV heads) -> attention
    -> out-projection (row-parallel over heads) -> exit (g / SP reduce-scatter) -> + x
  x -> norm -> enter -> MLP up / gate (column-parallel over F) -> act -> down (row-parallel)
    -> exit -> + x
The embedding and the output head are vocab-parallel. Parameters hold logical axis names
(`layers.param`); `parallel.py` maps "vocab", "kv_heads", "heads" and "mlp" to the TP mesh axis.
Blocks are stacked along a leading "layers" axis and run under `lax.scan` (one compiled block).

QKV layout [D, K, R, H]: KV head k owns slots 0..R-3 (its q_per_kv query heads), R-2 (key) and
R-1 (value), so sharding the K axis gives every rank whole GQA groups (needs K % tp == 0).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from taco_jax import telemetry
from taco_models import layers
from taco_models.config import ModelConfig
from taco_models.layers import TPContext

# Saved under remat: the outputs of the TP collectives, so that recomputing a block's forward in
# the backward pass never repeats communication (Korthikanti et al. 2022 recompute the rest).
# Also saved: the collectives' error statistics of a measuring step (`taco_jax.telemetry`), so
# that the exact collectives beside them are not run again either.
REMAT_SAVED_NAMES = ("tp_reduce", "sp_gather", "sp_scatter", telemetry.CHECKPOINT_NAME)


class Norm(nnx.Module):
    """LayerNorm (gpt) or RMSNorm (the rotary archs) over D; parameters replicated across TP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale = layers.ones((cfg.d_model,), ("embed",))
        self.bias = (
            layers.param(rngs, (cfg.d_model,), ("embed",), None) if cfg.arch == "gpt" else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, D]
        if self.bias is None:
            return layers.rms_norm(x, self.scale[...], self.eps)
        return layers.layer_norm(x, self.scale[...], self.bias[...], self.eps)


class Attention(nnx.Module):
    """Causal self-attention: column-parallel QKV over KV heads, row-parallel output projection."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, k, r, h = cfg.d_model, cfg.n_kv_heads, cfg.q_per_kv + 2, cfg.head_dim
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # GPT-2: scale residual writes
        self.rope_theta = cfg.rope_theta if cfg.rotary else None
        self.rope_scaling = cfg.rope_scaling
        self.wqkv = layers.param(
            rngs, (d, k, r, h), ("embed", "kv_heads", "slots", "head_dim"), cfg.init_std
        )
        self.bqkv = (
            layers.param(rngs, (k, r, h), ("kv_heads", "slots", "head_dim"), None)
            if cfg.qkv_bias
            else None
        )
        self.wo = layers.param(rngs, (cfg.n_heads, h, d), ("heads", "head_dim", "embed"), resid_std)
        self.bo = layers.param(rngs, (d,), ("embed",), None) if cfg.arch == "gpt" else None

    def __call__(self, x: jax.Array, ctx: TPContext, layer=None) -> jax.Array:
        # x: [B, T(_sp), D] -> same; layer: this block's index, naming its call sites
        q, key, value = self.qkv(x, ctx, layer=layer)
        o = layers.attention(q, key, value, ctx.attention, ctx.ranks_vmapped)  # [B, T, N, H]
        return self.out(o, ctx, layer)

    def qkv(self, x: jax.Array, ctx: TPContext, offset: jax.Array | int = 0, layer=None):
        """Queries [B, T, N, H] (n = k (R-2) + j), keys and values [B, T, K, H] of this rank's
        KV heads, rotated (qwen2, llama) for positions offset .. offset + T - 1."""
        w = self.wqkv[...].astype(ctx.dtype)  # [D, K, R, H] local K
        qkv = ctx.enter_product("BTD,DKRH->BTKRH", x, w, "attn_in", layer)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv[...].astype(ctx.dtype)
        b, t, k, r, h = qkv.shape
        q = qkv[:, :, :, : r - 2].reshape(b, t, k * (r - 2), h)
        key, value = qkv[:, :, :, r - 2], qkv[:, :, :, r - 1]
        if self.rope_theta is not None:
            q = layers.rotary(q, self.rope_theta, self.rope_scaling, offset)
            key = layers.rotary(key, self.rope_theta, self.rope_scaling, offset)
        return q, key, value

    def out(self, o: jax.Array, ctx: TPContext, layer=None) -> jax.Array:
        """The row-parallel output projection of the heads' outputs: [B, T, N, H] ->
        [B, T(_sp), D]."""
        out = ctx.exit_product(
            "BTNH,NHD->BTD", o, self.wo[...].astype(ctx.dtype), "attn_out", layer
        )
        return out if self.bo is None else out + self.bo[...].astype(ctx.dtype)


class Mlp(nnx.Module):
    """GELU MLP (gpt) or SwiGLU (others): column-parallel up / gate, row-parallel down, over F."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.gpt = cfg.arch == "gpt"
        if self.gpt:
            self.w_up = layers.param(rngs, (d, f), ("embed", "mlp"), cfg.init_std)
            self.b_up = layers.param(rngs, (f,), ("mlp",), None)
            self.b_down = layers.param(rngs, (d,), ("embed",), None)
        else:
            self.w_up = layers.param(rngs, (d, 2, f), ("embed", "gate", "mlp"), cfg.init_std)
        self.w_down = layers.param(rngs, (f, d), ("mlp", "embed"), resid_std)

    def __call__(self, x: jax.Array, ctx: TPContext, layer=None) -> jax.Array:
        # x: [B, T(_sp), D] -> same; layer: this block's index, naming its call sites
        w_up = self.w_up[...].astype(ctx.dtype)
        if self.gpt:
            up = ctx.enter_product("BTD,DF->BTF", x, w_up, "mlp_in", layer)
            hidden = jax.nn.gelu(up + self.b_up[...].astype(ctx.dtype))
        else:
            gate_up = ctx.enter_product("BTD,DCF->BTCF", x, w_up, "mlp_in", layer)  # C = 2
            hidden = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]  # [B, T, F] local F
        w_down = self.w_down[...].astype(ctx.dtype)
        out = ctx.exit_product("BTF,FD->BTD", hidden, w_down, "mlp_out", layer)
        return out + self.b_down[...].astype(ctx.dtype) if self.gpt else out


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.norm_attn = Norm(cfg, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.norm_mlp = Norm(cfg, rngs=rngs)
        self.mlp = Mlp(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, ctx: TPContext, layer=None) -> jax.Array:
        # x: [B, T(_sp), D] -> same; layer: this block's index (an int or traced int32)
        x = x + self.attn(self.norm_attn(x), ctx, layer)
        return x + self.mlp(self.norm_mlp(x), ctx, layer)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """`n_layers` independently initialized blocks with every parameter stacked on axis 0."""

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs)

    return create(rngs)


class Transformer(nnx.Module):
    """The whole model on one TP rank; with `TPContext()` it is the unsharded model."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        v, d = cfg.padded_vocab, cfg.d_model
        self.wte = layers.param(rngs, (v, d), ("vocab", "embed"), cfg.init_std)
        if cfg.arch == "gpt":
            self.wpe = layers.param(rngs, (cfg.seq_len, d), ("seq", "embed"), cfg.init_std)
        self.blocks = _stacked_blocks(cfg, rngs)
        self.norm_out = Norm(cfg, rngs=rngs)
        if not cfg.tied_embeddings:
            self.lm_head = layers.param(rngs, (d, v), ("embed", "vocab"), cfg.init_std)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32, T <= seq_len
        ctx: TPContext,
        *,
        remat: bool = False,
        scan_layers: bool = True,
    ) -> jax.Array:  # [B, T, V_local] logits of this rank's vocabulary shard, in ctx.dtype
        x = self.embed(tokens, ctx)
        return self.head(self.run_blocks(x, ctx, remat=remat, scan_layers=scan_layers), ctx)

    def embed(
        self, tokens: jax.Array, ctx: TPContext, offset: jax.Array | int = 0
    ) -> jax.Array:  # [B, T] -> [B, T(_sp), D]
        """Token (and, for gpt, position) embeddings: the first pipeline stage's part. offset:
        the first token's position (decoding with a cache; not with sequence parallelism)."""
        x = layers.vocab_parallel_embed(self.wte[...], tokens, ctx)
        if self.cfg.arch == "gpt":
            x = x + self._positions(tokens.shape[1], ctx, offset).astype(ctx.dtype)
        return x

    def head(self, x: jax.Array, ctx: TPContext) -> jax.Array:  # [B, T(_sp), D] -> [B, T, V_local]
        """Final norm and output projection (tied: the embedding): the last stage's part."""
        x = ctx.enter(self.norm_out(x), "head_in")  # [B, T, D]
        if self.cfg.tied_embeddings:
            return jnp.einsum("BTD,VD->BTV", x, self.wte[...].astype(ctx.dtype))
        return jnp.einsum("BTD,DV->BTV", x, self.lm_head[...].astype(ctx.dtype))

    def _positions(self, t: int, ctx: TPContext, offset: jax.Array | int = 0) -> jax.Array:
        """The learned positions offset .. offset + t - 1 (this rank's share with SP)."""
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.cfg.seq_len}")
        if not (ctx.sharded and ctx.sequence_parallel):
            return lax.dynamic_slice_in_dim(self.wpe[...], offset, t, axis=0)  # [T, D]
        t_sp = t // ctx.size()
        return lax.dynamic_slice_in_dim(self.wpe[...], ctx.rank() * t_sp, t_sp, axis=0)

    def run_blocks(
        self, x: jax.Array, ctx: TPContext, *, remat: bool, scan_layers: bool, first_layer=0
    ):
        """The stacked blocks this model holds, in order (a pipeline stage holds its own slice
        of the "layers" axis, whose first is the model's layer `first_layer`: an int or a
        traced int32). [B, T(_sp), D] -> same."""
        graphdef, stacked = nnx.split(self.blocks)
        n = jax.tree.leaves(stacked)[0].shape[0]

        def block(chunks, xs):
            layer_state, index = xs  # index: the layer's, where call sites need it, else None
            layer = nnx.merge(graphdef, layer_state)
            return tuple(layer(chunk, ctx, index) for chunk in chunks), None

        if remat:
            policy = jax.checkpoint_policies.save_only_these_names(*REMAT_SAVED_NAMES)
            block = jax.checkpoint(block, policy=policy)
        chunks = split_batch(x, ctx.overlap_chunks)
        named = ctx.names_layers
        if scan_layers:
            indices = first_layer + jnp.arange(n, dtype=jnp.int32) if named else None
            chunks = lax.scan(block, chunks, (stacked, indices))[0]
        else:
            for i in range(n):
                layer_state = jax.tree.map(lambda a, i=i: a[i], stacked)
                chunks = block(chunks, (layer_state, first_layer + i if named else None))[0]
        return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=0)


def split_batch(x: jax.Array, chunks: int) -> tuple[jax.Array, ...]:
    """[B, ...] -> `chunks` arrays [B / chunks, ...] that the blocks run independently.

    Rows of a transformer never mix, so the chunks compute what the whole batch would; being
    independent, one chunk's TP collectives can run while XLA computes another chunk's matmuls.
    """
    if chunks < 1 or x.shape[0] % chunks:
        raise ValueError(
            f"overlap_chunks={chunks} must be >= 1 and divide the per-device batch {x.shape[0]}"
        )
    return tuple(jnp.split(x, chunks, axis=0)) if chunks > 1 else (x,)
