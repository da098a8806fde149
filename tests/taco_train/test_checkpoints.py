"""Checkpoints that survive damage: a damaged newest checkpoint is reported in one line and the
run resumes from the newest good one, which is never deleted for a newer one that is not; any
other restore error moves nothing and stops in one line; no launch starts a run over silently;
a signal stops a run within a step of its arrival."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from train_testing import (
    REPO,
    assert_same_state,
    checkpoint_steps,
    final_state,
    subprocess_env,
    tiny_args,
    untimed,
)

from taco_train import checkpointing, metrics, trainer
from taco_train.checkpointing import MANIFEST, Checkpointer, RestoreError, damage
from taco_train.main import main

_args = tiny_args


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache):
    """A 6-step run with checkpoints at steps 3 and 6, both good."""
    out = tmp_path_factory.mktemp("finished")
    main(_args(out, cache))
    return out


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _largest_data_file(step_dir):
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(step_dir):
    path = _largest_data_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_bytes(step_dir):
    path = _largest_data_file(step_dir)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def _empty_metadata(step_dir):
    path = next(p for p in step_dir.rglob("_METADATA"))
    path.write_bytes(b"")


# The tests of a finished run (`finished`: 18 s on two cores before the first) are the slow
# tier's; the fast tier checks saves, pruning and a second signal here (a resume after a
# signal: test_train_loop.py, beside its own finished run).
@pytest.mark.slow
def test_a_finished_run_leaves_good_checkpoints(finished):
    """Saved asynchronously, the last one too is complete with its manifest once the run ends,
    and each save's pause is recorded in metrics.jsonl."""
    checkpoints = finished / "checkpoints"
    assert checkpoint_steps(checkpoints) == [3, 6]
    assert damage(checkpoints / "3") is None and damage(checkpoints / "6") is None
    records = metrics.read_jsonl(finished / "metrics.jsonl")
    saves = [r for r in records if r["kind"] == "checkpoint"]
    assert [(r["step"], r["async"]) for r in saves] == [(3, True), (6, True)]
    assert all(r["blocked_s"] >= 0 for r in saves)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_save_that_fails_leaves_the_previous_good_checkpoint(asynchronous, tmp_path, monkeypatch):
    """A save that breaks before its manifest is written (here: hashing its files fails, as
    when the process dies there) is not good, and the checkpoint before it is not pruned for
    it: restoring falls back to it."""
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=1, asynchronous=asynchronous)
    state = {"x": jnp.arange(4.0)}
    ckpt.save(1, state)
    ckpt.wait()

    def crash(step_dir):
        raise OSError("the disk went away")

    monkeypatch.setattr(checkpointing, "_file_hashes", crash)
    with pytest.raises(OSError, match="the disk went away"):
        ckpt.save(2, {"x": state["x"] + 1})
        ckpt.wait()
    monkeypatch.undo()
    assert checkpoint_steps(tmp_path / "checkpoints") == [1, 2]
    assert damage(tmp_path / "checkpoints" / "1") is None
    assert damage(tmp_path / "checkpoints" / "2") == "it was never completed (no manifest)"
    restored, step = ckpt.restore_newest_good({"x": jax.ShapeDtypeStruct((4,), jnp.float32)})
    ckpt.close()
    assert step == 1
    np.testing.assert_array_equal(restored["x"], state["x"])


def test_a_damaged_newest_checkpoint_is_set_aside_in_one_line(tmp_path, capsys):
    """The fast tier's damaged checkpoint (the whole run's resume: the slow tier): a truncated
    newest file makes `restore_newest_good` say so in one line, move it aside and restore the
    one before it."""
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=2, asynchronous=False)
    state = {"x": jnp.arange(1024.0)}
    ckpt.save(1, state)
    ckpt.save(2, {"x": state["x"] + 1})
    _truncate(tmp_path / "checkpoints" / "2")
    restored, step = ckpt.restore_newest_good({"x": jax.ShapeDtypeStruct((1024,), jnp.float32)})
    ckpt.close()
    assert step == 1
    np.testing.assert_array_equal(restored["x"], state["x"])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "checkpoint 2 in" in err, err
    assert "is not usable: its file" in err, err
    assert (tmp_path / "checkpoints" / "2.unusable").is_dir()


