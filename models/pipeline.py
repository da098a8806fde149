"""Pipeline parallelism over a "pp" mesh axis, composed with TP and DP in one `shard_map` (or
its one-device emulation, `ParallelConfig.mode="emulate"`).

Layout: the stacked blocks' "layers" axis is cut into P x V chunks of L / (P V) layers and
chunk c goes to stage c mod P: V = 1 (GPipe) gives contiguous stages [s L / P, (s + 1) L / P),
V > 1 (circular) gives each stage V chunks spread over the depth. The cut is a free reshape of
the full [L, ...] arrays to [V, P, L / (P V), ...] with the P axis split over "pp". Every other
parameter is replicated over "pp": the first stage embeds, the last applies the head, and tied
embeddings need nothing special (the embedding's gradient is the psum over stages of what each
stage's use contributed: the first stage's lookup, the last stage's projection; compressed with
`StageCodecs.shared_grads`). Checkpoints keep the full layout, as for TP (`models.parallel`).

Schedules, over the M microbatches of each dp rank's batch, as one `lax.scan` over steps in
which every stage runs one chunk on one microbatch and sends the result on with
`taco_jax.compressed_ppermute` (`StageCodecs`; "none" is `lax.ppermute`):
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
over "pp" and everything is averaged over "dp" (or, for a sharded optimizer, each dp rank's own
gradients are returned: `make_pipeline_loss_and_local_grads`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import taco_jax
from models import layers
from models.config import ModelConfig
from models.parallel import (
    PP_AXIS,
    ParallelConfig,
    _context,
    _map_axes,
    check_config,
    graphdef,
    make_mesh,
    param_specs,
    replicated_mask,
    spmd_map,
)


def check_pipeline(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Raises ValueError naming the value when the model cannot be staged / split as asked."""
    check_config(model, parallel)
    if parallel.mode == "vmap":
        raise ValueError("pipelining runs with parallel.mode 'shard_map' or 'emulate', not 'vmap'")


@dataclasses.dataclass(frozen=True)
class StageCodecs:
    """The codecs of the pipeline's traffic over "pp".

    forward / backward: of the activations sent forward and of their gradients sent back
      (`taco_jax.compressed_ppermute`; backward None: the codec's default backward).
    shared_grads: of the sum over stages of the gradients of the parameters every stage holds
      (`pp_replicated_mask`: the embedding, tied to the head of the last stage, positions, the
      final norm) through `taco_jax.compressed_psum`: a TP codec name (`taco_jax.CODEC_NAMES`,
      the collective's "auto" options) or a `taco_jax.CommConfig`; "none" is `lax.psum`. For
      GPT-1.3B that sum is 0.4 GB of fp32, more bytes than all of a step's stage sends
      (BENCHMARKS.md, "Pipelined training step").
    telemetry: record each compressed collective's relative error (`taco_jax.telemetry`, tags
      "pp:<codec>" and "pp_grads:<codec>").
    """

    forward: str = "none"
    backward: str | None = None
    telemetry: bool = False
    shared_grads: str | taco_jax.CommConfig = "none"


UNCOMPRESSED = StageCodecs()


def pipeline_param_specs(model: ModelConfig, tp_axis: str = "tp") -> dict:
    """PartitionSpecs of the staged parameters (`to_stages`): the blocks' [V, P, L / (P V), ...]
    split over "pp" on P (and over TP as `param_specs`), everything else as `param_specs`."""
    specs = param_specs(model, tp_axis)
    return _map_axes(
        lambda axes, spec: P(None, PP_AXIS, *spec) if axes[0] == "layers" else spec, model, specs
    )


def to_stages(params: dict, model: ModelConfig, parallel: ParallelConfig) -> dict:
    """Full parameters -> the staged layout: each block leaf [L, ...] -> [V, P, L / (P V), ...]
    (a free reshape; chunk c = v P + p holds layers [c L / (P V), (c + 1) L / (P V)))."""
    v, p = parallel.repeats, parallel.pp
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


def full_layout_specs(model: ModelConfig, tp_axis: str = "tp") -> dict:
    """PartitionSpecs of the full parameters over a ("dp", "pp", tp) mesh: the blocks' layers
    split over "pp" in contiguous slices, which is the staged layout itself for GPipe (the
    circular schedule regroups them every step)."""
    specs = param_specs(model, tp_axis)
    return _map_axes(
        lambda axes, spec: P(PP_AXIS, *spec[1:]) if axes[0] == "layers" else spec, model, specs
    )


def _send_forward(y, parallel: ParallelConfig, codecs: StageCodecs, key, step):
    """This stage's activations to the next stage; the last sends to the first in a circular
    schedule, and nothing in GPipe."""
    pairs = [(s, s + 1) for s in range(parallel.pp - 1)]
    if parallel.repeats > 1:
        pairs.append((parallel.pp - 1, 0))
    step_key = None if key is None else jax.random.fold_in(key, step)
    return taco_jax.compressed_ppermute(
        y, PP_AXIS, pairs, codec=codecs.forward, bwd_codec=codecs.backward, key=step_key,
        telemetry=codecs.telemetry, name="pp",
    )  # fmt: skip


