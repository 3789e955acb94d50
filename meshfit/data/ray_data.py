"""A Ray Data `Dataset` as `fit`'s input: `model.fit(dataset, batch_size=B)`.

The dataset's rows, in Ray Data's order, `B` rows a batch (the last one
partial, padded and masked as for arrays), a new pass over the dataset each
epoch. Its columns are read by name: `x`, and `y` and `sample_weight` where
the dataset has them (rename others first: `dataset.rename_columns(...)`).

Under a strategy over several processes (`meshfit launch --ray`, every
rank joined to the Ray cluster with `ray.init(address="auto")`), each rank
reads its share through Ray Data's own `Dataset.streaming_split(P,
equal=True)`: process 0 makes the split and hands each rank its
`DataIterator` (pickled, broadcast over the job's `jax.distributed`
collectives), and each yields `B / P` rows of every step's batch. The split
is equal (Ray Data may drop up to P - 1 rows an epoch to make it so), since
every rank must take as many steps.

Position. Ray Data's iterators keep no state a backup could save, so the
position is `(epoch, batches taken)`; a resumed epoch starts a new pass and
skips (reads, does not train on) the batches already taken. On one process
that continues exactly when Ray Data yields the rows in the same order on
every pass: set
`ray.data.DataContext.get_current().execution_options.preserve_order = True`
(without it a parallel read may order rows differently, and the resumed
epoch may repeat some rows and miss others). Split over processes it is not
exact: `streaming_split` hands blocks to whichever rank asks first, so which
rows a rank skipped is not known on the next pass. Ray is imported by whoever
made the dataset, never here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from meshfit.core.batch import Batch
from meshfit.data.global_batches import GlobalBatchSource, Tap
from meshfit.data.sources import check_numeric, make_batch

__all__ = ["RayData", "is_ray_dataset", "ray_dataset"]

COLUMNS = ("x", "y", "sample_weight")


def is_ray_dataset(value: Any) -> bool:
    """Whether `value` is a `ray.data.Dataset` (without importing Ray: only a program that made one has it)."""
    data = sys.modules.get("ray.data")
    return data is not None and isinstance(value, data.Dataset)


def ray_dataset(dataset: Any, *, batch_size: int, tap: Tap | None = None) -> RayData:
    """A `ray.data.Dataset` as `fit`'s `x`, with a `tap` to audit what each process trains on.

    `model.fit(dataset, batch_size=B)` makes the same source without a tap.

    Args:
        dataset: a `ray.data.Dataset` with a column `x` (and `y`, `sample_weight` where used).
        batch_size: the global batch: each of P processes takes `batch_size / P` rows of every step's batch.
        tap: `tap(epoch, step, rows)` is called on each process once for each batch a training step takes, in
            step order, `rows` this process's real rows of every column the dataset has (`{column: array}`, no
            padding); never for batches a resumed epoch skips, nor for evaluation.
    """
    return RayData(dataset, batch_size=batch_size, tap=tap)


class RayData(GlobalBatchSource):
    """Batches of a `ray.data.Dataset`'s columns `x` (and `y`, `sample_weight`), `batch_size` rows each."""

    random_access = False
    steps_per_epoch = None  # read until the pass ends

    def __init__(self, dataset: Any, *, batch_size: int, tap: Tap | None = None) -> None:
        self._take(batch_size, tap)
        columns = list(dataset.columns())
        if "x" not in columns:
            raise ValueError(
                "A ray.data.Dataset given to fit must have a column named 'x' (and 'y', 'sample_weight' if "
                f"used). Received columns: {', '.join(columns)}. Rename them: dataset.rename_columns({{...}})."
            )
        self.dataset = dataset
        self.columns = [c for c in COLUMNS if c in columns]
        self._split: Any = None  # this process's DataIterator of a split over processes
        self._position: dict = {}
        self._pending: dict | None = None
        self._label_check: Callable | None = None
        self._first: Batch | None = None

    def lay_out(self, block: tuple[int, int], batch_multiple: int) -> None:
        """Feeds `batch_size / block[1]` rows of each batch, padded to this process's share of `batch_multiple`;
        over several processes, reads its share of a `streaming_split` made by process 0 (a collective: every
        process of the job calls it, as `fit` does)."""
        self._split_batch(block, batch_multiple)
        index, count = block
        if count > 1 and self._split is None:
            self._split = _split_over_processes(self.dataset, index, count)

    def _parts(self) -> Iterator[dict]:
        """This process's real rows of each batch of a new pass, `{column: array}`."""
        source = self.dataset if self._split is None else self._split
        return source.iter_batches(batch_size=self.local_rows, batch_format="numpy")

    def _batch(self, part: dict, step: int) -> Batch:
        x, y, weight = (part.get(name) for name in COLUMNS)
        check_numeric(x, "x (the dataset's column 'x')")
        check_numeric(y, "y (the dataset's column 'y')")
        if self._label_check is not None and y is not None:
            self._label_check(y, lambda row: f"row {row} of batch {step} of the Ray dataset")
        return make_batch(x, y, weight, self.padded_rows)

    def peek(self) -> Batch:
        """The first batch (read once, kept), to build the model."""
        if self._first is None:
            first = self.dataset.take_batch(self.local_rows, batch_format="numpy")  # a read of its own
            if not len(first["x"]):
                raise ValueError("The ray.data.Dataset is empty: it has no rows. Pass a dataset with rows.")
            self._first = self._batch(first, 0)
        return self._first

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """A new pass over the dataset; a resumed epoch skips its first `start_step` batches (read, not trained)."""
        self._pending = None
        for step, part in enumerate(self._parts()):
            if step < start_step:
                continue
            batch = self._batch(part, step)
            self._position = {"epoch": epoch, "batches": step + 1, "batch_size": self.batch_size}
            if self.tap is not None:
                self.tap(epoch, step, part)
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
        return self.padded_rows != self.local_rows  # a short last batch cannot be known without counting rows