def _two_good_checkpoints(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=2, asynchronous=False)
    ckpt.save(1, {"x": jnp.arange(1024.0)})
    ckpt.save(2, {"x": jnp.arange(1024.0) + 1})
    return ckpt


TARGET = {"x": jax.ShapeDtypeStruct((1024,), jnp.float32)}


def test_a_transient_restore_error_moves_nothing_and_stops_in_one_line(tmp_path, monkeypatch):
    """A good checkpoint whose restore fails (here a device out of memory, as orbax would raise
    it) is not damaged: RestoreError, one line naming the checkpoint and the error, and both
    checkpoints stay where they were (before, each was moved aside in turn)."""
    ckpt = _two_good_checkpoints(tmp_path)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4.0GiB.\nmore detail")

    monkeypatch.setattr(ckpt._manager, "restore", out_of_memory)
    with pytest.raises(RestoreError) as error:
        ckpt.restore_newest_good(TARGET)
    ckpt.close()
    message = str(error.value)
    assert "\n" not in message and message.startswith("checkpoint 2 in "), message
    assert "did not restore (RuntimeError: RESOURCE_EXHAUSTED: Out of memory" in message
    assert "nothing was moved" in message
    assert checkpoint_steps(tmp_path / "checkpoints") == [1, 2]
    assert not list((tmp_path / "checkpoints").glob("*.unusable"))


def test_a_checkpoint_that_cannot_be_read_is_not_called_damaged(tmp_path, monkeypatch):
    """Reading the files to verify them fails (a filesystem error): RestoreError, nothing moved;
    only files that do not match their manifest set a checkpoint aside."""
    ckpt = _two_good_checkpoints(tmp_path)

    def unreadable(step_dir):
        raise OSError(5, "Input/output error", str(step_dir / "default" / "d" / "0"))

    monkeypatch.setattr(checkpointing, "damage", unreadable)
    with pytest.raises(RestoreError, match=r"checkpoint 2 in .* could not be read.*OSError"):
        ckpt.restore_newest_good(TARGET)
    ckpt.close()
    assert checkpoint_steps(tmp_path / "checkpoints") == [1, 2]


def test_an_async_save_keeps_the_state_of_its_step_when_the_next_step_donates_it(tmp_path):
    """`train_step` donates the state; an asynchronous save returns before the files are written,
    so it must already hold its own copy: the checkpoint has the values of its step."""
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=1, asynchronous=True)
    state = {"x": jnp.arange(1024.0)}
    ckpt.save(1, state)
    step = jax.jit(lambda s: {"x": s["x"] * -1.0}, donate_argnums=0)
    for _ in range(3):
        state = step(state)
    ckpt.close()
    np.testing.assert_array_equal(final_state(tmp_path, 1)["x"], np.arange(1024.0))


