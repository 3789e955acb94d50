"""meshfit.runtime.job_layout: the plain jax.distributed job's ranks, and how the launcher judges their exits."""

import io
import os
import subprocess
import sys

import pytest

from meshfit.cli import _layout as layout_from_args
from meshfit.cli import _parser
from meshfit.launch import local as launch
from meshfit.runtime import job_env
from meshfit.runtime.job_layout import DistributedJob, JobStart
from meshfit.strategies.parameter_server.launcher import ParameterServerJob

pytestmark = pytest.mark.processes  # starts real processes: the tier CI runs after the README's

START = JobStart(coordinator_port=1111, control_port=2222, heartbeat_timeout=7)


def test_every_rank_of_a_distributed_job_runs_the_script_in_one_jax_job():
    job = DistributedJob(3)
    envs = [job.env(rank, START) for rank in range(3)]
    assert [env[job_env.ENV_PROCESS_ID] for env in envs] == ["0", "1", "2"]
    assert {
        (env[job_env.ENV_COORDINATOR], env[job_env.ENV_NUM_PROCESSES], env[job_env.ENV_HEARTBEAT]) for env in envs
    } == {("127.0.0.1:1111", "3", "7")}
    assert job.command(1, ["train.py", "--epochs", "2"]) == ["train.py", "--epochs", "2"]
    assert job.needed_ranks == range(3) and not job.needs_authkey
    verdict = job.judge_exit(1, -9)
    assert verdict.ends_job and verdict.message == (
        "rank 1 exited with status -9 (killed by SIGKILL); stopping the other 2 process(es)."
    )


class _Finished:
    """`launch._Exits` for ranks that have already ended, in this order."""

    def __init__(self, order):
        self.order = order

    def wait(self, timeout):
        return list(self.order)


class _Signals:
    received = None


def watch(layout, order):
    """The launcher's verdict on a job whose ranks ended in `order` ((rank, status), first first), and its log."""
    config = launch.LaunchConfig(command=["train.py"], layout=layout)
    running = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(layout.nprocs)]
    for proc in running:
        proc.wait()
    log = io.StringIO()
    return launch._watch(config, running, _Finished(order), _Signals(), log), log.getvalue()


def test_the_first_failure_of_a_distributed_job_ends_it_and_success_needs_every_rank():
    status, log = watch(DistributedJob(2), [(0, 0), (1, 3)])
    assert status == 3 and log == "[launch] rank 1 exited with status 3; stopping the other 1 process(es).\n"
    assert watch(DistributedJob(2), [(1, 0), (0, 0)]) == (0, "")


def test_a_parameter_server_job_goes_on_without_a_lost_worker_and_ends_with_its_servers():
    status, log = watch(ParameterServerJob(servers=1, workers=2), [(2, -9), (0, 0)])
    assert status == 0
    assert log == "[launch] worker rank 2 exited with status -9 (killed by SIGKILL); the job goes on without it.\n"
    status, log = watch(ParameterServerJob(servers=2, workers=1), [(1, 1)])
    assert status == 1 and log == "[launch] the parameter server (rank 1) exited with status 1; stopping the job.\n"


def test_ranks_the_job_can_lose_are_judged_before_those_it_needs_within_one_look():
    status, log = watch(ParameterServerJob(servers=1, workers=2), [(0, 1), (1, -9), (2, 3)])
    assert status == 3
    assert log.splitlines() == [
        "[launch] worker rank 1 exited with status -9 (killed by SIGKILL); the job goes on without it.",
        "[launch] worker rank 2 found the parameter server silent (see its output); stopping the job.",
    ]


def test_the_command_line_picks_the_layout():
    parse = _parser().parse_args
    assert layout_from_args(parse(["launch", "--nprocs", "3", "train.py"])) == DistributedJob(3)
    assert layout_from_args(parse(["launch", "--ps", "2", "--workers", "3", "train.py"])) == ParameterServerJob(2, 3)
    assert layout_from_args(parse(["launch", "--workers", "2", "--server-timeout", "5", "x.py"])) == (
        ParameterServerJob(1, 2, server_timeout=5.0)
    )


def test_launch_without_a_job_size_names_every_kind_of_job():
    result = subprocess.run(
        [sys.executable, "-m", "meshfit.cli", "launch", "train.py"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert result.returncode == 2
    assert "launch needs --nprocs N, or --ps S --workers N" in result.stderr
