"""Which implementation runs the codec operations of the collectives.

The collectives speak to codecs only through `CodecOps`, on packed wire buffers (uint8 rows of
`codec.wire_bytes(n)` bytes; see `codecs.pack`). The "xla" ops are the packed-wire jnp
references of `taco_jax.codecs`; the "pallas" ops are the fused kernels of `pallas_kernels`,
imported on first use (they import the codec definition, never this module). A backend never
changes the reference, and every backend is tested against it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from taco_jax import codecs, tahquant
from taco_jax.codecs import Codec

IMPLS = ("auto", "xla", "pallas", "pallas_interpret")


@dataclasses.dataclass(frozen=True)
class CodecOps:
    """Packed-wire codec operations. Shapes: rows [R, n] -> wire [R, codec.wire_bytes(n)]."""

    encode: Callable[[Codec, jax.Array], jax.Array]
    """(codec, x[R, n]) -> wire[R, B]."""
    decode: Callable[[Codec, jax.Array, int, jnp.dtype], jax.Array]
    """(codec, wire[R, B], n, dtype) -> x[R, n]."""
    decode_sum: Callable[[Codec, jax.Array, int, jnp.dtype], jax.Array]
    """(codec, wire[N, B], n, dtype) -> the fp32 sum over the N decoded rows as `dtype`, [n]; end
    of a reduce-scatter and of the one-shot all-reduce."""
    decode_sum_reencode: Callable[[Codec, jax.Array, int], jax.Array]
    """(codec, wire[N, B], n) -> wire[B] of the fp32 sum; the middle of the two-shot all-reduce."""


XLA_OPS = CodecOps(
    codecs.encode_wire, codecs.decode_wire, codecs.decode_sum_wire, codecs.decode_sum_reencode_wire
)


@functools.cache
def _kernels():
    """The `pallas_kernels` module, or the ImportError that stopped it (imported once)."""
    try:
        import pallas_kernels
    except ImportError as error:
        return error
    return pallas_kernels


def _fused(kernel, reference, interpret: bool):
    """`kernel` for compressing codecs; the reference for the identity codec "none"."""

    def op(codec: Codec, *args):
        if codec.is_identity:
            return reference(codec, *args)
        return kernel(codec, *args, interpret=interpret)

    return op


@functools.cache
def _pallas_ops(interpret: bool) -> CodecOps:
    kernels = _kernels()
    if isinstance(kernels, ImportError):
        raise ImportError(
            "impl='pallas' needs the fused kernels of the pallas_kernels package, which failed "
            f"to import: {kernels!r}"
        ) from kernels
    return CodecOps(
        *(
            _fused(getattr(kernels, name), getattr(XLA_OPS, name), interpret)
            for name in ("encode", "decode", "decode_sum", "decode_sum_reencode")
        )
    )


@functools.cache
def _warn_fallback(error: str) -> None:
    warnings.warn(
        "taco_jax: impl='auto' runs the XLA reference codec on this GPU, far slower than the "
        f"fused kernels (BENCHMARKS.md), because pallas_kernels failed to import: {error}",
        RuntimeWarning,
        stacklevel=2,
    )


def _compiled(impl: str) -> bool:
    """Whether `impl` runs the compiled GPU kernels (not the jnp reference or the interpreter)."""
    return get_ops(impl) is not XLA_OPS and impl != "pallas_interpret"


def matmul_encode_runs(impl: str, codec: Codec, x: jax.Array, w: jax.Array) -> bool:
    """Whether `matmul_encode` encodes x @ w in `codecs.tile_major` order here: the product is
    whole 128 x 128 tiles, and with the compiled kernels, the fused kernel takes the call
    (`pallas_kernels.matmul_encode_mosaic.preferred`: elsewhere the product's own encode is
    cheaper, with no transposes into that order and back). The jnp reference and the
    interpreter take that order at any such size (the path of CPU tests)."""
    tile = codecs.PRODUCT_TILE
    if x.shape[0] % tile or w.shape[1] % tile:
        return False
    return not _compiled(impl) or _kernels().matmul_encode_mosaic.preferred(codec, x, w)


def matmul_encode(impl: str, codec: Codec, x: jax.Array, w: jax.Array) -> jax.Array:
    """wire[1, B] of x[M, K] @ w[K, H] in `codecs.tile_major` order: `pallas_kernels.
    matmul_encode` (the encode in the matmul's epilogue where its kernel takes the call) under
    the compiled kernels, else the product, rounded to its dtype, then that impl's encode (the
    jnp reference, or the kernels in the CPU interpreter)."""
    if _compiled(impl):
        return _kernels().matmul_encode(codec, x, w)
    return get_ops(impl).encode(codec, codecs.tile_major_product(x, w)[None])


def decode_sum_product(impl: str, codec: Codec, wire: jax.Array, m: int, h: int, dtype):
    """The decode-sum of wire[N, B] holding an [M, H] product's groups in `codecs.tile_major`
    order (`matmul_encode`) -> the sum [M, H]: `pallas_kernels.decode_sum(product=(M, H))`
    where `get_ops(impl)` runs the kernels (the Mosaic kernel stores each tile in its place),
    else the reference's sum put back in place (`codecs.from_tile_major`)."""
    ops = get_ops(impl)
    if ops is XLA_OPS:
        return codecs.from_tile_major(ops.decode_sum(codec, wire, m * h, dtype), m, h)
    interpret = impl == "pallas_interpret"
    total = _kernels().decode_sum(codec, wire, m * h, dtype, interpret=interpret, product=(m, h))
    return total.reshape(m, h)


