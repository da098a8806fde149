"""compressed_psum / psum_scatter / all_gather against the lax (NCCL) collectives, one run.

For every TP size the machine has (2, 4, 8; or `--emulate N` ranks under `jax.vmap` on one
device) and each message size, times `lax.psum` (the baseline) and `compressed_psum` with each
codec, all-reduce algorithm (`--algorithms`: a named one compresses every message; "auto"
leaves whether and how to `taco_jax.policy`, and the row names what it chose) and `slices`,
interleaved with an A/A control (`timing.compare`), and checks every output (relative error
vs the exact fp32 psum, rank-identical results). With `--ops pair`, the reduce-scatter +
all-gather pair against the lax pair the same way. One sample is one jitted loop of `--inner`
dependent collectives, divided by `--inner`. Rows: per-op median seconds, algorithm and bus
bandwidth (NCCL's convention, x 2 (N-1)/N: both ops move each byte in two phases), the speedup
over the lax collective (median of paired ratios) with its interval and verdict; the record
keeps every comparison's raw times.

    python -m benchmarks.collectives                       # every GPU of the machine
    python -m benchmarks.collectives --emulate 4           # one device, 4 ranks under vmap
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.collectives --smoke
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from benchmarks._common import MiB, compare_options, timed_script_options, tp_mesh, write_record
from pallas_kernels import registry
from taco_jax import target, timing
from taco_jax.telemetry import relative_error

OPS = {"all_reduce": "all_reduce", "pair": "reduce_scatter+all_gather"}


def _op(op: str, codec: str, slices: int, algorithm: str):
    """One collective over "tp" of a rank's block, keeping its shape (so that it can loop)."""
    exchange = "one_shot" if algorithm == "-" else algorithm  # "-": the pair through NCCL
    # A named algorithm compresses every message (the policy's own choice is the "auto" row's).
    forced = None if algorithm == "auto" else 0
    options = dict(codec=codec, slices=slices, algorithm=exchange, min_compress_bytes=forced)

    def all_reduce(v):
        if codec == "lax":
            return lax.psum(v, "tp")
        return tj.compressed_psum(v, "tp", **options)

    def pair(v):  # the sequence-parallel pair: NCCL's exchange ("-"), "fused" or "auto"
        if codec == "lax":
            part = lax.psum_scatter(v, "tp", scatter_dimension=0, tiled=True)
            return lax.all_gather(part, "tp", axis=0, tiled=True)
        part = tj.compressed_psum_scatter(v, "tp", **options)
        return tj.compressed_all_gather(part, "tp", axis=0, tiled=True, **options)

    return all_reduce if op == "all_reduce" else pair


def _on_ranks(fn, mesh):
    """`fn` on each rank's block: `shard_map` over the mesh, or under `vmap` (mesh None)."""
    if mesh is None:
        return jax.jit(jax.vmap(fn, axis_name="tp"))
    spec = P("tp")
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def _sampler(op, x: jax.Array, inner: int, mesh) -> timing.Sampler:
    """Seconds of one `op` on `x`, from one jitted `fori_loop` of `inner` dependent ones:
    nothing is elided, one dispatch covers them all."""
    looped = _on_ranks(lambda v: lax.fori_loop(0, inner, lambda _, u: op(u), v), mesh)
    return timing.wall(lambda: looped(x), per=inner)


def _chosen(codec: str, algorithm: str, tp: int, size: int, mesh) -> str:
    """The all-reduce algorithm a row runs; for "auto", what `taco_jax.policy` chose on this
    machine's link, "fused" only where its kernel runs here ("plain": the lax collective
    itself; two-shot where no bytes move)."""
    if algorithm != "auto":
        return algorithm
    where = target.probe("tp", mesh=mesh) if mesh is not None else target.Target()
    if not where.real_link:
        return "auto:two_shot"
    codec = tj.collectives.collective_codec(codec)
    exchange = registry.select("encode_all_gather", codec, impl="auto", target=where)
    choice = tj.policy.measured_choice("all_reduce", where.link, tp, size, exchange is not None)
    return "auto:" + (choice.algorithm if choice.compress else "plain")


def _check(tp: int, codec: str, algorithm: str, x: jax.Array, mesh) -> dict:
    """One compressed_psum against the exact fp32 sum; rank-identical output."""
    run = _on_ranks(_op("all_reduce", codec, 1, algorithm), mesh)
    out = run(x).astype(jnp.float32).reshape(tp, -1)
    exact = jnp.sum(x.astype(jnp.float32).reshape(tp, -1), axis=0)
    return {
        "rel_err": float(relative_error(out[0], exact)),
        "rank_identical": bool(jnp.all(out == out[0])),
    }


def variant_name(codec: str, algorithm: str, slices: int) -> str:
    return f"{codec} {algorithm}" + (f" slices={slices}" if slices != 1 else "")


def _message(tp: int, size: int, mesh) -> jax.Array:
    """Each rank's bf16 N(0, 1) block of `size` bytes: [tp * elements] split over the mesh,
    or [tp, elements] under vmap."""
    elements = size // 2
    x = jax.random.normal(jax.random.key(size + tp), (tp, elements), jnp.bfloat16)
    if mesh is None:
        return x
    return jax.device_put(x.reshape(-1), NamedSharding(mesh, P("tp")))


