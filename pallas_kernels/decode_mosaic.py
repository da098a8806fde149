"""Decode, decode-sum and decode-sum-reencode on Hopper through Mosaic GPU, G = 128.

The same functions as the Triton `decode_kernel.decode` and `decode_sum_kernel` (and so as
`codecs.decode_wire`, `codecs.decode_sum_wire`, `codecs.decode_sum_reencode_wire`, up to fp32
rounding; re-encoded codes up to rounding ties), for the codecs `encode_mosaic` takes.

A decode is S q x d per group (S the +-1 Sylvester matrix, d the group's factor
`codecs.decode_factor`). TMA loads a tile of 64 groups of FP8 codes into swizzled shared
memory; they go into registers as fp16 (which holds every E4M3 and E5M2 value) and one
64 x 128 x 128 fp16 wgmma multiplies them by S, accumulating exactly in fp32. Not an FP8
wgmma: Hopper's keeps only about 14 bits of its running sums (DeepSeek-V3, arXiv:2412.19437,
section 3.3.2), which would err by ~2^-13 over 128 terms.

Two ways to sum N peers' rows (the registry picks by N):
- every peer's tile in one pipeline step (`decode_sum`, `decode_sum_reencode`): each peer
  through its own Hadamard, the decoded tiles summed in peer order;
- one peer's tile a step (`peer_steps=True`): the sum carried in registers across a tile's N
  steps, in the Hadamard domain (H is linear and orthonormal, so sum_p H(q_p d_p) =
  H(sum_p q_p d_p)), and one Hadamard of the fp32 sum at the end, as three bf16 pieces; a step
  holds one tile whatever N, so more steps fit in flight.
The re-encode needs no Hadamard at all (H H = I: the sum is re-encoded where it is), so it sums
and encodes the tiles in the layout of their 8-bit loads, with no shuffle into the wgmma
layout. Peers are summed in the fixed order 0..N-1, so every rank computes the same bytes.

The wire row is read through views XLA makes without a copy (bitcasts of the uint8 row): the
codes as [W / 128, 128] of their FP8 type, the fp32 side sections as [W / 4] fp32, each
tile's side values one block. Outputs are stored by the kernel itself, not by the pipeline
(whose predicated stores Mosaic GPU's CPU interpreter cannot run), so that CI runs these
kernels too; the interpreter reads wgmma operands from refs only, so there register operands
go through shared-memory tiles (`staged`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _pallas, encode_mosaic
from pallas_kernels._pallas import pl, plgpu
from pallas_kernels.encode_mosaic import (
    FP8_CODES,
    GROUP_SIZE,
    ROW_BYTES,
    TILE_GROUPS,
    MosaicConfig,
)
from taco_jax import codecs
from taco_jax.codecs import Codec

OUT_DTYPES = (jnp.float32, jnp.bfloat16)
ACCUMULATOR = plgpu.Layout.WGMMA
NARROW_LOAD = plgpu.Layout.WGMMA_UPCAST_2X  # 8-bit loads: one warp shuffle from ACCUMULATOR

# Shared memory a program may take (Hopper allows 227 KiB a block; some is Mosaic's own), and
# what each of two programs sharing an SM may take: (228 KiB - 2 x 1 KiB reserved) / 2, less
# Mosaic's own 0.5 KiB.
SMEM_BUDGET_BYTES = 200 << 10
TWO_PROGRAMS_SMEM_BYTES = (113 << 10) - 512
MAX_TILES_PER_PROGRAM = 16
MIN_PROGRAMS = 256
# Steps in flight, at most: every peer's tile a step / one peer's tile a step (decode-sum,
# re-encode). Records: kernels-2026-12-02-register-operands.json,
# launch_sweep-2026-12-04-decode_sum-p8-widened.json (docs/decisions/006).
MAX_STEPS_IN_FLIGHT = 3
MAX_PEER_STEPS_IN_FLIGHT = {"decode_sum": 4, "decode_sum_reencode": 8}


def decode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret=False,
    config: MosaicConfig | None = None,
) -> jax.Array:
    """wire[R, codec.wire_bytes(n)] -> x[R, n] of `dtype` (ValueError where the kernels cannot
    take it). interpret: Mosaic GPU's CPU interpreter. config: default `default_config`."""
    _check(codec, wire, n, dtype)
    return _decoded_rows(codec, wire, n, dtype, interpret, config, summed=False)


