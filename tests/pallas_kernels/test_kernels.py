"""The Triton codec kernels vs the jnp references (interpret mode on the CPU; the GPU class on a
GPU). Their launches (`BlockConfig`) only change which program computes what: every variant
must compute the references' function.

Tolerances (derivations):
- FP8/INT8 codes: identical, except where the kernel's code is the rounding of another value
  within fp32 noise of the ideal one (`assert_codes_match`). The kernel's pre-rounding value
  differs from the ideal only by fp32 rounding of a G-term Hadamard sum, relative error
  <= G * 2^-24 of the group's l1 mass, which is <= sqrt(G) * l2 = sqrt(G) * (RMS 448 group)
  -> we allow values within tol = TIE_RTOL * 448 of the ideal, TIE_RTOL = G^1.5 * 2^-24
  (8.6e-5 at G = 128). tol is absolute: for the integer grids and for FP8 codes above ~32 tol
  (E4M3: 1.2 of 448; E5M2, whose tol is 4.9, 79 of 57344) it is below half a code step, so a
  differing code is one step at a rounding tie; smaller FP8 codes have finer steps, and
  several may be valid.
  The integer grids (INT8 .. INT4) scale each group to absmax qmax, so its RMS is at most qmax
  and the same derivation allows TIE_RTOL * qmax (`assert_codes_match` uses qmax for all).
- fp32 scales: the same relative bound, SCALE_RTOL = G^1.5 * 2^-24 (amax moves by at most that).
- decode / decode_sum: outputs of exact codes through one fp32 Hadamard: rtol G * 2^-24 of the
  row's max magnitude per summed row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from codec_testing import DECADES, groups64, mixed_magnitudes
from tiers import tiered

import pallas_kernels as pk
from pallas_kernels import _tile, decode_kernel, decode_sum_kernel, encode_kernel
from pallas_kernels.config import LAUNCHES, block_config
from taco_jax import codecs

FP32_EPS = 2.0**-24


def _tie_rtol(g: int) -> float:
    return g**1.5 * FP32_EPS


def _fp8_values(codec, codes):
    return np.asarray(codecs.dequantize(codec, jnp.asarray(codes)))


def _ideal_scaled(codec, x64, ref_payload):
    """float64 pre-rounding values y / divisor, with the reference's stored scales."""
    g = codec.group_size
    groups = x64.reshape(*x64.shape[:-1], -1, g)
    alpha = ref_payload.prescales
    # e8m0 stores only s / alpha: y / (2^e alpha) with y = H(alpha x) is H(x) / 2^e.
    if codec.prescale and alpha is not None:
        groups = groups * np.asarray(alpha, np.float64)[..., None]
    y = groups @ codecs.hadamard_matrix(g).astype(np.float64) if codec.hadamard else groups
    if not codec.postscale:
        return y.reshape(x64.shape)
    if codec.scale_format == "e8m0":
        divisor = np.asarray(codecs.e8m0_value(ref_payload.scales), np.float64)
    else:
        divisor = np.asarray(ref_payload.scales, np.float64)
    return (y / divisor[..., None]).reshape(x64.shape)


def assert_codes_match(codec, codes, ref_codes, ideal):
    """Equal values, or a code the kernel may rightly give (module docstring): its pre-rounding
    value lies within tol = TIE_RTOL * qmax of the ideal one, so its code is quantize(v) for
    some v in [ideal - tol, ideal + tol], and quantize is monotone: exactly the codes from
    quantize(ideal - tol) to quantize(ideal + tol) are valid. Where a code step exceeds 2 tol
    this is the one-step rounding tie; for small FP8 codes, whose steps are finer than tol,
    it may be a few steps.

    +0 and -0 are the same value: a sum that is exactly zero in one and fp32 noise in the other
    rounds to zeros of different signs, and both decode to 0.
    """
    codes, ref_codes = np.asarray(codes), np.asarray(ref_codes)
    diff = np.nonzero(_fp8_values(codec, codes) != _fp8_values(codec, ref_codes))
    if not diff[0].size:
        return
    a = _fp8_values(codec, codes[diff])
    b = _fp8_values(codec, ref_codes[diff])
    v = np.clip(ideal[diff], -codec.qmax, codec.qmax)
    tol = _tie_rtol(codec.group_size) * codec.qmax
    lo, hi = (
        _fp8_values(codec, codecs.quantize(codec, jnp.asarray(v + d, jnp.float32)))
        for d in (-tol, tol)
    )
    bad = ~((lo <= a) & (a <= hi))
    assert not bad.any(), (
        f"{int(bad.sum())} of {a.size} differing codes are not roundings of a value within "
        f"{tol:.3g} of the ideal: at flat indices "
        f"{np.ravel_multi_index(diff, codes.shape)[bad][:8]} kernel={a[bad][:8]} "
        f"reference={b[bad][:8]} ideal={v[bad][:8]}"
    )


