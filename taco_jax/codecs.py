"""Group-wise codecs for tensor-parallel traffic: ASH + DS FP8 (TACO), its ablations, INT8.

This module is the one definition of a codec: its stages, its element formats, its wire layout,
and the jnp reference built from them. The fused kernels (`pallas_kernels`) import the same
stage functions and wire layout; only how they compute the Hadamard product and move bytes is
their own. Every stage is plain jnp on an array whose last axis is one group, written with ops
that also lower inside Pallas kernel bodies (no `round`, no value slicing; see `quantize`).

A codec turns the last axis of an array into a `Payload` of uint8 codes plus per-group side
scales, and back. It composes four optional stages applied to each contiguous group of
`group_size` (G) values, all in fp32 (docs/method.md, "Codec" and "Range"):

1. ASH pre-scale:  alpha = 448 / rms(x), kept within [2^-126, 2^126]; x <- alpha x
2. Hadamard:       y = H_G x,  H_G = S_G / sqrt(G), S_G the +-1 Sylvester matrix (orthonormal,
                   self-inverse)
3. DS post-scale:  s = max|y| / qmax
4. quantize:       q = round(y / s) in E4M3 / E5M2 / INT8 / INT6 / INT5 / INT4 (saturating)

Decode runs the stages backwards: x = H_G (q s) / alpha. In exact arithmetic alpha cancels from
y / s = qmax * (S_G x) / max|S_G x|, and the encoder computes the codes in that form, after
scaling each group by a power of two (exact) that brings its absmax into [1, 2): no fp32
intermediate overflows or underflows, so a codec's relative error is the same at every
magnitude (docs/method.md, "Range"). The decoder returns `(S_G q) * (s / (sqrt(G) alpha))`, one
multiply per element (`encode_groups`, `decode_factor`).

Codes travel as uint8 (a bitcast), never as float8: XLA on CPU moves float8 collectives as
f16, and XLA may drop an f32 -> f8 -> f32 round trip inside one fusion (docs/method.md, "Traps").

Non-finite input is never hidden: a group holding NaN or Inf gets a NaN scale, so the whole group
decodes to NaN and the training loop sees the divergence (the reference CUDA code maps NaN/Inf to
0 instead).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ElementFormat = Literal["e4m3", "e5m2", "int8", "int6", "int5", "int4", "raw"]
ScaleFormat = Literal["fp32", "e8m0"]

ALLOWED_GROUP_SIZES = (32, 64, 128, 256, 512)
DEFAULT_GROUP_SIZE = 128
DEFAULT_CODEC = "taco"

# The ASH pre-scale alpha stays a normal fp32 power-of-two range away from overflow: a group
# whose alpha would leave it (rms below ~2^-117) keeps the bound and lets s carry the rest.
PRESCALE_MIN, PRESCALE_MAX = 2.0**-126, 2.0**126

FLOAT8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
# Largest finite magnitude of each element format; the target of the post-scale.
QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0, "int6": 31.0, "int5": 15.0, "int4": 7.0}
# Bits of the symmetric integer grids {-qmax .. qmax}, qmax = 2^(bits - 1) - 1.
INT_BITS = {"int8": 8, "int6": 6, "int5": 5, "int4": 4}
# How a row's codes are split into bit planes on the wire (low bits first, `code_planes`):
# every plane packs 8 / width codes per byte, so a tile's codes land in whole bytes of each
# plane with shifts and pairwise interleaves only (what the Triton lowering supports).
PLANE_WIDTHS = {8: (8,), 6: (4, 2), 5: (4, 1), 4: (4,)}
# The ASH pre-scale targets a group RMS of the E4M3 maximum, whatever the element format.
ASH_TARGET_RMS = QMAX["e4m3"]
# 1.5 * 2^23: adding and subtracting it rounds an fp32 |v| < 2^22 to the nearest integer, ties to
# even (IEEE add), which is jnp.round's rule; the Triton lowering of Pallas has no `round`.
ROUND_MAGIC = 12582912.0


def round_even(v: jax.Array, magic_round: bool) -> jax.Array:
    """fp32 v (|v| < 2^22) rounded to the nearest integer, ties to even: by `ROUND_MAGIC` where
    `magic_round` (the GPU lowerings have no `round`; XLA on the CPU folds the magic add away, so
    the reference and interpret mode use `jnp.round`)."""
    return (v + ROUND_MAGIC) - ROUND_MAGIC if magic_round else jnp.round(v)


# E8M0 (OCP MX): a biased power-of-two exponent byte; 0xFF is NaN.
E8M0_BIAS = 127.0
E8M0_NAN = 255


# --------------------------------------------------------------------------------------------
# The codec, its payload and its wire layout.


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["codes", "scales", "prescales"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class Payload:
    """An encoded array: `codec.decode(payload) ~= x` for `payload = codec.encode(x)`.

    Invariant: `codes.shape == x.shape` (uint8, one code per element; `pack` packs sub-byte
    codes densely on the wire) and every scale array has
    shape `x.shape[:-1] + (x.shape[-1] // group_size,)`. `scales` holds the DS post-scale (fp32,
    or uint8 E8M0 exponents for compact codecs, where it is the whole per-group scale);
    `prescales` holds the ASH pre-scale alpha (fp32) or is None when the codec stores none.
    """

    codes: jax.Array
    scales: jax.Array | None
    prescales: jax.Array | None


@dataclasses.dataclass(frozen=True)
class WireSection:
    """One per-group side section of a packed wire row (see `wire_sections`).

    field: the `Payload` field it holds ("scales" or "prescales").
    offset: its first byte in the row.
    width: bytes per group: 1 (a uint8 E8M0 exponent) or 4 (a little-endian fp32).
    """

    field: str
    offset: int
    width: int


@dataclasses.dataclass(frozen=True)
class CodePlane:
    """One bit plane of the codes of a packed wire row (see `code_planes`).

    shift: the lowest code bit it holds.
    width: bits per code in this plane (8, 4, 2 or 1); 8 / width codes share a byte, the first
      one in the byte's low bits.
    offset: its first byte in the row.
    """

    shift: int
    width: int
    offset: int

    def size(self, n: int) -> int:
        """Bytes of this plane in a row of `n` codes."""
        return n * self.width // 8


@dataclasses.dataclass(frozen=True)
class Codec:
    """A group-wise codec: which of the four stages run, in which formats.

    Construct through `get_codec(name)`; the fields are static (hashable), so a codec can be a
    `jit` static argument or a `custom_vjp` non-differentiable argument.
    """

    name: str
    group_size: int = DEFAULT_GROUP_SIZE
    element: ElementFormat = "e4m3"
    prescale: bool = False  # ASH
    hadamard: bool = False
    postscale: bool = False  # DS
    scale_format: ScaleFormat = "fp32"

    def __post_init__(self):
        validate_group_size(self.group_size)
        if self.scale_format == "e8m0" and not self.postscale:
            raise ValueError(f"scale_format=e8m0 needs a post-scale; codec {self.name!r} has none")
        if self.is_integer and not self.postscale:
            raise ValueError(
                f"element={self.element!r} needs a post-scale; codec {self.name!r} has none"
            )

    @property
    def is_identity(self) -> bool:
        return self.element == "raw"

    @property
    def is_integer(self) -> bool:
        """Codes on a symmetric integer grid (INT8 .. INT4), not a float format."""
        return self.element in INT_BITS

    @property
    def bits(self) -> int:
        """Bits of one code on the wire."""
        return INT_BITS.get(self.element, 8)

    @property
    def code_offset(self) -> int:
        """What a sub-byte code stores: the grid value plus this (offset binary, 1 .. 2^bits -
        1); INT8 and the float formats store their own bits (offset 0)."""
        return 1 << (self.bits - 1) if self.bits < 8 else 0

    @property
    def qmax(self) -> float:
        return QMAX[self.element]

    @property
    def side_fields(self) -> tuple[tuple[str, int], ...]:
        """(Payload field, bytes per group) of each side section, in wire order.

        E8M0 stores the product s / alpha as one exponent byte; fp32 scales take four bytes.
        """
        if self.is_identity:
            return ()
        if self.scale_format == "e8m0":
            return (("scales", 1),)
        return (("scales", 4),) * self.postscale + (("prescales", 4),) * self.prescale

    @property
    def side_bytes_per_group(self) -> int:
        """Bytes of scales stored per group on the wire."""
        return sum(width for _, width in self.side_fields)

    @property
    def bits_per_element(self) -> float:
        """Wire bits per encoded element: bits + 8 * side bytes / G (8.5 for `taco` at G = 128,
        6.25 for `int6_hadamard`)."""
        if self.is_identity:
            return 32.0  # `none` moves the fp32 value itself
        return self.bits + 8.0 * self.side_bytes_per_group / self.group_size

    def code_bytes(self, n: int) -> int:
        """Bytes of the codes of a chunk of `n` elements (`n` a multiple of G)."""
        return n * self.bits // 8

    def wire_bytes(self, n: int) -> int:
        """Bytes of one packed chunk of `n` elements (`n` a multiple of G)."""
        if self.is_identity:
            return 4 * n
        return self.code_bytes(n) + self.side_bytes_per_group * (n // self.group_size)

    def encode(self, x: jax.Array) -> Payload:
        """Encodes the last axis of `x` (fp32/bf16/fp16, last dim a multiple of G)."""
        return encode_reference(self, x)

    def decode(self, payload: Payload, dtype=jnp.float32) -> jax.Array:
        """Decodes a payload to `dtype`."""
        return decode_reference(self, payload, dtype)


_CODECS = {
    # TACO: ASH + Hadamard + DS, FP8 E4M3, fp32 scales (8 + 64/G bits).
    "taco": dict(prescale=True, hadamard=True, postscale=True),
    # TACO with one byte of scale per group: s/alpha rounded up to a power of two (8 + 8/G bits).
    "taco_e8m0": dict(prescale=True, hadamard=True, postscale=True, scale_format="e8m0"),
    # TACO with E5M2 codes (range over precision; an option for activation gradients).
    "taco_e5m2": dict(element="e5m2", prescale=True, hadamard=True, postscale=True),
    # Ablation "w/o ASH": plain per-group absmax E4M3.
    "fp8": dict(postscale=True),
    # Ablation "w/o DS": pre-scale + Hadamard, saturating cast, no absmax post-scale.
    "taco_no_ds": dict(prescale=True, hadamard=True),
    # Fallback for hardware without FP8: per-group absmax symmetric INT8, optionally rotated.
    "int8": dict(element="int8", postscale=True),
    "int8_hadamard": dict(element="int8", hadamard=True, postscale=True),
    # Sub-byte Hadamard codes for slow links (bits + 32/G bits per element): the Hadamard makes
    # the groups near-Gaussian, where a uniform grid beats a float format of the same bits.
    "int6_hadamard": dict(element="int6", hadamard=True, postscale=True),
    "int5_hadamard": dict(element="int5", hadamard=True, postscale=True),
    "int4_hadamard": dict(element="int4", hadamard=True, postscale=True),
    # Identity: collectives with this codec are the plain lax collectives.
    "none": dict(element="raw"),
}
CODEC_NAMES = tuple(_CODECS)


def validate_group_size(group_size: int) -> None:
    if group_size not in ALLOWED_GROUP_SIZES:
        raise ValueError(f"{group_size=} must be a power of two in {ALLOWED_GROUP_SIZES}")


def get_codec(codec: str | Codec = DEFAULT_CODEC, group_size: int | None = None) -> Codec:
    """The codec named `codec` (one of `CODEC_NAMES`), or `codec` itself if a `Codec`.

    group_size: G; None keeps a `Codec`'s own and gives a named codec `DEFAULT_GROUP_SIZE`.
    """
    if isinstance(codec, Codec):
        return codec if group_size is None else dataclasses.replace(codec, group_size=group_size)
    if codec not in _CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {CODEC_NAMES}")
    size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    return Codec(name=codec, group_size=size, **_CODECS[codec])


def code_planes(codec: Codec, n: int) -> tuple[CodePlane, ...]:
    """The code planes of a packed row of `n` codes, in wire order from byte 0.

    8-bit codes are one plane of bytes. A b-bit code is split into planes of 4, 2 and 1 bits
    (`PLANE_WIDTHS`: 6 = 4 + 2, 5 = 4 + 1): b / 8 bytes per code in all, so four 6-bit codes
    take three bytes (two of the nibble plane, one of the 2-bit plane).
    """
    planes, shift, offset = [], 0, 0
    for width in PLANE_WIDTHS[codec.bits]:
        planes.append(CodePlane(shift, width, offset))
        shift, offset = shift + width, offset + planes[-1].size(n)
    return tuple(planes)


def wire_sections(codec: Codec, n: int) -> tuple[WireSection, ...]:
    """The side sections of a packed row of `n` codes: `[codes][section 0][section 1]`, the
    codes taking `codec.code_bytes(n)` bytes (`code_planes`).

    `pack` / `unpack` and the kernels all read the layout from here.
    """
    groups = n // codec.group_size
    sections, offset = [], codec.code_bytes(n)
    for field, width in codec.side_fields:
        sections.append(WireSection(field, offset, width))
        offset += width * groups
    return tuple(sections)


# --------------------------------------------------------------------------------------------
# Stages. Each takes groups along the last axis (or per-group values) and runs both in the
# reference and inside Pallas kernel bodies, on [T, G] tiles.


def sylvester_parity(i, j):
    """popcount(i & j) & 1 for 0 <= i, j < 2^16, elementwise on numpy or jnp integer arrays.

    The Sylvester-ordered Hadamard matrix has S[i, j] = (-1)^parity(i & j).
    """
    v = i & j
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    return (v ^ (v >> 1)) & 1


def signs_matrix(b: int) -> np.ndarray:
    """S_b = sqrt(b) H_b, the +-1 Sylvester matrix of order b, fp32 (exact in bf16 too)."""
    i, j = np.indices((b, b))
    return (1 - 2 * sylvester_parity(i, j)).astype(np.float32)


@functools.cache
def hadamard_matrix(group_size: int) -> np.ndarray:
    """The normalized Sylvester Walsh-Hadamard matrix H_G = S_G / sqrt(G) (symmetric, H H = I)."""
    validate_group_size(group_size)
    return signs_matrix(group_size) * np.float32(hadamard_unit(group_size))


def hadamard_unit(group_size: int) -> float:
    """1 / sqrt(G): S_G times this is the orthonormal Hadamard H_G."""
    return 1.0 / math.sqrt(group_size)


def mean_square(v: jax.Array, unit: float = 1.0) -> jax.Array:
    """mean((v * unit)^2) over the last axis; exact scaling when unit^2 / G is a power of two
    (unit 1 or `hadamard_unit(G)`, G a power of two)."""
    g = v.shape[-1]
    return jnp.sum(v * v, axis=-1) * np.float32(unit * unit / g)


def exponent_field(x: jax.Array) -> jax.Array:
    """The biased exponent bits of fp32 `x` (int32): floor(log2|x|) + 127 for a normal x, 0 for
    zero and subnormals, 255 for Inf and NaN. Bit operations: exact, and they lower in kernels."""
    return (lax.bitcast_convert_type(x, jnp.int32) >> 23) & 0xFF


def power_of_two(exponent: jax.Array) -> jax.Array:
    """2^exponent as fp32, exactly, for int32 exponents in [-126, 127]."""
    return lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


def group_normalizer(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(p, k) with p = 2^k the power of two that brings a group's absmax into [1, 2).

    k is kept within [-126, 126] (p a normal fp32): a group of subnormals lands in [2^-23, 1),
    an all-zero group gets p = 2^126 (it stays zero), and a non-finite one p = 2^-126 (it is
    marked NaN by `mark_nonfinite` anyway). Scaling by p is exact, so every later stage sees the
    same numbers whatever the group's magnitude.
    """
    k = jnp.clip(127 - exponent_field(amax), -126, 126)
    return power_of_two(k), k


