"""Orbax checkpoints of the `TrainState` that count only once they are verified.

A save is complete when orbax has finalized the step directory and this module has written a
manifest beside it (`taco_manifest.json`: the sha256 of every file of the step). Only steps whose
files still match their manifest are "good": restoring takes the newest good step and says in
one line why it skipped any newer one (truncated, damaged or unfinished files, or a restore that
failed), and old checkpoints are deleted only when `keep` newer good ones exist, so the last good
checkpoint is never deleted for a newer one that is not.

Restoring uses an abstract state carrying the target shardings, so each process reads only its
shards and the restored arrays are placed exactly where `train_step` expects them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

MANIFEST = "taco_manifest.json"


def abstract_state(init, state_sharding, key: jax.Array) -> Any:
    """Shapes, dtypes and shardings of `init(key)` without computing it."""
    shapes = jax.eval_shape(init, key)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state_sharding
    )


def _file_hashes(step_dir: Path) -> dict[str, str]:
    hashes = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            with open(path, "rb") as f:  # streamed: checkpoint files can be large
                hashes[str(path.relative_to(step_dir))] = hashlib.file_digest(
                    f, "sha256"
                ).hexdigest()
    return hashes


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


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stderr, flush=True)


class Checkpointer:
    """Saves `save(step, state)` and verifies it; keeps the newest `keep` good checkpoints."""

    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory).absolute()
        self.keep = keep
        # Deletion is this class's (only of good checkpoints' elders), never orbax's own.
        options = ocp.CheckpointManagerOptions(max_to_keep=None, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def steps(self) -> list[int]:
        """Every checkpoint step orbax finalized, good or not."""
        return list(self._manager.all_steps())

    def completed_steps(self) -> list[int]:
        """Steps whose save finished with a manifest (verified when written, not re-read here:
        restoring verifies them again)."""
        return [s for s in self.steps() if (self._step_dir(s) / MANIFEST).exists()]

    def save(self, step: int, state: Any) -> None:
        """Writes the checkpoint, waits until it is complete, then records its manifest."""
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self._manager.wait_until_finished()
        if jax.process_index() == 0:
            hashes = _file_hashes(self._step_dir(step))
            (self._step_dir(step) / MANIFEST).write_text(json.dumps(hashes, indent=0))
        multihost_utils.sync_global_devices(f"checkpoint {step} verified")
        self._prune(step)

    def _prune(self, written: int) -> None:
        """Deletes the oldest good checkpoints beyond `keep`, counting the one just `written` as
        the newest whatever its number (a run started over in a directory that still held
        higher steps must not delete what it just saved). Every process calls it (orbax's
        delete waits for all of them)."""
        others = sorted(s for s in self.completed_steps() if s != written)
        for old in (others + [written])[: -self.keep]:
            self._manager.delete(old)

    def restore_newest_good(self, target: Any) -> tuple[Any, int] | None:
        """The newest checkpoint that is good and restores, laid out like `target` (an
        `abstract_state`), with its step; None when there is none.

        Each newer checkpoint that is skipped is reported in one line and moved aside to
        `<step>.unusable` (kept for inspection, out of the way of the run's next saves).
        """
        for step in sorted(self.steps(), reverse=True):
            reason = damage(self._step_dir(step))
            if reason is None:
                try:
                    return self._manager.restore(step, args=ocp.args.StandardRestore(target)), step
                except Exception as error:  # noqa: BLE001 -- a damaged checkpoint, whatever broke
                    reason = f"restoring it failed ({type(error).__name__})"
            self._set_aside(step, reason)
        return None

    def _set_aside(self, step: int, reason: str) -> None:
        aside = self.directory / f"{step}.unusable"
        if jax.process_index() == 0:
            self._step_dir(step).rename(aside)
        multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
        self._manager.reload()
        _say(f"checkpoint {step} in {self.directory} is not usable: {reason}; moved to {aside}")

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
