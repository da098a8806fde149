"""Launch shapes of one codec kernel: the default launch against a grid of `BlockConfig`s.

Times one op of `pallas_kernels` (`--op`: encode, decode, decode_sum, decode_sum_reencode) for
`--codec` on rows of `--peers` x n values (decode-sum and decode-sum-reencode sum the peers into
one row), with the default launch (the kernel module's `default_config`) and with every
candidate of the grid `--groups x --warps x --tiles x --dots x --per-peer` (groups per tile,
Triton warps, tiles per program, Hadamard dot columns, decode-sum's Hadamard per peer or once
on the sum), each inside one jitted program (`_common.in_program_seconds`, so JAX's per-call
dispatch is not counted), beside an XLA pass over the same bytes (a negate of a
buffer of (bytes read + bytes written) / 2: it reads and writes that many, once each). Every
candidate's output is compared with the default's first: byte for byte, and where they differ,
the fraction of differing values and the largest difference relative to the output's RMS.

    python benchmarks/launch_sweep.py --op decode_sum --codec taco --peers 2 --sizes-mib 64 1024
    python benchmarks/launch_sweep.py --op decode_sum --peers 2 --groups 64 --warps 4 \
        --tiles 1 --dots 16 --per-peer 0 1
    python benchmarks/launch_sweep.py --op encode --codec int6_hadamard --groups 16 32 64 \
        --warps 4 8 --tiles 1 2

`--backend mosaic` sweeps the Mosaic GPU kernels' `MosaicLaunch` instead (Hopper): the grid
`--tiles x --steps x --store-slots x --peer-steps` (tiles per program, pipeline steps in
flight, output slots, and for the sums one peer's tile a step), against the Mosaic default
launch, with the Triton kernel's default launch timed beside them:

    python benchmarks/launch_sweep.py --backend mosaic --op encode --peers 8 --sizes-mib 32 48 64 \
        --tiles 4 8 16 --steps 3 4
    python benchmarks/launch_sweep.py --backend mosaic --op decode_sum --peers 8 --peer-steps 1 \
        --tiles 16 --steps 3 4 5 --store-slots 1 2
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
from _common import in_program_seconds, write_record

import pallas_kernels as pk
from pallas_kernels import (
    decode_kernel,
    decode_mosaic,
    decode_sum_kernel,
    encode_kernel,
    encode_mosaic,
)
from pallas_kernels.config import MOSAIC_GROUPS_PER_TILE, MosaicLaunch, mosaic_launch
from taco_jax import codecs

MiB = 1 << 20
OPS = ("encode", "decode", "decode_sum", "decode_sum_reencode")
SUM_OPS = ("decode_sum", "decode_sum_reencode")  # one output row; the Mosaic ones take peer steps


@dataclasses.dataclass(frozen=True)
class MosaicCandidate:
    """A launch of the Mosaic GPU kernels (None: the kernel's default) and, for the sums,
    whether a pipeline step holds one peer's tile (`decode_mosaic`'s `peer_steps`)."""

    launch: MosaicLaunch | None = None
    peer_steps: bool = False


def _op(op: str, codec, n: int, config, interpret: bool):
    """The op on its input (x[P, n] bf16 for encode, else wire[P, B]) with launch `config`
    (a `MosaicCandidate`, else a Triton `BlockConfig`; None: the Triton default)."""
    if isinstance(config, MosaicCandidate):
        return _mosaic_op(op, codec, n, config, interpret)
    # backend="triton": "auto" would take the Mosaic kernels for large `taco` messages.
    kw = dict(config=config, interpret=interpret, backend="triton")
    if op == "encode":
        return lambda x: pk.encode(codec, x, **kw)
    if op == "decode":
        return lambda w: pk.decode(codec, w, n, jnp.bfloat16, **kw)
    if op == "decode_sum":
        return lambda w: pk.decode_sum(codec, w, n, jnp.bfloat16, **kw)
    return lambda w: pk.decode_sum_reencode(codec, w, n, **kw)


def _mosaic_op(op: str, codec, n: int, config: MosaicCandidate, interpret: bool):
    """The Mosaic GPU kernel of `op` with `config`'s launch."""
    kw = dict(launch=config.launch, interpret=interpret)
    if op == "encode":
        return lambda x: encode_mosaic.encode(codec, x, **kw)
    if op == "decode":
        return lambda w: decode_mosaic.decode(codec, w, n, jnp.bfloat16, **kw)
    kw["peer_steps"] = config.peer_steps
    if op == "decode_sum":
        return lambda w: decode_mosaic.decode_sum(codec, w, n, jnp.bfloat16, **kw)
    return lambda w: decode_mosaic.decode_sum_reencode(codec, w, n, **kw)


