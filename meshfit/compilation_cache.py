"""JAX's persistent compilation cache, so a restarted job does not compile again.

A job resumed after a crash or a preemption compiles the same programs as the
run before it. JAX can keep compiled executables on disk and load them instead
(`jax_compilation_cache_dir`); this module points it at a directory:

    mf.compilation_cache.use("/fast/disk/jax-cache")    # for every compile after this
    JAX_COMPILATION_CACHE_DIR=/fast/disk/jax-cache python train.py   # JAX's own variable

and `BackupAndRestore` defaults it to `<backup_dir>/.compilation_cache` while
its fit runs when no cache was chosen, so a resumed run finds what the
interrupted one compiled.
A cache the user chose (`use`, or JAX's own setting) is never replaced.

meshfit caches every program (`jax_persistent_cache_min_compile_time_secs = 0`)
rather than JAX's default of those that took over a second to compile: a
restart pays for all its compilations, small ones included.

The cache is trusted code: JAX executes what it loads from there, so whoever
can write to it chooses what this process runs. A cache meshfit turns on
(`use`, and `BackupAndRestore`'s default) must therefore be a directory of
the user's that no one else can write to (`meshfit.checkpointing.trusted_dirs`: made with
mode 0700, or an existing one of theirs without group or other write bits;
anything else is refused). Each time meshfit turns it on, it looks at every
entry with `os.lstat`, never opening one, and moves whatever JAX must not read
into a quarantine folder (`.meshfit-quarantine-<time>-<pid>`, never deleted,
never read): a FIFO (JAX's read would block for ever), a socket, a device, a
symlink, a directory where JAX keeps files, a file owned by someone else or
with other links. JAX reads only `<key>-cache` and `<key>-atime` files directly
in the directory (`jax._src.lru_cache`), so nothing under the quarantine folder
is ever loaded. Once the directory is the user's and 0700, no one else can
plant anything in it.

A cache the user configured for JAX directly (`jax.config`,
`JAX_COMPILATION_CACHE_DIR`) stays theirs: meshfit neither checks its entries
nor refuses it, and warns once if others can write to it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from meshfit.checkpointing import trusted_dirs
from meshfit.runtime import job_env

__all__ = [
    "BACKUP_CACHE_NAME",
    "ENV_LAUNCH_CACHE",
    "QUARANTINE_PREFIX",
    "default_to",
    "directory",
    "quarantine",
    "release",
    "remove",
    "use",
]

#: Set by `meshfit launch` beside `JAX_COMPILATION_CACHE_DIR` for every rank: the launch's own cache (a 0700
#: directory of the launcher's, shared by the ranks and their restarts), which JAX turns on at import, so that
#: what a start compiles before its fit (the model's creation) loads in the next. It is a default of meshfit's:
#: `BackupAndRestore` replaces it by its backups' cache, which outlives the launch.
ENV_LAUNCH_CACHE = job_env.ENV_LAUNCH_CACHE
#: Where `BackupAndRestore` puts the cache, inside its backup directory.
BACKUP_CACHE_NAME = ".compilation_cache"
#: The folders inside a cache where entries JAX must not read are moved (JAX reads only files directly inside).
QUARANTINE_PREFIX = ".meshfit-quarantine-"

_chosen_by_meshfit: str | None = None  # the default meshfit set (`default_to`), which another default replaces
_set_by_use: str | None = None  # the directory `use` set (the user's choice): kept by every default
_warned_open: set[str] = set()  # the users' own caches already warned about


def directory() -> str | None:
    """The persistent cache directory in effect, or None when JAX caches nothing on disk."""
    return jax.config.jax_compilation_cache_dir or None


def use(path: str | os.PathLike) -> str:
    """Makes JAX keep every compiled program in `path` and load it from there; returns the absolute path.

    `path` is made with mode 0700, or must be a directory of yours that no one
    else can write to; entries JAX must not read are moved aside (`quarantine`).

    Raises:
        ValueError: `path` is a symlink (a planted one would let another user
            choose what this process runs) or not a directory.
        meshfit.checkpointing.trusted_dirs.UntrustedDirectory: `path` belongs to someone
            else or others can write to it.
    """
    global _chosen_by_meshfit, _set_by_use
    path = _turn_on(path)
    _chosen_by_meshfit, _set_by_use = None, path
    return path


def _turn_on(path: str | os.PathLike) -> str:
    """`use`'s checks and switch, without saying whose choice it was."""
    path = os.path.abspath(os.fspath(path))
    if os.path.islink(path):
        raise ValueError(f"Compilation cache {path!r} is a symlink; meshfit keeps its cache only in a real directory.")
    try:
        trusted_dirs.ensure(path, "compilation cache")
    except NotADirectoryError:
        raise ValueError(f"Compilation cache {path!r} is not a directory. Pass a directory path.") from None
    quarantine(path)
    if directory() != path:
        jax_cache.reset_cache()  # JAX opens its cache once; reopen it at the new path
        jax_cache.set_cache_dir(path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def _readable(info: os.stat_result) -> bool:
    """Whether JAX may read an entry of this `os.lstat`: a regular file of the user's with one name."""
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_nlink == 1


def quarantine(path: str | os.PathLike) -> list[str]:
    """Moves every entry of the cache `path` that JAX must not read into a new quarantine folder inside it
    (`QUARANTINE_PREFIX`); returns their names. Never opens an entry (only `os.lstat` and `os.rename`)."""
    path = os.fspath(path)
    moved, folder = [], None
    for entry in os.scandir(path):
        info = os.lstat(entry.path)
        own_folder = stat.S_ISDIR(info.st_mode) and trusted_dirs.problem(entry.path, info) is None
        if _readable(info) or (own_folder and entry.name.startswith(QUARANTINE_PREFIX)):
            continue
        if folder is None:
            folder = os.path.join(path, f"{QUARANTINE_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            while os.path.lexists(folder):
                folder += "-"
            os.mkdir(folder, trusted_dirs.MODE)
        os.rename(entry.path, os.path.join(folder, entry.name))
        moved.append(entry.name)
    if moved:
        warnings.warn(
            f"Compilation cache {path!r}: moved {len(moved)} entr{'y' if len(moved) == 1 else 'ies'} JAX must not "
            f"load (not a regular file of yours: {', '.join(sorted(moved)[:3])}) into {folder!r}, unread.",
            stacklevel=3,
        )
    return moved


def default_to(path: str | os.PathLike) -> str | None:
    """Uses `path` unless the user chose a cache (JAX config, `JAX_COMPILATION_CACHE_DIR`); returns the one in use.

    A directory that meshfit itself chose before (another fit's backup
    directory) is replaced, as the new job's backups are where its restart
    will look.

    A cache that cannot be made there (a read-only or full disk, a symlink in
    its place, a directory others can write to) is warned about and skipped:
    it saves time, training does not depend on it.
    """
    global _chosen_by_meshfit
    current = directory()
    launch = os.environ.get(ENV_LAUNCH_CACHE)
    if current is not None and current != _chosen_by_meshfit and current != launch:
        if current != _set_by_use:
            _warn_if_open(current)
        return current
    try:
        _chosen_by_meshfit = _turn_on(path)
        return _chosen_by_meshfit
    except (OSError, ValueError) as error:
        warnings.warn(f"No persistent compilation cache at {os.fspath(path)!r}: {error}", stacklevel=2)
        return current


def _warn_if_open(path: str) -> None:
    """Warns once per directory if others could write to the user's own cache `path` (JAX's setting: kept)."""
    why = trusted_dirs.others_can_write(path) if path not in _warned_open else None
    if why is not None:
        _warned_open.add(path)
        warnings.warn(
            f"The compilation cache you configured, {path!r}, is not yours alone ({why}): whoever can write "
            "there chooses the programs this job runs. Kept as you set it; `chmod go-w` it or choose another.",
            stacklevel=3,
        )


def release(path: str | os.PathLike) -> None:
    """Stops caching in `path` if meshfit turned it on (`use`, `default_to`), e.g. before the directory is deleted
    (JAX would make it again)."""
    global _chosen_by_meshfit, _set_by_use
    path = os.path.abspath(os.fspath(path))
    if path in (_chosen_by_meshfit, _set_by_use) and directory() == path:
        jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", None)
        _chosen_by_meshfit = _set_by_use = None


def remove(path: str | os.PathLike) -> list[str]:
    """Deletes the cache `path` (after `release`) except its quarantine folders, kept for the user to look at;
    removes the directory when nothing is kept. Returns the names kept. Never follows a link."""
    path = os.fspath(path)
    kept = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                if entry.name.startswith(QUARANTINE_PREFIX):
                    kept.append(entry.name)
                else:
                    shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        if not kept:
            os.rmdir(path)
    return sorted(kept)
