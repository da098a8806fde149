"""A matmul whose epilogue encodes: a[M, K] @ b[K, H] -> one wire row, on Hopper (Mosaic GPU).

`matmul_encode(codec, a, b)` equals `encode(codec, tile_major(a @ b)[None])` (the product
rounded to bf16, then the fused encode) up to the rounding of the product: the encode of the
output of a row-parallel projection without the product ever reaching HBM in bf16. The wire
holds the product's groups in `tile_major` order: 128 x 128 tiles, row block after row block,
each tile's 128 rows (one group of 128 columns each) in order; `from_tile_major` puts decoded
values back.

The kernel is JAX's warp-specialized Hopper matmul (`jax.experimental.pallas.ops.gpu.
hopper_matmul_mgpu`: a persistent grid, one memory warpgroup feeding a TMA pipeline over K, two
compute warpgroups of 128 x 128 accumulators side by side along H) with the encode of
`encode_mosaic` in its epilogue: each compute warpgroup encodes its accumulator in two 64-row
halves (`encode_mosaic.encode_and_store`) and TMA-stores their codes and side values, while the
memory warpgroup already loads the next tile's operands. Each half tile is rounded to bf16
(the unfused path's product) and multiplied by the Hadamard signs on the tensor cores (one
more 64 x 128 x 128 wgmma: `hadamard="epilogue"`, `config.MATMUL_ENCODE_HADAMARD`); or the
Hadamard is folded into the weight, b' = b S per 128-column group (`fold_hadamard`, bf16,
exact signs; `hadamard="folded"`), so the accumulator holds v = S y already and v carries the
rounding of b' (2^-9 of each of its elements) where the unfused path carries that of y. The
programs take the output tiles row block after row block, or in `plgpu.planar_snake` order
(`config.MATMUL_ENCODE_GRID_ORDER`).

Measured (one H200, `benchmarks/kernels.py --matmul-encode`, BENCHMARKS.md "Encode in the
matmul"): with the Hadamard in its epilogue the kernel costs about 6 us or less beyond XLA's
matmul alone at GPT-125M's and GPT-1.3B's row-parallel shapes, 1.05-1.5x faster than the matmul then
the encode. In the emulated training steps it saves about what it costs: GPT-1.3B's step loses
3.7 ms of encodes and gains 3 ms of matmul (28.4 ms of fused kernels where cuBLAS's batched
matmuls of the same products take 25.3, `train_step-2026-12-04-tp2-b4-matmul-encode.json`;
docs/development_history.md, "The encode in the matmul, in the emulated steps").

Mosaic GPU's CPU interpreter blocks on warp-specialized kernels, so this kernel is checked on
the GPU only; on the CPU it is lowered for CUDA (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _pallas, encode_kernel, encode_mosaic
from pallas_kernels.config import (
    HOPPER_SMS,
    MATMUL_ENCODE_CODECS,
    MATMUL_ENCODE_FROM_ELEMENTS,
    MATMUL_ENCODE_GRID_ORDER,
    MATMUL_ENCODE_HADAMARD,
)
from taco_jax import codecs
from taco_jax.codecs import Codec

GROUP_SIZE = encode_mosaic.GROUP_SIZE
# The wire's group order (128 x 128 tiles, row block first): `codecs.tile_major`.
tile_major, from_tile_major = codecs.tile_major, codecs.from_tile_major
ROW_BYTES = encode_mosaic.ROW_BYTES
HALF = encode_mosaic._TILE  # the encode's tile: 64 groups
# A compute warpgroup's accumulator (two encode tiles), the K step of the pipeline, and the
# steps in flight: 3 x 48 KiB of operands beside the output slots (2 x 2 x 8.5 KiB) fit the
# SM's 227 KiB, 4 do not.
TILE_M, TILE_N, TILE_K = codecs.PRODUCT_TILE, codecs.PRODUCT_TILE, 64
COMPUTE_WARPGROUPS = 2
STEPS_IN_FLIGHT = 3
STORE_SLOTS = 2
CODE_ELEMENTS = ("e4m3", "e5m2", "int8")
# Where the Hadamard of the groups is applied: folded into the weight, or in the epilogue.
HADAMARDS = ("folded", "epilogue")


def unsupported(codec: Codec, a: jax.Array, b: jax.Array, *, need_hopper: bool = True):
    """Why this kernel cannot take a @ b with `codec` (None: it can)."""
    if codec.group_size != GROUP_SIZE or codec.scale_format != "fp32":
        return (f"codec {codec.name!r} with group_size={codec.group_size}, scale_format="
                f"{codec.scale_format!r} (needs {GROUP_SIZE} and fp32 scales)")  # fmt: skip
    if codec.element not in CODE_ELEMENTS:
        return f"codec {codec.name!r} with element={codec.element!r} (needs {CODE_ELEMENTS})"
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        return f"a of shape={a.shape}, b of shape={b.shape} (needs a[M, K] and b[K, H])"
    if a.dtype != jnp.bfloat16 or b.dtype != jnp.bfloat16:
        return f"a.dtype={a.dtype}, b.dtype={b.dtype} (needs bfloat16)"
    (m, k), h = a.shape, b.shape[1]
    if m % TILE_M or k % TILE_K or h % (COMPUTE_WARPGROUPS * TILE_N):
        return (f"M={m}, K={k}, H={h} (needs multiples of {TILE_M}, {TILE_K} and "
                f"{COMPUTE_WARPGROUPS * TILE_N})")  # fmt: skip
    reason = encode_mosaic.unfit_row(codec, m * h)
    if reason is not None:
        return reason
    if need_hopper and not _pallas.hopper_gpu():
        return "the default device is not a Hopper GPU (wgmma)"
    return None


def fold_hadamard(codec: Codec, b: jax.Array) -> jax.Array:
    """b' [K, H] bf16 with a @ b' = (a @ b) S on each 128-column group (b itself for a codec
    without a Hadamard): one bf16 matmul of b by the +-1 signs, fp32 sums rounded once."""
    if not codec.hadamard:
        return b
    k, h = b.shape
    signs = jnp.asarray(codecs.signs_matrix(GROUP_SIZE), jnp.bfloat16)  # exact
    folded = jnp.matmul(b.reshape(k, h // GROUP_SIZE, GROUP_SIZE), signs,
                        preferred_element_type=jnp.float32)  # fmt: skip
    return folded.reshape(k, h).astype(jnp.bfloat16)


def matmul_encode_reference(codec: Codec, a: jax.Array, b: jax.Array) -> jax.Array:
    """What `matmul_encode` equals up to the product's rounding: XLA's matmul, rounded to the
    operands' dtype, in `tile_major` order, encoded by the jnp reference -> wire[1, W]."""
    return codecs.encode_wire(codec, codecs.tile_major_product(a, b).reshape(1, -1))


