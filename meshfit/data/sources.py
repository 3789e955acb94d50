"""Turning user inputs into fixed-shape host batches.

Every batch the step sees has the same shape, so the step compiles once (an
iterable's batches may grow: at most log2(largest / first) more times). A
partial batch is padded (by repeating its own rows) up to the full size and
carries a `mask` of 1s for real rows and 0s for padding; losses and metrics
weight by the mask, so results equal those of the unpadded batch exactly.

Inputs: numpy/JAX arrays and dicts/tuples/lists of them (`ArrayData`), any
other iterable of batches — Python generators, grain datasets and loaders
(`IterableData`) — and a user's own `DataSource` subclass, taken as it is.

A source only yields host batches and says how many, whether one is partial
and where it stands; nothing here knows of devices, programs or
`steps_per_execution` (that is `meshfit.training.feeder`).
"""

from __future__ import annotations

import collections
import itertools
import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from meshfit.core.batch import Batch
from meshfit.data.read_ahead import read_ahead

__all__ = [
    "DataSource",
    "ArrayData",
    "IterableData",
    "Replay",
    "REPLAY_BYTES",
    "make_batch",
    "stack_batches",
]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def is_array_like(value: Any) -> bool:
    return isinstance(value, (np.ndarray, jax.Array)) or (
        hasattr(value, "__array__") and hasattr(value, "shape") and hasattr(value, "dtype")
    )


def is_array_tree(value: Any) -> bool:
    """True for an array or a dict/tuple/list whose leaves are all arrays."""
    if is_array_like(value):
        return True
    if not isinstance(value, (dict, tuple, list)):
        return False
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(is_array_like(leaf) for leaf in leaves)


def _to_numpy(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


#: numpy dtype kinds no step can take: strings, bytes, Python objects, dates and times.
_NOT_NUMERIC = {"U": "strings", "S": "bytes", "O": "Python objects", "M": "dates", "m": "time deltas"}


def check_numeric(tree: Any, name: str) -> None:
    """Raises a TypeError naming `name` if an array in `tree` holds strings, objects or dates, not numbers.

    Such arrays cannot go to a device; without this check the strategy fails
    inside JAX with a message that names neither the argument nor the fix.
    """
    for leaf in jax.tree.leaves(tree):
        kind = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype)).kind
        if kind in _NOT_NUMERIC:
            hint = (
                "Encode labels as integers first, e.g. `classes, y = np.unique(y, return_inverse=True)`."
                if name.startswith("y")
                else "Convert them to a numeric array first (e.g. np.asarray(..., dtype=np.float32)), "
                "or encode categories as integers."
            )
            raise TypeError(
                f"`{name}` must hold numbers: arrays of dtype bool, int, float (bfloat16 included) or complex. "
                f"Received an array of dtype {np.dtype(leaf.dtype)} ({_NOT_NUMERIC[kind]}). {hint}"
            )


def _num_rows(tree: Any, name: str) -> int:
    sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(tree)}
    if None in sizes:
        raise ValueError(f"Every array in `{name}` needs a leading batch dimension. Received a scalar in `{name}`.")
    if len(sizes) != 1:
        raise ValueError(
            f"All arrays in `{name}` must have the same number of samples (first dimension). "
            f"Received sizes: {sorted(sizes)}."
        )
    return sizes.pop()


#: Batches an iterable input (generator, grain) is read ahead of the trainer, on a thread (0: read each
#: batch when the trainer takes it); `IterableData(prefetch=...)` sets it per input.
PREFETCH_BATCHES = 2

#: Bytes to which gathered groups of batches are aligned: XLA's CPU client takes a host buffer so aligned
#: without copying it first (placing a 0.5 MiB stage inside a fit: about 60 µs against 170 µs).
HOST_ALIGNMENT = 64


def _aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array whose data starts at a multiple of `HOST_ALIGNMENT` bytes."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    buffer = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    offset = -buffer.ctypes.data % HOST_ALIGNMENT
    return buffer[offset : offset + nbytes].view(dtype).reshape(shape)


def _take(tree: Any, index: slice | np.ndarray, aligned: bool = False) -> Any:
    """The rows `index` (a slice, or an integer array) of each leaf; with `aligned` an integer array gathers into
    arrays aligned to `HOST_ALIGNMENT` bytes (groups of batches placed on the devices at once; a slice stays a view)."""
    if tree is None:
        return None
    if isinstance(index, slice):
        take = lambda a: a[index]  # noqa: E731 - a view
    elif aligned:

        def take(a):  # "clip" only so that `out` is written directly (the rows are in range): no buffered copy
            return np.take(a, index, axis=0, out=_aligned_empty((len(index),) + a.shape[1:], a.dtype), mode="clip")

    else:
        take = lambda a: np.take(a, index, axis=0)  # noqa: E731 - about 2x faster than `a[index]` for rows
    return take(tree) if isinstance(tree, np.ndarray) else jax.tree.map(take, tree)


