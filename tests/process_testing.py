"""Processes the tests start: their environment, and a module run as a command."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[1]
# The test session's compilation cache and compile flags (tests/conftest.py) stay out of the
# processes tests start.
_SESSION_ONLY = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
    "TACO_TEST_USER_XLA_FLAGS",
)


def subprocess_env(**updates: str) -> dict[str, str]:
    """os.environ for a process a test starts, without the session's compilation cache and with
    the user's XLA_FLAGS (without the session's fast-compile flag)."""
    env = {k: v for k, v in os.environ.items() if k not in _SESSION_ONLY}
    if "TACO_TEST_USER_XLA_FLAGS" in os.environ:
        env["XLA_FLAGS"] = os.environ["TACO_TEST_USER_XLA_FLAGS"]
    return env | updates


def run_module(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m module args` in the repository, its output captured; asserts it exited 0,
    with the ends of its output where it did not."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done
