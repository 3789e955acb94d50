"""Checkpoint directories on Orbax: save a state pytree plus JSON, restore onto any layout.

`CheckpointDir` wraps an `orbax.checkpoint.CheckpointManager` with what
meshfit promises about saved files:
  * a directory that holds files meshfit did not write is never used;
  * an older checkpoint is deleted only after a newer one is complete (Orbax
    writes to a temporary directory and renames it when done);
  * a checkpoint that cannot be read (cut off, truncated) is skipped with a
    warning naming it and moved aside as `<step>.unreadable` (never deleted),
    and the previous one is restored;
  * restoring lays arrays out as the template says — a different strategy
    or mesh than the one that saved them.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

MARKER = "meshfit_checkpoints.json"
STATE, META = "state", "meta"


def is_key(leaf) -> bool:
    """Whether `leaf` is a typed PRNG key array."""
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def encode(tree):
    """Replaces typed PRNG keys by their raw data (what Orbax can store)."""
    return jax.tree.map(lambda leaf: jax.random.key_data(leaf) if is_key(leaf) else leaf, tree)


def decode(restored, template):
    """Wraps raw key data back into typed keys where the template has keys."""
    return jax.tree.map(
        lambda new, old: jax.random.wrap_key_data(new, impl=jax.random.key_impl(old)) if is_key(old) else new,
        restored, template)


def abstract(template):
    """Shape, dtype and sharding of each leaf: the target layout of a restore."""
    def one(leaf):
        sharding = getattr(leaf, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

    return jax.tree.map(one, encode(template))


def check_directory(directory: str, kind: str) -> None:
    """Refuses a directory that holds anything meshfit did not write there."""
    if not os.path.exists(directory):
        return
    if not os.path.isdir(directory):
        raise FileExistsError(f"{kind} directory {directory!r} is a file. Pass a directory path.")
    entries = [e for e in os.listdir(directory) if not e.startswith(".")]
    if not entries:
        return
    marker = os.path.join(directory, MARKER)
    if not os.path.exists(marker):
        raise FileExistsError(
            f"{kind} directory {directory!r} already holds files meshfit did not write ({sorted(entries)[:5]}). "
            "meshfit never writes into such a directory; choose a new or empty one.")
    with open(marker) as f:
        found = json.load(f).get("kind")
    if found != kind:
        raise FileExistsError(
            f"Directory {directory!r} holds meshfit {found} checkpoints, not {kind} ones; choose another directory.")


class CheckpointDir:
    """Numbered checkpoints of a state pytree and a JSON dict in one directory.

    Args:
        directory: where checkpoints go (created if missing).
        kind: what this directory is for ("backup", "checkpoint", "model");
            a directory is only ever reused for the same kind.
        max_to_keep: how many complete checkpoints to keep (None: all).
        async_save: write in a background thread; `save` returns once the
            arrays are copied off the devices.
    """

    def __init__(self, directory: str, kind: str, *, max_to_keep: int | None = 2, async_save: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        self.kind = kind
        check_directory(self.directory, kind)
        if jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
            marker = os.path.join(self.directory, MARKER)
            if not os.path.exists(marker):
                with open(marker, "w") as f:
                    json.dump({"kind": kind, "format": 1}, f)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, META))

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict[str, Any], *, wait: bool = False, if_exists: str = "skip") -> None:
        """Starts writing checkpoint `step`; with `wait`, returns when it is complete.

        If checkpoint `step` exists already it is never overwritten: with
        `if_exists="skip"` it is kept (a resumed run saves the same values),
        with "error" a FileExistsError says so.
        """
        if step in self.manager.all_steps():
            if if_exists == "error":
                raise FileExistsError(
                    f"Checkpoint {os.path.join(self.directory, str(step))} already exists (from an earlier run?). "
                    "meshfit does not overwrite it: use a new directory, or move the old checkpoints away.")
            if wait:
                self.manager.wait_until_finished()
            return
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(encode(state)), META: ocp.args.JsonSave(meta)})
        self.manager.save(step, args=args, force=True)
        if wait:
            self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON part of checkpoint `step`."""
        return dict(self.manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META])

    def restore(self, step: int, template, *, partial: bool = False):
        """Restores checkpoint `step`; returns (state, meta).

        `template` is a pytree of arrays laid out as the restored state should
        be, or a function of the checkpoint's meta that returns one. With
        `partial`, the template may name a subset of what was saved.
        """
        meta = self.read_meta(step)
        if callable(template):
            template = template(meta)
        target = abstract(template)
        if partial:  # the PyTree handler reads Standard checkpoints and can skip what the target lacks
            restore = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                             restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        else:
            restore = ocp.args.StandardRestore(target)
        args = ocp.args.Composite(**{STATE: restore})
        restored = self.manager.restore(step, args=args)
        return decode(restored[STATE], template), meta

    def _move_aside(self, step: int) -> None:
        source = os.path.join(self.directory, str(step))
        target = f"{source}.unreadable"
        if jax.process_index() == 0:
            suffix = 0
            while os.path.exists(target):
                suffix += 1
                target = f"{source}.unreadable{suffix}"
            os.rename(source, target)
            warnings.warn(f"Moved the unreadable checkpoint {source} to {target}.", stacklevel=3)
        self.manager.reload()

    def restore_latest(self, template, *, partial: bool = False, steps=None):
        """The newest readable checkpoint as (step, state, meta), or None if there is none.

        A checkpoint that fails to load is skipped with a warning naming it.
        `steps` limits the candidates (default: all complete checkpoints).
        """
        for step in reversed(sorted(self.steps() if steps is None else steps)):
            try:
                state, meta = self.restore(step, template, partial=partial)
            except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is skipped
                warnings.warn(
                    f"Checkpoint {os.path.join(self.directory, str(step))} could not be read "
                    f"({type(error).__name__}: {str(error)[:200]}); trying the previous one.", stacklevel=2)
                self._move_aside(step)  # out of the rotation, so nothing deletes it
                continue
            return step, state, meta
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