def test_pinning_ahead_copies_what_a_save_copies_and_leaves_the_state(tmp_path, monkeypatch):
    """`reserve_host_memory` copies to pinned host memory what this process's save copies, on
    a thread: a leaf sharded over 8 devices whole; a leaf sharded over tp = 4 and replicated over
    dp = 2 once, half from each replica's devices (orbax splits a replicated array between its
    replicas: with every process pinning its share, none pins in its first save). The state is
    then donated and saved as usual, with the values of its step."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # orbax's replica-parallel default on
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    sharded = jax.device_put(jnp.arange(1024.0), NamedSharding(mesh, P(("dp", "tp"))))
    replicated = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P(None, "tp")))
    state = {"sharded": sharded, "replicated": replicated}
    parts = checkpointing._saved(replicated)
    assert sorted(part.device.id for part in parts) == list(range(8))
    assert {part.shape for part in parts} == {(32, 64)}
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=1, asynchronous=True, pin_ahead=True)
    ckpt.reserve_host_memory(state)
    said = ckpt.host_memory_reserved()
    assert said.startswith("pinned 0.00 GiB of host memory for checkpoints in "), said
    assert checkpointing.pin_host_copy(state) == (1024 + 64 * 256) * 4
    assert ckpt.host_memory_reserved() is None  # once
    state = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)(state)
    ckpt.save(1, state)
    ckpt.close()
    np.testing.assert_array_equal(final_state(tmp_path, 1)["sharded"], np.arange(1024.0) + 1)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_host_memory_is_pinned_ahead_for_either_kind_of_save(asynchronous, tmp_path):
    """Synchronous saves copy through pinned host memory too: `asynchronous` changes nothing."""
    state = {"x": jnp.arange(4.0)}
    for pin in (False, True):
        ckpt = Checkpointer(tmp_path / str(pin), 1, asynchronous, pin_ahead=pin)
        ckpt.reserve_host_memory(state)
        said = ckpt.host_memory_reserved()
        assert (said is not None and said.startswith("pinned ")) == pin, said
        ckpt.close()


def test_pinning_ahead_is_off_where_saves_do_not_pin(tmp_path):
    assert not Checkpointer(tmp_path, 1).pin_ahead  # a CPU backend


def test_a_failed_pinning_is_one_line_and_saves_still_work(tmp_path):
    """Pinning ahead only saves the first save's pause: where it fails, the run goes on."""
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=1, asynchronous=True, pin_ahead=True)
    ckpt.reserve_host_memory({"x": jnp.arange(4.0), "gone": _deleted_array()})
    said = ckpt.host_memory_reserved()
    assert said.startswith("host memory for checkpoints not pinned ahead (RuntimeError: "), said
    assert "\n" not in said
    ckpt.save(1, {"x": jnp.arange(4.0)})
    ckpt.close()
    assert checkpoint_steps(tmp_path / "checkpoints") == [1]


def _deleted_array() -> jax.Array:
    array = jnp.arange(4.0)
    array.delete()
    return array


