"""The tuned policy file: this machine's measurements of the collectives, where "auto" reads them.

`python -m taco_jax.tune` (`taco_jax.tune`) writes it; `taco_jax.policy` reads it. One JSON file
per machine, named by the machine's fingerprint (`fingerprint`: platform, device kind and count,
process count, JAX, jaxlib and NCCL versions) in the project's cache directory, as XLA's
autotuning caches are: `$TACO_JAX_CACHE`, else `~/.cache/taco_jax` (where the trainer caches
its data too); `$TACO_JAX_POLICY_FILE`, where set, names one file instead (e.g. one shared by a
cluster).

    {"format": FORMAT, "taco_jax": version, "fingerprint": {...}, "date": ..., "command": ...,
     "entries": [{"n_ranks": 4, "link": "nvlink", "ops": {op: {bytes: {codec: comparison}}}}]}
    comparison: {"plain_s", "aa", "repeats", "roundtrip_err",
                 "variants": {algorithm: {"seconds", "median", "interval", "verdict", "rel_err"}}}

An entry holds one TP group size on one link ("vmap": emulated on one device, where no bytes
move); a comparison (`taco_jax.timing.compare`) holds, for one op, message size (bytes per rank,
as `policy.choose` counts them) and codec (`codec_key`), the plain collective's seconds, the A/A
control's interval and each compressed algorithm against it. A file of another machine
(foreign), of another version of the library (stale: its kernels are not the ones that run) or
that cannot be read (damaged) is ignored with one warning line.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path

import jax

FORMAT = "taco_jax.policy/1"
LOG = logging.getLogger("taco_jax.policy")
EMULATED = "vmap"  # the link of an entry measured under vmap on one device: the codec's cost


def codec_key(codec, impl: str = "auto") -> str:
    """The name of a codec with its group size (a `Codec` or a `TahQuant`): "taco@128"; with
    `impl` where it times other code than the kernels ("auto" and "pallas" run the same ones):
    "taco@128/xla", so that a run of the jnp reference neither reads nor writes their times."""
    return f"{codec.name}@{codec.group_size}" + ("" if impl in ("auto", "pallas") else f"/{impl}")


def library_version() -> str:
    try:
        return importlib.metadata.version("taco-jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def nccl_version() -> str:
    """The NCCL that JAX's GPU plugin loads: its wheel's version (`nvidia-nccl-cu12` / `-cu13`),
    else `$NCCL_VERSION` (set by NVIDIA's containers), else "unknown"; "-" off a GPU."""
    if jax.default_backend() != "gpu":
        return "-"
    for wheel in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            return importlib.metadata.version(wheel)
        except importlib.metadata.PackageNotFoundError:
            continue
    return os.environ.get("NCCL_VERSION", "unknown")


@functools.cache  # the devices, processes and versions of a process do not change
def fingerprint() -> dict[str, object]:
    """What the measurements depend on besides the TP group's link (each entry's own). Asked
    after `jax.distributed.initialize`, where there is one."""
    import jaxlib

    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "processes": jax.process_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "nccl": nccl_version(),
    }


def cache_dir() -> Path:
    """`$TACO_JAX_CACHE`, else `~/.cache/taco_jax`."""
    return Path(os.environ.get("TACO_JAX_CACHE") or Path.home() / ".cache" / "taco_jax")


def default_path(machine: dict[str, object] | None = None) -> Path:
    """`$TACO_JAX_POLICY_FILE` where set (not empty), else the file in `cache_dir()` of the
    machine whose fingerprint is `machine` (None: this one, `fingerprint()`), named by it."""
    if os.environ.get("TACO_JAX_POLICY_FILE"):
        return Path(os.environ["TACO_JAX_POLICY_FILE"])
    text = json.dumps(fingerprint() if machine is None else machine, sort_keys=True)
    return cache_dir() / f"policy-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


@dataclasses.dataclass(frozen=True)
class Table:
    """A policy file read and checked: its entries by (n_ranks, link)."""

    path: str
    date: str
    entries: dict[tuple[int, str], dict]

    def entry(self, n_ranks: int, link: str) -> dict | None:
        """{op: {bytes: {codec: comparison}}} measured for N = `n_ranks` on `link`, or None."""
        return self.entries.get((n_ranks, link))

    def describe(self) -> str:
        groups = ", ".join(f"N = {n} on {link}" for n, link in sorted(self.entries))
        return f"{self.path} (measured {self.date}: {groups})"


