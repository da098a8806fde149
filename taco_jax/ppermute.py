"""`compressed_ppermute`: `lax.ppermute` with compressed traffic, for pipeline stage-to-stage
sends (activations forward, their gradients backward).

It carries any codec: the stage codecs of `taco_jax.tahquant` (TAH-Quant; the default) and the
TP codecs of `taco_jax.codecs` (`taco`, `int8_hadamard`, ...). Each rank encodes its whole
message, the wire moves with `lax.ppermute`, the receiver decodes; a rank that receives nothing
gets zeros, as from `lax.ppermute`. The backward is the compressed ppermute of the cotangent
along the inverse permutation, with the backward codec (TAH-Quant: its symmetric variant).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import _backends, _local, codecs, tahquant, tahquant_adaptive, telemetry
from taco_jax import target as platform
from taco_jax.algorithms import AxisName, axis_size
from taco_jax.tahquant import TahQuant
from taco_jax.tahquant_adaptive import AdaptiveTahQuant

DEFAULT_STAGE_CODEC = "tahquant"
StageCodec = codecs.Codec | TahQuant | AdaptiveTahQuant
# Every codec name compressed_ppermute takes: the stage codecs, then the TP codecs.
CODEC_NAMES = tahquant.STAGE_CODEC_NAMES + tahquant_adaptive.CODEC_NAMES + codecs.CODEC_NAMES


@dataclasses.dataclass(frozen=True)
class _Direction:
    """One direction's codec and options (static)."""

    codec: StageCodec
    impl: str
    telemetry: bool


def resolve_codec(codec: str | StageCodec) -> StageCodec:
    """A codec object from one of `CODEC_NAMES` (stage codecs, then TP codecs), or itself."""
    if isinstance(codec, codecs.Codec | TahQuant | AdaptiveTahQuant):
        return codec
    if codec in tahquant.STAGE_CODEC_NAMES:
        return tahquant.get_stage_codec(codec)
    if codec in tahquant_adaptive.CODEC_NAMES:
        return tahquant_adaptive.get_codec(codec)
    if codec in codecs.CODEC_NAMES:
        return codecs.get_codec(codec)
    raise ValueError(f"unknown codec {codec!r}; choose one of {CODEC_NAMES}")


def backward_codec(codec: StageCodec) -> StageCodec:
    """The default codec of the gradients: TAH-Quant's symmetric variant, else the same codec."""
    return codec.backward if isinstance(codec, TahQuant | AdaptiveTahQuant) else codec


def check_perm(perm, n_ranks: int) -> tuple[tuple[int, int], ...]:
    """`perm` as a tuple of (source, destination) pairs; a clear error if it is not one."""
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise ValueError(
            f"perm={perm!r} must be a sequence of (source, destination) pairs"
        ) from None
    for s, d in pairs:
        if not (0 <= s < n_ranks and 0 <= d < n_ranks):
            raise ValueError(
                f"perm={perm!r}: pair ({s}, {d}) is outside the axis of size {n_ranks}"
            )
    for position, label in ((0, "source"), (1, "destination")):
        ranks = [pair[position] for pair in pairs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"perm={perm!r}: a {label} appears twice")
    return pairs


def _wire_ops(direction: _Direction, target: platform.Target):
    """(encode(rows, key) -> wire, decode(wire, n, dtype) -> rows) of the direction's codec on
    `target`."""
    codec = direction.codec
    if isinstance(codec, AdaptiveTahQuant):  # the jnp reference (no fused kernel)
        return (
            functools.partial(tahquant_adaptive.encode_wire, codec),
            functools.partial(tahquant_adaptive.decode_wire, codec),
        )
    if isinstance(codec, TahQuant):
        ops = _backends.stage_ops(direction.impl, target)
        return functools.partial(ops.encode, codec), functools.partial(ops.decode, codec)
    ops = _backends.get_ops(direction.impl, target)
    return (
        lambda rows, key: ops.encode(codec, rows),
        lambda wire, n, dtype: ops.decode(codec, wire, n, dtype),
    )


