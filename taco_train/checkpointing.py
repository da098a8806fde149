"""Orbax checkpoints of the `TrainState` (orbax-checkpoint 0.12 `CheckpointManager` API).

Restoring uses an abstract state carrying the target shardings, so each process reads only its
shards and the restored arrays are placed exactly where `train_step` expects them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_state(init, state_sharding, key: jax.Array) -> Any:
    """Shapes, dtypes and shardings of `init(key)` without computing it."""
    shapes = jax.eval_shape(init, key)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state_sharding
    )


class Checkpointer:
    """Saves every `save(step, state)` (asynchronously), keeps the newest `keep`."""

    def __init__(self, directory: str | Path, keep: int):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any) -> None:
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(self, step: int, target: Any) -> Any:
        """The state saved at `step`, laid out like `target` (an `abstract_state`)."""
        return self._manager.restore(step, args=ocp.args.StandardRestore(target))

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
