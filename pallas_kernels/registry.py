"""What runs each compressed op: `select`, one pure function of (op, codec, sizes, dtype, impl,
target) that returns the `Kernel` to call and the row multiple it needs.

| platform (`taco_jax.target.Target`)    | codecs                           | kernel           |
|----------------------------------------|----------------------------------|------------------|
| any GPU, the interpreter               | every codec                      | Triton           |
| Hopper GPU, a JAX whose Pallas has no  | FP8 with a Hadamard, fp32 scales,| Mosaic GPU       |
| Triton lowering                        | G = 128 (taco, taco_e5m2, ...)   | (`*_mosaic`)     |
| any                                    | TAH-Quant, SDP4Bit (`TahQuant`)  | Triton           |
| Hopper GPU storing into its peers      | `taco` on bf16                   | `exchange_mosaic`|

On an H100 the Triton kernels were faster than the Mosaic GPU ones, or level with them, for
every op at the 8 MiB - 1 GiB messages of 2, 4 and 8 peers, but the decode-sum of 8 peers at
1 GiB (docs/decisions/004-one-kernel-per-op.md). The Mosaic kernels stay as the path for a JAX
whose Pallas has no Triton lowering (deprecated since JAX 0.11) and for the fused exchange
(`exchange_mosaic`, which stores codes into peers' memory: Triton cannot). Their sums of more
than two peers take one peer's tile a pipeline step (`decode_mosaic`, peer steps), of two peers
both peers' tiles a step; they read bf16 into the encode's wgmma and write fp32 or bf16.

`impl` is the collectives' option: "xla" runs the jnp reference, as "auto" does off a GPU;
"pallas" and "auto" on a GPU the compiled kernels, "pallas_interpret" the Triton kernels in
Pallas' CPU interpreter. Where the chosen kernel cannot take a call (a row that is not whole
Mosaic tiles, a dtype the Mosaic kernels do not take, a JAX without the Triton lowering, a
TAH-Quant group beyond the kernels') "auto" runs the jnp reference: the `Kernel` says why, and
when it runs it warns once and `on_reference` lists it; "pallas" and "pallas_interpret" raise
instead, naming the call. The collectives pad their rows to `Kernel.row_multiple` (asked with
no sizes) so that the kernels take every call they make. The fused exchange is selected only
where it runs (None elsewhere: the caller encodes and runs the lax collective).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import (
    decode_kernel,
    decode_mosaic,
    decode_sum_kernel,
    encode_kernel,
    encode_mosaic,
    exchange_mosaic,
    tahquant_kernel,
)
from taco_jax import codecs, tahquant
from taco_jax.codecs import Codec
from taco_jax.target import Target, wants_kernels

OPS = ("encode", "decode", "decode_sum", "decode_sum_reencode")
SUMS = ("decode_sum", "decode_sum_reencode")
STAGE_OPS = ("encode", "decode")  # a `TahQuant` codec's (their sums are the caller's)
EXCHANGES = ("encode_all_gather", "encode_all_to_all")
KERNELS = ("mosaic", "mosaic_peer_steps", "triton", "reference", "exchange_mosaic")
# The Mosaic encode reads bf16 tiles into its wgmma; the decodes write fp32 or bf16.
MOSAIC_ENCODE_DTYPES = (jnp.bfloat16,)
MOSAIC_DECODE_DTYPES = (jnp.float32, jnp.bfloat16)

# Per op, what each kernel family runs; each takes the op's arguments as `pallas_kernels.api`
# does (a stage encode also a PRNG key, an exchange the axis name and its size).
REFERENCE = {
    "encode": codecs.encode_wire,
    "decode": codecs.decode_wire,
    "decode_sum": codecs.decode_sum_wire,
    "decode_sum_reencode": codecs.decode_sum_reencode_wire,
}
TRITON = {
    "encode": encode_kernel.encode,
    "decode": decode_kernel.decode,
    "decode_sum": decode_sum_kernel.decode_sum,
    "decode_sum_reencode": decode_sum_kernel.decode_sum_reencode,
}
MOSAIC = {
    "encode": encode_mosaic.encode,
    "decode": decode_mosaic.decode,
    "decode_sum": decode_mosaic.decode_sum,
    "decode_sum_reencode": decode_mosaic.decode_sum_reencode,
}
STAGE_REFERENCE = {"encode": tahquant.encode_wire, "decode": tahquant.decode_wire}
STAGE_TRITON = {"encode": tahquant_kernel.encode, "decode": tahquant_kernel.decode}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What runs one op: `name` (one of `KERNELS`); `row_multiple`, the element count each row
    must be a multiple of for it; `fallback`, why the jnp reference runs where a kernel was asked
    for (None: no fallback), said by `call`. Calling it runs the op (and, on a fallback, warns
    once and lists the call in `on_reference`)."""

    name: str
    run: Callable = dataclasses.field(repr=False)
    row_multiple: int
    fallback: str | None = None
    call: str = ""

    def __call__(self, *args, **kwargs):
        if self.fallback is not None:
            _ON_REFERENCE[self.call] = self.fallback
            _warn_once(self.call, self.fallback)
        return self.run(*args, **kwargs)


