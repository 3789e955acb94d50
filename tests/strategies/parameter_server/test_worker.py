"""The worker process's entry point (`python -m meshfit.strategies.parameter_server.worker`).

Its work inside a job is checked end to end in test_processes.py.
"""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # starts real processes (the fast tier leaves these out)


def test_the_worker_started_outside_a_job_says_how_to_start_one():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHFIT_PS_")}
    result = subprocess.run(
        [sys.executable, "-m", "meshfit.strategies.parameter_server.worker"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2
    assert "meshfit launch --ps S --workers N script.py" in result.stderr
    assert "Warning" not in result.stderr  # runpy: the package must not import the worker module itself
