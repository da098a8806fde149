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
  <= n 2^-24 for n squares), so step t's clipped gradients differ by a factor 1 + d_t,
  |d_t| <= n 2^-24, another each step: Adam's m^ / sqrt(v^) moves by at most 2 C |d| / (1 - |d|)
  with C = max_t sqrt(sum_k a_k^2 / b_k) over the bias-corrected weights a_k of m and b_k of v
  (C <= 1.004 for t <= 3, Cauchy-Schwarz), eps and the decayed weights not at all:
  |dp| <= steps * lr * (2.01 n + 4) 2^-24 per value, plus the compilation term above.
- qWD: the replica moves by the decoded difference, within one step s = absmax / 7 of its
  group of 2048 of the exact new master minus the old replica, then rounds to bf16 (half an
  ulp: 2^-8 of the value): |replica - master| <= s + 2^-8 (|master| + s).
- one bucket for every leaf against one per leaf: two programs whose reduce-scatters sum each
  element over the ranks in an order neither fixes (StableHLO's reduce_scatter reduces along
  "an implementation-defined binary tree" per element, as its all_reduce; NCCL's order follows
  the buffer's size, github.com/NVIDIA/nccl/issues/157), as the norm sums its squares. So the
  gradients are multiples of 1/2 (`_dyadic_grads`) and every partial sum is exact, in any
  order: over the ranks (halves of magnitude < 2^8), the mean (a division by a power of two),
  the squares of the mean and their sum (multiples of q = 1/(2 ranks)^2, below 2^24 q, which
  `_exact_norms` checks). Both programs clip the same mean gradient by the sqrt of the same
  exact sum. What remains may round apart: that sqrt and the clip's s / norm x clip (allowing
  each 2 ulps, 4 2^-24 relative, in each program) scale step t's clipped gradients by 1 + d_t,
  |d_t| <= 24 2^-24, which moves Adam's m^ / (sqrt(v^) + eps) by <= 2 C |d| / (1 - |d|),
  C = max_t sqrt(sum_k a_k^2 / b_k) <= 1.004 for t <= 3 (Cauchy-Schwarz on the bias-corrected
  weights a_k of m, b_k of v): <= 49 2^-24 lr a step, clip_term = 49 lr, plus the compilation
  term above (~1e-6 in all). A misplaced element steps with another one's gradients and lands
  ~lr away (Adam's first step is lr sign(g), the next ones differ in size too).
  The all-gather only moves values: every rank's replica is the same bits, and is its run's
  master converted to bf16, which the spec leaves unfixed when inexact (either neighbour:
  within one bf16 ulp, <= 2^-7 |value|) of the master or of a recomputation of it (within the
  step bound): |replica - master| <= 2^-7 |master| + 2 bound.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tp_testing import run_on_mesh

from taco_train import zero

LR = 1e-2
STEPS = 3
# "long" crosses a rank boundary at dp = 4 inside a block of 32 (2100 = 65 x 32 + 20): the
# padding mask must use the rank's offset.
SHAPES = {"w": (37, 19), "b": (19,), "emb": (300, 8), "long": (2100,)}
DECAY = {"w": True, "b": False, "emb": True, "long": True}
N_PARAMS = sum(int(np.prod(s)) for s in SHAPES.values())


def _params(shapes=SHAPES):
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return {n: jax.random.normal(k, s) for k, (n, s) in zip(keys, shapes.items(), strict=True)}


def _grads(ranks, step, shapes=SHAPES):
    """Per-rank gradients [ranks, *shape] of step `step`; their mean's norm grows with the step
    (about 1, 2, 3 x sqrt(N_PARAMS / ranks))."""
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        key = jax.random.fold_in(jax.random.key(100 + step), i)
        out[name] = jax.random.normal(key, (ranks, *shape)) * (1 + step)
    return out


def _dyadic_grads(ranks, step, shapes=SHAPES):
    """`_grads` rounded to multiples of 1/2: their sums over the ranks and the squares and sums
    of squares of their mean are exact in fp32 (module docstring), in any order."""
    return jax.tree.map(lambda g: jnp.round(2 * g) / 2, _grads(ranks, step, shapes))


def _adamw(params=None):
    mask = DECAY if params is None else {n: DECAY.get(n, True) for n in params}
    return optax.adamw(LR, weight_decay=0.1, mask=mask)


def _replicated(params, ranks, clip):
    """The reference: replicated DP, mean gradient, clipping, AdamW on fp32 parameters.
    Returns (params, the mean gradient's norm at each step)."""
    opt = optax.chain(optax.clip_by_global_norm(clip), _adamw())
    state, norms = opt.init(params), []
    for step in range(STEPS):
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), _grads(ranks, step))
        norms.append(float(optax.tree.norm(grads)))
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, norms


