"""Jitted init / train / eval steps of a `models` transformer: the optimizer side of a run.

`taco_models.parallel` runs the per-device model (loss and gradients in the full parameter layout);
this module adds the optimizer state, its shardings, and the three jitted functions the trainer
calls. Parameters and optimizer state live in their full shapes, placed by `NamedSharding`, so
the optimizer (and global-norm clipping) sees whole gradients and checkpoints are portable
across TP sizes; the sharded optimizer (`make_sharded_steps`) keeps padded shards instead, tied
to the dp (and model-parallel) split that wrote them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax
from taco_models import parallel as layout
from taco_models import pipeline
from taco_models.config import ModelConfig
from taco_models.parallel import ParallelConfig
from taco_train import zero


class TrainState(flax.struct.PyTreeNode):
    """step: int32 scalar, the batches consumed; params and opt_state: pytrees of full-shape
    jax.Arrays; skipped: int32 scalar, the steps whose update was skipped because their loss or
    gradient was not finite (the state stays the last finite one)."""

    step: jax.Array
    params: Any
    opt_state: Any
    skipped: jax.Array


@dataclasses.dataclass(frozen=True)
class Steps:
    """init(key): a fresh state; start(params): the state of given full-layout fp32 parameters
    (e.g. a loaded checkpoint, placed as `state_sharding.params`), optimizer state fresh."""

    init: Callable[[jax.Array], TrainState]
    train_step: Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]
    eval_step: Callable[[TrainState, jax.Array], dict[str, jax.Array]]
    is_finite: Callable[[TrainState], jax.Array]
    state_sharding: Any
    batch_sharding: jax.sharding.Sharding
    mesh: jax.sharding.Mesh
    start: Callable[[Any], TrainState]


def _key_names(path) -> tuple:
    names = []
    for key in reversed(path):
        if not isinstance(key, jax.tree_util.DictKey):
            break
        names.append(key.key)
    return tuple(reversed(names))


def _opt_state_sharding(opt_abstract, params_abstract, param_sharding, replicated):
    """Optimizer-state leaves that mirror a parameter (same trailing dict path and shape, e.g.
    Adam's mu / nu) take its sharding; everything else (counts, scalars) is replicated."""
    by_path = {}
    flat_params = jax.tree_util.tree_flatten_with_path(params_abstract)[0]
    flat_sh = jax.tree.leaves(param_sharding)
    for (path, leaf), sharding in zip(flat_params, flat_sh, strict=True):
        by_path[_key_names(path)] = (leaf.shape, sharding)

    def pick(path, leaf):
        for start in range(len(path)):
            match = by_path.get(_key_names(path[start:]))
            if match is not None and match[0] == getattr(leaf, "shape", None):
                return match[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, opt_abstract)


def _losses(model, parallel, comm, stage_codecs, mesh, seed, local=False):
    """(loss_and_grads(params, tokens, step), loss(params, tokens, step)) of the layout: the TP
    runners, or the pipeline's (whose stochastic stage codecs draw from `seed` and the step:
    every step new noise, a resumed run the same). local: each dp rank's own gradients,
    stacked on a leading dp axis, instead of their mean (for the sharded optimizer)."""
    if parallel.pp == 1:
        make = layout.make_loss_and_local_grads if local else layout.make_loss_and_grads
        both = make(model, parallel, comm, mesh)
        only = layout.make_loss(model, parallel, comm, mesh)
        return (lambda p, t, step: both(p, t)), (lambda p, t, step: only(p, t))
    make = (
        pipeline.make_pipeline_loss_and_local_grads
        if local
        else pipeline.make_pipeline_loss_and_grads
    )
    both = make(model, parallel, comm, stage_codecs, mesh)
    only = pipeline.make_pipeline_loss(model, parallel, comm, stage_codecs, mesh)
    train_key, eval_key = jax.random.split(jax.random.key(seed))
    return (
        lambda p, t, step: both(p, t, jax.random.fold_in(train_key, step)),
        lambda p, t, step: only(p, t, jax.random.fold_in(eval_key, step)),
    )


def make_steps(
    model: ModelConfig,
    parallel: ParallelConfig,
    comm: taco_jax.TPComm,
    optimizer: optax.GradientTransformation,
    stage_codecs: pipeline.StageCodecs = pipeline.UNCOMPRESSED,
    seed: int = 0,
    sharded: zero.ZeroConfig | None = None,
) -> Steps:
    """Jitted init / train / eval steps of `model` laid out by `parallel`, TP traffic by `comm`,
    pipeline stage traffic (parallel.pp > 1) by `stage_codecs` (stochastic ones seeded by `seed`).

    sharded: ZeRO-1 over dp (`taco_train.zero`, `make_sharded_steps`); `optimizer` must then not
    clip (the sharded step clips by `sharded.grad_clip` over all shards).
    train_step(state, tokens [global_batch, T + 1]) -> (state, {"loss", "grad_norm"}) donates
    `state`; eval_step(state, tokens) -> {"loss"} does not (it returns no state to hand back).
    """
    if sharded is not None:
        return make_sharded_steps(model, parallel, comm, optimizer, sharded, stage_codecs, seed)
    layout.check_config(model, parallel)
    mesh = layout.make_mesh(parallel, comm.axis_name)
    replicated = NamedSharding(mesh, P())
    if parallel.mode != "vmap":
        specs = (
            pipeline.full_layout_specs(model, comm.axis_name)
            if parallel.pp > 1
            else layout.param_specs(model, comm.axis_name)
        )
        param_sharding = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    else:
        param_sharding = jax.tree.map(lambda _: replicated, layout.abstract_params(model))
    params_abstract = layout.abstract_params(model)
    opt_abstract = jax.eval_shape(optimizer.init, params_abstract)
    state_sharding = TrainState(
        step=replicated,
        params=param_sharding,
        opt_state=_opt_state_sharding(opt_abstract, params_abstract, param_sharding, replicated),
        skipped=replicated,
    )
    batch_sharding = NamedSharding(mesh, P(parallel.dp_axis))
    loss_and_grads, loss_only = _losses(model, parallel, comm, stage_codecs, mesh, seed)

    @functools.partial(jax.jit, out_shardings=state_sharding)
    def start(params) -> TrainState:
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, optimizer.init(params), zero)

    init = jax.jit(lambda key: start(layout.init_params(model, key)), out_shardings=state_sharding)

    @_jitted_train_step(state_sharding, batch_sharding)
    def train_step(state: TrainState, tokens: jax.Array):
        layout.check_tokens(model, parallel, tokens)
        loss, grads = loss_and_grads(state.params, tokens, state.step)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss or gradient skips the update on the device (no host sync per step):
        # the state stays the last finite one, and the count tells the host at its next look.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = _guarded(finite, (params, opt_state), (state.params, state.opt_state))
        skipped = state.skipped + (~finite).astype(jnp.int32)
        new_state = TrainState(state.step + 1, params, opt_state, skipped)
        return new_state, {"loss": loss, "grad_norm": grad_norm, "skipped_steps": skipped}

    eval_step = _eval_step(model, parallel, loss_only, state_sharding, batch_sharding)
    is_finite = _is_finite(state_sharding, replicated)
    return Steps(
        init, train_step, eval_step, is_finite, state_sharding, batch_sharding, mesh, start
    )


