"""What the benchmark scripts share besides timing (`taco_jax.timing`): the record, profiles, data.

`write_record` writes one JSON file per run, `<out>/<name>-<date><suffix>.json`: date, device,
versions, command, environment, the commit and a fingerprint of the kernels' code first, so
that a table can say when and on which code a figure was measured (`tables.py`).
"""

from __future__ import annotations

import argparse
import ast
import collections
import datetime
import functools
import gzip
import hashlib
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp

from taco_jax import timing

ENV_PREFIXES = ("NCCL_", "XLA_", "CUDA_VISIBLE_DEVICES", "JAX_", "TACO_JAX_")
REPO = pathlib.Path(__file__).resolve().parents[1]
KERNELS = REPO / "pallas_kernels"
RESULTS = REPO / "benchmarks" / "results"
MiB = 1 << 20
COMMIT_ENV = "TACO_JAX_COMMIT"  # names the commit where the tree has no .git (a copied tree)


def commit() -> str | None:
    """`$TACO_JAX_COMMIT` where set, else the checkout's commit (short hash, "+" where tracked
    files differ from it), else None (a copied tree without git)."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    git = lambda *a: subprocess.run(
        ["git", *a], cwd=REPO, text=True, capture_output=True, check=True
    ).stdout.strip()  # noqa: E731
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


@functools.cache
def kernels_fingerprint(root: pathlib.Path = KERNELS) -> str:
    """A hash of the code of `pallas_kernels` (its syntax trees without docstrings: comments
    and prose do not count), so that a table marks a figure whose kernels changed since."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and _is_docstring(body[0]):
                node.body = body[1:] or [ast.Pass()]
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(ast.dump(tree).encode())
    return digest.hexdigest()[:12]


def _is_docstring(node) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(getattr(node, "value", None), ast.Constant)
        and isinstance(node.value.value, str)
    )


def device_time_by_kernel(call: Callable[[], object], steps: int, top: int = 100) -> dict:
    """Device time of `steps` calls of `call()` under `jax.profiler`, per step: in total and per
    kind of kernel (its name without trailing numbering; the `top` largest), from the kernel
    events of the GPU streams in the perfetto trace; also each trace thread's total, to see
    what was counted."""
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
        for _ in range(steps):
            jax.block_until_ready(call())
        jax.profiler.stop_trace()
        (path,) = pathlib.Path(log_dir).glob("plugins/profile/*/perfetto_trace.json.gz")
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    names = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    processes = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    threads, kinds = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "GPU" not in processes.get(e["pid"], ""):
            continue
        thread, us = names.get((e["pid"], e.get("tid")), "?"), e.get("dur", 0.0) / steps
        threads[thread] += us
        if thread.startswith("Stream"):
            kinds[re.sub(r"([._]\d+)+$", "", e["name"])] += us
    ranked = dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:top])
    return {"us_per_step": sum(kinds.values()), "by_kind_us": ranked, "by_thread_us": dict(threads)}


def write_record(
    name: str, out_dir: str | os.PathLike, *, suffix: str = "", **fields
) -> pathlib.Path:
    """Writes `<out_dir>/<name>-<date><suffix>.json`: date, device, versions, command, `fields`.

    A field named like a header field (e.g. `device`) replaces it.
    """
    record = {
        "date": datetime.date.today().isoformat(),  # local time
        "commit": commit(),
        "kernels": kernels_fingerprint(),
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind} ({platform.machine()})",
        "backend": jax.default_backend(),
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        # The transport and compiler settings a run was made with (e.g. NCCL_P2P_DISABLE).
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        **fields,
    }
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{record['date']}{suffix}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def timed_script_options(p: argparse.ArgumentParser, budget_s: float, max_repeats: int) -> None:
    """The options of a timed script: its comparisons' budget and rounds (`taco_jax.timing`),
    a deadline, and where its record goes (`compare_options` reads them)."""
    p.add_argument("--budget-s", type=float, default=budget_s, help="a comparison's budget")
    p.add_argument("--min-repeats", type=int, default=timing.MIN_REPEATS, help="rounds, at least")
    p.add_argument("--max-repeats", type=int, default=max_repeats, help="rounds, at most")
    p.add_argument("--deadline", type=float, help="time.time() to stop at the minimum rounds")
    p.add_argument("--suffix", default="", help="appended to the record's file name")
    p.add_argument("--out", default=os.environ.get("OUT") or str(RESULTS))


def compare_options(args) -> dict:
    """`taco_jax.timing.compare`'s options, from `timed_script_options`' arguments."""
    names = ("budget_s", "deadline", "min_repeats", "max_repeats")
    return {name: getattr(args, name) for name in names}


def tp_mesh(tp: int) -> jax.sharding.Mesh:
    """A ("tp",) mesh of the first `tp` devices."""
    auto = (jax.sharding.AxisType.Auto,)
    return jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp], axis_types=auto)


def activation_like(leading: int, size: int, seed: int, dof: float) -> dict[str, jax.Array]:
    """Three data sets of shape [leading, size] for codec error studies: Gaussian; Student-t with
    `dof` degrees of freedom (dense near zero, heavy tails); activation-like Gaussian with 1% of
    the channels (last axis) 30x larger (outlier features)."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    gaussian = jax.random.normal(k1, (leading, size))
    student = jax.random.t(k2, dof, (leading, size))
    channels = jax.random.uniform(k3, (size,)) < 0.01
    return {
        "gaussian": gaussian,
        f"student_t{dof:g}": student,
        "outlier_channels": gaussian * jnp.where(channels, 30.0, 1.0),
    }
