"""Backend study: the taco encode as a Mosaic GPU kernel against the Pallas (Triton) kernel.

PYTHONPATH=. python3 benchmarks/mosaic_study.py --out $OUT   (on the device machine)

The Triton-lowered encode spends ~20% of its time on the Hadamard dot's layout traffic
(BENCHMARKS.md, "Kernels", note 11). A Mosaic GPU kernel stages each tile with TMA into swizzled
shared memory, where `wgmma` reads it directly, and pipelines the loads and stores of
consecutive tiles (`emit_pipeline`). This script builds that kernel for the `taco` codec
(G = 128, bf16 input, one 64-group tile per pipeline step, the full 128 x 128 +-1 block as one
wgmma), checks it against the reference on fresh data, and times it beside the Pallas encode and
the XLA copy of the same bytes in one run (program timing: dependent calls inside one program).

Variants: "arrays" writes codes, scales and pre-scales to three arrays (study 1: the same bytes
as the wire, a bound for it); "packed" writes the real wire row, scales through a uint8 alias
of an fp32 shared buffer (what `pallas_kernels/encode_mosaic.py` became); "planar64" writes a
byte-planar side layout that needs no alias (studies 2-3, BENCHMARKS.md note 12). The Triton
encode is timed as `pk.encode(..., backend="triton")`.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels as pk
from benchmarks import _common
from benchmarks.kernels import IN_PROGRAM_CALLS, PEERS, _ulp_mismatch, in_program_seconds
from taco_jax import codecs

MiB = 1 << 20
G = 128
TILE = 64  # groups per step: one wgmma M block of a warpgroup
QMAX = codecs.QMAX["e4m3"]


def _encode_tile(v):
    """taco codes of the groups v / sqrt(G) (v = S x, [TILE, G] fp32): `_tile.encode_groups`
    with the ASH energy taken from v (H is orthonormal)."""
    unit = 1.0 / math.sqrt(G)
    mean_sq = jnp.sum(v * v, axis=1) * np.float32(unit * unit / G)
    energy = jnp.maximum(mean_sq + codecs.ENERGY_EPS, codecs.ENERGY_FLOOR)
    alpha = jnp.minimum(
        jnp.maximum(QMAX * lax.rsqrt(energy), codecs.PRESCALE_MIN), codecs.PRESCALE_MAX
    )
    to_y = alpha * np.float32(unit)
    amax = jnp.max(jnp.abs(v), axis=1) * to_y
    s = jnp.minimum(jnp.maximum(amax / QMAX, codecs.SCALE_MIN), codecs.SCALE_MAX)
    s = jnp.where(amax < jnp.inf, s, jnp.nan)  # NaN / Inf groups: NaN scale
    factor = lax.broadcast_in_dim(to_y / s, v.shape, [0])
    codes = jnp.minimum(jnp.maximum(v * factor, -QMAX), QMAX).astype(jnp.float8_e4m3fn)
    return codes, s, alpha


def mosaic_encode(x, *, tiles_per_program: int, steps: int, interpret=None):
    """x [M, G] bf16 (M groups) -> (codes f8e4m3 [M, G], scale [M], prescale [M])."""
    m = x.shape[0]
    tiles = m // TILE
    if m % TILE or tiles % tiles_per_program:
        raise ValueError(f"{m=} groups must fill tiles of {TILE} x {tiles_per_program}")
    swizzle = plgpu.SwizzleTransform(128)
    x_transforms = (plgpu.TilingTransform((8, 64)), swizzle)  # bf16: 64 elements = 128 bytes
    h = jnp.asarray(codecs.hadamard_matrix(G) * math.sqrt(G), jnp.bfloat16)  # +-1

    def body(x_gmem, h_gmem, codes_gmem, scale_gmem, prescale_gmem, h_smem, h_barrier):
        plgpu.copy_gmem_to_smem(h_gmem, h_smem, h_barrier)
        plgpu.barrier_wait(h_barrier)
        first = lax.axis_index("p") * tiles_per_program

        def step(_, x_smem, codes_smem, scale_smem, prescale_smem):
            def dot(acc_ref):
                plgpu.wgmma(acc_ref, x_smem, h_smem)
                return acc_ref[...]

            v = pl.run_scoped(dot, plgpu.ACC((TILE, G), jnp.float32))
            codes, s, alpha = _encode_tile(v)
            codes_smem[...] = codes
            scale_smem[...] = s
            prescale_smem[...] = alpha

        tile_2d = lambda i: (first + i, 0)  # noqa: E731
        tile_1d = lambda i: (first + i,)  # noqa: E731
        plgpu.emit_pipeline(
            step,
            grid=(tiles_per_program,),
            in_specs=[plgpu.BlockSpec((TILE, G), tile_2d, transforms=x_transforms)],
            out_specs=[
                plgpu.BlockSpec((TILE, G), tile_2d),
                plgpu.BlockSpec((TILE,), tile_1d),
                plgpu.BlockSpec((TILE,), tile_1d),
            ],
            max_concurrent_steps=steps,
        )(x_gmem, codes_gmem, scale_gmem, prescale_gmem)

    kernel = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((m, G), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((m,), jnp.float32),
            jax.ShapeDtypeStruct((m,), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM((G, G), jnp.bfloat16, transforms=x_transforms),
            plgpu.Barrier(num_barriers=1),
        ],
        grid=(tiles // tiles_per_program,),
        grid_names=("p",),
        interpret=interpret,
    )
    return kernel(x, h)


def byte_planes(v):
    """fp32 [T] -> its four little-endian bytes as planes, uint8 [T] each (plane k: byte k)."""
    bits = lax.bitcast_convert_type(v, jnp.uint32)
    return [((bits >> np.uint32(8 * k)) & np.uint32(0xFF)).astype(jnp.uint8) for k in range(4)]


def planar64_sides(v_list):
    """Side bytes in blocks of 64 groups, plane-major inside a block: plane k of the fp32 values
    v_list[i] is byte k of each group (whole blocks only)."""
    planes = []
    for v in v_list:
        b = lax.bitcast_convert_type(v, jnp.uint8)  # [R, groups, 4]
        planes.append(b.reshape(*v.shape[:-1], -1, TILE, 4))
    b = jnp.concatenate(planes, axis=-1)  # [R, blocks, 64, 8]
    return jnp.swapaxes(b, -1, -2).reshape(*v_list[0].shape[:-1], -1)


def wire_reference(codec, x, layout):
    p = codecs.encode_reference(codec, x)
    if layout == "planar64":
        return jnp.concatenate([p.codes, planar64_sides([p.scales, p.prescales])], axis=-1)
    return codecs.pack(codec, p)


def mosaic_encode_wire(x, *, tiles_per_program: int, steps: int, layout: str = "planar64"):
    """x [R, n] bf16 -> wire rows uint8 [R, n + 8 n / G], codes and sides stored by TMA.

    The output is declared [R, W / 128, 128] (a free reshape of the wire): Mosaic GPU indexes
    GMEM refs but does not reshape them, and with 128-byte rows both a tile's codes (64 rows) and
    its side bytes (4 rows) are whole rows. layout "planar64": side bytes in 64-group blocks,
    plane-major (`planar64_sides`), one (4, 128) block per tile. layout "packed": today's wire
    (all scales, then all pre-scales, fp32 little-endian), written from fp32 shared memory
    through a uint8 alias (RefUnion) by explicit TMA stores.
    """
    rows, n = x.shape
    groups = n // G
    tiles = groups // TILE
    if n % G or tiles % tiles_per_program:
        raise ValueError(f"{n=} must fill tiles of {TILE} x {tiles_per_program} groups")
    x_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    h = jnp.asarray(codecs.hadamard_matrix(G) * math.sqrt(G), jnp.bfloat16)
    side_rows = groups // 16  # 8 bytes per group in 128-byte rows

    def tile_codes(x_smem, h_smem):
        def dot(acc_ref):
            plgpu.wgmma(acc_ref, x_smem, h_smem)
            return acc_ref[...]

        return _encode_tile(pl.run_scoped(dot, plgpu.ACC((TILE, G), jnp.float32)))

    def planar_body(x_gmem, h_gmem, wire_gmem, h_smem, h_barrier):
        plgpu.copy_gmem_to_smem(h_gmem, h_smem, h_barrier)
        plgpu.barrier_wait(h_barrier)
        row = lax.axis_index("r")
        first = lax.axis_index("p") * tiles_per_program

        def step(_, x_smem, codes_smem, sides_smem):
            codes, s, alpha = tile_codes(x_smem, h_smem)
            codes_smem[...] = lax.bitcast_convert_type(codes, jnp.uint8)
            for k, plane in enumerate(byte_planes(s) + byte_planes(alpha)):
                sides_smem[k // 2, pl.ds(64 * (k % 2), 64)] = plane

        plgpu.emit_pipeline(
            step,
            grid=(tiles_per_program,),
            in_specs=[
                plgpu.BlockSpec((TILE, G), lambda i: (first + i, 0), transforms=x_transforms)
            ],
            out_specs=[
                plgpu.BlockSpec((TILE, G), lambda i: (first + i, 0)),
                plgpu.BlockSpec((4, G), lambda i: (groups // 4 + first + i, 0)),
            ],
            max_concurrent_steps=steps,
        )(x_gmem.at[row], wire_gmem.at[row], wire_gmem.at[row])

    def packed_body(x_gmem, h_gmem, wire_gmem, h_smem, h_barrier, sides):
        sides_f32, sides_u8 = sides
        plgpu.copy_gmem_to_smem(h_gmem, h_smem, h_barrier)
        plgpu.barrier_wait(h_barrier)
        row = lax.axis_index("r")
        first = lax.axis_index("p") * tiles_per_program

        def step(idx, x_smem, codes_smem):
            (i,) = idx
            slot = lax.rem(i, 2)
            codes, s, alpha = tile_codes(x_smem, h_smem)
            codes_smem[...] = lax.bitcast_convert_type(codes, jnp.uint8)
            # The slot's stores of two steps ago (3 bulk copies per step since) have read it.
            plgpu.wait_smem_to_gmem(3, wait_read_only=True)
            sides_f32[slot, 0] = s
            sides_f32[slot, 1] = alpha
            plgpu.commit_smem()
            tile_row = 2 * (first + i)  # 64 fp32 values = 2 rows of 128 bytes
            for k, section in enumerate((groups, groups + side_rows // 2)):
                plgpu.copy_smem_to_gmem(
                    sides_u8.at[slot, pl.ds(2 * k, 2)],
                    wire_gmem.at[row, pl.ds(section + tile_row, 2)],
                )

        plgpu.emit_pipeline(
            step,
            grid=(tiles_per_program,),
            in_specs=[
                plgpu.BlockSpec((TILE, G), lambda i: (first + i, 0), transforms=x_transforms)
            ],
            out_specs=[plgpu.BlockSpec((TILE, G), lambda i: (first + i, 0))],
            max_concurrent_steps=steps,
        )(x_gmem.at[row], wire_gmem.at[row])

    scratch = [
        plgpu.SMEM((G, G), jnp.bfloat16, transforms=x_transforms),
        plgpu.Barrier(num_barriers=1),
    ]
    if layout == "packed":
        scratch.append(
            plgpu.RefUnion(plgpu.SMEM((2, 2, TILE), jnp.float32), plgpu.SMEM((2, 4, G), jnp.uint8))
        )
    kernel = plgpu.kernel(
        planar_body if layout == "planar64" else packed_body,
        out_type=jax.ShapeDtypeStruct((rows, groups + side_rows, G), jnp.uint8),
        scratch_types=scratch,
        grid=(rows, tiles // tiles_per_program),
        grid_names=("r", "p"),
    )
    return kernel(x.reshape(rows, groups, G), h).reshape(rows, -1)


def check_wire(key, *, tiles_per_program, steps, layout) -> dict:
    rows, n = 3, G * TILE * tiles_per_program * 2
    x = (jax.random.normal(key, (rows, n), jnp.float32) * 3).astype(jnp.bfloat16)
    x = x.at[1, 7].set(jnp.nan)
    codec = codecs.get_codec("taco", G)
    got = mosaic_encode_wire(x, tiles_per_program=tiles_per_program, steps=steps, layout=layout)
    want = wire_reference(codec, x, layout)
    got, want = np.asarray(got), np.asarray(want)
    mism, worst = _ulp_mismatch(got[:, :n], want[:, :n])
    side, side_ref = side_values(got, n, layout), side_values(want, n, layout)
    finite = np.isfinite(side_ref)
    return dict(
        code_mismatch=mism,
        max_code_steps=worst,
        side_rel=float(np.max(np.abs(side[finite] / side_ref[finite] - 1))),
        nonfinite_sides_kept=bool(np.array_equal(np.isnan(side), np.isnan(side_ref))),
    )


def side_values(wire, n, layout):
    """(scale, pre-scale) per group, fp32 [R, groups, 2], from either wire layout."""
    rows, groups = wire.shape[0], n // G
    side = wire[:, n:]
    if layout == "planar64":
        b = np.swapaxes(side.reshape(rows, -1, 8, TILE), -1, -2)  # [R, blocks, 64, 8]
        return b.reshape(rows, groups, 2, 4).copy().view(np.float32)[..., 0]
    return np.swapaxes(side.reshape(rows, 2, groups, 4).copy().view(np.float32)[..., 0], 1, 2)


def check(key, *, tiles_per_program, steps, interpret=None) -> dict:
    """Mosaic encode vs the reference on fresh data: code mismatches (steps), scale error."""
    x = (jax.random.normal(key, (TILE * tiles_per_program * 4, G), jnp.float32) * 3).astype(
        jnp.bfloat16
    )
    x = x.at[5, 7].set(jnp.nan)  # a non-finite group must keep a NaN scale
    codec = codecs.get_codec("taco", G)
    codes, s, alpha = mosaic_encode(
        x, tiles_per_program=tiles_per_program, steps=steps, interpret=interpret
    )
    ref = codecs.encode_reference(codec, x.reshape(1, -1))
    got = lax.bitcast_convert_type(codes, jnp.uint8).reshape(1, -1)
    finite = np.isfinite(np.asarray(ref.scales).reshape(-1))
    mism, worst = _ulp_mismatch(got[:, np.repeat(finite, G)], ref.codes[:, np.repeat(finite, G)])
    s_ref = np.asarray(ref.scales).reshape(-1)
    return dict(
        code_mismatch=mism,
        max_code_steps=worst,
        scale_rel=float(np.max(np.abs(np.asarray(s)[finite] / s_ref[finite] - 1))),
        nan_groups_kept=bool(np.all(np.isnan(np.asarray(s)[~finite]))),
    )


def time_sizes(key, sizes_mib, variants) -> list[dict]:
    """Program-timed XLA copy, Pallas encode and each Mosaic variant, per size (TB/s, % copy)."""
    codec = codecs.get_codec("taco", G)
    rows = []
    for size_mib in sizes_mib:
        elements = size_mib * MiB // 2
        sets = max(1, min(4, 256 // size_mib))
        shape = (PEERS, elements // PEERS)
        xs = [
            (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16),)
            for i in range(sets)
        ]
        encode_bytes = 2 * elements + PEERS * codec.wire_bytes(elements // PEERS)
        copy_bytes = 4 * elements  # bf16 read + written
        row = dict(size_mib=size_mib)
        row["xla_copy_s"] = in_program_seconds(lambda x: -x, xs, IN_PROGRAM_CALLS)
        row["xla_copy_tbps"] = copy_bytes / row["xla_copy_s"] / 1e12
        fns = {"pallas_encode": lambda x: pk.encode(codec, x, backend="triton"), **variants}
        for name, fn in fns.items():
            try:
                sec = in_program_seconds(fn, xs, IN_PROGRAM_CALLS)
            except Exception as e:  # a variant Mosaic rejects is a result too
                row[name + "_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                continue
            row[name + "_s"] = sec
            row[name + "_tbps"] = encode_bytes / sec / 1e12
            row[name + "_of_copy"] = row[name + "_tbps"] / row["xla_copy_tbps"]
        rows.append(row)
        print("TIME", json.dumps(row), flush=True)
    return rows


def _arrays(tpp, steps):
    return lambda x: mosaic_encode(x.reshape(-1, G), tiles_per_program=tpp, steps=steps)


def _wire(tpp, steps, layout):
    return lambda x: mosaic_encode_wire(x, tiles_per_program=tpp, steps=steps, layout=layout)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--sizes-mib", default="64,256,1024")
    p.add_argument("--package-only", action="store_true", help="time only pallas_kernels' encoders")
    args = p.parse_args()
    key = jax.random.key(np.random.SeedSequence().entropy % 2**31)  # fresh data every run
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    if args.package_only:
        codec = codecs.get_codec("taco", G)
        mosaic = {"package_mosaic": lambda x: pk.encode(codec, x, backend="mosaic")}
        rows = time_sizes(key, sizes, mosaic)
        _common.write_record("mosaic_study_package", args.out, timings=rows)
        return
    checks = {}
    wire_cases = {
        "planar64_t16_s3": (16, 3, "planar64"),
        "packed_t16_s3": (16, 3, "packed"),
        "planar64_t8_s2": (8, 2, "planar64"),
        "packed_t8_s3": (8, 3, "packed"),
    }
    for i, (name, (tpp, steps, layout)) in enumerate(wire_cases.items()):
        try:
            checks[name] = check_wire(
                jax.random.fold_in(key, i), tiles_per_program=tpp, steps=steps, layout=layout
            )
        except Exception as e:
            checks[name] = dict(error=f"{type(e).__name__}: {str(e)[-1500:]}")
        print("CHECK", name, json.dumps(checks[name]), flush=True)
    variants = {"arrays_t16_s3": _arrays(16, 3)}
    for name, (tpp, steps, layout) in wire_cases.items():
        if "error" not in checks[name]:
            variants[name] = _wire(tpp, steps, layout)
    rows = time_sizes(key, sizes, variants)
    _common.write_record("mosaic_study", args.out, checks=checks, timings=rows)


if __name__ == "__main__":
    main()
