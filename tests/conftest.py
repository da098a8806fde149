"""Test session set-up: 8 fake CPU devices for shard_map, and a compilation cache.

The suite expects `XLA_FLAGS=--xla_force_host_platform_device_count=8` (set by `.ci/run` and the
README's test command); it is set here too, before JAX initializes, for a bare `pytest` run.
Shared helpers live in plain modules beside this file (`tp_testing.py`, `tolerances.py`), not
here: `from conftest import ...` would pick whichever conftest.py was imported first.

Many tests compile the same program more than once (a run, then its resume from a checkpoint,
each building its jitted step anew); JAX's persistent compilation cache, in a fresh directory per
session (nothing carries over between sessions), compiles each once. It changes no result: a
cached executable is the one compiled. Tests that start processes hand them
`train_testing.subprocess_env()`, without the cache: a process timed or killed mid-run must
compile as a user's would.

The session also compiles with XLA's backend (LLVM) optimization at level 1 instead of XLA's
default 3 (on the CPU, and for the jnp references of a GPU session): the suite's programs are
tiny and compiled once or twice, so compiling dominates (one TAH-Quant train-step test on a
2-core machine: 55 s -> 45 s, not recorded). No test depends on the level for its verdict: two
separately compiled programs computing the same values need not round alike (at level 0 the
receivers of a compressed ppermute and the codec's own round trip differed in the last bit), so
tests compare such programs within derived bounds, and bit for bit only where a guarantee
makes it exact (dyadic values, data movement, integer codes, the same program run twice;
docs/decisions/029-floats-across-programs.md). Processes started with
`train_testing.subprocess_env` get the user's XLA_FLAGS back: a process killed mid-run must
take as long as a user's would.
"""

import contextlib
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
_FAST_COMPILE = "--xla_backend_optimization_level=1"
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:  # the user's choice stays
    os.environ["TACO_TEST_USER_XLA_FLAGS"] = os.environ["XLA_FLAGS"]
    os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {_FAST_COMPILE}"
_JIT_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # a cache of the user's own is left alone
    _JIT_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="taco-jit-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# The tuned policy file "auto" reads (`taco_jax._tuned`): one in a fresh directory per session,
# so that no table of the user's decides a test; every process a test starts inherits it.
_POLICY_CACHE = tempfile.mkdtemp(prefix="taco-policy-")
os.environ["TACO_JAX_POLICY_FILE"] = os.path.join(_POLICY_CACHE, "policy.json")


def pytest_sessionfinish(session, exitstatus):
    if _JIT_CACHE is not None:
        shutil.rmtree(_JIT_CACHE, ignore_errors=True)
    shutil.rmtree(_POLICY_CACHE, ignore_errors=True)


@pytest.fixture
def check_replicas():
    """check_replicas(on=True): for the rest of the test, every emulated output's copies along
    the mesh axes its spec leaves out must be the same bits
    (`taco_models.spmd.replicas_checked`)."""
    from taco_models import spmd

    with contextlib.ExitStack() as stack:
        yield lambda on=True: stack.enter_context(spmd.replicas_checked(on))
