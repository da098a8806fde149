"""The Mosaic GPU kernels (`encode_mosaic`, `decode_mosaic`): what they take, that their launches
fit the GPU and cover every tile, that they lower for CUDA, and that they compute the
references' functions, codes and scale bytes, in Mosaic GPU's CPU interpreter and on a Hopper
GPU.

Tolerances (u = 2^-24):
- Codes and fp32 scales: those of test_kernels.py (`assert_codes_match`: codes one step apart
  only at rounding ties; scales within TIE_RTOL).
- Decoded values: a group's output is d times a G-term sum of exact products s_j q_j; a
  recursive fp32 sum errs by at most G u ||q||_1 |d| <= G u sqrt(G) ||q||_2 |d|, and
  ||q||_2 |d| is the RMS of the group's outputs, at most their max. The kernel and the
  reference each err by that, so they differ by at most 2 G^1.5 u of the row's largest value.
  bf16 outputs: rounding may then fall on either side of a tie, one bf16 step, at most 2^-7
  of the largest value.
- Decode-sum of N rows: each decoded row as above, plus N - 1 fp32 additions: at most
  2 (G^1.5 + N) u times the sum over rows of each row's largest decoded value. The peer-steps
  sum applies one Hadamard to the fp32 sum's three bf16 pieces (z to fp32's 24 bits), within
  the same bound.
Unwritten bytes: `plgpu.kernel` cannot alias a poisoned output, so each GPU check runs two
different inputs in a row; a byte the kernel skipped would keep the first call's value.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from codec_testing import mixed_magnitudes
from test_kernels import FP32_EPS, _ideal_scaled, _tie_rtol, _x, assert_codes_match

import pallas_kernels as pk
from pallas_kernels import _pallas, decode_mosaic, encode_mosaic
from pallas_kernels.encode_mosaic import MosaicConfig
from taco_jax import codecs, target

TILE_ELEMENTS = 64 * 128
CODECS = ("taco", "taco_e5m2", "taco_no_ds")  # the codecs the Mosaic kernels take
TILES = {"taco": 2, "taco_e5m2": 2, "taco_no_ds": 4}  # the fewest whole tiles of whole boxes
# Hopper allows 227 KiB of shared memory a block; what a default launch may take.
HOPPER_SMEM_BYTES = 227 << 10
SLOW = pytest.mark.slow
hopper = pytest.mark.skipif(not target.probe().hopper, reason="needs a Hopper GPU")


def _wire(codec, rows, tiles, seed):
    x = _x(jax.random.key(seed), (rows, tiles * TILE_ELEMENTS), jnp.float32)
    return pk.encode_reference(codec, x), x.shape[1]


def _hadamard_rtol(codec) -> float:
    return 2 * codec.group_size**1.5 * FP32_EPS  # module docstring


def assert_encodes_like_reference(codec, x, wire):
    """Codes (where their group is finite) and scale bytes as the reference's."""
    n = x.shape[1]
    ref = pk.encode_reference(codec, x)
    assert wire.shape == ref.shape and wire.dtype == jnp.uint8
    got, want = codecs.unpack(codec, wire, n), codecs.unpack(codec, ref, n)
    ideal = _ideal_scaled(codec, np.asarray(x, np.float64), want)
    factors = want.scales if want.scales is not None else want.prescales
    finite = np.repeat(np.isfinite(np.asarray(factors)), codec.group_size, axis=-1)
    assert_codes_match(
        codec, np.asarray(got.codes)[finite], np.asarray(want.codes)[finite], ideal[finite]
    )
    for a, b in ((got.scales, want.scales), (got.prescales, want.prescales)):
        if b is None:
            assert a is None
        else:
            np.testing.assert_allclose(a, b, rtol=_tie_rtol(codec.group_size), atol=0)