def run(args) -> dict:
    sizes = [int(s * MiB) for s in args.sizes_mib]
    sizes_tp = args.tp or [tp for tp in (2, 4, 8) if tp <= jax.device_count()]
    groups = [(args.emulate, None)] if args.emulate else [(tp, tp_mesh(tp)) for tp in sizes_tp]
    rows, comparisons = [], []
    variants = [(c, s, a) for c in args.codecs for s in args.slices for a in args.algorithms]
    for tp, mesh in groups:
        for size in sizes:
            x = _message(tp, size, mesh)
            checks = {(c, a): _check(tp, c, a, x, mesh) for c, _, a in variants}
            for op in args.ops:
                timed = variants if op == "all_reduce" else _pair_variants(variants)
                # `inner` dependent collectives and nothing else: an all-reduce of bf16 N(0, 1)
                # data grows by N per step, far from overflow for the default.
                samplers = {"lax": _sampler(_op(op, "lax", 1, "-"), x, args.inner, mesh)}
                for codec, slices, algorithm in timed:
                    samplers[variant_name(codec, algorithm, slices)] = _sampler(
                        _op(op, codec, slices, algorithm), x, args.inner, mesh
                    )
                result = timing.compare(samplers, "lax", **compare_options(args))
                comparisons.append(dict(tp=tp, bytes=size, op=OPS[op], **result))
                rows += _rows(tp, size, OPS[op], timed, checks, result, mesh)
                for row in rows[-len(samplers) :]:
                    print(_format(row), flush=True)
    return dict(emulated=bool(args.emulate), inner=args.inner, rows=rows, comparisons=comparisons)


def _pair_variants(variants: list[tuple]) -> list[tuple]:
    """The pair's variants: its exchange is the fused kernel ("fused"), the policy's ("auto")
    or NCCL's ("-", under one- and two-shot alike), each timed once."""
    out = []
    for codec, slices, algorithm in variants:
        exchange = (codec, slices, algorithm if algorithm in ("fused", "auto") else "-")
        if exchange not in out:
            out.append(exchange)
    return out


def _rows(tp, size, op, variants, checks, result, mesh) -> list[dict]:
    """One row per timed collective of a comparison: its median seconds and, for the
    compressed ones, the speedup over the lax collective (median, interval, verdict)."""
    times, summary = result["times_s"], result["summary"]
    bus_factor = 2 * (tp - 1) / tp  # both ops move every byte twice: (N-1)/N in each phase
    out = []
    for codec, slices, algorithm in [("lax", 1, "-"), *variants]:
        name = "lax" if codec == "lax" else variant_name(codec, algorithm, slices)
        seconds = sorted(times[name])[len(times[name]) // 2]
        row = dict(tp=tp, bytes=size, op=op, codec=codec, slices=slices, seconds=seconds)
        row.update(algbw_gbs=size / seconds / 1e9, busbw_gbs=size * bus_factor / seconds / 1e9)
        if codec == "lax":
            row.update(algorithm="-", speedup=1.0, aa=summary[timing.AA_RATIO])
        else:
            all_reduce = op == OPS["all_reduce"]
            chosen = _chosen(codec, algorithm, tp, size, mesh) if all_reduce else algorithm
            row["algorithm"] = chosen
            s = summary[name]
            row.update(speedup=s["median"], interval=s["interval"], verdict=s["verdict"])
            row.update(checks.get((codec, algorithm), {}))
        out.append(row)
    return out


def _format(row: dict) -> str:
    extra = f" err={row['rel_err']:.4f} same={row['rank_identical']}" if "rel_err" in row else ""
    if "interval" in row:
        lo, hi = row["interval"]
        extra += f" {row['speedup']:.3f}x [{lo:.3f}, {hi:.3f}] {row['verdict']}"
    else:
        lo, hi = row["aa"]["interval"]
        extra += f" A/A [{lo:.3f}, {hi:.3f}]"
    return (
        f"tp={row['tp']} {row['bytes'] / MiB:8.2f} MiB {row['op']:26s} {row['codec']:14s} "
        f"{row['algorithm']:14s} D={row['slices']:2d} {row['seconds'] * 1e6:10.1f} us "
        f"bus {row['busbw_gbs']:7.1f} GB/s{extra}"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--codecs", nargs="+", default=["taco"])
    p.add_argument("--slices", type=int, nargs="+", default=[1])
    p.add_argument("--algorithms", nargs="+", default=["auto"], choices=tj.collectives.ALGORITHMS)
    p.add_argument("--ops", nargs="+", default=["all_reduce", "pair"], choices=tuple(OPS))
    p.add_argument("--tp", type=int, nargs="+", default=[], help="TP sizes (default 2, 4, 8)")
    p.add_argument("--emulate", type=int, default=0, help="N ranks under vmap on one device")
    p.add_argument("--inner", type=int, default=5, help="collectives per sample")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats (a CPU check)")
    timed_script_options(p, budget_s=30.0, max_repeats=30)
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.smoke:
        args.sizes_mib, args.inner, args.min_repeats, args.max_repeats = [0.0625], 2, 2, 2
    if not args.emulate and jax.device_count() < 2:
        sys.exit(f"needs >= 2 devices (or --emulate N), have {jax.device_count()}")
    write_record("collectives", args.out, suffix=args.suffix, **run(args))


if __name__ == "__main__":
    main()