def assert_e8m0_exponents_match(codec, got, want, ideal_scale):
    """E8M0 exponents equal, or one apart where the ideal scale is a power-of-two tie.

    The exponent is ceil(log2(scale)) of an fp32 scale whose rounding error is at most
    TIE_RTOL relative (the amax moves by that much, see module docstring), so where the ideal
    scale is within TIE_RTOL of a power of two either neighbouring exponent is a correct encoding.
    Returns the mask of groups that took the other exponent.
    """
    got, want = np.asarray(got).astype(int), np.asarray(want).astype(int)
    flipped = got != want
    lower = np.exp2(np.minimum(got, want)[flipped] - 127.0)
    near_tie = np.abs(ideal_scale[flipped] / lower - 1) <= _tie_rtol(codec.group_size)
    assert np.all(np.abs(got - want) <= 1) and near_tie.all(), (
        f"exponents differ off a tie: got={got[flipped]} want={want[flipped]} "
        f"ideal scale={ideal_scale[flipped]}"
    )
    return flipped


def _x(key, shape, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * 3).astype(dtype)


ENCODE_CASES = [(name, 128, jnp.bfloat16) for name in codecs.CODEC_NAMES if name != "none"] + [
    ("taco", 128, jnp.float32),
    ("taco", 32, jnp.bfloat16),
    ("taco", 512, jnp.float32),
    ("int8_hadamard", 256, jnp.float32),
]
OTHER_CASES = [
    ("taco", 128),
    ("taco_e8m0", 128),
    ("fp8", 128),
    ("taco_no_ds", 128),
    ("int8_hadamard", 128),
    ("taco", 512),
    ("int6_hadamard", 128),
    ("int5_hadamard", 128),
    ("int4_hadamard", 32),
]
# The fast tier's cases (`tiers.tiered`): the encodes of the 8-bit codec with scales (G = 128
# and 512), E8M0 scales and a 4 + 2 bit plane codec; the decodes of the 8-bit codec, one
# without a Hadamard and the 4 + 2 bit planes. The rest: the slow tier.
FAST_ENCODES = [
    ("taco", 128, jnp.bfloat16),
    ("taco_e8m0", 128, jnp.bfloat16),
    ("int6_hadamard", 128, jnp.bfloat16),
    ("taco", 512, jnp.float32),
]
FAST_OTHERS = [("taco", 128), ("fp8", 128), ("int6_hadamard", 128)]
# Sub-byte codes split into bit planes (codecs.code_planes): 6 = 4 + 2 and 5 = 4 + 1 bits.
MULTI_PLANE_CODECS = ["int6_hadamard", "int5_hadamard"]


# Launch variants (tile size, tile loop, factored Hadamard): each must compute the same function
# as the reference; None is the default.
LAUNCH_CONFIGS = [
    None,
    pk.BlockConfig(groups_per_tile=16, tiles_per_program=2),  # the last program overruns the row
    pk.BlockConfig(groups_per_tile=32, tiles_per_program=4, num_stages=2),
    pk.BlockConfig(groups_per_tile=64, tiles_per_program=4),
    pk.BlockConfig(groups_per_tile=32, hadamard_dot=32, num_warps=8),
    pk.BlockConfig(groups_per_tile=16, hadamard_dot=16, tiles_per_program=4),
    # decode-sum with a Hadamard per peer (the other ops ignore it), one tile and a tile loop
    pk.BlockConfig(groups_per_tile=64, hadamard_dot=16, hadamard_per_peer=True),
    pk.BlockConfig(groups_per_tile=16, tiles_per_program=2, hadamard_per_peer=True),
]


