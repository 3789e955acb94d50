"""One writer per checkpoint directory: a live holder (another process, or this one) is refused by name;
the lock of a SIGKILLed holder is stale and taken over."""

import os
import signal
import sys
import textwrap

import pytest
from processes import Job

from meshfit.checkpointing import safe_files
from meshfit.checkpointing.checkpoint import CheckpointDir
from meshfit.checkpointing.dirlock import LOCK_NAME, DirectoryLock, DirectoryLocked

HOLDER = textwrap.dedent("""
    import os, sys, time
    from meshfit.checkpointing.dirlock import DirectoryLock
    DirectoryLock(sys.argv[1]).acquire()
    print(f"holding as {os.getpid()}", flush=True)
    time.sleep(120)
""")


@pytest.mark.processes
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


@pytest.mark.parametrize("plant", ["symlink", "fifo", "hard link"])
def test_a_planted_lock_file_is_refused_and_nothing_outside_changes(tmp_path, plant):
    """A symlink, FIFO or hard link at the lock's name (planted after any check of the directory) is never
    written through, and opening a FIFO does not hang."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "d").mkdir()
    lock_path = tmp_path / "d" / LOCK_NAME
    {"symlink": os.symlink, "hard link": os.link}.get(plant, lambda _, path: os.mkfifo(path))(victim, lock_path)
    with pytest.raises(safe_files.PlantedFile, match=rf"{LOCK_NAME}'. Received: a symlink or another kind"):
        DirectoryLock(str(tmp_path / "d")).acquire()
    assert victim.read_bytes() == b"precious"
    assert os.path.lexists(lock_path)  # left as it was, for its owner to look at
