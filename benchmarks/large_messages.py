"""Do the collectives stay right for messages whose kernel buffers pass 2^31 bytes (N = 2)?

The kernels address their buffers with 32-bit offsets (`pallas_kernels.config.MAX_BUFFER_BYTES`);
the collectives slice messages to stay below that (`taco_jax.collectives._addressable`). For
each `--ops` and `--sizes-mib` of bf16 per rank this runs the collective with the fused exchange
(`link="nvlink"`, the peer-store kernel) and through NCCL (`link="shm"`, one-shot: the same
codes moved by NCCL), every message compressed, and reports per rank the non-finite outputs of
each and their relative L2 error against the exact result (fp32 `lax.psum`, or the exact
`lax.all_gather`). Expected: no non-finite value, the one-quantization error (~0.026).

    NCCL_NVLS_ENABLE=0 python benchmarks/large_messages.py --sizes-mib 1024 2048
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
from _common import tp_message, write_record
from jax import lax

import taco_jax as tj


def _collective(op: str, v, link: str):
    options = dict(codec="taco", min_compress_bytes=0, link=link)
    if op == "psum":
        algorithm = "fused" if link == "nvlink" else "one_shot"
        return tj.compressed_psum(v, "tp", algorithm=algorithm, **options)
    return tj.compressed_all_gather(v, "tp", tiled=True, **options)


def _exact(op: str, v):
    if op == "psum":
        return lax.psum(v.astype(jnp.float32), "tp")
    return lax.all_gather(v, "tp", tiled=True).astype(jnp.float32)


def _checks(op: str, v):
    """[non-finite fused, non-finite NCCL, error fused, error NCCL] of this rank, [1, 4]."""
    exact = _exact(op, v)
    outs = [_collective(op, v, link).astype(jnp.float32) for link in ("nvlink", "shm")]
    bad = [jnp.sum(~jnp.isfinite(out)).astype(jnp.float32) for out in outs]
    err = [jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact) for out in outs]
    return jnp.stack([*bad, *err])[None]


def run(args) -> dict:
    rows = []
    for size_mib in args.sizes_mib:
        mesh, x = tp_message(size_mib)
        spec = jax.sharding.PartitionSpec("tp")
        for op in args.ops:
            fn = jax.shard_map(lambda v, o=op: _checks(o, v), mesh=mesh, in_specs=spec,
                               out_specs=spec, check_vma=False)  # fmt: skip
            per_rank = jax.jit(fn)(x).tolist()
            rows.append(dict(op=op, bytes_per_rank=int(size_mib * (1 << 20)), per_rank=[
                dict(nonfinite_fused=int(r[0]), nonfinite_nccl=int(r[1]), error_fused=r[2],
                     error_nccl=r[3]) for r in per_rank]))  # fmt: skip
            print(f"{size_mib:6.0f} MiB {op:10s} {rows[-1]['per_rank']}", flush=True)
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1024, 2048])
    parser.add_argument("--ops", nargs="+", default=["psum", "all_gather"])
    parser.add_argument("--suffix", default="")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    write_record("large_messages", args.out, suffix=args.suffix, **run(args))


if __name__ == "__main__":
    main()
