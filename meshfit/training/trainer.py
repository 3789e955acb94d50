"""Keras's training entry points, as a base class of `meshfit.Model` (Keras 3's `Trainer`).

`fit`, `evaluate`, `predict` and the `*_on_batch` calls check their arguments, turn inputs into data sources
(`fit_inputs`), build the steps on the first batch, order the callbacks (`callback_setup`) and run the loops
(`loop`). What they need of the model (its session, strategy, step builder and compile settings) is the
`Model`'s; the default callbacks' classes are given by it (`_history_class`, `_progbar_class`), as they live
in the layer above this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from meshfit.runtime import start_phases
from meshfit.training import callback_setup, fit_inputs
from meshfit.training.loop import evaluate_loop, fit_loop, host_logs, predict_loop

if TYPE_CHECKING:
    from meshfit import callbacks as callbacks_lib
    from meshfit.training.callback_protocol import CallbackList

__all__ = ["Trainer"]


class Trainer:
    """`fit`, `evaluate`, `predict`, `train_on_batch`, `test_on_batch` and `predict_on_batch` of a `Model`."""

    #: The default callbacks' classes (`meshfit.callbacks`, a layer above): set by `Model`.
    _history_class: type
    _progbar_class: type

    def _callbacks(self, callbacks, verbose: int, steps: int | None, epochs: int = 1, history=None) -> CallbackList:
        """The callbacks of one call, ordered with its defaults (`callback_setup.callback_list`)."""
        return callback_setup.callback_list(
            callbacks,
            model=self,
            progbar=self._progbar_class,
            history=history,
            verbose=verbose,
            epochs=epochs,
            steps=steps,
        )

    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: int | str = "auto",
        callbacks: Sequence[callbacks_lib.Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        class_weight: dict[int, float] | None = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int | Sequence[int] = 1,
    ) -> callbacks_lib.History:
        """Trains the model for a number of epochs (Keras's `fit`); returns a `History`.

        The last partial batch of an epoch is trained on exactly (padded and masked), with no recompilation (a loss
        returning a scalar: one, see `compile`). Every check runs before any state changes.

        Args:
            x: input data: a numpy/JAX array, a dict, tuple or list of arrays, or an iterable of batches (a
                generator, a grain dataset) yielding `(x, y)` or `(x, y, sample_weight)`. A list or tuple of arrays
                is passed to the module as positional arguments; a dict as keyword arguments when the module's
                `__call__` names every key, else as one argument.
            y: targets, for array `x`; None when `x` yields them. For a module with several outputs, a dict or list
                shaped like its outputs (those no loss or metric reads may be left out).
            batch_size: the global batch size, split over the strategy's devices and processes (default 32); None
                for datasets.
            epochs: the index of the epoch to stop after (with `initial_epoch`, as in Keras: epochs `initial_epoch`
                to `epochs - 1` run).
            verbose: "auto" or 1 (progress bar), 2 (a line per epoch), 0 (silent).
            callbacks: `meshfit.callbacks.Callback` objects; History is added.
            validation_split: the fraction of array data (taken from the end, before shuffling) held out to validate
                on after each epoch.
            validation_data: `(x_val, y_val)`, `(x_val, y_val, sample_weight)` or a dataset, evaluated after each
                epoch (`val_` logs). A re-iterable dataset (grain, anything whose `iter()` starts anew) is read from
                its start each time; a one-shot iterator (a generator) is kept on the host as it is read, up to
                `meshfit.data.REPLAY_BYTES`, and replayed (beyond that, a warning, and no `val_` logs once it ran
                out).
            shuffle: shuffle array data anew each epoch (seeded by the model's `seed`; passes are numbered across
                calls of fit).
            class_weight: `{class: weight}`, multiplied into the sample weights (a model with one output).
            sample_weight: per-sample weights for array data: a `(samples,)` array for every output, or a dict/list
                of them per output.
            initial_epoch: the epoch to start at (to continue an earlier fit).
            steps_per_epoch: batches per epoch; required for an endless iterator, optional otherwise (an array epoch
                stops early).
            validation_steps: batches of `validation_data` per evaluation.
            validation_batch_size: batch size for array `validation_data` (default: `batch_size`).
            validation_freq: validate every N epochs (an int) or after the epochs listed (1-based, as in Keras).

        Returns:
            A `History` whose `.history` maps each log name to its per-epoch values.

        Raises:
            meshfit.Preempted: after a SIGTERM was handled by a callback that saves (BackupAndRestore); exits with
                status 143 if uncaught.
        """
        start_phases.mark("fit called")
        self._check_strategy("fit")
        self._require_compiled("fit")
        verbose = fit_inputs.verbose_level(verbose)
        fit_inputs.check_epochs(epochs, initial_epoch, validation_freq)
        # Armed before anything compiles or restores: a SIGTERM from now on ends in a backup.
        watch = callback_setup.preemption_watch(callbacks, self.session.context.timer)
        with watch or contextlib.nullcontext(), self.session.context.timer:  # the timer: where the fit's time goes
            data, all_data, val_data = self._inputs.fit_sources(
                x,
                y,
                sample_weight,
                batch_size,
                shuffle=shuffle,
                steps_per_epoch=steps_per_epoch,
                class_weight=class_weight,
                validation_split=validation_split,
                validation_data=validation_data,
                validation_batch_size=validation_batch_size,
            )
            first = self._inputs.first_batch(data)
            if first.y is None and self._needs_targets("train_step"):
                raise ValueError("`fit()` needs targets: pass `y`, or a dataset yielding (x, y) pairs.")
            self._build(first)
            fit_inputs.check_labels(self._builder.label_ranges, all_data, val_data if all_data is data else None)
            self.session.check_batches(data)
            if val_data is not None:
                self._check_input(self._inputs.first_batch(val_data))
                self.session.check_batches(val_data)
            history = self._history_class()
            callback_list = self._callbacks(callbacks, verbose, data.steps_per_epoch, epochs, history)
            self.history = history
            self.stop_training = False
            with callback_setup.running_fit(self.session, data, callback_list, initial_epoch):
                fit_loop(
                    self,
                    data,
                    epochs=epochs,
                    initial_epoch=initial_epoch,
                    callbacks=callback_list,
                    val_data=val_data,
                    validation_freq=validation_freq,
                    validation_steps=validation_steps,
                    watch=watch,
                )
        return history

    @overload  # (so that a type checker knows `evaluate(..., return_dict=True)["accuracy"]` is a float)
    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[callbacks_lib.Callback] | None = None,
        *,
        return_dict: Literal[True],
    ) -> dict[str, float]: ...

    @overload
    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[callbacks_lib.Callback] | None = None,
        return_dict: bool = False,
    ) -> float | list[float] | dict[str, float]: ...

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[callbacks_lib.Callback] | None = None,
        return_dict: bool = False,
    ) -> float | list[float] | dict[str, float]:
        """Loss and metrics over the data (Keras's `evaluate`).

        Results over N samples equal the full-batch values, whatever the batch size (partial batches are masked).

        Args:
            x: input data, as for `fit`.
            y: targets, for array `x`, as for `fit`.
            batch_size: the global batch size (default 32); None for datasets.
            verbose: "auto" or 1 (progress bar), 2 or 0 (silent).
            sample_weight: per-sample weights for array data, as for `fit`.
            steps: stop after this many batches (None: the whole data).
            callbacks: callbacks whose test hooks are called.
            return_dict: return `{name: value}` instead of a list.

        Returns:
            A dict with `return_dict=True`; otherwise the loss alone when there are no metrics, else a list in
            `metrics_names` order: the loss, each output's loss (several losses), the metrics.
        """
        self._check_strategy("evaluate")
        self._require_compiled("evaluate")
        verbose = fit_inputs.verbose_level(verbose)
        data = self._inputs.source(x, y, sample_weight, batch_size, steps=None, what="evaluate")
        first = self._inputs.first_batch(data)
        if first.y is None and self._needs_targets("test_step"):
            raise ValueError("`evaluate()` needs targets: pass `y`, or a dataset yielding (x, y) pairs.")
        self._build(first)
        fit_inputs.check_labels(self._builder.label_ranges, data)
        self.session.check_batches(data)
        callback_list = self._callbacks(callbacks, verbose, steps or data.steps_per_epoch)
        logs = evaluate_loop(self, data, callbacks=callback_list, steps=steps)
        return self._ordered(logs, return_dict)

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        steps: int | None = None,
        callbacks: Sequence[callbacks_lib.Callback] | None = None,
    ) -> Any:
        """Model outputs for `x` as numpy (Keras's `predict`), exact on partial batches.

        Works without `compile` (as in Keras).

        Args:
            x: input data: arrays (passed to the module as for `fit`) or an iterable of batches (targets, if any,
                are ignored).
            batch_size: the global batch size (default 32); None for datasets.
            verbose: "auto" or 1 (progress bar), 2 or 0 (silent).
            steps: stop after this many batches (None: the whole data).
            callbacks: callbacks whose predict hooks are called.

        Returns:
            The outputs for every input row, as numpy arrays (a pytree of them for a module with several outputs).
        """
        self._check_strategy("predict")
        if self.abstract:
            self._require_compiled("predict")
        verbose = fit_inputs.verbose_level(verbose)
        data = self._inputs.source(x, None, None, batch_size, steps=None, what="predict")
        first = self._inputs.first_batch(data)
        if not self.session.built:
            if self._compiled is None:  # predict works without compile, as in Keras
                self.compile(optimizer="sgd")
            self._build(first)
        else:
            self._check_input(first)
        callback_list = self._callbacks(callbacks, verbose, steps or data.steps_per_epoch)
        return predict_loop(self, data, callbacks=callback_list, steps=steps)

    # -- one batch (Keras's *_on_batch) ---------------------------------------------------------

    def train_on_batch(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        class_weight: dict[int, float] | None = None,
        return_dict: bool = False,
    ) -> float | list[float] | dict[str, float]:
        """One gradient update on one batch: every row of `x` and `y` (Keras's `train_on_batch`).

        Metrics are counted afresh for the batch, as in Keras 3. The step is compiled once per batch shape, under
        any strategy.

        Args:
            x: one batch of inputs: an array, or a dict/tuple/list of arrays.
            y: its targets.
            sample_weight: per-sample weights for the batch.
            class_weight: `{class: weight}`, multiplied into the sample weights.
            return_dict: return `{name: value}` instead of a list.

        Returns:
            As `evaluate`: a dict with `return_dict=True`; otherwise the loss alone when there are no metrics, else
            `[loss, *metrics]`.
        """
        self._check_strategy("train_on_batch")
        self._require_compiled("train_on_batch")
        if class_weight is not None:
            sample_weight = fit_inputs.class_weights(y, class_weight, sample_weight)
        rows = fit_inputs.rows(x, "train_on_batch")
        batch = self._inputs.first_batch(self._inputs.source(x, y, sample_weight, rows, what="train_on_batch"))
        if batch.y is None and self._needs_targets("train_step"):
            raise ValueError("`train_on_batch()` needs targets: pass `y`.")
        self._build(batch)
        logs = host_logs(self.session.train_batch(batch), self.strategy.to_host)
        return self._ordered(logs, return_dict)

    def test_on_batch(
        self, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False
    ) -> float | list[float] | dict[str, float]:
        """Loss and metrics of one batch: every row of `x` and `y` (Keras's `test_on_batch`).

        Args:
            x: one batch of inputs: an array, or a dict/tuple/list of arrays.
            y: its targets.
            sample_weight: per-sample weights for the batch.
            return_dict: return `{name: value}` instead of a list.

        Returns:
            As `evaluate`.
        """
        rows = fit_inputs.rows(x, "test_on_batch")
        return self.evaluate(x, y, batch_size=rows, sample_weight=sample_weight, verbose=0, return_dict=return_dict)

    def predict_on_batch(self, x: Any) -> Any:
        """The outputs for one batch: every row of `x` (Keras's `predict_on_batch`), as numpy.

        Args:
            x: one batch of inputs: an array, or a dict/tuple/list of arrays.
        """
        return self.predict(x, batch_size=fit_inputs.rows(x, "predict_on_batch"), verbose=0)

    def _ordered(self, logs: dict, return_dict: bool) -> float | list[float] | dict[str, float]:
        if return_dict:
            return logs
        names = self.metrics_names
        values = [logs[name] for name in names] if set(names) == set(logs) else list(logs.values())
        return values[0] if len(values) == 1 else values
