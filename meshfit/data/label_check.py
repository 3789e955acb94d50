"""Class-id labels checked against the number of classes the model outputs, on the host, before a step uses them.

A sparse loss or metric (`SparseCategoricalCrossentropy`, the sparse accuracies) reads each label as an index
into the output's class axis. An index outside `[0, classes)` is not an error inside a compiled step: the
one-hot of 7 among 3 classes is all zeros, the loss of that row 0 and its accuracy 0 (optax's
`softmax_cross_entropy_with_integer_labels` gives garbage likewise), so a run with wrong labels trains on
nothing and looks fine. `label_ranges` finds, once per build, which targets are class ids and how many
classes each has; `check_labels` checks a host array of them with numpy (a min and a max when every label is
in range) and raises a ValueError naming the first bad value, where it is and the valid range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from meshfit import losses as losses_lib
from meshfit import metrics as metrics_lib
from meshfit.steps.terms import LossTerm, MetricTerm, Output

__all__ = ["LabelRange", "check_labels", "label_ranges"]

#: The functions that read `y_true` as class ids (index into `y_pred`'s class axis).
_SPARSE_FUNCTIONS = (
    losses_lib.sparse_categorical_crossentropy,
    metrics_lib.sparse_categorical_accuracy,
    metrics_lib.sparse_top_k_categorical_accuracy,
)


class LabelRange(NamedTuple):
    """The targets of one output hold class ids in `[0, classes)` (or `ignore_class`), as `reader` reads them."""

    output: Output
    classes: int
    ignore_class: int | None
    reader: str


def _sparse_arguments(term: Any) -> dict | None:
    """The keyword arguments of a sparse loss or metric (`axis`, `ignore_class`), or None if `term` is not one."""
    fn = getattr(term, "fn", None) or getattr(term, "_fn", None)
    if not any(fn is sparse for sparse in _SPARSE_FUNCTIONS):
        return None
    return dict(getattr(term, "_fn_kwargs", {}) or {})


def label_ranges(
    losses: tuple[LossTerm, ...] | list[LossTerm], metrics: tuple[MetricTerm, ...] | list[MetricTerm], y_pred: Any
) -> tuple[LabelRange, ...]:
    """One `LabelRange` for each output a sparse loss or metric reads; `y_pred` gives the class axes' sizes.

    `y_pred` may be abstract (`jax.ShapeDtypeStruct`s): only shapes are read.
    """
    found: dict[tuple, LabelRange] = {}
    for output, term in [(t.output, t.loss) for t in losses] + [(t.output, t.metric) for t in metrics]:
        arguments = _sparse_arguments(term)
        if arguments is None:
            continue
        shape = output.of(y_pred).shape
        if not shape:
            continue
        classes = int(shape[arguments.get("axis", -1)])
        ignore = arguments.get("ignore_class")
        known = found.get(output.path)
        if known is not None:  # a value any of the output's readers ignores is allowed
            ignore = known.ignore_class if ignore is None else ignore
            classes = min(classes, known.classes)
        reader = known.reader if known is not None else getattr(term, "name", type(term).__name__)
        found[output.path] = LabelRange(output, classes, ignore, reader)
    return tuple(found.values())


def check_labels(ranges: tuple[LabelRange, ...], y: Any, at: Callable[[int], str]) -> None:
    """Raises a ValueError if a class id in the host targets `y` is out of its range; `at(row)` says where row is.

    Costs two numpy reductions per output when every label is in range; only an error looks further.
    """
    for label_range in ranges:
        labels = np.asarray(label_range.output.of(y))
        if labels.size == 0 or labels.dtype.kind not in "iuf":
            continue
        classes, ignore = label_range.classes, label_range.ignore_class
        if ignore is None and labels.min() >= 0 and labels.max() < classes:  # NaN fails both: looked at below
            continue
        valid = (labels >= 0) & (labels < classes)
        if ignore is not None:
            valid |= labels == ignore
        if valid.all():
            continue
        first = tuple(int(i) for i in np.argwhere(~valid)[0])
        inner = f" (index {first[1:]} within it)" if len(first) > 1 else ""
        output = "" if len(ranges) == 1 and not label_range.output.path else f" of output '{label_range.output.name}'"
        allowed = f" or {ignore}" if ignore is not None else ""
        raise ValueError(
            f"Labels{output} must be class ids in [0, {classes}){allowed}: the output has {classes} classes, and "
            f"{label_range.reader} reads each label as an index into them. Received: {labels[first].item()!r} at "
            f"{at(first[0])}{inner}.\nFix the labels or the output's size; to skip a label, pass "
            "SparseCategoricalCrossentropy(ignore_class=...)."
        )


def no_check(y: Any, at: Callable[[int], str]) -> None:
    """The label check of a model with no sparse loss or metric."""
    del y, at


def checker(ranges: tuple[LabelRange, ...]) -> Callable[[Any, Callable[[int], str]], None]:
    """`check(y, at)` for a data source: `check_labels` with these ranges (a no-op with none)."""
    if not ranges:
        return no_check
    return lambda y, at: check_labels(ranges, y, at)
