"""One writer per checkpoint directory: a lock file naming its holder.

Two jobs writing backups into one directory would delete and rename each
other's files. The writer holds `.meshfit.lock` in the directory: an advisory
`flock` on it (the kernel drops it when the process dies, even by SIGKILL, so
a lock left by a dead process is stale and taken over) and, inside, the
holder's host, pid, process start time and lock time, so a refusal says who
holds it. On file systems without `flock`, the recorded holder is checked
instead: a lock whose process no longer runs on this host is stale. The lock
file is opened without following a symlink planted at its name
(`meshfit.checkpointing.safe_files`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from meshfit.checkpointing import safe_files

LOCK_NAME = ".meshfit.lock"


class DirectoryLocked(RuntimeError):
    """Another live process writes into this directory."""


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart), if known."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the recorded holder may still run (a holder on another host is assumed to)."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    start = holder.get("process_start")
    return start is None or start == _process_start(pid)


def describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("time", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')!r} (since {since})"


class DirectoryLock:
    """Exclusive write access to `directory` while held (`acquire` / `release`, or `with`)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = None

    def _read(self, fd: int) -> dict:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            return json.loads(os.read(fd, 4096).decode() or "{}")
        except (OSError, ValueError):
            return {}

    def _refuse(self, holder: dict):
        return DirectoryLocked(
            f"{self.directory!r} is being written by another process: {describe(holder)}. "
            "Two jobs must not write into one checkpoint directory: give this one its own directory, or stop "
            f"the other first. If no such process runs any more (on another host), delete {self.path}."
        )

    def acquire(self) -> DirectoryLock:
        """Takes the lock or raises `DirectoryLocked` naming its holder; takes over a stale one."""
        while True:
            # Held read-only: an open writable file would keep its file system from being remounted.
            fd = safe_files.open_regular(self.path, os.O_RDONLY | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._read(fd)
                os.close(fd)
                raise self._refuse(holder) from None
            except OSError as error:
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                holder = self._read(fd)  # no flock here: judge by the recorded holder
                if holder and _alive(holder) and holder.get("pid") != os.getpid():
                    os.close(fd)
                    raise self._refuse(holder) from None
            try:  # the file may have been removed by its releasing holder since we opened it
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": _process_start(os.getpid()),
            "time": time.time(),
        }
        try:
            self._record(fd, json.dumps(me).encode())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _record(self, locked: int, holder: bytes) -> None:
        """Writes the holder into the locked file itself (the same inode as `locked`, never through a link)."""
        fd = safe_files.open_regular(self.path, os.O_WRONLY)
        try:
            if os.fstat(fd).st_ino != os.fstat(locked).st_ino:
                raise safe_files.PlantedFile(
                    f"Expected {self.path} to stay the file this process locked. Received: another file put in "
                    "its place meanwhile. Nothing was written; use a directory that only you can write to."
                )
            os.ftruncate(fd, 0)
            os.write(fd, holder)
            os.fsync(fd)
        finally:
            os.close(fd)

    def release(self) -> None:
        """Removes the lock file and drops the lock (nothing if not held)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
