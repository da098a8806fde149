"""One SPMD program on a device mesh (`jax.shard_map`) or emulated on one device.

`jax.shard_map(f, mesh=..., in_specs=..., out_specs=...)` runs `f` once per device on the
blocks its specs name. `emulated_shard_map` runs the same `f` on one device for a mesh of any
shape: every mesh axis becomes a `jax.vmap` with that axis name, so the lax collectives over it
(psum, pmean, psum_scatter, all_gather, all_to_all, ppermute, axis_index) keep their meaning.
Each input is cut into the blocks its spec names and stacked on leading axes; each output is
put back together from the blocks its spec names, and taken from rank 0 along the mesh axes
its spec leaves out (where `shard_map` with `check_vma=False` assumes every copy is the same).

It lets one GPU study a layout with more ranks than it has devices (the paper's TP 4 x PP 2 x
DP 2, 16 ranks) with each rank's arithmetic unchanged. It saves no time (every rank runs, one
after another in a batch), and `lax.cond` on a rank's index runs both branches under vmap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _dim_axes(spec: P, ndim: int, sizes: Mapping[str, int]) -> list[tuple[str, ...]]:
    """Per array dimension, the mesh axes it is split over (major first)."""
    if len(spec) > ndim:
        raise ValueError(f"spec {spec} names {len(spec)} dimensions of a {ndim}-d array")
    dims = []
    for entry in (*spec, *(None,) * (ndim - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for name in axes:
            if name not in sizes:
                raise ValueError(f"spec {spec} names axis {name!r}, not one of {tuple(sizes)}")
        dims.append(axes)
    return dims


def _split(x: jax.Array, spec: P, sizes: Mapping[str, int]) -> jax.Array:
    """x -> its blocks, stacked: [one axis per mesh axis the spec names, in mesh order, *block]."""
    shape, lead = [], {}  # lead: mesh axis -> its position in `shape`
    for d, axes in enumerate(_dim_axes(spec, x.ndim, sizes)):
        ranks = math.prod(sizes[a] for a in axes)
        if x.shape[d] % ranks:
            raise ValueError(f"dimension {d} of an array of shape {x.shape} does not split "
                             f"into {ranks} blocks over {axes} (spec {spec})")  # fmt: skip
        for a in axes:
            lead[a] = len(shape)
            shape.append(sizes[a])
        shape.append(x.shape[d] // ranks)
    front = [lead[a] for a in sizes if a in lead]
    rest = [i for i in range(len(shape)) if i not in front]
    return jnp.transpose(x.reshape(shape), front + rest)


def _merge(y: jax.Array, spec: P, sizes: Mapping[str, int]) -> jax.Array:
    """Inverse of `_split` for vmap's outputs [every mesh axis in mesh order, *block]: the
    axes the spec leaves out keep rank 0's copy."""
    names = list(sizes)
    dims = _dim_axes(spec, y.ndim - len(names), sizes)
    named = {a for axes in dims for a in axes}
    y = y[tuple(slice(None) if a in named else 0 for a in names)]
    kept = [a for a in names if a in named]
    order, shape = [], []
    for d, axes in enumerate(dims):
        order += [kept.index(a) for a in axes] + [len(kept) + d]
        shape.append(math.prod(sizes[a] for a in axes) * y.shape[len(kept) + d])
    return jnp.transpose(y, order).reshape(shape)


def _leaf_specs(specs, tree) -> Any:
    """`specs` (a prefix of `tree`, PartitionSpec leaves) broadcast to every leaf of `tree`."""
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), specs, tree,
                        is_leaf=_is_spec)  # fmt: skip


def emulated_shard_map(f: Callable, *, axis_sizes: Mapping[str, int], in_specs, out_specs):
    """`jax.shard_map(f, mesh=<a mesh of axis_sizes>, in_specs=in_specs, out_specs=out_specs,
    check_vma=False)` on one device: nested `jax.vmap`s, one per mesh axis (the first outermost),
    over the blocks of the inputs.

    axis_sizes: the emulated mesh, axis name -> size, in mesh order. in_specs: a tuple, one
    PartitionSpec prefix per positional argument; out_specs: a PartitionSpec prefix of f's
    output. Raises ValueError naming the array when a spec does not divide it.
    """
    sizes = dict(axis_sizes)

    def emulated(*args):
        specs = _leaf_specs(tuple(in_specs), args)
        blocks = jax.tree.map(lambda x, s: _split(x, s, sizes), args, specs, is_leaf=_is_spec)
        run = f
        for name in reversed(sizes):  # the innermost vmap is the last mesh axis
            in_axes = jax.tree.map(lambda s, n=name: 0 if n in _named(s) else None, specs,
                                   is_leaf=_is_spec)  # fmt: skip
            run = jax.vmap(run, in_axes=in_axes, axis_name=name, axis_size=sizes[name])
        out = run(*blocks)
        return jax.tree.map(lambda y, s: _merge(y, s, sizes), out, _leaf_specs(out_specs, out),
                            is_leaf=_is_spec)  # fmt: skip

    return emulated


def _named(spec: P) -> set[str]:
    return {a for entry in spec if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)}  # fmt: skip


def shard_map(f: Callable, *, mesh, in_specs, out_specs,
              emulate: Mapping[str, int] | None = None):  # fmt: skip
    """`jax.shard_map(f, ..., check_vma=False)` over `mesh`, or with `emulate` (the mesh to
    emulate, axis name -> size) `emulated_shard_map` on one device."""
    if emulate is None:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)  # fmt: skip
    return emulated_shard_map(f, axis_sizes=emulate, in_specs=in_specs, out_specs=out_specs)
