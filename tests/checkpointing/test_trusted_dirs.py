"""Directories meshfit trusts: made 0700; an existing one only if it is the user's and no one else can write to it.

Another user is "nobody" (uid 65534): the suite runs as root, which may chown; a job run as that user (setpriv)
shows the check holds for an ordinary user too.
"""

import os
import shutil
import stat
import subprocess
import tempfile

import pytest

from meshfit.checkpointing import trusted_dirs
from meshfit.checkpointing.trusted_dirs import UntrustedDirectory

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_ensure_makes_a_missing_directory_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        made = trusted_dirs.ensure(tmp_path / "a" / "b", "backup directory")
    finally:
        os.umask(old)
    assert made == str(tmp_path / "a" / "b") and mode(made) == 0o700
    assert mode(tmp_path / "a") == 0o755  # a missing parent: never writable by others either
    assert trusted_dirs.ensure(made) == made  # one of the user's, used again


@as_root
def test_another_user_s_directory_is_refused_naming_it_its_owner_and_mode(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UntrustedDirectory) as refusal:
        trusted_dirs.ensure(theirs, "backup directory")
    message = str(refusal.value)
    assert f"backup directory {str(theirs)!r}" in message and "uid 65534 (nobody), not to you (uid 0" in message
    assert "Choose a directory of your own" in message and len(message.splitlines()) <= 3
    assert os.listdir(theirs) == []


@pytest.mark.parametrize("bits", [0o777, 0o770, 0o702])
def test_a_directory_others_can_write_to_is_refused_with_the_chmod_that_fixes_it(tmp_path, bits):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, bits)
    with pytest.raises(UntrustedDirectory, match=rf"others can write to it \(mode 0{bits:o}\)") as refusal:
        trusted_dirs.check(shared, "compilation cache")
    assert f"chmod go-w {shared}" in str(refusal.value)
    os.chmod(shared, 0o755)
    trusted_dirs.check(shared)  # fixed as told: accepted


def test_a_symlink_in_the_directory_s_place_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UntrustedDirectory, match="it is a symlink") as refusal:
        trusted_dirs.ensure(tmp_path / "link")
    assert repr(str(tmp_path / "real")) in str(refusal.value)


def test_a_parent_everyone_can_write_to_needs_the_sticky_bit(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(UntrustedDirectory, match="where anyone can replace it"):
        trusted_dirs.ensure(parent / "backup")
    assert os.listdir(parent) == []
    os.chmod(parent, 0o1777)  # as /tmp: only an entry's owner may rename it
    assert mode(trusted_dirs.ensure(parent / "backup")) == 0o700


def test_a_file_in_the_directory_s_place_is_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        trusted_dirs.ensure(tmp_path / "file")


SYSTEM_PYTHON = "/usr/bin/python3"  # an ordinary user may run it (the suite's Python may lie under /root)


@as_root
@pytest.mark.skipif(not shutil.which("setpriv") or not os.path.exists(SYSTEM_PYTHON), reason="needs setpriv")
def test_a_job_run_by_an_ordinary_user_refuses_root_s_directory_and_makes_its_own_0700():
    """trusted_dirs needs only the standard library, so an ordinary user's Python loads it from its file."""
    base = tempfile.mkdtemp()  # under /tmp: reachable by nobody once opened
    try:
        os.chmod(base, 0o755)
        home, roots = os.path.join(base, "home"), os.path.join(base, "roots")
        os.mkdir(home)
        os.chown(home, NOBODY, NOBODY)
        os.mkdir(roots, 0o755)
        code = (
            "import importlib.util, os, sys\n"
            "spec = importlib.util.spec_from_file_location('trusted_dirs', sys.argv[1])\n"
            "t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)\n"
            "try:\n    t.ensure(sys.argv[2])\nexcept t.UntrustedDirectory as e:\n    print(e)\n"
            "print(oct(os.stat(t.ensure(sys.argv[3])).st_mode & 0o777))\n"
        )
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-c", code]
            + [trusted_dirs.__file__, roots, os.path.join(home, "backup")],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", "HOME": home},
            cwd=home,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "belongs to uid 0 (root), not to you (uid 65534 (nobody))" in done.stdout
        assert done.stdout.strip().endswith("0o700")
        assert os.stat(os.path.join(home, "backup")).st_uid == NOBODY
    finally:
        shutil.rmtree(base)


def test_others_can_write_says_why_for_a_warning(tmp_path):
    assert trusted_dirs.others_can_write(tmp_path) is None
    os.chmod(tmp_path, 0o777)
    try:
        assert "others can write to it (mode 0777)" in trusted_dirs.others_can_write(tmp_path)
    finally:
        os.chmod(tmp_path, 0o700)
