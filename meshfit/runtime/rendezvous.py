"""The start-up handshake: the processes of a job meet on the coordinator's port before JAX joins them.

Why not leave the wait to `jax.distributed.initialize`: it waits in C++ and
says nothing while it waits, nothing in it can tell how many processes came,
and when its time is up JAX's coordination client ends the process with
SIGABRT and a service dump (a `LOG(FATAL)`), not an exception. The hook that
would replace the abort, jaxlib's `missed_heartbeat_callback`, cannot deliver
its status to a Python function (the call fails with `std::bad_cast`), and
after the join the same hook handles lost heartbeats. A watchdog thread
could print, but not raise in the thread JAX blocks.

So the processes first meet on the same HOST:PORT in a small exchange of
JSON lines of meshfit's own: process 0 listens there, every other process
connects and says its id and the count of processes it was given. Process 0
counts them, says once what it waits for, refuses two processes with one id
and counts that disagree, and when all N are there tells them to go, closes
the port, and JAX's coordination service binds it. Every failure is a Python
exception in every process that can know of it:

- `JoinTimeoutError`: not all N came within the timeout ("only K of N
  processes joined at HOST:PORT within T s", or, where a process never
  reached process 0, "the job did not assemble: ...");
- `ValueError`: two processes with one id, or processes given different counts;
- `JoinError`: process 0 went away while the others waited, or something
  that is not meshfit's handshake answers on the port.

The handshake needs no port beyond the one JAX uses. Every process of a job
must take part, that is join through `meshfit.runtime.cluster.initialize`.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import selectors
import socket
import sys
import time
from dataclasses import dataclass, field

PROTOCOL = "meshfit-join/1"
#: Seconds without every process after which process 0 says what it waits for (once).
NOTICE_SECONDS = 5.0
_HELLO_SECONDS = 10.0  # a connection that has not said who it is by then is not one of ours
_GOODBYE_SECONDS = 2.0  # after "go": time for the others to close first (the port is then free at once)
_PROBE_SECONDS = 5.0  # process 0 finding its port taken: time to ask whether a second process 0 holds it
# (a holder just started on a loaded machine may take seconds to answer)
# A process connected to process 0 whose own time is up waits this long for process 0's verdict, so
# that all give the same count (each process's clock starts when it starts).
_VERDICT_SECONDS = 5.0
_RETRY_SECONDS = 0.5
# Out of file descriptors, process 0 stops accepting for a pause that doubles up to this (a pending
# connection keeps the port readable: accepting again at once would spin at 100 % CPU).
_MAX_ACCEPT_PAUSE = 1.0
_FIRST_ACCEPT_PAUSE = 0.05
_MAX_LINE = 65536


class JoinError(RuntimeError):
    """The processes did not form a job: process 0 went away, or the port is not the handshake's."""


class JoinTimeoutError(TimeoutError):
    """Not every process of the job joined within the initialization timeout."""


_ERROR_KINDS = {"value": ValueError, "timeout": JoinTimeoutError, "join": JoinError}


def waiting_message(num_processes: int, address: str, joined: int | None, timeout: float) -> str:
    """What a process says once while it waits: `waiting for N processes at HOST:PORT (K joined, timeout T s)`."""
    joined_part = "" if joined is None else f"{joined} joined, "
    return f"waiting for {num_processes} processes at {address} ({joined_part}timeout {timeout:g} s)"


def timeout_message(
    num_processes: int, address: str, timeout: float, joined: int | None, missing: list[int] | tuple = ()
) -> str:
    """The error when not all came in time, with the likely causes; `joined` None: the count is unknown."""
    if joined is None:
        head = f"the job did not assemble: {num_processes} processes expected at {address} within {timeout:g} s"
    else:
        head = f"only {joined} of {num_processes} processes joined at {address} within {timeout:g} s"
    if missing:
        head += f" (not joined: process {', '.join(map(str, missing))})"
    return (
        f"{head}. Likely causes: a process was not started, or failed before it joined (see its output); "
        "a wrong process count (MESHFIT_NUM_PROCESSES, SLURM_NTASKS or the launcher's differs from the processes "
        f"started); a firewall or a wrong address. MESHFIT_INIT_TIMEOUT (seconds) sets how long to wait."
    )


def no_coordinator_message(
    num_processes: int, process_id: int, address: str, timeout: float, last_error: OSError | None
) -> str:
    """The error of a process that never reached process 0: the count of those that came is unknown."""
    host, port = split_address(address)
    why = f" (last attempt: {last_error})" if last_error else ""
    return (
        f"the job did not assemble: {num_processes} processes expected at {address} within {timeout:g} s. "
        f"This process (id {process_id} of {num_processes} processes) got no answer at {address}{why}: "
        f"process 0 was not started or failed first (see its output), {host} is not its host, or a firewall "
        f"blocks port {port}. MESHFIT_INIT_TIMEOUT (seconds) sets how long to wait."
    )


