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

pytestmark = pytest.mark.processes  # starts real processes: the tier CI runs after the README's

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


@pytest.mark.parametrize("bits, who", [(0o777, "anyone"), (0o775, "its group"), (0o770, "its group")])
def test_a_parent_others_or_its_group_can_write_to_needs_the_sticky_bit(tmp_path, bits, who):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, bits)
    for attempt in (trusted_dirs.check, trusted_dirs.ensure):
        with pytest.raises(UntrustedDirectory) as refusal:
            attempt(parent / "backup", "backup directory")
        message = str(refusal.value)
        assert f"{str(parent)!r} above it (uid 0 (root), mode 0{bits:o}) lets {who} rename entries" in message
        assert f"have {parent} owned by you or root (and chmod +t" in message and len(message.splitlines()) <= 3
    assert os.listdir(parent) == []
    os.chmod(parent, 0o1000 | bits)  # as /tmp: only an entry's owner (or the parent's, or root) may rename it
    assert mode(trusted_dirs.ensure(parent / "backup")) == 0o700


def test_a_root_owned_sticky_parent_everyone_can_write_to_is_accepted_as_tmp_is(tmp_path):
    parent = tmp_path / "tmp"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    made = trusted_dirs.ensure(parent / "run1", "backup directory")
    assert mode(made) == 0o700
    trusted_dirs.check(made)
    assert trusted_dirs.others_can_write(made) is None


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


# -- the directories above: nobody but the user and root may rename entries in them ----------------------------

OTHER = 1234  # the second local user (an attacker), no login name


@as_root
@pytest.mark.parametrize("bits", [0o1777, 0o755])
@pytest.mark.parametrize("depth", ["parent", "grandparent"])
def test_a_directory_under_another_user_s_parent_is_refused_naming_the_parent_and_its_owner(tmp_path, bits, depth):
    """`parent` of uid 1234 (1777 as a shared /tmp, or 0755: a job run as root) holds root's `run1`: its owner may
    rename `run1` away and put a link in its place, so `run1` is refused, however deep below it lies."""
    parent = tmp_path / "parent"
    parent.mkdir()
    os.chmod(parent, bits)
    os.chown(parent, OTHER, OTHER)
    above = parent if depth == "parent" else parent / "root-s"
    above.mkdir(mode=0o755, exist_ok=True)
    run1 = above / "run1"
    run1.mkdir(mode=0o700)
    for attempt in (trusted_dirs.check, trusted_dirs.ensure):
        with pytest.raises(UntrustedDirectory) as refusal:
            attempt(run1, "backup directory")
        message = str(refusal.value)
        assert f"Expected every directory above backup directory {str(run1)!r}" in message
        assert f"{str(parent)!r} above it belongs to uid 1234 (mode {bits:04o})" in message
        assert "Choose a directory under your home or $XDG_RUNTIME_DIR" in message
        assert f"have {parent} owned by you or root" in message and len(message.splitlines()) <= 3
    with pytest.raises(UntrustedDirectory, match="belongs to uid 1234"):
        trusted_dirs.ensure(above / "missing" / "run2")  # refused before anything is made
    assert not (above / "missing").exists() and os.listdir(run1) == []
    assert f"{str(parent)!r} above it belongs to uid 1234" in trusted_dirs.others_can_write(run1)
    os.chown(parent, 0, 0)  # fixed as told: root's (and sticky where others may write)
    assert trusted_dirs.ensure(run1) == str(run1) and trusted_dirs.others_can_write(run1) is None


@as_root
def test_a_symlink_on_the_path_owned_by_another_user_is_refused(tmp_path):
    """root's `real` reached through `via`, a link of uid 1234 (its owner could point it elsewhere)."""
    (tmp_path / "real").mkdir(mode=0o755)
    via = tmp_path / "via"
    via.symlink_to(tmp_path / "real")
    os.lchown(via, OTHER, OTHER)
    with pytest.raises(UntrustedDirectory) as refusal:
        trusted_dirs.ensure(via / "run1", "backup directory")
    assert f"{str(via)!r} on its path is a symlink (to {str(tmp_path / 'real')!r}) of uid 1234" in str(refusal.value)
    assert os.listdir(tmp_path / "real") == []
    os.lchown(via, 0, 0)  # root's link to root's directory: accepted
    assert trusted_dirs.ensure(via / "run1") == str(via / "run1")


