"""Which kernel runs each codec op: one per (op, codec family, platform), chosen here alone.

| platform                               | codecs                           | kernel           |
|----------------------------------------|----------------------------------|------------------|
| any GPU, the interpreter               | every codec                      | Triton           |
| Hopper GPU, a JAX whose Pallas has no  | FP8 with a Hadamard, fp32 scales,| Mosaic GPU       |
| Triton lowering                        | G = 128 (taco, taco_e5m2, ...)   | (`*_mosaic`)     |
| any                                    | TAH-Quant, SDP4Bit (`tahquant`)  | Triton           |

On an H100 the Triton kernels were faster than the Mosaic GPU ones, or level with them, for
every op at the 8 MiB - 1 GiB messages of 2, 4 and 8 peers, but the decode-sum of 8 peers at
1 GiB (docs/decisions/004-one-kernel-per-op.md). The Mosaic kernels stay as the path for a JAX
whose Pallas has no Triton lowering (deprecated since JAX 0.11) and for the fused exchange
(`exchange_mosaic`, which stores codes into peers' memory: Triton cannot). Their sums of more
than two peers take one peer's tile a pipeline step (`decode_mosaic`, peer steps), of two peers
both peers' tiles a step; they read bf16 into the encode's wgmma and write fp32 or bf16.

Where the chosen kernel cannot take a call (a row that is not whole Mosaic tiles, a dtype the
Mosaic kernels do not take, a JAX without the Triton lowering, a TAH-Quant group beyond the
kernels') the jnp reference runs, with one warning, and `on_reference` lists it; with
`fallback=False` (the collectives' explicit `impl="pallas"`) the call raises instead, naming
itself. The collectives pad their rows to `row_multiple` so that the kernels take every call
they make.
"""

from __future__ import annotations

import functools
import warnings

import jax.numpy as jnp

from pallas_kernels import _pallas, encode_mosaic, tahquant_kernel
from taco_jax.codecs import Codec

OPS = ("encode", "decode", "decode_sum", "decode_sum_reencode")
SUMS = ("decode_sum", "decode_sum_reencode")
KERNELS = ("mosaic", "mosaic_peer_steps", "triton", "reference")
# The Mosaic encode reads bf16 tiles into its wgmma; the decodes write fp32 or bf16.
MOSAIC_ENCODE_DTYPES = (jnp.bfloat16,)
MOSAIC_DECODE_DTYPES = (jnp.float32, jnp.bfloat16)


def kernel_for(
    op: str,
    codec: Codec,
    *,
    n: int,
    dtype,
    peers: int = 1,
    interpret: bool = False,
    fallback: bool = True,
) -> str:
    """The kernel of `op` on rows of `n` elements (`dtype`: the encode's input, the decodes'
    output, None for the re-encode; `peers`: the rows a sum adds), one of `KERNELS`;
    interpret: the CPU interpreter; fallback: where the kernel cannot take the call, the
    reference (with one warning) or, False, a ValueError naming the call."""
    if op not in OPS:
        raise ValueError(f"unknown {op=}; choose one of {OPS}")
    if codec.is_identity:  # "none" moves raw bytes: nothing to fuse
        return "reference"
    call = _call(op, codec, n, dtype, peers)
    if not mosaic_chosen(codec, interpret):
        return _triton(call, fallback)
    dtypes = MOSAIC_ENCODE_DTYPES if op == "encode" else MOSAIC_DECODE_DTYPES
    if dtype is not None and jnp.dtype(dtype) not in dtypes:
        why = f"the Mosaic GPU kernels take {[jnp.dtype(d).name for d in dtypes]}"
        return _reference(call, why, fallback)
    reason = encode_mosaic.unsupported(codec, n)
    if reason is not None:
        return _reference(call, f"the Mosaic GPU kernels cannot take {reason}", fallback)
    return "mosaic_peer_steps" if op in SUMS and peers > 2 else "mosaic"


def _call(op: str, codec, n: int, dtype, peers: int) -> str:
    """How a warning or an error names a call: "decode_sum of taco (rows [4, n=384], float32)"."""
    of = f", {jnp.dtype(dtype).name}" if dtype is not None else ""
    return f"{op} of {codec.name} (rows [{peers}, n={n}]{of})"


def mosaic_runs(codec) -> bool:
    """Whether Mosaic GPU kernels can run `codec`'s ops here: a Hopper GPU and a codec they
    take (the fused exchange runs wherever they can)."""
    if not isinstance(codec, Codec) or encode_mosaic.unsupported_codec(codec) is not None:
        return False
    return _pallas.hopper_gpu()


def mosaic_chosen(codec, interpret: bool = False) -> bool:
    """Whether the codec ops of `codec` run Mosaic GPU kernels: where they can run and JAX has
    no Triton lowering of Pallas."""
    return not interpret and _pallas.pltriton is None and mosaic_runs(codec)


def row_multiple(codec) -> int:
    """What the collectives pad each row to, so that the chosen kernels take it."""
    return encode_mosaic.row_multiple(codec) if mosaic_chosen(codec) else codec.group_size


def stage_kernel(codec, *, interpret: bool = False, fallback: bool = True) -> str:
    """The TAH-Quant / SDP4Bit codecs' kernel: Triton, or the reference where the kernels cannot
    take `codec`'s groups or JAX has no Triton lowering (as `kernel_for`'s fallback)."""
    call = f"the {codec.name} stage codec (groups of {codec.group_size})"
    if codec.group_size > tahquant_kernel.MAX_KERNEL_GROUP:
        why = f"its kernels take groups of at most {tahquant_kernel.MAX_KERNEL_GROUP}"
        return _reference(call, why, fallback)
    return "triton" if interpret else _triton(call, fallback)


def on_reference() -> dict[str, str]:
    """{call: why} of every call this process gave the jnp reference instead of a kernel (as
    traced: once per program), for a summary of what runs slow."""
    return dict(_ON_REFERENCE)


_ON_REFERENCE: dict[str, str] = {}


def _triton(call: str, fallback: bool) -> str:
    if _pallas.pltriton is None:
        return _reference(call, _pallas.TRITON_IMPORT_ERROR, fallback)
    return "triton"


def _reference(call: str, why: str, fallback: bool) -> str:
    if not fallback:
        raise ValueError(
            f"impl='pallas': {call} cannot run a fused kernel: {why}; impl='auto' runs the jnp "
            "reference there (far slower), impl='xla' runs it everywhere"
        )
    _ON_REFERENCE[call] = why
    _warn_once(call, why)
    return "reference"


@functools.cache
def _warn_once(call: str, why: str) -> None:
    warnings.warn(
        f"pallas_kernels: {call} runs the jnp reference, far slower than a fused kernel: {why}",
        RuntimeWarning,
        stacklevel=4,
    )