def _io_bytes(op: str, codec, peers: int, n: int) -> int:
    """Bytes the op reads and writes, once each."""
    wire = peers * codec.wire_bytes(n)
    return {
        "encode": 2 * peers * n + wire,
        "decode": wire + 2 * peers * n,
        "decode_sum": wire + 2 * n,
        "decode_sum_reencode": wire + codec.wire_bytes(n),
    }[op]


def _default(op: str, codec, peers: int, n: int) -> pk.BlockConfig:
    """The launch the op takes when given none."""
    if op == "encode":
        return encode_kernel.default_config(codec, peers, n)
    if op == "decode":
        return decode_kernel.default_config(codec, peers, n)
    return decode_sum_kernel.default_config(codec, peers, n, reencode=op != "decode_sum")


def candidates(args) -> list:
    """The grid of launches, minus the ones `BlockConfig` (`MosaicLaunch`) refuses; the Mosaic
    kernels refuse the rest (tiles that do not divide a row, shared memory) when traced."""
    if args.backend == "mosaic":
        return _mosaic_candidates(args)
    out = []
    grid = itertools.product(args.groups, args.warps, args.tiles, args.dots, args.per_peer)
    for groups, warps, tiles, dot, per_peer in grid:
        try:
            out.append(pk.BlockConfig(groups, num_warps=warps, num_stages=1,
                                      tiles_per_program=tiles, hadamard_dot=dot,
                                      hadamard_per_peer=bool(per_peer)))  # fmt: skip
        except ValueError as error:
            print(f"skipped: {error}")
    return out


def _mosaic_candidates(args) -> list[MosaicCandidate]:
    """`MosaicLaunch`es over tiles x steps x store slots (x peer steps for the sums). Steps in
    flight beyond a program's steps are its steps (as the default launches take them: the
    pipeline would run no more), each launch once."""
    out = []
    for tiles, steps, slots, peer_steps in itertools.product(
        args.tiles, args.steps, args.store_slots, _peer_steps(args)
    ):
        steps = min(steps, tiles * (args.peers if peer_steps else 1))
        try:
            candidate = MosaicCandidate(MosaicLaunch(tiles, steps, slots), bool(peer_steps))
        except ValueError as error:
            print(f"skipped: {error}")
            continue
        if candidate not in out:
            out.append(candidate)
    return out


def _peer_steps(args) -> list[int]:
    return args.peer_steps if args.op in SUM_OPS else [0]


def _label(config) -> str:
    """A launch in a few words (a `MosaicCandidate` or a Triton `BlockConfig`)."""
    if isinstance(config, MosaicCandidate):
        peer_steps = " peer-steps" * config.peer_steps
        if config.launch is None:
            return "default" + peer_steps
        launch = config.launch
        return (f"tiles={launch.tiles_per_program} steps={launch.steps_in_flight} "
                f"slots={launch.store_slots}" + peer_steps)  # fmt: skip
    return (f"groups={config.groups_per_tile} warps={config.num_warps} "
            f"tiles={config.tiles_per_program} dot={config.hadamard_dot}"
            + " per-peer" * config.hadamard_per_peer)  # fmt: skip


def _difference(op: str, out: np.ndarray, default: np.ndarray) -> tuple[float, float]:
    """(fraction of differing values, largest |difference| / RMS of the default's values) of
    a decoding op's bf16 output (wire outputs: fraction of differing bytes, and nan)."""
    if op in ("encode", "decode_sum_reencode"):
        return float(np.mean(out != default)), float("nan")
    a = out.view(jnp.bfloat16).astype(np.float32)
    b = default.view(jnp.bfloat16).astype(np.float32)
    rms = float(np.sqrt(np.mean(np.square(b))))
    return float(np.mean(a != b)), float(np.max(np.abs(a - b)) / rms)


