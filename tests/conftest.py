"""Test session set-up: 8 fake CPU devices for shard_map.

The suite expects `XLA_FLAGS=--xla_force_host_platform_device_count=8` (set by `.ci/run` and the
README's test command); it is set here too, before JAX initializes, for a bare `pytest` run.
Shared helpers live in plain modules beside this file (`tp_testing.py`, `tolerances.py`), not
here: `from conftest import ...` would pick whichever conftest.py was imported first.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
