"""Noticing a preemption (SIGTERM) and agreeing on the step to stop at.

While a `PreemptionWatch` is armed, SIGTERM no longer kills the process: it
sets a flag, and the training loop stops at the next step boundary, after the
callbacks that handle preemption (BackupAndRestore) have saved. In a
multi-process job JAX's preemption sync point makes every process stop at the
same step. `fit` then raises `Preempted`, which exits with status 143
(128 + SIGTERM) unless caught.
"""

from __future__ import annotations

import signal
import threading

import jax

from meshfit import compat

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class Preempted(SystemExit):
    """Raised by `fit` after a preemption was handled; exits with `PREEMPTED_EXIT_CODE`."""

    def __init__(self, message: str = "Training was preempted (SIGTERM); a backup was saved."):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class PreemptionWatch:
    """Arms a SIGTERM handler (main thread only) for the duration of a `with` block.

    Once a SIGTERM was seen, further ones are ignored after the block too:
    the preemption backup is written and the process exits with status 143.
    """

    def __init__(self):
        self.requested = False
        self._last_step = None
        self._previous = None
        self._armed = False

    def __enter__(self):
        # In a multi-process job JAX's own preemption notifier owns SIGTERM.
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._armed = True
        return self

    def __exit__(self, *exc):
        if self._armed:
            # After a preemption the process is on its way out with status 143: a repeated
            # SIGTERM (schedulers send more than one) must not turn that into a kill by signal.
            signal.signal(signal.SIGTERM, signal.SIG_IGN if self.requested else self._previous)
            self._armed = False

    def _on_sigterm(self, signum, frame):
        del signum, frame
        self.requested = True

    def should_stop(self, step: int) -> bool:
        """True at the step every process stops at (checked between executions).

        JAX's sync point is one step number agreed by all processes; an
        execution of K steps asks about each of them, so it cannot be skipped.
        """
        if jax.process_count() > 1 and compat.preemption_sync_manager() is not None:
            from jax.experimental import multihost_utils

            first = step if self._last_step is None else self._last_step + 1
            self._last_step = step
            return any([multihost_utils.reached_preemption_sync_point(s) for s in range(first, step + 1)])
        return self.requested
