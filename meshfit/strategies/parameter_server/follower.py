"""Server ranks 1..N-1 of a job with several server processes: they replay what rank 0 decides.

Every server process runs the user's script, so evaluation, callbacks and
checkpoints run on all of them, as in any multi-process job. Only rank 0 talks
to workers and decides what happens when. It sends each decision to the other
servers over the authenticated control channel (`coordinator.ServerGroup`),
and they replay it:

    ("offer", [(job, pid)])    send this server's part of the parameters to the
                               worker of each pid, for that job
    ("apply", s, parts)        apply this server's part of a worker's result,
                               which comes with the message (s: its staleness, or None)
    ("return",)                the end of one call of the train function

Workers connect to each server of rank 1.. (`transport.Gate`, authenticated
like rank 0's listener) when rank 0 sends them the gradient program, which
carries the servers' addresses.
"""

from __future__ import annotations

import os
import queue
import threading

import jax

from meshfit.strategies.parameter_server import launcher, transport
from meshfit.strategies.parameter_server.partition import TransferPlan
from meshfit.strategies.parameter_server.server import ServerTrainFunction


class FollowerLink:
    """A server of rank 1.., its channel to rank 0 (decisions and result parts in) and its listener for
    workers (each worker's connection, by pid, takes this server's parts of the parameters)."""

    def __init__(self):
        self.rank = int(os.environ[launcher.ENV_PS_SERVER_RANK])
        self.count = transport.server_count()
        self.timeout = transport.server_timeout()
        self.workers: dict[int, transport.Channel] = {}  # pid -> its connection
        self._outboxes: dict[int, queue.SimpleQueue] = {}  # pid -> parts to send it
        self._joined = threading.Condition()
        self.gate = transport.Gate(("127.0.0.1", 0), transport.authkey(), self._admit)
        self.conn = transport.connect()
        self.conn.send(("hello", "server", self.gate.address, os.getpid(), self.rank))
        transport.watch_for_silence(self.conn, self.timeout, lambda: f"parameter server rank {self.rank}")

    def _admit(self, conn: transport.Channel, hello: tuple) -> None:
        with self._joined:
            old = self.workers.get(hello[3])
            self.workers[hello[3]] = conn
            self._joined.notify_all()
        if old is not None:
            old.close()

    def send_part(self, pid: int, job: int, items: list) -> None:
        """Sends this server's part of the parameters to the worker `pid` for `job`, from a thread of that
        worker's: a worker that is slow to read, stopped or gone holds up no one else."""
        if pid not in self._outboxes:
            self._outboxes[pid] = queue.SimpleQueue()
            threading.Thread(target=self._deliver, args=(pid,), daemon=True, name="ps-parts").start()
        self._outboxes[pid].put((job, items))

    def _deliver(self, pid: int) -> None:
        """Sends the worker `pid` its parts, in order. It connects when it gets the program: each part waits
        for that up to `transport.PULL_TIMEOUT`; one that finds no connection is dropped (the worker gives up
        on its job, or rank 0 finds it gone, and the batch is redone)."""
        outbox = self._outboxes[pid]
        while True:
            job, items = outbox.get()
            with self._joined:
                self._joined.wait_for(lambda: pid in self.workers, transport.PULL_TIMEOUT)
                conn = self.workers.get(pid)
            if conn is None:
                continue
            try:
                conn.send(("part", job, items))
            except OSError:  # the worker is gone
                with self._joined:
                    if self.workers.get(pid) is conn:
                        del self.workers[pid]
                conn.close()

    def recv(self):
        """rank 0's next decision; an error if the connection breaks or rank 0 goes silent."""
        try:
            return self.conn.recv(self.timeout, silent=lambda: TimeoutError(transport.silent_server(self.timeout)))
        except TimeoutError as error:
            raise RuntimeError(f"Parameter server rank {self.rank}: {error}; the job cannot go on.") from None
        except (EOFError, OSError) as error:
            raise RuntimeError(
                f"Parameter server rank {self.rank} lost its connection to rank 0, which "
                "coordinates the job; the job cannot go on."
            ) from error


class FollowerEngine(ServerTrainFunction):
    """The train function of server ranks 1..N-1: replays rank 0's decisions on this server's part.

    Called exactly as often as rank 0's engine (every server runs the same
    script over the same data); each call applies what rank 0 applied in its
    call, and `drain()` what rank 0's `drain()` applied (asynchronous mode
    only: synchronous engines have nothing in flight). It is not an engine with
    `Workers`: it hands out no jobs and decides nothing (not even staleness,
    which rank 0 sends); it repeats, in order, what rank 0's engine did.
    """

    def __init__(self, strategy, steps, link: FollowerLink, asynchronous: bool):
        super().__init__(strategy, steps)
        self.link = link
        self.asynchronous = asynchronous
        self.plan: TransferPlan | None = None

    def __call__(self, state, batch):
        return self._replay(state)

    def drain(self):
        return self._replay(self.state) if self.asynchronous and self.state is not None else None

    def _replay(self, state):
        if state is not self.state:
            self.state, self.staleness = state, []
        if self.plan is None:
            self.plan = TransferPlan(self.strategy.servers, state, self.link.count)
        server, device = self.link.rank, self.strategy.server_device
        while True:
            op = self.link.recv()
            if op[0] == "offer":
                items = transport.to_wire(self.plan.offered(self.state, server))
                for job, pid in op[1]:
                    self.link.send_part(pid, job, items)
            elif op[0] == "apply":
                _, staleness, items = op
                parts = [jax.device_put(a, device) for a in transport.from_wire(items)]
                self.apply(*self.plan.build(parts), encoded=True)
                if staleness is not None:
                    self.staleness.append(staleness)
            elif op[0] == "return":
                return self.state, self.current_logs()
            else:
                raise RuntimeError(f"Unexpected message from the coordinator (rank 0): {op[0]!r}.")
