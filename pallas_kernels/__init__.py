"""Fused Pallas GPU kernels for the taco_jax codecs, on packed wire rows.

Four ops per codec, each beside the jnp reference it equals (`*_reference`, from
`taco_jax.codecs`): encode (rows -> wire rows), decode, decode-sum (the end of a
reduce-scatter) and decode-sum-reencode (the middle of the two-shot all-reduce). Every
compressing codec of `taco_jax.CODEC_NAMES` is fused; the identity codec "none" (raw fp32 bytes,
no arithmetic) has no kernel, and `taco_jax` runs its reference there. The pipeline codecs of
`taco_jax.tahquant` have their encode and decode in `tahquant_kernel`. `exchange_mosaic` holds
the `taco` encodes that store their codes into the peers' memory (all-gather, all-to-all) for
the collectives on NVLink. `matmul_encode` encodes a product in its matmul's epilogue
(`matmul_encode_mosaic`, Hopper), its groups in `tile_major` order.

Each op takes `backend=`: "triton" (`pl.pallas_call` on the Triton lowering: every codec and
shape, interpret mode on the CPU), "mosaic" (Mosaic GPU on Hopper, for the TP codecs of fp32 or
E8M0 scales, 8-bit or sub-byte codes: `encode_mosaic`, `decode_mosaic`; the sub-byte ones encode,
decode and decode-sum; their CPU interpreter runs them too, codes only), or "auto",
the default: Mosaic where it measured faster (the encodes of `taco`, `taco_e5m2` and
`int8_hadamard` from 24 MiB of bf16, the decodes of `taco` and `taco_e5m2` and their two-peer
decode-sum from 32 MiB, their two-peer re-encode from 64 MiB; why:
`_pallas.py`, the table: `config.py`), Triton elsewhere. All work under `jax.vmap` and inside
`jax.shard_map`. With `TACO_JAX_TRITON=0` in the environment, or a JAX whose Pallas has no
Triton lowering (`triton_unavailable`), "auto" lowers nothing through Triton: Mosaic GPU
wherever its kernel takes the call, the jnp reference elsewhere (with a warning naming why).

This package imports the codec definitions (`taco_jax.codecs`, `taco_jax.tahquant`) and nothing
else of taco_jax; the
dispatch from the collectives to these kernels lives in `taco_jax._backends`.
"""

from __future__ import annotations

from pallas_kernels import (
    decode_mosaic,
    encode_mosaic,
    exchange_mosaic,
    matmul_encode_mosaic,
    tahquant_kernel,
)
from pallas_kernels._pallas import TRITON_ENV, triton_unavailable
from pallas_kernels.config import BlockConfig, block_config
from pallas_kernels.decode_kernel import decode, decode_reference
from pallas_kernels.decode_sum_kernel import (
    decode_sum,
    decode_sum_reencode,
    decode_sum_reencode_reference,
    decode_sum_reference,
)
from pallas_kernels.encode_kernel import encode, encode_reference
from pallas_kernels.matmul_encode_mosaic import matmul_encode, matmul_encode_reference

__all__ = [
    "TRITON_ENV",
    "BlockConfig",
    "block_config",
    "decode",
    "decode_reference",
    "decode_sum",
    "decode_sum_reencode",
    "decode_mosaic",
    "decode_sum_reencode_reference",
    "decode_sum_reference",
    "encode",
    "encode_mosaic",
    "encode_reference",
    "exchange_mosaic",
    "matmul_encode",
    "matmul_encode_mosaic",
    "matmul_encode_reference",
    "tahquant_kernel",
    "triton_unavailable",
]
