"""`model.export(path)`: the forward pass for serving, callable with JAX alone (no meshfit, no Flax).

The directory holds two files:

- `forward.jax`: the inference forward pass, `forward(weights, x) -> y`,
  serialized by `jax.export` (StableHLO), with a symbolic batch dimension `b`:
  one file serves batches of any size.
- `weights.npz`: the weights it takes, `w0`, `w1`, ... in the order of the
  list `forward` expects (every leaf of the parameters and the module's
  state, `meshfit.Model.weight_names` order for the weights).

Loading needs numpy and jax only:

    >>> exported = jax.export.deserialize(open(f"{path}/forward.jax", "rb").read())
    >>> stored = np.load(f"{path}/weights.npz")
    >>> weights = [stored[f"w{i}"] for i in range(len(stored.files))]
    >>> y = exported.call(weights, x)  # x: a batch of any size, shaped like the model's inputs

The outputs are those of `model.predict` (the compiled dtype policy applies).
A directory is written beside `path` and renamed into place, so a crash
leaves the old export or the new one whole; an existing non-empty `path` is
refused unless `overwrite=True`, and even then only an earlier export (or an
empty directory) is replaced.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

import jax
import numpy as np

from meshfit.checkpointing import safe_files
from meshfit.steps.builtin import forward

FORWARD = "forward.jax"
WEIGHTS = "weights.npz"


def export_forward(
    path: str | os.PathLike,
    *,
    batch: Any,
    state: Any,
    strategy: Any,
    adapter: Any,
    policy: Any,
    overwrite: bool = False,
) -> None:
    """Writes a model's forward pass and weights to the directory `path` (see the module docstring).

    `batch` is a host batch of the shapes the model was built for (None: never called on data), `state`
    its `TrainState`, `strategy` where that state lies, `adapter` and `policy` how its module is called.
    """
    path = os.path.abspath(os.fspath(path))
    _check_target(path, overwrite)
    if batch is None:
        raise ValueError(
            "export() needs the model's input shapes: call predict, evaluate or fit on data first "
            "(e.g. model.predict(x[:1])). Received: a model never called on data."
        )
    tree = (state.params, state.model_state)
    leaves, treedef = jax.tree.flatten(tree)
    host = [np.asarray(a) for a in jax.tree.leaves(strategy.to_host(leaves))]

    def serve(weights: list, x: Any) -> Any:
        params, model_state = jax.tree.unflatten(treedef, weights)
        return forward(adapter, policy, params, model_state, x, None, False, None)[0]

    (b,) = jax.export.symbolic_shape("b")
    x_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct((b, *np.shape(a)[1:]), np.asarray(a).dtype), batch.x)
    w_spec = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in host]
    exported = jax.export.export(jax.jit(serve))(w_spec, x_spec)
    _write(path, bytes(exported.serialize()), host, overwrite)


def _check_target(path: str, overwrite: bool) -> None:
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        raise FileExistsError(f"export() writes a directory; {path!r} is a file or a link. Pass another path.")
    entries = os.listdir(path)
    if entries and not overwrite:
        raise FileExistsError(
            f"export() refuses to write into {path!r}, which is not empty. Pass an empty or new path, "
            "or overwrite=True to replace an earlier export there."
        )
    if entries and FORWARD not in entries:
        raise FileExistsError(
            f"export(overwrite=True) replaces only an earlier export, and {path!r} holds other files "
            f"({sorted(entries)[:5]}). Pass another path."
        )


def _write(path: str, serialized: bytes, weights: list[np.ndarray], overwrite: bool) -> None:
    """Writes the export into a new sibling directory, then renames it into place."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(path)}.export-{uuid.uuid4().hex[:8]}")
    os.mkdir(staging)
    try:
        safe_files.write_new(os.path.join(staging, FORWARD), serialized)
        fd = safe_files.open_regular(os.path.join(staging, WEIGHTS), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{f"w{i}": a for i, a in enumerate(weights)})
        old = None
        if os.path.lexists(path):  # checked by `_check_target`: empty, or an earlier export with overwrite
            old = f"{staging}.old"
            os.rename(path, old)
        os.rename(staging, path)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
