"""Where a running fit stands: what a backup records, and where a resumed fit continues."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a fit stands: what a backup records to continue it exactly.

    Attributes:
        epoch: the epoch to continue (numbered as `fit` numbers them).
        step_in_epoch: batches of that epoch already trained on.
        step: optimizer steps taken, over all fits.
        data_origin: the pass over array data that epoch 0 reads (passes are
            numbered across fits, so each epoch is shuffled anew).
        data: the training input's own position (an iterator's state).
    """

    epoch: int
    step_in_epoch: int
    step: int
    data_origin: int = 0
    data: dict = dataclasses.field(default_factory=dict)


class FitCursor:
    """The running fit's place: its input, the epoch and batch within it, and the data pass it reads.

    Shuffled passes over array data are numbered across fits: epoch `e` reads
    pass `data_origin + e`, so each epoch of each fit is shuffled anew and a
    resumed fit reads the passes the interrupted one would have.
    """

    def __init__(self) -> None:
        self.data = None  # the running fit's training input
        self.resumed = False  # the running fit continues one restored from a backup
        self._epoch = self._step_in_epoch = 0
        self._resume_point: tuple[int, int] | None = None
        self._epochs_begun = 0
        self._data_origin = 0

    def begin_fit(self, data, initial_epoch: int) -> None:
        """Starts a fit over `data` at `initial_epoch`; a backup may `restore` a position next."""
        self.data, self.resumed = data, False
        self._data_origin = self._epochs_begun - initial_epoch
        self._resume_point = None

    def end_fit(self) -> None:
        self.data = None

    def start_point(self, initial_epoch: int) -> tuple[int, int]:
        """`(epoch, step_in_epoch)` the fit starts at: a restored position, or `initial_epoch`'s start."""
        start, self._resume_point = self._resume_point or (initial_epoch, 0), None
        return start

    def begin_epoch(self, epoch: int, step_in_epoch: int) -> int:
        """Marks the start of `epoch` (at `step_in_epoch`); returns the data pass it reads."""
        self._epoch, self._step_in_epoch = epoch, step_in_epoch
        data_epoch = self._data_origin + epoch
        self._epochs_begun = data_epoch + 1
        return data_epoch

    def count(self, steps: int) -> None:
        """Counts `steps` trained batches of the current epoch."""
        self._step_in_epoch += steps

    def epoch_done(self) -> None:
        """The current epoch is complete: the position is the next epoch's start."""
        self._epoch, self._step_in_epoch = self._epoch + 1, 0

    def position(self, step: int) -> Position:
        """Where the running fit stands after `step` optimizer steps (the caller settles the state first)."""
        data = self.data.get_state() if self.data is not None else {}
        return Position(self._epoch, self._step_in_epoch, step, self._data_origin, data)

    def restore(self, position: Position) -> None:
        """Continues the running fit from `position`: its input position, epoch and data pass."""
        if self.data is not None:
            self.data.set_state(position.data)
        self._resume_point = (position.epoch, position.step_in_epoch)
        self._data_origin = position.data_origin
        self.resumed = True
