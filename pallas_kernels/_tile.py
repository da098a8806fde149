"""In-kernel math shared by the kernel families: one tile = T groups of G values, fp32.

Each function mirrors a stage of `taco_jax.codecs` (same constants, same order of clamps) on a
[T, G] tile held in registers, written only with ops the Triton lowering supports (no `round`,
no value slicing, `concatenate` only of [..., 1] pieces, `unstack` / `stack` only of a last axis
of size 2).

Rounding differences from the reference (all of them O(few fp32 ulp) in a pre-rounding value, so
an FP8/INT8 code can differ only where the reference value sits within that distance of a
rounding tie; the tests check exactly that):
- the Hadamard runs as a bf16 tensor-core dot of exact operands with fp32 accumulation: the +-1
  product `S x` (S = sqrt(G) H), applied to x before alpha (the reference rounds `H (alpha x)`);
- every per-group factor is folded into one multiplier per group, so each element takes one
  multiply: encode codes `Q(S x * (alpha / (sqrt(G) s)))` (the reference: `Q(H(alpha x) / s)`),
  decode `S q * (s / (sqrt(G) alpha))` (the reference: `H(q s) / alpha`);
- fp32 inputs are split exactly into three bf16 pieces (8 + 8 + 8 mantissa bits), three dots.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _pallas
from pallas_kernels.config import BlockConfig
from taco_jax import codecs
from taco_jax.codecs import Codec

# 1.5 * 2^23: adding and subtracting it rounds an fp32 |v| < 2^22 to the nearest integer, ties to
# even (IEEE add), which is jnp.round's rule; the Triton lowering has no `round`.
_ROUND_MAGIC = 12582912.0
_FLOAT8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def hadamard_block(group_size: int, cfg: BlockConfig) -> np.ndarray:
    """The +-1 Sylvester matrix of the dot block (bf16-exact), an input of every kernel."""
    return signs_matrix(min(group_size, cfg.hadamard_dot))


def signs_matrix(b: int) -> np.ndarray:
    """S_b = sqrt(b) H_b, the +-1 Sylvester matrix of order b (b <= 256), fp32."""
    i, j = np.indices((b, b))
    return (1 - 2 * _parity(i & j)).astype(np.float32)


def _parity(v):
    """popcount(v) & 1 for 0 <= v < 256 (Sylvester order: H[i, j] = (-1)^parity(i & j))."""
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    return (v ^ (v >> 1)) & 1


def sylvester_signs(b: int):
    """The same +-1 block as `hadamard_block`, built from an iota inside the kernel."""
    i = lax.broadcasted_iota(jnp.int32, (b, b), 0)
    j = lax.broadcasted_iota(jnp.int32, (b, b), 1)
    return (1 - 2 * _parity(i & j)).astype(jnp.bfloat16)


def signs(h_ref, cfg: BlockConfig):
    """The kernel's +-1 dot block: loaded from h_ref, or built in registers (cfg)."""
    return sylvester_signs(h_ref.shape[0]) if cfg.signs_in_kernel else h_ref[...]


def for_each_tile(cfg: BlockConfig, program, load, process) -> None:
    """process(tile, load(tile)) for each tile of `program` (a loop if cfg.tiles_per_program > 1).

    With cfg.prefetch the loop loads tile k + 1 before it processes tile k (a register double
    buffer): the next tile's bytes are in flight while this one does its math.
    """
    first = program * cfg.tiles_per_program
    count = cfg.tiles_per_program
    if count == 1:
        process(first, load(first))
        return
    if not cfg.prefetch:

        def step(k, carry):
            process(first + k, load(first + k))
            return carry

        lax.fori_loop(0, count, step, 0)
        return

    def prefetching_step(k, raw):
        upcoming = load(first + k + 1)
        process(first + k, raw)
        return upcoming

    last = lax.fori_loop(0, count - 1, prefetching_step, load(first))
    process(first + count - 1, last)


def _bf16_pieces(x: jnp.ndarray, exact: bool) -> list[jnp.ndarray]:
    """x == sum(pieces) exactly: one bf16 piece when x is bf16-exact, else three."""
    if exact:
        return [x.astype(jnp.bfloat16)]
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return [hi, mid, lo]


def hadamard_unit(group_size: int) -> float:
    """1 / sqrt(G): `signed_hadamard` times this is the orthonormal Hadamard H_G."""
    return 1.0 / math.sqrt(group_size)


