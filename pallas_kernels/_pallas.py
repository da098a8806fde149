"""Every Pallas and backend import of the package, in one place: the import paths and the
`CompilerParams` classes move between JAX versions, so only this module names them.

Backends, chosen per kernel by measurement on the H200 (BENCHMARKS.md, "Kernels"; the studies
behind the choice: docs/development_history.md):
- the Triton lowering of `pl.pallas_call` (jax 0.11 picks it for `triton.CompilerParams`) for
  decode, decode-sum, decode-sum-reencode and every encode the Mosaic kernel does not take. These
  are streaming passes over HBM with a small per-group reduction and small dots; the lowering
  streams at HBM speed, works under `jax.vmap` and `shard_map`, and runs the same bodies on the
  CPU in interpret mode (CI). jax 0.11 deprecates this lowering (a DeprecationWarning when
  lowered for a GPU; 0.12 still warns, and interpret mode does not); it is kept while it is the
  fastest path for these kernels and the only one whose CPU interpret mode runs them. Where it
  is off (`TRITON_ENV`, or a JAX without it: `triton_unavailable`), "auto" takes Mosaic GPU
  wherever it applies and the jnp reference elsewhere (`kernel_for`).
- Mosaic GPU (`plgpu.kernel`, below) for the `taco` encode of bf16 on Hopper from 24 MiB
  (`encode_mosaic`): there the Triton lowering spends a fifth of the time moving each tile
  between the dot's register and shared-memory layouts, while TMA-staged tiles that wgmma reads
  in place stream at copy speed. `plgpu.kernel` batches under `vmap` by adding a grid axis. Its
  CPU interpreter runs the kernel, because the kernel issues its own stores (the interpreter has
  no predicated stores, which `emit_pipeline`'s outputs use), but it does not alias `RefUnion`
  members: on the CPU only the codes are checked, the side bytes on the GPU. The same kind of
  kernel decodes, decode-sums and re-encodes the 8-bit codecs (`decode_mosaic`, the Hadamard a
  wgmma on the codes: INT8 as they are, FP8 through fp16), measured faster than Triton for the
  decode and the two-peer decode-sum from 32 MiB and the two-peer re-encode from 64 MiB, and
  level or slower at some size for the sums of four and eight peers; "auto" keeps Triton for
  those until the table in `config.py` says. The sub-byte codecs' encode, decode and
  decode-sum have Mosaic kernels too (their bit planes packed and unpacked by wgmma), their
  encode and decode measured 1.1-1.4x slower than Triton's from 64 MiB (the sums 2-3.5x): their
  per-element work, with few programs per SM, bounds them. The `taco` encode, storing into the
  peers' memory too (`exchange_mosaic`: `plgpu.remote_ref`, semaphores), is the exchange of the
  collectives on NVLink; the interpreter has no semaphores, so that one runs only on GPUs (on
  the CPU it is lowered for CUDA, not run).
- jax-triton (raw Triton): not used. Its 0.4.1 release needs triton >= 3.7 (the GPU image has
  3.6) and does not batch under `vmap`, which TP emulation needs.

`check_vma`: the kernels run inside `jax.shard_map` with either setting and under `vmap`. With
`check_vma=True` each output takes the manual axis type of its input (`_typed_like`); that path
is tested on 2 GPUs (tests/pallas_kernels/test_check_vma_gpu.py), while interpret mode fails
there (a masked load pads a varying ref with an invariant constant): CPU tests use
`check_vma=False`.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import config

# Why this JAX cannot lower through Triton (None: it can).
_TRITON_IMPORT_ERROR: str | None = None
try:
    from jax.experimental.pallas import triton as pltriton
except ImportError as error:  # a JAX whose Pallas no longer has the Triton lowering
    pltriton = None
    _TRITON_IMPORT_ERROR = f"jax {jax.__version__} has no Pallas Triton lowering ({error})"

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
    check_addressable(name, *args, out_shape)
    if pltriton is None:
        raise ValueError(f"kernel {name} is Triton-lowered, and {_TRITON_IMPORT_ERROR}")
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


def load(*args, **kwargs):
    """`pltriton.load` (masked loads of the Triton-lowered kernels)."""
    return pltriton.load(*args, **kwargs)


def store(*args, **kwargs):
    """`pltriton.store` (masked stores of the Triton-lowered kernels)."""
    return pltriton.store(*args, **kwargs)


def check_addressable(name: str, *arrays) -> None:
    """Raises ValueError, naming the array, if an operand or result of kernel `name` holds more
    than `config.MAX_BUFFER_BYTES` (the kernels' offsets are 32-bit). Under `jax.vmap` this
    sees one batch element's arrays, not the batched buffer the kernel then runs on."""
    limit = config.MAX_BUFFER_BYTES  # read per call, so that tests may lower it
    for a in arrays:
        nbytes = a.size * jnp.dtype(a.dtype).itemsize
        if nbytes > limit:
            raise ValueError(
                f"kernel {name}: an array of shape={a.shape} dtype={a.dtype} holds {nbytes} "
                f"bytes, more than the {limit} a kernel addresses with 32-bit offsets; split "
                "it (the taco_jax collectives do, by slices)"
            )


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

# The backends a public kernel op takes (`backend=`): "triton" (every codec and shape, interpret
# mode, launch configs), "mosaic" (Hopper; 8-bit or sub-byte codes, G = 128, whole tiles), or
# "auto".
BACKENDS = ("auto", "triton", "mosaic")

# Set to 0 (or off / false / no) to keep "auto" off the Triton lowering: the Mosaic GPU kernel
# wherever it takes the call, the jnp reference elsewhere. Read whenever an op is traced, so set
# it before the first trace: a jitted function already traced keeps the kernels it took.
TRITON_ENV = "TACO_JAX_TRITON"
_ENV_VALUES = {"1": True, "on": True, "true": True, "yes": True,
               "0": False, "off": False, "false": False, "no": False}  # fmt: skip


def triton_unavailable() -> str | None:
    """Why "auto" may not lower a kernel through Triton (None: it may): this JAX has no Pallas
    Triton lowering, or `TRITON_ENV` turns it off. Raises ValueError for a value of
    `TRITON_ENV` that is not one of `_ENV_VALUES`."""
    if pltriton is None:
        return _TRITON_IMPORT_ERROR
    value = os.environ.get(TRITON_ENV, "").strip() or "1"  # set but empty: as unset
    if value.lower() not in _ENV_VALUES:
        raise ValueError(f"{TRITON_ENV}={value!r}: choose one of {sorted(_ENV_VALUES)}")
    return None if _ENV_VALUES[value.lower()] else f"{TRITON_ENV}={value}"


def kernel_for(op: str, backend: str, *, triton_options: bool, preferred, unsupported) -> str:
    """Which implementation runs `op`: "mosaic", "triton" or "reference" (the jnp definition).

    backend "mosaic" and "triton" are taken as asked, as are Triton-only options (interpret,
    out_init, config). "auto" takes Mosaic GPU where `preferred()` (it applies, at a size where
    it measured faster), else Triton; where "auto" may not use Triton (`triton_unavailable`),
    Mosaic GPU unless `unsupported()` says why not (then the reference, with a warning once).
    Raises ValueError for an unknown backend, "mosaic" with Triton-only options, or Triton
    asked for where this JAX has none."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown {op} {backend=}; choose one of {BACKENDS}")
    if backend == "mosaic":
        if triton_options:
            raise ValueError(f"{op} backend='mosaic' takes no interpret, out_init or config")
        return "mosaic"
    if backend == "triton" or triton_options:
        if pltriton is None:
            raise ValueError(f"{op} on the Triton lowering (backend='triton', interpret, "
                             f"out_init or config): {_TRITON_IMPORT_ERROR}")  # fmt: skip
        return "triton"
    no_triton = triton_unavailable()
    if no_triton is None:
        return "mosaic" if preferred() else "triton"
    no_mosaic = unsupported()
    if no_mosaic is None:
        return "mosaic"
    _warn_reference(op, no_triton, no_mosaic)
    return "reference"


@functools.cache
def _warn_reference(op: str, no_triton: str, no_mosaic: str) -> None:
    warnings.warn(
        f"pallas_kernels: {op} runs the jnp reference, far slower than a fused kernel: the "
        f"Triton lowering is off ({no_triton}) and the Mosaic GPU kernel cannot take {no_mosaic}",
        RuntimeWarning,
        stacklevel=4,
    )


# ------------------------------------------------------------------------------------------
# Mosaic GPU (`encode_mosaic`, `decode_mosaic`, `exchange_mosaic`): Hopper only (wgmma, TMA);
# the interpreter runs the first two on the CPU.

_SWIZZLE_BYTES = 128


def hopper_gpu() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x: wgmma)."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def hopper_sms() -> int | None:
    """The SM count of the default device if it is a Hopper GPU that reports one, else None."""
    return getattr(jax.devices()[0], "core_count", None) if hopper_gpu() else None


def _swizzle(dtype) -> tuple:
    """Tiling + 128-byte swizzle of a shared-memory tile that wgmma reads (rows of 128 bytes)."""
    elements = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elements)), plgpu.SwizzleTransform(_SWIZZLE_BYTES))


def smem(shape, dtype, *, swizzled: bool = False):
    return plgpu.SMEM(shape, dtype, transforms=_swizzle(dtype) if swizzled else ())


def smem_bytes(scratch) -> int:
    """Bytes of shared memory a `mosaic_kernel` scratch list allocates (8 per barrier)."""
    total = 0
    for ref in scratch:
        if isinstance(ref, plgpu.Barrier):
            total += 8
        else:
            total += math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
    return total


def smem_union(*shapes_and_dtypes):
    """One shared buffer seen as each (shape, dtype): written as one, TMA-stored as another."""
    return plgpu.RefUnion(*(plgpu.SMEM(shape, dtype) for shape, dtype in shapes_and_dtypes))


def barrier():
    return plgpu.Barrier(num_barriers=1)


def block(shape, index_map, *, swizzled: bool = False, dtype=jnp.bfloat16):
    """A pipeline block of a GMEM ref (swizzled: for a wgmma operand of `dtype`)."""
    return plgpu.BlockSpec(shape, index_map, transforms=_swizzle(dtype) if swizzled else ())


def pipeline(body, *, steps, in_specs, out_specs, in_flight: int, init_carry=None):
    """`steps` pipeline steps (an int, or a tuple: a grid of them) over GMEM refs, `in_flight`
    of them loading/storing at once; with `init_carry`, `body` takes and returns a carry."""
    return plgpu.emit_pipeline(
        body,
        grid=steps if isinstance(steps, tuple) else (steps,),
        in_specs=in_specs,
        out_specs=out_specs,
        max_concurrent_steps=in_flight,
        init_carry=init_carry,
    )


def when(condition, fn):
    """Runs `fn()` where `condition` (a scalar) holds."""
    pl.when(condition)(fn)


# A wgmma accumulator's register layout, and the one an 8-bit tile loads in (`load_upcast`): a
# warp shuffle away from the former.
ACCUMULATOR = plgpu.Layout.WGMMA
NARROW_LOAD = plgpu.Layout.WGMMA_UPCAST_2X


def zeros_rows(shape, layout=None):
    """fp32 zeros in `layout`, by default the wgmma accumulator's (a carry that accumulators add
    to)."""
    return plgpu.layout_cast(
        jnp.zeros(shape, jnp.float32), ACCUMULATOR if layout is None else layout
    )


def wgmma_of_pieces(z, b_smem, shape, pieces_smem=None):
    """z @ b for fp32 registers z and a bf16 operand b: z split into three bf16 pieces
    (z = z1 + z2 + z3 to fp32's 24 bits), each the register operand of one wgmma into one fp32
    accumulator: bf16 operands, fp32 accuracy. z may be in `ACCUMULATOR` or `NARROW_LOAD`
    layout: the pieces take the operand's layout (a 16-bit shuffle, as `load_upcast`'s; an fp32
    one does not lower). pieces_smem: a [3, ...] shared-memory tile the pieces go through
    instead (Mosaic GPU's CPU interpreter reads wgmma operands from refs)."""
    pieces, rest = [], z
    for _ in range(3):
        piece = rest.astype(jnp.bfloat16)
        rest = rest - piece.astype(jnp.float32)
        pieces.append(plgpu.layout_cast(piece, ACCUMULATOR))
    if pieces_smem is not None:
        pieces = [staged(piece, pieces_smem.at[k]) for k, piece in enumerate(pieces)]

    def dot(acc_ref):
        for piece in pieces:
            plgpu.wgmma(acc_ref, piece, b_smem)
        return acc_ref[...]

    return pl.run_scoped(dot, plgpu.ACC(shape, jnp.float32))


def staged(value, smem_ref):
    """`value` (registers) written to `smem_ref` and committed, so that the tensor cores may
    read it: a wgmma operand as a ref, for Mosaic GPU's CPU interpreter (on a GPU, registers
    are operands themselves)."""
    smem_ref[...] = value
    plgpu.commit_smem()  # the threads' writes, before the tensor cores read them
    return smem_ref


def copy_in(gmem_ref, smem_ref, done):
    """Blocking TMA load of a whole GMEM ref into shared memory."""
    plgpu.copy_gmem_to_smem(gmem_ref, smem_ref, done)
    plgpu.barrier_wait(done)


def copy_out(smem_ref, gmem_ref):
    """Asynchronous TMA store (commit shared-memory writes first: `commit_smem`)."""
    plgpu.copy_smem_to_gmem(smem_ref, gmem_ref)


def wait_stores(pending: int):
    """Waits until at most `pending` TMA stores have not yet read their shared memory."""
    plgpu.wait_smem_to_gmem(pending, wait_read_only=True)


commit_smem = plgpu.commit_smem


def load_vectors(smem_ref, vector_elements: int):
    """A shared-memory ref into registers, each thread holding runs of `vector_elements`
    contiguous elements: what the threads then store with vector stores (`ref[...] = value`,
    also into a peer's memory) instead of a TMA store."""
    layout = plgpu.Layout.WG_STRIDED(tuple(smem_ref.shape), vector_elements)
    return plgpu.load(smem_ref, layout=layout)


def wait_writes():
    """Waits until every TMA store of this thread has written its bytes (also a peer's)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)


# Peer memory (Mosaic GPU on NVLink-connected GPUs: `exchange_mosaic`). Peers are named by their
# index along one mesh axis; the other mesh axes keep this device's coordinates.


def peer_ref(ref, axis_name: str, peer):
    """`ref` (a kernel operand or output, allocated by XLA on every device) on rank `peer`."""
    return plgpu.remote_ref(ref, {axis_name: peer})


def semaphore():
    """One semaphore per program, zero at launch; a peer's program of the same index signals."""
    return plgpu.SemaphoreType.REGULAR


def signal_peer(sem, axis_name: str, peer):
    pl.semaphore_signal(sem, 1, device_id={axis_name: peer})


def wait_signals(sem, count: int):
    """Blocks until `sem` has been signalled `count` times, and takes them (back to zero)."""
    pl.semaphore_wait(sem, count)


def wgmma(a, b_smem, shape):
    """a @ b (bf16 or fp16 operands: `a` in shared memory, or registers in the wgmma layout,
    as `load_upcast` leaves them) on the tensor cores -> fp32 registers of `shape`."""

    def dot(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)
        return acc_ref[...]

    return pl.run_scoped(dot, plgpu.ACC(shape, jnp.float32))


def wgmma_sum(operands, shape):
    """sum_k a_k @ b_k over (a_k, b_k) in `operands` (as `wgmma`), in one fp32 accumulator."""

    def dot(acc_ref):
        for a, b_smem in operands:
            plgpu.wgmma(acc_ref, a, b_smem)
        return acc_ref[...]

    return pl.run_scoped(dot, plgpu.ACC(shape, jnp.float32))


def wgmma_transposed(a, b_smem, shape, acc_dtype=jnp.float32):
    """a @ b.T on the tensor cores (`a` in shared memory, or bf16 / fp16 registers in the wgmma
    layout) -> registers of `shape` in `acc_dtype` (fp32, or int32 for INT8 operands). 8-bit
    operands must be K-major, so the second is read transposed: callers pass a symmetric matrix
    (the Sylvester signs, for INT8 codes), for which b.T = b, or b stored [N, K]."""

    def dot(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem.T)
        return acc_ref[...]

    return pl.run_scoped(dot, plgpu.ACC(shape, acc_dtype))


def load_upcast(smem_ref, dtype):
    """An 8-bit shared-memory tile (swizzled, as TMA loaded it for wgmma) into registers as
    `dtype`, laid out as a wgmma operand (8-bit loads in the layout that upcasts with one warp
    shuffle)."""
    narrow = plgpu.load(smem_ref, layout=NARROW_LOAD)
    return plgpu.layout_cast(narrow.astype(dtype), ACCUMULATOR)


def load_widened(smem_ref):
    """An 8-bit shared-memory tile (swizzled, as TMA loaded it) into fp32 registers in the
    layout of its load (`NARROW_LOAD`): no shuffle into the wgmma layout, for sums and encodes
    that run no wgmma."""
    return plgpu.load(smem_ref, layout=NARROW_LOAD).astype(jnp.float32)


def load_tile(smem_ref):
    """A shared-memory tile (not swizzled) into registers in the wgmma layout."""
    return plgpu.load(smem_ref, layout=ACCUMULATOR)


def load_rows(smem_ref, layout=None):
    """A shared-memory vector of one value per row of a tile in `layout` (by default a wgmma
    accumulator's), laid out to scale that tile's rows (`codecs.scale_rows`)."""
    return plgpu.load(smem_ref, layout=(ACCUMULATOR if layout is None else layout).reduce(1))


def _retyped(out, like, replicated_along):
    """`out` typed as varying along the mesh axes `like` varies along, except `replicated_along`.

    Under `shard_map(check_vma=True)` jax 0.11.2's `plgpu.kernel` types its output replicated
    (it ignores `out_type`'s manual axis type); a kernel maps rows to rows, so its output varies
    where its input does, unless it leaves the same bytes on every rank of an axis.
    """
    manual = getattr(jax.typeof(like), "manual_axis_type", None)
    if manual is None:
        return out
    have = getattr(jax.typeof(out), "manual_axis_type", None)
    have = set(have.varying) if have is not None else set()
    missing = tuple(sorted(set(manual.varying) - set(replicated_along) - have))
    return jax.lax.pcast(out, missing, to="varying") if missing else out


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

    `jax.vmap` adds a grid axis (`plgpu.kernel`'s batching rule); under `shard_map` the output
    varies along the mesh axes args[0] varies along (`_retyped`), except `replicated_along` (a
    kernel that leaves the same bytes on every rank of them). interpret: Mosaic GPU's CPU
    interpreter.
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
    return _retyped(out, args[0], replicated_along)
