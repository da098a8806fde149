"""Decode, decode-sum and decode-sum-reencode on Hopper through Mosaic GPU: 8-bit codes, G = 128.

The same functions as the Triton-lowered `decode_kernel.decode` and `decode_sum_kernel`
(and so as `codecs.decode_wire`, `codecs.decode_sum_wire`, `codecs.decode_sum_reencode_wire`,
up to fp32 rounding; re-encoded codes up to rounding ties), for the codecs whose codes are one
byte (`taco`, `taco_e8m0`, `taco_e5m2`, `taco_no_ds`, `fp8`, `int8`, `int8_hadamard`).

Why the tensor cores: a decode is S q x d per group (S the +-1 Sylvester matrix, d the group's
factor `codecs.decode_factor`). TMA loads a tile of 64 groups of codes into swizzled shared
memory and one 64 x 128 x 128 wgmma multiplies it by S (staged once per program), exactly:
every code and sign is exact and the accumulator sums 128 products. INT8 codes are wgmma
operands as they are (int32 sums). FP8 codes are too, but Hopper's FP8 wgmma keeps only ~14
bits of its sums (`_upcasts`), so FP8 codes go through registers into an fp16 tile first (fp16
holds every E4M3 and E5M2 value) and the fp16 wgmma accumulates in fp32. Codecs without a
Hadamard multiply by the identity instead (one nonzero product per output: exact in any
type). The decode-sum runs one dot per peer (each peer's exact codes, as
`config.TWO_PEERS_DOT`); the decode-sum-reencode needs no Hadamard (H H = I: the sum is
re-encoded where it is, in the Hadamard domain), so its dots are by the identity.

Measured against the Triton kernels (`config.MOSAIC_DECODE_FROM_BYTES`): the decode is faster
from 64 MiB; the decode-sum and re-encode of eight peers are slower at every size, because each
pipeline step holds every peer's tile and so only one step fits in flight.

The wire row is read through views XLA makes without a copy (bitcasts of the uint8 row): the
codes as [W / 128, 128] of the code type, the fp32 side sections as [W / 4] fp32 and the E8M0
ones as [W] bytes, each tile's side values one 1-D block. Outputs are stored by the kernel
itself, not by the pipeline (whose predicated stores Mosaic GPU's CPU interpreter cannot run),
so that CI runs these kernels too. Rows must hold whole tiles and fill whole 8-row TMA boxes of
the codes view (`unsupported`: `taco` from two tiles, one-scale codecs four, `taco_e8m0` 16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _pallas, encode_mosaic
from pallas_kernels.config import (
    MOSAIC_DECODE_CODECS,
    MOSAIC_DECODE_FROM_BYTES,
    MOSAIC_GROUPS_PER_TILE,
    MosaicLaunch,
    mosaic_launch,
)
from taco_jax import codecs
from taco_jax.codecs import Codec

GROUP_SIZE = encode_mosaic.GROUP_SIZE
ROW_BYTES = encode_mosaic.ROW_BYTES
_TILE = MOSAIC_GROUPS_PER_TILE
# The dtype wgmma reads each code element as, and the dtype of its +-1 (or identity) operand.
CODE_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2, "int8": jnp.int8}
OUT_DTYPES = (jnp.float32, jnp.bfloat16)


def unsupported(codec: Codec, n: int, *, reencode: bool = False, need_hopper: bool = True):
    """Why these kernels cannot decode rows of `n` elements coded with `codec` (None: they can).

    reencode: for `decode_sum_reencode`, whose re-encode stores fp32 side sections only."""
    if codec.group_size != GROUP_SIZE:
        return f"group_size={codec.group_size} (needs {GROUP_SIZE})"
    if codec.element not in CODE_DTYPES:
        return f"codec {codec.name!r} (needs 8-bit codes: {', '.join(CODE_DTYPES)})"
    if reencode and codec.scale_format != "fp32":
        return f"codec {codec.name!r} (the re-encode needs fp32 scales)"
    if n % (_TILE * GROUP_SIZE) or codec.wire_bytes(n) % (8 * ROW_BYTES):
        return (
            f"n={n} (needs whole tiles of {_TILE * GROUP_SIZE} and wire rows of a multiple of "
            f"{8 * ROW_BYTES} bytes: TMA moves the codes 8 rows of {ROW_BYTES} bytes at a time)"
        )
    if need_hopper and not _pallas.hopper_gpu():
        return "the default device is not a Hopper GPU (wgmma)"
    return None


def preferred(op: str, codec: Codec, wire: jax.Array, n: int, dtype=jnp.float32) -> bool:
    """Whether "auto" takes the Mosaic kernel of `op` ("decode", "decode_sum",
    "decode_sum_reencode"): it applies, the codec is one of `config.MOSAIC_DECODE_CODECS`,
    and the call moves at least `config.MOSAIC_DECODE_FROM_BYTES[op]` bytes of wire (None:
    Triton at every size)."""
    threshold = MOSAIC_DECODE_FROM_BYTES[op]
    if threshold is None or codec.name not in MOSAIC_DECODE_CODECS:
        return False
    if jnp.dtype(dtype) not in OUT_DTYPES or wire.ndim != 2:
        return False
    if unsupported(codec, n, reencode=op == "decode_sum_reencode") is not None:
        return False
    return wire.size >= threshold


def decode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret: bool = False,
    launch: MosaicLaunch | None = None,
) -> jax.Array:
    """wire[R, codec.wire_bytes(n)] -> x[R, n] of `dtype` (ValueError where `unsupported`).

    interpret: Mosaic GPU's CPU interpreter (tests). launch: tiles per program and pipeline
    steps in flight; default `mosaic_launch`.
    """
    _check(codec, wire, n, dtype, interpret=interpret)
    rows = wire.shape[0]
    groups = n // GROUP_SIZE
    launch = _launch(launch, rows, groups // _TILE, codec=codec, n=n, peers=1,
                     out_tile_bytes=_out_tile_bytes(dtype))  # fmt: skip
    body = _pallas.partial(_decode_body, codec=codec, n=n, launch=launch, rows_summed=False)
    out = _pallas.mosaic_kernel(
        body,
        *_wire_views(codec, wire),
        _dot_operand(codec, hadamard=codec.hadamard),
        out_shape=jax.ShapeDtypeStruct((rows, groups, GROUP_SIZE), dtype),
        scratch=_scratch(codec, dtype, launch, hadamard=codec.hadamard),
        grid=(rows, (groups // _TILE) // launch.tiles_per_program),
        grid_names=("row", "program"),
        name=f"taco_decode_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return out.reshape(rows, n)


def decode_sum(
    codec: Codec,
    wire: jax.Array,
    n: int,
    dtype=jnp.float32,
    *,
    interpret: bool = False,
    launch: MosaicLaunch | None = None,
) -> jax.Array:
    """wire[N, B] -> [n] of `dtype`: the fp32 sum of the N decoded rows, in peer order, rounded
    once to `dtype` (as `decode`)."""
    _check(codec, wire, n, dtype, interpret=interpret)
    groups = n // GROUP_SIZE
    launch = _launch(launch, 1, groups // _TILE, codec=codec, n=n, peers=wire.shape[0],
                     out_tile_bytes=_out_tile_bytes(dtype))  # fmt: skip
    body = _pallas.partial(_decode_body, codec=codec, n=n, launch=launch, rows_summed=True)
    out = _pallas.mosaic_kernel(
        body,
        *_wire_views(codec, wire),
        _dot_operand(codec, hadamard=codec.hadamard),
        out_shape=jax.ShapeDtypeStruct((1, groups, GROUP_SIZE), dtype),
        scratch=_scratch(codec, dtype, launch, hadamard=codec.hadamard),
        grid=(1, (groups // _TILE) // launch.tiles_per_program),
        grid_names=("row", "program"),
        name=f"taco_decode_sum_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return out.reshape(n)


def decode_sum_reencode(
    codec: Codec,
    wire: jax.Array,
    n: int,
    *,
    interpret: bool = False,
    launch: MosaicLaunch | None = None,
) -> jax.Array:
    """wire[N, B] -> wire[B] holding encode(sum of the N decoded rows) (as `decode_sum`)."""
    _check(codec, wire, n, None, interpret=interpret, reencode=True)
    groups = n // GROUP_SIZE
    launch = _launch(launch, 1, groups // _TILE, codec=codec, n=n, peers=wire.shape[0],
                     out_tile_bytes=_out_tile_bytes(None))  # fmt: skip
    body = _pallas.partial(_reencode_body, codec=codec, n=n, launch=launch, interpret=interpret)
    wire_rows = codec.wire_bytes(n) // ROW_BYTES
    out = _pallas.mosaic_kernel(
        body,
        *_wire_views(codec, wire),
        _dot_operand(codec, hadamard=False),
        out_shape=jax.ShapeDtypeStruct((wire_rows, ROW_BYTES), jnp.uint8),
        scratch=_scratch(codec, None, launch, hadamard=False),
        grid=((groups // _TILE) // launch.tiles_per_program,),
        grid_names=("program",),
        name=f"taco_decode_sum_reencode_mosaic_{codec.name}_g{GROUP_SIZE}",
        interpret=interpret,
    )
    return out.reshape(wire_rows * ROW_BYTES)


def _check(codec, wire, n, dtype, *, interpret, reencode=False):
    reason = unsupported(codec, n, reencode=reencode, need_hopper=not interpret)
    if reason is not None:
        raise ValueError(f"the Mosaic GPU decode cannot take {reason}")
    if wire.ndim != 2 or wire.shape[1] != codec.wire_bytes(n) or wire.dtype != jnp.uint8:
        raise ValueError(
            f"wire shape={wire.shape} dtype={wire.dtype} is not uint8[R, {codec.wire_bytes(n)}] "
            f"for {n=} and codec {codec.name!r}"
        )
    if dtype is not None and jnp.dtype(dtype) not in OUT_DTYPES:
        raise ValueError(f"the Mosaic GPU decode writes float32 or bfloat16, not {dtype=}")


# Shared memory a program may take (the H100/H200 allow 227 KiB per block; some is Mosaic's).
SMEM_BUDGET_BYTES = 200 * 1024


def _launch(launch, rows, tiles_per_row, *, codec, n, peers, out_tile_bytes):
    """The given launch (checked), or `mosaic_launch` with as many pipeline steps in flight as
    fit `SMEM_BUDGET_BYTES` beside the dot operand and the output slots: each step holds every
    peer's codes and side values of one tile (8 peers: one step)."""
    if launch is None:
        launch = mosaic_launch(rows, tiles_per_row)
        side_bytes = sum(_TILE * s.width for s in codecs.wire_sections(codec, n))
        step_bytes = peers * (_TILE * GROUP_SIZE + side_bytes)
        operand = GROUP_SIZE * GROUP_SIZE * 2  # fp16 at most
        upcast = _TILE * GROUP_SIZE * 2
        fixed = operand + upcast + launch.store_slots * out_tile_bytes
        fits = max(1, (SMEM_BUDGET_BYTES - fixed) // step_bytes)
        launch = MosaicLaunch(
            launch.tiles_per_program, min(launch.steps_in_flight, fits), launch.store_slots
        )
    if tiles_per_row % launch.tiles_per_program:
        raise ValueError(
            f"tiles_per_program={launch.tiles_per_program} must divide the {tiles_per_row} "
            "tiles of a row"
        )
    return launch


def _out_tile_bytes(dtype) -> int:
    """Shared memory of one output slot: a decoded tile of `dtype`, or (None) a re-encoded one
    (its codes and two sections of fp32 side values: `encode_mosaic.encode_scratch`)."""
    if dtype is None:
        return _TILE * GROUP_SIZE + 2 * _TILE * 4
    return _TILE * GROUP_SIZE * jnp.dtype(dtype).itemsize


def _wire_views(codec: Codec, wire: jax.Array) -> tuple[jax.Array, ...]:
    """The wire rows [R, W] as the kernels read them (bitcasts: no copies): the codes as
    [R, W / 128, 128] of `CODE_DTYPES`, then one view per side section ([R, W / 4] fp32 for
    fp32 sections, the bytes [R, W] for E8M0 exponents)."""
    rows, width = wire.shape
    codes = lax.bitcast_convert_type(wire, CODE_DTYPES[codec.element])
    views = [codes.reshape(rows, width // ROW_BYTES, ROW_BYTES)]
    for _, side_width in codec.side_fields:
        if side_width == 4:
            words = wire.reshape(rows, width // 4, 4)
            views.append(lax.bitcast_convert_type(words, jnp.float32))
        else:
            views.append(wire)
    return tuple(views)


def _upcasts(codec: Codec, hadamard: bool) -> bool:
    """Whether the codes go through fp16 before the dot: FP8 codes times the +-1 matrix. Hopper's
    FP8 wgmma keeps only about 14 bits of its running sum (DeepSeek-V3, arXiv:2412.19437,
    section 3.3.2), so a 128-term Hadamard of FP8 codes would err by ~2^-13; the fp16 wgmma
    accumulates in fp32, and fp16 holds every E4M3 and E5M2 value exactly (the hardware
    converts FP8 to fp16, not to bf16). INT8 codes sum exactly in int32, and an identity dot has
    one nonzero product per output: both stay 8-bit."""
    return hadamard and codec.element != "int8"


def _dot_operand(codec: Codec, *, hadamard: bool) -> jax.Array:
    """The +-1 Sylvester matrix (hadamard) or the identity, in the type wgmma pairs with the
    codes: INT8 with INT8 codes, FP8 E4M3 with either FP8 type, fp16 where `_upcasts` (all
    exact)."""
    matrix = codecs.signs_matrix(GROUP_SIZE) if hadamard else np.eye(GROUP_SIZE)
    return jnp.asarray(matrix, _dot_dtype(codec, hadamard))


def _dot_dtype(codec: Codec, hadamard: bool):
    if _upcasts(codec, hadamard):
        return jnp.float16
    return jnp.int8 if codec.element == "int8" else jnp.float8_e4m3fn


def _scratch(codec: Codec, dtype, launch: MosaicLaunch, *, hadamard: bool) -> list:
    """The dot operand (and its load barrier), the fp16 tile the codes are upcast into (where
    `_upcasts`), then the output's slots: `launch.store_slots` decoded tiles of `dtype`, or
    (dtype None) the re-encoded tiles of `encode_mosaic`."""
    operand = [
        _pallas.smem((GROUP_SIZE, GROUP_SIZE), _dot_dtype(codec, hadamard), swizzled=True),
        _pallas.barrier(),
    ]
    if _upcasts(codec, hadamard):
        operand.append(_pallas.smem((_TILE, GROUP_SIZE), jnp.float16, swizzled=True))
    if dtype is None:
        return operand + encode_mosaic.encode_scratch(launch.store_slots)[2:]
    return operand + [_pallas.smem((launch.store_slots, _TILE, GROUP_SIZE), dtype)]


def _tile_specs(codec: Codec, n: int, first, peers: int) -> list:
    """Pipeline blocks of one tile: per peer its codes (swizzled for wgmma), then each side
    section's 64 values; `first` is the program's first tile."""
    code_block = _pallas.block(
        (_TILE, GROUP_SIZE), lambda i: (first + i, 0), swizzled=True,
        dtype=CODE_DTYPES[codec.element],
    )  # fmt: skip
    side_blocks = []
    for section in codecs.wire_sections(codec, n):
        start = section.offset // section.width // _TILE  # whole tiles: `unsupported`
        side_blocks.append(_pallas.block((_TILE,), lambda i, s=start: (s + first + i,)))
    return [code_block, *side_blocks] * peers


def _peer_refs(views, row):
    """Per peer (the rows of the views: the N peers of a decode-sum, or row `row` alone), its
    codes and side views, in `_tile_specs` order."""
    if row is not None:
        return [view.at[row] for view in views]
    peers = views[0].shape[0]
    return [view.at[p] for p in range(peers) for view in views]


def _decoded_peers(codec, blocks, dot_smem, n, unit, upcast_smem=None):
    """Per peer of this tile's `blocks` (codes, then side sections, per peer): its codes times
    the dot operand (fp32, exact; through `upcast_smem` in fp16 where given) and its decode
    factor d (`codecs.decode_factor` with `unit`): the decoded tile is `scale_rows(v, d)`."""
    sections = codecs.wire_sections(codec, n)
    per_peer = 1 + len(sections)
    out = []
    for p in range(len(blocks) // per_peer):
        code_smem, *side_smem = blocks[p * per_peer : (p + 1) * per_peer]
        acc = jnp.int32 if codec.element == "int8" else jnp.float32
        if upcast_smem is None:
            v = _pallas.wgmma_transposed(code_smem, dot_smem, (_TILE, GROUP_SIZE), acc)
        else:
            upcast_smem[...] = _pallas.load_upcast(code_smem, jnp.float16)
            _pallas.commit_smem()  # the threads' writes, before the tensor cores read them
            v = _pallas.wgmma(upcast_smem, dot_smem, (_TILE, GROUP_SIZE))
        sides = {s.field: _pallas.load_rows(r) for s, r in zip(sections, side_smem, strict=True)}
        d = codecs.decode_factor(codec, sides.get("scales"), sides.get("prescales"), unit)
        out.append((v.astype(jnp.float32), d))
    return out


def _decode_body(*refs, codec, n, launch, rows_summed):
    """One program: `launch.tiles_per_program` consecutive tiles of one row (decode) or of the
    sum of all rows (decode-sum), stored into the output row."""
    views = refs[: 1 + len(codec.side_fields)]  # `_wire_views`
    dot_gmem, out_gmem, dot_smem, dot_barrier, *upcast, out_smem = refs[len(views) :]
    upcast_smem = upcast[0] if upcast else None
    _pallas.copy_in(dot_gmem, dot_smem, dot_barrier)
    row = None if rows_summed else lax.axis_index("row")
    peers = views[0].shape[0] if rows_summed else 1
    first = lax.axis_index("program") * launch.tiles_per_program
    unit = codecs.hadamard_unit(GROUP_SIZE) if codec.hadamard else 1.0
    out_row = out_gmem.at[0 if rows_summed else row]

    def step(index, *blocks):
        (i,) = index
        total = None
        for v, d in _decoded_peers(codec, blocks, dot_smem, n, unit, upcast_smem):  # peer order
            x = codecs.scale_rows(v, d)
            total = x if total is None else total + x
        _store_decoded(out_smem, out_row, first + i, total)

    _pallas.pipeline(
        step,
        steps=launch.tiles_per_program,
        in_specs=_tile_specs(codec, n, first, peers),
        out_specs=[],
        in_flight=launch.steps_in_flight,
    )(*_peer_refs(views, row))
    _pallas.wait_stores(0)


def _store_decoded(out_smem, out_row, tile, x):
    """TMA-stores one decoded tile through the slots of `out_smem` (slot = tile mod S; waiting
    until at most S - 1 stores are pending frees the slot of S tiles ago)."""
    slots = out_smem.shape[0]
    slot = lax.rem(tile, slots)
    _pallas.wait_stores(slots - 1)
    out_smem[slot] = x.astype(out_smem.dtype)
    _pallas.commit_smem()
    _pallas.copy_out(out_smem.at[slot], out_row.at[_pallas.ds(_TILE * tile, _TILE)])


def _reencode_body(*refs, codec, n, launch, interpret):
    """One program: the sum of the N peers' tiles, in the Hadamard domain (dots by the
    identity), re-encoded and stored into the wire row as `encode_mosaic` stores."""
    *views, dot_gmem, out_gmem, dot_smem, dot_barrier, codes_smem, sides = refs
    _pallas.copy_in(dot_gmem, dot_smem, dot_barrier)
    first = lax.axis_index("program") * launch.tiles_per_program
    sections = codecs.wire_sections(codec, n)

    def step(index, *blocks):
        (i,) = index
        z = None
        for v, d in _decoded_peers(codec, blocks, dot_smem, n, unit=1.0):  # in peer order
            x = codecs.scale_rows(v, d)
            z = x if z is None else z + x
        # magic_round: Mosaic GPU has no round; XLA's CPU folds the magic add (`quantize`).
        codes, scale, prescale = codecs.encode_groups(codec, z, unit=1.0,
                                                      magic_round=not interpret)  # fmt: skip
        side_values = {"scales": scale, "prescales": prescale}
        encode_mosaic.store_tile(
            (codes_smem, sides), [out_gmem], first + i, sections, codes, side_values
        )

    _pallas.pipeline(
        step,
        steps=launch.tiles_per_program,
        in_specs=_tile_specs(codec, n, first, views[0].shape[0]),
        out_specs=[],
        in_flight=launch.steps_in_flight,
    )(*_peer_refs(views, None))
    _pallas.wait_stores(0)
