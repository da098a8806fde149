"""Workarounds for JAX transforms and lowerings that lose track of named axes, in one place.

Each names the JAX behaviour it works around (jax 0.11.2 and 0.12); where JAX fixes one, its
function becomes the identity or the plain lax call, and its callers (`taco_jax.collectives`,
`taco_jax.tp`, `taco_jax.algorithms`, `taco_jax.target`) stay as they are. The private JAX
names the library needs are here: `jax._src.core.extend_axis_env_nd` (no public form binds an
axis name) and `jax._src.mesh.get_concrete_mesh` (no public form works inside jit).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as _jax_core  # extend_axis_env_nd: no public form (see axes_bound)

from taco_jax import _local


def _names(axis_name) -> tuple[str, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def axis_sizes(axis_name) -> jax.Array:
    """An empty residual whose shape holds the size of each axis of `axis_name` (static in the
    backward pass, where `axes_bound` may need them)."""
    return jnp.zeros((*(lax.axis_size(a) for a in _names(axis_name)), 0), jnp.int8)


def _is_bound(name: str) -> bool:
    try:
        lax.axis_size(name)
    except NameError:
        return False
    return True


def unbound_here(axis_name) -> bool:
    """Whether a name of `axis_name` is unbound here: a custom_vjp's backward that runs under
    `jax.grad(jax.vmap(...))` without the vmap's axis (`axes_bound`)."""
    return not all(map(_is_bound, _names(axis_name)))


@contextlib.contextmanager
def axes_bound(axis_name, sizes: jax.Array) -> Iterator[None]:
    """Binds again the names of `axis_name` that a custom_vjp's backward runs without.

    Under `jax.grad(jax.vmap(f, axis_name=...))` (the vmap inside the differentiated function),
    JAX runs the backward pass of a custom_vjp in `f` under the vmap's batching trace but
    without its axis name in the axis environment (jax/_src/interpreters/batching.py,
    `batch_custom_vjp_bwd`), so every collective in it would fail with an unbound axis, where
    `lax.psum`, a primitive, is transposed by its own batching rule. With the names bound again,
    at the sizes the forward pass saw (`axis_sizes`), the collectives batch as they do in the
    forward pass. Bound names (shard_map, a vmap outside the grad) are left alone."""
    unbound = [
        (a, n) for a, n in zip(_names(axis_name), sizes.shape, strict=False) if not _is_bound(a)
    ]
    if not unbound:
        yield
        return
    with _jax_core.extend_axis_env_nd(unbound):
        yield


def batched_under_vmap(out: jax.Array, axis_name) -> jax.Array:
    """`out`, batched along `axis_name` where that is a vmap axis (no mesh axis of that name).

    A collective's output can come out of vmap unbatched (one copy for all ranks, as
    `lax.psum`'s does), and a custom_vjp whose output is unbatched gets, under
    `jax.grad(jax.vmap(...))`, the cotangent summed over the ranks once, unbatched, and the
    same for every rank, where its backward expects each rank's own (JAX batches the backward
    as if the op were rank-local, jax/_src/interpreters/batching.py `batch_custom_vjp_bwd`):
    a psum of it would count the sum N times. Batched, each rank's cotangent arrives as its own.
    Adding 0 changes no value; shard_map's outputs (typed replicated under check_vma) are left
    as they are."""
    mesh_axes = jax.sharding.get_abstract_mesh().axis_names
    if any(a in mesh_axes for a in _names(axis_name)):
        return out
    return varying(out, axis_name)


def varying(wire: jax.Array, axis_name) -> jax.Array:
    """`wire`, made to vary along `axis_name`: under vmap, `lax.all_to_all` of an operand that
    does not vary along the axis returns a wrong shape (JAX 0.11.2, docs/method.md "Traps");
    adding 0 * axis_index makes it vary at no cost."""
    return wire + (lax.axis_index(axis_name) * 0).astype(wire.dtype)


def psum_scatter(x: jax.Array, *, axis_name, dim: int, tiled: bool) -> jax.Array:
    """`lax.psum_scatter`; on each device's block where x's type is sharded over an axis left
    to the compiler, where jax 0.11.2 cannot lower it (`_reduce_scatter_lowering` types a
    scalar with x's sharding: "Length of sharding.spec (3) must be equal to aval's ndim (0)")."""
    scatter = functools.partial(
        lax.psum_scatter, axis_name=axis_name, scatter_dimension=dim, tiled=tiled
    )
    if not _local.typed_sharded(x):
        return scatter(x)
    change = "keep" if tiled else "drop"
    return _local.on_local_blocks(scatter, x, dim=dim, change=change, axis_name=axis_name)


def concrete_mesh() -> jax.sharding.Mesh | None:
    """The concrete mesh being traced, where JAX exposes it (None: unknown): only under
    `jax.set_mesh`, through a private function of jax 0.11 (no public one works inside jit)."""
    try:
        from jax._src.mesh import get_concrete_mesh

        mesh = get_concrete_mesh()
    except (ImportError, AttributeError):
        return None
    return None if mesh is None or mesh.empty else mesh