def _split_over_processes(dataset: Any, index: int, count: int) -> Any:
    """This process's `DataIterator` of `dataset.streaming_split(count, equal=True)`, made on process 0 and
    broadcast pickled over the job's collectives (`jax.experimental.multihost_utils.broadcast_one_to_all`).

    The iterators live in process 0's Ray cluster, so first every process compares its cluster's address
    with process 0's, and all raise together if one differs."""
    import jax
    from jax.experimental import multihost_utils

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() or jax.process_count() != count:
        raise ValueError(_NOT_ONE_CLUSTER.format(count=count))
    cluster = ray.get_runtime_context().gcs_address
    first_cluster = _from_process_0(cluster.encode() if index == 0 else b"").decode()
    joined = np.asarray(multihost_utils.process_allgather(np.int32(cluster == first_cluster))).ravel()
    if not joined.all():
        apart = [rank for rank, same in enumerate(joined.tolist()) if not same]
        raise ValueError(
            _NOT_ONE_CLUSTER.format(count=count)
            + f" Process(es) {apart} are joined to another Ray cluster than process 0's ({first_cluster})."
        )
    split = ray.cloudpickle.dumps(dataset.streaming_split(count, equal=True)) if index == 0 else b""
    return ray.cloudpickle.loads(_from_process_0(split))[index]


def _from_process_0(payload: bytes) -> bytes:
    """Process 0's `payload` on every process (a collective; the others pass b"")."""
    from jax.experimental import multihost_utils

    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(payload))))
    buffer = np.frombuffer(payload, np.uint8) if payload else np.zeros(size, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buffer), np.uint8).tobytes()


_NOT_ONE_CLUSTER = (
    "A ray.data.Dataset split over {count} processes needs each process to be one rank of a "
    "`meshfit launch --ray` job joined to its cluster (ray.init(address='auto') in the script). "
    "Use mf.data.parquet(...) otherwise, or one process."
)
