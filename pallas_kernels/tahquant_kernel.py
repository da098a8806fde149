"""Fused TAH-Quant encode and decode (pipeline stage traffic), one pass over HBM per tile.

encode: x[R, n] (bf16/fp32) -> wire rows uint8[R, codec.wire_bytes(n)]: load a tile of T groups,
pivot swap and H_32 on the groups with a dominant outlier (for G = 128 only on tiles that hold
one, `SKIP_PIVOT_GROUP_SIZES`), quantize with stochastic rounding
(noise hashed from the element's index in registers, `tahquant.uniform_noise`: nothing extra is
read), pack (4-bit codes two per byte), store codes and side bytes into their places in the row.
decode: the inverse, to bf16 or fp32.

The tile arithmetic is `taco_jax.tahquant`'s own (`encode_groups`, `decode_groups`), so the
kernels equal `tahquant.encode_wire` / `decode_wire` up to fp32 rounding differences of the
compiled arithmetic (the GPU may fuse a multiply and an add): a code may move by one step only
where the reference's pre-rounding value lies within a few ulp of a rounding boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _pallas, _tile
from pallas_kernels._pallas import pl
from pallas_kernels.config import MIN_GROUPS_PER_TILE, BlockConfig, block_config
from taco_jax import codecs, tahquant
from taco_jax.tahquant import TahQuant


def _tile_pairs(row, tile, t: int, g: int, n: int) -> jax.Array:
    """The uint32 pair numbers of a [T, G] tile, [T, G / 2] (`tahquant.pair_counters`)."""
    start = row.astype(jnp.uint32) * np.uint32(n // 2) + (tile * (t * g // 2)).astype(jnp.uint32)
    within = lax.broadcasted_iota(jnp.int32, (t, g // 2), 0) * (g // 2) + lax.broadcasted_iota(
        jnp.int32, (t, g // 2), 1
    )
    return start + within.astype(jnp.uint32)


# The encode skips the pivot's swap and H_32 on a tile with no flagged group for these group
# sizes only. Measured at 64 MiB on one H200 (BENCHMARKS.md "Pipeline codec kernels"): G = 128
# encodes 1.5x faster on Gaussian data and the same where every tile pivots; at G = 32 the skip
# made the encode 10% slower where every tile pivots (the decodes gained nothing from it).
SKIP_PIVOT_GROUP_SIZES = (128,)


def _pivot_forward(groups, flag, index):
    """`tahquant.pivot_forward` with the butterflies in the kernels' form."""
    return tahquant.pivot_forward(groups, flag, index, tahquant.butterflies_by_pair_splits)


def _encode_pivot(codec: TahQuant):
    """`_pivot_forward`, or for `SKIP_PIVOT_GROUP_SIZES` the same values computed only where
    some group of the tile is flagged (unflagged groups have index 0, which the transform leaves
    alone): a select would still compute the swap and H_32 of every group."""
    if codec.group_size not in SKIP_PIVOT_GROUP_SIZES:
        return _pivot_forward

    def tile_pivot(groups, flag, index):
        any_flag = jnp.max(flag.astype(jnp.int32)) > 0  # "any", as an integer max reduction
        return lax.cond(any_flag, _pivot_forward, lambda g, f, i: g, groups, flag, index)

    return tile_pivot


def _encode_kernel(
    x_ref, seeds_ref, wire_ref, *, codec: TahQuant, n: int, cfg: BlockConfig, interpret: bool
):
    row = pl.program_id(0)
    g, t = codec.group_size, cfg.groups_per_tile
    groups, masked = n // g, cfg.masked(n // g)
    seeds = (seeds_ref[0], seeds_ref[1]) if codec.stochastic else None
    code_bytes = t * g * codec.bits // 8

    def load(tile):
        return _tile.load_1d(x_ref, row, tile * t * g, t * g, n, masked=masked)

    def encode_tile(tile, x):
        noise = None
        if codec.stochastic:
            noise = tahquant.uniform_noise(seeds, _tile_pairs(row, tile, t, g, n))
        values = x.reshape(t, g).astype(jnp.float32)
        codes, sides = tahquant.encode_groups(
            codec,
            values,
            noise,
            magic_round=not interpret,
            pivot=_encode_pivot(codec),
        )
        packed = tahquant.pack_codes(codec, codes.reshape(t * g))
        _tile.store_1d(wire_ref, row, tile * code_bytes, packed, codec.code_bytes(n), masked=masked)
        for field, (offset, width) in tahquant.sections(codec, n).items():
            data = codecs.side_to_bytes(sides[field], width)
            _tile.store_side(wire_ref, row, offset, width, tile, data, groups, masked=masked)

    _tile.for_each_tile(cfg, pl.program_id(1), load, encode_tile)


