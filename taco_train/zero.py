"""Sharded data parallelism (ZeRO-1, as Megatron's distributed optimizer): the fp32 master
weights and the optimizer state are split over the dp ranks, every rank holds a replica of the
parameters for the forward and backward, and a step is

    gradients --reduce-scatter over dp--> this rank's shard of the mean gradient
              --global-norm clip, optimizer--> this rank's new master shard
              --all-gather over dp--> the new replica on every rank,

each collective plain or compressed with SDP4Bit (`taco_jax.sdp4bit`: TLq-HS for the
reduce-scatter, qWD for the all-gather; docs/method.md, "Data-parallel codecs").

Every parameter leaf is sharded on its own: flattened, zero-padded to a multiple of
dp x 2048 (`sdp4bit.padded_size`), and split into dp equal shards, so the optimizer sees a
pytree of shards with the parameters' structure (per-leaf options such as AdamW's decay mask
apply unchanged). `update` runs per rank, inside `shard_map` or `vmap` over the dp axes.

With tensor parallelism every rank of a (dp, tp) mesh holds its TP slice of each leaf (the
whole leaf where TP replicates it): ZeRO shards that slice over dp, so a rank keeps 1 / (dp tp)
of a split leaf's state (`shard_leaves(..., tp_dims=...)`), and the global norm counts a split
leaf's slices once each and a replicated leaf once (`update(..., split=...)`).
Uncompressed, its master weights equal the replicated-DP AdamW update of the mean gradient
(tests/taco_train/test_zero.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax

from taco_jax import sdp4bit
from taco_jax.collectives import axis_size

GRAD_CODECS = ("none", "tlq_hs")
PARAM_CODECS = ("none", "qwd")


class ShardState(flax.struct.PyTreeNode):
    """One rank's share: master (fp32 shards [S] per leaf), opt_state (the optimizer's state
    over those shards)."""

    master: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """The dp axes (one axis, or (outer, inner) for TLq-HS's two levels), the codec of each
    collective, the global-norm clipping threshold (None: no clipping), and the codec kernels
    (`impl`, as `taco_jax.CommConfig.impl`)."""

    dp_axes: str | tuple[str, ...] = "dp"
    grad_codec: str = "none"
    param_codec: str = "none"
    grad_clip: float | None = None
    impl: str = "auto"

    def __post_init__(self):
        if self.grad_codec not in GRAD_CODECS:
            raise ValueError(f"grad_codec={self.grad_codec!r}: choose one of {GRAD_CODECS}")
        if self.param_codec not in PARAM_CODECS:
            raise ValueError(f"param_codec={self.param_codec!r}: choose one of {PARAM_CODECS}")

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.dp_axes,) if isinstance(self.dp_axes, str) else tuple(self.dp_axes)


def shard_size(leaf_size: int, ranks: int) -> int:
    """Elements of one rank's shard of a leaf of `leaf_size` elements."""
    return sdp4bit.padded_size(leaf_size, ranks) // ranks


def _padded_flat(x: jax.Array, ranks: int, dtype=jnp.float32) -> jax.Array:
    flat = x.reshape(-1).astype(dtype)
    return jnp.pad(flat, (0, shard_size(flat.shape[0], ranks) * ranks - flat.shape[0]))


REPLICATED = -1  # a `tp_dims` entry: the leaf is whole on every TP rank


def tp_slices(x: jax.Array, dim: int, tp: int) -> jax.Array:
    """The TP slices of a full leaf, [tp, *slice shape]: rank r's part of axis `dim` (contiguous
    blocks, as `NamedSharding` places it), or tp copies of x for dim = REPLICATED."""
    if dim == REPLICATED:
        return jnp.broadcast_to(x, (tp, *x.shape))
    blocks = x.reshape(*x.shape[:dim], tp, x.shape[dim] // tp, *x.shape[dim + 1 :])
    return jnp.moveaxis(blocks, dim, 0)


def merge_tp_slices(slices: jax.Array, dim: int) -> jax.Array:
    """Inverse of `tp_slices` (a replicated leaf: the first copy)."""
    if dim == REPLICATED:
        return slices[0]
    blocks = jnp.moveaxis(slices, 0, dim)
    return blocks.reshape(*blocks.shape[:dim], -1, *blocks.shape[dim + 2 :])


def shard_leaves(params: Any, ranks: int, tp_dims: Any = None, tp: int = 1) -> Any:
    """Full parameters -> the master shards of every rank, fp32 per leaf: [ranks, S] or, with
    `tp_dims` (per leaf the axis split over tp, or REPLICATED), [ranks, tp, S] holding the
    shards of each TP slice. Outside any mapping: place them with the dp (and tp) axes on the
    leading dimensions."""
    if tp_dims is None:
        return jax.tree.map(lambda x: _padded_flat(x, ranks).reshape(ranks, -1), params)

    def shard(x, dim):
        slices = tp_slices(x, dim, tp)
        per_slice = jax.vmap(lambda v: _padded_flat(v, ranks).reshape(ranks, -1))(slices)
        return jnp.swapaxes(per_slice, 0, 1)

    return jax.tree.map(shard, params, tp_dims)


def unshard_leaves(shards: Any, like: Any, tp_dims: Any = None) -> Any:
    """Inverse of `shard_leaves`: shards -> leaves shaped like `like`."""

    def merge(s, x, dim=None):
        if dim is None:
            return s.reshape(-1)[: x.size].reshape(x.shape).astype(x.dtype)
        flat = jnp.swapaxes(s, 0, 1).reshape(s.shape[1], -1)  # [tp, ranks * S]
        size = x.size if dim == REPLICATED else x.size // s.shape[1]
        slices = flat[:, :size].reshape(s.shape[1], *tp_slices(x, dim, s.shape[1]).shape[1:])
        return merge_tp_slices(slices, dim).astype(x.dtype)

    if tp_dims is None:
        return jax.tree.map(merge, shards, like)
    return jax.tree.map(merge, shards, like, tp_dims)


def init(optimizer: optax.GradientTransformation, master: Any) -> ShardState:
    """One rank's state from its master shards (per rank, inside the mapping)."""
    return ShardState(master, optimizer.init(master))


def _reduce_scatter(g: jax.Array, cfg: ZeroConfig, key: jax.Array) -> jax.Array:
    """This rank's shard of the sum over ranks of the flat padded gradient g."""
    if cfg.grad_codec == "tlq_hs":
        return sdp4bit.tlq_hs_psum_scatter(g, cfg.axes, key=key, impl=cfg.impl)
    return sdp4bit.scatter_over(g, cfg.axes)


def _all_gather(shard: jax.Array, replica: jax.Array, cfg: ZeroConfig, key: jax.Array):
    """The new replica leaf (replica's shape and dtype) from every rank's new master shard."""
    if cfg.param_codec == "qwd":
        flat = _padded_flat(replica, axis_size(cfg.axes), replica.dtype)
        new = sdp4bit.qwd_all_gather(shard, flat, cfg.axes, key=key, impl=cfg.impl)
    else:
        new = sdp4bit.gather_over(shard.astype(replica.dtype), cfg.axes)
    return new[: replica.size].reshape(replica.shape)


def _valid(shard: jax.Array, size: int, cfg: ZeroConfig) -> jax.Array:
    """The shard with its padding zeroed: TLq-HS's Hadamard spreads rounding error into the
    padded tail of the last block, and the optimizer must not move padding."""
    index = sdp4bit.rank_index(cfg.axes) * shard.shape[0] + lax.broadcasted_iota(
        jnp.int32, shard.shape, 0
    )
    return jnp.where(index < size, shard, 0.0)


def _leaf_keys(key: jax.Array, tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, list(jax.random.split(key, len(leaves))))


def _global_norm(shards: Any, cfg: ZeroConfig, split: Any, split_axis: str | None):
    """sqrt of the sum of squares of every rank's shards: over the dp axes, and over
    `split_axis` too for the leaves `split` marks (their slices differ between its ranks; the
    others are the same on each, so counted once)."""
    squares = jax.tree.map(lambda s: jnp.sum(jnp.square(s)), shards)
    if split is None:
        return jnp.sqrt(lax.psum(sum(jax.tree.leaves(squares)), cfg.axes))
    pairs = list(zip(jax.tree.leaves(squares), jax.tree.leaves(split), strict=True))
    whole = sum((q for q, is_split in pairs if not is_split), jnp.zeros((), jnp.float32))
    sliced = sum((q for q, is_split in pairs if is_split), jnp.zeros((), jnp.float32))
    return jnp.sqrt(lax.psum(whole, cfg.axes) + lax.psum(sliced, (*cfg.axes, split_axis)))


def update(
    optimizer: optax.GradientTransformation,
    cfg: ZeroConfig,
    grads: Any,
    state: ShardState,
    replica: Any,
    key: jax.Array,
    split: Any = None,
    split_axis: str | None = None,
) -> tuple[ShardState, Any, jax.Array]:
    """One sharded step on this rank: (new state, new replica, global gradient norm).

    grads: this rank's gradients of its own batch (full leaves, or this rank's TP slices of
    them; not averaged over dp); the step uses their mean over the dp ranks. replica: the
    parameters (or slices) every dp rank holds (any float dtype). key: PRNG key of the
    compressed collectives' stochastic rounding (unused without compression); thread it through
    the training loop. split: with TP, a pytree of bools, True for the leaves sliced over the
    mesh axis `split_axis` (the norm sums their slices), False for those TP replicates.
    Plain JAX it equals, without compression: `optax.clip_by_global_norm` then `optimizer` on
    the full fp32 parameters with the dp-mean gradient, the replica being the new parameters
    cast to its dtype.
    """
    ranks = axis_size(cfg.axes)
    grad_key, param_key = jax.random.split(key)
    shards = jax.tree.map(
        lambda g, k: _valid(_reduce_scatter(_padded_flat(g, ranks), cfg, k) / ranks, g.size, cfg),
        grads,
        _leaf_keys(grad_key, grads),
    )
    norm = _global_norm(shards, cfg, split, split_axis)
    if cfg.grad_clip is not None:  # optax.clip_by_global_norm's rule, on the global norm
        clip = cfg.grad_clip
        shards = jax.tree.map(lambda s: jnp.where(norm < clip, s, (s / norm) * clip), shards)
    updates, opt_state = optimizer.update(shards, state.opt_state, state.master)
    master = optax.apply_updates(state.master, updates)
    new_replica = jax.tree.map(
        lambda s, r, k: _all_gather(s, r, cfg, k),
        master,
        replica,
        _leaf_keys(param_key, master),
    )
    return ShardState(master, opt_state), new_replica, norm
