"""The one training, evaluation and prediction loop, for every strategy.

The loop walks epochs and batches, calls callbacks, and hands each batch to
the model's `Runner`, which dispatches compiled steps asynchronously. Values
come back to the host only at logging points (the end of an epoch, or when a
callback reads a per-batch value), and at most `2 * max_in_flight` executions
are queued at once (`meshfit.in_flight.InFlight`), so slow collectives never pile up behind a
fast Python loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import numpy as np

from meshfit.callbacks.base import CallbackList
from meshfit.preemption import Preempted, PreemptionWatch


def host_logs(logs, to_host: Callable) -> dict[str, float]:
    """Pulls a dict of device scalars to Python floats (a host sync)."""
    return {k: float(v) for k, v in to_host(logs).items()} if logs else {}


def fit_loop(
    model,
    train_data,
    *,
    epochs: int,
    initial_epoch: int,
    callbacks: CallbackList,
    val_data=None,
    validation_freq=1,
    validation_steps=None,
    watch: PreemptionWatch | None = None,
) -> None:
    """Runs epochs of training with Keras's callback order and `stop_training` checks.

    A callback may set `model._resume_point = (epoch, batch)` in `on_train_begin`
    (BackupAndRestore does) to continue from the middle of an epoch. Epoch
    `e` reads pass `model._data_origin + e` of array data, so passes go on
    being numbered across calls of fit and each epoch is shuffled anew. If a
    callback handles preemption, SIGTERM stops training at the next step
    boundary: `on_preemption` runs, then `Preempted` is raised. `watch` is
    the armed `PreemptionWatch` (armed by `fit` before anything compiles, so a
    SIGTERM that comes early still ends in a backup).
    """
    runner = model._runner
    to_host = model.strategy.to_host
    callbacks.on_train_begin()
    batch_begin = callbacks._bound_hooks("on_train_batch_begin")
    batch_end = callbacks._bound_hooks("on_train_batch_end")
    start_epoch, start_step = model._resume_point or (initial_epoch, 0)
    model._resume_point = None
    per_step = bool(batch_begin or batch_end) or watch is not None  # else steps may run in blocks
    device_logs = callbacks.accepts_device_logs  # no callback reads epoch values now: no sync per epoch
    epoch_logs: dict[str, float] = {}
    for epoch in range(start_epoch, epochs):
        if start_step == 0:
            runner.reset_train_metrics()  # else they were restored mid-epoch
        data_epoch = model._data_origin + epoch
        model._epochs_begun = data_epoch + 1
        callbacks.on_epoch_begin(epoch)
        logs, step = None, start_step
        for count, batch in runner.train_executions(train_data, data_epoch, start_step, per_step):
            for hook in batch_begin:
                hook(step)
            logs = runner.train(batch)
            step += count
            model._host_step += count
            for hook in batch_end:
                hook(step - 1, logs)
            if model.stop_training:
                break
            if watch is not None and watch.should_stop(model._host_step):
                runner.end_epoch(logs)
                callbacks.on_preemption(epoch, step)
                raise Preempted()
        if epoch + 1 < epochs and not model.stop_training:
            runner.prefetch(train_data, data_epoch + 1, per_step)  # host work the devices need not wait for
        else:
            train_data.prepare(data_epoch + 1)  # the next fit's shuffle, while the devices finish this one
        logs = runner.end_epoch(logs)
        if logs is None and start_step == 0:  # a one-shot input ran out of data
            break
        start_step = 0
        if logs is None:
            logs = runner.steps.logs(model._state.metrics)
        epoch_logs = dict(logs) if device_logs else host_logs(logs, to_host)
        if val_data is not None and _should_validate(epoch, validation_freq):
            val_logs = evaluate_loop(model, val_data, callbacks=callbacks, steps=validation_steps)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    callbacks.on_train_end(epoch_logs)


def _should_validate(epoch: int, validation_freq) -> bool:
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return (epoch + 1) in validation_freq


def evaluate_loop(model, eval_data, *, callbacks: CallbackList, steps=None) -> dict[str, float]:
    """One pass over `eval_data` with fresh metric accumulators; returns host floats."""
    runner = model._runner
    metrics = runner.fresh_eval_metrics()
    callbacks.on_test_begin()
    logs, step = None, 0
    for count, batch in _limit(eval_data.executions(0, runner.steps_per_execution), steps):
        callbacks.on_test_batch_begin(step)
        metrics, logs = runner.evaluate(metrics, batch)
        step += count
        callbacks.on_test_batch_end(step - 1, logs)
    runner.in_flight.clear()
    result = host_logs(logs, model.strategy.to_host)
    callbacks.on_test_end(result)
    return result


def predict_loop(model, data, *, callbacks: CallbackList, steps=None):
    """Predictions for every real row of `data`, as numpy (padding rows dropped)."""
    runner = model._runner
    callbacks.on_predict_begin()
    outputs, masks, step = [], [], 0
    for count, batch in _limit(data.executions(0, runner.steps_per_execution), steps):
        callbacks.on_predict_batch_begin(step)
        y_pred, mask = runner.predict(batch)  # the global mask: rows of every process
        outputs.append(y_pred)
        masks.append(mask)
        step += count
        callbacks.on_predict_batch_end(step - 1, {"outputs": y_pred})
    runner.in_flight.clear()
    if not outputs:
        raise ValueError("predict() received no batches; the input is empty.")
    outputs, masks = model.strategy.to_host((outputs, masks))
    keep = np.concatenate([np.reshape(m, -1) for m in masks]) > 0
    stacked = runner.steps_per_execution > 1

    def real_rows(*parts):
        return np.concatenate([p.reshape((-1,) + p.shape[2:]) if stacked else p for p in parts])[keep]

    result = jax.tree.map(real_rows, *outputs)
    callbacks.on_predict_end()
    return result


def _limit(executions: Iterator, steps):
    """Stops after `steps` batches (an execution may hold several)."""
    if steps is None:
        yield from executions
        return
    done = 0
    for count, batch in executions:
        if done >= steps:
            return
        yield count, batch
        done += count
