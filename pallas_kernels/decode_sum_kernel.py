"""Fused decode-sum and decode-sum-reencode over N wire rows (one per peer), one pass.

decode_sum: wire[N, B] -> the fp32 sum of the N decoded rows, [n] in fp32 or the output dtype
  (the end of a reduce-scatter and of the one-shot all-reduce).
decode_sum_reencode: wire[N, B] -> wire[B] of that sum (middle of the two-shot all-reduce).

Both sum in the Hadamard domain: H is linear and orthonormal, so
  sum_p H(q_p) d_p = H(sum_p q_p d_p)          (one Hadamard instead of N), and
  encode(sum) needs H(sum) = sum_p q_p d_p       (none at all: H H = I),
with the energy of the sum read in the Hadamard domain (||H z|| = ||z||). A decode-sum may
instead decode each peer and sum the decoded values, as the reference does
(`BlockConfig.hadamard_per_peer`, the two-peer default): N dot chains of exact bf16 codes
against three for the fp32 sum's bf16 pieces. The peers are summed
in fixed order 0..N-1, so every rank computes the same bytes. Equal to the references
(`codecs.decode_sum_wire`, `codecs.decode_sum_reencode_wire`) up to fp32 rounding; codes differ
only at rounding ties.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _pallas, _tile
from pallas_kernels._pallas import pl
from pallas_kernels.config import BlockConfig, block_config
from pallas_kernels.decode_kernel import check_wire, decoded_tile
from taco_jax import codecs
from taco_jax.codecs import Codec


def _load_peers(codec: Codec, wire_ref, tile, n: int, cfg: BlockConfig):
    """The raw wire bytes of one tile from each of the N peers (rows of wire_ref)."""
    return [
        _tile.load_wire_tile(codec, wire_ref, peer, tile, n, cfg)
        for peer in range(wire_ref.shape[0])
    ]


def _peer_sum(codec: Codec, raws, tile, n: int, cfg: BlockConfig, unit, term) -> jax.Array:
    """sum_p term(q_p, d_p) over the N peers for one tile, in peer order, fp32 [T, G]; `unit`
    is folded into each d_p (`_tile.unpack_wire_tile`)."""
    total = None
    for raw in raws:
        q, d = _tile.unpack_wire_tile(codec, raw, tile, n, cfg, unit)
        part = term(q, d)
        total = part if total is None else total + part
    return total


def _summed_h_domain(codec: Codec, raws, tile, n: int, cfg: BlockConfig, unit=1.0) -> jax.Array:
    """sum_p q_p d_p: the sum of one tile, Hadamard-transformed, times `unit`."""
    return _peer_sum(codec, raws, tile, n, cfg, unit, codecs.scale_rows)


def _decode_sum_kernel(
    wire_ref, h_ref, out_ref, *, codec: Codec, n: int, cfg: BlockConfig, interpret: bool
):
    g, t = codec.group_size, cfg.groups_per_tile
    hblock = h_ref[...] if codec.hadamard else None
    unit = codecs.hadamard_unit(g) if codec.hadamard else 1.0

    def decoded(q, d):  # one peer through its own dot chain: its codes are exact in bf16
        return decoded_tile(codec, q, d, hblock, interpret)

    def decode_sum_tile(tile, raws):
        if codec.hadamard and cfg.hadamard_per_peer:  # N dot chains, no fp32 split
            x = _peer_sum(codec, raws, tile, n, cfg, unit, decoded)
        elif codec.hadamard:  # S (z / sqrt(G)) = H z: three chains, of the sum's bf16 pieces
            z = _summed_h_domain(codec, raws, tile, n, cfg, unit)
            x = _tile.signed_hadamard(z, hblock, exact_bf16=False, interpret=interpret)
        else:
            x = _summed_h_domain(codec, raws, tile, n, cfg)
        x = x.reshape(t * g).astype(out_ref.dtype)  # summed in fp32, stored in the output dtype
        _tile.store_1d(out_ref, 0, tile * t * g, x, n, masked=cfg.masked(n // g))

    load = functools.partial(_load_peers, codec, wire_ref, n=n, cfg=cfg)
    _tile.for_each_tile(cfg, pl.program_id(0), load, decode_sum_tile)


def _decode_sum_reencode_kernel(
    wire_ref, out_ref, *, codec: Codec, n: int, cfg: BlockConfig, interpret: bool
):
    def reencode_tile(tile, raws):
        hz = _summed_h_domain(codec, raws, tile, n, cfg)
        codes, scale, prescale = codecs.encode_groups(
            codec, hz, unit=1.0, magic_round=not interpret
        )
        _tile.store_groups(codec, out_ref, 0, tile, n, cfg, codes, scale, prescale)

    load = functools.partial(_load_peers, codec, wire_ref, n=n, cfg=cfg)
    _tile.for_each_tile(cfg, pl.program_id(0), load, reencode_tile)


def default_config(codec: Codec, peers: int, n: int, *, reencode: bool = False) -> BlockConfig:
    """The launch of `decode_sum` (`reencode`: of `decode_sum_reencode`, which never applies the
    Hadamard: H H = I) summing `peers` rows of n, unless given one."""
    if not codec.hadamard or reencode:
        launch = "peers_no_dot"
    else:
        launch = "two_peers_dot" if peers == 2 else "peers_dot"
    return block_config(launch, codec.group_size, n // codec.group_size)


def _launch(kernel, codec, wire, n, out_shape, name, *, interpret, out_init, config, signs):
    """One program per tile group; `signs`: the kernel takes the Hadamard block."""
    check_wire(codec, wire, n)
    cfg = config or default_config(codec, wire.shape[0], n, reencode=not signs)
    inputs = [wire]
    if signs:
        inputs.append(jnp.asarray(_tile.hadamard_block(codec.group_size, cfg), jnp.bfloat16))
    out = _pallas.call(
        functools.partial(kernel, codec=codec, n=n, cfg=cfg, interpret=interpret),
        *inputs,
        out_init=None if out_init is None else out_init[None],
        out_shape=out_shape,
        grid=(cfg.grid_size(n // codec.group_size),),
        name=f"{name}_{codec.name}_g{codec.group_size}",
        interpret=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out[0]


def decode_sum(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret=False,
    out_init=None,
    config: BlockConfig | None = None,
) -> jax.Array:
    """wire[N, B] -> [n] of `dtype`, the fp32 sum of the N decoded rows in peer order, rounded
    once to `dtype` (out_init, config: as `encode`)."""
    out_shape = jax.ShapeDtypeStruct((1, n), dtype)
    return _launch(
        _decode_sum_kernel,
        codec,
        wire,
        n,
        out_shape,
        "taco_decode_sum",
        interpret=interpret,
        out_init=out_init,
        config=config,
        signs=True,
    )


def decode_sum_reencode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    *,
    interpret=False,
    out_init=None,
    config: BlockConfig | None = None,
) -> jax.Array:
    """wire[N, B] -> wire[B] holding encode(sum of the N decoded rows) (as `decode_sum`)."""
    out_shape = jax.ShapeDtypeStruct((1, codec.wire_bytes(n)), jnp.uint8)
    return _launch(
        _decode_sum_reencode_kernel,
        codec,
        wire,
        n,
        out_shape,
        "taco_decode_sum_reencode",
        interpret=interpret,
        out_init=out_init,
        config=config,
        signs=False,
    )


# The definitions the kernels equal up to fp32 rounding (codes: up to rounding ties).
decode_sum_reference = codecs.decode_sum_wire
decode_sum_reencode_reference = codecs.decode_sum_reencode_wire
