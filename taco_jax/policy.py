"""The "auto" policy: whether, and how, to compress one collective, from measurements.

Compression pays only where the link is slow beside the codec's HBM passes, and how much
depends on the message size (docs/method.md, "The auto policy"). The collectives ask this module
when their options are left at "auto" (`CommConfig.algorithm="auto"`,
`CommConfig.min_compress_bytes=None`):

- On GPU devices bound by `jax.shard_map` (a real link), the choice comes from
  `_policy_table.SPEEDUPS`, measured at N = 2 on each link (`benchmarks/policy_table.py` writes
  it from `benchmarks/collectives.py` records). A message is compressed when the best measured
  algorithm at the largest measured size not above it was at least `MIN_SPEEDUP` faster than
  the plain collective (and, between two measured sizes, at both); below the smallest measured
  size, never. It runs the fastest algorithm measured there, or among those within `TIE` of it
  the one that quantizes least often. The "fused" rows (the kernels that store into the peers'
  memory) are read only where those kernels run (`peer_writes`, and the caller's codec and
  dtype). For N > 2 two-shot runs (fewer bytes than one-shot there) and its own N = 2 row
  decides: a model, not a measurement.
- Anywhere else (the CPU, or a TP group emulated with `jax.vmap(axis_name=...)`, where no bytes
  move) every message is compressed with two-shot, TACO's algorithm: what a numerics study wants.

The link is `CommConfig.link`, or with "auto" read from NCCL's own switches: `NCCL_P2P_DISABLE=1`
means host shared memory, with `NCCL_SHM_DISABLE=1` too sockets (a network-class link), and
otherwise NVLink. A machine whose GPUs talk over PCIe or a network without those switches should
say so with `link=`.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from taco_jax import _policy_table

LINKS = ("auto", "nvlink", "shm", "socket")
# Compress only where the measurement beat the plain collective by more than the run-to-run
# spread of large messages (a few percent). At 1-4 MiB the table's runs jitter more
# (BENCHMARKS.md); the rule between sizes (both neighbours must agree) keeps one lucky
# measurement from spreading to unmeasured sizes.
MIN_SPEEDUP = 1.05
# Algorithms measured within this share of the fastest are not told apart by the table (the
# spread between runs of one size is a few percent, BENCHMARKS.md); among them the one that
# quantizes fewer times wins (less error, and one collective instead of two), the fastest of
# those. Over shared memory the 16 MiB row had two-shot 0.5% ahead of one-shot, yet in the
# GPT-1.3B TP = 2 step with 32 MiB all-reduces one-shot measured faster (BENCHMARKS.md,
# "Overlapping the TP collectives with compute").
TIE = 0.03
QUANTIZATIONS = {"fused": 1, "one_shot": 1, "two_shot": 2, "-": 1}
# Which measured row a collective reads: an all-reduce its own, reduce-scatter and all-gather
# the row of the pair (each is about half of it).
TABLE_OPS = {
    "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter_all_gather",
    "all_gather": "reduce_scatter_all_gather",
}


@dataclasses.dataclass(frozen=True)
class Choice:
    """compress: run the compressed collective (else the plain lax one); algorithm: the
    all-reduce's ("one_shot" | "two_shot" | "fused"), "-" for the other ops."""

    compress: bool
    algorithm: str
    reason: str


def detect_link() -> str:
    """The link NCCL uses between the GPUs of this process, from NCCL's switches."""
    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        return "socket" if os.environ.get("NCCL_SHM_DISABLE") == "1" else "shm"
    return "nvlink"


def resolve_link(link: str) -> str:
    return detect_link() if link == "auto" else link


def _table(op: str, link: str, n_ranks: int, fused: bool = True) -> dict[str, dict[int, float]]:
    """{algorithm: {bytes: speedup}} the decision for `op` reads. Above N = 2 only two-shot's
    row: it is the algorithm that runs there (fewer bytes than one-shot, see module docstring).
    Without `fused` (its kernel cannot run here), not the "fused" row."""
    rows = _policy_table.SPEEDUPS[resolve_link(link)][TABLE_OPS[op]]
    if op == "all_reduce" and n_ranks > 2:
        return {"two_shot": rows["two_shot"]}
    return {a: per_size for a, per_size in rows.items() if fused or a != "fused"}


def _preferred(rows, size: int) -> str:
    """Among the algorithms measured within `TIE` of the fastest at a measured size, the fastest
    of those that quantize the fewest times."""
    fastest = max(per_size[size] for per_size in rows.values())
    close = [a for a, per_size in rows.items() if per_size[size] >= fastest / (1 + TIE)]
    return min(close, key=lambda a: (QUANTIZATIONS[a], -rows[a][size]))


