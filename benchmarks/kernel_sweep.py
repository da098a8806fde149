"""Launch-configuration study of the fused kernels on a GPU, in one call (BENCHMARKS.md, notes).

PYTHONPATH=. python3 benchmarks/kernel_sweep.py --out $OUT   (on the device machine)

For each op (encode, decode, decode-sum, decode-sum-reencode; codec taco, G = 128, 8 rows) and
each `BlockConfig` of the sweep: a correctness check against the reference on fresh data (codes
one step apart only at ties is not re-derived here: the sweep reports the mismatch count, the
test suite owns the tolerance), then the median time at `--size-mib`. Diagnostics timed in the
same run, to place the time inside a kernel by leaving a stage out (METHOD.md):
- `xla_copy` (a negate of the same bytes) and `pallas_copy` (a Pallas kernel with the kernels'
  own 1-D masked load/store pattern): the streaming ceilings;
- `no_hadamard`: encode / decode with the Hadamard replaced by the identity (wrong output,
  time only): what the dot and its layout shuffles cost;
- codec `fp8` (no pre-scale, no Hadamard): a real codec without the dot.
The best config per op is then timed at `--confirm-mib` beside the copy ceilings.

--baseline times the kernels of an earlier revision at their own default launches in the same
run (`bash benchmarks/baseline_package.sh REV` exports them to build/baseline; carry that path).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks import _common
from benchmarks.kernels import (
    IN_PROGRAM_CALLS,
    PEERS,
    _inputs,
    _n,
    _timeit,
    _ulp_mismatch,
    in_program_seconds,
    torch_copy_tbps,
)
from pallas_kernels import _pallas, _tile
from taco_jax import codecs

MiB = 1 << 20
C = pk.BlockConfig
SWEEPS = {
    # 1: tile size, warps, in-kernel signs, factored dot, pipelined tile loops.
    1: [
        C(64, num_warps=8),  # the default at large sizes before sweep 1
        C(16, num_warps=4),
        C(32, num_warps=4),
        C(32, num_warps=8),
        C(64, num_warps=4),
        C(128, num_warps=8),
        C(128, num_warps=16),
        C(64, num_warps=8, signs_in_kernel=True),
        C(64, num_warps=8, hadamard_dot=64),
        C(64, num_warps=8, hadamard_dot=32),
        C(16, num_warps=4, tiles_per_program=8, num_stages=3),
        C(32, num_warps=4, tiles_per_program=4, num_stages=3),
        C(64, num_warps=8, tiles_per_program=4, num_stages=3),
        C(32, num_warps=4, tiles_per_program=4, num_stages=1),
    ],
    # 2: sweep 1's best tiles, and tile loops that prefetch the next tile into registers.
    2: [
        C(64, num_warps=4),
        C(128, num_warps=8),
        C(16, num_warps=4),
        C(128, num_warps=4),
        C(64, num_warps=4, tiles_per_program=4, num_stages=1),
        C(64, num_warps=4, tiles_per_program=4, num_stages=1, prefetch=True),
        C(64, num_warps=4, tiles_per_program=8, num_stages=1, prefetch=True),
        C(32, num_warps=4, tiles_per_program=4, num_stages=1, prefetch=True),
        C(128, num_warps=8, tiles_per_program=4, num_stages=1, prefetch=True),
        C(128, num_warps=4, tiles_per_program=4, num_stages=1, prefetch=True),
        C(16, num_warps=4, tiles_per_program=8, num_stages=1, prefetch=True),
        C(64, num_warps=8, tiles_per_program=4, num_stages=1, prefetch=True),
        C(64, num_warps=2, tiles_per_program=4, num_stages=1, prefetch=True),
    ],
    # 3: longer plain tile loops around the default chosen from sweep 2 (t64 w4 x4).
    3: [
        C(64, num_warps=4, tiles_per_program=4, num_stages=1),
        C(64, num_warps=4, tiles_per_program=8, num_stages=1),
        C(64, num_warps=4, tiles_per_program=16, num_stages=1),
        C(32, num_warps=4, tiles_per_program=8, num_stages=1),
        C(128, num_warps=4, tiles_per_program=4, num_stages=1),
    ],
    # 4: after folding the per-group factors (one multiply per element, no division) and feeding
    # bf16 tiles to the dot as loaded: the ASH energy after the dot, which lets the input tile die
    # at the dot, so that prefetch, Triton pipelining and larger tiles may fit in registers again.
    4: [
        C(64, num_warps=4, tiles_per_program=4, num_stages=1),
        C(64, num_warps=4, tiles_per_program=4, num_stages=1, energy_after_dot=True),
        C(64, num_warps=4, tiles_per_program=4, num_stages=1, energy_after_dot=True, prefetch=True),
        C(64, num_warps=4, tiles_per_program=4, num_stages=2, energy_after_dot=True),
        C(64, num_warps=8, tiles_per_program=4, num_stages=1, energy_after_dot=True),
        C(128, num_warps=8, tiles_per_program=4, num_stages=1, energy_after_dot=True),
        C(128, num_warps=4, tiles_per_program=4, num_stages=1, energy_after_dot=True),
        C(32, num_warps=4, tiles_per_program=8, num_stages=1, energy_after_dot=True),
        C(16, num_warps=4, tiles_per_program=1, num_stages=1),
        C(16, num_warps=4, tiles_per_program=4, num_stages=1),
    ],
    # 5: smaller dots. The 64 x 128 x 128 dot of a tile is 256 flop per element, ~30% of the
    # tensor cores at encode's 2.75 TB/s; peeling the low index bits off as fp32 butterflies
    # (hadamard_dot b < G: G / b dots of b columns) divides that by G / b.
    5: [
        C(64, num_warps=4, tiles_per_program=4, num_stages=1),
        C(64, num_warps=4, tiles_per_program=4, num_stages=1, hadamard_dot=64),
        C(64, num_warps=4, tiles_per_program=4, num_stages=1, hadamard_dot=32),
        C(64, num_warps=4, tiles_per_program=4, num_stages=1, hadamard_dot=16),
        C(64, num_warps=8, tiles_per_program=4, num_stages=1, hadamard_dot=64),
        C(128, num_warps=4, tiles_per_program=4, num_stages=1, hadamard_dot=64),
        C(128, num_warps=8, tiles_per_program=4, num_stages=1, hadamard_dot=32),
        C(32, num_warps=4, tiles_per_program=4, num_stages=1, hadamard_dot=64),
        C(16, num_warps=4, tiles_per_program=4, num_stages=1),
        C(16, num_warps=4, tiles_per_program=4, num_stages=1, hadamard_dot=64),
    ],
    # 6: tile loops again, now that the staged +-1 block is 0.5-8 KiB instead of 32 KiB: a loop
    # of 4 leaves a tail of up to half a program per SM, ~10% of a 64 MiB call (2 waves).
    # Run at 64 MiB with --timing in_program.
    6: [
        C(64, num_warps=4, tiles_per_program=4, num_stages=1, hadamard_dot=16),
        C(64, num_warps=4, tiles_per_program=2, num_stages=1, hadamard_dot=16),
        C(64, num_warps=4, tiles_per_program=1, num_stages=1, hadamard_dot=16),
        C(32, num_warps=4, tiles_per_program=1, num_stages=1, hadamard_dot=16),
        C(128, num_warps=4, tiles_per_program=1, num_stages=1, hadamard_dot=16),
        C(16, num_warps=4, tiles_per_program=4, num_stages=1, hadamard_dot=64),
        C(16, num_warps=4, tiles_per_program=1, num_stages=1, hadamard_dot=64),
        C(16, num_warps=4, tiles_per_program=1, num_stages=1, hadamard_dot=16),
    ],
}


def config_name(c: pk.BlockConfig) -> str:
    return (
        f"t{c.groups_per_tile}w{c.num_warps}s{c.num_stages}x{c.tiles_per_program}"
        f"d{c.hadamard_dot}{'i' if c.signs_in_kernel else ''}{'p' if c.prefetch else ''}"
        f"{'e' if c.energy_after_dot else ''}"
    )


def ops(codec, cfg, kernels=pk):
    """name -> (jitted fused op, reference op, input kind, logical IO bytes for `elements`).

    kernels: the package whose kernels run (pallas_kernels, or the --baseline one)."""
    wb = codec.wire_bytes
    m = lambda el: el // PEERS  # noqa: E731
    kw = dict(config=cfg)
    # The sweep studies the Triton launches: keep "auto" from taking the Mosaic encode.
    encode_kw = dict(kw, backend="triton") if kernels is pk else kw
    return {
        "encode": (
            jax.jit(lambda x: kernels.encode(codec, x, **encode_kw)),
            pk.encode_reference,
            "x",
            lambda el: 2 * el + PEERS * wb(m(el)),
        ),
        "decode": (
            jax.jit(lambda w: kernels.decode(codec, w, _n(codec, w), jnp.bfloat16, **kw)),
            lambda c, w: pk.decode_reference(c, w, _n(c, w), jnp.bfloat16),
            "wire",
            lambda el: PEERS * wb(m(el)) + 2 * el,
        ),
        "decode_sum": (
            jax.jit(lambda w: kernels.decode_sum(codec, w, _n(codec, w), **kw)),
            lambda c, w: pk.decode_sum_reference(c, w, _n(c, w)),
            "wire",
            lambda el: PEERS * wb(m(el)) + 4 * m(el),
        ),
        "decode_sum_reencode": (
            jax.jit(lambda w: kernels.decode_sum_reencode(codec, w, _n(codec, w), **kw)),
            lambda c, w: pk.decode_sum_reencode_reference(c, w, _n(c, w)),
            "wire",
            lambda el: (PEERS + 1) * wb(m(el)),
        ),
    }


def check(codec, name, fused, reference, key) -> dict:
    """Fused vs reference on fresh data, 3 whole tiles of 64 groups + a partial one, per row."""
    n = codec.group_size * (3 * 128 + 5)
    x = jax.random.normal(key, (PEERS, n), jnp.float32).astype(jnp.bfloat16) * 3
    arg = x if name == "encode" else pk.encode_reference(codec, x)
    got, want = fused(arg), reference(codec, arg)
    if got.dtype == jnp.uint8:
        mism, steps = _ulp_mismatch(got.reshape(-1, got.shape[-1])[:, :n],
                                    want.reshape(-1, want.shape[-1])[:, :n])  # fmt: skip
        return dict(code_mismatch=mism, max_code_steps=steps)
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    return dict(max_rel=err, finite=bool(jnp.all(jnp.isfinite(got))))


def _copy_kernel(x_ref, out_ref, *, n: int, tile: int):
    row, t = _pallas.program_id(0), _pallas.program_id(1)
    v = _tile.load_1d(x_ref, row, t * tile, tile, n, masked=False)
    _tile.store_1d(out_ref, row, t * tile, -v, n, masked=False)


def pallas_copy(x, tile: int, warps: int):
    rows, n = x.shape
    return _pallas.call(
        _pallas.partial(_copy_kernel, n=n, tile=tile),
        x,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows, n // tile),
        name="pallas_copy",
        interpret=False,
        num_warps=warps,
        num_stages=1,
    )


@contextlib.contextmanager
def no_hadamard():
    """Diagnostic: the kernels' Hadamard becomes the identity (output wrong, time only)."""
    saved = _tile.signed_hadamard
    _tile.signed_hadamard = lambda x, *a, **k: x.astype(jnp.float32)
    try:
        yield
    finally:
        _tile.signed_hadamard = saved


