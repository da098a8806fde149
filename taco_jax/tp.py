"""Megatron's conjugate tensor-parallel operators, with compressed communication.

Megatron-LM (Shoeybi et al. 2019, section 3) places two operators around each pair of
column- and row-parallel layers:
  f = `copy_to_tp`:       identity forward, all-reduce backward   (before column-parallel)
  g = `reduce_from_tp`:   all-reduce forward, identity backward   (after row-parallel)
With sequence parallelism (Korthikanti et al. 2022) they become
  `gather_from_sp`:       all-gather forward, reduce-scatter backward (before column-parallel)
  `scatter_to_sp`:        reduce-scatter forward, all-gather backward (after row-parallel)

`TPComm` holds the forward and backward `CommConfig`s, so activations and activation gradients
can use different codecs (e.g. `taco` forward and `taco_e5m2` or `none` backward). Every
communication point is tagged with `checkpoint_name` so remat policies and profiles can name it,
and each call site may be named (`name=`, `layer=`) for `taco_jax.telemetry` and `site_codecs`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from taco_jax import telemetry
from taco_jax.codecs import DEFAULT_CODEC
from taco_jax.collectives import (
    CodecLike,
    CommConfig,
    all_reduce_at,
    as_varying,
    call_site,
    cast_varying,
    compressed_all_gather,
    compressed_psum,
    compressed_psum_scatter,
    fwd_bwd_configs,
    type_carrier,
    uses_layer,
)
from taco_jax.jax_workarounds import axes_bound, axis_sizes, batched_under_vmap, unbound_here


@dataclasses.dataclass(frozen=True)
class TPComm:
    """The tensor-parallel axis and how each direction of its traffic is compressed."""

    axis_name: str = "tp"
    fwd: CommConfig = dataclasses.field(default_factory=CommConfig)
    bwd: CommConfig = dataclasses.field(default_factory=CommConfig)

    @classmethod
    def create(
        cls,
        axis_name: str = "tp",
        *,
        fwd: CodecLike = DEFAULT_CODEC,
        bwd: CodecLike | None = None,
        **overrides,
    ) -> TPComm:
        """Both directions from codecs (names, `Codec`s or `CommConfig`s); `bwd` defaults to
        `fwd`. `overrides`: `CommConfig` options applied to both, as for `compressed_psum`
        (`telemetry=True` measures each call site's error, `taco_jax.telemetry`;
        `site_codecs` gives named call sites codecs of their own).
        """
        fwd_cfg, bwd_cfg = fwd_bwd_configs(fwd, bwd, **overrides)
        return cls(axis_name, fwd_cfg, bwd_cfg)


# Each operator's call site reports as f"{name}/fwd" or f"{name}/bwd" of its `layer` (None or a
# traced int32; `collectives.compressed_psum` says how).


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _copy(x, layer, comm: TPComm, name: str):
    # Typed varying where shard_map tracks it: otherwise the column-parallel layer's implicit
    # pcast would transpose to an uncompressed psum of the cotangent before this one's.
    return as_varying(x, comm.axis_name)


@jax.custom_batching.custom_vmap
def _batched(x):
    """Whether x is batched along the vmap that maps it (False outside vmap)."""
    return jnp.zeros((), bool)


@_batched.def_vmap
def _batched_rule(axis_size, in_batched, x):
    return jnp.asarray(in_batched[0]), False


def _copy_fwd(x, layer, comm, name):
    # Under vmap (an emulated TP group), whether x is each rank's own or one value shared by
    # all; the innermost vmap's view, which is TP's in an emulated mesh (taco_models.spmd).
    emulated = comm.axis_name not in jax.sharding.get_abstract_mesh().axis_names
    batched = _batched(lax.stop_gradient(x)) if emulated else jnp.ones((), bool)
    out = batched_under_vmap(_copy(x, layer, comm, name), comm.axis_name)  # ranks' own cotangents
    kept = layer if uses_layer(comm.bwd, f"{name}/bwd") else None
    return out, (type_carrier(x), axis_sizes(comm.axis_name), batched, kept)


def _copy_bwd(comm, name, residuals, ct):
    """The compressed all-reduce of the ranks' cotangents: every rank's own copy of x gets the
    sum (shard_map's pvary transposes to psum). Under `jax.grad(jax.vmap(...))` (the axis
    unbound here, `axes_bound`), JAX sums the ranks' cotangents of an x the vmap shares
    (`in_axes=None`), as its broadcast transposes: rank 0 alone returns the sum, the others 0,
    so that x gets the sum once, as a replicated input of `jax.shard_map` does."""
    like, sizes, batched, layer = residuals
    around_vmap = unbound_here(comm.axis_name)
    site = f"{name}/bwd"
    with axes_bound(comm.axis_name, sizes):
        reduced, stats = all_reduce_at(ct, comm.axis_name, comm.bwd, site, layer)
        telemetry.report(site, stats, layer=layer, axis_name=comm.axis_name)
        if around_vmap:
            mine = batched | (lax.axis_index(comm.axis_name) == 0)
            reduced = jnp.where(mine, reduced, jnp.zeros_like(reduced))
    return cast_varying(reduced, comm.axis_name, like), None


_copy.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _reduce(x, layer, comm: TPComm, name: str):
    return compressed_psum(x, comm.axis_name, codec=comm.fwd, name=name, layer=layer)


def _reduce_fwd(x, layer, comm, name):
    if not comm.fwd.telemetry:
        return _reduce(x, layer, comm, name), (type_carrier(x), None, None)
    # The forward's statistics are reported by the backward (`taco_jax.telemetry`).
    out, stats = all_reduce_at(x, comm.axis_name, comm.fwd, f"{name}/fwd", layer)
    return out, (type_carrier(x), layer, telemetry.keep(stats))


def _reduce_bwd(comm, name, residuals, ct):
    like, layer, stats = residuals
    telemetry.report(f"{name}/fwd", stats, layer=layer, axis_name=comm.axis_name)
    return cast_varying(ct, comm.axis_name, like), None


_reduce.defvjp(_reduce_fwd, _reduce_bwd)


def copy_to_tp(x: jax.Array, comm: TPComm, *, name: str = "tp_copy", layer=None) -> jax.Array:
    """Megatron f: identity forward; backward `compressed_psum` of the cotangent (`comm.bwd`).

    Sharding: `x[B, T, D]` replicated -> the same, now feeding a column-parallel layer.
    name, layer: the call site, `<name>/bwd` (`compressed_psum`'s arguments).
    """
    name, layer = call_site(name, layer)
    return checkpoint_name(_copy(x, layer, comm, name), "tp_copy")


def reduce_from_tp(x: jax.Array, comm: TPComm, *, name: str = "tp_reduce", layer=None) -> jax.Array:
    """Megatron g: forward `compressed_psum` (`comm.fwd`), equal to `lax.psum` up to FP8
    rounding; backward identity. Sharding: `x[B, T, D]{U_tp} -> x[B, T, D]`.
    name, layer: the call site, `<name>/fwd` (`compressed_psum`'s arguments).
    """
    name, layer = call_site(name, layer)
    return checkpoint_name(_reduce(x, layer, comm, name), "tp_reduce")


def gather_from_sp(
    x: jax.Array, comm: TPComm, *, axis: int = 1, name: str = "sp_gather", layer=None
) -> jax.Array:
    """Sequence-parallel entry: all-gather forward along `axis`, reduce-scatter backward.

    Equal to `lax.all_gather(x, comm.axis_name, axis=axis, tiled=True)` up to FP8 rounding.
    Sharding: `x[B, T/N, D] -> x[B, T, D]`. name, layer: the call site (`compressed_psum`'s).
    """
    out = compressed_all_gather(
        x,
        comm.axis_name,
        axis=axis,
        tiled=True,
        codec=comm.fwd,
        bwd_codec=comm.bwd,
        name=name,
        layer=layer,
    )
    return checkpoint_name(out, "sp_gather")


def scatter_to_sp(
    x: jax.Array, comm: TPComm, *, axis: int = 1, name: str = "sp_scatter", layer=None
) -> jax.Array:
    """Sequence-parallel exit: reduce-scatter forward along `axis`, all-gather backward.

    Equal to `lax.psum_scatter(x, comm.axis_name, scatter_dimension=axis, tiled=True)` up to FP8
    rounding. Sharding: `x[B, T, D]{U_tp} -> x[B, T/N, D]`. name, layer: the call site.
    """
    out = compressed_psum_scatter(
        x,
        comm.axis_name,
        scatter_dimension=axis,
        tiled=True,
        codec=comm.fwd,
        bwd_codec=comm.bwd,
        name=name,
        layer=layer,
    )
    return checkpoint_name(out, "sp_scatter")
