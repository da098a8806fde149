"""Per-collective compression telemetry: the relative error of each compressed collective.

When a `CommConfig` has `telemetry=True`, each compressed collective also runs the exact lax
collective on the same input and records `||out - exact|| / ||exact||` on the host through
`jax.debug.callback`. That costs a second (uncompressed) collective, so it is a debugging and
study tool, not a production setting. `drain()` returns the mean error per tag since the last call.
"""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np

_lock = threading.Lock()
_sums: dict[str, float] = collections.defaultdict(float)
_counts: dict[str, int] = collections.defaultdict(int)


def _accumulate(tag: str, errors, counted=None) -> None:
    values = np.asarray(errors, dtype=np.float64).reshape(-1)
    if counted is not None:  # ranks that took part (e.g. a ppermute's receivers)
        values = values[np.asarray(counted, bool).reshape(-1)]
    with _lock:
        _sums[tag] += float(values.sum())
        _counts[tag] += values.size


def relative_error(approx: jax.Array, exact: jax.Array) -> jax.Array:
    """||approx - exact|| / ||exact|| in fp32 (0 when both are 0; NaN stays NaN)."""
    # Sums of squares, not norms of ravelled arrays: a reduction needs no out_sharding on a
    # mesh of `Explicit` axes, where a reshape of a sharded array may.
    diff = jnp.sqrt(jnp.sum(jnp.square(approx.astype(jnp.float32) - exact.astype(jnp.float32))))
    norm = jnp.sqrt(jnp.sum(jnp.square(exact.astype(jnp.float32))))
    return jnp.where(norm > 0, diff / jnp.where(norm > 0, norm, 1.0), diff)


def record(tag: str, approx: jax.Array, exact: jax.Array, counted: jax.Array | None = None):
    """Records the relative error of `approx` against `exact` under `tag` (works under jit/vmap);
    with `counted` (a bool scalar per rank), only where it is true."""
    error = relative_error(approx, exact)
    if counted is None:
        jax.debug.callback(lambda err: _accumulate(tag, err), error)
    else:
        jax.debug.callback(lambda err, c: _accumulate(tag, err, c), error, counted)


def drain() -> dict[str, float]:
    """Mean relative error per tag recorded since the last `drain()`; resets the accumulators.

    Blocks until pending device work has reported (effects barrier), so call it after a step.
    """
    jax.effects_barrier()
    with _lock:
        means = {tag: _sums[tag] / _counts[tag] for tag in _sums if _counts[tag]}
        _sums.clear()
        _counts.clear()
    return means
