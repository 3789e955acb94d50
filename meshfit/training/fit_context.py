"""What a callback may read of, and do to, the running fit: a narrow view, not the session.

As Levanter hands its hooks a `StepInfo`, callbacks get a `FitContext`
(`Callback.context`): the optimizer steps taken, a settled snapshot of the
state, where the fit stands, how to continue it from a backup, and where its time goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfit.core.state import TrainState
from meshfit.training.fit_cursor import Position
from meshfit.training.fit_timer import FitTimer

if TYPE_CHECKING:
    from meshfit.training.session import Session

__all__ = ["FitContext", "Position"]


class FitContext:
    """The running fit as callbacks see it."""

    __slots__ = ("_session",)

    def __init__(self, session: Session):
        self._session = session

    @property
    def step(self) -> int:
        """Optimizer steps taken, over all fits (counted on the host: no transfer)."""
        return self._session.store.step

    @property
    def resumed(self) -> bool:
        """Whether the running fit continues one restored from a backup."""
        return self._session.cursor.resumed

    @property
    def state(self) -> TrainState:
        """The state after every batch handed out (settled): what a saver writes."""
        return self._session.state

    @property
    def latest(self) -> TrainState:
        """The state as the last step returned it, joining nothing (shapes, finiteness checks)."""
        return self._session.store.latest

    @property
    def template(self) -> TrainState:
        """The state's shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s): what a restore reads into. A
        model built from a factory that restores before its first step never creates the state it replaces."""
        return self._session.store.template

    @property
    def callbacks(self) -> list:
        """The running fit's callbacks (their state is saved with a backup)."""
        return self._session.callbacks

    @property
    def timer(self) -> FitTimer:
        """Where the running fit's time goes: savers mark the time they hold the loop
        (`with context.timer.phase("checkpoint"): ...`); Goodput reads `totals()`."""
        return self._session.timer

    def train_step_jaxpr(self):
        """The train step's jaxpr (`jax.core.ClosedJaxpr`) for the batch shape the fit was built with:
        traced on the host, nothing compiled or run; None before the model is built."""
        return self._session.train_step_jaxpr()

    def position(self, finished: bool = True) -> Position:
        """Where the running fit stands, with the state settled to match it; with `finished`, after the
        devices computed every step taken (`finished=False`: a saver whose device copies queue behind them)."""
        return self._session.position(finished)

    def restore(self, state: TrainState, position: Position) -> None:
        """Continues the running fit from a backup: its state, step count, input position and epoch."""
        self._session.restore(state, position)