def _chunk(params: dict, model: ModelConfig, repeat, chunks_per_stage: int) -> dict:
    """The local parameters with the blocks of chunk `repeat` of this stage ([L / (P V), ...]).

    With one chunk per stage (GPipe) a static index: differentiated inside the schedule's scan,
    a dynamic index becomes, at every step, a zero gradient of all the stage's blocks with the
    chunk's gradient written into it (docs/development_history.md, "The pipelined step's fixed
    cost")."""

    def pick(x):
        if chunks_per_stage == 1:
            return x[0, 0]
        return lax.dynamic_index_in_dim(x[:, 0], repeat, keepdims=False)

    return _map_axes(lambda axes, x: pick(x) if axes[0] == "layers" else x, model, params)


def _stage_loss(model, parallel, codecs, ctx, params, tokens, key):
    """This stage's share of the loss: the mean microbatch loss on the last stage, 0 on the
    others (their part of the gradient arrives through the sends). params: the staged local
    parameters (blocks [V, 1, L / (P V), ...])."""
    stages, m, v = parallel.pp, parallel.microbatches, parallel.repeats
    stage = lax.axis_index(PP_AXIS)
    # Under emulation a `lax.cond` on the stage runs both branches (vmap makes it a select):
    # the embedding's and the head's collectives then also run where shard_map skips them, on
    # values no stage uses, so they record no telemetry.
    branch_ctx = ctx.untracked() if parallel.mode == "emulate" else ctx
    if key is not None:  # dp ranks draw their own noise; tp ranks the same (replicated values)
        key = jax.random.fold_in(key, lax.axis_index(parallel.dp_axis))
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
        net = nnx.merge(graphdef(model), _chunk(params, model, repeat, v))

        def first_pass():
            return net.embed(micro[micro_index, :, :-1], branch_ctx).astype(ctx.dtype)

        x = lax.cond(stage == 0, first_pass, lambda: received)
        if v > 1:
            x = jnp.where((stage == 0) & (repeat > 0), store[micro_index], x)
        y = net.run_blocks(x, ctx, remat=parallel.remat, scan_layers=parallel.scan_layers)

        def loss():
            logits = net.head(y, branch_ctx)
            targets = micro[micro_index, :, 1:]
            return layers.vocab_parallel_cross_entropy(logits, targets, branch_ctx,
                                                       model.vocab_size)  # fmt: skip

        # The head runs only where a microbatch finishes (the same on every TP rank of a stage).
        last = (stage == stages - 1) & (work >= (v - 1) * m) & (work < v * m)
        total = total + lax.cond(last, loss, lambda: jnp.zeros((), jnp.float32))
        return (_send_forward(y, parallel, codecs, key, i), store, total), None

    init = (blank, store, jnp.zeros((), jnp.float32))
    (_, _, total), _ = lax.scan(step, init, jnp.arange(parallel.pipeline_steps))
    return total / m


def _stage_loss_and_grads(model, parallel, codecs, ctx, params, tokens, key, local=False):
    """The mean loss and the staged gradients: averaged over dp, or (local) this dp rank's own
    with a leading axis of 1 (for a sharded optimizer that averages them itself)."""
    loss, grads = jax.value_and_grad(
        lambda p: _stage_loss(model, parallel, codecs, ctx, p, tokens, key)
    )(params)
    if ctx.sharded and ctx.sequence_parallel:
        tp = ctx.comm.axis_name
        grads = jax.tree.map(
            lambda g, r: lax.psum(g, tp) if r else g, grads, replicated_mask(model)
        )
    grads = jax.tree.map(
        lambda g, r: _sum_over_stages(g, codecs) if r else g, grads, pp_replicated_mask(model)
    )
    dp = parallel.dp_axis
    if local:
        return _reduced_loss(loss, dp), jax.tree.map(lambda g: g[None], grads)
    return _reduced_loss(loss, dp), jax.tree.map(lambda g: lax.pmean(g, dp), grads)


def _sum_over_stages(grad, codecs: StageCodecs):
    """The sum over "pp" of a pp-replicated parameter's gradient parts (`StageCodecs`)."""
    shared = codecs.shared_grads
    if shared == "none":
        return lax.psum(grad, PP_AXIS)
    # A codec name takes the collective's defaults and this StageCodecs' telemetry; a
    # CommConfig keeps its own options.
    options = {"telemetry": codecs.telemetry} if isinstance(shared, str) else {}
    return taco_jax.compressed_psum(grad, PP_AXIS, codec=shared, name="pp_grads", **options)


