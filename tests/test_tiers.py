"""The suite's tiers stay true: a test that starts a process without the `processes` mark fails (tests/conftest.py)."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes  # runs the suite's conftest in a pytest of its own

INNER = """
import subprocess, sys

import pytest


def test_unmarked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.processes
def test_marked_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_in_process():
    assert sum(range(4)) == 6
"""


def test_an_unmarked_test_that_starts_a_process_fails_naming_the_mark(tmp_path):
    shutil.copy(os.path.join(os.path.dirname(__file__), "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(INNER)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp_path), "-q", "-n", "0", "-p", "no:cacheprovider", "-rf"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "1 failed, 2 passed" in said, said
    assert "test_unmarked_starts_a_process started a process (subprocess.Popen) but is not marked `processes`" in said
