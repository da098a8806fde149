"""Compressed collectives over a named axis: all-reduce, reduce-scatter and all-gather.

Each runs inside `jax.shard_map` (one program per device), including a partial one of a GSPMD
program (manual over the collective's axis only: the codec then works on each device's block,
`_local`, docs/gspmd.md), or inside `jax.vmap(..., axis_name=...)` (a TP group emulated on one
device), under `jit`, `grad`, `remat` and `lax.scan`. All of them move uint8 wire buffers (codes
+ scale bytes) and sum in fp32.

The all-reduce is TACO's two-shot scheme (docs/method.md, "Collectives"): split into N chunks,
encode, all-to-all, decode + fp32 sum + re-encode, all-gather, decode; or, on request, the
one-shot scheme: encode the whole message, all-gather the codes, decode and sum all N copies.
Every rank decodes the same bytes in the same order, so the output is bit-identical on every
rank, the reducing rank included.

This module holds the public custom-VJP ops and decides, per traced call, whether to compress
(`taco_jax.policy`, on the `taco_jax.target.Target` probed once there) and what to measure
(`taco_jax.telemetry`). The options are `taco_jax.comm_config`'s, the algorithms on each
device's block `taco_jax.algorithms`', and the workarounds of JAX transforms they need
`taco_jax.jax_workarounds`'.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taco_jax import _local, algorithms, policy, telemetry
from taco_jax import target as platform
from taco_jax.algorithms import (
    AxisName,
    axis_names,
    axis_size,
    exchange_rows,
    varies_along,
    wire_bytes_per_rank,
)
from taco_jax.codecs import DEFAULT_CODEC
from taco_jax.comm_config import (
    ALGORITHMS,
    MAX_SLICES,
    OPTION_NAMES,
    TAHQUANT_CODEC_NAMES,
    CodecLike,
    CommConfig,
    collective_codec,
    comm_config,
    fwd_bwd_configs,
)
from taco_jax.jax_workarounds import axes_bound, axis_sizes, batched_under_vmap, psum_scatter

__all__ = [  # the options and helpers that live beside the ops, imported from here too
    "ALGORITHMS",
    "MAX_SLICES",
    "OPTION_NAMES",
    "TAHQUANT_CODEC_NAMES",
    "AxisName",
    "CodecLike",
    "CommConfig",
    "all_reduce_at",
    "as_varying",
    "axis_size",
    "call_site",
    "cast_varying",
    "collective_codec",
    "comm_config",
    "compressed_all_gather",
    "compressed_psum",
    "compressed_psum_scatter",
    "exchange_rows",
    "fwd_bwd_configs",
    "type_carrier",
    "uses_layer",
    "varies_along",
    "wire_bytes_per_rank",
]


def _check_floating(x: jax.Array, op: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op} compresses floating arrays, got dtype={x.dtype}")


# --------------------------------------------------------------------------------------------
# Types under shard_map's check_vma, for the custom VJPs.


def type_carrier(x: jax.Array) -> jax.Array:
    """An empty slice of x: a custom_vjp residual that carries only x's type (its varying axes
    and sharding), for the backward's casts. Slicing keeps every dimension, so it needs no
    out_sharding on a mesh of `Explicit` axes, where a reshape of a sharded array may."""
    return x[(slice(0, 0),) * x.ndim]


def as_varying(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """x typed as varying along `axis_name` where shard_map tracks it (check_vma=True): each rank
    now holds its own copy. Elsewhere (`check_vma=False`, `vmap`) x itself."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if varies_along(x, axis_name) or not all(name in manual for name in axis_names(axis_name)):
        return x
    return lax.pcast(x, axis_name, to="varying")


def cast_varying(ct: jax.Array, axis_name: AxisName, like: jax.Array) -> jax.Array:
    """Types a cotangent as varying when the primal input `like` was (check_vma=True)."""
    if varies_along(like, axis_name) and not varies_along(ct, axis_name):
        return lax.pcast(ct, axis_name, to="varying")
    return ct


# --------------------------------------------------------------------------------------------
# Whether to compress (`taco_jax.policy`), on the target probed once per traced call, and what
# the result's error is (`taco_jax.telemetry`).