def _stack_rows(tree: Any, size: int) -> Any:
    """Reshapes each leaf's rows into `size` stacked batches: (size * rows, ...) -> (size, rows, ...)."""
    if tree is None:
        return None
    if isinstance(tree, np.ndarray):
        return tree.reshape((size, -1) + tree.shape[1:])
    return jax.tree.map(lambda a: a.reshape((size, -1) + a.shape[1:]), tree)


def _pad_rows(tree: Any, padded_rows: int) -> Any:
    """Pads each leaf along axis 0 to `padded_rows` by repeating its rows."""
    if tree is None:
        return None

    def pad(a: np.ndarray) -> np.ndarray:
        n = a.shape[0]
        if n == padded_rows:
            return a
        return a[np.arange(padded_rows) % n]

    return jax.tree.map(pad, tree)


def as_weights(sample_weight: Any) -> Any:
    """Sample weights as float32 numpy: one array (a list of numbers too), or a dict/list of arrays per output."""
    per_output = isinstance(sample_weight, dict) or (
        isinstance(sample_weight, (list, tuple)) and any(is_array_like(w) for w in sample_weight)
    )
    if per_output:
        return jax.tree.map(lambda w: np.asarray(w, np.float32), sample_weight)
    return np.asarray(sample_weight, np.float32)


def make_batch(x: Any, y: Any, sample_weight: Any, padded_rows: int) -> Batch:
    """Builds a padded `Batch` from the real rows of one batch."""
    n = _num_rows(x, "x")
    mask = (np.arange(padded_rows) < n).astype(np.float32)
    return Batch(
        _pad_rows(x, padded_rows),
        _pad_rows(y, padded_rows),
        None if sample_weight is None else _pad_rows(as_weights(sample_weight), padded_rows),
        mask,
    )


class DataSource(ABC):
    """Where a fit's batches come from: host batches, how many, whether one is partial, and a position.

    The contract, as Keras's `DataAdapter` states it: a source yields one
    epoch's host batches (`batches`), says how many an epoch has
    (`steps_per_epoch`), whether some batch is partial (`has_partial_batches`)
    and where a resumed epoch continues (`get_state` / `set_state`). It does
    nothing else: grouping batches for `steps_per_execution`, staging them and
    placing them on the devices is the trainer's work
    (`meshfit.training.feeder`).

    Batches are fixed-shape host `meshfit.core.batch.Batch`es: every batch has
    the rows of the first (rounded up to the strategy's `batch_multiple`; an
    iterable's may grow, see `IterableData`), and a partial batch is padded
    with rows whose `mask` is 0, so the step compiles once per size and the
    padding counts for nothing. `make_batch` pads one batch.

    `fit`, `evaluate` and `predict` take a subclass as `x` as it is (with
    `y`, `sample_weight` and `batch_size` left None), as Keras takes its own
    `DataAdapter`. Under a strategy over several processes, a source yields
    this process's rows of each batch.

    Example:
        >>> class Rows(meshfit.data.DataSource):
        ...     def __init__(self, x, y, rows):
        ...         self.x, self.y, self.rows = x, y, rows
        ...         self.steps_per_epoch = -(-len(x) // rows)
        ...
        ...     def _batch(self, i):
        ...         part = slice(i * self.rows, (i + 1) * self.rows)
        ...         return meshfit.data.make_batch(self.x[part], self.y[part], None, self.rows)
        ...
        ...     def peek(self):
        ...         return self._batch(0)
        ...
        ...     def batches(self, epoch, start_step=0):
        ...         for i in range(start_step, self.steps_per_epoch):
        ...             yield self._batch(i)
        ...
        ...     def get_state(self):
        ...         return {}
        ...
        ...     def set_state(self, state):
        ...         pass
        >>> model.fit(Rows(x, y, rows=32), epochs=3)
    """

    #: Whether any batch can be produced at any time from its position alone (in-memory arrays): then
    #: `gather` may be asked for any batches, the trainer stages several on the devices at once and
    #: prepares an epoch's first batches ahead. Such a source sets `steps_per_epoch`.
    random_access: bool = False
    #: Batches per epoch (Keras's `num_batches`), or None for an input read until it runs out.
    steps_per_epoch: int | None = None

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "executions" in cls.__dict__ and getattr(cls.batches, "__isabstractmethod__", False):
            raise TypeError(
                f"`{cls.__name__}` defines `executions(epoch, size, ...)`, which a meshfit.data.DataSource does not "
                "have: it yields one epoch's host batches from `batches(epoch, start_step=0)`, one Batch at a time, "
                "and the trainer groups, pads and places them. Rename it to `batches` and yield single Batches."
            )

    @abstractmethod
    def peek(self) -> Batch:
        """The first batch, without consuming it (the model is built from its shapes)."""

    @abstractmethod
    def batches(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """Yields epoch `epoch`'s host batches from batch `start_step` on (epochs are numbered across fits).

        While the trainer holds a batch, `get_state` is the position after it. A source may read its
        input ahead on a thread of its own (`IterableData` does), as long as that holds."""

    def gather(self, epoch: int, steps: range, aligned: bool = False) -> Batch:
        """Batches `steps` of epoch `epoch` stacked on a new leading axis (sources with `random_access`).

        With `aligned` the arrays start at multiples of `HOST_ALIGNMENT` bytes where the source can
        (they go to the devices whole, as a stage). This default stacks what `batches` yields; a source
        may gather every row of the group at once instead (`ArrayData`).
        """
        del aligned
        group = list(itertools.islice(self.batches(epoch, steps.start), len(steps)))
        return stack_batches(group, len(group))

    def prepare(self, epoch: int) -> None:
        """Work for epoch `epoch` that can be done ahead, while the devices finish the last one."""
        del epoch

    def for_evaluation(self) -> DataSource:
        """The source `evaluate` and `predict` read a pass of (also as a fit's `validation_data`).

        This source itself by default. A source whose position and audit belong to training
        (`mf.data.parquet`, a Ray dataset) returns a view that reads the same rows without moving the
        training position a backup saves, and without calling its `tap`."""
        return self

    @property
    def has_partial_batches(self) -> bool:
        """Whether some batch is known ahead to hold padding rows (False where it cannot be known ahead)."""
        return False

    @property
    def batch_nbytes(self) -> int:
        """Bytes of one batch (those of `peek()`); with `random_access`, it sizes how many batches are staged
        on the devices at once."""
        return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(self.peek()))

    def set_label_check(self, check: Callable[[Any, Callable[[int], str]], None]) -> None:
        """Has `check(y, at)` raise before a step takes targets with class ids out of range
        (`meshfit.data.label_check`); `at(row)` says where a row is. A source of your own checks nothing here."""
        del check

    @abstractmethod
    def get_state(self) -> dict:
        """The position in the input, as JSON-like values and numpy arrays: where a resumed epoch continues."""

    @abstractmethod
    def set_state(self, state: dict) -> None:
        """Returns to a position `get_state` gave."""


