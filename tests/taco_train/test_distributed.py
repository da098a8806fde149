"""Two local CPU processes train together through `jax.distributed` (dp = 2 across processes)."""

import socket
import subprocess
import sys

import numpy as np
import pytest
from train_testing import REPO, subprocess_env, tiny_overrides

from taco_train import metrics

TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train(tmp_path):
    port = _free_port()
    overrides = tiny_overrides(
        tmp_path / "run", tmp_path / "cache", "parallel.dp=2", "run.steps=4", "run.eval_every=4"
    )
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
    records = metrics.read_jsonl(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    assert all(np.isfinite(r["loss"]) for r in train)
