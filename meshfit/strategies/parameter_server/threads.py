"""Workers on this host's devices: the engines' `Workers` when no worker processes are started."""

from __future__ import annotations

import collections
import queue
import threading
import time

import jax

from meshfit.strategies.parameter_server.server import Task, salted


class LocalWorkers:
    """The local devices as workers, each computing one job at a time on its device.

    With `threads` (asynchronous training), each device has a thread that
    takes the next queued job, computes it on the state published last and
    pushes the gradient once it is computed: results arrive in the order
    workers finish them, as stale as the updates applied meanwhile. An error
    in a worker thread is raised again in the training thread by `collect`.

    Without (synchronous training), `collect` dispatches the queued jobs
    from the training thread, job i to device i (modulo their number): JAX
    runs them on their devices in parallel, a round waits for all its parts
    anyway, and asynchronous dispatch lets the loop run ahead.

    `worker_delays` makes a worker sleep after each gradient it computed
    (simulated stragglers); a synchronous round waits for its slowest worker.
    """

    encoded = False  # module state stays as the module keeps it
    applies_updates = False  # the engine applies each gradient to the server state

    def __init__(self, strategy, steps, threads: bool):
        self.devices = list(strategy.workers)
        self.delays = [strategy.worker_delays.get(i, 0.0) for i in range(len(self.devices))]
        self.servers = strategy.servers
        self.gradients = jax.jit(salted(steps.gradients))
        self.state, self.version = None, 0
        self.queued: collections.deque[Task] = collections.deque()  # synchronous: dispatched by `collect`
        self.jobs: queue.Queue = queue.Queue()  # asynchronous: taken by the threads
        self.results: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.threads = (
            [
                threading.Thread(target=self._serve, args=(device, delay), daemon=True, name=f"ps-worker-{i}")
                for i, (device, delay) in enumerate(zip(self.devices, self.delays, strict=True))
            ]
            if threads
            else []
        )
        for thread in self.threads:
            thread.start()

    @property
    def count(self) -> int:
        return len(self.devices)

    def prepare(self, state, task: Task) -> None:
        """Nothing to prepare: the gradient function compiles on first use on each device."""

    def publish(self, state, version: int) -> None:
        with self.lock:
            self.state, self.version = state, version

    def submit(self, task: Task) -> None:
        if self.threads:
            self.jobs.put(task)
        else:
            self.queued.append(task)

    def collect(self, timeout: float) -> list[tuple[Task, int, tuple]]:
        if not self.threads:
            return self._dispatch()
        arrived = []
        try:
            arrived.append(self.results.get(timeout=timeout) if timeout else self.results.get_nowait())
            while True:
                arrived.append(self.results.get_nowait())
        except queue.Empty:
            pass
        results = []
        for task, version, result, error in arrived:
            if error is not None:
                raise RuntimeError("A parameter-server worker failed while computing gradients.") from error
            results.append((task, version, self.servers.take(self.state, *result)))
        return results

    def take(self, state, result, staleness: int | None) -> tuple:
        return result  # placed on the server by `collect`, or combined there

    def end_call(self) -> None:
        """Nothing to tell: there are no other server processes."""

    def close(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)

    def _inputs(self, state, task: Task, device):
        return jax.device_put((state.params, state.model_state, task.batch, task.rng, task.salt), device)

    def _dispatch(self) -> list[tuple[Task, int, tuple]]:
        """Runs the queued jobs, job i on device i (synchronous training)."""
        tasks = list(self.queued)
        self.queued.clear()
        devices = [self.devices[i % len(self.devices)] for i in range(len(tasks))]
        outputs = [self.gradients(*self._inputs(self.state, t, d)) for t, d in zip(tasks, devices, strict=True)]
        delay = max((self.delays[i % len(self.devices)] for i in range(len(tasks))), default=0.0)
        if delay:  # the round waits for its slowest (simulated) worker
            jax.block_until_ready(outputs)
            time.sleep(delay)
        return [(t, self.version, self.servers.take(self.state, *out)) for t, out in zip(tasks, outputs, strict=True)]

    def _serve(self, device, delay: float) -> None:
        """A worker thread (asynchronous training)."""
        while True:
            task = self.jobs.get()
            if task is None:
                return
            with self.lock:
                state, version = self.state, self.version
            try:
                result = jax.block_until_ready(self.gradients(*self._inputs(state, task, device)))
                if delay:
                    time.sleep(delay)
                self.results.put((task, version, result, None))
            except BaseException as error:  # noqa: BLE001 - raised again in the training thread
                self.results.put((task, version, None, error))
