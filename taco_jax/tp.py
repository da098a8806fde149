"""Megatron's conjugate tensor-parallel operators, with compressed communication.

Megatron-LM (Shoeybi et al. 2019, section 3) places two operators around each pair of
column- and row-parallel layers:
  f = `copy_to_tp`:       identity forward, all-reduce backward   (before column-parallel)
  g = `reduce_from_tp`:   all-reduce forward, identity backward   (after row-parallel)
`reduce_matmul_from_tp(x, w)` is g of the row-parallel product x @ w, the product encoded in
its matmul's epilogue (`pallas_kernels.matmul_encode`) where the one-shot all-reduce runs;
`copy_matmul_to_tp(x, w)` is the column-parallel product after f, whose backward all-reduces
the input gradient ct @ w^T the same way.
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
    matmul_all_reduce,
    type_carrier,
    uses_layer,
    varies_along,
)


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


def _copy_fwd(x, layer, comm, name):
    kept = layer if uses_layer(comm.bwd, f"{name}/bwd") else None
    return _copy(x, layer, comm, name), (type_carrier(x), kept)


def _copy_bwd(comm, name, residuals, ct):
    like, layer = residuals
    site = f"{name}/bwd"
    reduced, stats = all_reduce_at(ct, comm.axis_name, comm.bwd, site, layer)
    telemetry.report(site, stats, layer=layer, axis_name=comm.axis_name)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _reduce_matmul(x, w, comm: TPComm):
    return matmul_all_reduce(x, w, comm.axis_name, comm.fwd, "tp_reduce/fwd")


def _reduce_matmul_fwd(x, w, comm):
    return _reduce_matmul(x, w, comm), (x, w)


def _reduce_matmul_bwd(comm, residuals, ct):
    # g's identity backward (the cotangent of the replicated sum, on every rank), then the
    # matmul's own: what autodiff of `reduce_from_tp(x @ w)` computes.
    x, w = residuals
    _, matmul_vjp = jax.vjp(jnp.matmul, x, w)  # its unused product: removed by XLA
    varying = x if varies_along(x, comm.axis_name) else w  # the product varies if either does
    return matmul_vjp(cast_varying(ct, comm.axis_name, varying))


_reduce_matmul.defvjp(_reduce_matmul_fwd, _reduce_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _copy_matmul(x, w, comm: TPComm):
    return jnp.matmul(as_varying(x, comm.axis_name), w)


def _copy_matmul_fwd(x, w, comm):
    return _copy_matmul(x, w, comm), (x, w)


def _copy_matmul_bwd(comm, residuals, ct):
    # f's backward of the matmul's input gradient ct @ w^T: its compressed all-reduce, the
    # product encoded by its matmul; the weight's gradient as autodiff takes it.
    x, w = residuals
    dx = matmul_all_reduce(ct, w.T, comm.axis_name, comm.bwd, "tp_copy/bwd")
    _, matmul_vjp = jax.vjp(jnp.matmul, as_varying(x, comm.axis_name), w)
    return cast_varying(dx, comm.axis_name, x).astype(x.dtype), matmul_vjp(ct)[1]


_copy_matmul.defvjp(_copy_matmul_fwd, _copy_matmul_bwd)


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


def _check_product_operands(op: str, x: jax.Array, w: jax.Array) -> None:
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{op} takes x[..., K] and w[K, N], got x.shape={x.shape}, w.shape={w.shape}"
        )


def copy_matmul_to_tp(x: jax.Array, w: jax.Array, comm: TPComm) -> jax.Array:
    """The column-parallel product after Megatron f: `copy_to_tp(x, comm) @ w`, the same forward;
    its backward all-reduces the input gradient ct @ w^T with `comm.bwd` as
    `reduce_matmul_from_tp` does (the product encoded in its matmul where the one-shot
    compressed all-reduce runs; where the matmul and encode run unfused, `copy_to_tp`'s
    all-reduce of that product, its groups in another order).

    Sharding: `x[..., D]` replicated and `w[D, N]` (this rank's columns) -> `[..., N]{V_tp}`.
    """
    _check_product_operands("copy_matmul_to_tp", x, w)
    lead, d = x.shape[:-1], x.shape[-1]
    out = _copy_matmul(checkpoint_name(x.reshape(-1, d), "tp_copy"), w, comm)
    return out.reshape(*lead, w.shape[1])


def reduce_matmul_from_tp(x: jax.Array, w: jax.Array, comm: TPComm) -> jax.Array:
    """Megatron g of the row-parallel product: `reduce_from_tp(x @ w, comm)`, equal to it up to
    the product's rounding, with the product encoded in its matmul's epilogue
    (`pallas_kernels.matmul_encode`, on a Hopper GPU where its kernel takes the call: bf16,
    whole 128 x 128 tiles) where `comm.fwd` takes the one-shot compressed all-reduce
    (`collectives.matmul_all_reduce`); where its matmul and encode run unfused the two are the
    same bits. Backward: the matmul's, of the cotangent on every rank (g's identity).

    Sharding: `x[..., K]{U_tp}` (this rank's slice of the contraction) and `w[K, H]` ->
    `[..., H]` replicated.
    """
    _check_product_operands("reduce_matmul_from_tp", x, w)
    lead, k = x.shape[:-1], x.shape[-1]
    out = _reduce_matmul(x.reshape(-1, k), w, comm)
    return checkpoint_name(out.reshape(*lead, w.shape[1]), "tp_reduce")


def gather_from_sp(
    x: jax.Array, comm: TPComm, *, axis: int = 1, name: str = "sp_gather", layer=None
) -> jax.Array:
    """Sequence-parallel entry: all-gather forward along `axis`, reduce-scatter backward.

    Equal to `lax.all_gather(x, comm.axis_name, axis=axis, tiled=True)` up to FP8 rounding.
    Sharding: `x[B, T/N, D] -> x[B, T, D]`. name, layer: the call site (`compressed_psum`'s).
    """
    out = compressed_all_gather(x, comm.axis_name, axis=axis, tiled=True, codec=comm.fwd,
                                bwd_codec=comm.bwd, name=name, layer=layer)  # fmt: skip
    return checkpoint_name(out, "sp_gather")


def scatter_to_sp(
    x: jax.Array, comm: TPComm, *, axis: int = 1, name: str = "sp_scatter", layer=None
) -> jax.Array:
    """Sequence-parallel exit: reduce-scatter forward along `axis`, all-gather backward.

    Equal to `lax.psum_scatter(x, comm.axis_name, scatter_dimension=axis, tiled=True)` up to FP8
    rounding. Sharding: `x[B, T, D]{U_tp} -> x[B, T/N, D]`. name, layer: the call site.
    """
    out = compressed_psum_scatter(x, comm.axis_name, scatter_dimension=axis, tiled=True,
                                  codec=comm.fwd, bwd_codec=comm.bwd, name=name,
                                  layer=layer)  # fmt: skip
    return checkpoint_name(out, "sp_scatter")
