"""Fused encode on Hopper through Mosaic GPU: x[R, n] bf16 -> packed wire rows, G = 128.

The same function as the Triton `encode_kernel.encode` (and so `codecs.encode_wire(codec, x)`
up to `_tile`'s rounding notes) for the FP8 codecs with a Hadamard and fp32 scales (`taco`,
`taco_e5m2`, `taco_no_ds`: `unsupported_codec`). A program walks `tiles_per_program`
tiles of 64 groups of one row in a software pipeline (`plgpu.emit_pipeline`): TMA loads each
bf16 tile into swizzled shared memory, where one 64 x 128 x 128 wgmma reads it together with
the +-1 Sylvester matrix (staged once per program), so the tile never passes through registers
before the dot. `codecs.encode_groups` turns the accumulator into codes, which TMA stores into
the wire row; the scales go through an fp32 shared buffer, TMA-stored through a uint8 alias of
it (`plgpu.RefUnion`). The kernel issues its own stores rather than the pipeline's predicated
ones, which Mosaic GPU's CPU interpreter cannot run, so CI runs this kernel too; the
interpreter does not alias `RefUnion` members, so there the scales take their bytes in
registers (`codecs.side_to_bytes`) into a uint8 buffer instead.

The wire row is addressed as [W / 128, 128] bytes: Mosaic GPU indexes GMEM refs but does not
reshape them, and with 128-byte rows a tile's codes (64 rows) and each of its side sections
(2 rows) are whole rows. TMA stores uint8 rows 8 at a time, so a row's wire must be a whole
number of 8-row boxes (`unsupported`; `row_multiple`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _pallas
from pallas_kernels._pallas import pl, plgpu
from taco_jax import codecs
from taco_jax.codecs import Codec

GROUP_SIZE = 128
TILE_GROUPS = 64  # a tile: one wgmma M block of a warpgroup
ROW_BYTES = 128  # the wire row is addressed in rows of this many bytes
TMA_ROWS = 8  # TMA moves uint8 rows of 128 bytes 8 at a time
# The code element -> the dtype TMA loads the codes as (FP8 codes go through fp16 into wgmma).
FP8_CODES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """The launch of a Mosaic GPU codec kernel (this module's, `decode_mosaic`'s,
    `exchange_mosaic`'s): tiles each program pipelines, TMA load steps in flight, and the
    shared-memory slots its output tiles rotate through while TMA stores read them."""

    tiles_per_program: int
    steps_in_flight: int
    store_slots: int = 2

    def __post_init__(self):
        if min(self.tiles_per_program, self.steps_in_flight, self.store_slots) < 1:
            raise ValueError(f"{self} needs >= 1 tile, step in flight and store slot")

    def check_row(self, tiles_per_row: int) -> None:
        if tiles_per_row % self.tiles_per_program:
            raise ValueError(
                f"tiles_per_program={self.tiles_per_program} must divide the "
                f"{tiles_per_row} tiles of a row"
            )


def unsupported_codec(codec: Codec) -> str | None:
    """Why the Mosaic kernels cannot take `codec` (None: they can): they take FP8 codes with a
    Hadamard and fp32 scales at G = 128 (`taco`, `taco_e5m2`, `taco_no_ds`)."""
    if codec.element not in FP8_CODES or not codec.hadamard or codec.scale_format != "fp32":
        return (
            f"codec {codec.name!r} (element={codec.element!r}, hadamard={codec.hadamard}, "
            f"scale_format={codec.scale_format!r}: needs FP8 codes with a Hadamard and "
            "fp32 scales)"
        )
    if codec.group_size != GROUP_SIZE:
        return f"codec {codec.name!r} with group_size={codec.group_size} (needs {GROUP_SIZE})"
    return None


def unsupported(codec: Codec, n: int) -> str | None:
    """Why the Mosaic kernels cannot take rows of `n` elements of `codec` (None: they can)."""
    reason = unsupported_codec(codec)
    if reason is not None:
        return reason
    if n % (TILE_GROUPS * GROUP_SIZE) or codec.wire_bytes(n) % (TMA_ROWS * ROW_BYTES):
        return (
            f"rows of n={n} (need whole tiles of {TILE_GROUPS * GROUP_SIZE} and a wire of "
            f"whole {TMA_ROWS}-row boxes of {ROW_BYTES} bytes: n a multiple of "
            f"{row_multiple(codec)})"
        )
    return None


def row_multiple(codec: Codec) -> int:
    """The fewest elements a row may be a multiple of for these kernels to take it: whole tiles
    whose wire fills whole TMA boxes (`taco`: 16384)."""
    tile = TILE_GROUPS * GROUP_SIZE
    tiles = 1
    while codec.wire_bytes(tiles * tile) % (TMA_ROWS * ROW_BYTES):
        tiles += 1
    return tiles * tile


# A Hopper SM runs two encode programs at once (three steps in flight: ~97 KiB of shared memory
# each). A grid whose last wave is part-empty loses more than shorter programs cost, and among
# full waves longer programs win (each stages the signs and fills its pipeline: ~0.4 of a
# tile's time). Record: launch_sweep-2026-12-03-wave-r1.json (docs/decisions/006).
HOPPER_SMS = 132  # H100 / H200 SXM, where the device does not say (the CPU interpreter)
PROGRAMS_PER_SM = 2
PROGRAM_OVERHEAD_TILES = 0.4
MAX_TILES_PER_PROGRAM = 16
MAX_STEPS_IN_FLIGHT = 3


def default_config(rows: int, tiles_per_row: int, sms: int | None = None) -> MosaicConfig:
    """Of the program lengths t <= 16 that divide a row, the one of most estimated throughput:
    the grid's occupancy of whole waves times t / (t + PROGRAM_OVERHEAD_TILES); ties to the
    longer. Under `jax.vmap` the grid is the batch times the one sized here. sms: the GPU's SM
    count (None: the device's, else `HOPPER_SMS`)."""
    at_once = (sms or _pallas.hopper_sms() or HOPPER_SMS) * PROGRAMS_PER_SM

    def throughput(t: int) -> float:
        programs = rows * tiles_per_row // t
        occupancy = programs / (-(-programs // at_once) * at_once)
        return occupancy * t / (t + PROGRAM_OVERHEAD_TILES)

    lengths = [t for t in range(MAX_TILES_PER_PROGRAM, 0, -1) if tiles_per_row % t == 0]
    t = max(lengths, key=throughput)
    return MosaicConfig(t, min(MAX_STEPS_IN_FLIGHT, t))


def encode(
    codec: Codec, x: jax.Array, *, interpret: bool = False, config: MosaicConfig | None = None
) -> jax.Array:
    """x[R, n] bf16 -> wire[R, codec.wire_bytes(n)]; raises ValueError where `unsupported`.

    interpret: Mosaic GPU's CPU interpreter. config: default `default_config`.
    """
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        raise ValueError(f"the Mosaic encode takes bf16 rows [R, n], got {x.shape=} {x.dtype=}")
    reason = unsupported(codec, x.shape[1])
    if reason is not None:
        raise ValueError(f"the Mosaic GPU encode cannot take {reason}")
    rows, n = x.shape
    tiles = n // (TILE_GROUPS * GROUP_SIZE)
    config = config or default_config(rows, tiles)
    config.check_row(tiles)
    body = functools.partial(
        _encode_body,
        codec=codec,
        config=config,
        layout=WireLayout.of(codec, n),
        interpret=interpret,
    )
    wire_rows = codec.wire_bytes(n) // ROW_BYTES
    wire = _pallas.mosaic_kernel(
        body,
        x.reshape(rows, n // GROUP_SIZE, GROUP_SIZE),
        signs_operand(),
        out_shape=jax.ShapeDtypeStruct((rows, wire_rows, ROW_BYTES), jnp.uint8),
        scratch=encode_scratch(config.store_slots, interpret),
        grid=(rows, tiles // config.tiles_per_program),
        grid_names=("row", "program"),
        name=f"taco_encode_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return wire.reshape(rows, wire_rows * ROW_BYTES)


class WireLayout(NamedTuple):
    """Where a wire row of `n` codes keeps its codes and side sections (`codecs`)."""

    codes_offset: int
    sections: tuple[codecs.WireSection, ...]

    @classmethod
    def of(cls, codec: Codec, n: int) -> WireLayout:
        (plane,) = codecs.code_planes(codec, n)  # 8-bit codes: one plane
        return cls(plane.offset, codecs.wire_sections(codec, n))


def signs_operand() -> jax.Array:
    """The +-1 Sylvester matrix each tile is multiplied by (exact in bf16)."""
    return jnp.asarray(codecs.signs_matrix(GROUP_SIZE), jnp.bfloat16)


def signs_smem(dtype=jnp.bfloat16):
    return plgpu.SMEM((GROUP_SIZE, GROUP_SIZE), dtype, transforms=_pallas.swizzled(dtype))


def encode_scratch(slots: int, interpret: bool = False) -> list:
    """Shared memory of `encode_tiles`: the signs and their load barrier, `slots` tiles of
    codes, and `slots` tiles' side values: fp32 seen also as uint8 rows for the TMA stores
    (`plgpu.RefUnion`), or uint8 rows alone in the interpreter (module docstring)."""
    sides_u8 = plgpu.SMEM((slots, 2 * 2, ROW_BYTES), jnp.uint8)  # two sections of 2 rows
    sides = (
        sides_u8
        if interpret
        else plgpu.RefUnion(plgpu.SMEM((slots, 2, TILE_GROUPS), jnp.float32), sides_u8)
    )
    return [
        signs_smem(),
        plgpu.Barrier(num_barriers=1),
        plgpu.SMEM((slots, TILE_GROUPS, GROUP_SIZE), jnp.uint8),
        sides,
    ]


def copy_in(gmem_ref, smem_ref, barrier) -> None:
    """Blocking TMA load of a whole GMEM ref into shared memory."""
    plgpu.copy_gmem_to_smem(gmem_ref, smem_ref, barrier)
    plgpu.barrier_wait(barrier)


def _encode_body(
    x_gmem,
    signs_gmem,
    wire_gmem,
    signs,
    barrier,
    codes_smem,
    sides,
    *,
    codec,
    config,
    layout,
    interpret,
):
    """One program: `config.tiles_per_program` consecutive tiles of row `row`."""
    copy_in(signs_gmem, signs, barrier)
    row = lax.axis_index("row")
    encode_tiles(
        x_gmem.at[row],
        [wire_gmem.at[row]],
        codec=codec,
        signs=signs,
        out=(codes_smem, sides),
        config=config,
        layout=layout,
        interpret=interpret,
    )
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def encode_tiles(x_row, wire_rows, *, codec, signs, out, config, layout, interpret=False):
    """Encodes this program's tiles of one bf16 row `x_row` (GMEM [groups, G]) and TMA-stores
    each tile's codes and sides into every ref of `wire_rows` (GMEM wire rows [W / 128, 128],
    local or a peer's: `exchange_mosaic`). Stores may still be in flight on return; a program
    may call this again (one row after another)."""
    # The slots rotate by tile index from this call's first tile: the stores of an earlier call
    # must be done reading them (a no-op in the first call).
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    first = lax.axis_index("program") * config.tiles_per_program
    unit = codecs.hadamard_unit(GROUP_SIZE)

    def step(index, x_smem):
        (i,) = index
        v = _pallas.wgmma(x_smem, signs, (TILE_GROUPS, GROUP_SIZE))  # S x, fp32
        encode_and_store(codec, v, unit, out, wire_rows, first + i, layout, interpret)

    block = plgpu.BlockSpec(
        (TILE_GROUPS, GROUP_SIZE),
        lambda i: (first + i, 0),
        transforms=_pallas.swizzled(jnp.bfloat16),
    )
    plgpu.emit_pipeline(
        step,
        grid=(config.tiles_per_program,),
        in_specs=[block],
        out_specs=[],
        max_concurrent_steps=config.steps_in_flight,
    )(x_row)


def encode_and_store(codec, v, unit, out, wire_rows, tile, layout, interpret):
    """Encodes the groups v * unit of one tile (v fp32 registers [64, G]) and TMA-stores its
    codes and side values into each of `wire_rows`.

    The tiles rotate through the S slots of `out` (`encode_scratch`). Each tile issues
    1 + len(sections) bulk stores per row, so waiting until at most S - 1 tiles' worth are
    pending frees the slot of S tiles ago."""
    codes, scale, prescale = codecs.encode_groups(codec, v, unit=unit, magic_round=not interpret)
    values = {"scales": scale, "prescales": prescale}
    codes_smem, sides = out
    slot = lax.rem(tile, codes_smem.shape[0])
    stores = 1 + len(layout.sections)
    plgpu.wait_smem_to_gmem(
        (codes_smem.shape[0] - 1) * stores * len(wire_rows), wait_read_only=True
    )
    codes_smem[slot] = codes
    if interpret:  # no RefUnion aliasing: the bytes, in registers
        sides_u8 = sides
        for k, section in enumerate(layout.sections):
            data = codecs.side_to_bytes(values[section.field], section.width)
            sides_u8[slot, pl.ds(2 * k, 2)] = data.reshape(2, ROW_BYTES)
    else:
        sides_f32, sides_u8 = sides
        for k, section in enumerate(layout.sections):
            sides_f32[slot, k] = values[section.field]
    plgpu.commit_smem()
    rows = TILE_GROUPS * GROUP_SIZE // ROW_BYTES  # a tile's codes: 64 rows of 128 bytes
    for wire_row in wire_rows:
        plgpu.copy_smem_to_gmem(
            codes_smem.at[slot],
            wire_row.at[pl.ds(layout.codes_offset // ROW_BYTES + rows * tile, rows)],
        )
        for k, section in enumerate(layout.sections):
            first_row = section.offset // ROW_BYTES + 2 * tile  # 64 fp32 values: 2 rows
            plgpu.copy_smem_to_gmem(
                sides_u8.at[slot, pl.ds(2 * k, 2)], wire_row.at[pl.ds(first_row, 2)]
            )
