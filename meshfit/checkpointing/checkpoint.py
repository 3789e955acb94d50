"""Checkpoint directories on Orbax: save a state pytree plus JSON, restore onto any layout.

`CheckpointDir` wraps an `orbax.checkpoint.CheckpointManager` with what
meshfit promises about saved files:
  * a directory that holds files meshfit did not write is never used, and one
    writer at a time holds it (`meshfit.checkpointing.dirlock`);
  * an older checkpoint is deleted only after a newer one is complete (Orbax
    writes to a temporary directory and renames it when done), and deleting
    one first renames it out of the listing (`DELETED`), so a crash while it
    is deleted never leaves a half-deleted checkpoint that looks complete;
  * every array's fingerprint is recorded, and a state with NaN or Inf can be
    refused (`meshfit.checkpointing.integrity`);
  * a restore first compares the saved shapes and dtypes with the template: a
    different model is the caller's mistake (`CheckpointMismatch`, nothing on
    disk touched); only content that cannot be read or does not match its
    fingerprints is damage, skipped with a warning naming it (and, for a
    writer, moved aside as `<step>.unreadable`, never deleted);
  * restoring lays arrays out as the template says — a different strategy
    or mesh than the one that saved them;
  * a save that fails (read-only or full disk) raises `CheckpointWriteError`
    and leaves no Orbax thread behind that would keep the process alive;
  * a directory it writes into is made with mode 0700, and one already there
    is used only if it is the user's and no one else can write to it
    (`meshfit.checkpointing.trusted_dirs`): its contents decide what a resumed job runs;
  * meshfit's own files (lock, marker, its temporaries, probes) are never
    written through a symlink, and a directory where one of their names is a
    symlink is refused before anything is written (`meshfit.checkpointing.safe_files`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from meshfit.checkpointing import integrity, safe_files, trusted_dirs
from meshfit.checkpointing.dirlock import LOCK_NAME, DirectoryLock, DirectoryLocked
from meshfit.core.compat import release_orbax_waiters
from meshfit.core.trees import decode, encode, on_devices, path_name

MARKER = "meshfit_checkpoints.json"
#: How the probe of a directory's writability is named (with the writer's pid).
PROBE = ".meshfit-probe-"
#: The longest marker read (it is a few dozen bytes): a huge file there is damage, not something to load.
MARKER_LIMIT = 4096
#: Where Orbax renames a rotated-out checkpoint before meshfit deletes it (`todelete_subdir`): the rename is
#: atomic, the delete is not, and a step directory half deleted by a crash would still be listed as complete.
DELETED = ".meshfit-deleted"
STATE, META = "state", "meta"
FINGERPRINTS = "fingerprints"
UNREADABLE = ".unreadable"
#: Mismatched paths named in a `CheckpointMismatch` (the rest are counted).
SHOWN_MISMATCHES = 6
#: The prefix of the `jax.monitoring` duration events a save records, one per piece, on the thread that did it
#: (see `CheckpointDir.save`): how long a save holds the loop, and where that time goes.
SAVE_EVENTS = "/meshfit/checkpoint/save/"


@contextlib.contextmanager
def _timed(piece: str):
    """Records the time inside as the duration event `SAVE_EVENTS + piece`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        jax.monitoring.record_event_duration_secs(SAVE_EVENTS + piece, time.perf_counter() - start)


class CheckpointMismatch(ValueError):
    """A checkpoint holds another model's (or optimizer's) arrays than the one loading it."""


class CheckpointDamaged(Exception):
    """A checkpoint's content cannot be read, or does not match the fingerprints saved with it."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed (a read-only or full disk, ...); earlier checkpoints are kept."""


class NonFiniteState(ValueError):
    """A state with NaN or Inf values was not saved."""

    def __init__(self, paths: list[str]):
        super().__init__(f"{len(paths)} array(s) hold NaN or Inf: {', '.join(paths[:SHOWN_MISMATCHES])}")
        self.paths = paths


