"""Collectives inside a partial `shard_map`: the codec works on each device's own shard.

A GSPMD program (parameters with shardings, plain `jax.jit`) calls a collective inside
`jax.shard_map(..., axis_names={"tp"})`: manual over the TP axis, the other mesh axes (dp, ...)
left to the compiler. The lax collectives act per device there: each device reduces its own
block with its TP peers, and a block stays where it is along the other axes. A compressed
collective flattens, pads and regroups its message (docs/method.md, "Collectives"), which the
compiler cannot partition along those axes: on an `Explicit` axis the reshape is a type error
("This reshape is not supported"), on an `Auto` axis the compiler gathers the wire across it.

So the compressed path runs in a nested `jax.shard_map` manual over every remaining axis: each
device encodes its own block, exactly the data the lax collective moves for it, and nothing but
the TP traffic crosses devices. The nested map does not check varying types (`check_vma=False`):
with the check on, JAX's partial evaluation (the backward of `lax.scan`, `jax.checkpoint`) gives
a residual of the nested map the spec of every axis its value varies along, the caller's TP axis
included, and the partitioner rejects a nested map naming an axis its parent already holds
("operates on axis ... already bound by a parent sdy.manual_computation";
jax/_src/core.py `nospec`, docs/decisions/021-local-blocks-unchecked.md). Unchecked, a residual
names only the nested map's own axes, and the output is typed here as the lax collective's is.

The block's layout along those axes comes from x's type on `Explicit` axes; `Auto` axes carry
no sharding in the type, so x is split over them along its first dimension they divide (other
than the collective's own dimension): the batch of data-parallel code, where the compiler has
put it anyway. This is a sharding constraint as `jax.lax.with_sharding_constraint` would make;
on other layouts the compiler reshards x first.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

# What a collective does to its dimension `dim` (a static description of the output's layout):
# "keep" (psum, tiled scatter / gather: the dimension stays, its size may change),
# "drop" (untiled psum_scatter removes it), "insert" (untiled all_gather adds one there).
SHAPE_CHANGES = ("keep", "drop", "insert")


def free_axes() -> tuple[str, ...]:
    """Inside a `shard_map`, the context mesh's axes of size > 1 that are not manual (none in a
    `shard_map` manual over every axis, and none outside `shard_map`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:  # outside shard_map (e.g. `vmap` under a set mesh)
        return ()
    return tuple(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind != AxisType.Manual and mesh.shape[name] > 1
    )


def _as_tuple(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def block_spec(x: jax.Array, *, skip_dim: int | None = None) -> tuple:
    """Per dimension of x, the free axes it is split over: `Explicit` axes as x's type says,
    `Auto` ones on the first dimension (not `skip_dim`) whose size they divide (module doc)."""
    mesh = jax.sharding.get_abstract_mesh()
    typed = getattr(jax.typeof(x).sharding, "spec", None) or P()
    spec = [_as_tuple(typed[d]) if d < len(typed) else () for d in range(x.ndim)]
    spec = [tuple(a for a in entry if a in free_axes()) for entry in spec]
    auto = tuple(a for a in free_axes() if mesh._name_to_type[a] == AxisType.Auto)
    if auto:
        for d in range(x.ndim):
            ways = math.prod(mesh.shape[a] for a in spec[d] + auto)
            if d != skip_dim and x.shape[d] % ways == 0:
                spec[d] = spec[d] + auto
                break
    return tuple(entry or None for entry in spec)


def typed_sharded(x: jax.Array) -> bool:
    """Whether x's type splits it over a free axis (one of `Explicit` type)."""
    free = free_axes()
    spec = getattr(jax.typeof(x).sharding, "spec", None) or P()
    return any(axis in free for entry in spec for axis in _as_tuple(entry))


def out_spec(spec: tuple, dim: int | None, change: str) -> P:
    """The output's spec from the input's: the collective's dimension holds no free axis."""
    if change == "drop":
        return P(*(spec[:dim] + spec[dim + 1 :]))
    if change == "insert":
        return P(*(spec[:dim] + (None,) + spec[dim:]))
    return P(*spec)


def _varying(x: jax.Array) -> frozenset[str]:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.11; older releases name it .vma
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _typed(out: jax.Array, varying: frozenset[str]) -> jax.Array:
    """out typed as varying along `varying` (the nested map's output is typed replicated)."""
    missing = tuple(
        a for a in jax.sharding.get_abstract_mesh().axis_names if a in varying - _varying(out)
    )
    return jax.lax.pcast(out, missing, to="varying") if missing else out


def on_local_blocks(
    fn: Callable[..., jax.Array],
    x: jax.Array,
    *replicated,
    dim: int | None = None,
    change: str = "keep",
    axis_name: str | tuple[str, ...] | None = None,
    sums: bool = False,
) -> jax.Array:
    """`fn(x)` run on each device's own block of x (module doc); `fn` itself where no free
    axis is left. `dim`: the dimension the collective scatters or gathers along (never split
    over an `Auto` axis here; on an `Explicit` one the blocks are gathered or scattered
    within each device's block, as the lax collective does); `change`: `SHAPE_CHANGES`;
    `replicated`: further arguments of `fn`, the same on every block.

    The output is typed as the collective `fn` runs over `axis_name` types it under
    shard_map's check_vma: varying along the axes the inputs vary along and along
    `axis_name`, except that a sum (`sums`) of an x varying along `axis_name` is replicated
    over it (as `lax.psum`'s). Without `axis_name`, replicated over the manual axes."""
    axes = free_axes()
    if not axes:
        return fn(x, *replicated)
    spec = block_spec(x, skip_dim=dim)
    out = jax.shard_map(
        fn,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(P(*spec),) + (P(),) * len(replicated),
        out_specs=out_spec(spec, dim, change),
        axis_names=set(axes),
        check_vma=False,  # module doc
    )(x, *replicated)
    if axis_name is None:
        return out
    collective = frozenset(_as_tuple(axis_name))
    varying = _varying(x).union(*map(_varying, replicated))
    summed = sums and collective <= _varying(x)
    return _typed(out, varying - collective if summed else varying | collective)
