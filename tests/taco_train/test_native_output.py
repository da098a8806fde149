"""The training script's filter of the native libraries' stdout (`taco_train.native_output`)."""

import subprocess
import sys

from train_testing import REPO, subprocess_env

from taco_train.native_output import is_gloo_connected, without_connected

CONNECTED = (
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
)
MISSING = (
    "[Gloo] Rank 1 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1"
)
# Lines written to fd 1 inside the filter from Python's print, os.write and C's stdio (flushed
# per line, as `std::cout << ... << std::endl` is), then one after it.
SCRIPT = f"""
import ctypes, os
from taco_train.native_output import without_gloo_connected_lines
libc = ctypes.CDLL(None)
with without_gloo_connected_lines():
    print("step      1 | loss 2.0000", flush=True)
    os.write(1, b"{CONNECTED}\\n")
    libc.printf(b"%s\\n", b"{MISSING}")
    libc.fflush(None)
    os.write(1, b"{CONNECTED.replace("Rank 0", "Rank 3")}\\n")
    print("done")
print("after")
"""


def test_only_gloo_lines_of_fully_connected_groups_are_dropped():
    """In a process whose stdout is a pipe, as a launcher's is: Gloo's line of a group whose
    peers all connected is dropped; one that misses a peer, and every other line, pass in
    order; after the filter, fd 1 writes where it did."""
    assert is_gloo_connected(CONNECTED.encode() + b"\n")
    assert not is_gloo_connected(MISSING.encode() + b"\n")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=subprocess_env(PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout == f"step      1 | loss 2.0000\n{MISSING}\ndone\nafter\n"


def test_a_gloo_line_started_inside_another_is_dropped_with_its_rest():
    """Gloo's threads write at once: a line starts inside another, its rest on the next line
    (as seen on two processes of 8 CPU devices each); both go, the text around them stays."""
    head, tail = CONNECTED.split("to ")
    first = f"{head}to {CONNECTED}\n".encode()
    passed, waiting = without_connected(first)
    assert (passed, waiting) == (b"", f"{head}to ".encode())
    assert without_connected(waiting + f"{tail}\n".encode()) == (b"", b"")
    mixed = f"model 1M params\n{CONNECTED}\n{MISSING}\n".encode()
    assert without_connected(mixed) == (f"model 1M params\n{MISSING}\n".encode(), b"")
    # A fragment whose rest never comes passes on with what follows, nothing dropped.
    assert without_connected(waiting + b"step 2\n") == (waiting + b"step 2\n", b"")
