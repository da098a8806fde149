"""The Mosaic GPU decode, decode-sum and decode-sum-reencode (`pallas_kernels.decode_mosaic`) and
the codecs of the Mosaic encode (8-bit and sub-byte): when they apply, which backend "auto"
takes, and that they compute the references' functions, in Mosaic GPU's CPU interpreter and on
a Hopper GPU.

Tolerances (u = 2^-24):
- Decoded values: a group's output is d times a G-term sum of exact products s_j q_j; a
  recursive fp32 sum errs by at most G u ||q||_1 |d| <= G u sqrt(G) ||q||_2 |d|, and
  ||q||_2 |d| is the RMS of the group's outputs, at most their max. The kernel and the
  reference each err by that, so they differ by at most 2 G^1.5 u of the row's largest value.
  bf16 outputs: rounding may then fall on either side of a tie, one bf16 step, at most 2^-7
  of the largest value.
- Decode-sum of N rows: each decoded row as above, plus N - 1 fp32 additions: at most
  2 (G^1.5 + N) u times the sum over rows of each row's largest decoded value.
- Codes: `assert_codes_match` (test_kernels.py), whose bound TIE_RTOL * qmax also covers the
  re-encode, whose ideal comes from the reference's fp32 sum (N Hadamards and N - 1 additions
  err far less than G^1.5 u of qmax).
In the interpreter only codes are checked (it does not alias the fp32 and uint8 views of the
side buffer); on the GPU the scales too. Unwritten bytes: each GPU check decodes two different
inputs in a row."""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_encode_mosaic import assert_same_under_vmap_and_shard_map
from test_kernels import FP32_EPS, _ideal_scaled, _tie_rtol, _x, assert_codes_match
from tiers import tiered

import pallas_kernels as pk
from pallas_kernels import _pallas, config, decode_mosaic, encode_mosaic
from taco_jax import codecs

TILE_ELEMENTS = 64 * 128
# Every codec has a Mosaic decode and decode-sum; those with fp32 scales an encode; those with
# fp32 scales and 8-bit codes a re-encode and the peer-steps sums. Tiles per row: the fewest
# whole tiles that fill 8-row TMA boxes of the wire.
SUB_BYTE_CODECS = ("int6_hadamard", "int5_hadamard", "int4_hadamard")
MOSAIC_CODECS = {"taco": 2, "taco_e5m2": 2, "taco_no_ds": 4, "fp8": 4, "int8": 4,
                 "int8_hadamard": 4, "taco_e8m0": 16,
                 **dict.fromkeys(SUB_BYTE_CODECS, 4)}  # fmt: skip
REENCODE_CODECS = [n for n in MOSAIC_CODECS if n != "taco_e8m0" and n not in SUB_BYTE_CODECS]
ENCODE_CODECS = [*REENCODE_CODECS, *SUB_BYTE_CODECS]


# The fast tier's codecs (`tiers.tiered`), the others slow: `taco` and `int6_hadamard` (two bit
# planes) lowered for CUDA and their encoded codes interpreted; `taco` alone through the
# interpreted decodes (`int6_hadamard`'s take 11 s on two cores; "auto" takes them only with
# Triton off).
FAST = ("taco", "int6_hadamard")
FAST_DECODES = ("taco",)


hopper = pytest.mark.skipif(not _pallas.hopper_gpu(), reason="needs a Hopper GPU")
SLOW = pytest.mark.slow


def _wire(codec, rows, tiles, seed):
    x = _x(jax.random.key(seed), (rows, tiles * TILE_ELEMENTS), jnp.float32)
    return pk.encode_reference(codec, x), x.shape[1]


def _hadamard_rtol(codec) -> float:
    return 2 * codec.group_size**1.5 * FP32_EPS  # module docstring


def assert_decodes_like_reference(codec, wire, n, decode_fn, sum_fn):
    for dtype in decode_mosaic.OUT_DTYPES:
        got = decode_fn(codec, wire, n, dtype)
        want = pk.decode_reference(codec, wire, n, dtype).astype(jnp.float32)
        assert got.shape == want.shape and got.dtype == dtype
        scale = float(jnp.max(jnp.abs(want)))
        rtol = _hadamard_rtol(codec) + (2.0**-7 if dtype == jnp.bfloat16 else 0.0)
        np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=0, atol=rtol * scale)
    assert_sums_like_reference(codec, wire, n, sum_fn(codec, wire, n, jnp.float32))


