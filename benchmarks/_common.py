"""What every benchmark script shares: device-synchronized median timing and the result record."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax


def median_seconds(fn, *args, reps: int, warmup: int = 2) -> float:
    """Median wall time of `fn(*args)` over `reps` calls, each ended by `block_until_ready`."""
    for _ in range(warmup):  # compile, then one warm call
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def write_record(name: str, out_dir: str, **fields) -> pathlib.Path:
    """Writes `<out_dir>/<name>-<date>.json` with date, device, versions and command first."""
    record = {
        "date": datetime.date.today().isoformat(),
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        **fields,
    }
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{record['date']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return path
