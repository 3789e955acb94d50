"""Goodput: where a job's wall-clock time went, across the processes of a killed or preempted run."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import stat
import time
import uuid
import warnings

import jax

from meshfit.callbacks.backup_and_restore import BackupAndRestore
from meshfit.callbacks.console import print_msg
from meshfit.checkpointing import safe_files, trusted_dirs
from meshfit.training.callback_protocol import Callback
from meshfit.training.fit_timer import PHASES

#: The buckets of a ledger, in the order a table prints them. The phases of a fit are
#: `meshfit.training.fit_timer.PHASES`; "startup" is a process's time before its first fit, "idle" the time
#: between fits of one process, "lost" the time of steps trained after the last backup before a
#: crash (trained again), "down" the time between a crashed process's last record and the next
#: process's start.
BUCKETS = ("startup", *PHASES, "idle", "lost", "down")

#: A record is a few hundred bytes; more is not one.
_RECORD_BYTES = 1 << 16
#: The name of process 0's record inside the backup directory (process i: `.goodput.<i>.json`).
RECORD_NAME = ".goodput.json"
_IMPORTED_AT = time.time()
_start_times: dict[int, float] = {}  # by pid: read once per process


def process_start_time() -> float:
    """The wall-clock time (`time.time()`) at which this process started, as the OS recorded it (see
    `_read_process_start_time`); read once per process, so every reading agrees."""
    pid = os.getpid()
    if pid not in _start_times:
        _start_times[pid] = _read_process_start_time()
    return _start_times[pid]


def _read_process_start_time() -> float:
    """The wall-clock time at which this process started, from the OS.

    On Linux: `/proc/self/stat`'s `starttime` (clock ticks after boot) read
    against `CLOCK_BOOTTIME`, to one tick (10 ms). Elsewhere psutil's
    `create_time()` where psutil is installed (to 1 s on Linux, as it reads
    the boot time in whole seconds), else the time this module was imported.
    """
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        ticks = int(after_name[19])  # field 22 of the line; field 3 is after_name[0]
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - not installed, or no such information on this platform
        return _IMPORTED_AT


def _this_process() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{process_start_time():.2f}"


@dataclasses.dataclass(frozen=True)
class Ledger:
    """A job's wall-clock time in seconds per bucket (`BUCKETS`); the buckets add up to `wall`.

    `print(ledger)` prints it as a table. `goodput` is the share of the time
    spent in training steps.
    """

    startup: float = 0.0
    compile: float = 0.0
    steps: float = 0.0
    input: float = 0.0
    checkpoint: float = 0.0
    evaluate: float = 0.0
    callbacks: float = 0.0
    other: float = 0.0
    idle: float = 0.0
    lost: float = 0.0
    down: float = 0.0
    #: steps trained after the last backup before a crash, trained again
    lost_steps: int = 0
    #: optimizer steps taken when the ledger was last counted
    step: int = 0
    #: wall-clock time (`time.time()`) the job's first process started, and the last moment counted
    started_at: float = 0.0
    ended_at: float = 0.0
    #: how many processes (one after the other) the ledger covers
    processes: int = 1
    #: an id shared by the processes of one job (it travels in the job's backups)
    job: str = ""
    #: the process that counted last (host, pid and start time)
    process: str = ""

    @property
    def wall(self) -> float:
        """The sum of the buckets: the job's wall-clock time from its first process's start to `ended_at`."""
        return sum(self.seconds().values())

    @property
    def goodput(self) -> float:
        """Steps time / wall-clock time."""
        wall = self.wall
        return self.steps / wall if wall > 0 else 0.0

    def seconds(self) -> dict[str, float]:
        """Seconds per bucket, in the order of `BUCKETS`."""
        return {name: getattr(self, name) for name in BUCKETS}

    def plus(self, **seconds: float) -> Ledger:
        """This ledger with `seconds` added to the buckets named."""
        return dataclasses.replace(self, **{name: getattr(self, name) + value for name, value in seconds.items()})

    def logs(self) -> dict[str, float]:
        """`goodput`, `time_lost` and `time_down` (seconds): what goes into the epoch logs. Three keys, not
        one per bucket, so that a progress bar's line stays readable; every bucket is in the ledger."""
        return {"goodput": self.goodput, "time_lost": self.lost, "time_down": self.down}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Ledger:
        """The ledger `to_dict` wrote; every field is checked (`ValueError` naming the first wrong one) and
        unknown keys are ignored, as a ledger is read back from files."""
        if not isinstance(values, dict):
            raise ValueError(f"Expected a ledger as a JSON object. Received: {type(values).__name__}.")
        found = {}
        for field in dataclasses.fields(cls):
            if field.name not in values:
                continue
            value = values[field.name]
            if field.type == "str":
                ok = isinstance(value, str) and len(value) <= 1024
            elif field.type == "int":
                ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
            else:  # seconds, or a time.time(): finite and >= 0
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                ok = ok and value >= 0
                value = float(value) if ok else value
            if not ok:
                raise ValueError(
                    f"Expected the ledger's {field.name!r} to be {_EXPECTED[field.type]}. Received: {value!r:.80}."
                )
            found[field.name] = value
        return cls(**found)

    def __str__(self) -> str:
        wall = self.wall
        plural = "es" if self.processes != 1 else ""
        lines = [
            f"Goodput {self.goodput:.1%}: {wall:.2f} s of wall-clock time over {self.processes} process{plural}, "
            f"{self.step} steps",
            f"{'bucket':<12}{'seconds':>10}{'share':>9}",
        ]
        for name, value in self.seconds().items():
            note = f"  ({self.lost_steps} steps trained again)" if name == "lost" and self.lost_steps else ""
            lines.append(f"{name:<12}{value:>10.2f}{value / wall if wall else 0:>9.1%}{note}")
        lines.append(f"{'total':<12}{wall:>10.2f}{1 if wall else 0:>9.1%}")
        return "\n".join(lines)