def assert_sums_like_reference(codec, wire, n, total):
    want = pk.decode_sum_reference(codec, wire, n)
    rows = pk.decode_reference(codec, wire, n)
    peak_sum = float(jnp.sum(jnp.max(jnp.abs(rows), axis=-1)))
    rtol = _hadamard_rtol(codec) + 2 * wire.shape[0] * FP32_EPS
    np.testing.assert_allclose(total, want, rtol=0, atol=rtol * peak_sum)


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
        ("int6_hadamard", 128, 4, True, "re-encode needs 8-bit codes"),
        ("int6_hadamard", 128, 2, False, "n=16384"),  # 12800 bytes: half a box
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
def test_every_codec_applies_from_its_whole_boxes(name, tiles):
    codec = codecs.get_codec(name)
    assert decode_mosaic.unsupported(codec, tiles * TILE_ELEMENTS, need_hopper=False) is None
    x = jax.ShapeDtypeStruct((2, tiles * TILE_ELEMENTS), jnp.bfloat16)
    applies = encode_mosaic.unsupported(codec, x, need_hopper=False) is None
    assert applies == (name in ENCODE_CODECS)


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
    """`preferred`'s rule, on any machine: never where `MOSAIC_DECODE_FROM_BYTES[op]` is None,
    else from that many wire bytes on (the shipped table, BENCHMARKS.md "Kernels": the decode
    and the two-peer decode-sum from 17 MiB, 32 MiB of bf16; the two-peer re-encode from
    34 MiB, 64 MiB of bf16), for the codecs of `MOSAIC_DECODE_CODECS`."""
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    codec = codecs.get_codec("taco")
    wire, n = _wire(codec, 2, 2, 0)
    shipped = {"decode": 17 << 20, "decode_sum": 17 << 20, "decode_sum_reencode": 34 << 20}[op]
    assert config.MOSAIC_DECODE_FROM_BYTES[op] == shipped
    assert not decode_mosaic.preferred(op, codec, wire, n)  # 34 KiB of wire: below any table
    monkeypatch.setitem(config.MOSAIC_DECODE_FROM_BYTES, op, None)
    assert not decode_mosaic.preferred(op, codec, wire, n)  # None: Triton at every size
    monkeypatch.setitem(config.MOSAIC_DECODE_FROM_BYTES, op, wire.size)
    assert decode_mosaic.preferred(op, codec, wire, n)
    monkeypatch.setitem(config.MOSAIC_DECODE_FROM_BYTES, op, wire.size + 1)
    assert not decode_mosaic.preferred(op, codec, wire, n)  # a byte fewer than the table's
    assert config.MOSAIC_DECODE_CODECS == ("taco", "taco_e5m2")
    other = codecs.get_codec("int8_hadamard")  # Triton's decode measured as fast (BENCHMARKS.md)
    other_wire, other_n = _wire(other, 2, MOSAIC_CODECS[other.name], 0)
    assert decode_mosaic.unsupported(other, other_n, need_hopper=False) is None
    monkeypatch.setitem(config.MOSAIC_DECODE_FROM_BYTES, op, other_wire.size)
    assert not decode_mosaic.preferred(op, other, other_wire, other_n)


@pytest.mark.parametrize("op", ["decode_sum", "decode_sum_reencode"])
def test_auto_takes_the_mosaic_sums_of_two_peers_only(monkeypatch, op):
    """Two peers' decode-sum (one output slot, two programs an SM) measured 1.14-1.26x Triton's
    from 64 MiB, their re-encode level or ahead from 64 MiB; at four and eight peers Triton's
    sums lead at some size from 64 MiB on (`config.MOSAIC_DECODE_SUM_PEERS`,
    `config.MOSAIC_REENCODE_PEERS`)."""
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    codec = codecs.get_codec("taco")
    assert config.MOSAIC_DECODE_SUM_PEERS == config.MOSAIC_REENCODE_PEERS == (2,)
    for peers in (2, 3, 4, 8):
        wire, n = _wire(codec, peers, 2, 0)
        monkeypatch.setitem(config.MOSAIC_DECODE_FROM_BYTES, op, wire.size)
        assert decode_mosaic.preferred(op, codec, wire, n) == (peers == 2), peers


