"""Group-wise codecs for tensor-parallel traffic: ASH + DS FP8 (TACO), its ablations, INT8.

A codec turns the last axis of an array into a `Payload` of uint8 codes plus per-group side
scales, and back. Every codec here is a composition of four optional stages applied to each
contiguous group of `group_size` (G) values, all in fp32 (TACO.md section 2):

1. ASH pre-scale:  alpha = clamp(448 * rsqrt(max(mean(x^2) + 1e-6, 1e-12)), 1e-3, 1e3); x <- alpha x
2. Hadamard:       y = H_G x / sqrt(G)   (Sylvester order, orthonormal, self-inverse)
3. DS post-scale:  s = clamp(max|y| / qmax, 1e-12, 1e6)
4. quantize:       q = round(clamp(y / s, -qmax, qmax)) in E4M3 / E5M2 / INT8

Decode runs the stages backwards: x = H_G (q s) / sqrt(G) / alpha.

Codes are stored as uint8 (a bitcast), never as float8: XLA on CPU moves float8 collectives as
f16, and XLA may drop an f32 -> f8 -> f32 round trip inside one fusion (TACO.md section 6).

Non-finite input is never hidden: a group holding NaN or Inf gets a NaN scale, so the whole group
decodes to NaN and the training loop sees the divergence (the reference CUDA code maps NaN/Inf to
0 instead).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ElementFormat = Literal["e4m3", "e5m2", "int8", "raw"]
ScaleFormat = Literal["fp32", "e8m0"]

ALLOWED_GROUP_SIZES = (32, 64, 128, 256, 512)
DEFAULT_GROUP_SIZE = 128

# ASH constants, TACO.md section 2 step 1-2 (taco.cu): energy epsilon, energy floor, alpha clamp.
ENERGY_EPS = 1e-6
ENERGY_FLOOR = 1e-12
PRESCALE_MIN, PRESCALE_MAX = 1e-3, 1e3
# DS clamp, TACO.md section 2 step 4.
SCALE_MIN, SCALE_MAX = 1e-12, 1e6

_FLOAT8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
# Largest finite magnitude of each element format; the target of the post-scale.
QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["codes", "scales", "prescales"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class Payload:
    """An encoded array: `codec.decode(payload) ~= x` for `payload = codec.encode(x)`.

    Invariant: `codes.shape == x.shape` (uint8, one byte per element) and every scale array has
    shape `x.shape[:-1] + (x.shape[-1] // group_size,)`. `scales` holds the DS post-scale (fp32,
    or uint8 E8M0 exponents for compact codecs, where it is the whole per-group scale);
    `prescales` holds the ASH pre-scale alpha (fp32) or is None when the codec stores none.
    """

    codes: jax.Array
    scales: jax.Array | None
    prescales: jax.Array | None


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
        if self.element == "int8" and not self.postscale:
            raise ValueError(f"element='int8' needs a post-scale; codec {self.name!r} has none")

    @property
    def is_identity(self) -> bool:
        return self.element == "raw"

    @property
    def qmax(self) -> float:
        return QMAX[self.element]

    @property
    def side_bytes_per_group(self) -> int:
        """Bytes of scales stored per group on the wire."""
        if self.is_identity:
            return 0
        if self.scale_format == "e8m0":
            return 1  # the product s / alpha as one power-of-two exponent byte
        return 4 * (int(self.prescale) + int(self.postscale))

    @property
    def bits_per_element(self) -> float:
        """Wire bits per encoded element (8 + 8 * side bytes / G; 8.5 for `taco` at G=128)."""
        if self.is_identity:
            return 32.0  # `none` moves the fp32 value itself
        return 8.0 + 8.0 * self.side_bytes_per_group / self.group_size

    def wire_bytes(self, n: int) -> int:
        """Bytes of one packed chunk of `n` elements (`n` a multiple of G)."""
        if self.is_identity:
            return 4 * n
        return n + self.side_bytes_per_group * (n // self.group_size)

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
    # Identity: collectives with this codec are the plain lax collectives.
    "none": dict(element="raw"),
}
CODEC_NAMES = tuple(_CODECS)


def validate_group_size(group_size: int) -> None:
    if group_size not in ALLOWED_GROUP_SIZES:
        raise ValueError(f"{group_size=} must be a power of two in {ALLOWED_GROUP_SIZES}")


def get_codec(codec: str | Codec, group_size: int = DEFAULT_GROUP_SIZE) -> Codec:
    """Returns the codec named `codec` (one of `CODEC_NAMES`), or `codec` itself if a `Codec`."""
    if isinstance(codec, Codec):
        return codec
    if codec not in _CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {CODEC_NAMES}")
    return Codec(name=codec, group_size=group_size, **_CODECS[codec])


@functools.cache
def hadamard_matrix(group_size: int) -> np.ndarray:
    """The normalized Sylvester Walsh-Hadamard matrix H_G / sqrt(G) (symmetric, H @ H = I)."""
    validate_group_size(group_size)
    index = np.arange(group_size)
    parity = np.bitwise_count(index[:, None] & index[None, :]) & 1
    return (1.0 - 2.0 * parity).astype(np.float32) / np.float32(np.sqrt(group_size))


def hadamard_transform(x: jax.Array, group_size: int) -> jax.Array:
    """Applies H_G / sqrt(G) to each group of G along the last axis (fp32, exact products)."""
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    # Entries are +-2^-k/2 or +-1/sqrt(G); HIGHEST keeps the fp32 sums out of TF32/bf16 passes.
    y = jnp.einsum(
        "...gi,ij->...gj",
        groups,
        jnp.asarray(hadamard_matrix(group_size)),
        precision=lax.Precision.HIGHEST,
    )
    return y.reshape(x.shape)


def _check_encodable(codec: Codec, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"codec {codec.name!r} encodes floating arrays, got dtype={x.dtype}")
    if x.ndim == 0 or x.shape[-1] % codec.group_size:
        raise ValueError(
            f"last dim of shape={x.shape} is not a multiple of "
            f"group_size={codec.group_size}; pad it first (see pad_to_multiple)"
        )


def _grouped(x: jax.Array, group_size: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def ash_prescale(groups: jax.Array) -> jax.Array:
    """alpha per group: scales each group to RMS 448 (the E4M3 maximum), clamped (TACO.md s2)."""
    energy = jnp.maximum(jnp.mean(groups * groups, axis=-1) + ENERGY_EPS, ENERGY_FLOOR)
    return jnp.clip(QMAX["e4m3"] * lax.rsqrt(energy), PRESCALE_MIN, PRESCALE_MAX)


def _nan_if_nonfinite(scale: jax.Array, amax: jax.Array) -> jax.Array:
    # Clamps would turn an Inf absmax into a finite scale; keep non-finite groups visible.
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan)


def e8m0_exponent(scale: jax.Array) -> jax.Array:
    """Smallest power-of-two exponent e with 2^e >= scale, biased by 127 into a uint8 (OCP E8M0).

    Rounding up keeps |y / 2^e| <= qmax, so the codes never saturate. NaN maps to 0xFF (E8M0 NaN).
    """
    exponent = jnp.clip(jnp.ceil(jnp.log2(scale)), -127, 127)
    biased = jnp.where(jnp.isnan(scale), 255, exponent + 127)
    return biased.astype(jnp.uint8)


def e8m0_value(biased: jax.Array) -> jax.Array:
    """fp32 value of E8M0 exponent bytes (0xFF is NaN)."""
    value = jnp.exp2(biased.astype(jnp.float32) - 127.0)
    return jnp.where(biased == 255, jnp.nan, value)


def _quantize(codec: Codec, scaled: jax.Array) -> jax.Array:
    """Rounds fp32 values (already divided by their scale) to uint8 codes, saturating."""
    clipped = jnp.clip(scaled, -codec.qmax, codec.qmax)
    if codec.element == "int8":
        return lax.bitcast_convert_type(jnp.round(clipped).astype(jnp.int8), jnp.uint8)
    return lax.bitcast_convert_type(clipped.astype(_FLOAT8_DTYPES[codec.element]), jnp.uint8)


def _dequantize(codec: Codec, codes: jax.Array) -> jax.Array:
    if codec.element == "int8":
        return lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.float32)
    return lax.bitcast_convert_type(codes, _FLOAT8_DTYPES[codec.element]).astype(jnp.float32)


def encode_reference(codec: Codec, x: jax.Array) -> Payload:
    """Pure-jnp encode of the last axis of `x`; the definition every kernel is tested against."""
    _check_encodable(codec, x)
    if codec.is_identity:
        return Payload(
            lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint8).reshape(
                *x.shape[:-1], 4 * x.shape[-1]
            ),
            None,
            None,
        )
    g = codec.group_size
    groups = _grouped(x.astype(jnp.float32), g)  # [..., n/G, G]
    alpha = ash_prescale(groups) if codec.prescale else None
    y = groups * alpha[..., None] if codec.prescale else groups
    if codec.hadamard:
        y = hadamard_transform(y, g)
    amax = jnp.max(jnp.abs(y), axis=-1)  # NaN propagates; Inf stays Inf
    scales = prescales = None
    if not codec.postscale:
        # w/o DS: a NaN pre-scale marks a non-finite group (no other scale is stored).
        prescales = _nan_if_nonfinite(alpha, amax)
        codes = _quantize(codec, y)
    elif codec.scale_format == "e8m0":
        s = jnp.clip(amax / codec.qmax, SCALE_MIN, SCALE_MAX)
        combined = s / alpha if codec.prescale else s
        scales = e8m0_exponent(_nan_if_nonfinite(combined, amax))
        divisor = e8m0_value(scales) * (alpha if codec.prescale else 1.0)
        codes = _quantize(codec, y / divisor[..., None])
    else:
        s = _nan_if_nonfinite(jnp.clip(amax / codec.qmax, SCALE_MIN, SCALE_MAX), amax)
        scales, prescales = s, alpha
        codes = _quantize(codec, y / s[..., None])
    codes = codes.reshape(x.shape)
    # The payload is a real boundary: without the barrier XLA may fold encode into a following
    # decode and skip the FP8 rounding (xla_allow_excess_precision, TACO.md section 6).
    return lax.optimization_barrier(Payload(codes, scales, prescales))


def decode_reference(codec: Codec, payload: Payload, dtype=jnp.float32) -> jax.Array:
    """Pure-jnp decode of a payload made by `encode_reference` (or a kernel of the same codec)."""
    codes = payload.codes
    if codec.is_identity:
        values = lax.bitcast_convert_type(codes.reshape(*codes.shape[:-1], -1, 4), jnp.float32)
        return values.astype(dtype)
    g = codec.group_size
    y = _grouped(_dequantize(codec, codes), g)
    if codec.scale_format == "e8m0":
        y = y * e8m0_value(payload.scales)[..., None]
        # The stored exponent already holds s / alpha; the Hadamard is linear, so apply it last.
        if codec.hadamard:
            y = hadamard_transform(y.reshape(codes.shape), g).reshape(y.shape)
        return y.reshape(codes.shape).astype(dtype)
    if codec.postscale:
        y = y * payload.scales[..., None]
    if codec.hadamard:
        y = _grouped(hadamard_transform(y.reshape(codes.shape), g), g)
    if codec.prescale:
        y = y / payload.prescales[..., None]
    return y.reshape(codes.shape).astype(dtype)


def roundtrip(codec: str | Codec, x: jax.Array, group_size: int = DEFAULT_GROUP_SIZE) -> jax.Array:
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
# Wire format: one uint8 buffer per chunk, [n codes][scale bytes][prescale bytes] (TACO.md s2.6).


def _scale_bytes(scale: jax.Array) -> jax.Array:
    if scale.dtype == jnp.uint8:
        return scale
    return lax.bitcast_convert_type(scale, jnp.uint8).reshape(*scale.shape[:-1], -1)


def _scale_from_bytes(data: jax.Array, groups: int, dtype) -> jax.Array:
    if dtype == jnp.uint8:
        return data
    return lax.bitcast_convert_type(data.reshape(*data.shape[:-1], groups, 4), dtype)


def pack(codec: Codec, payload: Payload) -> jax.Array:
    """Concatenates codes and scale bytes along the last axis: uint8[..., wire_bytes(n)]."""
    parts = [payload.codes] + [
        _scale_bytes(s) for s in (payload.scales, payload.prescales) if s is not None
    ]
    return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def side_offsets(codec: Codec, n: int) -> tuple[int | None, int | None]:
    """Byte offsets of the scale and pre-scale sections in a packed row of `n` codes.

    The row is `[n codes][scale bytes][pre-scale bytes]` (`pack`); None: the section is not
    stored. E8M0 scales take one byte per group, fp32 ones four. The kernels write and read the
    same offsets.
    """
    if codec.is_identity:
        return None, None
    if codec.scale_format == "e8m0":
        return n, None
    groups = n // codec.group_size
    scale_at = n if codec.postscale else None
    prescale_at = n + 4 * groups * int(codec.postscale) if codec.prescale else None
    return scale_at, prescale_at


def unpack(codec: Codec, wire: jax.Array, n: int) -> Payload:
    """Inverse of `pack` for chunks of `n` elements."""
    if codec.is_identity:
        return Payload(wire, None, None)
    groups = n // codec.group_size
    scale_at, prescale_at = side_offsets(codec, n)
    if codec.scale_format == "e8m0":
        return Payload(wire[..., :n], wire[..., scale_at : scale_at + groups], None)

    def fp32_section(at):
        if at is None:
            return None
        return _scale_from_bytes(wire[..., at : at + 4 * groups], groups, jnp.float32)

    return Payload(wire[..., :n], fp32_section(scale_at), fp32_section(prescale_at))