def select(
    op: str,
    codec,
    *,
    impl: str,
    target: Target,
    n: int | None = None,
    rows: int = 1,
    dtype=None,
) -> Kernel | None:
    """The `Kernel` that runs `op` of `codec` (a `Codec`, or a `TahQuant` for "encode" and
    "decode") under `impl` on `target`, on `rows` rows of `n` elements (None: any size; the
    rows a sum adds, or an exchange sends) of `dtype` (the encode's input, the decodes' output;
    None: any). The fused exchanges (`EXCHANGES`) are selected only where they run, else None.
    Raises ValueError, naming the call, where "pallas" asks for a kernel that cannot take it."""
    if op in EXCHANGES:
        return _exchange(op, codec, impl, target, n, rows, dtype)
    stage = isinstance(codec, tahquant.TahQuant)
    if op not in (STAGE_OPS if stage else OPS):
        raise ValueError(f"unknown {op=} for codec {codec.name!r}; choose one of {OPS + EXCHANGES}")
    references = STAGE_REFERENCE if stage else REFERENCE
    if not wants_kernels(impl, target) or codec.is_identity:  # "none" moves raw bytes
        return Kernel("reference", references[op], codec.group_size)
    interpret = impl == "pallas_interpret"
    call = _call(op, codec, n, dtype, rows)

    def reference(why: str) -> Kernel:
        if impl != "auto":
            raise ValueError(
                f"impl={impl!r}: {call} cannot run a fused kernel: {why}; impl='auto' runs the "
                "jnp reference there (far slower), impl='xla' runs it everywhere"
            )
        return Kernel("reference", references[op], codec.group_size, why, call)

    if stage and codec.group_size > tahquant_kernel.MAX_KERNEL_GROUP:
        return reference(f"its kernels take groups of at most {tahquant_kernel.MAX_KERNEL_GROUP}")
    if stage or not _mosaic_chosen(codec, target, interpret):
        if target.triton_missing is not None:
            return reference(target.triton_missing)
        run = (STAGE_TRITON if stage else TRITON)[op]
        return Kernel("triton", functools.partial(run, interpret=interpret), codec.group_size)
    dtypes = MOSAIC_ENCODE_DTYPES if op == "encode" else MOSAIC_DECODE_DTYPES
    if dtype is not None and jnp.dtype(dtype) not in dtypes:
        return reference(f"the Mosaic GPU kernels take {[jnp.dtype(d).name for d in dtypes]}")
    reason = None if n is None else encode_mosaic.unsupported(codec, n)
    if reason is not None:
        return reference(f"the Mosaic GPU kernels cannot take {reason}")
    multiple = encode_mosaic.row_multiple(codec)
    if op in SUMS and rows > 2:
        return Kernel("mosaic_peer_steps", functools.partial(MOSAIC[op], peer_steps=True), multiple)
    return Kernel("mosaic", MOSAIC[op], multiple)


def _mosaic_chosen(codec: Codec, target: Target, interpret: bool) -> bool:
    """Whether the codec ops of `codec` run Mosaic GPU kernels: compiled, on a Hopper GPU, for a
    codec they take, where JAX has no Triton lowering of Pallas."""
    return (
        not interpret
        and target.gpu
        and target.hopper
        and target.triton_missing is not None
        and encode_mosaic.unsupported_codec(codec) is None
    )


def _exchange(op, codec, impl, target, n, rows, dtype) -> Kernel | None:
    """The fused encode + exchange where it runs: compiled kernels asked for, a target whose
    peers a kernel can store into, and a codec, dtype and shape the kernel takes."""
    if op not in EXCHANGES:
        raise ValueError(f"unknown exchange {op=}; choose one of {EXCHANGES}")
    if impl not in ("auto", "pallas") or not target.fused_exchange_possible:
        return None
    if not isinstance(codec, Codec):
        return None
    n = exchange_mosaic.ROW_MULTIPLE if n is None else n  # any size: the rows it pads to
    x = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16 if dtype is None else dtype)
    if exchange_mosaic.unsupported(codec, x) is not None:
        return None
    return Kernel("exchange_mosaic", getattr(exchange_mosaic, op), exchange_mosaic.ROW_MULTIPLE)


def _call(op: str, codec, n: int | None, dtype, rows: int) -> str:
    """How a warning or an error names a call: "decode_sum of taco (rows [4, n=384], float32)",
    "encode of the tahquant stage codec (groups of 128)"."""
    if isinstance(codec, tahquant.TahQuant):
        return f"{op} of the {codec.name} stage codec (groups of {codec.group_size})"
    of = f", {jnp.dtype(dtype).name}" if dtype is not None else ""
    shape = f"rows [{rows}, n={n}]" if n is not None else "rows"
    return f"{op} of {codec.name} ({shape}{of})"


def on_reference() -> dict[str, str]:
    """{call: why} of every call this process gave the jnp reference instead of a kernel (as
    traced: once per program), for a summary of what runs slow."""
    return dict(_ON_REFERENCE)


def forget_reference() -> None:
    """Empties `on_reference` and lets each fallback warn again (a new run in this process)."""
    _ON_REFERENCE.clear()
    _warn_once.cache_clear()


_ON_REFERENCE: dict[str, str] = {}


@functools.cache
def _warn_once(call: str, why: str) -> None:
    warnings.warn(
        f"pallas_kernels: {call} runs the jnp reference, far slower than a fused kernel: {why}",
        RuntimeWarning,
        stacklevel=4,
    )