def check_batch(batch: Any, rows_multiple: int, origin: str) -> Batch:
    """Returns `batch` if the steps can take it: a `Batch` whose `mask` has one value per row of `x`, and rows
    a multiple of `rows_multiple` (this process's share of the strategy's `batch_multiple`); else raises a
    TypeError or ValueError naming `origin` (e.g. "Rows.peek()", for a user's own `DataSource`)."""
    if not isinstance(batch, Batch):
        raise TypeError(
            f"`{origin}` must return a meshfit.core.batch.Batch(x, y, sample_weight, mask). "
            f"Received: {type(batch).__name__}. Build one with meshfit.data.make_batch(x, y, sample_weight, rows)."
        )
    if batch.mask is None or np.ndim(batch.mask) != 1:
        received = "None" if batch.mask is None else f"an array of shape {np.shape(batch.mask)}"
        raise ValueError(
            f"`{origin}` must return a Batch whose `mask` is a 1-D array: 1.0 for each real row, 0.0 for each "
            f"padding row. Received: mask={received}. meshfit.data.make_batch builds it."
        )
    rows = len(batch.mask)
    if _num_rows(batch.x, "x") != rows:
        raise ValueError(
            f"`{origin}` returned a Batch whose `mask` has {rows} rows and whose `x` has "
            f"{_num_rows(batch.x, 'x')}; they must match (meshfit.data.make_batch pads both)."
        )
    if rows % rows_multiple:
        raise ValueError(
            f"`{origin}` returned a batch of {rows} rows; under this strategy each process's batch must have a "
            f"multiple of {rows_multiple} rows. Pad each batch to a multiple of {rows_multiple} with "
            "meshfit.data.make_batch(x, y, sample_weight, rows): the added rows get mask 0."
        )
    return batch


