"""Fused encode + exchange over NVLink (Mosaic GPU): encoded rows stored into the peers' memory.

Inside `jax.shard_map`, `encode_all_gather(codec, x, axis_name, n)` equals
`lax.all_gather(encode_mosaic.encode(codec, x), axis_name, axis=0)` byte for byte (wire[N, R, W],
block [r] the packed wire rows of rank r, identical on every rank): the exchange of the one-shot
all-reduce and of the compressed all-gather. `encode_all_to_all` equals `lax.all_to_all` of the
encoded rows: the exchange of the compressed reduce-scatter (`taco_jax.collectives`).

Why a kernel and not encode -> NCCL all-gather: those two run one after the other, and on
NVLink the all-gather of the wire alone takes most of what NCCL's bf16 all-reduce takes
(docs/decisions/007-fused-exchange-on-nvlink.md). Here each program encodes its tiles as
`encode_mosaic` does and TMA-stores every tile's codes and scales both into its own output and
straight into the same place of every peer's output (`plgpu.remote_ref`), so the transfer runs
under the encode of the next tiles. When its stores have landed, a program signals the program of
the same index on every peer and waits for theirs; when the kernel returns on a rank, every peer's
bytes are in its output. (QuickReduce and FlashInfer's all-reduce work this way; multicast is
off on the machines measured, so each peer is written separately.)

Conditions, beyond `encode_mosaic`'s: a `jax.shard_map` mesh axis of GPUs that can load and store
each other's memory (NVLink; the peers' buffers are XLA's, whose addresses XLA passes to the
kernel), a mesh in row-major device order (Mosaic GPU's rule), and few enough programs to be
resident together: a program waits for its peer counterparts, which must not wait for a free
SM (`launch`). Mosaic GPU's CPU interpreter has no semaphores, so these kernels run only on GPUs;
their tests compare them on two GPUs with the encode + NCCL collective they replace.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _pallas, encode_mosaic
from pallas_kernels._pallas import pl, plgpu
from pallas_kernels.encode_mosaic import GROUP_SIZE, ROW_BYTES, TILE_GROUPS, MosaicConfig
from taco_jax import codecs
from taco_jax.codecs import Codec

_TILE = TILE_GROUPS
# At most this many programs (and no more than the GPU's SMs: `max_programs`), so that all are
# resident at once (one program per SM: its shared memory, ~100 KiB, leaves room for NCCL's
# kernels beside it).
MAX_PROGRAMS = 128
# Rows are padded to a multiple of this many elements: 16 tiles of 64 groups of 128, so that a
# row splits into up to 16 x its length / 2^17 programs (`launch`).
ROW_MULTIPLE = 16 * TILE_GROUPS * GROUP_SIZE


def max_programs() -> int:
    """MAX_PROGRAMS, or fewer on a GPU with fewer SMs (one resident program per SM)."""
    sms = _pallas.hopper_sms()
    return min(MAX_PROGRAMS, sms) if sms else MAX_PROGRAMS


def launch(rows: int, tiles_per_row: int) -> MosaicConfig | None:
    """The fewest tiles per program (most programs, at most `max_programs()`) that divide a row's
    tiles; None when even one program per row exceeds that."""
    limit = max_programs()
    for per_program in range(1, tiles_per_row + 1):
        if tiles_per_row % per_program == 0 and rows * tiles_per_row // per_program <= limit:
            return MosaicConfig(per_program, min(encode_mosaic.MAX_STEPS_IN_FLIGHT, per_program))
    return None


def unsupported(codec: Codec, x: jax.Array) -> str | None:
    """Why this kernel cannot gather `x` encoded with `codec` (None: it can). The GPU, the link
    and the mesh are the caller's to check (`registry`, `taco_jax.collectives`)."""
    if codec != codecs.get_codec("taco"):
        return f"codec {codec.name!r} (the exchange is built and checked for 'taco' only)"
    if x.ndim != 2 or x.dtype != jnp.bfloat16:
        return f"x of shape={x.shape} dtype={x.dtype} (needs bf16 rows [R, n])"
    reason = encode_mosaic.unsupported(codec, x.shape[1])
    if reason is None and launch(x.shape[0], x.shape[1] // (_TILE * GROUP_SIZE)) is None:
        reason = f"{x.shape[0]} rows (more than {max_programs()} programs)"
    return reason


def encode_all_gather(
    codec: Codec,
    x: jax.Array,
    axis_name: str,
    n_ranks: int,
    *,
    replicated: bool = True,
    plan: MosaicConfig | None = None,
) -> jax.Array:
    """x[R, n] on each of the `n_ranks` ranks of mesh axis `axis_name` -> wire[N, R, W] on every
    rank, W = codec.wire_bytes(n); raises ValueError where `unsupported`.

    `replicated`: type the result as replicated along `axis_name` (under `check_vma=True`), as
    `lax.all_gather(..., to="invarying")` would; else varying, as by default.
    `plan`: the launch (default `launch`); its programs must all be resident at once.
    """
    rows = x.shape[0]
    gathered = _exchange(
        codec, x, axis_name, n_ranks, scatter=False, replicated=replicated, plan=plan
    )
    return gathered.reshape(n_ranks, rows, -1)


def encode_all_to_all(codec: Codec, x: jax.Array, axis_name: str, n_ranks: int) -> jax.Array:
    """x[N, n] on each of the `n_ranks` ranks of mesh axis `axis_name` -> wire[N, W]: row j is
    what rank j encoded from its row [this rank]. Equals
    `lax.all_to_all(encode_mosaic.encode(codec, x), axis_name, 0, 0, tiled=True)` byte for byte
    (the exchange of a reduce-scatter); raises ValueError where `unsupported`."""
    if x.shape[0] != n_ranks:
        raise ValueError(f"the all-to-all takes one row per rank: x.shape={x.shape}, N={n_ranks}")
    return _exchange(codec, x, axis_name, n_ranks, scatter=True, replicated=False)


def _exchange(codec, x, axis_name, n_ranks, *, scatter: bool, replicated: bool, plan=None):
    reason = unsupported(codec, x)
    if reason is not None:
        raise ValueError(f"the fused Mosaic GPU exchange cannot take {reason}")
    rows, n = x.shape
    groups = n // GROUP_SIZE
    # A gather's program takes its tiles of one row; a scatter's, its tiles of every row.
    grid_rows = 1 if scatter else rows
    plan = plan or launch(grid_rows, groups // _TILE)
    tiles = groups // _TILE
    if tiles % plan.tiles_per_program:
        raise ValueError(f"{plan} must divide the {tiles} tiles of a row")
    if grid_rows * tiles // plan.tiles_per_program > max_programs():
        # Programs wait for their peers' counterparts: one that waits for a free SM deadlocks.
        raise ValueError(
            f"{plan} launches {grid_rows * tiles // plan.tiles_per_program} programs, more than "
            f"the {max_programs()} that can be resident at once"
        )
    body = functools.partial(
        _exchange_body,
        axis_name=axis_name,
        n_ranks=n_ranks,
        scatter=scatter,
        codec=codec,
        config=plan,
        layout=encode_mosaic.WireLayout.of(codec, n),
    )
    wire_rows = codec.wire_bytes(n) // ROW_BYTES
    out_rows = () if scatter else (rows,)
    kind = "all_to_all" if scatter else "all_gather"
    kernel = functools.partial(
        _pallas.mosaic_kernel,
        body,
        out_shape=jax.ShapeDtypeStruct((n_ranks, *out_rows, wire_rows, ROW_BYTES), jnp.uint8),
        scratch=[*encode_mosaic.encode_scratch(plan.store_slots), plgpu.SemaphoreType.REGULAR],
        grid=(grid_rows, (groups // _TILE) // plan.tiles_per_program),
        grid_names=("row", "program"),
        name=f"taco_encode_{kind}_{codec.name}_n{n_ranks}",
        replicated_along=(axis_name,) if replicated else (),
    )
    out = _one_launch_per_call(kernel)(
        x.reshape(rows, groups, GROUP_SIZE), encode_mosaic.signs_operand()
    )
    return out.reshape(n_ranks, *out_rows, wire_rows * ROW_BYTES)


def _one_launch_per_call(kernel):
    """`kernel(x, signs)` that under `jax.vmap` runs once per batch element (`lax.map`), where
    `plgpu.kernel` would add a grid axis: the programs of one launch must all be resident at
    once (`MAX_PROGRAMS`), and a batch axis would multiply them."""

    @jax.custom_batching.custom_vmap
    def call(x, signs):
        return kernel(x, signs)

    @call.def_vmap
    def _(axis_size, in_batched, x, signs):
        if in_batched[1]:
            raise NotImplementedError("the sign matrix is a constant; it is never batched")
        x = x if in_batched[0] else jnp.broadcast_to(x, (axis_size, *x.shape))
        return lax.map(lambda xi: call(xi, signs), x), True

    return call


def _exchange_body(
    x_gmem,
    signs_gmem,
    out_gmem,
    signs_smem,
    signs_barrier,
    codes_smem,
    sides,
    done,
    *,
    axis_name,
    n_ranks,
    scatter,
    **encode,
):
    """One program: its tiles, into block [rank] of this rank's and the peers' outputs (a
    gather: of row `row`, to every rank; a scatter: of row j, to rank j alone); then the
    handshake with the programs of the same index on the peers."""
    encode_mosaic.copy_in(signs_gmem, signs_smem, signs_barrier)
    encode = dict(encode, signs=signs_smem, out=(codes_smem, sides))
    rank = lax.axis_index(axis_name)
    peers = [lax.rem(rank + k, n_ranks) for k in range(1, n_ranks)]
    if scatter:  # row j to rank j, this rank's own row first
        outs = _everywhere(out_gmem, axis_name, peers)
        for to, out in zip([rank, *peers], outs, strict=True):
            encode_mosaic.encode_tiles(x_gmem.at[to], [out.at[rank]], **encode)
    else:
        row = lax.axis_index("row")
        destinations = [
            gathered.at[rank, row] for gathered in _everywhere(out_gmem, axis_name, peers)
        ]
        encode_mosaic.encode_tiles(x_gmem.at[row], destinations, **encode)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # our bytes are in every peer's output
    for peer in peers:
        pl.semaphore_signal(done, 1, device_id={axis_name: peer})
    pl.semaphore_wait(done, n_ranks - 1)  # and every peer's program's bytes are in ours


def _everywhere(ref, axis_name, peers):
    """`ref` here and on every peer."""
    return [ref] + [plgpu.remote_ref(ref, {axis_name: peer}) for peer in peers]