def _measured(compressed, exact, x: jax.Array, cfg: CommConfig, nbytes, **block):
    """(`compressed(x)`, its `taco_jax.telemetry.STATS` against `exact` of x in fp32 where
    `cfg.telemetry`, else None), both collectives on each device's block (`_local`;
    `block`: `on_local_blocks`' keywords); the statistics are sums over the whole array."""
    out = _local.on_local_blocks(compressed, x, **block)
    if not cfg.telemetry:
        return out, None
    reference = _local.on_local_blocks(lambda v: exact(v.astype(jnp.float32)), x, **block)
    return out, telemetry.measure(out, reference, nbytes)


def _plain(out: jax.Array, cfg: CommConfig, nbytes) -> tuple[jax.Array, jax.Array | None]:
    """A collective that ran uncompressed: its output, and its bytes where `cfg.telemetry`."""
    return out, telemetry.unmeasured(nbytes) if cfg.telemetry else None


def _nbytes(x: jax.Array) -> int:
    return x.size * x.dtype.itemsize


def _chosen(op, x, axis_name, cfg, target, n_ranks, fused, scale=1) -> policy.Choice:
    """`taco_jax.policy.choose` for `op` on x (message bytes per rank: x's, times `scale`)."""
    nbytes = _nbytes(x) * scale
    available = fused is not None
    return policy.choose(
        cfg, op, nbytes, n_ranks, target, fused_available=available, axis_name=axis_name
    )


def _all_reduce(x: jax.Array, axis_name: AxisName, cfg: CommConfig):
    """(the all-reduce of x with `cfg`, its statistics or None: `_measured`)."""
    n_ranks = axis_size(axis_name)
    if n_ranks == 1:  # N = 1 moves nothing, so nothing is compressed or measured
        return lax.psum(x, axis_name), None
    nbytes = 2 * (n_ranks - 1) / n_ranks * _nbytes(x)
    target = platform.probe(axis_name, cfg.link)
    fused = algorithms.may_fuse(x, cfg, target, n_ranks)
    choice = _chosen("all_reduce", x, axis_name, cfg, target, n_ranks, fused)
    if not choice.compress:
        return _plain(lax.psum(x, axis_name), cfg, nbytes)
    compressed = functools.partial(
        algorithms.all_reduce,
        axis_name=axis_name,
        cfg=cfg,
        target=target,
        algorithm=choice.algorithm,
        n_ranks=n_ranks,
        fused=fused,
    )
    exact = functools.partial(lax.psum, axis_name=axis_name)
    return _measured(compressed, exact, x, cfg, nbytes, axis_name=axis_name, sums=True)


def _reduce_scatter(x: jax.Array, axis_name: AxisName, dim: int, tiled: bool, cfg: CommConfig):
    """(the reduce-scatter of x with `cfg`, its statistics or None: `_measured`)."""
    n_ranks = axis_size(axis_name)
    if x.ndim == 0 or x.shape[dim] % n_ranks:
        raise ValueError(
            f"scatter_dimension={dim} of shape={x.shape} is not divisible by the "
            f"axis size {n_ranks}"
        )
    if not tiled and x.shape[dim] != n_ranks:
        raise ValueError(f"tiled=False needs shape[{dim}] == axis size {n_ranks}, got {x.shape}")
    if n_ranks == 1:
        return (x if tiled else jnp.squeeze(x, dim)), None
    nbytes = (n_ranks - 1) / n_ranks * _nbytes(x)
    target = platform.probe(axis_name, cfg.link)
    fused = algorithms.may_fuse(x, cfg, target, n_ranks)
    exact = functools.partial(psum_scatter, axis_name=axis_name, dim=dim, tiled=tiled)
    if not _chosen("reduce_scatter", x, axis_name, cfg, target, n_ranks, fused).compress:
        return _plain(exact(x), cfg, nbytes)
    compressed = functools.partial(
        algorithms.reduce_scatter,
        axis_name=axis_name,
        dim=dim,
        tiled=tiled,
        cfg=cfg,
        target=target,
        fused=fused,
        n_ranks=n_ranks,
    )
    change = "keep" if tiled else "drop"
    return _measured(compressed, exact, x, cfg, nbytes, dim=dim, change=change, axis_name=axis_name)


