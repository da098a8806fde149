"""The compressed collectives' algorithms on one device's block: rows, padding, slices, and the
one-shot, two-shot and fused all-reduce, the reduce-scatter and the all-gather.

Each takes the `CommConfig` the policy left compressed and the `taco_jax.target.Target` its
collective is traced for (`taco_jax.collectives` decides whether to compress, measures, and
differentiates); every codec op goes through `taco_jax._backends`. The message is laid out as
rows (`rows[j]`: the chunk destined for rank j), padded with whole zero groups after the message
to whole rows of the kernels that run, and cut into `cfg.slices` independent column blocks.
docs/method.md, "Collectives", says what each algorithm sends.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import _backends, codecs, policy
from taco_jax.codecs import Codec
from taco_jax.comm_config import MAX_SLICES, CommConfig
from taco_jax.jax_workarounds import varying
from taco_jax.target import Target

AxisName = str | tuple[str, ...]


def axis_names(axis_name: AxisName) -> tuple[str, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def axis_size(axis_name: AxisName) -> int:
    """Size of a bound axis (or the product over a tuple of axes); a clear error otherwise."""
    names = axis_names(axis_name)
    if not names or not all(isinstance(name, str) for name in names):
        raise TypeError(f"axis_name={axis_name!r} must be an axis name or a tuple of them")
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound: call inside jax.shard_map over a "
            "mesh with that axis, or inside jax.vmap(..., axis_name=...); under "
            "jax.grad(jax.jit(jax.vmap(...))) JAX runs the op's custom_vjp rules without the "
            "vmap's axis: differentiate the vmap itself, with no jit between the grad and it "
            "(jax.jit(jax.grad(...)) around it; docs/method.md, 'Traps')"
        ) from None


def varies_along(x: jax.Array, axis_name: AxisName) -> bool:
    """Whether `x` is typed as varying along `axis_name` (only under shard_map's check_vma)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.11; older releases name it .vma
    varying_axes = manual.varying if manual is not None else getattr(aval, "vma", frozenset())
    return all(name in varying_axes for name in axis_names(axis_name))


# --------------------------------------------------------------------------------------------
# Building blocks on wire rows.


def exchange_rows(wire: jax.Array, axis_name: AxisName) -> jax.Array:
    """all_to_all of [N, B] wire rows: afterwards row j is what rank j sent to this rank."""
    return lax.all_to_all(varying(wire, axis_name), axis_name, 0, 0, tiled=True)


def _all_gather_wire(wire: jax.Array, axis_name: AxisName, *, invariant: bool) -> jax.Array:
    """wire [B] of this rank -> [N, B], row r from rank r.

    `invariant` types the result as replicated (shard_map's check_vma), as `lax.psum`'s is.
    """
    to = "invarying" if invariant else "varying"
    return lax.all_gather(wire, axis_name, axis=0, tiled=False, to=to)


def _sliced(fn, rows: jax.Array, slices: int) -> jax.Array:
    """Applies `fn` to `slices` independent column blocks of rows [..., n]; concatenates results.

    The pieces share no data, so XLA may overlap the encode of one with the transfer of another.
    """
    if slices == 1:
        return fn(rows)
    pieces = jnp.split(rows, slices, axis=-1)
    return jnp.concatenate([fn(piece) for piece in pieces], axis=-1)


# --------------------------------------------------------------------------------------------
# Where the fused exchange runs, and what the rows are padded to.


def fused_exchange(kind: str, cfg: CommConfig, target: Target, rows=None, dtype=None):
    """The fused encode + exchange kernel ("all_gather" or "all_to_all") of `cfg` for `rows`
    (an array or shape-dtype [R, n]; None: any rows of `dtype`) where it runs on `target`
    (`pallas_kernels.registry.select`: compiled kernels, a Hopper GPU that stores into its
    peers' memory, a codec, dtype and shape the kernel takes), else None."""
    if rows is None:
        return _backends.exchange(f"encode_{kind}", cfg.impl, cfg.codec, target, dtype=dtype)
    (count, n), dtype = rows.shape, rows.dtype
    return _backends.exchange(
        f"encode_{kind}", cfg.impl, cfg.codec, target, rows=count, n=n, dtype=dtype
    )


def fused_kernel_runs(target: Target, codec="taco", impl: str = "auto") -> bool:
    """Whether the fused exchange's kernel runs bf16 messages of `codec` (a name or a codec)
    under `impl` on `target` (a TP group's before any op is traced:
    `taco_jax.target.probe(axis, link, mesh=mesh)`): what `fused_exchange` finds while tracing,
    `pallas_kernels.registry.select`'s answer."""
    codec = codecs.get_codec(codec) if isinstance(codec, str) else codec
    kernel = _backends.exchange("encode_all_gather", impl, codec, target, dtype=jnp.bfloat16)
    return kernel is not None


def may_fuse(x: jax.Array, cfg: CommConfig, target: Target, n_ranks: int):
    """The fused exchange a collective may use (the all-reduce: whether the policy may pick
    "fused"), or None: it runs here (`fused_exchange`) and `algorithm` is "fused", or "auto"
    where a table measured it for this group size (`policy.fused_in_auto`: N = 2, or this
    machine's tuned table). One- and two-shot keep NCCL."""
    if cfg.algorithm not in ("auto", "fused"):
        return None
    fused = fused_exchange("all_gather", cfg, target, dtype=x.dtype)
    if fused is not None and cfg.algorithm == "auto":
        return fused if policy.fused_in_auto(n_ranks, target.link, cfg.codec, cfg.impl) else None
    return fused


def row_multiple(cfg: CommConfig, target: Target, fused=None) -> int:
    """What each row of one slice is padded to: whole rows of the kernels that run
    (`_backends.row_multiple`: whole groups, or whole Mosaic GPU rows), and, where the `fused`
    exchange runs, of its rows."""
    multiple = _backends.row_multiple(cfg.impl, cfg.codec, target)
    return multiple if fused is None else math.lcm(multiple, fused.row_multiple)


def _padded_rows(flat: jax.Array, rows: int, multiple: int) -> tuple[jax.Array, int]:
    """flat [M] padded so that each of `rows` rows is a multiple of `multiple`: ([rows, m], M).
    Padding adds whole zero groups after the message, so its own groups and codes do not
    depend on it."""
    padded, size = codecs.pad_to_multiple(flat, rows * multiple)
    return padded.reshape(rows, -1), size


def addressable(
    cfg: CommConfig,
    x: jax.Array,
    n_ranks: int,
    *,
    rows: int,
    padding: int,
    limit: int | None,
    gathers: bool = False,
) -> CommConfig:
    """`cfg` with at least as many slices as keep every buffer of one slice's kernel calls
    within `limit` bytes (the kernels' 32-bit offsets, `_backends.max_buffer_bytes`; None: no
    limit).

    The message, x's elements, is laid out as `rows` rows (1: one-shot, fused and all-gather;
    N: two-shot and reduce-scatter, a row per rank), each padded per slice to a multiple of
    `padding`. A slice's largest buffers are then its rows of values (N times that for an
    all-gather's output: `gathers`), N wire rows of one row's elements (gathered, or one from
    each rank) and, for a TAH-Quant codec, one row decoded to fp32. Slices do not change a
    value: each encodes whole groups. Raises ValueError, naming the size, where MAX_SLICES are
    not enough."""
    if limit is None:
        return cfg
    itemsize = jnp.dtype(x.dtype).itemsize
    for slices in range(cfg.slices, MAX_SLICES + 1):
        row = math.ceil(x.size / rows / slices / padding) * padding  # a slice's row, padded
        values = (n_ranks if gathers else 1) * rows * row * itemsize
        # TAH-Quant's decode-sum (no fused kernel) decodes each row to fp32 first.
        decoded = 0 if isinstance(cfg.codec, Codec) else 4 * row
        if max(values, decoded, n_ranks * cfg.codec.wire_bytes(row)) <= limit:
            return cfg if slices == cfg.slices else dataclasses.replace(cfg, slices=slices)
    raise ValueError(
        f"a message of {x.size} elements per rank over {n_ranks} ranks does not fit the "
        f"kernels' {limit}-byte buffers in {MAX_SLICES} slices; split it into smaller calls"
    )


def _laid_out(x, cfg, target, n_ranks, *, rows, fused=None, gathers=False):
    """(cfg with enough slices: `addressable`, this slice count's row multiple)."""
    padding = row_multiple(cfg, target, fused)
    limit = _backends.max_buffer_bytes(cfg.impl, target)
    cfg = addressable(cfg, x, n_ranks, rows=rows, padding=padding, limit=limit, gathers=gathers)
    return cfg, padding * cfg.slices


# --------------------------------------------------------------------------------------------
# The algorithms, on this device's block.


def all_reduce(
    x: jax.Array,
    *,
    axis_name: AxisName,
    cfg: CommConfig,
    target: Target,
    algorithm: str,
    n_ranks: int,
    fused=None,
) -> jax.Array:
    """The compressed all-reduce of this device's x with `algorithm` (one-shot, two-shot or
    fused: the exchange kernel `fused`, of `may_fuse`)."""
    invariant = varies_along(x, axis_name)
    fused = fused if algorithm == "fused" else None
    one_row = algorithm in ("one_shot", "fused")  # else two-shot: a row per rank
    rows_of = 1 if one_row else n_ranks
    cfg, multiple = _laid_out(x, cfg, target, n_ranks, rows=rows_of, fused=fused)
    ops = _backends.codec_ops(cfg.impl, cfg.codec, target)

    def two_shot(piece):  # piece: [N, m / slices], row j for rank j
        n = piece.shape[-1]
        received = exchange_rows(ops.encode(cfg.codec, piece), axis_name)
        reduced_wire = ops.decode_sum_reencode(cfg.codec, received, n)
        gathered = _all_gather_wire(reduced_wire, axis_name, invariant=invariant)
        return ops.decode(cfg.codec, gathered, n, x.dtype)

    def one_shot(piece):  # piece: [1, m / slices], this rank's whole message
        exchange = fused and fused_exchange("all_gather", cfg, target, piece)
        if exchange:
            gathered = exchange(cfg.codec, piece, axis_name, n_ranks, replicated=invariant)[:, 0]
        else:
            wire = ops.encode(cfg.codec, piece)[0]
            gathered = _all_gather_wire(wire, axis_name, invariant=invariant)
        # Every rank sums the same N rows in rank order: bit-identical outputs.
        return ops.decode_sum(cfg.codec, gathered, piece.shape[-1], x.dtype)[None]

    rows, size = _padded_rows(x.reshape(-1), rows_of, multiple)
    out = _sliced(one_shot if one_row else two_shot, rows, cfg.slices)
    return out.reshape(-1)[:size].reshape(x.shape)


def reduce_scatter(
    x: jax.Array,
    *,
    axis_name: AxisName,
    dim: int,
    tiled: bool,
    cfg: CommConfig,
    target: Target,
    fused,
    n_ranks: int,
) -> jax.Array:
    """The compressed reduce-scatter of this device's x: encode, all-to-all (or the `fused`
    exchange), decode-sum."""
    cfg, multiple = _laid_out(x, cfg, target, n_ranks, rows=n_ranks, fused=fused)
    ops = _backends.codec_ops(cfg.impl, cfg.codec, target)
    moved = jnp.moveaxis(x, dim, 0)
    block_shape = (moved.shape[0] // n_ranks,) + moved.shape[1:]
    rows, size = codecs.pad_to_multiple(moved.reshape(n_ranks, -1), multiple)

    def scatter(piece):  # piece: [N, m / slices], row j for rank j
        exchange = fused and fused_exchange("all_to_all", cfg, target, piece)
        if exchange:
            received = exchange(cfg.codec, piece, axis_name, n_ranks)
        else:
            received = exchange_rows(ops.encode(cfg.codec, piece), axis_name)
        return ops.decode_sum(cfg.codec, received, piece.shape[-1], x.dtype)

    block = _sliced(scatter, rows, cfg.slices)[:size].reshape(block_shape)
    return jnp.moveaxis(block, 0, dim) if tiled else block[0]


def all_gather(
    x: jax.Array,
    *,
    axis_name: AxisName,
    axis: int,
    tiled: bool,
    cfg: CommConfig,
    target: Target,
    fused,
    n_ranks: int,
) -> jax.Array:
    """The compressed all-gather of this device's x: encode, all-gather the wire (or the
    `fused` exchange), decode."""
    cfg, multiple = _laid_out(x, cfg, target, n_ranks, rows=1, fused=fused, gathers=True)
    ops = _backends.codec_ops(cfg.impl, cfg.codec, target)
    row, size = codecs.pad_to_multiple(x.reshape(1, -1), multiple)

    def gather(piece):  # piece: [1, n]
        exchange = fused and fused_exchange("all_gather", cfg, target, piece)
        if exchange:
            gathered = exchange(cfg.codec, piece, axis_name, n_ranks, replicated=False)[:, 0]
        else:
            gathered = _all_gather_wire(ops.encode(cfg.codec, piece)[0], axis_name, invariant=False)
        return ops.decode(cfg.codec, gathered, piece.shape[-1], x.dtype)

    stacked = _sliced(gather, row, cfg.slices)[:, :size].reshape((n_ranks,) + x.shape)
    out = jnp.moveaxis(stacked, 0, axis)
    if tiled:
        out = out.reshape(x.shape[:axis] + (n_ranks * x.shape[axis],) + x.shape[axis + 1 :])
    return out


def wire_bytes_per_rank(num_elements: int, n_ranks: int, cfg: CommConfig) -> int:
    """Bytes one rank sends in `compressed_psum` of `num_elements`, padding included.

    docs/method.md, "Collectives", for `taco`: two-shot 2 (N-1)/N x (1 + 8/G) bytes per element
    (both phases), one-shot (N-1) x (1 + 8/G); a bf16 ring all-reduce sends 2 (N-1)/N x 2.
    `algorithm="auto"` counts as two-shot, what it runs off a real link (on GPUs
    `taco_jax.policy` may choose one-shot, or no compression at all); "fused" as one-shot, what
    it runs off NVLink. The padding to the kernels' rows (`row_multiple`: whole Mosaic GPU rows
    where they run, the fused exchange's rows x slices) is not counted.
    """
    one_shot = cfg.algorithm in ("one_shot", "fused")
    rows = 1 if one_shot else n_ranks
    per_row = math.ceil(num_elements / (rows * cfg.codec.group_size * cfg.slices))
    chunk = cfg.codec.wire_bytes(per_row * cfg.codec.group_size * cfg.slices)
    return (n_ranks - 1) * chunk if one_shot else 2 * (n_ranks - 1) * chunk
