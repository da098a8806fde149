"""Every Pallas import of the package, and the two launchers the kernels share.

The import paths and the `CompilerParams` classes move between JAX versions, so only this module
names them; kernels import `pl`, `plgpu` and `pltriton` from here and call them directly.
`call` launches a Triton-lowered kernel (`pl.pallas_call`), `mosaic_kernel` a Mosaic GPU one
(`plgpu.kernel`); both refuse buffers past the kernels' 32-bit offsets and type their outputs
under `shard_map(check_vma=True)` as their inputs are typed. Which kernel runs where is decided
in `registry.select` alone.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from taco_jax import target

# Why this JAX cannot lower through Triton (None: it can).
TRITON_IMPORT_ERROR: str | None = None
try:
    from jax.experimental.pallas import triton as pltriton
except ImportError as error:  # a JAX whose Pallas no longer has the Triton lowering
    pltriton = None
    TRITON_IMPORT_ERROR = f"jax {jax.__version__} has no Pallas Triton lowering ({error})"

__all__ = ["pl", "plgpu", "pltriton"]

# Every operand and result of a kernel holds at most this many bytes: the kernels address their
# buffers with 32-bit offsets (past it the fused all-reduce returned non-finite values,
# docs/decisions/008). The collectives split messages to stay below it.
MAX_BUFFER_BYTES = (1 << 31) - 1


def check_addressable(name: str, *arrays) -> None:
    """Raises ValueError, naming the array, if an operand or result of kernel `name` holds more
    than `MAX_BUFFER_BYTES`. Under `jax.vmap` this sees one batch element's arrays."""
    limit = MAX_BUFFER_BYTES  # read per call, so that tests may lower it
    for a in arrays:
        nbytes = a.size * jnp.dtype(a.dtype).itemsize
        if nbytes > limit:
            raise ValueError(
                f"kernel {name}: an array of shape={a.shape} dtype={a.dtype} holds {nbytes} "
                f"bytes, more than the {limit} a kernel addresses with 32-bit offsets; split "
                "it (the taco_jax collectives do, by slices)"
            )


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
    """`pl.pallas_call(kernel)(*args)` on the Triton lowering, with whole-array refs (the
    kernels use masked `pl.ds`, so that one kernel writes a wire row's codes and scale bytes,
    which lie apart, in one pass). `out_init` (optional) is aliased to the output, so elements
    the kernel does not write keep its values: the checks pass a poisoned buffer."""
    check_addressable(name, *args, out_shape)
    if pltriton is None:
        raise ValueError(f"kernel {name} is Triton-lowered, and {TRITON_IMPORT_ERROR}")
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out_shape = _typed_like(out_shape, args[0])
    launch = dict(
        out_shape=out_shape, grid=grid, name=name, interpret=interpret, compiler_params=params
    )
    if out_init is None:
        return pl.pallas_call(kernel, **launch)(*args)

    def aliased(*refs):
        kernel(*refs[: len(args)], *refs[len(args) + 1 :])

    return pl.pallas_call(aliased, input_output_aliases={len(args): 0}, **launch)(*args, out_init)


def _typed_like(out_shape, like):
    """`out_shape` typed as varying / replicated along the mesh axes exactly as `like` is (the
    kernels map rows to rows, so the output varies wherever the input does)."""
    manual = getattr(jax.typeof(like), "manual_axis_type", None)
    if manual is None:
        return out_shape
    return jax.ShapeDtypeStruct(out_shape.shape, out_shape.dtype, manual_axis_type=manual)


def mosaic_kernel(
    body,
    *args,
    out_shape,
    scratch,
    grid,
    grid_names,
    name: str,
    interpret=False,
    replicated_along=(),
):
    """Runs a Mosaic GPU kernel `body(*arg_refs, out_ref, *scratch_refs)` over `grid`.

    `jax.vmap` adds a grid axis (`plgpu.kernel`'s batching rule). Under `shard_map` the output
    varies along the mesh axes args[0] varies along, except `replicated_along` (a kernel that
    leaves the same bytes on every rank of them): jax 0.11.2's `plgpu.kernel` types its output
    replicated. interpret: Mosaic GPU's CPU interpreter.
    """
    check_addressable(name, *args, out_shape)
    out = plgpu.kernel(
        body,
        out_type=out_shape,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        kernel_name=name,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*args)
    manual = getattr(jax.typeof(args[0]), "manual_axis_type", None)
    if manual is None:
        return out
    have = getattr(jax.typeof(out), "manual_axis_type", None)
    have = set(have.varying) if have is not None else set()
    missing = tuple(sorted(set(manual.varying) - set(replicated_along) - have))
    return jax.lax.pcast(out, missing, to="varying") if missing else out


def hopper_sms() -> int | None:
    """The SM count of the default device if it is a Hopper GPU that reports one, else None."""
    return getattr(jax.devices()[0], "core_count", None) if target.probe().hopper else None


def smem_bytes(scratch) -> int:
    """Bytes of shared memory a `mosaic_kernel` scratch list allocates (8 per barrier)."""
    total = 0
    for ref in scratch:
        if isinstance(ref, plgpu.Barrier):
            total += 8
        else:
            total += math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
    return total


def swizzled(dtype) -> tuple:
    """Tiling + 128-byte swizzle of a shared-memory tile that wgmma reads (rows of 128 bytes)."""
    return (
        plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(128),
    )


def wgmma(a, b_smem, shape, dtype=jnp.float32):
    """a @ b on the tensor cores (`a` in shared memory, or registers in the wgmma layout),
    accumulated in a scoped `dtype` accumulator of `shape` -> registers."""

    def dot(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)
        return acc_ref[...]

    return pl.run_scoped(dot, plgpu.ACC(shape, dtype))
