"""Times the fused TAH-Quant kernels (`pallas_kernels.tahquant_kernel`) against a copy of the
same bytes and against their jnp references, on one GPU (BENCHMARKS.md, "Pipeline codec kernels").

    python -m benchmarks.stage_kernels --out $OUT

For each bf16 message size (one row, as `compressed_ppermute` encodes a stage's activation), each
data set (`--data`: Gaussian, Student-t, outlier channels; the encode of the G = 128 codecs
skips the pivot's swap and H_32 on tiles without a flagged group, so the data moves its time)
and each stage codec (or SDP4Bit code: `--codecs tlq_hs4 qwd`): encode (bf16 -> wire) and
decode (wire -> bf16), fused and reference, interleaved with an XLA negate of the bf16 message
(the copy, the baseline) and its A/A control (`timing.compare`). Samples are host-dispatched
batches (`timing.batched`), inputs rotating over >= 256 MiB so that nothing is served from L2.
Bandwidth is logical IO (bytes read + bytes written, once each); "of copy" divides it by the
copy's (read + write). Each size first compares the kernels' outputs with the reference on one
message (moved codes, largest decode difference, in the record); a code moved by more than one
step stops the run before it writes its record.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import activation_like, write_record
from pallas_kernels import tahquant_kernel as tk
from taco_jax import sdp4bit, tahquant, timing

MiB = 1 << 20
ROTATE_BYTES = 256 * MiB


DATA = ("gaussian", "student_t3", "outlier_channels")  # `_common.activation_like`'s sets
# SDP4Bit's codes run on the same kernels (`taco_jax.sdp4bit`): --codecs takes their names too.
SDP4BIT_CODECS = {c.name: c for c in (sdp4bit.TLQ_INNER, sdp4bit.TLQ_OUTER, sdp4bit.QWD)}


def _codec(name: str) -> tahquant.TahQuant:
    """A stage codec (`tahquant.STAGE_CODEC_NAMES`) or an SDP4Bit code (`SDP4BIT_CODECS`)."""
    return SDP4BIT_CODECS.get(name) or tahquant.get_stage_codec(name)


def _messages(size: int, data: str = "gaussian") -> tuple[jax.Array, list[tuple]]:
    """(key, bf16 rows [1, size / 2] of `data` as 1-tuples): enough distinct messages to
    cover ROTATE_BYTES (at least 2)."""
    count = max(2, ROTATE_BYTES // size)
    xs = [
        (activation_like(1, size // 2, seed=size + i, dof=3)[data].astype(jnp.bfloat16),)
        for i in range(count)
    ]
    return jax.random.key(size), xs


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


def bench(size: int, names, data: str = "gaussian", **compare) -> tuple[dict, dict]:
    """One size and data set: every codec's encode and decode, fused and reference, against
    the copy; (row, comparison)."""
    elements = size // 2
    key, xs = _messages(size, data)
    samplers = {"copy": timing.batched(jax.jit(lambda x: -x), xs)}
    row = {"bytes": size, "data": data}
    io = {}
    for name in names:
        codec = _codec(name)
        keys = [jax.random.fold_in(key, 1000 + i) for i in range(len(xs))]
        enc_in = [(x, k) for (x,), k in zip(xs, keys, strict=True)]
        wires = [(tahquant.encode_wire(codec, x, k),) for x, k in enc_in]
        ops = {
            "encode": (
                lambda x, k, c=codec: tk.encode(c, x, k),
                lambda x, k, c=codec: tahquant.encode_wire(c, x, k),
                enc_in,
            ),
            "decode": (
                lambda w, c=codec: tk.decode(c, w, elements, jnp.bfloat16),
                lambda w, c=codec: tahquant.decode_wire(c, w, elements, jnp.bfloat16),
                wires,
            ),
        }
        for op, (fused, reference, inputs) in ops.items():
            samplers[f"{name} {op}"] = timing.batched(jax.jit(fused), inputs)
            samplers[f"{name} {op} reference"] = timing.batched(jax.jit(reference), inputs)
        io[name] = size + codec.wire_bytes(elements)  # bf16 in, wire out (and the reverse)
        row[name] = {
            "bits_per_element": codec.bits_per_element,
            "check": _check(codec, xs[0][0], keys[0]),
        }
    result = timing.compare(samplers, "copy", **compare)
    times, summary = result["times_s"], result["summary"]
    median = lambda label: sorted(times[label])[len(times[label]) // 2]  # noqa: E731
    row.update(copy_s=median("copy"), copy_tbps=2 * size / median("copy") / 1e12)
    for name in names:
        scale = io[name] / (2 * size)  # the op's bytes over the copy's
        for op in ("encode", "decode"):
            label, share = f"{name} {op}", summary[f"{name} {op}"]
            row[name][op] = {
                "kernel_s": median(label),
                "ref_s": median(f"{label} reference"),
                "kernel_tbps": io[name] / median(label) / 1e12,
                "of_copy": share["median"] * scale,
                "of_copy_interval": [v * scale for v in share["interval"]],
                "speedup_over_ref": median(f"{label} reference") / median(label),
            }
    print("BENCH", json.dumps(row), flush=True)
    return row, dict(bytes=size, data=data, **result)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 16, 64, 256])
    parser.add_argument("--codecs", nargs="+", default=list(tahquant.STAGE_CODEC_NAMES))
    parser.add_argument(
        "--data",
        nargs="+",
        choices=DATA,
        default=["gaussian"],
        help="message data (`_common.activation_like`)",
    )
    parser.add_argument("--budget-s", type=float, default=30.0, help="per size and data set")
    parser.add_argument("--max-repeats", type=int, default=20)
    parser.add_argument("--suffix", default="", help="appended to the record's file name")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("stage_kernels times compiled GPU kernels: run it on a GPU")
    runs = [
        bench(int(s * MiB), args.codecs, data, budget_s=args.budget_s, max_repeats=args.max_repeats)
        for s in args.sizes_mib
        for data in args.data
    ]
    rows = [row for row, _ in runs]
    np.testing.assert_array_less(  # checked before anything is recorded: a code moves by <= 1
        [row[n]["check"]["max_code_step"] for row in rows for n in args.codecs], 2
    )
    write_record(
        "stage_kernels",
        args.out,
        suffix=args.suffix,
        results=rows,
        comparisons=[c for _, c in runs],
    )
    print(
        "\n| size | data | codec | tiles pivoted | encode % of copy | decode % of copy | "
        "vs reference (enc/dec) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        for name in args.codecs:
            e, d = row[name]["encode"], row[name]["decode"]
            print(
                f"| {row['bytes'] / MiB:g} MiB | {row['data']} | {name} | "
                f"{100 * row[name]['check']['pivoted_tiles']:.0f}% | {100 * e['of_copy']:.0f}% | "
                f"{100 * d['of_copy']:.0f}% | {e['speedup_over_ref']:.1f}x / "
                f"{d['speedup_over_ref']:.1f}x |"
            )


if __name__ == "__main__":
    main()