class ShuffleOrders:
    """The row orders of shuffled passes, computed once and shared by a model's fits.

    Pass `p` of `n` rows is ordered by a generator seeded with `(seed, p)`;
    the order depends on nothing else, so it can be computed before it is
    needed (`prepare`: at the end of a fit, while the devices finish) and
    serve the next fit, which then starts without a shuffle on its critical
    path. Only the most recent orders are kept.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._orders: dict[tuple[int, int, int], np.ndarray] = {}

    def get(self, seed: int, pass_index: int, num_rows: int) -> np.ndarray:
        key = (seed, pass_index, num_rows)
        order = self._orders.get(key)
        if order is None:
            order = np.random.default_rng([seed, pass_index]).permutation(num_rows)
            order.flags.writeable = False  # shared by every batch of the pass
            if len(self._orders) >= self.keep:
                del self._orders[next(iter(self._orders))]  # the oldest
            self._orders[key] = order
        return order


class ArrayData(DataSource):
    """In-memory arrays, batched as a stream of shuffled passes.

    Global batch number `b` is batch `b % steps_per_pass` of pass
    `b // steps_per_pass`; pass `p` is shuffled with a generator seeded by
    `(seed, p)`. Epoch `e` covers batches `[e * steps_per_epoch, (e+1) * steps_per_epoch)`,
    so a run's data order depends only on the seed and the batch number. The
    loop numbers epochs over the model's life (`Model._data_origin`), so
    separate calls of fit read separate passes.
    """

    def __init__(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
        batch_multiple: int = 1,
        steps_per_epoch: int | None = None,
        block: tuple[int, int] = (0, 1),
        orders: ShuffleOrders | None = None,
    ) -> None:
        self.x = _to_numpy(x)
        self.y = None if y is None else _to_numpy(y)
        check_numeric(self.x, "x")
        check_numeric(self.y, "y")
        if sample_weight is not None:
            check_numeric(_to_numpy(sample_weight), "sample_weight")
        self.sample_weight = None if sample_weight is None else as_weights(sample_weight)
        self.num_samples = _num_rows(self.x, "x")
        if self.y is not None:
            ny = _num_rows(self.y, "y")
            if ny != self.num_samples:
                raise ValueError(
                    "`x` and `y` must have the same number of samples. "
                    f"Received: x has {self.num_samples} samples, y has {ny}."
                )
        for weights in jax.tree.leaves(self.sample_weight):
            if weights.shape[:1] != (self.num_samples,):
                raise ValueError(
                    f"`sample_weight` must have shape ({self.num_samples},) to match x "
                    "(or be a dict/list of such arrays, one per output). "
                    f"Received shape {weights.shape}."
                )
        if self.num_samples == 0:
            raise ValueError("The input data is empty: x has 0 samples. Pass at least one sample.")
        self.batch_size = batch_size
        self.batch_multiple = batch_multiple
        self.padded_batch_size = _round_up(batch_size, batch_multiple)
        self.block = block  # this process feeds row block block[0] of block[1] in every batch
        self.local_rows = self.padded_batch_size // block[1]
        self._full_mask = np.ones(self.local_rows, np.float32)
        self._full_mask.flags.writeable = False
        self._stacked_masks: dict[int, np.ndarray] = {}  # all-ones masks of groups of full batches, by count
        self._orders = orders if orders is not None else ShuffleOrders()
        self.shuffle = shuffle
        self.seed = seed
        self.steps_per_pass = math.ceil(self.num_samples / batch_size)
        self._steps_arg = steps_per_epoch
        self.steps_per_epoch = steps_per_epoch or self.steps_per_pass

    #: Any batch can be gathered at any time: its rows depend only on its position.
    random_access = True

    @property
    def has_partial_batches(self) -> bool:
        """Whether a batch holds padding rows: a short last batch, or a batch size rounded up to the strategy's
        multiple."""
        return self.num_samples % self.batch_size != 0 or self.padded_batch_size != self.batch_size

    @property
    def batch_nbytes(self) -> int:
        """Bytes of this process's rows of one batch (inputs, targets, weights and mask)."""
        row = sum(
            leaf.itemsize * math.prod(leaf.shape[1:]) for leaf in jax.tree.leaves((self.x, self.y, self.sample_weight))
        )
        return (row + self._full_mask.itemsize) * self.local_rows

    def _order(self, pass_index: int) -> np.ndarray | None:
        """The row order of one pass (None: unshuffled)."""
        return self._orders.get(self.seed, pass_index, self.num_samples) if self.shuffle else None

    def prepare(self, epoch: int) -> None:
        """Computes the shuffle order `epoch` starts with, ahead of need (it does not read the arrays)."""
        self._position(epoch * self.steps_per_epoch)

    def _position(self, global_step: int) -> tuple[np.ndarray | None, int]:
        """(order, within): the pass order and the batch within the pass of global batch `global_step`."""
        pass_index, within = divmod(global_step, self.steps_per_pass)
        return self._order(pass_index), within

    def _rows(self, order: np.ndarray | None, within: int) -> tuple[slice | np.ndarray, np.ndarray]:
        """(index, mask) of this process's rows of batch `within` of a pass.

        A partial batch repeats its own rows up to the padded size; the mask
        marks the copies. `index` is a slice when rows are contiguous.
        """
        start = within * self.batch_size
        stop = min(start + self.batch_size, self.num_samples)
        mine = slice(self.block[0] * self.local_rows, (self.block[0] + 1) * self.local_rows)
        if stop - start == self.padded_batch_size:
            if order is None:
                return slice(start + mine.start, start + mine.stop), self._full_mask
            return order[start:stop][mine], self._full_mask
        rows = np.arange(start, stop) if order is None else order[start:stop]
        index = rows[np.arange(self.padded_batch_size) % len(rows)][mine]
        return index, (np.arange(self.padded_batch_size) < len(rows)).astype(np.float32)[mine]

    def _positions(self, epoch: int, start_step: int) -> Iterator[tuple[np.ndarray | None, int]]:
        """(order, within) for each step of an epoch; one shuffle per pass."""
        first = epoch * self.steps_per_epoch
        for step in range(start_step, self.steps_per_epoch):
            yield self._position(first + step)

    def peek(self) -> Batch:
        """A batch with the shapes of every batch (the first rows, unshuffled), to build the model."""
        return self._take_all(*self._rows(None, 0))

    def _take_all(self, index: slice | np.ndarray, mask: np.ndarray, aligned: bool = False) -> Batch:
        x, y, weight = (_take(tree, index, aligned) for tree in (self.x, self.y, self.sample_weight))
        return Batch(x, y, weight, mask)

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """Yields the batches of one epoch, from `start_step` on (gathered as each is taken)."""
        for order, within in self._positions(epoch, start_step):
            yield self._take_all(*self._rows(order, within))

    def gather(self, epoch: int, steps: range, aligned: bool = False) -> Batch:
        """Batches `steps` of epoch `epoch` stacked on a new leading axis, every row in one indexing operation.

        With `aligned` (a stage, placed on the devices whole) the rows are
        gathered into arrays aligned to `HOST_ALIGNMENT`, which XLA's CPU
        client places without a copy; a group that goes straight into a
        compiled call is not: the call copies its arguments anyway, and aligned
        ones made the tiny MLP's 32-step scan slower there (0.89-0.93 of the
        raw scan against 0.96-1.00).
        """
        first, count = epoch * self.steps_per_epoch, len(steps)
        index = self._contiguous_rows(first + steps.start, count)
        if index is not None:  # the common case: one slice of the order
            mask = self._full_masks(count)
        else:
            rows = [self._rows(*self._position(first + step)) for step in steps]
            index = np.concatenate([np.arange(i.start, i.stop) if isinstance(i, slice) else i for i, _ in rows])
            mask = np.stack([m for _, m in rows], out=_aligned_empty((count, len(rows[0][1])), np.float32))
        batch = self._take_all(index, mask, aligned)  # all rows of the group in one gather
        x, y, weight = (_stack_rows(tree, count) for tree in (batch.x, batch.y, batch.sample_weight))
        return batch._replace(x=x, y=y, sample_weight=weight)

    def _full_masks(self, count: int) -> np.ndarray:
        """All-ones masks of `count` full batches, made once per count (aligned, shared by every group)."""
        mask = self._stacked_masks.get(count)
        if mask is None:
            mask = self._stacked_masks[count] = _aligned_empty((count, self.local_rows), np.float32)
            mask[...] = 1.0
            mask.flags.writeable = False
        return mask

    def _contiguous_rows(self, global_step: int, count: int) -> slice | np.ndarray | None:
        """The rows of `count` full, consecutive batches of one pass as one index, else None."""
        if self.block[1] != 1 or self.padded_batch_size != self.batch_size:
            return None
        pass_index, within = divmod(global_step, self.steps_per_pass)
        start, stop = within * self.batch_size, (within + count) * self.batch_size
        if within + count > self.steps_per_pass or stop > self.num_samples:
            return None
        order = self._order(pass_index)
        return slice(start, stop) if order is None else order[start:stop]

    def get_state(self) -> dict:
        """Nothing to save: the order of batch b depends only on the seed and b."""
        return {}

    def set_state(self, state: dict) -> None:
        del state

    def set_label_check(self, check: Callable[[Any, Callable[[int], str]], None]) -> None:
        """Checks every target now, once (numpy on the host): the arrays do not change."""
        if self.y is not None:
            check(self.y, lambda row: f"sample {row} of y")

    def split(self, fraction: float) -> tuple[ArrayData, ArrayData]:
        """Keras's `validation_split`: the last `fraction` of samples, taken before shuffling."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"`validation_split` must be in (0, 1). Received: validation_split={fraction}.")
        n_val = int(self.num_samples * fraction)
        n_train = self.num_samples - n_val
        if n_val == 0 or n_train == 0:
            raise ValueError(
                f"`validation_split={fraction}` leaves {n_train} training and {n_val} validation samples "
                f"out of {self.num_samples}; both must be non-empty."
            )

        def part(rows: np.ndarray, shuffle: bool, steps_per_epoch: int | None) -> ArrayData:
            return ArrayData(
                _take(self.x, rows),
                _take(self.y, rows),
                _take(self.sample_weight, rows),
                batch_size=self.batch_size,
                shuffle=shuffle,
                seed=self.seed,
                batch_multiple=self.batch_multiple,
                steps_per_epoch=steps_per_epoch,
                block=self.block,
                orders=self._orders,
            )

        return part(slice(0, n_train), self.shuffle, self._steps_arg), part(slice(n_train, None), False, None)


def unpack_element(element: Any) -> tuple[Any, Any, Any]:
    """Keras's convention for a dataset element: `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`."""
    if isinstance(element, tuple) and not hasattr(element, "_fields"):
        if len(element) == 1:
            return element[0], None, None
        if len(element) == 2:
            return element[0], element[1], None
        if len(element) == 3:
            return element
        raise ValueError(
            "A dataset element must be x, (x,), (x, y) or (x, y, sample_weight). "
            f"Received a tuple of length {len(element)}."
        )
    return element, None, None