def abstract(template):
    """Shape, dtype and sharding of each leaf: the target layout of a restore."""

    def one(leaf):
        sharding = getattr(leaf, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

    return jax.tree.map(one, encode(template))


def _looks_like_checkpoints(directory: str, entries: list[str]) -> bool:
    return any(e.isdigit() and os.path.exists(os.path.join(directory, e, "_CHECKPOINT_METADATA")) for e in entries)


def own_names(entries: list[str]) -> list[str]:
    """The entries named as the files meshfit writes into a directory: lock, marker, its temporaries, probes."""
    temporary = f".{MARKER}."
    return [
        e
        for e in entries
        if e in (MARKER, LOCK_NAME, DELETED) or e.startswith(PROBE) or (e.startswith(temporary) and e.endswith(".tmp"))
    ]


def read_marker(directory: str) -> dict | None:
    """The directory's marker (`{"kind": ..., "format": ...}`), or None if it has none.

    A damaged marker, or checkpoints without one, is an error that says what to do.
    """
    marker = os.path.join(directory, MARKER)
    if not os.path.lexists(marker):
        entries = os.listdir(directory) if os.path.isdir(directory) else []
        if _looks_like_checkpoints(directory, entries):
            raise FileNotFoundError(
                f"{directory!r} holds Orbax checkpoints but not meshfit's marker file {MARKER} (deleted?); nothing "
                f'was changed. If meshfit wrote them, recreate the marker: `echo \'{{"kind": "backup", "format": 1}}\' '
                f"> {marker}` (kind: backup, checkpoint, model or weights, for whichever of BackupAndRestore, "
                "ModelCheckpoint, model.save or save_weights wrote them)."
            )
        return None
    try:
        found = json.loads(safe_files.read_regular(marker, MARKER_LIMIT).decode("utf-8"))
        if not isinstance(found, dict) or not isinstance(found.get("kind"), str):
            raise ValueError(f"expected a JSON object with a 'kind', found {str(found)[:80]!r}")
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(
            f"meshfit's marker file {marker} is damaged ({type(error).__name__}: {str(error)[:120]}). It records "
            "what kind of checkpoints the directory holds; nothing was changed. If the directory holds meshfit "
            'checkpoints, rewrite the file as `{"kind": "backup", "format": 1}` (kind: backup, checkpoint, '
            "model or weights); otherwise choose another directory."
        ) from None
    return found


def write_marker(directory: str, kind: str) -> None:
    """Writes the marker whole or not at all: the other processes of a job may be reading it now."""
    partial = os.path.join(directory, f".{MARKER}.{os.getpid()}.tmp")
    safe_files.write_new(partial, json.dumps({"kind": kind, "format": 1}).encode())
    try:
        safe_files.replace(partial, os.path.join(directory, MARKER))
    except BaseException:
        os.unlink(partial)
        raise


def check_directory(directory: str, kind: str) -> None:
    """Refuses a directory that holds anything meshfit did not write there, symlinks at the names meshfit
    writes (`own_names`), or another kind's checkpoints."""
    if not os.path.exists(directory):
        return
    if not os.path.isdir(directory):
        raise FileExistsError(f"{kind} directory {directory!r} is a file. Pass a directory path.")
    everything = os.listdir(directory)
    safe_files.refuse_symlinks(directory, own_names(everything))
    entries = [e for e in everything if not e.startswith(".")]
    if not entries:
        return
    marker = read_marker(directory)
    if marker is None:
        raise FileExistsError(
            f"{kind} directory {directory!r} already holds files meshfit did not write ({sorted(entries)[:5]}). "
            "meshfit never writes into such a directory; choose a new or empty one."
        )
    if marker["kind"] != kind:
        raise FileExistsError(
            f"Directory {directory!r} holds meshfit {marker['kind']} checkpoints, not {kind} ones; "
            "choose another directory."
        )


#: Suffixes of the siblings of a directory being replaced whole (`replace_directory`).
STAGING, REPLACED = ".meshfit-new", ".meshfit-old"


def staging_path(directory: str) -> str:
    """Where a replacement of `directory` is written before it takes the directory's place."""
    return os.path.abspath(os.fspath(directory)).rstrip(os.sep) + STAGING


def _complete(directory: str, kind: str) -> bool:
    """Whether `directory` is meshfit's, of `kind`, and holds at least one complete checkpoint."""
    if not os.path.isdir(directory):
        return False
    try:
        marker = read_marker(directory)
    except (FileNotFoundError, ValueError):
        return False
    return marker is not None and marker["kind"] == kind and _looks_like_checkpoints(directory, os.listdir(directory))


def _remove_own(directory: str, kind: str) -> None:
    """Deletes a sibling meshfit left (a staging copy or a replaced one) if it is meshfit's, of `kind`."""
    if os.path.islink(directory):
        return  # not meshfit's: it makes directories, never links
    try:
        marker = read_marker(directory) if os.path.isdir(directory) else None
    except (FileNotFoundError, ValueError):
        return  # not recognisably ours: left alone
    if marker is None or marker["kind"] != kind:
        return
    lock = DirectoryLock(directory)
    try:
        lock.acquire()  # a live writer's staging copy is left to it
    except DirectoryLocked:
        return
    shutil.rmtree(directory, ignore_errors=True)
    lock.release()


def replace_directory(staged: str, directory: str, kind: str) -> None:
    """Puts the complete checkpoints in `staged` in the place of `directory` (both meshfit's, of `kind`).

    Two renames and a delete: `directory` -> `<directory>.meshfit-old`, `staged` ->
    `directory`, then the old copy is deleted. A crash between them leaves a
    complete copy under one of the names, which `finish_replacement` puts back.
    Both directories must be closed (no lock held): the lock file moves with them.
    """
    directory = os.path.abspath(os.fspath(directory))
    replaced = directory.rstrip(os.sep) + REPLACED
    _remove_own(replaced, kind)
    if os.path.exists(directory):
        os.rename(directory, replaced)
    os.rename(staged, directory)
    _remove_own(replaced, kind)


def finish_replacement(directory: str, kind: str) -> None:
    """Completes, or undoes, a `replace_directory` that a crash interrupted; nothing if there was none.

    If `directory` is missing, the new copy takes its place when it is complete,
    else the old one goes back. Leftover copies of `kind` beside a present
    `directory` (an interrupted staging write, a replaced copy not yet deleted) are
    deleted: `directory` itself is complete. Only process 0 acts.
    """
    directory = os.path.abspath(os.fspath(directory))
    staged, replaced = staging_path(directory), directory.rstrip(os.sep) + REPLACED
    safe_files.refuse_symlinks(os.path.dirname(directory), [os.path.basename(staged), os.path.basename(replaced)])
    if jax.process_index() != 0:
        return
    if not os.path.exists(directory):
        if _complete(staged, kind):
            os.rename(staged, directory)
        elif _complete(replaced, kind):
            os.rename(replaced, directory)
    if os.path.exists(directory):
        _remove_own(staged, kind)
        _remove_own(replaced, kind)


def readable_path(directory: str) -> str:
    """`directory`, or where its complete copy lies when a crash interrupted its replacement (readers move nothing)."""
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory):
        return directory
    for sibling in (staging_path(directory), directory.rstrip(os.sep) + REPLACED):
        if (
            not os.path.islink(sibling)
            and os.path.isdir(sibling)
            and _looks_like_checkpoints(sibling, os.listdir(sibling))
        ):
            return sibling
    return directory


