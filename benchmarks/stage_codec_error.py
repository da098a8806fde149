"""Accuracy of the pipeline stage codecs at their bits per element (numerics: the CPU is enough).

Encodes and decodes rows of activation-like data with every stage codec of
`taco_jax.compressed_ppermute` (fixed-bit TAH-Quant and the adaptive 3/4-bit allocations at equal
bits: entropy, the paper's rule; absmax; a fixed alternating pattern) and reports the relative
L2 error ||decode(encode(x)) - x|| / ||x||, the mean over `--keys` stochastic-rounding keys, beside
the wire's bits per element. Data (rows of `--size` values, the channels of tokens):
Gaussian; Student-t with 3 degrees of freedom (heavy tails); Gaussian with 1% of channels 30x
larger (outlier features). Writes `stage_codec_error-<date>.json` to `--out` and prints a table.

    python benchmarks/stage_codec_error.py
"""

from __future__ import annotations

import argparse
import pathlib

import jax
from _common import activation_like, write_record

from taco_jax import tahquant, tahquant_adaptive
from taco_jax.telemetry import relative_error

RESULTS = pathlib.Path(__file__).parent / "results"


def candidates() -> dict[str, tuple[object, object]]:
    """label -> (codec, its module): fixed 8 and 4 bits, and the 3/4-bit allocations."""
    out = {name: (tahquant.get_stage_codec(name), tahquant) for name in ("tahquant_sym",
                                                                          "tahquant4")}  # fmt: skip
    for allocation in tahquant_adaptive.ALLOCATIONS:
        codec = tahquant_adaptive.AdaptiveTahQuant(allocation=allocation)
        out[f"adaptive 3.5 ({allocation})"] = (codec, tahquant_adaptive)
    out["fixed 3-bit (budget 3)"] = (tahquant_adaptive.AdaptiveTahQuant(budget=3.0),
                                     tahquant_adaptive)  # fmt: skip
    return out


def measure(codec, module, x: jax.Array, keys) -> float:
    roundtrip = jax.jit(lambda v, k: module.decode_wire(codec, module.encode_wire(codec, v, k),
                                                        v.shape[-1]))  # fmt: skip
    return sum(float(relative_error(roundtrip(x, k), x)) for k in keys) / len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--keys", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    data = activation_like(args.rows, args.size, args.seed, dof=3.0)
    keys = list(jax.random.split(jax.random.key(args.seed + 1), args.keys))
    results = []
    for label, (codec, module) in candidates().items():
        row = {"codec": label, "bits_per_element": codec.bits_per_element}
        row.update({name: measure(codec, module, x, keys) for name, x in data.items()})
        results.append(row)
    write_record("stage_codec_error", args.out, rows=args.rows, size=args.size, keys=args.keys,
                 seed=args.seed, results=results)  # fmt: skip
    print("| codec | bits/elem | " + " | ".join(data) + " |")
    print("|---" * (2 + len(data)) + "|")
    for r in results:
        cells = " | ".join(f"{r[name]:.4f}" for name in data)
        print(f"| {r['codec']} | {r['bits_per_element']:.4g} | {cells} |")


if __name__ == "__main__":
    main()