def _sharded(params, cfg, mode, shape, replica_dtype=jnp.float32, grads_of=_grads):
    """STEPS sharded updates on a dp mesh of `shape` (names: cfg.axes), each rank's gradients
    from `grads_of`. Returns (master shards [ranks, S] per leaf, replicas [ranks, ...], the
    replicas before the last step, the norms)."""
    opt, names = _adamw(params), cfg.axes
    shapes = {n: p.shape for n, p in params.items()}
    ranks = int(np.prod(shape))
    stack = lambda tree: jax.tree.map(lambda x: x.reshape(*shape, *x.shape[1:]), tree)  # noqa: E731
    flat = lambda tree: jax.tree.map(lambda x: x.reshape(ranks, *x.shape[len(shape) :]), tree)  # noqa: E731
    state = run_on_mesh(
        lambda m: zero.init(opt, m), stack(zero.shard_leaves(params, ranks)), shape, names, mode
    )
    replica = jax.tree.map(
        lambda p: jnp.broadcast_to(p.astype(replica_dtype), (*shape, *p.shape)), params
    )
    norms = []
    for step in range(STEPS):
        before = replica

        def step_fn(args, step=step):
            grads, state, replica = args
            key = jax.random.fold_in(jax.random.key(7), step)  # the same on every rank
            return zero.update(opt, cfg, grads, state, replica, key)

        grads = stack(grads_of(ranks, step, shapes))
        state, replica, norm = run_on_mesh(step_fn, (grads, state, replica), shape, names, mode)
        norms.append(np.asarray(norm).reshape(-1))
    return flat(state.master), flat(replica), flat(before), norms


def _step_bound(want, clip_term):
    """steps 2^-24 (clip_term + 17 lr + 3 |p|) per value p of `want` (module docstring)."""
    return STEPS * 2.0**-24 * (clip_term + 17 * LR + 3 * np.abs(np.asarray(want, np.float64)))


def _assert_within_step_rounding(got, want, clip_term):
    """Every leaf of `want`: |got - want| <= `_step_bound`."""
    for name in want:
        err = np.abs(np.asarray(got[name], np.float64) - np.asarray(want[name], np.float64))
        assert np.all(err <= _step_bound(want[name], clip_term)), name


def _assert_norms(norms, want):
    """Every rank reports the global norm of the mean gradient: the same squares summed in
    another order, relative error <= N_PARAMS 2^-24."""
    for got, ref in zip(norms, want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=N_PARAMS * 2.0**-24)


@pytest.mark.slow  # the fast tier steps ZeRO-1 in test_slices_of_a_leaf_round_independently...
@pytest.mark.parametrize("mode", ["shard_map", "vmap"])
def test_uncompressed_equals_replicated_adamw(mode):
    params = _params()
    want, want_norms = _replicated(params, 2, clip=1e9)
    master, replica, _, norms = _sharded(params, zero.ZeroConfig(grad_clip=1e9), mode, (2,))
    got = zero.unshard_leaves(master, params)
    _assert_within_step_rounding(got, want, 0.0)
    _assert_norms(norms, want_norms)
    for name in SHAPES:  # the fp32 replica is the master itself
        for rank in range(2):
            np.testing.assert_array_equal(replica[name][rank], got[name])


@pytest.mark.parametrize(
    "shape,axes",
    [
        pytest.param((4,), "dp", marks=pytest.mark.slow),
        pytest.param((2, 2), ("outer", "inner"), marks=pytest.mark.slow),
    ],
    ids=["dp4", "outer2-inner2"],
)
def test_clipping_uses_the_global_norm_of_the_mean_gradient(shape, axes):
    """The mean gradient's norm is ~ 36, 72, 108 over the three steps at dp = 4: a threshold of
    40 leaves the first step unclipped and clips the others. Over two dp axes the reduce-scatter
    and the all-gather run one axis at a time."""
    params, clip = _params(), 40.0
    want, want_norms = _replicated(params, 4, clip=clip)
    assert want_norms[0] < clip < want_norms[1]
    cfg = zero.ZeroConfig(dp_axes=axes, grad_clip=clip)
    master, _, _, norms = _sharded(params, cfg, "shard_map", shape)
    _assert_within_step_rounding(
        zero.unshard_leaves(master, params), want, LR * (2.01 * N_PARAMS + 4)
    )
    _assert_norms(norms, want_norms)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shard_map"])  # vmap: test_sdp4bit.py runs both under it
