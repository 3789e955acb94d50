"""`TensorBoard`: scalars and weight histograms for TensorBoard, written with tensorboardX.

Same layout and tags as Keras's `keras.callbacks.TensorBoard`: event files in
`<log_dir>/train` and `<log_dir>/validation`; `epoch_<name>` scalars per epoch
(the `val_` prefix stripped in the validation writer), `batch_<name>` every
`update_freq` training batches, `epoch_learning_rate`,
`evaluation_<name>_vs_iterations` after each evaluation, and
`<weight>/histogram` every `histogram_freq` epochs. With `profile_batch`, a
`jax.profiler` trace of those training batches goes to `<log_dir>/train/plugins/profile/<run>/`
(`*.xplane.pb` for TensorBoard's profile plugin, `*.trace.json.gz` for Perfetto).
With `write_graph` (Keras's default), the train step's jaxpr goes to
`<log_dir>/train/train_step.jaxpr.txt` and to the text summary `train_step_jaxpr`
at each `fit`'s start: JAX programs have no TensorBoard graph. Keras's
`write_images` and `embeddings_*` have nothing to act on in a Flax model and warn.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings

import jax
import numpy as np

from meshfit.callbacks.console import is_chief
from meshfit.core import keras_names
from meshfit.training.callback_protocol import Callback

# Event file names carry the time in whole seconds; a per-process counter keeps
# writers opened within the same second (e.g. two quick fits) from overwriting
# each other's file.
_writer_ids = itertools.count()


def _import_summary_writer():
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise ImportError(
            "The TensorBoard callback needs the `tensorboardX` package. "
            "Install it with `pip install meshfit[tensorboard]`."
        ) from e
    return SummaryWriter


class TensorBoard(Callback):
    """Enable visualizations for TensorBoard.

    Only process 0 writes. Batch-level logs are read (from the device) only
    for the batches that are written.

    Args:
        log_dir: directory where to save the event files (one sub-directory
            per writer: `train`, `validation`). Don't share it with other
            callbacks.
        histogram_freq: frequency (in epochs) at which to write histograms of
            the model's weights (`model.get_weights()`, named by
            `model.weight_names()` when the model has it, else `weight_<i>`).
            0 disables them.
        write_graph: write the train step's jaxpr at the start of each `fit`
            (`<log_dir>/train/train_step.jaxpr.txt` and the text summary
            `train_step_jaxpr`, in TensorBoard's Text tab), as Keras writes
            its graph. Tracing the step once costs what the first step's
            trace costs (no compilation).
        write_images: Keras's weight images; ignored (a warning).
        write_steps_per_second: whether to log the training steps per second
            (`epoch_steps_per_second`, and `batch_steps_per_second` on the
            batches written).
        update_freq: `"epoch"`, `"batch"` or an integer: with an integer N,
            the batch logs are written every N training batches (`"batch"` is
            1), at the global step `1, 2, ...` counted across epochs (a call that
            runs several steps, with `steps_per_execution`, counts them all).
        profile_batch: training batches to trace with `jax.profiler`, counted
            from 1 across epochs: an int N (batch N alone), a pair
            `(start, stop)` or a string `"start,stop"`; 0 (default) traces
            nothing. With `steps_per_execution`, tracing starts at the first
            call that begins at or after `start` and stops after the call
            that reaches `stop`. Process 0 traces.
        embeddings_freq: Keras's Projector data; ignored (a warning): a Flax
            module has no `Embedding` layers to find.
        embeddings_metadata: ignored (a warning), as `embeddings_freq`.
    """

    def __init__(
        self,
        log_dir="logs",
        histogram_freq=0,
        write_graph=True,
        write_images=False,
        write_steps_per_second=False,
        update_freq="epoch",
        profile_batch=0,
        embeddings_freq=0,
        embeddings_metadata=None,
    ):
        super().__init__()
        for name, value, default in (
            ("write_images", write_images, False),
            ("embeddings_freq", embeddings_freq, 0),
            ("embeddings_metadata", embeddings_metadata, None),
        ):
            if value != default:
                keras_names.warn_ignored("TensorBoard", name, value)
        self._profile_range = _profile_range(profile_batch)
        self._summary_writer_cls = _import_summary_writer()
        self.log_dir = os.fspath(log_dir)
        self.histogram_freq = histogram_freq
        self.write_graph = write_graph
        self.write_steps_per_second = write_steps_per_second
        update_freq = 1 if update_freq == "batch" else update_freq
        if update_freq != "epoch" and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise ValueError(
                f"`update_freq` must be 'epoch', 'batch' or a positive integer. Received: update_freq={update_freq!r}"
            )
        self.update_freq = update_freq
        self._train_dir = os.path.join(self.log_dir, "train")
        self._val_dir = os.path.join(self.log_dir, "validation")
        self._writers = {}
        self._global_train_batch = 0
        self._epoch_base = 0
        self._epoch_start_time = 0.0
        self._epoch_steps = 0
        self._batch_start_time = 0.0
        self._tracing = False
        self._traced = False

    def set_model(self, model):
        super().set_model(model)
        self._close_writers()  # Resets writers.

    # Writers (created lazily, on process 0 only).
    def _writer(self, key):
        if key not in self._writers:
            logdir = self._train_dir if key == "train" else self._val_dir
            suffix = f".{os.getpid()}.{next(_writer_ids):06d}"
            self._writers[key] = self._summary_writer_cls(logdir=logdir, filename_suffix=suffix)
        return self._writers[key]

    @property
    def _train_writer(self):
        return self._writer("train")

    @property
    def _val_writer(self):
        return self._writer("val")

    def _close_writers(self):
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    # Hooks.
    def on_train_begin(self, logs=None):
        self._global_train_batch = 0
        self._epoch_base = 0
        self._traced = False
        if self.write_graph and is_chief():
            self._write_graph()

    def on_train_end(self, logs=None):
        self._stop_trace()
        self._close_writers()

    def close(self) -> None:
        self._stop_trace()  # a fit that raised while tracing

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_base = self._global_train_batch
        self._epoch_steps = 0
        self._epoch_start_time = time.time()

    def on_train_batch_begin(self, batch, logs=None):
        if self.write_steps_per_second:
            self._batch_start_time = time.time()
        if self._profile_range and not self._traced and not self._tracing and is_chief():
            if self._epoch_base + batch + 1 >= self._profile_range[0]:
                jax.profiler.start_trace(self._train_dir)
                self._tracing = True

    def on_train_batch_end(self, batch, logs=None):
        # The global step comes from the batch index, so a call that ran several
        # steps at once (steps_per_execution > 1) advances it by all of them.
        previous = self._global_train_batch
        self._global_train_batch = step = self._epoch_base + batch + 1
        self._epoch_steps = batch + 1
        if self._tracing and step >= self._profile_range[1]:
            jax.block_until_ready(logs)  # the traced steps have run on the devices
            self._stop_trace()
        if self.update_freq == "epoch" or step // self.update_freq == previous // self.update_freq:
            return  # No multiple of update_freq reached: leave the device values alone.
        if not is_chief():
            return
        writer = self._train_writer
        if self.write_steps_per_second:
            batch_run_time = time.time() - self._batch_start_time
            if batch_run_time > 0:
                writer.add_scalar("batch_steps_per_second", (step - previous) / batch_run_time, step)
        if isinstance(logs, dict):
            for name, value in logs.items():
                writer.add_scalar(f"batch_{name}", _scalar(value), step)

    def on_test_end(self, logs=None):
        if not logs or not is_chief():
            return
        step = self._iterations()
        writer = self._val_writer
        for name, value in logs.items():
            writer.add_scalar(f"evaluation_{name}_vs_iterations", _scalar(value), step)
        writer.flush()

    def on_epoch_end(self, epoch, logs=None):
        """Writes epoch metrics and histograms, then flushes."""
        if not is_chief():
            return
        self._log_epoch_metrics(epoch, logs)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            self._log_weights(epoch)
        for writer in self._writers.values():
            writer.flush()

    # Helpers.
    def _write_graph(self):
        """The train step's jaxpr as a file and a text summary (traced on the host: nothing compiled or run)."""
        if not hasattr(self.model, "fit_context"):  # not a meshfit Model: no step to trace
            return
        try:
            jaxpr = self.context.train_step_jaxpr()
        except Exception as error:  # the graph is an aid: a step that cannot be traced apart does not stop fit
            warnings.warn(
                f"TensorBoard(write_graph=True) could not trace the train step: {type(error).__name__}: {error}. "
                "Pass write_graph=False to skip it.",
                UserWarning,
                stacklevel=2,
            )
            return
        if jaxpr is None:
            return
        text = str(jaxpr)
        os.makedirs(self._train_dir, exist_ok=True)
        with open(os.path.join(self._train_dir, "train_step.jaxpr.txt"), "w") as f:
            f.write(text)
        # Indented: Markdown shows it as code, lines and spacing kept.
        writer = self._train_writer
        writer.add_text("train_step_jaxpr", "\n".join("    " + line for line in text.splitlines()), self._iterations())
        writer.flush()

    def _stop_trace(self):
        if self._tracing:
            self._tracing = False
            self._traced = True
            jax.profiler.stop_trace()

    def _iterations(self):
        optimizer = getattr(self.model, "optimizer", None)
        iterations = getattr(optimizer, "iterations", None) if optimizer is not None else None
        if iterations is not None:
            try:
                return int(iterations)
            except (TypeError, ValueError):
                pass
        return self._global_train_batch

    def _collect_learning_rate(self, logs):
        if "learning_rate" in logs:
            return logs
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None:
            return logs
        # Several optimizers (a dict): each one's rate, as "<key>_learning_rate".
        named = optimizer.items() if isinstance(optimizer, dict) else [("", optimizer)]
        for key, one in named:
            try:
                logs[f"{key}_learning_rate" if key else "learning_rate"] = float(one.learning_rate)
            except (AttributeError, TypeError, ValueError):  # No learning rate to read.
                pass
        return logs

    def _log_epoch_metrics(self, epoch, logs):
        if not logs:
            return

        train_logs = {k: v for k, v in logs.items() if not k.startswith("val_")}
        val_logs = {k: v for k, v in logs.items() if k.startswith("val_")}
        train_logs = self._collect_learning_rate(train_logs)
        if self.write_steps_per_second:
            elapsed = time.time() - self._epoch_start_time
            if elapsed > 0:
                train_logs["steps_per_second"] = self._epoch_steps / elapsed

        if train_logs:
            writer = self._train_writer
            for name, value in train_logs.items():
                writer.add_scalar(f"epoch_{name}", _scalar(value), epoch)
        if val_logs:
            writer = self._val_writer
            for name, value in val_logs.items():
                name = name[4:]  # Remove 'val_' prefix.
                writer.add_scalar(f"epoch_{name}", _scalar(value), epoch)

    def _weight_names(self, n):
        names_fn = getattr(self.model, "weight_names", None)
        if callable(names_fn):
            names = list(names_fn())
            if len(names) == n:
                return names
        return [f"weight_{i}" for i in range(n)]

    def _log_weights(self, epoch):
        weights = self.model.get_weights()
        names = self._weight_names(len(weights))
        writer = self._train_writer
        for name, weight in zip(names, weights, strict=True):
            tag = f"{str(name).replace(':', '_')}/histogram"
            writer.add_histogram(tag, np.asarray(weight), epoch)
        writer.flush()


def _profile_range(profile_batch) -> tuple[int, int] | None:
    """Keras's `profile_batch` as `(start, stop)` (1-based, inclusive), or None for no profiling."""
    error = (
        "`profile_batch` must be a non-negative int, a pair (start, stop) of positive ints with start <= stop, "
        f"or a string 'start,stop'. Received: profile_batch={profile_batch!r}."
    )
    value = profile_batch
    if isinstance(value, str):
        try:
            value = tuple(int(part) for part in value.split(","))
        except ValueError:
            raise ValueError(error) from None
        value = value[0] if len(value) == 1 else value
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(error)
        return (value, value) if value else None
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and 0 < value[0] <= value[1]
    ):
        return int(value[0]), int(value[1])
    raise ValueError(error)


def _scalar(value):
    if isinstance(value, float):
        return value
    try:
        return float(value)
    except TypeError:
        return float(np.mean(np.asarray(value)))
