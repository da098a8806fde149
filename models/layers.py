"""Primitive layers of the per-device model, and the TP context they communicate through.

Every function here sees only this device's shard of a parameter: the head, MLP and vocabulary
counts come from the parameter shapes, so the same code is the unsharded model (`TPContext()`:
no collectives) and one rank of a Megatron TP group (`TPContext(comm)`), whether the group is
a `shard_map` mesh axis or a `vmap` axis. All TP communication goes through `taco_jax.tp`.

Notation: B batch, T positions (T_sp = T / tp with sequence parallelism), D model width,
K KV heads, R = q_per_kv + 2 projection slots per KV head (its queries, key, value), N query
heads, H head size, F MLP width, V vocabulary; local sizes are per TP rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from taco_jax import (
    TPComm,
    comm_config,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    scatter_to_sp,
)
from taco_models.config import RopeScaling


@dataclasses.dataclass(frozen=True)
class TPContext:
    """How one rank of the model communicates. Static and hashable.

    comm: the TP axis and its codecs; None is the unsharded model (every operator is identity).
    sequence_parallel: activations outside the column/row-parallel pairs are split along T.
    dtype: compute dtype of matmuls and activations (parameters stay fp32).
    overlap_chunks: independent batch chunks through the blocks (`ParallelConfig.overlap_chunks`).
    ranks_vmapped: the ranks run under `jax.vmap` (emulated TP, `taco_models.spmd`).
    """

    comm: TPComm | None = None
    sequence_parallel: bool = False
    dtype: jnp.dtype = jnp.bfloat16
    attention: str = "auto"  # "auto" | "xla" | "cudnn", see `attention`
    overlap_chunks: int = 1
    ranks_vmapped: bool = False

    @property
    def sharded(self) -> bool:
        return self.comm is not None

    @property
    def exact(self) -> TPComm:
        """The same axis with uncompressed collectives both ways: loss statistics must be exact."""
        none = comm_config("none")
        return dataclasses.replace(self.comm, fwd=none, bwd=none)

    @property
    def names_layers(self) -> bool:
        """Whether call sites need their layer's index: to report it (telemetry) or to pick a
        codec by it (`site_codecs`). Else none is passed, and the program is what it is
        without names."""
        if not self.sharded:
            return False
        return any(c.telemetry or c.site_codecs for c in (self.comm.fwd, self.comm.bwd))

    def untracked(self) -> TPContext:
        """The same context with the collectives' telemetry off."""
        if not self.sharded:
            return self
        fwd = dataclasses.replace(self.comm.fwd, telemetry=False)
        bwd = dataclasses.replace(self.comm.bwd, telemetry=False)
        return dataclasses.replace(self, comm=dataclasses.replace(self.comm, fwd=fwd, bwd=bwd))

    def rank(self) -> jax.Array | int:
        return lax.axis_index(self.comm.axis_name) if self.sharded else 0

    def size(self) -> int:
        return lax.axis_size(self.comm.axis_name) if self.sharded else 1

    def enter(self, x: jax.Array, name: str = "enter", layer=None) -> jax.Array:
        """Before a column-parallel layer: f, or the SP all-gather. [B, T(_sp), D] -> [B, T, D].
        name, layer: the call site (`taco_jax.telemetry`), e.g. "mlp_in" of layer 3."""
        if not self.sharded:
            return x
        if self.sequence_parallel:
            return gather_from_sp(x, self.comm, axis=1, name=name, layer=layer)
        return copy_to_tp(x, self.comm, name=name, layer=layer)

    def exit(self, x: jax.Array, name: str = "exit", layer=None) -> jax.Array:
        """After a row-parallel layer: g or SP reduce-scatter; [B, T, D]{U} -> [B, T(_sp), D].
        name, layer: the call site, as `enter`'s."""
        if not self.sharded:
            return x
        if self.sequence_parallel:
            return scatter_to_sp(x, self.comm, axis=1, name=name, layer=layer)
        return reduce_from_tp(x, self.comm, name=name, layer=layer)

    def enter_product(
        self, subscripts: str, x: jax.Array, w: jax.Array, name: str = "enter", layer=None
    ) -> jax.Array:
        """`jnp.einsum(subscripts, enter(x), w)`: a column-parallel layer's product."""
        return jnp.einsum(subscripts, self.enter(x, name, layer), w)

    def exit_product(
        self, subscripts: str, x: jax.Array, w: jax.Array, name: str = "exit", layer=None
    ) -> jax.Array:
        """`exit(jnp.einsum(subscripts, x, w))`: a row-parallel layer's product."""
        return self.exit(jnp.einsum(subscripts, x, w), name, layer)

    def psum_exact(self, x: jax.Array) -> jax.Array:
        """Exact `lax.psum` over TP with Megatron semantics (identity backward), differentiable."""
        return reduce_from_tp(x, self.exact) if self.sharded else x


