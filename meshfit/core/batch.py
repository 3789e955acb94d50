"""`Batch`: what one step takes: inputs, targets, per-sample weights and the padding mask.

The data sources (`meshfit.data.sources`) make batches and the steps (`meshfit.steps.builtin`)
consume them; both import the type from here, so the steps know nothing of
where batches come from.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["Batch"]


class Batch(NamedTuple):
    """One batch: inputs, targets, per-sample weights and the padding mask.

    Attributes:
        x: the inputs (an array, or a dict/tuple/list of arrays).
        y: the targets, shaped like the model's outputs (None: none, e.g. for `predict`).
        sample_weight: per-sample weights: one array, or one per output (None: all 1).
        mask: 1.0 for each real row, 0.0 for each padding row (a partial batch padded to the full size);
            None in a compiled step's batch where every batch of the input is full (`meshfit.training.feeder`).
    """

    x: Any
    y: Any = None
    sample_weight: Any = None
    mask: Any = None

    @property
    def num_real(self) -> int:
        """The number of real (unpadded) rows (reads the mask on the host)."""
        return int(np.sum(self.mask))
