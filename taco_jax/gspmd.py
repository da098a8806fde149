"""Tensor-parallel dense layers for GSPMD programs (docs/gspmd.md).

In a model whose parameters carry shardings and whose step is a plain `jax.jit`, the compiler
inserts its own fp32/bf16 all-reduce after a row-parallel matmul (and in the backward of a
column-parallel one). These layers run that matmul in a `jax.shard_map` manual over the TP axis
only (every other mesh axis stays the compiler's), with Megatron's operators around it
(`taco_jax.tp`), so that the TP reductions move compressed bytes and nothing else changes.
They work on meshes of `Auto` and of `Explicit` axes, under the mesh set by `jax.set_mesh`, in
Python loops and under `lax.scan` / `nnx.scan` with `jax.checkpoint`; a weight sharded over
other axes as well (FSDP's "fsdp", ZeRO-3) is gathered over them first, as GSPMD gathers it for
a plain matmul.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from taco_jax.tp import TPComm, copy_to_tp, reduce_from_tp


def _check(x: jax.Array, w: jax.Array) -> None:
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"x.shape={x.shape} @ w.shape={w.shape}: need x[..., K] and w[K, M]")


def _tp_only(w: jax.Array, spec: P) -> jax.Array:
    """w with its type sharded as `spec` alone: an `Explicit` mesh types FSDP's shards, and a
    matmul of them inside the TP block would shard its result twice over one axis; this is the
    all-gather over those axes that GSPMD runs for FSDP (its transpose reduce-scatters the
    weight's gradient). On `Auto` axes the type holds no such split: the compiler's choice."""
    typed = getattr(jax.typeof(w).sharding, "spec", None) or P()
    if any(entry is not None for entry, want in zip(typed, spec, strict=False) if entry != want):
        return jax.sharding.reshard(w, spec)
    return w


def _batch(x: jax.Array) -> tuple[None, ...]:
    return (None,) * (x.ndim - 1)  # leading dims: no TP split (other axes: the compiler's)


def column_parallel_dense(x: jax.Array, w: jax.Array, comm: TPComm) -> jax.Array:
    """`x @ w` with w's columns split over `comm.axis_name`: equal to `jnp.matmul(x, w)`
    exactly in the forward; in the backward x's gradient is the compressed all-reduce of the
    ranks' partial gradients (`copy_to_tp`, Megatron f) where GSPMD would all-reduce in full
    precision.

    Sharding: `x[..., K]` (replicated over TP), `w[K, M]{M: tp}` -> `y[..., M]{M: tp}`.
    """
    _check(x, w)
    axis = comm.axis_name
    return jax.shard_map(
        lambda x, w: copy_to_tp(x, comm) @ w,
        in_specs=(P(), P(None, axis)),
        out_specs=P(*_batch(x), axis),
        axis_names={axis},
    )(x, _tp_only(w, P(None, axis)))


def row_parallel_dense(x: jax.Array, w: jax.Array, comm: TPComm) -> jax.Array:
    """`x @ w` with the contraction split over `comm.axis_name`: equal to `jnp.matmul(x, w)` up
    to the FP8 rounding of the sum over TP ranks (`reduce_from_tp`, Megatron g: compressed
    all-reduce forward, identity backward), where GSPMD would all-reduce in full precision.

    Sharding: `x[..., K]{K: tp}`, `w[K, M]{K: tp}` -> `y[..., M]` (replicated over TP).
    """
    _check(x, w)
    axis = comm.axis_name
    return jax.shard_map(
        lambda x, w: reduce_from_tp(x @ w, comm),
        in_specs=(P(*_batch(x), axis), P(axis, None)),
        out_specs=P(),
        axis_names={axis},
    )(x, _tp_only(w, P(axis, None)))
