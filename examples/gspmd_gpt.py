"""A GSPMD-sharded Flax NNX GPT whose tensor-parallel reductions move FP8 (docs/gspmd.md).

Written as MaxText and Levanter write models: the layers' parameters are stacked [L, ...] and
the block runs under `jax.lax.scan` inside `jax.checkpoint`; the parameters carry their
shardings (`nnx.with_partitioning`: fsdp on the embedding, tensor on heads and MLP columns) on
a (data, fsdp, tensor) mesh, and the train step is a plain `jax.jit` that the compiler
partitions: data parallelism, FSDP's gathers, the optimizer, the loss. Only the TP reductions go
through taco_jax: the attention and MLP blocks run their matmuls in `jax.shard_map`s manual over
"tensor" alone (`taco_jax.gspmd`), so each all-reduce GSPMD would do in fp32 becomes a
compressed one. Runs on 8 CPU devices:

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

AXES = ("data", "fsdp", "tensor")
BATCH = P(("data", "fsdp"))  # the batch over every data-parallel axis
REMAT = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
}


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 512
    n_layers: int = 2
    seq_len: int = 64
    remat: str = "nothing"  # a key of REMAT


def _param(rngs: nnx.Rngs, shape, sharding, fan_in: int) -> nnx.Param:
    init = nnx.with_partitioning(nnx.initializers.normal(fan_in**-0.5), sharding)
    return nnx.Param(init(rngs.params(), shape))


def _norm(x, scale):  # LayerNorm without bias, x [B, T, D], scale [D]
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * scale


def attention(x, w_qkv, w_out, comm: taco_jax.TPComm):
    """Causal self-attention, this TP rank's heads (Megatron): f, QKV, attention, out, g."""

    def heads(x, w_qkv, w_out):  # x [B, T, D], w_qkv [D, 3, H/N, E], w_out [H/N, E, D]
        q, k, v = jnp.einsum("BTD,DKHE->KBTHE", taco_jax.copy_to_tp(x, comm), w_qkv)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, T, H/N, E]
        return taco_jax.reduce_from_tp(jnp.einsum("BTHE,HED->BTD", o, w_out), comm)

    if jax.sharding.get_abstract_mesh().are_all_axes_explicit:  # FSDP's gather, typed
        w_qkv = jax.sharding.reshard(w_qkv, P(None, None, "tensor"))
        w_out = jax.sharding.reshard(w_out, P("tensor"))
    specs = (P(), P(None, None, "tensor"), P("tensor"))
    return jax.shard_map(heads, in_specs=specs, out_specs=P(), axis_names={"tensor"})(
        x, w_qkv, w_out
    )


def block(x, layer: dict, comm: taco_jax.TPComm):  # x [B, T, D]; layer: one layer's weights
    x = x + attention(_norm(x, layer["ln1"]), layer["w_qkv"], layer["w_out"], comm)
    h = jax.nn.gelu(column_parallel_dense(_norm(x, layer["ln2"]), layer["w_up"], comm))
    return x + row_parallel_dense(h, layer["w_down"], comm)


