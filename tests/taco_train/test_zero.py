"""ZeRO-1 sharded data parallelism (`taco_train.zero`) on fake CPU devices and under vmap:
uncompressed it is the replicated-DP AdamW update; with SDP4Bit the replicas stay bit-identical.

Tolerances (derivations):
- dp = 2, no clipping: the mean gradient is (g0 + g1) / 2 on both sides (a sum of two is
  order-free, the halving exact) and AdamW is elementwise, so the master weights are the same
  fp32 formula; XLA may still compile it differently in the two programs (a multiply and an add
  fused or not, another order), so each of the ~8 roundings of an update
  u = -lr (m^ / (sqrt(v^) + eps) + wd p) may differ: |du| <= 16 2^-24 lr (|m^ / sqrt(v^)| +
  wd |p|), with |m^ / sqrt(v^)| <= 1.01 for t <= 3 at (b1, b2) = (0.9, 0.999) (Cauchy-Schwarz
  on the bias-corrected weights), plus the rounding of p + u, 2^-24 |p|. Per value:
  |dp| <= steps 2^-24 (17 lr + 3 |p|) (wd = 0.1).
- clipping at dp = 4: the global norm sums squares in another order (relative error
  <= n 2^-24 for n squares), so every clipped gradient differs by a common factor 1 + d; Adam's
  step m / (sqrt(v) + eps) does not change under a common factor except through eps, and the
  decayed weights not at all: |dp| <= steps * lr * (n + 4) 2^-24 per value, plus the
  compilation term above.
- qWD: the replica moves by the decoded difference, within one step s = absmax / 7 of its
  group of 2048 of the exact new master minus the old replica, then rounds to bf16 (half an
  ulp: 2^-8 of the value): |replica - master| <= s + 2^-8 (|master| + s).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from taco_train import zero

LR = 1e-2
STEPS = 3
SHAPES = {"w": (37, 19), "b": (19,), "emb": (300, 8)}
DECAY = {"w": True, "b": False, "emb": True}
MODES = ("shard_map", "vmap")


def _params():
    keys = jax.random.split(jax.random.key(0), len(SHAPES))
    return {n: jax.random.normal(k, s) for k, (n, s) in zip(keys, SHAPES.items(), strict=True)}


def _grads(ranks, step):
    """Per-rank gradients [ranks, *shape] of step `step`."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        key = jax.random.fold_in(jax.random.key(100 + step), i)
        out[name] = jax.random.normal(key, (ranks, *shape)) * (1 + step)
    return out


def _adamw():
    return optax.adamw(LR, weight_decay=0.1, mask=DECAY)


def _replicated(params, ranks, clip):
    """The reference: replicated DP, mean gradient, clipping, AdamW on fp32 parameters."""
    opt = optax.chain(optax.clip_by_global_norm(clip), _adamw())
    state = opt.init(params)
    for step in range(STEPS):
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), _grads(ranks, step))
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _run_per_rank(fn, stacked, ranks, mode, axis="dp"):
    if mode == "vmap":
        return jax.jit(jax.vmap(fn, axis_name=axis))(stacked)
    mesh = jax.make_mesh((ranks,), (axis,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:ranks])  # fmt: skip

    def body(block):
        out = fn(jax.tree.map(lambda a: a[0], block))
        return jax.tree.map(lambda a: a[None], out)

    placed = jax.device_put(stacked, NamedSharding(mesh, P(axis)))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False)
    return jax.jit(mapped)(placed)


def _sharded(params, ranks, cfg, mode, replica_dtype=jnp.float32):
    """STEPS sharded updates; returns (master shards [ranks, S] per leaf, replicas per rank,
    the replicas and masters of the last step's start)."""
    opt = _adamw()
    master = zero.shard_leaves(params, ranks)
    replica = jax.tree.map(lambda p: jnp.broadcast_to(p.astype(replica_dtype), (ranks, *p.shape)),
                           params)  # fmt: skip

    def init(shard):
        return zero.init(opt, shard)

    state = _run_per_rank(init, master, ranks, mode)
    history = []
    for step in range(STEPS):
        history.append(replica)

        def step_fn(args, step=step):
            grads, state, replica = args
            key = jax.random.fold_in(jax.random.key(7), step)  # the same on every rank
            new_state, new_replica, _ = zero.update(opt, cfg, grads, state, replica, key)
            return new_state, new_replica

        state, replica = _run_per_rank(step_fn, (_grads(ranks, step), state, replica), ranks,
                                       mode)  # fmt: skip
    return state.master, replica, history[-1]


