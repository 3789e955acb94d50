"""The launcher's side of the fork server: ranks forked from one process that imported the libraries once.

`meshfit launch` starts one fork server (`meshfit.launch.fork_server_process`)
for a launch on this machine, with the environment its ranks share, and
starts each rank of each start by asking it for a fork (`ForkServer.start`),
which returns a `ForkedProcess`: what the launcher needs of a
`subprocess.Popen` (pid, output, poll, wait, signals). The first start then
imports JAX, Flax, Optax, Orbax and meshfit once for all its ranks instead
of once for each, and a restart costs a fork instead of a new interpreter
(about 3.5 CPU-seconds a rank on the 2-core machine, all ranks at once); the
server is idle between starts, unlike a process started ahead per rank.

A rank is forked only when its environment differs from the server's in what
is read after the imports alone (`PER_START`: meshfit's variables, JAX's
coordinator, each rank's devices); otherwise, when the server refused (a
thread or a JAX backend an import started), or when it is gone, the launcher
starts the rank as a new process, as without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping

from meshfit.launch.fork_server_process import MAX_MESSAGE
from meshfit.runtime.start_phases import ENV_IMPORTS_REPORT

#: What a rank's environment may differ in from the server's: read only after the imports, when the rank
#: joins the job (meshfit's variables, JAX's coordinator) or first creates its devices.
PER_START = ("MESHFIT_", "JAX_COORDINATOR_", "CUDA_VISIBLE_DEVICES", "XLA_FLAGS")
#: How long a start waits for the server's answer to one fork.
ANSWER_SECONDS = 30.0


def forkable(command: list[str]) -> bool:
    """Whether the server can run `command` (a rank's argv after the interpreter): a script or `-m module`."""
    if not command:
        return False
    if command[0] == "-m":
        return len(command) > 1
    return not command[0].startswith("-")


class ForkedProcess:
    """A rank forked by the server: the part of `subprocess.Popen`'s interface the launcher uses.

    Its exit status comes from the server, which reaps it; signals go through a pidfd opened when it was
    forked, so a pid the kernel reuses after it ended is never signalled.
    """

    def __init__(self, pid: int, stdout, ended: Callable[[ForkedProcess], None]):
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._ended = threading.Event()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):  # already ended (its status is on its way), or no pidfd here
            self._pidfd = None
        ended(self)

    def _exit(self, status: int) -> None:
        self.returncode = status
        self._ended.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pidfd = self._pidfd
        if self.returncode is None and pidfd is not None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One launch's fork server on this machine, started with `env` (the ranks' environment, up to
    `PER_START`) and `preexec_fn` (the launcher's `die_with_parent`); with `learn_imports` (a launch with
    restarts left), it imports what rank 0's script imported, for the restarts."""

    def __init__(self, env: Mapping[str, str], preexec_fn=None, *, learn_imports: bool = False):
        self.env = dict(env)
        self._dir = tempfile.mkdtemp(prefix="meshfit-fork-server-")  # 0700: rank 0's list of imports
        #: Where rank 0 lists what its script imported, for the server to import before a restart (only when
        #: `learn_imports`: a launch without restarts would import it for nothing).
        self.imports_report = os.path.join(self._dir, "imports.json") if learn_imports else ""
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        program = [sys.executable, "-u", "-m", "meshfit.launch.fork_server_process"]
        self.proc = subprocess.Popen(
            [*program, str(theirs.fileno()), *([self.imports_report] if learn_imports else [])],
            env=self.env,
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            preexec_fn=preexec_fn,
        )
        theirs.close()
        self._lock = threading.Condition()
        self._answers: dict[int, dict] = {}
        self._live: dict[int, ForkedProcess] = {}
        self._exited: dict[int, int] = {}  # statuses that came before their process was registered
        self._state = "starting"  # then "ready", or "gone" with `why`
        self.why = ""
        self._next_id = 0
        threading.Thread(target=self._listen, daemon=True, name="meshfit-fork-server").start()

    def _listen(self) -> None:
        while True:
            try:
                data = self._control.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self._lock:
                if not data:  # the server ended: its children ended with it (they die with it)
                    self._state, self.why = "gone", self.why or "the fork server ended"
                    for process in list(self._live.values()):
                        process._exit(-signal.SIGKILL)
                    self._live.clear()
                    self._lock.notify_all()
                    return
                message = json.loads(data)
                if "ready" in message:
                    self._state = "ready"
                elif "unusable" in message:
                    self._state, self.why = "gone", message["unusable"]
                elif "exited" in message:
                    process = self._live.pop(message["exited"], None)
                    if process is None:
                        self._exited[message["exited"]] = message["status"]
                    else:
                        process._exit(message["status"])
                else:
                    self._answers[message["id"]] = message
                self._lock.notify_all()

    def _register(self, process: ForkedProcess) -> None:
        with self._lock:
            status = self._exited.pop(process.pid, None)
            if status is None:
                self._live[process.pid] = process
            else:
                process._exit(status)

    def start(self, env: Mapping[str, str], command: list[str], *, rank: int = 0) -> ForkedProcess | None:
        """Rank `rank`'s process for this start, forked with `env` to run `command`; None when it cannot be
        (the launcher then starts a new process): an environment that differs beyond `PER_START`, a command
        that is not a script or module, a server that refused or is gone."""
        if not forkable(command):
            self.why = f"{command[:1]} is not a script or -m module"
            return None
        differ = sorted(
            k
            for k in set(self.env) ^ set(env) | {k for k in env if env[k] != self.env.get(k)}
            if not k.startswith(PER_START)
        )
        if differ:
            self.why = f"its environment differs from the fork server's in {', '.join(differ)}"
            return None
        with self._lock:
            self._lock.wait_for(lambda: self._state != "starting", timeout=ANSWER_SECONDS * 4)
            if self._state != "ready":
                self.why = self.why or "the fork server is not ready"
                return None
            request_id, self._next_id = self._next_id, self._next_id + 1
        env = dict(env)
        if rank == 0 and self.imports_report:
            env[ENV_IMPORTS_REPORT] = self.imports_report
        read, write = os.pipe()
        try:
            request = json.dumps({"id": request_id, "env": env, "argv": list(command)}).encode()
            socket.send_fds(self._control, [request], [write])
        except OSError:
            os.close(read)
            return None
        finally:
            os.close(write)
        with self._lock:
            self._lock.wait_for(lambda: request_id in self._answers or self._state == "gone", timeout=ANSWER_SECONDS)
            answer = self._answers.pop(request_id, None)
        if answer is None or "pid" not in answer:
            os.close(read)
            if answer is not None:
                self.why = answer.get("refused", "")
            return None
        return ForkedProcess(answer["pid"], os.fdopen(read, "r", errors="replace"), self._register)

    def close(self) -> None:
        """Ends the server (and any rank still forked from it: they die with it)."""
        with contextlib.suppress(OSError):
            self._control.shutdown(socket.SHUT_RDWR)
        self._control.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)
