"""Saving and loading models and weights with Orbax, onto any strategy or mesh.

A saved model is a directory holding one Orbax checkpoint: the weights, the
optimizer state and step, and a JSON record of how the model was compiled.
Flax modules are Python code, so loading takes a module of the same
architecture (`load_model(path, module)`), as Orbax restores into a template.
Arrays are laid out as the loading model's strategy decides: saved under
MirroredStrategy on 8 devices, restored on one device or sharded with fsdp.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from meshfit import serialization
from meshfit.checkpoint import CheckpointDamaged, CheckpointDir, read_marker, readable_path

#: The format of the JSON record written beside saved arrays. 2: compile settings as
#: `meshfit.serialization` records (1: names only, objects left out).
FORMAT = 2
_LABELS = {"model": "a saved model", "weights": "saved weights"}


def weights_tree(model) -> dict:
    """The part of a model's state that `get_weights` covers, as saved on disk."""
    state = model.session.state
    return {"params": state.params, "model_state": state.model_state}


def training_tree(model) -> dict:
    """Weights plus optimizer state and step: enough to continue training."""
    state = model.session.state
    tree = {"weights": weights_tree(model), "step": state.step}
    if state.opt_state is not None:
        tree["opt_state"] = state.opt_state
    if state.loss_scale is not None:  # mixed_float16: the dynamic loss scale continues where it was
        tree["loss_scale"] = state.loss_scale
    return tree


def set_from_tree(model, tree: dict) -> None:
    """Puts restored values (already laid out for this model) into its state."""
    state = model.session.latest._replace(params=tree["weights"]["params"], model_state=tree["weights"]["model_state"])
    if "step" in tree:
        state = state._replace(step=tree["step"])
    if "opt_state" in tree:
        state = state._replace(opt_state=tree["opt_state"])
    if "loss_scale" in tree:
        saved = tree["loss_scale"]
        scale = type(state.loss_scale)(**saved) if isinstance(saved, dict) else type(state.loss_scale)(*saved)
        state = state._replace(loss_scale=scale)
    model.session.state = state


#: The compile arguments a saved model's record holds (format 2), in `Model.compile`'s order.
COMPILE_ENTRIES = (
    "optimizer",
    "loss",
    "loss_weights",
    "metrics",
    "weighted_metrics",
    "steps_per_execution",
    "dtype_policy",
    "gradient_accumulation_steps",
)


def compile_record(model) -> dict | None:
    """How the model was compiled, as JSON (see `meshfit.serialization`).

    Names, meshfit's built-in losses and metrics, and optimizers built by
    `meshfit.optimizers.get` are written down; anything else is recorded as
    `{"__custom__": description}`, for `load_model` to ask for again.
    """
    compiled = model.compile_settings
    if compiled is None:
        return None
    return {
        "optimizer": serialization.serialize_optimizer(compiled.optimizer_id),
        "loss": serialization.serialize(compiled.loss_id),
        "loss_weights": serialization.serialize(getattr(compiled, "loss_weights", None)),
        "metrics": serialization.serialize(compiled.metrics),
        "weighted_metrics": serialization.serialize(compiled.weighted),
        "steps_per_execution": compiled.steps_per_execution,
        "dtype_policy": compiled.dtype_policy.name,
        "gradient_accumulation_steps": compiled.gradient_accumulation_steps,
    }


def compile_arguments(meta: dict, compile_kwargs: dict) -> dict | None:
    """The arguments to compile a loaded model with: the saved ones, `compile_kwargs` overriding them.

    None when the model is not to be compiled: it was saved uncompiled and no
    optimizer is passed, or (records of format 1, names only) its optimizer
    was not a name and none is passed.

    Raises:
        ValueError: an entry the saved model was compiled with could not be
            saved (a custom loss, metric or optimizer) and is not in
            `compile_kwargs`: compiling without it would give other numbers.
    """
    saved = meta.get("compile")
    if meta.get("format", 1) < 2 or saved is None:  # names only; what was not a name is left out
        kwargs = {k: v for k, v in (saved or {}).items() if v}
        kwargs.update(compile_kwargs)
        return kwargs if kwargs.get("optimizer") is not None else None
    missing = {
        entry: serialization.unsaved(saved.get(entry)) for entry in COMPILE_ENTRIES if entry not in compile_kwargs
    }
    missing = {entry: found for entry, found in missing.items() if found}
    if missing:
        raise ValueError(_unsaved_message(missing))
    kwargs = {}
    for entry in COMPILE_ENTRIES:
        value = saved.get(entry)
        if entry in compile_kwargs or value is None:
            continue
        if entry == "optimizer":
            kwargs[entry] = serialization.deserialize_optimizer(value)
        else:
            kwargs[entry] = serialization.deserialize(value)
    kwargs.update(compile_kwargs)
    return kwargs


def _unsaved_message(missing: dict[str, list[str]]) -> str:
    """Names what `load_model` needs passed again, and how."""
    what = "; ".join(f"{entry} {', '.join(f'`{d}`' for d in found)}" for entry, found in missing.items())
    received = " or ".join(f"`{entry}`" for entry in missing)
    example = ", ".join(
        f"{entry}={found[0]}" if entry in ("optimizer", "loss") and found[0].isidentifier() else f"{entry}=..."
        for entry, found in missing.items()
    )
    return (
        "Expected load_model to be given again what the saved model was compiled with that `save` could not "
        "write down (code: not a name, one of meshfit's built-in losses and metrics, or an optimizer from "
        f"meshfit.optimizers.get with JSON arguments): {what}. Received: no {received} argument. Pass each as "
        f"it was given to compile, e.g. load_model(path, module, {example}), or pass compile=False to load the "
        "weights alone."
    )


