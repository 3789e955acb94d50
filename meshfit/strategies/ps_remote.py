"""Parameter-server training across processes: workers in their own processes.

Control plane: `multiprocessing.connection` with an authkey (HMAC challenge on
connect), loopback by default. Messages are small tuples of ints and strings;
batches travel as raw array bytes with their shape and dtype, so nothing from
the network is unpickled beyond the authenticated control tuples. Arrays
(parameters to a worker, gradients back) move through
`jax.experimental.transfer` servers, one per process. The gradient function
is shipped to workers as serialized StableHLO (`jax.export`), so worker
processes never build the model themselves.

The job does not use `jax.distributed`: a dead worker must not take the
others down. A worker whose connection drops is removed and its batch is
given to another worker.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import os
import secrets
import sys
import threading
import time
from typing import NamedTuple
from multiprocessing.connection import Client, Listener, wait

import jax
import numpy as np

from meshfit.checkpoint import decode, encode
from meshfit.data import Batch
from meshfit.strategies.ps_server import ServerUpdates, job_rng, job_salt, salted, split_rows

# The exported gradient program takes a Batch; both ends must know its name.
jax.export.register_namedtuple_serialization(Batch, serialized_name="meshfit.data.Batch")

ENV_ROLE = "MESHFIT_PS_ROLE"  # "coordinator" or "worker"
ENV_ADDRESS = "MESHFIT_PS_ADDRESS"  # host:port of the coordinator's control listener
ENV_AUTHKEY = "MESHFIT_PS_AUTHKEY"  # hex secret shared by the job's processes
ENV_WORKERS = "MESHFIT_PS_WORKERS"  # number of worker processes the coordinator waits for

PULL_TIMEOUT = datetime.timedelta(seconds=30)
#: How long a handed-out array waits to be pulled before the transfer server lets it go.
HOLD_TIMEOUT = datetime.timedelta(seconds=120)


def role() -> str | None:
    return os.environ.get(ENV_ROLE)


def _address() -> tuple[str, int]:
    host, port = os.environ[ENV_ADDRESS].rsplit(":", 1)
    return host, int(port)


def _authkey() -> bytes:
    key = os.environ.get(ENV_AUTHKEY)
    if not key:
        raise RuntimeError(f"{ENV_AUTHKEY} is not set; start parameter-server jobs with `meshfit launch --ps`.")
    return bytes.fromhex(key)


def new_authkey() -> str:
    return secrets.token_hex(32)


def _to_wire(tree) -> list:
    leaves = jax.tree.leaves(tree)
    return [(np.asarray(a).dtype.str, np.shape(a), np.ascontiguousarray(a).tobytes()) for a in leaves]


def _from_wire(items, treedef):
    return jax.tree.unflatten(treedef, [np.frombuffer(b, dtype=np.dtype(d)).reshape(s) for d, s, b in items])


def _transfer_server():
    from jax.experimental import transfer

    client = jax.local_devices()[0].client
    return transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"])


def _specs(tree, device):
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding), tree)


# -- worker process ----------------------------------------------------------------


def run_worker() -> None:
    """The life of a worker process: connect, take work until told to stop, exit."""
    device = jax.local_devices()[0]
    server = _transfer_server()
    conn = _connect(_address(), _authkey())
    conn.send(("hello", server.address(), os.getpid()))
    print(f"parameter-server worker pid {os.getpid()} connected", flush=True)
    coordinator = None
    compiled = None
    specs = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        kind = message[0]
        if kind == "stop":
            break
        if kind == "program":
            _, coordinator_address, blob, in_tree_blob = message
            del in_tree_blob
            coordinator = server.connect(coordinator_address)
            exported = jax.export.deserialize(bytearray(blob))
            compiled = exported.call
            specs = exported
            continue
        if kind == "work":
            _, job, pull_id, push_id, batch_items = message
            in_avals = specs.in_avals
            flat_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
                          for a in in_avals]
            n_state = len(flat_specs) - len(batch_items)
            try:
                state_flat = coordinator.pull(pull_id, flat_specs[:n_state], timeout=_deadline())
                batch_flat = [np.frombuffer(b, dtype=np.dtype(d)).reshape(s) for d, s, b in batch_items]
                args = jax.tree.unflatten(specs.in_tree, list(state_flat) + batch_flat)
                out = compiled(*args[0], **args[1])
                jax.block_until_ready(out)
            except jax.errors.JaxRuntimeError as error:  # a transfer broke: the coordinator redoes the batch
                conn.send(("failed", job, str(error)[:300]))
                continue
            server.await_pull(push_id, jax.tree.leaves(out), timeout=_deadline(HOLD_TIMEOUT))
            conn.send(("done", job, push_id))
    sys.exit(0)


def _connect(address, authkey: bytes, timeout: float = 120.0):
    """Connects to the coordinator, retrying while it starts up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _deadline(delta: datetime.timedelta = PULL_TIMEOUT) -> datetime.datetime:
    return datetime.datetime.now() + delta


