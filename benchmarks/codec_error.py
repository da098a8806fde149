"""Accuracy of the codecs (numerics: the CPU is enough): the collectives' and the stage codecs'.

Default: `compressed_psum` against exact `lax.psum`, per codec, at TP = 2, 4, 8, under
`shard_map` on 8 fake CPU devices: per TP size, codec and data set, the relative L2 error
||out - psum|| / ||psum|| and the fraction of non-zero sums that decode to exactly zero ("zero
collapse"); and the rounding error of three 6-bit grids (INT6, E2M3, E3M2) on Hadamard-rotated
groups, which is why `int6_hadamard` is an integer grid. Record `codec_error-<date>.json`.

`--stage`: the pipeline stage codecs of `taco_jax.compressed_ppermute` at their bits per element
(fixed-bit TAH-Quant and the adaptive 3/4-bit allocations at equal bits: entropy, the paper's
rule; absmax; a fixed alternating pattern): the relative L2 error of decode(encode(x)), the mean
over `--keys` stochastic-rounding keys, on `--rows` rows of `--stage-size` values (Gaussian,
Student-t with 3 degrees of freedom, Gaussian with 1% of channels 30x larger). Record
`stage_codec_error-<date>.json`.

    python -m benchmarks.codec_error            # sets 8 fake CPU devices itself
    python -m benchmarks.codec_error --stage

`python -m benchmarks.tables` renders the records (BENCHMARKS.md, "Codec error").
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import taco_jax as tj  # noqa: E402
from benchmarks._common import RESULTS, activation_like, tp_mesh, write_record  # noqa: E402
from taco_jax import tahquant, tahquant_adaptive  # noqa: E402
from taco_jax.codecs import hadamard_matrix  # noqa: E402
from taco_jax.telemetry import relative_error  # noqa: E402

# 6-bit grids compared after the Hadamard (why `int6_hadamard` is an integer grid): each group
# rotated, scaled by its absmax to the format's largest value, rounded to nearest, scaled back.
SIX_BIT_GRIDS = {"int6": None, "e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn}


def six_bit_grid_errors(x: jax.Array, group_size: int = 128) -> dict[str, float]:
    """Relative L2 rounding error of each 6-bit grid on the Hadamard-rotated groups of x."""
    groups = np.asarray(x, np.float64).reshape(-1, group_size)
    y = groups @ hadamard_matrix(group_size).astype(np.float64)
    amax = np.abs(y).max(axis=-1, keepdims=True)
    out = {}
    for name, dtype in SIX_BIT_GRIDS.items():
        top = 31.0 if dtype is None else float(ml_dtypes.finfo(dtype).max)
        scaled = y / amax * top
        rounded = np.round(scaled) if dtype is None else scaled.astype(dtype).astype(np.float64)
        out[name] = float(np.linalg.norm(rounded * amax / top - y) / np.linalg.norm(y))
    return out


def measure(codec: str, x: jax.Array, mesh) -> dict[str, float]:
    fn = jax.shard_map(
        lambda v: tj.compressed_psum(v[0], "tp", codec=codec)[None],
        mesh=mesh,
        in_specs=P("tp"),
        out_specs=P("tp"),
        check_vma=False,
    )
    out = jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, P("tp"))))[0]
    exact = jnp.sum(x, axis=0)
    return {
        "rel_l2": float(relative_error(out, exact)),
        "zero_collapse": float(jnp.mean((out == 0) & (exact != 0))),
    }


def stage_candidates() -> dict[str, tuple[object, object]]:
    """label -> (stage codec, its module): fixed 8 and 4 bits, and the 3/4-bit allocations."""
    fixed, adaptive = ("tahquant_sym", "tahquant4"), tahquant_adaptive.AdaptiveTahQuant
    out = {name: (tahquant.get_stage_codec(name), tahquant) for name in fixed}
    for allocation in tahquant_adaptive.ALLOCATIONS:
        out[f"adaptive 3.5 ({allocation})"] = (adaptive(allocation=allocation), tahquant_adaptive)
    out["fixed 3-bit (budget 3)"] = (adaptive(budget=3.0), tahquant_adaptive)
    return out


def stage_error(codec, module, x: jax.Array, keys) -> float:
    """Mean over `keys` of the relative L2 error of decode(encode(x))."""
    roundtrip = jax.jit(
        lambda v, k: module.decode_wire(codec, module.encode_wire(codec, v, k), v.shape[-1])
    )
    return sum(float(relative_error(roundtrip(x, k), x)) for k in keys) / len(keys)


def stage_main(args) -> None:
    data = activation_like(args.rows, args.stage_size, args.seed, dof=3.0)
    keys = list(jax.random.split(jax.random.key(args.seed + 1), args.keys))
    results = []
    for label, (codec, module) in stage_candidates().items():
        row = {"codec": label, "bits_per_element": codec.bits_per_element}
        row.update({name: stage_error(codec, module, x, keys) for name, x in data.items()})
        results.append(row)
    write_record(
        "stage_codec_error",
        args.out,
        rows=args.rows,
        size=args.stage_size,
        keys=args.keys,
        seed=args.seed,
        results=results,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--size", type=int, default=1 << 20, help="elements per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stage", action="store_true", help="the stage codecs instead")
    parser.add_argument("--rows", type=int, default=64, help="--stage: rows")
    parser.add_argument("--stage-size", type=int, default=4096, help="--stage: values a row")
    parser.add_argument("--keys", type=int, default=4, help="--stage: rounding keys")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.stage:
        return stage_main(args)
    codecs = [c for c in tj.CODEC_NAMES if c != "none"]
    results = {}
    for tp in args.tp:
        mesh = tp_mesh(tp)
        data = activation_like(tp, args.size, args.seed, dof=2.0)  # each rank's partial sums
        results[tp] = {c: {name: measure(c, x, mesh) for name, x in data.items()} for c in codecs}
        print(f"TP = {tp} measured", flush=True)
    one_rank = activation_like(1, args.size, args.seed, dof=2.0)
    grids = {name: six_bit_grid_errors(x[0]) for name, x in one_rank.items()}
    bits = {c: tj.get_codec(c).bits_per_element for c in codecs}
    write_record(
        "codec_error",
        args.out,
        tp=args.tp,
        elements_per_rank=args.size,
        seed=args.seed,
        bits_per_element=bits,
        results={str(tp): r for tp, r in results.items()},
        six_bit_grids_after_hadamard=grids,
    )


if __name__ == "__main__":
    main()
