"""Text from a model: autoregressive decoding with a key / value cache, greedy or sampled.

    tokens = generate(cfg, params, prompt, 32)                         # greedy, [B, 32]
    tokens = generate(cfg, params, prompt, 32, temperature=0.8, top_k=40, seed=1)

The unsharded model (`TPContext()`, no collectives) on one device, CPU or GPU, jitted: a
prefill runs the prompt [B, T] through every block, writing each layer's keys and values into a
cache [L, B, T + max_new_tokens, K, H]; then each step feeds the last token alone, its queries
attending to the cache up to its own position. The blocks and projections are the model's own
(`Attention.qkv` / `Attention.out`, `Mlp`, `Norm`, `Transformer.head`); only the attention over
the cache is this module's. Greedy decoding equals the argmax of the full forward, token for
token, and transformers' greedy generation on the GPT-2 and Qwen2 fixtures
(tests/models/test_generate.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from taco_models.config import ModelConfig
from taco_models.layers import TPContext
from taco_models.model import Block, Transformer


def generate(
    cfg: ModelConfig,
    params: dict,
    prompt: jax.Array,  # [B, T] int32, T >= 1
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> jax.Array:  # [B, max_new_tokens] int32
    """The next `max_new_tokens` tokens after each row of `prompt`.

    temperature 0: greedy (the argmax of the logits); above 0: drawn from softmax(logits /
    temperature), over the `top_k` largest logits only where given, from `jax.random.key(seed)`.
    Only the vocabulary's `vocab_size` ids are ever chosen (never its padding). A gpt model's
    learned positions bound T + max_new_tokens by `cfg.seq_len`; rotary positions do not."""
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(
            f"prompt must be [batch, tokens] with at least one token, got shape={prompt.shape}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"{max_new_tokens=} must be >= 1")
    if temperature < 0 or (top_k is not None and not 1 <= top_k <= cfg.vocab_size):
        raise ValueError(
            f"{temperature=} must be >= 0 and {top_k=} in [1, vocab_size={cfg.vocab_size}]"
        )
    total = prompt.shape[1] + max_new_tokens
    if cfg.arch == "gpt" and total > cfg.seq_len:
        raise ValueError(
            f"a prompt of {prompt.shape[1]} tokens and max_new_tokens={max_new_tokens} need "
            f"{total} positions; the model's learned positions end at seq_len={cfg.seq_len}: "
            f"at most {cfg.seq_len - prompt.shape[1]} new tokens"
        )
    run = _decoder(cfg, max_new_tokens, float(temperature), top_k, jnp.dtype(dtype))
    return run(params, prompt, jax.random.key(seed))


@functools.cache
def _decoder(cfg: ModelConfig, max_new_tokens: int, temperature: float, top_k, dtype):
    """The jitted decoding loop of `generate` for these static settings."""
    from taco_models.parallel import graphdef

    ctx = TPContext(dtype=dtype)

    @jax.jit
    def run(params, prompt, key):
        net = nnx.merge(graphdef(cfg), params)
        b, t = prompt.shape
        shape = (cfg.n_layers, b, t + max_new_tokens, cfg.n_kv_heads, cfg.head_dim)
        cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        logits, cache = _forward(net, prompt, 0, cache, ctx)
        first = _pick(logits[:, -1], cfg.vocab_size, temperature, top_k, key, 0)

        def step(carry, i):  # token i of the new ones in, token i + 1 out
            token, cache = carry
            logits, cache = _forward(net, token[:, None], t + i, cache, ctx)
            following = _pick(logits[:, 0], cfg.vocab_size, temperature, top_k, key, i + 1)
            return (following, cache), following

        _, rest = lax.scan(step, (first, cache), jnp.arange(max_new_tokens - 1))
        return jnp.concatenate([first[:, None], rest.T], axis=1)

    return run


def _forward(net: Transformer, tokens: jax.Array, start, cache, ctx: TPContext):
    """Logits [B, T, V] of `tokens` [B, T] at positions start .. start + T - 1, and the cache
    with their keys and values written in."""
    graphdef, stacked = nnx.split(net.blocks)

    def block(x, layer):
        state, keys, values = layer
        x, keys, values = _cached_block(nnx.merge(graphdef, state), x, keys, values, start, ctx)
        return x, (keys, values)

    x = net.embed(tokens, ctx, offset=start)
    x, cache = lax.scan(block, x, (stacked, *cache))
    return net.head(x, ctx), cache


def _cached_block(layer: Block, x, keys, values, start, ctx: TPContext):
    """`Block.__call__` with attention over the cache (keys / values [B, S, K, H])."""
    q, key, value = layer.attn.qkv(layer.norm_attn(x), ctx, offset=start)
    keys = lax.dynamic_update_slice_in_dim(keys, key.astype(keys.dtype), start, axis=1)
    values = lax.dynamic_update_slice_in_dim(values, value.astype(values.dtype), start, axis=1)
    x = x + layer.attn.out(_attend(q, keys, values, start), ctx)
    return x + layer.mlp(layer.norm_mlp(x), ctx), keys, values


def _attend(q, keys, values, start) -> jax.Array:
    """Causal grouped-query attention of queries q [B, T, N, H] at positions start + t over
    the cache [B, S, K, H]: query head n reads KV head n // (N / K) (as `layers.attention`),
    key s only where s <= start + t (the cache beyond is not written yet). fp32 softmax."""
    b, t, n, h = q.shape
    k = keys.shape[2]
    q = q.reshape(b, t, k, n // k, h)
    scores = jnp.einsum("BTKRH,BSKH->BKRTS", q, keys, preferred_element_type=jnp.float32)
    seen = jnp.arange(keys.shape[1])[None, :] <= start + jnp.arange(t)[:, None]  # [T, S]
    scores = jnp.where(seen, scores / math.sqrt(h), -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    return jnp.einsum("BKRTS,BSKH->BTKRH", weights, values).reshape(b, t, n, h)


def _pick(logits, vocab_size: int, temperature: float, top_k, key, index) -> jax.Array:
    """The next token of each row from logits [B, V_padded]: argmax, or a draw."""
    logits = logits[:, :vocab_size].astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    return jax.random.categorical(jax.random.fold_in(key, index), logits).astype(jnp.int32)