def assert_decodes_like_reference(codec, wire, n, got, dtype):
    want = pk.decode_reference(codec, wire, n, dtype).astype(jnp.float32)
    assert got.shape == want.shape and got.dtype == dtype
    scale = float(jnp.max(jnp.abs(want)))
    rtol = _hadamard_rtol(codec) + (2.0**-7 if dtype == jnp.bfloat16 else 0.0)
    np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=0, atol=rtol * scale)


def assert_sums_like_reference(codec, wire, n, total):
    want = pk.decode_sum_reference(codec, wire, n)
    rows = pk.decode_reference(codec, wire, n)
    peak_sum = float(jnp.sum(jnp.max(jnp.abs(rows), axis=-1)))
    rtol = _hadamard_rtol(codec) + 2 * wire.shape[0] * FP32_EPS
    np.testing.assert_allclose(total, want, rtol=0, atol=rtol * peak_sum)


def assert_reencodes_like_reference(codec, wire, n, fused):
    got = codecs.unpack(codec, fused[None], n)
    want = codecs.unpack(codec, pk.decode_sum_reencode_reference(codec, wire, n)[None], n)
    total = np.asarray(pk.decode_sum_reference(codec, wire, n), np.float64)[None]
    assert_codes_match(codec, got.codes, want.codes, _ideal_scaled(codec, total, want))
    for a, b in ((got.scales, want.scales), (got.prescales, want.prescales)):
        if b is not None:
            np.testing.assert_allclose(a, b, rtol=_tie_rtol(codec.group_size), atol=0)


# ------------------------------------------------------------------------------------------
# What the kernels take, and their launches.


@pytest.mark.parametrize(
    "name,group_size,tiles,reason",
    [
        ("taco", 64, 2, "group_size=64"),
        ("int8_hadamard", 128, 4, "element='int8'"),
        ("int6_hadamard", 128, 4, "element='int6'"),
        ("taco_e8m0", 128, 16, "scale_format='e8m0'"),
        ("fp8", 128, 4, "hadamard=False"),
        ("taco", 128, 1, "n=8192"),  # 8.5 rows of 1024 bytes: not whole TMA boxes
        ("taco_no_ds", 128, 2, "n=16384"),  # one scale a group: whole boxes from four tiles
    ],
)
def test_unsupported_names_the_value(name, group_size, tiles, reason):
    codec = codecs.get_codec(name, group_size)
    assert reason in encode_mosaic.unsupported(codec, tiles * 64 * group_size)


@pytest.mark.parametrize("name", CODECS)
def test_row_multiple_is_the_fewest_whole_tiles_that_fit(name):
    codec = codecs.get_codec(name)
    multiple = encode_mosaic.row_multiple(codec)
    assert multiple == TILES[name] * TILE_ELEMENTS
    for k in (1, 3, 64):
        assert encode_mosaic.unsupported(codec, k * multiple) is None
    for n in range(TILE_ELEMENTS, multiple, TILE_ELEMENTS):
        assert encode_mosaic.unsupported(codec, n) is not None


@pytest.mark.parametrize("sms", [None, 114, 132])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("tiles_per_row", [2, 6, 7, 64, 192, 512, 2048])
def test_encode_launches_cover_every_tile_and_fit(sms, rows, tiles_per_row):
    """Each program takes whole tiles of one row (tiles_per_program divides the row, so the
    grid covers each tile exactly once), no more steps in flight than tiles, and the program's
    shared memory fits a Hopper block."""
    config = encode_mosaic.default_config(rows, tiles_per_row, sms=sms)
    assert tiles_per_row % config.tiles_per_program == 0
    assert 1 <= config.steps_in_flight <= config.tiles_per_program
    tile_bytes = TILE_ELEMENTS * 2
    smem = _pallas.smem_bytes(encode_mosaic.encode_scratch(config.store_slots))
    assert smem + config.steps_in_flight * tile_bytes <= HOPPER_SMEM_BYTES


