"""Orbax checkpoints of the `TrainState` that count only once they are verified.

A save is complete when orbax has finalized the step directory and this module has written a
manifest beside it (`taco_manifest.json`: the sha256 of every file of the step). Only steps whose
files still match their manifest are "good": restoring takes the newest good step and says in
one line why it skipped any newer one (truncated, damaged or unfinished files: those alone are
moved aside), and old checkpoints are deleted only when `keep` newer good ones exist, so the last
good checkpoint is never deleted for a newer one that is not. A good checkpoint that fails to
restore (a device out of memory, a filesystem error, another orbax) is not damaged: the restore
stops with `RestoreError` and moves nothing.

Each checkpoint is read once to verify it, by process 0, which hands its verdict to the others
(and each restore's outcome is agreed the same way): processes that see the shared filesystem
differently still take the same branch, and N processes do not read the files N times.

Saves are asynchronous by default (orbax's async checkpointing): `save` returns once the state
is copied to host memory; orbax writes the files and a thread of process 0 then hashes them into
the manifest while training goes on. The guarantees stay: the checkpoint counts (and older ones
are pruned) only after that, which the next save, `wait` and `close` wait for, so a crash
mid-save leaves the previous good checkpoint, and the run's end waits for the save in flight.

Beside the state a checkpoint holds a little JSON (orbax's custom metadata, in a file of the step
that the manifest covers): the error budget's fallbacks, which a resumed run keeps.

A save copies the state to pinned host memory first (orbax's default on GPUs), which the
runtime pins the first time it is needed and keeps for later copies: pinning takes about half
a second per GiB, so `reserve_host_memory` pins it beside the start-up compiles, not in the first
save's pause (decision 018).

Restoring uses an abstract state carrying the target shardings, so each process reads only its
shards and the restored arrays are placed exactly where `train_step` expects them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import SingleDeviceSharding

MANIFEST = "taco_manifest.json"

# Threads hashing a checkpoint's files: 8 read a GPT-1.3B checkpoint (24 files) in 9.2 s where
# one took 14.1 s (one H100 machine's local disk, decision 018).
HASH_THREADS = 8


def abstract_state(init, state_sharding, key: jax.Array) -> Any:
    """Shapes, dtypes and shardings of `init(key)` without computing it."""
    shapes = jax.eval_shape(init, key)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state_sharding
    )


def _file_hashes(step_dir: Path) -> dict[str, str]:
    """The sha256 of every file in `step_dir` but the manifest, by relative name. Files are
    hashed on several threads (hashlib lets go of the GIL), as a checkpoint is a few large files."""
    paths = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)

    def digest(path: Path) -> str:
        with open(path, "rb") as f:  # streamed: checkpoint files can be large
            return hashlib.file_digest(f, "sha256").hexdigest()

    with concurrent.futures.ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = pool.map(digest, paths)
        return {str(p.relative_to(step_dir)): d for p, d in zip(paths, digests, strict=True)}


def pin_host_copy(state: Any) -> int:
    """Copies to pinned host memory what an orbax save of this process copies there (`_saved`)
    and lets the copies go; returns their bytes. The runtime keeps the pinned memory for the
    next copies of that size, so a save's copy then finds it pinned."""
    copies = [
        jax.device_put(part, SingleDeviceSharding(part.device, memory_kind="pinned_host"))
        for leaf in jax.tree.leaves(state)
        if isinstance(leaf, jax.Array)
        for part in _saved(leaf)
    ]
    jax.block_until_ready(copies)
    return sum(copy.nbytes for copy in copies)


def _saved(leaf: jax.Array) -> list[jax.Array]:
    """The device arrays of `leaf` an orbax save of this process copies to host memory. orbax
    chooses them (replica 0; a replicated array split between its replicas, unless
    JAX_PLATFORMS names a GPU): its own choice where its (private) function is as in 0.12, else
    replica 0's shards."""
    try:
        from orbax.checkpoint._src.serialization import jax_array_handlers, replica_slices

        parallel = jax_array_handlers._get_default_use_replica_parallel()
        chosen = replica_slices.get_replica_slices(leaf, 0, parallel).replica_slices
        return [part.data() for part in chosen]
    except (ImportError, AttributeError, TypeError):
        return [shard.data for shard in leaf.addressable_shards if shard.replica_id == 0]


