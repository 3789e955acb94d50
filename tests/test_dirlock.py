"""One writer per checkpoint directory: a live holder (another process, or this one) is refused by name;
the lock of a SIGKILLed holder is stale and taken over."""

import os
import signal
import sys
import textwrap

import pytest
from processes import Job

from meshfit.checkpoint import CheckpointDir
from meshfit.dirlock import LOCK_NAME, DirectoryLock, DirectoryLocked

HOLDER = textwrap.dedent("""
    import os, sys, time
    from meshfit.dirlock import DirectoryLock
    DirectoryLock(sys.argv[1]).acquire()
    print(f"holding as {os.getpid()}", flush=True)
    time.sleep(120)
""")


def test_a_live_process_holding_the_directory_is_refused_by_name_and_a_killed_one_is_taken_over(tmp_path):
    with Job([sys.executable, "-c", HOLDER, str(tmp_path)], timeout=60) as holder:
        pid = int(holder.wait_for(r"holding as (\d+)")[0].group(1))
        with pytest.raises(DirectoryLocked, match=rf"being written by another process: pid {pid} on host"):
            DirectoryLock(str(tmp_path)).acquire()
        os.kill(pid, signal.SIGKILL)
        holder.finish()
    assert (tmp_path / LOCK_NAME).exists()  # left behind by the killed holder: stale
    lock = DirectoryLock(str(tmp_path)).acquire()
    assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_NAME).read_text()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_two_writers_in_one_process_are_refused_and_the_lock_is_released_on_close(tmp_path):
    first = CheckpointDir(tmp_path / "b", "backup")
    with pytest.raises(DirectoryLocked, match=f"pid {os.getpid()}"):
        CheckpointDir(tmp_path / "b", "backup")
    reader = CheckpointDir(tmp_path / "b", "backup", read_only=True)  # readers take no lock
    reader.close()
    first.close()
    CheckpointDir(tmp_path / "b", "backup").close()
    assert not (tmp_path / "b" / LOCK_NAME).exists()