def _all_gather(x: jax.Array, axis_name: AxisName, axis: int, tiled: bool, cfg: CommConfig):
    """(the all-gather of x with `cfg`, its statistics or None: `_measured`)."""
    n_ranks = axis_size(axis_name)
    exact = functools.partial(lax.all_gather, axis_name=axis_name, axis=axis, tiled=tiled)
    if n_ranks == 1:  # N = 1 moves nothing; the lax op then only adds or keeps the gathered axis
        return exact(x), None
    nbytes = (n_ranks - 1) * _nbytes(x)
    target = platform.probe(axis_name, cfg.link)
    fused = algorithms.may_fuse(x, cfg, target, n_ranks)
    # The policy reads the all-gather's output size (the sequence-parallel pair's message).
    if not _chosen("all_gather", x, axis_name, cfg, target, n_ranks, fused, scale=n_ranks).compress:
        return _plain(exact(x), cfg, nbytes)
    compressed = functools.partial(
        algorithms.all_gather,
        axis_name=axis_name,
        axis=axis,
        tiled=tiled,
        cfg=cfg,
        target=target,
        fused=fused,
        n_ranks=n_ranks,
    )
    change = "keep" if tiled else "insert"
    return _measured(
        compressed, exact, x, cfg, nbytes, dim=axis, change=change, axis_name=axis_name
    )


# --------------------------------------------------------------------------------------------
# Call sites: each site's codec (`CommConfig.site_codecs`), per layer.


# A call site's name with a layer, as `taco_jax.telemetry.site_name` writes it.
_LAYERED_SITE = re.compile(r"layer_(\d+)/(.+)")


def _with_codec(cfg: CommConfig, codec) -> CommConfig:
    return dataclasses.replace(cfg, codec=codec, site_codecs=())


def _at_site(collective, x: jax.Array, cfg: CommConfig, site: str, layer, axis_name: AxisName):
    """`collective(x, cfg)` -> (out, statistics or None) with the configuration of call site
    `site` (`<name>/<fwd|bwd>`) of layer `layer` (None, or a traced int32): its codec from
    `cfg.site_codecs`. Where the layer is traced and some layers' codecs differ, a
    `lax.switch` on the layer picks the codec (one branch per codec). The statistics are each
    rank's (`taco_jax.telemetry.per_rank`)."""
    with policy.call_scope():  # ties the traced program to `policy.choose`'s record
        out, stats = _site_collective(collective, x, cfg, site, layer)
    return out, telemetry.per_rank(stats, axis_name)


def _site_collective(collective, x: jax.Array, cfg: CommConfig, site: str, layer):
    table = dict(cfg.site_codecs)
    if layer is None:
        return collective(x, _with_codec(cfg, table.get(site, cfg.codec)))
    by_layer = {
        int(m[1]): codec
        for name, codec in table.items()
        if (m := _LAYERED_SITE.fullmatch(name)) and m[2] == site
    }
    if not by_layer:
        return collective(x, _with_codec(cfg, cfg.codec))
    choices = [cfg.codec] + [c for c in dict.fromkeys(by_layer.values()) if c != cfg.codec]
    branch_of_layer = np.zeros(max(by_layer) + 1, np.int32)
    for index, codec in by_layer.items():
        branch_of_layer[index] = choices.index(codec)
    listed = (layer >= 0) & (layer < branch_of_layer.size)  # layers beyond keep `cfg.codec`
    last = branch_of_layer.size - 1
    branch = jnp.where(listed, jnp.asarray(branch_of_layer)[jnp.clip(layer, 0, last)], 0)
    branches = [functools.partial(collective, cfg=_with_codec(cfg, c)) for c in choices]
    return lax.switch(branch, branches, x)


def uses_layer(cfg: CommConfig, site: str) -> bool:
    """Whether call site `site` of `cfg` needs its layer's value: to report it, or to pick its
    codec (`_at_site`)."""
    layered = (_LAYERED_SITE.fullmatch(name) for name, _ in cfg.site_codecs)
    return cfg.telemetry or any(m is not None and m[2] == site for m in layered)


