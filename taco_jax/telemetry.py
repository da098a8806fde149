"""Compression error by call site: how far each compressed collective is from the exact one.

Measuring is a static option of the collectives: `CommConfig.telemetry=True` (so also
`TPComm.create(telemetry=True)` and `compressed_psum(..., telemetry=True)`), and
`compressed_ppermute(..., telemetry=True)`. A program built with it also runs, beside each
compressed collective, the exact one on the same inputs in fp32, and hands the host a few
sums per call (`STATS`, through `jax.debug.callback`); a program built without it is the same
program as before. To measure every few steps, build the step twice and run the measuring one
on those steps, as `taco_train` does (docs/decisions/024-measuring-call-sites.md).

Call sites: each op takes `name=` and `layer=`. Its forward collective reports as
`<name>/fwd`, its backward's as `<name>/bwd`, behind `layer_07/` for `layer=7`; `layer` may
be a traced int32, such as the index a `lax.scan` over layers carries (the host receives its
value). A site that runs several times (microbatches, chunks, ranks, devices) adds up its
sums: its error is that of all its values together.

Under `jax.grad` a forward site reports from the backward pass, which runs once where remat
computes the forward twice. Its sums are saved as a residual named `CHECKPOINT_NAME`: a remat
policy that saves that name also spares the exact collective's rerun in the backward.

`drain()` returns what this process's devices reported since the last call, per site (on
several processes, `drain(all_processes=True)` what all of them reported).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from taco_jax import _local

# The sums one call of a site reports (fp32): the squared error against the exact collective
# and the exact values squared (both over the compressed calls only), the non-finite values of
# the output and of the exact one, the bytes a rank sends in the uncompressed collective, and
# those of them that went compressed.
STATS = ("sq_error", "sq_exact", "nonfinite", "exact_nonfinite", "nbytes", "compressed_bytes")
CHECKPOINT_NAME = "comm_error"

# A layer index at or below DISCARDED / 2 marks the reports of work a program computes and
# throws away (a pipeline's bubble steps): the host drops them (`discarded_unless`), so a
# site's sums and `calls` are those of the work that counts.
DISCARDED = -(2**30)

_lock = threading.Lock()
_reports: dict[str, list[np.ndarray]] = {}
_axes: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class SiteError:
    """What one call site reported since the last `drain()`.

    error: ||out - exact|| / ||exact|| over its compressed calls (NaN where a value was not
      finite; None where no call ran compressed: uncompressed by policy, codec or fallback).
    nonfinite / exact_nonfinite: NaN and Inf values in its output and in the exact collective's,
      summed over the ranks that hold them (an all-reduce's replicated output counts once per
      rank).
    nbytes / compressed_bytes: bytes its ranks send in the uncompressed collective (a ring's:
      2 (N - 1) / N of the message for an all-reduce, (N - 1) / N for a reduce-scatter, N - 1
      messages for an all-gather, one for a ppermute's senders), and the share of those sent
      compressed.
    axis: the axis it communicates over ("dp_inter,dp_intra" for a tuple).
    calls: the reports its sums add up: one per call, rank and device that ran it (a check
      that no report was dropped or repeated: tests/taco_jax/test_telemetry.py).
    """

    error: float | None
    nonfinite: int
    exact_nonfinite: int
    nbytes: float
    compressed_bytes: float
    axis: str
    calls: int = 1

    @classmethod
    def of(cls, sums, axis: str) -> SiteError:
        """From a site's `STATS` sums and, last, its count of reports."""
        sq_error, sq_exact, nonfinite, exact_nonfinite, nbytes, compressed, calls = sums
        if compressed == 0:
            error = None
        elif sq_exact > 0 or math.isnan(sq_exact):
            error = math.sqrt(sq_error) / math.sqrt(sq_exact)
        else:
            error = math.sqrt(sq_error)  # as `relative_error`: 0 when both are 0
        return cls(
            error, int(nonfinite), int(exact_nonfinite), nbytes, compressed, axis, int(calls)
        )

    @property
    def codec_nonfinite(self) -> bool:
        """The compressed output held non-finite values where the exact one held none (a codec
        spreads a non-finite input over its group: that is not its doing)."""
        return self.nonfinite > 0 and self.exact_nonfinite == 0


def site_name(site: str, layer: int | None) -> str:
    """`site` behind its layer's prefix: site_name("mlp_out/fwd", 7) == "layer_07/mlp_out/fwd"."""
    return site if layer is None or layer < 0 else f"layer_{layer:02d}/{site}"


def relative_error(approx: jax.Array, exact: jax.Array) -> jax.Array:
    """||approx - exact|| / ||exact|| in fp32 (0 when both are 0; NaN stays NaN)."""
    # Sums of squares, not norms of ravelled arrays: a reduction needs no out_sharding on a
    # mesh of `Explicit` axes, where a reshape of a sharded array may.
    diff = jnp.sqrt(jnp.sum(jnp.square(approx.astype(jnp.float32) - exact.astype(jnp.float32))))
    norm = jnp.sqrt(jnp.sum(jnp.square(exact.astype(jnp.float32))))
    return jnp.where(norm > 0, diff / jnp.where(norm > 0, norm, 1.0), diff)


def _total(fn, *trees) -> jax.Array:
    return sum(fn(*leaves) for leaves in zip(*map(jax.tree.leaves, trees), strict=True))


def measure(out, exact, nbytes) -> jax.Array:
    """The `STATS` [6] of one compressed call: `out` against `exact`, pytrees of arrays alike
    (`exact` in fp32); `nbytes` as `SiteError.nbytes`, per rank."""
    f32 = jnp.float32
    sq_error = _total(lambda o, e: jnp.sum(jnp.square(o.astype(f32) - e.astype(f32))), out, exact)
    sq_exact = _total(lambda e: jnp.sum(jnp.square(e.astype(f32))), exact)
    nonfinite = _total(lambda o: jnp.sum(~jnp.isfinite(o), dtype=f32), out)
    exact_nonfinite = _total(lambda e: jnp.sum(~jnp.isfinite(e), dtype=f32), exact)
    nbytes = jnp.asarray(nbytes, f32)
    return jnp.stack([sq_error, sq_exact, nonfinite, exact_nonfinite, nbytes, nbytes])


def unmeasured(nbytes) -> jax.Array:
    """The `STATS` of a call that ran uncompressed: its bytes only."""
    zero = jnp.zeros((), jnp.float32)
    return jnp.stack([zero, zero, zero, zero, jnp.asarray(nbytes, jnp.float32), zero])


def per_rank(stats: jax.Array | None, axis_name) -> jax.Array | None:
    """`stats` as each rank's own along `axis_name` (bound): a collective's replicated output
    comes out of `vmap` as one copy for all ranks, and its sums would count once where
    `shard_map` counts them per rank. Adding 0 changes no value."""
    if stats is None:
        return None
    return stats + (lax.axis_index(axis_name) * 0).astype(stats.dtype)


def keep(stats: jax.Array | None) -> jax.Array | None:
    """`stats` named `CHECKPOINT_NAME`, as a custom_vjp's residual (see the module doc)."""
    return None if stats is None else checkpoint_name(stats, CHECKPOINT_NAME)


def _axis_label(axis_name) -> str:
    return ",".join(axis_name) if isinstance(axis_name, tuple) else str(axis_name)


def discarded_unless(keep, layer) -> jax.Array:
    """`layer` (the first layer index of some work), or where the traced bool `keep` is False a
    mark that drops every report of the sites named from it (their layers count up from it):
    the work is computed and thrown away, as on a pipeline's bubble steps. It travels with the
    layer index, also into the backward pass."""
    return jnp.where(keep, jnp.asarray(layer, jnp.int32), DISCARDED)


def report(site: str, stats: jax.Array | None, *, layer=None, axis_name="") -> None:
    """Hands one call's `STATS` to the host under `site_name(site, layer)` (nothing where
    `stats` is None); `layer`: None, an int or a traced int32. Works under jit, vmap, scan,
    shard_map and in a custom_vjp's backward pass. Reports of discarded work
    (`discarded_unless`) reach the host and are dropped there."""
    if stats is None:
        return
    index = jnp.asarray(-1 if layer is None else layer, jnp.int32)
    callback = functools.partial(_accumulate, site, _axis_label(axis_name))
    free = _local.free_axes()
    if not free:
        jax.debug.callback(callback, index, stats)
        return

    # In a partial shard_map (GSPMD), jax 0.11.2 cannot call back beside the axes left to the
    # compiler ("Closing over inputs to shard_map ... sharded on `Explicit` axes"): the call
    # goes from a map manual over them, its first device only (the sums are whole-array ones).
    def once(index, stats):
        first = lax.axis_index(free) == 0
        jax.debug.callback(
            lambda first, *args: bool(first) and callback(*args), first, index, stats
        )
        return index

    mesh = jax.sharding.get_abstract_mesh()
    jax.shard_map(
        once, mesh=mesh, in_specs=(P(), P()), out_specs=P(), axis_names=set(free), check_vma=False
    )(index, stats)


def _accumulate(site: str, axis: str, layer, stats) -> None:
    layer = int(np.asarray(layer))
    if layer <= DISCARDED // 2:  # discarded work (a layer counted up from the mark)
        return
    name = site_name(site, layer)
    with _lock:
        _reports.setdefault(name, []).append(np.asarray(stats, np.float64))
        _axes[name] = axis


def drain(*, all_processes: bool | None = None) -> dict[str, SiteError]:
    """Each call site's `SiteError` since the last `drain()`, in name order; resets.

    Blocks until the device work issued so far has reported (`jax.effects_barrier`), so call
    it after a step. The sums are exact whatever order the devices reported in (`math.fsum`).
    all_processes: True merges what every process's devices reported (every process must call
    it at the same point; each then returns the same, so decisions made from it agree); False
    returns this process's devices' reports alone. Left unset it is False on one process and
    refused on several: there, per-process errors would lead processes to different decisions
    (different programs, a hang), and a merge is a collective every process must join."""
    if all_processes is None and jax.process_count() > 1:
        raise ValueError(
            f"drain() on {jax.process_count()} processes: pass all_processes=True (every "
            "process calls it at the same point and gets the same merged errors, to decide "
            "from) or all_processes=False (this process's devices' reports alone)"
        )
    jax.effects_barrier()
    with _lock:
        reports, axes = dict(_reports), dict(_axes)
        _reports.clear()
        _axes.clear()
    sums = {
        site: [math.fsum(column) for column in zip(*rows, strict=True)] + [len(rows)]
        for site, rows in reports.items()
    }
    if all_processes and jax.process_count() > 1:
        sums, axes = _merged(sums, axes)
    return {site: SiteError.of(sums[site], axes[site]) for site in sorted(sums)}


def _merged(sums: dict, axes: dict) -> tuple[dict, dict]:
    """Every process's `sums` added up, in process order (the same on every process)."""
    from jax.experimental import multihost_utils

    payload = np.frombuffer(json.dumps([sums, axes]).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(payload.size))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[: payload.size] = payload
    gathered = multihost_utils.process_allgather(padded)
    merged, merged_axes = {}, {}
    for row, size in zip(np.asarray(gathered), np.asarray(sizes).reshape(-1), strict=True):
        their_sums, their_axes = json.loads(bytes(row[: int(size)]).decode())
        merged_axes.update(their_axes)
        for site, values in their_sums.items():
            merged.setdefault(site, []).append(values)
    return {s: [math.fsum(c) for c in zip(*v, strict=True)] for s, v in merged.items()}, merged_axes


def over_budget(errors: dict[str, SiteError], budget: float) -> list[str]:
    """The sites whose error exceeds `budget` (a relative error), or whose compressed output
    held non-finite values where the exact one held none; a site whose exact result was not
    finite (nor then its error) is not over it: its inputs were not finite."""
    return [
        site
        for site, e in errors.items()
        if e.error is not None and (e.codec_nonfinite or e.error > budget)
    ]
