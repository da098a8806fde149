"""Where the 6-bit decode-sum-reencode's time goes, against the 8-bit codecs' same op.

`int6_hadamard`'s decode-sum-reencode (the middle of the two-shot all-reduce) runs at 44-54% of a
copy of its bytes, where `taco`'s reaches 78-114% (BENCHMARKS.md, "Kernels"). Keeping codes in
plane order did not help (`plane_order.py`); the candidates left were the per-group reductions
and scale arithmetic. "% of a copy" divides by the bytes moved, and a 6-bit wire moves 24% fewer
bytes than an 8-bit one for the same elements: an op bound by its work per element looks slower
by that ratio. This times, for N = 2 rows of n elements, in one jitted program each beside an
XLA pass over the op's bytes (`_common.in_program_seconds`):

    int6 / int8_hadamard / taco   the library's op for each codec (default launch): the same
                                  sum and re-encode, with and without bit planes
    int6, copy                    the library's int6 op through the patches below, unchanged
                                  (must write the library's wire byte for byte)
    int6, fixed scale             the re-encode's absmax of every group fixed at 1: no per-group
                                  reduction or scale arithmetic, the quantization kept
    int6, nibble plane only       each peer's codes unpacked from the nibble plane alone (the
                                  2-bit plane is loaded but not unpacked or merged)
    int6, pack by sums            the re-encode's packing of each plane as one sum over the fields
                                  of a byte instead of pairwise splits (`codecs.pack_bits`): the
                                  same bytes, another form

Checks before timing: "copy" equals the library byte for byte; the library ops equal their jnp
references up to rounding ties (as the tests check; here: the fraction of differing bytes is
recorded); each ablated variant writes other bytes than the library, the exact rewrite the
same bytes, and every patch was called while the kernel was traced. TIMING ONLY for the two
ablated variants.

    PYTHONPATH=. python benchmarks/summing_ablation.py --sizes-mib 64 512 --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import copy_seconds_in_program, encoded_rows, in_program_seconds, run_study
from jax import lax

import pallas_kernels as pk
from taco_jax import codecs

MiB = 1 << 20


def _fixed_scale(codec, v, *, unit, magic_round=False):
    """`codecs.encode_groups` for a DS post-scale with fp32 scales, the absmax of every group
    fixed at 1: no per-group reduction (neither the max nor the non-finite test) and no
    per-group scale arithmetic, the per-element quantization kept."""
    amax = jnp.ones(v.shape[:-1], jnp.float32)
    codes = codecs.quantize(codec, v * np.float32(codec.qmax), magic_round=magic_round)
    return codes, amax * np.float32(unit / codec.qmax), None


def _pack_by_sums(values, width: int):
    """`codecs.pack_bits` as one sum over each byte's 8 / width fields (disjoint bits: the sum
    is their OR) instead of pairwise splits: the same bytes."""
    per_byte = 8 // width
    fields = values.reshape(*values.shape[:-1], -1, per_byte).astype(jnp.int32)
    shifts = width * lax.broadcasted_iota(jnp.int32, fields.shape, fields.ndim - 1)
    return jnp.sum(fields << shifts, axis=-1).astype(jnp.uint8)


def _nibble_plane_only(planes):
    """`codecs.codes_from_planes` reading the first (nibble) plane alone."""
    (plane, data), *_ = planes
    return codecs.unpack_bits(data, plane.width)


@contextlib.contextmanager
def _patched(**replacements):
    """Replaces `codecs` functions; yields the count of calls of the replacements (made while
    the kernel is traced: a patch that is never called did not take effect)."""
    saved = {name: getattr(codecs, name) for name in replacements}
    calls = collections.Counter()

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    for name, value in replacements.items():
        setattr(codecs, name, counted(name, value))
    try:
        yield calls
    finally:
        for name, value in saved.items():
            setattr(codecs, name, value)


INT6 = codecs.get_codec("int6_hadamard")
# (label, codec, patches of `codecs` or None for the library op, whether the bytes must equal
# the library's int6 op: the copy and exact rewrites must, an ablation must not)
VARIANTS = (
    ("int6_hadamard", INT6, None, None),
    ("int8_hadamard", codecs.get_codec("int8_hadamard"), None, None),
    ("taco", codecs.get_codec("taco"), None, None),
    ("int6, copy", INT6, {}, True),
    ("int6, fixed scale", INT6, {"encode_groups": _fixed_scale}, False),
    ("int6, nibble plane only", INT6, {"codes_from_planes": _nibble_plane_only}, False),
    ("int6, pack by sums", INT6, {"pack_bits": _pack_by_sums}, True),
)


def _dsr(codec, n, interpret=False):
    return jax.jit(lambda w: pk.decode_sum_reencode(codec, w, n, interpret=interpret))


def run(args) -> dict:
    rows = []
    for size in args.sizes_mib:
        n = int(size * MiB) // 2
        library = np.asarray(_dsr(INT6, n, args.interpret)(encoded_rows(INT6, args.peers, n, 1)[0]))
        for label, codec, patches, same_bytes in VARIANTS:
            if args.variants and label not in args.variants:
                continue
            wires = encoded_rows(codec, args.peers, n, 2)
            fn = _dsr(codec, n, args.interpret)
            io_bytes = (args.peers + 1) * codec.wire_bytes(n)
            copy_s = None if args.interpret else copy_seconds_in_program(
                io_bytes, args.calls, reps=args.reps)  # fmt: skip
            row = {"size_mib": size, "variant": label, "codec": codec.name, "peers": args.peers,
                   "io_bytes": io_bytes, "copy_seconds": copy_s}  # fmt: skip
            with _patched(**(patches or {})) as calls:
                got = np.asarray(fn(wires[0]))
                if patches is None:
                    ref = np.asarray(pk.decode_sum_reencode_reference(codec, wires[0], n))
                    row["bytes_differing_from_reference"] = float(np.mean(got != ref))
                elif np.array_equal(got, library) != same_bytes or len(calls) < len(patches):
                    raise SystemExit(f"{label}: the patch did not act as it should")
                if args.interpret:
                    print("CHECKED", label, row.get("bytes_differing_from_reference"), flush=True)
                    continue
                seconds = in_program_seconds(fn, [(w,) for w in wires], args.calls,
                                             reps=args.reps)  # fmt: skip
            row.update(seconds=seconds, ns_per_element=seconds / n * 1e9,
                       of_copy=copy_s / seconds)  # fmt: skip
            rows.append(row)
            print("ROW", row, flush=True)
    return {"rows": rows}


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--variants", nargs="+", choices=[v[0] for v in VARIANTS],
                        help="run these variants only (default: all)")  # fmt: skip
    parser.add_argument(
        "--interpret", action="store_true", help="CPU check of the patches, no timing"
    )


def main() -> None:
    if jax.default_backend() != "gpu" and "--interpret" not in sys.argv:
        raise SystemExit("summing_ablation.py times compiled GPU kernels: run it on a GPU")
    run_study("summing_ablation", __doc__, run, _options, sizes_mib=(64, 512))


if __name__ == "__main__":
    main()
