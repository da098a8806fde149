"""The matmul with the encode in its epilogue against XLA's matmul then the encode (one GPU).

Per shape (tokens x K x H: a row-parallel projection's input, weight and output), the device
time of one call inside one jitted program of `--calls` dependent calls
(`_common.in_program_seconds`): XLA's matmul alone; XLA's matmul then `pallas_kernels.encode`
("auto") of the product as it lies (what the collectives encode today) and in the fused
kernel's `tile_major` order (`matmul_encode(backend="unfused")`, an XLA transpose more); the
fused kernel given the folded weight (`matmul_encode_kernel`), the fold of a weight, which a
step needs once per weight, and the fused kernel with the Hadamard in its epilogue instead
(no fold: `hadamard="epilogue"`). The record is rewritten after each shape. Findings:
docs/development_history.md, "The encode in a warp-specialized matmul's epilogue".

    python benchmarks/matmul_encode.py --out $OUT
    python benchmarks/matmul_encode.py --shapes 16384x768x768 2048x768x768 --codec int8_hadamard
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from _common import in_program_seconds, write_record

import pallas_kernels as pk
from pallas_kernels import matmul_encode_mosaic as mem
from taco_jax import codecs

# The row-parallel projections of the emulated steps (BENCHMARKS.md, "Training step"): GPT-125M
# at TP = 4 (16384 tokens; attention out K = 768 / 4, MLP down K = 3072 / 4) and GPT-1.3B at
# TP = 2 (8192 tokens; K = 2048 / 2 and 8192 / 2), then smaller products.
SHAPES = ("16384x192x768", "16384x768x768", "8192x1024x2048", "8192x4096x2048",
          "8192x768x768", "4096x768x768", "2048x768x768", "512x256x512")  # fmt: skip


def _operands(m: int, k: int, h: int):
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (0.05 * jax.random.normal(kb, (k, h), jnp.float32)).astype(jnp.bfloat16)
    return a, b


def time_shape(codec, shape: str, calls: int) -> dict:
    m, k, h = (int(d) for d in shape.split("x"))
    a, b = _operands(m, k, h)
    folded = mem.fold_hadamard(codec, b)
    inputs, weights = [(a,), (a * 1.5,)], [(b,), (b * 1.5,)]
    us = lambda fn, xs=inputs: 1e6 * in_program_seconds(fn, xs, calls)  # noqa: E731
    row = {"shape": shape, "m": m, "k": k, "h": h}
    row["xla_matmul_us"] = us(lambda x: x @ b)
    row["unfused_us"] = us(lambda x: pk.encode(codec, (x @ b).reshape(1, -1)))
    row["unfused_tile_major_us"] = us(lambda x: pk.matmul_encode(codec, x, b, backend="unfused"))
    row["fused_us"] = us(lambda x: mem.matmul_encode_kernel(codec, x, folded))
    row["fold_us"] = us(lambda w: mem.fold_hadamard(codec, w), weights)
    row["fused_epilogue_us"] = us(
        lambda x: mem.matmul_encode_kernel(codec, x, b, hadamard="epilogue")
    )
    print(
        f"{shape:>16}  matmul {row['xla_matmul_us']:7.1f} us, then encode "
        f"{row['unfused_us']:7.1f} (tile-major {row['unfused_tile_major_us']:7.1f}), fused "
        f"{row['fused_us']:7.1f} + the fold {row['fold_us']:5.1f}, Hadamard in the epilogue "
        f"{row['fused_epilogue_us']:7.1f}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", default="taco")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="MxKxH")
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--suffix", default="")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    codec = codecs.get_codec(args.codec)
    rows = []
    for shape in args.shapes:
        rows.append(time_shape(codec, shape, args.calls))
        write_record(
            "matmul_encode", args.out, suffix=args.suffix, codec=args.codec, calls=args.calls,
            timing="device time of one call in one program of `calls` dependent calls, "
            "median of 7 programs", rows=rows,
        )  # fmt: skip


if __name__ == "__main__":
    main()
