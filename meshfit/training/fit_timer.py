"""Where a running fit's wall-clock time goes: each moment of the loop's thread in exactly one phase.

`Model.fit` runs inside the session's timer (`with timer:`), from its
argument checks to its end; the loop, the session and the savers mark what they do (`with timer.phase("input"): ...`);
phases nest, and a nested phase's time is its own, not its parent's, so the
phases of a fit add up to its duration. Compilation is not marked by meshfit:
JAX reports the span of every trace, lowering and XLA compilation
(`jax.monitoring`'s time-span events under `/jax/core/compile/`), and the
timer moves the spans that fall on the loop's thread from the phase they
interrupted into `compile`. Compilations on other threads overlap the loop and
do not hold it, so they are not counted.

A timer that is not running (outside `fit`) records nothing, so evaluate and
predict pay one attribute read per mark.
"""

from __future__ import annotations

import time
from threading import get_ident
from time import perf_counter

import jax

__all__ = ["PHASES", "FitTimer"]

#: The phases of a fit. "other" is the loop's own host work (and whatever no one marks).
PHASES = ("compile", "steps", "input", "checkpoint", "evaluate", "callbacks", "other")
#: The prefix of the `jax.monitoring` time-span events of tracing, lowering and compiling a program.
COMPILE_EVENTS = "/jax/core/compile/"

_running: list[FitTimer] = []  # timers between `start` and `stop`, for the one JAX listener


class _Phase:
    """A reusable context manager marking one phase of one timer (no allocation per use; the loop enters
    two or three a step, so the work is written out here)."""

    __slots__ = ("_timer", "_name")

    def __init__(self, timer: FitTimer, name: str):
        self._timer, self._name = timer, name

    def __enter__(self) -> None:
        timer = self._timer
        if timer._thread != get_ident():  # not running, or another thread
            return
        now = perf_counter()
        stack = timer._stack
        timer._totals[stack[-1]] += now - timer._since
        timer._since = now
        stack.append(self._name)
        if timer._compile_spans:
            timer._compile_spans.clear()

    def __exit__(self, *exc) -> None:
        timer = self._timer
        if timer._thread != get_ident() or len(timer._stack) < 2:
            return
        now = perf_counter()
        timer._totals[timer._stack.pop()] += now - timer._since
        timer._since = now
        if timer._compile_spans:
            timer._compile_spans.clear()


class FitTimer:
    """Seconds per phase (`PHASES`) of the running fit, measured on the thread that called `start`."""

    def __init__(self) -> None:
        self._phases = {name: _Phase(self, name) for name in PHASES}
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._stack: list[str] = []
        self._thread: int | None = None
        self._since = 0.0
        self._compile_spans: list[tuple[float, float]] = []  # this segment's, to count nested spans once
        self.started_at: float | None = None  # wall-clock time (`time.time()`) of `start`

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Starts a fit's timing afresh on this thread, in phase "other"."""
        _listen_to_compiles()
        self._totals = dict.fromkeys(PHASES, 0.0)
        self._stack = ["other"]
        self._compile_spans = []
        self._since = perf_counter()
        self.started_at = time.time()
        self._thread = get_ident()
        if self not in _running:
            _running.append(self)

    def stop(self) -> None:
        """Ends the fit's timing; `totals` keeps what it measured."""
        if self._thread is None:
            return
        self._switch()
        self._thread = None
        if self in _running:
            _running.remove(self)

    def __enter__(self) -> FitTimer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def phase(self, name: str) -> _Phase:
        """A context manager: the time inside it (less nested phases) is `name`'s (one of `PHASES`)."""
        return self._phases[name]

    def current(self) -> str | None:
        """The phase open now on the fit's thread (None outside a fit); may be read from another thread."""
        stack = self._stack if self._thread is not None else None
        return stack[-1] if stack else None

    def totals(self) -> dict[str, float]:
        """Seconds per phase so far, the open phase counted up to now (zeros before the first `start`)."""
        totals = dict(self._totals)
        if self._thread is not None:
            totals[self._stack[-1]] += perf_counter() - self._since
        return totals

    # -- marking ------------------------------------------------------------------------------

    def _switch(self) -> None:
        """Charges the time since the last switch to the open phase."""
        now = perf_counter()
        self._totals[self._stack[-1]] += now - self._since
        self._since = now
        self._compile_spans.clear()

    def _compiled(self, start: float, end: float) -> None:
        """A compile span on this timer's thread: its time, less what nested spans counted already, moves
        from the open phase (which it interrupted) to "compile"."""
        counted = sum(max(0.0, min(end, e) - max(start, s)) for s, e in self._compile_spans)
        new = max(0.0, end - start - counted)
        self._compile_spans = [(s, e) for s, e in self._compile_spans if s < start or e > end] + [(start, end)]
        self._totals[self._stack[-1]] -= new
        self._totals["compile"] += new


def _on_time_span(event: str, start_time: float, end_time: float, **kwargs) -> None:
    if not event.startswith(COMPILE_EVENTS) or not _running:
        return
    thread = get_ident()
    for timer in _running:
        if timer._thread == thread:
            timer._compiled(start_time, end_time)


_listening = False


def _listen_to_compiles() -> None:
    """Registers the one JAX listener of the process (once; it ignores events while no timer runs)."""
    global _listening
    if not _listening:
        jax.monitoring.register_event_time_span_listener(_on_time_span)
        _listening = True
