"""Does the 6-bit decode-sum-reencode pay for putting codes back in element order?

`int6_hadamard` splits each code over two bit planes (`codecs.code_planes`: a nibble plane, two
codes per byte, and a 2-bit plane, four per byte). The library's kernel unpacks each peer's
planes into element order (`codecs.unpack_bits`: interleaves of pairs, three levels), sums,
re-encodes and packs back (three levels of splits). Nothing in a decode-sum-reencode needs
element order: the sum is elementwise, and the re-encode needs only per-group reductions. This
study's kernel keeps the codes in *plane order*: value 4k + f of a group is class f (f < 4),
taken from nibble byte 2k + f // 2 (one split of the nibble bytes into even and odd) and 2-bit
field f of byte k; it sums and re-encodes the four classes side by side (the group's absmax is
the max over the classes' row maxima) and packs them back with one interleave, of the nibble
bytes. Same arithmetic as the library (`codecs.encode_groups` with unit 1, no pre-scale).

Checks, before timing: the plane-order kernel writes the library kernel's wire byte for byte
(and both equal the jnp reference up to rounding ties, as the library's tests check). Times,
in one jitted program each (`_common.in_program_seconds`), beside an XLA pass over the same
bytes: the library kernel with its default launch, and the plane-order kernel with the same
launch and with larger tiles.

    PYTHONPATH=. python benchmarks/plane_order.py --sizes-mib 64 --out $OUT

A study of one question (issue: the sub-byte codecs' summing kernels at copy speed); the
library is not changed by it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from _common import copy_seconds_in_program, encoded_rows, in_program_seconds, run_study
from jax import lax

import pallas_kernels as pk
from pallas_kernels import _pallas, _tile, decode_sum_kernel
from taco_jax import codecs

MiB = 1 << 20
CODEC = codecs.get_codec("int6_hadamard")
CLASSES = 4  # values per byte of the 2-bit plane


def _classes(codec, raw, tile, n, cfg):
    """One peer's tile in plane order: four fp32 arrays [T, G / 4] (class f holds values
    4k + f of each group), already multiplied by the group's decode factor."""
    (nibbles, twos), side_bytes = raw
    t, g = cfg.groups_per_tile, codec.group_size
    scale = codecs.side_from_bytes(side_bytes["scales"], 4)
    factor = codecs.decode_factor(codec, scale, None)
    pairs = lax.unstack(nibbles.reshape(t * g // CLASSES, 2), axis=1)  # bytes 2k, 2k + 1
    out = []
    for f in range(CLASSES):
        low = (pairs[f // 2] >> (4 * (f % 2))) & 0xF
        high = (twos >> (2 * f)) & 0x3
        code = (low | (high << 4)).reshape(t, g // CLASSES)
        out.append(codecs.scale_rows(codecs.dequantize(codec, code), factor))
    return out


def _reencode(codec, parts, magic_round: bool):
    """`codecs.encode_groups(codec, v, unit=1.0)` for v given as column classes `parts`:
    (codes per class, scale [T])."""
    # One reduction each over the classes' elementwise max and sum, not one per class.
    magnitude = functools.reduce(jnp.maximum, [jnp.abs(v) for v in parts])
    amax = jnp.max(magnitude, axis=-1)
    poisoned = jnp.sum(functools.reduce(jnp.add, [v * 0.0 for v in parts]), axis=-1)
    p, _ = codecs.group_normalizer(amax)
    amax_w = amax * p
    to_code = jnp.where(amax_w > 0, codec.qmax / amax_w, 0.0)
    codes = [
        codecs.quantize(codec, codecs.scale_rows(codecs.scale_rows(v, p), to_code),
                        magic_round=magic_round)
        for v in parts
    ]  # fmt: skip
    scale = amax * np.float32(1.0) / codec.qmax
    return codes, jnp.where(poisoned == 0.0, scale, jnp.nan)


def _kernel(wire_ref, out_ref, *, codec, n, cfg, interpret):
    t, g = cfg.groups_per_tile, codec.group_size
    groups, masked = n // g, cfg.masked(n // g)
    nib_plane, two_plane = codecs.code_planes(codec, n)
    (section,) = codecs.wire_sections(codec, n)

    def load(tile):
        raws = []
        for peer in range(wire_ref.shape[0]):
            nib = _tile.load_1d(wire_ref, peer, tile * t * g // 2, t * g // 2, n // 2,
                                offset=nib_plane.offset, masked=masked)  # fmt: skip
            two = _tile.load_1d(wire_ref, peer, tile * t * g // 4, t * g // 4, n // 4,
                                offset=two_plane.offset, masked=masked)  # fmt: skip
            side = _tile.load_side(wire_ref, peer, section.offset, 4, tile, t, groups,
                                   masked=masked)  # fmt: skip
            raws.append(((nib, two), {"scales": side}))
        return raws

    def process(tile, raws):
        total = None
        for raw in raws:
            parts = _classes(codec, raw, tile, n, cfg)
            total = parts if total is None else [a + b for a, b in zip(total, parts, strict=True)]
        codes, scale = _reencode(codec, total, magic_round=not interpret)
        flat = [c.reshape(t * g // CLASSES).astype(jnp.uint8) for c in codes]
        low = [(flat[2 * j] & 0xF) | ((flat[2 * j + 1] & 0xF) << 4) for j in range(2)]
        nib = lax.stack(low, axis=1).reshape(t * g // 2)
        two = None
        for f in range(CLASSES):
            bits = ((flat[f] >> 4) & 0x3) << (2 * f)
            two = bits if two is None else two | bits
        _tile.store_1d(out_ref, 0, tile * t * g // 2, nib, n // 2, offset=nib_plane.offset,
                       masked=masked)  # fmt: skip
        _tile.store_1d(out_ref, 0, tile * t * g // 4, two.astype(jnp.uint8), n // 4,
                       offset=two_plane.offset, masked=masked)  # fmt: skip
        _tile.store_side(out_ref, 0, section.offset, 4, tile, codecs.side_to_bytes(scale, 4),
                         groups, masked=masked)  # fmt: skip

    _tile.for_each_tile(cfg, _pallas.program_id(0), load, process)


def plane_order_dsr(wire, n, cfg, interpret=False):
    """wire[N, B] -> wire[B]: `pk.decode_sum_reencode(CODEC, wire, n)` in plane order."""
    return _pallas.call(
        _pallas.partial(_kernel, codec=CODEC, n=n, cfg=cfg, interpret=interpret),
        wire,
        out_shape=jax.ShapeDtypeStruct((1, CODEC.wire_bytes(n)), jnp.uint8),
        grid=(cfg.grid_size(n // CODEC.group_size),),
        name="plane_order_dsr_int6",
        interpret=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )[0]


def run(args) -> dict:
    rows = []
    for size in args.sizes_mib:
        n = int(size * MiB) // 2
        wires = encoded_rows(CODEC, args.peers, n, 2)
        default = decode_sum_kernel.default_config(CODEC, args.peers, n, reencode=True)
        library = jax.jit(
            lambda w, n=n: pk.decode_sum_reencode(CODEC, w, n, interpret=args.interpret)
        )
        want = np.asarray(library(wires[0]))
        io_bytes = args.peers * CODEC.wire_bytes(n) + CODEC.wire_bytes(n)
        copy_s = copy_seconds_in_program(io_bytes, args.calls, reps=args.reps)
        variants = {"library, default launch": (library, default)}
        for groups in args.groups:
            cfg = dataclasses.replace(default, groups_per_tile=groups)
            fn = jax.jit(lambda w, n=n, cfg=cfg: plane_order_dsr(w, n, cfg, args.interpret))
            variants[f"plane order, {groups} groups"] = (fn, cfg)
        for label, (fn, cfg) in variants.items():
            got = np.asarray(fn(wires[0]))
            same = bool(np.array_equal(got, want))
            if not same:
                raise SystemExit(f"{label}: {np.mean(got != want):.2e} of the bytes differ")
            seconds = None if args.interpret else in_program_seconds(
                fn, [(w,) for w in wires], args.calls, reps=args.reps)  # fmt: skip
            row = dict(size_mib=size, variant=label, groups_per_tile=cfg.groups_per_tile,
                       num_warps=cfg.num_warps, equal_to_library=same, seconds=seconds,
                       copy_seconds=copy_s,
                       of_copy=None if seconds is None else copy_s / seconds)  # fmt: skip
            rows.append(row)
            print("ROW", row, flush=True)
    return {"codec": CODEC.name, "peers": args.peers, "rows": rows}


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--groups", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--interpret", action="store_true", help="CPU check, no timing")


def main() -> None:
    run_study("plane_order", __doc__, run, _options, sizes_mib=(64,))


if __name__ == "__main__":
    main()