def damage(step_dir: Path) -> str | None:
    """Why the checkpoint in `step_dir` is not good (None: its files match its manifest)."""
    manifest = step_dir / MANIFEST
    if not manifest.exists():
        return "it was never completed (no manifest)"
    try:
        expected = json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"its manifest {manifest} is unreadable"
    actual = _file_hashes(step_dir)
    for name in sorted(set(expected) | set(actual)):
        if expected.get(name) != actual.get(name):
            what = "missing" if name not in actual else "changed"
            return f"its file {name} is {what}"
    return None


def read_arrays(step_dir: Path, keys: tuple[str, ...]) -> Any:
    """The subtree at `keys` (e.g. ("params",), ("opt_state", "master")) of the state saved in
    `step_dir`, as NumPy arrays in host memory: no device, mesh or layout is needed, so any
    machine reads any run's checkpoint."""
    path = (Path(step_dir) / "default").absolute()  # the CheckpointManager's one item
    checkpointer = ocp.PyTreeCheckpointer()
    with _quiet("absl"):  # orbax warns that this item has no metadata file of its own
        tree = checkpointer.metadata(path).item_metadata.tree
    for key in keys:
        tree = tree[key]
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    nest = lambda leaf: functools.reduce(lambda inner, key: {key: inner}, reversed(keys), leaf)
    restored = checkpointer.restore(
        path,
        args=ocp.args.PyTreeRestore(
            item=nest(tree), restore_args=nest(as_numpy), partial_restore=True
        ),
    )
    for key in keys:
        restored = restored[key]
    return restored


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Only errors from the logger `logger_name` while inside."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _timed(function, *args) -> tuple[Any, float]:
    started = time.perf_counter()
    return function(*args), time.perf_counter() - started


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


class RestoreError(RuntimeError):
    """A checkpoint that matches its manifest could not be restored or read; nothing was moved
    (the error may pass: a device out of memory, a filesystem hiccup)."""


def from_process_0(value: Any) -> Any:
    """Process 0's `value` (JSON) on every process: one process reads the shared filesystem and
    decides, so that every process takes the same branch."""
    if jax.process_count() == 1:
        return value
    return json.loads(_gathered_text(json.dumps(value) if jax.process_index() == 0 else "")[0])


def _gathered_text(text: str) -> list[str]:
    """Every process's `text`, in process order, on every process (a collective)."""
    payload = np.frombuffer(text.encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(payload.size))).reshape(-1)
    padded = np.zeros(max(int(np.max(sizes)), 1), np.uint8)
    padded[: payload.size] = payload
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [bytes(row[: int(size)]).decode() for row, size in zip(rows, sizes, strict=True)]


def _one_line(error: BaseException) -> str:
    """`error` as one short line: its type and the first line of its message."""
    first = (str(error).strip().splitlines() or [""])[0]
    first = first if len(first) <= 200 else first[:197] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def saved_steps(directory: Path) -> list[int]:
    """The steps of the checkpoint directories in `directory` (finished or not), ascending."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def set_aside(directory: Path) -> list[str]:
    """The checkpoints of `directory` moved aside as not usable (`<step>.unusable`), by name."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.glob("*.unusable") if p.is_dir())