class GPT(nnx.Module):
    def __init__(self, cfg: Config, comm: taco_jax.TPComm, *, rngs: nnx.Rngs):
        d, h, f, n = cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.n_layers
        self.cfg, self.comm = cfg, comm
        self.embed = _param(rngs, (cfg.vocab, d), (None, None), d)  # replicated: a tied head
        self.pos = _param(rngs, (cfg.seq_len, d), (None, None), d)
        self.layers = nnx.Dict(  # stacked over the layers, axis 0 unsharded
            ln1=nnx.Param(jnp.ones((n, d))),
            ln2=nnx.Param(jnp.ones((n, d))),
            w_qkv=_param(rngs, (n, d, 3, h, d // h), (None, "fsdp", None, "tensor", None), d),
            w_out=_param(rngs, (n, h, d // h, d), (None, "tensor", None, "fsdp"), d),
            w_up=_param(rngs, (n, d, f), (None, "fsdp", "tensor"), d),  # column-parallel
            w_down=_param(rngs, (n, f, d), (None, "tensor", "fsdp"), f),  # row-parallel
        )
        self.ln_f = nnx.Param(jnp.ones((d,)))

    def __call__(self, tokens):  # tokens [B, T] -> logits [B, T, V]
        embed = self.embed[...]
        x = jax.nn.one_hot(tokens, embed.shape[0]) @ embed + self.pos[: tokens.shape[1]]
        body = lambda x, layer: (block(x, layer, self.comm), None)
        body = jax.checkpoint(body, policy=REMAT[self.cfg.remat])
        x, _ = jax.lax.scan(body, x, {k: v[...] for k, v in self.layers.items()})
        return _norm(x, self.ln_f[...]) @ embed.T  # tied head


def make_batch(cfg: Config, batch: int, key) -> jax.Array:  # [batch, T + 1]
    """Sequences counting up by a random stride mod vocab: the next token is predictable."""
    k1, k2 = jax.random.split(key)
    start = jax.random.randint(k1, (batch, 1), 0, cfg.vocab)
    stride = jax.random.randint(k2, (batch, 1), 1, 4)
    return (start + stride * jnp.arange(cfg.seq_len + 1)) % cfg.vocab


def setup(shape: tuple[int, int, int], codec: str, axis_type: AxisType, n_layers: int = 2):
    """The mesh, the jitted train step, and the sharded parameters and optimizer state."""
    count = shape[0] * shape[1] * shape[2]
    if jax.device_count() < count:
        raise SystemExit(
            f"needs {count} devices, found {jax.device_count()}; on a CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8"
        )
    mesh = jax.make_mesh(shape, AXES, axis_types=(axis_type,) * 3, devices=jax.devices()[:count])
    cfg, comm = Config(n_layers=n_layers), taco_jax.TPComm.create("tensor", fwd=codec)
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


def train(
    steps: int,
    shape: tuple[int, int, int],
    codec: str,
    axis_type: AxisType,
    n_layers: int = 2,
    batch: int = 16,
) -> list[float]:
    """Trains for `steps` steps on batches sharded over (data, fsdp); returns the losses."""
    cfg, mesh, step, params, opt_state = setup(shape, codec, axis_type, n_layers)
    losses = []
    with jax.set_mesh(mesh):
        for i in range(steps):
            tokens = make_batch(cfg, batch, jax.random.key(i))
            tokens = jax.device_put(tokens, jax.NamedSharding(mesh, BATCH))
            params, opt_state, loss = step(params, opt_state, tokens)
            losses.append(float(loss))
            print(f"step {i:3d}  loss {losses[-1]:.4f}")
    return losses


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="The mesh is data x fsdp x tensor devices; on a CPU, set XLA_FLAGS="
        "--xla_force_host_platform_device_count to their product.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=30, help="AdamW steps to train")
    parser.add_argument("--data", type=int, default=2, help="devices on the data axis")
    parser.add_argument("--fsdp", type=int, default=2, help="devices on the fsdp axis")
    parser.add_argument("--tensor", type=int, default=2, help="devices on the tensor (TP) axis")
    parser.add_argument(
        "--codec",
        default="taco",
        choices=taco_jax.CODEC_NAMES,
        help="codec of the TP reductions (none: exact fp32)",
    )
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (scanned)")
    parser.add_argument(
        "--axis-type",
        default="explicit",
        choices=["explicit", "auto"],
        help="the mesh axes' type: Explicit (sharding in types) or Auto (the compiler's)",
    )
    args = parser.parse_args(argv)
    axis_type = AxisType.Explicit if args.axis_type == "explicit" else AxisType.Auto
    shape = (args.data, args.fsdp, args.tensor)
    return train(args.steps, shape, args.codec, axis_type, args.layers)


if __name__ == "__main__":
    main()
