"""Two local CPU processes train together through `jax.distributed`: docs/training.md's
two-host recipe as written (TP inside each process, dp = 2 across; its SLURM script too), a TP
group across the processes (the network link), and a pipeline with one stage per process that
checkpoints and resumes, stops together on a signal to one of them, and takes one verdict on a
checkpoint the processes see differently."""

import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time

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


def _run_two_processes(out_dir, cache_dir, *extra: str, env=None) -> list[str]:
    """configs/tiny.toml with `extra`, as two CPU processes of one device each (`env`: more
    environment)."""
    argv = [sys.executable, "-m", "taco_train", "--config", TINY]
    for o in tiny_overrides(out_dir, cache_dir, *extra):
        argv += ["--set", o]
    return _launch(_on_processes(2, argv, env or {}))


def _on_processes(n: int, argv: list[str], env: dict[str, str]) -> list[tuple[dict, list[str]]]:
    """(environment, argv) of each of `n` processes of one `jax.distributed` run."""
    env = {**env, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}"}
    return [
        ({**env, "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(r)}, argv) for r in range(n)
    ]


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
    (tests/taco_jax/test_ppermute.py) at steps 2 and 4 both processes switch the sends to
    uncompressed at the same step and finish the run."""
    run = tmp_path / "run"
    budget = ("run.comm_error_every=2", "compression.error_budget=0.005")
    _run_two_processes(run, cache, *ONE_STAGE_PER_PROCESS, *budget)
    records = metrics.read_jsonl(run / "metrics.jsonl")
    first = next(r for r in records if r["kind"] == "comm")
    assert first["step"] == 2 and 0.005 < first["comm_error/pp_send/fwd"] < 0.05
    switched = [r for r in records if r["kind"] == "comm_fallback"]
    assert [r["step"] for r in switched] == [4]
    assert {"pp_send/fwd", "pp_send/bwd"} <= set(switched[0]["sites"])
    later = [r for r in records if r["kind"] == "comm" and r["step"] > 4]
    assert later and all("comm_error/pp_send/fwd" not in r for r in later)


# Two processes of two CPU devices each: one all-reduce over all four, measured.
_DRAIN_SCRIPT = """
import json, os, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import taco_jax
from taco_jax import telemetry
address, rank = os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_PROCESS_ID"])
jax.distributed.initialize(address, 2, rank)
mesh = jax.make_mesh((4,), ("tp",))
psum = jax.jit(jax.shard_map(
    lambda x: taco_jax.compressed_psum(x, "tp", telemetry=True, name="sum"),
    mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
x = jax.make_array_from_callback((4, 4096), jax.NamedSharding(mesh, P("tp")),
    lambda index: jax.random.normal(jax.random.key(0), (4, 4096))[index])
jax.block_until_ready(psum(x))
try:
    telemetry.drain()
    refused = None
except ValueError as error:
    refused = str(error)
merged = telemetry.drain(all_processes=True)["sum/fwd"]  # the refusal kept the reports
jax.block_until_ready(psum(x))
alone = telemetry.drain(all_processes=False)["sum/fwd"]
print(json.dumps({"refused": refused, "merged": [merged.error, merged.calls],
                  "alone": [alone.error, alone.calls]}))
"""


@pytest.mark.slow
def test_drain_on_two_processes_merges_or_refuses_without_a_choice(tmp_path):
    """On two processes `drain()` without `all_processes` refuses in one line (per-process
    errors would have the processes decide apart); `all_processes=True` gives both the same
    sums of all four devices' reports (one each: `calls`), `False` each its own two."""
    port = _free_port()
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}
    argv = [sys.executable, "-c", _DRAIN_SCRIPT]
    outputs = _launch([({**env, "JAX_PROCESS_ID": str(rank)}, argv) for rank in range(2)], 2)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    for result in results:
        assert result["refused"].startswith("drain() on 2 processes: pass all_processes=True")
        assert result["merged"][1] == 4 and result["alone"][1] == 2
    assert results[0]["merged"] == results[1]["merged"]  # one decision for both
    # taco two-shot over 4 ranks of N(0, 1): ~0.036 (docs/api.md); each process alone sums
    # half the ranks' values of the same all-reduce.
    assert 0.01 < results[0]["merged"][0] < 0.06


def _start_two_processes(out_dir, cache_dir, logs, *extra: str) -> list[subprocess.Popen]:
    """`_run_two_processes` started, not awaited: each process's output goes to a file in
    `logs` (a pipe nobody reads could fill and stall it)."""
    port = _free_port()
    argv = [sys.executable, "-m", "taco_train", "--config", TINY]
    for o in tiny_overrides(out_dir, cache_dir, *extra):
        argv += ["--set", o]
    procs = []
    for rank in range(2):
        env = subprocess_env(
            XLA_FLAGS="--xla_force_host_platform_device_count=1",
            JAX_PLATFORMS="cpu",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(rank),
        )
        with open(logs / f"process{rank}.txt", "w") as log:
            procs.append(
                subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            )
    return procs


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_one_process_stops_both_after_the_same_step(signum, cache, tmp_path):
    """One stage per process; the signal goes to process 1 alone, mid-run with no log step to
    wait for: both agree on a step (through the coordination service), stop after it with one
    checkpoint of it and exit 128 + the signal; at most three steps after the last process 1
    had done (the step in progress, the one queued, and one more a process may run ahead)."""
    run = tmp_path / "run"
    steps = ("run.steps=1000", "run.log_every=1000", "run.eval_every=1000")
    procs = _start_two_processes(
        run, cache, tmp_path, *ONE_STAGE_PER_PROCESS, *steps, "run.checkpoint_every=4"
    )
    try:
        while not any(r["kind"] == "checkpoint" for r in _records(run)):
            assert all(p.poll() is None for p in procs), "a process ended before its first save"
            time.sleep(0.05)
        procs[1].send_signal(signum)
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            p.kill()
    logs = [(tmp_path / f"process{rank}.txt").read_text() for rank in range(2)]
    name = signal.Signals(signum).name
    assert [p.returncode for p in procs] == [128 + signum] * 2, logs
    heard = re.search(rf"taco-train: {name} after step (\d+): stopping once the processes", logs[1])
    agreed = re.search(rf"taco-train: {name}: the processes stop after step (\d+)", logs[0])
    assert heard and agreed, logs
    done, step = int(heard[1]), int(agreed[1])
    assert done <= step <= done + 3, logs
    for log in logs:
        assert f"taco-train: {name}: stopped at step {step}; run the same command" in log, log
    assert _steps(run)[-1] == step and damage(run / "checkpoints" / str(step)) is None


def _records(run) -> list[dict]:
    try:
        return metrics.read_jsonl(run / "metrics.jsonl")
    except json.JSONDecodeError:  # a line being written
        return []


# Two processes of one device each restore a checkpoint of an array split over both; the
# process named by DISAGREEING sees the files otherwise (a half-synced view): its own `damage`
# finds step 2 damaged.
_VERDICT_SCRIPT = """
import json, os, sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from taco_train import checkpointing
address, rank = os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_PROCESS_ID"])
jax.distributed.initialize(address, 2, rank)
sharding = jax.NamedSharding(jax.make_mesh((2,), ("x",)), P("x"))
ckpt = checkpointing.Checkpointer(sys.argv[1], keep=2, asynchronous=False)
if sys.argv[2] == "save":
    for step in (1, 2):
        x = jax.make_array_from_callback((8,), sharding, lambda i: step + np.arange(8.0)[i])
        ckpt.save(step, {"x": x})
else:
    if rank == int(os.environ["DISAGREEING"]):
        checkpointing.damage = lambda d: "its file x is changed" if d.name == "2" else None
    target = {"x": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)}
    state, step = ckpt.restore_newest_good(target)
    local = np.asarray(state["x"].addressable_shards[0].data).tolist()
    print(json.dumps({"step": step, "local": local}))
ckpt.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("disagreeing", [0, 1])
def test_processes_that_see_a_checkpoint_differently_take_one_verdict(tmp_path, disagreeing):
    """Process 0 reads the checkpoint and decides for both: where process 1 alone sees step 2
    damaged, both restore step 2; where process 0 does, both set it aside (moved once) and
    restore step 1. Before, each process hashed every file itself and one could enter the
    set-aside barrier while the other entered orbax's restore: a hang."""
    directory = str(tmp_path / "checkpoints")

    def launch(phase: str, **env) -> list[str]:
        argv = [sys.executable, "-c", _VERDICT_SCRIPT, directory, phase]
        base = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}", **env}
        return _launch([({**base, "JAX_PROCESS_ID": str(r)}, argv) for r in range(2)])

    launch("save")
    outputs = launch("restore", DISAGREEING=str(disagreeing))
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    want = 2 if disagreeing == 1 else 1
    assert [r["step"] for r in results] == [want, want], outputs
    assert [r["local"] for r in results] == [
        [want + i for i in range(4)],
        [want + i for i in range(4, 8)],
    ]
    aside = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if "unusable" in p.name)
    assert aside == ([] if disagreeing == 1 else ["2.unusable"])


# `python -m taco_jax.tune` over CPU processes of one device each: a TP group across processes
# (link "socket"), one size, a short budget (each comparison still runs its minimum rounds).
TUNE = [sys.executable, "-m", "taco_jax.tune", "--sizes-mib", "0.0625", "--budget-s", "4"]
TP_ACROSS = ("parallel.mode='shard_map'", "parallel.tp=2", "run.steps=2", "run.eval_every=2")


def _comparisons(entry: dict) -> list[dict]:
    return [c for sizes in entry["ops"].values() for cell in sizes.values() for c in cell.values()]


@pytest.mark.slow
def test_four_processes_tune_n2_and_n4_and_agree(tmp_path):
    """Four processes tune N = 2 and N = 4 together, each writing its own file: the four files
    hold the same measurements (every sample is the slowest process's, so every
    process stops after the same rounds and decides alike), with both group sizes, every op,
    and intervals beside the A/A control's; process 0 alone says its progress."""
    commands = _on_processes(4, [*TUNE, "--tp", "2", "4"], {})
    for rank, (env, _) in enumerate(commands):
        env["TACO_JAX_POLICY_FILE"] = str(tmp_path / f"policy{rank}.json")
    outputs = _launch(commands)
    tables = [json.loads((tmp_path / f"policy{r}.json").read_text()) for r in range(4)]
    assert all(t["entries"] == tables[0]["entries"] for t in tables)
    entries = {(e["n_ranks"], e["link"]): e for e in tables[0]["entries"]}
    assert set(entries) == {(2, "socket"), (4, "socket")}
    for entry in entries.values():
        assert set(entry["ops"]) == {"all_reduce", "reduce_scatter", "all_gather"}
        for comparison in _comparisons(entry):
            assert comparison["repeats"] >= 6 and len(comparison["aa"]) == 2
            for stats in comparison["variants"].values():
                lo, hi = stats["interval"]
                assert lo <= stats["median"] <= hi and stats["verdict"] != "wrong"
    assert "[3/3] N = 4 socket all_gather 64 KiB" in outputs[0] and "wrote" in outputs[0]
    assert all("[1/3]" not in out for out in outputs[1:])


@pytest.mark.slow
def test_the_trainer_names_the_table_two_processes_tuned(tmp_path, cache):
    """`python -m taco_jax.tune --tp 2` on two processes writes this machine's table; a run of
    TP = 2 across the same two processes then names it at start-up (its sizes, 32 KiB and
    512 B, lie below the tuned 64 KiB: those collectives run plain). Another machine's file or
    a damaged one is ignored in one line, the run then says it has no tuned table, as it does
    with the file removed (on the CPU: every message compressed)."""
    policy_dir = tmp_path / "policy"  # the cache directory, the file named by the machine
    env = {"TACO_JAX_CACHE": str(policy_dir), "TACO_JAX_POLICY_FILE": ""}
    tuned = _launch(_on_processes(2, [*TUNE, "--tp", "2"], env))
    (path,) = policy_dir.glob("policy-*.json")
    assert f"wrote {path}" in tuned[0]
    data = json.loads(path.read_text())
    assert data["fingerprint"]["processes"] == 2 and len(data["entries"]) == 1
    outputs = _run_two_processes(tmp_path / "tuned", cache, *TP_ACROSS, env=env)
    assert f"the TP collectives' policy: this machine's tuned table {path}" in outputs[0]
    none_line = "the TP collectives' policy: no tuned table for N = 2 on socket"
    foreign = {**data, "fingerprint": {**data["fingerprint"], "device_kind": "another"}}
    for spoiled, why in ((json.dumps(foreign), "foreign"), ("{", "damaged"), (None, None)):
        if spoiled is None:
            path.unlink()
        else:
            path.write_text(spoiled)
        outputs = _run_two_processes(tmp_path / str(why), cache, *TP_ACROSS, env=env)
        said = [line for out in outputs for line in out.splitlines() if "ignoring" in line]
        if why is None:
            assert said == []
        else:
            assert len(said) == 1 and f"{path}: {why}" in said[0], said
        assert none_line in outputs[0]
