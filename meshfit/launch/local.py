"""`meshfit launch`: run a multi-process JAX job on this machine.

Starts N copies of a script wired to a coordinator on 127.0.0.1 (a free port),
each with `--devices-per-proc` simulated CPU devices (or a slice of the GPUs),
prefixes every output line with the process's rank, and when any process
fails stops the others and exits with the status of the first to fail. With
`--max-restarts`, a failed job is started again from scratch (use
BackupAndRestore to resume). What each rank runs, its environment and what
its exit means come from the job's layout (`meshfit.runtime.job_layout`): every rank
the script in one `jax.distributed` job by default; a strategy that starts
processes of its own kinds (the parameter server's `--ps S --workers N`)
brings its own layout.

No rank outlives the launcher: SIGTERM, SIGINT or SIGHUP to the launcher (a
scheduler preempting the job) is passed on to every rank as SIGTERM, the
ranks get `--grace-period` seconds to write their preemption backups, what
is left is killed, and the launcher writes how each rank ended and exits
with 128 + the signal (143 for SIGTERM). A rank's own bound
(BackupAndRestore's `preemption_timeout`) ends a rank stuck in a hang; a
rank that cannot run at all (stopped) is killed after the grace period. A
launcher killed outright takes its ranks along: the kernel kills
them (their output would have nowhere to go, and a rank failing on that alone
could leave the other waiting in a collective); the last periodic backup is
what is left. A rank stopped (SIGSTOP) for longer than the heartbeat
timeout is treated as hung and ends the job.

The launcher also keeps the memory tier of `BackupAndRestore(memory_freq=K)`
(`meshfit.launch.keeper`): snapshots the ranks send every K steps, held in
the launcher's memory across restarts, so a restarted job resumes from the
newest one instead of the older disk backup.

Elastic restarts (`--min-nprocs M`): a rank that fails within
`START_WINDOW_SECONDS` of being started in a restart (a process that cannot
come up: a lost device, a slot that no longer works) is dropped, and the job
restarts with one process fewer, down to M; the ranks left keep their own
devices. A failure in the first start, or later than that in a restart,
restarts the job at its size as usual. BackupAndRestore resumes onto the
smaller job (from a memory snapshot when each process's part holds the
state whole, else from disk). Under `--ray` the Ray runner sizes each
restart itself: as many ranks as the cluster can place, down to M
(`meshfit.launch.ray`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from meshfit.launch.fork_server import ForkServer, forkable
from meshfit.launch.keeper import Keeper
from meshfit.runtime import exit_report, job_env, start_phases
from meshfit.runtime.job_layout import JobLayout, JobStart, status_text

GRACE_SECONDS = 5.0  # once the ranks the job needs finished: the others get this long to end before SIGKILL
#: After a rank failed: the others' collectives are broken, and nothing they could still do (a preemption
#: backup is a collective too) is worth waiting for: SIGTERM, then SIGKILL this soon.
FAILURE_GRACE_SECONDS = 0.5
PREEMPTION_GRACE_SECONDS = 60.0  # after a signal to the launcher: time for the ranks' preemption backups
#: A rank of a restarted job that fails this soon after it was started cannot be restarted (with
#: `--min-nprocs`, the job restarts without it): long enough for a process that cannot come up (a lost
#: device, a dead host's slot), short of a job that trained.
START_WINDOW_SECONDS = 20.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: What gloo (JAX's CPU collectives) prints to each process's stdout from C++ as the processes connect, one
#: line per device: nothing a user acts on, so the launcher drops it unless `--verbose`.
GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ")


def free_port() -> int:
    """A port no program listens on, from below the kernel's ephemeral range where one can be found.

    A port the kernel hands out for `bind(0)` comes from the ephemeral range, from which it also picks the
    local port of every outgoing connection: between this pick and the coordinator's bind, any connection
    on the machine (gloo opens many) can take it, and process 0 then fails with "Address already in use".
    Ports below the range are only ever taken by a program that binds them by number.
    """
    low = _ephemeral_range()[0]
    for port in random.sample(range(max(1024, low - 12_000), low), 32) if low > 1024 + 64 else ():
        if _can_bind(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' ports (Linux); IANA's 49152-65535 elsewhere."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(part) for part in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def _can_bind(port: int) -> bool:
    """Whether a listening socket can take `port` on every interface now (what process 0 will do)."""
    try:
        with socket.create_server(("", port)):
            return True
    except OSError:
        return False


def _visible_gpus(env: dict[str, str]) -> int:
    """GPUs the processes will run on: those `nvidia-smi` lists, or 0 when `JAX_PLATFORMS` (as the processes
    will see it) names no GPU platform, e.g. `cpu`, where `--devices-per-proc` means simulated host devices."""
    platforms = {p.strip() for p in env.get("JAX_PLATFORMS", "").lower().split(",") if p.strip()}
    if platforms and not platforms & {"cuda", "gpu", "rocm"}:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


@dataclass
class LaunchConfig:
    """What to start: `command` (argv after the interpreter) on the ranks of `layout`."""

    command: list[str]
    #: The job's ranks: what each runs, its environment, what its exit means (`job_layout.DistributedJob(N)`
    #: for `--nprocs N`).
    layout: JobLayout
    devices_per_proc: int | None = None
    max_restarts: int = 0
    heartbeat_timeout: int = 10
    env: dict[str, str] = field(default_factory=dict)
    #: Seconds the ranks get to save and exit after the launcher is sent SIGTERM/SIGINT/SIGHUP.
    grace_period: float = PREEMPTION_GRACE_SECONDS
    #: Seconds the other ranks get to end once the job is over (a rank failed, or the ranks the job needs
    #: finished) before what is left is killed.
    stop_grace: float = GRACE_SECONDS
    #: Pass on every line of the ranks' output, also gloo's connection lines (`GLOO_CONNECTED`).
    verbose: bool = False
    #: Fork the ranks of every start from one process that imported the libraries once
    #: (`meshfit.launch.fork_server`); False (`--no-fork-server`): each rank is a new interpreter.
    fork_server: bool = True
    #: Elastic restarts: the fewest processes the job may restart with (`--min-nprocs`); None: always
    #: `nprocs`. A restart drops a rank that fails within `start_window` seconds of being started.
    min_nprocs: int | None = None
    start_window: float = START_WINDOW_SECONDS
    #: The slot (devices) each rank runs on: after an elastic restart, the ranks left keep their own
    #: devices and the dropped rank's are not used. None: rank r on slot r.
    slots: tuple[int, ...] | None = None

    @property
    def nprocs(self) -> int:
        return self.layout.nprocs


#: Runs one start of a job: `(config, attempt, log) -> status` (0, the first failure's, or -signal), or its
#: `Outcome` (which also names the failed ranks and what they reported, for the launcher's fail-fast rule).
Runner = Callable[["LaunchConfig", int, TextIO], "int | Outcome"]


def process_env(config: LaunchConfig, rank: int, start: JobStart, attempt: int, gpus: int) -> dict[str, str]:
    """The environment of process `rank`: the launcher's own variables, the layout's, and its devices."""
    env = dict(os.environ, **config.env, MESHFIT_RESTART_COUNT=str(attempt), PYTHONUNBUFFERED="1")
    env.update(config.layout.env(rank, start))
    if config.verbose:
        env[start_phases.ENV_VERBOSE] = "1"  # each rank prints its start's phases at its first step
    _set_devices(env, config, config.slots[rank] if config.slots is not None else rank, gpus)
    return env


def process_command(config: LaunchConfig, rank: int) -> list[str]:
    """The command line of process `rank`: the interpreter, unbuffered, running what the layout says."""
    return [sys.executable, "-u", *config.layout.command(rank, config.command)]


def _set_devices(env: dict[str, str], config: LaunchConfig, rank: int, gpus: int) -> None:
    k = config.devices_per_proc
    if k:
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(rank * k, (rank + 1) * k))
        else:
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={k}"])
            env.setdefault("JAX_PLATFORMS", "cpu")


def _pump(stream, rank: int, out, verbose: bool = False) -> None:
    """Copies a rank's output to `out`, each line prefixed with its rank; gloo's connection lines only when
    `verbose`."""
    for line in iter(stream.readline, ""):
        if not verbose and GLOO_CONNECTED.match(line):
            continue
        out.write(f"[rank {rank}] {line}" if line.endswith("\n") else f"[rank {rank}] {line}\n")
        out.flush()
    stream.close()


def die_with_parent():
    """A `preexec_fn` asking the kernel to SIGKILL the child when the launcher dies (Linux).

    Every launcher (local processes, Ray actors' subprocesses) starts its ranks with it, so no rank outlives
    the process that watches it; `None` where `prctl` is not available.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def arm():  # runs in the child between fork and exec: no allocation, no locks
        prctl(pr_set_pdeathsig, int(signal.SIGKILL))

    return arm


def _stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP, SIGTSTP): state T in /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


