"""Two local CPU processes train together through `jax.distributed`: docs/training.md's
two-host recipe as written (TP inside each process, dp = 2 across; its SLURM script too), a TP
group across the processes (the network link), and a pipeline with one stage per process that
checkpoints and resumes."""

import os
import re
import shlex
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest
from train_testing import (
    REPO,
    TINY,
    assert_same_state,
    checkpoint_steps,
    subprocess_env,
    tiny_overrides,
    untimed,
)

from taco_train import metrics
from taco_train.checkpointing import damage
from taco_train.config import load_config
from taco_train.main import parse_args

TIMEOUT_S = 240
DOC = REPO / "docs" / "training.md"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(commands: list[tuple[dict[str, str], list[str]]], devices: int = 1) -> list[str]:
    """Runs each (environment, argv) as a CPU process of `devices` devices in the repository,
    together; their outputs, once all exited 0."""
    procs = []
    for env, argv in commands:
        env = subprocess_env(
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
            JAX_PLATFORMS="cpu",
            **env,
        )
        procs.append(
            subprocess.Popen(
                argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
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


def _run_two_processes(out_dir, cache_dir, *extra: str) -> list[str]:
    """configs/tiny.toml with `extra`, as two CPU processes of one device each."""
    port = _free_port()
    argv = [sys.executable, "-m", "taco_train", "--config", TINY]
    for o in tiny_overrides(out_dir, cache_dir, *extra):
        argv += ["--set", o]
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2"}
    return _launch([({**env, "JAX_PROCESS_ID": str(rank)}, argv) for rank in range(2)])


def _doc_block(after: str) -> str:
    """The first ```bash block after `after` in docs/training.md's "Several hosts"."""
    section = DOC.read_text().split("## Several hosts", 1)[1].split("\n## ", 1)[0]
    return section.split(after, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]


def _per_host_commands() -> list[tuple[dict[str, str], list[str]]]:
    """The docs' command for each host: (its environment, argv)."""
    commands = []
    for line in _doc_block("**Two hosts of 8 GPUs**").replace("\\\n", " ").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            words = shlex.split(line)
            env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
            commands.append((env, words[len(env) :]))
    return commands


@pytest.mark.slow
def test_the_two_host_recipe_of_the_docs(tmp_path, cache):
    """docs/training.md's commands per host, as written, with 127.0.0.1 for node0, 8 CPU
    devices per process for its 8 GPUs, and the model, data and length of configs/tiny.toml
    after them (a later --config replaces the docs' file; their --set layout keys stay)."""
    commands = _per_host_commands()
    assert [env["JAX_PROCESS_ID"] for env, _ in commands] == ["0", "1"]
    port, run = _free_port(), tmp_path / "run"
    launched = []
    for env, argv in commands:
        assert argv[:3] == ["python", "-m", "taco_train"]
        args = parse_args(argv[3:])
        assert load_config(REPO / args.config, args.overrides).parallel.num_devices == 16
        address = env["JAX_COORDINATOR_ADDRESS"].replace("node0", "127.0.0.1")
        tiny = ["--config", TINY]
        for o in tiny_overrides(run, cache, "run.steps=2", "run.eval_every=2"):
            tiny += ["--set", o]
        environment = {**env, "JAX_COORDINATOR_ADDRESS": address.replace("8476", str(port))}
        launched.append((environment, [sys.executable, *argv[1:], *tiny]))
    outputs = _launch(launched, devices=8)
    assert "| tp=8 (shard_map) dp=2 |" in outputs[0]
    assert (
        "compression.link=auto -> shm: the group's 8 cpu devices share one process's memory"
        in (outputs[0])
    )
    train = [r for r in metrics.read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2] and np.isfinite(train[0]["loss"])
    for out in outputs:  # Gloo connected the group: its line per group is not shown
        assert "[Gloo]" not in out and "step      2 | loss" in outputs[0]


def test_the_slurm_script_starts_the_per_host_commands(tmp_path):
    """docs/training.md's batch script under stand-ins for `scontrol` and `srun` (which starts
    its command once per host, as SLURM does with one task per node) and for `python` (which
    records what it was started with): each host's environment and arguments are the docs'
    command for that host."""
    bin_dir, launched = tmp_path / "bin", tmp_path / "launched"
    bin_dir.mkdir()
    launched.mkdir()
    stand_ins = {
        "scontrol": "printf 'node0\\nnode1\\n'",
        "srun": 'for i in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_PROCID=$i "$@"; done',
        "python": 'printf "%s\\n" "$JAX_COORDINATOR_ADDRESS" "$JAX_NUM_PROCESSES" '
        '"$JAX_PROCESS_ID" "$@" > "$LAUNCHED/$JAX_PROCESS_ID"',
    }
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(stat.S_IRWXU)
    (tmp_path / "two_hosts.sh").write_text(_doc_block("The same under SLURM"))
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[0-1]",
        "SLURM_NNODES": "2",
        "LAUNCHED": str(launched),
    }
    subprocess.run(["bash", str(tmp_path / "two_hosts.sh")], env=env, check=True, timeout=60)
    for env, argv in _per_host_commands():
        recorded = (launched / env["JAX_PROCESS_ID"]).read_text().splitlines()
        keys = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
        assert recorded == [env[k] for k in keys] + argv[1:]


@pytest.mark.slow
def test_a_tp_group_across_two_processes_reads_the_network_table(tmp_path, cache):
    """TP = 2 with one device per process: "auto" finds the group on two processes (whose CPU
    collectives go through sockets) and says so; the run trains."""
    run = tmp_path / "run"
    outputs = _run_two_processes(
        run, cache, "parallel.mode='shard_map'", "parallel.tp=2", "run.steps=2", "run.eval_every=2"
    )
    assert (
        "compression.link=auto -> socket: the group's 2 devices are on 2 processes" in (outputs[0])
    )
    train = [r for r in metrics.read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2] and np.isfinite(train[0]["loss"])
    for out in outputs:  # Gloo connected the group: its line per group is not shown
        assert "[Gloo]" not in out and "step      2 | loss" in outputs[0]


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