# "host": batches of host-dispatched calls; "in_program": dependent calls inside one jitted
# program (no per-call dispatch, which a kernel of <= 64 MiB does not outlast). Set by --timing.
TIMING = "host"


def time_row(fn, inputs, io_bytes) -> dict:
    if TIMING == "in_program":
        seconds, spread = in_program_seconds(fn, inputs, IN_PROGRAM_CALLS), None
    else:
        seconds, spread = _timeit(fn, inputs)
    return dict(seconds=seconds, tbps=io_bytes / seconds / 1e12, spread=spread)


def _data_and_copy(size: int, key):
    """taco inputs of `size` bf16 bytes (x and its wire) and the two copy ceilings timed on them."""
    codec = codecs.get_codec("taco", 128)
    xs = _inputs(codec, size // 2, key, "x")
    wires = _inputs(codec, size // 2, key, "wire")
    out = {"xla_copy": time_row(jax.jit(lambda x: -x), xs, 2 * size)}
    out["torch_copy_tbps"] = torch_copy_tbps(size)
    return codec, xs, wires, out


def _launches(configs, baseline):
    """(row label, config, kernels package) of each launch the sweep times."""
    runs = [(config_name(c), c, pk) for c in configs]
    if baseline is not None:
        runs.append((f"baseline_{baseline.REVISION[:7]}", None, baseline))
    return runs


def sweep(size: int, key, configs, baseline=None) -> dict:
    codec, xs, wires, out = _data_and_copy(size, key)
    elements = size // 2
    for tile, warps in ((4096, 4), (8192, 8), (16384, 8)):
        fn = jax.jit(lambda x, t=tile, w=warps: pallas_copy(x, t, w))
        out[f"pallas_copy_{tile}w{warps}"] = time_row(fn, xs, 2 * size)
    print("CEILINGS", json.dumps(out), flush=True)
    rows = []
    for i, (label, cfg, kernels) in enumerate(_launches(configs, baseline)):
        for op, (fused, ref, kind, io) in ops(codec, cfg, kernels).items():
            fields = {} if cfg is None else dataclasses.asdict(cfg)
            row = dict(config=label, op=op, **fields)
            try:
                row["check"] = check(codec, op, fused, ref, jax.random.fold_in(key, i))
                row.update(time_row(fused, xs if kind == "x" else wires, io(elements)))
                row["of_torch_copy"] = row["tbps"] / out["torch_copy_tbps"]
            except Exception as e:  # a config Triton rejects is a result too
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print("SWEEP", json.dumps(row), flush=True)
    out["sweep"] = rows
    diag = []
    with no_hadamard():
        for op, (fused, _, kind, io) in ops(codec, configs[0]).items():
            if op in ("encode", "decode"):
                r = time_row(fused, xs if kind == "x" else wires, io(elements))
                diag.append(dict(op=op, variant="no_hadamard", **r))
    fp8 = codecs.get_codec("fp8", 128)
    fxs, fwires = xs, _inputs(fp8, elements, key, "wire")
    for op, (fused, _, kind, io) in ops(fp8, configs[0]).items():
        r = time_row(fused, fxs if kind == "x" else fwires, io(elements))
        diag.append(dict(op=op, variant="codec_fp8", **r))
    for d in diag:
        print("DIAG", json.dumps(d), flush=True)
    out["diagnostics"] = diag
    return out


def confirm(size: int, key, best: dict[str, pk.BlockConfig], baseline=None) -> dict:
    codec, xs, wires, out = _data_and_copy(size, key)
    elements = size // 2
    for op, cfg in best.items():
        runs = [("default", None, pk), ("best", cfg, pk)]
        if baseline is not None:
            runs.append(("baseline", None, baseline))
        for label, c, kernels in runs:
            fused, _, kind, io = ops(codec, c, kernels)[op]
            r = time_row(fused, xs if kind == "x" else wires, io(elements))
            r["of_torch_copy"] = r["tbps"] / out["torch_copy_tbps"]
            out[f"{op}_{label}"] = dict(config=None if c is None else config_name(c), **r)
    print("CONFIRM", json.dumps(out), flush=True)
    return out


def best_configs(rows) -> dict[str, pk.BlockConfig]:
    best = {}
    for op in ("encode", "decode", "decode_sum", "decode_sum_reencode"):
        ok = [r for r in rows if r["op"] == op and "tbps" in r and "groups_per_tile" in r]
        top = max(ok, key=lambda r: r["tbps"])
        fields = {f.name: top[f.name] for f in dataclasses.fields(pk.BlockConfig)}
        best[op] = pk.BlockConfig(**fields)
    return best


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--confirm-mib", type=int, default=1024)
    p.add_argument("--sweep", type=int, default=max(SWEEPS), choices=sorted(SWEEPS))
    p.add_argument("--baseline", action="store_true", help="also time build/baseline's kernels")
    p.add_argument("--timing", choices=("host", "in_program"), default="host")
    args = p.parse_args()
    global TIMING
    TIMING = args.timing
    key = jax.random.key(np.random.SeedSequence().entropy % 2**31)  # fresh data every run
    configs = SWEEPS[args.sweep]
    baseline = load_baseline() if args.baseline else None
    result = sweep(args.size_mib * MiB, key, configs, baseline)
    best = best_configs(result["sweep"])
    result["confirm"] = confirm(args.confirm_mib * MiB, key, best, baseline)
    _common.write_record(
        f"kernel_sweep{args.sweep}",
        args.out,
        sweep_id=args.sweep,
        size_mib=args.size_mib,
        confirm_mib=args.confirm_mib,
        baseline_revision=None if baseline is None else baseline.REVISION,
        timing=TIMING,
        **result,
    )
    print(f"{'config':<22} " + " ".join(f"{op[:12]:>14}" for op in best))
    for name, _, _ in _launches(configs, baseline):
        cells = []
        for op in best:
            r = next(r for r in result["sweep"] if r["config"] == name and r["op"] == op)
            cells.append(f"{r['tbps']:5.2f} {r['of_torch_copy']:4.0%}" if "tbps" in r else "err")
        print(f"{name:<22} " + " ".join(f"{c:>14}" for c in cells))


def load_baseline():
    """The package `benchmarks/baseline_package.sh` exported, with its git revision."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build")
    sys.path.insert(0, os.path.join(root, "baseline"))
    kernels = importlib.import_module("pallas_kernels_base")
    with open(os.path.join(root, "baseline", "pallas_kernels_base", "REVISION")) as f:
        kernels.REVISION = f.read().strip()
    return kernels


if __name__ == "__main__":
    main()
