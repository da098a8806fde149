"""TAH-Quant (`taco_jax.tahquant`) against derived error bounds; the pivot path; stochastic
rounding; the wire format; errors.

Bounds, per group of G, with s the group's stored scale (asymmetric: (max - min) / (2^b - 1),
symmetric: absmax / (2^(b-1) - 1)), in the quantized domain y:
- round to nearest: |err_y| <= s / 2 per element; stochastic floor(v + u): |err_y| < s;
- a pivoted group's first 32 values come back through the orthonormal H_32, which keeps error
  norms, and the swap is a permutation. Hence
  ||err_x||_group <= sqrt(G) s / 2 (nearest) or sqrt(G) s (stochastic) for every group;
- fp32 arithmetic adds O(1e-6) relative, which the 1.01 factor covers.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from codec_testing import DECADES, group_errors, groups64, mixed_magnitudes
from tiers import tiered

from taco_jax import codecs, tahquant
from taco_jax.tahquant import get_stage_codec

NAMES = tahquant.STAGE_CODEC_NAMES
KEY = jax.random.key(0)


def _nearest(name):
    return dataclasses.replace(get_stage_codec(name), stochastic=False)


def _scales(codec, x, key=KEY):
    wire = tahquant.encode_wire(codec, x, key if codec.stochastic else None)
    return np.asarray(tahquant.unpack_sides(codec, wire, x.shape[-1])["scales"], np.float64)


def _normal(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _with_outliers(shape, seed=1, size=40.0, group=32):
    """N(0, 1) with one value per `group` values raised to `size` (a dominant outlier)."""
    return _normal(shape, seed).at[:, 7::group].set(size)


@pytest.mark.parametrize("name", tiered(NAMES, ["tahquant"]))  # the other grids: slow tier
@pytest.mark.parametrize("make", [_normal, _with_outliers], ids=["gaussian", "outliers"])
def test_round_to_nearest_group_bound(name, make):
    codec = _nearest(name)
    x = make((8, 1024))
    err = group_errors(codec, x, tahquant.roundtrip(codec, x))
    bound = np.sqrt(codec.group_size) * _scales(codec, x) / 2
    assert np.all(err <= 1.01 * bound)


@pytest.mark.parametrize(
    "name,dtype",
    # The fast tier: the 8-bit codec in bf16.
    tiered(
        [(n, d) for n in NAMES for d in (jnp.float32, jnp.bfloat16)], [("tahquant", jnp.bfloat16)]
    ),
)
def test_every_magnitude_keeps_the_stochastic_bound(name, dtype):
    """Groups from 1e-30 to 1e30 side by side (the same power-of-two scaling as the TP codecs)."""
    codec = get_stage_codec(name)
    g = codec.group_size
    x = mixed_magnitudes(jax.random.key(3), (4, g * len(DECADES)), g, dtype=dtype)
    err = group_errors(codec, x, tahquant.roundtrip(codec, x, KEY))
    assert np.all(err <= 1.01 * np.sqrt(g) * _scales(codec, x))


@pytest.mark.parametrize("name", NAMES)
def test_power_of_two_scaling_is_exact(name):
    codec = get_stage_codec(name)
    x = _with_outliers((4, 512))
    for power in (-90, 40):
        factor = np.float32(2.0**power)
        np.testing.assert_array_equal(
            tahquant.roundtrip(codec, x * factor, KEY), tahquant.roundtrip(codec, x, KEY) * factor
        )


def test_stochastic_rounding_is_unbiased_and_reproducible():
    """Mean error over K keys and M elements, in units of each group's scale: every term lies in
    (-1, 1) with mean 0 and variance <= 1/4, so the mean has std <= 0.5 / sqrt(K M); 5 sigma."""
    codec = get_stage_codec("tahquant_sym")
    x = _normal((4, 1024), seed=4)
    scale = np.repeat(_scales(codec, x), codec.group_size)
    keys = jax.random.split(jax.random.key(5), 64)
    errors = [
        (groups64(tahquant.roundtrip(codec, x, k), 128) - groups64(x, 128)).reshape(-1)
        for k in keys
    ]
    units = np.stack(errors) / scale
    # Also against the sign of x, so that opposite biases of the two signs cannot cancel.
    sign = np.sign(np.asarray(x, np.float64).reshape(-1))
    for weighted in (units, units * sign):
        assert abs(float(np.mean(weighted))) <= 5 * 0.5 / np.sqrt(64 * x.size)
    again = tahquant.encode_wire(codec, x, keys[0])
    np.testing.assert_array_equal(again, tahquant.encode_wire(codec, x, keys[0]))
    assert not np.array_equal(again, tahquant.encode_wire(codec, x, keys[1]))


def test_uniform_noise_is_uniform_and_keyed():
    """The counter hash behind stochastic rounding, over N = 2^16 elements (2^15 pairs): values
    on the grid (k + 1/2) 2^-16 inside (0, 1); a 64-bin histogram's chi-square (63 degrees of
    freedom: mean 63, sd sqrt(126) ~ 11.2) below mean + 6 sd; the correlation of neighbours
    (within a pair and across pairs) and of two seeds' streams below 6 / sqrt(N) (6 standard
    deviations of an independent pair's sample correlation)."""
    n = 1 << 16
    pairs = jnp.arange(n // 2, dtype=jnp.uint32)
    u0, u1 = (
        np.asarray(
            tahquant.uniform_noise(tahquant.noise_seeds(jax.random.key(s)), pairs), np.float64
        )
        for s in (0, 1)
    )
    assert u0.shape == (n,) and u0.min() > 0 and u0.max() < 1
    grid = u0 * 2**16 - 0.5
    np.testing.assert_array_equal(grid, np.round(grid))
    counts = np.histogram(u0, bins=64, range=(0, 1))[0]
    chi2 = float(np.sum((counts - n / 64) ** 2 / (n / 64)))
    assert chi2 < 63 + 6 * np.sqrt(126), chi2
    for a, b in ((u0[0::2], u0[1::2]), (u0[1:-1:2], u0[2::2]), (u0, u1)):
        assert abs(np.corrcoef(a, b)[0, 1]) < 6 / np.sqrt(a.size)


def test_pivot_rule_flags_exactly_the_dominant_outliers():
    x = _normal((8, 1024), seed=6).at[:3, 5::128].set(30.0)  # 3 rows with an outlier per group
    codec = get_stage_codec("tahquant")
    wire = tahquant.encode_wire(codec, x, KEY)
    pivots = np.asarray(tahquant.unpack_sides(codec, wire, 1024)["pivots"])
    groups = np.abs(np.asarray(x, np.float64).reshape(-1, 128))
    top2 = np.sort(groups, axis=-1)[:, -2:]
    expected = top2[:, 1] > 2 * top2[:, 0]
    np.testing.assert_array_equal(pivots >= tahquant.PIVOT_FLAG, expected)
    assert expected[: 3 * 8].all() and expected.sum() < len(expected)
    flagged = pivots >= tahquant.PIVOT_FLAG
    np.testing.assert_array_equal((pivots & 0x7F)[flagged], np.argmax(groups, axis=-1)[flagged])
    np.testing.assert_array_equal(pivots[~flagged], 0)  # no outlier: no swap, byte 0


def test_pivot_rule_at_its_edges():
    """m1 > 2 m2 exactly: a runner-up at exactly m1 / 2 does not flag, just below does; an
    all-zero group and a tie for the largest do not; the sign does not matter."""
    rows = np.zeros((6, 32), np.float32)
    rows[0, [3, 9]] = [2.0, 1.0]  # m1 = 2 m2
    rows[1, [3, 9]] = [2.0, np.nextafter(np.float32(1.0), np.float32(0.0))]
    rows[2, [4, 20]] = [-5.0, 5.0]  # tie
    rows[4, 31] = -1e-30  # a lone tiny value is an outlier too
    rows[5, [0, 7]] = [0.1, 3e38]  # near fp32's largest: 2 |x| overflows to inf, still exact
    flag, index = tahquant.pivot_rule(jnp.asarray(rows))
    np.testing.assert_array_equal(np.asarray(flag), [False, True, False, False, True, True])
    np.testing.assert_array_equal(np.asarray(index), [0, 3, 0, 0, 31, 7])
    # Groups of 128: the last position; a lone Inf; a runner-up whose double overflows (m1 = 3e38
    # is not > 2 m2 = 4e38), so no flag.
    wide = np.zeros((3, 128), np.float32)
    wide[0, [127, 3]] = [-9.0, 1.0]
    wide[1, [64, 65]] = [np.inf, 1e38]
    wide[2, [10, 90]] = [3e38, 2e38]
    flag, index = tahquant.pivot_rule(jnp.asarray(wide))
    np.testing.assert_array_equal(np.asarray(flag), [True, True, False])
    np.testing.assert_array_equal(np.asarray(index), [127, 64, 0])


@pytest.mark.parametrize("bits", [1, 3, 5, 7])
def test_both_butterfly_forms_agree_bit_for_bit(bits):
    """The reference's butterflies (`butterflies_by_axes`) and the kernels'
    (`butterflies_by_pair_splits`) add the same operands in the same order: the same bits, on
    groups of mixed magnitudes with zeros, a block of -0.0 (whose sums are -0.0 and whose
    differences are +0.0) and a NaN among them. Both equal S x, the +-1 Sylvester matrix over
    the low `bits` bits, to within fp32 rounding: each output is a sum of 2^bits terms through
    `bits` levels, each level rounding with relative error <= u = 2^-24 partial sums that
    cover the inputs once, so |error| <= gamma_bits sum |x|, gamma_k = k u / (1 - k u)."""
    x = np.array(mixed_magnitudes(jax.random.key(11), (24, 128), 128))
    x[0, :7], x[1, 32:64], x[2, 64] = 0.0, -0.0, np.nan
    by_axes = jax.jit(tahquant.butterflies_by_axes, static_argnums=1)(x, bits)
    by_pairs = jax.jit(tahquant.butterflies_by_pair_splits, static_argnums=1)(x, bits)
    np.testing.assert_array_equal(
        np.asarray(by_axes).view(np.uint32), np.asarray(by_pairs).view(np.uint32)
    )
    b = 1 << bits
    blocks = np.asarray(x[3:], np.float64).reshape(21, 128 // b, b)
    exact = blocks @ codecs.signs_matrix(b).astype(np.float64)
    u = 2.0**-24
    bound = bits * u / (1 - bits * u) * np.abs(blocks).sum(-1, keepdims=True)
    got = np.asarray(by_axes[3:], np.float64).reshape(blocks.shape)
    assert np.all(np.abs(got - exact) <= bound)


@pytest.mark.parametrize("name", NAMES)
def test_pivot_lowers_the_error_of_outlier_groups(name):
    """One outlier of 40 per group of N(0, 1): H_32 spreads it over 32 values of ~(40 + 2.5
    sqrt(31)) / sqrt(32) ~ 9.5 at most, so the group's absmax, its scale and (H_32 keeps error
    norms) its error drop ~4x: expected ratio ~0.24 (measured 0.23-0.28 at 8 bits, 0.38 on the
    coarser 4-bit grid). Round to nearest, so the comparison is not noise."""
    codec = _nearest(name)
    plain = dataclasses.replace(codec, pivot=False)
    x = _with_outliers((16, 1024), seed=7, group=codec.group_size)
    err = {
        c.pivot: float(np.linalg.norm(group_errors(c, x, tahquant.roundtrip(c, x))))
        for c in (codec, plain)
    }
    assert err[True] <= 0.5 * err[False]


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_groups_decode_to_nan_and_zeros_to_zero(name):
    codec = get_stage_codec(name)
    g = codec.group_size
    x = _normal((2, 4 * g), seed=8).at[0, 3].set(jnp.inf).at[1, g + 1].set(jnp.nan)
    x = x.at[1, 2 * g : 3 * g].set(0.0)
    y = np.asarray(tahquant.roundtrip(codec, x, KEY)).reshape(8, g)
    nan_groups = np.isnan(y).all(axis=-1)
    np.testing.assert_array_equal(nan_groups, [1, 0, 0, 0, 0, 1, 0, 0])
    assert np.isfinite(y[~nan_groups]).all()
    np.testing.assert_array_equal(y[6], 0.0)


def test_constant_groups_are_exact_with_the_asymmetric_grid():
    x = jnp.full((1, 256), 3.25, jnp.float32)
    np.testing.assert_array_equal(tahquant.roundtrip(get_stage_codec("tahquant"), x, KEY), x)


@pytest.mark.parametrize(
    "name,bits", [("tahquant", 8.5625), ("tahquant_sym", 8.3125), ("tahquant4", 5.25)]
)
def test_wire_bytes_match_bits_per_element(name, bits):
    codec = get_stage_codec(name)
    n = 4 * 128
    wire = tahquant.encode_wire(codec, _normal((3, n)), KEY)
    assert codec.bits_per_element == bits
    assert wire.shape == (3, codec.wire_bytes(n)) and wire.dtype == jnp.uint8
    assert wire.shape[-1] * 8 / n == bits


@pytest.mark.parametrize("asymmetric", [True, False])
def test_four_bit_codes_pack_two_per_byte(asymmetric):
    codec = dataclasses.replace(get_stage_codec("tahquant4"), asymmetric=asymmetric)
    low = 0 if asymmetric else -codec.qmax
    high = codec.levels if asymmetric else codec.qmax
    codes = jnp.arange(low, high + 1, dtype=jnp.int32)
    codes = jnp.concatenate([codes, codes[::-1]])[None]
    packed = tahquant.pack_codes(codec, codes)
    assert packed.shape[-1] == codes.shape[-1] // 2
    np.testing.assert_array_equal(tahquant.unpack_codes(codec, packed), codes)


def test_backward_variant_is_symmetric():
    codec = get_stage_codec("tahquant")
    assert codec.backward == dataclasses.replace(codec, name="tahquant_sym", asymmetric=False)
    assert codec.backward.backward == codec.backward


def test_errors_name_the_offending_value():
    with pytest.raises(ValueError, match="'tahquant9'"):
        get_stage_codec("tahquant9")
    with pytest.raises(ValueError, match="bits=6"):
        tahquant.TahQuant("x", bits=6)
    with pytest.raises(ValueError, match="group_size=256"):
        tahquant.TahQuant("x", group_size=256)
    codec = get_stage_codec("tahquant")
    with pytest.raises(ValueError, match="pass a PRNG key"):
        tahquant.encode_wire(codec, _normal((1, 128)))
    with pytest.raises(ValueError, match=r"shape=\(1, 100\)"):
        tahquant.encode_wire(codec, _normal((1, 100)), KEY)
    with pytest.raises(TypeError, match="int32"):
        tahquant.encode_wire(codec, jnp.zeros((1, 128), jnp.int32), KEY)


def _key_bits(x):
    return tuple(np.asarray(jax.random.key_data(tahquant.message_key(x))).tolist())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_message_key_follows_every_bit_of_the_message(dtype):
    """The same message gives the same key; a sign, one ulp of one element, or two elements
    swapped give another (the positions are hashed too)."""
    x = jnp.asarray(np.linspace(0.5, 3.0, 64), dtype)
    same = _key_bits(x)
    assert _key_bits(jnp.array(x)) == same
    one_ulp = x.at[5].set(jnp.nextafter(x[5], jnp.asarray(10, dtype)))
    variants = [-x, one_ulp, x.at[3].set(x[4]).at[4].set(x[3]), x[None]]
    keys = [_key_bits(v) for v in variants[:3]]
    assert len({same, *keys}) == 4
    assert _key_bits(variants[3]) == same  # the shape is not part of the message


def test_message_key_hashes_both_words_of_fp64():
    with jax.enable_x64(True):
        x = jnp.asarray(np.linspace(1.0, 2.0, 16), jnp.float64)
        keys = {_key_bits(v) for v in (x, 2 * x, -x)}  # the low 32 bits of each are equal
    assert len(keys) == 3