def ceil_log2(x: jax.Array) -> jax.Array:
    """ceil(log2 x) for normal fp32 x > 0, exactly (int32; -127 for zero)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return exponent_field(x) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def ash_prescale(mean_sq_normalized: jax.Array, p: jax.Array) -> jax.Array:
    """alpha per group: scales the group to RMS 448 (the E4M3 maximum), docs/method.md "Codec".

    mean_sq_normalized: the mean square of p x, the group scaled by `group_normalizer`'s p, so
    the energy neither overflows nor underflows; alpha = 448 p / rms(p x) = 448 / rms(x), kept in
    [PRESCALE_MIN, PRESCALE_MAX] (an all-zero group gets PRESCALE_MAX).
    """
    alpha = ASH_TARGET_RMS * lax.rsqrt(mean_sq_normalized) * p
    return jnp.clip(alpha, PRESCALE_MIN, PRESCALE_MAX)


def mark_nonfinite(scale: jax.Array, groups: jax.Array) -> jax.Array:
    """`scale` [T], NaN where the group of `groups` [T, G] holds a NaN or an Inf.

    The test is a sum of `groups * 0`, which is NaN exactly when the group holds a NaN or an Inf,
    rather than the absmax: XLA on the CPU has been seen to drop a NaN from a large max
    reduction (and to return -inf for an all-NaN row).
    """
    poisoned = jnp.sum(groups * 0.0, axis=-1)
    return jnp.where(poisoned == 0.0, scale, jnp.nan)


def e8m0_exponent(log2_scale: jax.Array, marker: jax.Array) -> jax.Array:
    """An integer power-of-two exponent e (int32) as a biased E8M0 byte (uint8, OCP MX).

    e is kept within [-126, 127]: the normal fp32 powers of two (E8M0's 2^-127 is an fp32
    subnormal, which XLA flushes to zero). 0xFF (E8M0 NaN) where `marker` is NaN.
    """
    biased = jnp.clip(log2_scale, -126, 127) + 127
    return jnp.where(jnp.isnan(marker), E8M0_NAN, biased).astype(jnp.uint8)


def e8m0_value(biased: jax.Array) -> jax.Array:
    """fp32 value 2^(b - 127) of E8M0 exponent bytes b, built from bits (exact; 0xFF is NaN).

    A byte 0 (2^-127, an fp32 subnormal) reads as 0, as XLA would flush it; no encoder here
    writes one."""
    value = lax.bitcast_convert_type(biased.astype(jnp.int32) << 23, jnp.float32)
    return jnp.where(biased == E8M0_NAN, jnp.nan, value)


def quantize(
    codec: Codec, scaled: jax.Array, *, magic_round: bool = False, float_codes: bool = False
) -> jax.Array:
    """fp32 values already divided by their scale -> uint8 codes (saturating).

    The integer grids round half to even: with `jnp.round`, or with `magic_round` by adding and
    subtracting 1.5 * 2^23 (for the Triton lowering, which has no `round`; XLA on the CPU folds
    that add away, so the reference and interpret mode use `jnp.round`). INT8 stores two's
    complement, the sub-byte grids offset binary (`Codec.code_offset`). float_codes: a sub-byte
    grid's codes as their fp32 values (exact integers), not narrowed to uint8."""
    if float_codes and not (codec.is_integer and codec.bits < 8):
        raise ValueError(
            f"float_codes=True takes a sub-byte integer grid, not codec {codec.name!r}"
        )
    clipped = jnp.clip(scaled, -codec.qmax, codec.qmax)
    if codec.is_integer:
        rounded = round_even(clipped, magic_round)
        if codec.bits == 8:
            return lax.bitcast_convert_type(rounded.astype(jnp.int8), jnp.uint8)
        if float_codes:
            return rounded + np.float32(codec.code_offset)
        return (rounded.astype(jnp.int32) + codec.code_offset).astype(jnp.uint8)
    return lax.bitcast_convert_type(clipped.astype(FLOAT8_DTYPES[codec.element]), jnp.uint8)


