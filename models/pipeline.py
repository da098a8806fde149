"""Pipeline parallelism over a "pp" mesh axis, composed with TP and DP in one `shard_map`.

Layout: the stacked blocks' "layers" axis is cut into P x V chunks of L / (P V) layers and
chunk c goes to stage c mod P: V = 1 (GPipe) gives contiguous stages [s L / P, (s + 1) L / P),
V > 1 (circular) gives each stage V chunks spread over the depth. The cut is a free reshape of
the full [L, ...] arrays to [V, P, L / (P V), ...] with the P axis split over "pp". Every other
parameter is replicated over "pp": the first stage embeds, the last applies the head, and tied
embeddings need nothing special (the embedding's gradient is the psum over stages of what each
stage's use contributed: the first stage's lookup, the last stage's projection). Checkpoints
keep the full layout, as for TP (`models.parallel`).

Schedules, over the M microbatches of each dp rank's batch, as one `lax.scan` over steps in
which every stage runs one chunk on one microbatch and sends the result on with
`taco_jax.compressed_ppermute` (codec `stage_codec`; "none" is `lax.ppermute`):
- "gpipe" (Huang et al. 2019): step t, stage s runs microbatch t - s; M + P - 1 steps.
- "circular" (interleaved; MaxText's circular pipeline): stage s's u-th work item (u = t - s)
  is microbatch u mod M through its chunk u // M; the last stage sends back to the first, which
  keeps what arrives in a buffer until that microbatch's next pass (needs M >= P);
  M V + P - 1 steps, each 1 / V of a GPipe step.
Work items outside [0, M V) are bubble steps, computed and discarded. Bubble fraction
(P - 1) / (M V + P - 1). Differentiating the scan gives the backward (all forwards, then all
backwards in reverse), the activation gradients sent back by the ppermute's transpose
(compressed with the stage codec's backward variant).

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
SCHEDULES = ("gpipe", "circular")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """pp: stages along the "pp" mesh axis; microbatches per dp rank and step; schedule
    ("gpipe", or "circular" with `repeats` = V > 1 chunks per stage); stage_codec /
    stage_bwd_codec: the codecs of the activations sent forward and of their gradients sent
    back (`taco_jax.compressed_ppermute`; None: the codec's default backward)."""

    pp: int = 1
    microbatches: int = 1
    schedule: Literal["gpipe", "circular"] = "gpipe"
    repeats: int = 1
    stage_codec: str = "none"
    stage_bwd_codec: str | None = None

    def __post_init__(self):
        if self.pp < 1 or self.microbatches < 1:
            raise ValueError(f"pp={self.pp} and microbatches={self.microbatches} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {SCHEDULES}")
        if self.schedule == "gpipe" and self.repeats != 1:
            raise ValueError(f"repeats={self.repeats} needs schedule='circular'")
        if self.schedule == "circular" and (self.repeats < 2 or self.microbatches < self.pp):
            raise ValueError(
                f"schedule='circular' needs repeats >= 2 (got {self.repeats}) and microbatches "
                f">= pp (got microbatches={self.microbatches}, pp={self.pp})"
            )

    @property
    def steps(self) -> int:
        return self.microbatches * self.repeats + self.pp - 1

    @property
    def bubble_fraction(self) -> float:
        """The idle share of each stage's steps: (P - 1) / (M V + P - 1)."""
        return (self.pp - 1) / self.steps


def check_pipeline(model: ModelConfig, parallel: ParallelConfig, pipe: PipelineConfig) -> None:
    """Raises ValueError naming the value when the model cannot be staged / split as asked."""
    check_config(model, parallel)
    chunks = pipe.pp * pipe.repeats
    if model.n_layers % chunks:
        raise ValueError(
            f"model.n_layers={model.n_layers} is not a multiple of pp x repeats={chunks}"
        )
    if parallel.mode != "shard_map":
        raise ValueError(f"pipelining runs under shard_map, got parallel.mode={parallel.mode!r}")


def pipeline_param_specs(model: ModelConfig, tp_axis: str = "tp") -> dict:
    """PartitionSpecs of the staged parameters (`to_stages`): the blocks' [V, P, L / (P V), ...]
    split over "pp" on P (and over TP as `param_specs`), everything else as `param_specs`."""
    specs = param_specs(model, tp_axis)
    return _map_axes(
        lambda axes, spec: P(None, PP_AXIS, *spec) if axes[0] == "layers" else spec, model, specs
    )


def to_stages(params: dict, model: ModelConfig, pipe: PipelineConfig) -> dict:
    """Full parameters -> the staged layout: each block leaf [L, ...] -> [V, P, L / (P V), ...]
    (a free reshape; chunk c = v P + p holds layers [c L / (P V), (c + 1) L / (P V)))."""
    v, p = pipe.repeats, pipe.pp
    return _map_axes(
        lambda axes, x: x.reshape(v, p, -1, *x.shape[1:]) if axes[0] == "layers" else x,
        model,
        params,
    )


def from_stages(staged: dict, model: ModelConfig) -> dict:
    """Inverse of `to_stages` (for gradients)."""
    return _map_axes(
        lambda axes, x: x.reshape(-1, *x.shape[3:]) if axes[0] == "layers" else x, model, staged
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
    """This stage's activations to the next stage; the last sends to the first in a circular
    schedule, and nothing in GPipe."""
    pairs = [(s, s + 1) for s in range(pipe.pp - 1)]
    if pipe.repeats > 1:
        pairs.append((pipe.pp - 1, 0))
    step_key = None if key is None else jax.random.fold_in(key, step)
    return taco_jax.compressed_ppermute(
        y, PP_AXIS, pairs, codec=pipe.stage_codec, bwd_codec=pipe.stage_bwd_codec,
        key=step_key, name="pp",
    )  # fmt: skip


def _chunk(params: dict, model: ModelConfig, repeat) -> dict:
    """The local parameters with the blocks of chunk `repeat` of this stage ([L / (P V), ...])."""
    return _map_axes(
        lambda axes, x: (
            lax.dynamic_index_in_dim(x[:, 0], repeat, keepdims=False) if axes[0] == "layers" else x
        ),
        model,
        params,
    )


def _stage_loss(model, parallel, pipe, ctx, params, tokens, key):
    """This stage's share of the loss: the mean microbatch loss on the last stage, 0 on the
    others (their part of the gradient arrives through the sends). params: the staged local
    parameters (blocks [V, 1, L / (P V), ...])."""
    stages, m, v = pipe.pp, pipe.microbatches, pipe.repeats
    stage = lax.axis_index(PP_AXIS)
    micro = tokens.reshape(m, tokens.shape[0] // m, tokens.shape[1])  # [M, b, T + 1]
    t = micro.shape[-1] - 1
    t_local = t // ctx.size() if (ctx.sharded and ctx.sequence_parallel) else t
    blank = jnp.zeros((micro.shape[1], t_local, model.d_model), ctx.dtype)
    # The first stage's store of returning microbatches (circular: unused by GPipe).
    store = jnp.zeros((m, *blank.shape), ctx.dtype) if v > 1 else None

    def step(carry, i):
        received, store, total = carry
        if v > 1:  # what the last stage finished a step ago, kept for its next pass
            back = i - stages
            slot = jnp.mod(back, m)
            keep = (stage == 0) & (back >= 0)
            store = store.at[slot].set(jnp.where(keep, received, store[slot]))
        work = i - stage  # this stage's work item: microbatch work mod M, chunk work // M
        micro_index, repeat = jnp.mod(work, m), jnp.clip(work // m, 0, v - 1)
        net = nnx.merge(graphdef(model), _chunk(params, model, repeat))

        def first_pass():
            return net.embed(micro[micro_index, :, :-1], ctx).astype(ctx.dtype)

        x = lax.cond(stage == 0, first_pass, lambda: received)
        if v > 1:
            x = jnp.where((stage == 0) & (repeat > 0), store[micro_index], x)
        y = net.run_blocks(x, ctx, remat=parallel.remat, scan_layers=parallel.scan_layers)

        def loss():
            logits = net.head(y, ctx)
            targets = micro[micro_index, :, 1:]
            return layers.vocab_parallel_cross_entropy(logits, targets, ctx, model.vocab_size)

        last = (stage == stages - 1) & (work >= (v - 1) * m) & (work < v * m)
        loss = lax.cond(stage == stages - 1, loss, lambda: jnp.zeros((), jnp.float32))
        total = total + jnp.where(last, loss, 0.0)
        return (_send_forward(y, pipe, key, i), store, total), None

    init = (blank, store, jnp.zeros((), jnp.float32))
    (_, _, total), _ = lax.scan(step, init, jnp.arange(pipe.steps))
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

    params and gradients are in the full layout (`init_params`); inside, they are staged with
    `to_stages` and placed by `pipeline_param_specs`. key: PRNG key of a stochastic stage codec
    (None otherwise); fold in the training step so that every step draws new noise and a resumed
    run the same. Not jitted.
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

    def loss_and_grads(params, tokens, key=None):
        loss, grads = mapped(to_stages(params, model, pipe), tokens, key)
        return loss, from_stages(grads, model)

    return loss_and_grads
