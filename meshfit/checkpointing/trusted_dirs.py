"""Directories whose contents meshfit trusts: made 0700, or used only when yours and writable by you alone.

meshfit runs what some directories hold: a compiled program loaded from the
compilation cache is executed, a backup decides the weights and the data
position a job resumes from, a Goodput record is read back into its ledger.
Whoever can write into such a directory can choose what the job does. So a
directory meshfit writes into (a backup, checkpoint or saved-model directory,
its compilation cache) is created with mode 0700, and one that already
exists is used only if

  * it is a real directory, not a symlink (a planted link would lend the job
    someone else's directory);
  * it belongs to the user running the job (`os.geteuid()`);
  * no one else can write to it (no group or other write bit).

Otherwise the job is refused before anything is read or written there
(`UntrustedDirectory`, naming the directory, its owner, its mode and what to do).

Parents: a directory is as safe as the directories above it, since whoever can
write to a parent can rename the checked directory away and put their own in
its place after the check. A parent writable by everyone without the sticky
bit (which lets only an entry's owner rename it, as on `/tmp`) lets any local
user do that, so such a parent is refused too. Group-writable parents are
accepted: shared project trees (`/scratch/<group>/...`) commonly are, and
their members are trusted by whoever administers the group; the directory
itself must still be writable only by its owner.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat

#: The mode of a directory meshfit creates for files it trusts.
MODE = 0o700
#: The mode of the missing parents meshfit creates: never writable by others, whatever the umask.
PARENT_MODE = 0o755
#: Write bits for anyone but the owner.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UntrustedDirectory(PermissionError):
    """A directory meshfit would trust is someone else's, writable by others, or a symlink."""


def user_name(uid: int) -> str:
    """`uid` with its login name where the system knows one: "65534 (nobody)"."""
    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def problem(path: str, info: os.stat_result) -> str | None:
    """Why the directory `path` (its `os.lstat`) cannot be trusted, or None when it can."""
    if stat.S_ISLNK(info.st_mode):
        return f"it is a symlink (to {os.readlink(path)!r})"
    if info.st_uid != os.geteuid():
        return f"it belongs to uid {user_name(info.st_uid)}, not to you (uid {user_name(os.geteuid())})"
    if info.st_mode & _OTHERS_WRITE:
        return f"others can write to it (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _unsafe_parent(path: str) -> str | None:
    """The first directory above `path` that everyone can write to without the sticky bit, or None."""
    parent = os.path.dirname(os.path.realpath(path))
    while True:
        try:
            mode = os.stat(parent).st_mode
        except OSError:
            return None
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            return parent
        above = os.path.dirname(parent)
        if above == parent:
            return None
        parent = above


def _refusal(what: str, path: str, why: str, fix: str) -> UntrustedDirectory:
    return UntrustedDirectory(
        f"Expected {what} {path!r} to be a directory of yours that only you can write to, as meshfit runs or "
        f"restores what it holds. Received: {why}.\nNothing was read or written there. {fix}"
    )


def check(path: str | os.PathLike, what: str = "directory") -> None:
    """Raises `UntrustedDirectory` if `path` exists and is not a directory meshfit may trust (see the module).

    Nothing at `path`, or something that is not a directory nor a symlink, passes: the caller makes it or
    refuses it as it does any file in a directory's place.
    """
    path = os.path.abspath(os.fspath(path))
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None and (stat.S_ISDIR(info.st_mode) or stat.S_ISLNK(info.st_mode)):
        why = problem(path, info)
        if why is not None:
            if stat.S_ISLNK(info.st_mode):
                fix = f"Pass the directory itself: {os.path.realpath(path)!r}, if it is yours."
            elif info.st_uid != os.geteuid():
                fix = "Choose a directory of your own (meshfit creates a missing one with mode 0700)."
            else:
                fix = f"If all it holds is yours, run `chmod go-w {path}`; or choose another directory."
            raise _refusal(what, path, why, fix)
    parent = _unsafe_parent(path)
    if parent is not None:
        mode = stat.S_IMODE(os.stat(parent).st_mode)
        raise _refusal(
            what,
            path,
            f"it lies in {parent!r} (mode {mode:04o}), where anyone can replace it (no sticky bit)",
            "Choose a directory under one only you can write to, or have the parent made sticky (chmod +t).",
        )


def ensure(path: str | os.PathLike, what: str = "directory") -> str:
    """Makes `path` with mode 0700 (its missing parents 0755, less the umask's bits), or checks the one there
    (`check`); returns its absolute path.

    Raises:
        UntrustedDirectory: as `check`.
        NotADirectoryError: a file is in its place.
        OSError: it cannot be made (a read-only or full disk).
    """
    path = os.path.abspath(os.fspath(path))
    check(path, what)
    parent = os.path.dirname(path)
    if parent != path:
        os.makedirs(parent, mode=PARENT_MODE, exist_ok=True)
    try:
        os.mkdir(path, MODE)  # fails on anything already there, a link included: no race with a planter
    except FileExistsError:
        pass
    check(path, what)  # what is there now, whoever made it
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, f"Expected {what} {path!r} to be a directory; it is a file", path)
    return path


def others_can_write(path: str | os.PathLike) -> str | None:
    """Why others could write into the existing directory `path` (for a warning), or None."""
    path = os.path.abspath(os.fspath(path))
    try:
        info = os.lstat(path)
    except OSError:
        return None
    why = problem(path, info)
    if why is None:
        parent = _unsafe_parent(path)
        why = None if parent is None else f"anyone can replace it in {parent!r} (no sticky bit)"
    return why
