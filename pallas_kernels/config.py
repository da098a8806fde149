"""The tuning of the Triton-lowered kernels: `BlockConfig`, and the default each kernel takes.

A kernel walks its rows in tiles of T groups; `block_config` picks T and the warps from one row
of `LAUNCHES`, by the kind of kernel. The values are the fastest of the sweeps in
`docs/decisions/005-triton-launches.md`.
"""

from __future__ import annotations

import dataclasses

# tl.dot needs every dimension >= 16 (the Hadamard is a tensor-core dot over a tile's groups).
MIN_GROUPS_PER_TILE = 16
# Largest Hadamard block applied as one dot; a larger G is split by butterflies first
# (`_tile.signed_hadamard`).
MAX_DOT_HADAMARD = 128
# The encode and decode give each warp this many elements of a tile (`Launch.num_warps` None), so
# that a group size forcing a larger tile (MIN_GROUPS_PER_TILE groups of G > 128) gets more warps.
ELEMENTS_PER_WARP = 2048
MAX_WARPS = 8


@dataclasses.dataclass(frozen=True)
class Launch:
    """One row of `LAUNCHES`: elements per tile (capped to the row), Triton warps (None: one per
    `ELEMENTS_PER_WARP` elements of the tile), the Hadamard dot's columns (None: no dot), and for
    a decode-sum whether each peer's codes take their own Hadamard
    (`BlockConfig.hadamard_per_peer`)."""

    elements_per_tile: int
    num_warps: int | None
    dot_columns: int | None
    hadamard_per_peer: bool = False


LAUNCHES = {
    # encode and decode with the Hadamard dot: small tiles, one a program, so that a TP step's
    # 8-64 MiB messages fill the GPU; sub-byte codes over several planes.
    "encode_dot": Launch(4096, num_warps=None, dot_columns=16),  # 2 warps at G <= 256
    "decode_dot": Launch(2048, num_warps=None, dot_columns=16),  # 1 warp at G <= 128
    "planes": Launch(8192, num_warps=4, dot_columns=16),
    # no Hadamard (fp8, int8): a plain streaming pass.
    "no_dot": Launch(8192, num_warps=8, dot_columns=None),
    # decode-sum: N peer tiles in registers at once; two peers, each through its own Hadamard.
    "peers_dot": Launch(2048, num_warps=4, dot_columns=64),
    "two_peers_dot": Launch(8192, num_warps=2, dot_columns=16, hadamard_per_peer=True),
    # decode-sum-reencode (no Hadamard: H H = I) and decode-sum without one.
    "peers_no_dot": Launch(2048, num_warps=4, dot_columns=None),
    # TAH-Quant (`tahquant_kernel`): the encode bound by its arithmetic, the decode streams.
    "stage_encode": Launch(2048, num_warps=2, dot_columns=None),
    "stage_decode": Launch(8192, num_warps=2, dot_columns=None),
    "stage_decode_g32": Launch(4096, num_warps=2, dot_columns=None),
}


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """How a Triton kernel splits its rows into programs.

    groups_per_tile: groups of G one tile holds (a power of two, >= min_groups).
    num_warps / num_stages: Triton launch parameters.
    tiles_per_program: consecutive tiles one program loops over (1: no loop).
    hadamard_dot: size b of the +-1 block applied as one tensor-core dot (G > b: G / b dots of
      b columns, combined by butterflies on the low index bits).
    hadamard_per_peer: decode-sum only: each peer's codes through their own Hadamard (exact
      bf16 operands), instead of one Hadamard of the fp32 sum (three bf16 pieces).
    min_groups: the fewest groups a tile may hold: 16 where the Hadamard is a dot over the
      tile's groups; the TAH-Quant kernels, with no dot, take large groups one at a time.
    """

    groups_per_tile: int
    num_warps: int = 4
    num_stages: int = 1
    tiles_per_program: int = 1
    hadamard_dot: int = MAX_DOT_HADAMARD
    hadamard_per_peer: bool = False
    min_groups: int = MIN_GROUPS_PER_TILE

    def __post_init__(self):
        for name in ("groups_per_tile", "tiles_per_program", "hadamard_dot"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"BlockConfig.{name}={value} must be a power of two")
        if self.groups_per_tile < self.min_groups:
            raise ValueError(
                f"BlockConfig.groups_per_tile={self.groups_per_tile} must be >= "
                f"min_groups={self.min_groups}"
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


def block_config(
    launch: str,
    group_size: int,
    num_groups: int,
    *,
    min_groups: int = MIN_GROUPS_PER_TILE,
) -> BlockConfig:
    """The `LAUNCHES[launch]` config for rows (or peers summed) of `num_groups` groups."""
    row = LAUNCHES[launch]
    groups = max(min_groups, row.elements_per_tile // group_size)
    groups = max(min_groups, min(groups, 1 << max(0, (num_groups - 1).bit_length())))
    warps = row.num_warps or min(MAX_WARPS, max(1, groups * group_size // ELEMENTS_PER_WARP))
    return BlockConfig(
        groups,
        num_warps=warps,
        hadamard_dot=row.dot_columns or MAX_DOT_HADAMARD,  # unused without a dot
        hadamard_per_peer=row.hadamard_per_peer,
        min_groups=min_groups,
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
