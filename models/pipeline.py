"""Pipeline parallelism over a "pp" mesh axis, composed with TP and DP in one `shard_map` (or
its one-device emulation, `ParallelConfig.mode="emulate"`).

Layout: the stacked blocks' "layers" axis is cut into P x V chunks of L / (P V) layers and
chunk c goes to stage c mod P: V = 1 (GPipe) gives contiguous stages [s L / P, (s + 1) L / P),
V > 1 (circular) gives each stage V chunks spread over the depth. The cut is a free reshape of
the full [L, ...] arrays to [V, P, L / (P V), ...] with the P axis split over "pp". Every other
parameter is replicated over "pp": the first stage embeds, the last applies the head, and tied
embeddings need nothing special (the embedding's gradient is the psum over stages of what each
stage's use contributed: the first stage's lookup, the last stage's projection; compressed with
`StageCodecs.shared_grads`). Checkpoints keep the full layout, as for TP (`taco_models.parallel`).

Schedules, over the M microbatches of each dp rank's batch, in steps in which every stage
runs one chunk on one microbatch and sends the result on with `taco_jax.compressed_ppermute`
(`StageCodecs`; "none" is `lax.ppermute`):
- "gpipe" (Huang et al. 2019): step t, stage s runs microbatch t - s; M + P - 1 steps.
- "circular" (interleaved; MaxText's circular pipeline): stage s's u-th work item (u = t - s)
  is microbatch u mod M through its chunk u // M; the last stage sends back to the first, which
  keeps what arrives in a buffer until that microbatch's next pass (needs M >= P);
  M V + P - 1 steps, each 1 / V of a GPipe step.
- "1f1b" (PipeDream-Flush; `_one_f_one_b`): tick t, stage s runs the forward of microbatch
  t - s and the backward of microbatch t - (2 P - 2 - s), explicitly, keeping at most 2 P - 1
  microbatches' residuals.
Work items outside [0, M V) are bubble steps, computed and discarded. Bubble fraction
(P - 1) / (M V + P - 1). GPipe and circular are differentiated (all forwards, then all
backwards in reverse), the activation gradients sent back by the ppermute's transpose
(compressed with the stage codec's backward variant); their steps run as a few `lax.scan`s,
each over a run of steps with a fixed chunk (`_segments`). Every schedule embeds all
microbatches once before its steps; GPipe and circular apply the head once after them.

Gradient convention as `taco_models.parallel`: `value_and_grad` runs inside the per-device function
on this stage's part of the loss (the last stage's microbatch losses, zero elsewhere; the chain
rule crosses stages through the sends), then gradients of pp-replicated parameters are summed
over "pp" and everything is averaged over "dp" (or, for a sharded optimizer, each dp rank's own
gradients are returned: `make_pipeline_loss_and_local_grads`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import taco_jax
from taco_jax import ppermute, telemetry
from taco_models import layers
from taco_models.config import ModelConfig
from taco_models.parallel import (
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
      (BENCHMARKS.md, "Pipelined step (pp = 2)").
    telemetry: measure each call site's error (`taco_jax.telemetry`): the sends "pp_send/fwd"
      and their transposes "pp_send/bwd" (under "1f1b" the gradients' own sends,
      "pp_send_grads/fwd"), and the shared gradients' sum "pp_grads/fwd".
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
        y,
        PP_AXIS,
        pairs,
        codec=codecs.forward,
        bwd_codec=codecs.backward,
        key=step_key,
        telemetry=codecs.telemetry,
        name="pp_send",
    )


def _segments(parallel: ParallelConfig) -> list[tuple[int, int, int, bool]]:
    """The schedule's steps cut into runs that use one chunk per stage: (first step, steps,
    chunk v, mixed). Stage s's chunk at step i is (i - s) // M clipped to [0, V - 1]; it is the
    same on every stage except in the P - 1 steps after stage 0 moves to chunk v >= 1, where
    stages s <= i - v M run chunk v and the others still v - 1 ("mixed": a select between the
    two). Each run is one `lax.scan` over a static slice of the stage's blocks, so the scan's
    backward accumulates one chunk's gradient instead of filling all V chunks' at every step."""
    p, m, v = parallel.pp, parallel.microbatches, parallel.repeats
    runs = [(0, m, 0, False)]
    for chunk in range(1, v):
        runs += [(chunk * m, p - 1, chunk, True), (chunk * m + p - 1, m - p + 1, chunk, False)]
    runs.append((v * m, p - 1, v - 1, False))
    merged = []
    for run in runs:
        if run[1] == 0:
            continue
        if merged and not run[3] and not merged[-1][3] and merged[-1][2] == run[2]:
            first, count, chunk, _ = merged[-1]
            merged[-1] = (first, count + run[1], chunk, False)
        else:
            merged.append(run)
    return merged


def _with_blocks(params: dict, model: ModelConfig, pick) -> dict:
    """The local parameters with the staged blocks [V, 1, L / (P V), ...] replaced by
    `pick(leaf)` (one chunk's [L / (P V), ...])."""
    return _map_axes(lambda axes, x: pick(x) if axes[0] == "layers" else x, model, params)


def _first_layer(ctx, model, parallel, run, stage, step, m):
    """The model's index of the first layer of the chunk `_run_chunk` runs (traced: it
    depends on the stage); chunk c holds layers [c L / (P V), (c + 1) L / (P V)). 0 where the
    call sites need no layer (`TPContext.names_layers`): nothing is computed then."""
    if not ctx.names_layers:
        return 0
    _, _, chunk, mixed = run
    per_chunk = model.n_layers // (parallel.pp * parallel.repeats)
    if mixed:
        chunk = jnp.where(stage <= step - chunk * m, chunk, chunk - 1)
    return (chunk * parallel.pp + stage) * per_chunk


def _run_chunk(params, model, run, stage, step, m):
    """The blocks of a run's chunk on this stage (`_segments`): a static slice, or in a mixed
    run the select between chunk v (stages that reached it) and v - 1."""
    _, _, chunk, mixed = run
    if not mixed:
        return _with_blocks(params, model, lambda x: x[chunk, 0])
    reached = stage <= step - chunk * m
    return _with_blocks(params, model, lambda x: jnp.where(reached, x[chunk, 0], x[chunk - 1, 0]))


def _branch_ctx(ctx, parallel):
    """The context of the embedding and head, which run under `lax.cond` on the stage. Under
    emulation a cond on the stage runs both branches (vmap makes it a select): their
    collectives then also run where shard_map skips them, on values no stage uses, so they
    record no telemetry."""
    return ctx.untracked() if parallel.mode == "emulate" else ctx


def _dp_key(key, parallel):
    """dp ranks draw their own noise; tp ranks the same (replicated values)."""
    return None if key is None else jax.random.fold_in(key, lax.axis_index(parallel.dp_axis))


def _microbatches(tokens, parallel: ParallelConfig):
    m = parallel.microbatches
    return tokens.reshape(m, tokens.shape[0] // m, tokens.shape[1])  # [M, b, T + 1]


def _embed_all(net, micro, ctx, branch_ctx):
    """Every microbatch's input embedded at once: [M, b, T + 1] -> [M, b, T(_sp), D]."""
    m, b = micro.shape[:2]
    x = net.embed(micro[:, :, :-1].reshape(m * b, -1), branch_ctx).astype(ctx.dtype)
    return x.reshape(m, b, *x.shape[1:])


def _on_stage(stage_index, fn, *args):
    """fn(*args) on one stage, zeros of its shape on the others (`lax.cond`)."""
    shape = jax.eval_shape(fn, *args)
    zeros = lambda *_: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)  # noqa: E731
    return lax.cond(lax.axis_index(PP_AXIS) == stage_index, fn, zeros, *args)


def _head_loss(net, y, micro, model, branch_ctx):
    """Mean token cross-entropy of finished microbatches y [n, b, T(_sp), D] against their
    targets micro [n, b, T + 1]: the final norm and output projection over all n at once."""
    n, b = y.shape[:2]
    logits = net.head(y.reshape(n * b, *y.shape[2:]), branch_ctx)
    targets = micro[:, :, 1:].reshape(n * b, -1)
    return layers.vocab_parallel_cross_entropy(logits, targets, branch_ctx, model.vocab_size)


def _stage_loss(model, parallel, codecs, ctx, params, tokens, key):
    """This stage's share of the loss: the mean token loss on the last stage, 0 on the others
    (their part of the gradient arrives through the sends). params: the staged local
    parameters (blocks [V, 1, L / (P V), ...]).

    The embedding runs once before the schedule's steps (first stage) and the head once after
    them (last stage), over all M microbatches, as in the unpipelined model: differentiated,
    the tied table's gradient is then one matmul over the batch, not a fill and a sum at each
    of the M V + P - 1 steps. The head's logits are those of the whole batch, as unpipelined."""
    stages, m, v = parallel.pp, parallel.microbatches, parallel.repeats
    stage = lax.axis_index(PP_AXIS)
    branch_ctx = _branch_ctx(ctx, parallel)
    key = _dp_key(key, parallel)
    micro = _microbatches(tokens, parallel)
    net = nnx.merge(graphdef(model), params)  # its blocks unused: the embedding and the head
    embedded = _on_stage(0, lambda: _embed_all(net, micro, ctx, branch_ctx))
    blank = jnp.zeros(embedded.shape[1:], ctx.dtype)
    # The first stage's store of returning microbatches (circular: unused by GPipe).
    store = jnp.zeros((m, *blank.shape), ctx.dtype) if v > 1 else None
    # The last stage finishes microbatch u's last pass at step (V - 1) M + u + P - 1.
    done_from = (v - 1) * m + stages - 1

    def step(run, carry, xs):
        received, store = carry
        i, fresh = xs
        if v > 1:  # what the last stage finished a step ago, kept for its next pass
            back = i - stages
            slot = jnp.mod(back, m)
            keep = (stage == 0) & (back >= 0)
            store = store.at[slot].set(jnp.where(keep, received, store[slot]))
        x = received
        if fresh is not None:  # steps [0, M): the first stage starts microbatch i
            x = jnp.where(stage == 0, fresh, x)
        elif v > 1:  # later: the first stage's work item i is microbatch i mod M's next pass
            x = jnp.where(stage == 0, store[jnp.mod(i, m)], x)
        chunk = nnx.merge(graphdef(model), _run_chunk(params, model, run, stage, i, m))
        first = _first_layer(ctx, model, parallel, run, stage, i, m)
        if ctx.names_layers:  # a bubble step's reports are dropped (`taco_jax.telemetry`)
            first = telemetry.discarded_unless((i >= stage) & (i - stage < m * v), first)
        y = chunk.run_blocks(
            x, ctx, remat=parallel.remat, scan_layers=parallel.scan_layers, first_layer=first
        )
        keep_y = y if run[0] + run[1] > done_from else None
        return (_send_forward(y, parallel, codecs, key, i), store), keep_y

    carry, finished = (blank, store), []
    for run in _segments(parallel):
        first, count = run[0], run[1]
        steps = jnp.arange(first, first + count)
        fresh = None
        if first == 0:  # stage 0's inputs: the M microbatches, then bubble steps' zeros
            fresh = jnp.pad(embedded, [(0, count - m)] + [(0, 0)] * (embedded.ndim - 1))
        carry, ys = lax.scan(functools.partial(step, run), carry, (steps, fresh))
        if ys is not None:
            finished.append(ys[max(done_from - first, 0) :])
    finished = jnp.concatenate(finished) if len(finished) > 1 else finished[0]  # [M, b, ...]
    return _on_stage(stages - 1, lambda: _head_loss(net, finished, micro, model, branch_ctx))


@dataclasses.dataclass(frozen=True)
class _SavedForward:
    """What a stage keeps of one microbatch's forward for its backward: the leaves of
    `jax.vjp`'s pullback (its residuals) less those that are the parameters themselves, which
    every microbatch shares and the backward takes from the parameters again. tree: the
    pullback's structure (its jaxpr is static, so one trace's structure rebuilds another's);
    param_index: per leaf, the index of the parameter leaf it is, or None (kept); kept: the
    shapes of the kept leaves."""

    tree: jax.tree_util.PyTreeDef
    param_index: tuple[int | None, ...]
    kept: tuple[jax.ShapeDtypeStruct, ...]

    @classmethod
    def of(cls, pullback_of, params, x) -> _SavedForward:
        """The structure of `pullback_of(params, x)[1]`, traced once without computing."""
        found = {}

        def probe(params, x):
            _, pullback = pullback_of(params, x)
            leaves, found["tree"] = jax.tree.flatten(pullback)
            found["index"] = tuple(_param_index(leaf, params) for leaf in leaves)
            return [leaf for leaf, i in zip(leaves, found["index"], strict=True) if i is None]

        kept = jax.eval_shape(probe, params, x)
        return cls(found["tree"], found["index"], tuple(kept))

    def empty_ring(self, slots: int) -> list[jax.Array]:
        return [jnp.zeros((slots, *s.shape), s.dtype) for s in self.kept]

    def store(self, ring, slot, pullback) -> list[jax.Array]:
        leaves = jax.tree.leaves(pullback)
        kept = [leaf for leaf, i in zip(leaves, self.param_index, strict=True) if i is None]
        pairs = zip(ring, kept, strict=True)
        return [lax.dynamic_update_index_in_dim(r, k, slot, 0) for r, k in pairs]

    def load(self, ring, slot, params):
        kept = iter(lax.dynamic_index_in_dim(r, slot, 0, keepdims=False) for r in ring)
        param_leaves = jax.tree.leaves(params)
        leaves = [next(kept) if i is None else param_leaves[i] for i in self.param_index]
        return jax.tree.unflatten(self.tree, leaves)


def _keep_per_token(primitive, *_, **__) -> bool:
    """The residuals 1F1B keeps per microbatch: everything but casts and broadcasts, which
    are recomputed in the backward. Kept, they would hold a compute-dtype copy of the stage's
    weights in every slot of the ring (their casts); recomputed, the backward casts the
    weights again (cheap) and the activations' casts (elementwise)."""
    return primitive not in (lax.convert_element_type_p, lax.broadcast_in_dim_p)


def _param_index(leaf, params) -> int | None:
    return next((i for i, p in enumerate(jax.tree.leaves(params)) if leaf is p), None)


def one_f_one_b_slots(parallel: ParallelConfig) -> int:
    """Microbatches whose forward residuals a stage holds at once under "1f1b": 2 P - 1 (the
    first stage keeps microbatch u from its forward at tick u to its backward at u + 2 P - 2)."""
    return 2 * parallel.pp - 1


def _one_f_one_b(model, parallel, codecs, ctx, params, tokens, key):
    """(this stage's share of the loss, its staged gradients) under the 1F1B schedule
    (PipeDream-Flush, Narayanan et al. 2021, section 2.2; Megatron-LM's default).

    Ticks t = 0 .. M + 2 P - 3: stage s runs the forward of microbatch t - s and then the
    backward of microbatch t - (2 P - 2 - s), each where it is in [0, M); the last stage's
    backward of a microbatch follows its forward and head in the same tick. Each forward is a
    `jax.vjp` whose residuals go to slot t mod (2 P - 1) of a ring carried through the scan
    until the backward of that microbatch calls the pullback: activations of at most 2 P - 1
    microbatches are held, whatever M. The slot a forward writes is the tick's, the same on
    every stage, so that under emulation (stages vmapped) the write is an in-place
    dynamic-update-slice, not a scatter; the backward's read is the stage's own. Activations
    go forward and their gradients back with
    `taco_jax.compressed_ppermute` (the stage codecs' forward and backward codecs). The ticks
    run as three scans (forwards only, both, backwards only), so no tick computes a pass that
    no stage needs. The embedding runs before the ticks (all microbatches at once, its
    gradient after them from the first stage's input gradients); the head inside, per
    microbatch, on the last stage."""
    stages, m = parallel.pp, parallel.microbatches
    slots = one_f_one_b_slots(parallel)
    stage = lax.axis_index(PP_AXIS)
    branch_ctx = _branch_ctx(ctx, parallel)
    key = _dp_key(key, parallel)
    micro = _microbatches(tokens, parallel)
    gd = graphdef(model)
    measuring = ctx.sharded and any(c.telemetry for c in (ctx.comm.fwd, ctx.comm.bwd))
    local = _with_blocks(params, model, lambda x: x[0, 0])
    blocks = local["blocks"]
    rest = {name: value for name, value in local.items() if name != "blocks"}
    merge = lambda rest, blocks: nnx.merge(gd, {**rest, "blocks": blocks})  # noqa: E731

    def embed(rest):
        return _embed_all(merge(rest, blocks), micro, ctx, branch_ctx)

    def forward(rest, blocks, x):
        net = merge(rest, blocks)
        first = stage * (model.n_layers // stages) if ctx.names_layers else 0  # one chunk each
        return net.run_blocks(
            x, ctx, remat=parallel.remat, scan_layers=parallel.scan_layers, first_layer=first
        )

    def pullback_of(params, x):  # params: (blocks, rest); the pullback's cotangents: blocks, x
        blocks, rest = params
        return jax.vjp(
            jax.checkpoint(lambda b, x: forward(rest, b, x), policy=_keep_per_token), blocks, x
        )

    def head_loss(rest, y, u):  # the last stage's loss of microbatch u, over M
        return _head_loss(merge(rest, blocks), y[None], micro[u][None], model, branch_ctx) / m

    embedded = _on_stage(0, embed, rest)  # [M, b, T(_sp), D]
    blank = jnp.zeros(embedded.shape[1:], ctx.dtype)
    saved = _SavedForward.of(pullback_of, (blocks, rest), blank)
    zeros_like = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731

    def run_forward(t, received, ring, head_grads, loss):
        u = t - stage
        x = jnp.where(stage == 0, embedded[jnp.clip(t, 0, m - 1)], received)
        y, pullback = pullback_of((blocks, rest), x)
        ring = saved.store(ring, jnp.mod(t, slots), pullback)  # the same slot on every stage

        def with_head(head_grads, loss):
            value, (g_rest, g_y) = jax.value_and_grad(head_loss, argnums=(0, 1))(
                rest, y, jnp.clip(u, 0, m - 1)
            )
            return jax.tree.map(jnp.add, head_grads, g_rest), loss + value, g_y

        finishes = (stage == stages - 1) & (u >= 0) & (u < m)
        head_grads, loss, g_y = lax.cond(
            finishes, with_head, lambda h, loss: (h, loss, jnp.zeros_like(y)), head_grads, loss
        )
        sent = _send(y, parallel, codecs, key, 2 * t, backward=False)
        return sent, ring, head_grads, loss, g_y

    def run_backward(t, received, ring, grads, g_y):
        u = t - (2 * stages - 2 - stage)
        valid = (u >= 0) & (u < m)
        cotangent = received if g_y is None else jnp.where(stage == stages - 1, g_y, received)
        forward_tick = u + stage  # the slot its forward wrote
        pullback = saved.load(ring, jnp.mod(forward_tick, slots), (blocks, rest))
        if measuring:  # a bubble tick's pullback (of a stale or empty slot) must not report:
            # skipped there (a branch per stage under shard_map; emulated stages run both)
            skipped = lambda c: jax.tree.map(jnp.zeros_like, (blocks, c))  # noqa: E731
            g_blocks, g_x = lax.cond(valid, pullback, skipped, cotangent)
        else:
            g_blocks, g_x = pullback(cotangent)
        # Bubble ticks run on stale slots: select (not multiply) so nothing of them survives.
        grads = jax.tree.map(lambda a, g: a + jnp.where(valid, g, 0), grads, g_blocks)
        g_x = jnp.where(valid, g_x, jnp.zeros_like(g_x))
        return _send(g_x, parallel, codecs, key, 2 * t + 1, backward=True), grads, g_x

    def tick(carry, t, *, forwards: bool, backwards: bool):
        recv_x, recv_g, ring, grads, head_grads, loss = carry
        g_y, g_x = None, None
        if forwards:
            recv_x, ring, head_grads, loss, g_y = run_forward(t, recv_x, ring, head_grads, loss)
        if backwards:
            recv_g, grads, g_x = run_backward(t, recv_g, ring, grads, g_y)
        return (recv_x, recv_g, ring, grads, head_grads, loss), g_x

    carry = (
        blank,
        blank,
        saved.empty_ring(slots),
        zeros_like(blocks),
        zeros_like(rest),
        jnp.zeros((), jnp.float32),
    )
    input_grads = []
    for first, count, forwards, backwards in (
        (0, stages - 1, True, False),  # no backward yet on any stage
        (stages - 1, m, True, True),
        (m + stages - 1, stages - 1, False, True),  # no forward left on any stage
    ):
        body = functools.partial(tick, forwards=forwards, backwards=backwards)
        carry, g_x = lax.scan(body, carry, jnp.arange(first, first + count))
        if backwards:
            input_grads.append(g_x)
    _, _, _, grads, head_grads, loss = carry
    # The first stage's backward of microbatch u ran at tick u + 2 P - 2.
    input_grads = jnp.concatenate(input_grads)[stages - 1 : stages - 1 + m]
    embed_grads = _on_stage(0, lambda: jax.vjp(embed, rest)[1](input_grads)[0])
    rest_grads = jax.tree.map(jnp.add, head_grads, embed_grads)
    return loss, {**rest_grads, "blocks": jax.tree.map(lambda g: g[None, None], grads)}


def _backward_codec(codecs: StageCodecs):
    """The codec of the gradients sent back: `StageCodecs.backward`, else the forward codec's
    default backward (as `compressed_ppermute`'s transpose takes it)."""
    if codecs.backward is not None or codecs.forward == "none":
        return codecs.forward if codecs.backward is None else codecs.backward
    return ppermute.backward_codec(ppermute.resolve_codec(codecs.forward))


def _send(x, parallel: ParallelConfig, codecs: StageCodecs, key, draw: int, *, backward: bool):
    """1F1B's sends: activations to the next stage with the forward codec, or gradients to
    the previous stage with the backward codec (`taco_jax.compressed_ppermute`); `draw` picks
    the stochastic codecs' noise (each send its own)."""
    pairs = [(s, s + 1) for s in range(parallel.pp - 1)]
    codec = codecs.forward
    if backward:
        pairs = [(d, s) for s, d in pairs]
        codec = _backward_codec(codecs)
    draw_key = None if key is None else jax.random.fold_in(key, draw)
    return taco_jax.compressed_ppermute(
        x,
        PP_AXIS,
        pairs,
        codec=codec,
        key=draw_key,
        telemetry=codecs.telemetry,
        name="pp_send_grads" if backward else "pp_send",
    )


def _stage_loss_and_grads(model, parallel, codecs, ctx, params, tokens, key, local=False):
    """The mean loss and the staged gradients: averaged over dp, or (local) this dp rank's own
    with a leading axis of 1 (for a sharded optimizer that averages them itself)."""
    if parallel.schedule == "1f1b":
        loss, grads = _one_f_one_b(model, parallel, codecs, ctx, params, tokens, key)
    else:
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
    share of the batch, stacked on a leading dp axis (`taco_models.parallel`'s
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