def all_reduce_at(x: jax.Array, axis_name: AxisName, cfg: CommConfig, site: str, layer=None):
    """(the all-reduce of x at call site `site` of layer `layer`, its statistics or None), for
    operators with their own vjp (`taco_jax.tp`): they report the statistics
    (`taco_jax.telemetry.report`)."""
    return _at_site(lambda v, cfg: _all_reduce(v, axis_name, cfg), x, cfg, site, layer, axis_name)


# --------------------------------------------------------------------------------------------
# Public ops. Each is a custom_vjp whose backward is the compressed conjugate collective. A call
# site reports (`taco_jax.telemetry`) as f"{name}/fwd" and f"{name}/bwd" of its `layer`: None
# or a traced int32, a primal argument because the backward needs its value too (`call_site`).


def call_site(name: str, layer) -> tuple[str, jax.Array | None]:
    """(name, layer) of a call site: an int layer goes into the name (its codec is then chosen
    while tracing), a traced one stays an argument."""
    if layer is None or isinstance(layer, int | np.integer):
        return telemetry.site_name(name, None if layer is None else int(layer)), None
    return name, jnp.asarray(layer, jnp.int32)


def _reported(result, site: str, layer, axis_name: AxisName) -> jax.Array:
    """The output of `result` (out, statistics), its statistics reported under `site`."""
    out, stats = result
    telemetry.report(site, stats, layer=layer, axis_name=axis_name)
    return out


def _residual_layer(layer, stats, bwd_cfg: CommConfig, bwd_site: str):
    """The layer, kept for the backward only where it reports or picks a codec with it (a
    program that needs neither keeps nothing more than before)."""
    return layer if stats is not None or uses_layer(bwd_cfg, bwd_site) else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _psum(x, layer, axis_name, cfg, bwd_cfg, name):
    result = all_reduce_at(x, axis_name, cfg, f"{name}/fwd", layer)
    return _reported(result, f"{name}/fwd", layer, axis_name)


def _psum_fwd(x, layer, axis_name, cfg, bwd_cfg, name):
    # The empty residuals carry only x's sharding type, for the backward's cast, and the axes'
    # sizes (`axes_bound`); the forward's statistics are reported by the backward
    # (`taco_jax.telemetry`: once, where remat runs the forward twice).
    out, stats = all_reduce_at(x, axis_name, cfg, f"{name}/fwd", layer)
    layer = _residual_layer(layer, stats, bwd_cfg, f"{name}/bwd")
    residuals = (type_carrier(x), axis_sizes(axis_name), layer, telemetry.keep(stats))
    return batched_under_vmap(out, axis_name), residuals


def _psum_bwd(axis_name, cfg, bwd_cfg, name, residuals, ct):
    """`lax.psum`'s own transpose, compressed with `bwd_cfg`.

    lax.psum transposes to the identity where shard_map tracks that the output is replicated
    (`check_vma=True`, x typed varying) and to a psum of the cotangent elsewhere (`vmap`,
    `check_vma=False`).
    """
    like, sizes, layer, stats = residuals
    telemetry.report(f"{name}/fwd", stats, layer=layer, axis_name=axis_name)
    if varies_along(like, axis_name):
        return cast_varying(ct, axis_name, like), None
    with axes_bound(axis_name, sizes):
        result = all_reduce_at(ct, axis_name, bwd_cfg, f"{name}/bwd", layer)
        return _reported(result, f"{name}/bwd", layer, axis_name), None


_psum.defvjp(_psum_fwd, _psum_bwd)