@pytest.mark.parametrize(
    "op,peers,peer_steps",
    [("decode", 2, False), ("decode", 8, False)]
    + [(op, p, s) for op in ("decode_sum", "decode_sum_reencode") for p in (2, 8) for s in (0, 1)],
)
@pytest.mark.parametrize("tiles", [2, 8, 512, 4096])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_launches_cover_every_tile_and_fit(monkeypatch, op, peers, peer_steps, tiles, dtype):
    """Every default launch divides the row's tiles, keeps its steps within the program's and
    its shared memory within the budget (checked inside, `_check_fits`), built for a Hopper
    GPU without building a kernel."""
    configs = _record_configs(monkeypatch)
    codec = codecs.get_codec("taco")
    n = tiles * TILE_ELEMENTS
    wire = jax.ShapeDtypeStruct((peers, codec.wire_bytes(n)), jnp.uint8)
    kwargs = {} if op == "decode" else {"peer_steps": bool(peer_steps)}
    args = () if op == "decode_sum_reencode" else (dtype,)
    jax.eval_shape(lambda w: getattr(decode_mosaic, op)(codec, w, n, *args, **kwargs), wire)
    (config,) = configs
    assert tiles % config.tiles_per_program == 0
    steps = config.tiles_per_program * (peers if peer_steps else 1)
    assert 1 <= config.steps_in_flight <= steps


def _record_configs(monkeypatch) -> list:
    """The configs `decode_mosaic` launches with, without building kernels."""
    configs = []

    def no_kernel(body, *args, out_shape, **kwargs):
        configs.append(body.keywords["config"])
        return jnp.zeros(out_shape.shape, out_shape.dtype)

    monkeypatch.setattr(_pallas, "mosaic_kernel", no_kernel)
    return configs


def test_configs_are_checked():
    with pytest.raises(ValueError, match="store slot"):
        MosaicConfig(4, 2, store_slots=0)
    with pytest.raises(ValueError, match="step in flight"):
        MosaicConfig(4, 0)
    x = jnp.zeros((1, 6 * TILE_ELEMENTS), jnp.bfloat16)
    with pytest.raises(ValueError, match="tiles_per_program=4 must divide the 6 tiles"):
        encode_mosaic.encode(codecs.get_codec("taco"), x, interpret=True, config=MosaicConfig(4, 2))


def test_a_launch_past_shared_memory_is_refused():
    codec = codecs.get_codec("taco")
    n = 2 * TILE_ELEMENTS
    wire = jax.ShapeDtypeStruct((32, codec.wire_bytes(n)), jnp.uint8)  # 32 x 8704 bytes a step
    with pytest.raises(ValueError, match="more than the 204800"):
        jax.eval_shape(lambda w: decode_mosaic.decode_sum(codec, w, n, interpret=True), wire)
    big = MosaicConfig(tiles_per_program=2, steps_in_flight=32, store_slots=1)
    wire = jax.ShapeDtypeStruct((8, codec.wire_bytes(n)), jnp.uint8)
    with pytest.raises(ValueError, match="more than the 204800"):
        jax.eval_shape(
            lambda w: decode_mosaic.decode_sum(codec, w, n, peer_steps=True, config=big), wire
        )


@pytest.mark.parametrize("name", CODECS)
def test_every_kernel_lowers_for_cuda(name):
    """Mosaic GPU's lowering (layouts, wgmma operand types, TMA boxes) of every kernel, built
    for CUDA on any machine: what the interpreter does not check."""
    codec = codecs.get_codec(name)
    n = TILES[name] * TILE_ELEMENTS
    wire = jax.ShapeDtypeStruct((4, codec.wire_bytes(n)), jnp.uint8)
    ops = [lambda w: decode_mosaic.decode(codec, w, n, jnp.bfloat16)]
    for steps in (False, True):
        ops += [lambda w, s=steps: decode_mosaic.decode_sum(codec, w, n, peer_steps=s)]
        ops += [lambda w, s=steps: decode_mosaic.decode_sum_reencode(codec, w, n, peer_steps=s)]
    ops += [lambda _: encode_mosaic.encode(codec, jnp.zeros((4, n), jnp.bfloat16))]
    for op in ops:
        text = jax.jit(op).trace(wire).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


