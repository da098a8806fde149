"""compressed_psum / psum_scatter / all_gather against the lax (NCCL) collectives, timed in one run.

For every TP size the machine has (2, 4, 8) and message sizes 64 KiB .. 1 GiB of bf16, times
`lax.psum` (the baseline) and `compressed_psum` with each codec, all-reduce algorithm
(`--algorithms`: a named one compresses every message; "auto" leaves whether and how to
`taco_jax.policy`, and the row names what it chose) and `slices` in the same run, and checks
every output (relative error vs the exact fp32 psum, rank-identical results).
Each timed call runs `--inner` collectives back to back inside one jitted loop (a data
dependency between them, so none is elided); the figure is the median over `--reps` calls
after warm-up, divided by `--inner`. Reports algorithm bandwidth (message bytes / time), bus
bandwidth (NCCL's convention, x 2 (N-1)/N: both ops here move each byte in two phases) and the
speedup over the lax collective.

    python benchmarks/collectives.py                      # every GPU of the machine
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/collectives.py --smoke
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from _common import seconds_per_op, write_record
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax.telemetry import relative_error

MiB = 1 << 20


def _mesh(tp: int):
    return jax.make_mesh(
        (tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:tp]
    )


def _forced(algorithm: str) -> dict:
    """Rows that name an algorithm compress every message (the policy's own choice is the
    "auto" row's)."""
    return {"min_compress_bytes": None if algorithm == "auto" else 0}


def _ops(codec: str, slices: int, algorithm: str):
    options = dict(codec=codec, slices=slices, **_forced(algorithm))
    # The pair's exchange: NCCL under one- and two-shot, the fused kernel (where it runs) under
    # "fused" and "auto".
    pair_options = dict(options, algorithm=algorithm)

    def psum(v):
        if codec == "lax":
            return lax.psum(v, "tp")
        return tj.compressed_psum(v, "tp", algorithm=algorithm, **options)

    def psum_scatter_then_gather(v):  # keeps the shape, so it can loop
        if codec == "lax":
            part = lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True)
            return lax.all_gather(part, "tp", axis=0, tiled=True)
        part = tj.compressed_psum_scatter(v, "tp", **pair_options)
        return tj.compressed_all_gather(part, "tp", axis=0, tiled=True, **pair_options)

    return {"all_reduce": psum, "reduce_scatter+all_gather": psum_scatter_then_gather}


def _times_pair(algorithm: str, algorithms: list[str]) -> bool:
    """The pair is timed once through NCCL (with the first of one- and two-shot), once fused,
    once for "auto"."""
    if algorithm in ("auto", "fused"):
        return True
    return algorithm == next(a for a in algorithms if a in ("one_shot", "two_shot"))


def _row_algorithm(codec: str, op: str, algorithm: str, chosen: str) -> str:
    """The all-reduce's algorithm (for "auto", what ran); the pair's exchange: "-" (NCCL),
    "fused", or "auto" (whichever the defaults ran)."""
    if codec == "lax":
        return "-"
    if op == "all_reduce":
        return chosen
    return algorithm if algorithm in ("fused", "auto") else "-"


def _chosen(algorithm: str, tp: int, size: int) -> str:
    """The all-reduce algorithm a row runs; for "auto", what `taco_jax.policy` chose on this
    machine's link ("plain": the lax collective itself)."""
    if algorithm != "auto":
        return algorithm
    if jax.default_backend() != "gpu":
        return "auto:two_shot"  # no real link: every message compressed, two-shot
    choice = tj.policy.measured_choice("all_reduce", "auto", tp, size)
    return "auto:" + (choice.algorithm if choice.compress else "plain")


def _psum_once(tp: int, codec: str, algorithm: str, x_global: jax.Array, mesh) -> jax.Array:
    fn = jax.jit(
        jax.shard_map(
            lambda v: tj.compressed_psum(
                v, "tp", codec=codec, algorithm=algorithm, **_forced(algorithm)
            ),
            mesh=mesh,
            in_specs=P("tp"),
            out_specs=P("tp"),
            check_vma=False,
        )
    )
    return fn(x_global).astype(jnp.float32).reshape(tp, -1)