# -- coordinator -------------------------------------------------------------------


class _Task(NamedTuple):
    """A batch to compute gradients on, with its dropout key and salt; `index` orders a sync round's parts."""

    batch: Batch
    rng: np.ndarray | None
    salt: np.ndarray
    index: int = 0


class _Job(NamedTuple):
    """A task handed to a worker: the parameter version it computes on, where its gradient waits."""

    task: _Task
    version: int
    push_id: int
    started: float


class _Worker:
    def __init__(self, conn, address: str, pid: int, connection):
        self.conn = conn
        self.address = address
        self.pid = pid
        self.transfer = connection
        self.job: _Job | None = None  # while busy
        self.alive = True


class Coordinator:
    """Accepts worker processes and hands them jobs; lives in the process that runs `fit`."""

    def __init__(self, expected_workers: int, accept_timeout: float = 120.0):
        self.listener = Listener(_address(), authkey=_authkey())
        self.server = _transfer_server()
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self.program = None
        self.log = collections.Counter()
        self._ready = threading.Event()
        self._expected = expected_workers
        self._accepting = threading.Thread(target=self._accept, daemon=True, name="ps-accept")
        self._accepting.start()
        if not self._ready.wait(accept_timeout):
            raise TimeoutError(
                f"Only {len(self.workers)} of {expected_workers} parameter-server workers connected within "
                f"{accept_timeout:.0f} s to {os.environ.get(ENV_ADDRESS)}.")

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
                _, address, pid = conn.recv()
            except (OSError, EOFError):
                if getattr(self, "_closed", False):
                    return
                continue
            worker = _Worker(conn, address, pid, self.server.connect(address))
            with self.lock:
                self.workers.append(worker)
                if self.program is not None:
                    conn.send(self.program)
                if len(self.workers) >= self._expected:
                    self._ready.set()

    def set_program(self, exported) -> None:
        self.program = ("program", self.server.address(), bytes(exported.serialize()), None)
        with self.lock:
            for worker in self.workers:
                if worker.alive:
                    worker.conn.send(self.program)

    def live(self) -> list[_Worker]:
        with self.lock:
            return [w for w in self.workers if w.alive]

    def drop(self, worker: _Worker, why: str) -> None:
        """Removes a lost worker: it gets no more work, and its connection is closed."""
        worker.alive = False
        worker.job = None
        self.log["dropped"] += 1
        print(f"ParameterServerStrategy: worker pid {worker.pid} lost ({why}); its batch is redone elsewhere.",
              file=sys.stderr, flush=True)
        try:
            worker.conn.close()
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        for worker in self.live():
            try:
                worker.conn.send(("stop",))
            except OSError:
                pass
        self.listener.close()


