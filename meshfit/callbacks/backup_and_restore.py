"""BackupAndRestore: resume a killed or preempted `fit` exactly where it stopped."""

from __future__ import annotations

import math
import os
import re
import time
import warnings

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshfit import compilation_cache
from meshfit.checkpointing import job_fingerprint, memory_tier
from meshfit.checkpointing.checkpoint import CheckpointDir, CheckpointWriteError, NonFiniteState
from meshfit.checkpointing.checkpoint_schema import BACKUP, Backup
from meshfit.checkpointing.save_policy import (
    AFTER_BATCH,
    AT_EPOCH_END,
    AT_PREEMPTION,
    AnySavePolicy,
    DecisionContext,
    PreemptionPolicy,
    StepIntervalPolicy,
    from_save_freq,
)
from meshfit.runtime import keeper_protocol
from meshfit.runtime.preemption import DEFAULT_PREEMPTION_TIMEOUT
from meshfit.training.callback_protocol import Callback, state_keys
from meshfit.training.fit_cursor import Position

#: How backups of format 1 filed a callback's state: its index among the fit's other callbacks, and its class.
_POSITIONAL_KEY = re.compile(r"^(\d+):(.+)$")


def _from_positional_keys(saved: dict[str, dict], callbacks: list[Callback], keys: list[str]) -> dict[str, dict]:
    """The state of a format-1 backup ("<index>:<class name>") filed by today's keys.

    The k-th saved callback of a class goes to the k-th callback of that class
    now, so callbacks of different classes may have moved. Saved states with no
    such callback keep their old key (`_check_every_state_has_a_callback` names it).
    """
    now: dict[str, list[str]] = {}
    for cb, key in zip(callbacks, keys, strict=True):
        now.setdefault(type(cb).__name__, []).append(key)
    found, seen = {}, {}
    positional = sorted(
        ((int(m.group(1)), m.group(2), key) for key in saved if (m := _POSITIONAL_KEY.match(key))),
        key=lambda entry: entry[0],
    )
    for _, class_name, old_key in positional:
        k = seen[class_name] = seen.get(class_name, -1) + 1
        same_class = now.get(class_name, [])
        found[same_class[k] if k < len(same_class) else old_key] = saved[old_key]
    return found


#: Seconds a memory snapshot may wait for the one before it without a warning, however short the steps.
SLOW_SNAPSHOT_WAIT = 0.05


