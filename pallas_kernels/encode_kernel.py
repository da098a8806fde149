"""Fused encode: x[R, n] (bf16/fp32) -> packed wire rows uint8[R, codec.wire_bytes(n)].

One pass over HBM per tile of T groups: load, Hadamard (tensor-core dot), ASH pre-scale, DS
post-scale, cast, store codes and scale bytes straight into their places in the wire row.
Equal to `codecs.encode_wire(codec, x)` (the packed jnp reference) up to the rounding notes of
`_tile` (codes may differ from the reference only at FP8/INT8 rounding ties).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _pallas, _tile, encode_mosaic
from pallas_kernels.config import BlockConfig, block_config
from taco_jax import codecs
from taco_jax.codecs import Codec


def _encode_kernel(
    x_ref, h_ref, wire_ref, *, codec: Codec, n: int, cfg: BlockConfig, exact_bf16: bool, interpret
):
    row = _pallas.program_id(0)
    g, t = codec.group_size, cfg.groups_per_tile
    hblock = _tile.signs(h_ref, cfg) if codec.hadamard else None

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

    _tile.for_each_tile(cfg, _pallas.program_id(1), load, encode_tile)


def default_config(codec: Codec, rows: int, n: int) -> BlockConfig:
    """The launch the Triton `encode` takes for rows [R, n] unless given one (sub-byte codes:
    `config.PLANES_ENCODE_DECODE`)."""
    groups = n // codec.group_size
    return block_config(
        codec.group_size, groups, rows=rows, dot=codec.hadamard, planes=codec.bits < 8
    )


def encode(
    codec: Codec,
    x: jax.Array,
    *,
    interpret: bool = False,
    out_init=None,
    config: BlockConfig | None = None,
    backend: str = "auto",
) -> jax.Array:
    """x[R, n] -> wire[R, codec.wire_bytes(n)] (n a multiple of G; rows need not fill a tile).

    Equals `codecs.encode_wire(codec, x)` up to rounding ties.
    out_init: optional buffer of the output's shape, aliased to it (checks poison it).
    config: the Triton launch (default: `default_config`).
    backend: "triton" (Pallas, Triton lowering: every codec and shape, interpret mode), "mosaic"
      (`encode_mosaic`: Hopper, 8-bit or sub-byte codes with fp32 scales, bf16, G = 128, whole
      tiles), or
      "auto": Mosaic where `encode_mosaic.preferred` (it applies, at a size where it measured
      faster: BENCHMARKS.md, "Kernels") and no Triton option (interpret, out_init, config) is
      asked for, else Triton. With Triton off (`TACO_JAX_TRITON=0`, or a JAX without the
      Triton lowering: `_pallas.kernel_for`), "auto" takes Mosaic wherever it applies and
      `encode_reference` elsewhere.
    """
    codecs.check_encodable(codec, x)
    if x.ndim != 2:
        raise ValueError(f"encode takes rows [R, n], got shape={x.shape}")
    kernel = _pallas.kernel_for(
        "encode",
        backend,
        triton_options=interpret or out_init is not None or config is not None,
        preferred=lambda: encode_mosaic.preferred(codec, x),
        unsupported=lambda: encode_mosaic.unsupported(codec, x),
    )
    if kernel == "mosaic":
        return encode_mosaic.encode(codec, x)
    if kernel == "reference":
        return encode_reference(codec, x)
    rows, n = x.shape
    groups = n // codec.group_size
    cfg = config or default_config(codec, rows, n)
    kernel = _pallas.partial(
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
        grid=(rows, cfg.grid_size(groups)),
        name=f"taco_encode_{codec.name}_g{codec.group_size}",
        interpret=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


# The definition the kernel equals up to rounding ties: the jnp reference, packed.
encode_reference = codecs.encode_wire
