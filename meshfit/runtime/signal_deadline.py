"""A bound on how long SIGTERM or SIGINT may take to end the process, even with the main thread stuck in C.

Python runs a signal handler on the main thread between bytecodes only: a main
thread blocked in C (a compile, a wait for a step or a collective, a read from
a pipe no one writes) never runs it, so a handler that sets a flag and waits for
the next step boundary can wait forever. CPython's C-level handler, though,
writes the signal's number to the file given to `signal.set_wakeup_fd` at once,
whatever the main thread does. `SignalDeadline` gives it a pipe read by a daemon
thread: from the first SIGTERM or SIGINT that thread allows `timeout` seconds; if
the `with` block (the fit) has not ended by then, it writes what the main thread
was doing to stderr and ends the process with `os._exit` (143 for SIGTERM, 130
for SIGINT), without saving: what is half-written stays incomplete (Orbax lists
a checkpoint only once its commit marker is written), so the newest complete
backup is the one a restart resumes from. A second signal of the same kind, at
least `REPEAT_AFTER` seconds after the first and while no preemption backup is
being written, ends the process at once. A SIGTERM after a first SIGINT
(Ctrl-C at a terminal reaches every rank of `meshfit launch`, which then
sends each SIGTERM) is passed to `on_signal` too, within the SIGINT's bound.
`end(keep=True)` leaves the bound in force past the block (after a SIGTERM
the process is on its way out).

A main thread that holds the GIL in C the whole time (an extension that never
releases it) also stops this thread: no Python code can bound that.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

#: Signals bounded, and the status each ends the process with (128 + the signal, as a shell reports a kill).
BOUNDED = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 128 + signal.SIGINT}
#: A repeat of the first signal sooner than this is the same notice (a scheduler and a launcher both sending it).
REPEAT_AFTER = 1.0


class SignalDeadline:
    """While the `with` block runs (on the main thread), SIGTERM and SIGINT end the process within `timeout` s.

    Args:
        timeout: seconds from the first signal to the exit, or None for no bound.
        on_signal: called on the watching thread with the signal's number when the first one comes
            (before the main thread may run its Python handler).
        describe: what the main thread is doing, for the log (called on the watching thread).
    """

    def __init__(
        self,
        timeout: float | None,
        on_signal: Callable[[int], None] = lambda signum: None,
        describe: Callable[[], str] = lambda: "",
    ):
        self.timeout = timeout
        self.on_signal = on_signal
        self.describe = describe
        self.saving = False  # a preemption backup is being written: repeats no longer end the process at once
        self.ended = False  # the block ended (the process is exiting)
        self.received: int | None = None  # the first bounded signal, once it came
        self._write_end: int | None = None
        self._previous_fd = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SignalDeadline:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set the wakeup fd (and only it receives Python handlers)
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # the C-level handler must never block
        self._previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self._write_end = write_end
        self._thread = threading.Thread(
            target=self._watch, args=(read_end,), name="meshfit-signal-deadline", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.end(keep=False)

    def end(self, keep: bool) -> None:
        """Ends the watch; with `keep` (a SIGTERM came: the process is on its way out) the bound still holds
        for the rest of its life, so an exit that hangs (a thread joined, an atexit hook) ends in time too."""
        if self._write_end is None:
            return
        self.ended = True
        if keep:
            return
        signal.set_wakeup_fd(self._previous_fd)  # first: no signal is written to a closed pipe
        os.close(self._write_end)  # the watching thread reads the end of the pipe and stops
        self._write_end = None
        self._thread.join(timeout=1.0)

    def _watch(self, read_end: int) -> None:
        first: int | None = None
        since = 0.0
        terminated = False  # a SIGTERM came (passed to on_signal once)
        try:
            while True:
                wait = None if first is None or self.timeout is None else since + self.timeout - time.monotonic()
                ready, _, _ = select.select([read_end], [], [], None if wait is None else max(wait, 0.0))
                if not ready:
                    self._exit(first, self._late(first))
                data = os.read(read_end, 256)
                if not data:
                    return  # the block ended
                for signum in data:
                    if signum not in BOUNDED:
                        continue
                    now = time.monotonic()
                    if first is None:
                        first, since = signum, now
                        self.received = signum
                        self.on_signal(signum)
                    elif signum == first and now - since >= REPEAT_AFTER and not self.saving:
                        name = signal.Signals(signum).name
                        self._exit(signum, f"a second {name} came {now - since:.1f} s after the first")
                    elif signum == signal.SIGTERM and not terminated:  # after a SIGINT: told to go as well
                        self.on_signal(signum)
                    terminated = terminated or signum == signal.SIGTERM
        finally:
            os.close(read_end)

    def _late(self, signum: int) -> str:
        name = signal.Signals(signum).name
        doing = self.describe()
        doing = f" ({doing})" if doing else ""
        if self.ended:
            return f"the process did not exit within {self.timeout:g} s of the {name} after the fit ended{doing}"
        if self.saving:
            return f"the preemption backup was not written within {self.timeout:g} s{doing}"
        if signum == signal.SIGTERM:
            return f"no step boundary came within {self.timeout:g} s of the {name}{doing}"
        return f"training did not stop within {self.timeout:g} s of the {name}{doing}"

    def _exit(self, signum: int, why: str) -> None:
        status = BOUNDED[signum]
        name = signal.Signals(signum).name
        saved = "after the preemption backup" if self.ended and self.saving else "without saving"
        message = (
            f"meshfit: {name}: {why}. Exiting with status {status} {saved}: the newest complete backup "
            "is kept, and a restart resumes from it.\n"
        )
        with contextlib.suppress(OSError):
            os.write(2, message.encode())  # not print: the main thread may hold stderr's lock
        os._exit(status)


#: Functions of JAX's that compile (or read a compiled program from the persistent cache).
_COMPILING = ("compile_or_get_cached", "backend_compile", "_cached_compilation", "get_file_contents")


def main_thread_activity() -> str:
    """Where the main thread is, read from another thread: compiling, in which callback, and its innermost line."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    said = []
    if any(f.f_code.co_name in _COMPILING and f"{os.sep}jax{os.sep}" in f.f_code.co_filename for f in frames):
        said.append("compiling")
    for f in frames:  # innermost first
        name = getattr(f.f_code, "co_qualname", f.f_code.co_name)
        if f.f_code.co_name.startswith("on_") and "." in name and not name.startswith("CallbackList."):
            said.append(f"in callback {name}")
            break
    innermost = traceback.extract_stack(frames[0], limit=1)[-1]
    said.append(f"main thread at {os.path.basename(innermost.filename)}:{innermost.lineno} in {innermost.name}")
    return ", ".join(said)