def model_meta(model) -> dict:
    """The JSON record `load_model` reads beside a saved model's arrays."""
    has_optimizer = model.session.latest.opt_state is not None
    return {"format": FORMAT, "compile": compile_record(model), "has_optimizer": has_optimizer}


def _open_for_reading(path, kinds: tuple[str, ...]) -> CheckpointDir:
    """Opens a saved model, weights or checkpoints without writing anything there (not even a marker)."""
    path = readable_path(os.fspath(path))  # also a copy a crash left mid-replacement
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No meshfit checkpoint at {path!r}: no such directory.")
    marker = read_marker(path)
    if marker is None:
        raise FileNotFoundError(
            f"No meshfit checkpoint at {path!r}: it has no {'meshfit_checkpoints.json'} "
            "marker. Pass the directory that model.save, save_weights or ModelCheckpoint wrote."
        )
    if marker["kind"] not in kinds:
        raise ValueError(f"{path!r} holds meshfit {marker['kind']} checkpoints; expected {' or '.join(kinds)}.")
    return CheckpointDir(path, marker["kind"], read_only=True)


def open_for_saving(path, kind: str, *, overwrite: bool, async_save: bool = False) -> tuple[CheckpointDir, int]:
    """Opens `path` to save one model or set of weights into; returns the directory and the number to save as.

    A directory meshfit wrote for the same `kind` is overwritten (unless
    `overwrite=False`: a FileExistsError), crash-safely: the new checkpoint
    gets the next number and the old one is deleted only once the new one is
    complete (`max_to_keep=1`), so a crash mid-save leaves the old or the new
    copy, whole. A directory of another kind, or holding files meshfit did not
    write, is refused (`meshfit.checkpoint.check_directory`).
    """
    ckpt = CheckpointDir(os.fspath(path), kind, max_to_keep=1, async_save=async_save)
    try:
        steps = ckpt.steps()
        if steps and not overwrite:
            raise FileExistsError(
                f"{ckpt.directory!r} already holds {_LABELS[kind]}. Pass overwrite=True (the default) to replace it."
            )
    except BaseException:
        ckpt.close()
        raise
    return ckpt, max(steps) + 1 if steps else 0


def _write(path, kind: str, tree, meta: dict, overwrite: bool) -> None:
    ckpt, number = open_for_saving(path, kind, overwrite=overwrite)
    try:
        ckpt.save(number, tree, meta, wait=True)
    finally:
        ckpt.close()


def save_model(model, path, overwrite: bool = True) -> None:
    """Writes weights, optimizer state, step and compile settings to `path` (see `open_for_saving`)."""
    _write(path, "model", training_tree(model), model_meta(model), overwrite)


def save_weights(model, path, overwrite: bool = True) -> None:
    """Writes the weights (trainable and non-trainable) to `path` (see `open_for_saving`)."""
    _write(path, "weights", {"weights": weights_tree(model)}, {"format": FORMAT}, overwrite)


def load_weights(model, path) -> None:
    """Loads weights saved by `save_weights`, `save` or `ModelCheckpoint` (its newest checkpoint).

    Arrays are laid out by the model's strategy, whatever layout saved them.
    """
    ckpt = _open_for_reading(path, ("weights", "model", "checkpoint", "backup"))
    try:
        template = {"weights": weights_tree(model)}
        if ckpt.kind == "backup":  # a backup's weights live in its training state
            template = {
                "train": {"params": template["weights"]["params"], "model_state": template["weights"]["model_state"]}
            }
        found = ckpt.restore_latest(template, partial=True)
    finally:
        ckpt.close()
    if found is None:
        raise FileNotFoundError(f"{os.fspath(path)!r} holds no complete checkpoint.")
    tree = found[1]
    if "train" in tree:
        tree = {"weights": tree["train"]}
    set_from_tree(model, tree)


def load_saved_model(path, build: Callable[[], Any], *, compile: bool = True, **compile_kwargs):
    """Loads a model saved with `model.save` into the model `build()` returns; returns that model.

    With `compile`, the model is compiled as it was saved (`compile_kwargs`
    overriding entries; see `compile_arguments`) and its optimizer state and
    step are restored too; see `meshfit.load_model`. `build` is called once the
    saved record has been read and checked, so a refusal leaves the module alone.
    """
    ckpt = _open_for_reading(path, ("model",))
    try:
        steps = ckpt.steps()
        if not steps:
            raise FileNotFoundError(f"{ckpt.directory!r} holds no complete saved model.")
        try:
            meta = ckpt.read_meta(steps[-1])
        except CheckpointDamaged as damage:
            raise CheckpointDamaged(f"The saved model {ckpt.directory!r} is damaged: {damage}.") from None
        arguments = compile_arguments(meta, compile_kwargs) if compile else None
        model = build()
        if arguments is not None:
            model.compile(**arguments)
        with_optimizer = model.session.latest.opt_state is not None and meta.get("has_optimizer")
        template = training_tree(model) if with_optimizer else {"weights": weights_tree(model)}
        found = ckpt.restore_latest(template, partial=True)
    finally:
        ckpt.close()
    if found is None:
        raise FileNotFoundError(f"{ckpt.directory!r} holds no readable saved model (see the warnings above).")
    set_from_tree(model, found[1])
    return model
