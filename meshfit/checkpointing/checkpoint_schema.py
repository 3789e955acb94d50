"""What each kind of meshfit checkpoint holds, and how it maps to and from a `TrainState`.

One place answers, for every kind of checkpoint, three questions: which tree
to write from a state, which restore target to hand Orbax (laid out like the
live state: `CheckpointDir.restore` takes its shapes, dtypes and shardings, so
arrays land where this model's strategy puts them), and how a restored tree
goes back into a state. The layouts are the ones meshfit has always written,
so every checkpoint written before this module existed still loads (the
Orbax `state` item of each):

    WEIGHTS   save_weights, ModelCheckpoint(save_weights_only=True)
              {"weights": {"params", "model_state"}}
    TRAINING  model.save, ModelCheckpoint
              WEIGHTS' tree plus "step", "opt_state" and "loss_scale" (those the state has)
    BACKUP    BackupAndRestore
              {"train": <every TrainState field>, "arrays": {"a0": <host array>, ...}}

A backup's JSON part holds its position, the History so far and each
callback's `state_dict` (numpy arrays in them go to `"arrays"`, referenced by
name). Every schema can also read the weights alone out of its checkpoints
(`load_weights` of any directory).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from meshfit.core.state import TrainState

#: The format of the JSON record beside a saved model's or saved weights' arrays. 2: compile settings as
#: `meshfit.checkpointing.serialization` records (1: names only, objects left out).
FORMAT = 2
#: The format of a backup's JSON part. 2: callbacks' state filed by `state_key` (1: by "<index>:<class name>").
BACKUP_FORMAT = 2


def weights_of(state: TrainState) -> dict:
    """The part of a state that `get_weights` covers, as checkpoints hold it."""
    return {"params": state.params, "model_state": state.model_state}


def with_weights(state: TrainState, weights: dict) -> TrainState:
    """`state` with restored weights (already laid out for this model) in place of its own."""
    return state._replace(params=weights["params"], model_state=weights["model_state"])


class WeightsSchema:
    """The weights alone: `save_weights` and `ModelCheckpoint(save_weights_only=True)`."""

    kind = "weights"

    def tree(self, state: TrainState) -> dict:
        """What to write."""
        return {"weights": weights_of(state)}

    def target(self, state: TrainState) -> dict:
        """What to restore into, laid out like `state`."""
        return self.tree(state)

    def restored(self, state: TrainState, tree: dict) -> TrainState:
        """`state` with a restored `target` in place."""
        return with_weights(state, tree["weights"])

    def weights_target(self, state: TrainState) -> dict:
        """What to restore (partially) to read the weights alone out of a checkpoint of this schema."""
        return {"weights": weights_of(state)}

    def restored_weights(self, state: TrainState, tree: dict) -> TrainState:
        """`state` with the weights of a restored `weights_target` in place."""
        return with_weights(state, tree["weights"])

    def record(self, state: TrainState, compile_config: dict | None = None) -> dict:
        """The JSON record written beside the arrays of a single save (`save_weights`)."""
        del state, compile_config
        return {"format": FORMAT}


class TrainingSchema(WeightsSchema):
    """Weights plus what continues training (step, optimizer state, dynamic loss scale): `model.save`,
    `ModelCheckpoint`. What the live state lacks (no optimizer before `compile`) is neither written nor read."""

    kind = "model"

    def tree(self, state: TrainState) -> dict:
        tree = {"weights": weights_of(state), "step": state.step}
        if state.opt_state is not None:
            tree["opt_state"] = state.opt_state
        if state.loss_scale is not None:  # mixed_float16: the dynamic loss scale continues where it was
            tree["loss_scale"] = state.loss_scale
        return tree

    def restored(self, state: TrainState, tree: dict) -> TrainState:
        state = with_weights(state, tree["weights"])
        if "step" in tree:
            state = state._replace(step=tree["step"])
        if "opt_state" in tree:
            state = state._replace(opt_state=tree["opt_state"])
        if "loss_scale" in tree:
            saved = tree["loss_scale"]
            scale = type(state.loss_scale)(**saved) if isinstance(saved, dict) else type(state.loss_scale)(*saved)
            state = state._replace(loss_scale=scale)
        return state

    def record(self, state: TrainState, compile_config: dict | None = None) -> dict:
        """The JSON record `load_model` reads: the format, how the model was compiled, whether it has an optimizer."""
        return {"format": FORMAT, "compile": compile_config, "has_optimizer": state.opt_state is not None}


class Backup(NamedTuple):
    """Everything a backup holds: what `BackupAndRestore` needs to continue a fit exactly.

    Attributes:
        state: the whole training state.
        epoch, step_in_epoch, step, data_origin, data: the fit's position
            (`meshfit.training.session.Position`'s fields).
        history: History's `history` so far; `history_epochs` its `epoch`.
        callbacks: each other callback's `state_dict()`, by its state key
            (`meshfit.training.callback_protocol.state_keys`).
        format: `BACKUP_FORMAT` when read from a current backup; 1 for a
            backup whose callbacks are filed by "<index>:<class name>".
    """

    state: TrainState
    epoch: int
    step_in_epoch: int
    step: int
    data_origin: int
    data: dict
    history: dict[str, list]
    history_epochs: list[int]
    callbacks: dict[str, dict]
    format: int = BACKUP_FORMAT


class BackupSchema:
    """The whole training state, the fit's position, History and the callbacks' state: `BackupAndRestore`."""

    kind = "backup"

    def tree_and_meta(self, backup: Backup) -> tuple[dict, dict[str, Any]]:
        """The arrays to write and the JSON part beside them (numpy arrays in the callbacks' state and the
        input's position go with the arrays)."""
        arrays: dict = {}
        callbacks = {key: split_arrays(state, arrays) for key, state in backup.callbacks.items()}
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        data = split_arrays(backup.data, arrays)
        meta = {
            "epoch": backup.epoch,
            "step_in_epoch": backup.step_in_epoch,
            "data_origin": backup.data_origin,
            "history": backup.history,
            "history_epochs": backup.history_epochs,
            "callbacks": callbacks,
            "data": data,
            "format": BACKUP_FORMAT,
            "array_specs": {k: [list(v.shape), str(v.dtype)] for k, v in arrays.items()},
        }
        return {"train": backup.state, "arrays": arrays}, meta

    def target(self, state: TrainState, meta: dict[str, Any]) -> dict:
        """What to restore into: `state`'s layout, and host arrays of the shapes the JSON part records."""
        arrays = {k: np.zeros(shape, dtype) for k, (shape, dtype) in meta["array_specs"].items()}
        return {"train": state, "arrays": arrays}

    def restored(self, step: int, tree: dict, meta: dict[str, Any]) -> Backup:
        """A restored `target` and its JSON part, as a `Backup`."""
        arrays = {k: np.asarray(v) for k, v in tree["arrays"].items()}
        return Backup(
            state=tree["train"],
            epoch=meta["epoch"],
            step_in_epoch=meta["step_in_epoch"],
            step=step,
            data_origin=meta.get("data_origin", 0),  # backups from before it was saved: passes began at 0
            data=join_arrays(meta["data"], arrays),
            history=meta["history"],
            history_epochs=meta["history_epochs"],
            callbacks={key: join_arrays(state, arrays) for key, state in meta["callbacks"].items()},
            format=meta.get("format", 1),
        )

    def weights_target(self, state: TrainState) -> dict:
        """What to restore (partially) to read the weights alone: they lie in the training state."""
        return {"train": weights_of(state)}

    def restored_weights(self, state: TrainState, tree: dict) -> TrainState:
        """`state` with the weights of a restored `weights_target` in place."""
        return with_weights(state, tree["train"])


WEIGHTS = WeightsSchema()
TRAINING = TrainingSchema()
BACKUP = BackupSchema()

#: The schema of each kind of checkpoint directory (its marker's "kind"). ModelCheckpoint's numbered
#: checkpoints hold `TRAINING` or, with `save_weights_only`, `WEIGHTS`: the weights lie in the same place.
BY_KIND: dict[str, WeightsSchema | BackupSchema] = {
    "weights": WEIGHTS,
    "model": TRAINING,
    "checkpoint": TRAINING,
    "backup": BACKUP,
}


def for_kind(kind: str) -> WeightsSchema | BackupSchema:
    """The schema of a directory of `kind` checkpoints (see `BY_KIND`)."""
    try:
        return BY_KIND[kind]
    except KeyError:
        raise ValueError(
            f"Expected a meshfit checkpoint kind, one of {sorted(BY_KIND)}. Received: kind={kind!r}. "
            "The directory's meshfit_checkpoints.json names it; rewrite it if it is damaged."
        ) from None


def split_arrays(value: Any, arrays: dict, prefix: str = "a") -> Any:
    """Replaces numpy arrays in a JSON-like value by references; fills `arrays`."""
    if isinstance(value, np.ndarray):
        key = f"{prefix}{len(arrays)}"
        arrays[key] = value
        return {"__array__": key}
    if isinstance(value, dict):
        return {k: split_arrays(v, arrays, prefix) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [split_arrays(v, arrays, prefix) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def join_arrays(value: Any, arrays: dict) -> Any:
    """Inverse of `split_arrays`."""
    if isinstance(value, dict):
        if set(value) == {"__array__"}:
            return np.asarray(arrays[value["__array__"]])
        return {k: join_arrays(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [join_arrays(v, arrays) for v in value]
    return value