def _describe(leaf) -> str:
    return f"{tuple(leaf.shape)} {np.dtype(leaf.dtype).name}"


def structure_problems(saved, target, *, partial: bool) -> list[str]:
    """How the saved arrays (Orbax metadata) differ from `target`, one line per path; [] if they fit.

    With `partial`, arrays saved but not in `target` are fine (loading weights
    from a checkpoint that also holds optimizer state).
    """

    def flat(tree):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {path_name(p): leaf for p, leaf in leaves if hasattr(leaf, "shape")}

    have, want = flat(saved), flat(target)
    problems = []
    for name, expected in want.items():
        found = have.get(name)
        if found is None:
            problems.append(f"{name}: not in the checkpoint (expected {_describe(expected)})")
        elif tuple(found.shape) != tuple(expected.shape) or np.dtype(found.dtype) != np.dtype(expected.dtype):
            problems.append(f"{name}: saved {_describe(found)}, expected {_describe(expected)}")
    if not partial:
        problems += [f"{name}: saved {_describe(have[name])}, not in this model" for name in have if name not in want]
    return sorted(problems, key=lambda line: "opt_state" in line.split(":")[0])  # weights first


def _is_resource_error(error: Exception) -> bool:
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error)


class _ReadOnlyNotice(logging.Filter):
    """Drops Orbax's "Given directory is read only=..." warning: a load opens its directory read-only on
    purpose, so the warning would tell a user nothing on every `load_model` and `load_weights`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


@contextlib.contextmanager
def _without_read_only_notice():
    """While opening a directory read-only: Orbax's logger (absl's, "absl") drops that one warning; every
    other message, and that one from any other code after the opening, still goes out."""
    logger, notice = logging.getLogger("absl"), _ReadOnlyNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


class CheckpointDir:
    """Numbered checkpoints of a state pytree and a JSON dict in one directory.

    Args:
        directory: where checkpoints go (created with mode 0700 if missing; an existing one must be the
            user's and writable by no one else, `meshfit.checkpointing.trusted_dirs`, when writing).
        kind: what this directory is for ("backup", "checkpoint", "model",
            "weights"); a directory is only ever reused for the same kind.
        max_to_keep: how many complete checkpoints to keep (None: all).
        async_save: write in a background thread. In a single-process job
            `save` returns once a copy of the arrays on their devices is
            dispatched (the device holds one more copy of the state until it is
            written); the fingerprints, the copy to the host and Orbax's save
            run in meshfit's background thread, one save at a time. In a
            multi-process job `save` returns once Orbax has copied the arrays
            off the devices (every process must take part in each step of a
            save in the same order, which the loop's thread guarantees).
        read_only: only read: nothing is created, locked or written (loading).
        device_copy: with `async_save` in a single-process job, write from a
            copy on the devices as above (True); False writes as in a
            multi-process job: no extra device memory, but the loop waits for
            the fingerprints and the copy to the host.
    """

    def __init__(
        self,
        directory: str,
        kind: str,
        *,
        max_to_keep: int | None = 2,
        async_save: bool = True,
        read_only: bool = False,
        device_copy: bool = True,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.kind = kind
        self.read_only = read_only
        self._lock = DirectoryLock(self.directory)
        self.manager = None
        # meshfit's own background save (single process): the thread writing, and its error for the next call
        self._background = async_save and device_copy and not read_only and jax.process_count() == 1
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        self._probed = False
        if read_only:  # (no saving interval, nothing created: what read_only means, so Orbax warns of no change)
            options = ocp.CheckpointManagerOptions(
                read_only=True, enable_async_checkpointing=False, save_interval_steps=0, create=False
            )
        else:
            trusted_dirs.check(self.directory, f"{kind} directory")  # before anything there is read
            check_directory(self.directory, kind)
            if jax.process_index() == 0:
                try:
                    trusted_dirs.ensure(self.directory, f"{kind} directory")  # made 0700
                    self._lock.acquire()
                except trusted_dirs.UntrustedDirectory:
                    raise
                except OSError as error:
                    raise CheckpointWriteError(
                        f"Cannot write {kind} checkpoints into {self.directory!r}: {error}. Check that it is "
                        "writable (not a read-only mount) and has free space."
                    ) from error
            options = ocp.CheckpointManagerOptions(  # meshfit's thread writes synchronously through Orbax
                max_to_keep=max_to_keep,
                create=True,
                enable_async_checkpointing=async_save and not self._background,
                todelete_subdir=DELETED,
            )
        try:
            if not read_only and jax.process_index() == 0:
                if not os.path.lexists(os.path.join(self.directory, MARKER)):
                    write_marker(self.directory, kind)
            with _without_read_only_notice() if read_only else contextlib.nullcontext():
                self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, META))
            self._empty_deleted()  # what a crashed writer was deleting
        except BaseException:
            self._lock.release()
            raise

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self.manager.all_steps())

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _empty_deleted(self) -> None:
        """Deletes the checkpoints Orbax rotated out (renamed into `DELETED`); only process 0, the writer.

        Only the folder's entries: Orbax may be renaming the next one into it (its finalize thread, when
        it saves asynchronously), so the folder itself stays. Never follows a link (and `check_directory`
        refused the directory if the folder was one).
        """
        if self.read_only or jax.process_index() != 0:
            return
        deleted = os.path.join(self.directory, DELETED)
        if os.path.islink(deleted) or not os.path.isdir(deleted):
            return
        for entry in os.scandir(deleted):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    # -- writing -----------------------------------------------------------------------

    def _probe(self) -> None:
        """Fails now, with the OS's reason, if the directory cannot be written (before Orbax starts)."""
        probe = os.path.join(self.directory, f"{PROBE}{os.getpid()}")
        safe_files.write_new(probe, b"ok")
        os.remove(probe)

    def _write_failed(self, error: BaseException) -> CheckpointWriteError:
        release_orbax_waiters()
        kept = self.steps() if self.manager is not None else []
        return CheckpointWriteError(
            f"Writing a checkpoint into {self.directory!r} failed: {type(error).__name__}: {str(error)[:300]}. "
            f"The complete checkpoints already there are kept (steps: {kept or 'none'}). Check that the "
            "directory is writable (not a read-only mount) and that its disk has free space."
        )

    def save(
        self,
        step: int,
        state,
        meta: dict[str, Any],
        *,
        wait: bool = False,
        if_exists: str = "skip",
        finite_only: bool = False,
    ) -> None:
        """Starts writing checkpoint `step`; with `wait`, returns when it is complete.

        The fingerprint of every array goes into the JSON part. If checkpoint
        `step` exists already it is never overwritten: with
        `if_exists="skip"` it is kept (a resumed run saves the same values),
        with "error" a FileExistsError says so. With `finite_only`, a state
        holding NaN or Inf is not written: `NonFiniteState` names its arrays.
        A failed write raises `CheckpointWriteError`.
        """
        if self.read_only:
            raise RuntimeError(f"{self.directory!r} was opened read-only.")
        with _timed("previous"):
            self._finish_background()  # at most one save in flight; its error surfaces here
        self._empty_deleted()
        if step in self.manager.all_steps():
            if if_exists == "error":
                raise FileExistsError(
                    f"Checkpoint {self._path(step)} already exists (from an earlier run?). "
                    "meshfit does not overwrite it: use a new directory, or move the old checkpoints away."
                )
            if wait:
                self.wait()
            return
        with _timed("encode"):
            encoded = encode(state)
        if self._background:
            self._start_background(step, encoded, meta, finite_only)
        else:
            with _timed("steps"):  # the steps in flight, which the fingerprints would wait for anyway
                jax.block_until_ready(encoded)
            with _timed("fingerprints"):
                report = integrity.report(encoded)
            if finite_only and report.non_finite():
                raise NonFiniteState(report.non_finite())
            self._write(step, encoded, {**meta, FINGERPRINTS: report.fingerprints}, probe=True)
        if wait:
            self.wait()

    def _write(self, step: int, encoded, meta: dict[str, Any], *, probe: bool) -> None:
        """Probes the directory (with `probe`), then has Orbax save (returns after its blocking part)."""
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(encoded), META: ocp.args.JsonSave(meta)})
        try:
            if probe:
                with _timed("probe"):
                    self._probe()
            with _timed("orbax"):
                self.manager.save(step, args=args, force=True)
        except safe_files.PlantedFile:
            raise  # its own message names the link
        except Exception as error:
            raise self._write_failed(error) from error

    def _start_background(self, step: int, encoded, meta: dict[str, Any], finite_only: bool) -> None:
        """Dispatches a copy of the state on its devices and its fingerprints, then writes it in a thread.

        The copy is what the thread reads: the loop's next steps may donate (overwrite) the state's
        buffers while it is written. Only a `finite_only` save waits here, for the finiteness flags.
        """
        with _timed("copy"):  # and the fingerprints, in one program
            snapshot, pending = integrity.snapshot(encoded)
        if finite_only:
            with _timed("finite"):
                non_finite = pending.non_finite()
            if non_finite:
                raise NonFiniteState(non_finite)
        if not self._probed:  # the OS's reason now, on the loop's thread, for a directory never writable
            try:
                with _timed("probe"):
                    self._probe()
            except safe_files.PlantedFile:
                raise
            except Exception as error:
                raise self._write_failed(error) from error
            self._probed = True

        def write() -> None:
            try:
                with _timed("background"):
                    report = pending.result()
                    self._write(step, snapshot, {**meta, FINGERPRINTS: report.fingerprints}, probe=False)
                self._empty_deleted()
            except BaseException as error:  # noqa: BLE001 - kept for the next save, wait or close to raise
                self._write_error = error

        with _timed("thread"):
            self._writer = threading.Thread(target=write, name=f"meshfit-checkpoint-{step}")
            self._writer.start()

    def _finish_background(self) -> None:
        """Waits for meshfit's background save, if any; raises its error (`CheckpointWriteError`, ...)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        error, self._write_error = self._write_error, None
        if error is None:
            return
        if isinstance(error, (CheckpointWriteError, safe_files.PlantedFile)):
            raise error
        raise self._write_failed(error) from error

    def wait(self) -> None:
        """Returns when the checkpoint being written is complete; a failed write raises `CheckpointWriteError`."""
        self._finish_background()
        try:
            self.manager.wait_until_finished()
        except Exception as error:
            raise self._write_failed(error) from error
        self._empty_deleted()

    # -- reading -----------------------------------------------------------------------

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON part of checkpoint `step`; `CheckpointDamaged` if it cannot be read."""
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
            if not isinstance(meta, dict):
                raise ValueError(f"expected a JSON object, found {type(meta).__name__}")
        except Exception as error:  # noqa: BLE001 - a JSON part that cannot be read is damage
            raise CheckpointDamaged(
                f"its JSON part cannot be read ({type(error).__name__}: {str(error)[:200]})"
            ) from None
        return dict(meta)

    def _saved_structure(self, step: int):
        try:
            handler = ocp.PyTreeCheckpointHandler()
            try:
                return handler.metadata(epath.Path(self._path(step)) / STATE)
            finally:
                handler.close()
        except Exception as error:  # noqa: BLE001 - metadata that cannot be read is damage
            raise CheckpointDamaged(
                f"its array metadata cannot be read ({type(error).__name__}: {str(error)[:200]})"
            ) from None

    def restore(self, step: int, template, *, partial: bool = False):
        """Restores checkpoint `step`; returns (state, meta).

        `template` is a pytree of arrays laid out as the restored state should
        be, or a function of the checkpoint's meta that returns one. With
        `partial`, the template may name a subset of what was saved.

        Raises `CheckpointMismatch` (shapes, dtypes or arrays differ from the
        template) before reading any array, and `CheckpointDamaged` if the
        content cannot be read or does not match its fingerprints.
        """
        meta = self.read_meta(step)
        if callable(template):
            template = template(meta)
        target = abstract(template)
        problems = structure_problems(self._saved_structure(step), target, partial=partial)
        if problems:
            shown = "; ".join(problems[:SHOWN_MISMATCHES])
            more = f"; and {len(problems) - SHOWN_MISMATCHES} more" if len(problems) > SHOWN_MISMATCHES else ""
            raise self._mismatch(step, f"{len(problems)} array(s) differ: {shown}{more}")
        if partial:  # the PyTree handler reads Standard checkpoints and can skip what the target lacks
            restore = ocp.args.PyTreeRestore(
                item=target, partial_restore=True, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
            )
        else:
            restore = ocp.args.StandardRestore(target)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**{STATE: restore}))[STATE]
        except TypeError as error:  # Orbax's "Type mismatch at key path ...": containers differ, not bytes
            raise self._mismatch(step, str(error).split("\n")[0][:300]) from None
        except Exception as error:
            if _is_resource_error(error):
                raise
            raise CheckpointDamaged(f"its arrays cannot be read ({type(error).__name__}: {str(error)[:200]})") from None
        host = jax.tree.map(lambda new, old: new if on_devices(old) else np.asarray(new), restored, encode(template))
        altered = integrity.mismatched(meta.get(FINGERPRINTS, {}), self._report(host).result().fingerprints)
        if altered:
            raise CheckpointDamaged(
                f"the data of {len(altered)} array(s) in {os.path.join(self._path(step), STATE)} changed on disk "
                f"since it was written (fingerprint mismatch: {', '.join(altered[:SHOWN_MISMATCHES])})"
            )
        return decode(restored, template), meta

    def non_finite(self, state) -> list[str]:
        """Paths of `state`'s arrays that hold NaN or Inf, computed as this directory's saves compute them.

        A state saved here compiles no second program for the check (see `_report`).
        """
        return self._report(encode(state)).non_finite()

    def _report(self, tree) -> integrity.PendingReport:
        """The fingerprints and finiteness of `tree`, from the program this directory's saves compile.

        Saves that copy the state on its devices compute the report with the copy, in one program
        (`integrity.snapshot`). A restore or a check that computed it alone would compile a second
        program for the same arrays, which a restarted job then finds in no compilation cache (1.1-1.3 s
        each for the example transformer on the CPU, `benchmarks/bench_restart.py`). The copy is dropped
        at once: it costs what every save of this directory costs, one copy of the state while the
        program runs.
        """
        if self._background:
            return integrity.snapshot(tree)[1]
        return integrity.start_report(tree)

    def _mismatch(self, step: int, what: str) -> CheckpointMismatch:
        return CheckpointMismatch(
            f"Checkpoint {self._path(step)} does not match the model loading it ({what}). It was saved from a "
            "different model, optimizer or configuration; load it with the same architecture and optimizer, or "
            "use another directory. Nothing on disk was changed."
        )

    def _move_aside(self, step: int) -> None:
        source = self._path(step)
        target = f"{source}{UNREADABLE}"
        if jax.process_index() == 0:
            suffix = 0
            while os.path.exists(target):
                suffix += 1
                target = f"{source}{UNREADABLE}{suffix}"
            os.rename(source, target)
            warnings.warn(f"Moved the unreadable checkpoint {source} to {target} (kept, never deleted).", stacklevel=3)
        self.manager.reload()

    def restore_latest(self, template, *, partial: bool = False, steps=None):
        """The newest readable checkpoint as (step, state, meta), or None if there is none.

        A damaged checkpoint is skipped with a warning naming it; a writer
        moves it aside (`<step>.unreadable`) so no rotation deletes it. A
        `CheckpointMismatch` is raised at once, with nothing changed.
        `steps` limits the candidates (default: all complete checkpoints).
        """
        for step in reversed(sorted(self.steps() if steps is None else steps)):
            try:
                state, meta = self.restore(step, template, partial=partial)
            except CheckpointDamaged as damage:
                warnings.warn(
                    f"Checkpoint {self._path(step)} could not be read: {damage}; trying the previous one.", stacklevel=2
                )
                if not self.read_only:
                    self._move_aside(step)  # out of the rotation, so nothing deletes it
                continue
            return step, state, meta
        return None

    # -- ending ------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the write in progress, then releases Orbax and the lock, also when the write failed."""
        if self.manager is None:
            return
        try:
            if not self.read_only:
                self.wait()
        finally:
            try:
                self.manager.close()
            finally:
                self.manager = None
                self._lock.release()

    def remove_complete(self) -> list[str]:
        """Deletes the complete and unfinished checkpoints and the marker (after `close`), keeping
        anything moved aside as unreadable; removes the directory if nothing is left.

        Returns the names kept. Only process 0 deletes.
        """
        if self.manager is not None:
            raise RuntimeError("close() the directory before removing its checkpoints.")
        if jax.process_index() != 0 or not os.path.isdir(self.directory):
            return []
        kept = []
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if UNREADABLE in name:
                kept.append(name)
            elif (name.split(".")[0].isdigit() or name == DELETED) and os.path.isdir(path) and not os.path.islink(path):
                # <step>, <step>.orbax-checkpoint-tmp..., rotated-out steps; a link is not meshfit's and is kept
                shutil.rmtree(path)
            elif name in (MARKER, LOCK_NAME):
                os.remove(path)
            else:
                kept.append(name)
        if kept:
            write_marker(self.directory, self.kind)  # still meshfit's: keep it reusable
        else:
            os.rmdir(self.directory)
        return sorted(kept)


