"""`ReduceLROnPlateau` (Keras's `keras.callbacks.ReduceLROnPlateau`, same semantics)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from meshfit import optimizers as optimizers_lib
from meshfit.callbacks.console import print_msg
from meshfit.callbacks.monitor import MonitorCallback


class ReduceLROnPlateau(MonitorCallback):
    """Reduce the learning rate when a metric has stopped improving.

    After `patience` epochs without an improvement of at least `min_delta`,
    the learning rate becomes `max(lr * factor, min_lr)` (if it is still above
    `min_lr`), then the callback waits `cooldown` epochs before counting
    again. The current learning rate is added to the epoch logs as
    `"learning_rate"`. The learning rate is changed through
    `model.optimizer.learning_rate`, without recompiling.

    Args:
        monitor: quantity to be monitored.
        factor: factor by which the learning rate will be reduced
            (`new_lr = lr * factor`); must be < 1.
        patience: number of epochs with no improvement after which the
            learning rate will be reduced.
        verbose: 0: quiet, 1: update messages.
        mode: one of `{"auto", "min", "max"}`.
        min_delta: threshold for measuring the new optimum.
        cooldown: number of epochs to wait before resuming normal operation
            after the learning rate has been reduced.
        min_lr: lower bound on the learning rate.
        optimizer: for a model compiled with several optimizers (a dict), the
            key of the one whose learning rate this reduces; required then.
    """

    def __init__(
        self,
        monitor="val_loss",
        factor=0.1,
        patience=10,
        verbose=0,
        mode="auto",
        min_delta=1e-4,
        cooldown=0,
        min_lr=0.0,
        *,
        optimizer: str | None = None,
    ):
        super().__init__(monitor, mode, min_delta=min_delta)
        self.optimizer = optimizer
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau does not support a factor >= 1.0. Received factor={factor}")

        self.factor = factor
        self.min_lr = min_lr
        self.patience = patience
        self.verbose = verbose
        self.cooldown = cooldown
        self.cooldown_counter = 0  # Cooldown counter.
        self.wait = 0

    def _reset(self):
        """Resets wait counter, cooldown counter, and best value."""
        self.best = None
        self.cooldown_counter = 0
        self.wait = 0

    def _reduce_optimizer_lr(self, optimizer, epoch):
        old_lr = float(optimizer.learning_rate)
        if old_lr > np.float32(self.min_lr):
            new_lr = old_lr * self.factor
            new_lr = max(new_lr, self.min_lr)
            optimizer.learning_rate = new_lr
            if self.verbose > 0:
                print_msg(f"\nEpoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to {new_lr}.")
            return True
        return False

    @property
    def _optimizer(self):
        """The optimizer this acts on (`meshfit.optimizers.select`)."""
        return optimizers_lib.select(self.model.optimizer, self.optimizer, "ReduceLROnPlateau")

    def on_train_begin(self, logs=None):
        optimizer = self._optimizer  # several optimizers and none named: refused before any step
        if getattr(optimizer, "learning_rate_is_schedule", False):  # refused before any step
            raise optimizer.schedule_error("reduced by ReduceLROnPlateau")
        if self._take_loaded_state():
            return
        self._reset()

    def on_epoch_end(self, epoch, logs=None):
        self._state_loaded = False
        if self.monitor_op is None:
            # Delay setup until the model's metrics are all built
            self._set_monitor_op()
        logs = logs or {}
        logs["learning_rate"] = float(self._optimizer.learning_rate)
        current = logs.get(self.monitor)

        if current is None:
            warnings.warn(
                "Learning rate reduction is conditioned on metric "
                f"`{self.monitor}` which is not available. Available metrics "
                f"are: {','.join(list(logs.keys()))}.",
                stacklevel=2,
            )
        else:
            if self.in_cooldown():
                self.cooldown_counter -= 1
                self.wait = 0

            if self._is_improvement(current, self.best):
                self.best = current
                self.wait = 0
            elif not self.in_cooldown():
                self.wait += 1
                if self.wait >= self.patience:
                    if self._reduce_optimizer_lr(self._optimizer, epoch):
                        self.cooldown_counter = self.cooldown
                        self.wait = 0

    def in_cooldown(self):
        return self.cooldown_counter > 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait": int(self.wait),
            "best": None if self.best is None else float(self.best),
            "cooldown_counter": int(self.cooldown_counter),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait = int(state["wait"])
        self.best = state["best"]
        self.cooldown_counter = int(state["cooldown_counter"])
        self._state_loaded = True
