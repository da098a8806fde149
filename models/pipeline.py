"""Pipeline parallelism over a "pp" mesh axis, composed with TP and DP in one `shard_map`.

Layout: the stacked blocks' "layers" axis is split over "pp" (stage s holds layers
[s L / P, (s + 1) L / P), contiguous); every other parameter is replicated over "pp", so the
first stage embeds, the last applies the head, and tied embeddings need nothing special: the
embedding's gradient is the sum over stages of what each stage's use contributed (the first
stage's lookup, the last stage's projection), a psum over "pp". Checkpoints keep the full
layout, as for TP (`models.parallel`).

Schedule: GPipe (Huang et al. 2019). The global batch of each dp rank is split into M
microbatches; in step t of M + P - 1, stage s runs microbatch t - s (a bubble step when that is
not in [0, M): its result is discarded), the first stage embeds it, the last computes its loss,
and every stage sends its activations to the next with `taco_jax.compressed_ppermute` (codec
`stage_codec`: "none" is `lax.ppermute`). Differentiating the scan of steps gives GPipe's
backward: all forwards, then all backwards in reverse, the activation gradients sent back by
the ppermute's transpose (compressed with the stage codec's backward variant). Bubble fraction
(P - 1) / (M + P - 1).

Gradient convention as `models.parallel`: `value_and_grad` runs inside the per-device function
on this stage's part of the loss (the last stage's microbatch losses, zero elsewhere; the chain
rule crosses stages through the sends), then gradients of pp-replicated parameters are summed
over "pp" and everything is averaged over "dp".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import taco_jax
from models import layers
from models.config import ModelConfig
from models.parallel import (
    DP_AXIS,
    ParallelConfig,
    _context,
    _map_axes,
    check_config,
    graphdef,
    param_specs,
    replicated_mask,
)

PP_AXIS = "pp"
SCHEDULES = ("gpipe",)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """pp: stages along the "pp" mesh axis; microbatches per dp rank and step; schedule;
    stage_codec / stage_bwd_codec: the codecs of the activations sent forward and of their
    gradients sent back (`taco_jax.compressed_ppermute`; None: the codec's default backward)."""

    pp: int = 1
    microbatches: int = 1
    schedule: Literal["gpipe"] = "gpipe"
    stage_codec: str = "none"
    stage_bwd_codec: str | None = None

    def __post_init__(self):
        if self.pp < 1 or self.microbatches < 1:
            raise ValueError(f"pp={self.pp} and microbatches={self.microbatches} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {SCHEDULES}")

    @property
    def bubble_fraction(self) -> float:
        """GPipe's idle share of each stage's steps: (P - 1) / (M + P - 1)."""
        return (self.pp - 1) / (self.microbatches + self.pp - 1)


def check_pipeline(model: ModelConfig, parallel: ParallelConfig, pipe: PipelineConfig) -> None:
    """Raises ValueError naming the value when the model cannot be staged / split as asked."""
    check_config(model, parallel)
    if model.n_layers % pipe.pp:
        raise ValueError(f"model.n_layers={model.n_layers} is not a multiple of pp={pipe.pp}")
    if parallel.mode != "shard_map":
        raise ValueError(f"pipelining runs under shard_map, got parallel.mode={parallel.mode!r}")


def pipeline_param_specs(model: ModelConfig, tp_axis: str = "tp") -> dict:
    """`param_specs` with the blocks' leading "layers" axis split over "pp"."""
    specs = param_specs(model, tp_axis)
    return _map_axes(
        lambda axes, spec: P(PP_AXIS, *spec[1:]) if axes[0] == "layers" else spec, model, specs
    )


def pp_replicated_mask(model: ModelConfig) -> dict:
    """True for the parameters every stage holds whole (all but the blocks)."""
    return _map_axes(lambda axes: axes[0] != "layers", model)


def make_pipeline_mesh(parallel: ParallelConfig, pipe: PipelineConfig, tp_axis: str = "tp"):
    """("dp", "pp", tp_axis) over dp x pp x tp devices."""
    n = parallel.dp * pipe.pp * parallel.tp
    if n > jax.device_count():
        raise ValueError(
            f"dp={parallel.dp} x pp={pipe.pp} x tp={parallel.tp} needs {n} devices, "
            f"{jax.device_count()} visible; on a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting"
        )
    shape, names = (parallel.dp, pipe.pp, parallel.tp), (DP_AXIS, PP_AXIS, tp_axis)
    auto = (jax.sharding.AxisType.Auto,) * 3
    return jax.make_mesh(shape, names, auto, devices=jax.devices()[:n])


def _send_forward(y, pipe: PipelineConfig, key, step):
    """This stage's activations to the next stage (the last stage sends nothing)."""
    pairs = [(s, s + 1) for s in range(pipe.pp - 1)]
    step_key = None if key is None else jax.random.fold_in(key, step)
    return taco_jax.compressed_ppermute(
        y, PP_AXIS, pairs, codec=pipe.stage_codec, bwd_codec=pipe.stage_bwd_codec,
        key=step_key, name="pp",
    )  # fmt: skip


def _stage_loss(model, parallel, pipe, ctx, params, tokens, key):
    """This stage's share of the GPipe loss: the mean microbatch loss on the last stage, 0 on
    the others (their part of the gradient arrives through the sends)."""
    stages, m = pipe.pp, pipe.microbatches
    stage = lax.axis_index(PP_AXIS)
    micro = tokens.reshape(m, tokens.shape[0] // m, tokens.shape[1])  # [M, b, T + 1]
    net = nnx.merge(graphdef(model), params)
    t = micro.shape[-1] - 1
    t_local = t // ctx.size() if (ctx.sharded and ctx.sequence_parallel) else t
    blank = jnp.zeros((micro.shape[1], t_local, model.d_model), ctx.dtype)

    def step(carry, i):
        received, total = carry
        inputs = micro[jnp.clip(i, 0, m - 1), :, :-1]
        x = lax.cond(stage == 0, lambda: net.embed(inputs, ctx).astype(ctx.dtype), lambda: received)
        y = net.run_blocks(x, ctx, remat=parallel.remat, scan_layers=parallel.scan_layers)
        finished = i - (stages - 1)  # the microbatch the last stage completes in this step
        targets = micro[jnp.clip(finished, 0, m - 1), :, 1:]

        def loss():
            logits = net.head(y, ctx)
            return layers.vocab_parallel_cross_entropy(logits, targets, ctx, model.vocab_size)

        loss = lax.cond(stage == stages - 1, loss, lambda: jnp.zeros((), jnp.float32))
        total = total + jnp.where((finished >= 0) & (finished < m), loss, 0.0)
        return (_send_forward(y, pipe, key, i), total), None

    (_, total), _ = lax.scan(step, (blank, jnp.zeros((), jnp.float32)), jnp.arange(m + stages - 1))
    return total / m


def _stage_loss_and_grads(model, parallel, pipe, ctx, params, tokens, key):
    loss, grads = jax.value_and_grad(
        lambda p: _stage_loss(model, parallel, pipe, ctx, p, tokens, key)
    )(params)
    if ctx.sharded and ctx.sequence_parallel:
        tp = ctx.comm.axis_name
        grads = jax.tree.map(
            lambda g, r: lax.psum(g, tp) if r else g, grads, replicated_mask(model)
        )
    grads = jax.tree.map(
        lambda g, r: lax.psum(g, PP_AXIS) if r else g, grads, pp_replicated_mask(model)
    )
    loss = lax.psum(loss, PP_AXIS)  # only the last stage's is non-zero
    return jax.tree.map(lambda a: lax.pmean(a, DP_AXIS), (loss, grads))


def make_pipeline_loss_and_grads(
    model: ModelConfig,
    parallel: ParallelConfig,
    pipe: PipelineConfig,
    comm: taco_jax.TPComm,
    mesh=None,
) -> Callable[[dict, jax.Array, jax.Array | None], tuple[jax.Array, dict]]:
    """(full params, tokens [B, T + 1], key) -> (mean loss, full-layout gradients averaged over
    dp), with the model staged over "pp" (`PipelineConfig`), TP over `comm.axis_name` and DP.

    key: PRNG key of a stochastic stage codec (None otherwise); fold in the training step so
    that every step draws new noise and a resumed run the same. Not jitted; place inputs with
    `NamedSharding(mesh, pipeline_param_specs(model))` and `P("dp")`.
    """
    check_pipeline(model, parallel, pipe)
    mesh = make_pipeline_mesh(parallel, pipe, comm.axis_name) if mesh is None else mesh
    ctx = _context(parallel, comm)
    specs = pipeline_param_specs(model, comm.axis_name)

    def per_device(params, tokens, key):
        if tokens.shape[0] % pipe.microbatches:
            raise ValueError(
                f"the batch of each dp rank, {tokens.shape[0]}, is not a multiple of "
                f"microbatches={pipe.microbatches}"
            )
        return _stage_loss_and_grads(model, parallel, pipe, ctx, params, tokens, key)

    mapped = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(specs, P(DP_AXIS), P()),
        out_specs=(P(), specs),
        check_vma=False,
    )
    return lambda params, tokens, key=None: mapped(params, tokens, key)
