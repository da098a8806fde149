"""Fused encode on Hopper through Mosaic GPU: x[R, n] bf16 -> packed wire rows, G = 128.

The same function as the Triton-lowered `encode_kernel.encode` (and so as
`codecs.encode_wire(codec, x)` up to `_tile`'s rounding notes), for the codecs of fp32 scales:
`taco`, `taco_e5m2`, `taco_no_ds`, `fp8`, `int8`, `int8_hadamard` and the sub-byte
`int6_hadamard`, `int5_hadamard`, `int4_hadamard`. A codec without a Hadamard multiplies by
the identity instead of the signs (the same kernel).

Why a second backend for this kernel (see `_pallas.py`): the Triton lowering moves every tile
through registers, then shared memory for the dot, then back. Here a program walks
`tiles_per_program` tiles of 64 groups of one row in a software pipeline (`emit_pipeline`): TMA
loads each bf16 tile into swizzled shared memory, where one 64 x 128 x 128 wgmma reads it
together with the +-1 Sylvester matrix (staged once per program); `codecs.encode_groups` turns
the accumulator into codes, which TMA stores into the wire row. The scales and pre-scales go
through an fp32 shared buffer, stored by TMA through a uint8 alias of it (`RefUnion`) into the
row's side sections. The kernel issues these stores itself rather than through the pipeline's
outputs, whose predicated stores the CPU interpreter cannot run (a few percent slower, for a
kernel that CI can run).

Sub-byte codes are packed into their bit planes (`codecs.code_planes`) on the tensor cores too:
packing is linear, a plane's byte j of a group being sum_k part_k 2^(w (k mod 8/w)) over the
8 / w codes k it holds (part_k < 2^w the plane's bits of code k). So each plane is one more
wgmma, of the parts (bf16, exact) by a constant [G, G w / 8] matrix (`pack_matrix`, stored
transposed), whose
fp32 sums are the bytes exactly (<= 255). Their [64, G w / 8] tile is stored through a
shared-memory buffer reshaped to whole 128-byte rows.

The wire row is addressed as [W / 128, 128] bytes: Mosaic GPU indexes GMEM refs but does not
reshape them, and with 128-byte rows a tile's codes (64 rows) and each of its side sections
(2 rows) are whole rows. TMA stores of uint8 rows tile them by 8 rows, so the row count must be
a multiple of 8 (`taco`: whole pairs of tiles; one-scale codecs: fours). Hence `unsupported`.
A tile's bytes of a plane of width w are G w / 16 rows: 32, 16 or 8.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _pallas
from pallas_kernels.config import (
    HOPPER_SMS,
    MOSAIC_ENCODE_CODECS,
    MOSAIC_GROUPS_PER_TILE,
    MOSAIC_MIN_TILES,
    MosaicLaunch,
    mosaic_encode_launch,
    two_programs_steps,
)
from taco_jax import codecs
from taco_jax.codecs import Codec

GROUP_SIZE = 128
ROW_BYTES = 128  # the wire row is addressed in rows of this many bytes
_TILE = MOSAIC_GROUPS_PER_TILE


CODE_ELEMENTS = ("e4m3", "e5m2", "int8", "int6", "int5", "int4")


def unsupported(codec: Codec, x: jax.Array, *, need_hopper: bool = True) -> str | None:
    """Why this kernel cannot encode `x` with `codec` (None: it can)."""
    if codec.group_size != GROUP_SIZE:
        return f"group_size={codec.group_size} (needs {GROUP_SIZE})"
    if codec.scale_format != "fp32":
        return f"codec {codec.name!r} with scale_format={codec.scale_format!r} (needs fp32 scales)"
    if codec.element not in CODE_ELEMENTS:
        return f"codec {codec.name!r} with element={codec.element!r} (needs one of {CODE_ELEMENTS})"
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        return f"x of shape={x.shape} dtype={x.dtype} (needs bf16 rows [R, n])"
    reason = unfit_row(codec, x.shape[1])
    if reason is not None:
        return reason
    if need_hopper and not _pallas.hopper_gpu():
        return "the default device is not a Hopper GPU (wgmma)"
    if need_hopper and _packed_planes(codec) and not PACKED_ENCODE_LOWERS:
        return (
            f"codec {codec.name!r} with jax {jax.__version__}: Mosaic GPU's layout inference "
            "finds no solution for the sub-byte encode after 0.11 (use backend='triton')"
        )
    return None


# Mosaic GPU's layout inference (JAX 0.12.0.1) searches the sub-byte encode for minutes and ends
# with "Layout inference failed to find a solution"; JAX 0.11.2 lowers it, and the CPU
# interpreter runs it on either.
PACKED_ENCODE_LOWERS = jax.__version_info__ < (0, 12)


def unfit_row(codec: Codec, n: int) -> str | None:
    """Why a row of `n` elements does not fit these kernels' tiles (None: it does): whole tiles,
    and a wire row of whole 8-row TMA boxes of the [W / 128, 128] byte view (`taco`: pairs of
    tiles; one-scale codecs: fours; `taco_e8m0`: sixteens)."""
    if n % (_TILE * GROUP_SIZE) or codec.wire_bytes(n) % (8 * ROW_BYTES):
        return (
            f"n={n} (needs whole tiles of {_TILE * GROUP_SIZE} and wire rows of a multiple of "
            f"{8 * ROW_BYTES} bytes: TMA moves 8 rows of {ROW_BYTES} bytes at a time)"
        )
    return None


def row_multiple(codec: Codec) -> int:
    """The fewest elements a row may be a multiple of for these kernels to take it
    (`unfit_row`): whole tiles whose wire fills whole 8-row TMA boxes (`taco`: 16384)."""
    tile = _TILE * GROUP_SIZE
    for tiles in range(1, 8 * ROW_BYTES + 1):  # wire_bytes(1024 tiles) is a multiple of 1024
        if unfit_row(codec, tiles * tile) is None:
            return tiles * tile
    raise ValueError(f"codec {codec.name!r}: no row of whole tiles fits the TMA boxes")


def preferred(codec: Codec, x: jax.Array) -> bool:
    """Whether "auto" takes this kernel: it applies, the codec is one of MOSAIC_ENCODE_CODECS
    (measured and checked on a GPU), and the call has >= MOSAIC_MIN_TILES tiles."""
    if codec.name not in MOSAIC_ENCODE_CODECS or unsupported(codec, x) is not None:
        return False
    return x.shape[0] * x.shape[1] >= MOSAIC_MIN_TILES * _TILE * GROUP_SIZE


def encode(
    codec: Codec, x: jax.Array, *, interpret: bool = False, launch: MosaicLaunch | None = None
) -> jax.Array:
    """x[R, n] -> wire[R, codec.wire_bytes(n)] (raises ValueError where `unsupported`).

    interpret: run in Mosaic GPU's CPU interpreter (tests). It does not alias `RefUnion`
      members, so there the side sections are not written: only the codes are meaningful.
    launch: tiles per program and pipeline steps in flight; default `default_launch`.
    """
    reason = unsupported(codec, x, need_hopper=not interpret)
    if reason is not None:
        raise ValueError(f"the Mosaic GPU encode cannot take {reason}")
    rows, n = x.shape
    groups = n // GROUP_SIZE
    launch = launch or default_launch(rows, groups // _TILE, codec)
    tiles_per_program = launch.tiles_per_program
    if (groups // _TILE) % tiles_per_program:
        raise ValueError(f"{tiles_per_program=} must divide the {groups // _TILE} tiles of a row")
    body = _pallas.partial(
        _encode_body,
        codec=codec,
        tiles_per_program=tiles_per_program,
        steps=launch.steps_in_flight,
        layout=WireLayout.of(codec, n),
        magic_round=not interpret,
    )
    wire_rows = codec.wire_bytes(n) // ROW_BYTES
    out_shape = jax.ShapeDtypeStruct((rows, wire_rows, ROW_BYTES), jnp.uint8)
    wire = _pallas.mosaic_kernel(
        body,
        x.reshape(rows, groups, GROUP_SIZE),
        dot_operand(codec),
        *pack_operands(codec),
        out_shape=out_shape,
        scratch=[
            *encode_scratch(launch.store_slots, codec, interpret),
            *pack_scratch(codec, interpret),
        ],
        grid=(rows, (groups // _TILE) // tiles_per_program),
        grid_names=("row", "program"),
        name=f"taco_encode_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return wire.reshape(rows, wire_rows * ROW_BYTES)


def default_launch(rows: int, tiles_per_row: int, codec: Codec | None = None) -> MosaicLaunch:
    """`config.mosaic_encode_launch` for this device's SMs. Under a `jax.vmap` of B (an emulated
    TP group's ranks) the grid is B times the one sized here from a batch element's shape.

    Sub-byte codecs (`codec`) take the steps in flight that leave room for two programs per SM
    beside their packing matrices and plane slots (`config.two_programs_steps`)."""
    launch = mosaic_encode_launch(rows, tiles_per_row, _pallas.hopper_sms() or HOPPER_SMS)
    if codec is not None and _packed_planes(codec):
        fixed = _pallas.smem_bytes(
            encode_scratch(launch.store_slots, codec) + pack_scratch(codec, False)
        )
        step = _TILE * GROUP_SIZE * 2  # a bf16 tile
        steps = two_programs_steps(fixed, step, launch.steps_in_flight, "encode")
        launch = MosaicLaunch(launch.tiles_per_program, steps)
    return launch


class WireLayout(NamedTuple):
    """Where a wire row of `n` codes keeps its code planes and side sections (`codecs`)."""

    planes: tuple[codecs.CodePlane, ...]
    sections: tuple[codecs.WireSection, ...]

    @classmethod
    def of(cls, codec: Codec, n: int) -> WireLayout:
        return cls(codecs.code_planes(codec, n), codecs.wire_sections(codec, n))


def dot_operand(codec: Codec) -> jax.Array:
    """What the wgmma multiplies each tile by, staged per program (exact in bf16): the +-1
    Sylvester matrix for a codec with a Hadamard, else the identity (the dot is then the
    conversion of the tile into fp32 registers)."""
    matrix = codecs.signs_matrix(GROUP_SIZE) if codec.hadamard else np.eye(GROUP_SIZE)
    return jnp.asarray(matrix, jnp.bfloat16)


def pack_matrix(width: int) -> np.ndarray:
    """The transposed operand of the dot that packs one plane of `width` bits (1, 2 or 4) of a
    group's G codes into its G width / 8 bytes: [G width / 8, G], entry (j, k) the weight
    2^(width (k mod 8 / width)) of code k in byte j = k div (8 / width) (`codecs.pack_bits`:
    consecutive codes fill a byte from its low bits up), else 0. Exact in bf16 (<= 2^7)."""
    per_byte = 8 // width
    k = np.arange(GROUP_SIZE)
    matrix = np.zeros((GROUP_SIZE // per_byte, GROUP_SIZE), np.float32)
    matrix[k // per_byte, k] = 2.0 ** (width * (k % per_byte))
    return matrix


def _packed_planes(codec: Codec) -> tuple[codecs.CodePlane, ...]:
    """The planes whose bytes hold several codes each (none for 8-bit codes)."""
    return tuple(p for p in codecs.code_planes(codec, GROUP_SIZE) if p.width < 8)


def pack_operands(codec: Codec) -> tuple[jax.Array, ...]:
    """`pack_matrix` of each packed plane of `codec`, in bf16 (none for 8-bit codes)."""
    return tuple(jnp.asarray(pack_matrix(p.width), jnp.bfloat16) for p in _packed_planes(codec))


def group_bytes(plane: codecs.CodePlane) -> int:
    """Bytes of `plane` a group's G codes take: G width / 8."""
    return GROUP_SIZE * plane.width // 8