def out_of_descriptors_message(address: str, error: OSError) -> str:
    """What process 0 says once when `accept()` fails for lack of file descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    which = "this process" if error.errno == errno.EMFILE else "the system"
    return (
        f"process 0 is out of file descriptors ({which}: {error.strerror}; limit {soft}, hard limit {hard}) and "
        f"cannot accept the processes joining at {address}; it retries, pausing up to {_MAX_ACCEPT_PAUSE:g} s. "
        "Raise the limit (`ulimit -n`, or LimitNOFILE= under systemd) or find what holds the descriptors "
        "(`ls /proc/<pid>/fd`)."
    )


def split_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (or `[IPV6]:PORT`) as (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _say(message: str) -> None:
    print(f"meshfit: {message}", file=sys.stderr, flush=True)


def _send(sock: socket.socket, message: dict) -> None:
    """Sends one JSON line; a peer that is gone is not an error here (its end is noticed where it is read)."""
    try:
        sock.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


@dataclass(frozen=True)
class _Job:
    address: str
    num_processes: int
    process_id: int
    timeout: float
    notice_after: float

    def hello(self) -> bytes:
        message = {
            "protocol": PROTOCOL,
            "id": self.process_id,
            "processes": self.num_processes,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        return json.dumps(message).encode() + b"\n"


def assemble(
    address: str,
    num_processes: int,
    process_id: int,
    timeout: float,
    bind_address: str | None = None,
    notice_after: float = NOTICE_SECONDS,
) -> None:
    """Returns once all `num_processes` processes met at `address` (`HOST:PORT`); raises as the module says.

    Process 0 listens on `bind_address` (default: every interface, on the
    port of `address`), as JAX's coordination service will; the others
    connect to `address` and retry until it answers or `timeout` (seconds)
    passes. `notice_after`: seconds after which a process still waiting says
    for what, once.
    """
    job = _Job(address, num_processes, process_id, timeout, notice_after)
    if process_id == 0:
        _Chief(job, bind_address or f"[::]:{split_address(address)[1]}").run()
    else:
        _Member(job).run()


# -- process 0 ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Conn:
    """A connection to process 0: who is at the other end once it said so (`process_id`)."""

    sock: socket.socket
    opened: float
    buffer: bytearray = field(default_factory=bytearray)
    process_id: int | None = None


class _Chief:
    """Process 0's side: listens, counts the processes that say hello, and lets them go when all are there."""

    def __init__(self, job: _Job, bind_address: str):
        self.job = job
        self.bind_address = bind_address
        self.joined: dict[int, str] = {0: f"process 0 (pid {os.getpid()} on {socket.gethostname()})"}
        self.conns: list[_Conn] = []
        self.selector = selectors.DefaultSelector()
        self.accept_pause = 0.0  # > 0 while out of file descriptors (the pause before the next attempt)
        self.accept_at: float | None = None  # when to listen again, while the listener is set aside
        self.short_since: float | None = None  # the last time accept() found no descriptor

    def run(self) -> None:
        listener = self._listen()
        try:
            self.selector.register(listener, selectors.EVENT_READ)
            self._gather(listener)
            self._go()
        finally:
            for conn in self.conns:
                conn.sock.close()
            self.selector.close()
            listener.close()

    def _listen(self) -> socket.socket:
        host, port = split_address(self.bind_address)
        try:
            if host in ("", "::") and socket.has_dualstack_ipv6():
                return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            return socket.create_server(("" if host in ("", "::") else host, port), family=family)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                self._ask_the_holder(error)
            raise JoinError(
                f"process 0 cannot listen on {self.bind_address} for the job's coordinator: {error}."
            ) from error

    def _ask_the_holder(self, error: OSError) -> None:
        """The port is taken: a second process 0 of this job makes the holder refuse both; else the port is busy."""
        probe = _Job(self.job.address, self.job.num_processes, 0, _PROBE_SECONDS, notice_after=float("inf"))
        try:
            _Member(probe, verdict_seconds=0.0).run()
        except ValueError:
            raise
        except (JoinError, JoinTimeoutError, OSError):
            pass
        port = split_address(self.bind_address)[1]
        raise JoinError(
            f"process 0 cannot listen on port {port} for the job's coordinator, which is in use: {error.strerror}. "
            "Another program, or an earlier job still running, holds it: stop it, or give the job another port "
            "(MESHFIT_COORDINATOR_ADDRESS, or JAX_COORDINATOR_PORT under a detected cluster)."
        ) from error

    def _gather(self, listener: socket.socket) -> None:
        job = self.job
        start = time.monotonic()
        deadline, noticed = start + job.timeout, False
        while len(self.joined) < job.num_processes:
            now = time.monotonic()
            if now >= deadline:
                self._fail(
                    JoinTimeoutError(
                        timeout_message(job.num_processes, job.address, job.timeout, len(self.joined), self._missing())
                    )
                )
            if not noticed and now - start >= job.notice_after:
                _say(waiting_message(job.num_processes, job.address, len(self.joined), job.timeout))
                noticed = True
            wait = min(_RETRY_SECONDS, deadline - now)
            if self.accept_at is not None:
                wait = max(0.0, min(wait, self.accept_at - now))
            for key, _ in self.selector.select(wait):
                if key.fileobj is listener:
                    self._accept(listener)
                else:
                    self._read(key.data)
            now = time.monotonic()
            self._drop_silent(now)
            if self.accept_at is not None and now >= self.accept_at:
                self.accept_at = None
                self.selector.register(listener, selectors.EVENT_READ)

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except OSError as error:
            if error.errno in (errno.EMFILE, errno.ENFILE):
                self._out_of_descriptors(listener, error)
            return
        self.accept_pause = 0.0
        sock.settimeout(_GOODBYE_SECONDS)  # sends never wait long on a peer that does not read
        conn = _Conn(sock, time.monotonic())
        self.conns.append(conn)
        self.selector.register(sock, selectors.EVENT_READ, conn)

    def _out_of_descriptors(self, listener: socket.socket, error: OSError) -> None:
        """No descriptor for a new connection: close the oldest stranger that said nothing for a while to make
        room (a process of the job says hello at once, and retries if closed first), else stop accepting for a
        pause that doubles up to `_MAX_ACCEPT_PAUSE`. Says so once per shortage (one that ended over
        `_HELLO_SECONDS` before is another), with the limit."""
        now = time.monotonic()
        if self.short_since is None or now - self.short_since > _HELLO_SECONDS:
            _say(out_of_descriptors_message(self.job.address, error))
        self.short_since = now
        self.accept_pause = min(2 * self.accept_pause or _FIRST_ACCEPT_PAUSE, _MAX_ACCEPT_PAUSE)
        strangers = [c for c in self.conns if c.process_id is None and now - c.opened > _RETRY_SECONDS]
        if strangers:
            self._close(min(strangers, key=lambda c: c.opened))
            return
        self.selector.unregister(listener)
        self.accept_at = now + self.accept_pause

    def _receive(self, conn: _Conn) -> bytes:
        """What `conn` sent; b"" once it ended or failed, and then it is closed."""
        try:
            data = conn.sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            self._close(conn)
        return data

    def _read(self, conn: _Conn) -> None:
        data = self._receive(conn)
        if not data:
            if conn.process_id is not None:
                del self.joined[conn.process_id]
                self._broadcast({"joined": len(self.joined), "missing": self._missing()})
            return
        conn.buffer += data
        while b"\n" in conn.buffer and conn in self.conns:
            line, _, rest = bytes(conn.buffer).partition(b"\n")
            conn.buffer = bytearray(rest)
            self._hear(conn, line)
        if len(conn.buffer) > _MAX_LINE:
            self._close(conn)

    def _hear(self, conn: _Conn, line: bytes) -> None:
        """A process's hello: checked against the job, then counted."""
        if conn.process_id is not None:
            return
        hello = _parse(line)
        if not hello or hello.get("protocol") != PROTOCOL:
            self._close(conn)  # not one of ours (a port scanner, a JAX client of another job)
            return
        process_id, count = hello.get("id"), hello.get("processes")
        if not isinstance(process_id, int) or not isinstance(count, int):
            self._close(conn)
            return
        who = f"process {process_id} (pid {hello.get('pid')} on {hello.get('host')})"
        n = self.job.num_processes
        if count != n:
            self._fail(
                ValueError(
                    f"the processes were given different process counts: {who} was told the job has {count} "
                    f"processes, process 0 that it has {n}. Give every process the same count "
                    "(MESHFIT_NUM_PROCESSES, SLURM_NTASKS, the launcher's)."
                )
            )
        if process_id in self.joined:
            self._fail(
                ValueError(
                    f"two processes were given process id {process_id}: {self.joined[process_id]} and {who}. "
                    f"Each process of a job needs its own id, from 0 to {n - 1}: check the ids the launcher gives "
                    "(MESHFIT_PROCESS_ID, SLURM_PROCID, OMPI_COMM_WORLD_RANK, JOB_COMPLETION_INDEX)."
                )
            )
        if not 0 < process_id < n:
            self._fail(
                ValueError(f"{who} has an id out of range: ids run from 0 to {n - 1} in a job of {n} processes.")
            )
        conn.process_id = process_id
        self.joined[process_id] = who
        self._broadcast({"joined": len(self.joined), "missing": self._missing()})

    def _missing(self) -> list[int]:
        return [i for i in range(self.job.num_processes) if i not in self.joined]

    def _drop_silent(self, now: float) -> None:
        for conn in [c for c in self.conns if c.process_id is None and now - c.opened > _HELLO_SECONDS]:
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn in self.conns:
            self.conns.remove(conn)
            self.selector.unregister(conn.sock)
            conn.sock.close()

    def _broadcast(self, message: dict) -> None:
        for conn in self.conns:
            if conn.process_id is not None:
                _send(conn.sock, message)

    def _fail(self, error: Exception) -> None:
        """Tells every connected process why the job cannot form, then raises it here too."""
        kind = next(k for k, cls in _ERROR_KINDS.items() if isinstance(error, cls))
        for conn in self.conns:
            _send(conn.sock, {"error": str(error), "kind": kind})
        raise error

    def _go(self) -> None:
        """All are there: tells them, and waits briefly for them to close first, so that the port is free."""
        self._broadcast({"go": True, "joined": len(self.joined)})
        end = time.monotonic() + _GOODBYE_SECONDS
        while any(c.process_id is not None for c in self.conns) and time.monotonic() < end:
            for key, _ in self.selector.select(max(0.0, end - time.monotonic())):
                if key.data is not None:
                    self._receive(key.data)  # a goodbye: the process closed its end


