"""Where the time of a compressed all-reduce goes at N = 2: each piece timed alone, beside the
composed algorithms and `lax.psum`, in one run.

Pieces (per rank, bf16 message of `--sizes-mib`): the encode kernel, the exchange of the wire
(`all_gather`, `ppermute`, `all_to_all`), stacking two wires into one [2, B] buffer (what a
ppermute exchange needs before the decode-sum: an XLA copy of uint8 bytes), the decode-sum
kernel on the gathered wires, an HBM copy of the message (the memory-bound floor), and the
composed all-reduces (one-shot by all-gather or ppermute of the wire, two-shot; `slices` 1, 4
and 8). Every figure is the median of `--reps` single calls (each ended
by `block_until_ready`, after warm-up); at >= 16 MiB the per-call dispatch (~0.05 ms) is small
beside the pieces. The record also keeps, per composed algorithm, the compiled program's list of
kernels and collectives in schedule order (copies and fusions included), to show what XLA adds
between the pieces.

    python benchmarks/allreduce_breakdown.py --sizes-mib 64 1024
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
from _common import median_seconds, write_record
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taco_jax as tj
from taco_jax import _backends, codecs

MiB = 1 << 20
TP = 2


def _mesh():
    return jax.make_mesh(
        (TP,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:TP]
    )


def _one_shot_ppermute(codec, ops, x):
    """encode -> ppermute -> both wires in rank order -> decode_sum (the issue's prototype)."""
    wire = ops.encode(codec, x.reshape(1, -1))[0]
    peer = lax.ppermute(wire, "tp", [(0, 1), (1, 0)])
    first = lax.axis_index("tp") == 0
    stacked = jnp.where(first, jnp.stack([wire, peer]), jnp.stack([peer, wire]))
    return ops.decode_sum(codec, stacked, x.size, x.dtype).reshape(x.shape)


def _one_shot_ppermute_unordered(codec, ops, x):
    """As above without the rank-order select: a sum of two terms is commutative in IEEE
    arithmetic, so [own, peer] gives the same bytes on both ranks at N = 2."""
    wire = ops.encode(codec, x.reshape(1, -1))[0]
    peer = lax.ppermute(wire, "tp", [(0, 1), (1, 0)])
    return ops.decode_sum(codec, jnp.stack([wire, peer]), x.size, x.dtype).reshape(x.shape)


def _pieces(codec, ops, n):
    """name -> (per-rank function, which per-rank input it takes)."""
    b = codec.wire_bytes(n)
    return (
        {
            "lax.psum": (lambda x: lax.psum(x, "tp"), "x"),
            "hbm copy (x * 2)": (lambda x: x * 2, "x"),
            "encode": (lambda x: ops.encode(codec, x.reshape(1, -1))[0], "x"),
            "all_gather(wire)": (lambda w: lax.all_gather(w, "tp", axis=0, tiled=False), "wire"),
            "ppermute(wire)": (lambda w: lax.ppermute(w, "tp", [(0, 1), (1, 0)]), "wire"),
            "all_to_all(wire)": (
                lambda w: lax.all_to_all(w.reshape(2, b // 2), "tp", 0, 0, tiled=True),
                "wire",
            ),
            "stack two wires (uint8 copy)": (lambda w: jnp.stack([w, w]), "wire"),
            "decode_sum(gathered [2, B]) -> bf16": (
                lambda g: ops.decode_sum(codec, g, n, jnp.bfloat16),
                "gathered",
            ),
            "one_shot (ppermute, ordered)": (lambda x: _one_shot_ppermute(codec, ops, x), "x"),
            "one_shot (ppermute, [own, peer])": (
                lambda x: _one_shot_ppermute_unordered(codec, ops, x),
                "x",
            ),
        }
        | {
            f"{algorithm} D={slices}": (
                functools.partial(
                    tj.compressed_psum,
                    axis_name="tp",
                    codec=codec,
                    algorithm=algorithm,
                    slices=slices,
                    min_compress_bytes=0,  # compressed whatever the policy would choose
                ),
                "x",
            )
            for algorithm in ("two_shot", "one_shot")
            for slices in (1, 4, 8)
        }
        | (_fused_pieces(codec, n) if jax.default_backend() == "gpu" else {})
    )


def _fused_pieces(codec, n):
    """The fused encode + all-gather kernel alone (peer stores, `exchange_mosaic`) and the
    "fused" all-reduce it starts (then the decode-sum above)."""
    from pallas_kernels import exchange_mosaic

    return {
        "encode + all_gather, fused kernel": (
            lambda x: exchange_mosaic.encode_all_gather(codec, x.reshape(1, -1), "tp", TP),
            "x",
        ),
        "fused D=1": (
            functools.partial(
                tj.compressed_psum, axis_name="tp", codec=codec, algorithm="fused",
                min_compress_bytes=0,
            ),
            "x",
        ),
    }  # fmt: skip


SCHEDULE_OPS = re.compile(
    r"= \S+ (custom-call|all-gather-start|all-gather-done|all-gather|collective-permute-start|"
    r"collective-permute-done|collective-permute|all-to-all|all-reduce-start|all-reduce-done|"
    r"all-reduce|copy|fusion|concatenate|dynamic-update-slice)\("
)


def _schedule(compiled_text: str) -> list[str]:
    """The entry computation's kernels and collectives in schedule order (short names)."""
    entry = compiled_text[compiled_text.index("ENTRY") :]
    entry = entry[: entry.index("\n}")]
    order = []
    for line in entry.splitlines():
        match = SCHEDULE_OPS.search(line)
        if not match:
            continue
        target = re.search(r'custom_call_target="([^"]+)"', line)
        name = re.search(r'name="([^"]+)"', line)
        label = match.group(1)
        if target:
            label += f":{name.group(1) if name else target.group(1)}"
        if "is_sync" in line and '"is_sync":true' in line:
            label += "(sync)"
        order.append(label)
    return order


def _compiler_options(args) -> dict:
    """XLA options of the timed programs: the latency-hiding scheduler (`--lhs`), which makes
    collectives asynchronous and schedules kernels inside their windows."""
    return {"xla_gpu_enable_latency_hiding_scheduler": True} if args.lhs else {}


def run(args) -> dict:
    mesh = _mesh()
    codec = codecs.get_codec(args.codec)
    ops = _backends.get_ops(args.impl)
    rows = []
    for size_mib in args.sizes_mib:
        n = int(size_mib * MiB) // 2  # bf16 elements per rank
        x = jax.device_put(
            jax.random.normal(jax.random.key(n), (TP * n,), jnp.bfloat16),
            NamedSharding(mesh, P("tp")),
        )
        encode = jax.jit(
            jax.shard_map(
                lambda v: ops.encode(codec, v.reshape(1, -1))[0],
                mesh=mesh,
                in_specs=P("tp"),
                out_specs=P("tp"),
                check_vma=False,
            )
        )
        gather = jax.jit(
            jax.shard_map(
                lambda w: lax.all_gather(w, "tp", axis=0, tiled=False),
                mesh=mesh,
                in_specs=P("tp"),
                out_specs=P("tp"),
                check_vma=False,
            )
        )
        wire = encode(x)
        inputs = {"x": x, "wire": wire, "gathered": gather(wire)}
        for name, (fn, source) in _pieces(codec, ops, n).items():
            mapped = jax.jit(
                jax.shard_map(fn, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False),
                compiler_options=_compiler_options(args),
            )
            seconds = median_seconds(mapped, inputs[source], reps=args.reps, warmup=3)
            row = dict(bytes=int(size_mib * MiB), piece=name, ms=seconds * 1e3)
            if name.startswith(("one_shot", "two_shot", "fused")) and "D=8" not in name:
                text = mapped.lower(inputs[source]).compile().as_text()
                row["schedule"] = _schedule(text)
            rows.append(row)
            print(f"{size_mib:8.1f} MiB {name:34s} {row['ms']:8.3f} ms", flush=True)
        base = next(
            r["ms"] for r in rows if r["bytes"] == int(size_mib * MiB) and r["piece"] == "lax.psum"
        )
        for r in rows:
            if r["bytes"] == int(size_mib * MiB):
                r["speedup_vs_psum"] = base / r["ms"]
    for r in rows:
        if "schedule" in r and r["bytes"] == int(args.sizes_mib[-1] * MiB):
            print(r["piece"], "schedule:", " ".join(r["schedule"]))
    return {"codec": args.codec, "impl": args.impl, "rows": rows, "median_of": args.reps,
            "compiler_options": _compiler_options(args)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 1024])
    parser.add_argument("--codec", default="taco")
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--lhs", action="store_true", help="the latency-hiding scheduler on")
    parser.add_argument("--suffix", default="")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if jax.device_count() < TP:
        sys.exit(f"needs {TP} devices, have {jax.device_count()}")
    write_record("allreduce_breakdown", args.out, suffix=args.suffix, **run(args))


if __name__ == "__main__":
    main()