def test_sdp4bit_replicas_stay_bit_identical_near_the_master(mode):
    ranks = 4
    params = _params()
    cfg = zero.ZeroConfig(grad_codec="tlq_hs", param_codec="qwd", grad_clip=40.0)
    master, replica, before, _ = _sharded(params, cfg, mode, (ranks,), jnp.bfloat16)
    plain, _, _, _ = _sharded(params, zero.ZeroConfig(grad_clip=40.0), mode, (ranks,), jnp.bfloat16)
    for name in SHAPES:
        for rank in range(1, ranks):
            np.testing.assert_array_equal(replica[name][rank], replica[name][0])
        # TLq-HS really ran: the compressed gradients moved the master elsewhere.
        assert not np.array_equal(np.asarray(master[name]), np.asarray(plain[name])), name
    # The last step's bound, group by group of each rank's padded shard.
    new = {n: np.asarray(m, np.float64).reshape(-1, 2048) for n, m in master.items()}
    old = zero.shard_leaves(jax.tree.map(lambda r: r[0].astype(jnp.float32), before), ranks)
    got = zero.shard_leaves(jax.tree.map(lambda r: r[0].astype(jnp.float32), replica), ranks)
    for name in SHAPES:
        step = np.abs(new[name] - np.asarray(old[name], np.float64).reshape(-1, 2048))
        s = step.max(axis=-1, keepdims=True) / 7
        replica64 = np.asarray(got[name], np.float64).reshape(-1, 2048)
        err = np.abs(replica64 - new[name])
        assert np.all(err <= s + 2.0**-8 * (np.abs(new[name]) + s)), name
        assert np.any(step > 0), name  # the master moved
        # qWD really ran: the replica is not the master rounded to bf16.
        rounded = np.asarray(jnp.asarray(new[name], jnp.bfloat16), np.float64)
        assert not np.array_equal(replica64, rounded), name
        padding = np.asarray(master[name]).reshape(-1)[int(np.prod(SHAPES[name])) :]
        np.testing.assert_array_equal(padding, 0)  # the optimizer never moves padding


def test_buckets_hold_leaves_of_one_kind_in_tree_order_up_to_the_limit():
    """Shards at dp = 2: a 2048, b 2048 (bf16), c 4096, d 2048 (split over tp): a and c share
    a bucket (same axes and dtype, 2 x 6144 padded elements) unless the limit is below that;
    b and d never join them."""
    like = {
        "a": jnp.zeros(3000),
        "b": jnp.zeros(10, jnp.bfloat16),
        "c": jnp.zeros(5000),
        "d": jnp.zeros(100),
    }
    split = {"a": (), "b": (), "c": (), "d": ("tp",)}
    assert zero._Buckets(like, split, 2, None).groups == [[0, 2], [1], [3]]
    assert zero._Buckets(like, split, 2, 2 * 6144).groups == [[0, 2], [1], [3]]
    assert zero._Buckets(like, split, 2, 2 * 6144 - 1).groups == [[0], [1], [2], [3]]
    assert zero._Buckets(like, None, 2, None).groups == [[0, 2, 3], [1]]


