"""Tile plumbing shared by the Triton-lowered kernel families: one tile = T groups of G values.

The codec arithmetic itself (pre-scale, post-scale, E8M0, quantize, decode factors, side bytes)
is `taco_jax.codecs`'s, called on [T, G] tiles held in registers. What is the kernels' own: the
Hadamard as tensor-core dots, tile loops, masked loads and stores of packed wire rows. All of it
is written only with ops the Triton lowering supports (no `round`, no value slicing,
`concatenate` only of [..., 1] pieces, `unstack` / `stack` only of a last axis of size 2).

Rounding differences from the reference (all of them O(few fp32 ulp) in a pre-rounding value, so
an FP8/INT8 code can differ only where the reference value sits within that distance of a
rounding tie; the tests check exactly that): the Hadamard runs as a bf16 tensor-core dot of exact
operands with fp32 accumulation (the reference: one fp32 product), and fp32 inputs are split
exactly into three bf16 pieces (8 + 8 + 8 mantissa bits), three dots.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels._pallas import pl, pltriton
from pallas_kernels.config import BlockConfig
from taco_jax import codecs
from taco_jax.codecs import Codec


def hadamard_block(group_size: int, cfg: BlockConfig) -> np.ndarray:
    """The +-1 Sylvester matrix of the dot block (bf16-exact), an input of every kernel."""
    return codecs.signs_matrix(min(group_size, cfg.hadamard_dot))


def for_each_tile(cfg: BlockConfig, program, load, process) -> None:
    """process(tile, load(tile)) for each tile of `program` (a loop over several tiles)."""
    first = program * cfg.tiles_per_program
    if cfg.tiles_per_program == 1:
        process(first, load(first))
        return

    def step(k, carry):
        process(first + k, load(first + k))
        return carry

    lax.fori_loop(0, cfg.tiles_per_program, step, 0)


def _bf16_pieces(x: jnp.ndarray, exact: bool) -> list[jnp.ndarray]:
    """x == sum(pieces) exactly: one bf16 piece when x is bf16-exact, else three."""
    if exact:
        return [x.astype(jnp.bfloat16)]
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return [hi, mid, lo]


def signed_hadamard(x, hblock, *, exact_bf16: bool, interpret: bool):
    """S_G x along the last axis of x [T, G] (fp32, or bf16 when exact_bf16) -> fp32.

    S_G = sqrt(G) H_G is the +-1 Sylvester matrix (hblock: its bf16 [b, b] dot block). Callers
    fold `codecs.hadamard_unit` into their per-group factors, not a multiply per element.
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


