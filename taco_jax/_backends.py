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


def _fused(kernel, reference, interpret: bool, fallback: bool):
    """`kernel` for compressing codecs; the reference for the identity codec "none"."""

    def op(codec: Codec, *args):
        if codec.is_identity:
            return reference(codec, *args)
        return kernel(codec, *args, interpret=interpret, fallback=fallback)

    return op


@functools.cache
def _pallas_ops(interpret: bool, fallback: bool) -> CodecOps:
    kernels = _kernels()
    if isinstance(kernels, ImportError):
        raise ImportError(
            "impl='pallas' needs the fused kernels of the pallas_kernels package, which failed "
            f"to import: {kernels!r}"
        ) from kernels
    return CodecOps(
        *(
            _fused(getattr(kernels, name), getattr(XLA_OPS, name), interpret, fallback)
            for name in ("encode", "decode", "decode_sum", "decode_sum_reencode")
        )
    )


@functools.cache
def _warn_fallback(error: str) -> None:
    _IMPORT_FALLBACK["every codec op (impl='auto')"] = f"pallas_kernels failed to import: {error}"
    warnings.warn(
        "taco_jax: impl='auto' runs the XLA reference codec on this GPU, far slower than the "
        f"fused kernels (BENCHMARKS.md), because pallas_kernels failed to import: {error}",
        RuntimeWarning,
        stacklevel=2,
    )


@dataclasses.dataclass(frozen=True)
class StageOps:
    """Packed-wire operations of the TAH-Quant codecs (`taco_jax.tahquant`)."""

    encode: Callable
    """(codec, x[R, n], key) -> wire[R, B] (key: the stochastic rounding's PRNG key)."""
    decode: Callable
    """(codec, wire[R, B], n, dtype) -> x[R, n]."""


def get_stage_ops(impl: str) -> StageOps:
    """The TAH-Quant ops for `impl`, chosen as `get_ops` chooses: the fused kernels of
    `pallas_kernels.tahquant_kernel`, or the jnp reference (as `get_ops`: with a warning under
    "auto" where the kernels cannot take a codec, an error naming it under "pallas")."""
    if get_ops(impl) is XLA_OPS:
        return StageOps(tahquant.encode_wire, tahquant.decode_wire)
    kernels = _kernels().tahquant_kernel
    options = (impl == "pallas_interpret", impl == "auto")  # interpret, fallback
    return StageOps(
        functools.partial(_stage_op, kernels.encode, tahquant.encode_wire, *options),
        functools.partial(_stage_op, kernels.decode, tahquant.decode_wire, *options),
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


def _stage_op(kernel, reference, interpret: bool, fallback: bool, codec, *args):
    """The kernel where the registry gives it the call (`pallas_kernels.registry.stage_kernel`:
    the codec's groups, the Triton lowering), else the reference, said or refused there."""
    registry = _kernels().registry
    if registry.stage_kernel(codec, interpret=interpret, fallback=fallback) == "reference":
        return reference(codec, *args)
    return kernel(codec, *args, interpret=interpret)


# The fused all-gather takes rows of a multiple of this many elements: 16 tiles of 64 groups of
# 128, so that a row splits into up to 16 x its length / 2^17 programs (`exchange_mosaic.launch`).
FUSED_ROW_MULTIPLE = 16 * 64 * 128


FUSED_KINDS = ("all_gather", "all_to_all")


def fused_exchange(kind: str, impl: str, codec: Codec, x: jax.Array, axis_name: str):
    """The fused encode + exchange kernel of `pallas_kernels.exchange_mosaic` for `kind`
    ("all_gather": x[R, n] -> wire[N, R, B]; "all_to_all": x[N, n] -> wire[N, B]) bound to
    (codec, axis_name, its size), where `impl` runs compiled kernels, the registry runs Mosaic
    GPU kernels for `codec`, and the kernel takes `x` (`exchange_mosaic.unsupported`); else
    None. The caller vouches for the link (peer stores need NVLink) and for the axis (one
    `shard_map` mesh axis)."""
    if kind not in FUSED_KINDS:
        raise ValueError(f"unknown fused exchange {kind=}; choose one of {FUSED_KINDS}")
    if not isinstance(codec, Codec) or impl not in ("auto", "pallas") or get_ops(impl) is XLA_OPS:
        return None
    kernels = _kernels()
    exchange = kernels.exchange_mosaic
    if not kernels.registry.mosaic_runs(codec) or exchange.unsupported(codec, x) is not None:
        return None
    kernel = getattr(exchange, f"encode_{kind}")
    return functools.partial(
        kernel, codec, axis_name=axis_name, n_ranks=jax.lax.axis_size(axis_name)
    )


def kernel_row_multiple(impl: str, codec: Codec | tahquant.TahQuant) -> int:
    """What the collectives pad each row (per slice) to for `impl`'s kernels: whole groups, and
    where compiled kernels run Mosaic GPU kernels for `codec`, whole rows of those
    (`pallas_kernels.registry.row_multiple`; zero groups after the message, as any padding),
    so that they take every row."""
    if not isinstance(codec, Codec) or impl not in ("auto", "pallas") or get_ops(impl) is XLA_OPS:
        return codec.group_size
    return _kernels().registry.row_multiple(codec)


def max_buffer_bytes(impl: str) -> int | None:
    """The most bytes an operand or result of one kernel call may hold where `impl` runs the
    kernels (their offsets are 32-bit: `pallas_kernels._pallas.MAX_BUFFER_BYTES`); None for the
    jnp reference, which has no such limit."""
    if get_ops(impl) is XLA_OPS:
        return None
    return _kernels()._pallas.MAX_BUFFER_BYTES


def get_ops(impl: str) -> CodecOps:
    """The ops for `impl`: "xla", "pallas", "pallas_interpret" (the kernels in Pallas' CPU
    interpreter) or "auto".

    "auto" picks the fused kernels on a GPU backend, else "xla". On a GPU where the kernels
    cannot be imported it falls back to "xla" and warns once, naming the import error; "pallas"
    raises that error instead. Which kernel runs each op is `pallas_kernels.registry`'s
    choice; where that kernel cannot take a call, "auto" runs the reference there (one
    warning; `reference_ops` lists it) and "pallas" raises, naming the call.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown {impl=}; choose one of {IMPLS}")
    if impl == "xla" or (impl == "auto" and jax.default_backend() != "gpu"):
        return XLA_OPS
    if impl == "auto" and isinstance(_kernels(), ImportError):
        _warn_fallback(repr(_kernels()))
        return XLA_OPS
    return _pallas_ops(interpret=impl == "pallas_interpret", fallback=impl == "auto")


_IMPORT_FALLBACK: dict[str, str] = {}


def reference_ops() -> dict[str, str]:
    """{call: why} of the codec ops this process ran on the jnp reference although it asked
    for the fused kernels ("auto" on a GPU): the registry's fallbacks (as traced, once per
    program) and a failed import of the kernels. Empty where every op ran its kernel, or where
    the reference was asked for ("xla", or "auto" off a GPU)."""
    kernels = _kernels()
    fallbacks = {} if isinstance(kernels, ImportError) else kernels.registry.on_reference()
    return {**_IMPORT_FALLBACK, **fallbacks}
