"""Where the fused exchange's time goes (N = 2, NVLink): its stores, ablated.

The fused exchange (`pallas_kernels.exchange_mosaic.encode_all_gather`) encodes each tile of 64
groups and TMA-stores it to two places, this rank's output and the peer's: the codes (8 KiB) and
two side sections (256 bytes each: the fp32 scales and pre-scales). More store slots did not
change its time at 1 GiB (BENCHMARKS.md, "The fused exchange's launch"). This times the
exchange alone (5 per jitted loop, median of `--reps` calls) with some of those stores left
out, to see which cost:

    full           codes and sides, here and on the peer (the library's stores, in another
                   order: the codes to both places, then the sides)
    no_peer_sides  the peer gets the codes only (256-byte remote stores left out)
    no_sides       codes only, here and on the peer
    no_local       the peer's stores only
    local_only     this rank's stores only: no NVLink traffic (encode + handshake)
    peer_threads   as full, but the peer's codes written from the registers of the
                   warpgroup's 128 threads (uint8 vectors of 16, which the compiled kernel
                   stores byte by byte), not by TMA; its output is compared with the
                   library's byte for byte

With `--programs P ...` each variant runs with the library's launch rule
(`exchange_mosaic.launch`) under a cap of P programs instead of its own (at most one per SM, 128
on an H200; P programs where P divides the tiles); `--programs 256` puts two on each SM, as
the standalone Mosaic encode runs, by raising the kernel's residency cap for this study
(`exchange_mosaic.max_programs`: both fit in an SM's shared memory, ~97 KiB each). For each P
the whole fused all-reduce (exchange, then decode-sum) is timed too, and its output compared
with the library's byte for byte.

Each exchange-only time also holds the loop's own work (the same in every variant): read the
differences between variants. TIMING ONLY: the ablated kernels leave parts of the outputs
unwritten. The variants replace `encode_mosaic._store_tile` while the kernel is traced; the
library is not changed.

    NCCL_NVLS_ENABLE=0 python benchmarks/exchange_ablation.py --sizes-mib 64 1024 \
        --programs 128 256
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from _common import looped_on_tp, message_and_psum, run_study, seconds_per_op
from exchange_launch import TILE_ELEMENTS, fused_all_reduce
from jax import lax

from pallas_kernels import _pallas, encode_mosaic, exchange_mosaic
from taco_jax import codecs

INNER = 5
# Which destinations (0: this rank's output, 1: the peer's) get the codes by TMA / the side
# sections by TMA / the codes by the threads' vector stores.
VARIANTS = {
    "full": ((0, 1), (0, 1), ()),
    "no_peer_sides": ((0, 1), (0,), ()),
    "no_sides": ((0, 1), (), ()),
    "no_local": ((1,), (1,), ()),
    "local_only": ((0,), (0,), ()),
    "peer_threads": ((0,), (0, 1), (1,)),
}
COMPLETE = ("full", "peer_threads")  # the variants that write every byte
VECTOR_BYTES = 16


def _ablated_store(codes_to, sides_to, threads_to):
    """`encode_mosaic._store_tile` storing the codes by TMA to `codes_to` and by the threads to
    `threads_to`, the sides by TMA to `sides_to` (indices into its wire rows), with the slot
    accounting of that many TMA stores per tile."""

    def store(out, wire_rows, tile, sections, codes, sides):
        codes_smem, (sides_f32, sides_u8) = out
        slots = codes_smem.shape[0]
        slot = lax.rem(tile, slots)
        per_tile = len(codes_to) + len(sections) * len(sides_to)
        _pallas.wait_stores((slots - 1) * per_tile)
        codes_smem[slot] = codes
        for k, section in enumerate(sections):
            sides_f32[slot, k] = sides[section.field]
        _pallas.commit_smem()
        tile_rows = encode_mosaic._TILE  # a tile's codes: this many 128-byte wire rows
        codes_at = _pallas.ds(tile_rows * tile, tile_rows)
        for d in codes_to:
            _pallas.copy_out(codes_smem.at[slot], wire_rows[d].at[codes_at])
        if threads_to:
            in_registers = _pallas.load_vectors(codes_smem.at[slot], VECTOR_BYTES)
            for d in threads_to:
                wire_rows[d].at[codes_at][...] = in_registers
        for d in sides_to:
            for k, section in enumerate(sections):
                rows = section.width * tile_rows // encode_mosaic.ROW_BYTES
                first_row = section.offset // encode_mosaic.ROW_BYTES + rows * tile
                _pallas.copy_out(
                    sides_u8.at[slot, _pallas.ds(rows * k, rows)],
                    wire_rows[d].at[_pallas.ds(first_row, rows)],
                )

    return store


@contextlib.contextmanager
def patched(module, name: str, value):
    kept = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, kept)


def variant(name: str):
    return patched(encode_mosaic, "_store_tile", _ablated_store(*VARIANTS[name]))


def exchange(x, plan):
    """The gathered wire [2, 1, W] of this rank's x [n] (one slice)."""
    return exchange_mosaic.encode_all_gather(
        codecs.get_codec("taco"), x.reshape(1, -1), "tp", 2, replicated=False, plan=plan
    )


