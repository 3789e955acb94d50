"""The training engines: the train functions of parameter-server training."""

from __future__ import annotations

import queue
import threading
import time

import jax
import numpy as np

from meshfit.strategies.parameter_server.coordinator import Coordinator, RemoteWorkers, _Task
from meshfit.strategies.parameter_server.server import ServerUpdates, job_rng, job_salt, salted, split_rows, sum_trees


class _Training(ServerUpdates):
    """Shared pieces: compiled worker and server functions, and placement."""

    def __init__(self, strategy, steps):
        super().__init__(strategy, steps)
        self.gradients = jax.jit(salted(steps.gradients))

    def job_inputs(self, state, version: int, worker: int, device):
        """What a worker computes on: parameters, module state, dropout key and salt, on its device."""
        rng = job_rng(self.steps, state, version, worker)
        return jax.device_put((state.params, state.model_state, rng, job_salt(version, worker)), device)

    def to_server(self, grads, model_state, increments):
        return self.strategy.servers.take(self.state, grads, model_state, increments)


class _SyncTraining(_Training):
    """Each batch split over all workers; one averaged update per batch."""

    def __call__(self, state, batch):
        workers = self.strategy.workers
        step = self.round_step(state)
        parts = split_rows(batch, len(workers))
        outputs = []
        for i, (device, part) in enumerate(zip(workers, parts, strict=True)):
            params, model_state, rng, salt = self.job_inputs(state, step, i, device)
            outputs.append(self.gradients(params, model_state, jax.device_put(part, device), rng, salt))
        delays = self.strategy.worker_delays
        if delays:  # the round waits for its slowest (simulated) worker
            jax.block_until_ready(outputs)
            time.sleep(max(delays.get(i, 0.0) for i in range(len(workers))))
        self.apply_round(state, outputs, [float(part.mask.sum()) for part in parts])
        return self.state, self.logs


class _AsyncTraining(_Training):
    """Worker threads pull parameters and push gradients; the caller's thread applies them.

    Each call queues one batch and applies whatever gradients have arrived;
    at most two batches per worker wait in the queue. `drain()` applies
    everything outstanding (the loop calls it at the end of an epoch).
    """

    def __init__(self, strategy, steps):
        super().__init__(strategy, steps)
        self.work: queue.Queue = queue.Queue()
        self.results: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.version = 0
        self.pending = 0
        self.dropped = 0
        self.error: BaseException | None = None
        self.threads = [
            threading.Thread(target=self._worker, args=(i, d), daemon=True, name=f"ps-worker-{i}")
            for i, d in enumerate(strategy.workers)
        ]
        for thread in self.threads:
            thread.start()

    # -- worker threads ----------------------------------------------------------

    def _worker(self, index: int, device) -> None:
        delay = self.strategy.worker_delays.get(index, 0.0)
        while True:
            batch = self.work.get()
            if batch is None:
                return
            try:
                with self.lock:
                    state, version = self.state, self.version
                params, model_state, rng, salt = self.job_inputs(state, version, index, device)
                out = self.gradients(params, model_state, jax.device_put(batch, device), rng, salt)
                jax.block_until_ready(out)
                if delay:
                    time.sleep(delay)
                self.results.put((out, version, batch, None))
            except BaseException as error:  # noqa: BLE001 - re-raised in the training thread
                self.results.put((None, version, batch, error))

    # -- server side (the training thread) -----------------------------------------

    def _apply(self, result) -> None:
        out, version, batch, error = result
        if error is not None:
            raise RuntimeError("A parameter-server worker failed while computing gradients.") from error
        staleness = self.version - version
        if self.strategy.max_staleness is not None and staleness > self.strategy.max_staleness:
            self.dropped += 1
            self.work.put(batch)  # too old: redo it on fresh parameters
            return
        grads, model_state, increments = self.to_server(*out)
        new_state, logs = self.apply(self.state, grads, model_state, increments)
        with self.lock:
            self.state, self.logs, self.version = new_state, logs, self.version + 1
        self.staleness.append(staleness)
        self.pending -= 1

    def _adopt(self, state) -> None:
        """Takes a state set from outside (epoch start, set_weights, a restore)."""
        with self.lock:
            self.state = state
        self.staleness, self.dropped = [], 0

    def __call__(self, state, batch):
        if state is not self.state:
            self._adopt(state)
        self.work.put(batch)
        self.pending += 1
        while True:  # apply what has arrived; wait when too much is queued
            block = self.pending > 2 * len(self.threads)
            try:
                result = self.results.get(block=block)
            except queue.Empty:
                break
            self._apply(result)
        return self.state, self.current_logs()

    def drain(self):
        while self.pending:
            self._apply(self.results.get())
        return self.state, self.current_logs()

    def __del__(self):
        for _ in self.threads:
            self.work.put(None)


