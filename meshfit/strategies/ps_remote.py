"""Parameter-server training across processes: workers in their own processes.

Control plane: `multiprocessing.connection` with an authkey (HMAC challenge on
connect), loopback by default. Messages are small tuples of ints and strings;
batches travel as raw array bytes with their shape and dtype, so nothing from
the network is unpickled beyond the authenticated control tuples. Arrays
(parameters to a worker, gradients back) move through
`jax.experimental.transfer` servers, one per process. The gradient function
is shipped to workers as serialized StableHLO (`jax.export`), so worker
processes never build the model themselves.

Workers are never part of a `jax.distributed` job: a dead worker must not
take the others down. A worker whose connection drops is removed and its batch
is given to another worker. Several server processes (`--ps N`) form a
`jax.distributed` job of their own and hold one partitioned state; rank 0
coordinates them (`ps_group`).
"""

from __future__ import annotations

import array
import collections
import fcntl
import itertools
import os
import secrets
import sys
import termios
import threading
import time
from multiprocessing.connection import Client, Listener, wait
from typing import NamedTuple

import jax
import numpy as np

from meshfit.checkpoint import decode, encode
from meshfit.data import Batch
from meshfit.strategies.ps_group import HOLD_TIMEOUT, Partition, ServerGroup, deadline, specs
from meshfit.strategies.ps_server import ServerUpdates, job_rng, job_salt, salted, split_rows, sum_trees

# The exported gradient program takes a Batch; both ends must know its name.
jax.export.register_namedtuple_serialization(Batch, serialized_name="meshfit.data.Batch")

ENV_ROLE = "MESHFIT_PS_ROLE"  # "coordinator" (server rank 0), "server" (server ranks 1..) or "worker"
ENV_ADDRESS = "MESHFIT_PS_ADDRESS"  # host:port of the coordinator's control listener
ENV_AUTHKEY = "MESHFIT_PS_AUTHKEY"  # hex secret shared by the job's processes
ENV_WORKERS = "MESHFIT_PS_WORKERS"  # number of worker processes the coordinator waits for
ENV_SERVERS = "MESHFIT_PS_SERVERS"  # number of server processes (rank 0 included)
ENV_SERVER_RANK = "MESHFIT_PS_SERVER_RANK"  # this server's rank among the servers
ENV_SERVER_TIMEOUT = "MESHFIT_PS_SERVER_TIMEOUT"  # seconds without a word from rank 0 before its peers give up
DEFAULT_SERVER_TIMEOUT = 60.0
#: Exit status of a worker that found the parameter server silent (`meshfit launch` then ends the job).
EXIT_SERVER_SILENT = 3


def role() -> str | None:
    return os.environ.get(ENV_ROLE)


def server_count() -> int:
    """How many server processes the job has (1 outside a `meshfit launch --ps` job)."""
    return int(os.environ.get(ENV_SERVERS, "1"))


def _address() -> tuple[str, int]:
    host, port = os.environ[ENV_ADDRESS].rsplit(":", 1)
    return host, int(port)


def server_timeout() -> float:
    """Seconds a worker or a server of rank 1.. waits without any message from rank 0 (pings included)."""
    value = os.environ.get(ENV_SERVER_TIMEOUT)
    try:
        timeout = float(value) if value else DEFAULT_SERVER_TIMEOUT
    except ValueError:
        raise ValueError(f"{ENV_SERVER_TIMEOUT} must be a number of seconds. Received: {value!r}.") from None
    if timeout <= 0:
        raise ValueError(f"{ENV_SERVER_TIMEOUT} must be positive. Received: {value!r}.")
    return timeout


def _silent_server(timeout: float) -> str:
    return (
        f"the parameter server (rank 0, which coordinates the job, at {os.environ.get(ENV_ADDRESS)}) sent "
        f"nothing for {timeout:g} s ({ENV_SERVER_TIMEOUT}); it is stopped or hung"
    )


