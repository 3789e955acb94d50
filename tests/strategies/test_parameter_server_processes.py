"""ParameterServerStrategy with worker processes under `meshfit launch --ps 1 --workers 3`."""

import os
import re
import signal
import subprocess
import sys
import time

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "parameter_server.py")


def test_a_killed_worker_is_dropped_and_training_finishes_with_accuracy():
    proc = subprocess.Popen([sys.executable, "-m", "meshfit.cli", "launch", "--ps", "1", "--workers", "3",
                             EXAMPLE, "--epochs", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers, killed = {}, None
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        lines.append(line)
        match = re.match(r"\[rank (\d)\] parameter-server worker pid (\d+) connected", line)
        if match:
            workers[int(match.group(1))] = int(match.group(2))
        if killed is None and line.startswith("[rank 0] Epoch 4/20"):
            time.sleep(0.05)  # mid-epoch
            os.kill(workers[2], signal.SIGKILL)
            killed = time.monotonic()
        if time.monotonic() > deadline:
            proc.kill()
            break
    out = "".join(lines)
    _, err = proc.communicate(timeout=60)
    assert sorted(workers) == [1, 2, 3], out[-2000:]
    assert killed is not None, out[-3000:]
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "[launch] worker rank 2 exited with status -9 (killed by SIGKILL); the job goes on without it." in err
    assert "its batch is redone elsewhere" in out
    assert "[rank 0] Epoch 20/20" in out  # all epochs ran
    accuracy = float(re.search(r"\[rank 0\] test accuracy: ([\d.]+)", out).group(1))
    assert accuracy >= 0.95, out[-2000:]


def test_a_dead_parameter_server_fails_the_job_and_restarts_resume_from_the_backup(tmp_path):
    worker = os.path.join(os.path.dirname(__file__), "..", "workers", "train_ps.py")
    result = subprocess.run([sys.executable, "-m", "meshfit.cli", "launch", "--ps", "1", "--workers", "2",
                             "--max-restarts", "1", worker, str(tmp_path / "backup"), "--die-at-step", "75"],
                            capture_output=True, text=True, timeout=400)
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, out[-3000:] + err[-3000:]
    assert "[launch] the parameter server (rank 0) exited with status -9 (killed by SIGKILL)" in err
    assert "[launch] restarting the job (1/1)." in err
    # Backups every 10 steps, written asynchronously: the one at step 70 may still have been in flight.
    assert re.search(r"\[rank 0\] BackupAndRestore: resumed .* \(step (60|70)\)", out), out[-2000:]
    summary = re.search(r"\[rank 0\] epochs (\d+) last (\d+) test accuracy: ([\d.]+)", out)
    assert summary and int(summary.group(2)) == 11  # all 12 epochs done, counting those before the crash
    assert float(summary.group(3)) >= 0.95
