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
name); `BackupSchema.check_meta` refuses one that `target` and `restored`
cannot take as it is. Every schema can also read the weights alone out of its
checkpoints (`load_weights` of any directory).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from meshfit.core.state import TrainState
from meshfit.pipeline import layer_stacks

#: The format of the JSON record beside a saved model's or saved weights' arrays. 2: compile settings as
#: `meshfit.checkpointing.serialization` records (1: names only, objects left out).
FORMAT = 2
#: The format of a backup's JSON part. 2: callbacks' state filed by `state_key` (1: by "<index>:<class name>").
BACKUP_FORMAT = 2

#: How deeply lists and objects may nest in a backup's JSON part (and a snapshot part's header, which holds
#: one): a backup nests a few levels (a callback's state, an input's position); refusing deeper ones keeps
#: the parsers and `join_arrays`, which recurse once a level, far from Python's recursion limit.
MAX_JSON_DEPTH = 64
#: The most axes an array of a checkpoint may have (numpy's own limit is 64; 32 before numpy 2).
MAX_RANK = 32
#: An array's bytes must stay below numpy's own limit on an array's size.
_MAX_ARRAY_BYTES = 2**63 - 1
#: What `restored` reads of a backup's JSON part without a default.
_META_REQUIRED = ("epoch", "step_in_epoch", "history", "history_epochs", "callbacks", "data", "array_specs")


