"""What the JAX runtime's native libraries print on stdout, filtered for the training script.

On the CPU, the collectives between processes run on Gloo, which prints one line on stdout
per group of processes a collective spans when it connects them: "[Gloo] Rank 0 is connected
to 1 peer ranks. Expected number of connected peer ranks is : 1" (16 lines per process in a
pipeline with TP across two processes). Gloo has no setting that turns it off, and it writes
from C++, past Python's `sys.stdout`. `without_gloo_connected_lines` sends fd 1 through a pipe
whose reader drops those lines where every expected peer connected, and passes on everything
else as it comes, a Gloo line that says a peer is missing included.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import threading
from collections.abc import Iterator

# Gloo's line for a group all of whose peers connected (the two counts equal).
GLOO_CONNECTED = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    rb"Expected number of connected peer ranks is : (\d+)\s*"
)


def is_gloo_connected(line: bytes) -> bool:
    """Whether `line` is Gloo's report of a group whose every expected peer connected."""
    match = GLOO_CONNECTED.fullmatch(line)
    return match is not None and match[1] == match[2]


@contextlib.contextmanager
def without_gloo_connected_lines() -> Iterator[None]:
    """While active, the process's stdout (fd 1) passes through a filter that drops
    `is_gloo_connected` lines; on exit every line written is through, and fd 1 is as it was."""
    _flush()
    saved = os.dup(1)
    read, write = os.pipe()
    os.dup2(write, 1)
    os.close(write)
    pump = threading.Thread(target=_pump, args=(read, saved), name="stdout-filter", daemon=True)
    pump.start()
    try:
        yield
    finally:
        _flush()
        os.dup2(saved, 1)  # closes the pipe's only writer: the pump reads its end
        pump.join(timeout=30)
        os.close(saved)


def _pump(read: int, out: int) -> None:
    with os.fdopen(read, "rb") as lines:
        for line in lines:
            if not is_gloo_connected(line):
                os.write(out, line)


def _flush() -> None:
    """Python's and C's buffers of stdout, into fd 1."""
    sys.stdout.flush()
    ctypes.CDLL(None).fflush(None)
