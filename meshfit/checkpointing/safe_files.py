"""Files meshfit writes into a directory others may write to: never through a link planted there.

A checkpoint or model directory may lie where another user can create names
(a shared `/tmp`). A symlink planted at a name meshfit writes (the lock, the
marker, its temporaries, a probe) would make meshfit overwrite a file outside
the directory. So every such file is opened with `O_NOFOLLOW` (and `O_EXCL`
where it must be new), only a regular file with a single link is written or
replaced, and a directory whose meshfit names are symlinks is refused before
anything is written (`refuse_symlinks`). `O_NONBLOCK` makes a planted FIFO an
error instead of a hang. Nothing here follows a link; removing one
(`os.unlink`, `os.rename` of the link itself) never touches its target.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable

#: Flags every open here adds: no symlink is followed, a FIFO does not block, no child inherits the descriptor.
_NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class PlantedFile(FileExistsError):
    """A name meshfit writes is a symlink, or not a regular file of its own (a FIFO, a hard link)."""


def _planted(paths: list[str], found: str = "a symlink or another kind of file (a FIFO, a hard link)") -> PlantedFile:
    return PlantedFile(
        f"Expected meshfit's own regular files or nothing at {', '.join(map(repr, paths))}. Received: {found}, "
        "which meshfit never writes through: it may have been planted to make meshfit overwrite a file "
        "elsewhere. Nothing was written. Remove it if you made it, or use a directory that only you can write to."
    )


def refuse_symlinks(directory: str, names: Iterable[str]) -> None:
    """Raises `PlantedFile` naming every one of `names` in `directory` that is a symlink."""
    links = sorted(os.path.join(directory, n) for n in names if os.path.islink(os.path.join(directory, n)))
    if links:
        raise _planted(links, "symlinks")


def open_regular(path: str, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags)` that never follows a symlink and only returns a regular file (with one link,
    when opened for writing: another link would be a name elsewhere for the same bytes).

    Anything else at `path` is a `PlantedFile`, with nothing written (`O_TRUNC`
    is refused: truncate with `os.ftruncate` once the file is known).
    """
    if flags & os.O_TRUNC:
        raise ValueError("Expected flags without O_TRUNC (it would act before the file is checked).")
    try:
        fd = os.open(path, flags | _NO_FOLLOW, mode)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a FIFO opened for writing with no reader
            raise _planted([path]) from None
        raise
    info = os.fstat(fd)
    writing = flags & (os.O_WRONLY | os.O_RDWR)
    if not stat.S_ISREG(info.st_mode) or (writing and info.st_nlink != 1):
        os.close(fd)
        raise _planted([path])
    return fd


def write_new(path: str, data: bytes) -> None:
    """Creates `path` holding `data` (`O_EXCL`: never onto anything already there, never through a link).

    A regular file already at `path` (left by a crashed process that had this
    pid) is removed first; a symlink or other file there is a `PlantedFile`.
    """
    try:
        fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError as error:
        if isinstance(error, PlantedFile) or not stat.S_ISREG(os.lstat(path).st_mode):
            raise _planted([path]) from None
        os.unlink(path)  # the name only; a hard link's other names keep their content
        fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def replace(source: str, target: str) -> None:
    """`os.replace(source, target)` onto a regular file or nothing; a link or directory at `target` is refused."""
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise _planted([target])
    os.replace(source, target)


def read_regular(path: str, limit: int) -> bytes:
    """The first `limit` bytes of the regular file at `path`, read without following a link."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)
