"""Checks and times the fused codec kernels of `pallas_kernels` on one GPU (BENCHMARKS.md, Kernels).

    python -m benchmarks.kernels --out $OUT           # every check, then 64 KiB .. 1 GiB

Codec `taco` (or `--codec NAME`: record `kernels-NAME-<date>.json`), G = 128, messages of 8 rows
(an 8-way TP group, `--peers`); needs a CUDA GPU (the kernels run compiled), or `--interpret`
(Pallas' CPU interpreter, tiny sizes: a check of the script). One run, one record:
1. Checks, on fresh random data each run: every fused codec (and `taco` with G = 32 .. 512),
   bf16 and fp32 input, rows that do not fill a tile, two poisons of the outputs to catch
   unwritten bytes; codes compared in code steps, scales relatively, against the references.
   Then the Mosaic GPU kernels (Hopper only): every op of each codec they take, at 16, 64 and
   512 tiles per row, two fresh inputs each. `--check-mosaic-only` runs only the latter,
   `--skip-check` neither.
2. Timings per bf16 message size (`--sizes-kib`, `--sizes-mib`): a copy of the same bytes (an
   XLA negate, the baseline), the XLA-fused jnp references (with `--reference`) and the
   kernels of each op (encode, decode, decode-sum, decode-sum-reencode) for each of
   `--backends`: "auto" (the kernel `pallas_kernels.registry` picks, as the collectives call
   them), "triton", "mosaic" (Hopper, the codecs the Mosaic kernels take; the sums of more
   than two peers with peer steps, as the registry runs them). Each is timed as one call in a
   jitted program of dependent calls (`timing.in_program`: 16 calls rotating over inputs of
   >= 256 MiB from 1 MiB, so that nothing is served from L2; below, 200 calls on one input, in
   L2 as a fresh activation would be), all interleaved with an A/A control of the copy
   (`timing.compare`); the record keeps the raw times.
Bandwidth is logical IO: bytes read + bytes written, once each; "of copy" is an op's bandwidth
over the copy's (median of the paired ratios, with its interval).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks._common import write_record
from pallas_kernels import (
    _pallas,
    decode_kernel,
    decode_mosaic,
    decode_sum_kernel,
    encode_kernel,
    encode_mosaic,
    registry,
)
from taco_jax import codecs, timing

PEERS = 8  # rows of the benchmark: an 8-way TP group
MiB = 1 << 20
L2_FLUSH_BYTES = 256 * MiB  # > 4x the H200's 60 MB L2
IN_PROGRAM_CALLS = 16  # dependent calls per program from 1 MiB (inputs rotate)
LATENCY_CALLS = 200  # below 1 MiB (one input, in L2)


BACKENDS = ("auto", "triton", "mosaic")


def _ops(codec, backends=("auto",), reference=False, interpret=False):
    """name -> (jitted fn, input kind, bytes moved for `elements` bf16 values).

    Per op, one entry per backend of `backends` ("auto": the registry's kernel, named by the op
    alone; "triton", "mosaic": that kernel, named `<op>_<backend>`, Mosaic only where its
    kernels run: a Hopper GPU, a codec they take), and with `reference` the jnp reference
    (`<op>_reference`). interpret: the registry's kernels in Pallas' CPU interpreter."""
    m = lambda el: el // PEERS  # noqa: E731
    wb = codec.wire_bytes
    n_of = lambda w: _n(codec, w)  # noqa: E731
    steps = PEERS > 2  # the registry's Mosaic sums of more than two peers
    kernels = {
        "auto": tuple(
            functools.partial(op, interpret=interpret)
            for op in (pk.encode, pk.decode, pk.decode_sum, pk.decode_sum_reencode)
        ),
        "triton": (
            encode_kernel.encode,
            decode_kernel.decode,
            decode_sum_kernel.decode_sum,
            decode_sum_kernel.decode_sum_reencode,
        ),
        "mosaic": (
            encode_mosaic.encode,
            decode_mosaic.decode,
            lambda c, w, n, *a: decode_mosaic.decode_sum(c, w, n, *a, peer_steps=steps),
            lambda c, w, n: decode_mosaic.decode_sum_reencode(c, w, n, peer_steps=steps),
        ),
    }
    ops = {
        "encode": (
            lambda k: lambda x: k(codec, x),
            lambda x: pk.encode_reference(codec, x),
            "x",
            lambda el: 2 * el + PEERS * wb(m(el)),
        ),
        "decode": (
            lambda k: lambda w: k(codec, w, n_of(w), jnp.bfloat16),
            lambda w: pk.decode_reference(codec, w, n_of(w), jnp.bfloat16),
            "wire",
            lambda el: PEERS * wb(m(el)) + 2 * el,
        ),
        "decode_sum": (
            lambda k: lambda w: k(codec, w, n_of(w)),
            lambda w: pk.decode_sum_reference(codec, w, n_of(w)),
            "wire",
            lambda el: PEERS * wb(m(el)) + 4 * m(el),
        ),
        "decode_sum_reencode": (
            lambda k: lambda w: k(codec, w, n_of(w)),
            lambda w: pk.decode_sum_reencode_reference(codec, w, n_of(w)),
            "wire",
            lambda el: (PEERS + 1) * wb(m(el)),
        ),
    }
    out = {}
    for i, (op, (bind, ref, kind, io)) in enumerate(ops.items()):
        for backend in backends:
            if backend == "mosaic" and not registry.mosaic_runs(codec):
                continue
            name = op if backend == "auto" else f"{op}_{backend}"
            out[name] = (jax.jit(bind(kernels[backend][i])), kind, io)
        if reference:
            out[f"{op}_reference"] = (jax.jit(ref), kind, io)
    return out


def _applies_at(name: str, codec, elements: int) -> bool:
    """Whether the timed variant `name` (`_ops`) runs at a message of `elements` values."""
    if "_mosaic" not in name:
        return True
    return encode_mosaic.unsupported(codec, elements // PEERS) is None


def _n(codec, wire):
    """Elements of a wire row: wire_bytes(n) = n * bits_per_element / 8."""
    return round(wire.shape[1] * 8 / codec.bits_per_element)


def _inputs(codec, elements, key, kind, rotate=True):
    """1-tuples of bf16 messages [PEERS, elements / PEERS] ("x") or their wire rows ("wire"):
    with `rotate`, enough sets to cover L2_FLUSH_BYTES (at most 16), else one."""
    sets = max(1, min(16, L2_FLUSH_BYTES // (2 * elements))) if rotate else 1
    out = []
    for i in range(sets):
        x = jax.random.normal(jax.random.fold_in(key, i), (PEERS, elements // PEERS), jnp.bfloat16)
        out.append((x if kind == "x" else pk.encode_reference(codec, x),))
    return out


def _ulp_mismatch(codec, wire, ref, n: int):
    """(# differing codes, max distance in code steps) of two wire buffers of rows of `n`:
    integer grids by value, FP8 by their sign-magnitude order."""
    a, b = (
        np.asarray(codecs.unpack(codec, w.reshape(-1, w.shape[-1]), n).codes) for w in (wire, ref)
    )
    if codec.is_integer:
        ordered = lambda c: np.asarray(codecs.dequantize(codec, c)).astype(np.int32)  # noqa: E731
    else:
        ordered = lambda c: np.where(c & 0x80, -(c & 0x7F), c & 0x7F)  # noqa: E731
    a, b = a.astype(np.int32), b.astype(np.int32)
    diff = np.abs(ordered(a) - ordered(b))
    return int(np.sum(a != b)), int(diff.max(initial=0))


def _side_difference(codec, wire, ref, n: int) -> float:
    """Largest difference of the stored per-group scale (else pre-scale), kernel vs reference:
    relative for fp32 scales; for E8M0 exponents, the number of groups that differ."""
    unpacked, unpacked_ref = codecs.unpack(codec, wire, n), codecs.unpack(codec, ref, n)
    pick = "prescales" if unpacked.scales is None else "scales"
    side = np.asarray(getattr(unpacked, pick))
    side_ref = np.asarray(getattr(unpacked_ref, pick))
    if not side.size:
        return 0.0
    if side.dtype == np.uint8:
        return float(np.sum(side != side_ref))
    return float(np.max(np.abs(side / side_ref - 1)))


def check(key):
    """The Triton kernels vs the references for every fused codec; rows for the JSON."""
    rows = []
    cases = [(name, 128) for name in codecs.CODEC_NAMES if name != "none"]
    cases += [("taco", g) for g in (32, 64, 256, 512)]
    for i, (name, g) in enumerate(cases):
        codec = codecs.get_codec(name, g)
        for dtype in (jnp.bfloat16, jnp.float32):
            n = g * (37 if i % 2 == 0 else 64)  # 37 groups: a partial (masked) last tile
            k = jax.random.fold_in(key, i * 2 + (dtype == jnp.float32))
            x = (jax.random.normal(k, (PEERS, n), jnp.float32) * 3).astype(dtype)
            b = codec.wire_bytes(n)
            poison = jnp.full((PEERS, b), 0xAB, jnp.uint8)
            wire = encode_kernel.encode(codec, x, out_init=poison)
            ref = pk.encode_reference(codec, x)
            diffs, steps = _ulp_mismatch(codec, wire, ref, n)
            dec = decode_kernel.decode(codec, ref, n, out_init=jnp.full((PEERS, n), jnp.nan))
            dec_ref = pk.decode_reference(codec, ref, n)
            dec_err = float(jnp.max(jnp.abs(dec - dec_ref)) / jnp.max(jnp.abs(dec_ref)))
            s = decode_sum_kernel.decode_sum(codec, ref, n, out_init=jnp.full((n,), jnp.nan))
            s_ref = pk.decode_sum_reference(codec, ref, n)
            sum_err = float(jnp.max(jnp.abs(s - s_ref)) / jnp.max(jnp.abs(s_ref)))
            poisoned = jnp.full((b,), 0xAB, jnp.uint8)
            r = decode_sum_kernel.decode_sum_reencode(codec, ref, n, out_init=poisoned)
            r_ref = pk.decode_sum_reencode_reference(codec, ref, n)
            r_diffs, r_steps = _ulp_mismatch(codec, r, r_ref, n)
            row = dict(
                codec=name,
                group_size=g,
                dtype=jnp.dtype(dtype).name,
                n=n,
                encode_code_mismatch=diffs,
                encode_max_code_steps=steps,
                encode_scale_max_rel=_side_difference(codec, wire, ref, n),
                decode_max_rel=dec_err,
                decode_finite=bool(jnp.all(jnp.isfinite(dec))),
                decode_sum_max_rel=sum_err,
                decode_sum_finite=bool(jnp.all(jnp.isfinite(s))),
                dsr_code_mismatch=r_diffs,
                dsr_max_code_steps=r_steps,
                # E8M0: groups whose exponent differs (a flip moves its codes by ~8 steps).
                dsr_scale_difference=_side_difference(codec, r, r_ref, n),
                # Two poisons: an element the kernel never writes keeps the poison, so differs.
                unwritten=int(
                    jnp.sum(wire != encode_kernel.encode(codec, x, out_init=poison ^ 0xFF))
                )
                + int(
                    jnp.sum(
                        r
                        != decode_sum_kernel.decode_sum_reencode(
                            codec, ref, n, out_init=poisoned ^ 0xFF
                        )
                    )
                ),
            )
            rows.append(row)
            print("CHECK", json.dumps(row), flush=True)
    return rows


MOSAIC_CHECK_CODECS = ("taco", "taco_e5m2", "taco_no_ds")  # what `encode_mosaic` takes


def check_mosaic(key) -> list[dict]:
    """The Mosaic GPU kernels vs the references (Hopper only): every op of each codec they
    take, at 16, 64 and 512 tiles per row, two fresh inputs per case (a byte the kernel skipped
    would keep the first call's value)."""
    if not _pallas.hopper_gpu():
        return []
    rows = []
    for c, name in enumerate(MOSAIC_CHECK_CODECS):
        codec = codecs.get_codec(name, 128)
        for i, tiles in enumerate((16, 64, 512)):  # tiles of 64 groups per row
            n = tiles * 64 * 128
            for rep in range(2):
                k = jax.random.fold_in(key, 1000 + 10 * c + 2 * i + rep)
                x = (jax.random.normal(k, (PEERS, n), jnp.float32) * 3).astype(jnp.bfloat16)
                row = dict(codec=name, backend="mosaic", n=n, rep=rep)
                row.update(_check_mosaic_ops(codec, x, n))
                rows.append(row)
                print("CHECK", json.dumps(row), flush=True)
    return rows


def _check_mosaic_ops(codec, x, n) -> dict:
    """Each Mosaic op of `codec` on `x` (PEERS rows of n) against its reference, the sums with
    and without peer steps."""
    ref = pk.encode_reference(codec, x)
    wire = encode_mosaic.encode(codec, x)
    diffs, steps = _ulp_mismatch(codec, wire, ref, n)
    out = dict(
        encode_code_mismatch=diffs,
        encode_max_code_steps=steps,
        encode_scale_max_rel=_side_difference(codec, wire, ref, n),
    )
    dec = decode_mosaic.decode(codec, ref, n, jnp.float32)
    dec_ref = pk.decode_reference(codec, ref, n)
    out["decode_max_rel"] = float(jnp.max(jnp.abs(dec - dec_ref)) / jnp.max(jnp.abs(dec_ref)))
    s_ref = pk.decode_sum_reference(codec, ref, n)
    r_ref = pk.decode_sum_reencode_reference(codec, ref, n)
    for suffix, peer_steps in (("", False), ("_peer_steps", True)):
        s = decode_mosaic.decode_sum(codec, ref, n, peer_steps=peer_steps)
        out[f"decode_sum{suffix}_max_rel"] = float(
            jnp.max(jnp.abs(s - s_ref)) / jnp.max(jnp.abs(s_ref))
        )
        r = decode_mosaic.decode_sum_reencode(codec, ref, n, peer_steps=peer_steps)
        diffs, code_steps = _ulp_mismatch(codec, r, r_ref, n)
        out[f"dsr{suffix}_code_mismatch"] = diffs
        out[f"dsr{suffix}_max_code_steps"] = code_steps
        out[f"dsr{suffix}_scale_max_rel"] = _side_difference(codec, r, r_ref, n)
    return out


def bench(
    key,
    sizes: list[int],
    codec_name="taco",
    backends=("auto",),
    reference=True,
    interpret=False,
    calls=None,
    **compare,
) -> tuple[list[dict], list[dict]]:
    """Per message size (bytes of bf16): an XLA copy of the same bytes (a negate, the
    baseline) and each op of `_ops`, in one program of dependent calls each, interleaved with
    an A/A control (`timing.compare`). Rows per size and the comparisons' raw times."""
    codec = codecs.get_codec(codec_name, 128)
    ops = _ops(codec, backends, reference, interpret)
    rows, comparisons = [], []
    for size in sizes:
        elements = size // 2
        calls_here = calls or (IN_PROGRAM_CALLS if size >= MiB else LATENCY_CALLS)
        xs = _inputs(codec, elements, key, "x", rotate=size >= MiB)
        wires = _inputs(codec, elements, key, "wire", rotate=size >= MiB)
        samplers = {"copy": timing.in_program(lambda x: -x, xs, calls_here)}
        for name, (fn, kind, _) in ops.items():
            if _applies_at(name, codec, elements):
                inputs = xs if kind == "x" else wires
                samplers[name] = timing.in_program(fn, inputs, calls_here)
        result = timing.compare(samplers, "copy", **compare)
        comparisons.append(dict(bytes=size, calls=calls_here, **result))
        rows.append(_row(size, ops, result))
        print("BENCH", json.dumps(rows[-1]), flush=True)
        del xs, wires
    return rows, comparisons


def _row(size: int, ops, result) -> dict:
    """Medians per op: seconds a call, TB/s of logical IO, the share of the copy's bandwidth
    (median of the paired ratios, with its interval)."""
    times, summary = result["times_s"], result["summary"]
    median = lambda name: statistics.median(times[name])  # noqa: E731
    row = dict(
        bytes=size,
        copy_in_program_s=median("copy"),
        copy_in_program_tbps=2 * size / median("copy") / 1e12,
        aa=summary[timing.AA_RATIO],
    )
    for name, (_, _, io) in ops.items():
        if name not in times:
            continue
        nbytes, share = io(size // 2), summary[name]
        scale = nbytes / (2 * size)  # the op's bytes over the copy's
        row[name] = dict(
            kernel_in_program_s=median(name),
            in_program_tbps=nbytes / median(name) / 1e12,
            in_program_of_copy=share["median"] * scale,
            of_copy_interval=[v * scale for v in share["interval"]],
        )
    return row


def _default_configs(codec, n: int) -> dict:
    """The launch each Triton kernel takes for PEERS rows of n values of `codec`."""
    launches = {
        "encode": encode_kernel.default_config(codec, PEERS, n),
        "decode": decode_kernel.default_config(codec, PEERS, n),
        "decode_sum": decode_sum_kernel.default_config(codec, PEERS, n),
        "decode_sum_reencode": decode_sum_kernel.default_config(codec, PEERS, n, reencode=True),
    }
    return {op: dataclasses.asdict(cfg) for op, cfg in launches.items()}


def _sizes(text: str, unit: int) -> list[int]:
    return [int(float(v) * unit) for v in text.split(",") if v]


def main(argv=None):
    global PEERS  # --peers: the rows of every message timed
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--sizes-mib", default="1,4,16,64,256,1024")
    p.add_argument("--sizes-kib", default="64,256", help="sizes below 1 MiB (latency)")
    p.add_argument("--codec", default="taco")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--check-mosaic-only", action="store_true", help="check only the Mosaic ops")
    p.add_argument(
        "--backends",
        nargs="+",
        default=["auto"],
        choices=BACKENDS,
        help="kernels timed per op: auto (the registry's, as the collectives call), triton, mosaic",
    )
    p.add_argument("--peers", type=int, default=PEERS, help="rows of each message (TP group)")
    p.add_argument("--reference", action="store_true", help="also time the jnp references")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="the registry's kernels in Pallas' CPU interpreter (a check)",
    )
    p.add_argument(
        "--calls",
        type=int,
        default=None,
        help=f"calls a program (default {IN_PROGRAM_CALLS}; {LATENCY_CALLS} below 1 MiB)",
    )
    p.add_argument("--budget-s", type=float, default=20.0, help="per size")
    p.add_argument("--min-repeats", type=int, default=timing.MIN_REPEATS)
    p.add_argument("--max-repeats", type=int, default=30)
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="time.time() after which sizes stop at their minimum rounds",
    )
    p.add_argument("--suffix", default="", help="appended to the record's file name")
    args = p.parse_args(argv)
    PEERS = args.peers
    if args.interpret and args.backends != ["auto"]:
        p.error("--interpret times the registry's kernels: --backends auto")
    key = jax.random.key(int(time.time()))  # fresh data every run
    t0 = time.time()
    checks = [] if args.skip_check else check_mosaic(key)
    if not (args.skip_check or args.check_mosaic_only):
        checks = check(key) + checks
    t_check = time.time() - t0
    sizes = _sizes(args.sizes_kib, 1024) + _sizes(args.sizes_mib, MiB)
    rows, comparisons = bench(
        key,
        sizes,
        args.codec,
        args.backends,
        args.reference,
        args.interpret,
        args.calls,
        budget_s=args.budget_s,
        min_repeats=args.min_repeats,
        max_repeats=args.max_repeats,
        deadline=args.deadline,
    )
    codec = codecs.get_codec(args.codec, 128)
    write_record(
        "kernels" if args.codec == "taco" else f"kernels-{args.codec}",
        args.out,
        suffix=args.suffix,
        codec=args.codec,
        backends=args.backends,
        group_size=128,
        peers=PEERS,
        interpret=args.interpret,
        # The kernel each op runs at the largest size, and the launches of the Triton ones.
        registry={
            op: registry.kernel_for(
                op,
                codec,
                n=max(sizes) // 2 // PEERS,
                dtype=None if op == "decode_sum_reencode" else jnp.bfloat16,
                peers=PEERS,
                interpret=args.interpret,
            )
            for op in registry.OPS
        },
        block_configs=_default_configs(codec, max(sizes) // 2 // PEERS),
        check_seconds=t_check,
        checks=checks,
        bench=rows,
        comparisons=comparisons,
    )
    names = [name for name in _ops(codec, args.backends, args.reference) if name in rows[0]]
    print("% of the copy's bandwidth, in one program (median [interval])")
    print(f"{'bytes':>12} {'copy TB/s':>10} " + " ".join(f"{k[:22]:>24}" for k in names))
    for r in rows:
        cells = [
            f"{o['in_program_of_copy']:5.0%} [{o['of_copy_interval'][0]:4.0%}, "
            f"{o['of_copy_interval'][1]:4.0%}]"
            if (o := r.get(k))
            else "-"
            for k in names
        ]
        print(
            f"{r['bytes']:>12} {r['copy_in_program_tbps']:10.2f} "
            + " ".join(f"{c:>24}" for c in cells)
        )


if __name__ == "__main__":
    main()
