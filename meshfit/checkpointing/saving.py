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
import warnings
from collections.abc import Callable
from typing import Any

from meshfit.checkpointing import config_check, serialization
from meshfit.checkpointing.checkpoint import (
    CheckpointDamaged,
    CheckpointDir,
    open_for_saving,
    read_marker,
    readable_path,
)
from meshfit.checkpointing.checkpoint_schema import TRAINING, WEIGHTS, for_kind

#: The compile arguments a saved model's record holds (format 2), in `Model.compile`'s order.
COMPILE_ENTRIES = config_check.ENTRIES


def compile_record(model) -> dict | None:
    """How the model was compiled, as JSON (see `meshfit.checkpointing.serialization`).

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
    was not a name and none is passed. An optimizer that could not be saved
    and is not passed gives `optimizer=None` (with a warning naming it): the
    model evaluates and predicts, and `fit` asks for the optimizer.

    Raises:
        ValueError: a loss or metric the saved model was compiled with could
            not be saved (code) and is not in `compile_kwargs`: compiling
            without it would give other numbers; or a saved setting is not
            one meshfit accepts (`meshfit.checkpointing.config_check`), naming its field.
    """
    saved = meta.get("compile")
    config_check.check_compile_record(saved, skip=compile_kwargs)  # a garbled record: refused before anything
    if meta.get("format", 1) < 2 or saved is None:  # names only; what was not a name is left out
        kwargs = {k: v for k, v in (saved or {}).items() if v}
        kwargs.update(compile_kwargs)
        return kwargs if kwargs.get("optimizer") is not None else None
    missing = {
        entry: serialization.unsaved(saved.get(entry)) for entry in COMPILE_ENTRIES if entry not in compile_kwargs
    }
    missing = {entry: found for entry, found in missing.items() if found}
    if set(missing) - {"optimizer"}:
        raise ValueError(_unsaved_message(missing))
    if missing:
        warnings.warn(_no_optimizer_message(missing["optimizer"]), stacklevel=4)  # load_model's caller
    kwargs = {}
    for entry in COMPILE_ENTRIES:
        value = saved.get(entry)
        if entry in compile_kwargs or entry in missing:
            continue
        if entry == "optimizer":  # None: saved from a model compiled without one
            kwargs[entry] = serialization.deserialize_optimizer(value)
        elif value is not None:
            kwargs[entry] = serialization.deserialize(value)
    kwargs.setdefault("optimizer", None)  # the one that could not be saved: none, rather than another
    kwargs.update(compile_kwargs)
    return kwargs


def _no_optimizer_message(found: list[str]) -> str:
    """Says that a model loads without its optimizer, and how to train it."""
    return (
        f"The saved model's optimizer {', '.join(f'`{d}`' for d in found)} is code that `save` could not write "
        "down; it loads without one: evaluate and predict work, fit asks for it. To train on from the saved "
        "optimizer state, pass it: load_model(path, module, optimizer=...)."
    )


def _unsaved_message(missing: dict[str, list[str]]) -> str:
    """Names what `load_model` needs passed again, and how."""
    what = "; ".join(f"{entry} {', '.join(f'`{d}`' for d in found)}" for entry, found in missing.items())
    received = " or ".join(f"`{entry}`" for entry in missing)
    example = ", ".join(
        f"{entry}={found[0]}" if entry in ("optimizer", "loss") and found[0].isidentifier() else f"{entry}=..."
        for entry, found in missing.items()
    )
    return (
        "Expected load_model to be given again what the model was compiled with that `save` could not write down "
        f"(code, not a built-in name): {what}. Received: no {received} argument. Pass each as it was given to "
        f"compile, e.g. load_model(path, module, {example}), or pass compile=False to load the weights alone."
    )


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


def _write(path: str | os.PathLike, kind: str, tree: dict, meta: dict, overwrite: bool) -> None:
    ckpt, number = open_for_saving(path, kind, overwrite=overwrite)
    try:
        ckpt.save(number, tree, meta, wait=True)
    finally:
        ckpt.close()


def save_model(model, path: str | os.PathLike, overwrite: bool = True) -> None:
    """Writes weights, optimizer state, step and compile settings to `path` (see `checkpoint.open_for_saving`)."""
    state = model.session.state
    _write(path, "model", TRAINING.tree(state), TRAINING.record(state, compile_record(model)), overwrite)


def save_weights(model, path: str | os.PathLike, overwrite: bool = True) -> None:
    """Writes the weights (trainable and non-trainable) to `path` (see `checkpoint.open_for_saving`)."""
    state = model.session.state
    _write(path, "weights", WEIGHTS.tree(state), WEIGHTS.record(state), overwrite)


def load_weights(model, path: str | os.PathLike) -> None:
    """Loads weights saved by `save_weights`, `save`, `ModelCheckpoint` (its newest checkpoint) or
    `BackupAndRestore` (its newest backup).

    Arrays are laid out by the model's strategy, whatever layout saved them.
    """
    ckpt = _open_for_reading(path, ("weights", "model", "checkpoint", "backup"))
    schema = for_kind(ckpt.kind)
    try:
        found = ckpt.restore_latest(schema.weights_target(model.session.state), partial=True)
    finally:
        ckpt.close()
    if found is None:
        raise FileNotFoundError(f"{os.fspath(path)!r} holds no complete checkpoint.")
    model.session.state = schema.restored_weights(model.session.latest, found[1])


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
        schema = TRAINING if with_optimizer else WEIGHTS
        found = ckpt.restore_latest(schema.target(model.session.state), partial=True)
    finally:
        ckpt.close()
    if found is None:
        raise FileNotFoundError(f"{ckpt.directory!r} holds no readable saved model (see the warnings above).")
    model.session.state = schema.restored(model.session.latest, found[1])
    return model