class IterableData(DataSource):
    """Batches from an iterable: a generator, a grain dataset or loader, any re-iterable object.

    (A Python list is read as multi-input arrays, as in Keras, not as batches.)

    A re-iterable input (not itself an iterator) starts a new pass each epoch;
    a one-shot iterator is consumed across epochs, and training stops with a
    warning when it runs out, as in Keras. With `steps_per_epoch`, an epoch is
    that many batches of one continuing stream.

    Batches may come in any sizes and order. Each is padded (masked rows) to
    the padded size: the first batch's size, rounded up to `batch_multiple`;
    a batch larger than any before raises it to at least twice its value
    (`max(rows, 2 * padded)`, rounded up). The step compiles once per padded
    size, so at most `1 + ceil(log2(largest / first))` times for a fit's
    training batches (and as often for evaluation), however the sizes vary;
    a padded batch costs up to twice the compute of its real rows only after
    such a growth. Every process of a multi-process job must yield batches of
    the same sizes, as before.

    With `prefetch > 0` (default `PREFETCH_BATCHES`), the input is read,
    checked and padded by a background thread, up to `prefetch` batches ahead
    of the trainer, so host input work overlaps device work. The position
    (`get_state`) is that of the next batch the trainer has not taken:
    batches read ahead and not taken, when an epoch ends early, are kept and
    come first next time.
    """

    random_access = False  # batches come in the iterator's order, once

    def __init__(
        self,
        data: Iterable,
        *,
        steps_per_epoch: int | None = None,
        batch_multiple: int = 1,
        prefetch: int | None = None,
    ) -> None:
        if not hasattr(data, "__iter__"):
            raise TypeError(f"Expected arrays or an iterable of batches. Received: {type(data).__name__}.")
        self.data = data
        self.reiterable = not isinstance(data, Iterator)
        self.steps_per_epoch = steps_per_epoch
        self.batch_multiple = batch_multiple
        self.prefetch = prefetch
        self.padded_batch_size: int | None = None
        self._iterator: Iterator | None = None
        self._fresh = False
        self._consumed = 0  # elements taken from `_iterator`
        self._pending_state: dict | None = None
        # Elements read but not taken by the loop (read ahead, or peeked), each with the position after it.
        self._pushback: collections.deque = collections.deque()
        self._position: dict | None = None  # the position after the last element the loop took
        self.exhausted = False
        self._first_spec: dict | None = None  # feature shapes and dtype kinds of the first batch
        self._label_check: Callable | None = None

    def _next_element(self) -> tuple[Any, dict | None]:
        """The next element and the position after it."""
        if self._pushback:
            return self._pushback.popleft()
        if self._iterator is None:
            self._iterator, self._fresh, self._consumed = iter(self.data), True, 0
            self._apply_pending_state()
        element = next(self._iterator)
        self._fresh = False
        self._consumed += 1
        return element, self._snapshot()

    # -- position, for BackupAndRestore ----------------------------------------------

    def _snapshot(self) -> dict | None:
        """The stream's position now (only a continuing stream of a re-iterable input has one)."""
        if not self.reiterable or self.steps_per_epoch is None:
            return None
        if hasattr(self._iterator, "get_state"):  # grain iterators
            return {"iterator_state": self._iterator.get_state()}
        return {"consumed": self._consumed}

    def get_state(self) -> dict:
        """Where the continuing stream is (only needed with `steps_per_epoch`)."""
        if not self.reiterable:
            return {"rewindable": False}
        return dict(self._position) if self._position else {}

    def set_state(self, state: dict) -> None:
        if state.get("rewindable") is False or not self.reiterable:
            warnings.warn(
                "The training input is a one-shot iterator (e.g. a generator), which cannot be rewound: "
                "the resumed run continues with the batches it yields next, so it will not repeat the "
                "interrupted run exactly. Pass a re-iterable dataset (e.g. grain) for exact resume.",
                stacklevel=2,
            )
            return
        self._pending_state = state or None
        self._position = state or None
        self._pushback.clear()
        self._iterator = None

    def _apply_pending_state(self) -> None:
        state, self._pending_state = self._pending_state, None
        if not state:
            return
        self._fresh = False  # a restored position is not the start of a pass
        if "iterator_state" in state:
            self._iterator.set_state(state["iterator_state"])
            return
        for _ in range(state.get("consumed", 0)):
            next(self._iterator)
        self._consumed = state.get("consumed", 0)

    def set_label_check(self, check: Callable[[Any, Callable[[int], str]], None]) -> None:
        """Checks each batch's targets as it is read (on the reading thread when reading ahead)."""
        self._label_check = check

    def _to_batch(self, element: Any, index: int) -> Batch:
        """Batch number `index` of this epoch (from 0), checked against the first and padded."""
        x, y, sw = unpack_element(element)
        x, y = _to_numpy(x), None if y is None else _to_numpy(y)
        check_numeric(x, "x (a batch the dataset yielded)")
        check_numeric(y, "y (a batch the dataset yielded)")
        check_numeric(sw, "sample_weight (a batch the dataset yielded)")
        rows = _num_rows(x, "x")
        if rows == 0:
            raise ValueError("The dataset yielded an empty batch (0 samples). Every batch needs samples.")
        self._check_spec({"x": x, "y": y}, index)
        if self._label_check is not None and y is not None:
            self._label_check(y, lambda row: f"batch {index} of the epoch (counting from 0), row {row}")
        if self.padded_batch_size is None:
            self.padded_batch_size = _round_up(rows, self.batch_multiple)
        elif rows > self.padded_batch_size:  # at least doubles: at most log2(largest / first) growths
            self.padded_batch_size = _round_up(max(rows, 2 * self.padded_batch_size), self.batch_multiple)
        if y is not None and _num_rows(y, "y") != rows:
            raise ValueError(f"A batch has {rows} inputs but {_num_rows(y, 'y')} targets; they must match.")
        return make_batch(x, y, sw, self.padded_batch_size)

    def _check_spec(self, parts: dict, index: int) -> None:
        """Raises unless `parts` have the first batch's feature shapes (after the batch axis) and dtype kinds."""
        spec = {
            name: jax.tree.map(lambda a: (tuple(np.shape(a)[1:]), np.asarray(a).dtype.kind), tree)
            for name, tree in parts.items()
            if tree is not None
        }
        if self._first_spec is None:
            self._first_spec = spec
            return
        for name, tree in spec.items():
            expected = self._first_spec.get(name)
            if tree != expected:
                raise ValueError(
                    f"Batch {index} of the epoch (counting from 0) has {name} of feature shape and dtype kind "
                    f"{_describe_spec(tree)}; the first batch had {_describe_spec(expected)}. Every batch must "
                    f"have the first one's shapes after the batch axis: pad or crop them alike."
                )

    def _epoch_items(self, epoch: int, start_step: int = 0) -> Iterator[tuple[Batch, tuple]]:
        """One epoch's batches, each with its `(element, position after it)`; sets `exhausted` if a
        one-shot input had none left."""
        del epoch
        if self.steps_per_epoch is None and self.reiterable and self._pending_state is None:
            self._iterator = None  # a new pass each epoch
            self._pushback.clear()
        # A restored stream position already stands at `start_step`; otherwise skip to it.
        step = start_step if self._pending_state else 0
        while self.steps_per_epoch is None or step < self.steps_per_epoch:
            try:
                read = self._next_element()
            except StopIteration:
                was_fresh, self._iterator = self._fresh, None
                if self.reiterable and self.steps_per_epoch is not None and not was_fresh:
                    continue  # the stream goes on with the next pass
                if step == 0:
                    self.exhausted = True
                    if isinstance(self.data, Replay):
                        return  # `Replay` has said why
                    warnings.warn(
                        "Your input ran out of data; interrupting training. Make sure the dataset can "
                        "produce at least `steps_per_epoch * epochs` batches.",
                        stacklevel=2,
                    )
                return
            if step >= start_step:
                yield self._to_batch(read[0], step), read
            step += 1

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """Yields one epoch's batches; with `prefetch`, read ahead on a thread (see `_read_ahead`)."""
        items = self._epoch_items(epoch, start_step)
        prefetch = PREFETCH_BATCHES if self.prefetch is None else self.prefetch
        if prefetch < 1:
            for batch, (_, position) in items:
                self._position = position
                yield batch
            return
        yield from self._read_ahead(items, prefetch)

    def _read_ahead(self, items: Iterator, prefetch: int) -> Iterator[Batch]:
        """Reads, checks and pads `items` on a thread, up to `prefetch` batches ahead of the caller
        (`read_ahead`); the reads of batches not taken go back to the front of the input, with their positions."""

        def give_back(left: list) -> None:
            self._pushback.extendleft(reversed([read for _, read in left]))

        for batch, read in read_ahead(items, prefetch, name="meshfit-prefetch", give_back=give_back):
            self._position = read[1]
            yield batch

    def peek(self) -> Batch:
        """The first batch, without losing it for a later epoch (to build the model)."""
        try:
            if self.reiterable:
                return self._to_batch(next(iter(self.data)), 0)
            read = self._next_element()
        except StopIteration:
            raise ValueError(
                "The dataset is empty: it yielded no batches. Pass data with at least one batch."
            ) from None
        self._pushback.appendleft(read)
        return self._to_batch(read[0], 0)


