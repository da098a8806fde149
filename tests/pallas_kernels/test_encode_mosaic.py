"""The Mosaic GPU encode (`pallas_kernels.encode_mosaic`): when it applies, and on a Hopper GPU
that it computes the reference's encode.

Tolerances: those of test_kernels.py (codes one step apart only at rounding ties, fp32 scales
within TIE_RTOL).

Unwritten bytes: the Mosaic kernel cannot alias a poisoned output buffer (`plgpu.kernel` has no
input/output aliasing), so each check encodes two different fresh inputs in a row; a byte the
kernel skipped would keep the first call's value and fail the second comparison.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from codec_testing import mixed_magnitudes
from test_kernels import _ideal_scaled, _tie_rtol, _x, assert_codes_match

import pallas_kernels as pk
from pallas_kernels import _pallas, encode_mosaic
from pallas_kernels.config import (
    MOSAIC_MIN_PROGRAMS,
    MOSAIC_MIN_TILES,
    MOSAIC_STEPS_IN_FLIGHT,
    MOSAIC_TILES_PER_PROGRAM,
    MosaicLaunch,
    mosaic_encode_launch,
    mosaic_launch,
)
from taco_jax import codecs

TILE_ELEMENTS = 64 * 128  # one 64-group tile of G = 128

hopper = pytest.mark.skipif(not _pallas.hopper_gpu(), reason="needs a Hopper GPU")


def _x_tiles(key, rows, tiles):
    return _x(key, (rows, tiles * TILE_ELEMENTS), jnp.bfloat16)


@pytest.mark.parametrize(
    "name,group_size,dtype,tiles,reason",
    [
        ("taco", 64, jnp.bfloat16, 2, "group_size=64"),
        ("int6_hadamard", 128, jnp.bfloat16, 2, "n=16384"),  # 12800 wire bytes: half a box
        ("taco_e8m0", 128, jnp.bfloat16, 16, "fp32 scales"),
        ("fp8", 128, jnp.bfloat16, 2, "n=16384"),  # one scale: whole boxes from four tiles
        ("taco", 128, jnp.float32, 2, "dtype=float32"),
    ],
)
def test_unsupported_names_the_value(name, group_size, dtype, tiles, reason):
    codec = codecs.get_codec(name, group_size)
    x = jnp.zeros((2, tiles * 64 * group_size), dtype)
    assert reason in encode_mosaic.unsupported(codec, x)


@pytest.mark.parametrize("n", [TILE_ELEMENTS + 128, TILE_ELEMENTS, 3 * TILE_ELEMENTS])
def test_partial_tiles_and_boxes_are_unsupported(n):
    x = jnp.zeros((2, n), jnp.bfloat16)
    assert f"n={n}" in encode_mosaic.unsupported(codecs.get_codec("taco"), x)


@pytest.mark.skipif(_pallas.hopper_gpu(), reason="checks the error off Hopper")
def test_mosaic_backend_off_hopper_says_why():
    x = jnp.zeros((2, 2 * TILE_ELEMENTS), jnp.bfloat16)
    with pytest.raises(ValueError, match="not a Hopper GPU"):
        pk.encode(codecs.get_codec("taco"), x, backend="mosaic")


def test_auto_prefers_mosaic_only_for_large_calls(monkeypatch):
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)  # the size rule, on any machine
    codec = codecs.get_codec("taco")
    small = jnp.zeros((8, 2 * TILE_ELEMENTS), jnp.bfloat16)
    below = jnp.zeros((8, (MOSAIC_MIN_TILES // 8 - 2) * TILE_ELEMENTS), jnp.bfloat16)
    large = jnp.zeros((8, MOSAIC_MIN_TILES // 8 * TILE_ELEMENTS), jnp.bfloat16)
    for x in (small, below, large):
        assert encode_mosaic.unsupported(codec, x) is None
    assert not encode_mosaic.preferred(codec, small)
    assert not encode_mosaic.preferred(codec, below)  # 16 tiles short (`taco`: pairs a row)
    assert encode_mosaic.preferred(codec, large)


@pytest.mark.parametrize(
    "name", ["taco", "int8_hadamard", "taco_e5m2", "fp8", "int8", "taco_no_ds", "int6_hadamard"]
)
def test_auto_takes_the_codecs_measured_faster(monkeypatch, name):
    """The codecs with a Hadamard measured faster through Mosaic (BENCHMARKS.md, "Kernels"): a
    large call of `taco`, `int8_hadamard` or `taco_e5m2` takes it, the codecs whose Triton
    kernel measured faster (`fp8`, `int8`, `int6_hadamard`) or not yet measured (`taco_no_ds`)
    stay on Triton."""
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    codec = codecs.get_codec(name)
    large = jnp.zeros((8, MOSAIC_MIN_TILES // 8 * TILE_ELEMENTS), jnp.bfloat16)
    assert encode_mosaic.unsupported(codec, large, need_hopper=False) is None
    assert encode_mosaic.preferred(codec, large) == (name in ("taco", "int8_hadamard", "taco_e5m2"))


def test_encode_backend_errors_name_the_value():
    codec, x = codecs.get_codec("taco"), jnp.zeros((2, TILE_ELEMENTS), jnp.bfloat16)
    with pytest.raises(ValueError, match="backend='cuda'"):
        pk.encode(codec, x, backend="cuda")
    with pytest.raises(ValueError, match="takes no interpret"):
        pk.encode(codec, x, backend="mosaic", interpret=True)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("tiles_per_row", [1, 6, 64, 512, 2048])
def test_mosaic_launch_divides_rows_and_fills_the_gpu(rows, tiles_per_row):
    launch = mosaic_launch(rows, tiles_per_row)
    per_program, in_flight = launch.tiles_per_program, launch.steps_in_flight
    assert tiles_per_row % per_program == 0 and per_program & (per_program - 1) == 0
    assert 1 <= in_flight <= per_program
    if per_program == MOSAIC_TILES_PER_PROGRAM:
        assert rows * tiles_per_row // per_program >= MOSAIC_MIN_PROGRAMS
    elif per_program > 1:  # the next larger loop would leave too few programs or not divide
        bigger = 2 * per_program
        assert tiles_per_row % bigger or rows * tiles_per_row // bigger < MOSAIC_MIN_PROGRAMS


@pytest.mark.parametrize(
    "rows,tiles_per_row,per_program",
    [
        (8, 128, 4),  # 16 MiB: 256 programs, one wave of 264
        (8, 192, 6),  # 24 MiB: 4 tiles would make 384 programs (1.45 waves)
        (8, 384, 12),  # 48 MiB: 8 tiles would make 384 programs
        (8, 512, 16),  # 64 MiB: the longest programs, 256 of them
        (8, 768, 12),  # 96 MiB: 512 programs of 12 tiles (0.97 of two waves), not 384 of 16
        (3, 12, 1),  # under a wave: the most programs
        (1, 7, 1),  # a prime number of tiles
    ],
)
def test_mosaic_encode_launch_fills_whole_waves(rows, tiles_per_row, per_program):
    """On 132 SMs (264 programs at once): whole waves, and the longest programs among them.
    Expected by hand from the rule's estimate, occupancy x t / (t + 0.4): e.g. 24 MiB, 6 tiles:
    256 / 264 x 6 / 6.4 = 0.91 against 4 tiles' 384 / 528 x 4 / 4.4 = 0.66."""
    launch = mosaic_encode_launch(rows, tiles_per_row, sms=132)
    assert launch.tiles_per_program == per_program
    assert launch.steps_in_flight == min(MOSAIC_STEPS_IN_FLIGHT, per_program)


