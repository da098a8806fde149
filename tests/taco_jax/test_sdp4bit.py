"""SDP4Bit's compressors (`taco_jax.sdp4bit`) on 8 fake CPU devices and under vmap: TLq-HS
against the exact reduce-scatter (one and two levels), qWD's bit-identical replicas.

Bounds (derivations):
- one quantization of a group of G values with stochastic rounding errs by less than one step
  s = absmax / qmax per value (`tahquant`), s from the group it quantizes;
- TLq-HS quantizes in the smoothed domain (H_32 per block, orthonormal), where the sum's
  per-value error is below the sum of the steps of the groups that carried it: one level,
  sum over sources j of s_j; two levels, the inner sources' 8-bit steps plus the outer
  sources' 4-bit steps, where an outer step is at most (absmax of the exact partial sum + the
  inner error) / 7. The inverse H_32 keeps the L2 norm of each block of 32, so a block's error
  norm is below sqrt(32) x the largest per-value bound in it; x 1.01 for fp32 arithmetic.
- qWD: each replica value moves by the decoded difference, within one step s = absmax / 7 of
  its group of 2048 of the exact difference, then rounds to bf16 (half an ulp of the result).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tp_testing import run_on_mesh

from taco_jax import codecs, sdp4bit

KEY = jax.random.key(3)
MODES = ("shard_map", "vmap")
MODES_SHARD_MAP_SLOW = [pytest.param("shard_map", marks=pytest.mark.slow), "vmap"]


def _gradients(ranks, n, seed=0):
    """Per-rank gradients: N(0, 1) with an outlier in every 512th value and rank-dependent
    scales (from 1e-3 to 1e3), so groups of very different magnitude meet in the sums."""
    x = np.asarray(jax.random.normal(jax.random.key(seed), (ranks, n)), np.float64)
    x[:, 7::512] *= 50
    return (x * np.logspace(-3, 3, ranks)[:, None]).astype(np.float32)


def _smoothed64(x):
    """H_32 per block of 32 in float64, [..., n]."""
    h = codecs.hadamard_matrix(32).astype(np.float64)
    return (x.reshape(*x.shape[:-1], -1, 32) @ h).reshape(x.shape)


def _steps(y, group, qmax):
    """Per-value step absmax / qmax of each group of `group` values of y [..., n]."""
    groups = np.abs(y).reshape(*y.shape[:-1], -1, group)
    return np.repeat(groups.max(axis=-1) / qmax, group, axis=-1)


def _group_max(v, group=128):
    """Each value replaced by the largest value of its group of `group`, [..., n]."""
    return np.repeat(v.reshape(*v.shape[:-1], -1, group).max(axis=-1), group, axis=-1)


def _assert_block_bound(out, exact, per_value_bound):
    err = np.linalg.norm((out - exact).reshape(-1, 32), axis=-1)
    bound = np.sqrt(32) * per_value_bound.reshape(-1, 32).max(axis=-1)
    assert np.all(err <= 1.01 * bound), f"worst block at {np.argmax(err / bound)}"


@pytest.mark.parametrize("mode", MODES_SHARD_MAP_SLOW)
def test_one_level_is_the_reduce_scatter_within_its_bound(mode):
    ranks, n = 8, 8 * 1024
    x = _gradients(ranks, n)
    out = run_on_mesh(
        lambda v: sdp4bit.tlq_hs_psum_scatter(v, "dp", key=KEY),
        jnp.asarray(x),
        (ranks,),
        ("dp",),
        mode,
    )
    exact = x.astype(np.float64).sum(axis=0)
    y = _smoothed64(x.astype(np.float64))  # what each source quantizes, [ranks, n]
    bound = _steps(y, 128, sdp4bit.TLQ_OUTER.qmax).sum(axis=0)
    _assert_block_bound(np.asarray(out, np.float64).reshape(-1), exact, bound)


@pytest.mark.parametrize("mode", MODES_SHARD_MAP_SLOW)
def test_two_levels_are_the_reduce_scatter_within_their_bound(mode):
    outer, inner, n = 2, 4, 8 * 1024
    x = _gradients(outer * inner, n, seed=1)
    fn = lambda v: sdp4bit.tlq_hs_psum_scatter(v, ("outer", "inner"), key=KEY)  # noqa: E731
    stacked = jnp.asarray(x.reshape(outer, inner, n))
    out = run_on_mesh(fn, stacked, (outer, inner), ("outer", "inner"), mode)
    exact = x.astype(np.float64).sum(axis=0)
    y = _smoothed64(x.astype(np.float64)).reshape(outer, inner, n)
    inner_steps = _steps(y, 128, sdp4bit.TLQ_INNER.qmax)  # [outer, inner, n]
    inner_error = inner_steps.sum(axis=1)  # per outer index: its partial sum's error, [outer, n]
    partial = y.sum(axis=1)  # exact partial sums, [outer, n]
    outer_step = _group_max(np.abs(partial)) / 7 + _group_max(inner_error) / 7
    bound = inner_error.sum(axis=0) + outer_step.sum(axis=0)
    # Shards in psum_scatter order over (outer, inner): rank (o, i) holds shard o * inner + i.
    _assert_block_bound(np.asarray(out, np.float64).reshape(-1), exact, bound)


def test_two_levels_over_one_group_take_the_8_bit_level_alone():
    """(outer, inner) = (1, 8): one group, so the 4-bit outer level would only add its error;
    the result keeps the 8-bit level's bound alone (a 4-bit pass has 18x its steps)."""
    inner, n = 8, 8 * 1024
    x = _gradients(inner, n, seed=2)
    fn = lambda v: sdp4bit.tlq_hs_psum_scatter(v, ("outer", "inner"), key=KEY)  # noqa: E731
    out = run_on_mesh(
        fn, jnp.asarray(x.reshape(1, inner, n)), (1, inner), ("outer", "inner"), "vmap"
    )
    exact = x.astype(np.float64).sum(axis=0)
    bound = _steps(_smoothed64(x.astype(np.float64)), 128, sdp4bit.TLQ_INNER.qmax).sum(axis=0)
    _assert_block_bound(np.asarray(out, np.float64).reshape(-1), exact, bound)


