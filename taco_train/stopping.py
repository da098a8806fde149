"""Stopping a run on SIGTERM or SIGINT after the step in progress, every process at one step.

Schedulers send SIGTERM before they preempt a job (and kill it after a grace period, often
30 s); Ctrl-C is SIGINT. While `StopRequests` is active the first such signal asks the loop to
stop with a checkpoint; a second ends the process at once.

How soon: the loop keeps at most two steps in flight (the device runs one while the next is
queued; `taco_train.trainer` waits for step k - 1 before it dispatches step k + 1), so a signal
that arrives during step k stops one process after step k + 1 at most, the step queued behind
the one in progress, and its checkpoint follows.

Several processes must stop after the same step (each step is one program over all of them),
and agree on it without waiting for anything the loop does not already wait for: a signalled
process posts a request in the coordination service of `jax.distributed` (its key-value
store); a thread of each process watches for it and posts the last step its process committed
to (the step it runs, or the next one where it is past the point of deciding); all stop after
the largest posted step, at most one step after the one a process had queued (processes may
run a step apart), so two steps after the step in progress where the signal arrived.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
from typing import Any

import jax

# Keys of the coordination service, under a prefix per `StopRequests` of the job (every process
# makes the same ones in the same order): "request", a signalled process's signal number, and
# "at/<process>", the last step each process committed to.
_KEY_PREFIX = "taco_train/stop/{}/"
_instances = itertools.count()
WATCH_TIMEOUT_MS = 1000  # the watcher re-asks this often (to notice the run ended)


class Stopped(Exception):
    """A SIGTERM or SIGINT stopped the run after a step, with a checkpoint of that step.

    The command line prints it as one line and exits with 128 + the signal's number (143 for
    SIGTERM, 130 for SIGINT), as a shell reports a process the signal ended."""

    def __init__(self, signum: int, step: int):
        name = signal.Signals(signum).name
        super().__init__(f"{name}: stopped at step {step}; run the same command to resume")
        self.exit_status = 128 + signum


def _client():
    """The coordination service's client of `jax.distributed` (no public form; orbax reads it
    the same way)."""
    from jax._src import distributed

    return distributed.global_state.client


class StopRequests:
    """While active (a context manager, in the main thread), SIGTERM and SIGINT ask the loop to
    stop after the current step instead of ending the process. A second signal ends the
    process at once (exit 128 + its number), without a checkpoint; the last complete one stays
    good. The loop tells it which steps are in flight (`dispatched`) and asks after each step
    whether to stop there (`decide`)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None  # the signal this process received
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._committed = 0  # the last step this process runs before it next decides
        self._in_flight: list[tuple[int, Any]] = []  # (step, an output of it), newest last
        self._several = jax.process_count() > 1
        self._agreed = threading.Event()
        self._stop: tuple[int, int] | None = None  # (signal, step) every process stops after
        self._posted = False
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self._keys = _KEY_PREFIX.format(next(_instances))

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # where Python runs handlers
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        if self._several:
            self._watcher = threading.Thread(target=self._watch, name="stop requests", daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join()

    def dispatched(self, step: int, out) -> None:
        """The loop dispatched `step`, whose outputs are `out` (kept to say, on a signal, which
        step the device was running)."""
        with self._lock:
            self._committed = step
            leaf = jax.tree.leaves(out)[0]
            self._in_flight = [*self._in_flight[-1:], (step, leaf)]

    def decide(self, step: int) -> int | None:
        """The signal to stop for after `step` (the step just run), or None: go on. Where a stop
        was requested and the processes have not agreed yet, waits until they do (the others
        are at most a step away: their watchers answer at once)."""
        if not self._several:
            return self.received
        with self._lock:
            if not self._posted:
                self._committed = step + 1  # decided: this process goes on to the next step
                return None
        while not self._agreed.wait(timeout=0.1):  # short waits: signal handlers run between
            pass
        signum, last = self._stop
        if step > last:  # the loop stops at `last`; never run past it
            raise RuntimeError(f"step {step} ran past the agreed stop after step {last}")
        return signum if step == last else None

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(
                f"taco-train: {name} again: exiting at once, without a checkpoint",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)
            return  # (only where os._exit is replaced, as in a test)
        self.received = signum
        done = self._last_done()
        when = f" after step {done}" if done is not None else ""
        plan = "stopping after the step in progress or the one queued behind it, with a checkpoint"
        if self._several:
            plan = "stopping once the processes agree on a step, with a checkpoint"
            try:
                _client().key_value_set(self._keys + "request", str(signum), allow_overwrite=True)
            except jax.errors.JaxRuntimeError as error:  # never raised into the loop's work
                plan = f"the other processes could not be told ({error}): the run goes on"
        print(
            f"taco-train: {name}{when}: {plan} (again: exit at once)", file=sys.stderr, flush=True
        )

    def _last_done(self) -> int | None:
        """The last step the device finished, of those the loop told of (None: none yet)."""
        with self._lock:
            in_flight = list(self._in_flight)
        done = [step for step, leaf in in_flight if leaf.is_ready()]
        if len(done) == len(in_flight):
            return in_flight[-1][0] if in_flight else None
        return max(done, default=in_flight[0][0] - 1)

    def _watch(self) -> None:
        """The watcher thread (several processes): waits for a request, posts this process's
        last committed step, then waits for every process's post and sets the agreed stop."""
        client = _client()
        while not self._closing.is_set():
            asked = time.monotonic()
            try:
                request = client.blocking_key_value_get(self._keys + "request", WATCH_TIMEOUT_MS)
                break
            except jax.errors.JaxRuntimeError:  # the timeout: ask again, unless the run ended
                if time.monotonic() - asked < WATCH_TIMEOUT_MS / 2000:  # not a timeout: back off
                    self._closing.wait(0.1)
        else:
            return
        with self._lock:
            self._posted = True
            committed = self._committed
        client.key_value_set(f"{self._keys}at/{jax.process_index()}", str(committed))
        while not self._closing.is_set():
            posts = client.key_value_dir_get(self._keys + "at/")
            if len(posts) == jax.process_count():
                signum, last = int(request), max(int(value) for _, value in posts)
                self._stop = (signum, last)
                self._agreed.set()
                if jax.process_index() == 0:
                    name = signal.Signals(signum).name
                    print(
                        f"taco-train: {name}: the processes stop after step {last}",
                        file=sys.stderr,
                        flush=True,
                    )
                return
            self._closing.wait(0.01)
