"""Two local CPU processes train together through `jax.distributed`: dp = 2 across processes,
and a pipeline with one stage per process that checkpoints and resumes."""

import socket
import subprocess
import sys

import numpy as np
import pytest
from train_testing import (
    REPO,
    assert_same_state,
    checkpoint_steps,
    subprocess_env,
    tiny_overrides,
    untimed,
)

from taco_train import metrics
from taco_train.checkpointing import damage

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(out_dir, cache_dir, *extra: str) -> None:
    """configs/tiny.toml with `extra`, as two CPU processes of one device each."""
    port = _free_port()
    overrides = tiny_overrides(out_dir, cache_dir, *extra)
    cmd = [sys.executable, "-m", "taco_train", "--config", str(REPO / "configs" / "tiny.toml")]
    for o in overrides:
        cmd += ["--set", o]
    procs = []
    for rank in range(2):
        env = subprocess_env(
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(rank),
            XLA_FLAGS="--xla_force_host_platform_device_count=1",
            JAX_PLATFORMS="cpu",
        )
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outputs


@pytest.mark.slow
def test_two_processes_train(tmp_path):
    run = tmp_path / "run"
    _run_two_processes(run, tmp_path / "cache", "parallel.dp=2", "run.steps=4", "run.eval_every=4")
    records = metrics.read_jsonl(run / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    assert all(np.isfinite(r["loss"]) for r in train)


# A pipeline of two stages, one per process (each process one device): the stage sends, INT8
# with TAH-Quant, and the stages' sum of the shared gradients cross processes.
ONE_STAGE_PER_PROCESS = (
    "parallel.mode='shard_map'",
    "parallel.tp=1",
    "parallel.pp=2",
    "parallel.microbatches=2",
    "compression.pp='tahquant'",
    "run.keep_checkpoints=1",  # pruning too: orbax's delete waits for every process
)


def _steps(run) -> list[int]:
    return checkpoint_steps(run / "checkpoints")


@pytest.mark.slow
def test_one_stage_per_process_checkpoints_and_resumes_exactly(tmp_path, cache):
    """pp = 2 with each stage in its own process: a run stopped at its step-3 checkpoint and
    resumed ends with the metrics and the state of the run uninterrupted, bit for bit (each
    process saves and restores its own stage's shards). The reference runs as two processes
    too: a program compiled with other flags (this test session's, tests/conftest.py) may
    differ in the last bit."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    _run_two_processes(run, cache, *ONE_STAGE_PER_PROCESS, "run.stop_at=3")
    assert _steps(run) == [3]
    outputs = _run_two_processes(run, cache, *ONE_STAGE_PER_PROCESS)
    assert "at step 3" in outputs[0], outputs[0][-3000:]
    assert _steps(run) == [6]
    assert damage(run / "checkpoints" / "6") is None
    _run_two_processes(reference, cache, *ONE_STAGE_PER_PROCESS)
    want = untimed(metrics.read_jsonl(reference / "metrics.jsonl"))
    assert untimed(metrics.read_jsonl(run / "metrics.jsonl")) == want
    assert_same_state(run, reference, 6)


@pytest.mark.slow
def test_processes_decide_the_error_budget_together(tmp_path, cache):
    """One stage per process, measuring every 2 steps: a stage send's error exists only with
    both processes' sums (the sender's process holds its bytes, the receiver's its error), so
    the step-2 record shows it, and over a budget below TAH-Quant's ~0.009
    (tests/taco_jax/test_ppermute.py) both processes switch the sends to uncompressed at the
    same step and finish the run."""
    run = tmp_path / "run"
    budget = ("run.comm_error_every=2", "compression.error_budget=0.005")
    _run_two_processes(run, cache, *ONE_STAGE_PER_PROCESS, *budget)
    records = metrics.read_jsonl(run / "metrics.jsonl")
    first = next(r for r in records if r["kind"] == "comm")
    assert first["step"] == 2 and 0.005 < first["comm_error/pp_send/fwd"] < 0.05
    switched = [r for r in records if r["kind"] == "comm_fallback"]
    assert [r["step"] for r in switched] == [2]
    assert {"pp_send/fwd", "pp_send/bwd"} <= set(switched[0]["sites"])
    later = [r for r in records if r["kind"] == "comm" and r["step"] > 2]
    assert later and all("comm_error/pp_send/fwd" not in r for r in later)
