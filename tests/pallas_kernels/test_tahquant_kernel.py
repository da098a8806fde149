"""Fused TAH-Quant kernels vs the jnp reference (interpret mode on the CPU; the GPU class on a GPU).

Tolerances (derivations):
- codes: the kernel runs the reference's own tile functions (but for the H_32's butterflies,
  which it takes in the form `tahquant.butterflies_by_pair_splits`, bit for bit the reference's
  `butterflies_by_axes`: tests/taco_jax/test_tahquant.py), so a code can differ only through
  fp32 rounding of the compiled arithmetic: the GPU may fuse a multiply and an add (one rounding
  fewer) and divides to within 2 ulp (the factor levels / span). The pre-rounding value v + u
  (v <= 2^b - 1 < 256) then moves by at most ~4 ulp, |dv| <= DV = 4 * 256 * 2^-24, and a code
  moves by one step only if v + u (v, rounding to nearest) lies within DV of a rounding
  boundary: probability <= 2 DV per element (u is uniform; v's fractional part is spread
  evenly over these data). Over E elements the count of moved codes is ~Poisson(2 DV E); we allow
  2 DV E + 5 sqrt(2 DV E) + 3, every moved code by exactly one step. In interpret mode the
  kernel runs the same arithmetic as XLA operations on the CPU: the wire must be byte-for-byte
  equal where every tile pivots (`_data` flags a group in each); a tile that skips the pivot
  (`tk.SKIP_PIVOT_GROUP_SIZES`) runs under a `cond` that XLA fuses differently, so there only
  the rule above holds.
- side values (fp32 scale, min): the same arithmetic on the same group; the reductions are
  order-independent (max, min), and the scale takes two divisions of up to 2 ulp (1 ulp =
  2^-23 relative at most): rtol 8 * 2^-24.
- pivot bytes: a comparison of exact magnitudes: equal in every finite group.
- decode: per element a code times the scale plus the min (two roundings), then in a pivoted
  group 5 butterfly levels over 32 values and one multiply: each rounding <= 2^-24 of a partial
  sum <= 32 max|y| (y the dequantized group). Bound: 8 * 32 * 2^-24 * max|y| per group.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import tiered

from pallas_kernels import tahquant_kernel as tk
from taco_jax import sdp4bit, tahquant
from taco_jax.tahquant import get_stage_codec

FP32_EPS = 2.0**-24
ROWS = 3  # rows of the test messages (magnitudes 1e-20, 1, 1e20: `_data`)
CODE_DV = 4 * 256 * FP32_EPS
NAMES = tahquant.STAGE_CODEC_NAMES
# Every kernel path, in bf16 and fp32: the stage codecs (asymmetric and symmetric, 8 and 4
# bits); in fp32 only, a round-to-nearest variant of each grid (the magic-number rounding that
# runs only compiled) and SDP4Bit's 4-bit gradient codec (no pivot).
ENCODE_CASES = (
    [(get_stage_codec(name), dtype) for name in NAMES for dtype in (jnp.float32, jnp.bfloat16)]
    + [
        (dataclasses.replace(get_stage_codec(name), stochastic=False), jnp.float32)
        for name in ("tahquant", "tahquant4")
    ]
    + [(sdp4bit.TLQ_OUTER, jnp.float32)]
)


# The fast tier's encode: the 8-bit stage codec in bf16 (the 4-bit one decodes there).
FAST_ENCODES = [ENCODE_CASES[1]]

# Groups above the wide tiles' G: qWD's, and an asymmetric 8-bit G = 256 without the pivot.
LARGE_GROUP_CASES = [
    (sdp4bit.QWD, jnp.float32),
    (sdp4bit.QWD, jnp.bfloat16),
    (tahquant.TahQuant("g256", bits=8, group_size=256, pivot=False), jnp.float32),
]


def _case_id(case):
    codec, dtype = case
    nearest = "-nearest" * (not codec.stochastic)
    return f"{codec.name}{nearest}-{jnp.dtype(dtype).name}"


def _split(codec, wire, n):
    codes = tahquant.unpack_codes(codec, wire[:, : codec.code_bytes(n)])
    sides = tahquant.unpack_sides(codec, wire, n)
    return np.asarray(codes), {field: np.asarray(value) for field, value in sides.items()}


def assert_wire_matches(codec, wire, ref, n):
    codes, sides = _split(codec, wire, n)
    ref_codes, ref_sides = _split(codec, ref, n)
    moved = codes != ref_codes
    assert np.all(np.abs(codes - ref_codes) <= 1), "a code moved by more than one step"
    expected = 2 * CODE_DV * codes.size
    allowed = expected + 5 * np.sqrt(expected) + 3
    assert moved.sum() <= allowed, f"{int(moved.sum())} moved codes, allowed {allowed:.1f}"
    finite = np.isfinite(ref_sides["scales"])
    np.testing.assert_array_equal(np.isfinite(sides["scales"]), finite)
    for field in ("scales", "mins"):
        if field in sides:
            np.testing.assert_allclose(
                sides[field][finite], ref_sides[field][finite], rtol=8 * FP32_EPS, atol=0
            )
    if "pivots" in sides:
        np.testing.assert_array_equal(sides["pivots"][finite], ref_sides["pivots"][finite])


def _data(shape, dtype, seed):
    """N(0, 1) rows with a dominant outlier in every fourth group of 32 (the pivot path), a
    constant run, and magnitudes from 1e-20 to 1e20 across rows."""
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    x = x.at[:, 7::128].set(40.0).at[0, 64:96].set(3.0)
    decades = jnp.logspace(-20, 20, shape[0], dtype=jnp.float32)[:, None]
    return (x * decades).astype(dtype)


class TahQuantKernelTest:
    """Shared suite: INTERPRET=False needs a GPU; the subclass below runs it on the CPU."""

    INTERPRET = False
    GROUPS = 19  # of 128 elements: a whole encode tile (16 groups of 128) and a partial one

    @pytest.fixture(autouse=True)
    def _need_backend(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("needs a GPU")

    @pytest.mark.parametrize("case", tiered(ENCODE_CASES, FAST_ENCODES, _case_id, unpack=False))
    def test_encode_matches_reference(self, case):
        codec, dtype = case
        n = 128 * self.GROUPS
        x = _data((ROWS, n), dtype, seed=len(codec.name))
        key = jax.random.key(7) if codec.stochastic else None
        wire = tk.encode(codec, x, key, interpret=self.INTERPRET)
        assert wire.shape == (ROWS, codec.wire_bytes(n)) and wire.dtype == jnp.uint8
        ref = tahquant.encode_wire(codec, x, key)
        if self.INTERPRET:
            np.testing.assert_array_equal(wire, ref)
        assert_wire_matches(codec, wire, ref, n)

    # The fast tier decodes the 8-bit and 4-bit asymmetric grids; the symmetric one is slow.
    @pytest.mark.parametrize("name", tiered(NAMES, ["tahquant", "tahquant4"]))
    def test_decode_matches_reference(self, name):
        codec = get_stage_codec(name)
        n = 128 * self.GROUPS
        wire = tahquant.encode_wire(codec, _data((ROWS, n), jnp.float32, seed=3), jax.random.key(1))
        want = np.asarray(tahquant.decode_wire(codec, wire, n), np.float64)
        for dtype in (jnp.float32, jnp.bfloat16):
            got = tk.decode(codec, wire, n, dtype, interpret=self.INTERPRET)
            assert got.dtype == dtype
            groups = want.reshape(-1, codec.group_size)
            bound = 8 * 32 * FP32_EPS * np.max(np.abs(groups), axis=-1, keepdims=True)
            if dtype == jnp.bfloat16:  # plus the cast: half a bf16 ulp of each value
                bound = bound + np.abs(groups) * 2.0**-8
            err = np.abs(np.asarray(got, np.float64).reshape(groups.shape) - groups)
            assert np.all(err <= bound), f"decode error {err.max():.3g} beyond its bound"

    @pytest.mark.slow
    @pytest.mark.parametrize("name", NAMES)
    def test_nonfinite_groups_stay_nonfinite(self, name):
        """A NaN, an Inf and a -Inf (the asymmetric grid's min) each mark exactly their group:
        the GPU's max / min drop NaN, so only `mark_nonfinite` keeps those groups NaN."""
        codec = get_stage_codec(name)
        g = codec.group_size
        x = _data((2, 4 * g), jnp.float32, seed=1)
        x = x.at[0, 3].set(jnp.nan).at[1, 2 * g + 5].set(jnp.inf).at[1, 3 * g].set(-jnp.inf)
        run = dict(interpret=self.INTERPRET)
        out = tk.decode(codec, tk.encode(codec, x, jax.random.key(0), **run), 4 * g, **run)
        nan_groups = np.isnan(np.asarray(out)).reshape(2, 4, g).all(axis=-1)
        np.testing.assert_array_equal(nan_groups, [[1, 0, 0, 0], [0, 0, 1, 1]])

    @pytest.mark.slow
    @pytest.mark.parametrize("name", NAMES)
    def test_tiles_without_outliers_skip_the_pivot(self, name):
        """The encode skips the swap and H_32 on a tile with no flagged group (G = 128,
        `tk.SKIP_PIVOT_GROUP_SIZES`): rows of values with |x| in [1, 1.5) (m1 < 2 m2: nothing
        flags) but for one outlier group in the second and in the fourth 8192 elements (a tile
        holds at most 8192), so tiles of both kinds run, encoded and decoded."""
        codec = get_stage_codec(name)
        g, n = codec.group_size, 4 * 8192
        tile = tk.encode_config(codec, n).groups_per_tile * g
        assert 8192 % tile == 0, f"a tile of {tile} elements would mix the two kinds of tiles"
        magnitudes = jax.random.uniform(jax.random.key(5), (2, n), jnp.float32, 1.0, 1.5)
        signs = jax.random.rademacher(jax.random.key(6), (2, n), jnp.float32)
        outliers = (8192 + 3 * g + 11, 3 * 8192 + 5)
        x = (magnitudes * signs).at[:, list(outliers)].set(-50.0)
        key = jax.random.key(2)
        ref = tahquant.encode_wire(codec, x, key)
        pivots = tahquant.unpack_sides(codec, ref, n)["pivots"].reshape(2, n // g)
        for row in np.asarray(pivots):
            np.testing.assert_array_equal(np.flatnonzero(row & 0x80), [i // g for i in outliers])
        run = dict(interpret=self.INTERPRET)
        # Not byte-for-byte even in interpret mode: the tile's `cond` splits XLA's fusions, so
        # a multiply and an add may fuse differently (the rounding the module docstring bounds).
        assert_wire_matches(codec, tk.encode(codec, x, key, **run), ref, n)
        want = np.asarray(tahquant.decode_wire(codec, ref, n), np.float64)
        got = np.asarray(tk.decode(codec, ref, n, **run), np.float64)
        groups = want.reshape(-1, g)
        bound = 8 * 32 * FP32_EPS * np.max(np.abs(groups), axis=-1, keepdims=True)  # as above
        assert np.all(np.abs(got.reshape(groups.shape) - groups) <= bound)

    # qWD's groups in the fast tier; the 8-bit G = 256 in the slow one.
    @pytest.mark.parametrize(
        "case", tiered(LARGE_GROUP_CASES, LARGE_GROUP_CASES[:1], _case_id, unpack=False)
    )
    def test_large_groups_match_reference(self, case):
        """Groups above `tk.MAX_GROUP_OF_WIDE_TILES` fill a tile with whole groups: SDP4Bit's
        qWD (G = 2048, one group per encode tile, 4 per decode tile) and an asymmetric 8-bit
        G = 256 (8 per encode tile). 3 groups here and 66 on the GPU leave a partial last tile
        wherever a tile holds more than one group. The bounds are the other codecs'."""
        codec, dtype = case
        g = codec.group_size
        n = g * (self.GROUPS // 16 + 2)
        x = _data((ROWS, n), dtype, seed=11)
        key = jax.random.key(9)
        run = dict(interpret=self.INTERPRET)
        wire = tk.encode(codec, x, key, **run)
        ref = tahquant.encode_wire(codec, x, key)
        if self.INTERPRET:
            np.testing.assert_array_equal(wire, ref)
        assert_wire_matches(codec, wire, ref, n)
        want = np.asarray(tahquant.decode_wire(codec, ref, n), np.float64).reshape(-1, g)
        got = np.asarray(tk.decode(codec, ref, n, **run), np.float64).reshape(-1, g)
        # No pivot here: one code times the scale plus the min, within the bound above.
        bound = 8 * 32 * FP32_EPS * np.max(np.abs(want), axis=-1, keepdims=True)
        assert np.all(np.abs(got - want) <= bound)

    def test_keys_draw_reproducible_noise(self):
        codec = get_stage_codec("tahquant4")
        x = _data((1, 4096), jnp.float32, seed=2)
        run = dict(interpret=self.INTERPRET)
        first = tk.encode(codec, x, jax.random.key(0), **run)
        np.testing.assert_array_equal(first, tk.encode(codec, x, jax.random.key(0), **run))
        assert not np.array_equal(first, tk.encode(codec, x, jax.random.key(1), **run))

    def test_errors_name_the_offending_value(self):
        codec = get_stage_codec("tahquant")
        with pytest.raises(ValueError, match="PRNG key"):
            tk.encode(codec, jnp.zeros((1, 128)), interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="wire shape"):
            tk.decode(codec, jnp.zeros((1, 10), jnp.uint8), 128, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="n=100"):
            tk.decode(codec, jnp.zeros((1, 10), jnp.uint8), 100, interpret=self.INTERPRET)


@pytest.mark.gpu
class TestTahQuantKernelGPU(TahQuantKernelTest):
    INTERPRET = False
    GROUPS = 1027  # several tiles, the last one partial


class TestTahQuantKernelInterpret(TahQuantKernelTest):
    INTERPRET = True