#: What a directory of one saved model or set of weights is called in messages.
_SINGLE_LABELS = {"model": "a saved model", "weights": "saved weights"}


def open_for_saving(
    path: str | os.PathLike, kind: str, *, overwrite: bool, async_save: bool = False, device_copy: bool = True
) -> tuple[CheckpointDir, int]:
    """Opens `path` to save one model or set of weights into; returns the directory and the number to save as.

    A directory meshfit wrote for the same `kind` is overwritten (unless
    `overwrite=False`: a FileExistsError), crash-safely: the new checkpoint
    gets the next number and the old one is deleted only once the new one is
    complete (`max_to_keep=1`), so a crash mid-save leaves the old or the new
    copy, whole. A directory of another kind, or holding files meshfit did not
    write, is refused (`check_directory`).
    """
    ckpt = CheckpointDir(os.fspath(path), kind, max_to_keep=1, async_save=async_save, device_copy=device_copy)
    try:
        steps = ckpt.steps()
        if steps and not overwrite:
            raise FileExistsError(
                f"{ckpt.directory!r} already holds {_SINGLE_LABELS[kind]}. Pass overwrite=True (the default) to "
                "replace it."
            )
    except BaseException:
        ckpt.close()
        raise
    return ckpt, max(steps) + 1 if steps else 0
