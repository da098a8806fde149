"""TAH-Quant: the codec for pipeline stage-to-stage traffic (activations and their gradients).

The definition (docs/method.md, "Pipeline codecs"; TAH-Quant, arXiv 2506.01352, as COCCL's
`tahquant` compressor implements it), per group of G consecutive values of the flattened message
(G channels of one token when the model width is a multiple of G), in fp32:

1. pivot swap + Hadamard: with m1 >= m2 the two largest |x| of the group, a group where
   m1 > 2 m2 ("a dominant outlier") swaps its largest element into position 0 and applies the
   32-point Hadamard to its first 32 elements (where the outlier now is); the group stores a
   flag and the index. The decoder applies the Hadamard again and swaps back. The Hadamard is
   the orthonormal H_32 = S_32 / sqrt(32): the outlier's magnitude drops by ~sqrt(32) in the
   group's absmax, and with it the scale of all G values. (The descriptions this follows use
   the unnormalized S_32 forward and S_32 / 32 back; with one transformed block per group that
   leaves the absmax at the outlier's and raised the error of groups of 128 by 13% over no
   pivot at all, docs/method.md "Pipeline codecs".)
2. quantize to `bits`: asymmetric (scale = (max - min) / (2^bits - 1), and the min; codes
   0 .. 2^bits - 1) for activations, symmetric (scale = absmax / (2^(bits-1) - 1), codes
   -qmax .. qmax) for gradients; stochastic rounding (floor(v + u), u ~ U(0, 1) hashed from the
   element's index and a key the caller passes, `uniform_noise`: unbiased within 2^-17 of a
   step, and a resumed run draws the same numbers), or round to nearest.
3. wire: [codes][n/G fp32 scales][n/G fp32 mins, asymmetric only][n/G pivot bytes], 4-bit codes
   two per byte (the even element in the low nibble).

As in `taco_jax.codecs`: every group is scaled by a power of two into [1, 2) before the
arithmetic (nothing overflows or underflows in between), and a group holding NaN or Inf gets a
NaN scale and decodes to NaN. This module holds the jnp reference, written in ops that the
fused kernels (`pallas_kernels.tahquant_kernel`) run on their tiles too; `compressed_ppermute`
moves its wire.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taco_jax import codecs

PIVOT_BLOCK = 32  # the Hadamard's size: the first block of a pivoted group
PIVOT_FLAG = 0x80  # pivot byte: flag in the top bit, the index in the low 7
MAX_PIVOT_GROUP = 128


@dataclasses.dataclass(frozen=True)
class TahQuant:
    """A TAH-Quant codec; construct through `get_stage_codec`. Static and hashable."""

    name: str
    bits: int = 8
    group_size: int = 128
    asymmetric: bool = True
    pivot: bool = True
    stochastic: bool = True

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits} must be 4 or 8 (codec {self.name!r})")
        g = self.group_size
        if g < PIVOT_BLOCK or g & (g - 1):
            raise ValueError(
                f"group_size={g} must be a power of two >= {PIVOT_BLOCK} (codec {self.name!r})"
            )
        if self.pivot and g > MAX_PIVOT_GROUP:
            raise ValueError(
                f"group_size={g} must be at most {MAX_PIVOT_GROUP} with the pivot "
                f"(its index fits 7 bits; codec {self.name!r})"
            )

    is_identity = False

    @property
    def levels(self) -> int:
        """Largest code of the asymmetric grid (codes 0 .. levels)."""
        return (1 << self.bits) - 1

    @property
    def qmax(self) -> int:
        """Largest magnitude of the symmetric grid (codes -qmax .. qmax)."""
        return (1 << (self.bits - 1)) - 1

    @property
    def side_fields(self) -> tuple[tuple[str, int], ...]:
        """(field, bytes per group) of each side section, in wire order."""
        fields = (("scales", 4),) + (("mins", 4),) * self.asymmetric
        return fields + (("pivots", 1),) * self.pivot

    @property
    def bits_per_element(self) -> float:
        sides = sum(width for _, width in self.side_fields)
        return self.bits + 8.0 * sides / self.group_size

    def code_bytes(self, n: int) -> int:
        return n * self.bits // 8

    def wire_bytes(self, n: int) -> int:
        """Bytes of one packed row of `n` elements (`n` a multiple of G)."""
        return self.code_bytes(n) + sum(w for _, w in self.side_fields) * (n // self.group_size)

    @property
    def backward(self) -> TahQuant:
        """The codec for the gradients of what this codec carries: symmetric (TAH-Quant)."""
        if not self.asymmetric:
            return self
        return dataclasses.replace(self, name=f"{self.name}_sym", asymmetric=False)


_STAGE_CODECS = {
    # COCCL's tahquant: INT8, groups of 128, asymmetric forward (symmetric backward), pivot swap.
    "tahquant": dict(bits=8, group_size=128),
    "tahquant_sym": dict(bits=8, group_size=128, asymmetric=False),
    # COCCL's training-config variant: 4-bit, groups of 32, symmetric, pivot swap.
    "tahquant4": dict(bits=4, group_size=32, asymmetric=False),
}
STAGE_CODEC_NAMES = tuple(_STAGE_CODECS)
# The same two grids rounding to nearest (the TP collectives take these and the stochastic ones,
# `taco_jax.collectives.TAHQUANT_CODEC_NAMES`).
_NEAREST_CODECS = {
    f"{name}_nearest": dict(_STAGE_CODECS[name], stochastic=False)
    for name in ("tahquant", "tahquant4")
}
NEAREST_CODEC_NAMES = tuple(_NEAREST_CODECS)


def get_stage_codec(name: str | TahQuant) -> TahQuant:
    """The TAH-Quant codec named `name` (one of `STAGE_CODEC_NAMES` or `NEAREST_CODEC_NAMES`),
    or `name` itself."""
    if isinstance(name, TahQuant):
        return name
    fields = _STAGE_CODECS.get(name, _NEAREST_CODECS.get(name))
    if fields is None:
        raise ValueError(
            f"unknown stage codec {name!r}; choose one of {STAGE_CODEC_NAMES + NEAREST_CODEC_NAMES}"
        )
    return TahQuant(name=name, **fields)


# --------------------------------------------------------------------------------------------
# Stages, on groups [M, G] (fp32). Written only with ops the Triton lowering of Pallas also
# takes (reductions, `where`, splits of a last axis of size 2, integer shifts): the fused kernels
# (`pallas_kernels.tahquant_kernel`) call these same functions on their tiles. The one exception
# is the H_32's butterflies, which the kernels take in their own form (`butterflies_by_pair_splits`,
# the same arithmetic as the reference's `butterflies_by_axes`).


_COUNT_UNIT = 1 << 14  # > the sum of all positions of a group of 128 (8128)


def pivot_rule(groups: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(flag [M] bool, index [M] int32): whether each group has a dominant outlier, and where it
    is (0 in groups without one; unspecified in a group holding a NaN, which decodes to NaN
    whatever its pivot byte says).

    With m1 >= m2 the two largest |x|, "m1 > 2 m2" holds exactly when the largest element is the
    only one with 2 |x| >= m1 (2 |x| is exact; m1 = 0 flags nothing). One sum counts those
    elements and adds their positions, packed as count * 2^14 + positions: a flagged group's sum
    is its outlier's position plus 2^14. Two reductions (max, sum), where naming the largest
    element and the runner-up separately took three.
    """
    magnitude = jnp.abs(groups)
    positions = lax.broadcasted_iota(jnp.int32, groups.shape, 1)
    m1 = jnp.max(magnitude, axis=-1)
    above = 2.0 * magnitude >= m1[:, None]
    packed = jnp.sum(jnp.where(above, positions + _COUNT_UNIT, 0), axis=-1)
    flag = packed >> 14 == 1
    return flag, jnp.where(flag, packed & (_COUNT_UNIT - 1), 0)