@pytest.mark.parametrize("mode", MODES)
def test_uncompressed_equals_replicated_adamw(mode):
    params = _params()
    want = _replicated(params, 2, clip=1e9)
    master, replica, _ = _sharded(params, 2, zero.ZeroConfig(grad_clip=1e9), mode)
    got = zero.unshard_leaves(master, params)
    for name in SHAPES:
        w = np.asarray(want[name], np.float64)
        bound = STEPS * 2.0**-24 * (17 * LR + 3 * np.abs(w))
        assert np.all(np.abs(np.asarray(got[name], np.float64) - w) <= bound), name
        for rank in range(2):  # the fp32 replica is the master itself
            np.testing.assert_array_equal(replica[name][rank], got[name])


def test_clipping_uses_the_global_norm_of_the_mean_gradient():
    params = _params()
    clip = 1.0  # the gradients' norm is ~40-120: every step clips
    want = _replicated(params, 4, clip=clip)
    master, _, _ = _sharded(params, 4, zero.ZeroConfig(grad_clip=clip), "shard_map")
    got = zero.unshard_leaves(master, params)
    squares = sum(int(np.prod(s)) for s in SHAPES.values())
    for name in SHAPES:
        w = np.asarray(want[name], np.float64)
        bound = STEPS * 2.0**-24 * (LR * (squares + 4) + 17 * LR + 3 * np.abs(w))
        assert np.all(np.abs(np.asarray(got[name], np.float64) - w) <= bound), name


@pytest.mark.parametrize("mode", ["shard_map"])  # vmap: test_sdp4bit.py runs both under it
def test_sdp4bit_replicas_stay_bit_identical_near_the_master(mode):
    ranks = 4
    params = _params()
    cfg = zero.ZeroConfig(grad_codec="tlq_hs", param_codec="qwd", grad_clip=1.0)
    master, replica, before = _sharded(params, ranks, cfg, mode, jnp.bfloat16)
    for name in SHAPES:
        for rank in range(1, ranks):
            np.testing.assert_array_equal(replica[name][rank], replica[name][0])
    # The last step's bound, group by group of each rank's padded shard.
    new = {n: np.asarray(m, np.float64).reshape(-1, 2048) for n, m in master.items()}
    old = zero.shard_leaves(jax.tree.map(lambda r: r[0].astype(jnp.float32), before), ranks)
    got = zero.shard_leaves(jax.tree.map(lambda r: r[0].astype(jnp.float32), replica), ranks)
    for name in SHAPES:
        step = np.abs(new[name] - np.asarray(old[name], np.float64).reshape(-1, 2048))
        s = step.max(axis=-1, keepdims=True) / 7
        err = np.abs(np.asarray(got[name], np.float64).reshape(-1, 2048) - new[name])
        assert np.all(err <= s + 2.0**-8 * (np.abs(new[name]) + s)), name
        assert np.any(step > 0), name  # the master moved
        padding = np.asarray(master[name]).reshape(-1)[int(np.prod(SHAPES[name])) :]
        np.testing.assert_array_equal(padding, 0)  # the optimizer never moves padding


def test_errors_name_the_offending_value():
    with pytest.raises(ValueError, match="grad_codec='fp8'"):
        zero.ZeroConfig(grad_codec="fp8")
    with pytest.raises(ValueError, match="param_codec='int4'"):
        zero.ZeroConfig(param_codec="int4")
    assert zero.shard_size(5000, 4) == 2048 and zero.shard_size(8192, 4) == 2048
