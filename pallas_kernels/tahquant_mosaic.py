"""TAH-Quant encode on Hopper through Mosaic GPU: x[R, n] bf16 -> packed wire rows, G = 128.

The same function as the Triton-lowered `tahquant_kernel.encode` (and so as
`tahquant.encode_wire(codec, x, key)` up to rounding at code boundaries) for the 8-bit codecs
with groups of 128 (`tahquant`, `tahquant_sym` and their round-to-nearest variants).

Why a second kernel: the Triton encode is bound by the instructions it issues (BENCHMARKS.md,
"Pipeline codec kernels"): the pivot's swap and H_32 are masked sums, selects and five butterfly
levels across the threads that share a group. Here TMA stages each tile of groups in shared
memory, where two wgmmas read it in place: A = x I (the group in fp32, exactly) and
C = x diag(S_32, 0) (S_32 of every group's first 32 values). The pivot is then arithmetic on
registers, by linearity: with d = x[j] - x[0] for a group whose outlier sits at j, the swapped
group x' = x + d (e_0 - e_j) has

    S_32 x'[:32] = C + d (1 - [j < 32] S_32[:, j])      (S_32's column 0 is all ones)
    x'[i] = x[0] at i = j >= 32, x[i] elsewhere past 32,

so the swap and H_32 cost a few multiply-adds per element and two masked sums per group. The
accumulators hold a row's 128 values on the four threads of a quad: a per-group reduction is
two shuffle levels.

Rounding: the reference (and the Triton kernel) apply H_32 as fp32 butterflies; the tensor
cores sum the 32 exact products in their own order, and the correction adds two roundings, so
in pivoted groups a code may move by one step where the reference's value sits within those
roundings of a boundary (the tests' bound: tests/pallas_kernels/test_tahquant_mosaic.py).
Groups without a pivot take A, exact: their codes round as the reference's do.

Layout: a pipeline step takes 128 groups (two wgmma M blocks of 64), so that its codes (128
rows of the wire addressed as [W / 128, 128] bytes), each fp32 side section (4 rows) and its
pivot bytes (1 row) are whole rows for TMA; the wire's row count must be a multiple of 8
(TMA tiles uint8 rows by 8), hence rows of a multiple of `ROW_MULTIPLE` elements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _pallas
from pallas_kernels.config import STAGE_MOSAIC_MIN_ELEMENTS, MosaicLaunch, mosaic_launch
from taco_jax import codecs, tahquant
from taco_jax.tahquant import TahQuant

GROUP_SIZE = 128
ROW_BYTES = 128  # the wire row is addressed in rows of this many bytes
_HALF = 64  # groups per wgmma (one M block of a warpgroup)
_STEP = 2 * _HALF  # groups per pipeline step
# Whole steps whose wire rows come in multiples of 8: W / 128 = 137 steps (8.5625 bits per value).
ROW_MULTIPLE = 8 * _STEP * GROUP_SIZE


def unsupported(codec: TahQuant, x: jax.Array, *, need_hopper: bool = True) -> str | None:
    """Why this kernel cannot encode `x` with `codec` (None: it can)."""
    if codec.group_size != GROUP_SIZE or codec.bits != 8 or not codec.pivot:
        have = f"bits={codec.bits}, group_size={codec.group_size}, pivot={codec.pivot}"
        return f"codec {codec.name!r} with {have} (needs 8 bits, G = {GROUP_SIZE}, the pivot)"
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        return f"x of shape={x.shape} dtype={x.dtype} (needs bf16 rows [R, n])"
    if x.shape[1] % ROW_MULTIPLE:
        return f"n={x.shape[1]} (needs a multiple of {ROW_MULTIPLE})"
    if need_hopper and not _pallas.hopper_gpu():
        return "the default device is not a Hopper GPU (wgmma)"
    return None


def preferred(codec: TahQuant, x: jax.Array) -> bool:
    """Whether "auto" takes this kernel: it applies, and x holds >= STAGE_MOSAIC_MIN_ELEMENTS."""
    return unsupported(codec, x) is None and x.size >= STAGE_MOSAIC_MIN_ELEMENTS


def encode(codec: TahQuant, x: jax.Array, key: jax.Array | None = None, *,
           interpret: bool = False, launch: MosaicLaunch | None = None) -> jax.Array:  # fmt: skip
    """x[R, n] -> wire[R, codec.wire_bytes(n)] (raises ValueError where `unsupported`).

    Equals `tahquant.encode_wire(codec, x, key)` up to rounding at code boundaries.
    interpret: Mosaic GPU's CPU interpreter (it does not alias `RefUnion` members: there only the
      codes and the pivot bytes are meaningful).
    launch: steps (of 128 groups) per program and TMA loads in flight; default `mosaic_launch`.
    """
    reason = unsupported(codec, x, need_hopper=not interpret)
    if reason is not None:
        raise ValueError(f"the Mosaic GPU TAH-Quant encode cannot take {reason}")
    if codec.stochastic and key is None:
        raise ValueError(f"codec {codec.name!r} rounds stochastically: pass a PRNG key")
    rows, n = x.shape
    steps_per_row = n // (_STEP * GROUP_SIZE)
    launch = launch or mosaic_launch(rows, steps_per_row)
    if steps_per_row % launch.tiles_per_program:
        raise ValueError(f"tiles_per_program={launch.tiles_per_program} must divide the "
                         f"{steps_per_row} steps of a row")  # fmt: skip
    seeds = tahquant.noise_seeds(key) if codec.stochastic else jnp.zeros((2,), jnp.uint32)
    body = _pallas.partial(
        _encode_body,
        codec=codec,
        n=n,
        steps_per_program=launch.tiles_per_program,
        in_flight=launch.steps_in_flight,
        slots=launch.store_slots,
    )
    wire_rows = codec.wire_bytes(n) // ROW_BYTES
    wire = _pallas.mosaic_kernel(
        body,
        x.reshape(rows, n // GROUP_SIZE, GROUP_SIZE),
        *operands(),
        jnp.concatenate([seeds, jnp.zeros((2,), jnp.uint32)]),  # 16 bytes: one TMA load
        out_shape=jax.ShapeDtypeStruct((rows, wire_rows, ROW_BYTES), jnp.uint8),
        scratch=_scratch(launch.store_slots),
        grid=(rows, steps_per_row // launch.tiles_per_program),
        grid_names=("row", "program"),
        name=f"tahquant_encode_mosaic_{codec.name}",
        interpret=interpret,
    )
    return wire.reshape(rows, wire_rows * ROW_BYTES)


def operands() -> tuple[jax.Array, jax.Array]:
    """The two wgmma right-hand sides (exact in bf16): I_128, and diag(S_32, 0)."""
    identity = np.eye(GROUP_SIZE, dtype=np.float32)
    front = np.zeros((GROUP_SIZE, GROUP_SIZE), np.float32)
    block = tahquant.PIVOT_BLOCK
    front[:block, :block] = codecs.signs_matrix(block)
    return jnp.asarray(identity, jnp.bfloat16), jnp.asarray(front, jnp.bfloat16)


def _scratch(slots: int) -> list:
    """Shared memory: both wgmma operands and the seeds (one load barrier each), then `slots`
    steps' codes, fp32 sides seen also as uint8 rows, and pivot bytes."""
    g = GROUP_SIZE
    return [
        _pallas.smem((g, g), jnp.bfloat16, swizzled=True),
        _pallas.smem((g, g), jnp.bfloat16, swizzled=True),
        _pallas.smem((4,), jnp.uint32),
        _pallas.barrier(),
        _pallas.barrier(),
        _pallas.barrier(),
        _pallas.smem((slots, _STEP, g), jnp.uint8),
        _pallas.smem_union(((slots, 2, _STEP), jnp.float32), ((slots, 8, ROW_BYTES), jnp.uint8)),
        _pallas.smem((slots, 1, ROW_BYTES), jnp.uint8),
    ]


