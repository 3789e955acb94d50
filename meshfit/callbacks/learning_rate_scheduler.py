"""`LearningRateScheduler` (Keras's `keras.callbacks.LearningRateScheduler`)."""

from __future__ import annotations

import numpy as np

from meshfit import optimizers as optimizers_lib
from meshfit.callbacks.console import print_msg
from meshfit.training.callback_protocol import Callback


class LearningRateScheduler(Callback):
    """Learning rate scheduler.

    At the beginning of every epoch, calls `schedule(epoch, lr)` (epoch
    indexed from 0, `lr` the current learning rate as a float; a one-argument
    `schedule(epoch)` is also accepted) and sets the returned float on
    `model.optimizer.learning_rate`, without recompiling. At the end of every
    epoch the learning rate is added to the logs as `"learning_rate"`.

    Args:
        schedule: function `(epoch, lr) -> float`.
        verbose: 0: quiet, 1: log update messages.
        optimizer: for a model compiled with several optimizers (a dict), the
            key of the one whose learning rate this sets; required then.
    """

    def __init__(self, schedule, verbose=0, *, optimizer: str | None = None):
        super().__init__()
        self.schedule = schedule
        self.verbose = verbose
        self.optimizer = optimizer

    @property
    def _optimizer(self):
        """The optimizer this acts on (`meshfit.optimizers.select`)."""
        return optimizers_lib.select(self.model.optimizer, self.optimizer, "LearningRateScheduler")

    def on_train_begin(self, logs=None):
        optimizer = self._optimizer  # several optimizers and none named: refused before any step
        if getattr(optimizer, "learning_rate_is_schedule", False):  # refused before any step
            raise optimizer.schedule_error("set by LearningRateScheduler")

    def _update_optimizer_lr(self, optimizer, epoch):
        try:
            current = optimizer.learning_rate
        except AttributeError as e:
            raise ValueError(f'Optimizer must have a "learning_rate" attribute. {e}') from e

        try:  # new API
            learning_rate = float(current)
            learning_rate = self.schedule(epoch, learning_rate)
        except TypeError:  # Support for old API for backward compatibility
            learning_rate = self.schedule(epoch)

        if not isinstance(learning_rate, (float, np.float32, np.float64)):
            raise ValueError(f"The output of the `schedule` function should be a float. Got: {learning_rate}")

        optimizer.learning_rate = learning_rate
        return learning_rate

    def on_epoch_begin(self, epoch, logs=None):
        learning_rate = self._update_optimizer_lr(self._optimizer, epoch)
        if self.verbose > 0:
            print_msg(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {learning_rate}.")

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        logs["learning_rate"] = float(self._optimizer.learning_rate)
