"""Launch shapes of the decode-sum kernel for few peers and large outputs (one-shot at N = 2).

Times `pallas_kernels.decode_sum(codec, wire[P, B], n, bf16)` with the default launch and with
each candidate `BlockConfig`, inside one jitted program (`_common.in_program_seconds`, so JAX's
per-call dispatch is not counted), beside an XLA copy of the same bytes (read the P wires, write
the bf16 output). Checks every candidate's output against the default's first.

    python benchmarks/decode_sum_launch.py --sizes-mib 64 1024 --peers 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import in_program_seconds, write_record

import pallas_kernels as pk
from taco_jax import codecs

MiB = 1 << 20
CANDIDATES = [
    pk.BlockConfig(groups_per_tile=64, tiles_per_program=2, hadamard_dot=16, num_stages=1),
    pk.BlockConfig(groups_per_tile=64, tiles_per_program=1, hadamard_dot=16, num_stages=1),
    pk.BlockConfig(groups_per_tile=32, tiles_per_program=2, hadamard_dot=32, num_stages=1),
    pk.BlockConfig(
        groups_per_tile=64, tiles_per_program=2, hadamard_dot=16, num_warps=8, num_stages=1
    ),  # fmt: skip
]


def run(args) -> dict:
    codec = codecs.get_codec(args.codec)
    if codec.bits != 8:  # the copy below reads one byte per element
        sys.exit(f"--codec {args.codec}: this study times codecs of one byte per element")
    rows = []
    for size_mib in args.sizes_mib:
        n = int(size_mib * MiB) // 2  # bf16 output elements
        x = jax.random.normal(jax.random.key(n), (args.peers, n), jnp.bfloat16)
        wires = [pk.encode(codec, x)]
        wires.append(pk.encode(codec, x * 0.5))  # a second input set, so L2 serves neither
        io_bytes = wires[0].size + 2 * n
        # The same traffic through one XLA pass: read n bytes of each wire, write n bf16.
        copy = jax.jit(lambda w, n=n: jnp.sum(w[:, :n].astype(jnp.bfloat16), axis=0))
        copy_s = in_program_seconds(copy, [(w,) for w in wires], args.calls)
        default = pk.decode_sum(codec, wires[0], n, jnp.bfloat16)
        configs = [("default", None)] + [(str(c), c) for c in CANDIDATES]
        for label, config in configs:
            fn = jax.jit(
                lambda w, c=config, n=n: pk.decode_sum(codec, w, n, jnp.bfloat16, config=c)
            )
            out = fn(wires[0])
            same = bool(np.array_equal(np.asarray(out), np.asarray(default)))
            seconds = in_program_seconds(fn, [(w,) for w in wires], args.calls)
            config_of = config or pk.block_config(codec.group_size, n // codec.group_size,
                                                  peers=args.peers)  # fmt: skip
            rows.append(dict(bytes=int(size_mib * MiB), peers=args.peers, label=label,
                             config=dataclasses.asdict(config_of), seconds=seconds,
                             tbps=io_bytes / seconds / 1e12, of_copy=copy_s / seconds,
                             equal_to_default=same))  # fmt: skip
            print(f"{size_mib:7.0f} MiB {label[:90]:90s} {seconds * 1e3:7.3f} ms "
                  f"{rows[-1]['tbps']:5.2f} TB/s {rows[-1]['of_copy']:4.0%} of copy "
                  f"same={same}", flush=True)  # fmt: skip
    return {"codec": args.codec, "rows": rows, "calls_per_program": args.calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 1024])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--codec", default="taco")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    write_record("decode_sum_launch", args.out, **run(args))


if __name__ == "__main__":
    main()