class _Exits:
    """Exit statuses in the order the processes ended: a thread per process waits for it.

    Polling all processes at once cannot tell which of two ranks that died
    within one interval died first; the rank killed is the cause, the one that
    aborted on losing its peer a consequence.
    """

    def __init__(self, procs: list):
        self.order: list[tuple[int, int]] = []  # (rank, status), first to end first
        self.at: dict[int, float] = {}  # rank -> when it ended (time.monotonic)
        self.changed = threading.Condition()
        for rank, proc in enumerate(procs):
            threading.Thread(target=self._wait, args=(rank, proc), daemon=True).start()

    def _wait(self, rank: int, proc) -> None:
        status = proc.wait()
        with self.changed:
            self.at[rank] = time.monotonic()
            self.order.append((rank, status))
            self.changed.notify_all()

    def wait(self, timeout: float) -> list[tuple[int, int]]:
        with self.changed:
            self.changed.wait(timeout)
            return list(self.order)


class Signals:
    """Catches SIGTERM, SIGINT and SIGHUP sent to the launcher while a job runs (main thread only).

    A context manager: inside it, `received` is the first signal caught (or `None`), which the launcher's
    watch loop passes on to every rank; on exit the previous handlers come back.
    """

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED:
                self._previous[sig] = signal.signal(sig, self._catch)
        return self

    def _catch(self, signum, frame):
        del frame
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _stop(procs: list, grace: float = GRACE_SECONDS) -> list[int]:
    """SIGTERM every live process, then SIGKILL what is left after `grace` seconds; returns the ranks killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    killed = []
    for rank, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed.append(rank)
    return killed


def _watch(config: LaunchConfig, procs: list, exits: _Exits, signals: Signals, log: TextIO) -> int:
    """Waits until the job ends, fails, or the launcher is signalled; returns the job's status."""
    layout = config.layout
    needed = set(layout.needed_ranks)
    judged: set[int] = set()
    stopped_since: dict[int, float] = {}
    while True:
        order = exits.wait(0.05)
        if signals.received is not None:
            name = signal.Signals(signals.received).name
            log.write(
                f"[launch] received {name}: sending SIGTERM to every rank and waiting up to "
                f"{config.grace_period:g} s for their preemption backups.\n"
            )
            return -signals.received
        statuses = dict(order)
        now = time.monotonic()
        # A rank stopped by a signal never fails by itself; one the job can lose may be dropped
        # by the others (a parameter-server worker), so only ranks the job needs are watched.
        for rank, proc in enumerate(procs):
            if rank in needed and rank not in statuses and _stopped(proc.pid):
                since = stopped_since.setdefault(rank, now)
                if now - since > config.heartbeat_timeout:
                    role = layout.role(rank)
                    log.write(
                        f"[launch] rank {rank}{f' ({role})' if role else ''} (pid {proc.pid}) is stopped (SIGSTOP?) "
                        f"and has not run for {config.heartbeat_timeout} s; stopping the job.\n"
                    )
                    return 1
            else:
                stopped_since.pop(rank, None)
        # The failures not judged yet, in the order the ranks ended, those of ranks the job can lose first.
        failed = [(rank, code) for rank, code in order if code != 0 and rank not in judged]
        for rank, code in sorted(failed, key=lambda exit: exit[0] in needed):
            judged.add(rank)
            verdict = layout.judge_exit(rank, code)
            log.write(f"[launch] {verdict.message}\n")
            if verdict.ends_job:
                return code
        if layout.is_complete(statuses):
            return 0