def signed_hadamard(x, hblock, *, exact_bf16: bool, interpret: bool):
    """S_G x along the last axis of x [T, G] (fp32, or bf16 when exact_bf16) -> fp32.

    S_G = sqrt(G) H_G is the +-1 Sylvester matrix (hblock: its bf16 [b, b] dot block). Callers
    fold `hadamard_unit` into their per-group factors instead of paying a multiply per element.
    For G > b the low index bits are peeled off first (`_split_low_bit`), so the dots shrink.
    """
    if x.shape[-1] > hblock.shape[0]:
        return _split_low_bit(x, hblock, exact_bf16=exact_bf16, interpret=interpret)
    return _block_dot(x, hblock, exact_bf16=exact_bf16, interpret=interpret)


def _split_low_bit(x, hblock, **kw):
    """S_G x = (S_{G/2} (x) S_2) x on the low index bit, i = 2 i' + i1:

      y[2 j'] = S_{G/2} a + S_{G/2} b,  y[2 j' + 1] = S_{G/2} a - S_{G/2} b,

    with a, b the even and odd elements. The halves go through the dots as they are (exact bf16
    operands stay exact) and the butterfly runs after, in fp32. Splitting and interleaving pairs
    on the last axis stays inside each thread's registers (Triton's split / join)."""
    t, g = x.shape
    even, odd = lax.unstack(x.reshape(t, g // 2, 2), axis=2)
    sa = signed_hadamard(even, hblock, **kw)
    sb = signed_hadamard(odd, hblock, **kw)
    return lax.stack([sa + sb, sa - sb], axis=2).reshape(t, g)


def _block_dot(x, hblock, *, exact_bf16: bool, interpret: bool):
    """x [T, b] @ S_b on the tensor cores (fp32 accumulation of exact bf16 pieces of x).

    In interpret mode (XLA on the CPU) the product is one fp32 HIGHEST dot: XLA rewrites
    dot(hi, H) + dot(mid, H) into dot(hi + mid, H) in bf16 and drops the split's low bits.
    """
    if interpret:
        return jnp.dot(
            x.astype(jnp.float32),
            hblock.astype(jnp.float32),
            precision=lax.Precision.HIGHEST,
        )
    h = None
    for piece in _bf16_pieces(x, exact_bf16):
        part = jnp.dot(piece, hblock, preferred_element_type=jnp.float32)
        h = part if h is None else h + part
    return h


def mean_square(v: jnp.ndarray, unit: float) -> jnp.ndarray:
    """mean((v * unit)^2) per row of v [T, G]; exact scaling when unit^2 / G is a power of two
    (unit 1 or `hadamard_unit(G)`, G a power of two)."""
    g = v.shape[-1]
    return jnp.sum(v * v, axis=-1) * np.float32(unit * unit / g)


def ash_prescale(mean_sq: jnp.ndarray) -> jnp.ndarray:
    """alpha per group from the mean square of its values, as `codecs.ash_prescale`."""
    energy = jnp.maximum(mean_sq + codecs.ENERGY_EPS, codecs.ENERGY_FLOOR)
    return jnp.clip(
        codecs.QMAX["e4m3"] * lax.rsqrt(energy), codecs.PRESCALE_MIN, codecs.PRESCALE_MAX
    )


def _nan_if_nonfinite(scale, amax):
    # amax >= 0 or NaN, so `amax < inf` is isfinite(amax), in ops Mosaic GPU lowers too.
    return jnp.where(amax < jnp.inf, scale, jnp.nan)


def quantize(codec: Codec, scaled: jnp.ndarray, *, interpret: bool) -> jnp.ndarray:
    """fp32 values already divided by their scale -> uint8 codes (saturating), as the reference.

    INT8 rounds half to even: `jnp.round` in interpret mode, the magic-number add on the GPU
    (XLA on the CPU folds `(v + M) - M` back to v, so the trick is GPU-only)."""
    clipped = jnp.clip(scaled, -codec.qmax, codec.qmax)
    if codec.element == "int8":
        rounded = jnp.round(clipped) if interpret else (clipped + _ROUND_MAGIC) - _ROUND_MAGIC
        return lax.bitcast_convert_type(rounded.astype(jnp.int8), jnp.uint8)
    return lax.bitcast_convert_type(clipped.astype(_FLOAT8[codec.element]), jnp.uint8)


def dequantize(codec: Codec, codes: jnp.ndarray) -> jnp.ndarray:
    if codec.element == "int8":
        return lax.bitcast_convert_type(codes, jnp.int8).astype(jnp.float32)
    return lax.bitcast_convert_type(codes, _FLOAT8[codec.element]).astype(jnp.float32)


def e8m0_exponent(scale):
    exponent = jnp.clip(jnp.ceil(jnp.log2(scale)), -127.0, 127.0)
    return jnp.where(jnp.isnan(scale), 255.0, exponent + 127.0).astype(jnp.uint8)


def e8m0_value(biased):
    value = jnp.exp2(biased.astype(jnp.float32) - 127.0)
    return jnp.where(biased == 255, jnp.nan, value)


def encode_groups(codec: Codec, v, mean_sq, *, unit: float, interpret: bool):
    """Encodes the groups v * unit, v [T, G]: after the Hadamard (v = S x, unit = 1 / sqrt(G)),
    or the raw groups without one (unit = 1). mean_sq [T]: their mean square (ASH energy; H is
    orthonormal, so the input's serves too), None for codecs without pre-scale.

    Returns (codes uint8 [T, G], scale [T] or None, prescale [T] or None) with the reference's
    meaning: scale is fp32 s (or the uint8 E8M0 exponent of s / alpha), prescale is alpha.
    The reference's y = alpha * H x and y / s become per-group factors: amax(|y|) is
    amax(|v|) * alpha * unit (rounding is monotone), and codes take one multiply per element.
    """
    alpha = ash_prescale(mean_sq) if codec.prescale else None
    to_y = alpha * np.float32(unit) if codec.prescale else unit  # y = v * to_y
    amax = jnp.max(jnp.abs(v), axis=-1) * to_y
    if not codec.postscale:
        codes = quantize(codec, scale_rows(v, to_y), interpret=interpret)
        return codes, None, _nan_if_nonfinite(alpha, amax)
    s = jnp.clip(amax / codec.qmax, codecs.SCALE_MIN, codecs.SCALE_MAX)
    if codec.scale_format == "e8m0":
        combined = s / alpha if codec.prescale else s
        exponent = e8m0_exponent(_nan_if_nonfinite(combined, amax))
        # y / (2^e alpha) = v * unit / 2^e: alpha cancels.
        codes = quantize(codec, scale_rows(v, unit / e8m0_value(exponent)), interpret=interpret)
        return codes, exponent, None
    s = _nan_if_nonfinite(s, amax)
    return quantize(codec, scale_rows(v, to_y / s), interpret=interpret), s, alpha


def decode_factor(codec: Codec, scale, prescale, unit: float = 1.0) -> jnp.ndarray | float:
    """d [T] with decoded = S(q) * d when unit = `hadamard_unit(G)` (or q * d, unit = 1)."""
    if codec.scale_format == "e8m0":
        return e8m0_value(scale) * np.float32(unit)
    d = scale * np.float32(unit) if codec.postscale else unit
    if codec.prescale:
        d = d / prescale
    return d


def scale_rows(q, d):
    """q [T, G] times a per-group factor d [T] (or a Python float: 1.0 is nothing to do)."""
    if isinstance(d, float):
        return q if d == 1.0 else q * np.float32(d)
    return q * lax.broadcast_in_dim(d, q.shape, (0,))


# ------------------------------------------------------------------------------------------
# Wire layout in one uint8 row: [n codes][scale bytes][prescale bytes] (codecs.pack; the section
# offsets come from codecs.side_offsets).


def f32_to_bytes(v: jnp.ndarray) -> jnp.ndarray:
    """fp32 [T] -> its little-endian bytes, uint8 [4T] (as lax.bitcast_convert_type on CPU/GPU)."""
    bits = lax.bitcast_convert_type(v, jnp.uint32)
    shift = (8 * lax.broadcasted_iota(jnp.int32, (v.shape[0], 4), 1)).astype(jnp.uint32)
    return ((bits[:, None] >> shift) & 0xFF).astype(jnp.uint8).reshape(4 * v.shape[0])


def bytes_to_f32(b: jnp.ndarray) -> jnp.ndarray:
    """uint8 [4T] little-endian -> fp32 [T]."""
    t = b.shape[0] // 4
    shift = (8 * lax.broadcasted_iota(jnp.int32, (t, 4), 1)).astype(jnp.uint32)
    words = jnp.sum(b.reshape(t, 4).astype(jnp.uint32) << shift, axis=-1)
    return lax.bitcast_convert_type(words, jnp.float32)


def _mask(start, size: int, limit: int, repeat: int = 1, masked: bool = True):
    """start + k // repeat < limit for k < size; None when the caller knows it is all true.

    A 1-D iota keeps Triton's mask-constancy analysis intact (vectorized loads/stores)."""
    if not masked:
        return None
    if repeat == 1:
        return start + lax.broadcasted_iota(jnp.int32, (size,), 0) < limit
    idx = lax.broadcasted_iota(jnp.int32, (size // repeat, repeat), 0).reshape(size)
    return start + idx < limit


def load_1d(ref, row, start, size: int, limit: int, *, repeat: int = 1, masked: bool = True):
    """ref[row, start : start + size] (elements at or past `limit` read as 0).

    With repeat > 1, element k is valid when start / repeat + k // repeat < limit (byte views of
    per-group words: `start` and `limit` then count groups)."""
    mask = _mask(start // repeat, size, limit, repeat, masked)
    other = None if mask is None else 0
    return _pallas.load(ref.at[_row(row), _pallas.ds(start, size)], mask=mask, other=other)


def store_1d(ref, row, start, value, limit: int, *, repeat: int = 1, masked: bool = True):
    mask = _mask(start // repeat, value.shape[0], limit, repeat, masked)
    _pallas.store(ref.at[_row(row), _pallas.ds(start, value.shape[0])], value, mask=mask)


def store_groups(codec: Codec, ref, row, tile, n: int, cfg: BlockConfig, codes, scale, prescale):
    """Writes one tile's codes and side bytes into wire row `row` of ref [R, B]."""
    g, t = codec.group_size, cfg.groups_per_tile
    groups = n // g
    masked = cfg.masked(groups)
    store_1d(ref, row, tile * t * g, codes.reshape(t * g), n, masked=masked)
    scale_at, prescale_at = codecs.side_offsets(codec, n)
    if codec.scale_format == "e8m0":
        store_1d(ref, row, scale_at + tile * t, scale, scale_at + groups, masked=masked)
        return
    for at, value in ((scale_at, scale), (prescale_at, prescale)):
        if at is not None:
            # byte k of this section belongs to group k // 4; mask counts groups.
            mask = _mask(tile * t, 4 * t, groups, 4, masked)
            _pallas.store(
                ref.at[_row(row), _pallas.ds(at + 4 * tile * t, 4 * t)],
                f32_to_bytes(value),
                mask=mask,
            )


def load_wire_tile(codec: Codec, ref, row, tile, n: int, cfg: BlockConfig):
    """The raw bytes of one tile of wire row `row`: (codes [T*G], scale bytes, prescale bytes).

    Split from `unpack_wire_tile` so a tile loop can issue the next tile's loads early."""
    g, t = codec.group_size, cfg.groups_per_tile
    groups = n // g
    masked = cfg.masked(groups)
    codes = load_1d(ref, row, tile * t * g, t * g, n, masked=masked)
    scale_at, prescale_at = codecs.side_offsets(codec, n)
    if codec.scale_format == "e8m0":
        scale = _pallas.load(
            ref.at[_row(row), _pallas.ds(scale_at + tile * t, t)],
            mask=_mask(tile * t, t, groups, 1, masked),
            other=127 if masked else None,  # 2^0: masked groups decode to finite zeros
        )
        return codes, scale, None
    sides = []
    for at in (scale_at, prescale_at):
        if at is None:
            sides.append(None)
            continue
        sides.append(
            _pallas.load(
                ref.at[_row(row), _pallas.ds(at + 4 * tile * t, 4 * t)],
                mask=_mask(tile * t, 4 * t, groups, 4, masked),
                other=0 if masked else None,
            )
        )
    return codes, *sides


def unpack_wire_tile(codec: Codec, raw, tile, n: int, cfg: BlockConfig, unit: float = 1.0):
    """`load_wire_tile`'s bytes -> (dequantized q [T, G] fp32, `decode_factor` d [T])."""
    g, t = codec.group_size, cfg.groups_per_tile
    codes, scale, prescale = raw
    if codec.scale_format != "e8m0":
        scale = None if scale is None else bytes_to_f32(scale)
        prescale = None if prescale is None else bytes_to_f32(prescale)
        if prescale is not None and cfg.masked(n // g):
            # masked groups read alpha = 0; keep their (unstored) values finite.
            prescale = jnp.where(_mask(tile * t, t, n // g), prescale, 1.0)
    return dequantize(codec, codes.reshape(t, g)), decode_factor(codec, scale, prescale, unit)


def _row(row):
    # A Python int index breaks the interpret-mode discharge of masked loads (jax 0.11.2).
    return jnp.asarray(row, jnp.int32) if isinstance(row, int) else row
