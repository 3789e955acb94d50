"""`meshfit launch`: real processes, output prefixes, failure propagation, a SIGKILLed worker."""

import os
import re
import signal
import sys
import time

from processes import Job, run

WORKERS = os.path.join(os.path.dirname(__file__), "workers")


def launch_cmd(*args):
    return [sys.executable, "-m", "meshfit.cli", "launch", *args]


def test_failure_of_one_process_stops_the_others_and_sets_the_status():
    start = time.monotonic()
    result = run(launch_cmd("--nprocs", "3", "--devices-per-proc", "2", os.path.join(WORKERS, "exit_with.py"), "3"),
                 timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 3
    assert elapsed < 30  # rank 0 and 2 would sleep 120 s if not stopped
    assert "[launch] rank 1 exited with status 3; stopping the other 2 process(es)." in result.stderr
    for rank in range(3):
        assert re.search(rf"^\[rank {rank}\] rank {rank} of 3 at 127\.0\.0\.1:\d+ xla=.*device_count=2",
                         result.stdout, re.M), result.stdout


def test_killed_worker_ends_the_job_with_a_clear_error_in_bounded_time(tmp_path):
    with Job(launch_cmd("--nprocs", "2", "--devices-per-proc", "2", os.path.join(WORKERS, "train_data_parallel.py"),
                        str(tmp_path), "--hang"), timeout=180) as job:
        pids = {int(m.group(1)): int(m.group(2)) for m in job.wait_for(r"\[rank (\d)\] pid (\d+) rank", count=2)}
        job.wait_for(r"\[rank 0\] epoch ", count=2)  # training is under way
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        job.finish(timeout=60)
    proc, err = job.proc, job.stderr
    assert time.monotonic() - killed_at < 30
    assert proc.returncode == 128 + signal.SIGKILL
    assert "[launch] rank 1 exited with status -9 (killed by SIGKILL); stopping the other 1 process(es)." in err
    try:
        os.kill(pids[0], 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, "rank 0 was left running"


def test_launch_requires_a_script():
    result = run(launch_cmd("--nprocs", "2"), timeout=60)
    assert result.returncode == 2
    assert "launch needs a script" in result.stderr