def _watch_for_silence(channel: Channel, timeout: float, describe) -> None:
    """Ends this process (status `EXIT_SERVER_SILENT`) once nothing came from rank 0 for `timeout` s.

    A daemon thread, for the time the main thread is busy with a job: then it
    reads nothing, so new bytes waiting in the socket are the sign of life (a
    job blocked on a transfer from a stopped server would otherwise wait forever).
    """

    def run():
        unread, changed = channel.unread_bytes(), time.monotonic()
        while True:
            time.sleep(min(1.0, timeout / 4))
            now, pending = time.monotonic(), channel.unread_bytes()
            if pending != unread:
                unread, changed = pending, now
            if now - max(changed, channel.last_heard) > timeout:
                print(
                    f"{describe()}: {_silent_server(timeout)}. Exiting with status {EXIT_SERVER_SILENT}.",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_SERVER_SILENT)

    threading.Thread(target=run, daemon=True, name="ps-silence-watch").start()


class Channel:
    """A control connection whose sends are serialised: rank 0's heartbeat thread sends beside its main
    thread, and two writers must not interleave one message's bytes."""

    def __init__(self, conn):
        self.conn = conn
        self._lock = threading.Lock()
        self.last_heard = time.monotonic()  # when a message (a ping too) was last read

    def send(self, message) -> None:
        with self._lock:
            self.conn.send(message)

    def recv(self, timeout: float | None = None, silent=None):
        """The next message other than a ping; with `timeout`, raises `silent()` when rank 0 says nothing."""
        while True:
            if timeout is not None and not self.conn.poll(timeout):
                raise silent()
            message = self.conn.recv()
            self.last_heard = time.monotonic()
            if message[0] != "ping":
                return message

    def unread_bytes(self) -> int:
        """Bytes received but not read yet (pings arriving while the reader is busy)."""
        buffer = array.array("i", [0])
        fcntl.ioctl(self.conn.fileno(), termios.FIONREAD, buffer)
        return buffer[0]

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()


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


# -- worker process ----------------------------------------------------------------


def run_worker() -> None:
    """The life of a worker process: connect, take work until told to stop, exit."""
    device = jax.local_devices()[0]
    server = _transfer_server()
    conn = Channel(_connect(_address(), _authkey()))
    conn.send(("hello", "worker", server.address(), os.getpid()))
    print(f"parameter-server worker pid {os.getpid()} connected", flush=True)
    program = None
    timeout = server_timeout()
    _watch_for_silence(conn, timeout, lambda: f"parameter-server worker pid {os.getpid()}")
    while True:
        try:
            message = conn.recv(timeout, silent=lambda: TimeoutError(_silent_server(timeout)))
        except (EOFError, OSError) as error:
            if isinstance(error, TimeoutError):
                print(
                    f"parameter-server worker pid {os.getpid()}: {error}. Exiting with status {EXIT_SERVER_SILENT}.",
                    file=sys.stderr,
                    flush=True,
                )
                sys.exit(EXIT_SERVER_SILENT)
            break
        kind = message[0]
        if kind == "stop":
            break
        if kind == "program":
            program = _WorkerProgram(server, device, *message[1:])
            continue
        if kind == "work":
            _, job, pull_id, push_id, batch_items = message
            try:
                out = program.run(pull_id, [np.frombuffer(b, dtype=np.dtype(d)).reshape(s) for d, s, b in batch_items])
            except jax.errors.JaxRuntimeError as error:  # a transfer broke: the coordinator redoes the batch
                conn.send(("failed", job, str(error)[:300]))
                continue
            server.await_pull(push_id, jax.tree.leaves(out), timeout=deadline(HOLD_TIMEOUT))
            conn.send(("done", job, push_id))
    sys.exit(0)


class _WorkerProgram:
    """A worker's gradient program and where it pulls the parameters from (each server's part)."""

    def __init__(self, server, device, addresses: list[str], blob: bytes, dims: list[int | None]):
        self.exported = jax.export.deserialize(bytearray(blob))
        self.servers = [server.connect(address) for address in addresses]
        self.partition = Partition(dims, len(addresses))
        self.device = device

    def run(self, pull_id: int, batch_leaves: list):
        avals = self.exported.in_avals[: len(self.partition.dims)]
        parts = [
            connection.pull(pull_id, specs(self.partition.part_avals(avals, k), self.device), timeout=deadline())
            for k, connection in enumerate(self.servers)
        ]
        state_leaves = self.partition.assemble([list(p) for p in parts])
        args = jax.tree.unflatten(self.exported.in_tree, state_leaves + batch_leaves)
        out = self.exported.call(*args[0], **args[1])
        return jax.block_until_ready(out)


