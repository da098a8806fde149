"""Fused Pallas kernels for the TACO codecs on packed wire rows (see `taco_jax._backends`).

Every codec of `taco_jax.CODEC_NAMES` except "none" is fused (encode, decode, decode-sum,
decode-sum-reencode); "none" (raw fp32 bytes, no arithmetic) runs the reference ops. Kernels are
`pl.pallas_call`s on the Triton lowering, except the `taco` encode of large bf16 messages on
Hopper, a Mosaic GPU kernel (`encode_mosaic`; why: `_pallas.py`). All work under `jax.vmap` and
inside `jax.shard_map`; `interpret=True` runs the Triton bodies on the CPU (and
`encode_mosaic.encode(..., interpret=True)` the Mosaic one, codes only).
"""

from __future__ import annotations

import functools

from pallas_kernels.config import BlockConfig, block_config
from pallas_kernels.decode_kernel import decode, decode_reference
from pallas_kernels.decode_sum_kernel import (
    decode_sum,
    decode_sum_reencode,
    decode_sum_reencode_reference,
    decode_sum_reference,
)
from pallas_kernels.encode_kernel import encode, encode_reference
from taco_jax import _backends

__all__ = [
    "BlockConfig",
    "block_config",
    "codec_ops",
    "decode",
    "decode_reference",
    "decode_sum",
    "decode_sum_reencode",
    "decode_sum_reencode_reference",
    "decode_sum_reference",
    "encode",
    "encode_reference",
]


def _or_reference(fused, reference):
    """Runs `fused` for compressing codecs; the reference op for the identity codec "none"."""

    def op(codec, *args, **kwargs):
        if codec.is_identity:
            return reference(codec, *args)
        return fused(codec, *args, **kwargs)

    return op


@functools.cache
def codec_ops(interpret: bool = False) -> _backends.CodecOps:
    """The four packed-wire ops of `taco_jax._backends.CodecOps`, fused."""
    xla = _backends.XLA_OPS
    kw = dict(interpret=interpret)
    return _backends.CodecOps(
        encode=_or_reference(functools.partial(encode, **kw), xla.encode),
        decode=_or_reference(functools.partial(decode, **kw), xla.decode),
        decode_sum=_or_reference(functools.partial(decode_sum, **kw), xla.decode_sum),
        decode_sum_reencode=_or_reference(
            functools.partial(decode_sum_reencode, **kw), xla.decode_sum_reencode
        ),
    )