def _completed(pairs, n_ranks: int) -> tuple[tuple[int, int], ...]:
    """`pairs` extended to a permutation of all ranks (the ranks that send nothing send to those
    that receive nothing): `lax.ppermute` under `vmap` takes only full permutations."""
    free_sources = sorted(set(range(n_ranks)) - {s for s, _ in pairs})
    free_destinations = sorted(set(range(n_ranks)) - {d for _, d in pairs})
    return pairs + tuple(zip(free_sources, free_destinations, strict=True))


def _receives(axis_name, pairs) -> jax.Array:
    """Whether this rank is a destination of `pairs`."""
    return jnp.isin(lax.axis_index(axis_name), jnp.asarray([d for _, d in pairs]))


def _moved(v, axis_name, pairs, full):
    """`lax.ppermute(v, axis_name, pairs)`, moved along `full` (`pairs`, or `_completed(pairs)`
    under vmap): zeros on ranks that receive nothing."""
    moved = lax.ppermute(v, axis_name, full)
    return moved if full == pairs else jnp.where(_receives(axis_name, pairs), moved, 0)


def _sent_bytes(x, axis_name, pairs) -> jax.Array:
    """The bytes this rank sends in `lax.ppermute` along `pairs`: x's, where it is a source."""
    sends = jnp.isin(lax.axis_index(axis_name), jnp.asarray([s for s, _ in pairs]))
    return jnp.where(sends, x.size * x.dtype.itemsize, 0)


