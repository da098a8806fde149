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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core as _jax_core  # extend_axis_env_nd: no public form (see _axes_bound)

from taco_jax import _backends, _local, codecs, policy, tahquant, telemetry
from taco_jax.codecs import Codec

MAX_SLICES = 16
# How an all-reduce moves its codes (docs/method.md, "Collectives"). "one_shot": every rank
# encodes its whole message once, all-gathers the codes and sums all N decoded copies (one
# collective, one quantization; each rank sends (N - 1) x the wire). "two_shot": reduce-scatter
# of codes, re-encode of the sum, all-gather (two quantizations; each rank sends 2 (N - 1) / N x
# the wire). "auto": `taco_jax.policy` chooses.
# "fused": one-shot, with the exchange done by the encode kernel itself, which stores the codes
# straight into every peer's memory (`pallas_kernels.exchange_mosaic`; Hopper GPUs on NVLink
# under shard_map, codec `taco`, bf16); the same arithmetic as "one_shot" (the same codes from
# 24 MiB, where one-shot's encode is the same Mosaic kernel; below, Triton's codes may differ at
# rounding ties), which runs wherever the fused kernel cannot (`policy.choose`).
ALGORITHMS = ("auto", "one_shot", "two_shot", "fused")


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """How one direction of a collective communicates. Static and hashable.

    The defaults of every collective option live here; the public ops and `taco_jax.TPComm`
    take a codec (name, `Codec` or `CommConfig`) plus keyword overrides of these fields.

    codec: the codec, a `Codec` or a `TahQuant` (`collective_codec`;
      `codec.is_identity` means the plain lax collective).
    impl: "auto" | "xla" | "pallas" | "pallas_interpret"; which codec kernels run.
    algorithm: "auto" | "one_shot" | "two_shot" | "fused"; how an all-reduce moves its codes
      (`ALGORITHMS`; "auto": `taco_jax.policy`). Reduce-scatter and all-gather have one each,
      whose exchange runs in the fused kernel where it can under "auto" and "fused", and
      through NCCL under the other two.
    slices: split the message into this many independent pieces (1..16) so that the encode of
      piece i+1 can overlap the transfer of piece i; where the kernels run, at least as many as
      keep each kernel buffer under 2^31 bytes (their offsets are 32-bit). Slices do not change
      a result.
    min_compress_bytes: messages smaller than this use the plain lax collective (0: compress
      every message); None: `taco_jax.policy` decides from measurements on GPU links (and
      compresses every message where no bytes move: the CPU, `vmap` emulation).
    link: "auto" | "nvlink" | "shm" | "socket"; the link the policy assumes ("auto": from the
      machine, the TP group's hosts and NVML, `taco_jax.policy.explain_link`).
    telemetry: measure: also run the exact collective in fp32 and report each call site's error
      to `taco_jax.telemetry` (a program built without it is unchanged).
    site_codecs: codecs of named call sites that differ from `codec` (`taco_jax.telemetry`'s
      site names, e.g. {"layer_03/mlp_out/fwd": "none"}, as an error budget's fallbacks set
      them); given as a mapping, kept as sorted (site, codec) pairs.
    """

    codec: Codec | tahquant.TahQuant = dataclasses.field(default_factory=codecs.get_codec)
    _: dataclasses.KW_ONLY  # options by name only: adding one never shifts another
    impl: str = "auto"
    algorithm: str = "auto"
    slices: int = 1
    min_compress_bytes: int | None = None
    link: str = "auto"
    telemetry: bool = False
    site_codecs: tuple[tuple[str, Codec | tahquant.TahQuant], ...] = ()

    def __post_init__(self):
        if isinstance(self.site_codecs, Mapping):  # frozen: set once, here
            pairs = tuple(
                sorted((site, collective_codec(codec)) for site, codec in self.site_codecs.items())
            )
            object.__setattr__(self, "site_codecs", pairs)
        if self.impl not in _backends.IMPLS:
            raise ValueError(f"unknown impl={self.impl!r}; choose one of {_backends.IMPLS}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm={self.algorithm!r}; choose one of {ALGORITHMS}")
        if not 1 <= self.slices <= MAX_SLICES:
            raise ValueError(f"slices={self.slices} must be in [1, {MAX_SLICES}]")
        if self.min_compress_bytes is not None and self.min_compress_bytes < 0:
            raise ValueError(f"min_compress_bytes={self.min_compress_bytes} must be >= 0 or None")
        if self.link not in policy.LINKS:
            raise ValueError(f"unknown link={self.link!r}; choose one of {policy.LINKS}")

    def choice(
        self, op: str, x: jax.Array, axis_name, n_ranks: int, *, scale: int = 1, fused=False
    ):
        """`taco_jax.policy.choose` for `op` on x (message bytes per rank: x's, times `scale`);
        `fused`: whether the fused all-reduce kernel can run here."""
        nbytes = x.size * x.dtype.itemsize * scale
        return policy.choose(self, op, nbytes, axis_name, n_ranks, fused_available=fused)


