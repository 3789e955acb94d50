"""One 2-process `meshfit launch` job shared by the data-parallel tests of this folder."""

import os
import re
import sys

import pytest
from processes import run

WORKER = os.path.join(os.path.dirname(__file__), "..", "workers", "train_data_parallel.py")

#: The trainings of the shared job, one after the other in the same processes: name -> the worker's options.
TRAININGS = {
    "spe1": "--steps-per-execution 1",
    "spe3": "--steps-per-execution 3",
    "bf16": "--compression bf16 --epochs 1",
    "mesh": "--strategy mesh",
    "custom": "--custom-step --n 160 --batch-size 16",  # every batch full: 4 replicas, 128 + 32 rows
    "keras": "--keras --epochs 2",  # (a space: argparse reads it as --each's value, not an option)
}


class TwoProcessJob:
    """The finished job: `result` (its whole output), and per training its folder and its output lines."""

    def __init__(self, result, out):
        self.result, self.out = result, out
        self._lines = {name: [] for name in TRAININGS}
        current = {}  # rank -> the training its lines belong to
        for line in result.stdout.splitlines():
            ranked = re.match(r"\[rank (\d+)\] (.*)", line)
            if not ranked:
                continue
            started = re.fullmatch(r"training (\w+)", ranked.group(2))
            if started:
                current[ranked.group(1)] = started.group(1)
            elif ranked.group(1) in current:
                self._lines[current[ranked.group(1)]].append(line)

    def folder(self, name):
        """Where training `name` wrote params.npz and history_<rank>.json."""
        return self.out / name

    def lines(self, name):
        """The lines both ranks printed during training `name`, each with its `[rank N] ` prefix."""
        return self._lines[name]


@pytest.fixture(scope="session")
def two_process_job(tmp_path_factory):
    """`meshfit launch --nprocs 2 --devices-per-proc 2` of tests/workers/train_data_parallel.py training a fresh
    model for each of TRAININGS in turn: the processes start, join the job and end once for all of them (~15 s
    each time on 2 cores) rather than once per test."""
    out = tmp_path_factory.mktemp("two_processes")
    each = [arg for name, options in TRAININGS.items() for arg in ("--each", name, options)]
    cmd = [sys.executable, "-m", "meshfit.cli", "launch", "--nprocs", "2", "--devices-per-proc", "2"]
    result = run(cmd + [WORKER, str(out), *each], timeout=360)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job = TwoProcessJob(result, out)
    assert all(job.lines(name) for name in TRAININGS), result.stdout[-3000:]
    return job