# Shared memory per program (bytes), by hand: a 64 x 128 tile of codes is 8192, its two fp32
# side sections 2 x 256 (`taco`); one step holds one tile per peer it reads. Buffers beside the
# steps: the signs as fp16 (32768) for a Hadamard decode (the codes and the sum's bf16 pieces
# are register operands; a re-encode and peer steps load the codes into registers: no dot
# operand); output slots of 64 x 128 fp32 (32768 each), or of re-encoded tiles (2 x 8192 codes
# + 1024 of side values); peer steps' decode-sum adds the bf16 signs (32768); 8 bytes per
# barrier. 512 tiles in one row take 2 tiles per program (`mosaic_launch`), so at most 2 steps,
# or 2 x N with peer steps. The decode-sum of two peers (every peer a step) keeps one output
# slot and the steps that leave two programs an SM (`config.two_programs_steps`: 115712 - 512
# bytes less its buffers); the peer steps one slot and at most
# `config.MOSAIC_PEER_STEPS_IN_FLIGHT` steps (4 for the decode-sum, 8 for the re-encode).
@pytest.mark.parametrize(
    "op,peers,steps,slots",
    [
        ("decode_sum", 2, 2, 1),  # (115712 - 512 - 65544) // 17408 = 2 leave two programs
        ("decode_sum", 8, 1, 2),  # (204800 - 98312) // 69632 = 1
        ("decode_sum_reencode", 8, 2, 2),  # (204800 - 17408) // 69632 = 2
        ("peer_steps", 8, 4, 1),  # (204800 - 65544) // 8704 = 15 fit; at most 4 in flight
        ("peer_steps_reencode", 8, 8, 1),  # (204800 - 8704) // 8704 = 22 fit; at most 8
    ],
)
def test_pipeline_steps_fit_shared_memory(monkeypatch, op, peers, steps, slots):
    codec = codecs.get_codec("taco")
    n = 512 * TILE_ELEMENTS
    wire = jax.ShapeDtypeStruct((peers, codec.wire_bytes(n)), jnp.uint8)
    launches = _record_launches(monkeypatch)
    if op == "peer_steps":
        jax.eval_shape(lambda w: decode_mosaic.decode_sum(codec, w, n, peer_steps=True), wire)
    elif op == "peer_steps_reencode":
        jax.eval_shape(lambda w: decode_mosaic.decode_sum_reencode(codec, w, n, peer_steps=True),
                       wire)  # fmt: skip
    else:
        jax.eval_shape(lambda w: getattr(decode_mosaic, op)(codec, w, n), wire)
    picked = launches[-1]
    assert (picked.tiles_per_program, picked.steps_in_flight, picked.store_slots) == (
        2, steps, slots)  # fmt: skip


@pytest.mark.parametrize(
    "name,dtype,steps",
    [
        ("int6_hadamard", jnp.bfloat16, 2),  # 96 KiB + 3 x 6400 bytes = 114.8 KiB > 112.5; two fit
        ("int6_hadamard", jnp.float32, 3),  # 128 KiB of matrices and slots: never two programs
        ("int5_hadamard", jnp.bfloat16, 3),  # 96 KiB + 3 x 5376 = 111.8 KiB: two programs
        ("int4_hadamard", jnp.float32, 3),  # 96 KiB + 3 x 4352 = 108.8 KiB
        ("taco", jnp.bfloat16, 3),  # 8-bit codes keep their measured launch
    ],
)
def test_sub_byte_decodes_leave_two_programs_per_sm(monkeypatch, name, dtype, steps):
    """`config.two_programs_steps` with the decode's 0.5 KiB of Mosaic's own (113 KiB in all a
    program); 4096 tiles in 8 rows take 16 tiles a program (`mosaic_launch`). Buffers by hand:
    the unpacking matrices 32 KiB a plane, the output slots 2 x 64 x 128 of `dtype`."""
    codec = codecs.get_codec(name)
    n = 512 * TILE_ELEMENTS
    wire = jax.ShapeDtypeStruct((8, codec.wire_bytes(n)), jnp.uint8)
    launches = _record_launches(monkeypatch)
    jax.eval_shape(lambda w: decode_mosaic.decode(codec, w, n, dtype), wire)
    assert (launches[-1].tiles_per_program, launches[-1].steps_in_flight) == (16, steps)


