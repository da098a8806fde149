"""SDP4Bit's two compressors of sharded data parallelism (ZeRO-1) traffic, as collectives over
the dp mesh axes (Jia et al., "SDP4Bit", NeurIPS 2024; docs/method.md, "Data-parallel codecs").

- `tlq_hs_psum_scatter` (TLq-HS, the gradient reduce-scatter): a Hadamard over every block of 32,
  then one level (one dp axis: 4-bit codes, group 128, all-to-all, decode-sum) or two (an inner
  and an outer axis, e.g. within and across nodes: 8-bit codes within, decode-sum, re-encode to
  4 bits, all-to-all across, decode-sum), then the inverse Hadamard. Each rank gets its shard of
  the sum in fp32.
- `qwd_all_gather` (qWD, the parameter all-gather): every rank holds the same bf16 replica of
  the parameters; the owner of a shard sends the difference between its new fp32 master shard
  and the replica's shard, 4-bit, group 2048; every rank, the owner too, adds the same decoded
  differences, so the replicas stay bit-identical. The master weights stay exact.

The codes are those of the TAH-Quant codec framework (`taco_jax.tahquant.TahQuant`: symmetric,
no pivot, stochastic rounding from a threaded key, 4-bit codes two per byte, full range), so
their fused kernels serve both (TLq-HS: G = 128; qWD: G = 2048, one group per encode tile).
Both work inside `shard_map` and under `vmap(axis_name=...)`, with any number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from taco_jax import _backends, codecs
from taco_jax import target as platform
from taco_jax.algorithms import AxisName, axis_size, exchange_rows
from taco_jax.tahquant import TahQuant

_SYMMETRIC = dict(asymmetric=False, pivot=False, stochastic=True)
# TLq-HS: 8-bit codes within the inner level, 4-bit across (and for a single level).
TLQ_INNER = TahQuant("tlq_hs8", bits=8, group_size=128, **_SYMMETRIC)
TLQ_OUTER = TahQuant("tlq_hs4", bits=4, group_size=128, **_SYMMETRIC)
# qWD: 4-bit weight differences, groups of 2048, scale absmax / 7.
QWD = TahQuant("qwd", bits=4, group_size=2048, **_SYMMETRIC)
HADAMARD_BLOCK = 32


def _axes(axis_names: AxisName | Sequence[AxisName]) -> tuple:
    return tuple(axis_names) if isinstance(axis_names, list | tuple) else (axis_names,)


def _rank_key(key: jax.Array, axes: tuple) -> jax.Array:
    """`key` with this rank's index along each of `axes` folded in: independent noise per rank."""
    for axis in axes:
        key = jax.random.fold_in(key, lax.axis_index(axis))
    return key


def smoothed(x: jax.Array) -> jax.Array:
    """The orthonormal H_32 over every block of 32 of the flat x (its own inverse up to fp32
    rounding): SDP4Bit's "smooth" step, spreading an outlier over its block before quantizing.

    (SDP4Bit applies the unnormalized S_32 forward and S_32 / 32 back; the factor sqrt(32)
    between the two conventions is absorbed exactly by every group's absmax scale.)"""
    blocks = x.reshape(-1, HADAMARD_BLOCK)
    return codecs.hadamard_transform(blocks, HADAMARD_BLOCK).reshape(x.shape)


def _decode_sum(codec: TahQuant, wire: jax.Array, n: int, stage: _backends.StageOps) -> jax.Array:
    """The fp32 sum of the decoded rows of wire [N, B], in row order (every rank alike): the
    TP collectives' decode-sum for TAH-Quant codecs (`_backends.stage_collective_ops`)."""
    return _backends.stage_collective_ops(stage).decode_sum(codec, wire, n)


def _check_gradient(x: jax.Array, ranks: int) -> None:
    if x.ndim != 1 or x.dtype != jnp.float32:
        raise ValueError(
            f"tlq_hs_psum_scatter takes a flat fp32 gradient, got shape={x.shape} dtype={x.dtype}"
        )
    quantum = ranks * TLQ_OUTER.group_size
    if x.shape[0] % quantum:
        raise ValueError(
            f"gradient size {x.shape[0]} is not a multiple of {quantum} (dp ranks {ranks} x "
            f"group {TLQ_OUTER.group_size}): pad it (`padded_size`)"
        )


