"""Subprocesses for tests, with hard deadlines.

Every wait here is bounded: output is read by threads, and a job that runs
past its time is killed with its whole process group (a launcher and the
processes it started), then reported with the end of its output. A hung job
fails its test instead of stalling the suite.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time

LAUNCH = [sys.executable, "-m", "meshfit.cli", "launch"]


class Job:
    """A running command in its own process group; stdout and stderr are collected as they come.

    Python's fault handler is on in the job (`PYTHONFAULTHANDLER`): a job that does not finish in time is sent
    SIGABRT first, so the failure shows where each of its threads was stuck.
    """

    def __init__(self, argv: list[str], timeout: float, env: dict | None = None):
        self.argv = argv
        self.deadline = time.monotonic() + timeout
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env={**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"},
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._new_line = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._new_line:
                lines.append(line)
                self._new_line.notify_all()
        stream.close()
        with self._new_line:
            self._new_line.notify_all()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, pattern: str, count: int = 1, timeout: float | None = None) -> list[re.Match]:
        """Waits until `count` stdout lines match `pattern` (from their start) and returns their matches.

        Fails the test if the job ends or the deadline passes first.
        """
        end = min(self.deadline, time.monotonic() + timeout) if timeout else self.deadline
        with self._new_line:
            while True:
                matches = [m for m in map(re.compile(pattern).match, self.out) if m]
                if len(matches) >= count:
                    return matches[:count]
                if self.proc.poll() is not None and not self._readers[0].is_alive():
                    self._fail(f"exited with status {self.proc.returncode} before printing {pattern!r}")
                if time.monotonic() > end:
                    self._fail(f"printed no line matching {pattern!r} in time")
                self._new_line.wait(timeout=0.2)

    def finish(self, timeout: float | None = None) -> int:
        """Waits for the job to end and returns its exit status; kills it and fails the test past the deadline."""
        end = min(self.deadline, time.monotonic() + timeout) if timeout else self.deadline
        try:
            self.proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._fail("did not finish in time")
        for reader in self._readers:
            reader.join(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILLs the job's whole process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def children(self) -> list[int]:
        """Pids of the processes the job started itself (a launcher's ranks, also those its fork server forked)."""
        return _children(self.proc.pid)

    def _signal_state(self) -> str:
        """Each thread's pending, blocked, ignored and caught signals (hex masks from /proc), for a stuck job."""
        lines = []
        for task in sorted(glob.glob(f"/proc/{self.proc.pid}/task/*/status")):
            try:
                with open(task) as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            masks = " ".join(f"{k}={fields[k].strip()}" for k in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
            lines.append(f"{fields['Name'].strip()} ({task.split('/')[4]}): {masks}")
        return "\n".join(lines)

    def _fail(self, why: str) -> None:
        state = ""
        if self.proc.poll() is None:  # stuck: its threads' signal state and stacks before it is killed
            state = f"\n--- signals (SIGINT is bit 0x2, SIGTERM 0x4000) ---\n{self._signal_state()}"
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for reader in self._readers:
                reader.join(timeout=2)
        self.kill()
        raise AssertionError(
            f"{' '.join(self.argv)}: {why}.\n--- stdout (end) ---\n{self.stdout[-8000:]}"
            f"\n--- stderr (end) ---\n{self.stderr[-6000:]}{state}"
        )

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.kill()


def _children(pid: int, through_fork_server: bool = True) -> list[int]:
    """The children of `pid`, `meshfit launch`'s fork server replaced by its own (the ranks it forked)."""
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    pids = []
    for child in (int(p) for p in found.stdout.split()):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                server = through_fork_server and b"meshfit.launch.fork_server_process" in f.read()
        except OSError:
            server = False
        pids += _children(child, through_fork_server=False) if server else [child]
    return pids


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie waiting for its parent is gone too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def run(argv: list[str], timeout: float, env: dict | None = None) -> Job:
    """Runs a command to the end, bounded by `timeout`; like `subprocess.run`, with .returncode, .stdout, .stderr."""
    with Job(argv, timeout, env) as job:
        job.finish()
    return job


#: What tests/conftest.py sets so that the run's processes share one compilation cache.
SUITE_CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")


def without_suite_cache(env: dict) -> dict:
    """`env` without the run's shared compilation cache (tests/conftest.py): a process as started from a shell."""
    return {k: v for k, v in env.items() if k not in SUITE_CACHE_VARIABLES}
