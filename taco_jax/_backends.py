"""Which implementation runs the codec operations of the collectives.

The collectives speak to codecs only through `CodecOps`, on packed wire buffers (uint8 rows of
`codec.wire_bytes(n)` bytes; see `codecs.pack`). "xla" runs the packed-wire jnp references of
`taco_jax.codecs`; the kernels' ops ask `pallas_kernels.registry.select` what runs each call on
the `taco_jax.target.Target` the op is traced for. `pallas_kernels` is imported on first use
(it imports the codec definitions and the target, never this module). A backend never changes
the reference, and every backend is tested against it.
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
from taco_jax.target import Target, wants_kernels


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


@dataclasses.dataclass(frozen=True)
class StageOps:
    """Packed-wire operations of the TAH-Quant codecs (`taco_jax.tahquant`)."""

    encode: Callable
    """(codec, x[R, n], key) -> wire[R, B] (key: the stochastic rounding's PRNG key)."""
    decode: Callable
    """(codec, wire[R, B], n, dtype) -> x[R, n]."""


STAGE_REFERENCE = StageOps(tahquant.encode_wire, tahquant.decode_wire)


@functools.cache
def _kernels():
    """The `pallas_kernels` module, or the ImportError that stopped it (imported once)."""
    try:
        import pallas_kernels
    except ImportError as error:
        return error
    return pallas_kernels


def _registry(impl: str, target: Target):
    """`pallas_kernels.registry` where `impl` asks for the kernels on `target`, else None (the
    reference). Where the kernels fail to import, "auto" runs the reference with one warning,
    naming the import error, and the others raise it."""
    if not wants_kernels(impl, target):
        return None
    kernels = _kernels()
    if not isinstance(kernels, ImportError):
        return kernels.registry
    if impl == "auto":
        _warn_fallback(repr(kernels))
        return None
    raise ImportError(
        f"impl={impl!r} needs the fused kernels of the pallas_kernels package, which failed "
        f"to import: {kernels!r}"
    ) from kernels


@functools.cache
def _warn_fallback(error: str) -> None:
    _IMPORT_FALLBACK["every codec op (impl='auto')"] = f"pallas_kernels failed to import: {error}"
    warnings.warn(
        "taco_jax: impl='auto' runs the XLA reference codec on this GPU, far slower than the "
        f"fused kernels (BENCHMARKS.md), because pallas_kernels failed to import: {error}",
        RuntimeWarning,
        stacklevel=2,
    )


def get_ops(impl: str, target: Target) -> CodecOps:
    """The TP codec ops for `impl` ("xla", "pallas", "pallas_interpret": the kernels in Pallas'
    CPU interpreter, or "auto") on `target`.

    "auto" runs the kernels on a GPU, else the reference; on a GPU where the kernels cannot be
    imported it runs the reference and warns once, naming the import error ("pallas" raises
    it). What runs each call is `pallas_kernels.registry.select`'s choice; where that kernel
    cannot take a call, "auto" runs the reference there (one warning; `reference_ops` lists
    it) and "pallas" raises, naming the call.
    """
    if _registry(impl, target) is None:
        return XLA_OPS
    return _kernel_ops(impl, target)


@functools.cache
def _kernel_ops(impl: str, target: Target) -> CodecOps:
    options = dict(interpret=impl == "pallas_interpret", fallback=impl == "auto", target=target)
    kernels = _kernels()
    return CodecOps(
        *(functools.partial(getattr(kernels, op), **options) for op in kernels.registry.OPS)
    )


def stage_ops(impl: str, target: Target) -> StageOps:
    """The TAH-Quant ops for `impl` on `target`, chosen as `get_ops` chooses: the fused kernels
    of `pallas_kernels.tahquant_kernel`, or the reference (with a warning under "auto" where
    the kernels cannot take a codec, an error naming it under "pallas")."""
    registry = _registry(impl, target)
    if registry is None:
        return STAGE_REFERENCE

    def op(name, codec, *args):
        return registry.select(name, codec, impl=impl, target=target)(codec, *args)

    return StageOps(functools.partial(op, "encode"), functools.partial(op, "decode"))


def codec_ops(impl: str, codec: Codec | tahquant.TahQuant, target: Target) -> CodecOps:
    """The collectives' ops for `codec` under `impl` on `target`: `get_ops` for a TP `Codec`;
    for a TAH-Quant codec (TAH-Quant on TP traffic), its stage encode and decode
    (`stage_ops`), with the sums in fp32 in rank order as `codecs.decode_sum_wire` does."""
    if isinstance(codec, Codec):
        return get_ops(impl, target)
    return stage_collective_ops(stage_ops(impl, target))


def stage_collective_ops(stage: StageOps) -> CodecOps:
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


def exchange(kind: str, impl: str, codec, target: Target, *, rows: int = 1, n=None, dtype=None):
    """The fused encode + exchange (`pallas_kernels.registry.select`: "encode_all_gather",
    x[R, n] -> wire[N, R, B], or "encode_all_to_all", x[N, n] -> wire[N, B]) of `rows` rows of
    `n` elements (None: any) of `dtype`, where it runs on `target`; else None."""
    registry = _registry(impl, target)
    if registry is None:
        return None
    return registry.select(kind, codec, impl=impl, target=target, n=n, rows=rows, dtype=dtype)


def row_multiple(impl: str, codec, target: Target) -> int:
    """What the collectives pad each row (per slice) to for the ops `impl` runs on `target`:
    whole groups, or whole rows of the Mosaic GPU kernels where they run `codec` (zero groups
    after the message, as any padding), so that the kernels take every row."""
    registry = _registry(impl, target)
    if registry is None or not isinstance(codec, Codec | tahquant.TahQuant):
        return codec.group_size
    return registry.select("encode", codec, impl=impl, target=target).row_multiple


def max_buffer_bytes(impl: str, target: Target) -> int | None:
    """The most bytes an operand or result of one kernel call may hold where `impl` runs the
    kernels on `target` (their offsets are 32-bit: `pallas_kernels._pallas.MAX_BUFFER_BYTES`);
    None for the jnp reference, which has no such limit."""
    if _registry(impl, target) is None:
        return None
    return _kernels()._pallas.MAX_BUFFER_BYTES


_IMPORT_FALLBACK: dict[str, str] = {}


def reference_ops() -> dict[str, str]:
    """{call: why} of the codec ops this process ran on the jnp reference although it asked
    for the fused kernels ("auto" on a GPU): the registry's fallbacks (as traced, once per
    program) and a failed import of the kernels. Empty where every op ran its kernel, or where
    the reference was asked for ("xla", or "auto" off a GPU)."""
    kernels = _kernels()
    fallbacks = {} if isinstance(kernels, ImportError) else kernels.registry.on_reference()
    return {**_IMPORT_FALLBACK, **fallbacks}