def padded_size(size: int, ranks: int) -> int:
    """The smallest multiple of ranks x 2048 (qWD's group, a multiple of TLq-HS's) >= size:
    a size both collectives here take."""
    quantum = ranks * QWD.group_size
    return -(-size // quantum) * quantum


def tlq_hs_psum_scatter(
    x: jax.Array,
    axis_names: AxisName | Sequence[AxisName],
    *,
    key: jax.Array,
    impl: str = "auto",
) -> jax.Array:
    """`lax.psum_scatter(x, axis_names, scatter_dimension=0, tiled=True)` of a flat fp32
    gradient, compressed with TLq-HS, up to its stochastic rounding.

    Args:
      x: this rank's gradient, fp32 [n], n a multiple of (dp ranks x 128) (`padded_size`).
      axis_names: one dp axis (one level: 4-bit codes), or (outer, inner) (two levels: 8-bit
        codes over the inner axis, 4-bit over the outer; a level over one rank is skipped, so
        one inner group alone is reduced with 8-bit codes only). The shards are ordered as
        `lax.psum_scatter` orders them over that tuple (outer major).
      key: PRNG key of the stochastic rounding; each rank folds in its indices, the outer level
        folds in 1 more.
      impl: the codec kernels (`taco_jax._backends`): fused on a GPU, the reference elsewhere.
    Returns:
      fp32 [n / ranks]: this rank's shard of the sum over all ranks.
    """
    axes = _axes(axis_names)
    if len(axes) not in (1, 2):
        raise ValueError(f"axis_names={axis_names!r}: one dp axis or (outer, inner)")
    sizes = [axis_size(axis) for axis in axes]
    ranks = axis_size(axes)
    _check_gradient(x, ranks)
    key = _rank_key(key, axes)
    y = smoothed(x)
    stage = _backends.stage_ops(impl, platform.probe())
    if len(axes) == 1:
        return _one_level(TLQ_OUTER, y, axes[0], key, stage)
    outer, inner = axes
    n_outer, n_inner = sizes
    if n_outer == 1:  # one group: the 8-bit level alone (a 4-bit pass would add error only)
        return _one_level(TLQ_INNER, y, inner, key, stage)
    if n_inner == 1:
        return _one_level(TLQ_OUTER, y, outer, key, stage)
    shard = x.shape[0] // ranks
    # Row i of the inner level holds, for every outer index o, shard (o, i): what inner peer i
    # sums before the outer level.
    rows = y.reshape(n_outer, n_inner, shard).transpose(1, 0, 2).reshape(n_inner, -1)
    wire = exchange_rows(stage.encode(TLQ_INNER, rows, key), inner)
    partial = _decode_sum(TLQ_INNER, wire, rows.shape[1], stage).reshape(n_outer, shard)
    wire = exchange_rows(stage.encode(TLQ_OUTER, partial, jax.random.fold_in(key, 1)), outer)
    return smoothed(_decode_sum(TLQ_OUTER, wire, shard, stage))


def _one_level(codec: TahQuant, y: jax.Array, axis: AxisName, key, stage) -> jax.Array:
    """The smoothed gradient y [n] reduce-scattered over one axis with `codec`'s codes."""
    rows = y.reshape(axis_size(axis), -1)  # row j: shard j
    wire = exchange_rows(stage.encode(codec, rows, key), axis)
    return smoothed(_decode_sum(codec, wire, rows.shape[1], stage))


def qwd_all_gather(
    new_shard: jax.Array,
    replica: jax.Array,
    axis_names: AxisName | Sequence[AxisName],
    *,
    key: jax.Array,
    impl: str = "auto",
) -> jax.Array:
    """The bf16 replica after every rank's shard moved to its new value, through quantized
    weight differences (qWD); `replica` is the same on every rank, and so is the result.

    Plain JAX it approximates: `lax.all_gather(new_shard, axis_names, tiled=True)` cast to the
    replica's dtype. Each rank sends q(new_shard - replica's shard) (4-bit, group 2048,
    stochastic rounding); every rank adds every decoded difference to the replica in fp32 and
    casts back, so all replicas stay bit-identical (the owner uses the decoded difference too,
    never the exact one).

    Args:
      new_shard: this rank's updated fp32 master shard [m], m a multiple of 2048.
      replica: the full parameter replica [ranks x m] (bf16 in SDP4Bit; any float dtype).
      axis_names: the dp axis, or a tuple of axes (outer major, as `lax.all_gather`).
      key: PRNG key of the stochastic rounding (each rank folds in its indices).
      impl: the codec ops (`taco_jax._backends`: fused on a GPU, the reference elsewhere).
    """
    axes = _axes(axis_names)
    ranks = axis_size(axes)
    m = new_shard.shape[0]
    if new_shard.ndim != 1 or m % QWD.group_size:
        raise ValueError(
            f"new_shard shape={new_shard.shape} must be flat with a multiple of "
            f"{QWD.group_size} elements (`padded_size`)"
        )
    if replica.shape != (ranks * m,):
        raise ValueError(f"replica shape={replica.shape} is not ({ranks} ranks x {m},)")
    index = rank_index(axes)
    mine = lax.dynamic_slice_in_dim(replica, index * m, m).astype(jnp.float32)
    delta = new_shard.astype(jnp.float32) - mine
    stage = _backends.stage_ops(impl, platform.probe())
    wire = stage.encode(QWD, delta[None], _rank_key(key, axes))
    every = gather_over(wire, axes)  # [ranks, B], row j from rank j
    deltas = stage.decode(QWD, every, m, jnp.float32).reshape(-1)
    return (replica.astype(jnp.float32) + deltas).astype(replica.dtype)


def gather_over(x: jax.Array, axes: tuple) -> jax.Array:
    """`lax.all_gather(x, axes, tiled=True)`, one axis at a time (innermost first), so it also
    runs under nested `vmap` (JAX 0.11.2 fails there on a tuple of axes): outer-major order."""
    for axis in reversed(axes):
        x = lax.all_gather(x, axis, tiled=True)
    return x


def scatter_over(x: jax.Array, axes: tuple) -> jax.Array:
    """`lax.psum_scatter(x, axes, tiled=True)` on the leading axis, one axis at a time
    (outermost first; as `gather_over`): this rank gets shard outer_index x inner + inner_index."""
    for axis in axes:
        x = lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
    return x


def rank_index(axes: tuple) -> jax.Array:
    """This rank's index over `axes`, outer major (the order of `lax.all_gather` and
    `lax.psum_scatter` over them)."""
    index = lax.axis_index(axes[0])
    for axis in axes[1:]:
        index = index * axis_size(axis) + lax.axis_index(axis)
    return index
