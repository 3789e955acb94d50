"""`History`: records the epoch logs of `fit()` (Keras's `keras.callbacks.History`)."""

from __future__ import annotations

from meshfit.callbacks.base import Callback


class History(Callback):
    """Callback that records events into a `History` object.

    `history` maps each log key (`"loss"`, metric names, `"val_<name>"`,
    `"learning_rate"`, ...) to the list of its epoch values; `epoch` lists the
    epoch indices seen by the current `fit()` call. As in Keras, `history`
    keeps growing across `fit()` calls on the same instance while `epoch` is
    reset at the start of each. The model (not this callback) sets
    `model.history`.
    """

    def __init__(self):
        super().__init__()
        self.history: dict[str, list] = {}
        self.epoch: list[int] = []

    def on_train_begin(self, logs=None):
        self.epoch = []

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        self.epoch.append(epoch)
        for k, v in logs.items():
            self.history.setdefault(k, []).append(v)