def preferred(codec: Codec, a: jax.Array, b: jax.Array) -> bool:
    """Whether "auto" takes the fused kernel: it applies, the codec is one of
    `config.MATMUL_ENCODE_CODECS` (measured), and the product has at least
    `config.MATMUL_ENCODE_FROM_ELEMENTS` elements (where it measured faster)."""
    if codec.name not in MATMUL_ENCODE_CODECS or unsupported(codec, a, b) is not None:
        return False
    return a.shape[0] * b.shape[1] >= MATMUL_ENCODE_FROM_ELEMENTS


def matmul_encode(codec: Codec, a: jax.Array, b: jax.Array, *, backend: str = "auto"):
    """a[M, K] @ b[K, H] encoded -> wire[1, codec.wire_bytes(M H)], the product's groups in
    `tile_major` order (M and H multiples of 128). Equals `encode(codec, tile_major((a @
    b).astype(dtype))[None])`, dtype that of a @ b (plain JAX: `matmul_encode_reference`), up
    to rounding: the fused kernel sums the product in fp32 in its own order before rounding it
    to bf16 (`config.MATMUL_ENCODE_HADAMARD="epilogue"`), so a product element may round to the
    neighbouring bf16 value and move its group's codes by a step; folded into the weight, the
    weight's bf16 rounding replaces the product's (8% of `taco`'s codes one step off on normal
    data, at the same error against the exact product; docs/development_history.md).

    backend: "mosaic" (the fused kernel: Hopper, bf16, 8-bit codes with fp32 scales, M and H
      multiples of 128 and 256, K of 64; ValueError naming what else), "unfused" (XLA's matmul,
      then `pallas_kernels.encode` on a GPU, the jnp reference elsewhere), or "auto": the
      fused kernel where `preferred`, else unfused.
    """
    if backend not in ("auto", "mosaic", "unfused"):
        raise ValueError(f"unknown matmul_encode {backend=}; choose auto, mosaic or unfused")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or (a.shape[0] | b.shape[1]) % 128:
        raise ValueError(
            f"matmul_encode takes a[M, K] and b[K, H] with M and H multiples of 128 (whole "
            f"128 x 128 tiles of the product), got a.shape={a.shape}, b.shape={b.shape}"
        )
    if backend == "mosaic" or (backend == "auto" and preferred(codec, a, b)):
        if MATMUL_ENCODE_HADAMARD == "epilogue":
            return matmul_encode_kernel(codec, a, b, hadamard="epilogue")
        return matmul_encode_kernel(codec, a, fold_hadamard(codec, b), hadamard="folded")
    rows = codecs.tile_major_product(a, b).reshape(1, -1)
    if jax.default_backend() != "gpu":  # the kernels are GPU kernels: the jnp reference
        return codecs.encode_wire(codec, rows)
    return encode_kernel.encode(codec, rows)


