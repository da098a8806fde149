"""Checks and times the fused codec kernels of `pallas_kernels` on one GPU (BENCHMARKS.md, Kernels).

    PYTHONPATH=. python benchmarks/kernels.py --out $OUT       # every check, 1 MiB .. 1 GiB

Codec `taco` (or `--codec NAME`: record `kernels-NAME-<date>.json`), G = 128, messages of 8 rows
(an 8-way TP group); needs a CUDA GPU (the kernels run compiled, not interpreted). One run, one
record `kernels-<date>.json`:
1. Checks, on fresh random data each run: every fused codec (and `taco` with G = 32 .. 512),
   bf16 and fp32 input, rows that do not fill a tile, two poisons of the outputs to catch
   unwritten bytes; codes compared in code steps, scales relatively, against the references.
   Then the Mosaic GPU kernels (Hopper only): every op each codec of MOSAIC_CHECK_CODECS has
   one for, at 16, 64 and 512 tiles per row, two fresh inputs each. `--check-mosaic-only` runs
   only the latter, `--skip-check` neither.
2. Timings per bf16 message size (`--latency-kib`, `--sizes-mib`): a copy of the same bytes
   (an XLA negate; from 64 MiB also torch's `copy_`, timed with CUDA events, where torch is
   installed), the XLA-fused jnp references (unless `--no-reference`) and the kernels of each
   op (encode, decode, decode-sum, decode-sum-reencode) for each of `--backends`: "auto" (as
   the collectives call them), "triton", "mosaic" (the public ops' Mosaic kernels: the sums
   with peer steps by `decode_mosaic.default_peer_steps`), "mosaic_steps" and "mosaic_rows"
   (the Mosaic sums with one peer's tile, or every peer's, per pipeline step), Mosaic only at
   sizes its kernels take. Two
   timings: host-dispatched batches (`kernel_s`, `_common.batched_seconds`) and 16 dependent
   calls inside one jitted program (`kernel_in_program_s`, `_common.in_program_seconds`, no
   per-call dispatch, which at 64 MiB lasts as long as a kernel). Inputs rotate over >= 256 MiB
   so that nothing is served from L2.
3. Small messages (`--in-program-kib`): each op's latency inside one program of 200 dependent
   calls (one input, in L2 as a fresh activation would be), beside a one-element negate (the
   floor); `launch_floor_s` is a host-dispatched one-element jitted op.
Bandwidth is logical IO: bytes read + bytes written, once each.

`--matmul-encode [MxKxH ...]` times the encode in the matmul's epilogue instead (record
`matmul_encode-<date>.json`, rewritten after each shape; default shapes: the emulated steps'
row-parallel projections, then smaller products): per shape, one call's device time in a
program of 16 dependent calls of XLA's matmul; XLA's matmul then `pallas_kernels.encode`
("auto") of the product as it lies (what the collectives encode) and in `codecs.tile_major`
order (`matmul_encode(backend="unfused")`, an XLA transpose more); the fused kernel given the
folded weight, the fold (once per weight and step), and the kernel with the Hadamard in its
epilogue (no fold). docs/development_history.md, "The encode in a warp-specialized matmul's
epilogue".

    PYTHONPATH=. python benchmarks/kernels.py --matmul-encode --out $OUT
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
)
from pallas_kernels import matmul_encode_mosaic as mem
from taco_jax import codecs

PEERS = 8  # rows of the benchmark: an 8-way TP group
MiB = 1 << 20
L2_FLUSH_BYTES = 256 * MiB  # > 4x the H200's 60 MB L2
IN_PROGRAM_CALLS = 16  # dependent calls per program at bandwidth sizes (inputs rotate)


def _ops(codec, backends=("auto",)):
    """name -> (fused fn, reference fn, input builder, bytes moved) for `elements` bf16 values.

    Per op, one entry per backend of `backends` ("auto": what the collectives call, named by
    the op alone; "triton", "mosaic": that kernel, named `<op>_<backend>`, Mosaic only where
    its kernel applies: Hopper, 8-bit codes)."""
    m = lambda el: el // PEERS  # noqa: E731
    wb = codec.wire_bytes
    n_of = lambda w: _n(codec, w)  # noqa: E731
    ops = {
        "encode": (
            lambda b: lambda x: pk.encode(codec, x, backend=b),
            lambda x: pk.encode_reference(codec, x),
            "x",
            lambda el: 2 * el + PEERS * wb(m(el)),
        ),
        "decode": (
            lambda b: lambda w: pk.decode(codec, w, n_of(w), jnp.bfloat16, backend=b),
            lambda w: pk.decode_reference(codec, w, n_of(w), jnp.bfloat16),
            "wire",
            lambda el: PEERS * wb(m(el)) + 2 * el,
        ),
        "decode_sum": (
            lambda b: lambda w: pk.decode_sum(codec, w, n_of(w), backend=b),
            lambda w: pk.decode_sum_reference(codec, w, n_of(w)),
            "wire",
            lambda el: PEERS * wb(m(el)) + 4 * m(el),
        ),
        "decode_sum_reencode": (
            lambda b: lambda w: pk.decode_sum_reencode(codec, w, n_of(w), backend=b),
            lambda w: pk.decode_sum_reencode_reference(codec, w, n_of(w)),
            "wire",
            lambda el: (PEERS + 1) * wb(m(el)),
        ),
    }
    # "mosaic_steps" / "mosaic_rows": the Mosaic sums with `peer_steps` on / off.
    sums = {
        f"mosaic_{kind}": {
            "decode_sum": lambda w, s=steps: decode_mosaic.decode_sum(
                codec, w, n_of(w), peer_steps=s
            ),
            "decode_sum_reencode": lambda w, s=steps: decode_mosaic.decode_sum_reencode(
                codec, w, n_of(w), peer_steps=s
            ),
        }
        for kind, steps in (("steps", True), ("rows", False))
    }
    out = {}
    for op, (fused, reference, kind, io) in ops.items():
        for backend in backends:
            if backend.startswith("mosaic") and not _mosaic_applies(op, codec):
                continue
            if backend in sums and op not in sums[backend]:
                continue
            fn = sums[backend][op] if backend in sums else fused(backend)
            name = op if backend == "auto" else f"{op}_{backend}"
            out[name] = (jax.jit(fn), jax.jit(reference), kind, io)
    return out


def _mosaic_applies(op: str, codec, n: int = 1 << 20) -> bool:
    """Whether `op` has a Mosaic GPU kernel for `codec` here, for rows of `n` elements."""
    if not _pallas.hopper_gpu():
        return False
    if op == "encode":
        x = jax.ShapeDtypeStruct((PEERS, n), jnp.bfloat16)
        return encode_mosaic.unsupported(codec, x) is None
    return decode_mosaic.unsupported(codec, n, reencode=op == "decode_sum_reencode") is None


def _applies_at(name: str, codec, elements: int) -> bool:
    """Whether the timed variant `name` (`_ops`) runs at a message of `elements` values."""
    if "_mosaic" not in name:
        return True
    op = name.split("_mosaic")[0]
    return _mosaic_applies(op, codec, elements // PEERS)


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
    """interpret=False vs reference for every fused codec; returns rows for the JSON."""
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
            wire = pk.encode(codec, x, out_init=poison)
            ref = pk.encode_reference(codec, x)
            diffs, steps = _ulp_mismatch(codec, wire, ref, n)
            dec = pk.decode(codec, ref, n, jnp.float32, out_init=jnp.full((PEERS, n), jnp.nan))
            dec_ref = pk.decode_reference(codec, ref, n)
            dec_err = float(jnp.max(jnp.abs(dec - dec_ref)) / jnp.max(jnp.abs(dec_ref)))
            s = pk.decode_sum(codec, ref, n, out_init=jnp.full((n,), jnp.nan))
            s_ref = pk.decode_sum_reference(codec, ref, n)
            sum_err = float(jnp.max(jnp.abs(s - s_ref)) / jnp.max(jnp.abs(s_ref)))
            r = pk.decode_sum_reencode(codec, ref, n, out_init=jnp.full((b,), 0xAB, jnp.uint8))
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
                unwritten=int(jnp.sum(wire != pk.encode(codec, x, out_init=poison ^ 0xFF)))
                + int(
                    jnp.sum(r != pk.decode_sum_reencode(codec, ref, n, out_init=poison[0] ^ 0xFF))
                ),
            )
            rows.append(row)
            print("CHECK", json.dumps(row), flush=True)
    return rows


MOSAIC_CHECK_CODECS = ("taco", "taco_e8m0", "taco_e5m2", "fp8", "int8", "int8_hadamard",
                       "int6_hadamard", "int5_hadamard", "int4_hadamard")  # fmt: skip


def check_mosaic(key) -> list[dict]:
    """The Mosaic GPU kernels vs the references (Hopper only): every op each codec of
    `MOSAIC_CHECK_CODECS` has a Mosaic kernel for, at 16, 64 and 512 tiles per row, two fresh
    inputs per case (a byte the kernel skipped would keep the first call's value)."""
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
    """Each Mosaic op of `codec` on `x` (PEERS rows of n) against its reference."""
    out = {}
    ref = pk.encode_reference(codec, x)
    if encode_mosaic.unsupported(codec, x) is None:
        wire = pk.encode(codec, x, backend="mosaic")
        diffs, steps = _ulp_mismatch(codec, wire, ref, n)
        out.update(encode_code_mismatch=diffs, encode_max_code_steps=steps,
                   encode_scale_max_rel=_side_difference(codec, wire, ref, n))  # fmt: skip
    if decode_mosaic.unsupported(codec, n) is None:
        dec = pk.decode(codec, ref, n, jnp.float32, backend="mosaic")
        dec_ref = pk.decode_reference(codec, ref, n)
        out["decode_max_rel"] = float(jnp.max(jnp.abs(dec - dec_ref)) / jnp.max(jnp.abs(dec_ref)))
        s = pk.decode_sum(codec, ref, n, backend="mosaic")
        s_ref = pk.decode_sum_reference(codec, ref, n)
        out["decode_sum_max_rel"] = float(jnp.max(jnp.abs(s - s_ref)) / jnp.max(jnp.abs(s_ref)))
    if decode_mosaic.unsupported(codec, n, reencode=True) is None:
        r = pk.decode_sum_reencode(codec, ref, n, backend="mosaic")
        r_ref = pk.decode_sum_reencode_reference(codec, ref, n)
        diffs, steps = _ulp_mismatch(codec, r, r_ref, n)
        out.update(dsr_code_mismatch=diffs, dsr_max_code_steps=steps,
                   dsr_scale_max_rel=_side_difference(codec, r, r_ref, n))  # fmt: skip
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


# The row-parallel projections of the emulated steps (BENCHMARKS.md, "Training step"): GPT-125M
# at TP = 4 (16384 tokens; attention out K = 768 / 4, MLP down K = 3072 / 4) and GPT-1.3B at
# TP = 2 (8192 tokens; K = 2048 / 2 and 8192 / 2), then smaller products.
MATMUL_ENCODE_SHAPES = ("16384x192x768", "16384x768x768", "8192x1024x2048", "8192x4096x2048",
                        "8192x768x768", "4096x768x768", "2048x768x768", "512x256x512")  # fmt: skip


def time_matmul_encode(codec, shape: str, calls: int = IN_PROGRAM_CALLS) -> dict:
    """One `--matmul-encode` row (module docstring), us per call."""
    m, k, h = (int(d) for d in shape.split("x"))
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (0.05 * jax.random.normal(kb, (k, h), jnp.float32)).astype(jnp.bfloat16)
    folded = mem.fold_hadamard(codec, b)
    inputs, weights = [(a,), (a * 1.5,)], [(b,), (b * 1.5,)]
    us = lambda fn, xs=inputs: 1e6 * in_program_seconds(fn, xs, calls)  # noqa: E731
    row = {"shape": shape, "m": m, "k": k, "h": h}
    row["xla_matmul_us"] = us(lambda x: x @ b)
    row["unfused_us"] = us(lambda x: pk.encode(codec, (x @ b).reshape(1, -1)))
    row["unfused_tile_major_us"] = us(lambda x: pk.matmul_encode(codec, x, b, backend="unfused"))
    row["fused_us"] = us(lambda x: mem.matmul_encode_kernel(codec, x, folded, hadamard="folded"))
    row["fold_us"] = us(lambda w: mem.fold_hadamard(codec, w), weights)
    epilogue = lambda x: mem.matmul_encode_kernel(codec, x, b, hadamard="epilogue")  # noqa: E731
    row["fused_epilogue_us"] = us(epilogue)
    print(
        f"{shape:>16}  matmul {row['xla_matmul_us']:7.1f} us, then encode "
        f"{row['unfused_us']:7.1f} (tile-major {row['unfused_tile_major_us']:7.1f}), fused "
        f"{row['fused_us']:7.1f} + the fold {row['fold_us']:5.1f}, Hadamard in the epilogue "
        f"{row['fused_epilogue_us']:7.1f}",
        flush=True,
    )
    return row


def matmul_encode_main(args) -> None:
    codec = codecs.get_codec(args.codec)
    rows = []
    for shape in args.matmul_encode or MATMUL_ENCODE_SHAPES:
        rows.append(time_matmul_encode(codec, shape))
        write_record(
            "matmul_encode", args.out, codec=args.codec, calls=IN_PROGRAM_CALLS,
            timing="device time of one call in one program of `calls` dependent calls, "
            "median of 7 programs", rows=rows,
        )  # fmt: skip


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
        choices=(*_pallas.BACKENDS, "mosaic_steps", "mosaic_rows"),
        help="kernels timed per op: auto (as the collectives call), triton, mosaic, "
        "mosaic_steps / mosaic_rows (the Mosaic sums with one peer's / every peer's tile per "
        "pipeline step)",
    )
    p.add_argument("--peers", type=int, default=PEERS, help="rows of each message (TP group)")
    p.add_argument("--no-reference", action="store_true", help="do not time the jnp references")
    p.add_argument("--matmul-encode", nargs="*", metavar="MxKxH",
                   help="time the encode in the matmul's epilogue instead (docstring)")  # fmt: skip
    args = p.parse_args()
    if args.matmul_encode is not None:
        return matmul_encode_main(args)
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