def compressed_psum(
    x: jax.Array,
    axis_name: AxisName,
    *,
    codec: CodecLike = DEFAULT_CODEC,
    bwd_codec: CodecLike | None = None,
    name: str = "all_reduce",
    layer: int | jax.Array | None = None,
    **overrides,
) -> jax.Array:
    """All-reduce with compressed traffic: equal to `jax.lax.psum(x, axis_name)` up to FP8 rounding.

    Sharding: `x[...]{U_axis} -> x[...]` (unreduced partial sums in, the replicated sum out,
    bit-identical on every rank). Two-shot quantizes each element twice (docs/method.md,
    "Collectives"), so its error is about sqrt(2) times one codec round trip of the sum's scale;
    one-shot (`algorithm="one_shot"`, or "fused": the same, its exchange done by the encode
    kernel through the peers' memory on NVLink) quantizes each rank's input once.

    Backward: `lax.psum`'s own, so gradients taken inside or outside `shard_map` or
    `vmap(..., axis_name=...)` match it: the identity under `shard_map(check_vma=True)` (the
    output is typed replicated), a compressed psum of the cotangent (`bwd_codec`, default
    `codec`) under `vmap` or `check_vma=False`.
    Megatron's g with an identity backward everywhere is `taco_jax.reduce_from_tp`.

    Where compressing pays depends on the link and the size (BENCHMARKS.md): with the "auto"
    options, on GPUs `taco_jax.policy` runs `lax.psum` itself where the measurements say the
    compressed one is not faster (on 2 NVLink-connected H200s: below 16 MiB; from there the
    fused all-reduce runs).
    Under `check_vma=True`, x must be typed varying along the axis (partial sums are); for a
    replicated x, `lax.psum` returns N x, which this op does not reproduce.

    Args:
      x: floating array, any shape (flattened, padded to N x G x slices, trimmed back).
      axis_name: a bound `shard_map` mesh axis or `vmap` axis name, or a tuple of mesh axes
        (the group is then their product, in mesh order, as for `lax.psum`).
      codec: a name from `taco_jax.CODEC_NAMES`, a `Codec`, or a `CommConfig`. "none" runs
        `lax.psum` itself. TAH-Quant's codecs (`TAHQUANT_CODEC_NAMES`) run too, as a baseline:
        their decode-sums are the stage kernels' decodes summed by XLA, and the stochastic ones
        draw their noise from each message's bits (`tahquant.message_key`).
      bwd_codec: codec of the backward psum (see Backward); None means `codec`.
      name, layer: this call site's name, `<name>/fwd` and `<name>/bwd` in
        `taco_jax.telemetry` (where `telemetry=True`) and in `site_codecs`, behind
        `layer_07/` for layer 7; `layer`: None, an int, or a traced int32 (the index of a
        `lax.scan` over layers).
      **overrides: any `CommConfig` option, applied to both directions: `group_size` (G,
        32..512), `impl` ("auto": Pallas kernels on GPU, else XLA; "xla", "pallas",
        "pallas_interpret"), `algorithm` ("auto", "one_shot", "two_shot", "fused"), `slices` (1..16
        independent pieces), `min_compress_bytes` (smaller messages run `lax.psum`; None:
        `taco_jax.policy`), `link` (what the policy assumes),
        `telemetry` (measure each call site's error), `site_codecs`. Defaults: `CommConfig`'s.
    """
    _check_floating(x, "compressed_psum")
    cfg, bwd_cfg = fwd_bwd_configs(codec, bwd_codec, **overrides)
    name, layer = call_site(name, layer)
    return _psum(x, layer, axis_name, cfg, bwd_cfg, name)