def matmul_encode_kernel(codec: Codec, a: jax.Array, b: jax.Array, *, hadamard: str,
                         sms: int | None = None) -> jax.Array:  # fmt: skip
    """The fused kernel (ValueError where `unsupported`). hadamard (no default: the two take
    different weights): "folded", b being
    `fold_hadamard(codec, b)` (the accumulator is v itself), or "epilogue", b itself: each half
    tile of the accumulator is rounded to bf16, as the unfused path rounds the product, and
    multiplied by the signs (one more 64 x 128 x 128 wgmma; no fold). sms: the persistent
    grid's programs (default: the device's SMs)."""
    if hadamard not in HADAMARDS:
        raise ValueError(f"unknown {hadamard=}; choose one of {HADAMARDS}")
    reason = unsupported(codec, a, b)
    if reason is not None:
        raise ValueError(f"the Mosaic GPU matmul-encode cannot take {reason}")
    (m, k), h = a.shape, b.shape[1]
    wire_rows = codec.wire_bytes(m * h) // ROW_BYTES
    epilogue = hadamard == "epilogue"
    body = functools.partial(_kernel, codec=codec, shape=(m, k, h), magic_round=True,
                             epilogue_hadamard=epilogue)  # fmt: skip
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((wire_rows, ROW_BYTES), jnp.uint8),
        grid=(sms or _pallas.hopper_sms() or HOPPER_SMS,),
        grid_names=("program",),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        kernel_name=f"taco_matmul_encode_mosaic_{codec.name}_g{GROUP_SIZE}",
    )
    _pallas.check_addressable("matmul_encode", a, b)
    operands = (a, b, encode_mosaic.dot_operand(codec)) if epilogue else (a, b)
    return kernel(*operands).reshape(1, wire_rows * ROW_BYTES)


def _signs_scratch():
    """The signs (bf16, swizzled for wgmma) and the barrier of their one TMA load."""
    return _pallas.smem((GROUP_SIZE, GROUP_SIZE), jnp.bfloat16, swizzled=True), _pallas.barrier()


def _hadamard_of_rounded(v, signs_smem, codec):
    """The half tile v [64, 128] rounded to bf16 (the unfused path's product) and, for a codec
    with a Hadamard, multiplied by the signs on the tensor cores (exact: +-1 times bf16 values
    summed in fp32)."""
    rounded = v.astype(jnp.bfloat16)
    if not codec.hadamard:
        return rounded.astype(jnp.float32)
    return _pallas.wgmma(rounded, signs_smem, (HALF, GROUP_SIZE))


def _output_tile(index, m_tiles: int, n_tiles: int):
    """The program's index-th output tile (row block, column block), in the order of
    `config.MATMUL_ENCODE_GRID_ORDER` (None: row block after row block)."""
    if MATMUL_ENCODE_GRID_ORDER is None:
        return index // n_tiles, index % n_tiles
    return plgpu.planar_snake(index, (m_tiles, n_tiles), *MATMUL_ENCODE_GRID_ORDER)


