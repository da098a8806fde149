"""Fused Pallas GPU kernels of the taco_jax codecs, on packed wire rows.

Four ops per codec (`api`): encode (rows -> wire rows), decode, decode-sum (the end of a
reduce-scatter and of the one-shot all-reduce) and decode-sum-reencode (the middle of the
two-shot all-reduce), each equal to its jnp reference of `taco_jax.codecs`.
`registry.select` alone says what runs each, from the op, codec, sizes, dtype, impl and the
platform (`taco_jax.target.Target`): the Triton lowering wherever JAX's Pallas has it
(`encode_kernel`, `decode_kernel`, `decode_sum_kernel`; in Pallas' CPU interpreter with
`interpret=True`), Mosaic GPU on Hopper for the FP8 codecs with a Hadamard where it has not
(`encode_mosaic`, `decode_mosaic`). `exchange_mosaic` holds the `taco` encodes that store their
codes into the peers' memory (the collectives' exchange on NVLink); `tahquant_kernel` the
pipeline codecs of `taco_jax.tahquant`.

This package is a plugin of `taco_jax`: it imports the codec definitions (`taco_jax.codecs`,
`taco_jax.tahquant`) and the platform description (`taco_jax.target`) and nothing else of it,
and `taco_jax` imports it on first use (`taco_jax._backends`), so the library runs without it.
"""

from __future__ import annotations

from pallas_kernels import (
    decode_kernel,
    decode_mosaic,
    decode_sum_kernel,
    encode_kernel,
    encode_mosaic,
    exchange_mosaic,
    registry,
    tahquant_kernel,
)
from pallas_kernels.api import decode, decode_sum, decode_sum_reencode, encode
from pallas_kernels.config import BlockConfig
from pallas_kernels.decode_kernel import decode_reference
from pallas_kernels.decode_sum_kernel import decode_sum_reencode_reference, decode_sum_reference
from pallas_kernels.encode_kernel import encode_reference
from pallas_kernels.encode_mosaic import MosaicConfig

__all__ = [
    "BlockConfig",
    "MosaicConfig",
    "decode",
    "decode_kernel",
    "decode_mosaic",
    "decode_reference",
    "decode_sum",
    "decode_sum_kernel",
    "decode_sum_reencode",
    "decode_sum_reencode_reference",
    "decode_sum_reference",
    "encode",
    "encode_kernel",
    "encode_mosaic",
    "encode_reference",
    "exchange_mosaic",
    "registry",
    "tahquant_kernel",
]
