"""Server rank 0 of a job with worker processes: it accepts the workers and the other servers and hands out work.

The coordinator listens on the job's address (`transport.Gate`: each
connection is authenticated on a thread of its own, within
`transport.HANDSHAKE_TIMEOUT`, so a stranger that stays silent, sends garbage
or does not know the secret is dropped without holding up the others), pings
everyone so that a hung rank 0 is noticed (`transport.watch_for_silence`),
ships the gradient program to each worker, hands batches to idle workers and
collects their gradients (`RemoteWorkers`, the engines' transport for worker
processes). A worker whose connection drops, or that holds a batch past
`worker_timeout`, is dropped and its batch is given to another worker. With
several server processes, rank 0 also sends each of its decisions to the
others (`ServerGroup`), with their parts of each gradient.
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import NamedTuple

import jax

from meshfit.strategies.parameter_server import launcher, transport
from meshfit.strategies.parameter_server.partition import TransferPlan
from meshfit.strategies.parameter_server.server import Task, export_gradients


class _Job(NamedTuple):
    """A task handed to a worker: the parameter version it computes on, when it started."""

    task: Task
    version: int
    started: float


class _Worker:
    def __init__(self, conn, pid: int):
        self.conn = conn
        self.pid = pid
        self.job: _Job | None = None  # while busy
        self.alive = True


class Coordinator:
    """Accepts worker and server processes and hands workers jobs; lives on server rank 0.

    Waits up to `accept_timeout` seconds for `expected_workers` workers and
    `expected_servers - 1` other servers. Workers may connect later (a worker
    restarted by hand); servers may not.
    """

    def __init__(
        self,
        expected_workers: int,
        expected_servers: int = 1,
        accept_timeout: float = 120.0,
        worker_timeout: float = 60.0,
    ):
        self.workers: list[_Worker] = []
        self.worker_timeout = worker_timeout  # also how long a send may wait on a worker that reads nothing
        self.followers: dict[int, tuple] = {}  # server rank -> (channel, address of its listener for workers)
        self.lock = threading.Lock()
        self.ids = itertools.count(1)  # ids of jobs
        self.program = None
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._expected = expected_workers, expected_servers - 1
        self.gate = transport.Gate(transport.address(), transport.authkey(), self._admit)
        # Pings tell workers and other servers this process still runs: a stopped or hung
        # rank 0 goes silent, and they end the job after `server_timeout` instead of waiting forever.
        self._heartbeat = threading.Thread(
            target=self._ping, args=(transport.server_timeout() / 4,), daemon=True, name="ps-heartbeat"
        )
        self._heartbeat.start()
        if not self._ready.wait(accept_timeout):
            raise TimeoutError(
                f"Only {len(self.workers)} of {expected_workers} parameter-server workers and "
                f"{len(self.followers)} of {expected_servers - 1} other servers connected within "
                f"{accept_timeout:.0f} s to {os.environ.get(launcher.ENV_PS_ADDRESS)}."
            )

    def _ping(self, every: float) -> None:
        while not self._closed.wait(every):
            with self.lock:
                channels = [w.conn for w in self.workers if w.alive] + [c for c, _ in self.followers.values()]
            for channel in channels:
                try:
                    channel.send_if_idle(("ping",))
                except OSError:
                    pass  # a lost worker is noticed and dropped by the main thread

    def _admit(self, conn: transport.Channel, hello: tuple) -> None:
        """Takes on an authenticated worker or server (`transport.Gate`)."""
        _, kind, address, pid = hello[:4]
        with self.lock:
            if kind == "server":
                self.followers[hello[4]] = (conn, address)
            else:
                transport.bound_sends(conn, self.worker_timeout)
                self.workers.append(_Worker(conn, pid))
                if self.program is not None:
                    self._send_program(self.workers[-1])
            if len(self.workers) >= self._expected[0] and len(self.followers) >= self._expected[1]:
                self._ready.set()

    def group(self, layout) -> ServerGroup:
        """The servers (this one and the others, in rank order), for placing results and offering state."""
        return ServerGroup(layout, [self.followers[r] for r in sorted(self.followers)])

    def set_program(self, exported, addresses: list[str], dims: list[int | None]) -> None:
        self.program = ("program", addresses, bytes(exported.serialize()), dims)
        with self.lock:
            for worker in self.workers:
                if worker.alive:
                    self._send_program(worker)

    def _send_program(self, worker: _Worker) -> None:
        try:
            worker.conn.send(self.program)
        except OSError as error:  # gone, or it read nothing for worker_timeout (a stopped process)
            self.drop(worker, f"the gradient program could not be sent: {error}")

    def live(self) -> list[_Worker]:
        with self.lock:
            return [w for w in self.workers if w.alive]

    def drop(self, worker: _Worker, why: str) -> None:
        """Removes a lost worker: it gets no more work, and its connection is closed."""
        worker.alive = False
        worker.job = None
        print(
            f"ParameterServerStrategy: worker pid {worker.pid} lost ({why}); its batch is redone elsewhere.",
            file=sys.stderr,
            flush=True,
        )
        try:
            worker.conn.close()
        except OSError:
            pass

    def close(self) -> None:
        self._closed.set()
        for worker in self.live():
            try:
                worker.conn.send(("stop",))
            except OSError:
                pass
        self.gate.close()


class ServerGroup:
    """Rank 0's side of the servers: what workers are sent, where results go, what the others replay.

    With one server process it only sends rank 0's state and places results
    on its devices; with several it also sends each decision to the others,
    and each its part of every result.
    """

    def __init__(self, layout, followers):
        self.layout = layout
        self.followers = followers  # [(channel, address of its listener for workers)] of ranks 1.., in rank order
        self._plan: TransferPlan | None = None

    @property
    def count(self) -> int:
        return 1 + len(self.followers)

    @property
    def addresses(self) -> list[str]:
        """Where workers take the other servers' parts of the parameters, in rank order (none with one server)."""
        return [address for _, address in self.followers]

    def plan(self, state) -> TransferPlan:
        """What each server sends workers and takes of their results, for states shaped like `state`."""
        if self._plan is None:
            self._plan = TransferPlan(self.layout, state, self.count)
        return self._plan

    def offer(self, state, jobs: list[tuple[int, int]]) -> list | None:
        """Rank 0's part of `state` as wire items, to send with each of these `(job id, worker pid)`; the other
        servers are told to send theirs to the same workers."""
        if not jobs:
            return None
        self._send(("offer", jobs))
        return transport.to_wire(self.plan(state).offered(state, 0))

    def take(self, state, grads, model_state, increments, staleness: int | None):
        """A worker's whole result (on rank 0) as server arrays; the other servers are sent their parts."""
        if self.count == 1:
            return self.layout.take(state, grads, model_state, increments)
        plan = self.plan(state)
        for server, (conn, _) in enumerate(self.followers, start=1):
            parts = plan.result_parts(server, grads, model_state, increments)
            conn.send(("apply", staleness, transport.to_wire(parts)))
        return plan.build(plan.result_parts(0, grads, model_state, increments))

    def finish(self) -> None:
        """Ends one call of the train function on every server."""
        self._send(("return",))

    def _send(self, message) -> None:
        for conn, _ in self.followers:
            conn.send(message)