class RemoteAsyncTraining(ServerUpdates):
    """Asynchronous training with worker processes: each batch goes whole to the next free worker."""

    def __init__(self, strategy, steps, coordinator: Coordinator):
        super().__init__(strategy, steps)
        self.workers = RemoteWorkers(strategy, coordinator)
        self.version = 0
        self.outstanding = 0  # batches not yet applied

    def _step(self, timeout: float) -> None:
        self.workers.dispatch(self.state, self.version)
        for job, result in self.workers.collect(timeout):
            staleness = self.version - job.version
            if self.strategy.max_staleness is not None and staleness > self.strategy.max_staleness:
                self.workers.submit(self._task(job.task.batch))
                continue
            self.workers.apply(self, result, staleness)
            self.version += 1
            self.outstanding -= 1
            self.staleness.append(staleness)

    def _task(self, batch) -> _Task:
        job = next(self.workers.coordinator.ids)
        return _Task(batch, job_rng(self.steps, self.state, job, 0), job_salt(job, 0))

    def __call__(self, state, batch):
        if state is not self.state:
            self.state = state
            self.staleness = []
        if self.workers.exported is None:
            self.workers.export(self.steps, state, batch)
        self.workers.submit(self._task(batch))
        self.outstanding += 1
        self._step(timeout=0)
        while self.outstanding > 2 * max(1, len(self.workers.coordinator.live())):
            self._step(timeout=1.0)
        self.workers.group.finish()
        return self.state, self.current_logs()

    def drain(self):
        while self.outstanding:
            self._step(timeout=1.0)
        self.workers.group.finish()
        return self.state, self.current_logs()


class RemoteSyncTraining(ServerUpdates):
    """Synchronous training with worker processes: each batch is split in one part per worker.

    The parts are fixed (their number is the job's worker count), so a lost
    worker's part is redone by another and the update stays the same: the
    average of the parts' gradients weighted by their real rows, as in
    MirroredStrategy. Rank 0 combines the parts, then the servers apply the
    combined gradient once.
    """

    def __init__(self, strategy, steps, coordinator: Coordinator, parts: int):
        super().__init__(strategy, steps)
        self.workers = RemoteWorkers(strategy, coordinator)
        self.parts = parts

    def __call__(self, state, batch):
        parts = split_rows(batch, self.parts)
        if self.workers.exported is None:
            self.workers.export(self.steps, state, parts[0])
        step = self.round_step(state)
        self.state = state
        for i, part in enumerate(parts):
            self.workers.submit(_Task(part, job_rng(self.steps, state, step, i), job_salt(step, i), index=i))
        outputs = {}
        while len(outputs) < self.parts:
            self.workers.dispatch(state, 0)
            for job, result in self.workers.collect(timeout=1.0):
                outputs[job.task.index] = result
        ordered = [outputs[i] for i in range(self.parts)]
        weights = np.asarray([float(np.sum(part.mask)) for part in parts], np.float32)
        grads = self.combine([grads for grads, _, _ in ordered], weights)
        result = grads, ordered[0][1], sum_trees([increments for _, _, increments in ordered])
        self.workers.apply(self, result)
        self._round += 1
        self.workers.group.finish()
        return self.state, self.current_logs()