@pytest.mark.slow  # `finished`
@pytest.mark.parametrize("harm", [_truncate, _flip_bytes, _empty_metadata])
def test_damaged_newest_checkpoint_falls_back_in_one_line(harm, finished, cache, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    harm(run / "checkpoints" / "6")
    assert damage(run / "checkpoints" / "6") is not None
    main(_args(run, cache))  # resumes at 3 and trains steps 4-6 again
    err = capsys.readouterr().err
    assert "checkpoint 6 in" in err and "is not usable: its file" in err, err
    assert "resuming from" in err and "at step 3" in err, err
    assert (run / "checkpoints" / "6.unusable").is_dir()  # kept for inspection, out of the way
    # The rerun reproduces the uninterrupted run (batches and state are functions of the step).
    ours = untimed(metrics.read_jsonl(run / "metrics.jsonl"))
    assert ours == untimed(metrics.read_jsonl(finished / "metrics.jsonl"))
    assert damage(run / "checkpoints" / "6") is None  # saved again, good
    # ... and the first run's records of steps 4-6 were moved aside, not lost.
    first = (finished / "metrics.jsonl").read_text().splitlines(keepends=True)
    later = [line for line in first if json.loads(line).get("step", 0) > 3]
    assert later and (run / "metrics.after-step-3.jsonl").read_text() == "".join(later)
    assert "lines of metrics.jsonl from later steps" in err, err


@pytest.mark.slow  # `finished`
def test_no_usable_checkpoint_is_one_line_and_a_requeue_never_starts_over(
    finished, cache, tmp_path, capsys
):
    """Every checkpoint damaged: the launch stops in one line; the same command again (a
    scheduler's requeue) refuses too, in one line, instead of training from step 0 over the
    run's metrics (before: 5 records left of 43, nothing archived); run.resume=false then
    starts over with the earlier run archived whole."""
    run = _copy(finished, tmp_path)
    records = (run / "metrics.jsonl").read_text()
    for step in ("3", "6"):
        _flip_bytes(run / "checkpoints" / step)
    with pytest.raises(SystemExit) as exit_info:
        main(_args(run, cache))
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("taco-train: error: no checkpoint in") and "is usable" in last
    assert "run.resume=false" in last
    with pytest.raises(SystemExit) as exit_info:  # the requeue
        main(_args(run, cache))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("taco-train: error: every checkpoint in"), err
    assert "(3.unusable, 6.unusable)" in err[0] and "run.resume=false" in err[0]
    assert (run / "metrics.jsonl").read_text() == records  # nothing truncated
    main(_args(run, cache, "run.resume=false", "run.steps=1"))
    (archived,) = (run / "archive").iterdir()
    assert (archived / "metrics.jsonl").read_text() == records
    assert sorted(p.name for p in (archived / "checkpoints").iterdir()) == [
        "3.unusable",
        "6.unusable",
    ]


@pytest.mark.slow  # `finished`
def test_a_transient_restore_error_stops_the_launch_in_one_line(
    finished, cache, tmp_path, capsys, monkeypatch
):
    """The command line: one line naming the checkpoint and the error, exit 1, every
    checkpoint and metrics record where it was; the next launch resumes."""
    run = _copy(finished, tmp_path)
    records = (run / "metrics.jsonl").read_text()

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4.0GiB.")

    with monkeypatch.context() as patch:
        patch.setattr(checkpointing.ocp.CheckpointManager, "restore", out_of_memory)
        with pytest.raises(SystemExit) as exit_info:
            main(_args(run, cache))
    assert exit_info.value.code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("taco-train: error: checkpoint 6 in ") and "Out of memory" in last
    assert checkpoint_steps(run / "checkpoints") == [3, 6]
    assert (run / "metrics.jsonl").read_text() == records
    main(_args(run, cache, "run.steps=7"))
    assert "at step 6" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_is_archived_not_truncated(
    cache, tmp_path, capsys
):
    """A launch that logged steps but died before its first save leaves metrics and no
    checkpoint: the next launch starts from step 0 with that run archived (one line), not cut
    to nothing."""
    run = tmp_path / "run"
    main(_args(run, cache, "run.steps=2", "run.log_every=1", "run.checkpoint_every=100"))
    shutil.rmtree(run / "checkpoints")  # as if killed before its first save completed
    records = (run / "metrics.jsonl").read_text()
    assert records.count('"kind": "train"') == 2
    capsys.readouterr()
    main(_args(run, cache, "run.steps=1"))
    err = capsys.readouterr().err
    moved = [line for line in err.splitlines() if "was moved to" in line]
    assert len(moved) == 1 and moved[0].startswith(f"no checkpoint in {run}"), err
    (archived,) = (run / "archive").iterdir()
    assert (archived / "metrics.jsonl").read_text() == records


@pytest.mark.slow
def test_resume_with_another_dp_restores_and_continues(cache, tmp_path, capsys):
    """Stopped at step 3 on dp = 1, resumed on dp = 2 (twice the devices, TP and the model
    unchanged): orbax lays the checkpoint out on the new mesh, the change is said and
    recorded, and the run finishes with a good checkpoint."""
    run = tmp_path / "run"
    main(_args(run, cache, "run.stop_at=3"))
    capsys.readouterr()
    main(_args(run, cache, "parallel.dp=2"))
    err = capsys.readouterr().err
    assert "at step 3" in err and "from step 4: parallel.dp 1 -> 2" in err, err
    assert "| tp=2 (vmap) dp=2 |" in err
    train = [r for r in metrics.read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6] and all(np.isfinite(r["loss"]) for r in train)
    assert damage(run / "checkpoints" / "6") is None


def _wait_for_step_line(process, after: int) -> int:
    """Reads the run's console (stdout) until it logs a train step later than `after`; returns
    that step. A condition, not a duration: how long start-up and compiling take varies."""
    for line in process.stdout:
        found = re.match(r"step\s+(\d+) \| loss", line)
        if found and int(found[1]) > after:
            return int(found[1])
    raise AssertionError(f"the run ended (exit {process.wait()}) before logging a step > {after}")


def _start_run(args, stderr_path):
    """The run in a process of its own; its console's stdout is piped, its stderr goes to a
    file (a pipe nobody reads could fill and stall it)."""
    env = subprocess_env(PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "taco_train", *args]
    with open(stderr_path, "w") as stderr:
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True
        )