@as_root
def test_a_root_owned_symlinked_ancestor_into_another_user_s_directory_is_refused(tmp_path):
    """`via` is root's, but it leads into `theirs/sub`, and `theirs` (uid 1234) could swap `sub`: the path it
    resolves to is checked as well as the one written."""
    theirs = tmp_path / "theirs"
    (theirs / "sub").mkdir(parents=True)
    os.chmod(theirs, 0o755)
    os.chown(theirs, OTHER, OTHER)
    via = tmp_path / "via"
    via.symlink_to(theirs / "sub")
    with pytest.raises(UntrustedDirectory) as refusal:
        trusted_dirs.ensure(via / "run1", "compilation cache")
    assert f"{str(theirs)!r} above it belongs to uid 1234 (mode 0755)" in str(refusal.value)
    assert os.listdir(theirs / "sub") == []
    (theirs / "sub" / "run1").mkdir(mode=0o700)  # root's: were it there, a warning would say why as well
    assert f"{str(theirs)!r} above it belongs to uid 1234" in trusted_dirs.others_can_write(via / "run1")


# -- end to end: a fit whose backup directory another user could swap ----------------------------------------


def _as_other(*argv: str) -> subprocess.CompletedProcess:
    """Runs `argv` as uid 1234 (no groups): what the attacker can do."""
    return subprocess.run(
        ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
    )


@pytest.fixture
def reachable():
    """A root-owned directory under /tmp that uid 1234 may enter (pytest's tmp_path is 0700)."""
    base = tempfile.mkdtemp()
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base)


@pytest.mark.slow
@as_root
@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv")
def test_fit_refuses_a_backup_directory_another_user_could_swap_before_any_step(reachable):
    """The attack: `parent` is uid 1234's (1777, as a shared scratch directory); the job backs up into
    `parent/run1`. Mid-fit the attacker renames `run1` away and puts a link to root's `victim` (holding checkpoint
    names `100`, `200`) in its place: later backups would be written there and, at the end of the fit, its
    checkpoints deleted. `fit` refuses `parent/run1` before any step, so no swap can follow a check; `victim`
    keeps its files and nothing is written into `parent`. The swap itself is shown to work as that user."""
    from helpers import MLP, classification_data

    import meshfit as mf

    parent, victim = os.path.join(reachable, "parent"), os.path.join(reachable, "victim")
    os.mkdir(parent)
    os.chmod(parent, 0o1777)
    os.chown(parent, OTHER, OTHER)
    os.mkdir(victim, 0o700)
    for step in ("100", "200"):
        os.mkdir(os.path.join(victim, step))
        with open(os.path.join(victim, step, "x"), "w") as f:
            f.write(f"root's checkpoint {step}")

    swapped = []

    class SwapAtStep(mf.callbacks.Callback):
        """The attacker's move, made as uid 1234 after the first step (were there one)."""

        def on_train_batch_end(self, batch, logs=None):
            if not swapped:
                script = 'mv "$1/run1" "$1/run1.away" && ln -s "$2" "$1/run1"'
                swapped.append(_as_other("/bin/sh", "-c", script, "sh", parent, victim).returncode)

    x, y = classification_data(n=64)
    model = mf.Model(MLP())
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    backup = mf.callbacks.BackupAndRestore(os.path.join(parent, "run1"), save_freq=1)
    with pytest.raises(UntrustedDirectory) as refusal:
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[backup, SwapAtStep()])
    message = str(refusal.value)
    assert f"{parent!r} above it belongs to uid 1234 (mode 1777)" in message and len(message.splitlines()) <= 3
    assert swapped == [] and os.listdir(parent) == []  # refused before any step; nothing made in `parent`

    # What the refusal prevents: once `run1` is there (root's, 0700, as meshfit makes it), uid 1234 can swap it.
    os.mkdir(os.path.join(parent, "run1"), 0o700)
    SwapAtStep().on_train_batch_end(0)
    assert swapped == [0] and os.readlink(os.path.join(parent, "run1")) == victim
    with pytest.raises(UntrustedDirectory):  # and a job started after the swap refuses the link too
        model.fit(
            x, y, batch_size=16, epochs=1, verbose=0, callbacks=[mf.callbacks.BackupAndRestore(backup.backup_dir)]
        )
    assert sorted(os.listdir(victim)) == ["100", "200"]
    for step in ("100", "200"):
        with open(os.path.join(victim, step, "x")) as f:
            assert f.read() == f"root's checkpoint {step}"