def test_mosaic_encode_launch_follows_the_sms():
    """114 SMs (an H100 PCIe: 228 at once) move the waves. 24 MiB of 8 rows, by hand:
    6 tiles 256 / 456 x 6 / 6.4 = 0.53, 4 tiles 384 / 456 x 4 / 4.4 = 0.77, 8 tiles
    192 / 228 x 8 / 8.4 = 0.80 (the most), 1 tile 1536 / 1596 x 1 / 1.4 = 0.69."""
    assert mosaic_encode_launch(8, 192, sms=114).tiles_per_program == 8


def test_default_launch_asks_the_device_for_its_sms(monkeypatch):
    monkeypatch.setattr(_pallas, "hopper_sms", lambda: 114)
    assert encode_mosaic.default_launch(8, 192).tiles_per_program == 8  # as above
    monkeypatch.setattr(_pallas, "hopper_sms", lambda: None)  # off Hopper: an H100 / H200's 132
    assert encode_mosaic.default_launch(8, 192).tiles_per_program == 6


@pytest.mark.parametrize(
    "name,steps", [("int6_hadamard", 2), ("int5_hadamard", 2), ("int4_hadamard", 3), ("taco", 3)]
)
def test_steps_in_flight_leave_two_programs_per_sm(name, steps):
    """`config.two_programs_steps`: a program's shared memory (`encode_scratch`, `pack_scratch`)
    plus 16 KiB a step and Mosaic's own 2 KiB within 113 KiB. By hand, the buffers: signs 32
    KiB, sides 1, per plane of width w 2w KiB of slots and a 4w KiB matrix: int6 69.0 KiB
    (3 steps: 117.0 + 2 > 113; 2: 101.0 + 2), int5 63.0 (111.0 + 2 > 113), int4 57.0 (105.0
    + 2 <= 113: three stay)."""
    launch = encode_mosaic.default_launch(8, 512, codecs.get_codec(name))
    assert (launch.tiles_per_program, launch.steps_in_flight) == (16, steps)