class RemoteWorkers:
    """Worker processes reached through the coordinator: the engines' `Workers` under `meshfit launch --ps`.

    Queued jobs go to idle workers with the published parameters (rank 0's
    part with the batch, each other server's part from that server); results
    come back whole to rank 0's first server device.
    A job a lost worker held (its process died, its connection broke, or it
    held the batch past `worker_timeout`) goes back to the front of the queue
    and is redone by another worker.
    """

    encoded = True  # module state travels with its RNG keys as raw key data
    applies_updates = False  # the engine (rank 0, with the other servers) applies each gradient

    def __init__(self, strategy, steps, coordinator: Coordinator):
        self.strategy = strategy
        self.steps = steps
        self.coordinator = coordinator
        self.group = coordinator.group(strategy.servers)
        self.pending: collections.deque[Task] = collections.deque()  # not yet handed out
        self.exported = None
        self.state, self.version = None, 0

    @property
    def count(self) -> int:
        return len(self.coordinator.live())

    def prepare(self, state, task: Task) -> None:
        """Exports the worker's gradient computation for jobs like `task` and sends it to every worker.

        Typed RNG keys travel as raw key data (`core.trees.encode`).
        """
        self.exported = export_gradients(self.steps, state, task)
        plan = self.group.plan(state)
        self.coordinator.set_program(self.exported, self.group.addresses, plan.pulled.dims)

    def publish(self, state, version: int) -> None:
        self.state, self.version = state, version

    def submit(self, task: Task) -> None:
        self.pending.append(task)

    def collect(self, timeout: float) -> list[tuple[Task, int, tuple]]:
        self._dispatch()
        busy = [w for w in self.coordinator.live() if w.job is not None]
        if not busy:
            if not self.coordinator.live():
                raise RuntimeError("All parameter-server workers are gone; training cannot continue.")
            return []
        ready = wait([w.conn for w in busy], timeout=timeout)
        now, results = time.monotonic(), []
        for worker in busy:
            job = worker.job
            if worker.conn not in ready:
                if now - job.started > self.strategy.worker_timeout:
                    self.pending.appendleft(job.task)
                    self.coordinator.drop(worker, f"no answer within worker_timeout={self.strategy.worker_timeout:g} s")
                continue
            try:
                message = worker.conn.recv()
                if message[0] == "failed":  # the worker did not get every server's part: redo the batch
                    worker.job = None
                    self.pending.appendleft(job.task)
                    continue
                flat = [jax.device_put(a, self.strategy.server_device) for a in transport.from_wire(message[2])]
                jax.block_until_ready(flat)
            except (EOFError, OSError, RuntimeError) as error:
                self.pending.appendleft(job.task)
                self.coordinator.drop(
                    worker, f"{type(error).__name__}: {error}" if str(error) else "its connection closed"
                )
                continue
            worker.job = None
            results.append((job.task, job.version, jax.tree.unflatten(self.exported.out_tree, flat)))
        return results

    def take(self, state, result, staleness: int | None) -> tuple:
        return self.group.take(state, *result, staleness)

    def end_call(self) -> None:
        self.group.finish()

    def close(self) -> None:
        """Nothing to stop: the worker processes serve the job, not one train function."""

    def _dispatch(self) -> None:
        """Hands queued jobs to idle workers, with the published parameters."""
        assigned = []
        for worker in self.coordinator.live():
            if not self.pending:
                break
            if worker.job is None:
                assigned.append((worker, self.pending.popleft(), next(self.coordinator.ids)))
        parameters = self.group.offer(self.state, [(job_id, worker.pid) for worker, _, job_id in assigned])
        for worker, task, job_id in assigned:
            try:
                batch = transport.to_wire((task.batch, task.rng, task.salt))
                worker.conn.send(("work", job_id, batch, parameters))
            except OSError as error:
                self.pending.appendleft(task)
                self.coordinator.drop(worker, str(error))
                continue
            worker.job = _Job(task, version=self.version, started=time.monotonic())