def _connect(address, authkey: bytes, timeout: float = 120.0):
    """Connects to the coordinator, retrying while it starts up."""
    give_up_at = time.monotonic() + timeout
    while True:
        try:
            return Client(address, authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > give_up_at:
                raise
            time.sleep(0.2)


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
    """Accepts worker and server processes and hands workers jobs; lives on server rank 0.

    Waits up to `accept_timeout` seconds for `expected_workers` workers and
    `expected_servers - 1` other servers. Workers may connect later (a worker
    restarted by hand); servers may not.
    """

    def __init__(self, expected_workers: int, expected_servers: int = 1, accept_timeout: float = 120.0):
        self.listener = Listener(_address(), authkey=_authkey())
        self.server = _transfer_server()
        self.workers: list[_Worker] = []
        self.followers: dict[int, tuple] = {}  # server rank -> (conn, transfer address)
        self.lock = threading.Lock()
        self.ids = itertools.count(1)  # ids of what rank 0's transfer server offers, and of jobs
        self.program = None
        self.log = collections.Counter()
        self._ready = threading.Event()
        self._closed = threading.Event()
        self._expected = expected_workers, expected_servers - 1
        self._accepting = threading.Thread(target=self._accept, daemon=True, name="ps-accept")
        self._accepting.start()
        # Pings tell workers and other servers this process still runs: a stopped or hung
        # rank 0 goes silent, and they end the job after `server_timeout` instead of waiting forever.
        self._heartbeat = threading.Thread(
            target=self._ping, args=(server_timeout() / 4,), daemon=True, name="ps-heartbeat"
        )
        self._heartbeat.start()
        if not self._ready.wait(accept_timeout):
            raise TimeoutError(
                f"Only {len(self.workers)} of {expected_workers} parameter-server workers and "
                f"{len(self.followers)} of {expected_servers - 1} other servers connected within "
                f"{accept_timeout:.0f} s to {os.environ.get(ENV_ADDRESS)}."
            )

    def _ping(self, every: float) -> None:
        while not self._closed.wait(every):
            with self.lock:
                channels = [w.conn for w in self.workers if w.alive] + [c for c, _ in self.followers.values()]
            for channel in channels:
                try:
                    channel.send(("ping",))
                except OSError:
                    pass  # a lost worker is noticed and dropped by the main thread

    def _accept(self) -> None:
        while True:
            try:
                conn = Channel(self.listener.accept())
                hello = conn.recv()
            except (OSError, EOFError):
                if self._closed.is_set():
                    return
                continue
            _, kind, address, pid = hello[:4]
            with self.lock:
                if kind == "server":
                    self.followers[hello[4]] = (conn, address)
                    conn.send(("coordinator", self.server.address()))
                else:
                    self.workers.append(_Worker(conn, address, pid, self.server.connect(address)))
                    if self.program is not None:
                        conn.send(self.program)
                if len(self.workers) >= self._expected[0] and len(self.followers) >= self._expected[1]:
                    self._ready.set()

    def group(self, layout) -> ServerGroup:
        """The servers (this one and the others, in rank order), for placing results and offering state."""
        return ServerGroup(layout, self.server, [self.followers[r] for r in sorted(self.followers)], self.ids)

    def set_program(self, exported, addresses: list[str], dims: list[int | None]) -> None:
        self.program = ("program", addresses, bytes(exported.serialize()), dims)
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
        self.listener.close()


class FollowerLink:
    """A server of rank 1.. and its channel to rank 0: decisions in, result parts pulled from rank 0."""

    def __init__(self):
        self.rank = int(os.environ[ENV_SERVER_RANK])
        self.count = server_count()
        self.transfer = _transfer_server()
        self.timeout = server_timeout()
        self.conn = Channel(_connect(_address(), _authkey()))
        self.conn.send(("hello", "server", self.transfer.address(), os.getpid(), self.rank))
        _, coordinator_address = self.recv()
        self.coordinator = self.transfer.connect(coordinator_address)
        _watch_for_silence(self.conn, self.timeout, lambda: f"parameter server rank {self.rank}")

    def recv(self):
        """rank 0's next decision; an error if the connection breaks or rank 0 goes silent."""
        try:
            return self.conn.recv(self.timeout, silent=lambda: TimeoutError(_silent_server(self.timeout)))
        except TimeoutError as error:
            raise RuntimeError(f"Parameter server rank {self.rank}: {error}; the job cannot go on.") from None
        except (EOFError, OSError) as error:
            raise RuntimeError(
                f"Parameter server rank {self.rank} lost its connection to rank 0, which "
                "coordinates the job; the job cannot go on."
            ) from error


class RemoteWorkers:
    """Hands batches to worker processes and collects their gradients.

    A batch a lost worker held (its process died, its connection broke, or it
    held the batch past `worker_timeout`) goes back to the front of the queue
    and is redone by another worker.
    """

    def __init__(self, strategy, coordinator: Coordinator):
        self.strategy = strategy
        self.coordinator = coordinator
        self.group = coordinator.group(strategy.servers)
        self.pending: collections.deque[_Task] = collections.deque()  # not yet handed out
        self.exported = None

    def export(self, steps, state, batch) -> None:
        """Serializes the worker's gradient computation; typed RNG keys travel as raw key data."""
        template = state.model_state

        salted_gradients = salted(steps.gradients)

        def gradients(params, encoded_model_state, batch, rng, salt):
            grads, model_state, increments = salted_gradients(
                params, decode(encoded_model_state, template), batch, rng, salt
            )
            return grads, encode(model_state), increments

        args = (
            state.params,
            jax.eval_shape(encode, state.model_state),
            batch,
            job_rng(steps, state, 0),
            job_salt(0, 0),
        )
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
        self.exported = jax.export.export(jax.jit(gradients))(*shapes)
        view = self.group.describe(state)
        self.coordinator.set_program(self.exported, self.group.addresses, view.pulled.dims)

    def submit(self, task: _Task) -> None:
        self.pending.append(task)

    def dispatch(self, state, version: int) -> None:
        """Hands queued tasks to idle workers, with `state`'s parameters (parameter version `version`)."""
        assigned = []
        for worker in self.coordinator.live():
            if not self.pending:
                break
            if worker.job is None:
                assigned.append((worker, self.pending.popleft(), next(self.coordinator.ids)))
        self.group.offer(state, [pull_id for _, _, pull_id in assigned])
        for worker, task, pull_id in assigned:
            push_id = next(self.coordinator.ids)
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
                    self.coordinator.drop(worker, f"no answer within worker_timeout={self.strategy.worker_timeout:g} s")
                continue
            try:
                message = worker.conn.recv()
                if message[0] == "failed":  # the worker could not pull: redo the batch
                    worker.job = None
                    self.pending.appendleft(job.task)
                    continue
                avals = [(a.shape, a.dtype) for a in self.exported.out_avals]
                flat = worker.transfer.pull(job.push_id, specs(avals, self.strategy.server_device), timeout=deadline())
                jax.block_until_ready(flat)
            except (EOFError, OSError, RuntimeError) as error:
                self.pending.appendleft(job.task)
                self.coordinator.drop(
                    worker, f"{type(error).__name__}: {error}" if str(error) else "its connection closed"
                )
                continue
            worker.job = None
            results.append((job, jax.tree.unflatten(self.exported.out_tree, flat)))
        return results

    def apply(self, training: ServerUpdates, result, staleness: int | None = None) -> None:
        """Applies a worker's result to `training.state` on every server."""
        taken = self.group.take(training.state, *result, staleness)
        training.state, training.logs = training.apply_encoded(training.state, *taken)


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
