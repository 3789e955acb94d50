"""ModelCheckpoint: save the model during training, asynchronously, with Orbax."""

from __future__ import annotations

import os
import string

from meshfit.callbacks.console import print_msg
from meshfit.callbacks.monitor import MonitorCallback
from meshfit.checkpointing.checkpoint import (
    CheckpointDir,
    finish_replacement,
    open_for_saving,
    replace_directory,
    staging_path,
)
from meshfit.checkpointing.checkpoint_schema import TRAINING, WEIGHTS, WeightsSchema
from meshfit.checkpointing.save_policy import AFTER_BATCH, AT_EPOCH_END, from_save_freq
from meshfit.core import keras_names
from meshfit.core.state import TrainState


def _has_fields(path: str) -> bool:
    """Whether `path` has `str.format` fields such as `{epoch:02d}` or `{val_loss:.2f}`."""
    try:
        return any(field is not None for _, field, _, _ in string.Formatter().parse(path))
    except ValueError:  # an unmatched brace: a literal name
        return False


#: Keras's file suffixes: a path ending in one names one save (a directory here), not a directory of checkpoints.
KERAS_SUFFIXES = (".keras", ".weights.h5")


class ModelCheckpoint(MonitorCallback):
    """Saves the model (or its weights) every epoch or every N batches.

    Two forms of `directory` (Keras's name, `filepath=`, is accepted too):

    * a plain path: checkpoints go to numbered subdirectories of it (an Orbax
      `CheckpointManager`: the epoch number, 1-based, for `save_freq="epoch"`,
      the step otherwise), the oldest deleted beyond `max_to_keep`, and only
      once a newer one is complete. Load the newest with
      `model.load_weights(directory)`. A new run into a directory that holds an
      earlier run's checkpoints replaces them, as Keras overwrites its file: the
      new run writes its first checkpoint beside the directory
      (`<directory>.meshfit-new`) and, once it is complete, takes the
      directory's place, so a crash leaves the old or the new checkpoints whole.
      A run resumed by `BackupAndRestore` continues its own checkpoints instead.
    * a path with `str.format` fields, as Keras's `filepath`: `{epoch}` (1-based),
      `{batch}` (1-based, for `save_freq=N`) and any log key, e.g.
      `"ckpt/model-{epoch:02d}-{val_loss:.2f}"`. Each save writes one model
      (`meshfit.load_model(path, module)` reads it) or, with
      `save_weights_only`, one set of weights, into the formatted path,
      replacing what an earlier save wrote there. A path ending in Keras's
      `.keras` or `.weights.h5` is of this form too, with or without fields:
      `"ckpt/{epoch}.keras"` writes the directories `ckpt/1.keras`, `ckpt/2.keras`,
      ..., each holding a meshfit saved model, and `.weights.h5` saves the
      weights only (Keras's `save_weights_only=True`).

    Writing happens in a background thread, so training continues while a
    checkpoint is written. With `overwrite=False`, checkpoints already on disk
    are never replaced (a FileExistsError). A directory holding files meshfit
    did not write, or another kind of checkpoints, is always refused.

    Args:
        directory: where to write (see above).
        monitor: the logged value that decides "best" for `save_best_only`.
        verbose: 1 prints a line when a checkpoint is written.
        save_best_only: save only when `monitor` improved on the best so far.
        save_weights_only: save weights only, not optimizer state and step.
        mode: "auto", "min" or "max", as in Keras.
        save_freq: "epoch", or a number of batches between checkpoints.
        initial_value_threshold: a first "best" value to beat.
        max_to_keep: newest checkpoints kept (None keeps all; a plain path only).
        async_save: write in the background (True) or block until written.
        device_copy: with `async_save`, a save copies the state on its devices
            and writes that copy from a background thread, so the loop only
            dispatches the copy; the devices hold one more copy of the state
            until it is written. False: no extra device memory, the loop waits
            for the fingerprints and the copy to the host (`CheckpointDir`).
        overwrite: replace checkpoints an earlier run (or save) wrote, as Keras does (True).
        filepath: Keras's name for `directory` (pass one of them).
    """

    def __init__(
        self,
        directory=None,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq="epoch",
        initial_value_threshold=None,
        max_to_keep: int | None = None,
        async_save: bool = True,
        overwrite: bool = True,
        device_copy: bool = True,
        *,
        filepath=None,
    ):
        directory = keras_names.alias("ModelCheckpoint", "filepath", filepath, "directory", directory)
        if directory is None:
            raise TypeError("ModelCheckpoint() needs where to save: `directory=` (or Keras's `filepath=`).")
        directory = os.fspath(directory)
        super().__init__(monitor=monitor, mode=mode, baseline=initial_value_threshold)
        self.save_policy = from_save_freq(save_freq)
        self.directory = directory
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only or directory.endswith(".weights.h5")
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self.device_copy = device_copy
        self.overwrite = overwrite
        self.formatted = _has_fields(directory) or directory.endswith(KERAS_SUFFIXES)
        self._dir: CheckpointDir | None = None
        self._earlier = False  # the directory held an earlier run's checkpoints when this run opened it
        self._epoch = 0
        self._last_step = 0  # the step of the last save point (or of the fit's start): what `save_freq` counts from

    def on_train_begin(self, logs=None):
        if self._dir is None and not self.formatted:
            finish_replacement(self.directory, "checkpoint")  # a replacement a crash interrupted
            self._dir = CheckpointDir(
                self.directory,
                "checkpoint",
                max_to_keep=self.max_to_keep,
                async_save=self.async_save,
                device_copy=self.device_copy,
            )
            self._earlier = bool(self._dir.steps())
        if self.monitor_op is None:
            self._set_monitor_op()
        self._last_step = self.context.step

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self.context.step
        if self.save_policy.should_save(step, (self._last_step,), context=AFTER_BATCH):
            self._last_step = step  # a save point, also when `save_best_only` then saves nothing
            with self.context.timer.phase("checkpoint"):  # the time the save holds the loop
                self._maybe_save(step, logs, batch=batch)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_policy.should_save(self.context.step, (self._last_step,), context=AT_EPOCH_END):
            with self.context.timer.phase("checkpoint"):
                self._maybe_save(epoch + 1, logs)

    def path_for(self, logs: dict, batch: int | None = None) -> str:
        """Where the next save goes: `directory` formatted as Keras formats `filepath` (a formatted path),
        or the numbered checkpoint in `directory`."""
        if not self.formatted:
            return os.path.join(os.path.abspath(self.directory), "<step>")
        if not _has_fields(self.directory):  # a Keras file name: one path for every save
            return self.directory
        fields = {"epoch": self._epoch + 1, **logs}
        if batch is not None and "batch" not in logs:
            fields["batch"] = batch + 1
        try:
            return self.directory.format(**fields)
        except (KeyError, IndexError) as error:
            raise KeyError(
                f'Failed to format this callback filepath: "{self.directory}". Reason: {error}. The fields it '
                f"can use are epoch, batch (with save_freq=N) and the logs: {sorted(logs)}."
            ) from None

    def _maybe_save(self, number: int, logs, batch: int | None = None) -> None:
        with self.context.timer.phase("steps"):  # reading the logs waits for the steps in flight: step time
            logs = {k: float(v) for k, v in (logs or {}).items()}
        target = self.path_for(logs, batch) if self.formatted else os.path.join(self._dir.directory, str(number))
        if self.save_best_only:
            current = logs.get(self.monitor)
            if current is None:
                print_msg(f"Can save best model only with {self.monitor} available, skipping.")
                return
            current = float(current)
            if not self._is_improvement(current, self.best):
                if self.verbose:
                    print_msg(f"Epoch {self._epoch + 1}: {self.monitor} did not improve from {self.best:.5f}")
                return
            if self.verbose:
                previous = "inf" if self.best is None else f"{self.best:.5f}"
                print_msg(
                    f"Epoch {self._epoch + 1}: {self.monitor} improved from {previous} to {current:.5f}, "
                    f"saving to {target}"
                )
            self.best = current
        elif self.verbose:
            print_msg(f"Epoch {self._epoch + 1}: saving model to {target}")
        state = self.context.state
        tree = self._schema.tree(state)
        meta = {
            "epoch": self._epoch,
            "step": int(self.context.step),
            "weights_only": self.save_weights_only,
            "logs": logs,
        }
        if self.formatted:
            self._save_formatted(target, tree, {**self._single_save_record(state), **meta})
        elif self._earlier and self.overwrite and not self.context.resumed:
            self._replace_earlier_run(number, tree, meta)
        else:
            # A run resumed by BackupAndRestore may save a step it saved before (same values).
            self._dir.save(number, tree, meta, if_exists="skip" if self.context.resumed else "error")

    @property
    def _schema(self) -> WeightsSchema:
        """What each save holds: the weights, or (unless `save_weights_only`) what continues training too."""
        return WEIGHTS if self.save_weights_only else TRAINING

    def _single_save_record(self, state: TrainState) -> dict:
        """The JSON record `model.save` (or `save_weights`) writes, for `load_model` to read."""
        compile_config = self.model.get_compile_config() if self._schema is TRAINING else None
        return self._schema.record(state, compile_config)

    def _save_formatted(self, path: str, tree: dict, meta: dict) -> None:
        """One model (or weights) in its own directory, as `model.save` writes it; written in the background."""
        self.close()  # the previous save is complete first (it may be the same directory)
        self._dir, number = open_for_saving(
            path, self._schema.kind, overwrite=self.overwrite, async_save=self.async_save, device_copy=self.device_copy
        )
        self._dir.save(number, tree, meta)

    def _replace_earlier_run(self, number: int, tree, meta: dict) -> None:
        """This run's first checkpoint replaces an earlier run's: written beside, then swapped in whole."""
        staged = staging_path(self._dir.directory)
        self.close()  # the directory's lock file moves with it: released before the swap
        finish_replacement(self.directory, "checkpoint")  # a stale staging copy goes
        new = CheckpointDir(staged, "checkpoint", max_to_keep=self.max_to_keep, async_save=False)
        try:
            new.save(number, tree, meta, wait=True)
        finally:
            new.close()
        replace_directory(staged, self.directory, "checkpoint")
        self._dir = CheckpointDir(
            self.directory, "checkpoint", max_to_keep=self.max_to_keep, async_save=self.async_save
        )
        self._earlier = False

    def state_dict(self):
        return {"best": None if self.best is None else float(self.best)}

    def load_state_dict(self, state):
        self.best = state["best"]

    def on_train_end(self, logs=None):
        self.close()  # a checkpoint is complete on disk when fit returns

    def close(self) -> None:
        """Waits for the checkpoint being written and releases the directory (also after a failed fit)."""
        if self._dir is not None:
            with self.context.timer.phase("checkpoint"):
                self._dir.close()
            self._dir = None
