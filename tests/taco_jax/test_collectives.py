"""Compressed collectives on 8 fake CPU devices (shard_map) and under vmap emulation.

Error bounds (E4M3 stores a normal value with relative error <= u = 2^-4; groups scaled to
absmax 448 make subnormal codes contribute < 1e-4 of that bound for the Gaussian data used here,
covered by the factor 1.01; L2 norms of group-wise bounds add in quadrature, so the per-group
bound holds for the whole tensor):
- all-gather, one quantization of each rank's block:          ||err|| <= u ||x||
- reduce-scatter, one quantization per rank, then fp32 sum:     ||err|| <= u sum_r ||x_r||
- all-reduce (two-shot), the sum above is quantized again:
    ||err|| <= u (1 + u) sum_r ||x_r|| + u ||sum_r x_r||
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from codec_testing import group_error_bound, groups64
from jax import lax
from tiers import tiered
from tp_testing import MODES, run_tp

import pallas_kernels
import taco_jax as tj
from pallas_kernels.exchange_mosaic import ROW_MULTIPLE as FUSED_ROW
from taco_jax import algorithms, codecs, tahquant
from taco_jax.target import Target

U = 2.0**-4
TP_SIZES = (2, 4, 8)  # each test's fast-tier sizes differ: together they cover all three
MAX_TIES = 2  # rounding ties allowed to land differently in the replay test


def _ranks(tp, shape, seed=0):
    return jax.random.normal(jax.random.key(seed), (tp, *shape), jnp.float32)


def _rank_norms(x):
    return float(jnp.sum(jnp.linalg.norm(x.reshape(x.shape[0], -1), axis=1)))


def _assert_rank_identical(out):
    np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(np.asarray(out[0]), out.shape))


# ------------------------------------------------------------------------------ codec "none"


@pytest.mark.parametrize("tp", tiered(TP_SIZES, (2,)))
@pytest.mark.parametrize("mode", MODES)
def test_none_equals_lax_exactly(tp, mode):
    x = _ranks(tp, (4, 48), seed=tp)

    def both(v):
        return (
            tj.compressed_psum(v, "tp", codec="none"),
            lax.psum(v, "tp"),
            tj.compressed_psum_scatter(v, "tp", scatter_dimension=1, codec="none"),
            lax.psum_scatter(v, "tp", scatter_dimension=1, tiled=True),
            tj.compressed_all_gather(v, "tp", axis=1, tiled=True, codec="none"),
            lax.all_gather(v, "tp", axis=1, tiled=True),
        )

    out = run_tp(both, x, tp=tp, mode=mode)
    for ours, theirs in zip(out[::2], out[1::2], strict=True):
        np.testing.assert_array_equal(ours, theirs)


# ------------------------------------------------------------------------------ codec "taco"


@pytest.mark.parametrize("tp", tiered(TP_SIZES, (8,)))
@pytest.mark.parametrize("mode", MODES)
def test_psum_within_two_quantization_bound(tp, mode):
    x = _ranks(tp, (3, 1000), seed=10 + tp)  # 3000 elements: not a multiple of tp x G
    out = run_tp(lambda v: tj.compressed_psum(v, "tp"), x, tp=tp, mode=mode)
    exact = jnp.sum(x, axis=0)
    err = float(jnp.linalg.norm(out[0] - exact))
    bound = U * (1 + U) * _rank_norms(x) + U * float(jnp.linalg.norm(exact))
    assert err <= 1.01 * bound
    assert err >= 1e-3 * float(jnp.linalg.norm(exact))  # FP8 rounding really happened
    _assert_rank_identical(out)


@pytest.mark.parametrize("tp", tiered(TP_SIZES, (4,)))
@pytest.mark.parametrize("mode", MODES)
def test_one_shot_psum_within_one_quantization_bound(tp, mode):
    """One-shot quantizes each rank's input once and sums in fp32: ||err|| <= u sum_r ||x_r||."""
    x = _ranks(tp, (3, 1000), seed=15 + tp)  # not a multiple of G
    fn = lambda v: tj.compressed_psum(v, "tp", algorithm="one_shot")
    out = run_tp(fn, x, tp=tp, mode=mode)
    exact = jnp.sum(x, axis=0)
    err = float(jnp.linalg.norm(out[0] - exact))
    assert err <= 1.01 * U * _rank_norms(x)
    assert err >= 1e-3 * float(jnp.linalg.norm(exact))  # FP8 rounding really happened
    _assert_rank_identical(out)


@pytest.mark.parametrize("algorithm", ["two_shot", "one_shot"])
def test_psum_keeps_its_bound_at_every_magnitude(algorithm):
    """Inputs N(0, 1) x 10^d for d = -30 .. 30 (each a separate call, as a user's tensors come):
    the relative error stays within the bounds above at every scale. Norms in float64, where
    the squares of 1e-30 and 1e30 do not leave the range."""
    x = _ranks(4, (2, 1024), seed=40)
    fn = jax.jit(
        jax.vmap(lambda v: tj.compressed_psum(v, "tp", algorithm=algorithm), axis_name="tp")
    )
    for decade in range(-30, 31, 5):
        scaled = x * np.float32(10.0**decade)
        x64 = np.asarray(scaled, np.float64)
        exact = x64.sum(axis=0)
        rank_norms = float(np.sum(np.linalg.norm(x64.reshape(4, -1), axis=1)))
        bound = U * rank_norms
        if algorithm == "two_shot":
            bound = U * (1 + U) * rank_norms + U * float(np.linalg.norm(exact))
        err = float(np.linalg.norm(np.asarray(fn(scaled)[0], np.float64) - exact))
        assert 1e-3 * np.linalg.norm(exact) <= err <= 1.01 * bound, decade


def test_auto_is_two_shot_where_no_bytes_move():
    """On the CPU (no real link) "auto" compresses every message with two-shot
    (`taco_jax.policy`; its measured choices on GPUs are tested in test_policy.py)."""
    x = _ranks(2, (2048,), seed=16)
    auto = run_tp(lambda v: tj.compressed_psum(v, "tp"), x, tp=2, mode="shard_map")
    two = run_tp(
        lambda v: tj.compressed_psum(v, "tp", algorithm="two_shot"), x, tp=2, mode="shard_map"
    )
    np.testing.assert_array_equal(auto, two)
    assert not np.array_equal(
        auto, run_tp(lambda v: jax.lax.psum(v, "tp"), x, tp=2, mode="shard_map")
    )


