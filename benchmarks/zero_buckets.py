"""ZeRO-1's two halves with SDP4Bit, bucketed against per leaf, outside a training step: the
gradient reduce-scatter (`taco_train.zero._mean_shards`), the replica all-gather
(`zero._new_replica`) and the whole `zero.update` (with AdamW), on GPT-350M's attention
leaves `attn.wo`, `bo` and `bqkv` (the leaves that share a bucket of 40 M and not one of 4 M),
with dp ranks emulated under `vmap` as in `train_step.py --dp-emulate`.

Time: `_common.in_program_seconds` (dependent calls in one jitted program, median of 7
programs), every bucket size in the same run. The outputs are not compared: the noise keys
differ between bucket sizes (tests/taco_train/test_zero.py checks that the buckets move and
round what one collective per leaf does).

    python benchmarks/zero_buckets.py --out $OUT
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

# The repository root first, so that the packages of this checkout are the ones timed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _common import in_program_seconds, write_record  # noqa: E402

from taco_train import zero  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# GPT-350M's leaves per layer; `--layers` stacks them (24 in the model).
LAYER_SHAPES = {"bo": (1024,), "bqkv": (16, 3, 64), "wo": (16, 64, 1024)}
CALLS = 8


def inputs(dp: int, layers: int, seed: int) -> dict:
    """Per emulated rank: fp32 gradients, the bf16 replica, the master shards, AdamW's state."""
    shapes = {n: (layers, *s) for n, s in LAYER_SHAPES.items()}
    keys = jax.random.split(jax.random.key(seed), 2 * len(shapes))
    params = {n: jax.random.normal(k, s) for k, (n, s) in zip(keys, shapes.items(), strict=False)}
    grads = {n: 1e-2 * jax.random.normal(k, (dp, *s))
             for k, (n, s) in zip(keys[len(shapes):], shapes.items(), strict=True)}  # fmt: skip
    master = zero.shard_leaves(params, dp)
    state = jax.vmap(lambda m: zero.init(optax.adamw(1e-4), m))(master)
    replica = jax.tree.map(lambda p: jnp.broadcast_to(p.astype(jnp.bfloat16), (dp, *p.shape)),
                           params)  # fmt: skip
    return {"grads": grads, "replica": replica, "master": master, "state": state}


def ops(cfg: zero.ZeroConfig, dp: int) -> dict:
    """name -> fn(inputs) over every emulated rank."""
    key = jax.random.key(1)
    leaves = jax.tree.leaves

    def reduce_scatter(d):
        buckets = zero._Buckets(d["replica"], None, dp, cfg.bucket_elements)
        return zero._mean_shards(leaves(d["grads"]), buckets, cfg, key)

    def all_gather(d):
        buckets = zero._Buckets(d["replica"], None, dp, cfg.bucket_elements)
        return zero._new_replica(leaves(d["master"]), leaves(d["replica"]), buckets, cfg, key)

    def update(d):
        return zero.update(optax.adamw(1e-4), cfg, d["grads"], d["state"], d["replica"], key)[1]

    fns = {"reduce-scatter": reduce_scatter, "all-gather": all_gather, "update": update}
    return {name: jax.vmap(fn, axis_name="dp") for name, fn in fns.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24, help="stacked layers (CPU check: 2)")
    parser.add_argument("--bucket-elements", type=int, nargs="+", default=[40_000_000, 1])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS))
    args = parser.parse_args()

    data = [inputs(args.dp, args.layers, seed) for seed in (0, 1)]
    rows = []
    for limit in args.bucket_elements:
        cfg = zero.ZeroConfig(grad_codec="tlq_hs", param_codec="qwd", bucket_elements=limit)
        buckets = zero._Buckets(jax.tree.map(lambda r: r[0], data[0]["replica"]), None,
                                args.dp, limit)  # fmt: skip
        for name, fn in ops(cfg, args.dp).items():
            seconds = in_program_seconds(fn, [(d,) for d in data], CALLS)
            rows.append({"bucket_elements": limit, "buckets": buckets.groups, "op": name,
                         "us": 1e6 * seconds})  # fmt: skip
            print(f"buckets {limit:>10} {name:15s} {rows[-1]['us']:9.1f} us", flush=True)
    write_record("zero_buckets", args.out, dp=args.dp, layers=args.layers,
                 layer_shapes=LAYER_SHAPES, calls=CALLS, results=rows)  # fmt: skip


if __name__ == "__main__":
    main()
