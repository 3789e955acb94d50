"""`MonitorCallback`: the base Keras gives the callbacks that watch a metric.

`EarlyStopping`, `ModelCheckpoint` and `ReduceLROnPlateau` each watch one
logged quantity and ask whether it improved; this base resolves the direction
(`mode="auto"` from the name or the model's metrics) and the comparison.
"""

from __future__ import annotations

import warnings

import numpy as np

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
