"""The "auto" policy: whether, and how, to compress one collective, from measurements.

Compression pays only where the link is slow beside the codec's HBM passes, and how much
depends on the message size (docs/method.md, "The auto policy"). The collectives ask this module
when their options are left at "auto" (`CommConfig.algorithm="auto"`,
`CommConfig.min_compress_bytes=None`):

- On GPU devices bound by `jax.shard_map` (a real link), the choice comes from
  `_policy_table.SPEEDUPS`, measured at N = 2 on each link (`benchmarks/policy_table.py` writes
  it from `benchmarks/collectives.py` records). A message is compressed when the best measured
  algorithm at the largest measured size not above it was at least `MIN_SPEEDUP` faster than
  the plain collective; below the smallest measured size, never. For N > 2 the same decision is
  taken with two-shot, which moves fewer bytes than one-shot there: a model, not a measurement.
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

from taco_jax import _policy_table

LINKS = ("auto", "nvlink", "shm", "socket")
# Compress only where the measurement beat the plain collective by more than run-to-run noise.
MIN_SPEEDUP = 1.05
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
    all-reduce's ("one_shot" | "two_shot"), "-" for the other ops."""

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


def measured_choice(op: str, link: str, n_ranks: int, nbytes: int) -> Choice:
    """What the table says for `op` on `link` with a message of `nbytes` per rank (the all-reduce's
    and reduce-scatter's input, the all-gather's output)."""
    rows = _policy_table.SPEEDUPS[resolve_link(link)][TABLE_OPS[op]]
    sizes = sorted({size for per_size in rows.values() for size in per_size})
    below = [size for size in sizes if size <= nbytes]
    if not below:
        return Choice(False, "-", f"{nbytes} B is below the smallest measured size {sizes[0]} B")
    size = below[-1]
    best, speedup = max(((a, per_size[size]) for a, per_size in rows.items()), key=lambda r: r[1])
    where = f"{link} at {size >> 20} MiB"
    if speedup < MIN_SPEEDUP:
        return Choice(False, "-", f"{where}: best measured {speedup:.2f}x < {MIN_SPEEDUP}x")
    if op != "all_reduce":
        best = "-"
    elif n_ranks > 2:
        best = "two_shot"  # fewer bytes than one-shot for N > 2 (a model, see module docstring)
    return Choice(True, best, f"{where}: measured {speedup:.2f}x")


def on_real_link(axis_name) -> bool:
    """Whether `axis_name` is a `shard_map` mesh axis of GPU devices (bytes really move)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return jax.default_backend() == "gpu" and all(name in manual for name in names)


def choose(cfg, op: str, nbytes: int, axis_name, n_ranks: int) -> Choice:
    """The `Choice` for one collective of `cfg` (a `CommConfig`) on `nbytes` per rank.

    Explicit options win: `min_compress_bytes` (an int) decides whether, `algorithm` (not
    "auto") how; "auto" options come from the table on a real link, else as the module says.
    """
    asks_policy = cfg.min_compress_bytes is None or cfg.algorithm == "auto"
    measured = None
    if asks_policy and on_real_link(axis_name):
        measured = measured_choice(op, cfg.link, n_ranks, nbytes)
    if cfg.min_compress_bytes is not None:
        compress = nbytes >= cfg.min_compress_bytes
        reason = f"min_compress_bytes={cfg.min_compress_bytes}"
    elif measured is not None:
        compress, reason = measured.compress, measured.reason
    else:
        compress, reason = True, "no real link: every message is compressed"
    if op != "all_reduce":
        algorithm = "-"
    elif cfg.algorithm != "auto":
        algorithm = cfg.algorithm
    elif measured is not None and measured.algorithm != "-":
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