def short_repr(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters, a nested or long list or dict described instead: an error
    quoting what it received stays short however large that was (a damaged or hostile file's)."""
    if isinstance(value, (list, dict)):
        items = value.values() if isinstance(value, dict) else value
        if len(value) > limit or any(isinstance(item, (list, dict)) for item in items):
            return f"<a {type(value).__name__} of {len(value)}>"
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an int of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _array_dtypes() -> dict[str, np.dtype]:
    """`ARRAY_DTYPES`: each of these names that numpy resolves here (importing jax registers ml_dtypes' narrow
    types with numpy)."""
    names = ["bool", "bfloat16", "complex64", "complex128"]
    names += [f"{kind}{bits}" for kind in ("int", "uint") for bits in (2, 4, 8, 16, 32, 64)]
    names += [f"float{bits}" for bits in (16, 32, 64)]
    names += ["float4_e2m1fn", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn"]
    names += ["float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"]
    found = {}
    for name in names:
        try:
            found[name] = np.dtype(name)
        except TypeError:  # an older ml_dtypes without this one: no array of it can have been saved
            continue
    return found


#: The dtypes an array of a checkpoint may have, by name (`np.dtype(x).name`, as a snapshot part and a
#: backup's `array_specs` spell them): booleans and numbers, JAX's narrow floats and ints among them (a
#: typed PRNG key is saved as its uint32 data). An object or string array is never restored: its bytes are
#: not values.
ARRAY_DTYPES: dict[str, np.dtype] = _array_dtypes()


def array_nbytes(shape: Any, dtype: Any, field: str) -> int:
    """The bytes of an array of `shape` (a list of axis lengths) and `dtype` (a name in `ARRAY_DTYPES`), after
    checking both; `ValueError` naming `field` when they describe no array numpy could hold."""
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise ValueError(
            f"{field}: expected a shape, a list of at most {MAX_RANK} axis lengths. Received: {short_repr(shape)}."
        )
    if not all(isinstance(axis, int) and not isinstance(axis, bool) and axis >= 0 for axis in shape):
        raise ValueError(f"{field}: expected axis lengths that are ints >= 0. Received: shape={short_repr(shape)}.")
    if not isinstance(dtype, str) or dtype not in ARRAY_DTYPES:
        raise ValueError(
            f"{field}: expected a dtype, one of {', '.join(sorted(ARRAY_DTYPES))}. Received: dtype={short_repr(dtype)}."
        )
    itemsize = ARRAY_DTYPES[dtype].itemsize
    # numpy refuses a shape whose nonzero axes overflow its size, even where another axis is 0
    if itemsize * math.prod(max(axis, 1) for axis in shape) > _MAX_ARRAY_BYTES:
        raise ValueError(f"{field}: shape {short_repr(shape)} of {dtype} is larger than any array numpy can hold.")
    return itemsize * math.prod(shape)


def check_json_depth(value: Any, field: str) -> None:
    """Refuses (`ValueError` naming `field`) lists and dicts in `value` nested deeper than `MAX_JSON_DEPTH`;
    walks `value` without recursion, so it refuses a value nested too deeply for Python's own limit too."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"{field}: lists and objects nested deeper than {MAX_JSON_DEPTH} levels.")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))


def _int_at_least(meta: dict, key: str, lowest: int) -> int:
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{key}: expected an int >= {lowest}. Received: {key}={short_repr(value)}.")
    return value


def _array_references(value: Any, field: str, specs: dict) -> None:
    """Refuses `{"__array__": name}` references in `value` (as `join_arrays` reads them) to no array of `specs`."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if set(item) == {"__array__"} and not (isinstance(item["__array__"], str) and item["__array__"] in specs):
                raise ValueError(
                    f"{field}: a reference to array {short_repr(item['__array__'])}, expected a name in array_specs."
                )
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def weights_of(state: TrainState) -> dict:
    """The part of a state that `get_weights` covers, as checkpoints hold it: layer stacks in their natural
    (layers, ...) form whatever the schedule stores them in (`meshfit.pipeline.layer_stacks`)."""
    return layer_stacks.natural({"params": state.params, "model_state": state.model_state})


def with_weights(state: TrainState, weights: dict) -> TrainState:
    """`state` with restored weights (laid out for this model, layer stacks in either form) in place of its own."""
    weights = layer_stacks.stored(weights, {"params": state.params, "model_state": state.model_state})
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
        if state.opt_state is not None:  # its moments follow the parameters: stacks in the natural form too
            tree["opt_state"] = layer_stacks.natural(state.opt_state)
        if state.loss_scale is not None:  # mixed_float16: the dynamic loss scale continues where it was
            tree["loss_scale"] = state.loss_scale
        return tree

    def restored(self, state: TrainState, tree: dict) -> TrainState:
        state = with_weights(state, tree["weights"])
        if "step" in tree:
            state = state._replace(step=tree["step"])
        if "opt_state" in tree:
            state = state._replace(opt_state=layer_stacks.stored(tree["opt_state"], state.opt_state))
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
        state: the whole training state (read back from a backup, layer stacks in their natural form, as
            saved: `meshfit.training.session.Session.restore` stores them as the live state does).
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
        return {"train": layer_stacks.natural(backup.state), "arrays": arrays}, meta

    def check_meta(self, meta: Any, step: int, array_bytes: int | None = None, first_epoch: int | None = None) -> None:
        """Refuses a JSON part that `target` and `restored` cannot take as it is, or whose position no fit
        reaches: a `ValueError` naming the entry, before anything is allocated.

        A backup's own JSON part always passes; one read from bytes a keeper or a disk handed back may not
        (damaged, or written by something else). Checked: every entry `restored` reads, with its JSON type;
        the position (`epoch`, `step_in_epoch`, `history_epochs` ints >= 0; `step_in_epoch` at most `step`,
        as every batch of an epoch took a step; the data pass `data_origin + epoch` >= 0, as passes are
        numbered from 0 (`data_origin` itself is negative for a fit begun at an `initial_epoch`)); each
        `array_specs` entry an array numpy can hold; every `{"__array__": name}` in `callbacks` and `data`
        naming one of them; nesting at most `MAX_JSON_DEPTH` deep. Entries it does not read (such as
        `"job"`) are left alone.

        Args:
            meta: the JSON part.
            step: the step the backup was taken at (its directory's or snapshot's).
            array_bytes: when the arrays `array_specs` describes travel in a known number of bytes (a
                snapshot part's array bytes): their total may not exceed it, so a part cannot ask for more
                memory than it brought.
            first_epoch: the running fit's `initial_epoch`, when the caller knows it: every epoch the
                backup's fit passed from there took a step at least, so an `epoch` beyond
                `first_epoch + step` is refused. Without it no upper bound holds: a fit begun at
                `initial_epoch=k` (e.g. fine-tuning after `compile`, whose step count starts at 0 again)
                backs up epoch `k` at any step.
        """
        if not isinstance(meta, dict):
            raise ValueError(f"a backup's JSON part: expected an object. Received: {type(meta).__name__}.")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected an int >= 0. Received: step={short_repr(step)}.")
        missing = [key for key in _META_REQUIRED if key not in meta]
        if missing:
            raise ValueError(
                f"a backup's JSON part lacks {', '.join(missing)}; it was not written by BackupAndRestore."
            )
        check_json_depth(meta, "a backup's JSON part")
        epoch = _int_at_least(meta, "epoch", 0)
        if _int_at_least(meta, "step_in_epoch", 0) > step:
            raise ValueError(
                f"step_in_epoch: {short_repr(meta['step_in_epoch'])} batches of an epoch at step {step}: expected "
                "at most one a step."
            )
        if first_epoch is not None and epoch > first_epoch + step:
            raise ValueError(
                f"epoch: epoch {short_repr(epoch)} at step {step} of a fit begun at epoch {first_epoch}: expected "
                f"at most {first_epoch + step} (a step an epoch at least)."
            )
        if "data_origin" in meta:
            origin = meta["data_origin"]
            if isinstance(origin, bool) or not isinstance(origin, int) or origin + epoch < 0:
                raise ValueError(
                    f"data_origin: expected an int with data_origin + epoch >= 0 (the data pass epoch {epoch} "
                    f"reads). Received: data_origin={short_repr(origin)}."
                )
        if "format" in meta:
            form = meta["format"]
            if isinstance(form, bool) or not isinstance(form, int) or not 1 <= form <= BACKUP_FORMAT:
                raise ValueError(
                    f"format: expected an int from 1 to {BACKUP_FORMAT}. Received: format={short_repr(form)}."
                )
        history = meta["history"]
        if not isinstance(history, dict) or not all(isinstance(v, list) for v in history.values()):
            raise ValueError("history: expected an object of lists (History's `history`).")
        epochs = meta["history_epochs"]
        if not isinstance(epochs, list) or not all(
            isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in epochs
        ):
            raise ValueError("history_epochs: expected a list of ints >= 0 (History's `epoch`).")
        callbacks = meta["callbacks"]
        if not isinstance(callbacks, dict) or not all(isinstance(v, dict) for v in callbacks.values()):
            raise ValueError("callbacks: expected an object of objects (each callback's `state_dict()`).")
        if not isinstance(meta["data"], dict):
            raise ValueError("data: expected an object (the training input's `get_state()`).")
        specs = meta["array_specs"]
        if not isinstance(specs, dict):
            raise ValueError("array_specs: expected an object of [shape, dtype] entries.")
        total = 0
        for name, spec in specs.items():
            field = f"array_specs[{short_repr(name)}]"
            if not isinstance(spec, list) or len(spec) != 2:
                raise ValueError(f"{field}: expected [shape, dtype]. Received: {short_repr(spec)}.")
            total += array_nbytes(spec[0], spec[1], field)
        if array_bytes is not None and total > array_bytes:
            raise ValueError(
                f"array_specs: {total:,} bytes of arrays, more than the {array_bytes:,} bytes that hold them."
            )
        _array_references(callbacks, "callbacks", specs)
        _array_references(meta["data"], "data", specs)

    def target(self, state: TrainState, meta: dict[str, Any]) -> dict:
        """What to restore into: `state`'s layout (layer stacks in the natural form, as saved), and host arrays
        of the shapes the JSON part records."""
        arrays = {k: np.zeros(shape, dtype) for k, (shape, dtype) in meta["array_specs"].items()}
        return {"train": layer_stacks.natural(state), "arrays": arrays}

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
