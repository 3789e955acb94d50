"""JAX's persistent compilation cache, so a restarted job does not compile again.

A job resumed after a crash or a preemption compiles the same programs as the
run before it. JAX can keep compiled executables on disk and load them instead
(`jax_compilation_cache_dir`); this module points it at a directory:

    mf.compilation_cache.use("/fast/disk/jax-cache")    # for every compile after this
    JAX_COMPILATION_CACHE_DIR=/fast/disk/jax-cache python train.py   # JAX's own variable

and `BackupAndRestore` defaults it to `<backup_dir>/.compilation_cache` while
its fit runs when no cache was chosen, so a resumed run finds what the
interrupted one compiled.
A cache chosen by the user is never replaced.

meshfit caches every program (`jax_persistent_cache_min_compile_time_secs = 0`)
rather than JAX's default of those that took over a second to compile: a
restart pays for all its compilations, small ones included.

The cache is trusted code: whoever can write to it can make this process run
what they wrote (JAX's warning). meshfit creates it with the user's umask
and refuses a symlink in its place; keep it where only you can write.
"""

from __future__ import annotations

import os
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

__all__ = ["BACKUP_CACHE_NAME", "default_to", "directory", "release", "use"]

#: Where `BackupAndRestore` puts the cache, inside its backup directory.
BACKUP_CACHE_NAME = ".compilation_cache"

_chosen_by_meshfit: str | None = None  # the directory meshfit set, so a default never replaces a user's


def directory() -> str | None:
    """The persistent cache directory in effect, or None when JAX caches nothing on disk."""
    return jax.config.jax_compilation_cache_dir or None


def use(path: str | os.PathLike) -> str:
    """Makes JAX keep every compiled program in `path` and load it from there; returns the absolute path.

    Raises:
        ValueError: `path` is a symlink (a planted one would let another user
            choose what this process runs) or not a directory.
    """
    global _chosen_by_meshfit
    path = os.path.abspath(os.fspath(path))
    if os.path.islink(path):
        raise ValueError(f"Compilation cache {path!r} is a symlink; meshfit keeps its cache only in a real directory.")
    os.makedirs(path, exist_ok=True)
    if not os.path.isdir(path):
        raise ValueError(f"Compilation cache {path!r} is not a directory. Pass a directory path.")
    if directory() != path:
        jax_cache.reset_cache()  # JAX opens its cache once; reopen it at the new path
        jax_cache.set_cache_dir(path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _chosen_by_meshfit = path
    return path


def default_to(path: str | os.PathLike) -> str | None:
    """Uses `path` unless the user chose a cache (JAX config, `JAX_COMPILATION_CACHE_DIR`); returns the one in use.

    A directory that meshfit itself chose before (another fit's backup
    directory) is replaced, as the new job's backups are where its restart
    will look.

    A cache that cannot be made there (a read-only or full disk, a symlink in
    its place) is warned about and skipped: it saves time, training does not
    depend on it.
    """
    current = directory()
    if current is not None and current != _chosen_by_meshfit:
        return current
    try:
        return use(path)
    except (OSError, ValueError) as error:
        warnings.warn(f"No persistent compilation cache at {os.fspath(path)!r}: {error}", stacklevel=2)
        return current


def release(path: str | os.PathLike) -> None:
    """Stops caching in `path` if meshfit chose it, before the directory is deleted (JAX would make it again)."""
    global _chosen_by_meshfit
    path = os.path.abspath(os.fspath(path))
    if _chosen_by_meshfit == path and directory() == path:
        jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", None)
        _chosen_by_meshfit = None