def _decode_kernel(wire_ref, out_ref, *, codec: TahQuant, n: int, cfg: BlockConfig):
    row = pl.program_id(0)
    g, t = codec.group_size, cfg.groups_per_tile
    groups, masked = n // g, cfg.masked(n // g)
    code_bytes = t * g * codec.bits // 8
    sections = tahquant.sections(codec, n)

    def load(tile):
        codes = _tile.load_1d(
            wire_ref, row, tile * code_bytes, code_bytes, codec.code_bytes(n), masked=masked
        )
        sides = {
            field: _tile.load_side(wire_ref, row, offset, width, tile, t, groups, masked=masked)
            for field, (offset, width) in sections.items()
        }
        return codes, sides

    def decode_tile(tile, raw):
        packed, side_bytes = raw
        widths = dict(codec.side_fields)
        sides = {f: codecs.side_from_bytes(b, widths[f]) for f, b in side_bytes.items()}
        codes = tahquant.unpack_codes(codec, packed).reshape(t, g)
        x = tahquant.decode_groups(codec, codes, sides, tahquant.butterflies_by_pair_splits)
        x = x.reshape(t * g).astype(out_ref.dtype)
        _tile.store_1d(out_ref, row, tile * t * g, x, n, masked=masked)

    _tile.for_each_tile(cfg, pl.program_id(1), load, decode_tile)


# Up to G = MAX_GROUP_OF_WIDE_TILES a tile holds at least 16 groups (`block_config`, as the
# TP kernels); larger groups (SDP4Bit's qWD, G = 2048) fill the launch's tile with whole groups,
# down to one (these kernels have no dot). A group of 2048 on the encode's 2 warps is 32 fp32
# values per thread; larger groups run the reference (`taco_jax._backends`).
MAX_KERNEL_GROUP = 2048
MAX_GROUP_OF_WIDE_TILES = 128


def _launch(codec: TahQuant, n: int, launch: str) -> BlockConfig:
    g, groups = codec.group_size, n // codec.group_size
    if g > MAX_KERNEL_GROUP:
        raise ValueError(
            f"group_size={g} of codec {codec.name!r}: the kernels take groups of "
            f"at most {MAX_KERNEL_GROUP}"
        )
    min_groups = MIN_GROUPS_PER_TILE if g <= MAX_GROUP_OF_WIDE_TILES else 1
    return block_config(launch, g, groups, min_groups=min_groups)


def encode_config(codec: TahQuant, n: int) -> BlockConfig:
    """The encode's default launch for rows of n elements."""
    return _launch(codec, n, "stage_encode")


def encode(
    codec: TahQuant,
    x: jax.Array,
    key: jax.Array | None = None,
    *,
    interpret: bool = False,
    config: BlockConfig | None = None,
) -> jax.Array:
    """x[R, n] -> wire[R, codec.wire_bytes(n)] (n a multiple of G).

    Equals `tahquant.encode_wire(codec, x, key)` up to rounding at code boundaries.
    key: the stochastic rounding's PRNG key (required when `codec.stochastic`).
    config: the launch (default: `block_config`).
    """
    tahquant.check_stage_encodable(codec, x)
    if codec.stochastic and key is None:
        raise ValueError(f"codec {codec.name!r} rounds stochastically: pass a PRNG key")
    rows, n = x.shape
    cfg = config or encode_config(codec, n)
    seeds = tahquant.noise_seeds(key) if codec.stochastic else jnp.zeros((2,), jnp.uint32)
    kernel = functools.partial(_encode_kernel, codec=codec, n=n, cfg=cfg, interpret=interpret)
    return _pallas.call(
        kernel,
        x,
        seeds,
        out_shape=jax.ShapeDtypeStruct((rows, codec.wire_bytes(n)), jnp.uint8),
        grid=(rows, cfg.grid_size(n // codec.group_size)),
        name=f"tahquant_encode_{codec.name}",
        interpret=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def decode(
    codec: TahQuant,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret: bool = False,
    config: BlockConfig | None = None,
) -> jax.Array:
    """wire[R, codec.wire_bytes(n)] -> x[R, n] of `dtype`; equals `tahquant.decode_wire` up to
    fp32 rounding."""
    if n % codec.group_size:
        raise ValueError(f"{n=} is not a multiple of group_size={codec.group_size}")
    if wire.ndim != 2 or wire.shape[1] != codec.wire_bytes(n) or wire.dtype != jnp.uint8:
        raise ValueError(
            f"wire shape={wire.shape} dtype={wire.dtype} is not "
            f"uint8[R, {codec.wire_bytes(n)}] for {n=} and codec {codec.name!r}"
        )
    rows = wire.shape[0]
    launch = "stage_decode_g32" if codec.group_size == 32 else "stage_decode"
    cfg = config or _launch(codec, n, launch)
    return _pallas.call(
        functools.partial(_decode_kernel, codec=codec, n=n, cfg=cfg),
        wire,
        out_shape=jax.ShapeDtypeStruct((rows, n), dtype),
        grid=(rows, cfg.grid_size(n // codec.group_size)),
        name=f"tahquant_decode_{codec.name}",
        interpret=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


# The definitions the kernels equal up to rounding: the jnp references on packed rows.
encode_reference = tahquant.encode_wire
decode_reference = tahquant.decode_wire