@dataclasses.dataclass(frozen=True)
class StageOps:
    """Packed-wire operations of the TAH-Quant codecs (`taco_jax.tahquant`)."""

    encode: Callable
    """(codec, x[R, n], key) -> wire[R, B] (key: the stochastic rounding's PRNG key)."""
    decode: Callable
    """(codec, wire[R, B], n, dtype) -> x[R, n]."""


def get_stage_ops(impl: str) -> StageOps:
    """The TAH-Quant ops for `impl`, chosen as `get_ops` chooses: the fused kernels of
    `pallas_kernels.tahquant_kernel`, or the jnp reference."""
    if get_ops(impl) is XLA_OPS:
        return StageOps(tahquant.encode_wire, tahquant.decode_wire)
    kernels = _kernels().tahquant_kernel
    interpret = impl == "pallas_interpret"
    return StageOps(
        functools.partial(_stage_op, kernels.encode, tahquant.encode_wire, interpret),
        functools.partial(_stage_op, kernels.decode, tahquant.decode_wire, interpret),
    )


def codec_ops(impl: str, codec: Codec | tahquant.TahQuant) -> CodecOps:
    """The collectives' ops for `codec` under `impl`: `get_ops(impl)` for a TP `Codec`; for a
    TAH-Quant codec (TAH-Quant on TP traffic), its stage encode and decode (`get_stage_ops`),
    with the sums in fp32 in rank order as `codecs.decode_sum_wire` does."""
    if isinstance(codec, Codec):
        return get_ops(impl)
    return _stage_collective_ops(get_stage_ops(impl))


def _stage_collective_ops(stage: StageOps) -> CodecOps:
    """`CodecOps` built from a TAH-Quant codec's encode and decode (no fused sums)."""

    def encode(codec, x):
        # The collectives take no key: stochastic rounding hashes one from the message.
        return stage.encode(codec, x, tahquant.message_key(x) if codec.stochastic else None)

    def decode_sum(codec, wire, n, dtype=jnp.float32):
        # One row at a time, in rank order: decoding all N rows at once would make an fp32
        # kernel output N times the message, past the kernels' 2^31-byte buffers sooner.
        total = stage.decode(codec, wire[:1], n, jnp.float32)[0]
        for rank in range(1, wire.shape[0]):
            total = total + stage.decode(codec, wire[rank : rank + 1], n, jnp.float32)[0]
        return total.astype(dtype)

    def decode_sum_reencode(codec, wire, n):
        return encode(codec, decode_sum(codec, wire, n)[None])[0]

    return CodecOps(encode, stage.decode, decode_sum, decode_sum_reencode)


def _stage_op(kernel, reference, interpret: bool, codec, *args):
    """The kernel where it takes the codec's groups (G <= MAX_KERNEL_GROUP) and may lower, else
    the reference. The TAH-Quant kernels are Triton-lowered only: with Triton off
    (`pallas_kernels.triton_unavailable`) the compiled ones give way to the reference."""
    kernels = _kernels()
    if codec.group_size > kernels.tahquant_kernel.MAX_KERNEL_GROUP:
        return reference(codec, *args)
    no_triton = None if interpret else kernels.triton_unavailable()
    if no_triton is not None:
        _warn_stage_reference(codec.name, no_triton)
        return reference(codec, *args)
    return kernel(codec, *args, interpret=interpret)