def _mask(start, size: int, limit: int, repeat: int = 1, masked: bool = True):
    """start + k // repeat < limit for k < size; None when the caller knows it is all true.

    A 1-D iota keeps Triton's mask-constancy analysis intact (vectorized loads/stores)."""
    if not masked:
        return None
    if repeat == 1:
        return start + lax.broadcasted_iota(jnp.int32, (size,), 0) < limit
    idx = lax.broadcasted_iota(jnp.int32, (size // repeat, repeat), 0).reshape(size)
    return start + idx < limit


def load_1d(ref, row, start, size: int, limit: int, *, offset: int = 0, masked: bool = True):
    """ref[row, offset + start : offset + start + size]; elements whose index past `offset` is
    at or past `limit` read as 0."""
    mask = _mask(start, size, limit, masked=masked)
    other = None if mask is None else 0
    return pltriton.load(ref.at[_row(row), pl.ds(offset + start, size)], mask=mask, other=other)


def store_1d(ref, row, start, value, limit: int, *, offset: int = 0, masked: bool = True):
    """ref[row, offset + start : ...] = value, but for elements whose index past `offset` is at
    or past `limit`."""
    mask = _mask(start, value.shape[0], limit, masked=masked)
    pltriton.store(ref.at[_row(row), pl.ds(offset + start, value.shape[0])], value, mask=mask)


def _plane_span(codec: Codec, plane: codecs.CodePlane, tile, t: int, n: int):
    """(start, size, limit) of one tile's bytes within `plane` of a row of `n` codes."""
    size = plane.size(t * codec.group_size)
    return tile * size, size, plane.size(n)


def store_groups(codec: Codec, ref, row, tile, n: int, cfg: BlockConfig, codes, scale, prescale):
    """Writes one tile's codes (`codecs.code_planes`) and side bytes into wire row `row` of
    ref [R, B]."""
    g, t = codec.group_size, cfg.groups_per_tile
    groups = n // g
    masked = cfg.masked(groups)
    for plane in codecs.code_planes(codec, n):
        start, _, limit = _plane_span(codec, plane, tile, t, n)
        data = codecs.plane_bytes(codes.reshape(t * g), plane)
        store_1d(ref, row, start, data, limit, offset=plane.offset, masked=masked)
    sides = {"scales": scale, "prescales": prescale}
    for section in codecs.wire_sections(codec, n):
        data = codecs.side_to_bytes(sides[section.field], section.width)
        store_side(ref, row, section.offset, section.width, tile, data, groups, masked=masked)


def store_side(ref, row, offset: int, width: int, tile, data, groups: int, *, masked: bool):
    """Stores one tile's side bytes data [width * T] into the side section at `offset` (`width`
    bytes per group) of wire row `row`; byte k belongs to group k // width, the mask counts
    groups (`groups` per row)."""
    t = data.shape[0] // width
    mask = _mask(tile * t, width * t, groups, width, masked)
    pltriton.store(ref.at[_row(row), pl.ds(offset + width * tile * t, width * t)], data, mask=mask)


def load_side(
    ref, row, offset: int, width: int, tile, t: int, groups: int, *, masked: bool, other: int = 0
):
    """One tile's side bytes [width * T] of the section at `offset` (as `store_side`); bytes
    past the row read as `other`."""
    return pltriton.load(
        ref.at[_row(row), pl.ds(offset + width * tile * t, width * t)],
        mask=_mask(tile * t, width * t, groups, width, masked),
        other=other if masked else None,
    )


def load_wire_tile(codec: Codec, ref, row, tile, n: int, cfg: BlockConfig):
    """The raw bytes of one tile of wire row `row`: ([bytes of each `codecs.code_planes`],
    {field: side bytes}); arrays only, so a tile loop can carry them.

    Split from `unpack_wire_tile` so a tile loop can issue the next tile's loads early."""
    g, t = codec.group_size, cfg.groups_per_tile
    groups = n // g
    masked = cfg.masked(groups)
    codes = []
    for plane in codecs.code_planes(codec, n):
        start, size, limit = _plane_span(codec, plane, tile, t, n)
        codes.append(load_1d(ref, row, start, size, limit, offset=plane.offset, masked=masked))
    sides = {}
    for section in codecs.wire_sections(codec, n):
        sides[section.field] = load_side(
            ref,
            row,
            section.offset,
            section.width,
            tile,
            t,
            groups,
            masked=masked,
            other=_masked_side_byte(section),
        )
    return codes, sides


def _masked_side_byte(section: codecs.WireSection) -> int:
    """What a side byte past the row reads as: for an E8M0 exponent the bias (2^0), so those
    groups decode to finite zeros; for fp32 bytes 0 (scale 0, alpha 0, which
    `unpack_wire_tile` replaces)."""
    return int(codecs.E8M0_BIAS) if section.width == 1 else 0


def unpack_wire_tile(codec: Codec, raw, tile, n: int, cfg: BlockConfig, unit: float = 1.0):
    """`load_wire_tile`'s bytes -> (dequantized q [T, G] fp32, `codecs.decode_factor` d [T])."""
    g, t = codec.group_size, cfg.groups_per_tile
    codes, side_bytes = raw
    widths = dict(codec.side_fields)
    sides = {f: codecs.side_from_bytes(b, widths[f]) for f, b in side_bytes.items()}
    prescale = sides.get("prescales")
    if prescale is not None and cfg.masked(n // g):
        # masked groups read alpha = 0; keep their (unstored) values finite.
        prescale = jnp.where(_mask(tile * t, t, n // g), prescale, 1.0)
    planes = list(zip(codecs.code_planes(codec, n), codes, strict=True))
    q = codecs.dequantize(codec, codecs.codes_from_planes(planes).reshape(t, g))
    return q, codecs.decode_factor(codec, sides.get("scales"), prescale, unit)


def _row(row):
    # A Python int index breaks the interpret-mode discharge of masked loads (jax 0.11.2).
    return jnp.asarray(row, jnp.int32) if isinstance(row, int) else row