def param(rngs: nnx.Rngs, shape, axes, std: float | None) -> nnx.Param:
    """An fp32 parameter ~ N(0, std^2) (zeros if std is None) with logical axis names `axes`,
    which `parallel.py` maps to mesh axes."""
    if std is None:
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, axes=tuple(axes))


def ones(shape, axes) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, jnp.float32), axes=tuple(axes))


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis with fp32 statistics; returns x's dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * lax.rsqrt(var + eps) * scale + bias
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019) over the last axis with fp32 statistics."""
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps) * scale
    return y.astype(x.dtype)


def rotary_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
    """The rotary frequencies theta^(-2i/H), i < H/2: [H/2] fp32.

    With `scaling`, Llama 3.1's ("llama3", as transformers' `_compute_llama3_parameters`): a
    frequency f of wavelength w = 2 pi / f is kept where w < L / high_freq_factor, divided by
    factor where w > L / low_freq_factor, and in between (1 - s) f / factor + s f with
    s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor), L the
    original_max_position_embeddings (continuous at both ends: s = 1 and s = 0 there).
    """
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return inv_freq
    context = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    s = (context / wavelength - low) / (high - low)
    smoothed = (1 - s) * inv_freq / scaling.factor + s * inv_freq
    scaled = jnp.where(wavelength > context / low, inv_freq / scaling.factor, smoothed)
    return jnp.where(wavelength < context / high, inv_freq, scaled)


def rotary(
    x: jax.Array,
    theta: float,
    scaling: RopeScaling | None = None,
    offset: jax.Array | int = 0,
) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), half-split layout as in Qwen2 / Llama.

    x: [B, T, N, H] at positions offset..offset+T-1 -> same shape; pairs (i, i + H/2) rotate by
    position * `rotary_frequencies(H, theta, scaling)`[i].
    """
    t, h = x.shape[1], x.shape[-1]
    inv_freq = rotary_frequencies(h, theta, scaling)  # [H/2]
    positions = offset + jnp.arange(t, dtype=jnp.float32)
    angles = positions[:, None] * inv_freq  # [T, H/2]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# "auto": cuDNN flash attention where it applies (GPU, 16-bit), else XLA; "xla" forces XLA
# (e.g. where the installed cuDNN lacks the fused kernel).
def uses_cudnn(q: jax.Array, implementation: str = "auto") -> bool:
    """Whether `attention` runs cuDNN's fused kernel for `q` under `implementation`."""
    if implementation != "auto":
        return implementation == "cudnn"
    return jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    implementation: str = "auto",
    ranks_vmapped: bool = False,
) -> jax.Array:
    """Causal (grouped-query) attention: q [B, T, N, H], k / v [B, T, K, H] -> [B, T, N, H].

    Query head n reads KV head n // (N / K) (the layout of `jax.nn.dot_product_attention`).
    "auto": cuDNN's fused flash attention on GPU with bf16, XLA's reference elsewhere.
    ranks_vmapped: the caller runs under `jax.vmap` over emulated ranks; cuDNN then runs through
    `attention_over_vmapped_axes`, whose values are the same.
    """
    implementation = "cudnn" if uses_cudnn(q, implementation) else "xla"
    if ranks_vmapped and implementation == "cudnn":
        return attention_over_vmapped_axes(q, k, v, implementation)
    return _causal_attention(q, k, v, implementation)


def _causal_attention(q, k, v, implementation):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def _fold_vmapped_axes(fn):
    """`fn` (arrays with a leading batch axis in, a pytree of such arrays out) under `jax.vmap`
    as one call of `fn` with each vmapped axis merged into the leading batch axis, so that `fn`
    never sees a batching tracer. cuDNN's attention primitives batch only over axis 0, which
    the backward of a vmapped model does not keep (their batching rule raises)."""

    @jax.custom_batching.custom_vmap
    def folded(*args):
        return fn(*args)

    @folded.def_vmap
    def _merge_into_batch(axis_size, in_batched, *args):
        args = [
            a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip(args, in_batched, strict=True)
        ]
        out = folded(*(a.reshape(-1, *a.shape[2:]) for a in args))  # nested vmaps fold again
        unfold = lambda o: o.reshape(axis_size, -1, *o.shape[1:])
        return jax.tree.map(unfold, out), jax.tree.map(lambda _: True, out)

    return folded