def _operand_block(shape, index_map):
    """A pipeline block of a bf16 operand in shared memory, tiled and swizzled for wgmma."""
    return _pallas.block(shape, index_map, swizzled=True)


def _kernel(a_gmem, b_gmem, *refs, codec, shape, magic_round, epilogue_hadamard):
    """Each program walks output tiles of TILE_M x (2 TILE_N) (`plgpu.nd_loop`); per tile, the
    pipeline over K feeds both compute warpgroups, and each encodes and stores its 128 columns
    (epilogue_hadamard: refs start with the signs, staged once per program by warpgroup 0)."""
    signs_gmem, wire_gmem = refs if epilogue_hadamard else (None, *refs)
    m, k, h = shape
    cta_n = COMPUTE_WARPGROUPS * TILE_N
    m_tiles, n_tiles = m // TILE_M, h // cta_n
    layout = encode_mosaic.WireLayout.of(codec, m * h)
    unit = codecs.hadamard_unit(GROUP_SIZE) if codec.hadamard else 1.0

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k // TILE_K,),
            memory_registers=40,
            in_specs=[
                _operand_block((TILE_M, TILE_K), lambda s: (0, s)),
                _operand_block((TILE_K, cta_n), lambda s: (s, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WARPGROUPS,
            max_concurrent_steps=STEPS_IN_FLIGHT,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
        codes_smem=plgpu.SMEM((COMPUTE_WARPGROUPS, STORE_SLOTS, HALF, GROUP_SIZE), jnp.uint8),
        sides=plgpu.RefUnion(
            plgpu.SMEM((COMPUTE_WARPGROUPS, STORE_SLOTS, 2, HALF), jnp.float32),
            plgpu.SMEM((COMPUTE_WARPGROUPS, STORE_SLOTS, 4, ROW_BYTES), jnp.uint8),
        ),
        signs=_signs_scratch() if epilogue_hadamard else None,
        collective_axes="wg",
    )
    def scope(allocations, codes_smem, sides, signs):
        wg = lax.axis_index("wg")
        sides_f32, sides_u8 = sides
        out = ([codes_smem.at[wg]], (sides_f32.at[wg], sides_u8.at[wg]))  # this warpgroup's
        signs_smem = None
        if epilogue_hadamard:  # one TMA load for the program, every warpgroup waits on it
            signs_smem, loaded = signs
            _pallas.when(wg == 0, lambda: plgpu.copy_gmem_to_smem(signs_gmem, signs_smem, loaded))
            plgpu.barrier_wait(loaded)

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="program")
        def output_tile(info):
            (index,) = info.index
            row_block, col_block = _output_tile(index, m_tiles, n_tiles)
            column_group = col_block * COMPUTE_WARPGROUPS + wg  # this warpgroup's 128 columns

            def encode_accumulator(run_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((TILE_M, TILE_N)))
                def accumulate(acc_ref):
                    run_pipeline(acc_ref)
                    acc = acc_ref[...]
                    first = (row_block * (h // GROUP_SIZE) + column_group) * (TILE_M // HALF)
                    for half in range(TILE_M // HALF):
                        # A warpgroup's consecutive stores are consecutive tiles, so they take
                        # its two slots in turn (`encode_mosaic.store_tile`).
                        v = acc[half * HALF : (half + 1) * HALF]
                        if epilogue_hadamard:  # the product rounded as XLA's, then S y exactly
                            v = _hadamard_of_rounded(v, signs_smem, codec)
                        tile = first + half
                        encode_mosaic.encode_and_store(
                            codec, v, unit, out, [wire_gmem], tile, layout, magic_round
                        )

            def multiply(_, a_smem, b_smem, acc_ref):
                plgpu.wgmma(acc_ref, a_smem, b_smem.at[:, pl.ds(wg * TILE_N, TILE_N)])
                plgpu.wgmma_wait(0)
                return acc_ref

            pipeline(multiply, encode_accumulator)(
                a_gmem.at[pl.ds(row_block * TILE_M, TILE_M), :],
                b_gmem.at[:, pl.ds(col_block * cta_n, cta_n)],
                allocations=allocations,
            )

    _pallas.wait_stores(0)
