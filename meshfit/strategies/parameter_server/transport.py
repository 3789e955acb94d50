"""How the processes of a parameter-server job find and talk to each other.

`meshfit launch --ps S --workers N` gives every process its role and the
job's address and secret in `MESHFIT_PS_*` variables (named in `launcher`).

Control plane: `multiprocessing.connection` with an authkey (HMAC challenge on
connect), loopback by default. Each side runs the challenge within
`HANDSHAKE_TIMEOUT` (`handshake`): a peer that stays silent, sends garbage or
does not know the secret is dropped, and holds nothing up. Messages are small tuples of ints and strings;
batches travel as raw array bytes with their shape and dtype (`to_wire`), so
nothing from the network is unpickled beyond the authenticated control tuples.
Arrays (parameters to a worker, gradients back) move over that authenticated
connection when the job has one server (`arrays_inline`), and through
`jax.experimental.transfer` servers, one per process, when the state is
partitioned over several. A transfer server's listeners take any local
connection, and one that connects and stays silent stalls every later pull of
that server past its timeout (jaxlib 0.10); so they are started only where the
state is partitioned (see docs/parameter_server.md, "Limits").
"""

from __future__ import annotations

import array
import datetime
import fcntl
import os
import socket
import sys
import termios
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

import jax
import numpy as np

from meshfit.batch import Batch
from meshfit.strategies.parameter_server import launcher

# The exported gradient program takes a Batch; both ends must know its name.
jax.export.register_namedtuple_serialization(Batch, serialized_name="meshfit.batch.Batch")

#: How long an offered array waits to be pulled before its transfer server lets it go.
HOLD_TIMEOUT = datetime.timedelta(seconds=120)
PULL_TIMEOUT = datetime.timedelta(seconds=30)
#: Seconds a control connection has to complete the HMAC handshake and say hello (milliseconds between the job's
#: own processes); past it the connection is dropped.
HANDSHAKE_TIMEOUT = 10.0
#: What a peer that is not one of the job's processes can make the handshake raise: it stays silent (EOFError
#: once the bound shuts the socket), sends garbage (OSError "bad message length", AssertionError in
#: `answer_challenge`) or does not know the secret (AuthenticationError).
HANDSHAKE_ERRORS = (AuthenticationError, EOFError, OSError, AssertionError)


def role() -> str | None:
    """This process's role in a parameter-server job; None outside one."""
    return os.environ.get(launcher.ENV_PS_ROLE)


def server_count() -> int:
    """How many server processes the job has (1 outside a `meshfit launch --ps` job)."""
    return int(os.environ.get(launcher.ENV_PS_SERVERS, "1"))


def arrays_inline() -> bool:
    """Whether arrays travel over the control connections (one server process) rather than transfer servers."""
    return server_count() == 1


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


def handshake(conn: Connection, key: bytes, accepting: bool, timeout: float = HANDSHAKE_TIMEOUT, then=None):
    """Runs the HMAC challenge both ways on `conn` (and `then(conn)`, say reading a hello) within `timeout` s.

    Returns what `then` returned; raises one of `HANDSHAKE_ERRORS` if the peer
    fails or does not finish in time: the bound shuts the socket, so a silent or
    trickling peer ends in EOFError instead of blocking the caller. The accepting
    side delivers the challenge first, as `multiprocessing.connection.Listener` does.
    """
    done, lock = False, threading.Lock()

    def shut():
        with lock:
            if not done:
                with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # wakes a read blocked on `conn`
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    timer = threading.Timer(timeout, shut)
    timer.daemon = True
    timer.start()
    try:
        if accepting:
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
        else:
            answer_challenge(conn, key)
            deliver_challenge(conn, key)
        result = then(conn) if then else None
        with lock:
            done = True
            timer.cancel()
        return result
    except BaseException:
        timer.cancel()
        raise


def connect(timeout: float = 120.0) -> Channel:
    """Connects to the coordinator, retrying while it starts up; a clear error if it does not answer in time.

    Every attempt is bounded (connecting, then the handshake: `HANDSHAKE_TIMEOUT`),
    so something that holds the port without answering costs a retry, not the job.
    A rejected secret is an error at once: retrying cannot fix it.
    """
    where, key = address(), authkey()
    give_up_at = time.monotonic() + timeout
    while True:
        left = give_up_at - time.monotonic()
        try:
            sock = socket.create_connection(where, timeout=max(0.1, min(HANDSHAKE_TIMEOUT, left)))
            sock.settimeout(None)  # a Connection needs a blocking socket; `handshake` bounds the wait
            conn = Connection(sock.detach())
            try:
                handshake(conn, key, accepting=False, timeout=max(0.1, min(HANDSHAKE_TIMEOUT, left)))
            except BaseException:
                conn.close()
                raise
            return Channel(conn)
        except AuthenticationError as error:
            if "rejected" in str(error):
                raise RuntimeError(
                    f"the parameter-server coordinator at {where[0]}:{where[1]} rejected this process's secret "
                    f"({launcher.ENV_PS_AUTHKEY}): it belongs to another job. Copy the MESHFIT_PS_* variables from "
                    "a running process of this job."
                ) from None
            last_error = error
        except HANDSHAKE_ERRORS as error:
            last_error = error
        if time.monotonic() > give_up_at:
            raise TimeoutError(
                f"no parameter-server coordinator answered at {where[0]}:{where[1]} within {timeout:g} s "
                f"(last attempt: {type(last_error).__name__}: {last_error}). Rank 0 failed or was not started "
                "(see its output), or another program holds the port."
            ) from last_error
        time.sleep(0.2)


def to_wire(tree) -> list:
    """A pytree's leaves as `(dtype, shape, bytes)`: what a control message may carry of arrays."""
    leaves = [np.asarray(a) for a in jax.tree.leaves(tree)]
    return [(a.dtype.name, a.shape, np.ascontiguousarray(a).tobytes()) for a in leaves]


def from_wire(items) -> list[np.ndarray]:
    """The leaves `to_wire` sent (dtypes by name: bfloat16 and the other ml_dtypes too)."""
    return [np.frombuffer(b, dtype=jax.numpy.dtype(d)).reshape(s) for d, s, b in items]


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