@functools.cache
def _warn_stage_reference(codec_name: str, no_triton: str) -> None:
    warnings.warn(
        f"taco_jax: the TAH-Quant codec {codec_name!r} runs its jnp reference: its fused "
        f"kernels are Triton-lowered only, and the Triton lowering is off ({no_triton})",
        RuntimeWarning,
        stacklevel=3,
    )


# The fused all-gather takes rows of a multiple of this many elements: 16 tiles of 64 groups of
# 128, so that a row splits into up to 16 x its length / 2^17 programs (`exchange_mosaic.launch`).
FUSED_ROW_MULTIPLE = 16 * 64 * 128


FUSED_KINDS = ("all_gather", "all_to_all")


def fused_exchange(kind: str, impl: str, codec: Codec, x: jax.Array, axis_name: str):
    """The fused encode + exchange kernel of `pallas_kernels.exchange_mosaic` for `kind`
    ("all_gather": x[R, n] -> wire[N, R, B]; "all_to_all": x[N, n] -> wire[N, B]) bound to
    (codec, axis_name, its size), where `impl` runs compiled kernels and the kernel takes `x`
    (a Hopper GPU; see `exchange_mosaic.unsupported`); else None. The caller vouches for the
    link (peer stores need NVLink) and for the axis (one `shard_map` mesh axis)."""
    if kind not in FUSED_KINDS:
        raise ValueError(f"unknown fused exchange {kind=}; choose one of {FUSED_KINDS}")
    if not isinstance(codec, Codec) or impl not in ("auto", "pallas") or get_ops(impl) is XLA_OPS:
        return None
    exchange = _kernels().exchange_mosaic
    if exchange.unsupported(codec, x) is not None:
        return None
    kernel = getattr(exchange, f"encode_{kind}")
    return functools.partial(
        kernel, codec, axis_name=axis_name, n_ranks=jax.lax.axis_size(axis_name)
    )


def kernel_row_multiple(impl: str, codec: Codec | tahquant.TahQuant) -> int:
    """What the collectives pad each row (per slice) to for `impl`'s kernels: whole groups, and
    where compiled kernels run on a Hopper GPU with the Triton lowering off
    (`pallas_kernels.triton_unavailable`), whole rows of the Mosaic GPU kernels
    (`encode_mosaic.row_multiple`; zero groups after the message, as any padding), so that
    they, not the jnp reference, take every row."""
    if not isinstance(codec, Codec) or impl not in ("auto", "pallas") or get_ops(impl) is XLA_OPS:
        return codec.group_size
    kernels = _kernels()
    if kernels.triton_unavailable() is None or not kernels._pallas.hopper_gpu():
        return codec.group_size
    multiple = kernels.encode_mosaic.row_multiple(codec)
    if kernels.decode_mosaic.unsupported(codec, multiple) is not None:
        return codec.group_size
    return multiple


def max_buffer_bytes(impl: str) -> int | None:
    """The most bytes an operand or result of one kernel call may hold where `impl` runs the
    kernels (their offsets are 32-bit: `pallas_kernels.config.MAX_BUFFER_BYTES`); None for the
    jnp reference, which has no such limit."""
    if get_ops(impl) is XLA_OPS:
        return None
    return _kernels().config.MAX_BUFFER_BYTES


def get_ops(impl: str) -> CodecOps:
    """The ops for `impl`: "xla", "pallas", "pallas_interpret" (the kernels in Pallas' CPU
    interpreter) or "auto".

    "auto" picks the fused kernels on a GPU backend, else "xla". On a GPU where the kernels
    cannot be imported it falls back to "xla" and warns once, naming the import error; "pallas"
    raises that error instead. Which kernel runs each op (Triton- or Mosaic GPU-lowered, or,
    with the Triton lowering off, the reference where no Mosaic kernel takes the call) is the
    kernels' "auto" backend (`pallas_kernels`).
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown {impl=}; choose one of {IMPLS}")
    if impl == "xla" or (impl == "auto" and jax.default_backend() != "gpu"):
        return XLA_OPS
    if impl == "auto" and isinstance(_kernels(), ImportError):
        _warn_fallback(repr(_kernels()))
        return XLA_OPS
    return _pallas_ops(interpret=impl == "pallas_interpret")
