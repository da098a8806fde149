"""Where the TAH-Quant encode's time goes: its stochastic-rounding noise and its pivot, ablated.

The fused encode (`pallas_kernels.tahquant_kernel.encode`) draws 16 bits of noise per element
from a counter hash (`tahquant.uniform_noise`: one hash of two keyed rounds of a 32-bit mixer per
pair of elements, its two halves joined into the tile's element order). An earlier ablation
(BENCHMARKS.md, "Pipeline codec kernels") put about a third of the encode's time in the noise and
another third in the pivot. This times the encode with the noise drawn in other ways and with
the pivot cut apart, at one bf16 message size, on each data set:

    pairs, 2 rounds     the library's noise
    elements, 2 rounds  the same numbers, drawn per element in the tile's own [T, G] order (the
                        hash of the element's pair, then its half): twice the hashing, no join
    pairs, 1 round      one keyed round per pair: h = mix((j ^ s0) + s1)
    elements, 1 round   the same numbers as "pairs, 1 round", drawn per element (the library's
                        count of hashes, no join)
    constant 1/2        no hash (floor(v + 1/2): rounding to nearest with the noise's add kept)
    nearest             no noise (the codec's round-to-nearest twin; it also skips drawing the
                        noise's two seed words, a small XLA op before the kernel)
    rule only           the library's noise; the pivot's rule and side byte kept, its swap and
                        H_32 left out
    swap only           the swap kept, the H_32 left out
    H_32 only           the H_32 kept, the swap left out
    H_32 as one dot     the swap, then the first block's H_32 as one bf16 tensor-core dot of the
                        whole group [T, G] by diag(S_32, 0) [G, G] (for G = 128, 16x the
                        multiply-adds of a 32 x 32 block), kept where flagged and k < 32
    H_32 as one dot, 1 round   the same with "pairs, 1 round"'s noise

"rule only", "swap only" and "H_32 only" also leave out the G = 128 encode's tile skip (its
"any group flagged" reduction and `lax.cond`): read them on data where every tile pivots.

Checks before timing, on the first message: "elements, 2 rounds" writes the library's wire
byte for byte; "elements, 1 round" writes the wire of "pairs, 1 round"; "pairs, 1 round" writes
another wire than the library (the patch took effect); the dot variant's codes are within one
step of the library's (the count of moved codes is printed, not recorded). The variants replace
`tahquant_kernel._tile_pairs`, `tahquant.uniform_noise` and `tahquant_kernel._encode_pivot`
(the dot: `tahquant_kernel._pivot_forward`, inside the library's tile skip) while the kernel is
traced and timed; the library is not changed. TIMING ONLY for the variants that change the
codes.

    PYTHONPATH=. python benchmarks/noise_ablation.py --size-mib 64 \
        --data gaussian outlier_channels --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from _common import batched_seconds, write_record
from jax import lax
from stage_kernels import DATA, _messages

from pallas_kernels import _tile
from pallas_kernels import tahquant_kernel as tk
from taco_jax import codecs, tahquant

MiB = 1 << 20
_mix32 = tahquant._mix32


def _element_counters(row, tile, t: int, g: int, n: int) -> jax.Array:
    """The uint32 element numbers of a [T, G] tile, r n + i, in the tile's order."""
    start = row.astype(jnp.uint32) * np.uint32(n) + (tile * (t * g)).astype(jnp.uint32)
    within = (lax.broadcasted_iota(jnp.int32, (t, g), 0) * g
              + lax.broadcasted_iota(jnp.int32, (t, g), 1))  # fmt: skip
    return start + within.astype(jnp.uint32)


def _unit(bits16: jax.Array) -> jax.Array:
    return (bits16.astype(jnp.int32).astype(jnp.float32) + 0.5) * np.float32(2.0**-16)


def _pair_hash(seeds, pairs, rounds: int) -> jax.Array:
    if rounds == 2:
        return _mix32(_mix32(pairs ^ seeds[0]) + seeds[1])
    return _mix32((pairs ^ seeds[0]) + seeds[1])


def _pairs_noise(rounds: int):
    def noise(seeds, pairs):
        h = _pair_hash(seeds, pairs, rounds)
        u = [_unit(h & 0xFFFF), _unit(h >> 16)]
        return lax.stack(u, axis=-1).reshape(*pairs.shape[:-1], 2 * pairs.shape[-1])

    return noise


def _elements_noise(rounds: int):
    def noise(seeds, elements):
        h = _pair_hash(seeds, elements >> 1, rounds)
        return _unit(jnp.where((elements & 1) == 0, h & 0xFFFF, h >> 16))

    return noise


def _constant_noise(seeds, elements):
    return jnp.full(elements.shape, 0.5, jnp.float32)


def _front_signs(g: int) -> jax.Array:
    """diag(S_32, 0) [G, G] bf16: the first block's +-1 Hadamard, zeros elsewhere."""
    i = lax.broadcasted_iota(jnp.int32, (g, g), 0)
    j = lax.broadcasted_iota(jnp.int32, (g, g), 1)
    front = (i < tahquant.PIVOT_BLOCK) & (j < tahquant.PIVOT_BLOCK)
    return jnp.where(front, 1 - 2 * codecs.sylvester_parity(i, j), 0).astype(jnp.bfloat16)


def _dot_pivot(groups, flag, index):
    """`tk._pivot_forward` with the swap as selects and the first block's H_32 as one
    tensor-core dot of the swapped group by diag(S_32, 0) (bf16 inputs: exact operands). It
    replaces `_pivot_forward` itself, so the library's tile skip (`tk._encode_pivot`) wraps it."""
    swapped = tahquant.swap_to_front(groups, index)
    z = _tile._block_dot(swapped, _front_signs(groups.shape[1]), exact_bf16=True,
                         interpret=False)  # fmt: skip
    k = lax.broadcasted_iota(jnp.int32, groups.shape, 1)
    keep = flag[:, None] & (k < tahquant.PIVOT_BLOCK)
    return jnp.where(keep, z * tahquant.PIVOT_UNIT, swapped)


