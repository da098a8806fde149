"""What every benchmark script shares: device-synchronized timing and the result record.

Timing: `sample_seconds` (each call timed alone, ended by `block_until_ready`; `median_seconds`
is its median), `batched_seconds` (host-dispatched batches of calls, for kernels shorter than
the per-call sync) and `in_program_seconds` (dependent calls inside one jitted program: device
time without JAX's per-call dispatch). Record: `write_record` writes one JSON file per run,
`<out>/<name>-<date><suffix>.json`, with date, device, versions and the command first.
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

ENV_PREFIXES = ("NCCL_", "XLA_", "CUDA_VISIBLE_DEVICES", "JAX_", "TACO_JAX_")


def today() -> str:
    """The date that names and heads a record (ISO, local time)."""
    return datetime.date.today().isoformat()


def sample_seconds(call: Callable[[], object], *, reps: int, warmup: int = 2) -> list[float]:
    """Wall time of each of `reps` calls of `call()` after `warmup` untimed calls.

    Each call is ended by `jax.block_until_ready` on what it returns. `call` takes no argument
    so that a step can carry its state from one call to the next (a training step).
    """
    for _ in range(warmup):  # compile, then warm calls
        jax.block_until_ready(call())
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(call())
        samples.append(time.perf_counter() - start)
    return samples


def median_seconds(fn, *args, reps: int, warmup: int = 2) -> float:
    """Median wall time of `fn(*args)` over `reps` calls, each ended by `block_until_ready`."""
    return statistics.median(sample_seconds(lambda: fn(*args), reps=reps, warmup=warmup))


def batched_seconds(
    fn, inputs: Sequence[tuple], *, min_time: float = 0.2, reps: int = 15
) -> tuple[float, float]:
    """(median seconds per call, relative spread) of host-dispatched batches of `fn` calls.

    Calls rotate over `inputs` (tuples of arguments; several sets keep small inputs out of the
    L2 cache). A batch holds enough calls to last ~`min_time / reps` (at least one per input
    set, at most 200) and is synchronized once at its end, so per-call host overhead overlaps
    the device work. Spread = (slowest - fastest batch) / median.
    """
    for a in inputs[:2]:
        jax.block_until_ready(fn(*a))
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs[0]))
    one = max(time.perf_counter() - start, 1e-6)
    batch = int(min(200, max(len(inputs), min_time / reps / one)))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = None
        for i in range(batch):
            out = fn(*inputs[i % len(inputs)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / batch)
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median


def in_program_seconds(fn, inputs: Sequence[tuple], calls: int, *, reps: int = 7) -> float:
    """Device time of one `fn` call inside one jitted program of `calls` dependent calls.

    inputs: 1-tuples, taken in turn. The host dispatches one straight-line program (no device
    loop, whose per-iteration bookkeeping would be timed too); each call's input passes through
    an optimization barrier together with the previous output, so the calls run one after
    another, and every output is returned, so none is removed as dead code. This is the time an
    op has inside a training step (kernel launch included, JAX's per-call dispatch excluded).
    Median of `reps` programs (`batched_seconds`), divided by `calls`.
    """
    args = [a for (a,) in inputs]

    def program(*xs):
        outs = [fn(xs[0])]
        for i in range(1, calls):
            x, _ = lax.optimization_barrier((xs[i % len(xs)], outs[-1]))
            outs.append(fn(x))
        return outs

    return batched_seconds(jax.jit(program), [tuple(args)], reps=reps)[0] / calls


def looped_on_tp(mesh, op, inner: int):
    """Jitted `shard_map` over "tp" of `inner` dependent applications of `op` to each rank's
    block (one `fori_loop`: nothing is elided, and one dispatch covers them all)."""
    spec = jax.sharding.PartitionSpec("tp")

    def body(x):
        return lax.fori_loop(0, inner, lambda _, v: op(v), x)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def seconds_per_op(mesh, op, x, *, inner: int, reps: int) -> float:
    """Median seconds of one `op` over "tp", from `looped_on_tp` calls of `inner` ops."""
    return median_seconds(looped_on_tp(mesh, op, inner), x, reps=reps) / inner


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
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    threads: dict[str, float] = {}
    kinds: dict[str, float] = {}
    for e in events:
        if e.get("ph") != "X" or "GPU" not in processes.get(e["pid"], ""):
            continue
        thread = names.get((e["pid"], e.get("tid")), "?")
        threads[thread] = threads.get(thread, 0.0) + e.get("dur", 0.0) / steps
        if thread.startswith("Stream"):
            kind = re.sub(r"([._]\d+)+$", "", e["name"])
            kinds[kind] = kinds.get(kind, 0.0) + e.get("dur", 0.0) / steps
    ranked = dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:top])
    return {"us_per_step": sum(kinds.values()), "by_kind_us": ranked, "by_thread_us": threads}


def write_record(
    name: str, out_dir: str | os.PathLike, *, suffix: str = "", **fields
) -> pathlib.Path:
    """Writes `<out_dir>/<name>-<date><suffix>.json`: date, device, versions, command, `fields`.

    A field named like a header field (e.g. `device`) replaces it.
    """
    record = {
        "date": today(),
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


_START = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?\b([\w-]+-start)\(")
_DONE = re.compile(r"\b[\w-]+-done\(.*?%([\w.-]+)")
_COMPUTE = re.compile(r"\b(fusion|custom-call|convolution|dot|while|call|conditional)\(")


def collective_windows(compiled_text: str) -> dict:
    """Per kind of asynchronous op (`*-start` / `*-done` pairs: collectives, and also async
    fusions and copies), how many are synchronous, asynchronous, and asynchronous with compute
    inside their window (a kernel, loop, call or conditional scheduled between start and done),
    over every computation (scan bodies too): the schedule evidence of overlap. Counts are per
    compiled instruction, not per execution. Not seen: a pair whose start and done sit in
    different computations (e.g. across loop iterations after XLA's collective pipeliner), and
    work inside a called computation is one op."""
    open_windows: dict[str, list] = {}  # start name -> [its counts, kernels seen inside]
    kinds: dict[str, dict[str, int]] = {}
    for line in compiled_text.splitlines():
        if line.startswith("}"):  # a computation ends: a window cannot span two
            open_windows.clear()
        start, done = _START.search(line), _DONE.search(line)
        if start:
            kind = kinds.setdefault(start.group(2), {"async": 0, "overlapped": 0, "sync": 0})
            kind["sync" if '"is_sync":true' in line else "async"] += 1
            open_windows[start.group(1)] = [kind, 0]
        elif done and done.group(1) in open_windows:
            kind, inside = open_windows.pop(done.group(1))
            kind["overlapped"] += inside > 0
        elif _COMPUTE.search(line):
            for window in open_windows.values():
                window[1] += 1
    return kinds
