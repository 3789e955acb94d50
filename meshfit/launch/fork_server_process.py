"""The launch's fork server: one process with the libraries imported, from which every rank is forked.

Every rank of every start spends its first seconds starting Python and
importing JAX, Flax, Optax, Orbax and meshfit, the same for each; `meshfit
launch` (`meshfit.launch.fork_server`) therefore starts this program once,
with the environment its ranks share. It imports those libraries without
turning a JAX backend on (`jax.distributed` must come first in each rank)
and waits on its control socket (a Unix `SOCK_SEQPACKET` pair, inherited
from the launcher: no other process can reach it). For each start of a rank
the launcher sends one message: the rank's environment and command (a
script, or `-m module`) with the write end of the pipe its output goes to;
the server forks, the child takes the environment, the output and the
command as its own and runs the script as `python script.py` would
(`__main__`, `sys.argv`, the script's directory first on `sys.path`), and the
server answers with the child's pid. It reaps its children and tells the
launcher each exit status, as `subprocess.Popen.returncode` would say it.

A restart is then a `fork`: milliseconds, where a new interpreter takes
seconds of CPU (on the 2-core machine about 3.5 s a rank, all ranks at once).
What the job's script imports beyond those libraries (scikit-learn, its data
readers) rank 0 lists at its first step (`start_phases.ENV_IMPORTS_REPORT`), and the
server imports it while the job trains, so a restart skips those too.

Forking is safe only from a process whose other threads cannot hold what the
child needs: the server forks only while no import started a Python thread
and no JAX backend is on (its threads and devices cannot be forked);
otherwise it refuses, and the launcher starts that rank as a new process.
Native threads that libraries start when imported (OpenBLAS's, jemalloc's)
are the libraries' to make fork-safe, as they do (they stop or lock them
around a fork), as Python's own `multiprocessing` fork server takes them; a
library that does not is the reason for `meshfit launch --no-fork-server`. It ignores
SIGINT, SIGTERM and SIGHUP (a Ctrl-C reaches the whole process group; the
ranks take it themselves, and the server must outlive them to report their
exits); it dies with the launcher, and its children die with it.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time

#: What a rank's start imports that the server imports once for all of them.
PRELOADED = ("numpy", "jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint", "meshfit.model", "meshfit.callbacks")
#: The largest control message (a rank's environment and command).
MAX_MESSAGE = 1 << 20
#: How often the server looks for rank 0's list of imports while it waits.
LOOK_FOR_IMPORTS_SECONDS = 0.25


class _Server:
    """The loop: requests in, forks, exits out."""

    def __init__(self, control: socket.socket, imports_report: str | None):
        self.control = control
        self.imports_report = imports_report
        self.unsafe = ""  # why forking is no longer safe ("" while it is)
        self.children: set[int] = set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through the wakeup fd

    def send(self, message: dict) -> None:
        self.control.send(json.dumps(message).encode())

    def serve(self) -> None:
        self.send({"ready": True, "pid": os.getpid()})
        while True:
            ready, _, _ = select.select([self.control, self._wake_r], [], [], LOOK_FOR_IMPORTS_SECONDS)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            self._reap()
            if self.control in ready:
                data, fds, _, _ = socket.recv_fds(self.control, MAX_MESSAGE, 1)
                if not data:  # the launcher is done (or gone)
                    return
                self._handle(json.loads(data), fds)
            self._look_for_imports()

    def _handle(self, request: dict, fds: list[int]) -> None:
        why = self.unsafe or self._fork_hazard()
        if why or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.send({"id": request["id"], "refused": why or "no output pipe came with the request"})
            return
        pid = os.fork()
        if pid == 0:
            _become_rank(request, fds[0], self.control, (self._wake_r, self._wake_w))  # never returns
        os.close(fds[0])
        self.children.add(pid)
        self.send({"id": request["id"], "pid": pid})

    def _fork_hazard(self) -> str:
        from meshfit.core import compat

        if threading.active_count() > 1:
            return f"{threading.active_count()} Python threads run in the fork server"
        if compat.backends_are_initialized():
            return "an import turned a JAX backend on"
        return ""

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.send({"exited": pid, "status": os.waitstatus_to_exitcode(status)})

    def _look_for_imports(self) -> None:
        """Imports what rank 0 listed (once it did), so that restarts find it imported."""
        path = self.imports_report
        if not path or self.unsafe or not os.path.exists(path):
            return
        try:
            with open(path) as f:
                names = json.load(f)
            os.unlink(path)
        except (OSError, ValueError):
            return
        for name in names if isinstance(names, list) else ():
            if isinstance(name, str) and name not in sys.modules and name.replace(".", "").isidentifier():
                try:
                    importlib.import_module(name)
                except BaseException:  # noqa: BLE001 - a module that fails here is imported by the rank itself
                    pass
        self.unsafe = self._fork_hazard()


def _become_rank(request: dict, output: int, control: socket.socket, wake: tuple[int, int]) -> None:
    """In the forked child: the rank's signals, parent death, output, environment and command; runs it."""
    server = os.getppid()
    signal.set_wakeup_fd(-1)
    for fd in (*wake, control.fileno()):
        os.close(fd)
    control.detach()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    _die_with(server)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # a fork shares the server's global random state; a new process would not
        sys.modules["numpy"].random.seed()
    from meshfit.runtime import exit_report, start_phases

    start_phases.restart_clock(time.time(), "it was forked from the launch's fork server")
    exit_report.install()  # the start's report file is known only now
    argv = list(request["argv"])
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)  # the interpreter's normal end (atexit, flushed streams), never back into the server's loop


def _die_with(parent: int) -> None:
    """Asks the kernel to SIGKILL this process when the fork server ends (Linux); ends now if it has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    for name in PRELOADED:
        importlib.import_module(name)
    server = _Server(control, sys.argv[2] if len(sys.argv) > 2 else None)
    server.unsafe = server._fork_hazard()
    if server.unsafe:
        server.send({"unusable": server.unsafe})
        return
    server.serve()
    os._exit(0)  # nothing to flush or finalise; the interpreter's own end would take a second or more


if __name__ == "__main__":
    main()