def _tile_rows(plane: codecs.CodePlane) -> int:
    """128-byte wire rows of one tile's bytes of `plane`: 64 groups of G width / 8 bytes."""
    return _TILE * group_bytes(plane) // ROW_BYTES


def encode_scratch(slots: int = 2, codec: Codec | None = None, interpreted: bool = False) -> list:
    """Shared memory of `encode_tiles`: the signs (and their load barrier), then `slots` tiles'
    bytes of each code plane of `codec` (one plane of bytes where None), and `slots` tiles'
    fp32 sides seen also as uint8 rows (`RefUnion`) for the TMA stores. A packed plane's tile
    is [64, G w / 8] as the dot leaves it, TMA-stored into the wire rows seen as such; the CPU
    interpreter reshapes no ref, so there it is [G w / 16, 128] (`_tile_rows`) and the
    values are reshaped instead."""
    planes = codecs.code_planes(codec, GROUP_SIZE) if codec is not None else ()
    shapes = [(_TILE, GROUP_SIZE)] if not planes else [
        (_tile_rows(p), ROW_BYTES) if interpreted else (_TILE, group_bytes(p))
        for p in planes
    ]  # fmt: skip
    return [
        _pallas.smem((GROUP_SIZE, GROUP_SIZE), jnp.bfloat16, swizzled=True),
        _pallas.barrier(),
        *[_pallas.smem((slots, *shape), jnp.uint8) for shape in shapes],
        _pallas.smem_union(((slots, 2, _TILE), jnp.float32), ((slots, 4, ROW_BYTES), jnp.uint8)),
    ]


