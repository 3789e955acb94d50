"""safe_files: no write through a planted symlink, FIFO or hard link; a FIFO never hangs a reader."""

import os
import re

import pytest

from meshfit.checkpointing import safe_files


@pytest.fixture
def outside(tmp_path):
    (tmp_path / "outside").mkdir()
    victim = tmp_path / "outside" / "victim"
    victim.write_bytes(b"precious")
    return victim


def test_write_new_never_writes_through_a_symlink_and_replaces_a_leftover_regular_file(tmp_path, outside):
    path = tmp_path / ".meshfit-probe-1"
    os.symlink(outside, path)
    with pytest.raises(safe_files.PlantedFile, match=rf"at '{re.escape(str(path))}'. Received: a symlink"):
        safe_files.write_new(str(path), b"ok")
    assert outside.read_bytes() == b"precious" and os.path.islink(path)
    os.unlink(path)
    path.write_bytes(b"left by a crashed process with this pid")
    safe_files.write_new(str(path), b"ok")
    assert path.read_bytes() == b"ok"


def test_replace_onto_a_symlink_is_refused_and_onto_a_regular_file_or_nothing_works(tmp_path, outside):
    source, target = tmp_path / "new", tmp_path / "marker"
    source.write_bytes(b"new")
    os.symlink(outside, target)
    with pytest.raises(safe_files.PlantedFile, match="marker"):
        safe_files.replace(str(source), str(target))
    assert os.path.islink(target) and outside.read_bytes() == b"precious"
    os.unlink(target)
    safe_files.replace(str(source), str(target))
    (tmp_path / "newer").write_bytes(b"newer")
    safe_files.replace(str(tmp_path / "newer"), str(target))
    assert target.read_bytes() == b"newer"


def test_a_fifo_is_refused_at_once_for_reading_and_writing(tmp_path):
    fifo = tmp_path / "meshfit_checkpoints.json"
    os.mkfifo(fifo)  # opening it plainly would block until someone opens the other end
    with pytest.raises(safe_files.PlantedFile, match="FIFO"):
        safe_files.read_regular(str(fifo), 4096)
    with pytest.raises(safe_files.PlantedFile, match="FIFO"):
        safe_files.open_regular(str(fifo), os.O_WRONLY)
    with pytest.raises(safe_files.PlantedFile, match="FIFO"):
        safe_files.write_new(str(fifo), b"{}")


def test_a_hard_link_is_read_but_never_written(tmp_path, outside):
    link = tmp_path / ".meshfit.lock"
    os.link(outside, link)
    assert safe_files.read_regular(str(link), 100) == b"precious"  # copies made with `cp -al` stay readable
    with pytest.raises(safe_files.PlantedFile, match="hard link"):
        safe_files.open_regular(str(link), os.O_WRONLY)
    assert outside.read_bytes() == b"precious"


def test_refuse_symlinks_names_every_link_and_only_links(tmp_path, outside):
    (tmp_path / "regular").write_bytes(b"")
    os.symlink(outside, tmp_path / "a")
    os.symlink(tmp_path / "missing", tmp_path / "b")  # dangling: still a link
    with pytest.raises(safe_files.PlantedFile, match=r"/a', '.*/b'. Received: symlinks"):
        safe_files.refuse_symlinks(str(tmp_path), ["regular", "a", "b", "absent"])
    safe_files.refuse_symlinks(str(tmp_path), ["regular", "absent"])


def test_o_trunc_is_refused_before_anything_is_opened(tmp_path, outside):
    with pytest.raises(ValueError, match="without O_TRUNC"):
        safe_files.open_regular(str(outside), os.O_WRONLY | os.O_TRUNC)
    assert outside.read_bytes() == b"precious"
