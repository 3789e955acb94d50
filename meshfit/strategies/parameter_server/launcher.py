"""What `meshfit launch --ps S --workers N` starts on each rank, and the `MESHFIT_PS_*` variables it sets.

Ranks 0 to S - 1 are the servers: they run the script, rank 0 also
coordinates the job, and with S > 1 the servers form a `jax.distributed` job
of their own. The other N ranks are workers: they run the worker process
(`python -m meshfit.strategies.parameter_server.worker`), never join a
`jax.distributed` job, and may die without stopping the job.

Imports nothing of JAX (see `meshfit.runtime.job_layout`): `meshfit launch` reads it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from meshfit.runtime import job_env
from meshfit.runtime.job_layout import ExitVerdict, JobLayout, JobStart, distributed_env, status_text

ENV_PS_ROLE = "MESHFIT_PS_ROLE"  # "coordinator" (server rank 0), "server" (server ranks 1..) or "worker"
ENV_PS_ADDRESS = "MESHFIT_PS_ADDRESS"  # host:port of the coordinator's control listener
ENV_PS_AUTHKEY = "MESHFIT_PS_AUTHKEY"  # hex secret shared by the job's processes
ENV_PS_WORKERS = "MESHFIT_PS_WORKERS"  # number of worker processes the coordinator waits for
ENV_PS_SERVERS = "MESHFIT_PS_SERVERS"  # number of server processes (rank 0 included)
ENV_PS_SERVER_RANK = "MESHFIT_PS_SERVER_RANK"  # this server's rank among the servers
ENV_PS_SERVER_TIMEOUT = "MESHFIT_PS_SERVER_TIMEOUT"  # seconds without a word from rank 0 before its peers give up
#: What worker ranks run (`python -m`): the worker needs nothing of the training script.
PS_WORKER_MODULE = "meshfit.strategies.parameter_server.worker"
#: Exit status of a worker that found the parameter server silent (`meshfit launch` then ends the job).
EXIT_SERVER_SILENT = 3
#: Seconds a worker (or a server of rank 1..) waits on a silent rank 0, unless told otherwise.
DEFAULT_SERVER_TIMEOUT = 60.0

#: The arguments that ask `meshfit launch` for a parameter-server job, as messages name them.
USAGE = "--ps S --workers N"


@dataclass(frozen=True)
class ParameterServerJob(JobLayout):
    """S server ranks running the script (rank 0 coordinating), then N worker ranks running the worker process.

    A server's failure ends the job; a worker's does not (rank 0 drops it and
    redoes its batch), unless the worker found the servers silent. The job is
    complete when every server has exited with status 0.
    """

    servers: int
    workers: int
    #: Seconds a worker waits on a silent server before it gives up (`EXIT_SERVER_SILENT`).
    server_timeout: float = DEFAULT_SERVER_TIMEOUT

    needs_authkey = True

    @property
    def nprocs(self) -> int:
        return self.servers + self.workers

    def env(self, rank: int, start: JobStart) -> dict[str, str]:
        server = rank < self.servers
        env = {
            ENV_PS_ROLE: "coordinator" if rank == 0 else "server" if server else "worker",
            ENV_PS_ADDRESS: f"127.0.0.1:{start.control_port}",
            ENV_PS_AUTHKEY: start.authkey,
            ENV_PS_WORKERS: str(self.workers),
            ENV_PS_SERVERS: str(self.servers),
            ENV_PS_SERVER_TIMEOUT: str(self.server_timeout),
            job_env.ENV_PROCESS_ID: str(rank),
        }
        if server:
            env[ENV_PS_SERVER_RANK] = str(rank)
            if self.servers > 1:  # the servers' own jax.distributed job; workers stay out of it
                env.update(distributed_env(start.coordinator_port, self.servers, rank, start.heartbeat_timeout))
        return env

    def command(self, rank: int, script: list[str]) -> list[str]:
        """The script on the servers; on the workers the worker process, which gets its program from rank 0."""
        return script if rank < self.servers else ["-m", PS_WORKER_MODULE]

    def role(self, rank: int) -> str:
        return "the parameter server" if rank < self.servers else "a worker"

    @property
    def needed_ranks(self) -> range:
        return range(self.servers)

    def judge_exit(self, rank: int, status: int) -> ExitVerdict:
        if rank < self.servers:
            return ExitVerdict(
                True, f"the parameter server (rank {rank}) exited with status {status_text(status)}; stopping the job."
            )
        if status == EXIT_SERVER_SILENT:
            return ExitVerdict(
                True, f"worker rank {rank} found the parameter server silent (see its output); stopping the job."
            )
        return ExitVerdict(
            False, f"worker rank {rank} exited with status {status_text(status)}; the job goes on without it."
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`meshfit launch`'s arguments for a parameter-server job."""
    group = parser.add_argument_group(f"parameter-server jobs ({USAGE})")
    group.add_argument(
        "--ps",
        type=int,
        default=None,
        help="parameter-server processes (with --workers); the state is partitioned over them",
    )
    group.add_argument("--workers", type=int, default=None, help="worker processes of a parameter-server job")
    group.add_argument(
        "--server-timeout",
        type=float,
        default=DEFAULT_SERVER_TIMEOUT,
        help="seconds a parameter-server worker waits on a silent server before ending the job",
    )


def layout(args: argparse.Namespace) -> ParameterServerJob | None:
    """The job `--ps S --workers N` asks for (S defaults to 1); None without either; a `ValueError` when
    they cannot form one."""
    if args.ps is None and args.workers is None:
        return None
    servers = 1 if args.ps is None else args.ps
    if servers < 1 or not args.workers or args.workers < 1 or args.nprocs is not None:
        raise ValueError(
            f"a parameter-server job takes {USAGE} (S, N >= 1) and no --nprocs; "
            f"received --ps {args.ps} --workers {args.workers} --nprocs {args.nprocs}"
        )
    return ParameterServerJob(servers, args.workers, args.server_timeout)
