"""The per-chunk codec operations the collectives need, and which implementation runs them.

The collectives speak to codecs only through `CodecOps`, on packed wire buffers (uint8 rows of
`codec.wire_bytes(n)` bytes; see `codecs.pack`). The "xla" ops compose the pure-jnp reference;
the "pallas" ops are the fused kernels in `pallas_kernels/`. A backend never changes the
reference, and every backend is tested against it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from taco_jax import codecs
from taco_jax.codecs import Codec

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")


@dataclasses.dataclass(frozen=True)
class CodecOps:
    """Packed-wire codec operations. Shapes: rows [R, n] -> wire [R, codec.wire_bytes(n)]."""

    encode: Callable[[Codec, jax.Array], jax.Array]
    """(codec, x[R, n]) -> wire[R, B]."""
    decode: Callable[[Codec, jax.Array, int, jnp.dtype], jax.Array]
    """(codec, wire[R, B], n, dtype) -> x[R, n]."""
    decode_sum: Callable[[Codec, jax.Array, int], jax.Array]
    """(codec, wire[N, B], n) -> fp32 sum over the N decoded rows, [n]; end of a reduce-scatter."""
    decode_sum_reencode: Callable[[Codec, jax.Array, int], jax.Array]
    """(codec, wire[N, B], n) -> wire[B] of the fp32 sum; the middle of the two-shot all-reduce."""


def _encode_xla(codec: Codec, x: jax.Array) -> jax.Array:
    return codecs.pack(codec, codec.encode(x))


def _decode_xla(codec: Codec, wire: jax.Array, n: int, dtype) -> jax.Array:
    return codec.decode(codecs.unpack(codec, wire, n), dtype)


def _decode_sum_xla(codec: Codec, wire: jax.Array, n: int) -> jax.Array:
    # A fixed summation order (peer 0 first) makes the sum the same on every rank and every run.
    return jnp.sum(_decode_xla(codec, wire, n, jnp.float32), axis=0)


def _decode_sum_reencode_xla(codec: Codec, wire: jax.Array, n: int) -> jax.Array:
    return _encode_xla(codec, _decode_sum_xla(codec, wire, n)[None])[0]


XLA_OPS = CodecOps(_encode_xla, _decode_xla, _decode_sum_xla, _decode_sum_reencode_xla)


def _pallas_ops(interpret: bool) -> CodecOps | None:
    try:
        from pallas_kernels import codec_ops
    except ImportError:
        return None
    return codec_ops(interpret=interpret)


def get_ops(impl: str) -> CodecOps:
    """Returns the ops for `impl`: "xla", "pallas", "pallas_interpret" (CPU) or "auto".

    "auto" picks the Pallas kernels on a GPU backend when they are importable, else "xla".
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown {impl=}; choose one of {IMPLS}")
    if impl == "xla":
        return XLA_OPS
    if impl == "auto":
        if jax.default_backend() != "gpu":
            return XLA_OPS
        return _pallas_ops(interpret=False) or XLA_OPS
    ops = _pallas_ops(interpret=impl == "pallas_interpret")
    if ops is None:
        raise ValueError(f"{impl=} needs the pallas_kernels package, which is not importable")
    return ops