def to_json(entries: dict[tuple[int, str], dict], command: str) -> dict:
    return {
        "format": FORMAT,
        "taco_jax": library_version(),
        "fingerprint": fingerprint(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "entries": [
            {"n_ranks": n, "link": link, "ops": ops} for (n, link), ops in sorted(entries.items())
        ],
    }


def from_json(data: dict, path: str, trusted: bool = False) -> Table:
    """The `Table` of a file's JSON; ValueError (why it is unusable) for a foreign, stale or
    damaged one. `trusted`: another process checked that it is this machine's (its machine and
    version are not compared again)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"damaged: not a {FORMAT} file")
    if not trusted:
        _check_machine(data)
    try:
        entries = {
            (int(e["n_ranks"]), str(e["link"])): {
                op: {int(size): dict(cell) for size, cell in sizes.items()}
                for op, sizes in e["ops"].items()
            }
            for e in data["entries"]
        }
        for ops in entries.values():
            for sizes in ops.values():
                for cell in sizes.values():
                    for comparison in cell.values():
                        _check_comparison(comparison)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"damaged: {type(error).__name__}: {error}") from None
    return Table(path, str(data.get("date", "?")), entries)


def _check_machine(data: dict) -> None:
    """ValueError where `data` was measured by another version of the library or another
    machine."""
    if data.get("taco_jax") != library_version():
        raise ValueError(
            f"stale: measured with taco-jax {data.get('taco_jax')}, this is "
            f"{library_version()} (its kernels may differ)"
        )
    here, theirs = fingerprint(), data.get("fingerprint")
    if not isinstance(theirs, dict):
        raise ValueError("damaged: no machine fingerprint")
    differ = [f"{k} {theirs.get(k)!r} != {v!r}" for k, v in here.items() if theirs.get(k) != v]
    if differ:
        raise ValueError(f"foreign: measured on another machine ({', '.join(differ)})")


def _check_comparison(comparison: dict) -> None:
    float(comparison["plain_s"])
    lo, hi = comparison["aa"]
    for stats in comparison["variants"].values():
        float(stats["seconds"]), float(stats["median"])
        lo, hi = stats["interval"]
        if stats["verdict"] not in ("faster", "slower", "level", "wrong"):
            raise ValueError(f"verdict {stats['verdict']!r}")


def read(path: Path) -> Table | None:
    """The table in `path`, or None: no such file, or one that is foreign, stale or damaged (one
    warning line, once per file version)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return _read(str(path), stat.st_mtime_ns, stat.st_size)


@functools.cache  # per file version: read once, warned once
def _read(path: str, mtime_ns: int, size: int) -> Table | None:
    try:
        data = json.loads(Path(path).read_text())
        return from_json(data, path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        why = f"damaged: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    except ValueError as error:
        why = str(error)
    LOG.warning("ignoring the tuned policy file %s: %s; re-run python -m taco_jax.tune", path, why)
    return None


def write(path: Path, entries: dict[tuple[int, str], dict], command: str) -> Path:
    """Writes `entries` into `path`, over the entries of the same groups in a usable file there
    (others kept; a comparison of the same op, size and codec replaced). Atomic (a temporary
    file renamed), so that processes writing the same file leave one whole."""
    old = read(path)
    merged = copy.deepcopy(old.entries) if old else {}
    for key, ops in entries.items():
        into = merged.setdefault(key, {})
        for op, sizes in ops.items():
            for size, cell in sizes.items():
                into.setdefault(op, {}).setdefault(int(size), {}).update(cell)
    text = json.dumps(to_json(merged, command), indent=1, sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(tmp, 0o644)  # readable by the cluster's other users, as a cache file is
    os.replace(tmp, path)
    return path


_INSTALLED: list[Table | None] = []  # a table set by `install` (the trainer's), over the file


def install(table: Table | None) -> None:
    """Makes `table` the one "auto" reads in this process (None: none at all), in place of the
    file, until `uninstall`. The trainer installs process 0's, so that every process decides
    alike."""
    _INSTALLED[:] = [table]


def uninstall() -> None:
    _INSTALLED.clear()


def current() -> Table | None:
    """The installed table, else this machine's file (`default_path`), if usable."""
    if _INSTALLED:
        return _INSTALLED[0]
    return read(default_path())
