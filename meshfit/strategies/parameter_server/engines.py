"""The training engines: one asynchronous, one synchronous, each handing its gradient jobs to `Workers`.

An engine decides what is computed on which parameters and applies the
results; its `Workers` run the jobs: threads on this host's devices
(`threads.LocalWorkers`) or worker processes reached through the coordinator
(`coordinator.RemoteWorkers`). Engines are the `TrainFunction`s of server
rank 0 (or of the only server); the other server processes replay rank 0's
decisions instead (`follower`).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from meshfit.strategies.parameter_server.server import (
    ServerTrainFunction,
    Task,
    job_rng,
    job_salt,
    local,
    split_rows,
    sum_trees,
    weighted_mean,
)

if TYPE_CHECKING:
    from meshfit.core.batch import Batch
    from meshfit.core.state import TrainState

#: What a gradient job computes: `(gradients, module state, metric increments)`, pytrees like the state's.
GradientResult = tuple[Any, Any, Any]


class Workers(Protocol):
    """Where an engine's gradient jobs run. Called from the training thread only."""

    #: Whether results carry module state with RNG keys as raw key data (`core.trees.encode`).
    encoded: bool

    #: Whether servers of their own apply the optimizer update (Ray's server actors): the engine's state
    #: then takes only module state, metric sums and the step from a result, and the parameters and
    #: optimizer state from `settled`; such workers also `combine` a sync round's gradients.
    applies_updates: bool

    @property
    def count(self) -> int:
        """How many workers can take jobs now."""

    def prepare(self, state: TrainState, task: Task) -> None:
        """Gets ready for jobs like `task` on states like `state` (once, before the first job)."""

    def publish(self, state: TrainState, version: int) -> None:
        """The state, parameter version `version`, that jobs handed out from now on compute on."""

    def submit(self, task: Task) -> None:
        """Queues a job."""

    def collect(self, timeout: float) -> list[tuple[Task, int, GradientResult]]:
        """Hands queued jobs to idle workers and returns the results that arrived within `timeout` seconds
        (0: those already there), as `(task, version computed on, (grads, model_state, increments))` on the
        server. A job whose worker was lost is queued again."""

    def take(self, state: TrainState, result: GradientResult, staleness: int | None) -> GradientResult:
        """A result (or a sync round's combined result) as server arrays, given to every server process."""

    def settled(self, state: TrainState) -> TrainState:
        """`state` with the parameters and optimizer state the servers hold (`applies_updates` only)."""

    def end_call(self) -> None:
        """Ends one call of the train function (the other server processes return from theirs)."""

    def close(self) -> None:
        """Stops what serves this engine alone."""


class _Engine(ServerTrainFunction):
    def __init__(self, strategy, steps, workers: Workers):
        super().__init__(strategy, steps)
        self.workers = workers
        self._prepared = False

    def _submit(self, task: Task) -> None:
        if not self._prepared:
            self.workers.prepare(self.state, task)
            self._prepared = True
        self.workers.submit(task)

    def _apply_result(self, result, staleness: int | None) -> None:
        grads, model_state, increments = self.workers.take(self.state, result, staleness)
        if self.workers.applies_updates:  # the servers applied the optimizer update to their parts
            self.apply_rest(model_state, increments, encoded=self.workers.encoded)
        else:
            self.apply(grads, model_state, increments, encoded=self.workers.encoded)

    def _settle(self) -> None:
        """Takes the servers' parameters and optimizer state when they apply the updates themselves."""
        if self.workers.applies_updates:
            self.state = self.workers.settled(self.state)

    def __del__(self):
        self.workers.close()