def _transposed_pair(forward, backward):
    """A custom_vjp op `(x, layer, axis_name, dim, tiled, cfg, bwd_cfg, name)` running
    `forward` with `cfg`, whose backward is `backward` of the cotangent with `bwd_cfg`:
    reduce-scatter and all-gather are each other's transpose along the same dimension. Call
    sites as `_psum`'s."""

    def run(collective, x, axis_name, dim, tiled, cfg, site, layer):
        at = lambda v, cfg: collective(v, axis_name, dim, tiled, cfg)  # noqa: E731
        return _at_site(at, x, cfg, site, layer, axis_name)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
    def op(x, layer, axis_name, dim, tiled, cfg, bwd_cfg, name):
        result = run(forward, x, axis_name, dim, tiled, cfg, f"{name}/fwd", layer)
        return _reported(result, f"{name}/fwd", layer, axis_name)

    def op_fwd(x, layer, axis_name, dim, tiled, cfg, bwd_cfg, name):
        out, stats = run(forward, x, axis_name, dim, tiled, cfg, f"{name}/fwd", layer)
        layer = _residual_layer(layer, stats, bwd_cfg, f"{name}/bwd")
        residuals = (type_carrier(x), axis_sizes(axis_name), layer, telemetry.keep(stats))
        return batched_under_vmap(out, axis_name), residuals

    def op_bwd(axis_name, dim, tiled, cfg, bwd_cfg, name, residuals, ct):
        like, sizes, layer, stats = residuals
        telemetry.report(f"{name}/fwd", stats, layer=layer, axis_name=axis_name)
        with axes_bound(axis_name, sizes):
            result = run(backward, ct, axis_name, dim, tiled, bwd_cfg, f"{name}/bwd", layer)
            grad = _reported(result, f"{name}/bwd", layer, axis_name)
        # An x typed replicated (shard_map's check_vma) entered as if pvary'd to each rank,
        # which transposes to the sum of the ranks' cotangents (as lax's collectives do).
        if varies_along(grad, axis_name) and not varies_along(like, axis_name):
            grad = lax.psum(grad, axis_name)
        return grad, None

    op.defvjp(op_fwd, op_bwd)
    return op


_psum_scatter = _transposed_pair(_reduce_scatter, _all_gather)
_all_gather_op = _transposed_pair(_all_gather, _reduce_scatter)


def _normalize_dim(dim: int, ndim: int, name: str) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise ValueError(f"{name}={dim} is out of range for an array of rank {ndim}")
    return dim % max(ndim, 1)


def compressed_psum_scatter(
    x: jax.Array,
    axis_name: AxisName,
    *,
    scatter_dimension: int = 0,
    tiled: bool = True,
    codec: CodecLike = DEFAULT_CODEC,
    bwd_codec: CodecLike | None = None,
    name: str = "reduce_scatter",
    layer: int | jax.Array | None = None,
    **overrides,
) -> jax.Array:
    """Reduce-scatter with compressed traffic: equal to
    `jax.lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=...)` up to FP8 rounding.

    Sharding: `x[S, ...]{U_axis} -> x[S/N, ...]` sharded along `scatter_dimension` (rank r keeps
    block r). One quantization per element: encode, all-to-all, decode, fp32 sum.
    Backward: compressed all-gather of the cotangent with `bwd_codec` (default: `codec`).
    Other arguments as `compressed_psum`.
    """
    _check_floating(x, "compressed_psum_scatter")
    dim = _normalize_dim(scatter_dimension, x.ndim, "scatter_dimension")
    cfg, bwd_cfg = fwd_bwd_configs(codec, bwd_codec, **overrides)
    name, layer = call_site(name, layer)
    return _psum_scatter(x, layer, axis_name, dim, tiled, cfg, bwd_cfg, name)


def compressed_all_gather(
    x: jax.Array,
    axis_name: AxisName,
    *,
    axis: int = 0,
    tiled: bool = False,
    codec: CodecLike = DEFAULT_CODEC,
    bwd_codec: CodecLike | None = None,
    name: str = "all_gather",
    layer: int | jax.Array | None = None,
    **overrides,
) -> jax.Array:
    """All-gather with compressed traffic: equal to
    `jax.lax.all_gather(x, axis_name, axis=..., tiled=...)` up to FP8 rounding.

    Sharding: `x[s, ...]` sharded -> `x[N s, ...]` replicated (tiled) or `x[N, s, ...]`. Every rank,
    the owner included, decodes the same bytes, so the result is identical on every rank.
    Backward: compressed reduce-scatter of the cotangent with `bwd_codec` (default: `codec`).
    Other arguments as `compressed_psum`.
    """
    _check_floating(x, "compressed_all_gather")
    gather_axis = _normalize_dim(axis, x.ndim + (0 if tiled else 1), "axis")
    cfg, bwd_cfg = fwd_bwd_configs(codec, bwd_codec, **overrides)
    name, layer = call_site(name, layer)
    return _all_gather_op(x, layer, axis_name, gather_axis, tiled, cfg, bwd_cfg, name)
