"""The bound on SIGTERM and SIGINT: a fit that hangs (input, a step stuck in C) still ends in time, its backups intact.

Real child processes (tests/workers/hang_in_fit.py) hang after step 3 with a backup after every batch; the
signals are real, the hang is real (a FIFO no one writes; `sigwait` in C on the main thread).
"""

import os
import re
import signal
import sys
import time

import pytest
from processes import Job

import meshfit as mf

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "hang_in_fit.py")
TIMEOUT = 2.0  # the workers' preemption_timeout
MARGIN = 4.0  # seconds past the bound a loaded machine may take to end the process


def hang(tmp_path, how, first, *, again_after=None, timeout=TIMEOUT):
    """Starts a worker that hangs after step 3, sends `first` (again after `again_after` s); returns
    (status, seconds from the first signal to the end, stderr)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    argv = [sys.executable, WORKER, str(tmp_path / "backup"), how, str(fifo), "--timeout", str(timeout)]
    with Job(argv, timeout=120) as job:
        job.wait_for(r"step 3$")
        job.wait_for(r"hanging$")
        time.sleep(0.3)  # into the hang
        sent = time.monotonic()
        job.proc.send_signal(first)
        if again_after is not None:
            time.sleep(again_after)
            job.proc.send_signal(first)
        status = job.finish()
        took = time.monotonic() - sent
    return status, took, job.stderr


def resumed_step(tmp_path) -> int:
    """Resumes from the backups in a new process; the step it resumed from (the newest complete backup)."""
    argv = [sys.executable, WORKER, str(tmp_path / "backup"), "none", str(tmp_path / "fifo")]
    with Job(argv, timeout=120) as job:
        status = job.finish()
    assert status == 0, job.stderr[-3000:]
    return int(re.search(r"BackupAndRestore: resumed from .* \(step (\d+)\)", job.stdout).group(1))


def listed_steps(tmp_path) -> list[int]:
    return sorted(int(p) for p in os.listdir(tmp_path / "backup") if p.isdigit())


@pytest.mark.slow
def test_sigterm_while_waiting_for_input_exits_143_within_the_bound_and_the_last_backup_restores(tmp_path):
    status, took, stderr = hang(tmp_path, "input", signal.SIGTERM)
    assert status == mf.PREEMPTED_EXIT_CODE == 143, stderr[-3000:]
    assert TIMEOUT <= took < TIMEOUT + MARGIN, took
    assert "SIGTERM: no step boundary came within 2 s of the SIGTERM (waiting for input; after step 3" in stderr
    assert "without saving" in stderr
    newest = listed_steps(tmp_path)[-1]
    assert newest == 3  # saved after every batch; nothing after the hang, nothing half-written listed
    assert resumed_step(tmp_path) == newest


@pytest.mark.slow
def test_sigint_with_the_main_thread_stuck_in_c_exits_130_within_the_bound(tmp_path):
    """No KeyboardInterrupt can surface while the main thread waits in C; the bound ends the process."""
    status, took, stderr = hang(tmp_path, "step", signal.SIGINT)
    assert status == 130, stderr[-3000:]
    assert TIMEOUT <= took < TIMEOUT + MARGIN, took
    assert "SIGINT: training did not stop within 2 s of the SIGINT" in stderr
    assert "main thread at signal.py" in stderr and "in sigwait" in stderr, stderr  # where it was stuck
    newest = listed_steps(tmp_path)[-1]
    assert newest >= 2  # the step-3 backup may have waited for the stuck step
    assert resumed_step(tmp_path) == newest


@pytest.mark.slow
def test_a_second_sigterm_ends_a_stuck_process_at_once(tmp_path):
    status, took, stderr = hang(tmp_path, "step", signal.SIGTERM, again_after=1.2, timeout=60)
    assert status == 143, stderr[-3000:]
    assert took < 1.2 + MARGIN, took  # not the 60 s bound
    assert "SIGTERM: a second SIGTERM came 1." in stderr


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "30", True])
def test_preemption_timeout_must_be_a_positive_number_of_seconds(tmp_path, bad):
    with pytest.raises(ValueError, match=r"`preemption_timeout` must be a positive number .* Received: "):
        mf.callbacks.BackupAndRestore(tmp_path / "backup", preemption_timeout=bad)


def test_preemption_timeout_none_means_no_bound(tmp_path):
    backup = mf.callbacks.BackupAndRestore(tmp_path / "backup", preemption_timeout=None)
    assert backup.preemption_timeout is None
    assert mf.callbacks.BackupAndRestore(tmp_path / "b").preemption_timeout == 25.0