class BackupAndRestore(Callback):
    """Backs up training so a restarted `fit` continues from the exact step.

    At the start of `fit` the newest complete backup in `backup_dir`, if any,
    is restored: parameters, optimizer state, metric accumulators, step and
    RNG, the epoch and the batch within it (numpy inputs replay the same
    shuffled order; re-iterable datasets are advanced to the same batch; a
    one-shot generator cannot be rewound, with a warning), the History so
    far and the state of every callback that has one (EarlyStopping,
    ReduceLROnPlateau, ...), filed under its `state_key` (its class name by
    default), so callbacks of different classes may be reordered; a backup
    holding state for a callback the fit lacks is refused (a `ValueError`)
    before any step. Resumed runs end bitwise equal to uninterrupted ones on
    the same machine.

    Backups are written asynchronously with Orbax; the previous backup is
    deleted only after a newer one is complete. A backup that cannot be read
    or whose arrays no longer match their fingerprints is moved aside as
    `<step>.unreadable` (never deleted) and the one before is restored; a
    backup of a different model, or of a fit compiled differently (another
    optimizer or learning rate, loss, `steps_per_execution`, dtype policy:
    `meshfit.checkpointing.job_fingerprint`), is refused with a `ValueError`
    naming what differs, and nothing on disk changes. A state holding NaN or Inf is never saved, and a fit that
    ends on a non-finite loss keeps its backups. Only one job at a time may
    write into `backup_dir` (a lock file). On SIGTERM (preemption), `fit`
    saves a backup at the next step boundary and raises `meshfit.Preempted`
    (exit status 143); if the fit has not ended `preemption_timeout` seconds
    after the SIGTERM (no step boundary came: a hung compile, input, callback
    or collective), the process logs what it waited for and exits with 143
    without saving, the newest complete backup intact. After a `fit` that
    ends normally the backups are deleted (`delete_checkpoint=True`), as in Keras.

    With `memory_freq=K`, every K steps between disk backups a snapshot of
    exactly what a backup holds goes to host RAM outside the training
    processes: the keeper of `meshfit launch`, which outlives its ranks across
    `--max-restarts` (`meshfit.launch.keeper`), or under `meshfit launch
    --ray` the keeper of each node that runs ranks, each process's snapshot
    sent on by its own node's keeper to `memory_replicas - 1` other nodes'
    keepers (off the training process's path) so a lost node loses none. On
    its own node a process writes its part straight into memory the keeper
    lends it (no socket): on CPU devices from the live arrays, which holds the
    loop for that one copy; on an accelerator taking one holds the loop as long
    as starting an async save (a copy on the devices; the copy to the host and
    the hand-over run behind the next steps). A snapshot counts once
    every process's part has arrived whole; a restart resumes from the newest
    such snapshot when it is newer than the newest disk backup, else from disk,
    and says which. After an elastic restart onto fewer processes the snapshot
    of the larger job is restored when each process's part holds the arrays
    whole (replicated state, as under data parallelism); a state sharded
    across processes resumes from disk (with a warning). A snapshot whose
    part does not match its checksum, or one a process died while writing or
    sending, is never restored. In a multi-process job every process restores
    the same tier and step, or all resume from disk together. When the keeper's
    host cannot hold the snapshots, or the keeper stops answering
    (`keeper_protocol.ANSWER_TIMEOUT` without progress), the fit warns once and
    backs up to disk only; a backup directory that cannot be written (a
    read-only mount) then hides no newer snapshot: the fit resumes from it and
    backs up in memory only.

    Args:
        backup_dir: directory for the backups, created with mode 0700; a
            directory holding anything else, or one that is not yours alone
            (another user's, or writable by group or others: whoever can write
            there decides what the job resumes and runs) is refused before any
            step (`meshfit.checkpointing.trusted_dirs`).
        save_freq: "epoch", or a number of batches between backups.
        double_checkpoint: Keras's name for keeping the previous backup to fall
            back on: meshfit always does (`max_to_keep=2`); True keeps at least two.
        delete_checkpoint: delete the backups when training finishes.
        max_to_keep: complete backups kept on disk.
        async_save: write in the background while training continues.
        device_copy: with `async_save`, a save copies the state on its devices
            and writes that copy from a background thread (one more copy of
            the state in device memory until it is written); False: no extra
            device memory, the loop waits for the copy to the host.
        compilation_cache: where JAX keeps the compiled programs, so a resumed
            run loads them instead of compiling again (`meshfit.compilation_cache`):
            True (default) puts what the fit compiles in
            `<backup_dir>/.compilation_cache`, deleted with the backups,
            unless a cache was already chosen
            (`JAX_COMPILATION_CACHE_DIR`, `mf.compilation_cache.use`); a path
            puts them there; False leaves JAX's setting alone.
        preemption_timeout: seconds from a SIGTERM (or SIGINT) to the
            process's end at the latest, even with the main thread stuck in C
            (`meshfit.runtime.preemption.DEFAULT_PREEMPTION_TIMEOUT`, 25 s: within the
            30 s grace period of Kubernetes, SLURM and GCE preemptions). Past
            it the process exits with 143 (130 after SIGINT) without saving.
            None: wait for the step boundary however long it takes.
        memory_freq: steps between snapshots in the launcher's memory (see
            above), or None for disk backups only. Needs `meshfit launch`
            (one machine) or `meshfit launch --ray`; a process started
            without either is refused with a `ValueError` before any step.
        memory_replicas: keepers holding each process's snapshot, on
            distinct nodes: its own node's and the next ones' (under
            `--ray`, a keeper runs on each node that runs ranks), so losing
            a node loses no snapshot. None: 2 where the ranks run on
            several nodes, else 1. More than the job's nodes is refused (a
            restart that lost nodes warns instead).

    Example:

    ```python
    backup = mf.callbacks.BackupAndRestore("/ckpt/run1", save_freq=100, preemption_timeout=25)
    model.fit(dataset, epochs=10, steps_per_epoch=1000, callbacks=[backup])

    # under `meshfit launch --nprocs 2 --max-restarts 3 train.py`: a snapshot in RAM every 10 steps
    backup = mf.callbacks.BackupAndRestore("/ckpt/run1", save_freq=1000, memory_freq=10)
    ```
    """

    handles_preemption = True

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        max_to_keep: int = 2,
        async_save: bool = True,
        compilation_cache: bool | str | os.PathLike = True,
        device_copy: bool = True,
        preemption_timeout: float | None = DEFAULT_PREEMPTION_TIMEOUT,
        memory_freq: int | None = None,
        memory_replicas: int | None = None,
    ):
        super().__init__()
        self.memory_policy = self._memory_policy(memory_freq, memory_replicas)
        self.memory_freq = memory_freq
        self.memory_replicas = memory_replicas  # None: 2 where the ranks run on several nodes, else 1
        if preemption_timeout is not None and (
            isinstance(preemption_timeout, bool)
            or not isinstance(preemption_timeout, (int, float))
            or not 0 < preemption_timeout < math.inf
        ):
            raise ValueError(
                "`preemption_timeout` must be a positive number of seconds, or None for no bound. "
                f"Received: preemption_timeout={preemption_timeout!r}."
            )
        self.preemption_timeout = None if preemption_timeout is None else float(preemption_timeout)
        self.save_policy = AnySavePolicy((from_save_freq(save_freq), PreemptionPolicy()))
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.double_checkpoint = double_checkpoint
        self.max_to_keep = max(max_to_keep, 2) if double_checkpoint else max_to_keep
        self.async_save = async_save
        self.device_copy = device_copy
        self.compilation_cache = compilation_cache
        self._cache: str | None = None  # the compilation cache this fit turned on, turned off when it ends
        self._own_cache: str | None = None  # the one made inside backup_dir, deleted with the backups
        self._dir: CheckpointDir | None = None
        self._saved_step = 0  # the step of the last save (or of the fit's start): what `save_freq` counts from
        self._refused_step: int | None = None  # a step whose state was not finite, so not saved
        self._others: dict[str, Callback] = {}  # the fit's other callbacks, by state key
        self._memory: memory_tier.MemoryTier | None = None  # this fit's snapshots in the launcher's keeper
        self._memory_ever: memory_tier.MemoryTier | None = None  # the tier of this fit, also once turned off
        self._job: dict = {}  # this fit's `job_fingerprint`, written into each backup
        self._disk_error: str | None = None  # why the backup directory cannot be written (memory tier only)
        self._memory_step = 0  # the step of the last snapshot (or disk backup, or start)
        self._memory_since: float | None = None  # when the last snapshot was started (time.perf_counter)
        self._memory_slow_said = False  # warned that snapshots hold training

    @staticmethod
    def _memory_policy(memory_freq, memory_replicas) -> StepIntervalPolicy | None:
        """The memory tier's interval, after checking it can be kept (refused before any state changes)."""
        if memory_freq is None:
            return None
        if isinstance(memory_freq, bool) or not isinstance(memory_freq, int) or memory_freq < 1:
            raise ValueError(f"`memory_freq` must be a positive int or None. Received: memory_freq={memory_freq!r}.")
        if memory_replicas is not None and (
            isinstance(memory_replicas, bool) or not isinstance(memory_replicas, int) or memory_replicas < 1
        ):
            raise ValueError(
                f"`memory_replicas` must be a positive int or None. Received: memory_replicas={memory_replicas!r}."
            )
        if not keeper_protocol.available():
            raise ValueError(
                f"`memory_freq={memory_freq}` keeps snapshots in a launcher's memory, and this process was not "
                f"started by one that keeps them: {keeper_protocol.LAUNCHERS_WITH_KEEPER}. Start it with "
                "`meshfit launch [--ray] --nprocs N ... train.py`, or pass memory_freq=None for disk backups only."
            )
        nodes = keeper_protocol.nodes()
        if (
            memory_replicas is not None
            and memory_replicas > nodes
            and os.environ.get("MESHFIT_RESTART_COUNT", "0") != "0"
            and os.environ.get(keeper_protocol.ENV_KEEPER_HOMES)
        ):
            # A Ray restart on fewer nodes (a node lost, an elastic restart): each part goes to every node. On one
            # machine the nodes never change, so a restart decides as the first start did (an error).
            warnings.warn(
                f"BackupAndRestore: `memory_replicas={memory_replicas}`, and this restarted job's ranks run on "
                f"{nodes} node(s): each memory snapshot is kept on {nodes} node(s) until the job runs on more.",
                stacklevel=3,
            )
        elif memory_replicas is not None and memory_replicas > nodes:
            raise ValueError(
                f"`memory_replicas={memory_replicas}` needs a keeper on as many nodes; this job's ranks run on "
                f"{nodes} node(s), each with one. Pass memory_replicas <= {nodes}, or None (2 where there are "
                "several nodes)."
            )
        return StepIntervalPolicy(memory_freq)

    def _replicas(self) -> int:
        """Keepers holding each process's snapshot: as asked, else 2 where the ranks run on several nodes."""
        return min(self.memory_replicas or 2, keeper_protocol.nodes())

    # -- what goes into a backup ---------------------------------------------------

    def _keyed_others(self) -> dict[str, Callback]:
        """The fit's other callbacks by the key their state is filed under (`state_keys`)."""
        others = [cb for cb in self.context.callbacks if cb is not self]
        return dict(zip(state_keys(others), others, strict=True))

    def _save(self, logs=None, *, wait: bool = False) -> None:
        """Backs up the fit's state at its position; `logs` are an ending epoch's (History records them later).
        Where the directory cannot be written, a memory snapshot instead (awaited with `wait`)."""
        if self._disk_error is not None:
            if self._memory is not None:
                self._snapshot()
                if wait:
                    self.wait_until_finished()
            return
        with self.context.timer.phase("checkpoint"):  # the time the save holds the loop
            self._write(logs, wait=wait)

    def _backup_tree(self, logs=None, finished: bool = True) -> tuple[int, dict, dict]:
        """The step, tree and JSON part of a backup of the fit's state at its position (settles the state;
        with `finished`, waits for the devices to compute it)."""
        context = self.context
        position = context.position(finished)
        history = self.model.history
        history_dict = {k: list(v) for k, v in history.history.items()}
        history_epochs = list(history.epoch)
        if logs is not None and position.epoch - 1 not in history_epochs and position.step_in_epoch == 0:
            # Saving at an epoch end before History recorded it (History runs later).
            history_epochs.append(position.epoch - 1)
            for k, v in logs.items():
                history_dict.setdefault(k, []).append(v)
        callbacks = {key: cb.state_dict() for key, cb in self._others.items()}
        backup = Backup(
            state=context.state,
            epoch=position.epoch,
            step_in_epoch=position.step_in_epoch,
            step=position.step,
            data_origin=position.data_origin,
            data=position.data,
            history=history_dict,
            history_epochs=history_epochs,
            callbacks=callbacks,
        )
        tree, meta = BACKUP.tree_and_meta(backup)
        meta[job_fingerprint.KEY] = self._job
        return position.step, tree, meta

    def _write(self, logs, *, wait: bool) -> None:
        step, tree, meta = self._backup_tree(logs)
        self._saved_step = self._memory_step = step
        try:
            self._dir.save(step, tree, meta, wait=wait or not self.async_save, finite_only=True)
        except NonFiniteState as error:
            if self._refused_step is None and self.model.strategy.is_chief:
                print(
                    f"BackupAndRestore: not saving the state at step {step}: {error}. The last finite backup "
                    f"(step {self._newest()}) is kept.",
                    flush=True,
                )
            self._refused_step = step

    def _newest(self):
        steps = self._dir.steps() if self._dir is not None else []
        return steps[-1] if steps else "none"

    def _restore(self) -> None:
        """Continues from the newest committed memory snapshot when every process can restore its part of it
        and it is newer than the newest readable disk backup, else from that backup, if any; checks first that
        the backup is this job's (`job_fingerprint`) and that every saved callback state has its callback in
        this fit, so a refusal changes nothing."""
        model = self.model

        def template_of(meta):
            self._check_job(meta)
            return BACKUP.target(self.context.template, meta)

        found, tier = self._agreed(self._from_memory(template_of)), "memory"
        if found is None:
            found, tier = self._dir.restore_latest(template_of), "disk"
        if found is None:
            return
        step, tree, meta = found
        backup = BACKUP.restored(step, tree, meta)
        saved = backup.callbacks
        if backup.format < 2:
            saved = _from_positional_keys(saved, list(self._others.values()), list(self._others))
        self._check_every_state_has_a_callback(saved, step)
        model.history.history.update(backup.history)
        model.history.epoch[:] = backup.history_epochs
        for key, cb in self._others.items():
            if saved.get(key):
                cb.load_state_dict(saved[key])
        position = Position(backup.epoch, backup.step_in_epoch, step, backup.data_origin, backup.data)
        self.context.restore(backup.state, position)
        if model.strategy.is_chief:
            if tier == "memory":
                disk = self._dir.steps()
                print(
                    f"BackupAndRestore: resumed from the launcher's memory snapshot{self._memory_source()} at epoch "
                    f"{backup.epoch + 1}, "
                    f"batch {backup.step_in_epoch} (step {step}), newer than the newest disk backup "
                    f"({f'step {disk[-1]}' if disk else 'none'}).",
                    flush=True,
                )
            else:
                print(
                    f"BackupAndRestore: resumed from {self._dir.directory} at epoch {backup.epoch + 1}, "
                    f"batch {backup.step_in_epoch} (step {step}).",
                    flush=True,
                )

    def _check_job(self, meta) -> None:
        """Refuses a backup written by a fit compiled differently (`job_fingerprint`), naming what differs."""
        differs = job_fingerprint.differences(meta.get(job_fingerprint.KEY), self._job)
        if differs:
            raise job_fingerprint.BackupOfAnotherJob(
                f"BackupAndRestore: a backup in {self._dir.directory} (on disk, or the launcher's memory snapshot "
                f"of it) was written by a fit compiled differently: {'; '.join(differs)}. Nothing was restored.\n"
                "Compile as that fit did to resume it, or pass another backup_dir to start afresh."
            )

    def _agreed(self, found):
        """`found` (this process's memory snapshot, or None) where every process of the job found the same
        step and can restore its part of it, else None everywhere (the job resumes from disk together); and
        the memory tier on where it is on for every process. One all-gather of two numbers a process: a job
        whose processes restored different steps would deadlock in its first collective."""
        if self.memory_policy is None or jax.process_count() == 1:
            return found
        mine = [found[0] if found is not None else -1, int(self._memory is not None)]
        steps, on = _gathered(mine).T
        if not on.all() and self._memory is not None:
            ranks = ", ".join(str(r) for r in np.flatnonzero(on == 0))
            self._memory_off(f"process(es) {ranks} could not reach their keeper")
        if found is not None and (steps == steps[0]).all():
            return found
        if steps.max() >= 0 and self.model.strategy.is_chief:
            lacking = ", ".join(
                f"{r} ({'none' if s < 0 else f'step {s}'})" for r, s in enumerate(steps) if s != steps.max()
            )
            print(
                f"BackupAndRestore: not resuming from the memory snapshot of step {steps.max()}: process(es) "
                f"{lacking} could not restore their part of it; every process resumes from disk.",
                flush=True,
            )
        return None

    def _memory_source(self) -> str:
        """Whose snapshot was restored, for the log: another world size's job; a keeper on another node."""
        memory = self._memory
        if memory is None:
            return ""
        said = f" of a {memory.saved_world}-process job" if memory.saved_world != memory.world else ""
        if len(memory.addresses) > 1:
            own = memory.source == memory.addresses[memory.home]
            said += f" held by the keeper at {memory.source} ({'this' if own else 'another'} node's)"
        return said

    def _from_memory(self, template_of):
        """The newest committed memory snapshot as (step, tree, meta) when it is newer than every disk backup;
        None otherwise (also when it cannot be used: then with a warning)."""
        if self._memory is None:
            return None
        disk = self._dir.steps()
        try:
            fetched = self._memory.newest()
        except memory_tier.KEEPER_ERRORS as error:
            self._memory_off(f"the keeper did not answer ({memory_tier.error_text(error)})")
            return None
        if fetched is None:
            return None
        if disk and fetched[0] <= disk[-1]:
            self._memory.release(fetched[1])
            return None
        first_epoch = self.context.position(finished=False).epoch  # the fit's initial_epoch: nothing restored yet
        restored = self._memory.restore(fetched[0], fetched[1], template_of, first_epoch=first_epoch)
        return None if restored is None else (fetched[0], *restored)

    def _memory_off(self, why) -> None:
        """Backs up to disk only for the rest of the fit, saying why once."""
        memory, self._memory = self._memory, None
        if memory is not None:
            memory.close()
        if self.model.strategy.is_chief:
            rest = (
                "backing up to disk only"
                if self._disk_error is None
                else "and the backup directory cannot be written: no more backups"
            )
            warnings.warn(f"BackupAndRestore: memory snapshots are off for this fit, {rest}: {why}.", stacklevel=2)

    def _check_every_state_has_a_callback(self, saved: dict[str, dict], step: int) -> None:
        """Refuses a backup holding state for callbacks this fit lacks: resuming would silently drop it."""
        orphans = sorted(key for key, state in saved.items() if state and key not in self._others)
        if not orphans:
            return
        raise ValueError(
            f"BackupAndRestore: the backup at step {step} in {self._dir.directory} holds the state of "
            f"callback(s) {', '.join(map(repr, orphans))}, expected among this fit's callbacks (by `state_key`): "
            f"{', '.join(map(repr, self._others)) or 'none'}. Nothing was restored. Pass those callbacks to fit again "
            "(same `state_key`) to resume them, or start afresh with a new or empty backup_dir."
        )

    # -- hooks ---------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._refused_step = None
        self._memory_ever = None
        self._others = self._keyed_others()
        self._job = job_fingerprint.of(self.model)
        if self.memory_policy is not None:
            self._memory = memory_tier.MemoryTier(os.path.abspath(self.backup_dir), self._replicas())
            self._memory_ever = self._memory
            self._memory_since, self._memory_slow_said = None, False
        with self.context.timer.phase("checkpoint"):
            self._dir = self._open_directory()
            # The cache an earlier start of this job made is on for the restore too (its programs: the checks of
            # what is read); a new one is made only after the restore, which may refuse the directory.
            self._use_compilation_cache(existing_only=True)
            self._restore()
        self._use_compilation_cache()
        self._saved_step = self._memory_step = self.context.step

    def _open_directory(self) -> CheckpointDir:
        """The backup directory, opened to write; with the memory tier on, one that cannot be written (a
        read-only mount, on any process) is opened to read only, so a newer memory snapshot still resumes
        the fit, which then backs up in the launcher's memory only (said once). Without the tier such a
        directory fails the fit before any step (`CheckpointWriteError`)."""
        self._disk_error = None
        directory: CheckpointDir | None = None
        try:
            directory = CheckpointDir(
                self.backup_dir,
                "backup",
                max_to_keep=self.max_to_keep,
                async_save=self.async_save,
                device_copy=self.device_copy,
            )
        except CheckpointWriteError as error:
            if self.memory_policy is None or not os.path.isdir(self.backup_dir):
                raise
            self._disk_error = str(error).split(". Check that")[0]
        if self.memory_policy is not None and jax.process_count() > 1:
            if not _gathered([int(directory is not None)]).all() and directory is not None:
                directory.close()
                directory = None
                self._disk_error = f"another process of the job cannot write into {self.backup_dir!r}"
        if directory is None:
            directory = CheckpointDir(self.backup_dir, "backup", read_only=True)
            if self.model.strategy.is_chief:
                warnings.warn(
                    f"BackupAndRestore: {self._disk_error}. Resuming from the newest backup and backing up to the "
                    f"launcher's memory only (every {self.memory_freq} steps) for this fit; make the directory "
                    "writable for disk backups.",
                    stacklevel=3,
                )
        return directory

    def _use_compilation_cache(self, existing_only: bool = False) -> None:
        """Points JAX's persistent cache at the backups (before the first step compiles), unless told otherwise;
        with `existing_only`, only at a cache in the backups already (one made by an earlier start of the job)."""
        if self._cache is not None:
            return  # on already (before the restore)
        if self.compilation_cache is True:
            if self._disk_error is not None:
                return  # nothing can be written into the backup directory
            inside = os.path.abspath(os.path.join(self.backup_dir, compilation_cache.BACKUP_CACHE_NAME))
            if existing_only and not os.path.isdir(inside):
                return
            self._cache = inside if compilation_cache.default_to(inside) == inside else None
            self._own_cache = self._cache
        elif self.compilation_cache is not False:  # a path of the user's: nothing written into backup_dir
            self._cache = compilation_cache.use(self.compilation_cache)

    def _should_save(self, context: DecisionContext) -> bool:
        return self.save_policy.should_save(self.context.step, (self._saved_step,), context=context)

    def on_train_batch_end(self, batch, logs=None):
        if self._should_save(AFTER_BATCH):
            self._save()
        elif self._memory is not None and self.memory_policy.should_save(
            self.context.step, (self._memory_step,), context=AFTER_BATCH
        ):
            self._snapshot()

    def _snapshot(self) -> None:
        """Starts a snapshot in the launcher's memory (the copy to the host and the send run in a thread)."""
        with self.context.timer.phase("checkpoint"):
            # No wait for the steps in flight: the snapshot's device copies queue behind them.
            step, tree, meta = self._backup_tree(finished=False)
            self._memory_step = step
            try:
                waited = self._memory.save(step, tree, meta)
            except memory_tier.MemoryTierUnavailable as error:
                self._memory_off(error)
                return
        now = time.perf_counter()
        if self._memory_since is not None and not self._memory_slow_said:
            self._say_if_snapshots_hold_training(waited, now - self._memory_since)
        self._memory_since = now

    def _say_if_snapshots_hold_training(self, waited: float, interval: float) -> None:
        """Warns once when a snapshot waited for the one before it for over a tenth of the time between them (and
        `SLOW_SNAPSHOT_WAIT` seconds at least: milliseconds on a toy model's sub-millisecond steps are noise):
        the keeper cannot take a snapshot every `memory_freq` steps without slowing training."""
        if waited <= max(0.1 * interval, SLOW_SNAPSHOT_WAIT):
            return
        self._memory_slow_said = True
        memory, training = self._memory, max(interval - waited, 1e-6)
        every = math.ceil(self.memory_freq * memory.send_seconds / training)
        if self.model.strategy.is_chief:
            warnings.warn(
                f"BackupAndRestore: memory snapshots hold training: a snapshot waited {_seconds(waited)} for the "
                f"one before it, which took {_seconds(memory.send_seconds)} to reach the keeper "
                f"({memory.part_bytes / 2**20:,.1f} MiB a process), while memory_freq={self.memory_freq} steps "
                f"train in {_seconds(training)}.\n"
                f"Pass memory_freq={every} or more to keep the loop free.",
                stacklevel=3,
            )

    def on_epoch_end(self, epoch, logs=None):
        if self._should_save(AT_EPOCH_END):
            self._save(logs)

    def on_preemption(self, epoch, step_in_epoch):
        if self._should_save(AT_PREEMPTION):
            self._save(wait=True)

    def on_train_end(self, logs=None):
        directory = self._dir
        newest = self._newest()
        memory = self._memory_ever  # turned off or not: a keeper that answers again must forget the fit
        self.close()
        if not self.delete_checkpoint or directory is None:
            return
        if self._ended_non_finite(directory, logs):
            if self.model.strategy.is_chief:
                print(
                    f"BackupAndRestore: training ended on a non-finite loss or state (NaN or Inf), so the "
                    f"backups in {directory.directory} are kept (newest: step {newest}; no non-finite state "
                    "was saved). Fix the cause (a lower learning rate, clipping, the data) and run again to "
                    "resume from it.",
                    flush=True,
                )
            return
        if memory is not None:
            unreachable = memory.drop()  # a finished fit resumes from nothing
            memory.close()
            if unreachable and self.model.strategy.is_chief:
                warnings.warn(
                    f"BackupAndRestore: could not ask {unreachable} to forget this fit's memory snapshots; "
                    "they go when the launch ends.",
                    stacklevel=2,
                )
        if self._disk_error is not None:
            return  # the directory cannot be written: its backups stay as they are
        if self._own_cache is not None and self.model.strategy.is_chief:
            compilation_cache.remove(self._own_cache)  # but what was moved aside in it
        kept = directory.remove_complete()
        if kept and self.model.strategy.is_chief:
            print(
                f"BackupAndRestore: deleted the backups but kept {kept} in {directory.directory} "
                "(moved aside: unreadable backups, or cache entries JAX must not load; meshfit never deletes them).",
                flush=True,
            )

    def _ended_non_finite(self, directory, logs) -> bool:
        loss = (logs or {}).get("loss")
        if self._refused_step is not None or (loss is not None and not math.isfinite(float(loss))):
            return True
        return bool(directory.non_finite(self.context.latest))  # the program its saves compiled: no new one

    def wait_until_finished(self) -> None:
        """Returns when the backup being written and the memory snapshot being sent are complete (as Orbax's
        `CheckpointManager.wait_until_finished`): say, before a step that must find them committed."""
        if self._memory is not None:
            try:
                self._memory.wait()
            except memory_tier.MemoryTierUnavailable as error:
                self._memory_off(error)
        if self._dir is not None:
            with self.context.timer.phase("checkpoint"):
                self._dir.wait()

    def close(self) -> None:
        """Waits for the backup being written and releases the directory (also after a failed fit).

        The compilation cache turned on for this fit is turned off: what is
        compiled after it (another model, another fit) is not written into
        these backups.
        """
        if self._cache is not None:
            compilation_cache.release(self._cache)
            self._cache = None
        if self._memory is not None:
            memory, self._memory = self._memory, None
            failed = memory.close()  # after the snapshot in flight, so it is complete when the fit returns
            if failed is not None:
                self._memory_off(failed)
        if self._dir is not None:
            with self.context.timer.phase("checkpoint"):
                self._dir.close()
            self._dir = None


def _gathered(values: list[int]) -> np.ndarray:
    """Every process's `values` (small ints), one row a process: how the ranks of a job agree before a restore."""
    mine = np.asarray(values, np.int32)
    return np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(mine))


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 1 else f"{1e3 * t:.1f} ms"