def dequantize(codec: Codec, codes: jax.Array) -> jax.Array:
    """uint8 codes -> their fp32 values (exact: every code is representable)."""
    if codec.is_integer:
        if codec.bits == 8:
            return lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.float32)
        return (codes.astype(jnp.int32) - codec.code_offset).astype(jnp.float32)
    return lax.bitcast_convert_type(codes, FLOAT8_DTYPES[codec.element]).astype(jnp.float32)


def scale_rows(q: jax.Array, d) -> jax.Array:
    """q [T, G] times a per-group factor d [T] (or a Python float: 1.0 is nothing to do)."""
    if isinstance(d, float):
        return q if d == 1.0 else q * np.float32(d)
    return q * lax.broadcast_in_dim(d, q.shape, (0,))


def encode_groups(
    codec: Codec, v, *, unit: float, magic_round: bool = False, float_codes: bool = False
):
    """Encodes the groups v * unit, v [T, G] fp32: after the Hadamard (v = S x, unit =
    `hadamard_unit(G)`), or the raw groups without one (unit = 1).

    Returns (codes uint8 [T, G], scale [T] or None, prescale [T] or None) with the `Payload`
    meaning: scale is fp32 s (or the uint8 E8M0 exponent of s / alpha), prescale is alpha.
    float_codes: a sub-byte grid's codes as their fp32 values (exact integers), not uint8
      (`quantize`); the codes of a non-finite group are then NaN, where uint8 ones are
      unspecified (its scale is NaN either way, and every decode of it NaN).

    Every per-element quantity is computed on w = p v, p the power of two that brings the
    group's absmax into [1, 2) (`group_normalizer`): y / s = qmax v / max|v| = qmax w / max|w|
    in exact arithmetic (alpha and unit cancel), and the ASH energy is that of w. Only the
    stored per-group scales carry the group's magnitude, so nothing overflows or underflows in
    between. H is orthonormal: the energy of H x (w * unit) is that of x.
    """
    amax = jnp.max(jnp.abs(v), axis=-1)  # non-finite groups: see mark_nonfinite
    p, k = group_normalizer(amax)
    w = scale_rows(v, p)
    amax_w = amax * p
    alpha = ash_prescale(mean_square(w, unit), p) if codec.prescale else None
    if not codec.postscale:  # w/o DS: the pre-scale is the only scale; a NaN one marks the group
        scaled = scale_rows(v, alpha * np.float32(unit))
        codes = quantize(codec, scaled, magic_round=magic_round, float_codes=float_codes)
        return codes, None, mark_nonfinite(alpha, v)
    if codec.scale_format == "e8m0":
        # One byte holds s / alpha = max|v| unit / qmax, rounded up to 2^e; y / (2^e alpha) =
        # v unit / 2^e (alpha cancels), and rounding up keeps |codes| <= qmax.
        e = ceil_log2(amax_w * np.float32(unit / codec.qmax)) - k
        exponent = e8m0_exponent(e, mark_nonfinite(amax, v))
        factor = np.float32(unit) / e8m0_value(exponent)
        codes = quantize(
            codec, scale_rows(v, factor), magic_round=magic_round, float_codes=float_codes
        )
        return codes, exponent, None
    to_code = jnp.where(amax_w > 0, codec.qmax / amax_w, 0.0)  # zero groups stay zero
    codes = quantize(
        codec, scale_rows(w, to_code), magic_round=magic_round, float_codes=float_codes
    )
    to_y = alpha * np.float32(unit) if codec.prescale else np.float32(unit)  # y = v * to_y
    s = mark_nonfinite(amax * to_y / codec.qmax, v)
    return codes, s, alpha