def test_ranks_round_independently():
    """Every rank sends the same gradient. Stochastic rounding errs by e_j per value with
    E e_j = 0; with independent noise the sum's error has variance N var(e), with the same
    noise on every rank N^2 var(e). One rank's error (N = 1) measures var(e): require the
    RMS error of the sum of N = 8 below 0.6 N RMS(e) (independent: 1 / sqrt(8) ~ 0.35 of it;
    over 8192 values the RMS estimates are good to ~2%)."""
    n = 8 * 1024
    x = np.asarray(jax.random.normal(jax.random.key(9), (n,)), np.float32)
    fn = lambda v: sdp4bit.tlq_hs_psum_scatter(v, "dp", key=KEY)  # noqa: E731
    one = run_on_mesh(fn, jnp.asarray(x)[None], (1,), ("dp",), "vmap")
    single = np.sqrt(np.mean((np.asarray(one, np.float64).reshape(-1) - x) ** 2))
    many = run_on_mesh(fn, jnp.broadcast_to(jnp.asarray(x), (8, n)), (8,), ("dp",), "shard_map")
    total = np.sqrt(np.mean((np.asarray(many, np.float64).reshape(-1) - 8.0 * x) ** 2))
    assert 0 < total < 0.6 * 8 * single


def test_exact_order_of_shards_matches_lax_psum_scatter():
    """The shard each rank gets is the one `lax.psum_scatter` gives it, on inputs whose shards
    differ by 1000x. Every block is constant, so H_32 makes it [sqrt(32) c, 0, ..., 0], which
    both grids carry exactly (codes +-qmax and 0, stochastic rounding of an integer is exact):
    only fp32 roundings remain, fewer than 32 along any value's path (H_32 twice, the scales,
    the decodes, the sums): rtol 32 x 2^-24."""
    outer, inner, n = 2, 4, 8 * 256
    shard_scale = 1000.0 ** np.array([0, 1, 2, 0, 1, 2, 0, 1])  # neighbours differ by 1000x
    x = np.ones((outer * inner, n), np.float32) * np.repeat(shard_scale, n // 8)[None]
    fn = lambda v: sdp4bit.tlq_hs_psum_scatter(v, ("outer", "inner"), key=KEY)  # noqa: E731
    ref = lambda v: jax.lax.psum_scatter(v, ("outer", "inner"), tiled=True)  # noqa: E731
    stacked = jnp.asarray(x.reshape(outer, inner, n))
    got = run_on_mesh(fn, stacked, (outer, inner), ("outer", "inner"), "shard_map")
    want = run_on_mesh(ref, stacked, (outer, inner), ("outer", "inner"), "shard_map")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=32 * 2.0**-24)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "shape,names", [((8,), ("dp",)), ((2, 4), ("outer", "inner"))], ids=["dp8", "outer2-inner4"]
)
def test_qwd_replicas_stay_bit_identical_and_near_the_new_weights(mode, shape, names):
    ranks, m = 8, 2048
    replica = np.asarray(jax.random.normal(jax.random.key(5), (ranks * m,)), np.float32)
    replica = jnp.asarray(replica, jnp.bfloat16)
    step = 1e-2 * np.asarray(jax.random.normal(jax.random.key(6), (ranks, m)), np.float32)
    new = np.asarray(replica, np.float32).reshape(ranks, m) + step
    inputs = (jnp.asarray(new.reshape(*shape, m)), jnp.broadcast_to(replica, (*shape, ranks * m)))
    fn = lambda a: sdp4bit.qwd_all_gather(a[0], a[1], names, key=KEY)  # noqa: E731
    out = np.asarray(run_on_mesh(fn, inputs, shape, names, mode), np.float32)
    out = out.reshape(ranks, ranks * m)
    for rank in range(1, ranks):
        np.testing.assert_array_equal(out[rank], out[0])
    target = new.reshape(-1).astype(np.float64)
    steps = _steps(step.astype(np.float64).reshape(1, -1), 2048, 7)[0]
    half_ulp = (np.abs(target) + steps) * 2.0**-8  # bf16 rounding of the sum
    assert np.all(np.abs(out[0] - target) <= steps + half_ulp)
    assert not np.array_equal(out[0], np.asarray(replica, np.float32))  # the replica moved


