"""A parameter-server worker process: `python -m meshfit.strategies.parameter_server.worker`.

`meshfit launch --ps S --workers N` runs this on the worker ranks instead of
the training script. A worker needs nothing of the script: the coordinator
(server rank 0) sends it the gradient computation as serialized StableHLO
(`jax.export`), then batches with rank 0's part of the parameters; with
several servers, each other server sends its part over the worker's
authenticated connection to it. The worker computes and sends the gradients
back to rank 0 as raw array bytes, until told to stop.

A worker is never part of a `jax.distributed` job, so its death takes no one
down: the coordinator drops it and redoes its batch. It ends with status
`launcher.EXIT_SERVER_SILENT` when rank 0 says nothing for the job's server timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax

from meshfit.strategies.parameter_server import launcher, transport
from meshfit.strategies.parameter_server.partition import Partition

#: JSON {worker index: seconds} a worker sleeps after each gradient: what `worker_delays` is to one-host
#: training, for the process transport (benchmarks/bench_parameter_server.py's straggler). Workers are
#: indexed from 0 (rank - S under `--ps S`).
ENV_SIMULATED_DELAYS = "MESHFIT_PS_WORKER_DELAYS"


def simulated_delay() -> float:
    """This worker's seconds of simulated device time per gradient (`ENV_SIMULATED_DELAYS`), 0 by default."""
    text = os.environ.get(ENV_SIMULATED_DELAYS)
    if not text:
        return 0.0
    index = int(os.environ["MESHFIT_PROCESS_ID"]) - int(os.environ.get(launcher.ENV_PS_SERVERS, "1"))
    return float(json.loads(text).get(str(index), 0.0))


def connect_servers(addresses: list[str], connected: dict) -> list[transport.Channel]:
    """This worker's connections to the servers of rank 1.. at `addresses` (in rank order), which send it
    their parts of the parameters; made once (`connected`, by address) and kept for every later program."""
    for rank, address in enumerate(addresses, start=1):
        if address not in connected:
            server = transport.connect(where=transport.parse_address(address), what=f"server (rank {rank})")
            server.send(("hello", "worker", None, os.getpid()))
            connected[address] = server
    return [connected[address] for address in addresses]


class WorkerProgram:
    """A worker's gradient program, and its connections to the servers of rank 1.. (none with one server)."""

    def __init__(self, device, servers: list[transport.Channel], blob: bytes, dims: list[int | None]):
        self.exported = jax.export.deserialize(bytearray(blob))
        self.servers = servers
        self.partition = Partition(dims, 1 + len(servers))
        self.device = device

    def part(self, rank: int, job: int) -> list:
        """Server `rank`'s part of the parameters for `job` (older ones, of jobs this worker gave up, are
        skipped); a `TimeoutError` if it does not come within `transport.PULL_TIMEOUT`."""
        server = self.servers[rank - 1]
        while True:
            message = server.recv(
                transport.PULL_TIMEOUT,
                silent=lambda: TimeoutError(f"server rank {rank} sent nothing for {transport.PULL_TIMEOUT:g} s"),
            )
            if message[0] == "part" and message[1] == job:
                return message[2]

    def run(self, job: int, batch_leaves: list, parameters: list):
        parts = [parameters] + [self.part(rank, job) for rank in range(1, self.partition.count)]
        on_device = [[jax.device_put(a, self.device) for a in transport.from_wire(p)] for p in parts]
        state_leaves = self.partition.assemble(on_device)
        args = jax.tree.unflatten(self.exported.in_tree, state_leaves + batch_leaves)
        out = self.exported.call(*args[0], **args[1])
        return jax.block_until_ready(out)


def main() -> int:
    """The life of a worker process: connect, take work until told to stop; returns the exit status."""
    if transport.role() != "worker":
        print(
            "This is the worker process of a parameter-server job: `meshfit launch --ps S --workers N script.py` "
            f"starts it on the worker ranks, with {launcher.ENV_PS_ROLE}=worker and the job's other MESHFIT_PS_* "
            "variables (copy them from a running worker to add one by hand).",
            file=sys.stderr,
        )
        return 2
    device = jax.local_devices()[0]
    conn = transport.connect()
    conn.send(("hello", "worker", None, os.getpid()))
    print(f"parameter-server worker pid {os.getpid()} connected", flush=True)
    program, connected = None, {}
    timeout = transport.server_timeout()
    delay = simulated_delay()
    transport.watch_for_silence(conn, timeout, lambda: f"parameter-server worker pid {os.getpid()}")
    while True:
        try:
            message = conn.recv(timeout, silent=lambda: TimeoutError(transport.silent_server(timeout)))
        except TimeoutError as error:
            print(
                f"parameter-server worker pid {os.getpid()}: {error}. "
                f"Exiting with status {launcher.EXIT_SERVER_SILENT}.",
                file=sys.stderr,
                flush=True,
            )
            return launcher.EXIT_SERVER_SILENT
        except (EOFError, OSError):
            return 0  # rank 0 is gone: the job is over
        kind = message[0]
        if kind == "stop":
            return 0
        if kind == "program":
            _, addresses, blob, dims = message
            program = WorkerProgram(device, connect_servers(addresses, connected), blob, dims)
            continue
        if kind == "work":
            _, job, batch_items, parameters = message
            try:
                out = program.run(job, transport.from_wire(batch_items), parameters)
                if delay:
                    time.sleep(delay)
            except (TimeoutError, EOFError, OSError) as error:  # a server's part did not come: the batch is redone
                conn.send(("failed", job, f"{type(error).__name__}: {error}"[:300]))
                continue
            conn.send(("done", job, transport.to_wire(out)))


if __name__ == "__main__":
    sys.exit(main())
