"""The bound on SIGTERM and SIGINT: a fit that hangs (input, a step stuck in C) still ends in time, its backups intact.

Real child processes (tests/workers/hang_in_fit.py) hang after step 3 with a backup after every batch; the
signals are real, the hang is real (a FIFO no one writes; `sigwait` in C on the main thread). In 2-rank
`meshfit launch` jobs (tests/workers/train_resumable.py) one rank hangs in a callback and the other waits in
the next collective, where JAX's preemption handler owns SIGTERM; the SIGTERM goes to the launcher.
"""

import hashlib
import os
import re
import signal
import sys
import time

import pytest
from processes import LAUNCH, Job, alive

import meshfit as mf

pytestmark = pytest.mark.processes  # starts real processes: the tier CI runs after the README's

WORKERS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers")
WORKER = os.path.join(WORKERS, "hang_in_fit.py")
TRAINER = os.path.join(WORKERS, "train_resumable.py")  # 2 ranks: a backup every 3 steps
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


# -- 2 ranks under `meshfit launch`: one hangs, the other waits for it in a collective -------------------


def two_ranks(tmp_path, *more, hang: bool = True):
    """`meshfit launch` of a 2-rank job, a backup every 3 steps, whose rank 1 hangs in a callback after step 5
    (rank 0 then waits for it in step 6's collective) if `hang`."""
    fifo = tmp_path / "fifo"
    if hang:
        os.mkfifo(fifo)
    argv = LAUNCH + [
        "--nprocs",
        "2",
        "--devices-per-proc",
        "2",
        *more,
        TRAINER,
        str(tmp_path / "out"),
        str(tmp_path / "backup"),
        "--strategy",
        "multi_worker",
        "--preemption-timeout",
        str(TIMEOUT),
    ]
    return argv + ["--hang-at-step", "5", str(fifo), "--hang-rank", "1"] if hang else argv


def digest(directory) -> str:
    """One hash of every file's path and bytes under `directory`."""
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(directory)):
        for name in sorted(files):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, directory).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def sigterm_to_the_launcher_in_a_hang(tmp_path, grace: float, stop_rank_one: bool = False):
    """Runs `two_ranks` until rank 1 hangs and the step-3 backup is complete (SIGSTOPs rank 1 with
    `stop_rank_one`), then sends the launcher SIGTERM. Returns (status, seconds from the SIGTERM to the
    launcher's end, the ranks' pids, the job, the step-3 backup's digest when the SIGTERM was sent)."""
    with Job(two_ranks(tmp_path, "--grace-period", str(grace)), timeout=120) as job:
        pids = {int(m[1]): int(m[2]) for m in job.wait_for(r"\[rank (\d)\] pid (\d+) fitting", count=2)}
        job.wait_for(r"\[rank 1\] hanging at step 5$")
        end = time.monotonic() + 30
        while listed_steps(tmp_path) != [3] and time.monotonic() < end:  # its commit may still be on its way
            time.sleep(0.1)
        assert listed_steps(tmp_path) == [3], os.listdir(tmp_path / "backup")
        before = digest(tmp_path / "backup" / "3")
        if stop_rank_one:
            os.kill(pids[1], signal.SIGSTOP)
        time.sleep(0.3)  # rank 0 into the collective
        sent = time.monotonic()
        job.proc.send_signal(signal.SIGTERM)
        status = job.finish(timeout=60)
        took = time.monotonic() - sent
    return status, took, pids, job, before


@pytest.mark.slow
def test_sigterm_to_the_launcher_ends_a_job_whose_rank_hangs_within_the_bound_and_it_resumes(tmp_path):
    """Rank 1 stuck in a callback, rank 0 in a collective: each rank's own bound ends it with 143, the
    launcher with 143; no step-6 backup, and a new job resumes from the step-3 one."""
    status, took, pids, job, _ = sigterm_to_the_launcher_in_a_hang(tmp_path, grace=60)
    assert status == 143, job.stderr[-3000:]
    assert TIMEOUT <= took < TIMEOUT + MARGIN, took  # the ranks' bound, not the launcher's 60 s grace
    out = job.stdout
    assert "[rank 1] meshfit: SIGTERM: no step boundary came within 2 s of the SIGTERM (in a callback" in out, out
    assert "[rank 0] meshfit: SIGTERM: no step boundary came within 2 s of the SIGTERM" in out, out
    assert "[launch] rank 0 ended with status 143.\n[launch] rank 1 ended with status 143." in job.stderr, job.stderr
    assert not [pid for pid in pids.values() if alive(pid)], "a rank outlived the launcher"
    assert listed_steps(tmp_path) == [3]
    with Job(two_ranks(tmp_path, hang=False), timeout=120) as resumed:
        match = resumed.wait_for(r"\[rank 0\] BackupAndRestore: resumed from .* \(step (\d+)\)\.$")[0]
    assert int(match[1]) == 3


@pytest.mark.slow
def test_sigterm_to_the_launcher_ends_a_job_with_a_stopped_rank_after_the_grace_period(tmp_path):
    """Rank 1 SIGSTOPped (it cannot run its handler): rank 0 ends by its bound, the launcher SIGKILLs rank 1
    after --grace-period and exits 143; the step-3 backup is byte for byte what it was."""
    grace = TIMEOUT + 1.0
    status, took, pids, job, before = sigterm_to_the_launcher_in_a_hang(tmp_path, grace=grace, stop_rank_one=True)
    assert status == 143, job.stderr[-3000:]
    assert grace <= took < grace + MARGIN, took
    assert "[rank 0] meshfit: SIGTERM: no step boundary came within 2 s of the SIGTERM" in job.stdout, job.stdout
    err = job.stderr
    assert "[launch] rank(s) [1] did not end within the grace period and were killed." in err, err
    assert "[launch] rank 0 ended with status 143." in err and "rank 1 ended with status -9 (killed by SIGKILL)." in err
    assert not [pid for pid in pids.values() if alive(pid)], "a rank outlived the launcher"
    assert listed_steps(tmp_path) == [3] and digest(tmp_path / "backup" / "3") == before
