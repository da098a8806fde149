"""Times the fused codec kernels of `pallas_kernels` on one GPU (BENCHMARKS.md, Kernels).

    python -m benchmarks.kernels --out $OUT           # the registry's kernels, 8 peers, 1 MiB-1 GiB
    python -m benchmarks.kernels --backends auto triton mosaic --peers 2 4 8 --sizes-mib 8 16 32 64

Codec `taco` (or `--codec NAME`: record `kernels-NAME-<date>.json`), G = 128, messages of P rows
(a P-way TP group, each P of `--peers`); a CUDA GPU (the kernels run compiled), or `--interpret`
(Pallas' CPU interpreter, tiny sizes: a check of the script). Per P and bf16 message size: a copy
of the same bytes (an XLA negate, the baseline), the XLA-fused jnp references (`--reference`)
and the kernels of each op (encode, decode, decode-sum, decode-sum-reencode) for each of
`--backends`: "auto" (the kernel `pallas_kernels.registry` picks, as the collectives call
them), "triton", "mosaic" (Hopper, the codecs the Mosaic kernels take; the sums of more than two
peers with peer steps, as the registry runs them). Each is timed as one call in a jitted program
of dependent calls (`timing.in_program`: 16 calls rotating over inputs of >= 256 MiB from 1 MiB,
so that nothing is served from L2; below, 200 calls on one input, in L2 as a fresh activation
would be), all interleaved with an A/A control of the copy and a placement control, the copy
on inputs of its own (`timing.compare`: the ops run on other buffers than the copy's, and other
buffers alone ran a kernel at 0.81x of itself, docs/decisions/033); the record keeps the raw
times. Bandwidth is logical IO: bytes read + bytes written, once each; "of copy" is an op's
bandwidth over the copy's (the median of the paired ratios, with its interval). That the kernels
compute the references' functions is the GPU tier's (tests/pallas_kernels).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import asdict

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks._common import MiB, compare_options, timed_script_options, write_record
from pallas_kernels import (
    decode_kernel,
    decode_mosaic,
    decode_sum_kernel,
    encode_kernel,
    encode_mosaic,
    registry,
)
from taco_jax import codecs, target, timing

L2_FLUSH_BYTES = 256 * MiB  # > 4x the H200's 60 MB L2
IN_PROGRAM_CALLS = 16  # dependent calls per program from 1 MiB (inputs rotate)
LATENCY_CALLS = 200  # below 1 MiB (one input, in L2)
BACKENDS = ("auto", "triton", "mosaic")


def _ops(codec, peers: int, backends=("auto",), reference=False, interpret=False) -> dict:
    """name -> (jitted fn, input kind, bytes moved for `elements` bf16 values).

    Per op, one entry per backend of `backends` ("auto": the registry's kernel, named by the op
    alone; "triton", "mosaic": that kernel, named `<op>_<backend>`, Mosaic only where its
    kernels run: a Hopper GPU, a codec they take), and with `reference` the jnp reference
    (`<op>_reference`). interpret: the registry's kernels in Pallas' CPU interpreter."""
    wire = lambda el: codec.wire_bytes(el // peers)  # noqa: E731 - one row's wire bytes
    n_of = lambda w: round(w.shape[1] * 8 / codec.bits_per_element)  # noqa: E731 - a row's values
    steps = peers > 2  # the registry's Mosaic sums of more than two peers
    auto = (pk.encode, pk.decode, pk.decode_sum, pk.decode_sum_reencode)
    kernels = {
        "auto": tuple(functools.partial(op, interpret=interpret) for op in auto),
        "triton": (encode_kernel.encode, decode_kernel.decode)
        + (decode_sum_kernel.decode_sum, decode_sum_kernel.decode_sum_reencode),
        "mosaic": (
            encode_mosaic.encode,
            decode_mosaic.decode,
            lambda c, w, n, *a: decode_mosaic.decode_sum(c, w, n, *a, peer_steps=steps),
            lambda c, w, n: decode_mosaic.decode_sum_reencode(c, w, n, peer_steps=steps),
        ),
    }
    ops = {  # op: (bind a kernel, its reference, input kind, logical bytes)
        "encode": (
            lambda k: lambda x: k(codec, x),
            lambda x: pk.encode_reference(codec, x),
            "x",
            lambda el: 2 * el + peers * wire(el),
        ),
        "decode": (
            lambda k: lambda w: k(codec, w, n_of(w), jnp.bfloat16),
            lambda w: pk.decode_reference(codec, w, n_of(w), jnp.bfloat16),
            "wire",
            lambda el: peers * wire(el) + 2 * el,
        ),
        "decode_sum": (
            lambda k: lambda w: k(codec, w, n_of(w)),
            lambda w: pk.decode_sum_reference(codec, w, n_of(w)),
            "wire",
            lambda el: peers * wire(el) + 4 * (el // peers),
        ),
        "decode_sum_reencode": (
            lambda k: lambda w: k(codec, w, n_of(w)),
            lambda w: pk.decode_sum_reencode_reference(codec, w, n_of(w)),
            "wire",
            lambda el: (peers + 1) * wire(el),
        ),
    }
    out = {}
    for i, (op, (bind, ref, kind, io)) in enumerate(ops.items()):
        for backend in backends:
            if backend != "mosaic" or _mosaic_runs(codec):
                name = op if backend == "auto" else f"{op}_{backend}"
                out[name] = (jax.jit(bind(kernels[backend][i])), kind, io)
        if reference:
            out[f"{op}_reference"] = (jax.jit(ref), kind, io)
    return out


def _registry_kernel(op: str, codec, n: int, peers: int, interpret: bool) -> str:
    """The kernel the registry runs `op` of bf16 rows [peers, n] with, here."""
    impl = "pallas_interpret" if interpret else "auto"
    dtype = None if op == "decode_sum_reencode" else jnp.bfloat16
    where = target.probe()
    return registry.select(op, codec, impl=impl, target=where, n=n, rows=peers, dtype=dtype).name


def _mosaic_runs(codec) -> bool:
    """Whether the Mosaic GPU kernels run `codec` here: a Hopper GPU, a codec they take."""
    return target.probe().hopper and encode_mosaic.unsupported_codec(codec) is None


def _inputs(codec, peers: int, elements: int, key, kind: str, rotate: bool) -> list[tuple]:
    """1-tuples of bf16 messages [peers, elements / peers] ("x") or their wire rows ("wire"):
    with `rotate`, enough sets to cover L2_FLUSH_BYTES (at most 16), else one."""
    sets = max(1, min(16, L2_FLUSH_BYTES // (2 * elements))) if rotate else 1
    out = []
    for i in range(sets):
        x = jax.random.normal(jax.random.fold_in(key, i), (peers, elements // peers), jnp.bfloat16)
        out.append((x if kind == "x" else pk.encode_reference(codec, x),))
    return out


def bench(key, args):
    """Per peer count (`args.peers`) and message size (`args.sizes_mib`, bytes of bf16): an XLA
    copy of the same bytes (a negate, the baseline) and each op of `_ops`, in one program of
    dependent calls each, interleaved with an A/A control (`timing.compare`). Rows and the
    comparisons' raw times."""
    codec, interpret = codecs.get_codec(args.codec, 128), args.interpret
    rows, comparisons = [], []
    for p in args.peers:
        ops = _ops(codec, p, args.backends, args.reference, interpret)
        for size in (int(s * MiB) for s in args.sizes_mib):
            elements, rotate = size // 2, size >= MiB
            calls_here = args.calls or (IN_PROGRAM_CALLS if rotate else LATENCY_CALLS)
            inputs = {k: _inputs(codec, p, elements, key, k, rotate) for k in ("x", "wire")}
            copy = lambda x: -x  # noqa: E731 - the baseline
            samplers = {"copy": timing.in_program(copy, inputs["x"], calls_here)}
            own = _inputs(codec, p, elements, jax.random.fold_in(key, 1), "x", rotate)
            for name, (fn, kind, _) in ops.items():
                if "_mosaic" not in name or encode_mosaic.unsupported(codec, elements // p) is None:
                    samplers[name] = timing.in_program(fn, inputs[kind], calls_here)
            placement = timing.in_program(copy, own, calls_here)
            result = timing.compare(samplers, "copy", placement=placement, **compare_options(args))
            comparisons.append(dict(bytes=size, peers=p, calls=calls_here, **result))
            rows.append(_row(size, p, codec, ops, result, interpret))
            print(f"{p} peers, {size / MiB:g} MiB, % of the copy:", _shares(rows[-1]), flush=True)
    return rows, comparisons


def _row(size: int, peers: int, codec, ops, result, interpret: bool) -> dict:
    """Medians per op: seconds a call, TB/s of logical IO, the share of the copy's bandwidth
    (median of the paired ratios, with its interval); the kernel the registry runs per op and
    the launch each Triton kernel takes."""
    times, summary = result["times_s"], result["summary"]
    median = lambda name: statistics.median(times[name])  # noqa: E731
    n = size // 2 // peers
    sums = functools.partial(decode_sum_kernel.default_config, codec, peers, n)
    row = dict(
        bytes=size,
        peers=peers,
        copy_in_program_s=median("copy"),
        copy_in_program_tbps=2 * size / median("copy") / 1e12,
        aa=summary[timing.AA_RATIO],
        registry={op: _registry_kernel(op, codec, n, peers, interpret) for op in registry.OPS},
        triton_launches={
            "encode": asdict(encode_kernel.default_config(codec, n)),
            "decode": asdict(decode_kernel.default_config(codec, n)),
            "decode_sum": asdict(sums()),
            "decode_sum_reencode": asdict(sums(reencode=True)),
        },
    )
    for name, (_, _, io) in ops.items():
        if name in times:
            nbytes, share = io(size // 2), summary[name]
            scale = nbytes / (2 * size)  # the op's bytes over the copy's
            row[name] = dict(
                kernel_in_program_s=median(name),
                in_program_tbps=nbytes / median(name) / 1e12,
                in_program_of_copy=share["median"] * scale,
                of_copy_interval=[v * scale for v in share["interval"]],
            )
    return row


def _shares(row: dict) -> str:
    ops = (k for k, v in row.items() if isinstance(v, dict) and "in_program_of_copy" in v)
    return ", ".join(f"{k} {row[k]['in_program_of_copy']:.0%}" for k in ops)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--codec", default="taco")
    p.add_argument("--peers", type=int, nargs="+", default=[8], help="rows of each message")
    p.add_argument("--backends", nargs="+", default=["auto"], choices=BACKENDS)
    p.add_argument("--reference", action="store_true", help="also time the jnp references")
    p.add_argument("--interpret", action="store_true", help="Pallas' CPU interpreter (a check)")
    p.add_argument("--calls", type=int, default=None, help="calls a program (default: 16 or 200)")
    timed_script_options(p, budget_s=20.0, max_repeats=30)
    args = p.parse_args(argv)
    if args.interpret and args.backends != ["auto"]:
        p.error("--interpret times the registry's kernels: --backends auto")
    rows, comparisons = bench(jax.random.key(int(time.time())), args)  # fresh data every run
    write_record(
        "kernels" if args.codec == "taco" else f"kernels-{args.codec}",
        args.out,
        suffix=args.suffix,
        codec=args.codec,
        backends=args.backends,
        group_size=128,
        peers=args.peers,
        interpret=args.interpret,
        bench=rows,
        comparisons=comparisons,
    )


if __name__ == "__main__":
    main()
