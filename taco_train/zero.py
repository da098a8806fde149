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
apply unchanged). The collectives move buckets of leaves, not single leaves (`_Buckets`: one
reduce-scatter and one all-gather per bucket, `ZeroConfig.bucket_elements`). `update` runs per
rank, inside `shard_map` or `vmap` over the dp axes.

With model parallelism every rank of a (dp, tp) or (dp, pp, tp) mesh holds its slice of each
leaf (a contiguous block along the axis each model axis splits, the whole leaf where it
replicates it): ZeRO shards that slice over dp (`shard_leaves(..., dims, sizes)`), and the
global norm counts every slice once and a replicated leaf once (`update(..., split=...)`).
Uncompressed, its master weights equal the replicated-DP AdamW update of the mean gradient
(tests/taco_train/test_zero.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax

from taco_jax import sdp4bit, telemetry
from taco_jax.algorithms import axis_size

GRAD_CODECS = ("none", "tlq_hs")
PARAM_CODECS = ("none", "qwd")
# The most padded elements (summed over the dp ranks' shards) of one communication bucket, a
# larger leaf having one of its own: Megatron-LM's distributed optimizer's 40 M parameters. On
# one H200 a GPT-350M step with SDP4Bit runs as fast with them as with one collective per leaf
# (docs/decisions/014-zero-buckets.md).
BUCKET_ELEMENTS = 40_000_000


class ShardState(flax.struct.PyTreeNode):
    """One rank's share: master (fp32 shards [S] per leaf), opt_state (the optimizer's state
    over those shards)."""

    master: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """The dp axes (one axis, or (outer, inner) for TLq-HS's two levels), the codec of each
    collective, the global-norm clipping threshold (None: no clipping), the codec kernels
    (`impl`, as `taco_jax.CommConfig.impl`), and `telemetry`: also run each collective
    exactly and report its error (`taco_jax.telemetry`, call sites "dp_grads" and
    "dp_params"), and
    `bucket_elements`, the most padded elements of one communication bucket, a larger leaf
    having one of its own (None: one bucket per kind of leaf; 1: one per leaf; `_Buckets`)."""

    dp_axes: str | tuple[str, ...] = "dp"
    grad_codec: str = "none"
    param_codec: str = "none"
    grad_clip: float | None = None
    impl: str = "auto"
    telemetry: bool = False
    bucket_elements: int | None = BUCKET_ELEMENTS

    def __post_init__(self):
        if self.grad_codec not in GRAD_CODECS:
            raise ValueError(f"grad_codec={self.grad_codec!r}: choose one of {GRAD_CODECS}")
        if self.param_codec not in PARAM_CODECS:
            raise ValueError(f"param_codec={self.param_codec!r}: choose one of {PARAM_CODECS}")
        if self.bucket_elements is not None and self.bucket_elements < 1:
            raise ValueError(
                f"bucket_elements={self.bucket_elements} must be >= 1 (or None: "
                "one bucket per kind of leaf)"
            )

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.dp_axes,) if isinstance(self.dp_axes, str) else tuple(self.dp_axes)


def shard_size(leaf_size: int, ranks: int) -> int:
    """Elements of one rank's shard of a leaf of `leaf_size` elements."""
    return sdp4bit.padded_size(leaf_size, ranks) // ranks


def _padded_flat(x: jax.Array, ranks: int, dtype=jnp.float32) -> jax.Array:
    flat = x.reshape(-1).astype(dtype)
    return jnp.pad(flat, (0, shard_size(flat.shape[0], ranks) * ranks - flat.shape[0]))


REPLICATED = -1  # a `dims` entry: the leaf is whole on every rank of that mesh axis


