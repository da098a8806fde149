"""How fast can a kernel write into the peer GPU's memory (N = 2, NVLink), and by which stores?

The fused exchange (`pallas_kernels.exchange_mosaic`) stores each encoded tile into the peer's
memory with TMA bulk stores, and those stores set its time (BENCHMARKS.md, "Which of the fused
exchange's stores cost"). This probe copies a buffer into the peer's memory with nothing else
in the kernel, two ways, against NCCL's `lax.ppermute` of the same bytes in the same run:

    tma      each 8 KiB tile: TMA-loaded into shared memory, copied into a store slot, and
             TMA-stored into the peer's buffer (the exchange's way)
    threads  each tile: TMA-loaded, then the warpgroup's 128 threads store it into the peer's
             buffer with 16-byte vector stores from registers (uint32 x 4; NCCL's kernels write
             with ordinary stores from many threads)

Each kernel ends with the exchange's handshake (its stores landed, the peer's program
signalled and waited for), runs `--programs` programs (all resident: 128 is one per SM of an
H200, 256 two), and its output is checked against the ppermute's. For the thread stores that
handshake is not proven: `wait_writes` waits for TMA stores only, and what orders the threads'
stores before the signal is the warpgroup barrier after them and the signal's system-scope
release, by one thread; the check after the kernel cannot see a race. A library kernel would
need a fence there. Times: 5 copies per jitted loop, median of `--reps`.

    NCCL_NVLS_ENABLE=0 python benchmarks/peer_store_probe.py --sizes-mib 64 512
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from _common import run_study, seconds_per_op
from jax import lax

from pallas_kernels import _pallas

INNER = 5
TILE = (64, 32)  # uint32: 8 KiB, an encoded tile's codes
TILE_BYTES = 4 * TILE[0] * TILE[1]
VECTOR = 4  # uint32 per thread and store: 16 bytes
SLOTS = 2
STEPS_IN_FLIGHT = 3


def _body(x_gmem, out_gmem, slots_smem, done, *, way: str, tiles: int):
    """One program: its `tiles` tiles of x, into the same place of the peer's output."""
    rank = lax.axis_index("tp")
    peer = lax.rem(rank + 1, 2)
    program = lax.axis_index("program")
    remote = _pallas.peer_ref(out_gmem, "tp", peer).at[program]

    def step(index, tile_smem):
        (i,) = index
        if way == "threads":
            remote.at[i][...] = _pallas.load_vectors(tile_smem, VECTOR)
            return
        slot = lax.rem(i, SLOTS)
        _pallas.wait_stores(SLOTS - 1)
        slots_smem[slot] = tile_smem[...]
        _pallas.commit_smem()
        _pallas.copy_out(slots_smem.at[slot], remote.at[i])

    _pallas.pipeline(
        step,
        steps=tiles,
        in_specs=[_pallas.block((None, *TILE), lambda i: (i, 0, 0), dtype=jnp.uint32)],
        out_specs=[],
        in_flight=min(STEPS_IN_FLIGHT, tiles),
    )(x_gmem.at[program])
    _pallas.wait_writes()
    _pallas.signal_peer(done, "tp", peer)
    _pallas.wait_signals(done, 1)


def peer_copy(x, way: str, programs: int):
    """This rank's x [programs, tiles, 64, 32] uint32 -> the peer's x (a ppermute at N = 2)."""
    tiles = x.shape[1]
    body = _pallas.partial(_body, way=way, tiles=tiles)
    return _pallas.mosaic_kernel(
        body,
        x,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch=[_pallas.smem((SLOTS, *TILE), jnp.uint32), _pallas.semaphore()],
        grid=(programs,),
        grid_names=("program",),
        name=f"peer_copy_{way}",
    )


def run(args) -> dict:
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])  # fmt: skip
    spec = jax.sharding.PartitionSpec("tp")
    rows = []
    for size_mib in args.sizes_mib:
        tiles = int(size_mib * (1 << 20)) // TILE_BYTES // args.programs
        shape = (2 * args.programs, tiles, *TILE)
        x = jax.random.bits(jax.random.key(0), shape, jnp.uint32)
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
        nbytes = x.nbytes // 2
        timing = dict(inner=INNER, reps=args.reps)

        def ppermute(v):
            return lax.ppermute(v, "tp", [(0, 1), (1, 0)])

        lax_s = seconds_per_op(mesh, ppermute, x, **timing)
        want = jax.jit(jax.shard_map(ppermute, mesh=mesh, in_specs=spec, out_specs=spec))(x)
        print(f"{size_mib:6.0f} MiB ppermute {lax_s * 1e3:.3f} ms "
              f"({nbytes / lax_s / 1e9:.0f} GB/s)", flush=True)  # fmt: skip
        for way in args.ways:
            op = lambda v, w=way: peer_copy(v, w, args.programs)  # noqa: E731
            got = jax.jit(
                jax.shard_map(op, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
            )(x)
            equal = bool(jnp.all(got == want))
            seconds = seconds_per_op(mesh, op, x, **timing)
            rows.append(dict(bytes=nbytes, way=way, programs=args.programs, seconds=seconds,
                             gb_per_s=nbytes / seconds / 1e9, ppermute_seconds=lax_s,
                             equals_ppermute=equal))  # fmt: skip
            print(f"{size_mib:6.0f} MiB {way:8s} {seconds * 1e3:.3f} ms "
                  f"({nbytes / seconds / 1e9:.0f} GB/s) equal={equal}", flush=True)  # fmt: skip
    return {"rows": rows, "inner": INNER, "tile_bytes": TILE_BYTES}


def options(parser) -> None:
    parser.add_argument("--ways", nargs="+", default=["tma", "threads"])
    parser.add_argument("--programs", type=int, default=128)


def main() -> None:
    run_study("peer_store_probe", __doc__, run, options, sizes_mib=(64, 512))


if __name__ == "__main__":
    main()
