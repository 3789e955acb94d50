"""`meshfit launch`: run a multi-process JAX job on this machine.

Starts N copies of a script wired to a coordinator on 127.0.0.1 (a free port),
each with `--devices-per-proc` simulated CPU devices (or a slice of the GPUs),
prefixes every output line with the process's rank, and when any process
fails stops the others and exits with the status of the first to fail. With
`--max-restarts`, a failed job is started again from scratch (use
BackupAndRestore to resume). In a parameter-server job (`--ps S --workers N`)
ranks 0 to S - 1 run the script and the other ranks run the worker process
(`python -m meshfit.strategies.parameter_server.worker`).

No rank outlives the launcher: SIGTERM, SIGINT or SIGHUP to the launcher (a
scheduler preempting the job) is passed on to every rank as SIGTERM, the
ranks get `--grace-period` seconds to write their preemption backups, what
is left is killed, and the launcher exits with 128 + the signal (143 for
SIGTERM). A launcher killed outright takes its ranks along: the kernel kills
them (their output would have nowhere to go, and a rank failing on that alone
could leave the other waiting in a collective); the last periodic backup is
what is left. A rank stopped (SIGSTOP) for longer than the heartbeat
timeout is treated as hung and ends the job.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from meshfit import job_env

GRACE_SECONDS = 5.0  # after a rank failed: the others get this long to end before SIGKILL
PREEMPTION_GRACE_SECONDS = 60.0  # after a signal to the launcher: time for the ranks' preemption backups
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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
    """What to start: `command` (argv after the interpreter) on `nprocs` processes."""

    command: list[str]
    nprocs: int
    devices_per_proc: int | None = None
    max_restarts: int = 0
    heartbeat_timeout: int = 10
    env: dict[str, str] = field(default_factory=dict)
    #: Seconds the ranks get to save and exit after the launcher is sent SIGTERM/SIGINT/SIGHUP.
    grace_period: float = PREEMPTION_GRACE_SECONDS
    #: Seconds a parameter-server worker waits on a silent server before giving up.
    server_timeout: float = 60.0
    #: Seconds the other ranks get to end once the job is over (a rank failed, or in a parameter-server
    #: job the servers finished) before what is left is killed.
    stop_grace: float = GRACE_SECONDS
    #: Parameter-server processes (ranks 0 to servers - 1); 0 for a plain job. In a
    #: parameter-server job the other ranks are workers, which may die without
    #: stopping the job: they are never part of a jax.distributed job. Servers
    #: form one of their own when there are several.
    servers: int = 0


def process_env(
    config: LaunchConfig, rank: int, ports: tuple[int, int], attempt: int, gpus: int, authkey: str = ""
) -> dict[str, str]:
    """The environment of process `rank`: coordinator, rank, devices.

    `ports`: the `jax.distributed` coordinator's, and the parameter-server
    control listener's.
    """
    env = dict(os.environ, **config.env, MESHFIT_RESTART_COUNT=str(attempt), PYTHONUNBUFFERED="1")
    if not config.servers:
        env.update(_distributed_env(ports[0], config.nprocs, rank, config.heartbeat_timeout))
    else:
        server = rank < config.servers
        env.update(
            {
                job_env.ENV_PS_ROLE: "coordinator" if rank == 0 else "server" if server else "worker",
                job_env.ENV_PS_ADDRESS: f"127.0.0.1:{ports[1]}",
                job_env.ENV_PS_AUTHKEY: authkey,
                job_env.ENV_PS_WORKERS: str(config.nprocs - config.servers),
                job_env.ENV_PS_SERVERS: str(config.servers),
                job_env.ENV_PS_SERVER_TIMEOUT: str(config.server_timeout),
                job_env.ENV_PROCESS_ID: str(rank),
            }
        )
        if server:
            env[job_env.ENV_PS_SERVER_RANK] = str(rank)
            if config.servers > 1:
                env.update(_distributed_env(ports[0], config.servers, rank, config.heartbeat_timeout))
    _set_devices(env, config, rank, gpus)
    return env


def process_command(config: LaunchConfig, rank: int) -> list[str]:
    """The command line of process `rank`: the script, or on the worker ranks of a parameter-server job the
    worker process (which gets its program from the server and runs none of the script)."""
    if config.servers and rank >= config.servers:
        return [sys.executable, "-u", "-m", job_env.PS_WORKER_MODULE]
    return [sys.executable, "-u", *config.command]


def _distributed_env(port: int, processes: int, rank: int, heartbeat_timeout: int) -> dict[str, str]:
    """What `cluster.initialize` reads to join a `jax.distributed` job of `processes` processes."""
    address = f"127.0.0.1:{port}"
    return {
        job_env.ENV_COORDINATOR: address,
        job_env.ENV_NUM_PROCESSES: str(processes),
        job_env.ENV_PROCESS_ID: str(rank),
        job_env.ENV_HEARTBEAT: str(heartbeat_timeout),
        "JAX_COORDINATOR_BIND_ADDRESS": address,  # loopback only
    }


def _set_devices(env: dict, config: LaunchConfig, rank: int, gpus: int) -> None:
    k = config.devices_per_proc
    if k:
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(rank * k, (rank + 1) * k))
        else:
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={k}"])
            env.setdefault("JAX_PLATFORMS", "cpu")


def _pump(stream, rank: int, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[rank {rank}] {line}" if line.endswith("\n") else f"[rank {rank}] {line}\n")
        out.flush()
    stream.close()


def _die_with_parent():
    """A `preexec_fn` asking the kernel to SIGKILL the child when the launcher dies (Linux)."""
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

    def __init__(self, procs: list[subprocess.Popen]):
        self.order: list[tuple[int, int]] = []  # (rank, status), first to end first
        self.changed = threading.Condition()
        for rank, proc in enumerate(procs):
            threading.Thread(target=self._wait, args=(rank, proc), daemon=True).start()

    def _wait(self, rank: int, proc: subprocess.Popen) -> None:
        status = proc.wait()
        with self.changed:
            self.order.append((rank, status))
            self.changed.notify_all()

    def wait(self, timeout: float) -> list[tuple[int, int]]:
        with self.changed:
            self.changed.wait(timeout)
            return list(self.order)


class _Signals:
    """Catches SIGTERM, SIGINT and SIGHUP sent to the launcher while a job runs (main thread only)."""

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


def _stop(procs: list[subprocess.Popen], grace: float = GRACE_SECONDS) -> list[int]:
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


def _watch(config: LaunchConfig, procs: list[subprocess.Popen], exits: _Exits, signals: _Signals, log) -> int:
    """Waits until the job ends, fails, or the launcher is signalled; returns the job's status."""
    lost: set[int] = set()
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
        # A rank stopped by a signal never fails by itself; a parameter-server worker may
        # (the server drops it after worker_timeout), so only ranks the job needs are watched.
        for rank, proc in enumerate(procs[: config.servers or len(procs)]):
            if rank not in statuses and _stopped(proc.pid):
                since = stopped_since.setdefault(rank, now)
                if now - since > config.heartbeat_timeout:
                    log.write(
                        f"[launch] rank {rank}{_role(config, rank)} (pid {proc.pid}) is stopped (SIGSTOP?) "
                        f"and has not run for {config.heartbeat_timeout} s; stopping the job.\n"
                    )
                    return 1
            else:
                stopped_since.pop(rank, None)
        failed = [(rank, code) for rank, code in order if code != 0]
        if config.servers:
            for rank, code in failed:
                if rank >= config.servers and rank not in lost:
                    lost.add(rank)
                    if code == job_env.EXIT_SERVER_SILENT:
                        log.write(
                            f"[launch] worker rank {rank} found the parameter server silent (see its "
                            "output); stopping the job.\n"
                        )
                        return code
                    log.write(
                        f"[launch] worker rank {rank} exited with status {code}{_signal_name(code)}; "
                        "the job goes on without it.\n"
                    )
            servers = [(rank, code) for rank, code in failed if rank < config.servers]
            if servers:  # a server failed: the job is over
                rank, status = servers[0]
                log.write(
                    f"[launch] the parameter server (rank {rank}) exited with status {status}"
                    f"{_signal_name(status)}; stopping the job.\n"
                )
                return status
            if all(statuses.get(rank) == 0 for rank in range(config.servers)):  # the workers are done too
                return 0
            continue
        if failed:
            rank, status = failed[0]
            log.write(
                f"[launch] rank {rank} exited with status {status}{_signal_name(status)}; "
                f"stopping the other {config.nprocs - 1} process(es).\n"
            )
            return status
        if len(order) == len(procs):
            return 0


