"""ModelCheckpoint: save the model during training, asynchronously, with Orbax."""

from __future__ import annotations

import os

from meshfit import saving
from meshfit.callbacks.early_stopping import MonitorCallback
from meshfit.callbacks.progbar_logger import print_msg
from meshfit.checkpoint import CheckpointDir


class ModelCheckpoint(MonitorCallback):
    """Saves the model (or its weights) every epoch or every N batches.

    Checkpoints go to numbered subdirectories of `directory` (an Orbax
    `CheckpointManager`: the epoch number for `save_freq="epoch"`, the step
    otherwise). Writing happens in a background thread, so training continues
    while a checkpoint is written; the oldest are deleted beyond `max_to_keep`,
    and only once a newer one is complete. Load one with
    `model.load_weights(directory)` (the newest), onto any strategy. A
    directory that already holds checkpoints of the same numbers (from an
    earlier run) is not overwritten: the save raises FileExistsError.

    Args:
        directory: where to write; a directory holding anything else is refused.
        monitor: the logged value that decides "best" for `save_best_only`.
        verbose: 1 prints a line when a checkpoint is written.
        save_best_only: save only when `monitor` improved on the best so far.
        save_weights_only: save weights only, not optimizer state and step.
        mode: "auto", "min" or "max", as in Keras.
        save_freq: "epoch", or a number of batches between checkpoints.
        initial_value_threshold: a first "best" value to beat.
        max_to_keep: newest checkpoints kept (None keeps all).
        async_save: write in the background (True) or block until written.
    """

    def __init__(
        self,
        directory,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq="epoch",
        initial_value_threshold=None,
        max_to_keep: int | None = None,
        async_save: bool = True,
    ):
        super().__init__(monitor=monitor, mode=mode, baseline=initial_value_threshold)
        if save_freq != "epoch" and (not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(f"`save_freq` must be 'epoch' or a positive int. Received: save_freq={save_freq!r}.")
        self.directory = os.fspath(directory)
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self._dir: CheckpointDir | None = None
        self._epoch = 0
        self._last_step = 0

    def on_train_begin(self, logs=None):
        if self._dir is None:
            self._dir = CheckpointDir(
                self.directory, "checkpoint", max_to_keep=self.max_to_keep, async_save=self.async_save
            )
        if self.monitor_op is None:
            self._set_monitor_op()
        self._last_step = self.model.session.step

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self.model.session.step
        if self.save_freq != "epoch" and step // self.save_freq > self._last_step // self.save_freq:
            self._last_step = step
            self._maybe_save(step, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._maybe_save(epoch + 1, logs)

    def _maybe_save(self, number: int, logs) -> None:
        logs = logs or {}
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
                    f"saving to {os.path.join(self._dir.directory, str(number))}"
                )
            self.best = current
        elif self.verbose:
            print_msg(f"Epoch {self._epoch + 1}: saving model to {os.path.join(self._dir.directory, str(number))}")
        tree = (
            {"weights": saving.weights_tree(self.model)} if self.save_weights_only else saving.training_tree(self.model)
        )
        meta = {
            "epoch": self._epoch,
            "step": int(self.model.session.step),
            "weights_only": self.save_weights_only,
            "logs": {k: float(v) for k, v in logs.items()},
        }
        # A run resumed by BackupAndRestore may save a step it saved before (same values).
        self._dir.save(number, tree, meta, if_exists="skip" if self.model.session.resumed else "error")

    def state_dict(self):
        return {"best": None if self.best is None else float(self.best)}

    def load_state_dict(self, state):
        self.best = state["best"]

    def on_train_end(self, logs=None):
        self.close()  # a checkpoint is complete on disk when fit returns

    def close(self) -> None:
        """Waits for the checkpoint being written and releases the directory (also after a failed fit)."""
        if self._dir is not None:
            self._dir.close()
            self._dir = None