@pytest.mark.parametrize(
    "peers,dtype,steps,slots",
    [
        (2, jnp.bfloat16, 3, 1),  # 32768 + 8 + 16384 of signs and slot: 66040 // 17408 = 3
        (2, jnp.float32, 2, 1),  # an fp32 slot, 32768: 49656 // 17408 = 2
        (4, jnp.float32, 3, 2),  # two slots as before: (204800 - 98312) // 34816 = 3
    ],
)
def test_the_two_peer_decode_sum_leaves_two_programs_per_sm(monkeypatch, peers, dtype, steps,
                                                            slots):  # fmt: skip
    """The decode-sum of two peers takes one output slot and the steps that leave two programs
    an SM: 115712 - 512 bytes (`config.two_programs_steps`) less the fp16 signs, the slot and
    a barrier, over steps of both peers' tiles (2 x 8704). 4096 tiles in one row take 16 tiles
    a program (`mosaic_launch`), so shared memory alone bounds the steps."""
    codec = codecs.get_codec("taco")
    n = 4096 * TILE_ELEMENTS
    wire = jax.ShapeDtypeStruct((peers, codec.wire_bytes(n)), jnp.uint8)
    launches = _record_launches(monkeypatch)
    jax.eval_shape(lambda w: decode_mosaic.decode_sum(codec, w, n, dtype), wire)
    picked = launches[-1]
    assert (picked.tiles_per_program, picked.steps_in_flight, picked.store_slots) == (
        16, steps, slots)  # fmt: skip


def test_a_given_launch_is_held_to_shared_memory(monkeypatch):
    """A given launch may take more steps than the default's cap, as long as they fit: eight
    peer steps of 8704 bytes beside 65544 fit 204800, sixteen (204808) do not. (That one
    output slot is waited on before its reuse only a GPU shows: the CPU interpreter's stores
    are not asynchronous; `test_matches_reference_on_the_gpu` runs the default ones.)"""
    codec = codecs.get_codec("taco")
    n = 512 * TILE_ELEMENTS
    wire = jax.ShapeDtypeStruct((8, codec.wire_bytes(n)), jnp.uint8)
    launches = _record_launches(monkeypatch)

    def summed(launch):
        return jax.eval_shape(lambda w: decode_mosaic.decode_sum(
            codec, w, n, peer_steps=True, launch=launch), wire)  # fmt: skip

    summed(config.MosaicLaunch(tiles_per_program=2, steps_in_flight=8, store_slots=1))
    assert launches[-1].steps_in_flight == 8
    too_many = config.MosaicLaunch(tiles_per_program=2, steps_in_flight=16, store_slots=1)
    with pytest.raises(ValueError, match="steps_in_flight=16 of 8704 bytes beside 65544"):
        summed(too_many)


def test_byte_side_blocks_take_one_step_in_flight(monkeypatch):
    """`taco_e8m0`'s side blocks are 64 bytes a tile: a second pipeline slot would start off
    TMA's 128-byte alignment (`decode_mosaic.TMA_SMEM_ALIGN`), so its launches take one step
    in flight, and a launch asking for more is refused."""
    codec = codecs.get_codec("taco_e8m0")
    n = 512 * TILE_ELEMENTS
    wire = jax.ShapeDtypeStruct((2, codec.wire_bytes(n)), jnp.uint8)
    launches = _record_launches(monkeypatch)
    for op in ("decode", "decode_sum"):
        jax.eval_shape(lambda w, op=op: getattr(decode_mosaic, op)(codec, w, n), wire)
        assert launches[-1].tiles_per_program > 1 and launches[-1].steps_in_flight == 1
    two_steps = config.MosaicLaunch(tiles_per_program=2, steps_in_flight=2)
    with pytest.raises(ValueError, match="steps_in_flight=2: codec 'taco_e8m0'"):
        jax.eval_shape(lambda w: decode_mosaic.decode(codec, w, n, launch=two_steps), wire)


