"""The collectives with impl="pallas_interpret" vs impl="xla", under shard_map and vmap.

Both implementations quantize the same values; they differ only where a code sits at a rounding
tie (test_kernels.py), which moves one code by one FP8 step. Bound on the output difference:
a one-step move of an E4M3 code is <= 2^-3 of its magnitude <= 2^-3 * 448 * s; through the
orthonormal inverse Hadamard it moves each output of its group by <= that * s / sqrt(G) / alpha,
i.e. <= 2^-3 * max|group| * sqrt(G) / sqrt(G)... bounded by 2^-3 * the group's l2 norm. Both
quantizations (reduce-scatter and all-gather) can move: ATOL = 2 * 2^-3 * max group l2 norm.
Away from ties the outputs differ only by fp32 rounding, which the median check pins.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_tp

from taco_jax import collectives

TP = 8
G = 32


def _psum(impl):
    return lambda x: collectives.compressed_psum(x, "tp", group_size=G, impl=impl)


def _scatter(impl):
    return lambda x: collectives.compressed_psum_scatter(x, "tp", group_size=G, impl=impl)


def _gather(impl):
    return lambda x: collectives.compressed_all_gather(x, "tp", group_size=G, impl=impl)


def _max_group_norm(x):
    flat = np.asarray(x, np.float64).reshape(-1)
    flat = np.pad(flat, (0, -flat.size % G)).reshape(-1, G)
    return float(np.max(np.linalg.norm(flat, axis=1)))


@pytest.mark.parametrize("mode", ["shard_map", "vmap"])
@pytest.mark.parametrize("op", [_psum, _scatter, _gather])
def test_pallas_matches_xla(op, mode):
    x = jax.random.normal(jax.random.key(0), (TP, 16, 24), jnp.float32)  # 384 = 12 groups/rank
    got = run_tp(op("pallas_interpret"), x, tp=TP, mode=mode)
    want = run_tp(op("xla"), x, tp=TP, mode=mode)
    assert got.shape == want.shape
    atol = 2 * 2.0**-3 * _max_group_norm(want)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    # Away from ties the two differ only by fp32 rounding (a few Hadamard sums of G terms, each
    # <= G * 2^-24 relative): the median difference must sit at that level, not at FP8 steps.
    noise = 4 * G * 2.0**-24 * float(jnp.max(jnp.abs(want)))
    assert float(jnp.median(jnp.abs(got - want))) <= noise


def test_pallas_psum_is_identical_on_every_rank():
    x = jax.random.normal(jax.random.key(1), (TP, 256), jnp.float32)
    out = run_tp(_psum("pallas_interpret"), x, tp=TP, mode="shard_map")
    np.testing.assert_array_equal(out, jnp.broadcast_to(out[0], out.shape))
