"""`meshfit launch`: run a multi-process JAX job on this machine.

Starts N copies of a script wired to a coordinator on 127.0.0.1 (a free port),
each with `--devices-per-proc` simulated CPU devices (or a slice of the GPUs),
prefixes every output line with the process's rank, and when any process
fails stops the others and exits with its status. With `--max-restarts`, a
failed job is started again from scratch (use BackupAndRestore to resume).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from meshfit import cluster
from meshfit.strategies import ps_remote

GRACE_SECONDS = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _visible_gpus() -> int:
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
    #: Parameter-server processes (ranks 0 to servers - 1); 0 for a plain job. In a
    #: parameter-server job the other ranks are workers, which may die without
    #: stopping the job: they are never part of a jax.distributed job. Servers
    #: form one of their own when there are several.
    servers: int = 0


def process_env(config: LaunchConfig, rank: int, ports: tuple[int, int], attempt: int, gpus: int,
                authkey: str = "") -> dict[str, str]:
    """The environment of process `rank`: coordinator, rank, devices.

    `ports`: the `jax.distributed` coordinator's, and the parameter-server
    control listener's.
    """
    env = dict(os.environ, **config.env, MESHFIT_RESTART_COUNT=str(attempt), PYTHONUNBUFFERED="1")
    if not config.servers:
        env.update(_distributed_env(ports[0], config.nprocs, rank, config.heartbeat_timeout))
    else:
        server = rank < config.servers
        env.update({
            ps_remote.ENV_ROLE: "coordinator" if rank == 0 else "server" if server else "worker",
            ps_remote.ENV_ADDRESS: f"127.0.0.1:{ports[1]}",
            ps_remote.ENV_AUTHKEY: authkey,
            ps_remote.ENV_WORKERS: str(config.nprocs - config.servers),
            ps_remote.ENV_SERVERS: str(config.servers),
            "MESHFIT_PROCESS_ID": str(rank),
        })
        if server:
            env[ps_remote.ENV_SERVER_RANK] = str(rank)
            if config.servers > 1:
                env.update(_distributed_env(ports[0], config.servers, rank, config.heartbeat_timeout))
    _set_devices(env, config, rank, gpus)
    return env


def _distributed_env(port: int, processes: int, rank: int, heartbeat_timeout: int) -> dict[str, str]:
    """What `cluster.initialize` reads to join a `jax.distributed` job of `processes` processes."""
    address = f"127.0.0.1:{port}"
    return {
        cluster.ENV_COORDINATOR: address,
        cluster.ENV_NUM_PROCESSES: str(processes),
        cluster.ENV_PROCESS_ID: str(rank),
        cluster.ENV_HEARTBEAT: str(heartbeat_timeout),
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


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live process, then SIGKILL what is left after a grace period."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_once(config: LaunchConfig, attempt: int, log=sys.stderr) -> int:
    """Runs the job once; returns 0, or the status of the first process that failed."""
    ports, gpus = (free_port(), free_port()), _visible_gpus() if config.devices_per_proc else 0
    authkey = ps_remote.new_authkey() if config.servers else ""
    procs, pumps = [], []
    for rank in range(config.nprocs):
        proc = subprocess.Popen([sys.executable, "-u", *config.command],
                                env=process_env(config, rank, ports, attempt, gpus, authkey),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(proc.stdout, rank, sys.stdout), daemon=True)
        pump.start()
        pumps.append(pump)
    status = 0
    lost: set[int] = set()
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            if config.servers:
                for rank, code in enumerate(codes[config.servers:], start=config.servers):
                    if code not in (None, 0) and rank not in lost:
                        lost.add(rank)
                        log.write(f"[launch] worker rank {rank} exited with status {code}{_signal_name(code)}; "
                                  "the job goes on without it.\n")
                servers = codes[:config.servers]
                failed = [(rank, code) for rank, code in enumerate(servers) if code not in (None, 0)]
                if failed:  # a server failed: the job is over
                    rank, status = failed[0]
                    log.write(f"[launch] the parameter server (rank {rank}) exited with status {status}"
                              f"{_signal_name(status)}; stopping the job.\n")
                    break
                if all(code == 0 for code in servers):  # the servers finished: the workers are done too
                    break
                time.sleep(0.05)
                continue
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, status = failed[0]
                log.write(f"[launch] rank {rank} exited with status {status}{_signal_name(status)}; "
                          f"stopping the other {config.nprocs - 1} process(es).\n")
                break
            if all(code == 0 for code in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        status = 130
    finally:
        _stop(procs)
        for pump in pumps:
            pump.join(timeout=2)
    return status


def _signal_name(status: int) -> str:
    if status < 0:
        try:
            return f" (killed by {signal.Signals(-status).name})"
        except ValueError:
            return ""
    return ""


def launch(config: LaunchConfig, log=sys.stderr) -> int:
    """Runs the job, restarting it up to `max_restarts` times after a failure."""
    if config.nprocs < 1:
        raise ValueError(f"--nprocs must be at least 1. Received: {config.nprocs}.")
    attempt = 0
    while True:
        status = run_once(config, attempt, log)
        if status == 0 or status == 130 or attempt >= config.max_restarts:
            break
        attempt += 1
        log.write(f"[launch] restarting the job ({attempt}/{config.max_restarts}).\n")
    if status:
        log.write(f"[launch] job failed with status {status}.\n")
    # A negative status (killed by a signal) becomes the shell's 128 + signal.
    return status if status > 0 else 128 - status if status < 0 else 0