def _last_checkpoint(run) -> int:
    steps = [int(p.name) for p in (run / "checkpoints").glob("[0-9]*") if p.name.isdigit()]
    return max(steps, default=0)


@pytest.mark.slow
def test_kill_during_saves_never_loses_the_last_good_checkpoint(cache, tmp_path):
    """kill -9 at moments of a run (its own process) that saves every step, each right after
    the run logged its 1st to 3rd step since it (re)started: afterwards every checkpoint the
    directory offers as good is good, and a rerun finishes with the uninterrupted metrics."""
    run = tmp_path / "run"
    steps = ("run.steps=12", "run.log_every=1")
    args = _args(run, cache, "run.checkpoint_every=1", "run.keep_checkpoints=1", *steps)
    rng = np.random.default_rng(0)
    for _ in range(3):
        process = _start_run(args, tmp_path / "stderr.txt")
        start = _last_checkpoint(run)  # where this process resumes
        _wait_for_step_line(process, start + int(rng.integers(0, 3)))
        assert process.poll() is None, "the run ended before the kill: nothing was tested"
        process.send_signal(signal.SIGKILL)
        process.communicate()
        for step_dir in (run / "checkpoints").glob("[0-9]*"):
            if step_dir.name.isdigit() and (step_dir / MANIFEST).exists():
                assert damage(step_dir) is None
    main(args)  # the rerun resumes from what the kills left (in this process: compiled once)
    reference = tmp_path / "reference"
    main(_args(reference, cache, *steps))
    assert untimed(metrics.read_jsonl(run / "metrics.jsonl")) == untimed(
        metrics.read_jsonl(reference / "metrics.jsonl")
    )


