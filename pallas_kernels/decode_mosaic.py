"""Decode, decode-sum and decode-sum-reencode on Hopper through Mosaic GPU, G = 128.

The same functions as the Triton-lowered `decode_kernel.decode` and `decode_sum_kernel`
(and so as `codecs.decode_wire`, `codecs.decode_sum_wire`, `codecs.decode_sum_reencode_wire`,
up to fp32 rounding; re-encoded codes up to rounding ties), for the codecs whose codes are one
byte (`taco`, `taco_e8m0`, `taco_e5m2`, `taco_no_ds`, `fp8`, `int8`, `int8_hadamard`); the
decode and decode-sum also for the sub-byte ones (`int6_hadamard`, `int5_hadamard`,
`int4_hadamard`), whose bit planes are unpacked on the way into the dot (`_unpack_matrices`).

Why the tensor cores: a decode is S q x d per group (S the +-1 Sylvester matrix, d the group's
factor `codecs.decode_factor`). TMA loads a tile of 64 groups of codes into swizzled shared
memory and one 64 x 128 x 128 wgmma multiplies it by S (staged once per program), exactly:
every code and sign is exact and the accumulator sums 128 products. INT8 codes are wgmma
operands as they are (int32 sums). FP8 codes are not: Hopper's FP8 wgmma keeps only ~14 bits
of its sums (`_hadamard_in_fp16`), so they are loaded into registers as fp16 (which holds
every E4M3 and E5M2 value), the register operand of an fp16 wgmma accumulating in fp32.
Codecs without a Hadamard need no dot: their codes are loaded from the tile into registers
through fp16 (exact) in the accumulator's layout. The decode-sum runs one dot per peer (each
peer's exact codes, as `config.TWO_PEERS_DOT`); the decode-sum-reencode needs no Hadamard
(H H = I: the sum is re-encoded where it is, in the Hadamard domain), so it sums and encodes
the tiles in the layout of their 8-bit loads, with no shuffle into the wgmma layout
(`_pallas.load_widened`; at eight peers 1.1x faster with peer steps, 1.2x with all peers'
tiles in one step).

Measured against the Triton kernels (`config.MOSAIC_DECODE_FROM_BYTES`): the decode, and the
decode-sum of two peers (one output slot, so that two programs share an SM), are faster from
32 MiB, the re-encode of two peers level from 64 MiB and faster from 128 MiB; the decode-sum
and re-encode of eight peers are slower at every size: each pipeline step holds every peer's
tile, so few steps fit in flight, and the decode-sum runs a Hadamard per peer.
`peer_steps=True` runs them with one peer's tile per step instead, the sum carried in
registers across a tile's N steps, in the layout of the 8-bit loads, and, for the
decode-sum, one Hadamard of the sum (`_summed_body`; only its three bf16 pieces take the
shuffle into the wgmma layout), with one output slot (a tile is stored once every N steps, so
its slot is free again long before) and more steps in flight
(`config.MOSAIC_PEER_STEPS_IN_FLIGHT`): faster than one step per tile from 64 MiB; at eight
peers the decode-sum ahead of Triton at 64 MiB and level from 256 MiB (bf16 out: 1-2 points
behind there), the re-encode level to 256 MiB and behind at 1 GiB (docs/development_history.md,
"One output slot", "The Mosaic sums' launches", "The peer-steps decode-sum in the layout of
its loads"). Their shared
memory decides how many programs share an SM: up to 77 KiB for the peer-steps re-encode
(eight 8.5 KiB steps), 98 KiB for the peer-steps decode-sum with an fp32 output (four steps,
the signs, one slot): two programs; the sums of eight peers with a step per tile 120-165 KiB: one.

A decode-sum of a product's groups in `codecs.tile_major` order (`decode_sum(product=)`, the
all-reduce of `matmul_encode`) stores each tile at its place in the product [M, H] (a TMA store
of 64 rows of one 128-column group): the product's sum in row-major order, no transpose after.

The wire row is read through views XLA makes without a copy (bitcasts of the uint8 row): the
codes as [W / 128, 128] of the code type (sub-byte codes: per bit plane its bytes as
[W / (G w / 8), G w / 8], a group's a row), the fp32 side sections as [W / 4] fp32 and the E8M0
ones as [W] bytes, each tile's side values one 1-D block. Outputs are stored by the kernel
itself, not by the pipeline (whose predicated stores Mosaic GPU's CPU interpreter cannot run),
so that CI runs these kernels too. Rows must hold whole tiles and fill whole 8-row TMA boxes of
the codes view (`unsupported`: `taco` from two tiles, one-scale codecs four, `taco_e8m0` 16).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _pallas, encode_mosaic
from pallas_kernels.config import (
    MOSAIC_DECODE_CODECS,
    MOSAIC_DECODE_FROM_BYTES,
    MOSAIC_DECODE_SUM_PEERS,
    MOSAIC_GROUPS_PER_TILE,
    MOSAIC_PEER_STEPS_FROM_BYTES,
    MOSAIC_PEER_STEPS_FROM_PEERS,
    MOSAIC_PEER_STEPS_IN_FLIGHT,
    MOSAIC_REENCODE_PEERS,
    MOSAIC_STEPS_IN_FLIGHT,
    MosaicLaunch,
    mosaic_launch,
    two_programs_steps,
)
from taco_jax import codecs
from taco_jax.codecs import Codec

GROUP_SIZE = encode_mosaic.GROUP_SIZE
ROW_BYTES = encode_mosaic.ROW_BYTES
_TILE = MOSAIC_GROUPS_PER_TILE
# The dtype TMA loads each code element as (INT8 codes: also the Hadamard dot's operand).
CODE_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2, "int8": jnp.int8}
# Sub-byte codes, read as the uint8 bytes of their bit planes (`_unpack_matrices`).
PACKED_ELEMENTS = ("int6", "int5", "int4")
OUT_DTYPES = (jnp.float32, jnp.bfloat16)


def unsupported(codec: Codec, n: int, *, reencode: bool = False, need_hopper: bool = True):
    """Why these kernels cannot decode rows of `n` elements coded with `codec` (None: they can).

    reencode: for `decode_sum_reencode`, whose re-encode stores fp32 side sections only, of
      8-bit codes."""
    if codec.group_size != GROUP_SIZE:
        return f"group_size={codec.group_size} (needs {GROUP_SIZE})"
    if codec.element not in CODE_DTYPES and codec.element not in PACKED_ELEMENTS:
        return (
            f"codec {codec.name!r} with element={codec.element!r} (needs 8-bit codes: "
            f"{', '.join(CODE_DTYPES)}; or {', '.join(PACKED_ELEMENTS)})"
        )
    if reencode and _packed(codec):
        return f"codec {codec.name!r} (the re-encode needs 8-bit codes)"
    if reencode and codec.scale_format != "fp32":
        return f"codec {codec.name!r} (the re-encode needs fp32 scales)"
    reason = encode_mosaic.unfit_row(codec, n)
    if reason is not None:
        return reason
    if need_hopper and not _pallas.hopper_gpu():
        return "the default device is not a Hopper GPU (wgmma)"
    return None


def unsupported_call(op: str, codec: Codec, wire: jax.Array, n: int, dtype=jnp.float32):
    """Why the Mosaic kernel of `op` ("decode", "decode_sum", "decode_sum_reencode") cannot take
    this call (None: it can): `unsupported`, or output dtype, or wire rank."""
    if op != "decode_sum_reencode" and jnp.dtype(dtype) not in OUT_DTYPES:
        return f"{dtype=} (writes one of {[jnp.dtype(d).name for d in OUT_DTYPES]})"
    if wire.ndim != 2:
        return f"wire of shape={wire.shape} (needs rows [R, B])"
    return unsupported(codec, n, reencode=op == "decode_sum_reencode")


def preferred(op: str, codec: Codec, wire: jax.Array, n: int, dtype=jnp.float32) -> bool:
    """Whether "auto" takes the Mosaic kernel of `op` ("decode", "decode_sum",
    "decode_sum_reencode"): it applies, the codec is one of `config.MOSAIC_DECODE_CODECS`,
    a sum has the peers of its table (`config.MOSAIC_DECODE_SUM_PEERS`,
    `config.MOSAIC_REENCODE_PEERS`), and the call moves at least
    `config.MOSAIC_DECODE_FROM_BYTES[op]` bytes of wire (None: Triton at every size)."""
    threshold = MOSAIC_DECODE_FROM_BYTES[op]
    if threshold is None or codec.name not in MOSAIC_DECODE_CODECS:
        return False
    if unsupported_call(op, codec, wire, n, dtype) is not None:
        return False
    peers = {"decode_sum": MOSAIC_DECODE_SUM_PEERS, "decode_sum_reencode": MOSAIC_REENCODE_PEERS}
    if op in peers and wire.shape[0] not in peers[op]:
        return False
    return wire.size >= threshold


def kernel_for(op: str, backend: str, triton_options: bool, codec, wire, n, dtype=jnp.float32):
    """`_pallas.kernel_for` of the public `op` ("decode", "decode_sum", "decode_sum_reencode")
    on this call: "mosaic", "triton" or "reference"."""
    return _pallas.kernel_for(
        op,
        backend,
        triton_options=triton_options,
        preferred=lambda: preferred(op, codec, wire, n, dtype),
        unsupported=lambda: unsupported_call(op, codec, wire, n, dtype),
    )


def peer_steps_apply(codec: Codec) -> bool:
    """Whether the sums of `codec` can take `peer_steps`: fp32 scales and 8-bit codes."""
    return codec.scale_format == "fp32" and not _packed(codec)


def default_peer_steps(op: str, codec: Codec, wire: jax.Array) -> bool:
    """Whether the public ops' Mosaic sum ("decode_sum", "decode_sum_reencode") of wire[N, B]
    takes `peer_steps`: where it applies, from `config.MOSAIC_PEER_STEPS_FROM_PEERS` peers, the
    re-encode always and the decode-sum from `config.MOSAIC_PEER_STEPS_FROM_BYTES` of wire
    (the measurements: there)."""
    if not peer_steps_apply(codec) or wire.shape[0] < MOSAIC_PEER_STEPS_FROM_PEERS:
        return False
    return op == "decode_sum_reencode" or wire.size >= MOSAIC_PEER_STEPS_FROM_BYTES


def decode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret: bool = False,
    launch: MosaicLaunch | None = None,
) -> jax.Array:
    """wire[R, codec.wire_bytes(n)] -> x[R, n] of `dtype` (ValueError where `unsupported`).

    interpret: Mosaic GPU's CPU interpreter (tests). launch: tiles per program and pipeline
    steps in flight; default `mosaic_launch`, with the steps that fit shared memory.
    """
    _check(codec, wire, n, dtype, interpret=interpret)
    return _decoded_rows(codec, wire, n, dtype, interpret, launch, rows_summed=False)


def decode_sum(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret: bool = False,
    launch: MosaicLaunch | None = None,
    peer_steps: bool = False,
    product: tuple[int, int] | None = None,
) -> jax.Array:
    """wire[N, B] -> [n] of `dtype`: the fp32 sum of the N decoded rows, in peer order, rounded
    once to `dtype` (as `decode`).

    product: (M, H) where the wire holds an [M, H] product's groups in `codecs.tile_major` order
      (`matmul_encode_mosaic`): each decoded tile is stored at its place, so the output is the
      product's sum in row-major order, `codecs.from_tile_major` of the sum without the
      transpose.

    peer_steps: one peer's tile per pipeline step, summed in the Hadamard domain and one dot on
      the sum (`_summed_body`), instead of every peer's tile per step and a dot per peer; for
      codecs with fp32 side sections and 8-bit codes (ValueError else: `taco_e8m0`'s byte
      blocks allow one step in flight, `TMA_SMEM_ALIGN`, which would leave peer steps nothing
      to overlap; sub-byte codes are several blocks a tile, which the peer steps' one block of
      `CODE_DTYPES` does not read)."""
    _check(codec, wire, n, dtype, interpret=interpret)
    if peer_steps and not peer_steps_apply(codec):
        raise ValueError(
            f"peer_steps=True takes codecs with fp32 scales and 8-bit codes, not {codec.name!r} "
            f"(scale_format={codec.scale_format!r}, element={codec.element!r}); use "
            "peer_steps=False"
        )
    check_product(product, n)
    if peer_steps:
        out = _summed(codec, wire, n, dtype, interpret=interpret, launch=launch, product=product)
        return out.reshape(n)
    out = _decoded_rows(codec, wire, n, dtype, interpret, launch, rows_summed=True,
                        product=product)  # fmt: skip
    return out.reshape(n)


def check_product(product, n: int) -> None:
    """ValueError unless `product` is None or (M, H), whole 128 x 128 tiles of n values."""
    if product is None:
        return
    m, h = product
    tile = codecs.PRODUCT_TILE
    if m * h != n or m % tile or h % tile:
        raise ValueError(
            f"product={product} must be whole {tile} x {tile} tiles of the n={n} decoded values"
        )


def _out_struct(n: int, dtype, product) -> jax.ShapeDtypeStruct:
    """The decode-sum's output: one row of tiles [1, n / G, G], or the product [M, H / G, G]."""
    if product is None:
        return jax.ShapeDtypeStruct((1, n // GROUP_SIZE, GROUP_SIZE), dtype)
    m, h = product
    return jax.ShapeDtypeStruct((m, h // GROUP_SIZE, GROUP_SIZE), dtype)


def _tile_place(out, tile, product):
    """Where decoded tile `tile` (64 groups) goes: 64 rows of the row of tiles `out` [n / G, G],
    or, for a product's groups in `codecs.tile_major` order (`out` [M, H / G, G]), one half of a
    128 x 128 tile: 64 rows of one column group."""
    if product is None:
        return out.at[_pallas.ds(_TILE * tile, _TILE)]
    halves = codecs.PRODUCT_TILE // _TILE
    block, half = tile // halves, lax.rem(tile, halves)
    columns = product[1] // GROUP_SIZE
    row_block, column = block // columns, lax.rem(block, columns)
    return out.at[_pallas.ds(row_block * codecs.PRODUCT_TILE + half * _TILE, _TILE), column]


def _decoded_rows(codec, wire, n, dtype, interpret, launch, *, rows_summed, product=None):
    """The decode (rows [R, n]) or, rows_summed, the decode-sum ([1, n], or a product's
    [M, H] in place: `decode_sum`) kernel's launch."""
    rows, groups = wire.shape[0], n // GROUP_SIZE
    out_rows, peers = (1, rows) if rows_summed else (rows, 1)
    dot = codec.hadamard or _packed(codec)  # sub-byte codes: a dot by `_unpack_matrices`
    scratch_of = lambda lc: _scratch(codec, dtype, lc, dot=dot, staged=interpret)  # noqa: E731
    # A sub-byte decode, and the 8-bit decode-sum of two peers, take the steps that leave two
    # programs an SM: a sub-byte decode's matrices are large; the decode-sum stores a tile once
    # a step of both peers' tiles, so one output slot serves it, and two programs of one slot
    # ran 1.3x faster than one of two slots (bf16; docs/development_history.md, "The Mosaic
    # sums' launches"). More peers keep two slots: there two programs would leave one step.
    two_peer_sum = rows_summed and not _packed(codec) and peers in MOSAIC_DECODE_SUM_PEERS
    launch = _launch(
        codec, launch, out_rows, groups // _TILE, scratch_of, _step_bytes(codec, n, peers),
        store_slots=1 if two_peer_sum else 2,
        two_programs=two_peer_sum or (_packed(codec) and not rows_summed),
    )  # fmt: skip
    body = _pallas.partial(_decode_body, codec=codec, n=n, launch=launch,
                           rows_summed=rows_summed, product=product)  # fmt: skip
    op = "decode_sum" if rows_summed else "decode"
    rows_out = jax.ShapeDtypeStruct((out_rows, groups, GROUP_SIZE), dtype)
    out = _pallas.mosaic_kernel(
        body,
        *_wire_views(codec, wire),
        *_dot_operands(codec),
        out_shape=rows_out if product is None else _out_struct(n, dtype, product),
        scratch=scratch_of(launch),
        grid=(out_rows, (groups // _TILE) // launch.tiles_per_program),
        grid_names=("row", "program"),
        name=f"taco_{op}_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return out.reshape(out_rows, n)


def decode_sum_reencode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    *,
    interpret: bool = False,
    launch: MosaicLaunch | None = None,
    peer_steps: bool = False,
) -> jax.Array:
    """wire[N, B] -> wire[B] holding encode(sum of the N decoded rows) (as `decode_sum`)."""
    _check(codec, wire, n, None, interpret=interpret, reencode=True)
    if peer_steps:
        return _summed(codec, wire, n, None, interpret=interpret, launch=launch)
    groups, peers = n // GROUP_SIZE, wire.shape[0]
    scratch_of = lambda lc: _scratch(codec, None, lc, dot=False)  # noqa: E731
    launch = _launch(codec, launch, 1, groups // _TILE, scratch_of, _step_bytes(codec, n, peers))
    body = _pallas.partial(_reencode_body, codec=codec, n=n, launch=launch,
                           magic_round=not interpret)  # fmt: skip
    wire_rows = codec.wire_bytes(n) // ROW_BYTES
    out = _pallas.mosaic_kernel(
        body,
        *_wire_views(codec, wire),
        out_shape=jax.ShapeDtypeStruct((wire_rows, ROW_BYTES), jnp.uint8),
        scratch=scratch_of(launch),
        grid=((groups // _TILE) // launch.tiles_per_program,),
        grid_names=("program",),
        name=f"taco_decode_sum_reencode_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return out.reshape(wire_rows * ROW_BYTES)


def _check(codec, wire, n, dtype, *, interpret, reencode=False):
    reason = unsupported(codec, n, reencode=reencode, need_hopper=not interpret)
    if reason is not None:
        raise ValueError(f"the Mosaic GPU decode cannot take {reason}")
    if wire.ndim != 2 or wire.shape[1] != codec.wire_bytes(n) or wire.dtype != jnp.uint8:
        raise ValueError(
            f"wire shape={wire.shape} dtype={wire.dtype} is not uint8[R, {codec.wire_bytes(n)}] "
            f"for {n=} and codec {codec.name!r}"
        )
    if dtype is not None and jnp.dtype(dtype) not in OUT_DTYPES:
        raise ValueError(f"the Mosaic GPU decode writes float32 or bfloat16, not {dtype=}")


# Shared memory a program may take (the H100/H200 allow 227 KiB per block; some is Mosaic's).
SMEM_BUDGET_BYTES = 200 * 1024


# TMA writes shared memory from 128-byte aligned addresses. A pipeline rotates each block
# through one slot per step in flight, so a block of one tile's side values must fill whole
# 128-byte units to have more than one slot: fp32 ones do (256 bytes), `taco_e8m0`'s E8M0 bytes
# (64) do not; their second slot faulted on an H200 with a misaligned address.
TMA_SMEM_ALIGN = 128


def _one_step_only(codec: Codec) -> bool:
    """Whether the side blocks of `codec` allow only one pipeline step in flight (see
    `TMA_SMEM_ALIGN`)."""
    return any(_TILE * width % TMA_SMEM_ALIGN for _, width in codec.side_fields)


def _launch(codec, launch, rows, tiles_per_row, scratch_of, step_bytes, steps_per_tile=1,
            steps_cap=MOSAIC_STEPS_IN_FLIGHT, store_slots=2, two_programs=False):  # fmt: skip
    """The given launch, or by default `mosaic_launch`'s tiles per program with `store_slots`
    output slots and as many pipeline steps in flight as fit `SMEM_BUDGET_BYTES` beside the kernel's
    own shared memory (`scratch_of` the launch), each step holding `step_bytes`: at most
    `steps_cap` (one where `_one_step_only(codec)`) and the program's tiles x
    `steps_per_tile`, and with `two_programs` no more than leave room for two programs per SM
    (`config.two_programs_steps`). Raises ValueError where the steps do not fit, the tiles per
    program do not divide a row's tiles, or a given launch has more steps in flight than the
    codec's side blocks allow. In the CPU interpreter the kernels' own shared memory includes
    the tiles their register operands are staged through, so there a launch may take fewer
    steps, or refuse a peer count a GPU takes."""
    base = launch or dataclasses.replace(mosaic_launch(rows, tiles_per_row),
                                         store_slots=store_slots)  # fmt: skip
    fixed = _pallas.smem_bytes(scratch_of(base))
    if fixed + step_bytes > SMEM_BUDGET_BYTES:
        raise ValueError(
            f"one pipeline step of {step_bytes} bytes beside {fixed} bytes of buffers exceeds "
            f"the {SMEM_BUDGET_BYTES} bytes of shared memory a program may take"
        )
    if launch is None:
        fits = (SMEM_BUDGET_BYTES - fixed) // step_bytes
        most = 1 if _one_step_only(codec) else steps_cap
        steps = min(most, base.tiles_per_program * steps_per_tile, fits)
        if two_programs:  # `config.two_programs_steps`
            steps = two_programs_steps(fixed, step_bytes, steps, "decode")
        launch = MosaicLaunch(base.tiles_per_program, steps, base.store_slots)
    if fixed + launch.steps_in_flight * step_bytes > SMEM_BUDGET_BYTES:
        raise ValueError(
            f"steps_in_flight={launch.steps_in_flight} of {step_bytes} bytes beside {fixed} "
            f"bytes of buffers exceed the {SMEM_BUDGET_BYTES} bytes of shared memory a "
            "program may take"
        )
    if launch.steps_in_flight > 1 and _one_step_only(codec):
        raise ValueError(
            f"steps_in_flight={launch.steps_in_flight}: codec {codec.name!r}'s side blocks of "
            f"{_TILE} x {min(w for _, w in codec.side_fields)} bytes take one step in flight "
            f"(TMA writes from {TMA_SMEM_ALIGN}-byte aligned addresses)"
        )
    if tiles_per_row % launch.tiles_per_program:
        raise ValueError(
            f"tiles_per_program={launch.tiles_per_program} must divide the {tiles_per_row} "
            "tiles of a row"
        )
    return launch


def _step_bytes(codec: Codec, n: int, peers: int) -> int:
    """Shared memory of one pipeline step: `peers` tiles of codes and their side values."""
    side_bytes = sum(_TILE * s.width for s in codecs.wire_sections(codec, n))
    return peers * (_TILE * GROUP_SIZE * codec.bits // 8 + side_bytes)


def _wire_views(codec: Codec, wire: jax.Array) -> tuple[jax.Array, ...]:
    """The wire rows [R, W] as the kernels read them (bitcasts: no copies): the codes as
    [R, W / 128, 128] of `CODE_DTYPES` (sub-byte codes: per bit plane of width w the bytes as
    [R, W / (G w / 8), G w / 8], a group's bytes of it a row), then one view per side section
    ([R, W / 4] fp32 for fp32 sections, the bytes [R, W] for E8M0 exponents)."""
    rows, width = wire.shape
    if _packed(codec):
        views = [wire.reshape(rows, width // b, b) for b in _plane_group_bytes(codec)]
    else:
        codes = lax.bitcast_convert_type(wire, CODE_DTYPES[codec.element])
        views = [codes.reshape(rows, width // ROW_BYTES, ROW_BYTES)]
    for _, side_width in codec.side_fields:
        if side_width == 4:
            words = wire.reshape(rows, width // 4, 4)
            views.append(lax.bitcast_convert_type(words, jnp.float32))
        else:
            views.append(wire)
    return tuple(views)


def _hadamard_in_fp16(codec: Codec) -> bool:
    """Whether a dot by the +-1 matrix takes the codes through fp16: FP8 codes. Hopper's FP8
    wgmma keeps only about 14 bits of its running sum (DeepSeek-V3, arXiv:2412.19437, section
    3.3.2), so a 128-term Hadamard of FP8 codes would err by ~2^-13; the fp16 wgmma accumulates
    in fp32, and fp16 holds every E4M3 and E5M2 value exactly (the hardware converts FP8 to
    fp16, not to bf16). INT8 codes sum exactly in int32: they stay 8-bit."""
    return codec.hadamard and codec.element != "int8"


def _dot_operands(codec: Codec) -> tuple[jax.Array, ...]:
    """The decode's dot operand: for a codec with a Hadamard the +-1 Sylvester matrix, in the
    type wgmma pairs with the codes (INT8 with INT8 codes, fp16 where FP8 codes are upcast:
    exact); none without (the codes are loaded into registers through fp16: `_decoded`)."""
    if _packed(codec):
        return tuple(jnp.asarray(m, jnp.bfloat16) for m in _unpack_matrices(codec))
    if not codec.hadamard:
        return ()
    return (jnp.asarray(codecs.signs_matrix(GROUP_SIZE), _dot_dtype(codec)),)


def _dot_count(codec: Codec) -> int:
    """How many operands `_dot_operands` gives `codec`."""
    return len(_plane_group_bytes(codec)) if _packed(codec) else int(codec.hadamard)


def _packed(codec: Codec) -> bool:
    return codec.element in PACKED_ELEMENTS


def _plane_group_bytes(codec: Codec) -> list[int]:
    """Bytes of each code plane of `codec` per group: G w / 8."""
    return [encode_mosaic.group_bytes(p) for p in codecs.code_planes(codec, GROUP_SIZE)]


def _unpack_matrices(codec: Codec) -> list[np.ndarray]:
    """Per code plane of a sub-byte codec, the [G, G] operand that takes its parts to the
    Hadamard of the codes: the dot is linear in the parts, so the decode of a tile is
    sum over planes of parts @ M (exact in bf16 and fp32: parts < 2^4, entries +-2^shift,
    sums of 128 integers < 2^12).

    A plane of width w holds 8 / w parts per byte (`codecs.pack_bits`: code k = j 8 / w + s
    in bits [w s, w s + w) of byte j). The kernel lays its parts out as [64, G], column
    c = s (G w / 8) + j (`_parts`); row c of M is then 2^shift times row k of the signs S
    (of the identity without a Hadamard). The offset of the codes (`Codec.code_offset`, a
    multiple of 2^shift of the top plane) is taken off that plane's parts instead."""
    rows = codecs.signs_matrix(GROUP_SIZE) if codec.hadamard else np.eye(GROUP_SIZE)
    matrices = []
    for plane in codecs.code_planes(codec, GROUP_SIZE):
        per_byte = 8 // plane.width
        s, j = np.divmod(np.arange(GROUP_SIZE), GROUP_SIZE // per_byte)
        matrices.append(2.0**plane.shift * rows[j * per_byte + s])
    return matrices


def _parts(codec: Codec, plane_smems, staged_smem=None) -> list:
    """Per code plane, its parts of one tile as a [64, G] bf16 operand (`_unpack_matrices`):
    the bytes [64, G w / 8] split into their 8 / w parts, side by side; the top plane's less
    the codes' offset. staged_smem: [planes, 64, G] tiles they go through (the CPU
    interpreter, which reads wgmma operands from refs)."""
    planes = codecs.code_planes(codec, GROUP_SIZE)
    out = []
    for plane, plane_smem in zip(planes, plane_smems, strict=True):
        data = _pallas.load_tile(plane_smem).astype(jnp.int32)  # Mosaic shifts no 8-bit values
        mask = (1 << plane.width) - 1
        parts = [(data >> (plane.width * s)) & mask for s in range(8 // plane.width)]
        a = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        if plane is planes[-1]:
            a = a - (codec.code_offset >> plane.shift)
        a = a.astype(jnp.bfloat16)
        if staged_smem is not None:
            a = _pallas.staged(a, staged_smem.at[len(out)])
        out.append(a)
    return out


def _dot_dtype(codec: Codec):
    return jnp.float16 if _hadamard_in_fp16(codec) else jnp.int8


def _acc_dtype(codec: Codec):
    """wgmma's accumulator for 8-bit operands: int32 for INT8, fp32 for FP8 (and fp16)."""
    return jnp.int32 if codec.element == "int8" else jnp.float32


def _scratch(codec: Codec, dtype, launch: MosaicLaunch, *, dot: bool, staged=False) -> list:
    """Where `dot` (a Hadamard decode), its operand (`_dot_operands`) and load barrier and,
    `staged` with FP8 codes, the fp16 tile they go through (`_decoded`); then the output's
    slots: `launch.store_slots` decoded tiles of `dtype`, or (dtype None) the re-encoded tiles
    of `encode_mosaic`."""
    refs = []
    if dot and _packed(codec):  # a matrix per plane (`_unpack_matrices`)
        planes = len(_plane_group_bytes(codec))
        for _ in range(planes):
            refs += [_pallas.smem((GROUP_SIZE, GROUP_SIZE), jnp.bfloat16, swizzled=True),
                     _pallas.barrier()]  # fmt: skip
        if staged:
            refs.append(_pallas.smem((planes, _TILE, GROUP_SIZE), jnp.bfloat16, swizzled=True))
    elif dot:
        refs += [_pallas.smem((GROUP_SIZE, GROUP_SIZE), _dot_dtype(codec), swizzled=True),
                 _pallas.barrier()]  # fmt: skip
        if staged and _hadamard_in_fp16(codec):
            refs.append(_pallas.smem((_TILE, GROUP_SIZE), jnp.float16, swizzled=True))
    if dtype is None:
        return refs + encode_mosaic.encode_scratch(launch.store_slots)[2:]
    return refs + [_pallas.smem((launch.store_slots, _TILE, GROUP_SIZE), dtype)]


def _side_start(section) -> int:
    """The index, in blocks of one tile's side values, of a side section's first block."""
    return section.offset // section.width // _TILE  # whole tiles: `unsupported`


def _tile_specs(codec: Codec, n: int, first, peers: int) -> list:
    """Pipeline blocks of one tile: per peer its codes (swizzled for wgmma), then each side
    section's 64 values; `first` is the program's first tile."""
    if _packed(codec):  # a block of each plane: 64 groups' bytes of it (`_wire_views`)
        code_blocks = [
            _pallas.block((_TILE, b), lambda i, s=p.offset // b // _TILE: (s + first + i, 0),
                          dtype=jnp.uint8)
            for p, b in zip(codecs.code_planes(codec, n), _plane_group_bytes(codec), strict=True)
        ]  # fmt: skip
    else:
        code_blocks = [_pallas.block(
            (_TILE, GROUP_SIZE), lambda i: (first + i, 0), swizzled=True,
            dtype=CODE_DTYPES[codec.element],
        )]  # fmt: skip
    starts = [_side_start(section) for section in codecs.wire_sections(codec, n)]
    side_blocks = [_pallas.block((_TILE,), lambda i, s=s: (s + first + i,)) for s in starts]
    return [*code_blocks, *side_blocks] * peers


def _peer_refs(views, row):
    """Per peer (the rows of the views: the N peers of a decode-sum, or row `row` alone), its
    codes and side views, in `_tile_specs` order."""
    if row is not None:
        return [view.at[row] for view in views]
    peers = views[0].shape[0]
    return [view.at[p] for p in range(peers) for view in views]


def _decoded(codec, code_smem, side_smem, dot_smem, sections, unit, staged_smem=None,
             widened=False):  # fmt: skip
    """One peer's tile: its codes times the Hadamard dot operand `dot_smem` (exact) or, with
    none, the codes themselves, scaled by its decode factor (`codecs.decode_factor` with
    `unit`), fp32. staged_smem: an fp16 tile FP8 codes go through on their way to the dot,
    for Mosaic GPU's CPU interpreter, which reads wgmma operands from refs only. Sub-byte
    codes: `code_smem` and `dot_smem` hold a block and a matrix per plane (`_parts`).
    widened (no dot): the tile in the layout of its 8-bit load (`_pallas.NARROW_LOAD`), not a
    wgmma accumulator's, for the re-encodes, which take it into no wgmma."""
    rows_layout = _pallas.NARROW_LOAD if widened else _pallas.ACCUMULATOR
    if widened:
        assert dot_smem is None and not _packed(codec), "widened: 8-bit codes, no dot"
        v = _pallas.load_widened(code_smem)
    elif _packed(codec):
        parts = _parts(codec, code_smem, staged_smem)
        v = _pallas.wgmma_sum(list(zip(parts, dot_smem, strict=True)), (_TILE, GROUP_SIZE))
    elif dot_smem is None:
        # Into registers through fp16 (which holds every E4M3, E5M2 and INT8 code), in a
        # wgmma accumulator's layout, so the scaling and sums below take either. A dot by the
        # identity did the same no faster (docs/development_history.md), in more memory.
        v = _pallas.load_upcast(code_smem, jnp.float16)
    elif _hadamard_in_fp16(codec):  # FP8 codes: an fp16 register operand (exact)
        a = _pallas.load_upcast(code_smem, jnp.float16)
        if staged_smem is not None:
            a = _pallas.staged(a, staged_smem)
        v = _pallas.wgmma(a, dot_smem, (_TILE, GROUP_SIZE))
    else:
        v = _pallas.wgmma_transposed(code_smem, dot_smem, (_TILE, GROUP_SIZE), _acc_dtype(codec))
    pairs = zip(sections, side_smem, strict=True)
    sides = {s.field: _pallas.load_rows(r, rows_layout) for s, r in pairs}
    d = codecs.decode_factor(codec, sides.get("scales"), sides.get("prescales"), unit)
    return codecs.scale_rows(v.astype(jnp.float32), d)


def _peer_sum(codec, blocks, dot_smem, n, unit, staged_smem=None, widened=False):
    """The sum, in peer order, of the decoded tiles of `blocks` (codes, then side sections,
    per peer: `_tile_specs`); widened: as `_decoded`."""
    sections = codecs.wire_sections(codec, n)
    code_blocks = len(_plane_group_bytes(codec)) if _packed(codec) else 1
    per_peer = code_blocks + len(sections)
    total = None
    for p in range(len(blocks) // per_peer):
        peer_blocks = blocks[p * per_peer : (p + 1) * per_peer]
        code_smem, side_smem = peer_blocks[:code_blocks], peer_blocks[code_blocks:]
        code_smem = code_smem if _packed(codec) else code_smem[0]
        x = _decoded(codec, code_smem, side_smem, dot_smem, sections, unit, staged_smem, widened)
        total = x if total is None else total + x
    return total


def _decode_body(*refs, codec, n, launch, rows_summed, product=None):
    """One program: `launch.tiles_per_program` consecutive tiles of one row (decode) or of the
    sum of all rows (decode-sum), stored into the output row."""
    code_views = len(_plane_group_bytes(codec)) if _packed(codec) else 1
    views = refs[: code_views + len(codec.side_fields)]  # `_wire_views`
    dots = _dot_count(codec)
    dot_gmems, (out_gmem, *scratch) = (
        refs[len(views) : len(views) + dots],
        refs[len(views) + dots :],
    )
    dot_smems, barriers, (*staged, out_smem) = (
        scratch[: 2 * dots : 2],
        scratch[1 : 2 * dots : 2],
        scratch[2 * dots :],
    )
    for gmem, smem, barrier in zip(dot_gmems, dot_smems, barriers, strict=True):
        _pallas.copy_in(gmem, smem, barrier)
    dot_smem = (dot_smems if _packed(codec) else dot_smems[0]) if dots else None
    staged_smem = staged[0] if staged else None
    row = None if rows_summed else lax.axis_index("row")
    peers = views[0].shape[0] if rows_summed else 1
    first = lax.axis_index("program") * launch.tiles_per_program
    unit = codecs.hadamard_unit(GROUP_SIZE) if codec.hadamard else 1.0
    out = out_gmem if product is not None else out_gmem.at[0 if rows_summed else row]

    def step(index, *blocks):
        (i,) = index
        total = _peer_sum(codec, blocks, dot_smem, n, unit, staged_smem)
        _store_decoded(out_smem, _tile_place(out, first + i, product), first + i, total)

    _pallas.pipeline(
        step,
        steps=launch.tiles_per_program,
        in_specs=_tile_specs(codec, n, first, peers),
        out_specs=[],
        in_flight=launch.steps_in_flight,
    )(*_peer_refs(views, row))
    _pallas.wait_stores(0)


def _store_decoded(out_smem, destination, tile, x):
    """TMA-stores one decoded tile into `destination` (`_tile_place`) through the slots of
    `out_smem` (slot = tile mod S; waiting until at most S - 1 stores are pending frees the slot
    of S tiles ago)."""
    slots = out_smem.shape[0]
    slot = lax.rem(tile, slots)
    _pallas.wait_stores(slots - 1)
    out_smem[slot] = x.astype(out_smem.dtype)
    _pallas.commit_smem()
    _pallas.copy_out(out_smem.at[slot], destination)


def _reencode_body(*refs, codec, n, launch, magic_round):
    """One program: the sum of the N peers' tiles, in the Hadamard domain, re-encoded and
    stored into the wire row as `encode_mosaic` stores."""
    *views, out_gmem, codes_smem, sides = refs
    first = lax.axis_index("program") * launch.tiles_per_program
    layout = encode_mosaic.WireLayout.of(codec, n)

    def step(index, *blocks):
        (i,) = index
        z = _peer_sum(codec, blocks, None, n, unit=1.0, widened=True)
        encode_mosaic.encode_and_store(codec, z, 1.0, ([codes_smem], sides), [out_gmem],
                                       first + i, layout, magic_round)  # fmt: skip

    _pallas.pipeline(
        step,
        steps=launch.tiles_per_program,
        in_specs=_tile_specs(codec, n, first, views[0].shape[0]),
        out_specs=[],
        in_flight=launch.steps_in_flight,
    )(*_peer_refs(views, None))
    _pallas.wait_stores(0)


# ------------------------------------------------------------------------------------------
# Peer steps: one peer's tile per pipeline step, the sum carried in registers across a tile's
# N steps, so that a step holds one tile whatever N (more steps in flight) and a tile costs N
# register loads plus, for the decode-sum, one Hadamard of the sum.


def _summed(codec, wire, n, dtype, *, interpret, launch, product=None):
    """decode_sum (dtype given) or decode_sum_reencode (dtype None) with peer steps."""
    peers, groups = wire.shape[0], n // GROUP_SIZE
    reencode = dtype is None
    hadamard = codec.hadamard and not reencode  # the re-encode stays in the Hadamard domain
    scratch_of = lambda lc: _summed_scratch(codec, dtype, lc, hadamard=hadamard,  # noqa: E731
                                            staged=interpret)  # fmt: skip
    op = "decode_sum_reencode" if reencode else "decode_sum"
    # One output slot: a tile is stored once every N steps, so the store that last read the
    # slot was issued N steps before (docs/development_history.md, "One output slot").
    launch = _launch(codec, launch, 1, groups // _TILE, scratch_of,
                     _step_bytes(codec, n, peers=1), steps_per_tile=peers,
                     steps_cap=MOSAIC_PEER_STEPS_IN_FLIGHT[op], store_slots=1)  # fmt: skip
    operands = []
    if hadamard:  # the +-1 matrix in bf16, for the sum's three bf16 pieces
        operands.append(jnp.asarray(codecs.signs_matrix(GROUP_SIZE), jnp.bfloat16))
    if reencode:
        out_shape = jax.ShapeDtypeStruct((codec.wire_bytes(n) // ROW_BYTES, ROW_BYTES), jnp.uint8)
    else:
        out_shape = _out_struct(n, dtype, product)
    body = _pallas.partial(_summed_body, codec=codec, n=n, launch=launch, peers=peers,
                           hadamard=hadamard, reencode=reencode, staged=interpret,
                           magic_round=not interpret, product=product)  # fmt: skip
    out = _pallas.mosaic_kernel(
        body,
        *_wire_views(codec, wire),
        *operands,
        out_shape=out_shape,
        scratch=scratch_of(launch),
        grid=((groups // _TILE) // launch.tiles_per_program,),
        grid_names=("program",),
        name=f"taco_{op}_peer_steps_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return out.reshape(-1)


def _summed_scratch(codec, dtype, launch, *, hadamard: bool, staged: bool) -> list:
    """For a Hadamard of the sum, the bf16 +-1 matrix and its load barrier and, where
    `staged`, a tile for the sum's three bf16 pieces (`_pallas.wgmma_of_pieces`); then
    `_scratch` without a dot per peer."""
    refs = []
    if hadamard:
        refs += [
            _pallas.smem((GROUP_SIZE, GROUP_SIZE), jnp.bfloat16, swizzled=True),
            _pallas.barrier(),
        ]
        if staged:
            refs.append(_pallas.smem((3, _TILE, GROUP_SIZE), jnp.bfloat16, swizzled=True))
    return refs + _scratch(codec, dtype, launch, dot=False)


def _peer_step_specs(codec: Codec, n: int, first) -> list:
    """Pipeline blocks of step (i, p): peer p's codes of tile first + i (swizzled for wgmma),
    then its 64 values of each side section."""
    code_block = _pallas.block(
        (None, _TILE, GROUP_SIZE), lambda i, p: (p, first + i, 0), swizzled=True,
        dtype=CODE_DTYPES[codec.element],
    )  # fmt: skip
    starts = [_side_start(section) for section in codecs.wire_sections(codec, n)]
    side_blocks = [
        _pallas.block((None, _TILE), lambda i, p, s=s: (p, s + first + i)) for s in starts
    ]
    return [code_block, *side_blocks]


def _summed_body(*refs, codec, n, launch, peers, hadamard, reencode, staged, magic_round,
                 product=None):  # fmt: skip
    """One program: per tile, z = sum_p q_p d_p over the N peers' steps (in registers),
    then on the last peer's step either encode(z) (re-encode: z is already in the Hadamard
    domain) or S z unit (decode-sum: one bf16 wgmma chain over z's three pieces), stored."""
    views = refs[: 1 + len(codec.side_fields)]  # `_wire_views`
    signs_gmem = refs[len(views)] if hadamard else None
    out_gmem, *outs = refs[len(views) + int(hadamard) :]  # outs: `_summed_scratch`
    pieces_smem = None
    if hadamard:
        signs_smem, signs_barrier, *outs = outs
        if staged:
            pieces_smem, *outs = outs
        _pallas.copy_in(signs_gmem, signs_smem, signs_barrier)
    first = lax.axis_index("program") * launch.tiles_per_program
    layout = encode_mosaic.WireLayout.of(codec, n)
    sections = layout.sections

    def finish(tile, z):
        if reencode:
            codes_smem, sides = outs
            encode_mosaic.encode_and_store(codec, z, 1.0, ([codes_smem], sides), [out_gmem],
                                           tile, layout, magic_round)  # fmt: skip
            return
        if hadamard:
            z = _pallas.wgmma_of_pieces(z, signs_smem, (_TILE, GROUP_SIZE), pieces_smem)
            z = codecs.scale_rows(z, codecs.hadamard_unit(GROUP_SIZE))
        out = out_gmem if product is not None else out_gmem.at[0]
        _store_decoded(outs[0], _tile_place(out, tile, product), tile, z)

    def step(index, code_smem, *blocks):
        *side_smem, carry = blocks
        i, p = index
        x = _decoded(codec, code_smem, side_smem, None, sections, unit=1.0, widened=True)
        # Peers summed in order 0..N-1. A cond, not a select: Mosaic GPU does not broadcast a
        # scalar predicate over a tile, and a multiply by 0 would carry a NaN into the next tile.
        z = lax.cond(p == 0, lambda: x, lambda: carry + x)
        _pallas.when(p == peers - 1, lambda: finish(first + i, z))
        return z

    _pallas.pipeline(
        step,
        steps=(launch.tiles_per_program, peers),
        in_specs=_peer_step_specs(codec, n, first),
        out_specs=[],
        in_flight=launch.steps_in_flight,
        init_carry=_pallas.zeros_rows((_TILE, GROUP_SIZE), _pallas.NARROW_LOAD),
    )(*views)
    _pallas.wait_stores(0)