def decode_sum(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    peer_steps=False,
    interpret=False,
    config: MosaicConfig | None = None,
) -> jax.Array:
    """wire[N, B] -> [n] of `dtype`: the fp32 sum of the N decoded rows, in peer order, rounded
    once to `dtype` (as `decode`); peer_steps: one peer's tile a pipeline step."""
    _check(codec, wire, n, dtype)
    if peer_steps:
        return _peer_steps(codec, wire, n, dtype, interpret, config)
    return _decoded_rows(codec, wire, n, dtype, interpret, config, summed=True).reshape(n)


def decode_sum_reencode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    *,
    peer_steps=False,
    interpret=False,
    config: MosaicConfig | None = None,
) -> jax.Array:
    """wire[N, B] -> wire[B] holding encode(sum of the N decoded rows) (as `decode_sum`)."""
    _check(codec, wire, n, None)
    if peer_steps:
        return _peer_steps(codec, wire, n, None, interpret, config)
    tiles = n // (TILE_GROUPS * GROUP_SIZE)
    scratch_of = lambda c: encode_mosaic.encode_scratch(c.store_slots, interpret)[2:]  # noqa: E731
    config = config or default_config(tiles, scratch_of, _step_bytes(codec, n, wire.shape[0]))
    config.check_row(tiles)
    _check_fits(scratch_of(config), _step_bytes(codec, n, wire.shape[0]), config)
    body = functools.partial(_reencode_body, codec=codec, n=n, config=config, interpret=interpret)
    wire_rows = codec.wire_bytes(n) // ROW_BYTES
    out = _pallas.mosaic_kernel(
        body,
        *_wire_views(codec, wire),
        out_shape=jax.ShapeDtypeStruct((wire_rows, ROW_BYTES), jnp.uint8),
        scratch=scratch_of(config),
        grid=(tiles // config.tiles_per_program,),
        grid_names=("program",),
        name=f"taco_decode_sum_reencode_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return out.reshape(wire_rows * ROW_BYTES)


def default_config(
    tiles_per_row: int,
    scratch_of,
    step_bytes: int,
    *,
    rows: int = 1,
    steps_cap: int = MAX_STEPS_IN_FLIGHT,
    steps_per_tile: int = 1,
    store_slots: int = 2,
    two_programs: bool = False,
) -> MosaicConfig:
    """The most tiles a program (at most 16, dividing a row) that leave >= MIN_PROGRAMS
    programs over `rows` rows, with `store_slots` output slots and as many steps in flight,
    each of `step_bytes`, as fit beside the kernel's own shared memory (`scratch_of` the
    config): at most `steps_cap` and the program's steps; with `two_programs`, as leave room
    for two programs an SM."""
    t = MAX_TILES_PER_PROGRAM
    while t > 1 and (tiles_per_row % t or rows * tiles_per_row // t < MIN_PROGRAMS):
        t //= 2
    fixed = _pallas.smem_bytes(scratch_of(MosaicConfig(t, 1, store_slots)))
    budget = TWO_PROGRAMS_SMEM_BYTES if two_programs else SMEM_BUDGET_BYTES
    steps = min(steps_cap, t * steps_per_tile, max(1, (budget - fixed) // step_bytes))
    return MosaicConfig(t, steps, store_slots)


def _check_fits(scratch, step_bytes: int, config: MosaicConfig) -> None:
    used = _pallas.smem_bytes(scratch) + config.steps_in_flight * step_bytes
    if used > SMEM_BUDGET_BYTES:
        raise ValueError(
            f"{config} takes {used} bytes of shared memory, more than the "
            f"{SMEM_BUDGET_BYTES} a program may take"
        )


def _check(codec, wire, n, dtype):
    reason = encode_mosaic.unsupported(codec, n)
    if reason is not None:
        raise ValueError(f"the Mosaic GPU decode cannot take {reason}")
    if wire.ndim != 2 or wire.shape[1] != codec.wire_bytes(n) or wire.dtype != jnp.uint8:
        raise ValueError(
            f"wire shape={wire.shape} dtype={wire.dtype} is not "
            f"uint8[R, {codec.wire_bytes(n)}] for {n=} and codec {codec.name!r}"
        )
    if dtype is not None and jnp.dtype(dtype) not in OUT_DTYPES:
        raise ValueError(f"the Mosaic GPU decode writes float32 or bfloat16, not {dtype=}")


def _step_bytes(codec: Codec, n: int, peers: int) -> int:
    """Shared memory of one pipeline step: `peers` tiles of codes and their side values."""
    side_bytes = sum(TILE_GROUPS * s.width for s in codecs.wire_sections(codec, n))
    return peers * (TILE_GROUPS * GROUP_SIZE + side_bytes)


def _wire_views(codec: Codec, wire: jax.Array) -> tuple[jax.Array, ...]:
    """The wire rows [R, W] as the kernels read them (bitcasts, no copies): the codes as
    [R, W / 128, 128] of their FP8 type, then each fp32 side section's view [R, W / 4]."""
    rows, width = wire.shape
    codes = lax.bitcast_convert_type(wire, FP8_CODES[codec.element])
    words = lax.bitcast_convert_type(wire.reshape(rows, width // 4, 4), jnp.float32)
    return (codes.reshape(rows, width // ROW_BYTES, ROW_BYTES),) + (words,) * len(codec.side_fields)


def _tile_specs(codec: Codec, n: int, first, peers: int) -> list:
    """Pipeline blocks of one tile: per peer its codes (swizzled for wgmma), then each side
    section's 64 values; `first` is the program's first tile."""
    dtype = FP8_CODES[codec.element]
    codes = plgpu.BlockSpec(
        (TILE_GROUPS, GROUP_SIZE), lambda i: (first + i, 0), transforms=_pallas.swizzled(dtype)
    )
    starts = [s.offset // s.width // TILE_GROUPS for s in codecs.wire_sections(codec, n)]
    sides = [plgpu.BlockSpec((TILE_GROUPS,), lambda i, s=s: (s + first + i,)) for s in starts]
    return [codes, *sides] * peers


def _signs_scratch(dtype, staged: bool, staging_shape) -> list:
    """The +-1 matrix in `dtype` and its load barrier and, `staged` (the interpreter), a tile
    of `staging_shape` that register operands of the dot go through."""
    refs = [encode_mosaic.signs_smem(dtype), plgpu.Barrier(num_barriers=1)]
    if staged:
        refs.append(plgpu.SMEM(staging_shape, dtype, transforms=_pallas.swizzled(dtype)))
    return refs


def staged(value, smem_ref):
    """`value` written to `smem_ref` and committed, so that the tensor cores may read it."""
    smem_ref[...] = value
    plgpu.commit_smem()
    return smem_ref


def _decoded(code_smem, side_smems, sections, codec, signs=None, staging=None, widened=False):
    """One peer's tile times its decode factor, fp32: the Hadamard of its codes (a wgmma by the
    fp16 signs `signs`), or with `widened` the codes themselves in the layout of their 8-bit
    load (the sums of the Hadamard domain)."""
    if widened:
        layout = NARROW_LOAD
        v = plgpu.load(code_smem, layout=NARROW_LOAD).astype(jnp.float32)
    else:
        layout = ACCUMULATOR
        a = plgpu.load(code_smem, layout=NARROW_LOAD).astype(jnp.float16)
        a = plgpu.layout_cast(a, ACCUMULATOR)
        if staging is not None:
            a = staged(a, staging)
        v = _pallas.wgmma(a, signs, (TILE_GROUPS, GROUP_SIZE))
    sides = {
        s.field: plgpu.load(r, layout=layout.reduce(1))
        for s, r in zip(sections, side_smems, strict=True)
    }
    unit = 1.0 if widened else codecs.hadamard_unit(GROUP_SIZE)
    d = codecs.decode_factor(codec, sides.get("scales"), sides.get("prescales"), unit)
    return codecs.scale_rows(v, d)


def _peer_sum(codec, n, blocks, **decode):
    """The sum, in peer order, of the decoded tiles of `blocks` (`_tile_specs` order)."""
    sections = codecs.wire_sections(codec, n)
    per_peer = 1 + len(sections)
    total = None
    for p in range(len(blocks) // per_peer):
        code_smem, *side_smems = blocks[p * per_peer : (p + 1) * per_peer]
        x = _decoded(code_smem, side_smems, sections, codec, **decode)
        total = x if total is None else total + x
    return total


def _pipeline(body, specs, config, steps, views, init_carry=None):
    plgpu.emit_pipeline(
        body,
        grid=steps,
        in_specs=specs,
        out_specs=[],
        max_concurrent_steps=config.steps_in_flight,
        init_carry=init_carry,
    )(*views)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _store_decoded(out_smem, destination, tile, x):
    """TMA-stores one decoded tile through the slots of `out_smem` (slot = tile mod S; waiting
    until at most S - 1 stores are pending frees the slot of S tiles ago)."""
    slots = out_smem.shape[0]
    slot = lax.rem(tile, slots)
    plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
    out_smem[slot] = x.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[slot], destination)


# ------------------------------------------------------------------------------------------
# Every peer's tile in one pipeline step: the decode (one peer) and the sums of two.


def _decoded_rows(codec, wire, n, dtype, interpret, config, *, summed):
    """The decode (rows [R, n]) or, `summed`, the decode-sum ([1, n]) kernel's launch. The
    decode-sum of two peers stores a tile once a step of both peers' tiles, so one output slot
    serves it, and two programs of one slot share an SM (record:
    launch_sweep-2026-12-04-decode_sum-p2-sizes.json, docs/decisions/006)."""
    rows, tiles = wire.shape[0], n // (TILE_GROUPS * GROUP_SIZE)
    out_rows, peers = (1, rows) if summed else (rows, 1)

    def scratch_of(c):
        staging = (TILE_GROUPS, GROUP_SIZE)
        return [
            *_signs_scratch(jnp.float16, interpret, staging),
            plgpu.SMEM((c.store_slots, TILE_GROUPS, GROUP_SIZE), dtype),
        ]

    step = _step_bytes(codec, n, peers)
    pair = summed and peers == 2
    config = config or default_config(
        tiles, scratch_of, step, rows=out_rows, store_slots=1 if pair else 2, two_programs=pair
    )
    config.check_row(tiles)
    _check_fits(scratch_of(config), step, config)
    body = functools.partial(_rows_body, codec=codec, n=n, config=config, summed=summed)
    out = _pallas.mosaic_kernel(
        body,
        *_wire_views(codec, wire),
        _signs(jnp.float16),
        out_shape=jax.ShapeDtypeStruct((out_rows, n // GROUP_SIZE, GROUP_SIZE), dtype),
        scratch=scratch_of(config),
        grid=(out_rows, tiles // config.tiles_per_program),
        grid_names=("row", "program"),
        name=f"taco_{'decode_sum' if summed else 'decode'}_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return out.reshape(out_rows, n)


def _signs(dtype):
    return jnp.asarray(codecs.signs_matrix(GROUP_SIZE), dtype)


def _rows_body(*refs, codec, n, config, summed):
    """One program: `config.tiles_per_program` consecutive tiles of one row (decode) or of the
    sum of all rows (decode-sum), stored into the output row."""
    views = refs[: 1 + len(codec.side_fields)]  # `_wire_views`
    signs_gmem, out_gmem, signs, barrier, *staging, out_smem = refs[len(views) :]
    encode_mosaic.copy_in(signs_gmem, signs, barrier)
    row = None if summed else lax.axis_index("row")
    peers = views[0].shape[0] if summed else 1
    first = lax.axis_index("program") * config.tiles_per_program
    out = out_gmem.at[0 if summed else row]

    def step(index, *blocks):
        (i,) = index
        total = _peer_sum(codec, n, blocks, signs=signs, staging=staging[0] if staging else None)
        _store_decoded(
            out_smem, out.at[pl.ds(TILE_GROUPS * (first + i), TILE_GROUPS)], first + i, total
        )

    peer_views = (
        [v.at[p] for p in range(peers) for v in views] if summed else [v.at[row] for v in views]
    )
    _pipeline(
        step, _tile_specs(codec, n, first, peers), config, (config.tiles_per_program,), peer_views
    )


def _reencode_body(*refs, codec, n, config, interpret):
    """One program: the sum of the N peers' tiles, in the Hadamard domain, re-encoded and
    stored into the wire row as `encode_mosaic` stores."""
    *views, out_gmem, codes_smem, sides = refs
    first = lax.axis_index("program") * config.tiles_per_program
    layout = encode_mosaic.WireLayout.of(codec, n)
    peers = views[0].shape[0]

    def step(index, *blocks):
        (i,) = index
        z = _peer_sum(codec, n, blocks, widened=True)
        encode_mosaic.encode_and_store(
            codec, z, 1.0, (codes_smem, sides), [out_gmem], first + i, layout, interpret
        )

    peer_views = [v.at[p] for p in range(peers) for v in views]
    _pipeline(
        step, _tile_specs(codec, n, first, peers), config, (config.tiles_per_program,), peer_views
    )


# ------------------------------------------------------------------------------------------
# Peer steps: one peer's tile per pipeline step, the sum carried in registers across a tile's
# N steps; a tile costs N register loads plus, for the decode-sum, one Hadamard of the sum.


def _peer_steps(codec, wire, n, dtype, interpret, config):
    """decode_sum (dtype given) or decode_sum_reencode (dtype None) with peer steps. A tile is
    stored once every N steps, so one output slot serves it."""
    peers, tiles = wire.shape[0], n // (TILE_GROUPS * GROUP_SIZE)
    reencode = dtype is None
    op = "decode_sum_reencode" if reencode else "decode_sum"

    def scratch_of(c):
        if reencode:
            return encode_mosaic.encode_scratch(c.store_slots, interpret)[2:]
        staging = (3, TILE_GROUPS, GROUP_SIZE)  # the sum's three bf16 pieces
        return [
            *_signs_scratch(jnp.bfloat16, interpret, staging),
            plgpu.SMEM((c.store_slots, TILE_GROUPS, GROUP_SIZE), dtype),
        ]

    step = _step_bytes(codec, n, peers=1)
    config = config or default_config(
        tiles,
        scratch_of,
        step,
        steps_per_tile=peers,
        steps_cap=MAX_PEER_STEPS_IN_FLIGHT[op],
        store_slots=1,
    )
    config.check_row(tiles)
    _check_fits(scratch_of(config), step, config)
    if reencode:
        out_shape = jax.ShapeDtypeStruct((codec.wire_bytes(n) // ROW_BYTES, ROW_BYTES), jnp.uint8)
        operands = ()
    else:
        out_shape = jax.ShapeDtypeStruct((n // GROUP_SIZE, GROUP_SIZE), dtype)
        operands = (_signs(jnp.bfloat16),)
    body = functools.partial(
        _peer_steps_body,
        codec=codec,
        n=n,
        config=config,
        peers=peers,
        reencode=reencode,
        interpret=interpret,
    )
    out = _pallas.mosaic_kernel(
        body,
        *_wire_views(codec, wire),
        *operands,
        out_shape=out_shape,
        scratch=scratch_of(config),
        grid=(tiles // config.tiles_per_program,),
        grid_names=("program",),
        name=f"taco_{op}_peer_steps_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return out.reshape(-1)


def _peer_step_specs(codec: Codec, n: int, first) -> list:
    """Pipeline blocks of step (i, p): peer p's codes of tile first + i, then its 64 values of
    each side section."""
    dtype = FP8_CODES[codec.element]
    codes = plgpu.BlockSpec(
        (None, TILE_GROUPS, GROUP_SIZE),
        lambda i, p: (p, first + i, 0),
        transforms=_pallas.swizzled(dtype),
    )
    starts = [s.offset // s.width // TILE_GROUPS for s in codecs.wire_sections(codec, n)]
    sides = [
        plgpu.BlockSpec((None, TILE_GROUPS), lambda i, p, s=s: (p, s + first + i)) for s in starts
    ]
    return [codes, *sides]


def _peer_steps_body(*refs, codec, n, config, peers, reencode, interpret):
    """One program: per tile, z = sum_p q_p d_p over the N peers' steps (in registers), then on
    the last peer's step either encode(z) (the re-encode: z is already in the Hadamard domain)
    or H z (the decode-sum: one bf16 wgmma chain over z's three pieces), stored."""
    views = refs[: 1 + len(codec.side_fields)]  # `_wire_views`
    rest = refs[len(views) :]
    if reencode:
        out_gmem, codes_smem, sides = rest
    else:
        signs_gmem, out_gmem, signs, barrier, *staging, out_smem = rest
        encode_mosaic.copy_in(signs_gmem, signs, barrier)
    first = lax.axis_index("program") * config.tiles_per_program
    layout = encode_mosaic.WireLayout.of(codec, n)

    def finish(tile, z):
        if reencode:
            encode_mosaic.encode_and_store(
                codec, z, 1.0, (codes_smem, sides), [out_gmem], tile, layout, interpret
            )
            return
        z = _hadamard_of_sum(z, signs, staging[0] if staging else None)
        z = codecs.scale_rows(z, codecs.hadamard_unit(GROUP_SIZE))
        _store_decoded(out_smem, out_gmem.at[pl.ds(TILE_GROUPS * tile, TILE_GROUPS)], tile, z)

    def step(index, code_smem, *blocks):
        *side_smems, carry = blocks
        i, p = index
        x = _decoded(code_smem, side_smems, layout.sections, codec, widened=True)
        # Peers summed in order 0..N-1. A cond, not a select: Mosaic GPU does not broadcast a
        # scalar predicate over a tile, and a multiply by 0 would carry a NaN into the next tile.
        z = lax.cond(p == 0, lambda: x, lambda: carry + x)
        pl.when(p == peers - 1)(lambda: finish(first + i, z))
        return z

    zeros = plgpu.layout_cast(jnp.zeros((TILE_GROUPS, GROUP_SIZE), jnp.float32), NARROW_LOAD)
    _pipeline(
        step,
        _peer_step_specs(codec, n, first),
        config,
        (config.tiles_per_program, peers),
        views,
        init_carry=zeros,
    )


def _hadamard_of_sum(z, signs, staging=None):
    """S z for fp32 registers z (in the layout of the 8-bit loads): z split into three bf16
    pieces (z = z1 + z2 + z3 to fp32's 24 bits), each the register operand of one wgmma into
    one fp32 accumulator: bf16 operands, fp32 accuracy. Only the 16-bit pieces take the shuffle
    into the wgmma layout (an fp32 one does not lower)."""
    pieces, rest = [], z
    for _ in range(3):
        piece = rest.astype(jnp.bfloat16)
        rest = rest - piece.astype(jnp.float32)
        pieces.append(plgpu.layout_cast(piece, ACCUMULATOR))
    if staging is not None:
        pieces = [staged(piece, staging.at[k]) for k, piece in enumerate(pieces)]

    def dot(acc_ref):
        for piece in pieces:
            plgpu.wgmma(acc_ref, piece, signs)
        return acc_ref[...]

    return pl.run_scoped(dot, plgpu.ACC((TILE_GROUPS, GROUP_SIZE), jnp.float32))
