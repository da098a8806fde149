"""The public codec ops: each checks its call, asks `registry.select` what runs it, runs that.

Each equals its jnp reference on packed wire rows (`taco_jax.codecs`): exactly in structure,
up to fp32 rounding in values (codes: up to rounding ties). interpret: the Triton kernels in
Pallas' CPU interpreter. fallback: as the collectives' impl="auto" (True: the kernels on a GPU,
the jnp reference elsewhere and, with one warning, where the chosen kernel cannot take a call)
or impl="pallas" (False: the kernels, and a ValueError naming a call they cannot take).
target: the platform (`taco_jax.target.Target`; None: `taco_jax.target.probe()`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import decode_kernel, registry
from taco_jax import codecs
from taco_jax import target as platform
from taco_jax.codecs import Codec


def _kernel(op, codec, n, dtype, rows, interpret, fallback, target) -> registry.Kernel:
    impl = "pallas_interpret" if interpret else "auto" if fallback else "pallas"
    target = platform.probe() if target is None else target
    return registry.select(op, codec, impl=impl, target=target, n=n, rows=rows, dtype=dtype)


def encode(
    codec: Codec, x: jax.Array, *, interpret: bool = False, fallback: bool = True, target=None
) -> jax.Array:
    """x[R, n] -> wire[R, codec.wire_bytes(n)]; equals `codecs.encode_wire(codec, x)` up to
    rounding ties."""
    codecs.check_encodable(codec, x)
    if x.ndim != 2:
        raise ValueError(f"encode takes rows [R, n], got shape={x.shape}")
    rows, n = x.shape
    return _kernel("encode", codec, n, x.dtype, rows, interpret, fallback, target)(codec, x)


def decode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret: bool = False,
    fallback: bool = True,
    target=None,
) -> jax.Array:
    """wire[R, codec.wire_bytes(n)] -> x[R, n] of `dtype`; equals `codecs.decode_wire`."""
    decode_kernel.check_wire(codec, wire, n)
    kernel = _kernel("decode", codec, n, dtype, wire.shape[0], interpret, fallback, target)
    return kernel(codec, wire, n, dtype)


def decode_sum(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret: bool = False,
    fallback: bool = True,
    target=None,
) -> jax.Array:
    """wire[N, B] -> [n] of `dtype`, the fp32 sum of the N decoded rows in peer order, rounded
    once to `dtype`; equals `codecs.decode_sum_wire`."""
    decode_kernel.check_wire(codec, wire, n)
    kernel = _kernel("decode_sum", codec, n, dtype, wire.shape[0], interpret, fallback, target)
    return kernel(codec, wire, n, dtype)


def decode_sum_reencode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    *,
    interpret: bool = False,
    fallback: bool = True,
    target=None,
) -> jax.Array:
    """wire[N, B] -> wire[B] of encode(the sum of the N decoded rows); equals
    `codecs.decode_sum_reencode_wire` up to rounding ties."""
    decode_kernel.check_wire(codec, wire, n)
    rows = wire.shape[0]
    kernel = _kernel("decode_sum_reencode", codec, n, None, rows, interpret, fallback, target)
    return kernel(codec, wire, n)
