"""The one tile-size heuristic of the package (STYLE.md: never pasted into each kernel)."""

from __future__ import annotations

import dataclasses

# Elements one program handles: 8192 bf16 in + ~8.5 KiB out keeps enough bytes in flight per SM
# (132 SMs x a few programs) without spilling registers.
TARGET_TILE_ELEMENTS = 8192
# tl.dot needs every dimension >= 16 (the Hadamard is a tensor-core dot over groups).
MIN_GROUPS_PER_TILE = 16
# Largest Hadamard block applied as one dot; larger G is H_a (x) H_b with b = this.
MAX_DOT_HADAMARD = 128


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """How a kernel splits its rows into programs.

    groups_per_tile: groups of G one tile holds (a power of two, >= 16).
    tiles_per_program: consecutive tiles one program walks through in a loop (1: no loop).
    num_warps / num_stages: Triton launch parameters (stages pipeline the tile loop's loads).
    hadamard_dot: size b of the +-1 block applied as one tensor-core dot (G > b: H_{G/b} (x) H_b).
    signs_in_kernel: build that block from an iota in each program instead of loading it.
    prefetch: in the tile loop, load tile k + 1 before processing tile k.
    """

    groups_per_tile: int
    num_warps: int = 4
    num_stages: int = 2
    tiles_per_program: int = 1
    hadamard_dot: int = MAX_DOT_HADAMARD
    signs_in_kernel: bool = False
    prefetch: bool = False

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


def block_config(group_size: int, num_groups: int) -> BlockConfig:
    """Tile of ~TARGET_TILE_ELEMENTS elements, no larger than the row needs."""
    groups = max(MIN_GROUPS_PER_TILE, TARGET_TILE_ELEMENTS // group_size)
    groups = max(MIN_GROUPS_PER_TILE, min(groups, _next_pow2(num_groups)))
    warps = 8 if groups * group_size >= 8192 else 4
    return BlockConfig(groups_per_tile=groups, num_warps=warps)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