def pack_scratch(codec: Codec, staged: bool) -> list:
    """For sub-byte codes: each packed plane's `pack_matrix` (swizzled, read transposed by
    wgmma) and its load barrier and, `staged`, a bf16 tile the parts go through (Mosaic GPU's
    CPU interpreter reads wgmma operands from refs)."""
    refs = []
    for plane in _packed_planes(codec):
        refs += [
            _pallas.smem((group_bytes(plane), GROUP_SIZE), jnp.bfloat16, swizzled=True),
            _pallas.barrier(),
        ]
    if refs and staged:
        refs.append(_pallas.smem((_TILE, GROUP_SIZE), jnp.bfloat16, swizzled=True))
    return refs


def _encode_body(x_gmem, signs_gmem, *refs, codec, tiles_per_program, steps, layout,
                 magic_round):  # fmt: skip
    """One program: `tiles_per_program` consecutive tiles of row `row`, into the wire row."""
    packed = len(_packed_planes(codec))
    pack_gmems, (wire_gmem, signs_smem, signs_barrier, *scratch) = refs[:packed], refs[packed:]
    planes_out = scratch[: len(layout.planes)]
    sides, *pack_refs = scratch[len(layout.planes) :]
    _pallas.copy_in(signs_gmem, signs_smem, signs_barrier)
    for k, pack_gmem in enumerate(pack_gmems):
        _pallas.copy_in(pack_gmem, pack_refs[2 * k], pack_refs[2 * k + 1])
    matrices, staged = pack_refs[0 : 2 * packed : 2], pack_refs[2 * packed :]
    packing = Packing(tuple(matrices), staged[0] if staged else None)
    row = lax.axis_index("row")
    encode_tiles(
        x_gmem.at[row],
        [wire_gmem.at[row]],
        codec=codec,
        signs_smem=signs_smem,
        out=(planes_out, sides),
        tiles_per_program=tiles_per_program,
        steps=steps,
        layout=layout,
        magic_round=magic_round,
        packing=packing,
    )
    _pallas.wait_stores(0)