# "odd" pads to another shard size than the other leaves (4096 at dp = 4, not 2048), so a
# bucket's offsets differ from a multiple of one shard.
BUCKET_SHAPES = SHAPES | {"odd": (9000,)}


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape,axes", [((4,), "dp"), ((2, 2), ("outer", "inner"))], ids=["dp4", "outer2-inner2"]
)
def test_a_bucket_of_every_leaf_steps_as_one_collective_per_leaf(shape, axes):
    """Uncompressed, three steps with clipping, bf16 replicas: one bucket for every leaf against
    one bucket per leaf, over one dp axis and two (outer-major rows). Two programs, so bit for
    bit only what is exact (module docstring): every rank's replica of a run is the same. Both
    runs report the norm of the exact mean gradient (the sqrt of an exact sum, within 2 ulps),
    their master shards agree within the step bound, and each replica is its master in bf16:
    a leaf or element misplaced in the gradient rows moves the master, in the gathered rows
    the replica."""
    params, ranks = _params(BUCKET_SHAPES), int(np.prod(shape))
    exact_norms = _exact_norms(ranks, BUCKET_SHAPES)
    masters = []
    for limit in (None, 1):
        cfg = zero.ZeroConfig(dp_axes=axes, grad_clip=40.0, bucket_elements=limit)
        master, replica, _, norms = _sharded(
            params, cfg, "shard_map", shape, jnp.bfloat16, _dyadic_grads
        )
        for got, want in zip(norms, exact_norms, strict=True):  # an exact sum's sqrt
            np.testing.assert_allclose(got, want, rtol=4 * 2.0**-24)
        full = zero.unshard_leaves(master, params)
        for name in BUCKET_SHAPES:
            for rank in range(1, ranks):  # the all-gather moves values
                np.testing.assert_array_equal(replica[name][rank], replica[name][0])
            want = np.asarray(full[name], np.float64)
            err = np.abs(np.asarray(replica[name][0], np.float64) - want)
            assert np.all(err <= 2.0**-7 * np.abs(want) + 2 * _step_bound(want, 49 * LR)), name
        masters.append(master)
    # Every shard, padding included: a misplaced element is ~lr away, the bound ~1e-6.
    _assert_within_step_rounding(*masters, clip_term=49 * LR)


def _exact_norms(ranks, shapes):
    """The global norm of the mean of `_dyadic_grads` at each step, from its exact sum of
    squares; refuses data whose squares' partial sums fp32 could not hold exactly (the mean is
    a multiple of 1/(2 ranks), so its squares and their sums are multiples of q: exact below
    2^24 q)."""
    q = (1 / (2 * ranks)) ** 2
    norms = []
    for step in range(STEPS):
        grads = _dyadic_grads(ranks, step, shapes)
        total = sum(np.sum(np.mean(np.asarray(g, np.float64), axis=0) ** 2) for g in grads.values())
        assert total / q < 2**24, (step, total)
        norms.append(np.sqrt(total))
    return norms


@pytest.mark.slow
def test_buckets_round_as_one_collective_per_leaf_rounds():
    """SDP4Bit at dp = 4: the noise differs between one bucket and one per leaf (a key per
    bucket), so the guarantees are compared: replicas identical over the ranks, and the same
    distance of the master and of the replica from the uncompressed master (no codec group or
    Hadamard block straddles two leaves, so each element's rounding has the distribution it
    has alone; a misplaced leaf in the gradient or the replica rows would move it)."""
    params, clip, ranks = _params(BUCKET_SHAPES), 40.0, 4
    plain = _sharded(params, zero.ZeroConfig(grad_clip=clip), "shard_map", (ranks,), jnp.bfloat16)[
        0
    ]
    plain = zero.unshard_leaves(plain, params)
    distances = {}
    for limit in (None, 1):
        cfg = zero.ZeroConfig(
            grad_codec="tlq_hs", param_codec="qwd", grad_clip=clip, bucket_elements=limit
        )
        master, replica, _, _ = _sharded(params, cfg, "shard_map", (ranks,), jnp.bfloat16)
        for name in BUCKET_SHAPES:
            for rank in range(1, ranks):
                np.testing.assert_array_equal(replica[name][rank], replica[name][0])
        master = zero.unshard_leaves(master, params)
        distances[limit] = [
            _distance({n: master[n] for n in BUCKET_SHAPES}, plain),
            _distance({n: replica[n][0] for n in BUCKET_SHAPES}, plain),
        ]
    # Each distance is the norm of ~N independent errors of one distribution (N = 14222
    # values): its relative spread is about sqrt(2 / N) / 2 = 0.6% (for roughly Gaussian
    # errors, Var(e^2) = 2 E(e^2)^2), so the ratio of two is 1 within ~0.8%; 10% is 12 of those.
    # The replica's distance adds bf16 rounding of the same size both ways.
    for one, per_leaf in zip(distances[None], distances[1], strict=True):
        assert 0.9 < one / per_leaf < 1.1, distances


def _distance(tree, reference):
    return np.sqrt(
        sum(np.sum((np.asarray(tree[n], np.float64) - np.asarray(reference[n])) ** 2) for n in tree)
    )


def test_errors_name_the_offending_value():
    with pytest.raises(ValueError, match="grad_codec='fp8'"):
        zero.ZeroConfig(grad_codec="fp8")
    with pytest.raises(ValueError, match="param_codec='int4'"):
        zero.ZeroConfig(param_codec="int4")
    with pytest.raises(ValueError, match="bucket_elements=0 must be >= 1"):
        zero.ZeroConfig(bucket_elements=0)
    assert zero.shard_size(5000, 4) == 2048 and zero.shard_size(8192, 4) == 2048