@dataclass(frozen=True)
class Outcome:
    """How one start of the job ended: its status (as `run_once` returns it), the first rank to fail with the
    seconds it ran (None, None when none failed), the ranks that failed by themselves with their statuses (in
    the order they ended), and what each rank reported of the exception that ended it (`exit_report`)."""

    status: int
    failed_rank: int | None = None
    ran_for: float | None = None
    failures: tuple[tuple[int, int], ...] = ()
    reports: dict[int, dict] = field(default_factory=dict)
    #: Seconds from the first failure to the end of the start (its other ranks stopped): None when none failed.
    ended_after: float | None = None

    def setup_error(self) -> tuple[int, dict] | None:
        """The rank that failed first and its report, when it raised an exception before taking a training step
        and no rank was killed from outside (SIGKILL: the OOM killer, an operator): an error every start would
        repeat (a bad argument, a directory that cannot be written), not worth a restart. The ranks that ended
        after it are its consequences (a peer aborting on the broken collective). None otherwise."""
        if self.status <= 0 or not self.failures:
            return None
        rank, code = self.failures[0]
        report = self.reports.get(rank)
        if code <= 0 or report is None or report.get("first_step"):
            return None
        if any(code == -signal.SIGKILL for _, code in self.failures):
            return None
        return rank, report


