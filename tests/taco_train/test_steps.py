"""`make_steps`: placed state, a few train steps that lower the loss, eval, bad configs."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from tolerances import exact_tolerance

import taco_jax
from taco_jax import sdp4bit
from taco_models import ModelConfig, ParallelConfig, pipeline
from taco_models import parallel as layout
from taco_models.parallel import check_config
from taco_train import zero
from taco_train.steps import make_steps

CFG = ModelConfig.preset("gpt_tiny")
STEPS = 6
EMULATED_3D = ParallelConfig(  # dp x pp x tp on one device (models/spmd.py)
    dp=2,
    pp=2,
    tp=2,
    microbatches=2,
    sequence_parallel=True,
    compute_dtype="float32",
    mode="emulate",
)


SLOW = pytest.mark.slow  # > ~10 s on the 2-core CPU: the slow tier


def _batch(global_batch: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, CFG.vocab_size, (global_batch, CFG.seq_len + 1), dtype=np.int32)


@pytest.mark.parametrize(
    "parallel,codec",
    [
        pytest.param(
            ParallelConfig(dp=2, tp=4, sequence_parallel=True, remat=True), "taco", marks=SLOW
        ),
        pytest.param(ParallelConfig(dp=2, tp=2, mode="vmap"), "taco", marks=SLOW),
        # TAH-Quant on TP, stochastic (80 s on the CPU; the round-to-nearest grid shares every
        # path but the key and is tested inside the collectives, tests/taco_jax)
        pytest.param(ParallelConfig(dp=2, tp=2, mode="vmap"), "tahquant4", marks=SLOW),
    ],
    ids=[
        "shard_map-dp2-tp4-sp-remat",
        "vmap-dp2-tp2",
        "vmap-dp2-tp2-tahquant4",
    ],
)
def test_train_steps_lower_the_loss(parallel, codec):
    if jax.device_count() < parallel.num_devices:
        pytest.skip(f"needs {parallel.num_devices} devices")
    comm = taco_jax.TPComm.create("tp", fwd=codec, impl="xla")
    steps = make_steps(CFG, parallel, comm, optax.adamw(3e-3))
    state = steps.init(jax.random.key(0))
    if parallel.mode == "shard_map":
        assert state.params["blocks"]["attn"]["wqkv"].sharding.spec == P(
            None, None, "tp", None, None
        )
        assert state.opt_state[0].mu["wte"].sharding.spec == P("tp", None)
    tokens = jax.device_put(_batch(4), steps.batch_sharding)
    eval_before = float(steps.eval_step(state, tokens)["loss"])
    losses = []
    for _ in range(STEPS):
        state, metrics = steps.train_step(state, tokens)
        losses.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    assert int(state.step) == STEPS
    assert abs(losses[0] - eval_before) <= 1e-2 * eval_before  # same params, bf16 both ways
    # Adam's first steps move every weight by ~lr; on one repeated batch the loss must fall by
    # far more than bf16 noise (~1e-2): require 10% over 6 steps.
    assert losses[-1] < 0.9 * losses[0], losses
    assert float(steps.eval_step(state, tokens)["loss"]) < 0.9 * eval_before


def test_state_sharding_matches_state_tree():
    parallel = ParallelConfig(dp=1, tp=2)
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    steps = make_steps(CFG, parallel, taco_jax.TPComm.create(fwd="none"), optax.adam(1e-3))
    state = jax.eval_shape(steps.init, jax.random.key(0))
    assert jax.tree.structure(state) == jax.tree.structure(steps.state_sharding)


@pytest.mark.parametrize(
    ("cfg", "parallel", "message"),
    [
        (ModelConfig.preset("qwen2_tiny"), ParallelConfig(tp=8), "n_kv_heads=4 is not a multiple"),
        (ModelConfig.preset("gpt_tiny", n_heads=4, n_kv_heads=4), ParallelConfig(tp=8), "n_kv"),
        (CFG, ParallelConfig(tp=3), "is not a multiple of parallel.tp=3"),
        (
            ModelConfig.preset("gpt_tiny", seq_len=30),
            ParallelConfig(tp=4, sequence_parallel=True),
            "seq_len=30",
        ),
    ],
)
def test_bad_parallel_configs_name_the_value(cfg, parallel, message):
    with pytest.raises(ValueError, match=message):
        check_config(cfg, parallel)


def test_bad_parallel_config_fields():
    with pytest.raises(ValueError, match="mode='pipeline'"):
        ParallelConfig(mode="pipeline")
    with pytest.raises(ValueError, match="compute_dtype='int8'"):
        ParallelConfig(compute_dtype="int8")


def test_state_is_portable_across_tp_sizes():
    """The state holds full-shape arrays, so a tp = 4 state re-placed for tp = 2 (as an orbax
    restore with the other `state_sharding` does) evaluates to the same loss."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    comm = taco_jax.TPComm.create("tp", fwd="none")
    tp4, tp2 = (
        make_steps(CFG, ParallelConfig(tp=tp, compute_dtype="float32"), comm, optax.sgd(0.1))
        for tp in (4, 2)
    )
    state = tp4.init(jax.random.key(0))
    moved = jax.device_put(jax.device_get(state), tp2.state_sharding)
    tokens = _batch(2)
    loss4 = float(tp4.eval_step(state, tokens)["loss"])
    loss2 = float(tp2.eval_step(moved, tokens)["loss"])
    # fp32 with reductions split 4 vs 2 ways: the reassociation bound of the equivalence tests.
    assert abs(loss4 - loss2) <= exact_tolerance(CFG, batch=2) * loss4


