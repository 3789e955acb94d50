"""A parameter-server worker process: `python -m meshfit.strategies.parameter_server.worker`.

`meshfit launch --ps S --workers N` runs this on the worker ranks instead of
the training script. A worker needs nothing of the script: the coordinator
(server rank 0) sends it the gradient computation as serialized StableHLO
(`jax.export`), then batches; the worker takes the parameters (sent with each
batch by a single server, else pulled from each server's transfer server),
computes and returns the gradients the same way, until told to stop.

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
from meshfit.strategies.parameter_server.transport import HOLD_TIMEOUT, deadline, specs

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


class WorkerProgram:
    """A worker's gradient program and where it pulls the parameters from (each server's part; no addresses:
    they come with each job, `transport.arrays_inline`)."""

    def __init__(self, server, device, addresses: list[str], blob: bytes, dims: list[int | None]):
        self.exported = jax.export.deserialize(bytearray(blob))
        self.servers = [server.connect(address) for address in addresses]
        self.partition = Partition(dims, max(1, len(addresses)))
        self.device = device

    def run(self, pull_id: int, batch_leaves: list, parameters: list | None = None):
        if parameters is not None:
            state_leaves = [jax.device_put(a, self.device) for a in transport.from_wire(parameters)]
        else:
            avals = self.exported.in_avals[: len(self.partition.dims)]
            parts = [
                connection.pull(pull_id, specs(self.partition.part_avals(avals, k), self.device), timeout=deadline())
                for k, connection in enumerate(self.servers)
            ]
            state_leaves = self.partition.assemble([list(p) for p in parts])
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
    server = None if transport.arrays_inline() else transport.transfer_server()
    conn = transport.connect()
    conn.send(("hello", "worker", server and server.address(), os.getpid()))
    print(f"parameter-server worker pid {os.getpid()} connected", flush=True)
    program = None
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
            program = WorkerProgram(server, device, *message[1:])
            continue
        if kind == "work":
            _, job, pull_id, push_id, batch_items, parameters = message
            try:
                out = program.run(pull_id, transport.from_wire(batch_items), parameters)
                if delay:
                    time.sleep(delay)
            except jax.errors.JaxRuntimeError as error:  # a transfer broke: the coordinator redoes the batch
                conn.send(("failed", job, str(error)[:300]))
                continue
            if server is None:
                conn.send(("done", job, push_id, transport.to_wire(out)))
                continue
            server.await_pull(push_id, jax.tree.leaves(out), timeout=deadline(HOLD_TIMEOUT))
            conn.send(("done", job, push_id))


if __name__ == "__main__":
    sys.exit(main())
