"""The Mosaic GPU decode, decode-sum and decode-sum-reencode (`pallas_kernels.decode_mosaic`) and
the 8-bit codecs of the Mosaic encode: when they apply, which backend "auto" takes, and that they
compute the references' functions, in Mosaic GPU's CPU interpreter and on a Hopper GPU.

Tolerances: those of test_kernels.py. Decoded values: exact codes through one fp32 Hadamard sum
per row, so within G * 2^-24 of the largest magnitude per summed row (each of the G products is
exact; fp32 accumulation in any order errs by at most G ulps of the running magnitude).
Re-encoded codes: one step apart only at rounding ties. In the interpreter only codes are
checked (it does not alias the fp32 and uint8 views of the side buffer); on the GPU the scales
too. Unwritten bytes: each GPU check decodes two different inputs in a row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import FP32_EPS, _ideal_scaled, _tie_rtol, _x, assert_codes_match

import pallas_kernels as pk
from pallas_kernels import _pallas, config, decode_mosaic, encode_mosaic
from taco_jax import codecs

TILE_ELEMENTS = 64 * 128
# The codecs with 8-bit codes: every one has a Mosaic decode; those with fp32 scales an encode
# and a re-encode. Tiles per row: the fewest whole tiles that fill 8-row TMA boxes of the wire.
MOSAIC_CODECS = {"taco": 2, "taco_e5m2": 2, "taco_no_ds": 4, "fp8": 4, "int8": 4,
                 "int8_hadamard": 4, "taco_e8m0": 16}  # fmt: skip
REENCODE_CODECS = [name for name in MOSAIC_CODECS if name != "taco_e8m0"]
# The interpreter tests run these in the fast tier (float codes, integer codes, E8M0 scales), the
# other codecs in the slow one.
FAST_CODECS = ("taco", "int8_hadamard", "taco_e8m0")


def _tiered(names):
    return [pytest.param(name, marks=() if name in FAST_CODECS else pytest.mark.slow)
            for name in names]  # fmt: skip


hopper = pytest.mark.skipif(not _pallas.hopper_gpu(), reason="needs a Hopper GPU")


def _wire(codec, rows, tiles, seed):
    x = _x(jax.random.key(seed), (rows, tiles * TILE_ELEMENTS), jnp.float32)
    return pk.encode_reference(codec, x), x.shape[1]


def assert_decodes_like_reference(codec, wire, n, decode_fn, sum_fn):
    for dtype in decode_mosaic.OUT_DTYPES:
        got = decode_fn(codec, wire, n, dtype)
        want = pk.decode_reference(codec, wire, n, dtype).astype(jnp.float32)
        assert got.shape == want.shape and got.dtype == dtype
        scale = float(jnp.max(jnp.abs(want)))
        # bf16 output: one bf16 rounding (2^-8 relative) may differ at its own ties.
        atol = scale * (codec.group_size * FP32_EPS if dtype == jnp.float32 else 2.0**-8)
        np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=0, atol=atol)
    total = sum_fn(codec, wire, n, jnp.float32)
    want = pk.decode_sum_reference(codec, wire, n)
    atol = codec.group_size * FP32_EPS * wire.shape[0] * float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(total, want, rtol=0, atol=atol)


def assert_reencodes_like_reference(codec, wire, n, fused, *, scales: bool):
    got = codecs.unpack(codec, fused[None], n)
    want = codecs.unpack(codec, pk.decode_sum_reencode_reference(codec, wire, n)[None], n)
    total = np.asarray(pk.decode_sum_reference(codec, wire, n), np.float64)[None]
    assert_codes_match(codec, got.codes, want.codes, _ideal_scaled(codec, total, want))
    for a, b in ((got.scales, want.scales), (got.prescales, want.prescales)):
        if scales and b is not None:
            np.testing.assert_allclose(a, b, rtol=_tie_rtol(codec.group_size), atol=0)


# ------------------------------------------------------------------------------------------
# Anywhere: what applies, and the backend choice.


@pytest.mark.parametrize(
    "name,group_size,tiles,reencode,reason",
    [
        ("taco", 64, 2, False, "group_size=64"),
        ("int6_hadamard", 128, 2, False, "8-bit codes"),
        ("taco_e8m0", 128, 16, True, "fp32 scales"),
        ("taco", 128, 1, False, "n=8192"),  # 8.5 rows of 1024 bytes: not whole TMA boxes
        ("fp8", 128, 2, False, "n=16384"),
    ],
)
def test_unsupported_names_the_value(name, group_size, tiles, reencode, reason):
    codec = codecs.get_codec(name, group_size)
    n = tiles * 64 * group_size
    assert reason in decode_mosaic.unsupported(codec, n, reencode=reencode, need_hopper=False)


@pytest.mark.parametrize("name,tiles", MOSAIC_CODECS.items())
def test_every_8_bit_codec_applies_from_its_whole_boxes(name, tiles):
    codec = codecs.get_codec(name)
    assert decode_mosaic.unsupported(codec, tiles * TILE_ELEMENTS, need_hopper=False) is None
    x = jax.ShapeDtypeStruct((2, tiles * TILE_ELEMENTS), jnp.bfloat16)
    applies = encode_mosaic.unsupported(codec, x, need_hopper=False) is None
    assert applies == (name in REENCODE_CODECS)


@pytest.mark.skipif(_pallas.hopper_gpu(), reason="checks the error off Hopper")
@pytest.mark.parametrize("op", ["decode", "decode_sum", "decode_sum_reencode"])
def test_mosaic_backend_off_hopper_says_why(op):
    codec = codecs.get_codec("taco")
    wire, n = _wire(codec, 2, 2, 0)
    with pytest.raises(ValueError, match="not a Hopper GPU"):
        getattr(pk, op)(codec, wire, n, backend="mosaic")


def test_backend_errors_name_the_value():
    codec = codecs.get_codec("taco")
    wire, n = _wire(codec, 2, 2, 0)
    with pytest.raises(ValueError, match="backend='cuda'"):
        pk.decode(codec, wire, n, backend="cuda")
    with pytest.raises(ValueError, match="takes no interpret"):
        pk.decode_sum(codec, wire, n, backend="mosaic", interpret=True)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        decode_mosaic.decode(codec, wire, n, jnp.float16, interpret=True)


@pytest.mark.parametrize("op", ["decode", "decode_sum", "decode_sum_reencode"])
def test_auto_takes_mosaic_by_the_size_table(monkeypatch, op):
    """`preferred`'s rule, on any machine: never where `MOSAIC_DECODE_FROM_BYTES[op]` is None
    (the shipped table: the Triton kernels at every size, BENCHMARKS.md "Kernels"), else from
    that many wire bytes on, for the codecs of `MOSAIC_DECODE_CODECS`."""
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    codec = codecs.get_codec("taco")
    wire, n = _wire(codec, 2, 2, 0)
    assert config.MOSAIC_DECODE_FROM_BYTES[op] is None
    assert not decode_mosaic.preferred(op, codec, wire, n)
    monkeypatch.setitem(config.MOSAIC_DECODE_FROM_BYTES, op, wire.size)
    assert decode_mosaic.preferred(op, codec, wire, n)
    assert not decode_mosaic.preferred(op, codec, wire[:1], n)  # fewer bytes than the table's
    other = codecs.get_codec("taco_e5m2")
    assert other.name not in config.MOSAIC_DECODE_CODECS
    assert not decode_mosaic.preferred(op, other, _wire(other, 2, 2, 0)[0], n)


@pytest.mark.parametrize("peers", [2, 8])
def test_pipeline_steps_fit_shared_memory(peers):
    """Each step holds every peer's tile: eight peers' decode-sum keeps one step in flight."""
    codec = codecs.get_codec("taco")
    out_tile = decode_mosaic._out_tile_bytes(jnp.float32)
    n = 512 * TILE_ELEMENTS
    launch = decode_mosaic._launch(None, 1, 512, codec=codec, n=n, peers=peers,
                                   out_tile_bytes=out_tile)  # fmt: skip
    step = peers * (TILE_ELEMENTS + 2 * 64 * 4)  # codes and two fp32 side values per group
    # the fp16 signs, the fp16 tile the codes are upcast into, the fp32 output slots
    fixed = 128 * 128 * 2 + TILE_ELEMENTS * 2 + launch.store_slots * TILE_ELEMENTS * 4
    assert fixed + launch.steps_in_flight * step <= decode_mosaic.SMEM_BUDGET_BYTES
    assert launch.steps_in_flight == (1 if peers == 8 else 2)


# ------------------------------------------------------------------------------------------
# Mosaic GPU's CPU interpreter: the kernels' indexing and arithmetic.


def _interpreted(op):
    fn = getattr(decode_mosaic, op)
    return lambda codec, wire, n, *dtype: fn(codec, wire, n, *dtype, interpret=True)


@pytest.mark.parametrize("name", _tiered(MOSAIC_CODECS))
def test_decodes_in_the_cpu_interpreter(name):
    codec = codecs.get_codec(name)
    wire, n = _wire(codec, 3, MOSAIC_CODECS[name], hash(name) % 1000)
    assert_decodes_like_reference(
        codec, wire, n, _interpreted("decode"), _interpreted("decode_sum")
    )


@pytest.mark.parametrize("name", _tiered(REENCODE_CODECS))
def test_reencoded_codes_in_the_cpu_interpreter(name):
    codec = codecs.get_codec(name)
    wire, n = _wire(codec, 4, MOSAIC_CODECS[name], 5)
    fused = decode_mosaic.decode_sum_reencode(codec, wire, n, interpret=True)
    assert_reencodes_like_reference(codec, wire, n, fused, scales=False)


@pytest.mark.parametrize("name", _tiered(REENCODE_CODECS))
def test_encoded_codes_in_the_cpu_interpreter(name):
    codec = codecs.get_codec(name)
    x = _x(jax.random.key(3), (2, MOSAIC_CODECS[name] * TILE_ELEMENTS), jnp.bfloat16)
    n = x.shape[1]
    wire = encode_mosaic.encode(codec, x, interpret=True)
    want = codecs.unpack(codec, pk.encode_reference(codec, x), n)
    ideal = _ideal_scaled(codec, np.asarray(x, np.float64), want)
    assert_codes_match(codec, np.asarray(wire)[:, :n], want.codes, ideal)


# ------------------------------------------------------------------------------------------
# On a Hopper GPU: the compiled kernels, scales included.


def _on_gpu(op):
    return lambda codec, wire, n, *dtype: getattr(pk, op)(codec, wire, n, *dtype, backend="mosaic")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", MOSAIC_CODECS)
@pytest.mark.parametrize("rows,tiles", [(3, 16), (2, 512)])
def test_matches_reference_on_the_gpu(name, rows, tiles):
    codec = codecs.get_codec(name)
    for seed in range(2):  # two inputs in a row: a skipped byte would keep the first's value
        wire, n = _wire(codec, rows, tiles, hash((name, rows, tiles, seed)) % 2**31)
        assert_decodes_like_reference(codec, wire, n, _on_gpu("decode"), _on_gpu("decode_sum"))
        if name in REENCODE_CODECS:
            fused = pk.decode_sum_reencode(codec, wire, n, backend="mosaic")
            assert_reencodes_like_reference(codec, wire, n, fused, scales=True)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", ["taco", "int8_hadamard", "taco_e8m0"])
def test_nonfinite_groups_stay_visible_on_the_gpu(name):
    codec = codecs.get_codec(name)
    n = MOSAIC_CODECS[name] * TILE_ELEMENTS
    x = _x(jax.random.key(8), (2, n), jnp.float32).at[0, 100].set(jnp.nan)
    wire = pk.encode_reference(codec, x.at[1, n - 1].set(-jnp.inf))
    out = pk.decode(codec, wire, n, backend="mosaic").reshape(2, -1, 128)
    expected = np.zeros(out.shape[:2], bool)
    expected[0, 0] = expected[1, -1] = True
    np.testing.assert_array_equal(np.isnan(out).all(-1), expected)
    assert bool(np.isfinite(out)[~expected].all())
    total = pk.decode_sum(codec, wire, n, backend="mosaic").reshape(-1, 128)
    np.testing.assert_array_equal(np.isnan(total).all(-1), expected.any(0))


@pytest.mark.gpu
@hopper
def test_composes_with_vmap_and_shard_map():
    codec = codecs.get_codec("taco")
    wires = jnp.stack([_wire(codec, 2, 4, seed)[0] for seed in range(3)])
    n = 4 * TILE_ELEMENTS
    decode = lambda w: pk.decode(codec, w, n, backend="mosaic")  # noqa: E731
    decode_sum = lambda w: pk.decode_sum(codec, w, n, backend="mosaic")  # noqa: E731
    for fn in (decode, decode_sum):
        batched = jax.vmap(fn)(wires)
        for b in range(3):
            np.testing.assert_array_equal(batched[b], fn(wires[b]))
    mesh = jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    w = jax.device_put(wires[0], jax.sharding.NamedSharding(mesh, jax.P("tp")))
    sharded = jax.jit(
        jax.shard_map(decode, mesh=mesh, in_specs=jax.P("tp"), out_specs=jax.P("tp"))
    )(w)
    np.testing.assert_array_equal(sharded, decode(wires[0]))