def test_a_gradient_tree_unlike_the_replica_is_refused():
    params, ranks, opt = _params(), 2, _adamw()
    state = jax.vmap(lambda m: zero.init(opt, m))(zero.shard_leaves(params, ranks))
    replica = jax.tree.map(lambda p: jnp.broadcast_to(p, (ranks, *p.shape)), params)
    grads = {n: r for n, r in replica.items() if n != "b"}

    def step_with_split(grads, state, replica, split=None):
        return zero.update(
            opt, zero.ZeroConfig(), grads, state, replica, jax.random.key(0), split=split
        )

    with pytest.raises(ValueError, match="grads has the tree"):
        jax.vmap(step_with_split, axis_name="dp")(grads, state, replica)
    one_split = functools.partial(step_with_split, split={"w": ()})
    with pytest.raises(ValueError, match="split names 1 leaves' axes, the replica has 4"):
        jax.vmap(one_split, axis_name="dp")(replica, state, replica)


def test_model_slices_round_trip_through_the_shards():
    """With model parallelism each leaf is cut, per mesh axis, into contiguous blocks along the
    axis it is split over (rank r holds block r, as `NamedSharding` places it) or copied whole
    (REPLICATED); sharding the slices over dp and merging them back returns the leaves
    exactly. Two mesh axes of 2 (as pp and tp): "emb" split over both, "long" over the first."""
    params = _params()
    R = zero.REPLICATED
    dims = {"w": (R, R), "b": (R, R), "emb": (0, 1), "long": (0, R)}
    sizes, ranks = (2, 2), 4
    emb = zero.model_slices(params["emb"], (0, 1), sizes)
    for p in range(2):
        for t in range(2):
            want = params["emb"][150 * p : 150 * (p + 1), 4 * t : 4 * (t + 1)]
            np.testing.assert_array_equal(emb[p, t], want)
    np.testing.assert_array_equal(zero.model_slices(params["b"], (R, R), sizes)[1, 0], params["b"])
    shards = zero.shard_leaves(params, ranks, dims, sizes)
    assert shards["emb"].shape == (ranks, *sizes, zero.shard_size(150 * 4, ranks))
    assert shards["w"].shape == (ranks, *sizes, zero.shard_size(37 * 19, ranks))
    back = zero.unshard_leaves(shards, params, dims)
    for name in SHAPES:
        np.testing.assert_array_equal(back[name], params[name])


def test_slices_of_a_leaf_round_independently_and_its_copies_alike():
    """dp = 2 x a model axis "tp" = 2, SDP4Bit on both collectives, every tp rank handed the same
    gradients and replica. "emb" is split over tp (`split`: its slices differ), "w" is copied on
    both tp ranks: the copies of "w" must come out identical (they are one parameter), the two
    "emb" slices must not (each slice draws its own rounding noise; with one noise stream for
    both, equal inputs would round equally)."""
    params = {"w": _params()["w"], "emb": _params()["emb"]}
    cfg = zero.ZeroConfig(("dp",), "tlq_hs", "qwd", grad_clip=None)
    opt, ranks = optax.adamw(1e-3), 2
    split = {"w": (), "emb": ("tp",)}
    # jitted: run op by op under vmap, each operation would compile on its own (~20 s)
    state = jax.jit(jax.vmap(lambda m: zero.init(opt, m)))(zero.shard_leaves(params, ranks))
    grads = {
        n: 1e-2 * jax.random.normal(jax.random.key(i), (ranks, *p.shape))
        for i, (n, p) in enumerate(params.items())
    }
    replica = jax.tree.map(lambda p: jnp.broadcast_to(p, (ranks, *p.shape)), params)

    def step(grads, state, replica):
        return zero.update(opt, cfg, grads, state, replica, jax.random.key(5), split=split)[1]

    per_dp = jax.vmap(step, axis_name="dp")
    both_tp = jax.vmap(per_dp, in_axes=None, axis_name="tp", axis_size=2)  # same inputs
    new = jax.jit(both_tp)(grads, state, replica)  # [tp, dp, ...]
    np.testing.assert_array_equal(np.asarray(new["w"][0]), np.asarray(new["w"][1]))
    assert not np.array_equal(np.asarray(new["emb"][0]), np.asarray(new["emb"][1]))
