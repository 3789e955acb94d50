"""`EarlyStopping` (Keras's `keras.callbacks.EarlyStopping`, same semantics)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from meshfit.callbacks.console import print_msg
from meshfit.callbacks.monitor import MonitorCallback


class EarlyStopping(MonitorCallback):
    """Stop training when a monitored metric has stopped improving.

    At the end of every epoch the monitored value is compared with the best
    so far; after `patience` epochs without improvement (of at least
    `min_delta`) `model.stop_training` is set.

    Args:
        monitor: quantity to be monitored. Defaults to `"val_loss"`.
        min_delta: minimum change in the monitored quantity to qualify as an
            improvement. Defaults to `0`.
        patience: number of epochs with no improvement after which training
            is stopped. Defaults to `0`.
        verbose: 0 (silent) or 1 (messages when the callback acts).
        mode: one of `{"auto", "min", "max"}`. Defaults to `"auto"`.
        baseline: baseline value for the monitored quantity. If not `None`,
            training stops if the model doesn't show improvement over the
            baseline (the patience counter is only reset by a value that beats
            both the best so far and the baseline).
        restore_best_weights: whether to restore model weights from the epoch
            with the best value of the monitored quantity (at the end of
            training, whether it stopped early or not). If no epoch improves
            on `baseline`, training runs for `patience` epochs and restores
            the weights of the best epoch in that set. Defaults to `False`.
        start_from_epoch: number of epochs to wait before starting to monitor
            improvement. Defaults to `0`.
    """

    def __init__(
        self,
        monitor="val_loss",
        min_delta=0,
        patience=0,
        verbose=0,
        mode="auto",
        baseline=None,
        restore_best_weights=False,
        start_from_epoch=0,
    ):
        super().__init__(monitor, mode, min_delta=min_delta)
        self.patience = patience
        self.verbose = verbose
        self.baseline = baseline
        self.wait = 0
        self.stopped_epoch = 0
        self.restore_best_weights = restore_best_weights
        self.best_weights = None
        self.best_epoch = 0
        self.start_from_epoch = start_from_epoch

    def on_train_begin(self, logs=None):
        if self._take_loaded_state():
            return
        # Allow instances to be re-used across `model.fit()` calls.
        self.wait = 0
        self.stopped_epoch = 0
        self.best = None
        self.best_weights = None
        self.best_epoch = 0

    def on_epoch_end(self, epoch, logs=None):
        self._state_loaded = False
        if self.monitor_op is None:
            # Delay setup until the model's metrics are all built
            self._set_monitor_op()

        current = self.get_monitor_value(logs)
        if current is None or epoch < self.start_from_epoch:
            # If no monitor value exists or still in initial warm-up stage.
            return
        if self.restore_best_weights and self.best_weights is None:
            # If best weights were never set,
            # then the current weights are the best.
            self.best_weights = self.model.get_weights()
            self.best_epoch = epoch

        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best = current
            self.best_epoch = epoch
            if self.restore_best_weights:
                self.best_weights = self.model.get_weights()
            # Only restart wait if we beat both the baseline and our previous
            # best.
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
            return

        if self.wait >= self.patience and epoch > 0:
            # Patience has been exceeded: stop training
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0 and self.verbose > 0:
            print_msg(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0:
                print_msg(f"Restoring model weights from the end of the best epoch: {self.best_epoch + 1}.")
            self.model.set_weights(self.best_weights)

    def get_monitor_value(self, logs):
        logs = logs or {}
        monitor_value = logs.get(self.monitor)
        if monitor_value is None:
            warnings.warn(
                (
                    f"Early stopping conditioned on metric `{self.monitor}` "
                    "which is not available. "
                    f"Available metrics are: {','.join(list(logs.keys()))}"
                ),
                stacklevel=2,
            )
        return monitor_value

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait": int(self.wait),
            "best": None if self.best is None else float(self.best),
            "best_epoch": int(self.best_epoch),
            "stopped_epoch": int(self.stopped_epoch),
            "best_weights": (
                None if self.best_weights is None else [np.array(w, copy=True) for w in self.best_weights]
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait = int(state["wait"])
        self.best = state["best"]
        self.best_epoch = int(state["best_epoch"])
        self.stopped_epoch = int(state["stopped_epoch"])
        weights = state.get("best_weights")
        self.best_weights = None if weights is None else [np.asarray(w) for w in weights]
        self._state_loaded = True