def _describe_spec(spec: Any) -> str:
    """`(4,) float` for one array; a dict or list of them for several (numpy's dtype kind letters spelled out)."""
    kinds = {"f": "float", "i": "int", "u": "uint", "b": "bool", "c": "complex"}

    def one(leaf: tuple) -> str:
        return f"{leaf[0]} {kinds.get(leaf[1], leaf[1])}"

    def is_leaf(node: Any) -> bool:
        return isinstance(node, tuple) and len(node) == 2 and isinstance(node[1], str)

    if spec is None:
        return "none"
    return one(spec) if is_leaf(spec) else str(jax.tree.map(one, spec, is_leaf=is_leaf))


def pad_batch(batch: Batch, rows: int) -> Batch:
    """`batch` padded to `rows` rows: inputs repeated, the added rows masked out (mask 0)."""
    have = len(batch.mask)
    if have == rows:
        return batch
    mask = np.concatenate([batch.mask, np.zeros(rows - have, batch.mask.dtype)])
    return Batch(_pad_rows(batch.x, rows), _pad_rows(batch.y, rows), _pad_rows(batch.sample_weight, rows), mask)


#: Bytes of a one-shot validation iterator's batches kept on the host to evaluate them again each epoch.
REPLAY_BYTES = 256 * 2**20


