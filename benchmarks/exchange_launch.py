"""Launches of the fused exchange kernel (N = 2, NVLink): programs, load steps, store slots.

The fused all-reduce is the exchange kernel (`pallas_kernels.exchange_mosaic.encode_all_gather`:
encode, TMA-store the codes into the local and the peer's output) then the decode-sum. Its
exchange moved ~270 GB/s at 1 GiB, below the ~340 GB/s once measured for NCCL's ppermute
(the link's own rate is ~270 GB/s: BENCHMARKS.md, "How fast the link takes stores into the
peer's memory"). This times the composed all-reduce with the default
launch and with each candidate `MosaicLaunch` (`--programs`, `--steps`, `--slots`: programs per
row, TMA load steps in flight, shared-memory slots the encoded tiles rotate through while their
stores read them), 5 all-reduces per jitted loop, median of `--reps` calls, beside `lax.psum`
in the same run; each candidate's output is compared with the default's byte for byte.

    NCCL_NVLS_ENABLE=0 python benchmarks/exchange_launch.py --sizes-mib 64 1024
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
from _common import looped_on_tp, message_and_psum, run_study, seconds_per_op

from pallas_kernels import exchange_mosaic
from pallas_kernels.config import MOSAIC_GROUPS_PER_TILE, MosaicLaunch
from taco_jax import _backends, codecs

MiB = 1 << 20
INNER = 5
TILE_ELEMENTS = exchange_mosaic.GROUP_SIZE * MOSAIC_GROUPS_PER_TILE


def fused_all_reduce(x, plan: MosaicLaunch | None):
    """The library's fused all-reduce of this rank's x [n] (one slice), with launch `plan`."""
    codec, ops = codecs.get_codec("taco"), _backends.get_ops("auto")
    row = x.reshape(1, -1)
    wire = exchange_mosaic.encode_all_gather(codec, row, "tp", 2, replicated=False, plan=plan)
    return ops.decode_sum(codec, wire[:, 0], row.shape[-1], x.dtype).reshape(x.shape)


def candidates(args, tiles: int) -> list[MosaicLaunch]:
    out = []
    for programs, steps, slots in itertools.product(args.programs, args.steps, args.slots):
        if tiles % programs == 0 and programs <= exchange_mosaic.max_programs():
            per_program = tiles // programs
            out.append(MosaicLaunch(per_program, min(steps, per_program), slots))
    return out


def run(args) -> dict:
    rows = []
    for size_mib in args.sizes_mib:
        mesh, x, timing, lax_s = message_and_psum(size_mib, inner=INNER, reps=args.reps)
        n = x.shape[0] // 2
        tiles = n // TILE_ELEMENTS
        default = exchange_mosaic.launch(1, tiles)
        want = looped_on_tp(mesh, lambda v: fused_all_reduce(v, None), 1)(x)
        for plan in [None, *candidates(args, tiles)]:
            op = lambda v, p=plan: fused_all_reduce(v, p)  # noqa: E731
            same = bool(jnp.all(looped_on_tp(mesh, op, 1)(x) == want))
            seconds = seconds_per_op(mesh, op, x, **timing)
            used = plan or default
            rows.append(dict(bytes=int(size_mib * MiB), default=plan is None,
                             programs=tiles // used.tiles_per_program,
                             tiles_per_program=used.tiles_per_program,
                             steps_in_flight=used.steps_in_flight, store_slots=used.store_slots,
                             seconds=seconds, lax_seconds=lax_s, speedup=lax_s / seconds,
                             equals_default=same))  # fmt: skip
            r = rows[-1]
            print(f"{size_mib:6.0f} MiB {'default ' if plan is None else ''}programs="
                  f"{r['programs']} steps={r['steps_in_flight']} slots={r['store_slots']}: "
                  f"{seconds * 1e3:.3f} ms, psum {lax_s * 1e3:.3f} ms, {lax_s / seconds:.2f}x "
                  f"same={same}", flush=True)  # fmt: skip
    return {"rows": rows, "inner": INNER}


def options(parser) -> None:
    parser.add_argument("--programs", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--steps", type=int, nargs="+", default=[3])
    parser.add_argument("--slots", type=int, nargs="+", default=[2, 4, 6])


def main() -> None:
    run_study("exchange_launch", __doc__, run, options)


if __name__ == "__main__":
    main()