def _eval_step(model, parallel, loss_only, state_sharding, batch_sharding):
    """eval_step(state, tokens) -> {"loss"}, with loss_only(params, tokens, step)."""

    @functools.partial(
        jax.jit,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=NamedSharding(batch_sharding.mesh, P()),
    )
    def eval_step(state: TrainState, tokens: jax.Array):
        layout.check_tokens(model, parallel, tokens)
        return {"loss": loss_only(state.params, tokens, state.step)}

    return eval_step


def _is_finite(state_sharding, replicated):
    @functools.partial(jax.jit, in_shardings=(state_sharding,), out_shardings=replicated)
    def is_finite(state: TrainState) -> jax.Array:
        """Whether every parameter and optimizer value is finite (checked before each save)."""
        leaves = jax.tree.leaves((state.params, state.opt_state))
        floating = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]  # bf16 too
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in floating]))

    return is_finite


def _jitted_train_step(state_sharding, batch_sharding):
    """jit of train_step(state, tokens) -> (state, metrics): placed state and batch, replicated
    metrics, the state donated."""
    replicated = NamedSharding(batch_sharding.mesh, P())
    return functools.partial(
        jax.jit,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, replicated),
        donate_argnums=0,
    )


def _guarded(finite, new, old):
    """`new` where the step was finite, else `old` (the state stays the last finite one)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def full_params(
    state: TrainState,
    model: ModelConfig,
    parallel: ParallelConfig,
    sharded: bool,
    tp_axis: str = "tp",
) -> Any:
    """The fp32 full-layout parameters of `state`: its params, or with the sharded optimizer
    the fp32 master weights gathered from every rank's shards (not the compute-dtype
    replica)."""
    if not sharded:
        return state.params
    return unshard_master(state.opt_state.master, model, parallel, tp_axis)


def unshard_master(
    master: Any, model: ModelConfig, parallel: ParallelConfig, tp_axis: str = "tp"
) -> Any:
    """The sharded optimizer's fp32 master shards (`opt_state.master`, every leaf [dp, ...,
    S]) as the full-layout parameters."""
    shards = _ShardLayout.of(model, parallel, tp_axis)
    like = layout.abstract_params(model)
    return zero.unshard_leaves(jax.device_get(master), like, shards.dims)


def state_split(parallel: ParallelConfig) -> tuple[int, int, int]:
    """How the sharded optimizer splits its state, (dp, pp, tp): one shard per dp rank, and per
    stage and TP slice where model parallelism runs under shard_map (or its emulation). A
    checkpoint resumes only into the same split."""
    if parallel.mode == "vmap" or parallel.pp * parallel.tp == 1:
        return (parallel.dp, 1, 1)
    return (parallel.dp, parallel.pp, parallel.tp)


@dataclasses.dataclass(frozen=True)
class _ShardLayout:
    """How the sharded optimizer lays out a rank's share of the state.

    axes: the model-parallel mesh axes the state is sliced over: (), (tp,) with TP under
      shard_map, ("pp", tp) with pipeline stages; each rank's slice is what ZeRO shards.
    dims: per parameter one entry per axis, the axis of the full leaf split over it or
      `zero.REPLICATED` (None without axes).
    sizes: the mesh sizes of `axes`.
    param_specs: the replica's specs (the TP or pipeline model's full-layout parameter specs;
      None: replicated).
    """

    axes: tuple[str, ...] = ()
    dims: Any = None
    sizes: tuple[int, ...] = ()
    param_specs: Any = None
    dp_axis: str | tuple[str, ...] = layout.DP_AXIS

    @classmethod
    def of(cls, model: ModelConfig, parallel: ParallelConfig, tp_axis: str) -> _ShardLayout:
        dp = parallel.dp_axis
        if state_split(parallel)[1:] == (1, 1):
            return cls(dp_axis=dp)
        tp_dims = layout.tp_split_dims(model)
        if parallel.pp == 1:
            return cls(
                (tp_axis,),
                jax.tree.map(lambda d: (d,), tp_dims),
                (parallel.tp,),
                layout.param_specs(model, tp_axis),
                dp,
            )
        dims = jax.tree.map(lambda p, t: (p, t), pipeline.stage_split_dims(model), tp_dims)
        return cls(
            (layout.PP_AXIS, tp_axis),
            dims,
            (parallel.pp, parallel.tp),
            pipeline.full_layout_specs(model, tp_axis),
            dp,
        )

    @property
    def lead(self) -> int:
        """Leading rank axes of every state leaf: [dp, S], or [dp, *model axes, S]."""
        return 1 + len(self.axes)

    @property
    def state_spec(self) -> P:
        return P(self.dp_axis, *self.axes)

    def replica_specs(self, params_abstract) -> Any:
        """The replica's specs: whole on every rank, or as the model-parallel parameters."""
        if self.param_specs is None:
            return jax.tree.map(lambda _: P(), params_abstract)
        return self.param_specs

    @property
    def split(self) -> Any:
        """`zero.update`'s split: per leaf the mesh axes its slices differ over."""
        if self.dims is None:
            return None
        return jax.tree.map(
            lambda dims: tuple(
                a for a, d in zip(self.axes, dims, strict=True) if d != zero.REPLICATED
            ),
            self.dims,
            is_leaf=lambda d: isinstance(d, tuple),
        )


