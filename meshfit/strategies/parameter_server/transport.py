"""How the processes of a parameter-server job find and talk to each other.

`meshfit launch --ps S --workers N` gives every process its role and the
job's address and secret in `MESHFIT_PS_*` variables (named in `launcher`).

Every connection between the job's processes is a `multiprocessing.connection`
with an authkey (HMAC challenge on connect), on loopback: each worker and each
server of rank 1.. to rank 0 (the job's address), and, with several servers,
each worker to each server of rank 1.. (its own listener, whose address rank 0
sends the workers). A listener (`Gate`) runs the challenge of each connection
on a thread of its own within `HANDSHAKE_TIMEOUT` (`handshake`): a peer that
stays silent, sends garbage or does not know the secret is dropped, and holds
nothing up. These are the job's only ports besides the servers' own
`jax.distributed` job (S > 1).

Messages are small tuples of ints and strings; arrays (batches, parameters,
gradients) travel in them as raw bytes with their shape and dtype (`to_wire`),
so nothing from the network is unpickled beyond the authenticated control
tuples. A worker takes rank 0's part of the parameters with each batch and
each other server's part from that server; it sends its gradients to rank 0,
which sends each other server its part.
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
import sys
import termios
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener

import jax
import numpy as np

from meshfit.core.batch import Batch
from meshfit.runtime.handshake import HANDSHAKE_ERRORS, HANDSHAKE_TIMEOUT, handshake
from meshfit.strategies.parameter_server import launcher

# The exported gradient program takes a Batch; both ends must know its name.
jax.export.register_namedtuple_serialization(Batch, serialized_name="meshfit.core.batch.Batch")

#: Seconds a worker waits for a server's part of the parameters (a server of rank 1.. sends it when rank 0 says).
PULL_TIMEOUT = 30.0


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

    def send_if_idle(self, message) -> bool:
        """Sends `message` unless another thread is sending on this channel (then the peer hears that);
        returns whether it was sent. For heartbeats, which must not queue behind a send to a stopped peer."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self.conn.send(message)
        finally:
            self._lock.release()
        return True

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


def connect(timeout: float = 120.0, where: tuple[str, int] | None = None, what: str = "coordinator") -> Channel:
    """Connects to the coordinator (or the server at `where`, `what`), retrying while it starts up; a clear
    error if it does not answer in time.

    Every attempt is bounded (connecting, then the handshake: `HANDSHAKE_TIMEOUT`),
    so something that holds the port without answering costs a retry, not the job.
    A rejected secret is an error at once: retrying cannot fix it.
    """
    where, key = where or address(), authkey()
    give_up_at = time.monotonic() + timeout
    while True:
        left = give_up_at - time.monotonic()
        try:
            sock = socket.create_connection(where, timeout=max(0.1, min(HANDSHAKE_TIMEOUT, left)))
            sock.settimeout(None)  # a Connection needs a blocking socket; `handshake` bounds the wait
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see `no_delay`
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
                    f"the parameter-server {what} at {where[0]}:{where[1]} rejected this process's secret "
                    f"({launcher.ENV_PS_AUTHKEY}): it belongs to another job. Copy the MESHFIT_PS_* variables from "
                    "a running process of this job."
                ) from None
            last_error = error
        except HANDSHAKE_ERRORS as error:
            last_error = error
        if time.monotonic() > give_up_at:
            raise TimeoutError(
                f"no parameter-server {what} answered at {where[0]}:{where[1]} within {timeout:g} s "
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


def no_delay(conn: Connection) -> None:
    """Turns off Nagle's algorithm on `conn`: a `Connection` writes a message over 16 KiB as its length, then
    its bytes, and Nagle would hold the bytes until the peer acknowledges the length (up to 40 ms of delayed
    ACK on Linux) every time."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def bound_sends(channel: Channel, seconds: float) -> None:
    """Makes a send on `channel` fail with an `OSError` once the peer has taken no bytes for `seconds`.

    Why: a send blocks when the peer's socket buffer is full, and a stopped
    (SIGSTOP) or hung worker stops reading: with parameters larger than the
    buffers (a few MiB), rank 0 would wait on it forever instead of dropping
    it after `worker_timeout`, as it does for a worker that does not answer.
    """
    whole = int(seconds)
    with socket.socket(fileno=os.dup(channel.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def parse_address(value: str) -> tuple[str, int]:
    host, port = value.rsplit(":", 1)
    return host, int(port)


class Gate:
    """A listener of the job's processes: it authenticates each connection on a thread of its own, within
    `HANDSHAKE_TIMEOUT`, and hands `admit` the channel and hello of each one that knows the secret.

    No peer can stop or block the accept loop: a stranger that stays silent,
    sends garbage or does not know the secret is closed (the first one said on
    stderr, so that someone probing the port is seen without flooding the log).
    """

    _BACKLOG = 128  # connections the kernel queues for the accept thread (strangers may fill some)
    _MAX_HANDSHAKES = 64  # connections being authenticated at once; more are closed at once
    _ACCEPT_BACKOFF = 1.0  # the longest pause after a failed accept (out of file descriptors)

    def __init__(self, where: tuple[str, int], key: bytes, admit):
        # No authkey here: `Listener.accept` would run the handshake on the accept thread, unbounded.
        self.listener = Listener(where, backlog=self._BACKLOG)
        host, port = self.listener.address
        self.address = f"{host}:{port}"
        self.key = key
        self.admit = admit
        self.closed = threading.Event()
        self._stranger_seen = threading.Event()
        self._handshakes = threading.BoundedSemaphore(self._MAX_HANDSHAKES)
        threading.Thread(target=self._accept, daemon=True, name="ps-accept").start()

    def _accept(self) -> None:
        pause = 0.01
        while not self.closed.is_set():
            try:
                conn = self.listener.accept()
            except OSError:  # closed, or out of file descriptors: back off rather than spin
                if self.closed.wait(pause):
                    return
                pause = min(2 * pause, self._ACCEPT_BACKOFF)
                continue
            pause = 0.01
            if not self._handshakes.acquire(blocking=False):
                conn.close()  # a flood of strangers: the job's own processes retry
                continue
            threading.Thread(target=self._admit, args=(conn,), daemon=True, name="ps-handshake").start()

    def _admit(self, conn) -> None:
        no_delay(conn)
        try:
            hello = handshake(conn, self.key, accepting=True, then=lambda c: c.recv())
        except HANDSHAKE_ERRORS as error:
            conn.close()
            if not self._stranger_seen.is_set():
                self._stranger_seen.set()
                why = f"{type(error).__name__}: {str(error) or 'silent, or closed'}"
                print(
                    f"ParameterServerStrategy: closed a connection to {self.address} that did not complete the "
                    f"handshake ({why}); it is not one of the job's processes. Further ones are closed without a "
                    "word.",
                    file=sys.stderr,
                    flush=True,
                )
            return
        finally:
            self._handshakes.release()
        if not (isinstance(hello, tuple) and len(hello) >= 4 and hello[0] == "hello"):
            conn.close()
            return
        self.admit(Channel(conn), hello)

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