def run_once(config: LaunchConfig, attempt: int, log: TextIO = sys.stderr) -> int:
    """Runs the job once; returns 0, the status of the first process that failed, or -signal if the
    launcher was signalled."""
    return run_once_outcome(config, attempt, log).status


def run_once_outcome(
    config: LaunchConfig, attempt: int, log: TextIO = sys.stderr, forks: ForkServer | None = None
) -> Outcome:
    """`run_once`, also saying which rank failed first and how long it had run (for elastic restarts).

    `forks`: the launch's fork server, which each rank is forked from where it can be (else a new process).
    """
    gpus = _gpus_to_assign(config)
    start = JobStart(
        coordinator_port=free_port(),
        control_port=free_port(),
        heartbeat_timeout=config.heartbeat_timeout,
        authkey=job_env.new_authkey() if config.layout.needs_authkey else "",
    )
    procs, pumps, started = [], [], []
    exits = None
    reports = tempfile.mkdtemp(prefix="meshfit-exits-")  # mode 0700: the ranks' `exit_report`s
    status = 1  # (until the job's own is known)
    with Signals() as signals:
        try:
            for rank in range(config.nprocs):
                started.append(time.monotonic())
                env = process_env(config, rank, start, attempt, gpus)
                env[exit_report.ENV_EXIT_REPORT] = os.path.join(reports, f"{rank}.json")
                command = config.layout.command(rank, config.command)
                proc = forks.start(env, command, rank=rank) if forks is not None else None
                if proc is None and forks is not None and config.verbose:
                    log.write(f"[launch] rank {rank} starts as a new process: {forks.why}.\n")
                if proc is None:
                    proc = subprocess.Popen(
                        process_command(config, rank),
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        errors="replace",
                        preexec_fn=die_with_parent(),
                    )
                procs.append(proc)
                pump = threading.Thread(target=_pump, args=(proc.stdout, rank, sys.stdout, config.verbose), daemon=True)
                pump.start()
                pumps.append(pump)
            exits = _Exits(procs)
            status = _watch(config, procs, exits, signals, log)
            time.sleep(0.2)  # ranks failing because the first one did: reported as its consequences
            before_stop = list(exits.order)
        except KeyboardInterrupt:  # outside the main thread's handler (e.g. before it was installed)
            status, before_stop = -signal.SIGINT, []
        finally:
            signalled = signals.received is not None
            if signalled:
                grace = config.grace_period
            else:
                grace = config.stop_grace if status == 0 else min(config.stop_grace, FAILURE_GRACE_SECONDS)
            killed = _stop(procs, grace)
            for pump in pumps:
                pump.join(timeout=2)
        failures = [(rank, code) for rank, code in before_stop if code != 0]
        for rank, code in failures[1:] if not signalled else []:
            log.write(
                f"[launch] rank {rank} then exited with status {status_text(code)}, a consequence "
                f"of rank {failures[0][0]}'s exit.\n"
            )
        if killed and failures and not signalled:  # nothing left to wait for: their collectives are broken
            log.write(f"[launch] rank(s) {killed} killed: they cannot go on without rank {failures[0][0]}.\n")
        elif killed:
            log.write(f"[launch] rank(s) {killed} did not end within the grace period and were killed.\n")
        for rank, proc in enumerate(procs) if signalled else ():
            log.write(f"[launch] rank {rank} ended with status {status_text(proc.returncode)}.\n")
    said = {rank: exit_report.read(os.path.join(reports, f"{rank}.json")) for rank in range(len(procs))}
    shutil.rmtree(reports, ignore_errors=True)
    found = {rank: report for rank, report in said.items() if report is not None}
    if failures and exits is not None and not signalled:
        rank = failures[0][0]
        ran, after = exits.at[rank] - started[rank], time.monotonic() - exits.at[rank]
        return Outcome(status, rank, ran, tuple(failures), found, after)
    return Outcome(status, reports=found)