def measured_choice(op: str, link: str, n_ranks: int, nbytes: int, fused: bool = True) -> Choice:
    """What the table says for `op` on `link` with a message of `nbytes` per rank (the all-reduce's
    and reduce-scatter's input, the all-gather's output).

    The algorithm is the one measured best at the nearest size at or below (the smallest size's
    below it): the fastest, or within `TIE` of it the fastest of those that quantize the fewest
    times (`_preferred`), whether or not the table says to compress, so that a forced
    compression runs it too. Compress at a measured size when that algorithm's speedup reached
    MIN_SPEEDUP; between two measured sizes only when it did at both; above the largest as the
    largest; below the smallest never. `fused`: whether the "fused" algorithm's kernel can run
    (else its row is left out).
    """
    rows = _table(op, link, n_ranks, fused)
    sizes = sorted({size for per_size in rows.values() for size in per_size})
    below = [size for size in sizes if size <= nbytes]
    above = [size for size in sizes if size > nbytes]
    near = below[-1] if below else sizes[0]
    best = _preferred(rows, near)
    algorithm = best if op == "all_reduce" else "-"
    where = f"{link} at {near >> 20} MiB"
    if not below:
        return Choice(False, algorithm, f"{nbytes} B is below the smallest measured size")
    neighbours = [near] + ([above[0]] if nbytes != near and above else [])
    worst = min(rows[_preferred(rows, size)][size] for size in neighbours)
    if worst < MIN_SPEEDUP:
        return Choice(False, algorithm, f"{where}: measured {worst:.2f}x < {MIN_SPEEDUP}x")
    return Choice(True, algorithm, f"{where}: measured {rows[best][near]:.2f}x")


def on_real_link(axis_name) -> bool:
    """Whether `axis_name` is a `shard_map` mesh axis of GPU devices (bytes really move)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return jax.default_backend() == "gpu" and all(name in manual for name in names)


def peer_writes(cfg, axis_name) -> bool:
    """Whether a kernel may store into the peers' memory along `axis_name` (the fused kernels):
    one `shard_map` axis of GPUs on NVLink, driven by one process, in a mesh whose devices are
    in row-major order where that is known (Mosaic GPU's rule; `_mesh_in_device_order`). Over
    shared memory or sockets the link is NCCL's transport, which peer stores would bypass; PCIe
    cards (whose device name says so) and GPUs of other processes or hosts are not reached by
    peer stores here."""
    return (
        isinstance(axis_name, str)
        and on_real_link(axis_name)
        and resolve_link(cfg.link) == "nvlink"
        and jax.process_count() == 1
        and "pcie" not in jax.devices()[0].device_kind.lower()
        and _mesh_in_device_order()
    )


def _mesh_in_device_order() -> bool:
    """False if the concrete mesh being traced is known and its devices are not 0, 1, ... in
    row-major order. Under `shard_map(mesh=...)` jax 0.11.2 does not expose the concrete mesh
    while tracing (only under `jax.set_mesh`); such a mesh must follow the rule itself, or
    Mosaic GPU refuses it when the program is compiled."""
    try:  # a private function of jax 0.11 (no public one works inside jit); without it: unknown
        from jax._src.mesh import get_concrete_mesh

        mesh = get_concrete_mesh()
    except (ImportError, AttributeError):
        return True
    if mesh is None or mesh.empty:
        return True
    ids = mesh.device_ids.ravel()
    return bool((ids == np.arange(ids.size)).all())


def choose(
    cfg, op: str, nbytes: int, axis_name, n_ranks: int, *, fused_available: bool = False
) -> Choice:
    """The `Choice` for one collective of `cfg` (a `CommConfig`) on `nbytes` per rank.

    Explicit options win: `min_compress_bytes` (an int) decides whether, `algorithm` (not
    "auto") how; "auto" options come from the table on a real link, else as the module says.
    `fused_available`: whether the "fused" algorithm's kernel runs here (`peer_writes`, and the
    kernel takes the codec and dtype); where it does not, "fused" is "one_shot" and the table's
    "fused" measurements are not read.
    """
    asks_policy = cfg.min_compress_bytes is None or cfg.algorithm == "auto"
    measured = None
    if asks_policy and on_real_link(axis_name):
        measured = measured_choice(op, cfg.link, n_ranks, nbytes, fused_available)
    if cfg.min_compress_bytes is not None:
        compress = nbytes >= cfg.min_compress_bytes
        reason = f"min_compress_bytes={cfg.min_compress_bytes}"
    elif measured is not None:
        compress, reason = measured.compress, measured.reason
    else:
        compress, reason = True, "no real link: every message is compressed"
    if op != "all_reduce":
        algorithm = "-"
    elif cfg.algorithm == "fused" and not fused_available:
        algorithm = "one_shot"
    elif cfg.algorithm != "auto":
        algorithm = cfg.algorithm
    elif measured is not None:
        algorithm = measured.algorithm
    else:
        algorithm = "two_shot"
    return Choice(compress and not cfg.codec.is_identity, algorithm, reason)


def _label(choice: Choice) -> str:
    if not choice.compress:
        return "plain"
    return "compressed" if choice.algorithm == "-" else choice.algorithm


def summary(link: str = "auto", n_ranks: int = 2) -> str:
    """One line per op: from which message size "auto" compresses on `link`, and how."""
    link = resolve_link(link)
    lines = []
    for op in TABLE_OPS:
        rows = _policy_table.SPEEDUPS[link][TABLE_OPS[op]]
        sizes = sorted({size for per_size in rows.values() for size in per_size})
        chosen = [(size, measured_choice(op, link, n_ranks, size)) for size in sizes]
        parts = [f"{size >> 20} MiB {_label(c)}" for size, c in chosen]
        lines.append(f"{op} on {link}, N = {n_ranks}: " + ", ".join(parts))
    return "\n".join(lines)
