"""Stopping a run cleanly: SIGTERM or a time limit, agreed on by every host."""

from __future__ import annotations

import signal
import time

import jax
import numpy as np


class StopRequest:
    """Stop cleanly (checkpoint, then exit) on SIGTERM — a preempted TPU host, `timeout` —
    or after `max_seconds`. Hosts agree on the step: the flags are gathered every
    `log_every` steps, so every process saves the same checkpoint."""

    def __init__(self, max_seconds: float):
        self.deadline = time.monotonic() + max_seconds if max_seconds > 0 else None
        self.signalled = False
        self._previous = None
        try:
            self._previous = signal.signal(signal.SIGTERM, self._on_term)
        except ValueError:  # not the main thread: no handler, the deadline still works
            pass

    def _on_term(self, signum, frame):
        self.signalled = True

    def now(self, step: int, every: int) -> bool:
        if step % max(every, 1):
            return False
        wanted = self.signalled or (self.deadline is not None
                                    and time.monotonic() > self.deadline)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            wanted = bool(np.any(multihost_utils.process_allgather(np.asarray(wanted))))
        return wanted

    def release(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
