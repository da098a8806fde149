"""Where the Mosaic GPU TAH-Quant encode's time goes: its pivot, noise and quantization, ablated.

The Mosaic encode (`pallas_kernels.tahquant_mosaic`) measured slower than the Triton encode it
was written to beat (BENCHMARKS.md, "Pipeline codec kernels"). This times it at one bf16 message
size with parts of its per-tile arithmetic (`tahquant_mosaic._encode_groups`) replaced, beside
the library's Mosaic and Triton encodes, on data where every tile pivots:

    library             the library's Mosaic encode
    noise 1/2           the per-element hash replaced by the constant 1/2
    nearest             no noise (the codec's round-to-nearest twin)
    rule only           the pivot's rule and side byte kept; its swap and H_32 (the second
                        wgmma and the correction) left out
    rule only, 1/2      both of the above
    no pivot, nearest   neither the pivot nor the noise: the quantization alone
    skeleton            codes = the truncated values, scale = max, min = max, no pivot: the TMA
                        loads, the wgmma, one reduction and the stores

The variant named "copy" is the library's arithmetic run through the patch; before timing it
must write the library's wire byte for byte (the patch mechanism works). TIMING ONLY for the
others, whose codes differ. The library is not changed.

    PYTHONPATH=. python benchmarks/mosaic_stage_ablation.py --sizes-mib 64 --out $OUT
"""

from __future__ import annotations

import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from _common import batched_seconds, run_study
from stage_kernels import _messages

from pallas_kernels import _pallas, tahquant_mosaic
from pallas_kernels import tahquant_kernel as tk
from taco_jax import tahquant

MiB = 1 << 20
_library_encode_groups = tahquant_mosaic._encode_groups


def _variant(pivot: str, noise: str, quantize: str = "library"):
    """A replacement of `tahquant_mosaic._encode_groups` (pivot: full / rule / none; noise:
    library / half; quantize: library / skeleton)."""

    def encode_groups(codec, x_smem, eye_smem, front_smem, seeds, start):
        shape = (tahquant_mosaic._HALF, tahquant_mosaic.GROUP_SIZE)
        if pivot == "full":
            if noise == "library":
                return _library_encode_groups(codec, x_smem, eye_smem, front_smem, seeds, start)
            patched = lambda s, e: (e & 0).astype(jnp.float32) + 0.5  # noqa: E731
            with _patched(tahquant, "element_noise", patched):
                return _library_encode_groups(codec, x_smem, eye_smem, front_smem, seeds, start)
        a = _pallas.wgmma(x_smem, eye_smem, shape)
        col = tahquant_mosaic._wgmma_iota(1)
        if quantize == "skeleton":
            top = jnp.max(a, axis=-1)
            codes = a.astype(jnp.int32).astype(jnp.uint8)
            index = (top * 0).astype(jnp.int32)
            return codes, {"scales": top, "mins": top, "pivots": index.astype(jnp.uint8)}
        if pivot == "rule":
            flag, index = tahquant.pivot_rule(a, positions=col)
        else:
            index = (jnp.max(a, axis=-1) * 0).astype(jnp.int32)
            flag = index > 0
        noise_values = None
        if codec.stochastic:
            if noise == "library":
                element = start + tahquant_mosaic._wgmma_iota(0) * 128 + col
                noise_values = tahquant.element_noise(seeds, element.astype(jnp.uint32))
            else:
                noise_values = (col & 0).astype(jnp.float32) + 0.5
        codes, scale, low = tahquant.quantize_groups(
            codec, a, noise_values, floor=tahquant.floor_by_truncation
        )
        pivots = (index | jnp.where(flag, tahquant.PIVOT_FLAG, 0)).astype(jnp.uint8)
        return tahquant.pack_codes(codec, codes), {"scales": scale, "mins": low, "pivots": pivots}

    return encode_groups


@contextlib.contextmanager
def _patched(module, name, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


# label -> (variant or None for the library, round to nearest)
VARIANTS = {
    "copy": (_variant("full", "library"), False),
    "noise 1/2": (_variant("full", "half"), False),
    "nearest": (None, True),
    "rule only": (_variant("rule", "library"), False),
    "rule only, 1/2": (_variant("rule", "half"), False),
    "no pivot, nearest": (_variant("none", "library"), True),
    "skeleton": (_variant("none", "library", "skeleton"), False),
}


def run(args) -> dict:
    rows = []
    base = tahquant.get_stage_codec("tahquant")
    for size_mib in args.sizes_mib:
        size = int(size_mib * MiB)
        key, xs, t_copy = _messages(size, "outlier_channels")
        inputs = [(x, jax.random.fold_in(key, i)) for i, (x,) in enumerate(xs)]
        io = size + base.wire_bytes(size // 2)
        library = jax.jit(lambda x, k: tk.encode(base, x, k, backend="mosaic"))
        triton = jax.jit(lambda x, k: tk.encode(base, x, k, backend="triton"))
        want = np.asarray(library(*inputs[0]))
        timed = {"library (Mosaic)": library, "library (Triton)": triton}
        for label, fn in timed.items():
            t, spread = batched_seconds(fn, inputs)
            rows.append(_row(size, label, t, spread, io, t_copy))
        for label, (variant, nearest) in VARIANTS.items():
            codec = tahquant.get_stage_codec("tahquant_nearest") if nearest else base
            fn = jax.jit(lambda x, k, c=codec: tk.encode(c, x, k if c.stochastic else None,
                                                         backend="mosaic"))  # fmt: skip
            with _patched(tahquant_mosaic, "_encode_groups", variant or _library_encode_groups):
                wire = np.asarray(fn(*inputs[0]))
                if label == "copy" and not np.array_equal(wire, want):
                    raise SystemExit("the patched copy of the library wrote another wire")
                t, spread = batched_seconds(fn, inputs)
            rows.append(_row(size, label, t, spread, io, t_copy))
    return {"results": rows, "codec": "tahquant", "data": "outlier_channels"}


def _row(size, label, t, spread, io, t_copy) -> dict:
    row = {"bytes": size, "variant": label, "encode_s": t, "spread": spread,
           "encode_of_copy": (io / t) / (2 * size / t_copy)}  # fmt: skip
    print("ABLATE", json.dumps(row), flush=True)
    return row


def main() -> None:
    if jax.default_backend() != "gpu":
        raise SystemExit("mosaic_stage_ablation.py times compiled GPU kernels: run it on a GPU")
    run_study("mosaic_stage_ablation", __doc__, run, lambda parser: None, sizes_mib=(64,))


if __name__ == "__main__":
    main()
