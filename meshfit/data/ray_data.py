"""A Ray Data `Dataset` as `fit`'s input: `model.fit(dataset, batch_size=B)`.

The dataset's rows, in Ray Data's order, `B` rows a batch (the last one
partial, padded and masked as for arrays), a new pass over the dataset each
epoch. Its columns are read by name: `x`, and `y` and `sample_weight` where
the dataset has them (rename others first: `dataset.rename_columns(...)`).

Position. Ray Data's iterators keep no state a backup could save, so the
position is `(epoch, batches taken)`; a resumed epoch starts a new pass and
skips (reads, does not train on) the batches already taken. That continues
exactly when Ray Data yields the rows in the same order on every pass: set
`ray.data.DataContext.get_current().execution_options.preserve_order = True`
(without it a parallel read may order rows differently, and the resumed
epoch may repeat some rows and miss others).

One process only: under a strategy over several processes it is refused
(each rank would train on the whole dataset); `mf.data.parquet` splits by
process. Ray is imported by whoever made the dataset, never here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from meshfit.core.batch import Batch
from meshfit.data.global_batches import GlobalBatchSource
from meshfit.data.sources import check_numeric, make_batch

__all__ = ["RayData", "is_ray_dataset"]

COLUMNS = ("x", "y", "sample_weight")


def is_ray_dataset(value: Any) -> bool:
    """Whether `value` is a `ray.data.Dataset` (without importing Ray: only a program that made one has it)."""
    import sys

    data = sys.modules.get("ray.data")
    return data is not None and isinstance(value, data.Dataset)


class RayData(GlobalBatchSource):
    """Batches of a `ray.data.Dataset`'s columns `x` (and `y`, `sample_weight`), `batch_size` rows each."""

    random_access = False
    steps_per_epoch = None  # read until the pass ends

    def __init__(self, dataset: Any, *, batch_size: int) -> None:
        columns = list(dataset.columns())
        if "x" not in columns:
            raise ValueError(
                "A ray.data.Dataset given to fit must have a column named 'x' (and 'y', 'sample_weight' if "
                f"used). Received columns: {', '.join(columns)}. Rename them: dataset.rename_columns({{...}})."
            )
        self.dataset = dataset
        self.columns = [c for c in COLUMNS if c in columns]
        self.batch_size = batch_size
        self.padded_rows = batch_size
        self._position: dict = {}
        self._pending: dict | None = None
        self._label_check: Callable | None = None
        self._first: Batch | None = None

    def lay_out(self, block: tuple[int, int], batch_multiple: int) -> None:
        """One process only (see the module's docstring); the batch padded to `batch_multiple` rows."""
        if block[1] != 1:
            raise ValueError(
                f"A ray.data.Dataset as fit's input runs on one process; this strategy splits each batch over "
                f"{block[1]} processes, and each would train on the whole dataset. Use mf.data.parquet(...), which "
                "reads each process's share, or one process."
            )
        self.padded_rows = -(-self.batch_size // batch_multiple) * batch_multiple

    def _batches(self) -> Iterator[Batch]:
        for step, part in enumerate(self.dataset.iter_batches(batch_size=self.batch_size, batch_format="numpy")):
            x, y, weight = (part.get(name) for name in COLUMNS)
            check_numeric(x, "x (the dataset's column 'x')")
            check_numeric(y, "y (the dataset's column 'y')")
            if self._label_check is not None and y is not None:
                self._label_check(y, lambda row, step=step: f"row {row} of batch {step} of the Ray dataset")
            yield make_batch(x, y, weight, self.padded_rows)

    def peek(self) -> Batch:
        """The first batch (read once, kept), to build the model."""
        if self._first is None:
            first = next(self._batches(), None)
            if first is None:
                raise ValueError("The ray.data.Dataset is empty: it has no rows. Pass a dataset with rows.")
            self._first = first
        return self._first

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """A new pass over the dataset; a resumed epoch skips its first `start_step` batches (read, not trained)."""
        self._pending = None
        for step, batch in enumerate(self._batches()):
            if step < start_step:
                continue
            self._position = {"epoch": epoch, "batches": step + 1, "batch_size": self.batch_size}
            yield batch

    def get_state(self) -> dict:
        """`{"epoch", "batches", "batch_size"}`: the batches taken of the epoch (Ray Data saves no iterator state)."""
        return dict(self._position)

    def set_state(self, state: dict) -> None:
        """Continues at a position `get_state` gave; a ValueError for one of another batch size."""
        if state and state.get("batch_size") != self.batch_size:
            raise ValueError(
                f"The backup's Ray Data position was saved with batch_size={state.get('batch_size')}; this fit "
                f"has batch_size={self.batch_size}. Resume with the same batch_size."
            )
        self._pending, self._position = (dict(state) or None), dict(state)

    def set_label_check(self, check: Callable[[Any, Callable[[int], str]], None]) -> None:
        self._label_check = check

    @property
    def has_partial_batches(self) -> bool:
        return self.padded_rows != self.batch_size  # a short last batch cannot be known without counting rows
