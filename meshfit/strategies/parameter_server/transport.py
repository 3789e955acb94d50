"""How the processes of a parameter-server job find and talk to each other.

`meshfit launch --ps S --workers N` gives every process its role and the
job's address and secret in `MESHFIT_PS_*` variables (named in `launcher`).

Control plane: `multiprocessing.connection` with an authkey (HMAC challenge on
connect), loopback by default. Messages are small tuples of ints and strings;
batches travel as raw array bytes with their shape and dtype (`to_wire`), so
nothing from the network is unpickled beyond the authenticated control tuples.
Arrays (parameters to a worker, gradients back) move through
`jax.experimental.transfer` servers, one per process.
"""

from __future__ import annotations

import array
import datetime
import fcntl
import os
import sys
import termios
import threading
import time
from multiprocessing.connection import Client

import jax
import numpy as np

from meshfit.batch import Batch
from meshfit.strategies.parameter_server import launcher

# The exported gradient program takes a Batch; both ends must know its name.
jax.export.register_namedtuple_serialization(Batch, serialized_name="meshfit.batch.Batch")

#: How long an offered array waits to be pulled before its transfer server lets it go.
HOLD_TIMEOUT = datetime.timedelta(seconds=120)
PULL_TIMEOUT = datetime.timedelta(seconds=30)


def role() -> str | None:
    """This process's role in a parameter-server job; None outside one."""
    return os.environ.get(launcher.ENV_PS_ROLE)


def server_count() -> int:
    """How many server processes the job has (1 outside a `meshfit launch --ps` job)."""
    return int(os.environ.get(launcher.ENV_PS_SERVERS, "1"))


def address() -> tuple[str, int]:
    """The coordinator's control address (host, port)."""
    value = os.environ.get(launcher.ENV_PS_ADDRESS)
    if not value:
        raise RuntimeError(
            f"{launcher.ENV_PS_ADDRESS} is not set; start parameter-server jobs with `meshfit launch --ps`."
        )
    host, port = value.rsplit(":", 1)
    return host, int(port)


def authkey() -> bytes:
    """The job's shared secret: every control connection proves it knows it."""
    key = os.environ.get(launcher.ENV_PS_AUTHKEY)
    if not key:
        raise RuntimeError(
            f"{launcher.ENV_PS_AUTHKEY} is not set; start parameter-server jobs with `meshfit launch --ps`."
        )
    return bytes.fromhex(key)


def server_timeout() -> float:
    """Seconds a worker or a server of rank 1.. waits without any message from rank 0 (pings included)."""
    value = os.environ.get(launcher.ENV_PS_SERVER_TIMEOUT)
    try:
        timeout = float(value) if value else launcher.DEFAULT_SERVER_TIMEOUT
    except ValueError:
        raise ValueError(
            f"{launcher.ENV_PS_SERVER_TIMEOUT} must be a number of seconds. Received: {value!r}."
        ) from None
    if timeout <= 0:
        raise ValueError(f"{launcher.ENV_PS_SERVER_TIMEOUT} must be positive. Received: {value!r}.")
    return timeout


def silent_server(timeout: float) -> str:
    return (
        f"the parameter server (rank 0, which coordinates the job, at {os.environ.get(launcher.ENV_PS_ADDRESS)}) sent "
        f"nothing for {timeout:g} s ({launcher.ENV_PS_SERVER_TIMEOUT}); it is stopped or hung"
    )


def watch_for_silence(channel: Channel, timeout: float, describe) -> None:
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
                    f"{describe()}: {silent_server(timeout)}. Exiting with status {launcher.EXIT_SERVER_SILENT}.",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(launcher.EXIT_SERVER_SILENT)

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


def connect(timeout: float = 120.0) -> Channel:
    """Connects to the coordinator, retrying while it starts up."""
    where, key = address(), authkey()
    give_up_at = time.monotonic() + timeout
    while True:
        try:
            return Channel(Client(where, authkey=key))
        except ConnectionRefusedError:
            if time.monotonic() > give_up_at:
                raise
            time.sleep(0.2)


def to_wire(tree) -> list:
    """A pytree's leaves as `(dtype, shape, bytes)`: what a control message may carry of arrays."""
    leaves = jax.tree.leaves(tree)
    return [(np.asarray(a).dtype.str, np.shape(a), np.ascontiguousarray(a).tobytes()) for a in leaves]


def from_wire(items) -> list[np.ndarray]:
    """The leaves `to_wire` sent."""
    return [np.frombuffer(b, dtype=np.dtype(d)).reshape(s) for d, s, b in items]


def transfer_server():
    """This process's `jax.experimental.transfer` server, on loopback: what moves arrays between processes."""
    from jax.experimental import transfer

    client = jax.local_devices()[0].client
    return transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"])


def deadline(delta: datetime.timedelta = PULL_TIMEOUT) -> datetime.datetime:
    return datetime.datetime.now() + delta


def specs(avals, device) -> list[jax.ShapeDtypeStruct]:
    """What a transfer pull expects: these `(shape, dtype)` pairs, on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in avals]