# ------------------------------------------------------------------------------------------
# Mosaic GPU's CPU interpreter: the kernels' indexing and arithmetic, scale bytes included.


@pytest.mark.parametrize(
    "name,rows,tiles,config",
    [
        ("taco", 1, 2, None),
        ("taco", 2, 8, MosaicConfig(4, 3)),
        pytest.param("taco_e5m2", 2, 2, None, marks=SLOW),
        pytest.param("taco_no_ds", 2, 4, None, marks=SLOW),
        pytest.param("taco", 3, 4, MosaicConfig(2, 2), marks=SLOW),
        pytest.param("taco", 1, 8, MosaicConfig(8, 3, store_slots=3), marks=SLOW),
    ],
)
def test_encodes_in_the_cpu_interpreter(name, rows, tiles, config):
    codec = codecs.get_codec(name)
    x = _x(jax.random.key(rows * 100 + tiles), (rows, tiles * TILE_ELEMENTS), jnp.bfloat16)
    wire = encode_mosaic.encode(codec, x, interpret=True, config=config)
    assert_encodes_like_reference(codec, x, wire)


def test_encodes_every_magnitude_and_non_finite_groups_in_the_cpu_interpreter():
    """Groups from 1e-30 to 1e30 side by side (bf16 has fp32's exponent range), and a NaN and
    an Inf group whose scales stay NaN while their neighbours' are as the reference's."""
    codec = codecs.get_codec("taco")
    x = mixed_magnitudes(jax.random.key(5), (2, 2 * TILE_ELEMENTS), 128, dtype=jnp.bfloat16)
    x = x.at[1, 300].set(jnp.inf).at[0, 5].set(jnp.nan)
    wire = encode_mosaic.encode(codec, x, interpret=True)
    scales = np.asarray(codecs.unpack(codec, wire, x.shape[1]).scales)
    assert np.isnan(scales[0, 0]) and np.isnan(scales[1, 2])
    assert np.isfinite(np.delete(scales.reshape(-1), [0, scales.shape[1] + 2])).all()
    assert_encodes_like_reference(codec, x, wire)


@pytest.mark.parametrize("name", ["taco", pytest.param("taco_no_ds", marks=SLOW)])
def test_decodes_in_the_cpu_interpreter(name):
    codec = codecs.get_codec(name)
    wire, n = _wire(codec, 3, TILES[name], zlib.crc32(name.encode()) % 1000)
    for dtype in decode_mosaic.OUT_DTYPES:
        got = decode_mosaic.decode(codec, wire, n, dtype, interpret=True)
        assert_decodes_like_reference(codec, wire, n, got, dtype)
    assert_sums_like_reference(
        codec, wire[:2], n, decode_mosaic.decode_sum(codec, wire[:2], n, interpret=True)
    )


@pytest.mark.parametrize("peers,peer_steps", [(2, False), pytest.param(4, True, marks=SLOW)])
def test_sums_in_the_cpu_interpreter(peers, peer_steps):
    """The decode-sum (fp32, and rounded once to bf16: within one bf16 step, 2^-7 of the
    largest, of the fp32 sum) and the re-encode, codes and scales."""
    codec = codecs.get_codec("taco")
    wire, n = _wire(codec, peers, 2, 9)
    run = dict(interpret=True, peer_steps=peer_steps)
    total = decode_mosaic.decode_sum(codec, wire, n, **run)
    assert_sums_like_reference(codec, wire, n, total)
    rounded = decode_mosaic.decode_sum(codec, wire, n, jnp.bfloat16, **run)
    assert rounded.dtype == jnp.bfloat16
    atol = 2.0**-7 * float(jnp.max(jnp.abs(total)))
    np.testing.assert_allclose(rounded.astype(jnp.float32), total, rtol=0, atol=atol)
    fused = decode_mosaic.decode_sum_reencode(codec, wire, n, **run)
    assert_reencodes_like_reference(codec, wire, n, fused)


