"""Server ranks 1..N-1 of a job with several server processes: they replay what rank 0 decides.

Every server process runs the user's script, so evaluation, callbacks and
checkpoints run on all of them, as in any multi-process job. Only rank 0 talks
to workers and decides what happens when. It sends each decision to the other
servers over the authenticated control channel (`coordinator.ServerGroup`),
and they replay it:

    ("offer", pull_ids)        offer this server's part of the parameters to workers
    ("apply", take_id, s)      pull this server's part of a worker's result from
                               rank 0 and apply it (s: its staleness, or None)
    ("return",)                the end of one call of the train function
"""

from __future__ import annotations

import os

from meshfit.strategies.parameter_server import launcher, transport
from meshfit.strategies.parameter_server.partition import TransferPlan
from meshfit.strategies.parameter_server.server import ServerTrainFunction
from meshfit.strategies.parameter_server.transport import HOLD_TIMEOUT, deadline


class FollowerLink:
    """A server of rank 1.. and its channel to rank 0: decisions in, result parts pulled from rank 0."""

    def __init__(self):
        self.rank = int(os.environ[launcher.ENV_PS_SERVER_RANK])
        self.count = transport.server_count()
        self.transfer = transport.transfer_server()
        self.timeout = transport.server_timeout()
        self.conn = transport.connect()
        self.conn.send(("hello", "server", self.transfer.address(), os.getpid(), self.rank))
        _, coordinator_address = self.recv()
        self.coordinator = self.transfer.connect(coordinator_address)
        transport.watch_for_silence(self.conn, self.timeout, lambda: f"parameter server rank {self.rank}")

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
                variables = self.plan.offered(self.state, server)
                for pull_id in op[1]:
                    self.link.transfer.await_pull(pull_id, variables, timeout=deadline(HOLD_TIMEOUT))
            elif op[0] == "apply":
                _, take_id, staleness = op
                parts = self.link.coordinator.pull(take_id, self.plan.result_specs(server, device), timeout=deadline())
                self.apply(*self.plan.build(list(parts)), encoded=True)
                if staleness is not None:
                    self.staleness.append(staleness)
            elif op[0] == "return":
                return self.state, self.current_logs()
            else:
                raise RuntimeError(f"Unexpected message from the coordinator (rank 0): {op[0]!r}.")
