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
    _position: dict
    _pending: dict | None

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
