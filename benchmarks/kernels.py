"""Checks and times the fused codec kernels of `pallas_kernels` on one GPU (BENCHMARKS.md, Kernels).

    PYTHONPATH=. python benchmarks/kernels.py --out $OUT       # every check, 1 MiB .. 1 GiB

Codec `taco` (or `--codec NAME`: record `kernels-NAME-<date>.json`), G = 128, messages of 8 rows
(an 8-way TP group); needs a CUDA GPU (the kernels run compiled, not interpreted). One run, one
record `kernels-<date>.json`:
1. Checks, on fresh random data each run: every fused codec (and `taco` with G = 32 .. 512),
   bf16 and fp32 input, rows that do not fill a tile, two poisons of the outputs to catch
   unwritten bytes; codes compared in code steps, scales relatively, against the references.
   Then the Mosaic GPU kernels (Hopper only): every op of each codec they take, at 16, 64 and
   512 tiles per row, two fresh inputs each. `--check-mosaic-only` runs
   only the latter, `--skip-check` neither.
2. Timings per bf16 message size (`--latency-kib`, `--sizes-mib`): a copy of the same bytes
   (an XLA negate; from 64 MiB also torch's `copy_`, timed with CUDA events, where torch is
   installed), the XLA-fused jnp references (unless `--no-reference`) and the kernels of each
   op (encode, decode, decode-sum, decode-sum-reencode) for each of `--backends`: "auto" (the
   kernel `pallas_kernels.registry` picks, as the collectives call them), "triton", "mosaic"
   (Hopper, the codecs the Mosaic kernels take; the sums of more than two peers with peer
   steps, as the registry runs them). Two timings: host-dispatched batches (`kernel_s`,
   `_common.batched_seconds`) and 16 dependent calls inside one jitted program
   (`kernel_in_program_s`, `_common.in_program_seconds`, no per-call dispatch, which at 64 MiB
   lasts as long as a kernel). Inputs rotate over >= 256 MiB so that nothing is served from L2.
3. Small messages (`--in-program-kib`): each op's latency inside one program of 200 dependent
   calls (one input, in L2 as a fresh activation would be), beside a one-element negate (the
   floor); `launch_floor_s` is a host-dispatched one-element jitted op.
Bandwidth is logical IO: bytes read + bytes written, once each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import batched_seconds, in_program_seconds, write_record

import pallas_kernels as pk
from pallas_kernels import (
    _pallas,
    decode_kernel,
    decode_mosaic,
    decode_sum_kernel,
    encode_kernel,
    encode_mosaic,
    registry,
)
from taco_jax import codecs

PEERS = 8  # rows of the benchmark: an 8-way TP group
MiB = 1 << 20
L2_FLUSH_BYTES = 256 * MiB  # > 4x the H200's 60 MB L2
IN_PROGRAM_CALLS = 16  # dependent calls per program at bandwidth sizes (inputs rotate)


BACKENDS = ("auto", "triton", "mosaic")


def _ops(codec, backends=("auto",)):
    """name -> (kernel fn, reference fn, input kind, bytes moved) for `elements` bf16 values.

    Per op, one entry per backend of `backends` ("auto": the registry's kernel, named by the op
    alone; "triton", "mosaic": that kernel, named `<op>_<backend>`, Mosaic only where its
    kernels run: a Hopper GPU, a codec they take)."""
    m = lambda el: el // PEERS  # noqa: E731
    wb = codec.wire_bytes
    n_of = lambda w: _n(codec, w)  # noqa: E731
    steps = PEERS > 2  # the registry's Mosaic sums of more than two peers
    kernels = {
        "auto": (pk.encode, pk.decode, pk.decode_sum, pk.decode_sum_reencode),
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
    for i, (op, (bind, reference, kind, io)) in enumerate(ops.items()):
        for backend in backends:
            if backend == "mosaic" and not registry.mosaic_runs(codec):
                continue
            name = op if backend == "auto" else f"{op}_{backend}"
            out[name] = (jax.jit(bind(kernels[backend][i])), jax.jit(reference), kind, io)
    return out


def _applies_at(name: str, codec, elements: int) -> bool:
    """Whether the timed variant `name` (`_ops`) runs at a message of `elements` values."""
    if "_mosaic" not in name:
        return True
    return encode_mosaic.unsupported(codec, elements // PEERS) is None


def _n(codec, wire):
    """Elements of a wire row: wire_bytes(n) = n * bits_per_element / 8."""
    return round(wire.shape[1] * 8 / codec.bits_per_element)


def _inputs(codec, elements, key, kind):
    sets = max(1, min(16, L2_FLUSH_BYTES // (2 * elements)))
    out = []
    for i in range(sets):
        x = jax.random.normal(jax.random.fold_in(key, i), (PEERS, elements // PEERS), jnp.bfloat16)
        out.append((x if kind == "x" else pk.encode_reference(codec, x),))
    return out


def _ulp_mismatch(codec, wire, ref, n: int):
    """(# differing codes, max distance in code steps) of two wire buffers of rows of `n`:
    integer grids by value, FP8 by their sign-magnitude order."""
    a, b = (np.asarray(codecs.unpack(codec, w.reshape(-1, w.shape[-1]), n).codes)
            for w in (wire, ref))  # fmt: skip
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


def bench(key, sizes_mib, latency_kib, codec_name="taco", backends=("auto",), reference=True):
    codec = codecs.get_codec(codec_name, 128)
    copy = jax.jit(lambda x: -x)
    ops = _ops(codec, backends)
    results = []
    for size in [s * 1024 for s in latency_kib] + [s * MiB for s in sizes_mib]:
        elements = size // 2
        xs = _inputs(codec, elements, key, "x")
        t_copy, spread = batched_seconds(copy, xs)
        t_copy_prog = in_program_seconds(copy, xs, IN_PROGRAM_CALLS)
        row = dict(
            bytes=size,
            copy_s=t_copy,
            copy_tbps=2 * size / t_copy / 1e12,
            spread=spread,
            copy_in_program_s=t_copy_prog,
            copy_in_program_tbps=2 * size / t_copy_prog / 1e12,
        )
        if size >= 64 * MiB:
            row["torch_copy_tbps"] = torch_copy_tbps(size)
        wires = _inputs(codec, elements, key, "wire")
        for name, (fused, ref, kind, io) in ops.items():
            if not _applies_at(name, codec, elements):
                continue
            inp = xs if kind == "x" else wires
            t_k, sp = batched_seconds(fused, inp)
            t_r = batched_seconds(ref, inp, reps=5)[0] if reference else None
            t_prog = in_program_seconds(fused, inp, IN_PROGRAM_CALLS)
            nbytes = io(elements)
            row[name] = dict(
                kernel_s=t_k,
                ref_s=t_r,
                kernel_tbps=nbytes / t_k / 1e12,
                ref_tbps=None if t_r is None else nbytes / t_r / 1e12,
                of_copy=(nbytes / t_k) / (2 * size / t_copy),
                speedup=None if t_r is None else t_r / t_k,
                spread=sp,
                kernel_in_program_s=t_prog,
                in_program_tbps=nbytes / t_prog / 1e12,
                in_program_of_copy=(nbytes / t_prog) / (2 * size / t_copy_prog),
            )
        results.append(row)
        print("BENCH", json.dumps(row), flush=True)
        del xs, wires
    return results


def torch_copy_tbps(size: int) -> float | None:
    """Device-to-device copy of `size` bytes through PyTorch (CUDA events), read + write."""
    try:
        import torch
    except ImportError:
        return None
    src = torch.randn(size // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * size / statistics.median(times) / 1e12


def latency_in_program(key, sizes_kib, codec_name="taco", backends=("auto",)) -> list[dict]:
    """Per-op in-program latency at small sizes, and the same for a one-element negate (floor)."""
    codec = codecs.get_codec(codec_name, 128)
    calls = 200
    tiny = [(jnp.ones((1,), jnp.float32),)]
    rows = [dict(bytes=4, floor_s=in_program_seconds(lambda x: -x, tiny, calls))]
    for size in (s * 1024 for s in sizes_kib):
        elements = size // 2
        x = _inputs(codec, elements, key, "x")[:1]
        wire = _inputs(codec, elements, key, "wire")[:1]
        row = dict(bytes=size, copy_s=in_program_seconds(lambda v: -v, x, calls))
        for name, (fused, _, kind, _) in _ops(codec, backends).items():
            if not _applies_at(name, codec, elements):
                continue
            row[name + "_s"] = in_program_seconds(fused, x if kind == "x" else wire, calls)
        rows.append(row)
        print("IN_PROGRAM", json.dumps(row), flush=True)
    return rows


def _default_configs(codec, n: int) -> dict:
    """The launch each Triton kernel takes for PEERS rows of n values of `codec`."""
    launches = {
        "encode": encode_kernel.default_config(codec, PEERS, n),
        "decode": decode_kernel.default_config(codec, PEERS, n),
        "decode_sum": decode_sum_kernel.default_config(codec, PEERS, n),
        "decode_sum_reencode": decode_sum_kernel.default_config(codec, PEERS, n, reencode=True),
    }
    return {op: dataclasses.asdict(cfg) for op, cfg in launches.items()}


def launch_floor():
    tiny = jax.jit(lambda x: -x)
    x = jnp.ones((1,), jnp.float32)
    return batched_seconds(tiny, [(x,)], min_time=0.05)[0]


def main():
    global PEERS  # --peers: the rows of every message timed
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--sizes-mib", default="1,4,16,64,256,1024")
    p.add_argument("--latency-kib", default="64,256")
    p.add_argument(
        "--in-program-kib",
        default="64,256,1024,4096",
        help="sizes timed inside one jitted program (empty: skip)",
    )
    p.add_argument("--codec", default="taco", help="codec of the bandwidth table")
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
    p.add_argument("--no-reference", action="store_true", help="do not time the jnp references")
    args = p.parse_args()
    PEERS = args.peers
    key = jax.random.key(int(time.time()))  # fresh data every run
    t0 = time.time()
    checks = [] if args.skip_check else check_mosaic(key)
    if not (args.skip_check or args.check_mosaic_only):
        checks = check(key) + checks
    t_check = time.time() - t0
    sizes = [int(s) for s in args.sizes_mib.split(",") if s]
    lat = [int(s) for s in args.latency_kib.split(",") if s]
    floor = launch_floor()
    print("LAUNCH_FLOOR_S", floor, flush=True)
    results = bench(key, sizes, lat, args.codec, args.backends, not args.no_reference)
    in_program_kib = [int(s) for s in args.in_program_kib.split(",") if s]
    in_program = latency_in_program(key, in_program_kib, args.codec, args.backends)
    write_record(
        "kernels" if args.codec == "taco" else f"kernels-{args.codec}",
        args.out,
        codec=args.codec,
        backends=args.backends,
        group_size=128,
        peers=PEERS,
        launch_floor_s=floor,
        in_program_latency=in_program,
        # The launches the kernels take at the largest size, per op.
        block_configs=(
            _default_configs(codecs.get_codec(args.codec, 128), max(sizes) * MiB // 2 // PEERS)
            if sizes
            else {}
        ),
        check_seconds=t_check,
        checks=checks,
        bench=results,
    )
    print("TB/s and % of copy: host-dispatched | in one program; x: speedup over the XLA ref")
    names = list(_ops(codecs.get_codec(args.codec), args.backends))
    print(f"{'bytes':>12} {'copy TB/s':>11} " + " ".join(f"{k[:13]:>28}" for k in names))
    for r in results:
        cells = [
            f"{o['kernel_tbps']:4.2f} {o['of_copy']:4.0%}|"
            f"{o['in_program_tbps']:4.2f} {o['in_program_of_copy']:4.0%} x{o['speedup'] or 0:4.1f}"
            if (o := r.get(k))
            else "-"
            for k in names
        ]
        copies = f"{r['copy_tbps']:.2f}|{r['copy_in_program_tbps']:.2f}"
        print(f"{r['bytes']:>12} {copies:>11} " + " ".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