def test_a_second_signal_exits_at_once(monkeypatch, capsys):
    """The first SIGINT asks for a stop after the step; the second ends the process at once
    with 128 + 2 (os._exit, replaced here so that the test process survives)."""
    exits = []

    def fake_exit(status):
        exits.append(status)

    monkeypatch.setattr(os, "_exit", fake_exit)
    with trainer.StopRequests() as stops:
        signal.raise_signal(signal.SIGINT)
        assert stops.received == signal.SIGINT and exits == []
        signal.raise_signal(signal.SIGINT)
        assert exits == [128 + signal.SIGINT]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "taco-train: SIGINT: stopping after the step in progress or the one queued behind it, "
        "with a checkpoint (again: exit at once)",
        "taco-train: SIGINT again: exiting at once, without a checkpoint",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_process_stops_in_one_line_and_resumes_exactly(signum, cache, tmp_path):
    """A scheduler's SIGTERM, or Ctrl-C, sent to the run's process once it logged its first
    step: exit 128 + the signal, one line naming the step, a good checkpoint of it; resuming to
    two steps later equals the uninterrupted run to that step, metrics and state."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    common = ("run.steps=1000", "run.log_every=1", "run.eval_every=1000")
    process = _start_run(_args(run, cache, *common), tmp_path / "stderr.txt")
    _wait_for_step_line(process, 0)
    process.send_signal(signum)
    process.communicate()
    err = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 128 + signum, err
    last = err.strip().splitlines()[-1]
    stopped = re.fullmatch(
        r"taco-train: SIG\w+: stopped at step (\d+); run the same command "
        r"to resume",
        last,
    )
    assert stopped, err
    step = int(stopped[1])
    assert damage(run / "checkpoints" / str(step)) is None
    end = f"run.stop_at={step + 2}"
    main(_args(run, cache, *common, end))
    main(_args(reference, cache, *common, end))
    ours = untimed(metrics.read_jsonl(run / "metrics.jsonl"))
    assert ours == untimed(metrics.read_jsonl(reference / "metrics.jsonl"))
    assert_same_state(run, reference, step + 2)


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    """keep=2 with good checkpoints 5 and 6 in the directory: saving step 1 keeps 1 and the
    newest other one; the checkpoint just written counts as the newest whatever its number."""
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=2)
    state = {"x": jnp.arange(4.0)}
    for step in (5, 6, 1):
        ckpt.save(step, state)
    ckpt.close()
    assert checkpoint_steps(tmp_path / "checkpoints") == [1, 6]
    assert damage(tmp_path / "checkpoints" / "1") is None


def test_archiving_moves_every_output_of_the_earlier_run_and_nothing_else(tmp_path):
    """The files a run writes move into archive/<UTC time>/ whole; other files stay; two
    archives within one second get distinct folders."""
    moved = ("config.json", "metrics.jsonl", "metrics.after-step-3.jsonl", "loss.png")
    for name in (*moved, "notes.txt"):
        (tmp_path / name).write_text(name)
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    first = trainer.archive_previous_run(tmp_path)
    assert first.parent == tmp_path / "archive"
    assert re.fullmatch(r"\d{8}T\d{6}Z", first.name), first.name
    assert sorted(p.name for p in first.iterdir()) == sorted((*moved, "checkpoints"))
    assert (first / "checkpoints" / "3").is_dir() and (first / "loss.png").read_text() == "loss.png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["archive", "notes.txt"]
    assert trainer.archive_previous_run(tmp_path) is None  # nothing left to move
    (tmp_path / "metrics.jsonl").write_text("")
    second = trainer.archive_previous_run(tmp_path)
    assert second != first and (second / "metrics.jsonl").exists()


@pytest.mark.slow
def test_starting_over_archives_the_earlier_run_and_reruns_resume_the_new_one(
    finished, cache, tmp_path, capsys
):
    """run.resume=false in a directory holding a finished 6-step run (checkpoints 3 and 6): the
    old run moves whole into archive/<UTC time>/ (one line), the new one's checkpoints survive,
    and the next plain rerun resumes the new run, not the old one."""
    run = _copy(finished, tmp_path)
    old_metrics = (run / "metrics.jsonl").read_text()
    new = ("run.steps=2", "run.checkpoint_every=1")
    main(_args(run, cache, *new, "run.resume=false"))
    out, err = capsys.readouterr()
    # The end-of-run line, and an unknown MFU said once (not "mfu n/a" on every line).
    summary = err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"done: steps 0 -> 2 \| train loss \d\.\d{{4}} \| val loss \d\.\d{{4}} \| [\d,]+ tok/s \| "
        rf"wall [\d.]+ s \| outputs in {re.escape(str(run.absolute()))}",
        summary,
    ), summary
    assert err.count("MFU not reported: the peak FLOP/s of a 'cpu' device is unknown") == 1
    assert "step      2 | loss" in out and "mfu" not in out
    moved = [line for line in err.splitlines() if "was moved to" in line]
    assert len(moved) == 1 and moved[0].startswith("run.resume=false: the earlier run in"), err
    (archived,) = (run / "archive").iterdir()
    assert moved[0].endswith(str(archived))
    assert checkpoint_steps(archived / "checkpoints") == [3, 6]
    assert (archived / "metrics.jsonl").read_text() == old_metrics
    assert (archived / "config.json").exists() and (archived / "loss.png").exists()
    assert checkpoint_steps(run / "checkpoints") == [1, 2]
    assert {r["step"] for r in metrics.read_jsonl(run / "metrics.jsonl")} <= {1, 2}
    main(_args(run, cache, *new))  # the plain rerun
    err = capsys.readouterr().err
    assert "resuming from" in err and "at step 2" in err and "steps 2 -> 2" in err, err


@pytest.mark.slow
def test_resuming_with_changed_math_says_and_records_each_change(finished, cache, tmp_path, capsys):
    """A resume may lengthen the run and change codecs and optimizer hyperparameters: one line
    per key (old -> new, from which step), appended to config_history.jsonl; config.json holds
    the new values."""
    run = _copy(finished, tmp_path)
    changed = ("run.steps=8", "optimizer.lr=0.001", "compression.fwd='none'")
    main(_args(run, cache, *changed))
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("from step")] == [
        "from step 7: compression.fwd 'taco' -> 'none'",
        "from step 7: optimizer.lr 0.003 -> 0.001",
        "from step 7: run.steps 6 -> 8",
    ]
    (entry,) = metrics.read_jsonl(run / "config_history.jsonl")
    assert entry["after_step"] == 6 and entry["changes"] == {
        "compression.fwd": {"old": "taco", "new": "none"},
        "optimizer.lr": {"old": 0.003, "new": 0.001},
        "run.steps": {"old": 6, "new": 8},
    }
    assert json.loads((run / "config.json").read_text())["optimizer"]["lr"] == 0.001
    assert max(r["step"] for r in metrics.read_jsonl(run / "metrics.jsonl")) == 8
    main(_args(run, cache, *changed))  # the same command again: nothing changed, nothing to do
    err = capsys.readouterr().err
    assert "from step" not in err and "nothing to train; raise run.steps to go on" in err, err
    assert len(metrics.read_jsonl(run / "config_history.jsonl")) == 1


def _wait_for_a_save(run, process, after: int = 0) -> None:
    """Until the run (its own process) records a checkpoint after step `after` in metrics.jsonl:
    training is under way. A condition, not a duration."""
    path = run / "metrics.jsonl"
    while process.poll() is None:
        try:
            records = metrics.read_jsonl(path)
        except json.JSONDecodeError:  # a line being written
            records = []
        if any(r["kind"] == "checkpoint" and r["step"] > after for r in records):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended (exit {process.returncode}) before it saved")


def signal_latency(err: str, name: str) -> tuple[int, int]:
    """(the last step done when the signal was handled, the step the run stopped at) from a
    signalled run's stderr."""
    heard = re.search(rf"taco-train: {name} after step (\d+): stopping ", err)
    stopped = re.search(rf"taco-train: {name}: stopped at step (\d+); run the same command", err)
    assert heard and stopped, err
    return int(heard[1]), int(stopped[1])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_within_a_step_of_its_arrival(signum, cache, tmp_path):
    """A signal sent mid-run, with no log step to wait for (run.log_every=1000): the run stops
    after the step in progress or the one queued behind it, at most two steps after the last
    it had done (before: at the next log step, ten steps later with the default), with a good
    checkpoint of that step, exit 128 + the signal."""
    run = tmp_path / "run"
    steps = ("run.steps=1000", "run.log_every=1000", "run.eval_every=1000")
    process = _start_run(_args(run, cache, *steps, "run.checkpoint_every=4"), tmp_path / "err")
    _wait_for_a_save(run, process)
    process.send_signal(signum)
    process.communicate(timeout=120)
    err = (tmp_path / "err").read_text()
    assert process.returncode == 128 + signum, err
    done, stopped = signal_latency(err, signal.Signals(signum).name)
    assert done <= stopped <= done + 2, err
    assert damage(run / "checkpoints" / str(stopped)) is None