@pytest.mark.slow
def test_qwd_runs_the_stage_kernels():
    """impl="pallas_interpret" runs qWD's groups of 2048 through the fused stage kernels (one
    group per encode tile): the replicas stay bit-identical across ranks and equal the
    reference path's within one bf16 ulp (the encodes are byte-equal in interpret mode, test
    of `pallas_kernels.tahquant_kernel`; the decode may round its fp32 sum differently, which
    can move the final bf16 rounding by one ulp)."""
    ranks, m = 4, 2 * 2048
    replica = jnp.asarray(jax.random.normal(jax.random.key(7), (ranks * m,)), jnp.bfloat16)
    new = np.asarray(replica, np.float32).reshape(ranks, m) + 1e-2 * np.asarray(
        jax.random.normal(jax.random.key(8), (ranks, m)), np.float32
    )
    inputs = (jnp.asarray(new), jnp.broadcast_to(replica, (ranks, ranks * m)))

    def run(impl):
        fn = jax.vmap(
            lambda a: sdp4bit.qwd_all_gather(a[0], a[1], "dp", key=KEY, impl=impl), axis_name="dp"
        )
        return fn, np.asarray(fn(inputs), np.float32)

    fused, got = run("pallas_interpret")
    _, want = run("xla")
    assert "pallas_call" in str(jax.make_jaxpr(fused)(inputs)), "the stage kernels did not run"
    for rank in range(1, ranks):
        np.testing.assert_array_equal(got[rank], got[0])
    # One bf16 ulp of each value: 2^(e - 7) for |value| in [2^e, 2^(e + 1)).
    ulp = 2.0 ** (np.floor(np.log2(np.abs(want[0]))) - 7)
    assert np.all(np.abs(got[0] - want[0]) <= ulp)


def test_errors_name_the_offending_value():
    mesh_fn = lambda f, x: jax.vmap(f, axis_name="dp")(x)  # noqa: E731
    with pytest.raises(ValueError, match="multiple of 512"):
        mesh_fn(lambda v: sdp4bit.tlq_hs_psum_scatter(v, "dp", key=KEY), jnp.zeros((4, 1000)))
    with pytest.raises(ValueError, match="flat fp32"):
        mesh_fn(
            lambda v: sdp4bit.tlq_hs_psum_scatter(v, "dp", key=KEY),
            jnp.zeros((4, 512), jnp.bfloat16),
        )
    with pytest.raises(ValueError, match="replica shape"):
        mesh_fn(
            lambda v: sdp4bit.qwd_all_gather(v, jnp.zeros(10), "dp", key=KEY), jnp.zeros((4, 2048))
        )
    assert sdp4bit.padded_size(5000, 4) == 8192 and sdp4bit.padded_size(8192, 4) == 8192
