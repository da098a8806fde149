"""The one tile-size heuristic of the package (STYLE.md: never pasted into each kernel).

Chosen by measurement on the H200 (`benchmarks/kernel_sweep.py`, BENCHMARKS.md "Kernels"):
- kernels that apply the Hadamard dot stage the +-1 block in shared memory once per program, so
  a program walks several tiles with 4 warps (sweep 2: encode 1.8 -> 2.5 TB/s from that loop);
- encode and decode take 8192-element tiles and 16-column dots, the rest of the Hadamard as
  fp32 butterflies (sweep 5: +6% encode, +5% decode over one 128-column dot at 1 GiB), two tiles
  per program (sweep 6: the tail of a 4-tile loop costs encode 4% at 64 MiB);
- kernels that hold N peer rows in registers take 2048-element tiles: decode-sum with 64-column
  dots (sweep 5: 2.06 -> 2.96 TB/s at 1 GiB), decode-sum-reencode (no dot) one tile per program
  (sweeps 1-2: 3.0-3.2 TB/s at 256 MiB).
"""

from __future__ import annotations

import dataclasses

# Per kind of kernel (sweeps 1-6, 64 MiB - 1 GiB of bf16 on the H200): elements per tile,
# warps, Hadamard dot columns (None: no dot) and tiles per program (a loop, see below).
TILE_DOT = (8192, 4, 16, 2)  # encode / decode: 64 groups of 128, one M=64 block per warpgroup
TILE_PEERS_DOT = (2048, 4, 64, 4)  # decode-sum: N peer tiles live in registers at once
TILE_PEERS_NO_DOT = (2048, 4, None, 1)  # decode-sum-reencode; decode-sum without a Hadamard
TILE_NO_DOT = (8192, 8, None, 1)  # a plain streaming pass (fp8 / int8 codecs: 3.6-3.8 TB/s)
# A dot program loops over its tiles only once the launch has enough tiles to fill the GPU with
# programs anyway (132 SMs x ~4 resident programs x the loop).
MIN_TILES_FOR_LOOP = 1024
# tl.dot needs every dimension >= 16 (the Hadamard is a tensor-core dot over groups).
MIN_GROUPS_PER_TILE = 16
# Largest Hadamard block applied as one dot; larger G peels its low index bits off first:
# S_G = S_b (x) S_{G/b}, G/b dots of b columns and fp32 butterflies (`_tile.signed_hadamard`).
MAX_DOT_HADAMARD = 128


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """How a kernel splits its rows into programs.

    groups_per_tile: groups of G one tile holds (a power of two, >= 16).
    tiles_per_program: consecutive tiles one program walks through in a loop (1: no loop).
    num_warps / num_stages: Triton launch parameters (stages pipeline the tile loop's loads).
    hadamard_dot: size b of the +-1 block applied as one tensor-core dot (G > b: G / b dots of
      b columns, combined by butterflies on the low index bits).
    signs_in_kernel: build that block from an iota in each program instead of loading it.
    prefetch: in the tile loop, load tile k + 1 before processing tile k.
    energy_after_dot: encode takes the ASH energy of H x instead of x (equal in exact arithmetic,
      H is orthonormal), so the input tile is dead once the dot has read it.
    """

    groups_per_tile: int
    num_warps: int = 4
    num_stages: int = 2
    tiles_per_program: int = 1
    hadamard_dot: int = MAX_DOT_HADAMARD
    signs_in_kernel: bool = False
    prefetch: bool = False
    energy_after_dot: bool = False

    def __post_init__(self):
        for name in ("groups_per_tile", "tiles_per_program", "hadamard_dot"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"BlockConfig.{name}={value} must be a power of two")
        if self.groups_per_tile < MIN_GROUPS_PER_TILE:
            raise ValueError(
                f"BlockConfig.groups_per_tile={self.groups_per_tile} must be >= "
                f"{MIN_GROUPS_PER_TILE} (tensor-core dot)"
            )
        if not 16 <= self.hadamard_dot <= MAX_DOT_HADAMARD:
            raise ValueError(
                f"BlockConfig.hadamard_dot={self.hadamard_dot} must be in 16..{MAX_DOT_HADAMARD}"
            )

    def grid_size(self, num_groups: int) -> int:
        """Programs needed along a row of `num_groups` groups."""
        return cdiv(cdiv(num_groups, self.groups_per_tile), self.tiles_per_program)

    def masked(self, num_groups: int) -> bool:
        """Whether the programs overrun the row (then every load and store is masked)."""
        return num_groups % (self.groups_per_tile * self.tiles_per_program) != 0


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def block_config(group_size: int, num_groups: int, *, rows=1, peers=1, dot=True) -> BlockConfig:
    """The launch for `rows` rows (or `peers` rows summed into one) of `num_groups` groups.

    dot: the kernel applies the Hadamard dot (then it loops over tiles, see module docstring).
    """
    if peers > 1:
        elements, warps, dot_columns, loop = TILE_PEERS_DOT if dot else TILE_PEERS_NO_DOT
    else:
        elements, warps, dot_columns, loop = TILE_DOT if dot else TILE_NO_DOT
    groups = max(MIN_GROUPS_PER_TILE, elements // group_size)
    groups = max(MIN_GROUPS_PER_TILE, min(groups, _next_pow2(num_groups)))
    tiles = rows * cdiv(num_groups, groups)
    loop = loop if tiles >= MIN_TILES_FOR_LOOP else 1
    return BlockConfig(
        groups,
        num_warps=warps,
        num_stages=1,
        tiles_per_program=loop,
        hadamard_dot=dot_columns or MAX_DOT_HADAMARD,  # unused without a dot
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Mosaic GPU encode (`encode_mosaic`, mosaic_study 1-3 on the H200): a program pipelines
# MOSAIC_TILES_PER_PROGRAM tiles of 64 groups with MOSAIC_STEPS_IN_FLIGHT TMA stages (16 / 3:
# 3.6-4.0 TB/s from 64 MiB; 64 tiles starve a 64 MiB call of programs), fewer when the call is
# too small to give every SM ~2 programs.
MOSAIC_GROUPS_PER_TILE = 64  # one wgmma M block of a warpgroup
MOSAIC_TILES_PER_PROGRAM = 16
MOSAIC_STEPS_IN_FLIGHT = 3
MOSAIC_MIN_PROGRAMS = 256
# "auto" takes the Mosaic encode from this many tiles (64 MiB of bf16), where it measured 1.15x
# (64 MiB) - 1.30x (1 GiB) the Triton kernel; at 4 MiB it took twice as long (9.5 vs 4.5 us in
# one program: 1-tile programs each stage the 32 KiB sign matrix). 4 - 64 MiB is not measured.
MOSAIC_MIN_TILES = MOSAIC_TILES_PER_PROGRAM * MOSAIC_MIN_PROGRAMS


def mosaic_launch(rows: int, tiles_per_row: int) -> tuple[int, int]:
    """(tiles per program, pipeline steps in flight) of the Mosaic encode."""
    per_program = MOSAIC_TILES_PER_PROGRAM
    while per_program > 1 and (
        tiles_per_row % per_program or rows * tiles_per_row // per_program < MOSAIC_MIN_PROGRAMS
    ):
        per_program //= 2
    return per_program, min(MOSAIC_STEPS_IN_FLIGHT, per_program)