def run(args) -> dict:
    codec = codecs.get_codec(args.codec)
    rows = []
    for size_mib in args.sizes_mib:
        n = int(size_mib * MiB) // 2 // args.peers  # bf16 values per row
        n -= n % codec.group_size
        xs = [jax.random.normal(jax.random.key(i), (args.peers, n), jnp.bfloat16) for i in (0, 1)]
        # Two input sets, taken in turn, so that L2 serves neither.
        inputs = (
            xs
            if args.op == "encode"
            else [pk.encode(codec, x, interpret=args.interpret) for x in xs]
        )
        io_bytes = _io_bytes(args.op, codec, args.peers, n)
        copy_inputs = [jnp.full((io_bytes // 4,), i, jnp.bfloat16) for i in (1, 2)]
        copy_s = in_program_seconds(jax.jit(jnp.negative), [(c,) for c in copy_inputs], args.calls)
        default = None  # the default launch's output bytes, from the first row
        configs = _reference_rows(args) + [(_label(c), c) for c in candidates(args)]
        for index, (label, config) in enumerate(configs):
            fn = jax.jit(_op(args.op, codec, n, config, args.interpret))
            try:
                out = np.asarray(fn(inputs[0])).view(np.uint8)
            except Exception as error:  # a launch the compiler refuses (e.g. shared memory)
                if index == 0:
                    raise  # the default launch is the reference every row is compared with
                print(f"{size_mib:7.0f} MiB {label:44s} failed: {error!r}"[:300], flush=True)
                continue
            default = out if default is None else default
            same = bool(np.array_equal(out, default))
            differing, largest = _difference(args.op, out, default)
            seconds = in_program_seconds(fn, [(i,) for i in inputs], args.calls)
            config_of, label = _described(args, codec, n, label, config)
            rows.append(dict(bytes=int(size_mib * MiB), peers=args.peers, label=label,
                             config=config_of, seconds=seconds,
                             copy_seconds=copy_s, tbps=io_bytes / seconds / 1e12,
                             of_copy=copy_s / seconds, equal_to_default=same,
                             differing_fraction=differing,
                             max_difference_over_rms=largest))  # fmt: skip
            print(f"{size_mib:7.0f} MiB {label:44s} {seconds * 1e3:7.3f} ms "
                  f"{rows[-1]['tbps']:5.2f} TB/s {rows[-1]['of_copy']:4.0%} of copy "
                  f"same={same}", flush=True)  # fmt: skip
    return {"op": args.op, "codec": args.codec, "kernel_backend": args.backend, "rows": rows,
            "calls_per_program": args.calls}  # fmt: skip


def _reference_rows(args) -> list[tuple[str, object]]:
    """The default launches a sweep starts with; the first is what every row is compared with.
    A Mosaic sweep times the Triton kernel's default beside (and, for the sums, the Mosaic
    default with peer steps)."""
    if args.backend == "triton":
        return [("default", None)]
    rows = [("Mosaic default", MosaicCandidate()), ("Triton default", None)]
    if 1 in _peer_steps(args):
        rows.append(("Mosaic default peer-steps", MosaicCandidate(peer_steps=True)))
    return rows


def _described(args, codec, n: int, label: str, config) -> tuple[dict, str]:
    """A row's launch as a dict, and its label with the default launches spelled out (the
    Mosaic default's tiles per program; a decode's steps in flight are fit to shared memory)."""
    if config is None:
        triton = _default(args.op, codec, args.peers, n)
        return dataclasses.asdict(triton), f"{label} ({_label(triton)})"
    if isinstance(config, MosaicCandidate) and config.launch is None:
        rows = 1 if args.op in SUM_OPS else args.peers
        tiles_per_row = n // codec.group_size // MOSAIC_GROUPS_PER_TILE
        default_of = encode_mosaic.default_launch if args.op == "encode" else mosaic_launch
        per_program = default_of(rows, tiles_per_row).tiles_per_program
        described = dict(tiles_per_program=per_program, peer_steps=config.peer_steps)
        return described, f"{label} (tiles={per_program})"
    return dataclasses.asdict(config), label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--op", choices=OPS, default="decode_sum")
    parser.add_argument("--codec", default="taco")
    parser.add_argument("--peers", type=int, default=2, help="rows (summed by the summing ops)")
    parser.add_argument(
        "--sizes-mib",
        type=float,
        nargs="+",
        default=[64, 1024],
        help="bf16 bytes of the [peers, n] input (encode) or of what was encoded",
    )
    parser.add_argument("--groups", type=int, nargs="+", default=[32, 64],
                        help="Triton: groups per tile")  # fmt: skip
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="Triton")
    parser.add_argument("--tiles", type=int, nargs="+", default=[1, 2], help="tiles per program")
    parser.add_argument(
        "--dots", type=int, nargs="+", default=[16], help="Triton: Hadamard dot columns"
    )
    parser.add_argument(
        "--per-peer",
        type=int,
        nargs="+",
        default=[0],
        choices=(0, 1),
        help="decode-sum: 1 = the Hadamard per peer (BlockConfig.hadamard_per_peer)",
    )
    parser.add_argument("--backend", choices=("triton", "mosaic"), default="triton")
    parser.add_argument("--steps", type=int, nargs="+", default=[3],
                        help="Mosaic: pipeline steps in flight")  # fmt: skip
    parser.add_argument("--store-slots", type=int, nargs="+", default=[2],
                        help="Mosaic: output slots")  # fmt: skip
    parser.add_argument("--peer-steps", type=int, nargs="+", default=[0], choices=(0, 1),
                        help="Mosaic sums: 1 = one peer's tile a pipeline step")  # fmt: skip
    parser.add_argument(
        "--calls", type=int, default=8,
        help="dependent calls a program; more for kernels of a few us (below 16 MiB eight "
        "calls of one launch read 66 and 84%% of the copy in one run)",
    )  # fmt: skip
    parser.add_argument(
        "--interpret", action="store_true", help="Pallas' CPU interpreter (a check)"
    )
    parser.add_argument("--suffix", default="", help="appended to the record's file name")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    write_record("launch_sweep", args.out, suffix=args.suffix, **run(args))


if __name__ == "__main__":
    main()
