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

The directories above it: a directory is as safe as the path to it, since
whoever can rename an entry of an ancestor can move the checked directory (or
the ancestor holding it) away after the check and put a link to one of their
own in its place; later backups would be written through the link, the
linked directory's checkpoints deleted at the end of `fit`, or its planted
programs loaded. So every directory on the path must be one in which nobody
but the job's user and root can rename entries:

  * every ancestor belongs to the job's user or to root (uid 0), both on the
    path as written (each component `os.lstat`ed) and on the path it resolves
    to (`os.path.realpath`, each component `os.stat`ed), so a symlinked
    ancestor's place and its target are both covered;
  * a symlink on the path as written belongs to the user or root too (the
    owner of a link in a sticky directory can replace it);
  * an ancestor that its group or others can write to has the sticky bit, as
    `/tmp` (root's, mode 1777) does: there only an entry's owner (or the
    directory's, or root) may rename it. A group-writable parent without the
    sticky bit (`/scratch/<group>/`) is refused like a world-writable one: a
    member could swap the directory.

Which protection this is: an up-front check of every ancestor, not a walk of
the path with `openat` and `O_NOFOLLOW` that every later file access would
have to repeat. It is enough because what it checks can afterwards be changed
only by the user or root: no one else can rename an entry in, chmod or chown a
directory of theirs. Missing ancestors are made by `ensure` (0755, the user's)
and checked again once there. A refusal (`UntrustedDirectory`) names the
offending directory, its owner, its mode and what to do, before anything is
read or written.
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
    """A directory meshfit would trust is someone else's, writable by others, a symlink, or lies in a directory in
    which others than the user and root can rename entries."""


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


def _renamers(directory: str, info: os.stat_result) -> str | None:
    """Who besides the user and root could rename entries in `directory` (its `os.lstat` or `os.stat`), or None."""
    if stat.S_ISLNK(info.st_mode):
        if info.st_uid in (0, os.geteuid()):
            return None
        return (
            f"{directory!r} on its path is a symlink (to {os.readlink(directory)!r}) of uid "
            f"{user_name(info.st_uid)}, who can replace it with a link to a directory of their own"
        )
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid not in (0, os.geteuid()):
        return (
            f"{directory!r} above it belongs to uid {user_name(info.st_uid)} (mode {mode:04o}), who can rename "
            "it away and put a link to a directory of their own in its place"
        )
    if mode & _OTHERS_WRITE and not mode & stat.S_ISVTX:
        who = "anyone" if mode & stat.S_IWOTH else "its group"
        return (
            f"{directory!r} above it (uid {user_name(info.st_uid)}, mode {mode:04o}) lets {who} rename entries "
            "(writable without the sticky bit): it could be moved away and a link put in its place"
        )
    return None


def _components(path: str) -> list[str]:
    """`path`'s ancestors from the root down: "/a/b/c" -> ["/", "/a", "/a/b"]."""
    above = []
    while (parent := os.path.dirname(path)) != path:
        above.append(parent)
        path = parent
    return above[::-1]


def _unsafe_ancestor(path: str) -> tuple[str, str] | None:
    """The first directory (or link) above the absolute `path` in which others than the user and root could
    rename entries, and why; None when there is none. Walks the path as written (`os.lstat`) and then the one it
    resolves to (`os.stat` of `os.path.realpath`); stops where the path does not exist (yet) or is not a
    directory (the caller makes it, or fails to)."""
    real = os.path.realpath(os.path.dirname(path))
    walks = ((os.lstat, _components(path)), (os.stat, [*_components(real), real]))
    for look, ancestors in walks:
        for directory in ancestors:
            try:
                info = look(directory)
            except OSError:
                break
            if not (stat.S_ISDIR(info.st_mode) or stat.S_ISLNK(info.st_mode)):
                break
            why = _renamers(directory, info)
            if why is not None:
                return directory, why
    return None


def _refusal(what: str, path: str, why: str, fix: str) -> UntrustedDirectory:
    return UntrustedDirectory(
        f"Expected {what} {path!r} to be a directory of yours that only you can write to, as meshfit runs or "
        f"restores what it holds. Received: {why}.\nNothing was read or written there. {fix}"
    )


def _ancestor_refusal(what: str, path: str, directory: str, why: str) -> UntrustedDirectory:
    fix = (
        f"Choose a directory under your home or $XDG_RUNTIME_DIR, or have {directory} owned by you or root "
        "(and chmod +t if others may write to it)."
    )
    return UntrustedDirectory(
        f"Expected every directory above {what} {path!r} to be one in which only you and root can rename "
        "entries (owned by you or root, and sticky, as /tmp, if others may write to it), as meshfit runs or "
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
    unsafe = _unsafe_ancestor(path)
    if unsafe is not None:
        raise _ancestor_refusal(what, path, *unsafe)


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
    """Why others could write into the existing directory `path`, or rename it away (a directory above it that
    `check` refuses), for a warning; None when no one but the user (and root) can."""
    path = os.path.abspath(os.fspath(path))
    try:
        info = os.lstat(path)
    except OSError:
        return None
    why = problem(path, info)
    if why is None:
        unsafe = _unsafe_ancestor(path)
        why = None if unsafe is None else unsafe[1]
    return why
