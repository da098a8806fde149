"""SDP4Bit's H_32 smoothing on one device: the library's matmul form (`sdp4bit.smoothed`, a dot
by S_32 at HIGHEST precision) against the same transform as five butterflies
(`tahquant.butterflies_by_axes`), each on a gradient leaf alone and on that leaf concatenated
with two small ones, as a ZeRO-1 bucket lays them out (`taco_train.zero._Buckets.rows`:
[ranks, S_1 + S_2 + S_3], flattened), with a leading axis of `--dp` emulated ranks.

Time: `_common.in_program_seconds` (16 dependent calls in one jitted program, median of 7
programs), against an XLA negate of the same fp32 bytes in the same run. Before timing, the
butterflies are compared with the matmul (the same transform up to fp32 rounding). The record
also keeps, per variant, whether the compiled program calls a cuBLAS GEMM or a Triton GEMM
fusion, and how many fusions it holds.

    python benchmarks/smoothing.py --out $OUT     # GPT-350M's attn.wo, bo and bqkv at dp = 2
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

# The repository root first, so that the packages of this checkout are the ones timed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import in_program_seconds, write_record  # noqa: E402

from taco_jax import sdp4bit, tahquant  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CALLS = 16


def smoothed_by_butterflies(x: jax.Array) -> jax.Array:
    """`sdp4bit.smoothed` as five butterflies per block of 32 instead of a dot."""
    blocks = x.reshape(-1, sdp4bit.HADAMARD_BLOCK)
    bits = sdp4bit.HADAMARD_BLOCK.bit_length() - 1
    return (tahquant.butterflies_by_axes(blocks, bits) * tahquant.PIVOT_UNIT).reshape(x.shape)


def bucket_rows(parts: list[jax.Array], ranks: int) -> jax.Array:
    """The leaves' padded shards side by side, [ranks, sum S_i], flattened (one dp rank)."""
    return jnp.concatenate([p.reshape(ranks, -1) for p in parts], axis=1).reshape(-1)


def variants(small: list[jax.Array], ranks: int) -> dict:
    """name -> fn([dp, n] leaf) over every emulated dp rank."""
    per_rank = {
        "matmul, leaf": sdp4bit.smoothed,
        "matmul, bucket": lambda x: sdp4bit.smoothed(bucket_rows([x, *small], ranks)),
        "butterflies, leaf": smoothed_by_butterflies,
        "butterflies, bucket": lambda x: smoothed_by_butterflies(bucket_rows([x, *small], ranks)),
        "copy (negate), leaf": jnp.negative,
    }
    return {name: jax.vmap(fn) for name, fn in per_rank.items()}


def compiled_summary(fn, x) -> dict:
    text = jax.jit(fn).lower(x).compile().as_text()
    return {
        "cublas_gemm": bool(re.search(r'custom_call_target="__cublas', text)),
        "triton_gemm": "__triton_gemm" in text,
        "fusions": len(re.findall(r"= \S+ fusion\(", text)),
    }


def check_butterflies(x: jax.Array) -> float:
    """Max |butterflies - matmul| over max |matmul|: fp32 rounding of sums of 32 terms."""
    want = np.asarray(jax.jit(sdp4bit.smoothed)(x[0]), np.float64)
    got = np.asarray(jax.jit(smoothed_by_butterflies)(x[0]), np.float64)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    # 32 terms summed in fp32 either way: |error| <= 32 x 2^-24 of the largest |sum|, twice.
    if not err <= 64 * 2.0**-24:
        raise AssertionError(f"butterflies differ from the matmul by {err:.3g} (relative)")
    return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=25165824, help="the large leaf")
    parser.add_argument("--small", type=int, nargs="*", default=[24576, 73728],
                        help="the small leaves sharing its bucket")  # fmt: skip
    parser.add_argument("--ranks", type=int, default=2, help="ZeRO's dp ranks (rows)")
    parser.add_argument("--dp", type=int, default=2, help="emulated dp ranks (leading axis)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS))
    args = parser.parse_args()

    keys = jax.random.split(jax.random.key(0), 2 + len(args.small))
    inputs = [(jax.random.normal(k, (args.dp, args.elements)),) for k in keys[:2]]
    small = [jax.random.normal(k, (n,)) for k, n in zip(keys[2:], args.small, strict=True)]
    error = check_butterflies(inputs[0][0])
    rows = []
    for name, fn in variants(small, args.ranks).items():
        seconds = in_program_seconds(fn, inputs, CALLS)
        rows.append({"variant": name, "us": 1e6 * seconds, **compiled_summary(fn, inputs[0][0])})
        print(f"{name:24s} {rows[-1]['us']:9.1f} us  {rows[-1]}", flush=True)
    copy = rows[-1]["us"]
    for row in rows:
        row["x_copy"] = row["us"] / copy
    write_record(
        "smoothing",
        args.out,
        elements=args.elements,
        small=args.small,
        ranks=args.ranks,
        dp=args.dp,
        calls=CALLS,
        butterflies_vs_matmul_rel=error,
        results=rows,
    )


if __name__ == "__main__":
    main()
