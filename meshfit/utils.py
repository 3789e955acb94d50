"""Keras's helpers for a batch as the user gave it: `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`.

A custom `Model.train_step(state, data)` receives `data` in one of these forms
and unpacks it with `unpack_x_y_sample_weight`, as in Keras.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pack_x_y_sample_weight", "unpack_x_y_sample_weight"]


def unpack_x_y_sample_weight(data: Any) -> tuple[Any, Any, Any]:
    """`(x, y, sample_weight)` of a batch, with None for what it does not hold (Keras's function).

    Example:
        >>> x, y, sample_weight = meshfit.utils.unpack_x_y_sample_weight(data)
    """
    if isinstance(data, list):
        data = tuple(data)
    if not isinstance(data, tuple):
        return data, None, None
    if len(data) == 1:
        return data[0], None, None
    if len(data) == 2:
        return data[0], data[1], None
    if len(data) == 3:
        return data[0], data[1], data[2]
    raise ValueError(
        "Data is expected to be in format `x`, `(x,)`, `(x, y)`, or `(x, y, sample_weight)`. "
        f"Received: a tuple of length {len(data)}."
    )


def pack_x_y_sample_weight(x: Any, y: Any = None, sample_weight: Any = None) -> Any:
    """The batch as a step receives it: `x` alone (a tuple `(x,)` when `x` is itself a tuple or list),
    `(x, y)`, or `(x, y, sample_weight)` (Keras's function)."""
    if y is None:
        return (x,) if isinstance(x, (tuple, list)) else x
    if sample_weight is None:
        return (x, y)
    return (x, y, sample_weight)