def _attention_grads(q, k, v, g, implementation):
    return jax.vjp(lambda *qkv: _causal_attention(*qkv, implementation), q, k, v)[1](g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention_over_vmapped_axes(q, k, v, implementation: str):
    """`jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)`
    (implementation "xla" or "cudnn"), the same values, for callers under `jax.vmap`: forward
    and backward each run as one call over every vmapped rank's batch
    (`_fold_vmapped_axes`). The backward recomputes the forward (one more attention forward
    per layer) rather than carry cuDNN's residuals through the fold; without a vmap it is the
    plain call with that recomputation."""
    return _fold_vmapped_axes(functools.partial(_causal_attention, implementation=implementation))(
        q, k, v
    )


def _attention_fwd(q, k, v, implementation):
    return attention_over_vmapped_axes(q, k, v, implementation), (q, k, v)


def _attention_bwd(implementation, residuals, g):
    grads = functools.partial(_attention_grads, implementation=implementation)
    return _fold_vmapped_axes(grads)(*residuals, g)


attention_over_vmapped_axes.defvjp(_attention_fwd, _attention_bwd)


def vocab_parallel_embed(
    table: jax.Array,  # [V_local, D] fp32, rows rank * V_local ...
    tokens: jax.Array,  # [B, T] int32, full vocabulary ids
    ctx: TPContext,
) -> jax.Array:
    """Megatron's vocab-parallel embedding: equal to `table_full[tokens]`. -> [B, T(_sp), D] partial
    sums reduced by g (or the SP reduce-scatter). The gather reads the fp32 table so that its
    gradient (a scatter-add of repeated tokens) accumulates in fp32."""
    v_local = table.shape[0]
    local = tokens - ctx.rank() * v_local
    mine = (local >= 0) & (local < v_local)
    rows = jnp.take(table, jnp.where(mine, local, 0), axis=0)  # [B, T, D]
    rows = jnp.where(mine[..., None], rows, 0.0).astype(ctx.dtype)
    return ctx.exit(rows, "embed")


def vocab_parallel_cross_entropy(
    logits: jax.Array,  # [B, T, V_local], this rank's vocabulary shard
    targets: jax.Array,  # [B, T] int32
    ctx: TPContext,
    vocab_size: int,
) -> jax.Array:
    """Mean token cross-entropy over the sharded vocabulary; equal to
    `optax.softmax_cross_entropy_with_integer_labels(full[..., :vocab_size], targets).mean()`
    with `full` the logits gathered over TP.

    Megatron's vocab-parallel loss: the max is a constant (stop_gradient), and the two psums
    (sum of exponentials, target logit) are exact and replicate the loss on every rank; their
    backward is identity, so each rank's logit gradient is softmax - onehot on its own shard.
    Columns >= vocab_size (padding) are excluded. Statistics in fp32.
    """
    v_local = logits.shape[-1]
    offset = ctx.rank() * v_local
    z = logits.astype(jnp.float32)
    column = offset + jnp.arange(v_local)
    if vocab_size < ctx.size() * v_local:  # padded columns exist (static shapes)
        z = jnp.where(column < vocab_size, z, -jnp.inf)
    local_max = lax.stop_gradient(jnp.max(z, axis=-1))
    m = lax.pmax(local_max, ctx.comm.axis_name) if ctx.sharded else local_max  # [B, T]
    m = lax.stop_gradient(m)
    sum_exp = ctx.psum_exact(jnp.sum(jnp.exp(z - m[..., None]), axis=-1))  # [B, T]
    local = targets - offset
    mine = (local >= 0) & (local < v_local)
    picked = jnp.take_along_axis(z, jnp.where(mine, local, 0)[..., None], axis=-1)[..., 0]
    target_logit = ctx.psum_exact(jnp.where(mine, picked, 0.0))  # [B, T]
    return jnp.mean(jnp.log(sum_exp) + m - target_logit)
