"""`EarlyStopping` (Keras's `keras.callbacks.EarlyStopping`, same semantics).

Also defines `MonitorCallback`, the base Keras gives the callbacks that watch a
metric (`EarlyStopping`, `ReduceLROnPlateau`, `ModelCheckpoint`).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from meshfit.callbacks.progbar_logger import print_msg
from meshfit.training.callback_protocol import Callback

# Direction of the metrics Keras knows by name (their `_direction`), used when
# the model does not describe its metrics: `mode="auto"` then resolves
# `"accuracy"`/`"val_accuracy"` to "max" as Keras does for compiled metrics.
_UP_METRICS = frozenset(
    {
        "accuracy", "acc", "binary_accuracy", "categorical_accuracy",
        "sparse_categorical_accuracy", "top_k_categorical_accuracy",
        "sparse_top_k_categorical_accuracy", "auc", "precision", "recall",
        "precision_at_recall", "recall_at_precision", "sensitivity_at_specificity",
        "specificity_at_sensitivity", "f1_score", "fbeta_score", "r2_score",
        "cosine_similarity", "iou", "mean_iou", "binary_iou", "one_hot_iou",
        "one_hot_mean_iou", "pearson_correlation", "concordance_correlation",
    }
)  # fmt: skip
_DOWN_METRICS = frozenset(
    {
        "mse", "mae", "mape", "msle", "mean_squared_error", "mean_absolute_error",
        "mean_absolute_percentage_error", "mean_squared_logarithmic_error",
        "root_mean_squared_error", "rmse", "log_cosh_error", "logcosh", "kl_divergence",
        "kld", "poisson", "binary_crossentropy", "categorical_crossentropy",
        "sparse_categorical_crossentropy", "hinge", "squared_hinge", "categorical_hinge",
    }
)  # fmt: skip


def _less(a, b) -> bool:
    # Keras compares with `ops.less`, i.e. in float32 (JAX backend, no x64).
    return bool(np.less(np.float32(a), np.float32(b)))


def _greater(a, b) -> bool:
    return bool(np.greater(np.float32(a), np.float32(b)))


class MonitorCallback(Callback):
    """Base for callbacks that watch a quantity and decide whether it improved.

    Args:
        monitor: quantity to be monitored. Defaults to `"val_loss"`.
        mode: one of `{"auto", "min", "max"}`; `"auto"` infers the direction
            from the name (`loss` goes down; known metrics, or the model's
            metrics' `direction`/`_direction`, decide the others).
        baseline: initial "best" value; `None` takes the first value seen.
        min_delta: minimum change that counts as an improvement.
    """

    def __init__(self, monitor="val_loss", mode="auto", baseline=None, min_delta=0):
        super().__init__()
        if mode not in ["auto", "min", "max"]:
            warnings.warn(
                f"{self.__class__.__name__} mode '{mode}' is unknown, fallback to auto mode.",
                stacklevel=2,
            )
            mode = "auto"
        self.monitor = monitor
        self.mode = mode
        self.best = baseline
        self.min_delta = abs(min_delta)
        self.monitor_op = None
        self._state_loaded = False

    def _model_metric_direction(self, metric_name):
        metrics = getattr(self.model, "metrics", None)
        if metrics is None or isinstance(metrics, (str, bytes)):
            metrics = []
        if isinstance(metrics, dict):
            metrics = list(metrics.values())
        try:
            metrics = list(metrics)
        except TypeError:
            metrics = []
        flat = []
        for m in metrics:
            flat.append(m)
            inner = getattr(m, "metrics", None)
            if isinstance(inner, (list, tuple)):
                flat.extend(inner)
        direction = None
        for m in flat:
            if getattr(m, "name", None) == metric_name:
                d = getattr(m, "_direction", None) or getattr(m, "direction", None)
                if d in ("up", "down"):
                    direction = d
        return direction

    def _set_monitor_op(self):
        if self.mode == "min":
            self.monitor_op = _less
        elif self.mode == "max":
            self.monitor_op = _greater
        else:
            metric_name = self.monitor.removeprefix("val_")
            if metric_name == "loss":
                self.monitor_op = _less
            direction = self._model_metric_direction(metric_name)
            if direction is None and self.monitor_op is None:
                if metric_name in _UP_METRICS:
                    direction = "up"
                elif metric_name in _DOWN_METRICS:
                    direction = "down"
            if direction is not None:
                self.monitor_op = _greater if direction == "up" else _less
            if self.monitor_op is None:
                raise ValueError(
                    f"{self.__class__.__name__} callback received "
                    f"monitor={self.monitor}, but meshfit isn't able to "
                    "automatically determine whether that metric should be "
                    "maximized or minimized. Pass `mode='max'` in order to "
                    "monitor based on the highest metric value, or pass "
                    "`mode='min'` in order to use the lowest value."
                )
        if self.monitor_op is _less:
            self.min_delta *= -1

    def _is_improvement(self, monitor_value, reference_value):
        if reference_value is None:
            return True
        return self.monitor_op(monitor_value - self.min_delta, reference_value)

    def _take_loaded_state(self) -> bool:
        """True (once) when `load_state_dict` ran before this `on_train_begin`.

        A state restored for a resumed run must survive the reset Keras does in
        `on_train_begin`, whichever order the restoring callback runs in.
        """
        loaded, self._state_loaded = self._state_loaded, False
        return loaded

    def on_epoch_begin(self, epoch, logs=None):
        self._state_loaded = False


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