def _encode_body(x_gmem, eye_gmem, front_gmem, seeds_gmem, wire_gmem, eye_smem, front_smem,
                 seeds_smem, eye_done, front_done, seeds_done, codes_smem, sides, pivots_smem,
                 *, codec, n, steps_per_program, in_flight, slots):  # fmt: skip
    _pallas.copy_in(eye_gmem, eye_smem, eye_done)
    _pallas.copy_in(front_gmem, front_smem, front_done)
    _pallas.copy_in(seeds_gmem, seeds_smem, seeds_done)
    row = lax.axis_index("row")
    first = lax.axis_index("program") * steps_per_program
    seeds = (seeds_smem[0], seeds_smem[1]) if codec.stochastic else None
    out = (codes_smem, sides, pivots_smem)
    wire_row = wire_gmem.at[row]

    def step(index, x_smem):
        (i,) = index
        s = first + i
        slot = lax.rem(s, slots)
        _pallas.wait_stores((slots - 1) * _stores_per_step(codec))  # frees `slots` steps ago
        for half in range(2):
            x_half = x_smem.at[_pallas.ds(half * _HALF, _HALF)]
            start = (row * (n // GROUP_SIZE) + s * _STEP + half * _HALF) * GROUP_SIZE
            codes, side_values = _encode_groups(codec, x_half, eye_smem, front_smem, seeds, start)
            _write_half(out, slot, half, codes, side_values)
        _pallas.commit_smem()
        _store_step(codec, out, slot, wire_row, s, n)

    _pallas.pipeline(
        step,
        steps=steps_per_program,
        in_specs=[_pallas.block((_STEP, GROUP_SIZE), lambda i: (first + i, 0), swizzled=True)],
        out_specs=[],
        in_flight=in_flight,
    )(x_gmem.at[row])
    _pallas.wait_stores(0)


def _wgmma_iota(dimension: int) -> jax.Array:
    """Positions along `dimension` of a [64, 128] tile, in the wgmma accumulator's layout."""
    return _pallas.wgmma_layout(lax.broadcasted_iota(jnp.int32, (_HALF, GROUP_SIZE), dimension))


def _group_sum(v: jax.Array) -> jax.Array:
    """Each group's sum, broadcast back over the group [64, 128]."""
    return codecs.per_group(jnp.sum(v, axis=-1), v.shape)


def _encode_groups(codec: TahQuant, x_smem, eye_smem, front_smem, seeds, start):
    """64 groups of x_smem (bf16) -> (codes uint8 [64, 128], {side field: [64]}): what
    `tahquant.encode_groups` computes, with the pivot by linearity (module docstring)."""
    shape = (_HALF, GROUP_SIZE)
    a = _pallas.wgmma(x_smem, eye_smem, shape)  # x in fp32, exact
    c = _pallas.wgmma(x_smem, front_smem, shape)  # S_32 x[:32] in columns < 32
    col = _wgmma_iota(1)
    flag, index = tahquant.pivot_rule(a, positions=col)
    j = codecs.per_group(index, shape)
    x0 = _group_sum(jnp.where(col == 0, a, 0.0))
    xj = _group_sum(jnp.where(col == j, a, 0.0))
    d = xj - x0
    s = 1 - 2 * codecs.sylvester_parity(col, j)
    through = jnp.where(j < tahquant.PIVOT_BLOCK, s, 0).astype(jnp.float32)
    front = (c + d * (1.0 - through)) * tahquant.PIVOT_UNIT
    swapped = jnp.where(col == j, x0, a)
    pivoted = codecs.per_group(flag, shape)
    y = jnp.where(pivoted & (col < tahquant.PIVOT_BLOCK), front, jnp.where(pivoted, swapped, a))
    noise = None
    if codec.stochastic:
        element = start + _wgmma_iota(0) * GROUP_SIZE + col
        noise = tahquant.element_noise(seeds, element.astype(jnp.uint32))
    codes, scale, low = tahquant.quantize_groups(
        codec, y, noise, floor=tahquant.floor_by_truncation
    )
    pivots = (index | jnp.where(flag, tahquant.PIVOT_FLAG, 0)).astype(jnp.uint8)
    sides = {"scales": scale, "mins": low, "pivots": pivots}
    return tahquant.pack_codes(codec, codes), sides


def _write_half(out, slot, half, codes, sides):
    """One wgmma block's codes and side values into the step's shared-memory slot."""
    codes_smem, (sides_f32, _), pivots_smem = out
    rows = _pallas.ds(half * _HALF, _HALF)
    codes_smem[slot, rows] = codes
    sides_f32[slot, 0, rows] = sides["scales"]
    if sides["mins"] is not None:
        sides_f32[slot, 1, rows] = sides["mins"]
    pivots_smem[slot, 0, rows] = sides["pivots"]


def _stores_per_step(codec: TahQuant) -> int:
    """Bulk stores of one step: codes, each fp32 side section, pivot bytes."""
    return 1 + (1 + codec.asymmetric) + 1


def _store_step(codec: TahQuant, out, slot, wire_row, step, n: int):
    """TMA-stores a step's codes, fp32 sides and pivot bytes into their rows of the wire row."""
    codes_smem, (_, sides_u8), pivots_smem = out
    groups = n // GROUP_SIZE
    _pallas.copy_out(codes_smem.at[slot], wire_row.at[_pallas.ds(_STEP * step, _STEP)])
    side_rows = 4 * _STEP // ROW_BYTES  # 128 fp32 values = 4 rows
    offset_rows = n // ROW_BYTES
    fp32_sections = 1 + codec.asymmetric
    for k in range(fp32_sections):
        first_row = offset_rows + k * (4 * groups // ROW_BYTES) + side_rows * step
        _pallas.copy_out(sides_u8.at[slot, _pallas.ds(side_rows * k, side_rows)],
                         wire_row.at[_pallas.ds(first_row, side_rows)])  # fmt: skip
    pivot_row = offset_rows + fp32_sections * (4 * groups // ROW_BYTES) + step
    _pallas.copy_out(pivots_smem.at[slot], wire_row.at[_pallas.ds(pivot_row, 1)])