class Packing(NamedTuple):
    """The shared memory of the packing dots (`pack_scratch`): the matrices, the staging tile."""

    matrices: tuple = ()
    staged: object = None


NO_PACKING = Packing()  # 8-bit codes


def encode_tiles(x_row, wire_rows, *, codec, signs_smem, out, tiles_per_program, steps, layout,
                 magic_round=True, packing=NO_PACKING):  # fmt: skip
    """Encodes this program's `tiles_per_program` consecutive tiles of one bf16 row `x_row`
    (GMEM, [groups, G]) and TMA-stores each tile's codes and sides into every ref of
    `wire_rows` (GMEM wire rows [W / 128, 128], local or a peer's: `exchange_mosaic`).

    The pipeline only loads; each step stores its own tile (`store_tile`), unpredicated, so the
    kernel also runs in Mosaic GPU's interpreter (which has no predicated stores). Stores may
    still be in flight on return; a program may call this again (one row after another).
    magic_round: the integer grids' rounding (`codecs.quantize`): True on the GPU (Mosaic GPU
    has no round), False in the interpreter (XLA's CPU folds the magic add away)."""
    # The shared-memory slots rotate by tile index from this call's first tile: the stores of an
    # earlier call must be done reading them (a no-op in the first call).
    _pallas.wait_stores(0)
    first = lax.axis_index("program") * tiles_per_program
    step = _pallas.partial(
        _encode_step,
        codec=codec,
        signs_smem=signs_smem,
        out=out,
        wire_rows=wire_rows,
        first=first,
        layout=layout,
        magic_round=magic_round,
        packing=packing,
    )
    tile_block = lambda i: (first + i, 0)  # noqa: E731
    _pallas.pipeline(
        step,
        steps=tiles_per_program,
        in_specs=[_pallas.block((_TILE, GROUP_SIZE), tile_block, swizzled=True)],
        out_specs=[],
        in_flight=steps,
    )(x_row)


