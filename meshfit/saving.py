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

from meshfit.checkpoint import CheckpointDamaged, CheckpointDir, read_marker, readable_path

FORMAT = 1
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


def compile_record(model) -> dict | None:
    """How the model was compiled, where that can be written down (names)."""
    compiled = model.compile_settings
    if compiled is None:
        return None
    names = lambda values: [v for v in values if isinstance(v, str)]  # noqa: E731
    optimizer = compiled.optimizer_id if isinstance(compiled.optimizer_id, str) else None
    loss = compiled.loss_id if isinstance(compiled.loss_id, str) else None
    return {
        "optimizer": optimizer,
        "loss": loss,
        "metrics": names(compiled.metrics),
        "dtype_policy": compiled.dtype_policy.name,
        "gradient_accumulation_steps": compiled.gradient_accumulation_steps,
    }


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


def load_saved_model(model, path, *, compile: bool = True, **compile_kwargs) -> None:
    """Loads a model saved with `model.save` into `model` (built from a module of the same architecture).

    With `compile`, the model is compiled as it was saved (optimizer, loss and
    metrics given by name, `compile_kwargs` overriding them) and its optimizer
    state and step are restored too; see `meshfit.load_model`.
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
        saved = meta.get("compile") or {}
        kwargs = {k: v for k, v in saved.items() if v}
        kwargs.update(compile_kwargs)
        if compile and kwargs.get("optimizer") is not None:
            model.compile(**kwargs)
        with_optimizer = model.session.latest.opt_state is not None and meta.get("has_optimizer")
        template = training_tree(model) if with_optimizer else {"weights": weights_tree(model)}
        found = ckpt.restore_latest(template, partial=True)
    finally:
        ckpt.close()
    if found is None:
        raise FileNotFoundError(f"{ckpt.directory!r} holds no readable saved model (see the warnings above).")
    set_from_tree(model, found[1])