# -- every other process -----------------------------------------------------------------------------


class _Member:
    """A process other than 0: connects to process 0 (retrying until it answers) and waits for its word."""

    def __init__(self, job: _Job, verdict_seconds: float = _VERDICT_SECONDS):
        self.job = job
        self.verdict_seconds = verdict_seconds
        self.joined: int | None = None
        self.missing: list[int] = []

    def run(self) -> None:
        job = self.job
        host, port = split_address(job.address)
        start = time.monotonic()
        deadline, noticed, last_error = start + job.timeout, False, None
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise JoinTimeoutError(
                    no_coordinator_message(job.num_processes, job.process_id, job.address, job.timeout, last_error)
                )
            if not noticed and now - start >= job.notice_after:
                _say(
                    f"waiting for process 0, the coordinator, at {job.address} "
                    f"({job.num_processes} processes expected, timeout {job.timeout:g} s)"
                )
                noticed = True
            try:
                sock = socket.create_connection((host, port), timeout=min(2.0, deadline - now))
            except OSError as error:
                last_error = error
                time.sleep(max(0.0, min(_RETRY_SECONDS, deadline - time.monotonic())))
                continue
            with sock:
                if self._talk(sock, deadline):
                    return
            time.sleep(max(0.0, min(_RETRY_SECONDS, deadline - time.monotonic())))

    def _talk(self, sock: socket.socket, deadline: float) -> bool:
        """Says hello and reads process 0's word until "go" (True); False if it closed without a word."""
        job = self.job
        try:
            sock.sendall(job.hello())
        except OSError:
            return False
        buffer = b""
        while True:
            remaining = deadline + self.verdict_seconds - time.monotonic()
            if remaining <= 0:
                raise JoinTimeoutError(
                    timeout_message(job.num_processes, job.address, job.timeout, self.joined, self.missing)
                )
            sock.settimeout(min(remaining, 1.0))
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                if self.joined is None:
                    return False  # closed before a word: retry (a listener on its way out)
                raise JoinError(
                    f"process 0, the coordinator at {job.address}, closed the connection before the job assembled "
                    f"({self.joined} of {job.num_processes} processes had joined): it failed or was stopped; "
                    "see its output."
                )
            buffer += data
            if buffer and not buffer.startswith(b"{"):  # a JSON line: anything else is not process 0's handshake
                raise JoinError(self._not_ours())
            while b"\n" in buffer:
                line, _, buffer = buffer.partition(b"\n")
                if self._hear(_parse(line)):
                    return True

    def _hear(self, message: dict | None) -> bool:
        if message is None:
            raise JoinError(self._not_ours())
        if "error" in message:
            raise _ERROR_KINDS.get(message.get("kind"), JoinError)(message["error"])
        self.joined = message.get("joined", self.joined)
        self.missing = message.get("missing", self.missing)
        return bool(message.get("go"))

    def _not_ours(self) -> str:
        return (
            f"something other than meshfit's start-up answers at {self.job.address}: process 0 already started "
            f"a job without this process (two processes given id {self.job.process_id}, or more processes started "
            f"than the {self.job.num_processes} expected), or another program holds the port."
        )


def _parse(line: bytes) -> dict | None:
    try:
        message = json.loads(line.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return message if isinstance(message, dict) else None
