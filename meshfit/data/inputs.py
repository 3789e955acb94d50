"""Which `DataSource` serves an input: Keras's data-adapter choice, in one place below the model.

`fit`, `evaluate`, `predict` and the `*_on_batch` methods take arrays (or a
dict/tuple/list of them), an iterable of batches (a generator, a grain
dataset) or a user's own `meshfit.data.DataSource`; `data_source` checks the
arguments that go with each and returns the source the loop reads, so the
training path sees one kind of thing.
"""

from __future__ import annotations

from typing import Any

from meshfit.data import ray_data
from meshfit.data import sources as data_lib
from meshfit.data.global_batches import GlobalBatchSource

__all__ = ["DEFAULT_BATCH_SIZE", "data_source"]

#: Rows per batch when `batch_size` is not given for array inputs (Keras's default).
DEFAULT_BATCH_SIZE = 32


def data_source(
    x: Any,
    y: Any,
    sample_weight: Any,
    batch_size: int | None,
    strategy: Any,
    *,
    shuffle: bool = False,
    steps: int | None = None,
    what: str = "fit",
    seed: int = 0,
    orders: data_lib.ShuffleOrders | None = None,
) -> data_lib.DataSource:
    """The source of `x` (with `y` and `sample_weight`) for `what`, laid out for `strategy`'s batch split.

    Raises a `ValueError` or `TypeError` naming what was expected and what came, before anything is read.
    """
    if x is None:
        raise ValueError(f"`{what}()` needs input data `x`. Received: x=None.")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}.")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"The number of steps must be a positive int or None. Received: {steps!r}.")
    if isinstance(x, data_lib.DataSource):  # the user's own, taken as it is (as Keras takes a DataAdapter)
        _check_own_source(x, y, sample_weight, batch_size, steps)
        if isinstance(x, GlobalBatchSource):  # made before the strategy was known (mf.data.parquet)
            x.lay_out(strategy.batch_block, strategy.batch_multiple)
        return x
    if ray_data.is_ray_dataset(x):
        return _ray_source(x, y, sample_weight, batch_size, steps, strategy)
    if what in ("fit", "evaluate") and y is None and sample_weight is None and _is_list_of_batches(x):
        raise ValueError(
            f"`x` is a list of {len(x)} tuples of arrays, which Keras reads as one input made of several "
            "arrays (for a model with several inputs), not as a sequence of (x, y) batches. To pass batches, "
            f"pass an iterator or a generator of them: model.{what}(iter(batches)), or a generator function's "
            f"result, e.g. model.{what}(b for b in batches). Received: x=list of {len(x)} tuples of lengths "
            f"{sorted({len(b) for b in x})}."
        )
    if data_lib.is_array_tree(x):
        strategy.check_batch_size(batch_size or DEFAULT_BATCH_SIZE)
        return data_lib.ArrayData(
            x,
            y,
            sample_weight,
            batch_size=batch_size or DEFAULT_BATCH_SIZE,
            shuffle=shuffle,
            seed=seed,
            batch_multiple=strategy.batch_multiple,
            steps_per_epoch=steps,
            block=strategy.batch_block,
            orders=orders,
        )
    not_a_dataset = isinstance(x, (list, tuple, dict, str, bytes)) or not hasattr(x, "__iter__")
    if (y is not None or sample_weight is not None) and not_a_dataset:
        raise TypeError(
            "With `y` or `sample_weight` given, `x` must be a numpy/JAX array or a dict, tuple or list of "
            f"arrays. Received: x of type {_type_description(x)}. Convert it (e.g. np.asarray(x)), or pass "
            "a dataset or generator yielding (x, y) batches as `x` alone, with y=None and sample_weight=None."
        )
    if y is not None or sample_weight is not None:
        raise ValueError(
            f"When `x` is a dataset or generator, `y` and `sample_weight` must be None (the dataset "
            f"yields them). Received: x of type {type(x).__name__} with y or sample_weight set."
        )
    if batch_size is not None:
        raise ValueError(
            "`batch_size` must be None when `x` is a dataset or generator, which yields batches. "
            f"Received: batch_size={batch_size}."
        )
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        hint = (
            " It has `peek` and `batches`: make it a subclass of meshfit.data.DataSource."
            if hasattr(x, "peek") and hasattr(x, "batches")
            else ""
        )
        raise TypeError(
            "`x` must be a numpy/JAX array, a dict/tuple/list of arrays, an iterable of batches "
            f"(generator, grain dataset) or a meshfit.data.DataSource. Received: {type(x).__name__}.{hint}"
        )
    return data_lib.IterableData(x, steps_per_epoch=steps, batch_multiple=strategy.local_batch_multiple)


def _check_own_source(source: data_lib.DataSource, y: Any, sample_weight: Any, batch_size: Any, steps: Any) -> None:
    """Raises a ValueError if arguments that only array inputs take come with a user's own `DataSource`."""
    name = type(source).__name__
    if y is not None or sample_weight is not None:
        raise ValueError(
            f"When `x` is a meshfit.data.DataSource, `y` and `sample_weight` must be None (its batches hold them). "
            f"Received: x={name} with y or sample_weight set."
        )
    if batch_size is not None:
        raise ValueError(
            f"`batch_size` must be None when `x` is a meshfit.data.DataSource, which makes its own batches. "
            f"Received: x={name}, batch_size={batch_size}."
        )
    if steps is not None and steps != source.steps_per_epoch:
        raise ValueError(
            f"A meshfit.data.DataSource sets its own epoch length: `steps_per_epoch` must be None or equal to "
            f"its `steps_per_epoch` ({source.steps_per_epoch}). Received: steps_per_epoch={steps}. Set "
            f"`steps_per_epoch` on the {name} instead."
        )


def _ray_source(dataset: Any, y: Any, sample_weight: Any, batch_size: Any, steps: Any, strategy: Any):
    """A `ray.data.Dataset`'s source (`meshfit.data.ray_data`): its columns hold `y` and `sample_weight`."""
    if y is not None or sample_weight is not None or steps is not None:
        raise ValueError(
            "When `x` is a ray.data.Dataset, `y` and `sample_weight` must be None (its columns 'y' and "
            "'sample_weight' hold them) and so must `steps_per_epoch` (an epoch is one pass). "
            f"Received: y, sample_weight or steps set (steps={steps!r})."
        )
    source = ray_data.RayData(dataset, batch_size=batch_size or DEFAULT_BATCH_SIZE)
    source.lay_out(strategy.batch_block, strategy.batch_multiple)
    return source


def _is_list_of_batches(x: Any) -> bool:
    """Whether `x` looks like a list of `(x, y)` or `(x, y, sample_weight)` batches rather than one input."""
    return (
        type(x) is list
        and len(x) > 0
        and all(type(b) is tuple and len(b) in (2, 3) and data_lib.is_array_tree(b) for b in x)
    )


def _type_description(value: Any) -> str:
    """A value's type, with the types inside a container (`list of float`), for error messages."""
    name = type(value).__name__
    if isinstance(value, dict) and value:
        inner = sorted({type(v).__name__ for v in value.values()})
        return f"{name} of {', '.join(inner)}"
    if isinstance(value, (list, tuple)) and value:
        inner = sorted({type(v).__name__ for v in value})
        return f"{name} of {', '.join(inner)}"
    return name