def _encode_step(index, x_smem, *, codec, signs_smem, out, wire_rows, first, layout, magic_round,
                 packing):  # fmt: skip
    (i,) = index
    v = _pallas.wgmma(x_smem, signs_smem, (_TILE, GROUP_SIZE))  # S x (or x), fp32
    unit = codecs.hadamard_unit(GROUP_SIZE) if codec.hadamard else 1.0
    encode_and_store(codec, v, unit, out, wire_rows, first + i, layout, magic_round, packing)


def encode_and_store(codec, v, unit, out, wire_rows, tile, layout, magic_round,
                     packing=NO_PACKING):  # fmt: skip
    """Encodes the groups v * unit of one tile (`codecs.encode_groups`; v fp32 registers) and
    TMA-stores its code planes and side values into each of `wire_rows` (`store_tile`)."""
    packed = bool(packing.matrices)  # sub-byte codes: their fp32 values, for `plane_parts`
    codes, scale, prescale = codecs.encode_groups(
        codec, v, unit=unit, magic_round=magic_round, float_codes=packed
    )
    sides = {"scales": scale, "prescales": prescale}
    planes = plane_bytes(codes, layout.planes, packing, bits=codec.bits, magic_round=magic_round)
    store_tile(out, wire_rows, tile, layout, planes, sides)


def plane_bytes(codes, planes, packing: Packing, *, bits: int, magic_round: bool) -> list:
    """One tile's bytes of each code plane: uint8 [64, G width / 8] from its codes [64, G]
    (8-bit: uint8, their own bytes; sub-byte: fp32 values of `bits` bits). A packed plane's
    bytes are one wgmma of its parts (`plane_parts`) by its `pack_matrix` (parts < 2^width and
    bytes <= 255: exact in bf16 and fp32)."""
    if len(planes) == 1 and planes[0].width == 8:
        return [codes]
    out = []
    parts = plane_parts(codes, planes, bits, magic_round)
    for plane, part, matrix_smem in zip(planes, parts, packing.matrices, strict=True):
        part = part.astype(jnp.bfloat16)
        if packing.staged is not None:
            part = _pallas.staged(part, packing.staged)
        packed = _pallas.wgmma_transposed(part, matrix_smem, (_TILE, group_bytes(plane)))
        out.append(packed.astype(jnp.int32).astype(jnp.uint8))
    return out


