"""`GlobalBatchSource`: a source whose `batch_size` is the global batch, split over processes as `fit` lays out.

An array input learns its layout from the strategy when `fit` builds it
(`meshfit.data.inputs.data_source`). A source the user builds first —
`mf.data.parquet(...)`, a Ray dataset's — is made before any strategy is
known: `data_source` hands it the layout through `lay_out` before anything
is read, so it can yield this process's `batch_size / P` rows of every step's
batch and refuse a split it cannot make before any step.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

from meshfit.data.sources import DataSource

__all__ = ["GlobalBatchSource"]


#: `tap(epoch, step, rows)`: called for each batch a training step takes (see `mf.data.parquet`).
Tap = Callable[[int, int, dict], None]


class GlobalBatchSource(DataSource):
    """A `DataSource` made with a global batch size, told by `fit` which block of each batch this process feeds.

    Its training position (`_position`, with `_pending` a restored one not yet used) and its `tap` belong to
    training: `for_evaluation` reads the same rows without either.
    """

    tap: Tap | None = None
    batch_size: int
    block: tuple[int, int] = (0, 1)
    local_rows: int
    padded_rows: int
    _position: dict
    _pending: dict | None

    def _take(self, batch_size: Any, tap: Any) -> None:
        """Checks and keeps the global `batch_size` and the `tap`; one block (one process) until `lay_out`."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive int (the global batch). Received: {batch_size!r}.")
        if tap is not None and not callable(tap):
            raise TypeError(f"`tap` must be callable as tap(epoch, step, rows). Received: {type(tap).__name__}.")
        self.batch_size, self.tap = batch_size, tap
        self.local_rows = self.padded_rows = batch_size

    def _split_batch(self, block: tuple[int, int], batch_multiple: int) -> None:
        """`lay_out`'s common part: this process's `batch_size / block[1]` rows of each batch, padded to its share
        of `batch_multiple`; a ValueError, before anything is read, if `block[1]` does not divide the batch."""
        count = block[1]
        if self.batch_size % count:
            raise ValueError(
                f"`batch_size` is the global batch, split evenly over {count} processes: it must be a multiple of "
                f"{count}. Received: batch_size={self.batch_size}. "
                f"Use e.g. batch_size={-(-self.batch_size // count) * count}."
            )
        self.block = block
        self.local_rows = self.batch_size // count
        multiple = max(1, batch_multiple // count)
        self.padded_rows = -(-self.local_rows // multiple) * multiple

    def for_evaluation(self) -> GlobalBatchSource:
        """A view for `evaluate`, `predict` and `validation_data`: the same rows and layout, no `tap`, and a
        position of its own, so evaluating never moves what a backup saves of training."""
        view = copy.copy(self)
        view.tap, view._position, view._pending = None, {}, None
        return view

    @abstractmethod
    def lay_out(self, block: tuple[int, int], batch_multiple: int) -> None:
        """Feeds block `block[0]` of `block[1]` equal row blocks of each global batch, padded to a multiple of
        `batch_multiple` rows in all (the strategy's `batch_block` and `batch_multiple`).

        Raises a ValueError, before anything is read, if the global batch cannot be split so."""