def _role(config: LaunchConfig, rank: int) -> str:
    if not config.servers:
        return ""
    return " (the parameter server)" if rank < config.servers else " (a worker)"


def run_once(config: LaunchConfig, attempt: int, log=sys.stderr) -> int:
    """Runs the job once; returns 0, the status of the first process that failed, or -signal if the
    launcher was signalled."""
    ports, gpus = (free_port(), free_port()), _gpus_to_assign(config)
    authkey = job_env.new_authkey() if config.servers else ""
    procs, pumps = [], []
    with _Signals() as signals:
        try:
            for rank in range(config.nprocs):
                proc = subprocess.Popen(
                    process_command(config, rank),
                    env=process_env(config, rank, ports, attempt, gpus, authkey),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    errors="replace",
                    preexec_fn=_die_with_parent(),
                )
                procs.append(proc)
                pump = threading.Thread(target=_pump, args=(proc.stdout, rank, sys.stdout), daemon=True)
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
            killed = _stop(procs, config.grace_period if signalled else config.stop_grace)
            for pump in pumps:
                pump.join(timeout=2)
        failures = [(rank, code) for rank, code in before_stop if code != 0]
        for rank, code in failures[1:] if not signalled else []:
            log.write(
                f"[launch] rank {rank} then exited with status {code}{_signal_name(code)}, a consequence "
                f"of rank {failures[0][0]}'s exit.\n"
            )
        if killed:
            log.write(f"[launch] rank(s) {killed} did not end within the grace period and were killed.\n")
    return status


def _signal_name(status: int) -> str:
    if status < 0:
        try:
            return f" (killed by {signal.Signals(-status).name})"
        except ValueError:
            return ""
    return ""


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


def launch(config: LaunchConfig, log=sys.stderr) -> int:
    """Runs the job, restarting it up to `max_restarts` times after a failure (not after a signal)."""
    if config.nprocs < 1:
        raise ValueError(f"--nprocs must be at least 1. Received: {config.nprocs}.")
    _gpus_to_assign(config)  # a misconfiguration fails before any process starts
    attempt = 0
    while True:
        status = run_once(config, attempt, log)
        if status == 0 or -status in FORWARDED or attempt >= config.max_restarts:
            break
        attempt += 1
        log.write(f"[launch] restarting the job ({attempt}/{config.max_restarts}).\n")
    if -status in FORWARDED:
        log.write(f"[launch] stopped by {signal.Signals(-status).name}.\n")
    elif status:
        log.write(f"[launch] job failed with status {status}.\n")
    # A negative status (killed by a signal) becomes the shell's 128 + signal.
    return status if status > 0 else 128 - status if status < 0 else 0
