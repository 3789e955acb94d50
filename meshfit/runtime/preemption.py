"""Noticing a preemption (SIGTERM) and agreeing on the step to stop at.

While a `PreemptionWatch` is armed, SIGTERM no longer kills the process: it
sets a flag, and the training loop stops at the next step boundary, after the
callbacks that handle preemption (BackupAndRestore) have saved. In a
multi-process job JAX's preemption sync point makes every process stop at the
same step. `fit` then raises `Preempted`, which exits with status 143
(128 + SIGTERM) unless caught.

The wait is bounded (`meshfit.runtime.signal_deadline`): if the fit has not ended
`timeout` seconds after the SIGTERM (no step boundary came: a hung compile,
input, callback or collective; or the backup is not written in time), the
process exits with status 143 without saving; after a SIGINT, whose
KeyboardInterrupt never surfaces while the main thread is stuck in C, with 130.
"""

from __future__ import annotations

import ctypes
import signal
import threading

import jax

from meshfit.core import compat
from meshfit.runtime.signal_deadline import SignalDeadline, main_thread_activity

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
#: Seconds from a SIGTERM (or SIGINT) to the process's end at the latest, by default: within the 30 s a
#: scheduler waits before its SIGKILL (Kubernetes' terminationGracePeriodSeconds, SLURM's KillWait, a GCE
#: preemption), leaving 5 s to log why and exit with 143 rather than be killed without a word.
DEFAULT_PREEMPTION_TIMEOUT = 25.0

#: What each phase of `meshfit.training.fit_timer` means to someone waiting for a step boundary.
_WAITING = {
    "input": "waiting for input",
    "steps": "waiting for the devices to finish a step (a hung step or collective)",
    "checkpoint": "saving or restoring a backup",
    "evaluate": "validating",
    "callbacks": "in a callback",
    "compile": "compiling",
    "other": "in the loop's own work",
}


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
    From the first SIGTERM or SIGINT the block has `timeout` seconds (None:
    no bound) to end before the process exits without saving
    (`SignalDeadline`); `timer` (the fit's `FitTimer`) names what it waited for.
    After a SIGTERM, and in a multi-process job after a SIGINT too, the bound
    also covers the process's exit.

    In a multi-process job JAX's preemption notifier owns SIGTERM (a C
    handler setting a flag that its own thread polls). The watch then installs
    a Python handler in its place, so the signal reaches the deadline's
    thread, and that thread calls JAX's handler: JAX's sync point works as before.
    """

    def __init__(self, timeout: float | None = DEFAULT_PREEMPTION_TIMEOUT, timer=None):
        self.requested = False
        self._last_step = None
        self._seen_step = None  # the last step boundary the loop reached, for the log
        self._previous = None
        self._armed = False
        self._timer = timer
        self._jax_handler: _CHandler | None = None
        self._deadline = SignalDeadline(timeout, on_signal=self._first_signal, describe=self._describe)

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self
        if jax.process_count() > 1 and compat.preemption_sync_manager() is not None:
            self._jax_handler = _CHandler.of(signal.SIGTERM)
            if self._jax_handler is None:
                return self  # JAX's handler is one this watch cannot call: left alone, unbounded
        self._deadline.__enter__()
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._armed = True
        return self

    def __exit__(self, *exc):
        if not self._armed:
            return
        self._armed = False
        # After a SIGTERM the bound covers the way out too; in a multi-process job after a SIGINT as well: the
        # job is ending (Ctrl-C reaches every rank), and an exit that waits for a peer must not hang. The
        # KeyboardInterrupt may come out of the block before the deadline's thread has read its SIGINT.
        interrupted = self._deadline.received is not None or isinstance(exc[1], KeyboardInterrupt)
        signalled = self._jax_handler is not None and interrupted
        self._deadline.end(keep=self.requested or signalled)
        if self.requested:
            # After a preemption the process is on its way out with status 143: a repeated
            # SIGTERM (schedulers send more than one) must not turn that into a kill by signal.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif self._jax_handler is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._jax_handler.reinstall()
        else:
            signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum, frame):
        del signum, frame
        if self._jax_handler is None:
            self.requested = True

    def _first_signal(self, signum: int) -> None:
        """On the deadline's thread, as the first SIGTERM or SIGINT comes, and a SIGTERM after a SIGINT (the main
        thread may be stuck)."""
        if signum != signal.SIGTERM:
            return
        if self._jax_handler is not None:
            self._jax_handler.call(signum)  # JAX's notifier learns of the preemption
            self.requested = True  # for __exit__ only: should_stop asks JAX's sync point
        else:
            self.requested = True

    def _describe(self) -> str:
        """What the main thread is doing (read from the deadline's thread)."""
        phase = self._timer.current() if self._timer is not None else None
        said = [_WAITING.get(phase, phase)] if phase else []
        said.append("before the first step" if self._seen_step is None else f"after step {self._seen_step}")
        activity = main_thread_activity()
        return "; ".join(said + ([activity] if activity else []))

    def should_stop(self, step: int) -> bool:
        """True at the step every process stops at (checked between executions).

        JAX's sync point is one step number agreed by all processes; an
        execution of K steps asks about each of them, so it cannot be skipped.
        """
        self._seen_step = step
        if jax.process_count() > 1 and compat.preemption_sync_manager() is not None:
            from jax.experimental import multihost_utils

            first = step if self._last_step is None else self._last_step + 1
            self._last_step = step
            stop = any([multihost_utils.reached_preemption_sync_point(s) for s in range(first, step + 1)])
        else:
            stop = self.requested
        if stop:
            self._deadline.saving = True  # repeated SIGTERMs no longer cut the backup short; the bound holds
        return stop


class _CHandler:
    """A signal's C-level handler installed by native code (JAX's preemption notifier), read with sigaction.

    Only plain handlers (`void (*)(int)`, no SA_SIGINFO) are taken: calling one from a thread is what the
    kernel would do, and JAX's only sets an atomic flag. Linux's `struct sigaction` (glibc, 64-bit):
    the handler at offset 0, a 128-byte mask, then `int sa_flags`.
    """

    _SIZE, _FLAGS_AT, _SA_SIGINFO = 256, 8 + 128, 4

    def __init__(self, signum: int, saved, address: int):
        self.signum, self._saved, self._address = signum, saved, address

    @classmethod
    def of(cls, signum: int) -> _CHandler | None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
        saved = ctypes.create_string_buffer(cls._SIZE)
        if libc.sigaction(signum, None, saved) != 0:
            return None
        address = ctypes.c_void_p.from_buffer(saved).value or 0
        flags = ctypes.c_int.from_buffer(saved, cls._FLAGS_AT).value
        if address in (0, 1) or flags & cls._SA_SIGINFO:  # SIG_DFL, SIG_IGN, or a three-argument handler
            return None
        handler = cls(signum, saved, address)
        handler._libc = libc
        return handler

    def call(self, signum: int) -> None:
        ctypes.CFUNCTYPE(None, ctypes.c_int)(self._address)(signum)

    def reinstall(self) -> None:
        self._libc.sigaction(self.signum, self._saved, None)
