"""`ProgbarLogger`: Keras's progress output, drawn with tqdm.

The bar reads the (on-device) batch logs only when it redraws, at most once
every `interval` seconds, so an epoch of fast steps is never serialized by the
display: between two redraws the loop only counts steps.
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np
from tqdm.std import tqdm

from meshfit.callbacks.console import is_chief, print_msg
from meshfit.training.callback_protocol import Callback


class _Bar(tqdm):
    """A tqdm whose text around the bar is computed by the logger at redraw time."""

    def __init__(self, *args, count="", info="", **kwargs):
        self.count = count
        self.info = info
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        d = super().format_dict
        d["count"] = self.count
        d["info"] = self.info
        return d


def _screen_size(file) -> tuple[int | None, int | None]:
    """`(columns, rows)` of the terminal `file` writes to, each 80 x 24 where the terminal reports none (a
    pseudo-terminal nobody sized says 0 x 0, which tqdm reads as -1 and draws empty lines with);
    `(None, None)` when `file` is no terminal (a pipe, a file, a StringIO): lines are not trimmed."""
    try:
        size = os.get_terminal_size(file.fileno())
    except (AttributeError, OSError, ValueError):  # no fileno, not a terminal, closed
        return None, None
    return size.columns if size.columns > 0 else 80, size.lines if size.lines > 0 else 24


def _to_number(value):
    if isinstance(value, float):
        return value
    try:
        return float(value)  # 0-d jax/numpy arrays: one device read.
    except TypeError:
        return np.mean(np.asarray(value))


def _format_time(time_per_unit, unit_name):
    # Keras `Progbar._format_time`.
    if time_per_unit >= 1 or time_per_unit == 0:
        return f" {time_per_unit:.0f}s/{unit_name}"
    if time_per_unit >= 1e-3:
        return f" {time_per_unit * 1000.0:.0f}ms/{unit_name}"
    return f" {time_per_unit * 1000000.0:.0f}us/{unit_name}"


class ProgbarLogger(Callback):
    """Callback that prints metrics to stdout (Keras's progress bar, on tqdm).

    `params["verbose"]` chooses the output: 1 draws a bar per epoch with the
    step count, ETA (elapsed time once done), time per step and the latest
    value of every log, refreshed at most every `interval` seconds; 2 prints
    one line per epoch (`10/10 - 1s - 3ms/step - loss: 0.1234 - val_loss: ...`);
    0 prints nothing. When the callback is used for `evaluate()` or
    `predict()` (rather than for validation inside `fit()`) it shows their
    progress the same way. Only process 0 prints.

    Args:
        count_mode: `"steps"` (the only mode Keras 3 supports).
        stream: file to write to; defaults to `sys.stdout` at the time of writing.
        interval: minimum seconds between two redraws of the bar (Keras: 0.05).
    """

    def __init__(self, count_mode: str = "steps", *, stream=None, interval: float = 0.05):
        super().__init__()
        if count_mode != "steps":
            raise ValueError(
                f"ProgbarLogger only supports count_mode='steps' (as Keras 3 does). Received: count_mode={count_mode!r}"
            )
        self.count_mode = count_mode
        self.stream = stream
        self.interval = interval
        self.seen = 0
        self.target = None
        self.verbose = 1
        self.epochs = 1
        self._called_in_fit = False
        self._active = False
        self._bar = None
        self._start = 0.0
        self._time_after_first_step = None
        self._last_update = -math.inf
        self.refresh_count = 0  # redraws of the bar (each one reads the logs once)

    # Keras `ProgbarLogger.set_params`.
    def set_params(self, params):
        super().set_params(params)
        verbose = params.get("verbose", 1)
        if verbose == "auto":
            verbose = 1
        self.verbose = verbose
        self.epochs = params.get("epochs", 1)
        self.target = params.get("steps")

    def _file(self):
        return self.stream if self.stream is not None else sys.stdout

    # Hooks, as in Keras.
    def on_train_begin(self, logs=None):
        # When this logger is called inside `fit`, validation is silent.
        self._called_in_fit = True

    def on_train_end(self, logs=None):
        self._close_bar()
        # Lets the same instance show a later evaluate()/predict() (Keras builds a
        # new logger per call, so its flag never needs resetting).
        self._called_in_fit = False

    def on_test_begin(self, logs=None):
        if not self._called_in_fit:
            self._reset_progbar()
            self._maybe_init_progbar()

    def on_predict_begin(self, logs=None):
        self._reset_progbar()
        self._maybe_init_progbar()

    def on_epoch_begin(self, epoch, logs=None):
        self._reset_progbar()
        if self.verbose and self.epochs > 1:
            print_msg(f"Epoch {epoch + 1}/{self.epochs}", stream=self._file())
        self._maybe_init_progbar()

    def on_train_batch_end(self, batch, logs=None):
        self._update_progbar(batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        if not self._called_in_fit:
            self._update_progbar(batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        # Don't pass prediction results.
        self._update_progbar(batch, None)

    def on_epoch_end(self, epoch, logs=None):
        self._finalize_progbar(logs)

    def on_test_end(self, logs=None):
        if not self._called_in_fit:
            self._finalize_progbar(logs)

    def on_predict_end(self, logs=None):
        self._finalize_progbar(logs)

    # Progress state.
    def _reset_progbar(self):
        self._close_bar()
        self.seen = 0
        self._active = False

    def _maybe_init_progbar(self):
        if self._active:
            return
        self._active = True
        self._start = time.time()
        self._time_after_first_step = None
        self._last_update = -math.inf
        if self.verbose == 1 and is_chief():
            known = self.target is not None and self.target > 0
            ncols, nrows = _screen_size(self._file())
            self._bar = _Bar(
                count=self._count_str(0),
                total=self.target if known else None,
                file=self._file(),
                bar_format="{count} {bar:20}{info}" if known else "{count}{info}",
                mininterval=0,  # throttled here, where the logs are read
                miniters=1,
                leave=True,
                dynamic_ncols=False,
                ncols=ncols,
                nrows=nrows,
            )

    def _close_bar(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _count_str(self, current):
        if self.target is not None and self.target > 0:
            numdigits = int(math.log10(self.target)) + 1
            return f"{current:{numdigits}d}/{self.target}"
        return f"{current:7d}/Unknown"

    def _time_per_step(self, current, now):
        # Keras `Progbar._estimate_step_duration` (ignores the first, compiling step).
        if not current:
            return 0
        if self._time_after_first_step is not None and current > 1:
            return (now - self._time_after_first_step) / (current - 1)
        return (now - self._start) / current

    def _update_progbar(self, batch, logs=None):
        self._maybe_init_progbar()
        self.seen = batch + 1  # One-indexed.
        if self.seen == 1 and self._time_after_first_step is None:
            self._time_after_first_step = time.time()
        if self._bar is None:
            return
        now = time.monotonic()
        if now - self._last_update < self.interval:
            return  # Not redrawing: leave the device values alone.
        self._last_update = now
        self._redraw(self.seen, logs, finalize=False)

    def _metrics_str(self, logs, abs_threshold):
        info = ""
        for k, v in (logs or {}).items():
            avg = _to_number(v)
            info += f" - {k}:"
            big = abs(avg) > 1e-3 if abs_threshold else avg > 1e-3
            info += f" {avg:.4f}" if big else f" {avg:.4e}"
        return info

    def _redraw(self, current, logs, finalize):
        # Keras `Progbar.update` with verbose=1.
        now = time.time()
        time_per_unit = self._time_per_step(current, now)
        if self.target is not None and self.target > 0 and not finalize:
            eta = time_per_unit * (self.target - current)
            if eta > 3600:
                eta_format = f"{int(eta // 3600)}:{int((eta % 3600) // 60):02d}:{int(eta % 60):02d}"
            elif eta > 60:
                eta_format = f"{int(eta // 60)}:{int(eta % 60):02d}"
            else:
                eta_format = f"{int(eta)}s"
            info = f" {eta_format}"
        else:
            info = f" {now - self._start:.0f}s"
        info += _format_time(time_per_unit, "step")
        info += self._metrics_str(logs, abs_threshold=True)
        bar = self._bar
        bar.count = self._count_str(current)
        bar.info = info
        bar.n = current
        self.refresh_count += 1
        if not finalize:
            bar.refresh()  # (when finalizing, `close()` draws the last state)

    def _finalize_progbar(self, logs):
        if not self._active:
            return
        if self.target is None:
            self.target = self.seen
        current = self.target
        if self._bar is not None:
            if self.target > 0 and self._bar.total is None:
                self._bar.total = self.target
                self._bar.bar_format = "{count} {bar:20}{info}"
            # Redraws are trimmed to the terminal's width; the last one is kept whole.
            self._bar.ncols = None
            self._redraw(current, logs, finalize=True)
            self._close_bar()
        elif self.verbose == 2 and self.target > 0:
            now = time.time()
            info = f"{self._count_str(current)} - {now - self._start:.0f}s"
            info += f" -{_format_time(self._time_per_step(current, now), 'step')}"
            info += self._metrics_str(logs, abs_threshold=False)
            print_msg(info, stream=self._file())
        self._active = False
