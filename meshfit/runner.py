"""Runner: dispatches a compiled model's steps through its strategy.

It owns the compiled functions (each compiled once per batch shape and reused
across epochs and calls of fit) and swaps the model's state for the new one
after each step; the state buffers are donated, so no copy is kept. It also
decides how training batches reach the devices: one by one, or staged in
blocks that each step indexes into (see `train_executions`).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import jax
import numpy as np

from meshfit.in_flight import InFlight
from meshfit.steps import LOSS_KEY, Steps

#: Bytes of batches placed on the devices at once for single-step training from arrays.
STAGE_BYTES = 8 * 2**20
#: At most this many batches are placed at once (the host gathers them in one go).
MAX_STAGED_STEPS = 64


class Staged(NamedTuple):
    """Batches `indices` (device scalars) of a block already on the devices: one step each, in order."""

    block: Any
    indices: list


class Runner:
    def __init__(self, model, steps: Steps, steps_per_execution: int = 1, max_in_flight: int = 4):
        self.model = model
        self.steps = steps
        self.strategy = model.strategy
        self.steps_per_execution = steps_per_execution
        self.in_flight = InFlight(max_in_flight)
        multi = self.stacked = steps_per_execution > 1
        compile_ = self.strategy.compile
        self._train = self.strategy.train_function(steps, multi)
        # A short last group of an epoch runs step by step (compiled on first use).
        self._train_one = self.strategy.train_function(steps, False) if multi else self._train
        self._evaluate = compile_(steps.multi_eval_step if multi else steps.eval_step, donate_argnums=(1,))
        self._predict = compile_(steps.multi_predict_step if multi else steps.predict_step)
        self._train_staged = None
        if not multi and self.strategy.stages_batches:
            self._train_staged = compile_(steps.staged_train_step, donate_argnums=(0,))
        self._indices: list = []  # device scalars 0, 1, ... picking a batch of a staged block
        self._prefetched = None  # (data, epoch, start step, per_step, executions) read ahead by `prefetch`
        self._fresh_metrics = None  # compiled on first use, to lay out fresh accumulators like the first
        # The next epoch's accumulators, made while the devices finish an epoch: the
        # host work before an epoch's first step is what the devices wait for.
        self._spare_metrics = None

    def _variables(self):
        state = self.model._state
        return state.params, state.model_state

    def reset_train_metrics(self) -> None:
        """Fresh accumulators for an epoch: those `end_epoch` prepared, or new ones."""
        metrics, self._spare_metrics = self._spare_metrics, None
        if metrics is None:
            metrics = self.fresh_eval_metrics()
        self.model._state = self.model._state._replace(metrics=metrics)

    def fresh_eval_metrics(self):
        """Fresh loss and metric accumulators on the strategy's devices.

        After the first, they come from a compiled call laid out like the
        first: an epoch start then costs one dispatch, not a host transfer.
        """
        if self._fresh_metrics is None:
            placed = self.strategy.replicate(self.steps.init_metrics())
            shardings = jax.tree.map(lambda a: a.sharding, placed)
            self._fresh_metrics = jax.jit(self.steps.init_metrics, out_shardings=shardings)
            return placed
        return self._fresh_metrics()

    def train_executions(self, data, epoch: int, start_step: int = 0, per_step: bool = True):
        """Yields `(count, execution)` for the training steps of one epoch, from `start_step` on.

        With one step per execution and data that can gather any batch (in-memory
        arrays), batches travel to the devices in blocks of up to `STAGE_BYTES`:
        one host gather and one transfer per block, and each step picks its
        batch on the device (`Staged`, one step each). With `per_step=False`
        (nothing runs between steps: no batch callbacks, no preemption watch) a
        block's steps come as one execution, which saves the loop's work per
        step. Otherwise an execution is a host batch.
        """
        ahead, self._prefetched = self._prefetched, None
        if ahead is not None and ahead[:4] == (data, epoch, start_step, per_step):
            yield from ahead[4]
            return
        block_steps = self._block_steps(data)
        if block_steps == 1:
            yield from data.executions(epoch, self.steps_per_execution, start_step, pad_last=False)
            return
        while len(self._indices) < block_steps:
            self._indices.append(self.strategy.replicate(np.int32(len(self._indices))))
        for count, block in data.executions(epoch, block_steps, start_step, pad_last=True):
            placed = self.strategy.place_block(block)
            if not per_step:
                yield count, Staged(placed, self._indices[:count])
                continue
            for index in self._indices[:count]:
                yield 1, Staged(placed, [index])

    def prefetch(self, data, epoch: int, per_step: bool = True) -> None:
        """Prepares the first execution of `epoch` now, while the devices finish the last one.

        Only for data whose batches depend on nothing but their position
        (in-memory arrays): reading ahead of an iterator would move its state.
        """
        if not data.random_access:
            return
        executions = self.train_executions(data, epoch, per_step=per_step)
        first = next(executions, None)
        ahead = executions if first is None else itertools.chain([first], executions)
        self._prefetched = (data, epoch, 0, per_step, ahead)

    def _block_steps(self, data) -> int:
        if self._train_staged is None or not data.random_access:
            return 1
        return max(1, min(MAX_STAGED_STEPS, STAGE_BYTES // data.batch_nbytes))

    def train(self, execution):
        """One execution: staged batches, a (stacked) host batch, or a list of single batches
        (a short last group)."""
        if isinstance(execution, Staged):
            return self._train_staged_steps(execution)
        if isinstance(execution, list):
            for single in execution:
                batch = self.strategy.distribute_batch(single, False)
                self.model._state, logs = self._train_one(self.model._state, batch)
        else:
            batch = self.strategy.distribute_batch(execution, self.stacked)
            self.model._state, logs = self._train(self.model._state, batch)
        self.in_flight.add(logs[LOSS_KEY])
        return logs

    def _train_staged_steps(self, staged: Staged):
        """Each staged step in turn, with the in-flight bound kept at every step."""
        model, train, block, add = self.model, self._train_staged, staged.block, self.in_flight.add
        for index in staged.indices:
            model._state, logs = train(model._state, block, index)
            add(logs[LOSS_KEY])
        return logs

    def end_epoch(self, logs):
        """Returns the epoch's final logs (device values), after `settle`.

        Queued steps stay counted by `in_flight`: an epoch whose logs nobody
        reads yet ends without a sync, and the bound holds across epochs.
        """
        settled = self.settle()
        if self._spare_metrics is None:
            self._spare_metrics = self.fresh_eval_metrics()
        return logs if settled is None else settled

    def settle(self):
        """Applies every batch handed out but not yet applied (asynchronous strategies).

        Afterwards the state accounts for exactly the batches the data position
        counts as consumed, so what a saver writes resumes exactly. Returns the
        logs after that, or None for a strategy with nothing in flight.
        """
        drained = self._train.drain()
        if drained is None:
            return None
        self.model._state, logs = drained
        return logs

    def evaluate(self, metrics, host_batch):
        batch = self.strategy.distribute_batch(host_batch, self.stacked)
        metrics, logs = self._evaluate(self._variables(), metrics, batch)
        self.in_flight.add(logs[LOSS_KEY])
        return metrics, logs

    def predict(self, host_batch):
        batch = self.strategy.distribute_batch(host_batch, self.stacked)
        y_pred = self._predict(self._variables(), batch)
        self.in_flight.add(y_pred)
        return y_pred, batch.mask
