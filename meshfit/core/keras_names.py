"""Keras 3's argument names that meshfit takes with a note: one table for the code, the tests and the docs.

Every argument of Keras's callbacks and of `keras.Model.compile`, `fit`,
`evaluate`, `predict` and `save` is accepted by meshfit's counterpart under
Keras's name. Most mean exactly what they mean in Keras and need no row here.
A row says what the others do in meshfit:

* ``"alias"``: another name for meshfit's own argument (`ModelCheckpoint(filepath=...)`
  is `directory=`); passing both is a `TypeError`.
* ``"jax"``: Keras's meaning, done the JAX way (TensorBoard's `write_graph`
  writes the train step's jaxpr).
* ``"ignored"``: nothing in JAX to do; a non-default value warns once, naming why.
* ``"refused"``: the value in `refused` (keyword arguments of the call) has no
  meshfit equivalent; it raises a `ValueError` naming what to use instead.

`tests/test_keras_signatures.py` walks Keras's own signatures against these
facts, and `docs/keras.md` holds `markdown_table()` verbatim.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple


class KerasName(NamedTuple):
    """One Keras argument and what it is in meshfit.

    Attributes:
        where: the meshfit callable: a callback's class name, or `Model.<method>`.
        name: Keras's argument name.
        kind: "alias", "jax", "ignored" or "refused" (module docstring).
        meshfit: what it maps to (Markdown); a refusal's and a warning's message end with it.
        refused: for "refused", the keyword arguments of a call that is refused (the tests make it).
    """

    where: str
    name: str
    kind: str
    meshfit: str
    refused: dict | None = None


KERAS_NAMES: tuple[KerasName, ...] = (
    KerasName(
        "ModelCheckpoint",
        "filepath",
        "alias",
        "`directory`. With `{epoch}`/`{batch}`/log fields, or ending in `.keras` or `.weights.h5`, each save "
        "writes one meshfit saved model into a directory of that name (`ckpt/{epoch}.keras` becomes "
        "`ckpt/3.keras/`; `meshfit.load_model(path, module)` reads it); `.weights.h5` saves the weights only, "
        "as Keras's `save_weights_only=True`",
    ),
    KerasName(
        "BackupAndRestore",
        "double_checkpoint",
        "jax",
        "always on: the two newest backups are kept (`max_to_keep=2`) and an unreadable newest one is moved "
        "aside for the one before; `True` keeps at least two",
    ),
    KerasName(
        "TensorBoard",
        "write_graph",
        "jax",
        "the train step's jaxpr, written at the start of each `fit` as `<log_dir>/train/train_step.jaxpr.txt` "
        "and as a text summary `train_step_jaxpr` (TensorBoard's Text tab); JAX has no TensorBoard graph",
    ),
    KerasName(
        "TensorBoard",
        "write_steps_per_second",
        "jax",
        "`epoch_steps_per_second` and `batch_steps_per_second` scalars, as in Keras",
    ),
    KerasName(
        "TensorBoard",
        "update_freq",
        "jax",
        "`'epoch'`, `'batch'` or N batches, as in Keras; with `steps_per_execution`, counted in steps",
    ),
    KerasName(
        "TensorBoard",
        "write_images",
        "ignored",
        "no weight images: Flax parameters are not Keras layers' kernels; use `histogram_freq` for histograms",
    ),
    KerasName(
        "TensorBoard",
        "embeddings_freq",
        "ignored",
        "no Projector data: a Flax module has no `Embedding` layers to find; write embeddings from a callback",
    ),
    KerasName(
        "TensorBoard",
        "embeddings_metadata",
        "ignored",
        "no Projector data (see `embeddings_freq`)",
    ),
    KerasName(
        "Model.compile",
        "auto_scale_loss",
        "refused",
        "`dtype_policy='mixed_float16'` always scales the loss (Keras's default, `True`); `False` is refused "
        "there: use `dtype_policy='mixed_bfloat16'`, which needs no loss scale",
        refused={"dtype_policy": "mixed_float16", "auto_scale_loss": False},
    ),
    KerasName(
        "Model.compile",
        "run_eagerly",
        "jax",
        "accepted, as in Keras: `True` runs the steps uncompiled, for debugging",
    ),
    KerasName(
        "Model.compile",
        "jit_compile",
        "jax",
        "accepted, as in Keras: `False` runs the steps uncompiled, `'auto'` and `True` compile them",
    ),
    KerasName(
        "Model.save",
        "filepath",
        "alias",
        "`path`: a directory of Orbax files (`model.keras` becomes a directory of that name); "
        "`meshfit.load_model(path, module)` reads it",
    ),
    KerasName(
        "Model.save",
        "zipped",
        "refused",
        "meshfit writes a directory, as Keras's `zipped=False`; `True` is refused: zip the directory yourself",
        refused={"zipped": True},
    ),
)


def row(where: str, name: str) -> KerasName:
    """The table's row for Keras's argument `name` of `where`."""
    for entry in KERAS_NAMES:
        if entry.where == where and entry.name == name:
            return entry
    raise KeyError(f"No row for {where}({name}=...) in meshfit.core.keras_names.KERAS_NAMES.")


def alias(where: str, name: str, value: Any, meshfit_name: str, meshfit_value: Any, default: Any = None) -> Any:
    """The value of meshfit's `meshfit_name` given as Keras's `name` or as itself (a `TypeError` for both)."""
    if value is None:
        return meshfit_value
    if meshfit_value is not default:
        raise TypeError(
            f"{where}() got `{name}` (Keras's name) and `{meshfit_name}` (meshfit's) for one argument: pass one. "
            f"Received: {name}={value!r}, {meshfit_name}={meshfit_value!r}."
        )
    return value


def refuse(where: str, name: str, value: Any) -> None:
    """Raises the `ValueError` of a refused Keras value, naming meshfit's equivalent from the table."""
    raise ValueError(f"{where}() cannot take Keras's {name}={value!r}. In meshfit: {row(where, name).meshfit}.")


def warn_ignored(where: str, name: str, value: Any) -> None:
    """Warns (once per call) that Keras's `name` does nothing in meshfit, and why, from the table."""
    warnings.warn(f"{where}({name}={value!r}) is ignored: {row(where, name).meshfit}.", UserWarning, stacklevel=3)


def markdown_table() -> str:
    """The table as Markdown, as docs/keras.md holds it."""
    lines = ["| Keras | meshfit |", "| --- | --- |"]
    for entry in KERAS_NAMES:
        owner = entry.where.replace("Model.", "model.", 1)
        text = entry.meshfit.replace("|", "\\|")
        lines.append(f"| `{owner}({entry.name}=...)` | {text} |")
    return "\n".join(lines) + "\n"
