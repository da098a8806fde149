"""The one tile-size heuristic of the package (STYLE.md: never pasted into each kernel)."""

from __future__ import annotations

import dataclasses

# Elements one program handles: 8192 bf16 in + ~8.5 KiB out keeps enough bytes in flight per SM
# (132 SMs x a few programs) without spilling registers.
TARGET_TILE_ELEMENTS = 8192
# tl.dot needs every dimension >= 16 (the Hadamard is a tensor-core dot over groups).
MIN_GROUPS_PER_TILE = 16


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """groups_per_tile: groups of G handled by one program (a power of two, >= 16).
    num_warps / num_stages: Triton launch parameters."""

    groups_per_tile: int
    num_warps: int = 4
    num_stages: int = 2


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
