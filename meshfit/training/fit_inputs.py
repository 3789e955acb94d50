"""What `fit`, `evaluate`, `predict` and the `*_on_batch` calls are given, as data sources and checked.

`Inputs` turns a model's arguments into `meshfit.data` sources under its
strategy and seed (`fit`'s validation split and validation data too), reads
a source's first batch (checking a user's own source), and has each source
check its class-id targets. The small argument checks the calls share
(`verbose`, one batch's rows, class weights) are here as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from meshfit.core.batch import Batch
from meshfit.data import inputs, label_check
from meshfit.data import sources as data_lib


class Inputs:
    """A model's data sources: `x`, `y` and `sample_weight` batched under `strategy`, shuffled by `seed`.

    Args:
        strategy: the model's strategy (batches split over its devices and processes).
        seed: the model's seed (array data's shuffle orders).
        orders: the shuffle orders one fit computes ahead for the next (`meshfit.data.ShuffleOrders`).
    """

    def __init__(self, strategy: Any, seed: int, orders: data_lib.ShuffleOrders) -> None:
        self.strategy = strategy
        self.seed = seed
        self.orders = orders

    def source(
        self,
        x: Any,
        y: Any,
        sample_weight: Any,
        batch_size: int | None,
        *,
        shuffle: bool = False,
        steps: int | None = None,
        what: str = "fit",
    ) -> data_lib.DataSource:
        """The data source of one call's arguments (`meshfit.data.inputs.data_source`)."""
        return inputs.data_source(
            x,
            y,
            sample_weight,
            batch_size,
            self.strategy,
            shuffle=shuffle,
            steps=steps,
            what=what,
            seed=self.seed,
            orders=self.orders,
        )

    def fit_sources(
        self,
        x: Any,
        y: Any,
        sample_weight: Any,
        batch_size: int | None,
        *,
        shuffle: bool,
        steps_per_epoch: int | None,
        class_weight: dict | None,
        validation_split: float,
        validation_data: Any,
        validation_batch_size: int | None,
    ) -> tuple[data_lib.DataSource, data_lib.DataSource, data_lib.DataSource | None]:
        """`fit`'s training data, all of it before a validation split, and its validation data (or None).

        Arguments as `Model.fit` takes them; raises a ValueError for a combination it refuses.
        """
        if class_weight is not None:
            sample_weight = class_weights(y, class_weight, sample_weight)
        data = self.source(x, y, sample_weight, batch_size, shuffle=shuffle, steps=steps_per_epoch)
        all_data, val_data = data, None  # (before a validation split: sample numbers as the user's)
        if validation_split:
            if not isinstance(data, data_lib.ArrayData):
                raise ValueError(
                    "`validation_split` works only with array inputs; pass `validation_data` for datasets."
                )
            data, val_data = data.split(validation_split)
        if validation_data is not None:
            vx, vy, vsw = _unpack_validation(validation_data)
            if isinstance(vx, Iterator) and not data_lib.is_array_tree(vx):  # validated on every epoch
                vx = data_lib.Replay(vx)
            val_batch_size = (validation_batch_size or batch_size) if data_lib.is_array_tree(vx) else None
            val_data = self.source(vx, vy, vsw, val_batch_size, what="fit")
        return data, all_data, val_data

    def first_batch(self, data: data_lib.DataSource) -> Batch:
        """`data`'s first batch (read ahead, kept for the first step); a user's own source's is checked."""
        batch = data.peek()
        if not isinstance(data, (data_lib.ArrayData, data_lib.IterableData)):  # the user's own source
            data_lib.check_batch(batch, max(1, self.strategy.local_batch_multiple), f"{type(data).__name__}.peek()")
        return batch


def check_labels(ranges: tuple[label_check.LabelRange, ...], *sources: data_lib.DataSource | None) -> None:
    """Has each source check its class-id targets against `ranges` before a step takes them (arrays now,
    once; an iterable as it reads each batch): out-of-range ids raise, never train silently."""
    check = label_check.checker(ranges)
    for source in sources:
        if source is not None:
            source.set_label_check(check)


def verbose_level(verbose: int | str) -> int:
    """`verbose` as 0, 1 or 2 ("auto": 1); raises a ValueError for anything else."""
    if verbose == "auto":
        return 1
    if verbose not in (0, 1, 2) or isinstance(verbose, bool):
        raise ValueError(f"`verbose` must be 'auto', 0, 1 or 2. Received: verbose={verbose!r}.")
    return int(verbose)


def check_epochs(epochs: Any, initial_epoch: Any, validation_freq: Any) -> None:
    """Raises a ValueError for `fit`'s `epochs`, `initial_epoch` or `validation_freq` of the wrong kind."""
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise ValueError(f"`epochs` must be a positive int. Received: epochs={epochs!r}.")
    if not isinstance(initial_epoch, int) or not 0 <= initial_epoch:
        raise ValueError(f"`initial_epoch` must be a non-negative int. Received: {initial_epoch!r}.")
    if not (isinstance(validation_freq, int) and validation_freq >= 1) and not (
        isinstance(validation_freq, (list, tuple, set)) and all(isinstance(v, int) for v in validation_freq)
    ):
        raise ValueError(
            f"`validation_freq` must be a positive int or a list of epochs. Received: {validation_freq!r}."
        )


def rows(x: Any, what: str) -> int:
    """The rows of one batch of array input `x` (a `*_on_batch` call takes exactly one batch)."""
    leaves = jax.tree.leaves(x) if data_lib.is_array_tree(x) else []
    if not leaves:
        raise TypeError(
            f"`{what}()` takes one batch of arrays (a numpy/JAX array, or a dict/tuple/list of them). "
            f"Received: x of type {type(x).__name__}."
        )
    return len(leaves[0])


def class_weights(y: Any, class_weight: dict, sample_weight: Any) -> np.ndarray:
    """Per-row weights: each row's class weight (`y` holds class ids or one-hot rows), times `sample_weight`."""
    if y is None or not data_lib.is_array_like(y):
        raise ValueError(
            "`class_weight` needs `y` as a single array of class labels (a model with one output). "
            "For several outputs, weigh the rows of each with `sample_weight={output: weights}`."
        )
    labels = np.asarray(y)
    if labels.ndim > 1 and labels.shape[-1] > 1:
        labels = labels.argmax(-1)
    labels = labels.reshape(len(labels), -1)[:, 0].astype(int)
    missing = sorted(set(np.unique(labels).tolist()) - set(class_weight))
    if missing:
        raise ValueError(f"`class_weight` has no weight for classes {missing}. Received keys {sorted(class_weight)}.")
    weights = np.array([class_weight[c] for c in labels], np.float32)
    return weights if sample_weight is None else weights * np.asarray(sample_weight, np.float32)


def _unpack_validation(validation_data: Any) -> tuple[Any, Any, Any]:
    if (
        isinstance(validation_data, tuple)
        and len(validation_data) in (2, 3)
        and data_lib.is_array_tree(validation_data[0])
    ):
        return (*validation_data, None)[:3]
    if isinstance(validation_data, tuple) and len(validation_data) not in (2, 3):
        raise ValueError(
            "`validation_data` must be (x_val, y_val), (x_val, y_val, sample_weight) or a dataset. "
            f"Received a tuple of length {len(validation_data)}."
        )
    return validation_data, None, None
