"""`History`: records the epoch logs of `fit()` (Keras's `keras.callbacks.History`)."""

from __future__ import annotations

import jax

from meshfit.training.callback_protocol import Callback


class History(Callback):
    """Callback that records events into a `History` object.

    `history` maps each log key (`"loss"`, metric names, `"val_<name>"`,
    `"learning_rate"`, ...) to the list of its epoch values; `epoch` lists the
    epoch indices seen by the current `fit()` call. As in Keras, `history`
    keeps growing across `fit()` calls on the same instance while `epoch` is
    reset at the start of each. The model (not this callback) sets
    `model.history`.
    """

    #: Epoch logs may come as device scalars; they are read (a host sync) when
    #: `history` is, so a fit whose only callback is History never waits for
    #: the devices between epochs.
    accepts_device_logs = True

    def __init__(self):
        super().__init__()
        self._history: dict[str, list] = {}
        self._unread: list[dict] = []  # epoch logs not read to the host yet
        self.epoch: list[int] = []

    @property
    def history(self) -> dict[str, list]:
        for logs in self._unread:
            for k, v in self._read(logs).items():
                self._history.setdefault(k, []).append(v)
        self._unread = []
        return self._history

    @history.setter
    def history(self, value: dict[str, list]) -> None:
        self._history, self._unread = value, []

    def _read(self, logs: dict) -> dict:
        """The logs with device scalars read as Python floats (a host sync); other values as given."""
        on_device = {k: v for k, v in logs.items() if isinstance(v, jax.Array)}
        if not on_device:
            return logs
        strategy = getattr(self.model, "strategy", None)
        fetched = strategy.to_host(on_device) if strategy is not None else jax.device_get(on_device)
        return {k: float(fetched[k]) if k in fetched else v for k, v in logs.items()}

    def on_train_begin(self, logs=None):
        self.epoch = []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        self._unread.append(dict(logs or {}))
