"""The one training, evaluation and prediction loop, for every strategy.

The loop walks epochs and batches, calls callbacks, and hands each batch to
the model's `Session`, which dispatches compiled steps asynchronously. Values
come back to the host only at logging points (the end of an epoch, or when a
callback reads a per-batch value), and at most `2 * max_in_flight` executions
are queued at once (`meshfit.training.in_flight.InFlight`; more, up to a few milliseconds
of tiny steps, for a state on one device), so slow collectives never pile up behind a
fast Python loop.

The loop marks where its time goes as the session's phases (`Session.phase`,
`meshfit.training.fit_timer.FitTimer`): waiting for input, waiting for the devices at
the end of an epoch, validation and batch callbacks (the `CallbackList` marks
the other hooks; the session marks the steps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import numpy as np

from meshfit.runtime import start_phases
from meshfit.runtime.preemption import Preempted, PreemptionWatch
from meshfit.training.callback_protocol import CallbackList


def host_logs(logs, to_host: Callable) -> dict[str, float]:
    """Pulls a dict of device values to the host (a host sync): scalars as Python floats, a metric with one
    value per class (`F1Score(average=None)`) as a numpy array, as Keras logs it."""
    return {k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in to_host(logs).items()} if logs else {}


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

    A callback may `self.context.restore(state, position)` in `on_train_begin`
    (BackupAndRestore does) to continue from the middle of an epoch. The
    session numbers the passes over array data across calls of fit, so each
    epoch is shuffled anew. If a
    callback handles preemption, SIGTERM stops training at the next step
    boundary: `on_preemption` runs, then `Preempted` is raised. `watch` is
    the armed `PreemptionWatch` (armed by `fit` before anything compiles, so a
    SIGTERM that comes early still ends in a backup).
    """
    session = model.session
    in_callbacks, waiting_for_input = session.phase("callbacks"), session.phase("input")
    to_host = model.strategy.to_host
    callbacks.on_train_begin()
    start_phases.mark("train began")
    batch_begin = callbacks.bound_hooks("on_train_batch_begin")
    batch_end = callbacks.bound_hooks("on_train_batch_end")
    start_epoch, start_step = session.start_point(initial_epoch)
    per_step = bool(batch_begin or batch_end) or watch is not None  # else steps may run in blocks
    device_logs = callbacks.accepts_device_logs  # no callback reads epoch values now: no sync per epoch
    epoch_logs: dict[str, float] = {}
    for epoch in range(start_epoch, epochs):
        if start_step == 0:
            session.reset_train_metrics()  # else they were restored mid-epoch
        data_epoch = session.begin_epoch(epoch, start_step)
        callbacks.on_epoch_begin(epoch)
        logs, step = None, start_step
        executions = session.executions(train_data, data_epoch, start_step, per_step)
        for execution in _timed(executions, waiting_for_input):
            count = execution.count
            if batch_begin:
                with in_callbacks:
                    for hook in batch_begin:
                        hook(step)
            logs = session.train(execution)
            step += count
            session.count(count)
            if not start_phases.reached("first step"):  # an error from now on is not one every start repeats
                _first_step_done(session, logs)
            if batch_end:
                with in_callbacks:
                    for hook in batch_end:
                        hook(step - 1, logs)
            if model.stop_training:
                break
            if watch is not None and watch.should_stop(session.step):
                session.finish_epoch(logs)
                callbacks.on_preemption(epoch, step)
                raise Preempted()
        with waiting_for_input:
            if epoch + 1 < epochs and not model.stop_training:
                session.prefetch(train_data, data_epoch + 1, per_step)  # host work the devices need not wait for
            else:
                train_data.prepare(data_epoch + 1)  # the next fit's shuffle, while the devices finish this one
        logs = session.finish_epoch(logs)
        if logs is None and start_step == 0:  # a one-shot input ran out of data
            break
        start_step = 0
        session.epoch_done()
        if logs is None:
            logs = session.epoch_logs()
        with session.phase("steps"):  # the host waits here for the epoch's last steps
            epoch_logs = dict(logs) if device_logs else host_logs(logs, to_host)
        if val_data is not None and _should_validate(epoch, validation_freq):
            with session.phase("evaluate"):
                val_logs = evaluate_loop(model, val_data, callbacks=callbacks, steps=validation_steps)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callbacks.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    callbacks.on_train_end(epoch_logs)


def _first_step_done(session, logs) -> None:
    """Marks this process's first training step (`start_phases`); under `meshfit launch --verbose` it waits for
    the step's values first, so the phase ends when the step is done rather than dispatched."""
    if start_phases.verbose():
        jax.block_until_ready(logs)
    start_phases.first_step(session.timer.totals().get("compile", 0.0))


def _timed(items: Iterator, phase) -> Iterator:
    """Yields `items`, the time spent waiting for each counted in `phase`."""
    items = iter(items)
    while True:
        with phase:
            item = next(items, _END)
        if item is _END:
            return
        yield item


_END = object()


def _should_validate(epoch: int, validation_freq) -> bool:
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return (epoch + 1) in validation_freq


def evaluate_loop(model, eval_data, *, callbacks: CallbackList, steps=None) -> dict[str, float]:
    """One pass over `eval_data` with fresh metric accumulators; returns host floats."""
    session = model.session
    metrics = session.fresh_eval_metrics()
    callbacks.on_test_begin()
    logs, step = None, 0
    for count, batch in _limit(session.host_groups(eval_data), steps):
        callbacks.on_test_batch_begin(step)
        metrics, logs = session.evaluate(metrics, batch)
        step += count
        callbacks.on_test_batch_end(step - 1, logs)
    session.finish_pass()
    result = host_logs(logs, model.strategy.to_host)
    callbacks.on_test_end(result)
    return result


def predict_loop(model, data, *, callbacks: CallbackList, steps=None):
    """Predictions for every real row of `data`, as numpy (padding rows dropped)."""
    session = model.session
    callbacks.on_predict_begin()
    outputs, masks, step = [], [], 0
    for count, batch in _limit(session.host_groups(data), steps):
        callbacks.on_predict_batch_begin(step)
        y_pred, mask = session.predict(batch)  # the global mask: rows of every process
        outputs.append(y_pred)
        masks.append(mask)
        step += count
        callbacks.on_predict_batch_end(step - 1, {"outputs": y_pred})
    session.finish_pass()
    if not outputs:
        raise ValueError("predict() received no batches; the input is empty.")
    outputs, masks = model.strategy.to_host((outputs, masks))
    keep = np.concatenate([np.reshape(m, -1) for m in masks]) > 0
    stacked = session.steps_per_execution > 1

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
