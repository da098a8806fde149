"""`python -m benchmarks.checkpoint_pause --smoke`: the benchmark's two trainer runs (saves
blocking the loop, then in the background) end to end on the CPU, and the record it writes."""

import json
import math

import pytest
from process_testing import run_module

from benchmarks import checkpoint_pause


@pytest.mark.slow  # two trainer processes: ~35 s on two CPU cores
def test_smoke_runs_the_trainer_twice_and_records_each_save(tmp_path):
    run_module("benchmarks.checkpoint_pause", "--smoke", "--out", str(tmp_path), timeout=600)
    (path,) = tmp_path.glob("checkpoint_pause-*-smoke.json")
    record = json.loads(path.read_text())
    assert record["overrides"] == list(checkpoint_pause.SMOKE)
    assert set(record["runs"]) == set(checkpoint_pause.MODES)
    for mode, saves in record["runs"].items():
        # run.steps=4, run.checkpoint_every=2: a save at steps 2 and 4, in the run's own mode.
        assert [save["step"] for save in saves] == [2, 4], mode
        assert all(save["async"] is (mode == "async") for save in saves), saves
        for save in saves:
            blocked, finite, previous = save["blocked_s"], save["finite_s"], save["previous_s"]
            assert all(math.isfinite(s) and s >= 0 for s in (blocked, finite, previous)), save
            # The check and the wait are disjoint spans inside the pause, each a difference of
            # perf_counter readings (exact); only their sum rounds, by at most one ulp.
            assert blocked >= finite + previous - math.ulp(blocked), save
        assert record["wall_s_printed"][mode] > 0, mode  # the end-of-run line was parsed