def _check(tp: int, codec: str, algorithm: str, x_global: jax.Array, mesh) -> dict:
    """One compressed_psum against the exact fp32 sum; rank-identical output; "fused" also bit
    for bit against "one_shot" (the same codes and sums, exchanged by the kernel)."""
    out = _psum_once(tp, codec, algorithm, x_global, mesh)
    exact = jnp.sum(x_global.astype(jnp.float32).reshape(tp, -1), axis=0)
    check = {
        "rel_err": float(relative_error(out[0], exact)),
        "rank_identical": bool(jnp.all(out == out[0])),
    }
    if algorithm == "fused":
        one_shot = _psum_once(tp, codec, "one_shot", x_global, mesh)
        check["equals_one_shot"] = bool(jnp.all(out == one_shot))
    return check


def run(args) -> dict:
    sizes = [int(s * MiB) for s in args.sizes_mib]
    tps = [t for t in (2, 4, 8) if t <= jax.device_count()]
    rows = []
    for tp in tps:
        mesh = _mesh(tp)
        for size in sizes:
            elements = size // 2  # bf16
            key = jax.random.key(size + tp)
            x = jax.device_put(
                jax.random.normal(key, (tp * elements,), jnp.bfloat16), NamedSharding(mesh, P("tp"))
            )
            variants = [("lax", 1, "auto")] + [
                (codec, slices, algorithm)
                for codec in args.codecs
                for slices in args.slices
                for algorithm in args.algorithms
            ]
            for codec, slices, algorithm in variants:
                chosen = _chosen(algorithm, tp, size)
                check = _check(tp, codec, algorithm, x, mesh) if codec != "lax" else {}
                for name, op in _ops(codec, slices, algorithm).items():
                    if (
                        codec != "lax"
                        and name != "all_reduce"
                        and not _times_pair(algorithm, args.algorithms)
                    ):
                        continue  # one- and two-shot are the all-reduce's: time the pair once
                    # `inner` dependent collectives and nothing else: an all-reduce of bf16
                    # N(0, 1) data grows by N per step, far from overflow for the default.
                    seconds = seconds_per_op(mesh, op, x, inner=args.inner, reps=args.reps)
                    # Both ops move every byte twice: (N-1)/N in each of two phases.
                    bus_factor = 2 * (tp - 1) / tp
                    rows.append(
                        dict(
                            tp=tp,
                            bytes=size,
                            op=name,
                            codec=codec,
                            algorithm=_row_algorithm(codec, name, algorithm, chosen),
                            slices=slices,
                            seconds=seconds,
                            algbw_gbs=size / seconds / 1e9,
                            busbw_gbs=size * bus_factor / seconds / 1e9,
                            **check,
                        )
                    )
                    print(_format(rows[-1]), flush=True)
    for row in rows:
        base = next(
            r
            for r in rows
            if r["tp"] == row["tp"]
            and r["bytes"] == row["bytes"]
            and r["op"] == row["op"]
            and r["codec"] == "lax"
        )
        row["speedup"] = base["seconds"] / row["seconds"]
    return {"rows": rows}


def _format(row: dict) -> str:
    extra = f" err={row['rel_err']:.4f} same={row['rank_identical']}" if "rel_err" in row else ""
    if "equals_one_shot" in row:
        extra += f" =one_shot:{row['equals_one_shot']}"
    return (
        f"tp={row['tp']} {row['bytes'] / MiB:8.2f} MiB {row['op']:26s} {row['codec']:10s} "
        f"{row['algorithm']:14s} "
        f"D={row['slices']:2d} {row['seconds'] * 1e6:9.1f} us "
        f"bus {row['busbw_gbs']:7.1f} GB/s{extra}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes-mib", type=float, nargs="+", default=[0.0625, 0.25, 1, 4, 16, 64, 256, 1024]
    )
    parser.add_argument("--codecs", nargs="+", default=["taco", "taco_e8m0", "int8_hadamard"])
    parser.add_argument("--slices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--algorithms", nargs="+", default=["auto"], choices=tj.collectives.ALGORITHMS
    )
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CPU")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if args.smoke:
        args.sizes_mib, args.codecs, args.slices, args.inner, args.reps = (
            [0.0625],
            ["taco"],
            [1, 2],
            2,
            2,
        )
    if jax.device_count() < 2:
        sys.exit(f"needs >= 2 devices, have {jax.device_count()}")
    write_record(
        "collectives",
        args.out,
        **run(args),
    )


if __name__ == "__main__":
    main()
