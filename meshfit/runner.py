"""Runner: dispatches a compiled model's steps through its strategy.

It owns the compiled functions (each compiled once per batch shape and reused
across epochs and calls of fit) and swaps the model's state for the new one
after each step; the state buffers are donated, so no copy is kept.
"""

from __future__ import annotations

from meshfit.loop import InFlight
from meshfit.steps import LOSS_KEY, Steps


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

    def _variables(self):
        state = self.model._state
        return state.params, state.model_state

    def reset_train_metrics(self) -> None:
        self.model._state = self.model._state._replace(metrics=self.fresh_eval_metrics())

    def fresh_eval_metrics(self):
        return self.strategy.replicate(self.steps.init_metrics())

    def train(self, host_batch):
        """One execution: a (stacked) batch, or a list of single batches (a short last group)."""
        if isinstance(host_batch, list):
            for single in host_batch:
                batch = self.strategy.distribute_batch(single, False)
                self.model._state, logs = self._train_one(self.model._state, batch)
        else:
            batch = self.strategy.distribute_batch(host_batch, self.stacked)
            self.model._state, logs = self._train(self.model._state, batch)
        self.in_flight.add(logs[LOSS_KEY])
        return logs

    def end_epoch(self, logs):
        """Waits for queued steps; returns the epoch's final logs (device values)."""
        self.in_flight.clear()
        settled = self.settle()
        return logs if settled is None else settled

    def settle(self):
        """Applies every batch handed out but not yet applied (asynchronous strategies).

        Afterwards the state accounts for exactly the batches the data position
        counts as consumed, so what a saver writes resumes exactly. Returns the
        logs after that, or None for a strategy with nothing in flight.
        """
        drain = getattr(self._train, "drain", None)
        if drain is None:
            return None
        self.model._state, logs = drain()
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