def _reduced_loss(loss, dp_axis):
    """The mean loss: only the last stage's is non-zero; averaged over dp."""
    return lax.pmean(lax.psum(loss, PP_AXIS), dp_axis)


def _check_batch(tokens, parallel: ParallelConfig):
    if tokens.shape[0] % parallel.microbatches:
        raise ValueError(
            f"the batch of each dp rank, {tokens.shape[0]}, is not a multiple of "
            f"microbatches={parallel.microbatches}"
        )


def _pipelined(model, parallel, comm, mesh, per_device, out_specs):
    """shard_map of `per_device(ctx, staged params, tokens, key)` over the (dp, pp, tp) mesh,
    as a function of the full parameters."""
    check_pipeline(model, parallel)
    mesh = make_mesh(parallel, comm.axis_name) if mesh is None else mesh
    ctx = _context(parallel, comm)
    specs = pipeline_param_specs(model, comm.axis_name)

    def body(params, tokens, key):
        _check_batch(tokens, parallel)
        return per_device(ctx, params, tokens, key)

    mapped = spmd_map(
        parallel,
        body,
        mesh=mesh,
        in_specs=(specs, P(parallel.dp_axis), P()),
        out_specs=out_specs(specs),
    )
    return lambda params, tokens, key=None: mapped(to_stages(params, model, parallel), tokens, key)


def make_pipeline_loss_and_grads(
    model: ModelConfig,
    parallel: ParallelConfig,
    comm: taco_jax.TPComm,
    codecs: StageCodecs = UNCOMPRESSED,
    mesh=None,
) -> Callable[[dict, jax.Array, jax.Array | None], tuple[jax.Array, dict]]:
    """(full params, tokens [B, T + 1], key) -> (mean loss, full-layout gradients averaged over
    dp), staged over "pp" as `parallel` says (pp, microbatches, schedule, repeats), TP over
    `comm.axis_name`, stage traffic compressed with `codecs`.

    params and gradients are in the full layout (`init_params`); inside, they are staged with
    `to_stages` and placed by `pipeline_param_specs`. key: PRNG key of a stochastic stage codec
    (None otherwise); fold in the training step so that every step draws new noise and a resumed
    run the same. Not jitted.
    """
    return _loss_and_grads_runner(model, parallel, comm, codecs, mesh, local=False)


def make_pipeline_loss_and_local_grads(
    model: ModelConfig,
    parallel: ParallelConfig,
    comm: taco_jax.TPComm,
    codecs: StageCodecs = UNCOMPRESSED,
    mesh=None,
) -> Callable[[dict, jax.Array, jax.Array | None], tuple[jax.Array, dict]]:
    """As `make_pipeline_loss_and_grads`, but each dp rank's own full-layout gradients of its
    share of the batch, stacked on a leading dp axis (`models.parallel`'s
    `make_loss_and_local_grads` for pipelines). Not jitted."""
    return _loss_and_grads_runner(model, parallel, comm, codecs, mesh, local=True)


def _loss_and_grads_runner(model, parallel, comm, codecs, mesh, *, local: bool):
    """(full params, tokens, key) -> (mean loss, full-layout gradients): dp-averaged, or each dp
    rank's own on a leading dp axis (`local`)."""

    def per_device(ctx, params, tokens, key):
        return _stage_loss_and_grads(model, parallel, codecs, ctx, params, tokens, key, local=local)

    def out_specs(staged):
        dp = parallel.dp_axis
        return (P(), jax.tree.map(lambda spec: P(dp, *spec), staged) if local else staged)

    fn = _pipelined(model, parallel, comm, mesh, per_device, out_specs)
    unstage = lambda g: from_stages(g, model)  # noqa: E731

    def loss_and_grads(params, tokens, key=None):
        loss, grads = fn(params, tokens, key)
        return loss, jax.vmap(unstage)(grads) if local else unstage(grads)

    return loss_and_grads


def stage_split_dims(model: ModelConfig) -> dict:
    """Per parameter, the axis split over pipeline stages in the full layout (0: the blocks'
    layers, contiguous slices as `full_layout_specs` places them), or -1 where every stage
    holds it whole."""
    return _map_axes(lambda axes: 0 if axes[0] == "layers" else -1, model)


def make_pipeline_loss(
    model: ModelConfig,
    parallel: ParallelConfig,
    comm: taco_jax.TPComm,
    codecs: StageCodecs = UNCOMPRESSED,
    mesh=None,
) -> Callable[[dict, jax.Array, jax.Array | None], jax.Array]:
    """(full params, tokens, key) -> the mean loss of the pipelined model (no gradients)."""

    def per_device(ctx, params, tokens, key):
        loss = _stage_loss(model, parallel, codecs, ctx, params, tokens, key)
        return _reduced_loss(loss, parallel.dp_axis)

    return _pipelined(model, parallel, comm, mesh, per_device, lambda s: P())