def _encode_pivot(transform):
    """A replacement of `tk._encode_pivot`: `transform` on every tile (no tile skip)."""
    return "_encode_pivot", lambda codec: transform


# The pivot patches: (name in `tk`, replacement); None keeps the library's.
RULE_ONLY = _encode_pivot(lambda groups, flag, index: groups)
SWAP_ONLY = _encode_pivot(lambda groups, flag, index: tahquant.swap_to_front(groups, index))
H32_ONLY = _encode_pivot(
    lambda groups, flag, index: tahquant.hadamard_front(
        groups, flag, tahquant.butterflies_by_pair_splits
    )
)
DOT = ("_pivot_forward", _dot_pivot)

# label: (counters, noise, stochastic, pivot patch)
VARIANTS = {
    "pairs, 2 rounds": (None, None, True, None),
    "elements, 2 rounds": (_element_counters, _elements_noise(2), True, None),
    "pairs, 1 round": (None, _pairs_noise(1), True, None),
    "elements, 1 round": (_element_counters, _elements_noise(1), True, None),
    "constant 1/2": (_element_counters, _constant_noise, True, None),
    "nearest": (None, None, False, None),
    "rule only": (None, None, True, RULE_ONLY),
    "swap only": (None, None, True, SWAP_ONLY),
    "H_32 only": (None, None, True, H32_ONLY),
    "H_32 as one dot": (None, None, True, DOT),
    "H_32 as one dot, 1 round": (None, _pairs_noise(1), True, DOT),
}


@contextlib.contextmanager
def _variant(label):
    counters, noise, _, pivot = VARIANTS[label]
    patches = [(tk, "_tile_pairs", counters), (tahquant, "uniform_noise", noise)]
    if pivot is not None:
        name, replacement = pivot
        patches.append((tk, name, replacement))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, replacement in patches:
            if replacement is not None:
                setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _encoder(codec, label, interpret: bool = False):
    """A jitted encode of `codec` under variant `label` (trace it inside `_variant(label)`)."""
    stochastic = VARIANTS[label][2]
    codec = codec if stochastic else dataclasses.replace(codec, stochastic=False)
    return jax.jit(lambda x, k: tk.encode(codec, x, k if stochastic else None,
                                          interpret=interpret))  # fmt: skip


def _check_equal_noise(codec, x, key, interpret: bool = False) -> dict:
    """Whether the per-element variants write the wires of the per-pair ones (same noise)."""
    wires = {}
    for label in VARIANTS:
        if VARIANTS[label][2] and VARIANTS[label][3] in (None, DOT):
            with _variant(label):
                wires[label] = np.asarray(_encoder(codec, label, interpret)(x, key))
    same = {
        "elements, 2 rounds == library": bool(
            (wires["elements, 2 rounds"] == wires["pairs, 2 rounds"]).all()
        ),
        "elements, 1 round == pairs, 1 round": bool(
            (wires["elements, 1 round"] == wires["pairs, 1 round"]).all()
        ),
        # the patch took effect: other noise writes other codes
        "pairs, 1 round != library": bool(
            (wires["pairs, 1 round"] != wires["pairs, 2 rounds"]).any()
        ),
    }
    n = x.shape[-1]
    library = tahquant.unpack_codes(
        codec, jnp.asarray(wires["pairs, 2 rounds"])[:, : codec.code_bytes(n)]
    )
    dot = tahquant.unpack_codes(
        codec, jnp.asarray(wires["H_32 as one dot"])[:, : codec.code_bytes(n)]
    )
    step = int(jnp.max(jnp.abs(dot - library)))
    same["H_32 as one dot: codes within one step"] = step <= 1
    same["H_32 as one dot: moved codes (information)"] = int(jnp.sum(dot != library))
    return same


def study(size: int, names, data: str) -> list[dict]:
    elements = size // 2
    key, xs, t_copy = _messages(size, data)
    rows = []
    for name in names:
        codec = tahquant.get_stage_codec(name)
        inputs = [(x, jax.random.fold_in(key, i)) for i, (x,) in enumerate(xs)]
        checks = _check_equal_noise(codec, *inputs[0])
        print("CHECK", name, data, json.dumps(checks), flush=True)
        if not all(v for k, v in checks.items() if "information" not in k):
            raise SystemExit(f"{name}: a check before timing failed: {checks}")
        io = size + codec.wire_bytes(elements)
        for label in VARIANTS:
            with _variant(label):  # traced, and timed, under the variant
                t, spread = batched_seconds(_encoder(codec, label), inputs)
            row = {"codec": name, "data": data, "variant": label, "encode_s": t,
                   "encode_of_copy": (io / t) / (2 * size / t_copy), "spread": spread}  # fmt: skip
            print("ABLATE", json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=float, default=64)
    parser.add_argument("--codecs", nargs="+", default=["tahquant", "tahquant4"])
    parser.add_argument("--data", nargs="+", choices=DATA, default=["gaussian"])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("noise_ablation.py times compiled GPU kernels: run it on a GPU")
    rows = [r for data in args.data for r in study(int(args.size_mib * MiB), args.codecs, data)]
    write_record("noise_ablation", args.out, ablation=rows)
    print("\n| data | codec | variant | encode, us | % of copy |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['data']} | {r['codec']} | {r['variant']} | {1e6 * r['encode_s']:.1f} | "
            f"{100 * r['encode_of_copy']:.0f}% |"
        )


if __name__ == "__main__":
    main()
