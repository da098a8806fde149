"""The compute of one rank's two-shot compressed all-reduce on one GPU, and a projected speedup.

What compression costs one rank, measured on one device: for a bf16 message of M bytes and a
TP group of N, the rank runs encode (N chunks) -> a copy of the all-to-all's bytes ->
decode-sum-reencode -> a copy of the all-gather's bytes -> decode, with the communication
replaced by local copies of the same bytes. Each stage is its own jitted call, timed alone and
end to end (`_common.median_seconds`), for each `--impls` backend ("xla": the jnp reference
ops, "pallas": the fused kernels) in the same run, with the error of the output against the
exact sum.

The projection (a model, not a measurement) then adds the wire time on a link of bus bandwidth B:
  bf16 ring all-reduce:   t = 2 (N-1)/N x M / B
  compressed, serial:     t = t_compute + 2 (N-1)/N x M_wire / B,  M_wire = M (1 + 8/G) / 2
  compressed, overlapped: t = max(t_compute, 2 (N-1)/N x M_wire / B) (ideal slicing)
for NVLink 4 (NCCL ring bus bandwidth ~370 GB/s on H200), InfiniBand NDR (~48 GB/s per GPU) and
a PCIe-class link (~25 GB/s).

    python benchmarks/pipeline.py --sizes-mib 64 256 1024 --impls pallas   # on a GPU
    python benchmarks/pipeline.py --smoke                                  # CPU check
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
from _common import median_seconds, write_record

from taco_jax import _backends, codecs

MiB = 1 << 20
LINKS_GBS = {"nvlink4_ring": 370.0, "ib_ndr": 48.0, "pcie": 25.0}


def _stages(ops, codec, n_ranks: int, chunk: int):
    """Jitted stage functions of one rank; the copies move the collectives' bytes locally."""
    encode = jax.jit(lambda rows: ops.encode(codec, rows))
    # all-to-all: every row goes to another rank; a roll along the rank axis is a real copy.
    exchange = jax.jit(lambda wire: jnp.roll(wire, 1, axis=0))
    reduce = jax.jit(lambda wire: ops.decode_sum_reencode(codec, wire, chunk))
    gather = jax.jit(lambda wire: jnp.roll(jnp.broadcast_to(wire, (n_ranks, wire.shape[0])), 1, 0))
    decode = jax.jit(lambda wire: ops.decode(codec, wire, chunk, jnp.bfloat16))

    @jax.jit
    def pipeline(rows):
        return decode(gather(reduce(exchange(encode(rows)))))

    return dict(
        encode=encode,
        exchange=exchange,
        reduce=reduce,
        gather=gather,
        decode=decode,
        pipeline=pipeline,
    )


def measure(impl: str, codec_name: str, n_ranks: int, size: int, reps: int) -> dict:
    codec = codecs.get_codec(codec_name)
    ops = _backends.get_ops(impl)
    chunk = size // 2 // n_ranks
    rows = jax.random.normal(jax.random.key(size), (n_ranks, chunk), jnp.bfloat16)
    stages = _stages(ops, codec, n_ranks, chunk)
    wire = stages["encode"](rows)
    reduced = stages["reduce"](wire)
    times = {
        "encode": median_seconds(stages["encode"], rows, reps=reps),
        "exchange_copy": median_seconds(stages["exchange"], wire, reps=reps),
        "decode_sum_reencode": median_seconds(stages["reduce"], wire, reps=reps),
        "gather_copy": median_seconds(stages["gather"], reduced, reps=reps),
        "decode": median_seconds(stages["decode"], stages["gather"](reduced), reps=reps),
        "pipeline": median_seconds(stages["pipeline"], rows, reps=reps),
    }
    # Locally every "peer" row is one of this rank's rows, so each output row is ~ their sum.
    out = stages["pipeline"](rows).astype(jnp.float32)
    exact = jnp.sum(rows.astype(jnp.float32), axis=0)
    rel_err = float(jnp.max(jnp.linalg.norm(out - exact, axis=1)) / jnp.linalg.norm(exact))
    compute = times["encode"] + times["decode_sum_reencode"] + times["decode"]
    wire_bytes = codec.wire_bytes(chunk) * n_ranks  # whole message on the wire, per phase
    projection = {}
    for link, gbs in LINKS_GBS.items():
        factor = 2 * (n_ranks - 1) / n_ranks
        base = factor * size / (gbs * 1e9)
        comm = factor * wire_bytes / (gbs * 1e9)
        projection[link] = {
            "bf16_s": base,
            "serial_s": compute + comm,
            "overlapped_s": max(compute, comm),
            "speedup_serial": base / (compute + comm),
            "speedup_overlapped": base / max(compute, comm),
        }
    return dict(
        impl=impl,
        codec=codec_name,
        n_ranks=n_ranks,
        bytes=size,
        times_s=times,
        rel_err=rel_err,
        compute_s=compute,
        wire_bytes=wire_bytes,
        projection=projection,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes-mib", type=float, nargs="+", default=[0.0625, 0.25, 1, 4, 16, 64, 256, 1024]
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--impls", nargs="+", default=["xla", "pallas"])
    parser.add_argument("--codec", default="taco")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if args.smoke:
        args.sizes_mib, args.tp, args.impls, args.reps = [0.25], [4], ["xla"], 2
    rows = []
    for size_mib in args.sizes_mib:
        for tp in args.tp:
            for impl in args.impls:
                row = measure(impl, args.codec, tp, int(size_mib * MiB), args.reps)
                rows.append(row)
                nv = row["projection"]["nvlink4_ring"]
                ib = row["projection"]["ib_ndr"]
                print(
                    f"{size_mib:8.2f} MiB tp={tp} {impl:7s} "
                    f"compute {row['compute_s'] * 1e6:9.1f} us"
                    f" pipeline {row['times_s']['pipeline'] * 1e6:9.1f} us err {row['rel_err']:.4f}"
                    " | projected speedup "
                    f"NVLink {nv['speedup_serial']:.2f}/{nv['speedup_overlapped']:.2f} "
                    f"IB {ib['speedup_serial']:.2f}/{ib['speedup_overlapped']:.2f}",
                    flush=True,
                )
    write_record(
        "pipeline",
        args.out,
        links_gbs=LINKS_GBS,
        note="projection = measured one-rank compute + modelled wire time; not a multi-GPU run",
        rows=rows,
    )


if __name__ == "__main__":
    main()
