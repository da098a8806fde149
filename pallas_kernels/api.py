"""The public codec ops: each checks its call, asks `registry` which kernel runs it, runs it.

Each equals its jnp reference on packed wire rows (`taco_jax.codecs`): exactly in structure,
up to fp32 rounding in values (codes: up to rounding ties). fallback: where the chosen kernel
cannot take a call, run the reference with one warning (True) or raise, naming the call
(`registry.kernel_for`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import (
    decode_kernel,
    decode_mosaic,
    decode_sum_kernel,
    encode_kernel,
    encode_mosaic,
    registry,
)
from taco_jax import codecs
from taco_jax.codecs import Codec


def encode(
    codec: Codec, x: jax.Array, *, interpret: bool = False, fallback: bool = True
) -> jax.Array:
    """x[R, n] -> wire[R, codec.wire_bytes(n)]; equals `codecs.encode_wire(codec, x)` up to
    rounding ties. interpret: the kernels in Pallas' CPU interpreter."""
    codecs.check_encodable(codec, x)
    if x.ndim != 2:
        raise ValueError(f"encode takes rows [R, n], got shape={x.shape}")
    kernel = registry.kernel_for(
        "encode",
        codec,
        n=x.shape[1],
        dtype=x.dtype,
        peers=x.shape[0],
        interpret=interpret,
        fallback=fallback,
    )
    if kernel == "mosaic":
        return encode_mosaic.encode(codec, x)
    if kernel == "triton":
        return encode_kernel.encode(codec, x, interpret=interpret)
    return codecs.encode_wire(codec, x)


def decode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret: bool = False,
    fallback: bool = True,
) -> jax.Array:
    """wire[R, codec.wire_bytes(n)] -> x[R, n] of `dtype`; equals `codecs.decode_wire`."""
    decode_kernel.check_wire(codec, wire, n)
    kernel = registry.kernel_for(
        "decode",
        codec,
        n=n,
        dtype=dtype,
        peers=wire.shape[0],
        interpret=interpret,
        fallback=fallback,
    )
    if kernel == "mosaic":
        return decode_mosaic.decode(codec, wire, n, dtype)
    if kernel == "triton":
        return decode_kernel.decode(codec, wire, n, dtype, interpret=interpret)
    return codecs.decode_wire(codec, wire, n, dtype)


def decode_sum(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret: bool = False,
    fallback: bool = True,
) -> jax.Array:
    """wire[N, B] -> [n] of `dtype`, the fp32 sum of the N decoded rows in peer order, rounded
    once to `dtype`; equals `codecs.decode_sum_wire`."""
    decode_kernel.check_wire(codec, wire, n)
    kernel = registry.kernel_for(
        "decode_sum",
        codec,
        n=n,
        dtype=dtype,
        peers=wire.shape[0],
        interpret=interpret,
        fallback=fallback,
    )
    if kernel.startswith("mosaic"):
        return decode_mosaic.decode_sum(
            codec, wire, n, dtype, peer_steps=kernel == "mosaic_peer_steps"
        )
    if kernel == "triton":
        return decode_sum_kernel.decode_sum(codec, wire, n, dtype, interpret=interpret)
    return codecs.decode_sum_wire(codec, wire, n, dtype)


def decode_sum_reencode(
    codec: Codec, wire: jax.Array, n: int, *, interpret: bool = False, fallback: bool = True
) -> jax.Array:
    """wire[N, B] -> wire[B] of encode(the sum of the N decoded rows); equals
    `codecs.decode_sum_reencode_wire` up to rounding ties."""
    decode_kernel.check_wire(codec, wire, n)
    kernel = registry.kernel_for(
        "decode_sum_reencode",
        codec,
        n=n,
        dtype=None,
        peers=wire.shape[0],
        interpret=interpret,
        fallback=fallback,
    )
    if kernel.startswith("mosaic"):
        return decode_mosaic.decode_sum_reencode(
            codec, wire, n, peer_steps=kernel == "mosaic_peer_steps"
        )
    if kernel == "triton":
        return decode_sum_kernel.decode_sum_reencode(codec, wire, n, interpret=interpret)
    return codecs.decode_sum_reencode_wire(codec, wire, n)