def _sharded_update(
    optimizer,
    sharded: zero.ZeroConfig,
    shards: _ShardLayout,
    params_abstract,
    parallel: ParallelConfig,
    mesh,
):
    """`zero.update` over the mesh: (local grads [dp, ...], state, replica, key) -> (state,
    replica, global gradient norm), each rank on its block of the state."""
    lead = shards.lead
    replica_specs = shards.replica_specs(params_abstract)
    grad_specs = jax.tree.map(lambda spec: P(shards.dp_axis, *spec), replica_specs)

    def per_rank(grads, shard_state, replica, key):
        drop = lambda tree, k: jax.tree.map(lambda x: x.reshape(x.shape[k:]), tree)  # noqa: E731
        new, replica, norm = zero.update(
            optimizer,
            sharded,
            drop(grads, 1),
            drop(shard_state, lead),
            replica,
            key,
            split=shards.split,
        )
        return jax.tree.map(lambda x: x.reshape((1,) * lead + x.shape), new), replica, norm

    return layout.spmd_map(
        parallel,
        per_rank,
        mesh=mesh,
        in_specs=(grad_specs, shards.state_spec, replica_specs, P()),
        out_specs=(shards.state_spec, replica_specs, P()),
    )


def make_sharded_steps(
    model: ModelConfig,
    parallel: ParallelConfig,
    comm: taco_jax.TPComm,
    optimizer: optax.GradientTransformation,
    sharded: zero.ZeroConfig,
    stage_codecs: pipeline.StageCodecs = pipeline.UNCOMPRESSED,
    seed: int = 0,
) -> Steps:
    """`make_steps` with ZeRO-1 over the dp ranks (`taco_train.zero`), for every layout.

    The state: params, the replica every rank computes with (in `parallel.compute_dtype`,
    placed as the model's parameters); opt_state, a `zero.ShardState` of the fp32 master shards
    and the optimizer's state, every leaf [dp, ...] split over `parallel.dp_axis`, or with model
    parallelism under shard_map [dp, tp, ...] / [dp, pp, tp, ...]: each rank's TP / stage slice
    of the full-layout leaf is what ZeRO shards (`zero.shard_leaves`). A step computes each dp
    rank's gradients of its share of the batch (fp32, taken at the replica's values), then
    `zero.update` (reduce-scatter, clip, optimizer, all-gather; compressed as `sharded` says,
    its noise keyed by `seed` and the step).
    """
    layout.check_config(model, parallel)
    if sharded.axes != parallel.dp_axes:
        raise ValueError(
            f"sharded.dp_axes={sharded.dp_axes!r} must name the mesh's dp axes "
            f"{parallel.dp_axes} (parallel.dp_axis)"
        )
    mesh = layout.make_mesh(parallel, comm.axis_name)
    replicated = NamedSharding(mesh, P())
    shards = _ShardLayout.of(model, parallel, comm.axis_name)
    params_abstract = layout.abstract_params(model)
    replica_dtype = jnp.dtype(parallel.compute_dtype)
    to_shards = functools.partial(
        zero.shard_leaves, ranks=parallel.dp, dims=shards.dims, sizes=shards.sizes
    )
    init_shards = functools.partial(zero.init, optimizer)
    for _ in range(shards.lead):  # one vmap per leading rank axis
        init_shards = jax.vmap(init_shards)
    shards_abstract = jax.eval_shape(to_shards, params_abstract)
    opt_abstract = jax.eval_shape(init_shards, shards_abstract).opt_state
    placed = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    state_sharding = TrainState(
        step=replicated,
        params=jax.tree.map(placed, shards.replica_specs(params_abstract)),
        opt_state=jax.tree.map(
            lambda _: placed(shards.state_spec), zero.ShardState(shards_abstract, opt_abstract)
        ),
        skipped=replicated,
    )
    batch_sharding = NamedSharding(mesh, P(parallel.dp_axis))
    local_grads, loss_only = _losses(model, parallel, comm, stage_codecs, mesh, seed, local=True)
    # The compressors' noise: a stream apart from the parameters' init (key(seed) itself).
    step_key = jax.random.split(jax.random.key(seed), 3)[2]
    update = _sharded_update(optimizer, sharded, shards, params_abstract, parallel, mesh)

    @functools.partial(jax.jit, out_shardings=state_sharding)
    def start(params) -> TrainState:
        state = init_shards(to_shards(params))
        replica = jax.tree.map(lambda p: p.astype(replica_dtype), params)
        zero_count = jnp.zeros((), jnp.int32)
        return TrainState(zero_count, replica, state, zero_count)

    init = jax.jit(lambda key: start(layout.init_params(model, key)), out_shardings=state_sharding)

    @_jitted_train_step(state_sharding, batch_sharding)
    def train_step(state: TrainState, tokens: jax.Array):
        layout.check_tokens(model, parallel, tokens)
        at_replica = jax.tree.map(lambda p: p.astype(jnp.float32), state.params)
        loss, grads = local_grads(at_replica, tokens, state.step)
        key = jax.random.fold_in(step_key, state.step)
        shard_state, replica, grad_norm = update(grads, state.opt_state, state.params, key)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        replica, shard_state = _guarded(
            finite, (replica, shard_state), (state.params, state.opt_state)
        )
        skipped = state.skipped + (~finite).astype(jnp.int32)
        new_state = TrainState(state.step + 1, replica, shard_state, skipped)
        return new_state, {"loss": loss, "grad_norm": grad_norm, "skipped_steps": skipped}

    eval_step = _eval_step(model, parallel, loss_only, state_sharding, batch_sharding)
    is_finite = _is_finite(state_sharding, replicated)
    return Steps(
        init, train_step, eval_step, is_finite, state_sharding, batch_sharding, mesh, start
    )