def _send(x, axis_name, pairs, full, partial: bool, direction: _Direction, key):
    """(one compressed ppermute of x along `pairs`, moved along `full`, and where
    `direction.telemetry` its `taco_jax.telemetry.STATS` against `lax.ppermute` in fp32, else
    None); `partial`: some rank receives nothing."""
    if direction.codec.is_identity:
        out = _moved(x, axis_name, pairs, full)
        if not direction.telemetry:
            return out, None
        stats = telemetry.unmeasured(_sent_bytes(x, axis_name, pairs))
        return out, telemetry.per_rank(stats, axis_name)
    target = platform.probe()  # the codec kernels' platform (no link is read here)
    encode, decode = _wire_ops(direction, target)
    if key is not None:  # ranks draw independent rounding noise
        key = jax.random.fold_in(key, lax.axis_index(axis_name))

    blocks = _local.free_axes()  # the axes along which each device keeps its own block

    def compressed(x, *key):  # on this device's own block (`_local`)
        key = key[0] if key else None
        if key is not None and blocks:  # blocks draw independent noise
            key = jax.random.fold_in(key, lax.axis_index(blocks))
        # Whole groups, and whole rows of the kernels that run the codec (Mosaic GPU's tiles
        # on Hopper), so that the chosen kernel takes the message: none falls to the reference.
        multiple = _backends.row_multiple(direction.impl, direction.codec, target)
        row, size = codecs.pad_to_multiple(x.reshape(1, -1), multiple)
        wire = lax.ppermute(encode(row, key), axis_name, full)
        out = decode(wire, row.shape[-1], x.dtype)[0, :size].reshape(x.shape)
        if partial:  # a rank that receives nothing decoded a filler's message or a zero wire
            # (which need not decode to 0: a TP codec's zero pre-scale): it returns zeros
            out = jnp.where(_receives(axis_name, pairs), out, jnp.zeros_like(out))
        return out

    keys = () if key is None else (key,)
    out = _local.on_local_blocks(compressed, x, *keys, axis_name=axis_name)
    if not direction.telemetry:
        return out, None
    # Ranks that receive nothing hold exact zeros in both: they add nothing to the sums.
    exact = lambda v: _moved(v.astype(jnp.float32), axis_name, pairs, full)  # noqa: E731
    reference = _local.on_local_blocks(exact, x, axis_name=axis_name)
    stats = telemetry.measure(out, reference, _sent_bytes(x, axis_name, pairs))
    return out, telemetry.per_rank(stats, axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _ppermute(x, key, axis_name, perms, n_ranks, fwd, bwd, name):
    pairs, full = perms
    out, stats = _send(x, axis_name, pairs, full, len(pairs) < n_ranks, fwd, key)
    telemetry.report(f"{name}/fwd", stats, axis_name=axis_name)
    return out


def _ppermute_fwd(x, key, axis_name, perms, n_ranks, fwd, bwd, name):
    if not fwd.telemetry:
        return _ppermute(x, key, axis_name, perms, n_ranks, fwd, bwd, name), (key, None)
    # The forward's statistics are reported by the backward (`taco_jax.telemetry`).
    pairs, full = perms
    out, stats = _send(x, axis_name, pairs, full, len(pairs) < n_ranks, fwd, key)
    return out, (key, telemetry.keep(stats))


def _ppermute_bwd(axis_name, perms, n_ranks, fwd, bwd, name, residuals, ct):
    key, stats = residuals
    telemetry.report(f"{name}/fwd", stats, axis_name=axis_name)
    pairs, full = perms
    inverse = tuple((d, s) for s, d in pairs)
    ct_key = None if key is None else jax.random.fold_in(key, 1)  # noise apart from the forward
    full = inverse if full == pairs else _completed(inverse, n_ranks)
    partial = len(pairs) < n_ranks
    out, stats = _send(ct, axis_name, inverse, full, partial, bwd, ct_key)
    telemetry.report(f"{name}/bwd", stats, axis_name=axis_name)
    return out, None


_ppermute.defvjp(_ppermute_fwd, _ppermute_bwd)


def compressed_ppermute(
    x: jax.Array,
    axis_name: AxisName,
    perm,
    *,
    codec: str | StageCodec = DEFAULT_STAGE_CODEC,
    bwd_codec: str | StageCodec | None = None,
    key: jax.Array | None = None,
    impl: str = "auto",
    telemetry: bool = False,
    name: str = "ppermute",
) -> jax.Array:
    """`jax.lax.ppermute(x, axis_name, perm)` with compressed traffic, up to the codec's rounding.

    Sharding: each rank's x goes to the rank its (source, destination) pair names; a rank that
    is no destination returns zeros. `codec="none"` is `lax.ppermute` itself.
    Backward: the compressed ppermute of the cotangent along the inverse permutation, with
    `bwd_codec` (default: a TAH-Quant codec's symmetric variant, a TP codec itself).

    Args:
      x: floating array, any shape (flattened, padded to a multiple of G, trimmed back).
      axis_name: a bound `shard_map` mesh axis or `vmap` axis name.
      perm: (source, destination) pairs of ranks along the axis, each rank at most once as a
        source and once as a destination (as `lax.ppermute`).
      codec: a name from `CODEC_NAMES`: a stage codec ("tahquant", "tahquant4",
        "tahquant_adaptive", ...) or a TP codec (`taco_jax.CODEC_NAMES`), or a codec object.
      key: PRNG key of the stochastic rounding (required by stochastic codecs): thread it
        through the training loop so that a resumed run draws the same numbers. Each rank folds
        in its index; the backward folds in 1.
      impl: the codec kernels (as `CommConfig.impl`): fused Pallas kernels on a GPU for the TP
        codecs and TAH-Quant; `tahquant_adaptive` always runs its jnp reference.
      telemetry: also run `lax.ppermute` in fp32 and report the error of the call site,
        `<name>/fwd` and `<name>/bwd` (`taco_jax.telemetry`).
      name: the call site's name.
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"compressed_ppermute compresses floating arrays, got dtype={x.dtype}")
    n_ranks = axis_size(axis_name)
    pairs = check_perm(perm, n_ranks)
    # shard_map's ppermute takes partial permutations (ranks left out send and receive
    # nothing); vmap's takes full ones only, so there the pairs are completed with fillers.
    under_shard_map = axis_name in jax.sharding.get_abstract_mesh().manual_axes
    fwd_codec = resolve_codec(codec)
    bwd = backward_codec(fwd_codec) if bwd_codec is None else resolve_codec(bwd_codec)
    for c in (fwd_codec, bwd):
        if getattr(c, "stochastic", False) and key is None:
            raise ValueError(f"codec {c.name!r} rounds stochastically: pass key=")
    if impl not in platform.IMPLS:
        raise ValueError(f"unknown impl={impl!r}; choose one of {platform.IMPLS}")
    fwd = _Direction(fwd_codec, impl, telemetry)
    perms = (pairs, pairs if under_shard_map else _completed(pairs, n_ranks))
    bwd_direction = _Direction(bwd, impl, telemetry)
    return _ppermute(x, key, axis_name, perms, n_ranks, fwd, bwd_direction, name)