_EXPECTED = {"str": "a string", "int": "an integer >= 0", "float": "a finite number >= 0"}


def _with_record(saved: Ledger, last: Ledger | None) -> Ledger:
    """The ledger of a backup (`saved`) continued by the last record of the process that wrote it.

    The time that process spent after the backup, up to its record, is lost
    work if it trained steps there (the resumed run trains them again);
    without such a record the time after the backup counts as down time.
    """
    if last is None or last.job != saved.job or last.ended_at < saved.ended_at or last.step < saved.step:
        return saved
    if last.step == saved.step:
        return last  # nothing trained after the backup: the record's buckets hold
    return dataclasses.replace(
        saved.plus(lost=last.wall - saved.wall),
        lost_steps=saved.lost_steps + last.step - saved.step,
        ended_at=last.ended_at,
        process=last.process,
    )


class Goodput(Callback):
    """Splits the job's wall-clock time into buckets that add up to it, across killed and resumed runs.

    The buckets (`BUCKETS`): start-up (from the process's start, read from the
    OS, to its first fit: imports, building the model, reading data), then
    each fit's compilation (JAX's own compile events), steps (dispatching them
    and waiting for the devices), waiting for input, checkpoint blocking (the
    time a save or a restore holds the loop), evaluation, the callbacks' own
    time and the loop's other host work (`meshfit.training.fit_timer.FitTimer`), the
    time between fits of one process, and across a crash: lost work (the
    time of the steps trained after the last backup, which the resumed run
    trains again) and down time (from the crashed process's last record to
    the new process's start).

    The ledger travels in the backup (`BackupAndRestore`), so a resumed run's
    ledger covers every process of the job. To know how far a killed process
    got past its last backup, Goodput keeps a record of its running ledger
    inside the backup directory (`<backup_dir>/.goodput.json`, made 0700 and
    the user's alone: `meshfit.checkpointing.trusted_dirs`), rewritten atomically at most
    every `record_every` seconds and at each epoch's end; steps after the last
    record count as down time. Without a `BackupAndRestore` nothing is
    written and no batch hook runs. The record is read back as data: a record
    that is not a regular file of the user's (a symlink, a FIFO, a directory,
    another user's file) or whose fields are not numbers and strings in range
    is ignored with a warning naming it, and one that cannot be written stops
    the recording with a warning; neither stops the fit.

    At the end of each epoch and of `fit` it adds `goodput` (steps time /
    wall-clock time), `time_lost` and `time_down` (seconds) to the logs,
    which History, CSVLogger and TensorBoard then record (meshfit runs it
    before the others); at the end of `fit` process 0 prints the whole table.
    `Goodput().ledger` is the ledger (a `Ledger`, every bucket); `print` it
    for the table.

    Args:
        record_every: seconds between records of the running ledger (0: after every batch).
        record_path: where the record goes; default: inside the fit's `BackupAndRestore` directory. Its
            directory is made 0700 or must be yours alone, as a backup directory (refused before any step).
        verbose: 1 prints the table at the end of `fit` (on process 0); 0 prints nothing.
    """

    adds_epoch_logs = True

    def __init__(self, record_every: float = 10.0, record_path: str | os.PathLike | None = None, *, verbose: int = 1):
        super().__init__()
        if verbose not in (0, 1):
            raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}.")
        if isinstance(record_every, bool) or not isinstance(record_every, (int, float)) or record_every < 0:
            raise ValueError(
                f"`record_every` must be a number of seconds >= 0. Received: record_every={record_every!r}."
            )
        if record_path is not None and not isinstance(record_path, (str, os.PathLike)):
            raise ValueError(
                f"`record_path` must be a file path or None. Received: record_path={record_path!r} "
                f"of type {type(record_path).__name__}."
            )
        self.record_every = float(record_every)
        self.record_path = None if record_path is None else os.fspath(record_path)
        self.verbose = verbose
        self._base: Ledger | None = None  # the job's ledger up to the running fit's start
        self._final: Ledger | None = None  # the ledger when the last fit closed
        self._running = False
        self._path: str | None = None  # where this fit keeps its record (None: no record)
        self._next_record = 0.0

    @property
    def ledger(self) -> Ledger | None:
        """The job's ledger up to now (while `fit` runs) or to the end of the last fit; None before any fit."""
        if not self._running:
            return self._final
        context = self.context
        now = time.time()
        return dataclasses.replace(self._base.plus(**context.timer.totals()), ended_at=now, step=context.step)

    # -- hooks ---------------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        began = self.context.timer.started_at
        if self._final is None:
            start = process_start_time()
            self._base = Ledger(
                startup=began - start,
                started_at=start,
                ended_at=began,
                job=uuid.uuid4().hex,
                process=_this_process(),
                step=self.context.step,
            )
        else:
            self._base = dataclasses.replace(self._final.plus(idle=began - self._final.ended_at), ended_at=began)
        self._running = True
        self._path = self._record_path()
        self._warned = False
        vars(self).pop("on_train_batch_end", None)
        if self._path is not None:  # batch hooks only where a record is kept (they make the loop go step by step)
            self.on_train_batch_end = self._record_when_due
            self._next_record = time.monotonic() + self.record_every

    def state_dict(self):
        return self.ledger.to_dict() if self._running else {}

    def load_state_dict(self, state):
        """Continues the ledger of the backup being restored: what the crashed run did after it is lost
        work (as far as its last record tells), and the time until this process started is down time."""
        if not state:
            return
        try:
            saved = Ledger.from_dict(state)
        except ValueError as error:  # not a ledger meshfit wrote: this fit's ledger starts afresh
            self._warn(f"ignored the ledger in the backup being restored: {error}")
            return
        merged = _with_record(saved, self._read_record())
        began = self.context.timer.started_at
        if merged.process == _this_process():  # a fit of this process failed and this one resumes it
            self._base = dataclasses.replace(merged.plus(idle=began - merged.ended_at), ended_at=began)
            return
        start = process_start_time()
        self._base = dataclasses.replace(
            merged.plus(down=max(0.0, start - merged.ended_at), startup=began - start),
            ended_at=began,
            processes=merged.processes + 1,
            process=_this_process(),
        )

    def _record_when_due(self, batch, logs=None):
        now = time.monotonic()
        if now >= self._next_record:
            self._write_record()
            self._next_record = now + self.record_every

    def on_epoch_end(self, epoch, logs=None):
        self._write_record()
        if logs is not None:
            logs.update(self.ledger.logs())

    def on_preemption(self, epoch, batch):
        self._write_record()

    def on_train_end(self, logs=None):
        ledger = self.ledger
        if logs is not None:
            logs.update(ledger.logs())
        if self.verbose:
            print_msg(str(ledger))
        if self._path is not None and not os.path.isdir(self._path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._path)  # the fit finished: nothing is lost (a link: the link alone goes)
        self._path = None

    def close(self) -> None:
        """Stops the ledger at the end of `fit` (also one that failed: its record is kept)."""
        if not self._running:
            return
        self._write_record()
        self._final = self.ledger
        self._running = False
        vars(self).pop("on_train_batch_end", None)

    # -- the record of the running ledger --------------------------------------------------------

    def _record_path(self) -> str | None:
        index = jax.process_index()
        if self.record_path is not None:
            trusted_dirs.ensure(os.path.dirname(os.path.abspath(self.record_path)), "Goodput record directory")
            return self.record_path
        backups = [cb for cb in self.context.callbacks if isinstance(cb, BackupAndRestore)]
        if not backups:
            return None
        name = RECORD_NAME if index == 0 else f".goodput.{index}.json"
        return os.path.join(os.path.abspath(backups[0].backup_dir), name)

    def _warn(self, what: str) -> None:
        """One warning a fit about its record; the fit goes on."""
        if not self._warned:
            self._warned = True
            warnings.warn(f"Goodput: {what}", stacklevel=3)

    def _write_record(self) -> None:
        """Writes the running ledger atomically (a new file renamed over the old one, never through a planted
        link: `safe_files`; no fsync: a killed process's writes stay with the OS, and a machine that
        lost power loses the whole job's time anyway). A record that cannot be written (something else in its
        place, a full disk) stops the recording with a warning; a backup directory already deleted at the
        fit's end (by process 0, while another process records) ends it silently."""
        if self._path is None:
            return
        partial = f"{self._path}.{os.getpid()}.partial"
        try:
            safe_files.write_new(partial, json.dumps(self.ledger.to_dict()).encode())
            try:
                safe_files.replace(partial, self._path)
            except OSError:
                os.unlink(partial)
                raise
        except OSError as error:
            if os.path.isdir(os.path.dirname(self._path)):
                self._warn(f"not recording the ledger in {self._path!r} any more: {error}".splitlines()[0])
            self._path = None
            vars(self).pop("on_train_batch_end", None)

    def _read_record(self) -> Ledger | None:
        """The record, read as data; None (with one warning naming it) when it is not a regular file of the
        user's or its fields are not what a ledger holds: the time after the backup then counts as down time."""
        if self._path is None:
            return None
        try:
            info = os.lstat(self._path)
        except FileNotFoundError:
            return None
        except OSError as error:
            self._warn(f"ignored the record {self._path!r}: {error}")
            return None
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
            kind = "a regular file" if stat.S_ISREG(info.st_mode) else "not a regular file"
            owner = trusted_dirs.user_name(info.st_uid)
            self._warn(
                f"ignored the record {self._path!r}: expected a regular file of yours, found {kind} of uid "
                f"{owner} with {info.st_nlink} link(s) (mode {stat.filemode(info.st_mode)}); not read."
            )
            return None
        try:
            return Ledger.from_dict(json.loads(safe_files.read_regular(self._path, _RECORD_BYTES)))
        except (OSError, ValueError, TypeError, RecursionError) as error:
            self._warn(f"ignored the record {self._path!r}, not a ledger: {str(error)[:200]}")
            return None