@pytest.mark.parametrize("tp", tiered(TP_SIZES, (8,)))
def test_vmap_emulation_matches_shard_map(tp):
    """Emulation runs the same math; batching may reorder fp32 sums (the Hadamard, the energy).

    Measured: differences up to 4e-5 relative, no element further apart than that. A code that
    flipped by one E4M3 step (>= 2^-4 of its value) moves its whole group by ~2^-4 |code| s /
    sqrt(G) ~ 5e-3 of the group's scale through the inverse Hadamard, above the 1e-3 used.
    """
    x = _ranks(tp, (2, 640), seed=20 + tp)
    fn = lambda v: tj.compressed_psum(v, "tp")
    emulated, real = run_tp(fn, x, tp=tp, mode="vmap"), run_tp(fn, x, tp=tp, mode="shard_map")
    np.testing.assert_allclose(emulated, real, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("tp", tiered(TP_SIZES, (2,)))
@pytest.mark.parametrize("mode", MODES)
def test_psum_scatter_within_one_quantization_bound(tp, mode):
    x = _ranks(tp, (5, 8 * 24), seed=30 + tp)
    out = run_tp(
        lambda v: tj.compressed_psum_scatter(v, "tp", scatter_dimension=1), x, tp=tp, mode=mode
    )
    exact = run_tp(
        lambda v: lax.psum_scatter(v, "tp", scatter_dimension=1, tiled=True), x, tp=tp, mode=mode
    )
    assert out.shape == exact.shape == (tp, 5, 8 * 24 // tp)
    for r in range(tp):
        block = x[:, :, r * out.shape[-1] : (r + 1) * out.shape[-1]]
        assert float(jnp.linalg.norm(out[r] - exact[r])) <= 1.01 * U * _rank_norms(block)


@pytest.mark.parametrize("tp", tiered(TP_SIZES, (4,)))
@pytest.mark.parametrize("mode", MODES)
def test_all_gather_within_one_quantization_bound(tp, mode):
    x = _ranks(tp, (7, 33), seed=40 + tp)
    out = run_tp(
        lambda v: tj.compressed_all_gather(v, "tp", axis=0, tiled=False), x, tp=tp, mode=mode
    )
    assert out.shape == (tp, tp, 7, 33)
    _assert_rank_identical(out)
    for r in range(tp):
        err = float(jnp.linalg.norm(out[0, r] - x[r]))
        assert err <= 1.01 * U * float(jnp.linalg.norm(x[r]))


@pytest.mark.parametrize("slices", tiered([2, 4], (4,)))
def test_slices_keep_the_bound(slices):
    tp = 4
    x = _ranks(tp, (4096,), seed=50)
    out = run_tp(lambda v: tj.compressed_psum(v, "tp", slices=slices), x, tp=tp, mode="shard_map")
    exact = jnp.sum(x, axis=0)
    bound = U * (1 + U) * _rank_norms(x) + U * float(jnp.linalg.norm(exact))
    assert float(jnp.linalg.norm(out[0] - exact)) <= 1.01 * bound
    _assert_rank_identical(out)


def _integer_grid_psum_bound(codec, x) -> float:
    """||two-shot psum - exact|| for an integer-grid codec, from the data (float64).

    Phase 1 quantizes each rank's partial sum x_r: ||e1|| <= sum_r ||b(x_r)||, b the per-group
    bound sqrt(G) s / 2, s = max|H x_g| / qmax (`group_error_bound`). Phase 2 quantizes the
    decoded sum z = exact + e1: per group max|H z_g| <= max|H exact_g| + ||e1_g||, so (triangle
    inequality over the groups in l2) ||e2|| <= sqrt(G) / (2 qmax) (||max|H exact_g|||_2 +
    ||e1||)."""
    e1 = sum(float(np.linalg.norm(group_error_bound(codec, rank))) for rank in x)
    groups = groups64(jnp.sum(x, axis=0), codec.group_size)
    if codec.hadamard:
        groups = groups @ codecs.hadamard_matrix(codec.group_size).astype(np.float64)
    amax = np.abs(groups).max(axis=-1)
    return e1 + np.sqrt(codec.group_size) / (2 * codec.qmax) * (np.linalg.norm(amax) + e1)


# The fast tier: FP8, INT8 and bit-plane codes (the codecs' own tests take every path), the
# others slow.
@pytest.mark.parametrize(
    "name",
    tiered(
        [n for n in tj.CODEC_NAMES if n not in ("none", "taco_no_ds")],
        ["taco", "int8", "int6_hadamard"],  # of test_codecs.py's FAST_CODECS: FP8, INT8, bit planes
    ),
)
def test_every_codec_through_psum(name):
    tp = 4
    x = _ranks(tp, (1024,), seed=60)
    out = run_tp(lambda v: tj.compressed_psum(v, "tp", codec=name), x, tp=tp, mode="vmap")
    exact = jnp.sum(x, axis=0)
    codec = tj.get_codec(name)
    if codec.is_integer:
        bound = _integer_grid_psum_bound(codec, x)
    else:  # per-quantization relative bound: E4M3 2^-4, E5M2 2^-3 (module docstring)
        u = {"e5m2": 2.0**-3}.get(codec.element, U)
        bound = u * (1 + u) * _rank_norms(x) + u * float(jnp.linalg.norm(exact))
    assert float(jnp.linalg.norm(out[0] - exact)) <= 1.01 * bound


def test_min_compress_bytes_falls_back_to_lax():
    x = _ranks(4, (256,), seed=70)
    small = lambda v: tj.compressed_psum(v, "tp", min_compress_bytes=256 * 4 + 1)
    np.testing.assert_array_equal(
        run_tp(small, x, tp=4, mode="shard_map"),
        run_tp(lambda v: lax.psum(v, "tp"), x, tp=4, mode="shard_map"),
    )


def test_single_rank_is_identity():
    x = _ranks(1, (3, 5), seed=80)
    np.testing.assert_array_equal(
        run_tp(lambda v: tj.compressed_psum(v, "tp"), x, tp=1, mode="shard_map"), x
    )


def test_nonfinite_input_stays_visible():
    tp = 4
    x = _ranks(tp, (1024,), seed=90).at[2, 300].set(jnp.nan).at[1, 900].set(jnp.inf)
    out = run_tp(lambda v: tj.compressed_psum(v, "tp"), x, tp=tp, mode="shard_map")
    groups = jnp.isnan(out[0]).reshape(-1, 128)
    assert bool(groups[300 // 128].all()) and bool(groups[900 // 128].all())
    assert int(jnp.sum(groups)) == 2 * 128  # every other group is finite


# ------------------------------------------------------------------------------ wire format


def test_collectives_move_uint8():
    tp = 8
    x = _ranks(tp, (4096,), seed=100)
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    fn = jax.shard_map(
        lambda v: tj.compressed_psum(v[0], "tp")[None],
        mesh=mesh,
        in_specs=jax.P("tp"),
        out_specs=jax.P("tp"),
        check_vma=False,
    )
    hlo = jax.jit(fn).lower(x).compile().as_text()
    found = re.findall(r"= (.*?) (all-to-all|all-gather)\(", hlo)
    assert {op for _, op in found} == {"all-to-all", "all-gather"}, found
    for result_type, op in found:
        element_types = set(re.findall(r"(\w+)\[", result_type))
        assert element_types == {"u8"}, (op, result_type)
        # Per rank and phase: 4096 / 8 = 512 elements -> 512 + 8 * 512 / 128 = 544 bytes per peer.
        sizes = [
            math.prod(map(int, dims.split(",")))
            for dims in re.findall(r"u8\[([\d,]+)\]", result_type)
        ]
        assert sum(sizes) == tp * 544, (op, result_type)


def test_one_shot_moves_one_uint8_all_gather():
    tp = 2
    x = _ranks(tp, (4096,), seed=101)
    mesh = jax.make_mesh(
        (tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:tp]
    )
    fn = jax.shard_map(
        lambda v: tj.compressed_psum(v[0], "tp", algorithm="one_shot")[None],
        mesh=mesh,
        in_specs=jax.P("tp"),
        out_specs=jax.P("tp"),
        check_vma=False,
    )
    hlo = jax.jit(fn).lower(x).compile().as_text()
    found = re.findall(r"= (.*?) (all-to-all|all-gather|collective-permute|all-reduce)\(", hlo)
    assert [op for _, op in found] == ["all-gather"], found
    # Both ranks' whole wire: 2 x (4096 + 8 * 4096 / 128) bytes.
    assert re.findall(r"u8\[([\d,]+)\]", found[0][0]) == ["2,4352"], found


def test_wire_bytes_per_rank_formula():
    cfg = tj.comm_config("taco")
    # docs/method.md "Collectives": two-shot 2 (N-1)/N (1 + 8/G) bytes per element, one-shot
    # (N-1) (1 + 8/G).
    n = 8 * 128 * 1000
    assert tj.wire_bytes_per_rank(n, 8, cfg) == 2 * 7 * (n // 8) * (1 + 8 / 128)
    one_shot = tj.comm_config("taco", algorithm="one_shot")
    assert tj.wire_bytes_per_rank(n, 2, one_shot) == 1 * n * (1 + 8 / 128)
    assert tj.wire_bytes_per_rank(n, 2, cfg) == 2 * 1 * (n // 2) * (1 + 8 / 128)


# ------------------------------------------------------------------------------ gradients


def _dyadic(key, shape):
    """Values in {-1, -1/2, 0, 1/2, 1}: every fp32 product and sum below is exact."""
    return (jax.random.randint(key, shape, -2, 3) / 2).astype(jnp.float32)


def _mlp_problem(tp, batch=4, d=16, f=32):
    keys = jax.random.split(jax.random.key(tp), 4)
    x, w1, w2, ct = (
        _dyadic(k, s) for k, s in zip(keys, [(batch, d), (d, f), (f, d), (batch, d)], strict=True)
    )
    return x, w1, w2, ct


def _mlp_loss(params, x, ct, comm):
    """Megatron MLP on one rank: f, column-parallel W1, ReLU, row-parallel W2, g."""
    w1, w2 = params
    h = tj.copy_to_tp(x, comm) @ w1
    y = tj.reduce_from_tp(jax.nn.relu(h) @ w2, comm)
    return jnp.sum(y * ct)


def _sharded_mlp_grads(tp, mode, codec):
    x, w1, w2, ct = _mlp_problem(tp)
    comm = tj.TPComm.create(fwd=codec)
    w1_ranks = jnp.stack(jnp.split(w1, tp, axis=1))  # columns
    w2_ranks = jnp.stack(jnp.split(w2, tp, axis=0))  # rows
    per_rank = lambda p, x_: jax.value_and_grad(_mlp_loss, argnums=(0, 1))(p, x_, ct, comm)
    stacked_x = jnp.broadcast_to(x, (tp, *x.shape))
    loss, (grads, dx) = run_tp(
        lambda a: per_rank(a[0], a[1]), ((w1_ranks, w2_ranks), stacked_x), tp=tp, mode=mode
    )
    dw1 = jnp.concatenate(list(grads[0]), axis=1)
    dw2 = jnp.concatenate(list(grads[1]), axis=0)
    ref_loss, (ref_grads, ref_dx) = jax.value_and_grad(
        lambda p, x_: jnp.sum((jax.nn.relu(x_ @ p[0]) @ p[1]) * ct), argnums=(0, 1)
    )((w1, w2), x)
    return (loss, dw1, dw2, dx), (ref_loss, *ref_grads, ref_dx), (x, w1, w2, ct)


@pytest.mark.parametrize("tp", tiered([4, 8], (4,)))
@pytest.mark.parametrize("mode", MODES)
def test_megatron_mlp_gradients_exact_without_compression(tp, mode):
    (loss, dw1, dw2, dx), (ref_loss, ref_dw1, ref_dw2, ref_dx), _ = _sharded_mlp_grads(
        tp, mode, "none"
    )
    np.testing.assert_array_equal(loss, jnp.broadcast_to(ref_loss, loss.shape))
    np.testing.assert_array_equal(dw1, ref_dw1)
    np.testing.assert_array_equal(dw2, ref_dw2)
    np.testing.assert_array_equal(dx, jnp.broadcast_to(ref_dx, dx.shape))


@pytest.mark.parametrize("tp", tiered([4, 8], (4,)))
@pytest.mark.parametrize("mode", tiered(MODES, ("shard_map",)))
def test_megatron_mlp_gradients_with_taco(tp, mode):
    (loss, dw1, dw2, dx), (ref_loss, ref_dw1, ref_dw2, ref_dx), (x, w1, w2, ct) = (
        _sharded_mlp_grads(tp, mode, "taco")
    )
    # The loss is linear in y and g's backward is the identity, so dL/dy = ct exactly, and the
    # weight gradients see no compression at all: they must match bit for bit.
    np.testing.assert_array_equal(dw1, ref_dw1)
    np.testing.assert_array_equal(dw2, ref_dw2)
    # Forward: |loss - ref| <= ||y_err|| ||ct|| with the all-reduce bound on the partials.
    partials = jnp.stack(
        [
            jax.nn.relu(x @ a) @ b
            for a, b in zip(jnp.split(w1, tp, 1), jnp.split(w2, tp, 0), strict=True)
        ]
    )
    y = jnp.sum(partials, 0)
    y_bound = U * (1 + U) * _rank_norms(partials) + U * float(jnp.linalg.norm(y))
    assert float(jnp.max(jnp.abs(loss - ref_loss))) <= 1.01 * y_bound * float(jnp.linalg.norm(ct))
    # Backward: dx is the compressed all-reduce of the per-rank input gradients.
    mask = [(x @ a > 0).astype(jnp.float32) for a in jnp.split(w1, tp, 1)]
    dx_parts = jnp.stack(
        [
            ((ct @ b.T) * m) @ a.T
            for a, b, m in zip(jnp.split(w1, tp, 1), jnp.split(w2, tp, 0), mask, strict=True)
        ]
    )
    dx_bound = U * (1 + U) * _rank_norms(dx_parts) + U * float(jnp.linalg.norm(ref_dx))
    assert float(jnp.linalg.norm(dx[0] - ref_dx)) <= 1.01 * dx_bound
    _assert_rank_identical(dx)


@pytest.mark.parametrize("mode", MODES)
def test_sequence_parallel_operators_transpose_each_other(mode):
    """gather_from_sp / scatter_to_sp with "none" equal lax and have lax's gradients."""
    tp = 4
    x = _ranks(tp, (2, 3, 8), seed=110)  # per rank [B, T/N, D]
    ct = _ranks(tp, (2, 12, 8), seed=111)
    comm = tj.TPComm.create(fwd="none")

    def ours(v, c):
        out, vjp = jax.vjp(lambda a: tj.gather_from_sp(a, comm, axis=1), v)
        return out, vjp(c)[0]

    def theirs(v, c):
        out = lax.all_gather(v, "tp", axis=1, tiled=True)
        return out, lax.psum_scatter(c, "tp", scatter_dimension=1, tiled=True)

    for a, b in zip(
        run_tp(lambda p: ours(*p), (x, ct), tp=tp, mode=mode),
        run_tp(lambda p: theirs(*p), (x, ct), tp=tp, mode=mode),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    scattered = run_tp(lambda c: tj.scatter_to_sp(c, comm, axis=1), ct, tp=tp, mode=mode)
    np.testing.assert_array_equal(
        scattered,
        run_tp(
            lambda c: lax.psum_scatter(c, "tp", scatter_dimension=1, tiled=True),
            ct,
            tp=tp,
            mode=mode,
        ),
    )


def test_grad_under_scan_and_remat():
    """The ops trace under lax.scan + jax.checkpoint + grad, and g's backward is the identity."""
    tp = 4
    comm = tj.TPComm.create()
    x = _ranks(tp, (3, 256), seed=120)

    def loss(v):
        def step(carry, _):
            return jax.checkpoint(lambda c: tj.reduce_from_tp(c, comm) * 0.5)(carry), None

        out, _ = lax.scan(step, v, None, length=2)
        return jnp.sum(out)

    grads = run_tp(jax.grad(loss), x, tp=tp, mode="vmap")
    np.testing.assert_array_equal(grads, jnp.full_like(x, 0.25))


# ------------------------------------------------------------------------------ options


def test_options_are_comm_config_overrides():
    """One configuration surface: a codec (name, Codec or CommConfig) plus keyword overrides."""
    cfg = tj.comm_config("int8", slices=4, group_size=64)
    assert cfg == tj.CommConfig(tj.get_codec("int8", 64), slices=4)
    assert tj.comm_config(cfg, impl="xla") == tj.CommConfig(
        tj.get_codec("int8", 64), impl="xla", slices=4
    )
    assert tj.comm_config(cfg, group_size=256).codec.group_size == 256
    assert tj.comm_config() == tj.CommConfig() == tj.comm_config("taco")
    comm = tj.TPComm.create(fwd="taco", bwd="none", min_compress_bytes=10)
    assert comm.fwd.min_compress_bytes == comm.bwd.min_compress_bytes == 10
    assert comm.bwd.codec.is_identity
    with pytest.raises(TypeError, match="'slice'"):
        tj.comm_config("taco", slice=2)
    with pytest.raises(ValueError, match="algorithm='three_shot'"):
        tj.comm_config("taco", algorithm="three_shot")


# ------------------------------------------------------------------------------ errors


def test_errors_name_the_offending_value():
    x = _ranks(2, (256,))
    with pytest.raises(ValueError, match="'model'"):
        run_tp(lambda v: tj.compressed_psum(v, "model"), x, tp=2, mode="vmap")
    with pytest.raises(TypeError, match="int32"):
        run_tp(lambda v: tj.compressed_psum(v.astype(jnp.int32), "tp"), x, tp=2, mode="vmap")
    with pytest.raises(ValueError, match="'zstd'"):
        tj.compressed_psum(x, "tp", codec="zstd")
    with pytest.raises(ValueError, match="group_size=48"):
        tj.compressed_psum(x, "tp", group_size=48)
    with pytest.raises(ValueError, match="slices=0"):
        tj.compressed_psum(x, "tp", slices=0)
    with pytest.raises(ValueError, match="impl='cuda'"):
        tj.compressed_psum(x, "tp", impl="cuda")
    with pytest.raises(ValueError, match="not divisible"):
        run_tp(lambda v: tj.compressed_psum_scatter(v[:3], "tp"), x, tp=2, mode="vmap")


@pytest.mark.parametrize("codec", ["none", "taco"])
def test_drops_into_check_vma_shard_map(codec):
    """With shard_map's default check_vma=True the output is typed replicated, like lax.psum's
    (so out_specs=P() works), and the gradient equals lax.psum's (exactly for "none")."""
    tp = 8
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(
        _ranks(tp, (512,), seed=140).reshape(tp, 512), jax.sharding.NamedSharding(mesh, jax.P("tp"))
    )

    def grads(psum):
        loss = lambda v: jnp.sum(psum(v) ** 2)
        return jax.jit(
            jax.shard_map(
                lambda v: (psum(v), jax.grad(loss)(v)),
                mesh=mesh,
                in_specs=jax.P("tp"),
                out_specs=(jax.P(), jax.P("tp")),
            )
        )(x)

    out, grad = grads(lambda v: tj.compressed_psum(v, "tp", codec=codec))
    ref_out, ref_grad = grads(lambda v: lax.psum(v, "tp"))
    if codec == "none":
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_array_equal(grad, ref_grad)
    else:
        # grad = 2 psum(x) per rank: the psum bound applies to both.
        bound = U * (1 + U) * _rank_norms(x) + U * float(jnp.linalg.norm(ref_out))
        assert float(jnp.linalg.norm(out - ref_out)) <= 1.01 * bound
        for r in range(tp):
            assert float(jnp.linalg.norm(grad[r] - ref_grad[r])) <= 2 * 1.01 * bound


@pytest.mark.parametrize("check_vma", [True, False])
def test_gradient_outside_shard_map_matches_lax(check_vma):
    """A drop-in for lax.psum: the same gradient when jax.grad wraps the shard_map."""
    tp = 4
    mesh = jax.make_mesh(
        (tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:tp]
    )
    x = jax.device_put(_ranks(tp, (256,), seed=150), jax.sharding.NamedSharding(mesh, jax.P("tp")))
    w = jax.random.normal(jax.random.key(151), (1, 256))

    def grad_of(psum):
        mapped = jax.shard_map(
            psum, mesh=mesh, in_specs=jax.P("tp"), out_specs=jax.P(), check_vma=check_vma
        )
        return jax.jit(jax.grad(lambda v: jnp.sum(mapped(v) * w)))(x)

    np.testing.assert_array_equal(
        grad_of(lambda v: tj.compressed_psum(v, "tp", codec="none")),
        grad_of(lambda v: lax.psum(v, "tp")),
    )


def test_gradient_under_vmap_matches_lax():
    """Under vmap lax.psum transposes to a psum of the cotangent; compressed_psum does too
    (compressed: within one all-reduce bound of it), reduce_from_tp (Megatron g) does not."""
    tp = 4
    x = _ranks(tp, (512,), seed=160)
    ct = _ranks(tp, (512,), seed=161)
    grads = lambda psum: run_tp(
        lambda a: jax.vjp(psum, a[0])[1](a[1])[0], (x, ct), tp=tp, mode="vmap"
    )
    ref = grads(lambda v: lax.psum(v, "tp"))
    np.testing.assert_array_equal(grads(lambda v: tj.compressed_psum(v, "tp", codec="none")), ref)
    taco = grads(lambda v: tj.compressed_psum(v, "tp"))
    bound = U * (1 + U) * _rank_norms(ct) + U * float(jnp.linalg.norm(ref[0]))
    assert float(jnp.linalg.norm(taco[0] - ref[0])) <= 1.01 * bound
    np.testing.assert_array_equal(
        grads(lambda v: tj.reduce_from_tp(v, tj.TPComm.create(fwd="none"))), ct
    )


# Each public op with its lax counterpart, on [tp, 4, 64] inputs (rank's block [4, 64]).
_COUNTERPARTS = {
    "psum": (
        lambda v, **o: tj.compressed_psum(v, "tp", **o),
        lambda v: lax.psum(v, "tp"),
    ),
    "psum_scatter": (
        lambda v, **o: tj.compressed_psum_scatter(v, "tp", scatter_dimension=1, **o),
        lambda v: lax.psum_scatter(v, "tp", scatter_dimension=1, tiled=True),
    ),
    "all_gather": (
        lambda v, **o: tj.compressed_all_gather(v, "tp", axis=1, tiled=True, **o),
        lambda v: lax.all_gather(v, "tp", axis=1, tiled=True),
    ),
}


def _vjp_around_vmap(op, x, ct):
    """jax.vjp of the whole vmapped op: the backward runs outside the vmap's axis."""
    return jax.jit(lambda a, c: jax.vjp(jax.vmap(op, axis_name="tp"), a)[1](c)[0])(x, ct)


def _grad_around_vmap(op, x, w):
    loss = lambda v: jnp.sum(jax.vmap(op, axis_name="tp")(v) * w)
    return jax.jit(jax.grad(loss))(x)


def _vjp_inside_vmap(op, x, ct):
    return jax.jit(jax.vmap(lambda a, c: jax.vjp(op, a)[1](c)[0], axis_name="tp"))(x, ct)


def _grad_around_shard_map(op, x, w, check_vma):
    tp = x.shape[0]
    mesh = jax.make_mesh(
        (tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:tp]
    )
    mapped = jax.shard_map(
        lambda v: op(v[0])[None],
        mesh=mesh,
        in_specs=jax.P("tp"),
        out_specs=jax.P("tp"),
        check_vma=check_vma,
    )
    return jax.jit(jax.grad(lambda v: jnp.sum(mapped(v) * w)))(x)


def _cotangent_like(op, x, seed):
    shape = jax.eval_shape(jax.vmap(op, axis_name="tp"), x).shape
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("op_name", sorted(_COUNTERPARTS))
def test_vjp_and_grad_around_vmap_match_lax(op_name):
    """jax.vjp / jax.grad around jax.vmap(..., axis_name="tp") of each op: the same gradient as
    its lax counterpart's, exactly with codec "none"; with a codec, the backward is the same
    compressed collective of the same cotangent as when the vmap is outside the vjp, so the two
    nestings agree bit for bit."""
    op, reference = _COUNTERPARTS[op_name]
    tp = 4
    x = _ranks(tp, (4, 64), seed=170)
    ct = _cotangent_like(reference, x, seed=171)
    exact = lambda v: op(v, codec="none")
    expected = _vjp_around_vmap(reference, x, ct)
    np.testing.assert_array_equal(_vjp_around_vmap(exact, x, ct), expected)
    np.testing.assert_array_equal(
        _grad_around_vmap(exact, x, ct), _grad_around_vmap(reference, x, ct)
    )
    outside, inside = _vjp_around_vmap(op, x, ct), _vjp_inside_vmap(op, x, ct)
    assert bool(jnp.all(jnp.isfinite(outside))) and not np.array_equal(outside, expected)
    np.testing.assert_array_equal(outside, inside)


@pytest.mark.parametrize("op_name", sorted(_COUNTERPARTS))
def test_vjp_inside_vmap_matches_lax(op_name):
    """jax.vjp inside the vmap (each rank's own cotangent), exactly as lax's with codec "none"."""
    op, reference = _COUNTERPARTS[op_name]
    tp = 4
    x = _ranks(tp, (4, 64), seed=172)
    ct = _cotangent_like(reference, x, seed=173)
    np.testing.assert_array_equal(
        _vjp_inside_vmap(lambda v: op(v, codec="none"), x, ct), _vjp_inside_vmap(reference, x, ct)
    )


def test_grad_of_jit_of_vmap_says_to_differentiate_the_vmap():
    """jax.grad(jax.jit(jax.vmap(op))) runs the custom_vjp's forward rule without the vmap's
    axis (docs/method.md, "Traps"): an error that names the way out (`_grad_around_vmap`, the
    jit around the grad, is tested above)."""
    op, _ = _COUNTERPARTS["psum"]
    x = _ranks(4, (4, 64), seed=176)
    w = _ranks(4, (4, 64), seed=177)
    loss = lambda v: jnp.sum(jax.jit(jax.vmap(op, axis_name="tp"))(v) * w)  # noqa: E731
    with pytest.raises(ValueError, match=r"'tp' is not bound.*no jit between the grad"):
        jax.grad(loss)(x)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op_name", sorted(_COUNTERPARTS))
def test_grad_around_shard_map_matches_lax(op_name, check_vma):
    """jax.grad around shard_map, with and without check_vma, exactly as lax's."""
    op, reference = _COUNTERPARTS[op_name]
    tp = 4
    x = _ranks(tp, (4, 64), seed=174)
    w = _cotangent_like(reference, x, seed=175)
    np.testing.assert_array_equal(
        _grad_around_shard_map(lambda v: op(v, codec="none"), x, w, check_vma),
        _grad_around_shard_map(reference, x, w, check_vma),
    )


@pytest.mark.parametrize(
    "tp", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)]
)
def test_two_shot_matches_a_host_side_replay(tp):
    """Replays docs/method.md "Collectives" chunk by chunk with the codec itself. `fp8` has no
    Hadamard, so each output element depends on its own inputs and its group's two scales only:
    a misrouted chunk, a wrong peer order or a skipped re-encode moves elements by whole FP8
    steps (>= 2^-4 relative). What may differ is fp32 rounding of the N-term sum (XLA may
    contract the decode multiply into the sum with an FMA): <= N 2^-24 relative to the sum of
    magnitudes, which the re-encode carries through unchanged except where it lands on a
    rounding tie (one step).
    So: every element within N 2^-24 of the replay, but at most MAX_TIES single elements one
    FP8 step (2^-3 relative) away. Measured: none beyond the fp32 level at N = 2, 4, 8."""
    codec = tj.get_codec("fp8")
    x = _ranks(tp, (3 * 128 * tp + 50,), seed=170)  # padded: not a multiple of N x G
    out = run_tp(
        lambda v: tj.compressed_psum(v, "tp", codec="fp8", impl="xla", algorithm="two_shot"),
        x,
        tp=tp,
        mode="shard_map",
    )

    def roundtrip(v):
        return codec.decode(codec.encode(v))

    padded = jnp.pad(x, ((0, 0), (0, -x.shape[1] % (tp * 128))))
    rows = padded.reshape(tp, tp, -1)  # [rank, destination chunk, c]
    reduced = [roundtrip(jnp.sum(jax.vmap(roundtrip)(rows[:, j]), axis=0)) for j in range(tp)]
    expected = np.asarray(jnp.concatenate(reduced)[: x.shape[1]])
    magnitude = np.asarray(jnp.sum(jnp.abs(x), axis=0))
    for r in range(tp):
        diff = np.abs(np.asarray(out[r]) - expected)
        fp32_level = diff <= 2 * tp * 2.0**-24 * magnitude  # x2: the re-encode's own rounding
        assert int(np.sum(~fp32_level)) <= MAX_TIES
        assert bool(np.all(diff <= 2.0**-3 * np.abs(expected) + 2 * tp * 2.0**-24 * magnitude))


@pytest.mark.parametrize("tp", tiered([2, 4, 8], (8,)))
def test_one_shot_matches_a_host_side_replay(tp):
    """One-shot is sum_r decode(encode(x_r)) in rank order. With `fp8` (no Hadamard) each output
    element depends on its own inputs and its groups' scales only, so a misrouted row or a lost
    rank moves it by whole FP8 steps; what may differ is fp32 rounding of the N-term sum (an FMA
    may contract the decode multiply into it): <= N 2^-24 of the sum of magnitudes."""
    codec = tj.get_codec("fp8")
    x = _ranks(tp, (3 * 128 + 50,), seed=175)  # padded: not a multiple of G
    fn = lambda v: tj.compressed_psum(v, "tp", codec="fp8", impl="xla", algorithm="one_shot")
    out = run_tp(fn, x, tp=tp, mode="shard_map")
    expected = jnp.sum(jax.vmap(lambda v: codecs.roundtrip(codec, v))(x), axis=0)
    magnitude = np.asarray(jnp.sum(jnp.abs(x), axis=0))
    for r in range(tp):
        diff = np.abs(np.asarray(out[r]) - np.asarray(expected))
        assert bool(np.all(diff <= tp * 2.0**-24 * magnitude))


def test_tuple_axis_names_reduce_over_the_product():
    """psum over ("dp", "tp") of a 2 x 4 mesh: one group of 8, as lax.psum does."""
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = _ranks(8, (1024,), seed=180)
    spec = jax.P(("dp", "tp"))
    placed = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    run = lambda psum: jax.jit(
        jax.shard_map(
            lambda v: psum(v[0])[None], mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
        )
    )(placed)
    exact = run(lambda v: lax.psum(v, ("dp", "tp")))
    np.testing.assert_array_equal(
        run(lambda v: tj.compressed_psum(v, ("dp", "tp"), codec="none")), exact
    )
    out = run(lambda v: tj.compressed_psum(v, ("dp", "tp")))
    bound = U * (1 + U) * _rank_norms(x) + U * float(jnp.linalg.norm(exact[0]))
    assert float(jnp.linalg.norm(out[0] - exact[0])) <= 1.01 * bound
    _assert_rank_identical(out)


# ----------------------------------------------------------- kernels' 32-bit buffer offsets


KERNEL_OPS = {
    "psum": lambda v, **kw: tj.compressed_psum(v, "tp", **kw),
    "psum one-shot": lambda v, **kw: tj.compressed_psum(v, "tp", algorithm="one_shot", **kw),
    "psum_scatter": lambda v, **kw: tj.compressed_psum_scatter(v, "tp", tiled=True, **kw),
    "all_gather": lambda v, **kw: tj.compressed_all_gather(v, "tp", tiled=True, **kw),
}


@pytest.mark.slow
@pytest.mark.parametrize("op", sorted(KERNEL_OPS))
def test_messages_past_the_kernel_buffer_limit_are_sliced_not_changed(monkeypatch, op):
    """A message whose kernel buffers would pass the kernels' 32-bit offsets is cut into slices
    (`algorithms.addressable`), which changes no value. With the one limit lowered (to ~0.7 MB,
    where this odd-sized message needs 2-3 slices), the kernels' own check
    (`_pallas.check_addressable`) sees every buffer within it, the op ran sliced (an encode
    launch per slice), and its outputs equal the unlimited call's bit for bit."""
    tp = 2
    x = _ranks(tp, (3 * FUSED_ROW + 50,), seed=51).astype(jnp.bfloat16)
    fn = KERNEL_OPS[op]

    def run(v):
        return run_tp(lambda v: fn(v, impl="pallas_interpret"), v, tp=tp, mode="shard_map")

    def encodes() -> int:  # a fresh function: traced anew, not taken from make_jaxpr's cache
        return str(jax.make_jaxpr(lambda v: run(v))(x)).count("name=taco_encode_")

    want = run(x)
    assert encodes() == 1
    monkeypatch.setattr(pallas_kernels._pallas, "MAX_BUFFER_BYTES", 700_000)
    assert encodes() > 1  # sliced
    np.testing.assert_array_equal(np.asarray(run(x)), np.asarray(want))


def _addressable(codec: str, x, limit):
    cfg = tj.comm_config(codec, impl="pallas_interpret")
    padding = cfg.codec.group_size
    return algorithms.addressable(cfg, x, 2, rows=1, padding=padding, limit=limit)


def test_a_message_too_large_for_every_slice_count_is_refused():
    x = jnp.zeros((1 << 20,), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"1048576 elements per rank over 2 ranks .* 16 slices"):
        _addressable("taco", x, limit=1024)


def test_tahquant_slices_count_its_fp32_decode():
    """TAH-Quant's decode-sum writes each row in fp32 (no fused kernel): 4 bytes per element,
    more than the bf16 values (2) or the two wire rows (2 x ~1.07) that bound `taco` here."""
    x = jnp.zeros((2 * FUSED_ROW,), jnp.bfloat16)
    # One slice: values 524 kB, two `taco` wire rows 557 kB (TAH-Quant's 561 kB), fp32 row 1 MB.
    assert _addressable("taco", x, limit=600_000).slices == 1
    assert _addressable("tahquant_nearest", x, limit=600_000).slices == 2


def test_the_reference_codec_has_no_buffer_limit():
    cpu = Target()
    assert tj._backends.max_buffer_bytes("xla", cpu) is None
    assert tj._backends.max_buffer_bytes("auto", cpu) is None  # "auto" off a GPU: the reference
    limit = pallas_kernels._pallas.MAX_BUFFER_BYTES
    assert tj._backends.max_buffer_bytes("auto", Target(backend="gpu")) == limit
    assert _addressable("taco", jnp.zeros((8,)), limit=None).slices == 1


# ------------------------------------------------------------------ TAH-Quant's grids on TP


def _stage_replay(codec, x):
    """docs/method.md "Collectives" replayed chunk by chunk with TAH-Quant's own round trip, for
    x [N, N c] (whole groups per chunk): what each rank receives, [N, ...] per op."""
    tp = x.shape[0]

    def roundtrip(rows):
        return tahquant.roundtrip(codec, rows)

    def everywhere(value):
        return jnp.broadcast_to(value, (tp, *value.shape))

    chunks = x.reshape(tp, tp, -1)  # [rank, destination chunk, c]
    scattered = jnp.stack([jnp.sum(roundtrip(chunks[:, j]), axis=0) for j in range(tp)])
    return {
        "two_shot": everywhere(roundtrip(scattered).reshape(-1)),
        "one_shot": everywhere(jnp.sum(roundtrip(x), axis=0)),
        "scatter": scattered,
        "gather": everywhere(roundtrip(chunks[:, 0]).reshape(-1)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", tahquant.NEAREST_CODEC_NAMES)
def test_tahquant_grids_on_tp_match_a_host_side_replay(name):
    """TAH-Quant on TP traffic (the TACO paper's baseline) runs the TP codecs' exchanges with
    TAH-Quant's round trip (round to nearest). An output element depends on its own group only,
    so a misrouted chunk, a wrong peer order or a skipped re-encode moves whole groups by whole
    steps. What may differ is fp32 rounding, `_sum_level`. Where that moves a value across a
    rounding boundary of an encode, the element moves by at most one step of that encode's
    group (`_steps`). Gaussian data puts a value within 2 N 2^-24 relative of a boundary with
    probability ~1e-5 per element: at most MAX_TIES of the 4096 distinct outputs per op."""
    tp = 4
    codec = tahquant.get_stage_codec(name)
    x = _ranks(tp, (tp * 1024,), seed=180)
    replay = _stage_replay(codec, x)
    steps = _steps(codec, x).sum(axis=0)  # a tie in any rank's encode
    reencode_steps = _steps(codec, replay["scatter"]).reshape(-1)  # two-shot's second encode
    step_of = {
        "two_shot": steps + reencode_steps,
        "one_shot": steps,
        "scatter": steps.reshape(tp, -1),  # rank r holds chunk r
        "gather": _steps(codec, x[:, :1024]).reshape(-1),  # rank r's own x[r, :1024]
    }
    level = _sum_level(x)
    level_of = {
        "two_shot": level,
        "one_shot": level,
        "scatter": level.reshape(tp, -1),
        "gather": 4 * 2.0**-24 * np.abs(np.asarray(replay["gather"][0])),  # no sum: a few ulp
    }

    def ops(v):
        return {
            "two_shot": tj.compressed_psum(v, "tp", codec=name, impl="xla", algorithm="two_shot"),
            "one_shot": tj.compressed_psum(v, "tp", codec=name, impl="xla", algorithm="one_shot"),
            "scatter": tj.compressed_psum_scatter(v, "tp", tiled=True, codec=name, impl="xla"),
            "gather": tj.compressed_all_gather(v[:1024], "tp", tiled=True, codec=name, impl="xla"),
        }

    outs = run_tp(ops, x, tp=tp, mode="shard_map")
    for op, want in replay.items():
        want, got = np.asarray(want), np.asarray(outs[op])
        if op != "scatter":  # every rank holds the same result: compare one copy
            _assert_rank_identical(got)
            want, got = want[0], got[0]
        diff = np.abs(got - want)
        ties = int(np.sum(diff > level_of[op]))
        assert ties <= MAX_TIES, f"{op}: {ties} elements beyond the fp32 level"
        assert bool(np.all(diff <= step_of[op] + level_of[op])), op


def _sum_level(x):
    """x [N, n] -> [n]: how far two fp32 N-term sums of the ranks' round trips may differ. The
    replay sums with `jnp.sum` (XLA's order, maybe contracted into the decode), the library one
    decoded row at a time in rank order; each is within (N - 1) 2^-24 sum|terms| of the exact
    sum, and the decode after a re-encode adds one rounding of the value: 2 N 2^-24 sum|x|
    (a round trip exceeds |x| by at most one step, well inside the spare factor N / (N - 1))."""
    return 2 * x.shape[0] * 2.0**-24 * np.asarray(jnp.sum(jnp.abs(x), axis=0))


def _steps(codec, rows):
    """rows [R, n] -> [R, n]: the step of each element's group as the encode stores it (code k
    decodes to k scale, plus the min on the asymmetric grid). A code one step off moves its
    decoded element by exactly that step, or in the first block of a pivoted group by
    1 / sqrt(32) of it on each of the 32 elements there (the orthonormal H_32): <= one step."""
    rows = jnp.asarray(rows, jnp.float32)
    n = rows.shape[-1]
    key = jax.random.key(0) if codec.stochastic else None  # the scales do not read the noise
    sides = tahquant.unpack_sides(codec, tahquant.encode_wire(codec, rows, key), n)
    scales = np.asarray(sides["scales"]).reshape(rows.shape[0], n // codec.group_size)
    return np.repeat(scales, codec.group_size, axis=-1)


def _kernels_against_reference(name, x, **options):
    """|pallas_interpret - xla| of `compressed_psum` of x [N, ...] under vmap (one copy) and the
    fp32 level (`_sum_level`), after checking that the kernel path's ranks agree and that at
    most MAX_TIES elements differ beyond that level (the replay test's rule)."""
    outs = {
        impl: run_tp(
            lambda v, i=impl: tj.compressed_psum(v, "tp", codec=name, impl=i, **options),
            x,
            tp=x.shape[0],
            mode="vmap",
        )
        for impl in ("xla", "pallas_interpret")
    }
    _assert_rank_identical(outs["pallas_interpret"])
    level = _sum_level(x)
    diff = np.abs(np.asarray(outs["pallas_interpret"])[0] - np.asarray(outs["xla"])[0])
    assert int(np.sum(diff > level)) <= MAX_TIES
    return diff, level


@pytest.mark.slow
def test_tahquant_grids_on_tp_run_the_stage_kernels():
    """impl="pallas_interpret" runs the fused stage kernels (`pallas_kernels.tahquant_kernel`)
    inside the collectives: equal to the reference path within the replay test's rule."""
    tp, name = 2, "tahquant4_nearest"
    codec = tahquant.get_stage_codec(name)
    x = _ranks(tp, (2048,), seed=185)
    diff, level = _kernels_against_reference(name, x)
    # The default algorithm here (emulated: two-shot) encodes twice.
    scattered = _stage_replay(codec, x)["scatter"]
    steps = _steps(codec, x).sum(axis=0) + _steps(codec, scattered).reshape(-1)
    assert bool(np.all(diff <= steps + level))
    jaxpr = str(
        jax.make_jaxpr(
            jax.vmap(
                lambda v: tj.compressed_psum(v, "tp", codec=name, impl="pallas_interpret"),
                axis_name="tp",
            )
        )(x)
    )
    assert "pallas_call" in jaxpr, "the stage kernels did not run"


# Groups whose values sit 0.3 of a step above a grid point, no group pivoting (m1 <= 2 m2): the
# largest element sets the step, and every decoded value is the grid point or the next one.
#   tahquant4 (symmetric, qmax 7):   [7, 3.6, 2.3 x 30]       -> step 1, 2.3 decodes to 2 or 3
#   tahquant (asymmetric, 255 steps): [0, 255, 130, 100.3 x 125] -> step 1, 100.3 to 100 or 101
_BETWEEN_STEPS = {
    "tahquant4": ([7.0, 3.6], 2.3, 32),
    "tahquant": ([0.0, 255.0, 130.0], 100.3, 128),
}


def _between_steps(name, tp, groups):
    """[tp, groups G] of `_BETWEEN_STEPS[name]`'s groups, rank r's row rolled by r groups (the
    same values at other positions: another message, so other noise), and the mask of the
    in-between values (the same on every rank)."""
    head, value, g = _BETWEEN_STEPS[name]
    row = np.tile(np.array(head + [value] * (g - len(head)), np.float32), groups)
    x = np.stack([np.roll(row, rank * g) for rank in range(tp)])
    return jnp.asarray(x), np.tile(np.arange(g) >= len(head), groups)


@pytest.mark.parametrize("name", tiered(["tahquant4", "tahquant"], ["tahquant"]))
def test_stochastic_tahquant_on_tp_rounds_without_bias(name):
    """The stochastic grids on TP traffic draw their noise from the message
    (`tahquant.message_key`): a value 0.3 of a step above a grid point decodes to the point or
    the next one, 0.3 of a step above on average, where rounding to nearest is 0.3 of a step low
    on every element. Each decoded error lies in an interval one step wide (one-shot's sum,
    divided by N: the mean of N such errors, also within one step-wide interval); with noise that
    behaves as independent uniforms (the keyed hash of `uniform_noise`), Hoeffding bounds the
    mean of M of them: P(|mean| >= 0.1 step) <= 2 exp(-2 M 0.01), below 1e-16 from M = 2000
    per rank."""
    tp = 2
    x, between = _between_steps(name, tp, groups=96)
    head, value, _ = _BETWEEN_STEPS[name]
    assert int(between.sum()) >= 2000

    def gather(v, codec):
        return tj.compressed_all_gather(v, "tp", tiled=True, codec=codec, impl="xla")

    def ops(v):
        return {
            "gather": gather(v, name),
            "one_shot": tj.compressed_psum(v, "tp", codec=name, impl="xla", algorithm="one_shot"),
            "nearest": gather(v, f"{name}_nearest"),
        }

    outs = run_tp(ops, x, tp=tp, mode="shard_map")
    _assert_rank_identical(outs["one_shot"])
    gathered = np.asarray(outs["gather"][0]).reshape(tp, -1)[:, between] - value
    summed = (np.asarray(outs["one_shot"][0])[between] - tp * value) / tp
    nearest = np.asarray(outs["nearest"][0]).reshape(tp, -1)[:, between] - value
    for errors, terms in ((gathered, 1), (summed, tp)):  # terms: codes in each error
        steps_up = set(np.round((errors + 0.3) * terms, 3).ravel())
        assert steps_up <= set(range(terms + 1)), "not the neighbouring grid points"
        assert abs(float(errors.mean())) < 0.1
    np.testing.assert_allclose(nearest, -0.3, atol=1e-4)  # what the test tells apart


@pytest.mark.slow
def test_stochastic_tahquant_on_tp_noise_follows_the_message():
    """The same message rounds the same way every time (a resumed run reproduces it); changing
    one element changes the noise of every group (for the round-to-nearest grid, nothing
    outside that element's group moves)."""
    tp, name = 2, "tahquant4"
    x, _ = _between_steps(name, tp, groups=64)
    changed = x.at[:, 0].set(6.5)  # still its group's largest: the step stays 1

    def gather(codec):
        def op(v):
            return tj.compressed_all_gather(v, "tp", tiled=True, codec=codec, impl="xla")

        return [np.asarray(run_tp(op, v, tp=tp, mode="shard_map")[0]) for v in (x, x, changed)]

    first, again, moved = gather(name)
    np.testing.assert_array_equal(first, again)
    outside_group_0 = np.arange(first.size) % (64 * 32) >= 32
    assert np.sum(first[outside_group_0] != moved[outside_group_0]) > 100
    first, _, moved = gather(f"{name}_nearest")
    np.testing.assert_array_equal(first[outside_group_0], moved[outside_group_0])


def _pivots(codec, rows):
    """The pivot byte of every group of rows [R, n], flat (flag `tahquant.PIVOT_FLAG`, index)."""
    key = jax.random.key(0)  # the pivots do not read the noise
    wire = tahquant.encode_wire(codec, jnp.asarray(rows, jnp.float32), key)
    return np.asarray(tahquant.unpack_sides(codec, wire, rows.shape[-1])["pivots"]).reshape(-1)


def _stochastic_bound(codec, rows):
    """rows [R, n] -> [R, n]: how far one stochastic round trip of each element may land from
    it. Each code errs by less than one step of its group (floor(v + u) is one of the two grid
    points around v), so a plain element by less than a step. In a pivoted group the first
    block's 32 errors go through H_32 (orthonormal, entries 1 / sqrt(32)), so each element
    decoded from that block errs by less than 32 / sqrt(32) = sqrt(32) steps: elements 0..31
    and the outlier's own position (it was swapped into the block)."""
    rows = jnp.asarray(rows, jnp.float32)
    pivots = _pivots(codec, rows)
    factor = np.ones((pivots.size, codec.group_size))
    flagged = np.flatnonzero(pivots & tahquant.PIVOT_FLAG)
    factor[flagged, : tahquant.PIVOT_BLOCK] = np.sqrt(tahquant.PIVOT_BLOCK)
    factor[flagged, pivots[flagged] & 0x7F] = np.sqrt(tahquant.PIVOT_BLOCK)
    return _steps(codec, rows) * factor.reshape(rows.shape)


@pytest.mark.slow
def test_stochastic_tahquant_on_tp_stays_within_a_step_per_encode():
    """On Gaussian data (some groups of 32 pivot), every rank holds the same sum, within
    `_stochastic_bound` of each encode plus the fp32 level (`_sum_level`) of the exact sum:
    one-shot encodes each rank's input once; two-shot's first encodes are the same, and it
    re-encodes each chunk's fp32 sum, which the reduce-scatter of the same input returns (same
    rows, so the same message keys): that encode's bound is read from those sums."""
    tp, name = 4, "tahquant4"
    codec = tahquant.get_stage_codec(name)
    x = _ranks(tp, (tp * 1024,), seed=190)

    def ops(v):
        psum = functools.partial(tj.compressed_psum, v, "tp", codec=name, impl="xla")
        return {
            "one_shot": psum(algorithm="one_shot"),
            "two_shot": psum(algorithm="two_shot"),
            "sums": tj.compressed_psum_scatter(v, "tp", tiled=True, codec=name, impl="xla"),
        }

    outs = run_tp(ops, x, tp=tp, mode="vmap")
    exact, level = np.asarray(jnp.sum(x, axis=0)), _sum_level(x)
    first = _stochastic_bound(codec, x).sum(axis=0) + level
    sums = np.asarray(outs["sums"]).reshape(1, -1)  # rank r holds chunk r
    assert np.any(_pivots(codec, x) & tahquant.PIVOT_FLAG), "no pivoted group: a weaker test"
    reencode = _stochastic_bound(codec, sums)[0] + level
    for algorithm, bound in (("one_shot", first), ("two_shot", first + reencode)):
        _assert_rank_identical(outs[algorithm])
        err = np.abs(np.asarray(outs[algorithm][0]) - exact)
        assert bool(np.all(err <= bound)), algorithm


@pytest.mark.slow
def test_stochastic_tahquant_on_tp_runs_the_stage_kernels():
    """impl="pallas_interpret" draws the noise of the reference path (the same messages, so
    the same keys): one-shot's outputs agree but where fp32 rounding moved a code across a
    boundary (at most MAX_TIES beyond the fp32 level, as in the replay test), each by less
    than `_stochastic_bound` of a rank's encode."""
    tp, name = 2, "tahquant4"
    codec = tahquant.get_stage_codec(name)
    x = _ranks(tp, (2048,), seed=195)
    diff, level = _kernels_against_reference(name, x, algorithm="one_shot")
    assert bool(np.all(diff <= _stochastic_bound(codec, x).sum(axis=0) + level))


def test_tahquant_on_tp_errors_name_the_offending_value():
    x = _ranks(2, (256,))
    with pytest.raises(ValueError, match="group_size=128 differs"):
        tj.compressed_psum(x, "tp", codec="tahquant4_nearest", group_size=128)
    with pytest.raises(ValueError, match="unknown codec 'tahquant8'.*'tahquant_nearest'"):
        tj.compressed_psum(x, "tp", codec="tahquant8")