def _element_at(groups: jax.Array, at: jax.Array) -> jax.Array:
    """groups[m, j] where at[m, j] (one True per row) as a masked sum (one non-zero term:
    exact), [M]."""
    return jnp.sum(jnp.where(at, groups, 0.0), axis=-1)


def swap_to_front(groups: jax.Array, index: jax.Array) -> jax.Array:
    """Exchanges elements 0 and `index` of each group (its own inverse; index 0 leaves the group
    as it is, bit for bit, which is what `pivot_rule` gives groups without an outlier)."""
    positions = lax.broadcasted_iota(jnp.int32, groups.shape, 1)
    # Index 0 selects nothing: the masked sums of `_element_at` would turn a -0.0 into +0.0.
    moved = index[:, None] != 0
    is_index, is_first = moved & (positions == index[:, None]), moved & (positions == 0)
    at_index, first = _element_at(groups, is_index), _element_at(groups, is_first)
    return jnp.where(is_first, at_index[:, None], jnp.where(is_index, first[:, None], groups))


def butterflies_by_pair_splits(x: jax.Array, bits: int) -> jax.Array:
    """(I (x) S_{2^bits}) x on the last axis of x [M, K], the +-1 Sylvester transform over the
    low `bits` bits of the index, as recursive butterflies (i = 2 i' + i1: y[2 j'] = S a + S b,
    y[2 j' + 1] = S a - S b, with a, b the even and odd elements), written with the splits of a
    last axis of size 2 that the Triton lowering takes (the kernels' form; the fp32 counterpart
    of the TP kernels' `pallas_kernels._tile._split_low_bit`, which ends in tensor-core dots).
    Bit `bits - 1` is combined first, bit 0 last.

    Plain JAX, up to rounding: (x.reshape(M, K >> bits, 2^bits) @ S_{2^bits}).reshape(M, K),
    S = `codecs.signs_matrix`."""
    if bits == 0:
        return x
    m, k = x.shape
    even, odd = lax.unstack(x.reshape(m, k // 2, 2), axis=2)
    a = butterflies_by_pair_splits(even, bits - 1)
    b = butterflies_by_pair_splits(odd, bits - 1)
    return lax.stack([a + b, a - b], axis=2).reshape(m, k)


def butterflies_by_axes(x: jax.Array, bits: int) -> jax.Array:
    """`butterflies_by_pair_splits` as XLA compiles it best (the reference's form): the low
    `bits` bits of the index as axes of size 2, one butterfly per axis, bit `bits - 1` first.
    The same additions of the same operands in the same order, so the two agree bit for bit
    (tests/taco_jax/test_tahquant.py); the recursion stages 2^bits - 1 splits and joins where
    this stages `bits` butterflies: compiles faster on the CPU and runs faster on the H200
    (docs/decisions/015-tahquant-kernels.md)."""
    m, k = x.shape
    y = x.reshape(m, k >> bits, *(2,) * bits)  # axis 2 + level holds index bit bits - 1 - level
    for axis in range(2, 2 + bits):
        a, b = lax.index_in_dim(y, 0, axis), lax.index_in_dim(y, 1, axis)
        y = lax.concatenate([a + b, a - b], axis)
    return y.reshape(m, k)


# A butterfly form: `butterflies_by_axes` (the reference's) or `butterflies_by_pair_splits`
# (the kernels'), equal bit for bit.
Butterflies = Callable[[jax.Array, int], jax.Array]


_PIVOT_BITS = PIVOT_BLOCK.bit_length() - 1
PIVOT_UNIT = np.float32(1.0 / np.sqrt(PIVOT_BLOCK))  # H_32 = S_32 * PIVOT_UNIT


def hadamard_front(
    groups: jax.Array, flag: jax.Array, butterflies: Butterflies = butterflies_by_axes
) -> jax.Array:
    """The orthonormal H_32 = S_32 / sqrt(32) (its own inverse up to fp32 rounding) applied to
    the first 32 elements of each flagged group, its butterflies in the form `butterflies`.

    Written without slicing, so the kernels run this very function on their tiles (with
    `butterflies_by_pair_splits`): the first block of 32 is taken out as a masked sum over the
    blocks (one non-zero term: exact), goes through the butterflies, and is put back with a
    `where`."""
    m, g = groups.shape
    blocks = groups.reshape(m, g // PIVOT_BLOCK, PIVOT_BLOCK)
    first_block = lax.broadcasted_iota(jnp.int32, blocks.shape, 1) == 0
    front = jnp.sum(jnp.where(first_block, blocks, 0.0), axis=1)  # [M, 32]
    transformed = butterflies(front, _PIVOT_BITS) * PIVOT_UNIT
    keep = first_block & flag[:, None, None]
    return jnp.where(keep, transformed[:, None, :], blocks).reshape(m, g)


# --------------------------------------------------------------------------------------------
# Stochastic rounding noise: a counter-based hash of (seed, element index), so that a fused
# kernel draws exactly the numbers of the reference without reading them from memory.


def _mix32(h: jax.Array) -> jax.Array:
    """A bijective 32-bit integer mixer (Wellons' "lowbias32": strong avalanche, 2 multiplies)."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> 16)


def noise_seeds(key: jax.Array) -> jax.Array:
    """Two uint32 words of `key` that seed `uniform_noise`, [2]."""
    return jax.random.bits(key, (2,), jnp.uint32)


def uniform_noise(seeds, pairs: jax.Array) -> jax.Array:
    """Noise u in (0, 1) for the element pairs numbered `pairs` (uint32 [..., K]) -> [..., 2 K]:
    elements 2 j and 2 j + 1 of the flat encoded rows take the low and the high 16 bits of
    h = mix(mix(j ^ s0) + s1), u = (bits + 1/2) / 2^16, keyed by the two uint32 words `seeds`
    (`noise_seeds`; an array [2] or a pair of scalars).

    Two keyed rounds of a bijective mixer: within one seed distinct pairs draw distinct hashes.
    One hash serves two elements (the hash is the encode's costliest arithmetic,
    BENCHMARKS.md "Pipeline codec kernels"); 16 bits of noise round within 2^-17 of a step of
    unbiased. Pair numbers count modulo 2^32."""
    h = _mix32(_mix32(pairs ^ seeds[0]) + seeds[1])
    halves = [(h & 0xFFFF), (h >> 16)]
    u = [
        (half.astype(jnp.int32).astype(jnp.float32) + 0.5) * np.float32(2.0**-16) for half in halves
    ]
    return lax.stack(u, axis=-1).reshape(*pairs.shape[:-1], 2 * pairs.shape[-1])


def message_key(x: jax.Array) -> jax.Array:
    """A PRNG key hashed from the bits of `x` and their positions: the stochastic rounding's key
    where no caller threads one (TAH-Quant on TP traffic, `taco_jax.collectives`).

    h = sum_i mix(bits_i ^ mix(i)) mod 2^32, then `jax.random.key(h)`. A message draws the same
    noise whenever it is sent again (a resumed run reproduces the uninterrupted one); one that
    differs in a single element draws a different h (the mixer is a bijection, so the changed
    term changes the sum), and one that differs more the same h with probability ~2^-32: other
    messages draw unrelated noise. For a given message the rounding is
    fixed; across the messages of a training run (other steps, layers, ranks) it is unbiased
    as the keyed rounding is. Two ranks sending identical messages draw identical noise, so
    their errors add as round-to-nearest's do."""
    size = jnp.dtype(x.dtype).itemsize
    if size >= 4:  # fp64 becomes two uint32 words per value: both halves are hashed
        bits = lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    else:
        bits = lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)
        bits = bits.reshape(-1)
    index = jnp.arange(bits.size, dtype=jnp.uint32)
    return jax.random.key(jnp.sum(_mix32(bits ^ _mix32(index)), dtype=jnp.uint32))


def pair_counters(rows: int, n: int) -> jax.Array:
    """The pair numbers of rows [R, n] (n even) as [R n / 2] uint32: j = (r n + i) / 2."""
    return jnp.arange(rows * n // 2, dtype=jnp.uint32)


def _rounded(v: jax.Array, noise: jax.Array | None, magic_round: bool) -> jax.Array:
    """floor(v + u) with u in (0, 1) (`uniform_noise`: stochastic), or round half to even."""
    if noise is not None:
        return jnp.floor(v + noise)
    return codecs.round_even(v, magic_round)


def quantize_groups(
    codec: TahQuant, y: jax.Array, noise: jax.Array | None, *, magic_round: bool = False
):
    """y [M, G] -> (codes [M, G] int32 on the codec's grid, scale [M], min [M] or None).

    The code arithmetic runs on y scaled into [1, 2) by a power of two (exact); only the stored
    scale and min carry the magnitude. `noise` [M, G]: stochastic rounding, else to nearest.
    """
    if codec.asymmetric:
        # min and max of y give its absmax too; scaling by the power of two p is exact, so
        # min(y) p = min(y p): two reductions instead of three.
        low, high = jnp.min(y, axis=-1), jnp.max(y, axis=-1)
        p, _ = codecs.group_normalizer(jnp.maximum(high, -low))
        w = codecs.scale_rows(y, p)
        lo, hi = low * p, high * p
        span = hi - lo
        to_code = jnp.where(span > 0, codec.levels / span, 0.0)  # a constant group: all code 0
        v = codecs.scale_rows(w - lo[:, None], to_code)
        codes = jnp.clip(_rounded(v, noise, magic_round), 0, codec.levels)
        scale = codecs.mark_nonfinite(span / codec.levels / p, y)
        return codes.astype(jnp.int32), scale, low
    amax = jnp.max(jnp.abs(y), axis=-1)
    p, _ = codecs.group_normalizer(amax)
    w = codecs.scale_rows(y, p)
    amax_w = amax * p
    to_code = jnp.where(amax_w > 0, codec.qmax / amax_w, 0.0)
    v = codecs.scale_rows(w, to_code)
    codes = jnp.clip(_rounded(v, noise, magic_round), -codec.qmax, codec.qmax)
    scale = codecs.mark_nonfinite(amax / codec.qmax, y)
    return codes.astype(jnp.int32), scale, None


def dequantize_groups(codec: TahQuant, codes: jax.Array, scale, lo) -> jax.Array:
    y = codecs.scale_rows(codes.astype(jnp.float32), scale)
    return y + lo[:, None] if codec.asymmetric else y


def pivot_forward(
    groups: jax.Array,
    flag: jax.Array,
    index: jax.Array,
    butterflies: Butterflies = butterflies_by_axes,
) -> jax.Array:
    """The pivot's transform of groups [M, G]: swap, then H_32 of the first block where flagged
    (the identity on groups with flag False and index 0, as `pivot_rule` gives them);
    `butterflies`: as `hadamard_front`."""
    return hadamard_front(swap_to_front(groups, index), flag, butterflies)


def pivot_inverse(
    groups: jax.Array,
    flag: jax.Array,
    index: jax.Array,
    butterflies: Butterflies = butterflies_by_axes,
) -> jax.Array:
    """The decoder's inverse of `pivot_forward` (up to fp32 rounding; `butterflies`: as
    `hadamard_front`)."""
    return swap_to_front(hadamard_front(groups, flag, butterflies), index)


def encode_groups(
    codec: TahQuant,
    groups: jax.Array,
    noise: jax.Array | None,
    *,
    magic_round: bool = False,
    pivot=pivot_forward,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """groups [M, G] fp32 -> (codes [M, G] int32, {side field: [M]}): the whole encode but the
    packing (the reference and the fused kernels both run it).

    pivot: `pivot_forward`, or a function equal to it (the kernels skip it on a tile where no
    group is flagged)."""
    flag, index = pivot_rule(groups) if codec.pivot else (None, None)
    y = pivot(groups, flag, index) if codec.pivot else groups
    codes, scale, lo = quantize_groups(codec, y, noise, magic_round=magic_round)
    sides = {"scales": scale, "mins": lo}
    if codec.pivot:
        sides["pivots"] = (index | jnp.where(flag, PIVOT_FLAG, 0)).astype(jnp.uint8)
    return codes, {field: sides[field] for field, _ in codec.side_fields}


def decode_groups(
    codec: TahQuant,
    codes: jax.Array,
    sides: dict[str, jax.Array],
    butterflies: Butterflies = butterflies_by_axes,
) -> jax.Array:
    """Inverse of `encode_groups` up to the rounding: codes [M, G] int32 -> fp32 [M, G]
    (`butterflies`: as `hadamard_front`)."""
    y = dequantize_groups(codec, codes, sides["scales"], sides.get("mins"))
    if not codec.pivot:
        return y
    flag, index = pivot_fields(sides["pivots"], PIVOT_FLAG - 1)
    return pivot_inverse(y, flag, index, butterflies)


def pivot_fields(pivots: jax.Array, index_mask: int) -> tuple[jax.Array, jax.Array]:
    """(flag, index) of pivot bytes [M]: the index where the flag is set, else 0 (no swap)."""
    pivots = pivots.astype(jnp.int32)
    flag = (pivots & PIVOT_FLAG) != 0
    return flag, jnp.where(flag, pivots & index_mask, 0)


# --------------------------------------------------------------------------------------------
# Codes and side bytes <-> the wire.


def pack_codes(codec: TahQuant, codes: jax.Array) -> jax.Array:
    """Grid codes [..., n] int32 -> code bytes [..., n * bits / 8] (uint8)."""
    stored = codes if codec.asymmetric else codes + (1 << (codec.bits - 1))  # offset binary
    return codecs.pack_bits(stored.astype(jnp.uint8), codec.bits)


def unpack_codes(codec: TahQuant, data: jax.Array) -> jax.Array:
    """Inverse of `pack_codes`."""
    codes = codecs.unpack_bits(data, codec.bits).astype(jnp.int32)
    return codes if codec.asymmetric else codes - (1 << (codec.bits - 1))


def sections(codec: TahQuant, n: int) -> dict[str, tuple[int, int]]:
    """{field: (offset, width)} of the side sections of a row of `n` elements."""
    groups = n // codec.group_size
    offset, out = codec.code_bytes(n), {}
    for field, width in codec.side_fields:
        out[field] = (offset, width)
        offset += width * groups
    return out


def check_stage_encodable(codec: TahQuant, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"codec {codec.name!r} encodes floating arrays, got dtype={x.dtype}")
    if x.ndim != 2 or x.shape[-1] % codec.group_size:
        raise ValueError(
            f"rows of shape={x.shape} must be [R, n] with n a multiple of "
            f"group_size={codec.group_size}"
        )


# The reference ops are jitted (codec, sizes and dtype static): called eagerly, op by op, each
# of their operations would compile on its own; inside a caller's jit they inline.
@functools.partial(jax.jit, static_argnames=("codec",))
def encode_wire(codec: TahQuant, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """x [R, n] -> wire [R, codec.wire_bytes(n)]; `key` draws the stochastic rounding (required
    when `codec.stochastic`)."""
    check_stage_encodable(codec, x)
    if codec.stochastic and key is None:
        raise ValueError(f"codec {codec.name!r} rounds stochastically: pass a PRNG key")
    rows, n = x.shape
    groups = x.astype(jnp.float32).reshape(-1, codec.group_size)
    noise = None
    if codec.stochastic:
        pairs = pair_counters(rows, n).reshape(groups.shape[0], -1)
        noise = uniform_noise(noise_seeds(key), pairs)
    codes, sides = encode_groups(codec, groups, noise)
    parts = [pack_codes(codec, codes.reshape(rows, n))]
    for field, width in codec.side_fields:
        parts.append(codecs.side_to_bytes(sides[field].reshape(rows, -1), width))
    # A real boundary: XLA must not fold the rounding into a following decode.
    return lax.optimization_barrier(jnp.concatenate(parts, axis=-1))


def unpack_sides(codec: TahQuant, wire: jax.Array, n: int) -> dict[str, jax.Array]:
    """The per-group side values of wire rows [R, B], flattened over rows: scales (fp32), mins
    (fp32, asymmetric codecs), pivots (uint8: flag bit and index)."""
    groups = n // codec.group_size
    sides = {}
    for field, (offset, width) in sections(codec, n).items():
        data = wire[:, offset : offset + width * groups]
        sides[field] = codecs.side_from_bytes(data, width).reshape(-1)
    return sides


@functools.partial(jax.jit, static_argnames=("codec", "n", "dtype"))
def decode_wire(codec: TahQuant, wire: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """wire [R, B] -> x [R, n] of `dtype`."""
    codes = unpack_codes(codec, wire[:, : codec.code_bytes(n)]).reshape(-1, codec.group_size)
    y = decode_groups(codec, codes, unpack_sides(codec, wire, n))
    return y.reshape(wire.shape[0], n).astype(dtype)


@functools.partial(jax.jit, static_argnums=(0,))
def roundtrip(codec: TahQuant, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """decode(encode(x)) of rows [R, n] (n a multiple of G), fp32."""
    return decode_wire(codec, encode_wire(codec, x, key), x.shape[-1])