class AsyncEngine(_Engine):
    """Each batch goes whole to the next free worker; each gradient is applied as it arrives.

    A call queues one batch and applies whatever gradients have arrived; it
    waits while more than two batches per worker are outstanding. A gradient
    computed on parameters more than `max_staleness` versions old is dropped
    and its batch queued again, to be computed on fresh parameters. `drain()`
    applies everything outstanding (the loop calls it at the end of an epoch).
    """

    def __init__(self, strategy, steps, workers: Workers):
        super().__init__(strategy, steps, workers)
        self.version = 0  # gradients applied so far
        self.outstanding = 0  # batches queued or computing, not applied yet
        self._jobs = itertools.count()

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        if state is not self.state:
            self._adopt(state)
        self._submit(self._task(batch))
        self.outstanding += 1
        self._step(timeout=0)
        while self.outstanding > 2 * max(1, self.workers.count):
            self._step(timeout=1.0)
        self.workers.end_call()
        return self.state, self.current_logs()

    def drain(self) -> tuple[TrainState, dict[str, Any]] | None:
        if self.state is None:  # nothing handed out yet
            return None
        while self.outstanding:
            self._step(timeout=1.0)
        self._settle()
        self.workers.end_call()
        return self.state, self.current_logs()

    def _adopt(self, state) -> None:
        """Takes a state set from outside (epoch start, set_weights, a restore)."""
        self.state, self.staleness = state, []
        self.workers.publish(state, self.version)

    def _task(self, batch) -> Task:
        """A job with its own dropout key and salt: a batch redone draws new masks, as on fresh parameters."""
        job = next(self._jobs)
        return Task(batch, job_rng(self.steps, self.state, job, 0), job_salt(job, 0))

    def _step(self, timeout: float) -> None:
        for task, version, result in self.workers.collect(timeout):
            staleness = self.version - version
            if self.strategy.max_staleness is not None and staleness > self.strategy.max_staleness:
                self.workers.submit(self._task(task.batch))  # too old: redo it on fresh parameters
                continue
            self._apply_result(result, staleness)
            self.version += 1
            self.outstanding -= 1
            self.staleness.append(staleness)
            self.workers.publish(self.state, self.version)


class SyncEngine(_Engine):
    """Each batch is split in one part per worker; the parts' gradients make one update.

    The number of parts is fixed (`num_replicas_in_sync`: the workers the job
    started with), so a part a lost worker held is redone by another and the
    update stays the same: the average of the parts' gradients weighted by
    their real rows, as in MirroredStrategy, with the metric increments summed
    and module state taken from the first part.
    """

    def __init__(self, strategy, steps, workers: Workers):
        super().__init__(strategy, steps, workers)
        self.parts = strategy.num_replicas_in_sync
        self.combine = workers.combine if workers.applies_updates else jax.jit(weighted_mean)
        self._round = 0  # state.step of the next round, counted on the host

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        step = self._round_step(state)
        self.state = state
        parts = split_rows(batch, self.parts)
        self.workers.publish(state, step)
        for i, part in enumerate(parts):
            self._submit(Task(part, job_rng(self.steps, state, step, i), job_salt(step, i), index=i))
        results = {}
        while len(results) < self.parts:
            for task, _, result in self.workers.collect(timeout=1.0):
                results[task.index] = result
        ordered = [results[i] for i in range(self.parts)]
        weights = np.asarray([float(np.sum(part.mask)) for part in parts], np.float32)
        grads = self.combine([grads for grads, _, _ in ordered], weights)
        self._apply_result((grads, ordered[0][1], sum_trees([increments for _, _, increments in ordered])), None)
        self._round += 1
        self.workers.end_call()
        return self.state, self.current_logs()

    def drain(self) -> tuple[TrainState, dict[str, Any]] | None:
        """Nothing is in flight; servers that apply the updates themselves hand back their state."""
        if self.state is None or not self.workers.applies_updates:
            return None
        self._settle()
        return self.state, self.current_logs()

    def _round_step(self, state) -> int:
        """`state.step`, read from the device only for a state set from outside (no sync per round)."""
        if state is not self.state:
            self._round = int(jax.device_get(local(state.step)))
        return self._round