def decode_factor(codec: Codec, scale, prescale, unit: float = 1.0):
    """d [T] with decoded = S(q) * d when unit = `hadamard_unit(G)` (or q * d, unit = 1)."""
    if codec.scale_format == "e8m0":
        return e8m0_value(scale) * np.float32(unit)
    d = scale * np.float32(unit) if codec.postscale else unit
    if codec.prescale:
        d = d / prescale
    return d


# --------------------------------------------------------------------------------------------
# Side bytes: fp32 scales <-> little-endian bytes, in ops the kernels lower too (shifts, not
# a bitcast to a narrower type).


def side_to_bytes(value: jax.Array, width: int) -> jax.Array:
    """Per-group side values [..., k] -> their wire bytes [..., width * k] (uint8)."""
    if width == 1:
        return value
    bits = lax.bitcast_convert_type(value, jnp.uint32)
    shift = (8 * lax.broadcasted_iota(jnp.int32, (*value.shape, 4), value.ndim)).astype(jnp.uint32)
    return ((bits[..., None] >> shift) & 0xFF).astype(jnp.uint8).reshape(*value.shape[:-1], -1)


def side_from_bytes(data: jax.Array, width: int) -> jax.Array:
    """Wire bytes [..., width * k] -> per-group side values [..., k] (uint8 or fp32)."""
    if width == 1:
        return data
    words = data.reshape(*data.shape[:-1], data.shape[-1] // 4, 4).astype(jnp.uint32)
    shift = (8 * lax.broadcasted_iota(jnp.int32, words.shape, words.ndim - 1)).astype(jnp.uint32)
    return lax.bitcast_convert_type(jnp.sum(words << shift, axis=-1), jnp.float32)


# --------------------------------------------------------------------------------------------
# Codes <-> bit planes, in ops the kernels lower too (shifts, and interleaves of pairs on the
# last axis). The 4-bit codes of the stage and DP codecs use the same packing.


PACK_WIDTHS = (1, 2, 4, 8)


def _check_pack_width(width: int) -> None:
    if width not in PACK_WIDTHS:
        raise ValueError(f"{width=}: bit packing takes widths {PACK_WIDTHS}")


def pack_bits(values: jax.Array, width: int) -> jax.Array:
    """uint8 values [..., m], each below 2^width (width 1, 2, 4 or 8) -> bytes
    [..., m * width / 8]; consecutive values fill a byte from its low bits up."""
    _check_pack_width(width)
    while width < 8:
        low, high = lax.unstack(values.reshape(*values.shape[:-1], -1, 2), axis=-1)
        values, width = low | (high << width), 2 * width
    return values


def unpack_bits(data: jax.Array, width: int) -> jax.Array:
    """Inverse of `pack_bits`: bytes [..., k] -> uint8 values [..., 8 k / width]."""
    _check_pack_width(width)
    per_value = 8
    while per_value > width:
        per_value //= 2
        low = data & ((1 << per_value) - 1)
        data = jnp.stack([low, data >> per_value], axis=-1).reshape(*data.shape[:-1], -1)
    return data


def plane_bytes(codes: jax.Array, plane: CodePlane) -> jax.Array:
    """The bytes of `plane` for codes [..., m]: [..., m * plane.width / 8]."""
    if plane.width == 8:
        return codes
    return pack_bits((codes >> plane.shift) & ((1 << plane.width) - 1), plane.width)


def codes_from_planes(planes: list[tuple[CodePlane, jax.Array]]) -> jax.Array:
    """Inverse of `plane_bytes` over all the planes of a code: [(plane, bytes)] -> codes."""
    codes = None
    for plane, data in planes:
        part = unpack_bits(data, plane.width)
        # An 8-bit code is one plane at shift 0: no shift op, so its kernels stay as they were.
        part = part << plane.shift if plane.shift else part
        codes = part if codes is None else codes | part
    return codes


def pack(codec: Codec, payload: Payload) -> jax.Array:
    """Concatenates codes (packed into `code_planes`) and side bytes along the last axis:
    uint8[..., wire_bytes(n)]."""
    n = payload.codes.shape[-1]
    parts = [plane_bytes(payload.codes, plane) for plane in code_planes(codec, n)] + [
        side_to_bytes(getattr(payload, s.field), s.width) for s in wire_sections(codec, n)
    ]
    return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def unpack(codec: Codec, wire: jax.Array, n: int) -> Payload:
    """Inverse of `pack` for chunks of `n` elements."""
    if codec.is_identity:
        return Payload(wire, None, None)
    groups = n // codec.group_size
    sides = {
        s.field: side_from_bytes(wire[..., s.offset : s.offset + s.width * groups], s.width)
        for s in wire_sections(codec, n)
    }
    planes = [(p, wire[..., p.offset : p.offset + p.size(n)]) for p in code_planes(codec, n)]
    return Payload(codes_from_planes(planes), sides.get("scales"), sides.get("prescales"))


# --------------------------------------------------------------------------------------------
# The jnp reference: the stages above, with the Hadamard as an exact fp32 product.


def signed_hadamard(groups: jax.Array) -> jax.Array:
    """S_G x along the last axis (G = its size), fp32; HIGHEST keeps the +-1 sums out of
    TF32/bf16 passes."""
    signs = jnp.asarray(signs_matrix(groups.shape[-1]))
    return jnp.matmul(groups.astype(jnp.float32), signs, precision=lax.Precision.HIGHEST)


def hadamard_transform(x: jax.Array, group_size: int) -> jax.Array:
    """Applies H_G to each group of G along the last axis (fp32)."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    return (signed_hadamard(groups) * np.float32(hadamard_unit(group_size))).reshape(x.shape)


def check_encodable(codec: Codec, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"codec {codec.name!r} encodes floating arrays, got dtype={x.dtype}")
    if x.ndim == 0 or x.shape[-1] % codec.group_size:
        raise ValueError(
            f"last dim of shape={x.shape} is not a multiple of "
            f"group_size={codec.group_size}; pad it first (see pad_to_multiple)"
        )


def encode_reference(codec: Codec, x: jax.Array) -> Payload:
    """Pure-jnp encode of the last axis of `x`; the definition every kernel is tested against."""
    check_encodable(codec, x)
    if codec.is_identity:
        raw = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint8)
        return Payload(raw.reshape(*x.shape[:-1], 4 * x.shape[-1]), None, None)
    g = codec.group_size
    groups = x.astype(jnp.float32).reshape(-1, g)  # [M, G]
    v = signed_hadamard(groups) if codec.hadamard else groups
    unit = hadamard_unit(g) if codec.hadamard else 1.0
    codes, scale, prescale = encode_groups(codec, v, unit=unit)
    per_group = x.shape[:-1] + (x.shape[-1] // g,)
    scale, prescale = (None if a is None else a.reshape(per_group) for a in (scale, prescale))
    # The payload is a real boundary: without the barrier XLA may fold encode into a following
    # decode and skip the FP8 rounding (xla_allow_excess_precision, docs/method.md "Traps").
    return lax.optimization_barrier(Payload(codes.reshape(x.shape), scale, prescale))


def decode_reference(codec: Codec, payload: Payload, dtype=jnp.float32) -> jax.Array:
    """Pure-jnp decode of a payload made by `encode_reference` (or a kernel of the same codec)."""
    codes = payload.codes
    if codec.is_identity:
        values = lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], -1, 4), jnp.float32)
        return values.astype(dtype)
    g = codec.group_size
    q = dequantize(codec, codes).reshape(-1, g)
    flat = lambda a: None if a is None else a.reshape(-1)  # noqa: E731
    unit = hadamard_unit(g) if codec.hadamard else 1.0
    d = decode_factor(codec, flat(payload.scales), flat(payload.prescales), unit)
    y = scale_rows(signed_hadamard(q) if codec.hadamard else q, d)
    return y.reshape(codes.shape).astype(dtype)


def roundtrip(codec: str | Codec, x: jax.Array, group_size: int | None = None) -> jax.Array:
    """decode(encode(x)) along the last axis, padded to a multiple of G; same shape and dtype."""
    codec = get_codec(codec, group_size)
    padded, n = pad_to_multiple(x, codec.group_size)
    return codec.decode(codec.encode(padded), x.dtype)[..., :n]


def pad_to_multiple(x: jax.Array, multiple: int) -> tuple[jax.Array, int]:
    """Zero-pads the last axis of `x` up to a multiple of `multiple`; returns (padded, old size)."""
    n = x.shape[-1]
    pad = -n % multiple
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x, n


# --------------------------------------------------------------------------------------------
# The packed-wire reference ops: what the collectives call on the XLA path, and the definitions
# the fused kernels equal (up to rounding ties). Rows [R, n] <-> wire rows [R, wire_bytes(n)].


# Jitted (codec, sizes and dtype static): called eagerly, op by op, each of their operations
# would compile on its own; inside a caller's jit they inline.
@functools.partial(jax.jit, static_argnames=("codec",))
def encode_wire(codec: Codec, x: jax.Array) -> jax.Array:
    """x[R, n] -> wire[R, codec.wire_bytes(n)]: `pack(encode_reference(x))`."""
    return pack(codec, encode_reference(codec, x))


@functools.partial(jax.jit, static_argnames=("codec", "n", "dtype"))
def decode_wire(codec: Codec, wire: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """wire[R, B] -> x[R, n] of `dtype`: `decode_reference(unpack(wire))`."""
    return decode_reference(codec, unpack(codec, wire, n), dtype)


def decode_sum_wire(codec: Codec, wire: jax.Array, n: int, dtype=jnp.float32) -> jax.Array:
    """wire[N, B] -> [n]: the fp32 sum of the N decoded rows, rounded once to `dtype`. The end of
    a reduce-scatter and of the one-shot all-reduce.

    A fixed summation order (peer 0 first) makes the sum the same on every rank and every run.
    """
    return jnp.sum(decode_wire(codec, wire, n, jnp.float32), axis=0).astype(dtype)


def decode_sum_reencode_wire(codec: Codec, wire: jax.Array, n: int) -> jax.Array:
    """wire[N, B] -> wire[B] of the encoded fp32 sum: the middle of the two-shot all-reduce."""
    return encode_wire(codec, decode_sum_wire(codec, wire, n)[None])[0]