def _fork_server(config: LaunchConfig) -> ForkServer | None:
    """The launch's fork server, started with the environment the ranks share (`fork_server.PER_START`
    aside), where the ranks run a script or module; None where they cannot be forked or `fork_server` is off."""
    if not config.fork_server or not forkable(config.layout.command(0, config.command)):
        return None
    start = JobStart(coordinator_port=0, control_port=0, heartbeat_timeout=config.heartbeat_timeout, authkey="")
    env = process_env(config, 0, start, 0, _gpus_to_assign(config))
    return ForkServer(env, die_with_parent(), learn_imports=config.max_restarts > 0)


def _launch_cache(config: LaunchConfig) -> str | None:
    """A compilation cache for the launch's ranks on this machine (a new 0700 directory), unless the job
    chose its own (`JAX_COMPILATION_CACHE_DIR` set): every rank of every start compiles the same programs
    before its fit, where `BackupAndRestore`'s cache is not on yet."""
    if "JAX_COMPILATION_CACHE_DIR" in {**os.environ, **config.env}:
        return None
    return tempfile.mkdtemp(prefix="meshfit-compilation-cache-")


def _cache_env(cache: str) -> dict[str, str]:
    return {
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        job_env.ENV_LAUNCH_CACHE: cache,
    }


def _check_elastic(config: LaunchConfig, runner: Runner) -> bool:
    """Whether the job restarts elastically (`--min-nprocs` below `--nprocs`); refuses what cannot."""
    if config.min_nprocs is None or config.min_nprocs == config.nprocs:
        return False
    if not 1 <= config.min_nprocs <= config.nprocs:
        raise ValueError(
            f"--min-nprocs must be between 1 and --nprocs ({config.nprocs}). Received: {config.min_nprocs}."
        )
    resizes = runner is run_once or getattr(runner, "elastic", False)  # the Ray runner sizes its restarts
    if not resizes or config.layout.resized(config.min_nprocs) is None:
        raise ValueError(
            "--min-nprocs needs a `meshfit launch --nprocs N` job, on this machine or --ray (not a layout whose "
            f"ranks have roles). Received: --min-nprocs {config.min_nprocs}; drop it, or launch with --nprocs."
        )
    return True


def _shrunk(config: LaunchConfig, outcome: Outcome, attempt: int, log: TextIO) -> LaunchConfig:
    """The config of the next start: without the rank that failed at the start of a restart, while the job
    keeps at least `min_nprocs` processes; else the same."""
    rank, ran = outcome.failed_rank, outcome.ran_for
    restarted = attempt >= 2  # the start that just failed was itself a restart
    if rank is None or ran is None or not restarted or ran > config.start_window:
        return config
    assert config.min_nprocs is not None
    if config.nprocs - 1 < config.min_nprocs:
        log.write(
            f"[launch] rank {rank} failed {ran:.1f} s after it was restarted; the job cannot shrink below "
            f"--min-nprocs {config.min_nprocs}: restarting it with {config.nprocs} process(es).\n"
        )
        return config
    slots = list(config.slots if config.slots is not None else range(config.nprocs))
    dropped = slots.pop(rank)
    layout = config.layout.resized(config.nprocs - 1)
    assert layout is not None
    log.write(
        f"[launch] rank {rank} (slot {dropped}) failed {ran:.1f} s after it was restarted (within "
        f"{config.start_window:g} s): it cannot be restarted; restarting the job with {layout.nprocs} "
        f"process(es) (--min-nprocs {config.min_nprocs}).\n"
    )
    return dataclasses.replace(config, layout=layout, slots=tuple(slots))