def _record_launches(monkeypatch) -> list:
    """The launches `decode_mosaic` picks, without building kernels (a Hopper assumed)."""
    launches, pick = [], decode_mosaic._launch

    def recorded(*args, **kwargs):
        launches.append(pick(*args, **kwargs))
        return launches[-1]

    def no_kernel(*args, out_shape, **kwargs):
        return jnp.zeros(out_shape.shape, out_shape.dtype)

    monkeypatch.setattr(decode_mosaic, "_launch", recorded)
    monkeypatch.setattr(_pallas, "mosaic_kernel", no_kernel)
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    return launches


def test_a_step_that_cannot_fit_is_refused():
    codec = codecs.get_codec("taco")
    n = 2 * TILE_ELEMENTS
    wire = jax.ShapeDtypeStruct((32, codec.wire_bytes(n)), jnp.uint8)  # 32 x 8704 bytes a step
    with pytest.raises(ValueError, match="exceeds the 204800 bytes"):
        jax.eval_shape(lambda w: decode_mosaic.decode_sum(codec, w, n, interpret=True), wire)


@pytest.mark.parametrize("name", tiered(MOSAIC_CODECS, FAST))
def test_every_kernel_lowers_for_cuda(monkeypatch, name):
    """Mosaic GPU's lowering (layouts, wgmma operand types, TMA boxes) of every kernel of the
    codec, built for CUDA on any machine: what the interpreter does not check."""
    monkeypatch.setattr(_pallas, "hopper_gpu", lambda: True)
    codec = codecs.get_codec(name)
    n = MOSAIC_CODECS[name] * TILE_ELEMENTS
    wire = jax.ShapeDtypeStruct((4, codec.wire_bytes(n)), jnp.uint8)
    ops = [lambda w: decode_mosaic.decode(codec, w, n, jnp.bfloat16)]
    ops += [lambda w: decode_mosaic.decode_sum(codec, w, n)]
    if name in REENCODE_CODECS:  # fp32 scales and 8-bit codes: the peer-steps sums too
        ops += [lambda w: decode_mosaic.decode_sum(codec, w, n, peer_steps=True)]
        # ... and each tile stored at its place in a product [M, H]
        ops += [lambda w, s=s: decode_mosaic.decode_sum(codec, w, n, jnp.bfloat16, peer_steps=s,
                                                        product=(128, n // 128))
                for s in (0, 1)]  # fmt: skip
        ops += [lambda w, s=s: decode_mosaic.decode_sum_reencode(codec, w, n, peer_steps=s)
                for s in (0, 1)]  # fmt: skip
    if name in ENCODE_CODECS and (
        name not in SUB_BYTE_CODECS or encode_mosaic.PACKED_ENCODE_LOWERS
    ):
        x = jax.ShapeDtypeStruct((4, n), jnp.bfloat16)
        ops += [lambda _: encode_mosaic.encode(codec, jnp.zeros(x.shape, x.dtype))]
    for op in ops:
        text = jax.jit(op).trace(wire).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


# ------------------------------------------------------------------------------------------
# Mosaic GPU's CPU interpreter: the kernels' indexing and arithmetic.


def _interpreted(op):
    fn = getattr(decode_mosaic, op)
    return lambda codec, wire, n, *dtype: fn(codec, wire, n, *dtype, interpret=True)


@pytest.mark.parametrize("name", tiered(MOSAIC_CODECS, FAST_DECODES))
def test_decodes_in_the_cpu_interpreter(name):
    codec = codecs.get_codec(name)
    wire, n = _wire(codec, 3, MOSAIC_CODECS[name], zlib.crc32(name.encode()) % 1000)
    assert_decodes_like_reference(
        codec, wire, n, _interpreted("decode"), _interpreted("decode_sum")
    )


# The re-encode and peer steps, which "auto" takes only with Triton off, run in the slow tier;
# the fast tier lowers them for CUDA (`test_every_kernel_lowers_for_cuda`).
@pytest.mark.parametrize("name", tiered(REENCODE_CODECS, ()))
def test_reencoded_codes_in_the_cpu_interpreter(name):
    codec = codecs.get_codec(name)
    wire, n = _wire(codec, 4, MOSAIC_CODECS[name], 5)
    fused = decode_mosaic.decode_sum_reencode(codec, wire, n, interpret=True)
    assert_reencodes_like_reference(codec, wire, n, fused, scales=False)


@pytest.mark.parametrize("peers,peer_steps", [(2, False), pytest.param(4, True, marks=SLOW)])
def test_a_products_sum_is_stored_in_place_in_the_interpreter(peers, peer_steps):
    """`decode_sum(product=(M, H))` of a wire holding a product's groups in `codecs.tile_major`
    order stores each tile at its place: the same values as the row of tiles put back by
    `codecs.from_tile_major`, bit for bit (only the stores' addresses differ)."""
    codec = codecs.get_codec("taco")
    m, h = 256, 384
    wire, n = _wire(codec, peers, m * h // TILE_ELEMENTS, 11)
    run = dict(interpret=True, peer_steps=peer_steps)
    flat = decode_mosaic.decode_sum(codec, wire, n, jnp.bfloat16, **run)
    placed = decode_mosaic.decode_sum(codec, wire, n, jnp.bfloat16, product=(m, h), **run)
    np.testing.assert_array_equal(placed, codecs.from_tile_major(flat, m, h).reshape(n))
    assert not np.array_equal(placed, flat)  # the tiles did move


def test_a_product_must_be_whole_tiles_of_the_values():
    codec = codecs.get_codec("taco")
    wire, n = _wire(codec, 2, 4, 0)
    for product in ((128, 128), (64, 512)):  # 16384 of 32768 values; rows not whole tiles
        with pytest.raises(ValueError, match=rf"product=\({product[0]}, {product[1]}\)"):
            pk.decode_sum(codec, wire, n, product=product, backend="mosaic")


@pytest.mark.parametrize(
    "name,reason", [("taco_e8m0", "scale_format='e8m0'"), ("int6_hadamard", "element='int6'")]
)
def test_peer_steps_refuse_byte_scales_and_sub_byte_codes(name, reason):
    codec = codecs.get_codec(name)
    wire, n = _wire(codec, 2, MOSAIC_CODECS[name], 9)
    with pytest.raises(ValueError, match=f"'{name}'.*{reason}"):
        decode_mosaic.decode_sum(codec, wire, n, interpret=True, peer_steps=True)


@pytest.mark.parametrize("name", tiered(["taco", "int8_hadamard", "fp8"], ()))
def test_peer_steps_in_the_cpu_interpreter(name):
    """The sums with one peer's tile per pipeline step: the decode-sum (one Hadamard of the sum's
    three bf16 pieces: z to fp32's 24 bits, so within the same bound) and the re-encode."""
    codec = codecs.get_codec(name)
    wire, n = _wire(codec, 4, MOSAIC_CODECS[name], 9)
    total = decode_mosaic.decode_sum(codec, wire, n, interpret=True, peer_steps=True)
    assert_sums_like_reference(codec, wire, n, total)
    # Rounded once to bf16 at the end: within one bf16 step (2^-7 of the largest) of the fp32 sum.
    rounded = decode_mosaic.decode_sum(codec, wire, n, jnp.bfloat16, interpret=True,
                                       peer_steps=True)  # fmt: skip
    assert rounded.dtype == jnp.bfloat16
    np.testing.assert_allclose(rounded.astype(jnp.float32), total, rtol=0,
                               atol=2.0**-7 * float(jnp.max(jnp.abs(total))))  # fmt: skip
    if name in REENCODE_CODECS:
        fused = decode_mosaic.decode_sum_reencode(codec, wire, n, interpret=True, peer_steps=True)
        assert_reencodes_like_reference(codec, wire, n, fused, scales=False)


@pytest.mark.parametrize("name", tiered(ENCODE_CODECS, ("int8_hadamard", "int6_hadamard")))
def test_encoded_codes_in_the_cpu_interpreter(name):
    """The codes as the wire holds them, packed into bit planes for the sub-byte codecs (the
    packing dots, `encode_mosaic.pack_matrix`)."""
    codec = codecs.get_codec(name)
    x = _x(jax.random.key(3), (2, MOSAIC_CODECS[name] * TILE_ELEMENTS), jnp.bfloat16)
    n = x.shape[1]
    wire = encode_mosaic.encode(codec, x, interpret=True)
    want = codecs.unpack(codec, pk.encode_reference(codec, x), n)
    ideal = _ideal_scaled(codec, np.asarray(x, np.float64), want)
    got = codecs.unpack(codec, wire, n).codes  # the interpreter writes no side bytes
    assert_codes_match(codec, np.asarray(got), want.codes, ideal)


@pytest.mark.slow
def test_a_non_finite_group_leaves_its_neighbours_codes_alone_in_the_interpreter():
    """A NaN and an Inf group of `int6_hadamard` (codes NaN through the packing dot: their bytes
    are unspecified, their scales NaN): every other group's codes as the reference's."""
    codec = codecs.get_codec("int6_hadamard")
    x = _x(jax.random.key(4), (2, MOSAIC_CODECS["int6_hadamard"] * TILE_ELEMENTS), jnp.bfloat16)
    x = x.at[0, 5].set(jnp.nan).at[1, 300].set(jnp.inf)  # groups 0 of row 0, 2 of row 1
    n = x.shape[1]
    want = codecs.unpack(codec, pk.encode_reference(codec, x), n)
    got = np.asarray(codecs.unpack(codec, encode_mosaic.encode(codec, x, interpret=True), n).codes)
    finite = np.ones((2, n // 128), bool)
    finite[0, 0] = finite[1, 2] = False
    ideal = _ideal_scaled(codec, np.asarray(x, np.float64), want)
    pick = lambda a: np.asarray(a).reshape(2, -1, 128)[finite]  # noqa: E731
    assert_codes_match(codec, pick(got), pick(want.codes), pick(ideal))


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
        wire, n = _wire(codec, rows, tiles, zlib.crc32(f"{name}-{rows}-{tiles}-{seed}".encode()))
        assert_decodes_like_reference(codec, wire, n, _on_gpu("decode"), _on_gpu("decode_sum"))
        if name in REENCODE_CODECS:
            fused = pk.decode_sum_reencode(codec, wire, n, backend="mosaic")
            assert_reencodes_like_reference(codec, wire, n, fused, scales=True)
        if name not in REENCODE_CODECS:  # peer steps take fp32 scales and 8-bit codes only
            continue
        total = decode_mosaic.decode_sum(codec, wire, n, peer_steps=True)
        assert_sums_like_reference(codec, wire, n, total)
        fused = decode_mosaic.decode_sum_reencode(codec, wire, n, peer_steps=True)
        assert_reencodes_like_reference(codec, wire, n, fused, scales=True)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("name", ["taco", "int8_hadamard", "taco_e8m0", "int6_hadamard"])
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
    for peer_steps in (False, True) if name in REENCODE_CODECS else (False,):
        total = decode_mosaic.decode_sum(codec, wire, n, peer_steps=peer_steps)
        np.testing.assert_array_equal(np.isnan(total.reshape(-1, 128)).all(-1), expected.any(0))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("peers,peer_steps", [(2, False), (4, True)])
def test_a_products_sum_is_stored_in_place_on_the_gpu(peers, peer_steps):
    """The strided TMA stores of `decode_sum(product=)` (each 64 x 128 half tile into rows of
    H values): the row of tiles put back, bit for bit."""
    codec = codecs.get_codec("taco")
    m, h = 512, 768
    wire, n = _wire(codec, peers, m * h // TILE_ELEMENTS, 12)
    flat = decode_mosaic.decode_sum(codec, wire, n, jnp.bfloat16, peer_steps=peer_steps)
    placed = decode_mosaic.decode_sum(codec, wire, n, jnp.bfloat16, peer_steps=peer_steps,
                                      product=(m, h))  # fmt: skip
    np.testing.assert_array_equal(placed, codecs.from_tile_major(flat, m, h).reshape(n))


@pytest.mark.gpu
@hopper
def test_composes_with_vmap_and_shard_map():
    codec = codecs.get_codec("taco")
    wires = jnp.stack([_wire(codec, 2, 4, seed)[0] for seed in range(3)])
    n = 4 * TILE_ELEMENTS
    assert_same_under_vmap_and_shard_map(lambda w: pk.decode(codec, w, n, backend="mosaic"), wires)
    batched = jax.vmap(lambda w: pk.decode_sum(codec, w, n, backend="mosaic"))(wires)
    for b in range(3):
        np.testing.assert_array_equal(
            batched[b], pk.decode_sum(codec, wires[b], n, backend="mosaic")
        )


# ------------------------------------------------------------------------------------------
# The sub-byte kernels' constant matrices, in numpy (exact integers: compared exactly).


@pytest.mark.parametrize("width", [4, 2, 1])
def test_packing_dot_is_pack_bits(width):
    """parts @ pack_matrix.T is `codecs.pack_bits` of the parts, byte for byte."""
    parts = np.random.default_rng(width).integers(0, 1 << width, (64, 128))
    packed = parts @ encode_mosaic.pack_matrix(width).T
    want = np.asarray(codecs.pack_bits(jnp.asarray(parts, jnp.uint8), width))
    np.testing.assert_array_equal(packed, want)


@pytest.mark.parametrize("name", SUB_BYTE_CODECS)
@pytest.mark.parametrize("magic_round", [True, False])
def test_plane_parts_are_the_planes_bits(name, magic_round):
    """`encode_mosaic.plane_parts` of every code c (fp32) is (c >> shift) & (2^width - 1) per
    plane, exactly: by magic rounding in numpy fp32 as on the GPU (XLA on the CPU would fold the
    magic add away), by floor in jnp as in the interpreter."""
    codec = codecs.get_codec(name)
    codes = np.arange(1 << codec.bits)
    values = codes.astype(np.float32) if magic_round else jnp.asarray(codes, jnp.float32)
    planes = codecs.code_planes(codec, 128)
    parts = encode_mosaic.plane_parts(values, planes, codec.bits, magic_round)
    for plane, part in zip(planes, parts, strict=True):
        want = (codes >> plane.shift) & ((1 << plane.width) - 1)
        np.testing.assert_array_equal(np.asarray(part), want.astype(np.float32))


@pytest.mark.parametrize("name", SUB_BYTE_CODECS)
@pytest.mark.parametrize("hadamard", [True, False])
def test_unpacking_dots_are_the_hadamard_of_the_codes(name, hadamard):
    """sum over planes of parts @ `_unpack_matrices` = (codes - offset) @ S (or the codes less
    their offset, without a Hadamard), the parts laid out as `_parts` does: [s (G w / 8) + j]
    = bits [w s, w s + w) of byte j, the top plane's less the offset's share."""
    codec = dataclasses.replace(codecs.get_codec(name), hadamard=hadamard)
    codes = np.random.default_rng(7).integers(1, 1 << codec.bits, (64, 128))
    planes = codecs.code_planes(codec, 128)
    total = 0
    for plane, matrix in zip(planes, decode_mosaic._unpack_matrices(codec), strict=True):
        data = np.asarray(codecs.plane_bytes(jnp.asarray(codes, jnp.uint8), plane), np.int64)
        mask = (1 << plane.width) - 1
        parts = np.concatenate([(data >> (plane.width * s)) & mask
                                for s in range(8 // plane.width)], axis=1)  # fmt: skip
        if plane is planes[-1]:
            parts = parts - (codec.code_offset >> plane.shift)
        total = total + parts @ matrix
    rows = codecs.signs_matrix(128) if hadamard else np.eye(128)
    np.testing.assert_array_equal(total, (codes - codec.code_offset) @ rows)


@pytest.mark.slow
def test_a_sub_byte_codec_without_a_hadamard_decodes_in_the_cpu_interpreter():
    """The unpacking dots by the identity's rows (no sub-byte codec of `codecs` lacks a
    Hadamard; the kernels take one that does)."""
    codec = dataclasses.replace(codecs.get_codec("int6_hadamard"), name="int6", hadamard=False)
    wire, n = _wire(codec, 2, 4, 11)
    assert_decodes_like_reference(
        codec, wire, n, _interpreted("decode"), _interpreted("decode_sum")
    )