CodecLike = str | Codec | tahquant.TahQuant | CommConfig
# Keyword overrides the collectives accept: the CommConfig fields, and the codec's group size.
OPTION_NAMES = ("group_size",) + tuple(
    f.name for f in dataclasses.fields(CommConfig) if f.name != "codec"
)


def comm_config(codec: CodecLike = codecs.DEFAULT_CODEC, **overrides) -> CommConfig:
    """A `CommConfig` from a codec name, a `Codec` or a `CommConfig`, with keyword overrides of
    its fields (`impl`, `algorithm`, `slices`, `min_compress_bytes`, `link`, `telemetry`,
    `site_codecs`) and of `group_size`.

    comm_config("taco", slices=4) == CommConfig(get_codec("taco"), slices=4).
    """
    unknown = sorted(set(overrides) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown collective option(s) {unknown}; valid: {list(OPTION_NAMES)}")
    group_size = overrides.pop("group_size", None)
    if isinstance(codec, CommConfig):
        cfg = dataclasses.replace(codec, codec=collective_codec(codec.codec, group_size))
    else:
        cfg = CommConfig(collective_codec(codec, group_size))
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


# TAH-Quant codecs the collectives take (the TACO paper's "TAH-Quant on TP" baseline): the
# stochastic ones draw their noise from `tahquant.message_key` (the collectives take no key).
TAHQUANT_CODEC_NAMES = tahquant.STAGE_CODEC_NAMES + tahquant.NEAREST_CODEC_NAMES


def collective_codec(
    codec: str | Codec | tahquant.TahQuant, group_size: int | None = None
) -> Codec | tahquant.TahQuant:
    """The codec a collective runs: a TP codec (`codecs.get_codec`: a name of `CODEC_NAMES` or
    a `Codec`, group_size overriding its G), or a TAH-Quant codec (a name of
    `TAHQUANT_CODEC_NAMES` or a `TahQuant`; its G is part of it, so group_size may only repeat
    it). A stochastic TAH-Quant codec draws its noise from each encoded message's own bits
    (`tahquant.message_key`)."""
    if isinstance(codec, str) and codec not in codecs.CODEC_NAMES + TAHQUANT_CODEC_NAMES:
        raise ValueError(
            f"unknown codec {codec!r}; choose one of {codecs.CODEC_NAMES + TAHQUANT_CODEC_NAMES}"
        )
    if not isinstance(codec, tahquant.TahQuant) and codec not in TAHQUANT_CODEC_NAMES:
        return codecs.get_codec(codec, group_size)
    stage = tahquant.get_stage_codec(codec)
    if group_size not in (None, stage.group_size):
        raise ValueError(
            f"{group_size=} differs from codec {stage.name!r}'s own group_size={stage.group_size}"
        )
    return stage


def fwd_bwd_configs(
    codec: CodecLike, bwd_codec: CodecLike | None, **overrides
) -> tuple[CommConfig, CommConfig]:
    """The forward and backward `CommConfig`s; the backward defaults to the forward one."""
    cfg = comm_config(codec, **overrides)
    return cfg, cfg if bwd_codec is None else comm_config(bwd_codec, **overrides)


AxisName = str | tuple[str, ...]


def axis_size(axis_name: AxisName) -> int:
    """Size of a bound axis (or the product over a tuple of axes); a clear error otherwise."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(name, str) for name in names):
        raise TypeError(f"axis_name={axis_name!r} must be an axis name or a tuple of them")
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound: call inside jax.shard_map over a "
            "mesh with that axis, or inside jax.vmap(..., axis_name=...); under "
            "jax.grad(jax.jit(jax.vmap(...))) JAX runs the op's custom_vjp rules without the "
            "vmap's axis: differentiate the vmap itself, with no jit between the grad and it "
            "(jax.jit(jax.grad(...)) around it; docs/method.md, 'Traps')"
        ) from None


def _axis_names(axis_name: AxisName) -> tuple[str, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _axis_sizes(axis_name: AxisName) -> jax.Array:
    """An empty residual whose shape holds the size of each axis of `axis_name` (static in the
    backward pass, where `_axes_bound` may need them)."""
    return jnp.zeros((*(lax.axis_size(a) for a in _axis_names(axis_name)), 0), jnp.int8)


def _is_bound(name: str) -> bool:
    try:
        lax.axis_size(name)
    except NameError:
        return False
    return True


@contextlib.contextmanager
def _axes_bound(axis_name: AxisName, sizes: jax.Array) -> Iterator[None]:
    """Binds again the names of `axis_name` that a custom_vjp's backward runs without.

    Under `jax.grad(jax.vmap(f, axis_name=...))` (the vmap inside the differentiated function),
    JAX runs the backward pass of a custom_vjp in `f` under the vmap's batching trace but
    without its axis name in the axis environment (jax/_src/interpreters/batching.py,
    `batch_custom_vjp_bwd`), so every collective in it would fail with an unbound axis, where
    `lax.psum`, a primitive, is transposed by its own batching rule. With the names bound again,
    at the sizes the forward pass saw (`_axis_sizes`), the collectives batch as they do in the
    forward pass. Bound names (shard_map, a vmap outside the grad) are left alone."""
    unbound = [
        (a, n)
        for a, n in zip(_axis_names(axis_name), sizes.shape, strict=False)
        if not _is_bound(a)
    ]
    if not unbound:
        yield
        return
    with _jax_core.extend_axis_env_nd(unbound):
        yield


def _batched_under_vmap(out: jax.Array, axis_name: AxisName) -> jax.Array:
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
    if any(a in mesh_axes for a in _axis_names(axis_name)):
        return out
    return _varying(out, axis_name)


def _check_floating(x: jax.Array, op: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{op} compresses floating arrays, got dtype={x.dtype}")


# --------------------------------------------------------------------------------------------
# Building blocks on flat rows. `rows[j]` is the chunk destined for rank j.


def _varying(wire: jax.Array, axis_name: AxisName) -> jax.Array:
    # Under vmap, all_to_all of an operand that does not vary along the axis returns a wrong
    # shape (JAX 0.11.2, docs/method.md "Traps"); adding 0 * axis_index makes it vary at no cost.
    return wire + (lax.axis_index(axis_name) * 0).astype(wire.dtype)


def exchange_rows(wire: jax.Array, axis_name: AxisName) -> jax.Array:
    """all_to_all of [N, B] wire rows: afterwards row j is what rank j sent to this rank."""
    return lax.all_to_all(_varying(wire, axis_name), axis_name, 0, 0, tiled=True)


def _reduce_scatter_rows(
    rows: jax.Array, axis_name: AxisName, cfg: CommConfig, *, reencode: bool, dtype=jnp.float32
) -> jax.Array:
    """rows [N, n] (n multiple of G) -> this rank's sum [n] (summed in fp32, stored as `dtype`),
    or its re-encoded wire [B]."""
    ops = _backends.codec_ops(cfg.impl, cfg.codec)
    n = rows.shape[-1]
    received = exchange_rows(ops.encode(cfg.codec, rows), axis_name)
    if reencode:
        return ops.decode_sum_reencode(cfg.codec, received, n)
    return ops.decode_sum(cfg.codec, received, n, dtype)


def _all_gather_wire(wire: jax.Array, axis_name: AxisName, *, invariant: bool) -> jax.Array:
    """wire [B] of this rank -> [N, B], row r from rank r.

    `invariant` types the result as replicated (shard_map's check_vma), as `lax.psum`'s is.
    """
    to = "invarying" if invariant else "varying"
    return lax.all_gather(wire, axis_name, axis=0, tiled=False, to=to)


def _gather_wire(
    wire: jax.Array, n: int, axis_name: AxisName, cfg: CommConfig, dtype, *, invariant: bool = False
) -> jax.Array:
    """wire [B] of this rank's chunk -> every rank's decoded chunk [N, n]."""
    gathered = _all_gather_wire(wire, axis_name, invariant=invariant)
    return _backends.codec_ops(cfg.impl, cfg.codec).decode(cfg.codec, gathered, n, dtype)


def varies_along(x: jax.Array, axis_name: AxisName) -> bool:
    """Whether `x` is typed as varying along `axis_name` (only under shard_map's check_vma)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.11; older releases name it .vma
    varying = manual.varying if manual is not None else getattr(aval, "vma", frozenset())
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    return all(name in varying for name in names)


def type_carrier(x: jax.Array) -> jax.Array:
    """An empty slice of x: a custom_vjp residual that carries only x's type (its varying axes
    and sharding), for the backward's casts. Slicing keeps every dimension, so it needs no
    out_sharding on a mesh of `Explicit` axes, where a reshape of a sharded array may."""
    return x[(slice(0, 0),) * x.ndim]


def as_varying(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """x typed as varying along `axis_name` where shard_map tracks it (check_vma=True): each rank
    now holds its own copy. Elsewhere (`check_vma=False`, `vmap`) x itself."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if varies_along(x, axis_name) or not all(name in manual for name in names):
        return x
    return lax.pcast(x, axis_name, to="varying")


def cast_varying(ct: jax.Array, axis_name: AxisName, like: jax.Array) -> jax.Array:
    """Types a cotangent as varying when the primal input `like` was (check_vma=True)."""
    if varies_along(like, axis_name) and not varies_along(ct, axis_name):
        return lax.pcast(ct, axis_name, to="varying")
    return ct


def _sliced(fn, rows: jax.Array, slices: int) -> jax.Array:
    """Applies `fn` to `slices` independent column blocks of rows [..., n]; concatenates results.

    The pieces share no data, so XLA may overlap the encode of one with the transfer of another.
    """
    if slices == 1:
        return fn(rows)
    pieces = jnp.split(rows, slices, axis=-1)
    return jnp.concatenate([fn(piece) for piece in pieces], axis=-1)


def _fused_exchange(kind: str, piece, axis_name: AxisName, cfg: CommConfig):
    """The fused encode + exchange (`_backends.fused_exchange`: "all_gather" or "all_to_all")
    for rows `piece` (may be a ShapeDtypeStruct), or None where it cannot run: the codec kernels
    are not compiled ones, the axis is not one shard_map axis of Hopper GPUs on NVLink
    (`policy.peer_writes`), or the kernel does not take the codec, dtype or shape."""
    if not policy.peer_writes(cfg, axis_name):
        return None
    return _backends.fused_exchange(kind, cfg.impl, cfg.codec, piece, axis_name)


def _fused_runs(x: jax.Array, axis_name: AxisName, cfg: CommConfig) -> bool:
    """Whether the fused kernels would run on x's dtype (padded rows always fit their shape)."""
    row = jax.ShapeDtypeStruct((1, _backends.FUSED_ROW_MULTIPLE), x.dtype)
    return _fused_exchange("all_gather", row, axis_name, cfg) is not None


def _exchange_fused(x: jax.Array, axis_name: AxisName, cfg: CommConfig, n_ranks: int) -> bool:
    """Whether a collective may exchange through the fused kernels (the all-reduce: whether the
    policy may pick "fused"): they run here (`_fused_runs`), and `algorithm` is "fused", or "auto"
    where a table measured them for this group size (`policy.fused_in_auto`: N = 2, or this
    machine's tuned table). One- and two-shot keep NCCL."""
    if cfg.algorithm == "fused":
        return _fused_runs(x, axis_name, cfg)
    return (
        cfg.algorithm == "auto"
        and _fused_runs(x, axis_name, cfg)
        and policy.fused_in_auto(n_ranks, "nvlink", cfg.codec)
    )


def _row_multiple(cfg: CommConfig, fused: bool) -> int:
    """What each row of a collective is padded to: per slice, whole rows of the kernels that run
    (`_backends.kernel_row_multiple`: whole groups, or whole Mosaic GPU rows), and for the fused
    kernels whole `_backends.FUSED_ROW_MULTIPLE`s."""
    multiple = _backends.kernel_row_multiple(cfg.impl, cfg.codec) * cfg.slices
    return math.lcm(multiple, _backends.FUSED_ROW_MULTIPLE * cfg.slices) if fused else multiple


def _rows_for(
    flat: jax.Array, rows: int, cfg: CommConfig, *, fused: bool = False
) -> tuple[jax.Array, int]:
    """Pads flat [M] so that each of `rows` rows is a multiple of G x slices (and, `fused`, of
    the fused kernel's row multiple x slices); returns [rows, m]. Padding adds whole zero groups
    after the message, so the message's own groups and codes do not depend on it."""
    multiple = _row_multiple(cfg, fused)
    padded, size = codecs.pad_to_multiple(flat, rows * multiple)
    return padded.reshape(rows, -1), size


def _addressable(
    cfg: CommConfig, x: jax.Array, n_ranks: int, *, rows: int, gathers: bool = False
) -> CommConfig:
    """`cfg` with at least as many slices as keep every buffer of one slice's kernel calls
    within the kernels' 32-bit offsets (`_backends.max_buffer_bytes`).

    The message, x's elements, is laid out as `rows` rows (1: one-shot, fused and all-gather;
    N: two-shot and reduce-scatter, a row per rank), each padded per slice. A slice's largest
    buffers are then its rows of values (N times that for an all-gather's output: `gathers`),
    N wire rows of one row's elements (gathered, or one from each rank) and, for a TAH-Quant
    codec, one row decoded to fp32. The padding is
    taken at its largest (the fused kernels'), so this over-approximates a little. Slices do not
    change a value: each encodes whole groups.
    Raises ValueError, naming the size, where MAX_SLICES are not enough."""
    limit = _backends.max_buffer_bytes(cfg.impl)
    if limit is None:
        return cfg
    # The largest padding any row takes: the fused kernels', a multiple of the Mosaic rows'.
    padding = math.lcm(
        cfg.codec.group_size,
        _backends.FUSED_ROW_MULTIPLE,
        _backends.kernel_row_multiple(cfg.impl, cfg.codec),
    )
    itemsize = jnp.dtype(x.dtype).itemsize
    for slices in range(cfg.slices, MAX_SLICES + 1):
        row = math.ceil(x.size / rows / slices / padding) * padding  # a slice's row, padded
        values = (n_ranks if gathers else 1) * rows * row * itemsize
        # TAH-Quant's decode-sum (no fused kernel) decodes each row to fp32 first.
        decoded = 0 if isinstance(cfg.codec, Codec) else 4 * row
        if max(values, decoded, n_ranks * cfg.codec.wire_bytes(row)) <= limit:
            return cfg if slices == cfg.slices else dataclasses.replace(cfg, slices=slices)
    raise ValueError(
        f"a message of {x.size} elements per rank over {n_ranks} ranks does not fit the "
        f"kernels' {limit}-byte buffers in {MAX_SLICES} slices; split it into smaller calls"
    )


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


def _all_reduce(x: jax.Array, axis_name: AxisName, cfg: CommConfig):
    """(the all-reduce of x with `cfg`, its statistics or None: `_measured`)."""
    n_ranks = axis_size(axis_name)
    if n_ranks == 1:  # N = 1 moves nothing, so nothing is compressed or measured
        return lax.psum(x, axis_name), None
    nbytes = 2 * (n_ranks - 1) / n_ranks * _nbytes(x)
    may_fuse = _exchange_fused(x, axis_name, cfg, n_ranks)
    choice = cfg.choice("all_reduce", x, axis_name, n_ranks, fused=may_fuse)
    if not choice.compress:
        return _plain(lax.psum(x, axis_name), cfg, nbytes)
    compressed = functools.partial(
        _compressed_all_reduce,
        axis_name=axis_name,
        cfg=cfg,
        algorithm=choice.algorithm,
        n_ranks=n_ranks,
    )
    exact = functools.partial(lax.psum, axis_name=axis_name)
    return _measured(compressed, exact, x, cfg, nbytes, axis_name=axis_name, sums=True)


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


def _compressed_all_reduce(
    x: jax.Array, *, axis_name: AxisName, cfg: CommConfig, algorithm: str, n_ranks: int
) -> jax.Array:
    """The compressed all-reduce of this device's x with `algorithm` (one-shot, two-shot or
    fused)."""
    invariant = varies_along(x, axis_name)
    fused = algorithm == "fused"
    one_row = algorithm in ("one_shot", "fused")  # else two-shot: a row per rank
    rows_of = 1 if one_row else n_ranks
    cfg = _addressable(cfg, x, n_ranks, rows=rows_of)
    ops = _backends.codec_ops(cfg.impl, cfg.codec)

    def two_shot(piece):  # piece: [N, m / slices], row j for rank j
        n = piece.shape[-1]
        reduced_wire = _reduce_scatter_rows(piece, axis_name, cfg, reencode=True)
        return _gather_wire(reduced_wire, n, axis_name, cfg, x.dtype, invariant=invariant)

    def one_shot(piece):  # piece: [1, m / slices], this rank's whole message
        exchange = fused and _fused_exchange("all_gather", piece, axis_name, cfg)
        if exchange:
            gathered = exchange(piece, replicated=invariant)[:, 0]
        else:
            wire = ops.encode(cfg.codec, piece)[0]
            gathered = _all_gather_wire(wire, axis_name, invariant=invariant)
        # Every rank sums the same N rows in rank order: bit-identical outputs.
        return ops.decode_sum(cfg.codec, gathered, piece.shape[-1], x.dtype)[None]

    rows, size = _rows_for(x.reshape(-1), rows_of, cfg, fused=fused)
    out = _sliced(one_shot if one_row else two_shot, rows, cfg.slices)
    return out.reshape(-1)[:size].reshape(x.shape)


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
    fused = _exchange_fused(x, axis_name, cfg, n_ranks)
    exact = functools.partial(_lax_psum_scatter, axis_name=axis_name, dim=dim, tiled=tiled)
    if not cfg.choice("reduce_scatter", x, axis_name, n_ranks, fused=fused).compress:
        return _plain(exact(x), cfg, nbytes)
    compressed = functools.partial(
        _compressed_reduce_scatter,
        axis_name=axis_name,
        dim=dim,
        tiled=tiled,
        cfg=cfg,
        fused=fused,
        n_ranks=n_ranks,
    )
    change = "keep" if tiled else "drop"
    return _measured(compressed, exact, x, cfg, nbytes, dim=dim, change=change, axis_name=axis_name)


def _lax_psum_scatter(x: jax.Array, *, axis_name: AxisName, dim: int, tiled: bool) -> jax.Array:
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


def _compressed_reduce_scatter(
    x: jax.Array,
    *,
    axis_name: AxisName,
    dim: int,
    tiled: bool,
    cfg: CommConfig,
    fused: bool,
    n_ranks: int,
) -> jax.Array:
    """The compressed reduce-scatter of this device's x: encode, all-to-all, decode-sum."""
    cfg = _addressable(cfg, x, n_ranks, rows=n_ranks)
    moved = jnp.moveaxis(x, dim, 0)
    block_shape = (moved.shape[0] // n_ranks,) + moved.shape[1:]
    multiple = _row_multiple(cfg, fused)
    rows, size = codecs.pad_to_multiple(moved.reshape(n_ranks, -1), multiple)

    def reduce_scatter(piece):  # piece: [N, m / slices], row j for rank j
        exchange = fused and _fused_exchange("all_to_all", piece, axis_name, cfg)
        if not exchange:
            return _reduce_scatter_rows(piece, axis_name, cfg, reencode=False, dtype=x.dtype)
        ops = _backends.codec_ops(cfg.impl, cfg.codec)
        return ops.decode_sum(cfg.codec, exchange(piece), piece.shape[-1], x.dtype)

    block = _sliced(reduce_scatter, rows, cfg.slices)[:size].reshape(block_shape)
    return jnp.moveaxis(block, 0, dim) if tiled else block[0]


def _all_gather(x: jax.Array, axis_name: AxisName, axis: int, tiled: bool, cfg: CommConfig):
    """(the all-gather of x with `cfg`, its statistics or None: `_measured`)."""
    n_ranks = axis_size(axis_name)
    fused = _exchange_fused(x, axis_name, cfg, n_ranks)
    # The policy reads the all-gather's output size (the sequence-parallel pair's message).
    choice = cfg.choice("all_gather", x, axis_name, n_ranks, scale=n_ranks, fused=fused)
    exact = functools.partial(lax.all_gather, axis_name=axis_name, axis=axis, tiled=tiled)
    if n_ranks == 1:  # N = 1 moves nothing; the lax op then only adds or keeps the gathered axis
        return exact(x), None
    nbytes = (n_ranks - 1) * _nbytes(x)
    if not choice.compress:
        return _plain(exact(x), cfg, nbytes)
    compressed = functools.partial(
        _compressed_all_gather,
        axis_name=axis_name,
        axis=axis,
        tiled=tiled,
        cfg=cfg,
        fused=fused,
        n_ranks=n_ranks,
    )
    change = "keep" if tiled else "insert"
    return _measured(
        compressed, exact, x, cfg, nbytes, dim=axis, change=change, axis_name=axis_name
    )


def _compressed_all_gather(
    x: jax.Array,
    *,
    axis_name: AxisName,
    axis: int,
    tiled: bool,
    cfg: CommConfig,
    fused: bool,
    n_ranks: int,
) -> jax.Array:
    """The compressed all-gather of this device's x: encode, all-gather the wire, decode."""
    cfg = _addressable(cfg, x, n_ranks, rows=1, gathers=True)
    ops = _backends.codec_ops(cfg.impl, cfg.codec)
    row, size = codecs.pad_to_multiple(x.reshape(1, -1), _row_multiple(cfg, fused))

    def gather(piece):  # piece: [1, n]
        n = piece.shape[-1]
        exchange = fused and _fused_exchange("all_gather", piece, axis_name, cfg)
        if not exchange:
            return _gather_wire(ops.encode(cfg.codec, piece)[0], n, axis_name, cfg, x.dtype)
        return ops.decode(cfg.codec, exchange(piece, replicated=False)[:, 0], n, x.dtype)

    stacked = _sliced(gather, row, cfg.slices)[:, :size].reshape((n_ranks,) + x.shape)
    out = jnp.moveaxis(stacked, 0, axis)
    if tiled:
        out = out.reshape(x.shape[:axis] + (n_ranks * x.shape[axis],) + x.shape[axis + 1 :])
    return out


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
    # sizes (`_axes_bound`); the forward's statistics are reported by the backward
    # (`taco_jax.telemetry`: once, where remat runs the forward twice).
    out, stats = all_reduce_at(x, axis_name, cfg, f"{name}/fwd", layer)
    layer = _residual_layer(layer, stats, bwd_cfg, f"{name}/bwd")
    residuals = (type_carrier(x), _axis_sizes(axis_name), layer, telemetry.keep(stats))
    return _batched_under_vmap(out, axis_name), residuals


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
    with _axes_bound(axis_name, sizes):
        result = all_reduce_at(ct, axis_name, bwd_cfg, f"{name}/bwd", layer)
        return _reported(result, f"{name}/bwd", layer, axis_name), None


_psum.defvjp(_psum_fwd, _psum_bwd)


def compressed_psum(
    x: jax.Array,
    axis_name: AxisName,
    *,
    codec: CodecLike = codecs.DEFAULT_CODEC,
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
        residuals = (type_carrier(x), _axis_sizes(axis_name), layer, telemetry.keep(stats))
        return _batched_under_vmap(out, axis_name), residuals

    def op_bwd(axis_name, dim, tiled, cfg, bwd_cfg, name, residuals, ct):
        like, sizes, layer, stats = residuals
        telemetry.report(f"{name}/fwd", stats, layer=layer, axis_name=axis_name)
        with _axes_bound(axis_name, sizes):
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
    codec: CodecLike = codecs.DEFAULT_CODEC,
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
    codec: CodecLike = codecs.DEFAULT_CODEC,
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


def wire_bytes_per_rank(num_elements: int, n_ranks: int, cfg: CommConfig) -> int:
    """Bytes one rank sends in `compressed_psum` of `num_elements`, padding included.

    docs/method.md, "Collectives", for `taco`: two-shot 2 (N-1)/N x (1 + 8/G) bytes per element
    (both phases), one-shot (N-1) x (1 + 8/G); a bf16 ring all-reduce sends 2 (N-1)/N x 2.
    `algorithm="auto"` counts as two-shot, what it runs off a real link (on GPUs
    `taco_jax.policy` may choose one-shot, or no compression at all); "fused" as one-shot, what
    it runs off NVLink. The padding to the kernels' rows (`_row_multiple`: whole Mosaic GPU rows
    on Hopper, the fused kernel's `_backends.FUSED_ROW_MULTIPLE` x slices) is not counted.
    """
    one_shot = cfg.algorithm in ("one_shot", "fused")
    rows = 1 if one_shot else n_ranks
    per_row = math.ceil(num_elements / (rows * cfg.codec.group_size * cfg.slices))
    chunk = cfg.codec.wire_bytes(per_row * cfg.codec.group_size * cfg.slices)
    return (n_ranks - 1) * chunk if one_shot else 2 * (n_ranks - 1) * chunk
