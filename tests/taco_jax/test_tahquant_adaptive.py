"""`tahquant_adaptive`: 3 or 4 bits per group within a fixed budget (taco_jax/tahquant_adaptive.py).

Bounds as in test_tahquant.py: stochastic rounding to a grid of step s has |err| < s per
element, the pivot's H_32 keeps error norms, so ||err||_group <= sqrt(G) s with s the group's
stored scale (absmax / 3 or absmax / 7).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from codec_testing import group_errors
from tiers import tiered

from taco_jax import codecs, tahquant
from taco_jax import tahquant_adaptive as ta

KEY = jax.random.key(0)
N = 32 * 24  # 24 groups per row


def _x(seed=1):
    return jax.random.normal(jax.random.key(seed), (4, N), jnp.float32)


def _sides(codec, wire):
    per_row, groups = codec.code_bytes(N), N // 32
    scale = codecs.side_from_bytes(wire[:, per_row : per_row + 4 * groups], 4)
    pivots = np.asarray(wire[:, per_row + 4 * groups :]).astype(int)
    return np.asarray(scale, np.float64).reshape(-1), pivots


# The fast tier: the entropy allocation (the default); the others slow.
@pytest.mark.parametrize("allocation", tiered(ta.ALLOCATIONS, ["entropy"]))
def test_round_trip_within_the_group_bound(allocation):
    codec = ta.AdaptiveTahQuant(allocation=allocation)
    x = _x().at[:, 5::32].multiply(20.0)  # outliers: the pivot path too
    wire = ta.encode_wire(codec, x, KEY)
    scale, _ = _sides(codec, wire)
    err = group_errors(codec, x, ta.decode_wire(codec, wire, N))
    assert np.all(err <= 1.01 * np.sqrt(32) * scale)


@pytest.mark.parametrize("budget", [3.0, 3.5, 4.0])
def test_wire_bytes_match_the_budget(budget):
    codec = ta.AdaptiveTahQuant(budget=budget)
    wire = ta.encode_wire(codec, _x(), KEY)
    assert wire.shape == (4, codec.wire_bytes(N))
    assert wire.shape[1] * 8 / N == codec.bits_per_element == budget + 40 / 32


def test_a_full_budget_decodes_like_the_fixed_4bit_codec():
    """budget 4: every group 4-bit, same noise: the values of `tahquant4`, exactly."""
    x = _x(2)
    wide = ta.decode_wire(
        ta.AdaptiveTahQuant(budget=4.0), ta.encode_wire(ta.AdaptiveTahQuant(budget=4.0), x, KEY), N
    )
    np.testing.assert_array_equal(
        wide, tahquant.roundtrip(tahquant.get_stage_codec("tahquant4"), x, KEY)
    )


@pytest.mark.parametrize("allocation", ta.ALLOCATIONS)
def test_the_wide_groups_are_those_the_rule_ranks_first(allocation):
    codec = ta.AdaptiveTahQuant(allocation=allocation)
    x = _x(3) * jnp.linspace(0.5, 2.0, N)  # groups of different magnitude
    _, pivots = _sides(codec, ta.encode_wire(codec, x, KEY))
    wide = (pivots & ta.WIDE_FLAG) != 0
    groups = np.asarray(x, np.float64).reshape(4, -1, 32)
    if allocation == "absmax":
        priority = np.abs(groups).max(-1)  # no group here has a dominant outlier: no pivot
    elif allocation == "entropy":
        priority = np.asarray(ta.entropy(jnp.asarray(groups.reshape(-1, 32)))).reshape(4, -1)
    else:
        priority = -(np.arange(24) % 2) * np.ones((4, 1))
    top = np.argsort(-priority, axis=-1, kind="stable")[:, :12]
    expected = np.zeros_like(wide)
    np.put_along_axis(expected, top, True, axis=-1)
    np.testing.assert_array_equal(wide, expected)


def test_three_bit_codes_pack_eight_in_three_bytes():
    codes = jax.random.randint(jax.random.key(4), (5, 32), 0, 8)
    packed = ta._pack3(codes)
    assert packed.shape == (5, 12) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(ta._unpack3(packed), codes)


def test_nonfinite_groups_decode_to_nan_and_zeros_to_zero():
    codec = ta.AdaptiveTahQuant()
    x = _x(5).at[0, 3].set(jnp.nan).at[1, 40].set(jnp.inf).at[2, 64:96].set(0.0)
    y = np.asarray(ta.decode_wire(codec, ta.encode_wire(codec, x, KEY), N)).reshape(4, -1, 32)
    nan_groups = np.isnan(y).all(-1)
    assert nan_groups[0, 0] and nan_groups[1, 1] and nan_groups.sum() == 2
    np.testing.assert_array_equal(y[2, 2], 0.0)


def test_errors_name_the_offending_value():
    with pytest.raises(ValueError, match="budget=4.5"):
        ta.AdaptiveTahQuant(budget=4.5)
    with pytest.raises(ValueError, match="allocation='random'"):
        ta.AdaptiveTahQuant(allocation="random")
    with pytest.raises(ValueError, match="pass a PRNG key"):
        ta.encode_wire(ta.AdaptiveTahQuant(), _x())
    with pytest.raises(ValueError, match="'tahquant_adaptive_x'"):
        ta.get_codec("tahquant_adaptive_x")
