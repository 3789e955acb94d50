"""What each rank of a `meshfit launch` job is: its environment, its command, and what its exit means.

`meshfit launch` starts, watches and stops processes (`meshfit.launch`); a `JobLayout`
answers every question whose answer depends on the kind of job. The plain
`jax.distributed` job (`--nprocs N`) is `DistributedJob`, here; a strategy that
starts processes of its own kinds keeps its layout in its own package (the
parameter server's: `meshfit/strategies/parameter_server/launcher.py`) and names
that module in `LAUNCHERS`, so that `meshfit launch` takes its arguments.

Imports nothing of JAX, nor may a launcher module: the launcher starts in a
quarter of a second.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from meshfit.runtime import job_env

#: Modules that add a kind of job to `meshfit launch`, each free of JAX. Each defines
#: `USAGE` (its arguments, for messages), `add_arguments(parser)`, and `layout(args) -> JobLayout | None`
#: (None when its arguments were not given; a `ValueError` naming them when they cannot form a job).
LAUNCHERS = ("meshfit.strategies.parameter_server.launcher",)


@dataclass(frozen=True)
class JobStart:
    """What the ranks of one start of a job share: where they meet, and the secret that proves they belong."""

    #: The `jax.distributed` coordinator's port on 127.0.0.1.
    coordinator_port: int
    #: A port for a layout's own listener (the parameter server's control connections).
    control_port: int
    #: Seconds without heartbeats after which a rank is declared dead (or, stopped, hung).
    heartbeat_timeout: int
    #: A fresh secret for this start, when the layout `needs_authkey`; else "".
    authkey: str = ""
    #: The address of the coordinator's machine: loopback for a job on this machine, rank 0's node's IP for
    #: one on a Ray cluster (`meshfit launch --ray`).
    coordinator_host: str = "127.0.0.1"


@dataclass(frozen=True)
class ExitVerdict:
    """What a rank's failure means: whether the job is over, and the line the launcher writes."""

    ends_job: bool
    message: str


class JobLayout(ABC):
    """Which process each rank of a job runs and what its exit means. Ranks are 0 to `nprocs` - 1."""

    #: Whether the ranks' connections need a secret, fresh at each start (`JobStart.authkey`).
    needs_authkey: bool = False
    #: Whether the launcher keeps the memory tier of the ranks' backups (`meshfit.launch.keeper`): jobs whose
    #: ranks resume from `BackupAndRestore` together (all-reduce strategies).
    keeps_snapshots: bool = False

    @property
    @abstractmethod
    def nprocs(self) -> int:
        """How many processes the job starts."""

    @abstractmethod
    def env(self, rank: int, start: JobStart) -> dict[str, str]:
        """The variables that tell process `rank` its place in the job (the launcher adds its own and the devices')."""

    def command(self, rank: int, script: list[str]) -> list[str]:
        """What process `rank` runs after the interpreter: by default `script` (a path or `-m module`, and its
        arguments)."""
        del rank
        return script

    def role(self, rank: int) -> str | None:
        """The role of `rank` in the launcher's messages ("the parameter server"); None when all ranks are alike."""
        del rank
        return None

    @property
    def needed_ranks(self) -> range:
        """The ranks the job cannot do without: a stopped one ends the job, and the job is complete when all of
        them exited with status 0. By default every rank."""
        return range(self.nprocs)

    @abstractmethod
    def judge_exit(self, rank: int, status: int) -> ExitVerdict:
        """What the exit of `rank` with a nonzero `status` means (the job then ends with that status)."""

    def is_complete(self, statuses: Mapping[int, int]) -> bool:
        """Whether the job is over and succeeded, given the statuses of the ranks that have exited."""
        return all(statuses.get(rank) == 0 for rank in self.needed_ranks)

    def resized(self, nprocs: int) -> JobLayout | None:
        """The same job on `nprocs` processes (an elastic restart onto fewer), or None when it cannot run on
        another number (a layout whose ranks have roles of their own)."""
        del nprocs
        return None


def status_text(status: int) -> str:
    """`status`, and the signal that killed the process when it is negative: "-9 (killed by SIGKILL)"."""
    if status < 0:
        try:
            return f"{status} (killed by {signal.Signals(-status).name})"
        except ValueError:
            pass
    return str(status)


def distributed_env(
    port: int, processes: int, rank: int, heartbeat_timeout: int, host: str = "127.0.0.1"
) -> dict[str, str]:
    """What `cluster.initialize` reads to join a `jax.distributed` job of `processes` processes as `rank`,
    whose coordinator listens on `host` (loopback unless the job spans machines)."""
    address = f"{host}:{port}"
    return {
        job_env.ENV_COORDINATOR: address,
        job_env.ENV_NUM_PROCESSES: str(processes),
        job_env.ENV_PROCESS_ID: str(rank),
        job_env.ENV_HEARTBEAT: str(heartbeat_timeout),
        "JAX_COORDINATOR_BIND_ADDRESS": address,  # that address only (loopback for a job on one machine)
    }


@dataclass(frozen=True)
class DistributedJob(JobLayout):
    """`meshfit launch --nprocs N`: N copies of the script in one `jax.distributed` job; any failure ends it."""

    processes: int
    keeps_snapshots = True

    @property
    def nprocs(self) -> int:
        return self.processes

    def env(self, rank: int, start: JobStart) -> dict[str, str]:
        return distributed_env(
            start.coordinator_port, self.processes, rank, start.heartbeat_timeout, start.coordinator_host
        )

    def judge_exit(self, rank: int, status: int) -> ExitVerdict:
        return ExitVerdict(
            True,
            f"rank {rank} exited with status {status_text(status)}; stopping the other {self.processes - 1} "
            "process(es).",
        )

    def resized(self, nprocs: int) -> DistributedJob:
        return DistributedJob(nprocs)