def _gpus_to_assign(config: LaunchConfig) -> int:
    """The GPUs split over the processes by `--devices-per-proc` (0: simulated CPU devices instead)."""
    if not config.devices_per_proc:
        return 0
    gpus = _visible_gpus({**os.environ, **config.env})
    needed = config.nprocs * config.devices_per_proc
    if gpus and gpus < needed:
        raise ValueError(
            f"--nprocs {config.nprocs} x --devices-per-proc {config.devices_per_proc} needs {needed} GPUs; "
            f"nvidia-smi lists {gpus}. Start fewer processes or devices per process, or set JAX_PLATFORMS=cpu "
            "to simulate the devices on the host."
        )
    return gpus


def launch(config: LaunchConfig, log: TextIO = sys.stderr, runner: Runner | None = None) -> int:
    """Runs the job, restarting it up to `max_restarts` times after a failure (not after a signal).

    `runner` runs one start of the job and returns its status as `run_once` does (the default: processes on
    this machine; `meshfit.launch.ray` brings one that runs them on a Ray cluster).

    Raises:
        ValueError: a misconfiguration found before any process starts (`nprocs` below 1, `max_restarts` not
            a whole number of 0 or more, too few GPUs, a `min_nprocs` that cannot apply).
    """
    if config.nprocs < 1:
        raise ValueError(f"--nprocs must be at least 1. Received: {config.nprocs}.")
    if isinstance(config.max_restarts, bool) or not isinstance(config.max_restarts, int) or config.max_restarts < 0:
        raise ValueError(
            "--max-restarts expected a whole number of restarts, 0 or more (0: never restart). "
            f"Received: {config.max_restarts!r}."
        )
    snapshots = None
    if runner is None:
        _gpus_to_assign(config)  # a misconfiguration fails before any process starts
        runner = run_once
    if runner is run_once and config.layout.keeps_snapshots:
        snapshots = Keeper(log, host=None)  # the memory tier of BackupAndRestore, across restarts; a Unix socket
        config = dataclasses.replace(config, env={**config.env, **snapshots.env()})
    cache = _launch_cache(config) if runner is run_once else None
    if cache is not None:
        config = dataclasses.replace(config, env={**config.env, **_cache_env(cache)})
    # Elastic on this machine: the launcher drops the rank that cannot restart (`_shrunk`); an elastic runner
    # (Ray's) sizes each restart to what its cluster can place.
    elastic = _check_elastic(config, runner) and runner is run_once
    forks = _fork_server(config) if runner is run_once else None
    attempt = 0
    setup_error = None
    try:
        while True:
            if runner is run_once:
                outcome = run_once_outcome(config, attempt, log, forks)
            else:
                ran = runner(config, attempt, log)
                outcome = ran if isinstance(ran, Outcome) else Outcome(ran)
            status = outcome.status
            if status == 0 or -status in FORWARDED:
                break
            setup_error = outcome.setup_error()
            if setup_error is not None or attempt >= config.max_restarts:
                break
            attempt += 1
            if elastic:
                config = _shrunk(config, outcome, attempt, log)
            since = (
                f", {outcome.ended_after:.2f} s after rank {outcome.failed_rank} ended"
                if outcome.ended_after is not None
                else ""
            )
            log.write(f"[launch] restarting the job ({attempt}/{config.max_restarts}){since}.\n")
    finally:
        if forks is not None:
            forks.close()
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
        if snapshots is not None:
            snapshots.close()
        close = getattr(runner, "close", None)
        if close is not None:
            close()  # a runner's own resources for the launch (the Ray launcher's keepers)
    if -status in FORWARDED:
        log.write(f"[launch] stopped by {signal.Signals(-status).name}.\n")
    elif setup_error is not None:
        rank, report = setup_error
        log.write(
            f"[launch] not restarting: every failing rank raised before the job's first step, so every start would "
            f"fail the same way.\n[launch] job failed with status {status}: rank {rank} raised "
            f"{report['type']}: {report['message']}\n"
        )
    elif status:
        log.write(f"[launch] job failed with status {status}.\n")
    # A negative status (killed by a signal) becomes the shell's 128 + signal.
    return status if status > 0 else 128 - status if status < 0 else 0
