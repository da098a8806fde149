"""Times the fused TAH-Quant kernels (`pallas_kernels.tahquant_kernel`) against a copy of the
same bytes and against their jnp references, on one GPU (BENCHMARKS.md, "Pipeline codec kernels").

    PYTHONPATH=. python benchmarks/stage_kernels.py --out $OUT

For each bf16 message size (one row, as `compressed_ppermute` encodes a stage's activation), each
data set (`--data`: Gaussian, Student-t, outlier channels; the encode of the G = 128 codecs
skips the pivot's swap and H_32 on tiles without a flagged group, so the data moves its time)
and each stage codec (or SDP4Bit code: `--codecs tlq_hs4 qwd`): encode (bf16 -> wire) and
decode (wire -> bf16), fused and reference.
Bandwidth is logical IO (bytes read + bytes written, once each); "of copy" divides it by the
bandwidth of an XLA negate of a bf16 array of the same size (read + write), timed in the same
run. Timings: host-dispatched batches (`_common.batched_seconds`), inputs rotating over
>= 256 MiB so that nothing is served from L2. Each size first compares the kernels' outputs
with the reference on one message (moved codes, largest decode difference, in the record); a
code moved by more than one step stops the run before it writes its record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from _common import activation_like, batched_seconds, write_record

from pallas_kernels import tahquant_kernel as tk
from pallas_kernels.config import BlockConfig
from taco_jax import sdp4bit, tahquant

MiB = 1 << 20
ROTATE_BYTES = 256 * MiB


DATA = ("gaussian", "student_t3", "outlier_channels")  # `_common.activation_like`'s sets
# SDP4Bit's codes run on the same kernels (`taco_jax.sdp4bit`): --codecs takes their names too.
SDP4BIT_CODECS = {c.name: c for c in (sdp4bit.TLQ_INNER, sdp4bit.TLQ_OUTER, sdp4bit.QWD)}


def _codec(name: str) -> tahquant.TahQuant:
    """A stage codec (`tahquant.STAGE_CODEC_NAMES`) or an SDP4Bit code (`SDP4BIT_CODECS`)."""
    return SDP4BIT_CODECS.get(name) or tahquant.get_stage_codec(name)


def _messages(size: int, data: str = "gaussian") -> tuple[jax.Array, list[tuple], float]:
    """(key, bf16 rows [1, size / 2] of `data` as 1-tuples, copy seconds): enough distinct
    messages to cover ROTATE_BYTES (at least 2), and an XLA negate of one timed over them."""
    key = jax.random.key(size)
    count = max(2, ROTATE_BYTES // size)
    xs = [(activation_like(1, size // 2, seed=size + i, dof=3)[data].astype(jnp.bfloat16),)
          for i in range(count)]  # fmt: skip
    t_copy, _ = batched_seconds(jax.jit(lambda x: -x), xs)
    return key, xs, t_copy


def _pivoted_tiles(codec, wire, n: int) -> float:
    """The fraction of the encode kernel's tiles holding a flagged group (those run the swap
    and H_32; the others skip them)."""
    pivots = tahquant.unpack_sides(codec, wire, n)["pivots"] & tahquant.PIVOT_FLAG
    per_tile = tk.encode_config(codec, 1, n).groups_per_tile
    flagged = jnp.max(pivots.reshape(-1, per_tile), axis=-1) > 0
    return float(jnp.mean(flagged))


def _check(codec, x, key) -> dict:
    """The fused kernels against the reference: moved codes (count, largest step), side values
    (largest relative difference of the fp32 ones, count of differing pivot bytes), the
    largest decode error."""
    n = x.shape[-1]
    wire, ref = tk.encode(codec, x, key), tahquant.encode_wire(codec, x, key)
    codes = tahquant.unpack_codes(codec, wire[:, : codec.code_bytes(n)])
    ref_codes = tahquant.unpack_codes(codec, ref[:, : codec.code_bytes(n)])
    decoded = tk.decode(codec, ref, n, jnp.float32)
    want = tahquant.decode_wire(codec, ref, n)
    scale = float(jnp.max(jnp.abs(want)))
    out = {
        "pivoted_tiles": _pivoted_tiles(codec, ref, n) if codec.pivot else 0.0,
        "moved_codes": int(jnp.sum(codes != ref_codes)),
        "max_code_step": int(jnp.max(jnp.abs(codes - ref_codes))),
        "decode_max_err_rel": float(jnp.max(jnp.abs(decoded - want))) / scale,
    }
    sides, ref_sides = tahquant.unpack_sides(codec, wire, n), tahquant.unpack_sides(codec, ref, n)
    for field, expected in ref_sides.items():
        if field == "pivots":
            out["pivots_differing"] = int(jnp.sum(sides[field] != expected))
        else:
            rel = jnp.abs(sides[field] - expected) / jnp.maximum(jnp.abs(expected), 1e-30)
            out[f"{field}_max_rel"] = float(jnp.max(rel))
    return out


def bench(size: int, names, data: str = "gaussian") -> dict:
    elements = size // 2
    key, xs, t_copy = _messages(size, data)
    row = {"bytes": size, "data": data, "copy_s": t_copy, "copy_tbps": 2 * size / t_copy / 1e12}
    copy_bw = 2 * size / t_copy
    for name in names:
        codec = _codec(name)
        wire_bytes = codec.wire_bytes(elements)
        keys = [jax.random.fold_in(key, 1000 + i) for i in range(len(xs))]
        enc_in = [(x, k) for (x,), k in zip(xs, keys, strict=True)]
        wires = [(tahquant.encode_wire(codec, x, k),) for x, k in enc_in]
        ops = {
            "encode": (jax.jit(lambda x, k, c=codec: tk.encode(c, x, k)),
                       jax.jit(lambda x, k, c=codec: tahquant.encode_wire(c, x, k)), enc_in),
            "decode": (jax.jit(lambda w, c=codec: tk.decode(c, w, elements, jnp.bfloat16)),
                       jax.jit(lambda w, c=codec: tahquant.decode_wire(c, w, elements,
                                                                        jnp.bfloat16)), wires),
        }  # fmt: skip
        entry = {"bits_per_element": codec.bits_per_element,
                 "check": _check(codec, xs[0][0], keys[0])}  # fmt: skip
        io = size + wire_bytes  # bf16 in, wire out (and the reverse)
        for op, (fused, ref, inputs) in ops.items():
            t_k, spread = batched_seconds(fused, inputs)
            t_r, _ = batched_seconds(ref, inputs, reps=5)
            entry[op] = {
                "kernel_s": t_k,
                "ref_s": t_r,
                "kernel_tbps": io / t_k / 1e12,
                "of_copy": io / t_k / copy_bw,
                "speedup_over_ref": t_r / t_k,
                "spread": spread,
            }
        row[name] = entry
        del wires
    print("BENCH", json.dumps(row), flush=True)
    return row


SWEEP = [(groups, warps) for groups in (16, 32, 64, 128) for warps in (2, 4, 8)]


def sweep(size: int, names) -> list[dict]:
    """Encode / decode time of each launch (groups per tile x warps, `BlockConfig`) at `size`."""
    elements = size // 2
    key, xs, t_copy = _messages(size)
    out = []
    for name in names:
        codec = _codec(name)
        io = size + codec.wire_bytes(elements)
        enc_in = [(x, jax.random.fold_in(key, i)) for i, (x,) in enumerate(xs)]
        wires = [(tahquant.encode_wire(codec, x, k),) for x, k in enc_in]
        for groups, warps in SWEEP:
            if groups * codec.group_size > 16384:
                continue
            cfg = BlockConfig(groups, num_warps=warps, num_stages=1)
            enc = jax.jit(lambda x, k, c=codec, f=cfg: tk.encode(c, x, k, config=f))
            dec = jax.jit(lambda w, c=codec, f=cfg: tk.decode(c, w, elements, jnp.bfloat16,
                                                              config=f))  # fmt: skip
            row = {"codec": name, "groups_per_tile": groups, "num_warps": warps}
            for op, fn, inputs in (("encode", enc, enc_in), ("decode", dec, wires)):
                t, _ = batched_seconds(fn, inputs)
                row[op + "_of_copy"] = (io / t) / (2 * size / t_copy)
            print("SWEEP", json.dumps(row), flush=True)
            out.append(row)
    return out


# label: the TahQuant fields switched off
ABLATIONS = {
    "full": {},
    "no noise (round to nearest)": {"stochastic": False},
    "no pivot": {"pivot": False},
    "neither": {"stochastic": False, "pivot": False},
}


def ablate(size: int, names, data: str = "gaussian") -> list[dict]:
    """Encode time of each codec with its pivot and / or stochastic rounding switched off
    (real codecs, `TahQuant` fields): where the encode's arithmetic goes."""
    elements = size // 2
    key, xs, t_copy = _messages(size, data)
    out = []
    for name in names:
        for label, fields in ABLATIONS.items():
            codec = dataclasses.replace(_codec(name), **fields)
            enc = jax.jit(lambda x, k, c=codec: tk.encode(c, x, k if c.stochastic else None))
            inputs = [(x, jax.random.fold_in(key, i)) for i, (x,) in enumerate(xs)]
            t, _ = batched_seconds(enc, inputs)
            io = size + codec.wire_bytes(elements)
            row = {"codec": name, "data": data, "variant": label, "encode_s": t,
                   "encode_of_copy": (io / t) / (2 * size / t_copy)}  # fmt: skip
            print("ABLATE", json.dumps(row), flush=True)
            out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--codecs", nargs="+", default=list(tahquant.STAGE_CODEC_NAMES))
    parser.add_argument("--data", nargs="+", choices=DATA, default=["gaussian"],
                        help="message data (`_common.activation_like`)")  # fmt: skip
    parser.add_argument("--sweep-mib", type=float, default=None,
                        help="also time launch configurations at this size")  # fmt: skip
    parser.add_argument("--ablate-mib", type=float, default=None,
                        help="also time the encode without pivot / noise at this size")  # fmt: skip
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("stage_kernels.py times compiled GPU kernels: run it on a GPU")
    rows = [bench(int(s * MiB), args.codecs, data) for s in args.sizes_mib for data in args.data]
    np.testing.assert_array_less(  # checked before anything is recorded: a code moves by <= 1
        [row[n]["check"]["max_code_step"] for row in rows for n in args.codecs], 2
    )
    swept = sweep(int(args.sweep_mib * MiB), args.codecs) if args.sweep_mib else []
    ablated = [row for data in args.data if args.ablate_mib
               for row in ablate(int(args.ablate_mib * MiB), args.codecs, data)]  # fmt: skip
    write_record("stage_kernels", args.out, results=rows, launch_sweep=swept, ablation=ablated)
    print(
        "\n| size | data | codec | tiles pivoted | encode % of copy | decode % of copy | "
        "vs reference (enc/dec) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        for name in args.codecs:
            e, d = row[name]["encode"], row[name]["decode"]
            print(f"| {row['bytes'] / MiB:g} MiB | {row['data']} | {name} | "
                  f"{100 * row[name]['check']['pivoted_tiles']:.0f}% | {100 * e['of_copy']:.0f}% | "
                  f"{100 * d['of_copy']:.0f}% | {e['speedup_over_ref']:.1f}x / "
                  f"{d['speedup_over_ref']:.1f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