# ------------------------------------------------------------------------------------------
# On a Hopper GPU: the compiled kernels.


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", CODECS)
# Default launches of 1 to 16 tiles a program (`encode_mosaic.default_config`).
@pytest.mark.parametrize("rows,tiles", [(3, 4), (3, 12), (8, 64), (8, 192), (8, 480), (8, 512)])
def test_encodes_like_the_reference_on_the_gpu(name, rows, tiles):
    codec = codecs.get_codec(name)
    for seed in range(2):  # two inputs in a row: see the module docstring on unwritten bytes
        key = jax.random.key(zlib.crc32(f"{name}-{rows}-{tiles}-{seed}".encode()))
        x = _x(key, (rows, tiles * TILE_ELEMENTS), jnp.bfloat16)
        assert_encodes_like_reference(codec, x, encode_mosaic.encode(codec, x))
    x = mixed_magnitudes(jax.random.key(6), (3, 4 * TILE_ELEMENTS), 128, dtype=jnp.bfloat16)
    x = x.at[1, 300].set(jnp.inf)
    assert_encodes_like_reference(codec, x, encode_mosaic.encode(codec, x))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("rows,tiles", [(2, 16), (4, 16), (8, 512)])
def test_decodes_like_the_reference_on_the_gpu(name, rows, tiles):
    codec = codecs.get_codec(name)
    for seed in range(2):  # two inputs in a row: a skipped byte would keep the first's value
        wire, n = _wire(codec, rows, tiles, zlib.crc32(f"{name}-{rows}-{tiles}-{seed}".encode()))
        for dtype in decode_mosaic.OUT_DTYPES:
            assert_decodes_like_reference(
                codec, wire, n, decode_mosaic.decode(codec, wire, n, dtype), dtype
            )
        for peer_steps in (False, True):
            total = decode_mosaic.decode_sum(codec, wire, n, peer_steps=peer_steps)
            assert_sums_like_reference(codec, wire, n, total)
            fused = decode_mosaic.decode_sum_reencode(codec, wire, n, peer_steps=peer_steps)
            assert_reencodes_like_reference(codec, wire, n, fused)


@pytest.mark.gpu
@hopper
def test_nonfinite_groups_stay_visible_on_the_gpu():
    codec = codecs.get_codec("taco")
    n = 2 * TILE_ELEMENTS
    x = _x(jax.random.key(8), (2, n), jnp.float32).at[0, 100].set(jnp.nan)
    wire = pk.encode_reference(codec, x.at[1, n - 1].set(-jnp.inf))
    out = decode_mosaic.decode(codec, wire, n).reshape(2, -1, 128)
    expected = np.zeros(out.shape[:2], bool)
    expected[0, 0] = expected[1, -1] = True
    np.testing.assert_array_equal(np.isnan(out).all(-1), expected)
    assert bool(np.isfinite(out)[~expected].all())
    for peer_steps in (False, True):
        total = decode_mosaic.decode_sum(codec, wire, n, peer_steps=peer_steps)
        np.testing.assert_array_equal(np.isnan(total.reshape(-1, 128)).all(-1), expected.any(0))


@pytest.mark.gpu
@hopper
def test_composes_with_vmap_and_shard_map():
    codec = codecs.get_codec("taco")
    xs = _x(jax.random.key(9), (4, 2, 4 * TILE_ELEMENTS), jnp.bfloat16)
    assert_same_under_vmap_and_shard_map(lambda x: encode_mosaic.encode(codec, x), xs)
    wires = jnp.stack([_wire(codec, 2, 4, seed)[0] for seed in range(3)])
    n = 4 * TILE_ELEMENTS
    assert_same_under_vmap_and_shard_map(lambda w: decode_mosaic.decode(codec, w, n), wires)
    for peer_steps in (False, True):
        fn = lambda w, s=peer_steps: decode_mosaic.decode_sum(codec, w, n, peer_steps=s)  # noqa: E731
        batched = jax.vmap(fn)(wires)
        for b in range(3):
            np.testing.assert_array_equal(batched[b], fn(wires[b]))


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