def axis_slices(x: jax.Array, dim: int, size: int) -> jax.Array:
    """The slices of a full leaf over one mesh axis of `size` ranks, [size, *slice shape]: rank
    r's contiguous block of axis `dim` (as `NamedSharding` places it), or `size` copies of x for
    dim = REPLICATED."""
    if dim == REPLICATED:
        return jnp.broadcast_to(x, (size, *x.shape))
    blocks = x.reshape(*x.shape[:dim], size, x.shape[dim] // size, *x.shape[dim + 1 :])
    return jnp.moveaxis(blocks, dim, 0)


def merge_axis_slices(slices: jax.Array, dim: int) -> jax.Array:
    """Inverse of `axis_slices` (a replicated leaf: the first copy)."""
    if dim == REPLICATED:
        return slices[0]
    blocks = jnp.moveaxis(slices, 0, dim)
    return blocks.reshape(*blocks.shape[:dim], -1, *blocks.shape[dim + 2 :])


def model_slices(x: jax.Array, dims: tuple[int, ...], sizes: tuple[int, ...]) -> jax.Array:
    """`axis_slices` over several mesh axes (e.g. pp, then tp): [*sizes, *slice shape]."""
    if not dims:
        return x
    first = axis_slices(x, dims[0], sizes[0])
    return jax.vmap(lambda v: model_slices(v, dims[1:], sizes[1:]))(first)


def merge_model_slices(slices: jax.Array, dims: tuple[int, ...]) -> jax.Array:
    """Inverse of `model_slices`."""
    if not dims:
        return slices
    inner = jax.vmap(lambda v: merge_model_slices(v, dims[1:]))(slices)
    return merge_axis_slices(inner, dims[0])


def shard_leaves(params: Any, ranks: int, dims: Any = None, sizes: tuple[int, ...] = ()) -> Any:
    """Full parameters -> the master shards of every rank, fp32 per leaf: [ranks, S], or with
    model-parallel slices (`dims`: per leaf one axis per mesh axis of `sizes`, the axis it is
    split along or REPLICATED) [ranks, *sizes, S], the shards of each slice. Outside any
    mapping: place them with the dp (and model) axes on the leading dimensions."""
    if dims is None:
        return jax.tree.map(lambda x: _padded_flat(x, ranks).reshape(ranks, -1), params)

    def shard(x, leaf_dims):
        slices = model_slices(x, leaf_dims, sizes)
        flat = slices.reshape(-1, *slices.shape[len(sizes) :])
        per_slice = jax.vmap(lambda v: _padded_flat(v, ranks).reshape(ranks, -1))(flat)
        return jnp.moveaxis(per_slice.reshape(*sizes, ranks, -1), -2, 0)

    return jax.tree.map(shard, params, dims, is_leaf=lambda d: isinstance(d, tuple))


def unshard_leaves(shards: Any, like: Any, dims: Any = None) -> Any:
    """Inverse of `shard_leaves`: shards -> leaves shaped like `like`."""
    if dims is None:
        return jax.tree.map(
            lambda s, x: s.reshape(-1)[: x.size].reshape(x.shape).astype(x.dtype), shards, like
        )

    def merge(s, x, leaf_dims):
        sizes = s.shape[1:-1]
        local = jax.eval_shape(lambda v: model_slices(v, leaf_dims, sizes), x).shape[len(sizes) :]
        flat = jnp.moveaxis(s, 0, -2).reshape(*sizes, -1)[..., : math.prod(local)]
        return merge_model_slices(flat.reshape(*sizes, *local), leaf_dims).astype(x.dtype)

    return jax.tree.map(merge, shards, like, dims, is_leaf=lambda d: isinstance(d, tuple))


def init(optimizer: optax.GradientTransformation, master: Any) -> ShardState:
    """One rank's state from its master shards (per rank, inside the mapping)."""
    return ShardState(master, optimizer.init(master))


def _reduce_scatter(g: jax.Array, cfg: ZeroConfig, key: jax.Array) -> jax.Array:
    """This rank's shard of the sum over ranks of the flat padded gradient g."""
    if cfg.grad_codec == "tlq_hs":
        return sdp4bit.tlq_hs_psum_scatter(g, cfg.axes, key=key, impl=cfg.impl)
    return sdp4bit.scatter_over(g, cfg.axes)


def _valid(shard: jax.Array, size: int, cfg: ZeroConfig) -> jax.Array:
    """The shard with its padding zeroed: TLq-HS's Hadamard spreads rounding error into the
    padded tail of the last block, and the optimizer must not move padding."""
    index = sdp4bit.rank_index(cfg.axes) * shard.shape[0] + lax.broadcasted_iota(
        jnp.int32, shard.shape, 0
    )
    return jnp.where(index < size, shard, 0.0)


class _Buckets:
    """The leaves grouped into communication buckets: one collective per bucket instead of one
    per leaf (as Megatron-LM's distributed optimizer buckets its gradients). A bucket holds
    leaves in tree order that share the mesh axes their slices differ over (so one key, folded
    with those ranks' indices, serves all of them) and the replica's dtype, up to
    `limit` padded elements (a larger leaf has a bucket of its own).

    A bucket's rows are [ranks, S_1 + S_2 + ...]: row r is rank r's shard of every leaf, side
    by side, so one reduce-scatter of the flattened rows hands each rank exactly its per-leaf
    shards, and one all-gather of its shards side by side gives back the rows. Each S_i is a
    multiple of 2048 (`sdp4bit.padded_size`), so no codec group or Hadamard block of 32
    straddles two leaves: each element is coded as it would be alone, only the noise differs.
    """

    def __init__(self, like: Any, split: Any, ranks: int, limit: int | None):
        leaves, self.treedef = jax.tree.flatten(like)
        self.ranks, self.axes = ranks, _split_axes(split, len(leaves))
        self.shapes = [leaf.shape for leaf in leaves]
        self.shards = [shard_size(leaf.size, ranks) for leaf in leaves]
        self.groups: list[list[int]] = []
        open_groups: dict[tuple, tuple[list[int], int]] = {}  # kind -> (group, its elements)
        for i, leaf in enumerate(leaves):
            kind = (self.axes[i], jnp.dtype(leaf.dtype))
            group, used = open_groups.get(kind, (None, 0))
            size = self.shards[i] * ranks
            if group is None or (limit is not None and used + size > limit):
                group, used = [], 0
                self.groups.append(group)
            group.append(i)
            open_groups[kind] = (group, used + size)

    def check(self, name: str, tree: Any) -> None:
        """Refuses a tree not shaped as the replica's (its leaves would pair up wrongly)."""
        if jax.tree.structure(tree) != self.treedef:
            raise ValueError(
                f"{name} has the tree {jax.tree.structure(tree)}, the replica {self.treedef}"
            )

    def keys(self, key: jax.Array) -> list[jax.Array]:
        """A key per bucket, folded with this rank's index along each mesh axis its leaves'
        slices differ over: the slices of a leaf round independently, while its copies (over
        the other axes) draw alike and so stay identical."""
        keys = list(jax.random.split(key, len(self.groups)))
        return [
            _fold_axis_indices(k, self.axes[group[0]])
            for k, group in zip(keys, self.groups, strict=True)
        ]

    def rows(self, leaves: list[jax.Array], group: list[int], dtype) -> jax.Array:
        """The bucket's flat rows [ranks x sum S_i] of full leaves (zero-padded, cast).

        Several leaves pass an optimization barrier first: in a training step XLA otherwise
        fuses their producers (the biases' gradient reductions) into the concatenation, and on
        an H200 that one fusion took 4.4 ms a step where a copy of its bytes takes ~0.1 ms
        (docs/decisions/014-zero-buckets.md)."""
        parts = [leaves[i] for i in group]
        if len(parts) > 1:
            parts = lax.optimization_barrier(parts)
        parts = [_padded_flat(p, self.ranks, dtype).reshape(self.ranks, -1) for p in parts]
        return jnp.concatenate(parts, axis=1).reshape(-1)

    def split_shard(self, shard: jax.Array, group: list[int]) -> list[jax.Array]:
        """A rank's shard of the bucket -> its shard of each leaf."""
        return jnp.split(shard, self._offsets(group))

    def split_rows(self, flat: jax.Array, group: list[int]) -> list[jax.Array]:
        """The gathered rows [ranks x sum S_i] -> each full leaf."""
        rows = jnp.split(flat.reshape(self.ranks, -1), self._offsets(group), axis=1)
        return [
            r.reshape(-1)[: math.prod(self.shapes[i])].reshape(self.shapes[i])
            for r, i in zip(rows, group, strict=True)
        ]

    def reduce_scatter_bytes(self) -> float:
        """Bytes a rank sends in the plain fp32 reduce-scatters of every bucket (a ring's)."""
        return 4 * sum(self.shards) * (self.ranks - 1)

    def all_gather_bytes(self, replica: list[jax.Array]) -> float:
        """Bytes a rank sends in the plain all-gathers of every bucket (a ring's)."""
        return sum(s * r.dtype.itemsize for s, r in zip(self.shards, replica, strict=True)) * (
            self.ranks - 1
        )

    def _offsets(self, group: list[int]) -> list[int]:
        return list(itertools.accumulate(self.shards[i] for i in group[:-1]))


def _split_axes(split: Any, count: int) -> list[tuple[str, ...]]:
    """`update`'s split as a list, per leaf in tree order (() for every leaf without one)."""
    if split is None:
        return [()] * count
    axes = jax.tree.leaves(split, is_leaf=lambda a: isinstance(a, tuple))
    if len(axes) != count:
        raise ValueError(f"split names {len(axes)} leaves' axes, the replica has {count} leaves")
    return axes


def _fold_axis_indices(key: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    for axis in axes:
        key = jax.random.fold_in(key, lax.axis_index(axis))
    return key


def _mean_shards(grads: list, buckets: _Buckets, cfg: ZeroConfig, key: jax.Array) -> list:
    """Per leaf this rank's shard of the dp-mean gradient, padding zeroed."""
    shards = [None] * len(grads)
    for group, k in zip(buckets.groups, buckets.keys(key), strict=True):
        total = _reduce_scatter(buckets.rows(grads, group, jnp.float32), cfg, k)
        for i, s in zip(group, buckets.split_shard(total / buckets.ranks, group), strict=True):
            shards[i] = _valid(s, math.prod(buckets.shapes[i]), cfg)
    return shards


def _new_replica(master: list, replica: list, buckets: _Buckets, cfg: ZeroConfig, key) -> list:
    """Per leaf the new replica (its shape and dtype) from every rank's new master shards."""
    out = [None] * len(replica)
    for group, k in zip(buckets.groups, buckets.keys(key), strict=True):
        shard = jnp.concatenate([master[i] for i in group])
        dtype = replica[group[0]].dtype
        if cfg.param_codec == "qwd":
            rows = buckets.rows(replica, group, dtype)
            new = sdp4bit.qwd_all_gather(shard, rows, cfg.axes, key=k, impl=cfg.impl)
        else:
            new = sdp4bit.gather_over(shard.astype(dtype), cfg.axes)
        for i, leaf in zip(group, buckets.split_rows(new, group), strict=True):
            out[i] = leaf
    return out


def _global_norm(shards: Any, cfg: ZeroConfig, split: Any):
    """sqrt of the sum of squares of every rank's shards: over the dp axes, and for each leaf
    over the mesh axes `split` names for it (its slices differ between their ranks; over the
    other axes it is the same on every rank, so counted once)."""
    squares = [jnp.sum(jnp.square(s)) for s in jax.tree.leaves(shards)]
    if split is None:
        return jnp.sqrt(lax.psum(sum(squares), cfg.axes))
    groups: dict[tuple, jax.Array] = {}
    for square, axes in zip(squares, _split_axes(split, len(squares)), strict=True):
        groups[axes] = groups.get(axes, 0.0) + square
    return jnp.sqrt(sum(lax.psum(q, (*cfg.axes, *axes)) for axes, q in sorted(groups.items())))


def update(
    optimizer: optax.GradientTransformation,
    cfg: ZeroConfig,
    grads: Any,
    state: ShardState,
    replica: Any,
    key: jax.Array,
    split: Any = None,
) -> tuple[ShardState, Any, jax.Array]:
    """One sharded step on this rank: (new state, new replica, global gradient norm).

    grads: this rank's gradients of its own batch (full leaves, or this rank's model-parallel
    slices of them; not averaged over dp); the step uses their mean over the dp ranks. replica: the
    parameters (or slices) every dp rank holds (any float dtype). key: PRNG key of the
    compressed collectives' stochastic rounding (unused without compression); thread it through
    the training loop. split: with model parallelism (TP, PP), per leaf the tuple of mesh axes
    its slices differ over (the norm sums them; () for a leaf every model rank holds whole).
    Plain JAX it equals, without compression: `optax.clip_by_global_norm` then `optimizer` on
    the full fp32 parameters with the dp-mean gradient, the replica being the new parameters
    cast to its dtype.
    """
    ranks = axis_size(cfg.axes)
    grad_key, param_key = jax.random.split(key)
    buckets = _Buckets(replica, split, ranks, cfg.bucket_elements)
    buckets.check("grads", grads)
    buckets.check("state.master", state.master)
    leaves = jax.tree.leaves
    tree = lambda flat: jax.tree.unflatten(buckets.treedef, flat)  # noqa: E731
    shards = tree(_mean_shards(leaves(grads), buckets, cfg, grad_key))
    if cfg.telemetry:
        plain = dataclasses.replace(cfg, grad_codec="none")
        exact = lambda: _mean_shards(leaves(grads), buckets, plain, grad_key)  # noqa: E731
        _report("dp_grads", cfg.grad_codec, shards, exact, buckets.reduce_scatter_bytes(), cfg)
    norm = _global_norm(shards, cfg, split)
    if cfg.grad_clip is not None:  # optax.clip_by_global_norm's rule, on the global norm
        clip = cfg.grad_clip
        shards = jax.tree.map(lambda s: jnp.where(norm < clip, s, (s / norm) * clip), shards)
    updates, opt_state = optimizer.update(shards, state.opt_state, state.master)
    master = optax.apply_updates(state.master, updates)
    new_replica = tree(_new_replica(leaves(master), leaves(replica), buckets, cfg, param_key))
    if cfg.telemetry:
        plain = dataclasses.replace(cfg, param_codec="none")
        exact = lambda: _new_replica(leaves(master), leaves(replica), buckets, plain, param_key)  # noqa: E731
        nbytes = buckets.all_gather_bytes(leaves(replica))
        _report("dp_params", cfg.param_codec, new_replica, exact, nbytes, cfg)
    return ShardState(master, opt_state), new_replica, norm


def _report(site: str, codec: str, out: Any, exact, nbytes: float, cfg: ZeroConfig) -> None:
    """`taco_jax.telemetry` of call site `site`: `out` against `exact()` (pytrees), or only
    its bytes where `codec` is "none"."""
    if codec == "none":
        stats = telemetry.unmeasured(nbytes)
    else:
        stats = telemetry.measure(
            out, jax.tree.map(lambda x: x.astype(jnp.float32), exact()), nbytes
        )
    telemetry.report(site, telemetry.per_rank(stats, cfg.axes), axis_name=cfg.dp_axes)
