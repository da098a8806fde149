"""Fused encode: x[R, n] (bf16/fp32) -> packed wire rows uint8[R, codec.wire_bytes(n)].

One pass over HBM per tile of T groups: load, Hadamard (tensor-core dot), ASH pre-scale, DS
post-scale, cast, store codes and scale bytes straight into their places in the wire row.
Equal to `codecs.encode_wire(codec, x)` (the packed jnp reference) up to the rounding notes of
`_tile` (codes may differ from the reference only at FP8/INT8 rounding ties).
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


def _encode_kernel(
    x_ref, h_ref, wire_ref, *, codec: Codec, n: int, cfg: BlockConfig, exact_bf16: bool, interpret
):
    row = pl.program_id(0)
    g, t = codec.group_size, cfg.groups_per_tile
    hblock = h_ref[...] if codec.hadamard else None

    def load(tile):
        return _tile.load_1d(x_ref, row, tile * t * g, t * g, n, masked=cfg.masked(n // g))

    unit = codecs.hadamard_unit(g) if codec.hadamard else 1.0

    def encode_tile(tile, x):
        # A bf16 tile feeds the dot as loaded (an exact operand): no fp32 copy of x stays live
        # through the dot.
        x = x.reshape(t, g)
        v = (
            _tile.signed_hadamard(x, hblock, exact_bf16=exact_bf16, interpret=interpret)
            if codec.hadamard
            else x.astype(jnp.float32)
        )
        codes, scale, prescale = codecs.encode_groups(
            codec, v, unit=unit, magic_round=not interpret
        )
        _tile.store_groups(codec, wire_ref, row, tile, n, cfg, codes, scale, prescale)

    _tile.for_each_tile(cfg, pl.program_id(1), load, encode_tile)


def default_config(codec: Codec, n: int) -> BlockConfig:
    """The launch `encode` takes for rows of n elements unless given one."""
    launch = ("planes" if codec.bits < 8 else "encode_dot") if codec.hadamard else "no_dot"
    return block_config(launch, codec.group_size, n // codec.group_size)


def encode(
    codec: Codec,
    x: jax.Array,
    *,
    interpret: bool = False,
    out_init=None,
    config: BlockConfig | None = None,
) -> jax.Array:
    """x[R, n] -> wire[R, codec.wire_bytes(n)] (n a multiple of G; rows need not fill a tile).

    Equals `codecs.encode_wire(codec, x)` up to rounding ties (`_tile`).
    out_init: optional buffer of the output's shape, aliased to it (checks poison it).
    config: the launch (default: `default_config`).
    """
    codecs.check_encodable(codec, x)
    if x.ndim != 2:
        raise ValueError(f"encode takes rows [R, n], got shape={x.shape}")
    rows, n = x.shape
    cfg = config or default_config(codec, n)
    kernel = functools.partial(
        _encode_kernel,
        codec=codec,
        n=n,
        cfg=cfg,
        exact_bf16=x.dtype == jnp.bfloat16,
        interpret=interpret,
    )
    h = jnp.asarray(_tile.hadamard_block(codec.group_size, cfg), jnp.bfloat16)
    return _pallas.call(
        kernel,
        x,
        h,
        out_init=out_init,
        out_shape=jax.ShapeDtypeStruct((rows, codec.wire_bytes(n)), jnp.uint8),
        grid=(rows, cfg.grid_size(n // codec.group_size)),
        name=f"taco_encode_{codec.name}_g{codec.group_size}",
        interpret=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


# The definition the kernel equals up to rounding ties: the jnp reference, packed.
encode_reference = codecs.encode_wire
