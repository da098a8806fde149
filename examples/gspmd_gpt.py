"""A GSPMD-sharded Flax NNX GPT whose tensor-parallel reductions move FP8 (docs/gspmd.md).

The parameters carry their shardings (`nnx.with_partitioning`), the train step is a plain
`jax.jit` on a (dp, tp) mesh, and the compiler partitions everything: data parallelism, the
optimizer, the loss. Only the TP reductions go through taco_jax: the attention and MLP blocks
run their matmuls in `jax.shard_map`s manual over "tp" alone (`taco_jax.gspmd`), so each
all-reduce GSPMD would do in fp32 becomes a compressed one. Runs on 8 CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/gspmd_gpt.py --steps 30
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import taco_jax
from taco_jax.gspmd import column_parallel_dense, row_parallel_dense


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 512
    n_layers: int = 2
    seq_len: int = 64


def _param(rngs: nnx.Rngs, shape, sharding, fan_in: int) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.normal(fan_in**-0.5), sharding)
    return nnx.Param(init(rngs.params(), shape))


def attention(x, w_qkv, w_out, comm: taco_jax.TPComm):
    """Causal self-attention, this TP rank's heads (Megatron): f, QKV, attention, out, g."""

    def heads(x, w_qkv, w_out):  # x [B, T, D], w_qkv [D, 3, H/N, E], w_out [H/N, E, D]
        q, k, v = jnp.einsum("BTD,DKHE->KBTHE", taco_jax.copy_to_tp(x, comm), w_qkv)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, T, H/N, E]
        return taco_jax.reduce_from_tp(jnp.einsum("BTHE,HED->BTD", o, w_out), comm)

    specs = (P(), P(None, None, "tp"), P("tp"))
    return jax.shard_map(heads, in_specs=specs, out_specs=P(), axis_names={"tp"})(x, w_qkv, w_out)


class Block(nnx.Module):
    def __init__(self, cfg: Config, comm: taco_jax.TPComm, *, rngs: nnx.Rngs):
        d, h = cfg.d_model, cfg.n_heads
        self.comm = comm
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.w_qkv = _param(rngs, (d, 3, h, d // h), (None, None, "tp", None), d)
        self.w_out = _param(rngs, (h, d // h, d), ("tp", None, None), d)
        self.w_up = _param(rngs, (d, cfg.d_ff), (None, "tp"), d)  # column-parallel
        self.w_down = _param(rngs, (cfg.d_ff, d), ("tp", None), cfg.d_ff)  # row-parallel

    def __call__(self, x):  # x [B, T, D]
        x = x + attention(self.ln1(x), self.w_qkv[...], self.w_out[...], self.comm)
        h = jax.nn.gelu(column_parallel_dense(self.ln2(x), self.w_up[...], self.comm))
        return x + row_parallel_dense(h, self.w_down[...], self.comm)


class GPT(nnx.Module):
    def __init__(self, cfg: Config, comm: taco_jax.TPComm, *, rngs: nnx.Rngs):
        self.embed = _param(rngs, (cfg.vocab, cfg.d_model), (None, None), cfg.d_model)
        self.pos = _param(rngs, (cfg.seq_len, cfg.d_model), (None, None), cfg.d_model)
        self.blocks = nnx.List([Block(cfg, comm, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)

    def __call__(self, tokens):  # tokens [B, T] -> logits [B, T, V]
        x = jax.nn.one_hot(tokens, self.embed.shape[0]) @ self.embed[...]
        x = x + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.embed[...].T  # tied head


def make_batch(cfg: Config, batch: int, key) -> jax.Array:  # [batch, T + 1]
    """Sequences counting up by a random stride mod vocab: the next token is predictable."""
    k1, k2 = jax.random.split(key)
    start = jax.random.randint(k1, (batch, 1), 0, cfg.vocab)
    stride = jax.random.randint(k2, (batch, 1), 1, 4)
    return (start + stride * jnp.arange(cfg.seq_len + 1)) % cfg.vocab


def setup(dp: int, tp: int, codec: str, axis_type: AxisType, n_layers: int = 2):
    """The mesh, the jitted train step, and the sharded parameters and optimizer state."""
    if jax.device_count() < dp * tp:
        raise SystemExit(f"needs {dp * tp} devices, found {jax.device_count()}; on a CPU set "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8")  # fmt: skip
    mesh = jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(axis_type, axis_type),
                         devices=jax.devices()[: dp * tp])  # fmt: skip
    cfg, comm = Config(n_layers=n_layers), taco_jax.TPComm.create(fwd=codec)
    optimizer = optax.adamw(3e-3)
    with jax.set_mesh(mesh):  # annotated parameters are created sharded
        graphdef, params = nnx.split(GPT(cfg, comm, rngs=nnx.Rngs(0)))
        opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return cfg, mesh, step, params, opt_state


def train(steps: int, dp: int, tp: int, codec: str, axis_type: AxisType, n_layers: int = 2,
          batch: int = 16) -> list[float]:  # fmt: skip
    """Trains for `steps` steps on batches sharded over dp; returns the losses."""
    cfg, mesh, step, params, opt_state = setup(dp, tp, codec, axis_type, n_layers)
    losses = []
    with jax.set_mesh(mesh):
        for i in range(steps):
            tokens = make_batch(cfg, batch, jax.random.key(i))
            tokens = jax.device_put(tokens, jax.NamedSharding(mesh, P("dp")))
            params, opt_state, loss = step(params, opt_state, tokens)
            losses.append(float(loss))
            print(f"step {i:3d}  loss {losses[-1]:.4f}")
    return losses


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--codec", default="taco", choices=taco_jax.CODEC_NAMES)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--axis-type", default="explicit", choices=["explicit", "auto"])
    args = parser.parse_args(argv)
    axis_type = AxisType.Explicit if args.axis_type == "explicit" else AxisType.Auto
    return train(args.steps, args.dp, args.tp, args.codec, axis_type, args.layers)


if __name__ == "__main__":
    main()
