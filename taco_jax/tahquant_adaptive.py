"""`tahquant_adaptive`: TAH-Quant with entropy-guided bits, 3 or 4 per group within a fixed budget.

TAH-Quant's paper allocates 3-4 bits per tile by entropy; COCCL's compressor is fixed-bit. Here,
per row (one message) of groups of G = 32 (symmetric, pivot swap + H_32, stochastic rounding, as
`tahquant4`): the share `budget - 3` of the groups with the highest entropy gets 4 bits, the
rest 3 (budget 3.5: half and half), so every row has the same size. A group's entropy is that of
the histogram of its values over 16 equal bins of [-absmax, absmax] (after the pivot step).
`allocation` also offers the largest absmax first (what a row's L2 error rewards) and a fixed
alternating pattern (equal bits, no adaptation), for the comparison in BENCHMARKS.md.

Wire row: [code bytes][n/G fp32 scales][n/G pivot bytes]. Each group's codes fill 12 bytes
(3-bit: 8 codes in 3 bytes) or 16 (4-bit: 2 per byte), back to back in group order; bit 6 of the
pivot byte (free: an index of G = 32 needs 5) marks a 4-bit group, so the decoder finds every
group's bytes by a prefix sum. Bits per element: budget + 40 / G (4.75 at budget 3.5) when
(budget - 3) x the groups of a row is whole; otherwise the nearest whole number of groups is
4-bit (`wide_groups`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import codecs, tahquant

GROUP_SIZE = 32
# Which groups of a row get 4 bits: the highest entropy (TAH-Quant's rule), the largest absmax
# (whose rounding error is largest in absolute terms: what the L2 error of the row rewards), or
# a fixed pattern (every other group: the comparison at equal bits with no adaptation).
ALLOCATIONS = ("entropy", "absmax", "alternate")
WIDE_FLAG = 0x40  # pivot byte bit 6: this group has 4-bit codes
BINS = 16


@dataclasses.dataclass(frozen=True)
class AdaptiveTahQuant:
    """Construct through `tahquant.get_stage_codec("tahquant_adaptive")` or directly."""

    name: str = "tahquant_adaptive"
    budget: float = 3.5  # average code bits per element, in [3, 4]
    allocation: str = "entropy"  # which groups get 4 bits: ALLOCATIONS
    stochastic: bool = True
    group_size: int = GROUP_SIZE
    is_identity = False

    def __post_init__(self):
        if not 3.0 <= self.budget <= 4.0:
            raise ValueError(f"budget={self.budget} must be in [3, 4] (3 or 4 bits per group)")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation={self.allocation!r} is not one of {ALLOCATIONS}")
        if self.group_size != GROUP_SIZE:
            raise ValueError(f"group_size={self.group_size} must be {GROUP_SIZE}")

    @property
    def backward(self) -> AdaptiveTahQuant:
        return self  # already symmetric

    def wide_groups(self, groups: int) -> int:
        """How many of a row's `groups` get 4 bits."""
        return math.floor((self.budget - 3.0) * groups + 0.5)

    def code_bytes(self, n: int) -> int:
        groups = n // GROUP_SIZE
        wide = self.wide_groups(groups)
        return wide * GROUP_SIZE // 2 + (groups - wide) * GROUP_SIZE * 3 // 8

    def wire_bytes(self, n: int) -> int:
        return self.code_bytes(n) + 5 * (n // GROUP_SIZE)

    @property
    def bits_per_element(self) -> float:
        return self.budget + 8.0 * 5 / GROUP_SIZE


@dataclasses.dataclass(frozen=True)
class _SymmetricGrid:
    """What `tahquant.quantize_groups` reads of a codec: a symmetric grid -qmax .. qmax."""

    qmax: int
    asymmetric: bool = False


# The named codecs: the paper's rule, and the rule the row's L2 error rewards.
_CODECS = {
    "tahquant_adaptive": dict(allocation="entropy"),
    "tahquant_adaptive_absmax": dict(allocation="absmax"),
}
CODEC_NAMES = tuple(_CODECS)


def get_codec(name: str) -> AdaptiveTahQuant:
    if name not in _CODECS:
        raise ValueError(f"unknown adaptive codec {name!r}; choose one of {CODEC_NAMES}")
    return AdaptiveTahQuant(name=name, **_CODECS[name])


NARROW = _SymmetricGrid(qmax=3)  # 3 bits
WIDE = tahquant.get_stage_codec("tahquant4")  # 4 bits, symmetric, G = 32


def entropy(groups: jax.Array) -> jax.Array:
    """Shannon entropy (bits) of each group's histogram over BINS bins of [-absmax, absmax]."""
    amax = jnp.max(jnp.abs(groups), axis=-1, keepdims=True)
    position = jnp.where(amax > 0, groups / jnp.where(amax > 0, amax, 1.0), 0.0)
    bins = jnp.clip(jnp.floor((position + 1.0) * (BINS / 2)), 0, BINS - 1).astype(jnp.int32)
    counts = jnp.sum(jax.nn.one_hot(bins, BINS, dtype=jnp.float32), axis=-2)
    p = counts / groups.shape[-1]
    return -jnp.sum(jnp.where(p > 0, p * jnp.log2(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)


def _priority(codec: AdaptiveTahQuant, y: jax.Array) -> jax.Array:
    """[M] how much each group deserves 4 bits under `codec.allocation` (higher first)."""
    if codec.allocation == "entropy":
        return entropy(y)
    if codec.allocation == "absmax":
        return jnp.max(jnp.abs(y), axis=-1)
    position = lax.broadcasted_iota(jnp.int32, y.shape[:1], 0)
    return -(position % 2).astype(jnp.float32)  # even groups first (a stable sort keeps order)


def _wide_mask(codec: AdaptiveTahQuant, y: jax.Array, rows: int) -> jax.Array:
    """[rows * groups] bool: the `wide_groups` highest-priority groups of each row."""
    per_row = _priority(codec, y).reshape(rows, -1)
    groups = per_row.shape[-1]
    order = jnp.argsort(-per_row, axis=-1, stable=True)  # highest first, ties by position
    rank = jnp.argsort(order, axis=-1)
    return (rank < codec.wide_groups(groups)).reshape(-1)


def _pack3(codes: jax.Array) -> jax.Array:
    """Offset codes 0..7 [M, 32] -> [M, 12] bytes: 8 codes in 3 bytes, little-endian."""
    eights = codes.astype(jnp.uint32).reshape(codes.shape[0], -1, 8)
    shifts = 3 * lax.broadcasted_iota(jnp.uint32, eights.shape, 2)
    word = jnp.sum(eights << shifts, axis=-1)  # 24 bits
    parts = [(word >> (8 * b)) & 0xFF for b in range(3)]
    return jnp.stack(parts, axis=-1).reshape(codes.shape[0], -1).astype(jnp.uint8)


def _unpack3(data: jax.Array) -> jax.Array:
    """Inverse of `_pack3`: [M, 12] bytes -> [M, 32] offset codes."""
    triples = data.astype(jnp.uint32).reshape(data.shape[0], -1, 3)
    word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
    shifts = 3 * lax.broadcasted_iota(jnp.uint32, (*word.shape, 8), 2)
    return ((word[..., None] >> shifts) & 0x7).reshape(data.shape[0], -1).astype(jnp.int32)


def _group_bytes(wide: jax.Array) -> jax.Array:
    return jnp.where(wide, GROUP_SIZE // 2, GROUP_SIZE * 3 // 8)


# Jitted (codec, sizes and dtype static), as `tahquant`'s reference ops: an eager call compiles
# once instead of once per operation.
@functools.partial(jax.jit, static_argnames=("codec",))
def encode_wire(codec: AdaptiveTahQuant, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """x [R, n] -> wire [R, codec.wire_bytes(n)]."""
    tahquant.check_stage_encodable(WIDE, x)
    if codec.stochastic and key is None:
        raise ValueError(f"codec {codec.name!r} rounds stochastically: pass a PRNG key")
    rows, n = x.shape
    groups = x.astype(jnp.float32).reshape(-1, GROUP_SIZE)
    flag, index = tahquant.pivot_rule(groups)
    y = tahquant.pivot_forward(groups, flag, index)
    wide = _wide_mask(codec, y, rows)
    noise = None
    if codec.stochastic:  # the fixed-bit codec's noise (`tahquant.uniform_noise`)
        pairs = tahquant.pair_counters(rows, n).reshape(y.shape[0], -1)
        noise = tahquant.uniform_noise(tahquant.noise_seeds(key), pairs)
    narrow, narrow_scale, _ = tahquant.quantize_groups(NARROW, y, noise)
    broad, broad_scale, _ = tahquant.quantize_groups(WIDE, y, noise)
    chunks = jnp.where(  # each group's bytes, padded to 16
        wide[:, None],
        tahquant.pack_codes(WIDE, broad),
        jnp.pad(_pack3(narrow + NARROW.qmax + 1), ((0, 0), (0, 4))),
    )
    valid = lax.broadcasted_iota(jnp.int32, chunks.shape, 1) < _group_bytes(wide)[:, None]
    per_row = codec.code_bytes(n)
    # Stable sort of the valid bytes to the front of each row, keeping their order.
    order = jnp.argsort(~valid.reshape(rows, -1), axis=-1, stable=True)[:, :per_row]
    code_bytes = jnp.take_along_axis(chunks.reshape(rows, -1), order, axis=-1)
    scale = jnp.where(wide, broad_scale, narrow_scale)
    pivots = index | jnp.where(flag, tahquant.PIVOT_FLAG, 0) | jnp.where(wide, WIDE_FLAG, 0)
    sides = [
        codecs.side_to_bytes(scale.reshape(rows, -1), 4),
        pivots.astype(jnp.uint8).reshape(rows, -1),
    ]
    return lax.optimization_barrier(jnp.concatenate([code_bytes, *sides], axis=-1))


@functools.partial(jax.jit, static_argnames=("codec", "n", "dtype"))
def decode_wire(codec: AdaptiveTahQuant, wire: jax.Array, n: int, dtype=jnp.float32):
    """wire [R, B] -> x [R, n] of `dtype`."""
    rows, groups = wire.shape[0], n // GROUP_SIZE
    per_row = codec.code_bytes(n)
    scale = codecs.side_from_bytes(wire[:, per_row : per_row + 4 * groups], 4).reshape(-1)
    pivots = wire[:, per_row + 4 * groups :].reshape(-1).astype(jnp.int32)
    wide = (pivots & WIDE_FLAG) != 0
    sizes = _group_bytes(wide).reshape(rows, groups)
    starts = jnp.cumsum(sizes, axis=-1) - sizes  # each group's first byte in its row
    padded = jnp.pad(wire[:, :per_row], ((0, 0), (0, GROUP_SIZE // 2)))
    take = starts[..., None] + lax.broadcasted_iota(jnp.int32, (rows, groups, 16), 2)
    chunks = jnp.take_along_axis(padded[:, None, :], take, axis=-1).reshape(-1, 16)
    codes = jnp.where(
        wide[:, None],
        tahquant.unpack_codes(WIDE, chunks),
        _unpack3(chunks[:, :12]) - (NARROW.qmax + 1),
    )
    y = codecs.scale_rows(codes.astype(jnp.float32), scale)
    flag, index = tahquant.pivot_fields(pivots, WIDE_FLAG - 1)
    y = tahquant.pivot_inverse(y, flag, index)
    return y.reshape(rows, n).astype(dtype)
