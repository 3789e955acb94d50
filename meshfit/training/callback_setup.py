"""The callbacks of one `fit`, `evaluate` or `predict`: which run, in what order, and their close.

`callback_list` puts the user's callbacks and the defaults a call adds (a
progress bar, History) in the order the loop calls them; `preemption_watch`
arms SIGTERM when a callback saves on preemption; `running_fit` brackets a
fit in the session and closes every callback at its end, also when it raised.
The default callbacks' classes live above this package (`meshfit.callbacks`):
the caller passes them in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from meshfit.runtime.preemption import DEFAULT_PREEMPTION_TIMEOUT, PreemptionWatch
from meshfit.training.callback_protocol import Callback, CallbackList
from meshfit.training.session import Session


def callback_list(
    callbacks: Sequence[Callback] | None,
    *,
    model: Any,
    progbar: type[Callback],
    history: Callback | None = None,
    verbose: int,
    epochs: int,
    steps: int | None,
) -> CallbackList:
    """The user's `callbacks` and the defaults, in the order the loop calls them.

    Callbacks that add to the epoch logs run first, so the others see what
    they add; callbacks that save training state run last, after History and
    the others have updated theirs for the same step or epoch.

    Args:
        model: the `meshfit.Model` the callbacks see.
        progbar: the progress bar's class, added (with `verbose`) unless the user passed one.
        history: the fit's History, run after the user's callbacks other than the savers (None: none).
        verbose: 0 (silent), 1 or 2, as `fit` takes it.

    Raises:
        TypeError: an entry of `callbacks` is not a `meshfit.callbacks.Callback`.
    """
    user = list(callbacks or [])
    for cb in user:
        if not isinstance(cb, Callback):
            raise TypeError(f"Each callback must be a meshfit.callbacks.Callback. Received: {cb!r}.")
    defaults = [progbar()] if verbose and not any(isinstance(cb, progbar) for cb in user) else []
    adders = [cb for cb in user if cb.adds_epoch_logs]
    savers = [cb for cb in user if cb.handles_preemption and cb not in adders]
    others = [cb for cb in user if cb not in adders and cb not in savers]
    ordered = adders + others + defaults + ([history] if history else []) + savers
    return CallbackList(
        ordered, model=model, timer=model.session.context.timer, epochs=epochs, steps=steps, verbose=verbose
    )


def preemption_watch(callbacks: Sequence[Any] | None, timer: Any) -> PreemptionWatch | None:
    """A SIGTERM/SIGINT watch for a fit whose callbacks save on preemption (None: none does).

    It ends the fit within the shortest `preemption_timeout` those callbacks set; `timer` (the
    session's `FitTimer`) names what it waited for.
    """
    savers = [cb for cb in callbacks or () if _handles_preemption(cb)]
    if not savers:
        return None
    timeouts = [getattr(cb, "preemption_timeout", DEFAULT_PREEMPTION_TIMEOUT) for cb in savers]
    bounded = [t for t in timeouts if t is not None]
    return PreemptionWatch(min(bounded) if bounded else None, timer=timer)


@contextlib.contextmanager
def running_fit(session: Session, data: Any, callbacks: CallbackList, initial_epoch: int) -> Iterator[None]:
    """A fit over `data` in `session`: begun, and ended however the block ends.

    Every callback is closed at the end (finishing background writes) even when the fit raised:
    then the fit's error propagates; after a finished fit, the first error a close raised.
    """
    session.begin_fit(data, list(callbacks), initial_epoch)
    finished = False
    try:
        yield
        finished = True
    finally:
        errors = []
        for cb in session.callbacks:
            try:
                cb.close()
            except Exception as error:  # noqa: BLE001 - every callback is closed, the first error raised
                errors.append(error)
        session.end_fit(finished)
        if finished and errors:
            raise errors[0]


def _handles_preemption(callback: Any) -> bool:
    """Whether a (not yet validated) callback saves on preemption, so SIGTERM must be caught for it."""
    return isinstance(callback, Callback) and (
        callback.handles_preemption or type(callback).on_preemption is not Callback.on_preemption
    )
