"""Every Pallas and backend import of the package, in one place (STYLE.md: paths and
`CompilerParams` classes move between JAX versions).

Backend: the Triton lowering of `pl.pallas_call` (jax 0.11.2 picks it when the compiler params
are `triton.CompilerParams`). Why not Mosaic GPU: these kernels are streaming, element-wise
passes over HBM with a tiny per-group reduction and one small matmul per tile; the Triton
lowering reaches that with plain masked loads/stores, works under `jax.vmap` and inside
`shard_map`, and has an interpret mode that runs the same kernel body on the CPU (CI). Mosaic GPU
(`plgpu.kernel`) cannot be vmapped (TACO.md section 6), and its `pallas_call` path needs explicit
TMA/warpgroup staging for the same result. Measured (BENCHMARKS.md, "Kernels", sweeps 1-6): a
Pallas kernel with these kernels' own load/store pattern copies at 95-97% of torch's device copy,
and the codecs without a Hadamard encode at 3.5-3.8 TB/s, so the lowering streams at HBM speed.
With the Hadamard as 16-column dots plus butterflies, encode runs at 2.96 TB/s and decode at
3.37 (1 GiB): the remaining ~20% is the dot's layout traffic at 116 registers per thread, which
a Mosaic GPU or raw Triton (jax-triton) port would have to beat; that comparison is open, so
jax-triton is not used.

`check_vma`: the kernels run inside `jax.shard_map` with either setting and under `vmap`. With
`check_vma=True` each output takes the manual axis type of its input (`_typed_like`); that path
passed on 2 x H200 (tests/pallas_kernels/test_check_vma_gpu.py), while interpret mode fails
there (a masked load pads a varying ref with an invariant constant): CPU tests use
`check_vma=False`.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

load = pltriton.load
store = pltriton.store
program_id = pl.program_id
ds = pl.ds


def call(
    kernel,
    *args,
    out_shape,
    grid,
    name: str,
    interpret: bool,
    num_warps: int,
    num_stages: int,
    out_init=None,
):
    """Runs `pl.pallas_call(kernel)(*args)` with whole-array refs (kernels use masked `pl.ds`).

    Whole-array refs let one kernel write the codes and the scale bytes of a packed wire row,
    which live in different places of the same row, in one pass. `out_init` (optional) is
    aliased to the output, so elements the kernel does not write keep its values: the checks
    pass a poisoned buffer to catch unwritten elements.
    """
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out_shape = _typed_like(out_shape, args[0])
    if out_init is None:
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            name=name,
            interpret=interpret,
            compiler_params=params,
        )(*args)

    def aliased(*refs):
        kernel(*refs[: len(args)], *refs[len(args) + 1 :])

    return pl.pallas_call(
        aliased,
        out_shape=out_shape,
        grid=grid,
        name=name,
        interpret=interpret,
        compiler_params=params,
        input_output_aliases={len(args): 0},
    )(*args, out_init)


def _typed_like(out_shape, like):
    """`out_shape` typed as varying / replicated along the mesh axes exactly as `like` is.

    Under `shard_map(check_vma=True)` pallas_call needs the output's manual axis type; the
    kernels map rows to rows, so the output varies wherever the input does.
    """
    manual = getattr(jax.typeof(like), "manual_axis_type", None)
    if manual is None:
        return out_shape
    return jax.ShapeDtypeStruct(out_shape.shape, out_shape.dtype, manual_axis_type=manual)


partial = functools.partial