def _config_id(config):
    if config is None:
        return "default"
    c = config
    name = f"t{c.groups_per_tile}x{c.tiles_per_program}-dot{c.hadamard_dot}"
    return name + "-per-peer" * c.hadamard_per_peer


class KernelTest:
    """Shared suite: INTERPRET=False needs a GPU; the subclass below runs it on the CPU."""

    INTERPRET = False
    SEED = 11  # of the decode-sum-reencode data
    # 5 groups: the one tile is partial, so the masked tail path runs (never a whole tile).
    GROUPS = 5

    @pytest.fixture(autouse=True)
    def _need_backend(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("needs a GPU")

    @pytest.mark.parametrize("name,g,dtype", tiered(ENCODE_CASES, FAST_ENCODES))
    def test_encode_matches_reference(self, name, g, dtype):
        codec = codecs.get_codec(name, g)
        n = g * self.GROUPS
        x = _x(jax.random.key(hash((name, g)) % 2**31), (3, n), dtype)
        wire = encode_kernel.encode(codec, x, interpret=self.INTERPRET)
        ref = pk.encode_reference(codec, x)
        assert wire.shape == ref.shape and wire.dtype == jnp.uint8
        got, want = codecs.unpack(codec, wire, n), codecs.unpack(codec, ref, n)
        ideal = _ideal_scaled(codec, np.asarray(x, np.float64), want)
        assert_codes_match(codec, got.codes, want.codes, ideal)
        for a, b in ((got.scales, want.scales), (got.prescales, want.prescales)):
            if b is None:
                assert a is None
            elif b.dtype == jnp.uint8:
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=_tie_rtol(g), atol=0)

    @pytest.mark.parametrize("name,g", tiered(OTHER_CASES, FAST_OTHERS))
    def test_decode_ops_match_reference(self, name, g):
        codec = codecs.get_codec(name, g)
        n = g * self.GROUPS
        wire = pk.encode_reference(codec, _x(jax.random.key(7), (4, n), jnp.float32))
        rtol = g * FP32_EPS * 4  # one Hadamard per row, 4 rows summed
        for dtype in (jnp.float32, jnp.bfloat16):
            got = decode_kernel.decode(codec, wire, n, dtype, interpret=self.INTERPRET)
            want = pk.decode_reference(codec, wire, n, dtype)
            assert got.dtype == dtype
            scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
            # bf16 output: one bf16 rounding (2^-8 relative) may differ at its own ties.
            atol = scale * (rtol if dtype == jnp.float32 else 2.0**-8)
            np.testing.assert_allclose(
                got.astype(jnp.float32), want.astype(jnp.float32), rtol=0, atol=atol
            )
        for rows in (4, 2):  # two rows: the default launch applies the Hadamard per peer
            total = decode_sum_kernel.decode_sum(codec, wire[:rows], n, interpret=self.INTERPRET)
            want = pk.decode_sum_reference(codec, wire[:rows], n)
            atol = g * FP32_EPS * rows * float(jnp.max(jnp.abs(want)))  # one Hadamard per row
            np.testing.assert_allclose(total, want, rtol=0, atol=atol)

    @pytest.mark.parametrize("name,g", tiered(OTHER_CASES, FAST_OTHERS))
    def test_decode_sum_reencode_matches_reference(self, name, g):
        codec = codecs.get_codec(name, g)
        n = g * self.GROUPS
        wire = pk.encode_reference(codec, _x(jax.random.key(self.SEED), (4, n), jnp.float32))
        fused = decode_sum_kernel.decode_sum_reencode(codec, wire, n, interpret=self.INTERPRET)
        got = codecs.unpack(codec, fused[None], n)
        want = codecs.unpack(codec, pk.decode_sum_reencode_reference(codec, wire, n)[None], n)
        total = np.asarray(pk.decode_sum_reference(codec, wire, n), np.float64)[None]
        codes, ideal = np.asarray(got.codes[0]), _ideal_scaled(codec, total, want)[0]
        want_codes = np.array(want.codes[0])  # a writable copy
        if codec.scale_format == "e8m0":
            # Exact sums of power-of-two-scaled codes often put amax / qmax on a power of two.
            h_total = total.reshape(-1, g) @ codecs.hadamard_matrix(g).astype(np.float64)
            ideal_scale = np.abs(h_total).max(axis=-1) / codec.qmax
            flipped = assert_e8m0_exponents_match(codec, got.scales[0], want.scales[0], ideal_scale)
            # Groups with the other exponent: compare with their own ideal rounding.
            own = _ideal_scaled(codec, total, got)[0].reshape(-1, g)
            own_codes = np.asarray(codecs.quantize(codec, jnp.asarray(own, jnp.float32)))
            grouped = ideal.reshape(-1, g)
            grouped[flipped] = own[flipped]
            wanted = want_codes.reshape(-1, g)
            wanted[flipped] = own_codes[flipped]
        assert_codes_match(codec, codes, want_codes, ideal)

    @pytest.mark.parametrize(
        "name",
        tiered(["taco", "taco_e8m0", "fp8", "int8_hadamard", "int6_hadamard"], ["taco"]),
    )
    def test_every_magnitude_matches_reference(self, name):
        """Groups from 1e-30 to 1e30 side by side: each kernel agrees with the reference group by
        group, within the tolerances above taken relative to each group's own magnitude."""
        codec = codecs.get_codec(name, 128)
        n = 128 * len(DECADES)  # one group per decade in each row, aligned across rows
        x = mixed_magnitudes(jax.random.key(17), (2, n), 128)
        run = dict(interpret=self.INTERPRET)
        wire = encode_kernel.encode(codec, x, **run)
        got, want = (codecs.unpack(codec, w, n) for w in (wire, pk.encode_reference(codec, x)))
        assert_codes_match(
            codec, got.codes, want.codes, _ideal_scaled(codec, np.asarray(x, np.float64), want)
        )
        if codec.scale_format == "e8m0":
            np.testing.assert_array_equal(got.scales, want.scales)
        else:
            np.testing.assert_allclose(got.scales, want.scales, rtol=_tie_rtol(128), atol=0)
        checks = [  # (fused, reference, rows summed)
            (decode_kernel.decode(codec, wire, n, **run), pk.decode_reference(codec, wire, n), 1),
            (
                decode_sum_kernel.decode_sum(codec, wire, n, **run),
                pk.decode_sum_reference(codec, wire, n),
                2,
            ),
        ]
        for fused, reference, rows in checks:
            a, b = groups64(fused, 128), groups64(reference, 128)
            tol = rows * 128 * FP32_EPS * np.abs(b).max(axis=-1, keepdims=True)
            assert np.all(np.abs(a - b) <= tol)

    @pytest.mark.parametrize(
        "name,config",
        # The default launch in the fast tier, the launch variants in the slow one.
        [("taco", None)]
        + [pytest.param("taco", c, marks=pytest.mark.slow) for c in LAUNCH_CONFIGS[1:]]
        + [
            pytest.param(name, LAUNCH_CONFIGS[2], marks=pytest.mark.slow)
            for name in MULTI_PLANE_CODECS
        ]
        # bit-plane codes, a Hadamard per peer
        + [pytest.param("int6_hadamard", LAUNCH_CONFIGS[-1], marks=pytest.mark.slow)],
        ids=lambda v: _config_id(v) if v is None or isinstance(v, pk.BlockConfig) else v,
    )
    def test_rows_of_several_tiles(self, name, config):
        """Tiles after the first, a partial last tile, and each launch variant of BlockConfig
        (for the bit planes of sub-byte codes: a tile loop that overruns the row)."""
        codec = codecs.get_codec(name, 128)
        tile = (config or block_config("encode_dot", 128, 1 << 20)).groups_per_tile
        groups = 2 * tile + 5  # two whole tiles and a partial one
        n = 128 * groups
        if config is None:
            assert block_config("encode_dot", 128, groups).groups_per_tile == tile
        x = _x(jax.random.key(13), (2, n), jnp.float32)
        run = dict(interpret=self.INTERPRET, config=config)
        wire = encode_kernel.encode(codec, x, **run)
        want = codecs.unpack(codec, pk.encode_reference(codec, x), n)
        got = codecs.unpack(codec, wire, n)
        assert_codes_match(
            codec, got.codes, want.codes, _ideal_scaled(codec, np.asarray(x, np.float64), want)
        )
        np.testing.assert_allclose(got.scales, want.scales, rtol=_tie_rtol(128), atol=0)
        if codec.prescale:
            # alpha = 448 / rms: the energy is a G-term fp32 sum (of x, or of H x), same bound.
            np.testing.assert_allclose(got.prescales, want.prescales, rtol=_tie_rtol(128), atol=0)
        decoded = decode_kernel.decode(codec, wire, n, jnp.float32, **run)
        reference = pk.decode_reference(codec, wire, n, jnp.float32)
        scale = float(jnp.max(jnp.abs(reference)))
        np.testing.assert_allclose(decoded, reference, rtol=0, atol=scale * 128 * FP32_EPS)
        total = decode_sum_kernel.decode_sum(codec, wire, n, **run)
        want_total = pk.decode_sum_reference(codec, wire, n)
        atol = 2 * 128 * FP32_EPS * float(jnp.max(jnp.abs(want_total)))  # 2 rows summed
        np.testing.assert_allclose(total, want_total, rtol=0, atol=atol)
        again = codecs.unpack(
            codec, decode_sum_kernel.decode_sum_reencode(codec, wire, n, **run)[None], n
        )
        want_again = codecs.unpack(codec, pk.decode_sum_reencode_reference(codec, wire, n)[None], n)
        ideal = _ideal_scaled(codec, np.asarray(want_total, np.float64)[None], want_again)
        assert_codes_match(codec, again.codes, want_again.codes, ideal)

    @pytest.mark.parametrize("name", tiered(["taco"] + MULTI_PLANE_CODECS, ["taco"]))
    def test_every_output_element_is_written(self, name):
        codec = codecs.get_codec(name, 32)
        n = 32 * self.GROUPS
        x = _x(jax.random.key(3), (2, n), jnp.float32)
        b = codec.wire_bytes(n)
        outs = []
        for fill in (0x00, 0xFF):  # a byte the kernel skips keeps its fill, so the two differ
            wire = encode_kernel.encode(
                codec, x, interpret=self.INTERPRET, out_init=jnp.full((2, b), fill, jnp.uint8)
            )
            outs.append(wire)
            r = decode_sum_kernel.decode_sum_reencode(
                codec, wire, n, interpret=self.INTERPRET, out_init=jnp.full((b,), fill, jnp.uint8)
            )
            outs.append(r)
        np.testing.assert_array_equal(outs[0], outs[2])
        np.testing.assert_array_equal(outs[1], outs[3])
        dec = decode_kernel.decode(
            codec, outs[0], n, interpret=self.INTERPRET, out_init=jnp.full((2, n), jnp.nan)
        )
        assert bool(jnp.all(jnp.isfinite(dec)))

    def test_nonfinite_groups_stay_visible(self):
        codec = codecs.get_codec("taco", 32)
        x = _x(jax.random.key(5), (1, 64), jnp.float32).at[0, 3].set(jnp.inf)
        wire = encode_kernel.encode(codec, x, interpret=self.INTERPRET)
        out = decode_kernel.decode(codec, wire, 64, interpret=self.INTERPRET)
        assert bool(jnp.all(jnp.isnan(out[0, :32]))) and bool(jnp.all(jnp.isfinite(out[0, 32:])))

    @pytest.mark.parametrize(
        "name",
        tiered(
            ["taco", "fp8", "int8_hadamard", "taco_e8m0", "int6_hadamard"],
            ["taco", "int6_hadamard"],
        ),
    )
    def test_lone_nonfinite_values_mark_their_groups(self, name):
        """One NaN or Inf among 2 x 40 groups: its group decodes to NaN, all others stay finite,
        through encode + decode and through decode-sum."""
        codec = codecs.get_codec(name, 32)
        n = 32 * 40
        x = _x(jax.random.key(6), (2, n), jnp.float32).at[0, 100].set(jnp.nan)
        x = x.at[1, n - 1].set(-jnp.inf)
        wire = encode_kernel.encode(codec, x, interpret=self.INTERPRET)
        out = decode_kernel.decode(codec, wire, n, interpret=self.INTERPRET).reshape(2, 40, 32)
        expected = np.zeros((2, 40), bool)
        expected[0, 100 // 32] = expected[1, 39] = True
        np.testing.assert_array_equal(np.isnan(out).all(-1), expected)
        assert bool(np.isfinite(out)[~expected].all())
        total = decode_sum_kernel.decode_sum(codec, wire, n, interpret=self.INTERPRET).reshape(
            40, 32
        )
        np.testing.assert_array_equal(np.isnan(total).all(-1), expected.any(0))

    def test_bad_wire_shape_names_the_values(self):
        codec = codecs.get_codec("taco", 32)
        with pytest.raises(ValueError, match="wire shape"):
            decode_kernel.decode(codec, jnp.zeros((1, 10), jnp.uint8), 32, interpret=self.INTERPRET)


@pytest.mark.gpu
class TestKernelGPU(KernelTest):
    INTERPRET = False
    GROUPS = 37  # one partial tile (the tile is capped to the row: see config)


class TestKernelInterpret(KernelTest):
    INTERPRET = True
    GROUPS = 37  # as on the GPU: enough groups that E8M0 exponent ties occur (SEED 5 has one)
    SEED = 5


@pytest.mark.parametrize("groups", [1, 5, 16, 37, 64, 1000, 4096, 8191])
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_block_config_covers_every_group(groups, launch):
    """Every default launch reaches every group of a row, and masks exactly when it overruns
    the row."""
    cfg = block_config(launch, 128, groups)
    covered = cfg.grid_size(groups) * cfg.tiles_per_program * cfg.groups_per_tile
    assert groups <= covered < groups + cfg.tiles_per_program * cfg.groups_per_tile
    assert cfg.masked(groups) == (covered != groups)


@pytest.mark.parametrize(
    "group_size, dot_columns", [(32, 16), (128, 16), (128, 64), (128, 128), (512, 16), (512, 128)]
)
def test_signed_hadamard_factorization(group_size, dot_columns):
    """Dots of `dot_columns` plus low-bit butterflies equal x @ (sqrt(G) H_G), the +-1 matrix.

    Tolerance: each output is a G-term sum of +-x_i in fp32 (dot accumulation, then butterflies),
    so its error is at most (G - 1) 2^-24 sum_i |x_i| (recursive summation bound)."""
    x = _x(jax.random.key(3), (6, group_size), jnp.float32)
    cfg = pk.BlockConfig(16, hadamard_dot=dot_columns)
    hblock = jnp.asarray(_tile.hadamard_block(group_size, cfg), jnp.bfloat16)
    got = _tile.signed_hadamard(x, hblock, exact_bf16=False, interpret=True)
    x64 = np.asarray(x, np.float64)
    signs = np.round(codecs.hadamard_matrix(group_size).astype(np.float64) * np.sqrt(group_size))
    bound = (group_size - 1) * FP32_EPS * np.abs(x64).sum(axis=-1, keepdims=True)
    assert np.all(np.abs(np.asarray(got, np.float64) - x64 @ signs) <= bound)


def test_kernels_refuse_buffers_past_32_bit_offsets():
    """A kernel whose operand or result passes `_pallas.MAX_BUFFER_BYTES` is refused with the
    array named (measured on the GPU: past it the kernels return wrong values). Traced only:
    nothing of that size is allocated."""
    rows = jax.ShapeDtypeStruct((2, 1 << 30), jnp.bfloat16)  # 4 GiB
    codec = codecs.get_codec("taco")
    with pytest.raises(
        ValueError, match=r"shape=\(2, 1073741824\) dtype=bfloat16 holds 4294967296"
    ):
        jax.eval_shape(lambda x: encode_kernel.encode(codec, x, interpret=True), rows)