@pytest.mark.parametrize(
    "rows,tiles,launch",
    [
        (1, 2, None),
        (2, 8, MosaicLaunch(4, 3)),
        pytest.param(3, 4, MosaicLaunch(2, 2), marks=pytest.mark.slow),
        # slots that do not divide the tiles
        pytest.param(1, 8, MosaicLaunch(8, 3, store_slots=3), marks=pytest.mark.slow),
    ],
)
def test_codes_in_the_cpu_interpreter(rows, tiles, launch):
    """The kernel's indexing (rows, programs, pipeline steps, store slots) on the CPU. Only the
    codes: the interpreter does not alias the fp32 / uint8 views of the side buffer."""
    codec = codecs.get_codec("taco", 128)
    x = _x_tiles(jax.random.key(rows * 100 + tiles), rows, tiles)
    wire = encode_mosaic.encode(codec, x, interpret=True, launch=launch)
    ref = pk.encode_reference(codec, x)
    n = x.shape[1]
    want = codecs.unpack(codec, ref, n)
    ideal = _ideal_scaled(codec, np.asarray(x, np.float64), want)
    assert_codes_match(codec, np.asarray(wire)[:, :n], want.codes, ideal)


def test_codes_at_every_magnitude_in_the_cpu_interpreter():
    """Groups from 1e-30 to 1e30 side by side (bf16 has fp32's exponent range)."""
    codec = codecs.get_codec("taco", 128)
    x = mixed_magnitudes(jax.random.key(5), (2, 2 * TILE_ELEMENTS), 128, dtype=jnp.bfloat16)
    wire = encode_mosaic.encode(codec, x, interpret=True)
    n = x.shape[1]
    want = codecs.unpack(codec, pk.encode_reference(codec, x), n)
    ideal = _ideal_scaled(codec, np.asarray(x, np.float64), want)
    assert_codes_match(codec, np.asarray(wire)[:, :n], want.codes, ideal)


def test_launch_fields_are_checked():
    with pytest.raises(ValueError, match="store slot"):
        MosaicLaunch(4, 2, store_slots=0)
    with pytest.raises(ValueError, match="step in flight"):
        MosaicLaunch(4, 0)


def test_launch_must_divide_the_row():
    x = jnp.zeros((1, 6 * TILE_ELEMENTS), jnp.bfloat16)
    with pytest.raises(ValueError, match="tiles_per_program=4"):
        encode_mosaic.encode(codecs.get_codec("taco"), x, interpret=True, launch=MosaicLaunch(4, 2))


def assert_encodes_like_reference(codec, x, wire):
    n = x.shape[1]
    ref = pk.encode_reference(codec, x)
    assert wire.shape == ref.shape and wire.dtype == jnp.uint8
    got, want = codecs.unpack(codec, wire, n), codecs.unpack(codec, ref, n)
    ideal = _ideal_scaled(codec, np.asarray(x, np.float64), want)
    # A group's codes count where its factors are finite (`taco_no_ds` has no post-scale).
    factors = want.scales if want.scales is not None else want.prescales
    finite = np.repeat(np.isfinite(np.asarray(factors)), codec.group_size, axis=-1)
    assert_codes_match(codec, np.asarray(got.codes)[finite], np.asarray(want.codes)[finite],
                       ideal[finite])  # fmt: skip
    for a, b in ((got.scales, want.scales), (got.prescales, want.prescales)):
        if b is None:
            assert a is None
        else:
            np.testing.assert_allclose(a, b, rtol=_tie_rtol(codec.group_size), atol=0)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize(
    "name",
    ["taco", "taco_e5m2", "taco_no_ds", "fp8", "int8", "int8_hadamard", "int6_hadamard",
     "int5_hadamard", "int4_hadamard"],
)  # fmt: skip
# Default launches of 1, 2, 3, 6, 12, 15 and 16 tiles a program (`mosaic_encode_launch`).
@pytest.mark.parametrize(
    "rows,tiles", [(3, 4), (3, 12), (8, 64), (8, 96), (8, 192), (8, 384), (8, 480), (8, 512)]
)
def test_matches_reference_on_fresh_data(name, rows, tiles):
    codec = codecs.get_codec(name, 128)
    for seed in range(2):  # two inputs in a row: see the module docstring on unwritten bytes
        x = _x_tiles(
            jax.random.key(zlib.crc32(f"{name}-{rows}-{tiles}-{seed}".encode())), rows, tiles
        )
        assert_encodes_like_reference(codec, x, pk.encode(codec, x, backend="mosaic"))