def plane_parts(codes, planes, bits: int, magic_round: bool) -> list:
    """Each plane's bits of the codes c (fp32, exact integers < 2^bits), as fp32: with
    F_t = floor(c / 2^t) (F_0 = c, F_bits = 0), a plane of `width` bits from `shift` holds
    F_shift - 2^width F_(shift + width). Exact in fp32 arithmetic, and with only floating-point
    operations: a widening, a shift and a mask per plane through int32 cost these kernels more
    instructions than the rest of the encode (docs/development_history.md)."""
    floors = {0: codes, bits: None}

    def floor_at(t):  # F_t; None for F_bits = 0
        if t not in floors:
            floors[t] = _floor(codes * np.float32(2.0**-t), t, magic_round)
        return floors[t]

    parts = []
    for plane in planes:
        part, above = floor_at(plane.shift), floor_at(plane.shift + plane.width)
        parts.append(part if above is None else part - np.float32(1 << plane.width) * above)
    return parts


def _floor(y, t: int, magic_round: bool):
    """floor(y) for y = c / 2^t, c a non-negative integer: y - 1/2 + 2^-(t+1) lies strictly
    within 1/2 of floor(y), so rounding it to the nearest integer is exact (Mosaic GPU has no
    floor, and rounds by `codecs.round_even`'s magic number)."""
    return codecs.round_even(y - np.float32(0.5 - 2.0 ** -(t + 1)), magic_round)


def store_tile(out, wire_rows, tile, layout, planes, sides):
    """TMA-stores one tile's bytes of each code plane and its side values (fp32, by `Payload`
    field) into each row. A slot shaped otherwise than its plane's bytes is the CPU
    interpreter's (`encode_scratch`): the bytes are reshaped to it.

    The tiles rotate through the S slots of `out` (`encode_scratch`). Each tile issues
    len(planes) + len(sections) bulk stores per row, so waiting until at most S - 1 tiles' worth
    are pending frees the slot of S tiles ago.
    """
    planes_smem, (sides_f32, sides_u8) = out
    slots = planes_smem[0].shape[0]
    slot = lax.rem(tile, slots)
    stores = len(layout.planes) + len(layout.sections)
    _pallas.wait_stores((slots - 1) * stores * len(wire_rows))
    for plane_smem, data in zip(planes_smem, planes, strict=True):
        plane_smem[slot] = (
            data if plane_smem.shape[1:] == data.shape else data.reshape(plane_smem.shape[1:])
        )
    for k, section in enumerate(layout.sections):
        sides_f32[slot, k] = sides[section.field]
    _pallas.commit_smem()
    for wire_row in wire_rows:
        for plane, plane_smem in zip(layout.planes, planes_smem, strict=True):
            rows = _tile_rows(plane)
            destination = wire_row.at[_pallas.ds(plane.offset // ROW_BYTES + rows * tile, rows)]
            source = plane_smem.at[slot]
            if source.shape[1] != ROW_BYTES:  # a packed plane's [64, G w / 8]: `rows` rows
                source = source.reshape(rows, ROW_BYTES)
            _pallas.copy_out(source, destination)
        for k, section in enumerate(layout.sections):
            rows = section.width * _TILE // ROW_BYTES  # 64 fp32 values = 2 rows
            first_row = section.offset // ROW_BYTES + rows * tile
            _pallas.copy_out(
                sides_u8.at[slot, _pallas.ds(rows * k, rows)],
                wire_row.at[_pallas.ds(first_row, rows)],
            )