SDP4BIT = zero.ZeroConfig(grad_codec="tlq_hs", param_codec="qwd", grad_clip=1.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel,sharded",
    [(ParallelConfig(tp=2, mode="vmap"), None), (ParallelConfig(dp=2, tp=2, mode="vmap"), SDP4BIT)],
    ids=["replicated", "sharded-sdp4bit-bf16-replica"],
)
def test_a_nonfinite_step_is_skipped_on_the_device(parallel, sharded):
    """A NaN in the loss leaves params and optimizer state bit for bit as they were, counts the
    step as skipped, and `is_finite` reports the state (the trainer checks it before a save);
    with the sharded optimizer the params are the bf16 replica, which `is_finite` checks too."""
    steps = make_steps(CFG, parallel, taco_jax.TPComm.create(), optax.adamw(3e-3), sharded=sharded)
    tokens = jax.device_put(_batch(4), steps.batch_sharding)
    state, _ = steps.train_step(steps.init(jax.random.key(0)), tokens)
    assert bool(steps.is_finite(state)) and int(state.skipped) == 0
    poisoned = state.replace(
        params={**state.params, "wpe": state.params["wpe"].at[0, 0].set(np.nan)}
    )
    before = jax.device_get(poisoned)
    after, metrics = steps.train_step(poisoned, tokens)
    assert not np.isfinite(float(metrics["loss"]))
    assert int(after.skipped) == int(metrics["skipped_steps"]) == 1 and int(after.step) == 2
    for old, new in zip(
        jax.tree.leaves((before.params, before.opt_state)),
        jax.tree.leaves(jax.device_get((after.params, after.opt_state))),
        strict=True,
    ):
        # bit for bit (bytes: numpy does not treat bf16 NaNs as equal)
        as_bytes = lambda a: np.atleast_1d(np.asarray(a)).view(np.uint8)  # noqa: E731
        np.testing.assert_array_equal(as_bytes(old), as_bytes(new))
    assert not bool(steps.is_finite(after))


def _assert_copies_identical(state) -> None:
    """Every device holding the same block of a leaf holds the same bytes: the copies that the
    mesh axes replicating a leaf keep (and that the global norm counts once) never drift."""
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        blocks = {}
        for shard in leaf.addressable_shards:
            data = np.asarray(shard.data).tobytes()
            assert blocks.setdefault(str(shard.index), data) == data, shard.index


