"""Fused decode-sum and decode-sum-reencode over N wire rows (one per peer), one pass.

decode_sum: wire[N, B] -> fp32 sum of the N decoded rows, [n] (end of a reduce-scatter).
decode_sum_reencode: wire[N, B] -> wire[B] of that sum (middle of the two-shot all-reduce).

Both sum in the Hadamard domain: H is linear and orthonormal, so
  sum_p H(q_p) d_p = H(sum_p q_p d_p)          (one Hadamard instead of N), and
  encode(sum) needs H(sum) = sum_p q_p d_p       (none at all: H H = I),
with the energy of the sum read in the Hadamard domain (||H z|| = ||z||). The peers are summed
in fixed order 0..N-1, so every rank computes the same bytes. Equal to the reference
(`taco_jax._backends` XLA ops) up to fp32 rounding; codes differ only at rounding ties.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _pallas, _tile
from pallas_kernels.config import block_config, cdiv
from pallas_kernels.decode_kernel import check_wire
from taco_jax import _backends
from taco_jax.codecs import Codec


def _summed_h_domain(codec: Codec, wire_ref, tile, n: int, t: int) -> jax.Array:
    """sum_p q_p d_p over the N peers for one tile: the sum, Hadamard-transformed (fp32 [T, G])."""
    total = None
    for peer in range(wire_ref.shape[0]):
        q, d = _tile.load_groups(codec, wire_ref, peer, tile, n, t)
        part = q * d[:, None] if not isinstance(d, float) else q
        total = part if total is None else total + part
    return total


def _decode_sum_kernel(wire_ref, h_ref, out_ref, *, codec: Codec, n: int, t: int, interpret: bool):
    tile = _pallas.program_id(0)
    g = codec.group_size
    z = _summed_h_domain(codec, wire_ref, tile, n, t)
    x = (
        _tile.hadamard(z, h_ref[...], exact_bf16=False, interpret=interpret)
        if codec.hadamard
        else z
    )
    _tile.store_1d(out_ref, 0, tile * t * g, x.reshape(t * g), n, masked=(n // g) % t != 0)


def _decode_sum_reencode_kernel(
    wire_ref, out_ref, *, codec: Codec, n: int, t: int, interpret: bool
):
    tile = _pallas.program_id(0)
    hz = _summed_h_domain(codec, wire_ref, tile, n, t)
    codes, scale, prescale = _tile.encode_groups(codec, hz, hz, interpret=interpret)
    _tile.store_groups(codec, out_ref, 0, tile, n, t, codes, scale, prescale)


def _launch(kernel, codec, wire, n, out, name, interpret, out_init, *extra):
    check_wire(codec, wire, n)
    cfg = block_config(codec.group_size, n // codec.group_size)
    t = cfg.groups_per_tile
    return _pallas.call(
        _pallas.partial(kernel, codec=codec, n=n, t=t, interpret=interpret),
        wire,
        *extra,
        out_init=None if out_init is None else out_init[None],
        out_shape=out,
        grid=(cdiv(n // codec.group_size, t),),
        name=f"{name}_{codec.name}_g{codec.group_size}",
        interpret=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def decode_sum(codec: Codec, wire: jax.Array, n: int, *, interpret=False, out_init=None):
    """wire[N, B] -> fp32 [n], the sum of the N decoded rows (out_init: as `encode`)."""
    h = jnp.asarray(_tile.hadamard_block(codec.group_size), jnp.bfloat16)
    out = jax.ShapeDtypeStruct((1, n), jnp.float32)
    return _launch(
        _decode_sum_kernel, codec, wire, n, out, "taco_decode_sum", interpret, out_init, h
    )[0]


def decode_sum_reencode(codec: Codec, wire: jax.Array, n: int, *, interpret=False, out_init=None):
    """wire[N, B] -> wire[B] holding encode(sum of the N decoded rows) (out_init: as `encode`)."""
    out = jax.ShapeDtypeStruct((1, codec.wire_bytes(n)), jnp.uint8)
    name = "taco_decode_sum_reencode"
    return _launch(_decode_sum_reencode_kernel, codec, wire, n, out, name, interpret, out_init)[0]


def decode_sum_reference(codec: Codec, wire: jax.Array, n: int) -> jax.Array:
    """The definition: fp32 sum over peers 0..N-1 of `codecs.decode_reference` (the XLA op)."""
    return _backends.XLA_OPS.decode_sum(codec, wire, n)


def decode_sum_reencode_reference(codec: Codec, wire: jax.Array, n: int) -> jax.Array:
    """The definition: pack(encode_reference(decode_sum_reference(wire))) (the XLA op)."""
    return _backends.XLA_OPS.decode_sum_reencode(codec, wire, n)