@pytest.mark.gpu
@hopper
def test_matches_reference_at_every_magnitude():
    codec = codecs.get_codec("taco", 128)
    x = mixed_magnitudes(jax.random.key(6), (3, 4 * TILE_ELEMENTS), 128, dtype=jnp.bfloat16)
    assert_encodes_like_reference(codec, x, pk.encode(codec, x, backend="mosaic"))


@pytest.mark.gpu
@hopper
def test_nonfinite_groups_stay_visible():
    codec = codecs.get_codec("taco", 128)
    x = _x_tiles(jax.random.key(7), 2, 2).at[1, 300].set(jnp.inf).at[0, 5].set(jnp.nan)
    wire = pk.encode(codec, x, backend="mosaic")
    scales = np.asarray(codecs.unpack(codec, wire, x.shape[1]).scales)
    assert np.isnan(scales[0, 0]) and np.isnan(scales[1, 2])
    assert np.isfinite(np.delete(scales.reshape(-1), [0, scales.shape[1] + 2])).all()
    assert_encodes_like_reference(codec, x, wire)


@pytest.mark.gpu
@hopper
def test_auto_picks_mosaic_and_composes_with_vmap_and_shard_map():
    codec = codecs.get_codec("taco", 128)
    big = jnp.zeros((8, MOSAIC_MIN_TILES // 8 * TILE_ELEMENTS), jnp.bfloat16)
    assert "mosaic" in jax.jit(lambda x: pk.encode(codec, x)).lower(big).as_text().lower()
    assert "mosaic" not in jax.jit(lambda x: pk.encode(codec, x)).lower(big[:, :32768]).as_text()
    xs = _x_tiles(jax.random.key(9), 4 * 2, 4).reshape(4, 2, -1)
    assert_same_under_vmap_and_shard_map(lambda x: pk.encode(codec, x, backend="mosaic"), xs)


def assert_same_under_vmap_and_shard_map(fn, xs):
    """fn of each of xs[b], called alone, equals its value under `jax.vmap` over xs and inside a
    one-device `jax.shard_map` (with check_vma=True, the default: the Mosaic kernel's output is
    typed like its input)."""
    batched = jax.vmap(fn)(xs)
    for b in range(xs.shape[0]):
        np.testing.assert_array_equal(batched[b], fn(xs[b]))
    mesh = jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(xs[0], jax.sharding.NamedSharding(mesh, jax.P("tp")))
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=jax.P("tp"), out_specs=jax.P("tp")))(x)
    np.testing.assert_array_equal(sharded, fn(xs[0]))


def test_sub_byte_encode_says_where_it_does_not_lower(monkeypatch):
    """JAX 0.11.2 lowers the sub-byte encode (checked on the GPU); from 0.12 Mosaic GPU's layout
    inference finds no solution for it, which the refusal says instead of searching for
    minutes. The interpreter runs it on either (`need_hopper=False`)."""
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    codec = codecs.get_codec("int6_hadamard")
    x = jnp.zeros((2, 4 * TILE_ELEMENTS), jnp.bfloat16)
    reason = encode_mosaic.unsupported(codec, x)
    if encode_mosaic.PACKED_ENCODE_LOWERS:
        assert reason is None
    else:
        assert f"jax {jax.__version__}" in reason and "layout inference" in reason
    assert encode_mosaic.unsupported(codec, x, need_hopper=False) is None
    assert encode_mosaic.unsupported(codecs.get_codec("taco"), x) is None