def _slice_dims(parallel: ParallelConfig):
    """The sharded state's per-leaf slice axes (`zero.shard_leaves`): (tp,) or (pp, tp)."""
    tp = layout.tp_split_dims(CFG)
    if parallel.pp > 1:
        return jax.tree.map(lambda p, t: (p, t), pipeline.stage_split_dims(CFG), tp)
    return jax.tree.map(lambda t: (t,), tp) if parallel.tp > 1 else None


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [
        ParallelConfig(dp=2, compute_dtype="float32"),
        # Stages, TP slices and sequence parallelism (whose replicated-leaf gradients are summed
        # over tp) in one case.
        ParallelConfig(
            dp=2, pp=2, tp=2, microbatches=2, sequence_parallel=True, compute_dtype="float32"
        ),
        EMULATED_3D,  # the same layout emulated on one device
    ],
    ids=["dp2", "dp2-pp2-tp2-sp", "emulate-dp2-pp2-tp2-sp"],
)
def test_sharded_optimizer_is_the_replicated_one(parallel, check_replicas):
    """ZeRO-1 (`optimizer.sharded`), uncompressed, fp32: three steps land where the replicated
    optimizer lands, both report the same gradient norm (with pp and tp each rank keeps the
    shards of its stage and TP slice, and the norm must count the leaves that stages or TP
    replicate once), and the replicated copies stay identical.

    Bound per value (tests/taco_train/test_zero.py derives it): the same mean gradient at
    dp = 2; the global norm summed in another order scales every clipped gradient by a common
    1 + d, |d| <= n 2^-24 for n parameters, which Adam's step ignores but for eps; and ~8
    roundings of each update that XLA may compile differently:
    |dp| <= steps 2^-24 (lr (n + 4) + 17 lr + 3 |p|). (Under vmap, the same update is
    tests/taco_train/test_zero.py's, and the trainer's vmap path trains in the non-finite
    test above.)"""
    if jax.device_count() < parallel.num_devices:
        pytest.skip(f"needs {parallel.num_devices} devices")
    # Emulated there is one copy per leaf to compare; the ranks' copies are checked as made.
    check_replicas(parallel.mode == "emulate")
    lr, steps_run = 3e-3, 3
    comm = taco_jax.TPComm.create("tp", fwd="none")
    adamw = optax.adamw(lr, weight_decay=0.1)
    plain = make_steps(CFG, parallel, comm, optax.chain(optax.clip_by_global_norm(1.0), adamw))
    sharded = make_steps(
        CFG, parallel, comm, adamw, sharded=zero.ZeroConfig(parallel.dp_axis, grad_clip=1.0)
    )
    a, b = plain.init(jax.random.key(0)), sharded.init(jax.random.key(0))
    tokens = _batch(4)
    n = sum(x.size for x in jax.tree.leaves(a.params))
    for _ in range(steps_run):
        a, want_metrics = plain.train_step(a, jax.device_put(tokens, plain.batch_sharding))
        b, got_metrics = sharded.train_step(b, jax.device_put(tokens, sharded.batch_sharding))
        # The same squares summed in another order: relative error <= n 2^-24.
        np.testing.assert_allclose(
            got_metrics["grad_norm"], want_metrics["grad_norm"], rtol=n * 2.0**-24
        )
    for want, got in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
        bound = steps_run * 2.0**-24 * (lr * (n + 4) + 17 * lr + 3 * np.abs(want))
        assert np.all(np.abs(got - want) <= bound)
    _assert_copies_identical(b)
    masters = zero.unshard_leaves(b.opt_state.master, a.params, _slice_dims(parallel))
    for got, replica in zip(jax.tree.leaves(masters), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(replica))  # fp32 replica


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shard_map", "emulate"])
def test_two_level_dp_compresses_in_two_levels(mode, check_replicas, monkeypatch):
    """dp = 4 as 2 groups of 2 (`dp_intra=2`): the mesh names both levels, the batch and every
    sharded-state leaf are split over them, and ZeRO-1 with TLq-HS (8-bit codes within a group,
    4-bit across) and qWD trains: the loss falls over a few steps, the replicas stay identical,
    and the gradient reduce-scatter's relative error is that of a compressed one (above the
    exact path's 0, below the 4-bit bound of tests/taco_train/test_train_loop.py's
    ERROR_BOUNDS). Emulated on one device, the same (its mesh axes of size 1)."""
    parallel = ParallelConfig(dp=4, dp_intra=2, compute_dtype="float32", mode=mode)
    check_replicas(mode == "emulate")
    if jax.device_count() < parallel.num_devices:
        pytest.skip(f"needs {parallel.num_devices} devices")
    assert parallel.dp_axis == ("dp_inter", "dp_intra") and parallel.dp_shape == (2, 2)
    comm = taco_jax.TPComm.create("tp", fwd="none")
    sharded = zero.ZeroConfig(parallel.dp_axis, "tlq_hs", "qwd", grad_clip=1.0, telemetry=True)
    steps = make_steps(CFG, parallel, comm, optax.adamw(3e-3), sharded=sharded)
    sizes = (2, 2, 1) if mode == "shard_map" else (1, 1, 1)
    assert dict(steps.mesh.shape) == dict(zip(("dp_inter", "dp_intra", "tp"), sizes, strict=True))
    assert steps.batch_sharding.spec == P(("dp_inter", "dp_intra"))
    for sharding in jax.tree.leaves(steps.state_sharding.opt_state):
        assert sharding.spec[0] == ("dp_inter", "dp_intra")
    seen = []
    tlq_hs = sdp4bit.tlq_hs_psum_scatter

    def spy(g, axis_names, **kwargs):  # the levels the reduce-scatter runs over, while tracing
        seen.append(tuple((name, jax.lax.axis_size(name)) for name in axis_names))
        return tlq_hs(g, axis_names, **kwargs)

    monkeypatch.setattr(sdp4bit, "tlq_hs_psum_scatter", spy)
    state = steps.init(jax.random.key(0))
    tokens = jax.device_put(_batch(8), steps.batch_sharding)
    taco_jax.telemetry.drain()
    losses = []
    for _ in range(STEPS):
        state, metrics = steps.train_step(state, tokens)
        losses.append(float(metrics["loss"]))
    errors = taco_jax.telemetry.drain()
    assert seen and set(seen) == {(("dp_inter", 2), ("dp_intra", 2))}, seen  # both levels run
    assert losses[-1] < losses[0], losses
    assert 0 < errors["dp_grads"].error < 0.9, errors
    _assert_copies_identical(state)


def test_dp_intra_must_divide_dp_and_match_the_sharded_axes():
    with pytest.raises(ValueError, match="dp_intra=3 must be >= 1 and divide dp=4"):
        ParallelConfig(dp=4, dp_intra=3)
    comm = taco_jax.TPComm.create("tp", fwd="none")
    two_levels = ParallelConfig(dp=2, dp_intra=2)
    with pytest.raises(ValueError, match=r"sharded.dp_axes='dp' must name .*'dp_intra'"):
        make_steps(CFG, two_levels, comm, optax.adamw(1e-3), sharded=zero.ZeroConfig())
