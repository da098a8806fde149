"""Fused decode: packed wire rows uint8[R, B] -> x[R, n] in bf16 or fp32, one pass.

Equal to `codecs.decode_wire(codec, wire, n, dtype)` (the jnp reference) up to fp32
rounding (the Hadamard is a tensor-core dot of the exact codes, then scaled by s / alpha).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _pallas, _tile
from pallas_kernels._pallas import pl
from pallas_kernels.config import BlockConfig, block_config
from taco_jax import codecs
from taco_jax.codecs import Codec


def decoded_tile(codec: Codec, q, d, hblock, interpret: bool):
    """One tile's dequantized codes q [T, G] and decode factors d [T] -> fp32 values [T, G].

    d includes `codecs.hadamard_unit` for a rotating codec (`unpack_wire_tile(unit=...)`)."""
    if codec.hadamard:  # FP8/INT8 codes are exact in bf16
        q = _tile.signed_hadamard(q, hblock, exact_bf16=True, interpret=interpret)
    return codecs.scale_rows(q, d)


def _decode_kernel(
    wire_ref, h_ref, out_ref, *, codec: Codec, n: int, cfg: BlockConfig, interpret: bool
):
    row = pl.program_id(0)
    g, t = codec.group_size, cfg.groups_per_tile
    hblock = h_ref[...] if codec.hadamard else None
    unit = codecs.hadamard_unit(g) if codec.hadamard else 1.0

    def load(tile):
        return _tile.load_wire_tile(codec, wire_ref, row, tile, n, cfg)

    def decode_tile(tile, raw):
        q, d = _tile.unpack_wire_tile(codec, raw, tile, n, cfg, unit)
        x = decoded_tile(codec, q, d, hblock, interpret).reshape(t * g).astype(out_ref.dtype)
        _tile.store_1d(out_ref, row, tile * t * g, x, n, masked=cfg.masked(n // g))

    _tile.for_each_tile(cfg, pl.program_id(1), load, decode_tile)


def default_config(codec: Codec, n: int) -> BlockConfig:
    """The launch `decode` takes for rows of n elements unless given one: codes split over
    several bit planes (6 and 5 bits) take the planes' launch; 4-bit codes, one plane, the
    Hadamard decode's."""
    planes = len(codecs.PLANE_WIDTHS[codec.bits]) > 1
    launch = ("planes" if planes else "decode_dot") if codec.hadamard else "no_dot"
    return block_config(launch, codec.group_size, n // codec.group_size)


def decode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret=False,
    out_init=None,
    config: BlockConfig | None = None,
) -> jax.Array:
    """wire[R, codec.wire_bytes(n)] -> x[R, n] of `dtype` (out_init, config: as `encode`)."""
    check_wire(codec, wire, n)
    rows = wire.shape[0]
    cfg = config or default_config(codec, n)
    h = jnp.asarray(_tile.hadamard_block(codec.group_size, cfg), jnp.bfloat16)
    return _pallas.call(
        functools.partial(_decode_kernel, codec=codec, n=n, cfg=cfg, interpret=interpret),
        wire,
        h,
        out_init=out_init,
        out_shape=jax.ShapeDtypeStruct((rows, n), dtype),
        grid=(rows, cfg.grid_size(n // codec.group_size)),
        name=f"taco_decode_{codec.name}_g{codec.group_size}",
        interpret=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def check_wire(codec: Codec, wire: jax.Array, n: int) -> None:
    if n % codec.group_size:
        raise ValueError(f"{n=} is not a multiple of group_size={codec.group_size}")
    if wire.ndim != 2 or wire.shape[1] != codec.wire_bytes(n) or wire.dtype != jnp.uint8:
        raise ValueError(
            f"wire shape={wire.shape} dtype={wire.dtype} is not uint8[R, {codec.wire_bytes(n)}] "
            f"for {n=} and codec {codec.name!r}"
        )


# The definition the kernel equals up to fp32 rounding: the jnp reference on packed rows.
decode_reference = codecs.decode_wire
