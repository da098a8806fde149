"""The "auto" policy: whether, and how, to compress one collective, from measurements.

Compression pays only where the link is slow beside the codec's HBM passes, and how much
depends on the message size (docs/method.md, "The auto policy"). The collectives ask this module
when their options are left at "auto" (`CommConfig.algorithm="auto"`,
`CommConfig.min_compress_bytes=None`):

- On devices bound by `jax.shard_map`, where this machine's tuned table (`_tuned`, written by
  `taco_jax.tune`) measured the TP group's size on its link, the choice comes from it
  (`tuned_choice`): compressed where an algorithm measured faster beyond its A/A control (level
  means plain), N = 4 and 8 by their own measurements.
- Else on GPU devices bound by `jax.shard_map` (a real link), the choice comes from the shipped
  `_policy_table.SPEEDUPS`, measured at N = 2 on each link (`benchmarks/policy_table.py` writes
  it from `benchmarks/collectives.py` records). A message is compressed when the best measured
  algorithm at the largest measured size not above it was at least `MIN_SPEEDUP` faster than
  the plain collective (and, between two measured sizes, at both); below the smallest measured
  size, never. It runs the fastest algorithm measured there, or among those within `TIE` of it
  the one that quantizes least often. The "fused" rows (the kernels that store into the peers'
  memory) are read only where those kernels run (`Target.fused_exchange_possible`, and the
  caller's codec and dtype: `taco_jax.algorithms.fused_kernel_runs`). For N > 2 two-shot runs
  (fewer bytes than one-shot there) and its own N = 2 row decides: a model, not a measurement.
  One log line says so, and how to tune.
- Anywhere else (the CPU without a tuned table, or a TP group emulated with
  `jax.vmap(axis_name=...)`, where no bytes move) every message is compressed with two-shot,
  TACO's algorithm: what a numerics study wants.

The link is `CommConfig.link`, or with "auto" read from the machine (`explain_link`, docs/api.md
"Which link"): NCCL's switches when set (`NCCL_P2P_DISABLE=1`: host shared memory; with
`NCCL_SHM_DISABLE=1` too: sockets); a TP group whose devices sit on different hosts (CPU devices:
in different processes): the network table ("socket"); GPUs of one host that NVML finds joined
by NVLink: "nvlink", else the PCIe-class table ("shm"). Without NVML (`nvidia-ml-py`, optional)
the device kind decides ("PCIe" in it: "shm", else NVLink is assumed) and the log line says so.
The TP group's devices come from the mesh: `mesh_link(mesh, axis_name)`, or while tracing the
concrete mesh where JAX exposes it (under `jax.set_mesh`); otherwise the group is taken to be
this process's devices (with several processes a guess, which the log line says).

While `recording`, every collective traced is recorded with its choice (`Call`), in a named
scope that lets `taco_jax.tune.step_collectives` count how often a program runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from taco_jax import _policy_table, _tuned, codecs
from taco_jax.jax_workarounds import concrete_mesh

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
# GPT-1.3B TP = 2 step with 32 MiB all-reduces one-shot measured faster (docs/decisions/
# 009-auto-policy.md).
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


LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Link:
    """The link of a TP group as "auto" resolves it: name (one of `LINKS` but "auto"), why (a
    phrase naming what decided), assumed (a fallback decided it: no NVML, or no mesh)."""

    name: str
    why: str
    assumed: bool = False


# Slowest first: a mesh whose groups differ resolves to its slowest group's link.
SLOWEST_FIRST = ("socket", "shm", "nvlink")


def detect_link(devices: Sequence[jax.Device] | None = None) -> str:
    """The link between the devices of one TP group (None: this process's devices)."""
    return explain_link(devices).name


def explain_link(devices: Sequence[jax.Device] | None = None) -> Link:
    """The `Link` between `devices`, the members of one TP group (None: this process's).

    In order: NCCL's switches when set; devices on different hosts (GPUs: `slice_index`, which
    JAX gives the devices of one host, or one NVLink domain; CPU devices: their process) ->
    "socket"; GPUs of one host that NVML finds pairwise joined by NVLink -> "nvlink", else
    "shm"; without NVML, "shm" for a device kind naming PCIe, else "nvlink" (assumed)."""
    switches = _nccl_switches()
    if switches is not None:
        return switches
    return _device_link(tuple(jax.local_devices() if devices is None else devices))


@functools.cache  # NVML is asked once per group
def _device_link(devices: tuple[jax.Device, ...]) -> Link:
    hosts = {_host(d) for d in devices}
    if len(hosts) > 1:
        unit = "processes" if devices[0].platform == "cpu" else "hosts"
        return Link("socket", f"the group's {len(devices)} devices are on {len(hosts)} {unit}")
    if devices[0].platform != "gpu":
        return Link(
            "shm",
            f"the group's {len(devices)} {devices[0].platform} devices share one process's memory",
        )
    joined, why = _nvlink_joined(devices)
    if joined is not None:
        return Link("nvlink" if joined else "shm", why)
    kind = devices[0].device_kind
    if "pcie" in kind.lower():
        return Link("shm", f"{why}; device kind {kind!r} is a PCIe card", assumed=True)
    return Link("nvlink", f"{why}; NVLink assumed for device kind {kind!r}", assumed=True)


def _nccl_switches() -> Link | None:
    if os.environ.get("NCCL_P2P_DISABLE") != "1":
        return None
    if os.environ.get("NCCL_SHM_DISABLE") == "1":
        return Link("socket", "NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 are set")
    return Link("shm", "NCCL_P2P_DISABLE=1 is set")


def _host(device: jax.Device):
    """Which host (or NVLink domain) `device` is on, as far as its link goes: JAX numbers the
    GPUs of one host, or of one partition the launcher declares, with one `slice_index`. CPU
    devices count by process: their collectives between processes go through sockets (gloo),
    on one host too."""
    index = getattr(device, "slice_index", None)
    if device.platform == "cpu" or index is None:
        return ("process", device.process_index)
    return ("slice", index)


def _nvlink_joined(devices: Sequence[jax.Device]) -> tuple[bool | None, str]:
    """(whether NVML reports NVLink between every pair of the group's GPUs on this host, why);
    None where NVML cannot tell. The GPUs are this process's devices of the group as NVML
    numbers them (`CUDA_VISIBLE_DEVICES` maps CUDA's numbers), or, where the group has GPUs of
    other processes or that map is not a list of numbers, every GPU of the host."""
    try:
        import pynvml  # nvidia-ml-py: optional, the library needs only JAX and NumPy
    except ImportError:
        return None, "NVML is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return None, f"NVML did not start ({error})"
    try:
        indices = _nvml_indices(devices) or tuple(range(pynvml.nvmlDeviceGetCount()))
        handles = {i: pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        for a, b in itertools.combinations(indices, 2):
            status = pynvml.nvmlDeviceGetP2PStatus(
                handles[a], handles[b], pynvml.NVML_P2P_CAPS_INDEX_NVLINK
            )
            if status != pynvml.NVML_P2P_STATUS_OK:
                return False, f"NVML: no NVLink between GPUs {a} and {b} of this host"
        return True, f"NVML: NVLink joins GPUs {list(indices)} of this host"
    except pynvml.NVMLError as error:
        return None, f"NVML failed ({error})"
    finally:
        pynvml.nvmlShutdown()


def _nvml_indices(devices: Sequence[jax.Device]) -> tuple[int, ...] | None:
    """NVML's numbers of `devices` when all are this process's and at least two (else None)."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    if len(local) < 2 or len(local) != len(devices):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return tuple(d.local_hardware_id for d in local)
    order = visible.split(",")
    if not all(x.strip().isdigit() for x in order):  # UUIDs or MIG names
        return None
    return tuple(int(order[d.local_hardware_id]) for d in local)


def mesh_link(mesh: jax.sharding.Mesh, axis_name) -> Link:
    """`explain_link` of the groups along `axis_name` (a mesh axis or a tuple of them) of
    `mesh`: the slowest group's link (the groups of one mesh are usually alike)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    axes = [mesh.axis_names.index(name) for name in names]
    grid = np.moveaxis(mesh.devices, axes, list(range(-len(axes), 0)))
    size = math.prod(mesh.devices.shape[a] for a in axes)
    groups = {tuple(group) for group in grid.reshape(-1, size)}
    links = [explain_link(group) for group in groups]
    return min(links, key=lambda link: SLOWEST_FIRST.index(link.name))


def resolve_link(link: str, axis_name=None) -> str:
    """`link`, or for "auto" the link of the TP group along `axis_name` (`mesh_link` of the
    concrete mesh where JAX exposes it while tracing, else `explain_link` of this process's
    devices), said once in the log."""
    if link != "auto":
        return link
    mesh = concrete_mesh()
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if mesh is not None and axis_name is not None and set(names) <= set(mesh.axis_names):
        found = mesh_link(mesh, axis_name)
    else:
        found = explain_link()
        if jax.process_count() > 1:
            found = Link(
                found.name,
                f"{found.why}; the mesh is not known here (jax.set_mesh "
                "makes it known), so the group is taken to be this "
                "process's devices",
                assumed=True,
            )
    _say_once(found)
    return found.name


@functools.cache
def _say_once(found: Link) -> None:
    say = LOG.warning if found.assumed else LOG.info
    say(
        "TP link %s: %s%s",
        found.name,
        found.why,
        "; set link= (compression.link) to choose it" if found.assumed else "",
    )


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
    """What the shipped table says for `op` on `link` with a message of `nbytes` per rank (the
    all-reduce's and reduce-scatter's input, the all-gather's output).

    The algorithm is the one measured best at the nearest size at or below (the smallest size's
    below it): the fastest, or within `TIE` of it the fastest of those that quantize the fewest
    times (`_preferred`), whether or not the table says to compress, so that a forced
    compression runs it too. Compress at a measured size when that algorithm's speedup reached
    MIN_SPEEDUP; between two measured sizes only when it did at both; above the largest as the
    largest; below the smallest never (`_between_sizes`). `fused`: whether the "fused"
    algorithm's kernel can run (else its row is left out).
    """
    rows = _table(op, link, n_ranks, fused)
    sizes = sorted({size for per_size in rows.values() for size in per_size})
    cells = {}
    for size in sizes:
        best = _preferred(rows, size)
        speedup = rows[best][size]
        where = f"{link} at {size >> 20} MiB: measured {speedup:.2f}x"
        enough = speedup >= MIN_SPEEDUP
        reason = where if enough else f"{where} < {MIN_SPEEDUP}x"
        cells[size] = Choice(enough, best if op == "all_reduce" else "-", reason)
    return _between_sizes(cells, nbytes)


def _between_sizes(cells: dict[int, Choice], nbytes: int) -> Choice:
    """The choice for `nbytes` from the choices at measured sizes: the algorithm of the nearest
    size at or below (the smallest's below it); compressed when that size's choice is, and
    between two measured sizes only when both are (one lucky measurement does not spread to
    unmeasured sizes); above the largest as the largest; below the smallest never."""
    sizes = sorted(cells)
    below = [size for size in sizes if size <= nbytes]
    above = [size for size in sizes if size > nbytes]
    near = cells[below[-1] if below else sizes[0]]
    if not below:
        return Choice(False, near.algorithm, f"{nbytes} B is below the smallest measured size")
    neighbours = [cells[below[-1]]] + ([cells[above[0]]] if nbytes != below[-1] and above else [])
    refusal = next((c for c in neighbours if not c.compress), None)
    if refusal is not None:
        return Choice(False, near.algorithm, refusal.reason)
    return Choice(True, near.algorithm, near.reason)


# Tuned tables ------------------------------------------------------------------------------


def tuned_cell(op: str, comparison: dict, fused: bool, where: str) -> Choice:
    """The choice at one measured size from this machine's comparison (`taco_jax.tune`): the
    plain collective unless an algorithm that runs here measured "faster" (its interval above 1
    and above the A/A control's: `taco_jax.timing.verdict`); a ratio inside its A/A interval
    is "level", and level means plain. Among the faster ones, those whose intervals overlap the
    fastest's are not told apart, and the fastest of them that quantizes the fewest times runs.
    The all-reduce reads one-shot, two-shot and (where its kernel runs, `fused`) fused; the
    reduce-scatter and all-gather the exchange that runs ("fused" where it does, else "-"). The
    algorithm, also when plain, is the fastest measured (a forced compression runs it)."""
    variants = comparison["variants"]
    if op == "all_reduce":
        names = [a for a in variants if fused or a != "fused"]
    else:
        names = ["fused"] if fused and "fused" in variants else ["-"]
    names = [a for a in names if a in variants and variants[a]["verdict"] != "wrong"]
    if not names:
        return Choice(False, "two_shot" if op == "all_reduce" else "-", f"{where}: none runs right")
    fastest = max(names, key=lambda a: variants[a]["median"])
    faster = [a for a in names if variants[a]["verdict"] == "faster"]
    aa = comparison["aa"]
    if not faster:
        stats = variants[fastest]
        measured = f"{describe_ratio(stats)} {stats['verdict']}"
        reason = f"{where}: {fastest} {measured} (A/A {_interval(aa)})"
        return Choice(False, fastest if op == "all_reduce" else "-", reason)
    best = max(faster, key=lambda a: variants[a]["median"])
    floor = variants[best]["interval"][0]
    close = [a for a in faster if variants[a]["interval"][1] >= floor]
    chosen = min(close, key=lambda a: (QUANTIZATIONS[a], -variants[a]["median"]))
    stats = variants[chosen]
    reason = f"{where}: {chosen} {describe_ratio(stats)} faster (A/A {_interval(aa)})"
    return Choice(True, chosen if op == "all_reduce" else "-", reason)


def _interval(pair) -> str:
    return f"[{pair[0]:.2f}, {pair[1]:.2f}]"


def describe_ratio(stats: dict) -> str:
    """A measured ratio with its interval: "1.23x [1.18, 1.27]"."""
    return f"{stats['median']:.2f}x {_interval(stats['interval'])}"


def tuned_choice(
    op: str, link: str, n_ranks: int, nbytes: int, codec: str, fused: bool = False
) -> Choice | None:
    """What this machine's tuned table (`_tuned.current`) says for `op` of `codec` (`codec_key`)
    on a group of `n_ranks` on `link`, by the sizes it measured (`tuned_cell`, then
    `_between_sizes`); None where it measured no such op, codec and group."""
    table = _tuned.current()
    entry = table.entry(n_ranks, link) if table is not None else None
    if entry is None:
        return None
    measured = {size: cell[codec] for size, cell in entry.get(op, {}).items() if codec in cell}
    if not measured:
        return None
    where = f"tuned, {link} N = {n_ranks} at"
    cells = {
        size: tuned_cell(op, comparison, fused, f"{where} {describe_size(size)}")
        for size, comparison in measured.items()
    }
    return _between_sizes(cells, nbytes)


def describe_size(nbytes: int) -> str:
    """`nbytes` in its largest whole binary unit: "12 MiB", "1.5 KiB", "512 B"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def source(n_ranks: int, link: str, codec: str, *, real_link: bool) -> str:
    """Where "auto"'s choices for `codec` on a group of `n_ranks` on `link` come from: this
    machine's tuned table, else where the group's bytes move over GPUs (`real_link`,
    `Target.real_link`) the shipped table, else none (every message compressed); with how to
    tune where it is not the tuned table."""
    table = _tuned.current()
    entry = table.entry(n_ranks, link) if table is not None else None
    if entry is not None and any(codec in cell for op in entry.values() for cell in op.values()):
        return f"this machine's tuned table {table.describe()}"
    where = _tuned.default_path()
    tune = f"python -m taco_jax.tune --tp {n_ranks} measures this machine (into {where})"
    if not real_link:
        return f"no tuned table for N = {n_ranks} on {link}: every message is compressed; {tune}"
    shipped = _policy_table.SOURCES.get(link, {})
    model = "" if n_ranks == 2 else f"; N = {n_ranks} by a model (two-shot's N = 2 row)"
    return (
        f"the shipped table (measured on {shipped.get('device', '?')} at N = 2, "
        f"{shipped.get('date', '?')}{model}): no tuned table for N = {n_ranks} on {link}; {tune}"
    )


@functools.cache
def _say_shipped(n_ranks: int, link: str, codec: str) -> None:
    LOG.warning("auto policy for %s: %s", codec, source(n_ranks, link, codec, real_link=True))


def reads_link_off_gpu() -> bool:
    """Whether a collective on a `shard_map` axis of devices other than GPUs (the CPU's) may read
    its link: where this machine's tuned table is installed (`taco_jax.tune` measures any
    devices), or while the collectives are `recording` (their link prices them). Only then does
    `taco_jax.target.probe` find such an axis's link: no other choice reads it."""
    return bool(_RECORDS) or _tuned.current() is not None


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective as traced: what `choose` was asked, for which target (a
    `taco_jax.target.Target`) along which axis, and what it chose."""

    cfg: object
    op: str
    nbytes: int
    axis_name: object
    n_ranks: int
    fused_available: bool
    target: object
    choice: Choice

    @property
    def codec(self) -> str:
        return _tuned.codec_key(self.cfg.codec, self.cfg.impl)

    @property
    def link(self) -> str | None:
        """The TP group's link on a mesh axis (`Target.link`); None under `vmap`."""
        return self.target.link


_RECORDS: list[dict[int, list[Call]]] = []  # while `recording`: the calls by scope token
_SCOPES: list[int] = []  # the tokens of the `call_scope`s being traced, innermost last
SCOPE_PREFIX = "taco_collective_"
_TOKENS = itertools.count(1)


@contextlib.contextmanager
def recording() -> Iterator[dict[int, list[Call]]]:
    """While tracing in it, every collective's `Call`, by the token of its `call_scope` (a
    `jax.named_scope` named `SCOPE_PREFIX` + token, which the traced program's equations
    carry: `taco_jax.tune.step_collectives` counts how often each runs). Outside it the
    collectives add no scope and record nothing."""
    calls: dict[int, list[Call]] = {}
    _RECORDS.append(calls)
    try:
        yield calls
    finally:
        _RECORDS.remove(calls)


@contextlib.contextmanager
def call_scope() -> Iterator[None]:
    """Around one collective call: its `choose` and every operation it traces (see
    `recording`)."""
    if not _RECORDS:
        yield
        return
    token = next(_TOKENS)
    _SCOPES.append(token)
    _RECORDS[-1].setdefault(token, [])
    try:
        with jax.named_scope(f"{SCOPE_PREFIX}{token}"):
            yield
    finally:
        _SCOPES.pop()


def choose(
    cfg,
    op: str,
    nbytes: int,
    n_ranks: int,
    target,
    *,
    fused_available: bool = False,
    axis_name=None,
) -> Choice:
    """The `Choice` for one collective of `cfg` (a `CommConfig`) on `nbytes` per rank, traced for
    `target` (a `taco_jax.target.Target`: whether bytes really move, and over which link)
    along `axis_name` (kept in the record while `recording`).

    Explicit options win: `min_compress_bytes` (an int) decides whether, `algorithm` (not
    "auto") how; "auto" options come, on a `shard_map` axis (`target.link`), from this
    machine's tuned table where it measured this group (`tuned_choice`), else on GPUs
    (`target.real_link`) from the shipped table (one log line says so, and how to tune), else
    as the module says (every message compressed).
    `fused_available`: whether the "fused" algorithm's kernel runs here (the target's
    `fused_exchange_possible`, and the kernel takes the codec and dtype:
    `pallas_kernels.registry.select`); where it does not, "fused" is "one_shot" and no table's
    "fused" measurements are read.
    """
    choice = decide(cfg, op, nbytes, n_ranks, target, fused_available)
    if _RECORDS and _SCOPES:
        call = Call(cfg, op, nbytes, axis_name, n_ranks, fused_available, target, choice)
        _RECORDS[-1].setdefault(_SCOPES[-1], []).append(call)
    return choice


def decide(cfg, op: str, nbytes: int, n_ranks: int, target, fused_available: bool = False):
    """`choose`'s decision, recording nothing. The same call decides again after a new table
    is installed (`redecide`)."""
    asks_policy = cfg.min_compress_bytes is None or cfg.algorithm == "auto"
    measured = None
    # An identity codec runs plain whatever the tables say: none is read (nor said) for it.
    if asks_policy and target.link is not None and not cfg.codec.is_identity:
        codec = _tuned.codec_key(cfg.codec, cfg.impl)
        measured = tuned_choice(op, target.link, n_ranks, nbytes, codec, fused_available)
        if measured is None and target.real_link:
            _say_shipped(n_ranks, target.link, codec)
            measured = measured_choice(op, target.link, n_ranks, nbytes, fused_available)
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


def redecide(call: Call) -> Choice:
    """What `choose` decides for `call` now (after a table was installed or tuned)."""
    return decide(call.cfg, call.op, call.nbytes, call.n_ranks, call.target, call.fused_available)


def fused_in_auto(n_ranks: int, link: str | None, codec, impl: str = "auto") -> bool:
    """Whether "auto" may exchange through the fused kernels for a group of `n_ranks`: only
    where a table measured them for that group size (the shipped one at N = 2, this machine's
    tuned table at any N)."""
    if n_ranks == 2:
        return True
    table = _tuned.current()
    entry = table.entry(n_ranks, link) if table is not None else None
    key = _tuned.codec_key(codec, impl)
    return entry is not None and any(
        "fused" in cell[key]["variants"]
        for sizes in entry.values()
        for cell in sizes.values()
        if key in cell
    )


def describe_choice(choice: Choice) -> str:
    """What runs: "plain", the all-reduce's algorithm, or "compressed"."""
    if not choice.compress:
        return "plain"
    return "compressed" if choice.algorithm == "-" else choice.algorithm


def summary(
    link: str = "auto", n_ranks: int = 2, *, codec="taco", fused: bool = False, impl: str = "auto"
) -> str:
    """One line per op: how "auto" decides each measured message size on `link` for a group of
    `n_ranks` with `codec`, and from which table: this machine's tuned one where it measured
    them ("tuned"), else the shipped one ("shipped"). `fused`: whether the fused exchange's
    kernel runs for the group (`taco_jax.algorithms.fused_kernel_runs` of its target); "fused"
    is never named, nor its rows read, where it does not. `impl`: the run's (`codec_key`)."""
    link = resolve_link(link)
    codec = codecs.get_codec(codec) if isinstance(codec, str) else codec
    may_fuse = fused and fused_in_auto(n_ranks, link, codec, impl)
    key = _tuned.codec_key(codec, impl)
    return "\n".join(_summary_line(op, link, n_ranks, key, may_fuse) for op in TABLE_OPS)


def _summary_line(op: str, link: str, n_ranks: int, key: str, fused: bool) -> str:
    table = _tuned.current()
    entry = (table.entry(n_ranks, link) if table is not None else None) or {}
    sizes = sorted(size for size, cell in entry.get(op, {}).items() if key in cell)
    if sizes:
        origin = "tuned"
        chosen = [tuned_choice(op, link, n_ranks, size, key, fused) for size in sizes]
    else:
        origin = "shipped"
        rows = _policy_table.SPEEDUPS[link][TABLE_OPS[op]]
        sizes = sorted({size for per_size in rows.values() for size in per_size})
        chosen = [measured_choice(op, link, n_ranks, size, fused) for size in sizes]
    parts = [f"{describe_size(s)} {describe_choice(c)}" for s, c in zip(sizes, chosen, strict=True)]
    return f"{op} on {link}, N = {n_ranks} ({origin}): " + ", ".join(parts)