class Checkpointer:
    """Saves `save(step, state)` and verifies it; keeps the newest `keep` good checkpoints."""

    def __init__(
        self,
        directory: str | Path,
        keep: int,
        asynchronous: bool = True,
        pin_ahead: bool | None = None,
    ):
        """`pin_ahead`: whether `reserve_host_memory` pins host memory (None: where orbax's
        saves copy through pinned host memory, on GPUs)."""
        self.directory = Path(directory).absolute()
        self.keep = keep
        self.asynchronous = asynchronous
        if pin_ahead is None:
            pin_ahead = jax.default_backend() == "gpu"
        self.pin_ahead = pin_ahead
        self._reserving: concurrent.futures.Future | None = None
        # Deletion is this class's (only of good checkpoints' elders), never orbax's own.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=True, enable_async_checkpointing=asynchronous
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._pending: int | None = None  # the step of the save in flight
        self.previous_wait_s = 0.0  # of the last `save`: waiting for the one before it
        self._verifier: threading.Thread | None = None
        self._verify_error: BaseException | None = None

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def reserve_host_memory(self, state: Any) -> None:
        """Starts pinning, on a thread, the host memory a save copies `state` into
        (`pin_host_copy`), so that the first save does not pin it in the loop's pause (6-10 s
        for a GPT-1.3B state on one H100). `host_memory_reserved` must be called before
        `state` is donated (the first train step): the thread reads it."""
        if self.pin_ahead:
            pool = concurrent.futures.ThreadPoolExecutor(1, "pin host memory")
            self._reserving = pool.submit(_timed, pin_host_copy, state)
            pool.shutdown(wait=False)

    def host_memory_reserved(self) -> str | None:
        """Waits for `reserve_host_memory`; what it did, in a line (None: nothing to do)."""
        if self._reserving is None:
            return None
        reserving, self._reserving = self._reserving, None
        try:
            nbytes, seconds = reserving.result()
        except Exception as error:  # noqa: BLE001 -- the first save pins it instead
            return f"host memory for checkpoints not pinned ahead ({_one_line(error)})"
        return f"pinned {nbytes / 2**30:.2f} GiB of host memory for checkpoints in {seconds:.1f} s"

    def steps(self) -> list[int]:
        """Every checkpoint step orbax finalized, good or not."""
        return list(self._manager.all_steps())

    def completed_steps(self) -> list[int]:
        """Steps whose save finished with a manifest (verified when written, not re-read here:
        restoring verifies them again)."""
        return [s for s in self.steps() if (self._step_dir(s) / MANIFEST).exists()]

    def save(self, step: int, state: Any, metadata: dict[str, Any] | None = None) -> float:
        """Saves the checkpoint of `step`, with `metadata` (JSON, e.g. the error budget's
        fallbacks; `metadata(step)` reads it back); returns the seconds the caller was blocked.

        It first waits for the save before it (`wait`). Synchronous, it returns once the new
        checkpoint is complete and verified; asynchronous, once orbax holds the state in host
        memory (the state may then change: `train_step` donates it), the rest in background.
        Of the seconds returned, `previous_wait_s` went to waiting for the save before it; the
        rest is orbax's (asynchronous: its copy of the state to host memory).
        """
        started = time.perf_counter()
        self.wait()
        self.previous_wait_s = time.perf_counter() - started
        self._manager.save(
            step, args=ocp.args.StandardSave(state), force=True, custom_metadata=metadata or {}
        )
        self._pending = step
        if jax.process_index() == 0:
            if self.asynchronous:
                self._verifier = threading.Thread(
                    target=self._verify, args=(step,), name=f"verify checkpoint {step}", daemon=True
                )
                self._verifier.start()
            else:
                self._verify(step)
        if not self.asynchronous:
            self.wait()
        return time.perf_counter() - started

    def _verify(self, step: int) -> None:
        """Waits for orbax to finish writing `step`, then writes its manifest (process 0)."""
        try:
            self._manager.wait_until_finished()
            hashes = _file_hashes(self._step_dir(step))
            partial = self._step_dir(step) / f".{MANIFEST}.partial"
            partial.write_text(json.dumps(hashes, indent=0))
            os.replace(partial, self._step_dir(step) / MANIFEST)  # whole or absent
        except BaseException as error:  # noqa: BLE001 -- re-raised by `wait` in the main thread
            self._verify_error = error

    def wait(self) -> None:
        """Waits for the save in flight: written, verified (its manifest), and the checkpoints
        beyond `keep` pruned. Raises what went wrong in it."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        self._manager.wait_until_finished()
        if self._verifier is not None:
            self._verifier.join()
            self._verifier = None
        if self._verify_error is not None:
            error, self._verify_error = self._verify_error, None
            raise error
        multihost_utils.sync_global_devices(f"checkpoint {step} verified")
        self._prune(step)

    def _prune(self, written: int) -> None:
        """Deletes the oldest good checkpoints beyond `keep`, counting the one just `written` as
        the newest whatever its number (a run started over in a directory that still held
        higher steps must not delete what it just saved). Every process calls it (orbax's
        delete waits for all of them)."""
        # Process 0's list: processes that see the directory differently delete the same.
        others = from_process_0(sorted(s for s in self.completed_steps() if s != written))
        for old in (others + [written])[: -self.keep]:
            self._manager.delete(old)

    def restore_newest_good(self, target: Any) -> tuple[Any, int] | None:
        """The newest good checkpoint, laid out like `target` (an `abstract_state`), with its
        step; None when there is none.

        Each newer checkpoint whose files do not match its manifest is reported in one line and
        moved aside to `<step>.unusable` (kept for inspection, out of the way of the run's next
        saves). Any other error, reading or restoring one, raises `RestoreError` naming it, and
        moves nothing: a transient error must not demote good checkpoints.
        """
        for step in from_process_0(sorted(self.steps(), reverse=True)):
            reason = self._verdict(step)
            if reason is None:
                return self._restore(step, target), step
            self._set_aside(step, reason)
        return None

    def _verdict(self, step: int) -> str | None:
        """`damage` of `step`, found by process 0 alone (one read of the files) and agreed by
        every process; `RestoreError` where the files could not be read (not damage)."""
        verdict = {"damage": None}
        if jax.process_index() == 0:
            try:
                verdict = {"damage": damage(self._step_dir(step))}
            except OSError as error:
                verdict = {"error": _one_line(error)}
        verdict = from_process_0(verdict)
        if "error" in verdict:
            raise RestoreError(
                f"checkpoint {step} in {self.directory} could not be read to verify it "
                f"({verdict['error']}); nothing was moved: run again once the error is fixed"
            )
        return verdict["damage"]

    def _restore(self, step: int, target: Any) -> Any:
        """Orbax's restore of the good checkpoint `step` on every process; `RestoreError` on
        every process where it failed on any (each would otherwise go its own way)."""
        failure = ""
        try:
            state = self._manager.restore(step, args=ocp.args.StandardRestore(target))
        except Exception as error:  # noqa: BLE001 -- named in the RestoreError below
            state, failure = None, _one_line(error)
        failures = [failure] if jax.process_count() == 1 else _gathered_text(failure)
        failed = [(rank, text) for rank, text in enumerate(failures) if text]
        if failed:
            rank, text = failed[0]
            where = f" on process {rank}" if jax.process_count() > 1 else ""
            raise RestoreError(
                f"checkpoint {step} in {self.directory} matches its manifest but did not restore"
                f"{where} ({text}); nothing was moved: run again once the error is fixed"
            )
        return state

    def metadata(self, step: int) -> dict[str, Any]:
        """The `metadata` saved with the checkpoint of `step` ({} for one saved without)."""
        return dict(self._manager.metadata(step).custom_metadata or {})

    def _set_aside(self, step: int, reason: str) -> None:
        aside = self.directory / f"{step}.unusable"
        if jax.process_index() == 0:
            self._step_dir(step).rename(aside)
        multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
        self._manager.reload()
        _say(f"checkpoint {step} in {self.directory} is not usable: {reason}; moved to {aside}")

    def close(self) -> None:
        """Waits for the save in flight (`wait`), then closes orbax's manager."""
        try:
            self.wait()
        finally:
            self._manager.close()
