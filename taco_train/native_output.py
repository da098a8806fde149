"""What the JAX runtime's native libraries print on stdout, filtered for the training script.

On the CPU, the collectives between processes run on Gloo, which prints one line on stdout
per group of processes a collective spans when it connects them: "[Gloo] Rank 0 is connected
to 1 peer ranks. Expected number of connected peer ranks is : 1" (16 lines per process in a
pipeline with TP across two processes). Gloo has no setting that turns it off, and it writes
from C++, past Python's `sys.stdout`, from several threads at once: one line may start inside
another ("[Gloo] Rank 0 is connected to [Gloo] Rank 0 is connected to 1 peer ranks. ...",
then the first's rest on the next line). `without_gloo_connected_lines` sends fd 1 through a
pipe whose reader drops those lines where every expected peer connected, wherever they stand
in what it reads, and passes on everything else as it comes, a Gloo line that says a peer is
missing included.
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
    rb"Expected number of connected peer ranks is : (\d+)[ \t\r]*\n?"
)


def is_gloo_connected(line: bytes) -> bool:
    """Whether `line` is Gloo's report of a group whose every expected peer connected."""
    match = GLOO_CONNECTED.fullmatch(line)
    return match is not None and match[1] == match[2]


def without_connected(text: bytes) -> tuple[bytes, bytes]:
    """(what of `text` passes on, what waits for the next line): `text` without the
    `is_gloo_connected` lines in it; a rest that starts a Gloo line whose own end came inside
    it (no newline left) waits, to be read with the next line."""
    rest = GLOO_CONNECTED.sub(lambda m: b"" if m[1] == m[2] else m[0], text)
    if rest.startswith(b"[Gloo]") and not rest.endswith(b"\n"):
        return b"", rest
    return rest, b""


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
    waiting = b""
    with os.fdopen(read, "rb") as lines:
        for line in lines:
            passed, waiting = without_connected(waiting + line)
            if passed:
                os.write(out, passed)
    if waiting:
        os.write(out, waiting)


def _flush() -> None:
    """Python's and C's buffers of stdout, into fd 1."""
    sys.stdout.flush()
    ctypes.CDLL(None).fflush(None)
