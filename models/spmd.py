"""One SPMD program on a device mesh (`jax.shard_map`) or emulated on one device.

`jax.shard_map(f, mesh=..., in_specs=..., out_specs=...)` runs `f` once per device on the
blocks its specs name. `emulated_shard_map` runs the same `f` on one device for a mesh of any
shape: every mesh axis becomes a `jax.vmap` with that axis name, so the lax collectives over it
(psum, pmean, psum_scatter, all_gather, all_to_all, ppermute, axis_index) keep their meaning.
Each input is cut into the blocks its spec names and stacked on leading axes; each output is
put back together from the blocks its spec names, and taken from rank 0 along the mesh axes
its spec leaves out (where `shard_map` with `check_vma=False` assumes every copy is the same).

It lets one GPU study a layout with more ranks than it has devices (the paper's TP 4 x PP 2 x
DP 2, 16 ranks) with each rank's program unchanged. It saves no time (every rank runs, in one
batch). Where vmap differs from devices:
- `lax.cond` on a rank's index runs both branches (a select);
- jax 0.11.2's vmap rules take `lax.ppermute` with a full permutation only, and `all_gather` /
  `psum_scatter` over one axis name at a time (`taco_jax`'s collectives work around both);
- the copies an out spec leaves out are not compared, but inside `replicas_checked()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

_CHECK_REPLICAS = contextvars.ContextVar("check_replicas", default=False)


@contextlib.contextmanager
def replicas_checked(on: bool = True) -> Iterator[None]:
    """Inside it (tests), every output's copies along the mesh axes its spec leaves out must be
    bit-identical (checked on the host after each call), where `shard_map` would keep one
    device's copy unseen. Read while a program is traced."""
    token = _CHECK_REPLICAS.set(on)
    try:
        yield
    finally:
        _CHECK_REPLICAS.reset(token)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _entry_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _dim_axes(spec: P, ndim: int, sizes: Mapping[str, int]) -> list[tuple[str, ...]]:
    """Per array dimension, the mesh axes it is split over (major first)."""
    if len(spec) > ndim:
        raise ValueError(f"spec {spec} names {len(spec)} dimensions of a {ndim}-d array")
    dims = [_entry_axes(entry) for entry in (*spec, *(None,) * (ndim - len(spec)))]
    named = [name for axes in dims for name in axes]
    for name in named:
        if name not in sizes:
            raise ValueError(f"spec {spec} names axis {name!r}, not one of {tuple(sizes)}")
    if len(set(named)) < len(named):
        raise ValueError(f"spec {spec} names a mesh axis twice")
    return dims


def _named(spec: P) -> set[str]:
    return {name for entry in spec for name in _entry_axes(entry)}


def _split(x: jax.Array, spec: P, sizes: Mapping[str, int]) -> jax.Array:
    """x -> its blocks, stacked: [one axis per mesh axis the spec names, in mesh order, *block]."""
    shape, lead = [], {}  # lead: mesh axis -> its position in `shape`
    for d, axes in enumerate(_dim_axes(spec, x.ndim, sizes)):
        ranks = math.prod(sizes[a] for a in axes)
        if x.shape[d] % ranks:
            raise ValueError(
                f"dimension {d} of an array of shape {x.shape} does not split "
                f"into {ranks} blocks over {axes} (spec {spec})"
            )
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
    named = _named(spec)
    if _CHECK_REPLICAS.get() and named != set(names):
        _check_copies(y, [i for i, a in enumerate(names) if a not in named], spec)
    y = y[tuple(slice(None) if a in named else 0 for a in names)]
    kept = [a for a in names if a in named]
    order, shape = [], []
    for d, axes in enumerate(dims):
        order += [kept.index(a) for a in axes] + [len(kept) + d]
        shape.append(math.prod(sizes[a] for a in axes) * y.shape[len(kept) + d])
    return jnp.transpose(y, order).reshape(shape)


def _check_copies(y: jax.Array, axes: list[int], spec: P) -> None:
    """Raises (from the host, after the call) unless `y` is the same along `axes`, bit for bit
    (NaNs included)."""
    bits = jax.random.key_data(y) if jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key) else y
    if jnp.issubdtype(bits.dtype, jnp.floating):
        bits = jax.lax.bitcast_convert_type(bits, jnp.dtype(f"uint{8 * bits.dtype.itemsize}"))
    first = bits[tuple(slice(0, 1) if i in axes else slice(None) for i in range(bits.ndim))]
    same = jnp.all(bits == first)

    def check(same):
        if not same:
            raise AssertionError(
                f"an output of spec {spec} differs between the ranks that its spec leaves out"
            )

    jax.debug.callback(check, same)


def _leaf_specs(specs, tree) -> Any:
    """`specs` (a prefix of `tree`, PartitionSpec leaves) broadcast to every leaf of `tree`."""
    return jax.tree.map(
        lambda s, sub: jax.tree.map(lambda _: s, sub), specs, tree, is_leaf=_is_spec
    )


def emulated_shard_map(f: Callable, *, axis_sizes: Mapping[str, int], in_specs, out_specs):
    """`jax.shard_map(f, mesh=<a mesh of axis_sizes>, in_specs=in_specs, out_specs=out_specs,
    check_vma=False)` on one device: nested `jax.vmap`s, one per mesh axis (the first outermost),
    over the blocks of the inputs.

    axis_sizes: the emulated mesh, axis name -> size, in mesh order. in_specs: a tuple, one
    PartitionSpec prefix per positional argument, or one PartitionSpec for all of them;
    out_specs: a PartitionSpec prefix of f's output. Raises ValueError naming the array when a
    spec does not divide it, or names an axis the mesh lacks or an axis twice.
    """
    sizes = dict(axis_sizes)

    def emulated(*args):
        specs = _leaf_specs(
            in_specs if isinstance(in_specs, tuple) else (in_specs,) * len(args), args
        )
        blocks = jax.tree.map(lambda x, s: _split(x, s, sizes), args, specs, is_leaf=_is_spec)
        run = f
        for name in reversed(sizes):  # the innermost vmap is the last mesh axis
            in_axes = jax.tree.map(
                lambda s, n=name: 0 if n in _named(s) else None, specs, is_leaf=_is_spec
            )
            run = jax.vmap(run, in_axes=in_axes, axis_name=name, axis_size=sizes[name])
        out = run(*blocks)
        return jax.tree.map(
            lambda y, s: _merge(y, s, sizes), out, _leaf_specs(out_specs, out), is_leaf=_is_spec
        )

    return emulated