class RemoteWorkers:
    """Hands batches to worker processes and collects their gradients.

    A batch a lost worker held (its process died, its connection broke, or it
    held the batch past `worker_timeout`) goes back to the front of the queue
    and is redone by another worker.
    """

    def __init__(self, strategy, coordinator: Coordinator):
        self.strategy = strategy
        self.coordinator = coordinator
        self.pending: collections.deque[_Task] = collections.deque()  # not yet handed out
        self.exported = None

    def export(self, steps, state, batch) -> None:
        """Serializes the worker's gradient computation; typed RNG keys travel as raw key data."""
        template = state.model_state

        salted_gradients = salted(steps.gradients)

        def gradients(params, encoded_model_state, batch, rng, salt):
            grads, model_state, increments = salted_gradients(
                params, decode(encoded_model_state, template), batch, rng, salt)
            return grads, encode(model_state), increments

        args = (state.params, encode(state.model_state), batch, job_rng(steps, state, 0), job_salt(0, 0))
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), args)
        self.exported = jax.export.export(jax.jit(gradients))(*shapes)
        self.coordinator.set_program(self.exported)

    def submit(self, task: _Task) -> None:
        self.pending.append(task)

    def dispatch(self, state, version: int) -> None:
        """Hands queued tasks to idle workers, with `state`'s parameters (parameter version `version`)."""
        variables = None  # what workers pull, gathered once for all of this call's tasks
        for worker in self.coordinator.live():
            if not self.pending:
                return
            if worker.job is not None:
                continue
            task = self.pending.popleft()
            pull_id, push_id = next(self.coordinator.ids), next(self.coordinator.ids)
            if variables is None:
                variables = jax.tree.leaves(self.strategy.servers.gather((state.params, encode(state.model_state))))
            self.coordinator.server.await_pull(pull_id, variables, timeout=_deadline(HOLD_TIMEOUT))
            try:
                worker.conn.send(("work", pull_id, pull_id, push_id, _to_wire((task.batch, task.rng, task.salt))))
            except OSError as error:
                self.pending.appendleft(task)
                self.coordinator.drop(worker, str(error))
                continue
            worker.job = _Job(task, version, push_id, time.monotonic())

    def collect(self, timeout: float | None) -> list[tuple[_Job, tuple]]:
        """Gradients that arrived within `timeout`: (job, (grads, encoded model state, increments)) pairs."""
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
                    self.coordinator.drop(worker, f"no answer within worker_timeout="
                                                  f"{self.strategy.worker_timeout:g} s")
                continue
            try:
                message = worker.conn.recv()
                if message[0] == "failed":  # the worker could not pull: redo the batch
                    worker.job = None
                    self.pending.appendleft(job.task)
                    continue
                device = self.strategy.server_device
                specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
                         for a in self.exported.out_avals]
                flat = worker.transfer.pull(job.push_id, specs, timeout=_deadline())
                jax.block_until_ready(flat)
            except (EOFError, OSError, RuntimeError) as error:
                self.pending.appendleft(job.task)
                self.coordinator.drop(worker, f"{type(error).__name__}: {error}" if str(error)
                                      else "its connection closed")
                continue
            worker.job = None
            results.append((job, jax.tree.unflatten(self.exported.out_tree, flat)))
        return results


class RemoteAsyncTraining(ServerUpdates):
    """Asynchronous training with worker processes: each batch goes whole to the next free worker."""

    def __init__(self, strategy, steps, coordinator: Coordinator):
        super().__init__(strategy, steps)
        self.workers = RemoteWorkers(strategy, coordinator)
        self.version = 0
        self.outstanding = 0  # batches not yet applied

    def _step(self, timeout: float) -> None:
        self.workers.dispatch(self.state, self.version)
        for job, (grads, model_state, increments) in self.workers.collect(timeout):
            staleness = self.version - job.version
            if self.strategy.max_staleness is not None and staleness > self.strategy.max_staleness:
                self.workers.submit(self._task(job.task.batch))
                continue
            taken = self.strategy.servers.take(self.state, grads, decode(model_state, self.state.model_state),
                                               increments)
            self.state, self.logs = self.apply(self.state, *taken)
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
        return self.state, self.current_logs()

    def drain(self):
        while self.outstanding:
            self._step(timeout=1.0)
        return self.state, self.current_logs()


class RemoteSyncTraining(ServerUpdates):
    """Synchronous training with worker processes: each batch is split in one part per worker.

    The parts are fixed (their number is the job's worker count), so a lost
    worker's part is redone by another and the update stays the same: the
    average of the parts' gradients weighted by their real rows, as in
    MirroredStrategy.
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
        for i, part in enumerate(parts):
            self.workers.submit(_Task(part, job_rng(self.steps, state, step, i), job_salt(step, i), index=i))
        outputs = {}
        while len(outputs) < self.parts:
            self.workers.dispatch(state, 0)
            for job, (grads, model_state, increments) in self.workers.collect(timeout=1.0):
                outputs[job.task.index] = (grads, decode(model_state, state.model_state), increments)
        self.apply_round(state, [outputs[i] for i in range(self.parts)],
                         [float(np.sum(part.mask)) for part in parts])
        return self.state, self.current_logs()
