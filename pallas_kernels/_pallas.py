"""Every Pallas and backend import of the package, in one place (STYLE.md: paths and
`CompilerParams` classes move between JAX versions).

Backend: the Triton lowering of `pl.pallas_call` (jax 0.11.2 picks it when the compiler params
are `triton.CompilerParams`). Why not Mosaic GPU: these kernels are streaming, element-wise
passes over HBM with a tiny per-group reduction and one small matmul per tile; the Triton
lowering reaches that with plain masked loads/stores, works under `jax.vmap` and inside
`shard_map`, and has an interpret mode that runs the same kernel body on the CPU (CI). Mosaic GPU
(`plgpu.kernel`) cannot be vmapped (TACO.md section 6), and its `pallas_call` path needs explicit
TMA/warpgroup staging for the same result. This choice is argued, not measured: the device
budget went to checking and timing the Triton version (BENCHMARKS.md, "Kernels"); a Mosaic GPU
port is the open comparison. jax-triton is not used: nothing here needs a raw Triton kernel
unless the Pallas lowering itself proves to be the limit.

`check_vma`: under `jax.shard_map` the kernels run with `check_vma=False` (the tests' setting;
TACO.md section 6 saw interpret mode fail with `check_vma=True` on the CPU).
"""

from __future__ import annotations

import functools

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


partial = functools.partial