def exchange_only(x, plan):
    """The exchange of x; x back, made to depend on the result."""
    return x.at[0].add(exchange(x, plan)[1, 0, 0].astype(x.dtype) * 0)


def gathered(mesh, x, plan):
    """Both ranks' gathered wires, [2 x 2, 1, W] (jitted `shard_map`)."""
    spec = jax.sharding.PartitionSpec("tp")
    fn = jax.shard_map(lambda v: exchange(v, plan), mesh=mesh, in_specs=spec, out_specs=spec,
                       check_vma=False)  # fmt: skip
    return jax.jit(fn)(x)


def run(args) -> dict:
    rows = []
    for size_mib in args.sizes_mib:
        mesh, x, timing, lax_s = message_and_psum(size_mib, inner=INNER, reps=args.reps)
        wire_bytes = codecs.get_codec("taco").wire_bytes(x.shape[0] // 2)
        tiles = x.shape[0] // 2 // TILE_ELEMENTS
        want = looped_on_tp(mesh, lambda v: fused_all_reduce(v, None), 1)(x)
        for cap in args.programs:
            with patched(exchange_mosaic, "max_programs", lambda c=cap: c):
                plan = exchange_mosaic.launch(1, tiles)  # the library's rule, under this cap
                programs = tiles // plan.tiles_per_program
                reduce = lambda v, p=plan: fused_all_reduce(v, p)  # noqa: E731
                same = bool(jnp.all(looped_on_tp(mesh, reduce, 1)(x) == want))
                reduce_s = seconds_per_op(mesh, reduce, x, **timing)
                print(f"{size_mib:6.0f} MiB programs={programs} all-reduce {reduce_s * 1e3:.3f} "
                      f"ms ({lax_s / reduce_s:.2f}x psum {lax_s * 1e3:.3f} ms) same={same}",
                      flush=True)  # fmt: skip
                library = gathered(mesh, x, plan) if set(args.variants) & {*COMPLETE} else None
                for name in args.variants:
                    with variant(name):
                        op = lambda v, p=plan: exchange_only(v, p)  # noqa: E731
                        seconds = seconds_per_op(mesh, op, x, **timing)
                        equal = None
                        if name in COMPLETE:
                            equal = bool(jnp.all(gathered(mesh, x, plan) == library))
                    rows.append(dict(bytes=int(size_mib * (1 << 20)), programs=programs,
                                     variant=name, seconds=seconds, wire_bytes=wire_bytes,
                                     equals_library=equal, all_reduce_seconds=reduce_s,
                                     all_reduce_equal=same, lax_psum_seconds=lax_s))  # fmt: skip
                    print(f"{size_mib:6.0f} MiB programs={programs} {name:14s} "
                          f"{seconds * 1e3:.3f} ms equal={equal}", flush=True)  # fmt: skip
    return {"rows": rows, "inner": INNER, "note": "timing only: ablated outputs are incomplete"}


def options(parser) -> None:
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--programs", type=int, nargs="+", default=[128])


def main() -> None:
    run_study("exchange_ablation", __doc__, run, options)


if __name__ == "__main__":
    main()