def _nbytes(element: Any) -> int:
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(element))


class Replay:
    """A one-shot iterator (a generator) made re-iterable by keeping what it yielded, up to `max_bytes`.

    `fit` wraps a one-shot `validation_data` in one, so each epoch validates on
    the same batches (Keras validates on nothing after a generator ran out).
    Every `iter()` replays the kept elements (host numpy copies), then
    continues the source. If the source yields more than `max_bytes`, nothing
    more is kept (what was kept is freed): the pass reading it goes on, and
    later passes yield nothing, with a warning saying what to pass instead.
    """

    def __init__(self, source: Iterator, max_bytes: int | None = None, what: str = "validation_data") -> None:
        self.source = source
        self.max_bytes = REPLAY_BYTES if max_bytes is None else max_bytes
        self.what = what
        self._kept: list = []
        self._bytes = 0
        self._pulled = 0
        self._dropped = False
        self._exhausted = False
        self._warned = False

    def __iter__(self) -> Iterator:
        if self._dropped:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"`{self.what}` is a one-shot iterator (e.g. a generator) that ran out after its first pass, "
                    f"and its batches were more than meshfit keeps to replay ({self.max_bytes / 2**20:.1f} MiB, "
                    "meshfit.data.REPLAY_BYTES), so later epochs have no `val_` logs. Pass a re-iterable instead "
                    "(a list of batches, a grain MapDataset or IterDataset: anything whose iter() starts anew), "
                    "or arrays.",
                    stacklevel=2,
                )
            return iter(())
        return self._replay()

    def _replay(self) -> Iterator:
        position = 0
        while True:
            if position < len(self._kept):
                yield self._kept[position]
                position += 1
                continue
            if position < self._pulled or self._exhausted:  # pulled by an earlier pass and not kept / the end
                return
            try:
                element = next(self.source)
            except StopIteration:
                self._exhausted = True
                return
            self._pulled += 1
            position += 1
            if not self._dropped:
                element = jax.tree.map(np.array, element)  # a copy: the source may reuse its buffers
                self._bytes += _nbytes(element)
                # The first element is always kept: `peek` reads it before the first pass starts.
                if self._bytes > self.max_bytes and self._pulled > 1:
                    self._dropped, self._kept = True, []
                else:
                    self._kept.append(element)
            yield element


def stack_batches(batches: list[Batch], size: int) -> Batch:
    """Stacks up to `size` batches on a new leading axis, padding with fully masked batches (and batches
    padded before the input's batch size grew, to the largest)."""
    rows = max(len(b.mask) for b in batches)
    batches = [pad_batch(b, rows) for b in batches]
    filler = batches[-1]._replace(mask=np.zeros_like(batches[-1].mask))
    full = batches + [filler] * (size - len(batches))
    return jax.tree.map(lambda *leaves: np.stack(leaves), *full)
