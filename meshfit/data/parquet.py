"""`mf.data.parquet`: Parquet files as a fit's input, each process reading only its own row groups.

How an epoch is laid out. The row groups of every file are put in order
(file order, or shuffled from `(shuffle_seed, epoch)` alone) and dealt to L
*lanes*, each group to the lane with the fewest rows so far; L is the number
of blocks the global batch is split into when the epoch starts (the
processes). Global batch `s` is lane 0's rows `[s*B/L, (s+1)*B/L)`, then lane
1's, and so on; a lane that has run out gives padding (mask 0). Process `i`
of P takes positions `[i*B/P, (i+1)*B/P)` of that batch: with P equal to L,
exactly its own lane, so no row group is read by two processes. With a
shuffle seed the rows of each row group are shuffled too (from the seed, the
epoch and the group), so a shuffle never needs more than a row group in memory.

The position is one global offset. After `s` steps every lane has given its
first `s*B/L` rows, whatever P is, so `(epoch, rows = s*B, lanes L, seed)`
says which rows are consumed; a job resumed from a backup on P' processes
(any P' dividing B: the same, fewer after `meshfit launch --min-nprocs`, or a
plain one-process `fit`) continues the epoch with every remaining row exactly
once, and reads only its own row groups when P' divides L. The next epoch
starts with as many lanes as processes.

Rows are read on a thread, up to `read_ahead` batches ahead of the trainer,
so the devices do not wait on a file. pyarrow is imported only when a
source is made (`pip install "meshfit[data]"`).
"""

from __future__ import annotations

import glob as glob_lib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from meshfit.core.batch import Batch
from meshfit.data.global_batches import GlobalBatchSource, Tap
from meshfit.data.read_ahead import read_ahead

__all__ = ["ParquetData", "parquet"]

#: Batches read ahead of the trainer on the reading thread, by default.
READ_AHEAD = 4


def _pyarrow():
    """pyarrow and pyarrow.parquet, or an ImportError that says how to install them."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(
            "mf.data.parquet reads Parquet files with pyarrow, which is not installed. "
            'Install it: pip install "meshfit[data]" (or pip install pyarrow).'
        ) from error
    return pa, pq


def parquet(
    paths_or_glob: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    x: str | Sequence[str],
    y: str | None = None,
    columns: Sequence[str] | None = None,
    batch_size: int,
    shuffle_seed: int | None = None,
    tap: Tap | None = None,
    read_ahead: int = READ_AHEAD,
) -> ParquetData:
    """Parquet files as `fit`'s `x`: `batch_size` rows a step over all processes, every row once per epoch.

    Args:
        paths_or_glob: a file, a directory (its `*.parquet` files), a glob, or a list of them. Every file must
            have the same schema.
        x: the input column (numeric, or a list column of equal lengths), or a list of numeric scalar columns
            stacked into one `(rows, len(x))` array.
        y: the target column, or None.
        columns: the columns read (default: those `x` and `y` name); any other listed is read only for `tap`.
        batch_size: the global batch: under a strategy over P processes each process yields `batch_size / P`
            rows of every step's batch (P must divide it).
        shuffle_seed: shuffle row groups, and rows within each, from the seed and the epoch alone (None: file
            order, as written).
        tap: `tap(epoch, step, rows)` is called on each process once for each batch the trainer takes for a
            training step, in step order: `epoch` the data pass, `step` the batch's index in the epoch, `rows`
            this process's real rows (no padding) as `{column: array}` for each column in `columns`. Never for a
            batch only peeked at (to build the model), for batches a resumed epoch skips, nor for `evaluate`,
            `predict` or `validation_data` reading the source: it audits exactly-once.
        read_ahead: batches read ahead of the trainer on a thread (0: read each when it is taken).

    Example:
        >>> data = mf.data.parquet("shards/*.parquet", x=["f0", "f1"], y="label", batch_size=64, shuffle_seed=0)
        >>> model.fit(data, epochs=3, callbacks=[mf.callbacks.BackupAndRestore("backup")])
    """
    return ParquetData(
        paths_or_glob,
        x=x,
        y=y,
        columns=columns,
        batch_size=batch_size,
        shuffle_seed=shuffle_seed,
        tap=tap,
        read_ahead=read_ahead,
    )


class _Plan(NamedTuple):
    """One epoch's layout: the row groups (global ids) of each of `lanes` lanes, and its steps."""

    epoch: int
    lanes: int
    lane_groups: tuple[tuple[int, ...], ...]
    lane_rows: tuple[int, ...]
    steps: int


class ParquetData(GlobalBatchSource):
    """Batches of Parquet files, split per process by row groups, resumable from one global offset.

    Made by `mf.data.parquet` (which documents the arguments); the module's docstring says how an epoch is laid
    out and why its position survives a change in the number of processes.
    """

    random_access = False  # read in order, once, on a thread

    def __init__(
        self,
        paths_or_glob: Any,
        *,
        x: str | Sequence[str],
        y: str | None = None,
        columns: Sequence[str] | None = None,
        batch_size: int,
        shuffle_seed: int | None = None,
        tap: Tap | None = None,
        read_ahead: int = READ_AHEAD,
    ) -> None:
        pa, pq = _pyarrow()
        self._take(batch_size, tap)
        if shuffle_seed is not None and not isinstance(shuffle_seed, int):
            raise TypeError(f"`shuffle_seed` must be an int or None. Received: {shuffle_seed!r}.")
        if not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(f"`read_ahead` must be a non-negative int (batches). Received: {read_ahead!r}.")
        if isinstance(x, str):
            self.x_columns: list[str] = [x]
        elif isinstance(x, (list, tuple)) and x and all(isinstance(c, str) for c in x):
            self.x_columns = list(x)
        else:
            raise TypeError(f"`x` must be a column name or a non-empty list of column names. Received: {x!r}.")
        self.stack_x = not isinstance(x, str)
        if y is not None and not isinstance(y, str):
            raise TypeError(f"`y` must be a column name or None. Received: {y!r}.")
        self.y_column = y
        self.files = _expand(paths_or_glob)
        self._schema = schema = _same_schema(pq, self.files)
        named = self.x_columns + ([y] if y is not None else [])
        for name in named + list(columns or []):
            if name not in schema.names:
                role = "`x`" if name in self.x_columns else "`y`" if name == y else "`columns`"
                raise ValueError(
                    f"{role} names column {name!r}, which no file has. The files' columns: {', '.join(schema.names)}."
                )
        self.columns = list(dict.fromkeys(list(columns) if columns is not None else named))
        self.read_columns = list(dict.fromkeys(named + self.columns))
        for name in named:
            _check_numeric(pa, schema.field(name), name, list_ok=not self.stack_x or name == y)
        self._groups: list[tuple[int, int]] = []  # (file index, row group) of each global group id
        self._group_rows: list[int] = []
        for index, path in enumerate(self.files):
            meta = pq.ParquetFile(path).metadata
            for group in range(meta.num_row_groups):
                if meta.row_group(group).num_rows:
                    self._groups.append((index, group))
                    self._group_rows.append(meta.row_group(group).num_rows)
        self.num_rows = sum(self._group_rows)
        if self.num_rows == 0:
            raise ValueError(f"The Parquet files hold no rows. Received: {len(self.files)} file(s) of 0 rows.")
        self.shuffle_seed = shuffle_seed
        self.read_ahead = read_ahead
        self._pending: dict | None = None  # a restored position, used by the epoch it names
        self._position: dict = {}  # after the last batch the trainer took
        self._plan_cache: dict[tuple[int, int], _Plan] = {}
        self._label_check: Callable | None = None
        self._first: Batch | None = None

    # -- layout -------------------------------------------------------------------------------

    def lay_out(self, block: tuple[int, int], batch_multiple: int) -> None:
        """This process feeds block `block[0]` of `block[1]`: `batch_size / block[1]` rows of every batch, padded
        to this process's share of `batch_multiple`. Raises a ValueError if `block[1]` does not divide the batch."""
        self._split_batch(block, batch_multiple)

    def _lanes_now(self, epoch: int | None = None) -> int:
        """The lanes an epoch is read in: a restored position's for its epoch, else one per block."""
        if self._pending and (epoch is None or self._pending["epoch"] == epoch):
            return int(self._pending["lanes"])
        return self.block[1]

    def _plan(self, epoch: int, lanes: int) -> _Plan:
        """Epoch `epoch`'s row groups dealt to `lanes` lanes (from the seed and the epoch alone)."""
        key = (epoch, lanes)
        plan = self._plan_cache.get(key)
        if plan is not None:
            return plan
        order = np.arange(len(self._groups))
        if self.shuffle_seed is not None:
            order = np.random.default_rng([self.shuffle_seed, epoch]).permutation(len(self._groups))
        groups: list[list[int]] = [[] for _ in range(lanes)]
        rows = [0] * lanes
        for group in order.tolist():
            lane = rows.index(min(rows))
            groups[lane].append(group)
            rows[lane] += self._group_rows[group]
        width = self.batch_size // lanes
        steps = max(-(-r // width) for r in rows)
        plan = _Plan(epoch, lanes, tuple(map(tuple, groups)), tuple(rows), steps)
        if len(self._plan_cache) > 4:
            self._plan_cache.clear()
        self._plan_cache[key] = plan
        return plan

    @property
    def steps_per_epoch(self) -> int:  # type: ignore[override]
        """Batches in an epoch (laid out in as many lanes as processes, or a restored position's lanes)."""
        epoch = int(self._pending["epoch"]) if self._pending else 0
        return self._plan(epoch, self._lanes_now()).steps

    @property
    def has_partial_batches(self) -> bool:
        """Whether some batch of some epoch may hold padding rows (a short last batch, lanes of unequal rows,
        rounding), in the lanes of a resumed epoch or of the epochs after it."""
        if self.padded_rows != self.local_rows:
            return True
        return any(self._may_pad(lanes) for lanes in {self._lanes_now(), self.block[1]})

    def _may_pad(self, lanes: int) -> bool:
        """Whether an epoch dealt to `lanes` lanes may have padding. In file order (or in one lane) every epoch
        is dealt alike; shuffled over lanes, each is dealt anew, so only row groups of one size that deal evenly
        are full every epoch."""
        if self.shuffle_seed is None or lanes == 1:
            return self._plan(0, lanes).steps * self.batch_size != self.num_rows
        groups, sizes = len(self._group_rows), set(self._group_rows)
        even = len(sizes) == 1 and groups % lanes == 0
        return not (even and (groups // lanes * sizes.pop()) % (self.batch_size // lanes) == 0)

    def _pieces(self, lanes: int) -> list[tuple[int, int, int]]:
        """`(lane, start, stop)`: the positions this process takes within each lane's block of a global batch."""
        width = self.batch_size // lanes
        first, last = self.block[0] * self.local_rows, (self.block[0] + 1) * self.local_rows
        pieces = []
        for lane in range(lanes):
            start, stop = max(first, lane * width), min(last, (lane + 1) * width)
            if start < stop:
                pieces.append((lane, start - lane * width, stop - lane * width))
        return pieces

    # -- the DataSource contract ------------------------------------------------------------

    def peek(self) -> Batch:
        """A batch of zeros with every batch's shapes and dtypes, to build the model: from the schema (a list
        column of variable length: from its first row), so no row group of another process is read for it,
        nothing is consumed and `tap` is not called."""
        if self._first is None:
            columns = {name: self._empty(name, rows=self.padded_rows) for name in self.read_columns}
            x, y = self._features(columns)
            self._first = Batch(x, y, None, np.ones(self.padded_rows, np.float32))
        return self._first

    def _empty(self, name: str, rows: int = 0) -> np.ndarray:
        """Zeros of column `name`'s dtype and row shape, `rows` rows."""
        pa, pq = _pyarrow()
        kind = self._schema.field(name).type
        if pa.types.is_fixed_size_list(kind):
            return np.zeros((rows, kind.list_size), kind.value_type.to_pandas_dtype())
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):  # the length is in the data: one row
            first = next(pq.ParquetFile(self.files[0]).iter_batches(batch_size=1, columns=[name]))
            return np.zeros((rows,) + _to_numpy(first.column(0)).shape[1:], kind.value_type.to_pandas_dtype())
        return np.zeros(rows, kind.to_pandas_dtype())

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """Yields this process's rows of epoch `epoch`'s batches from `start_step` on, read ahead on a thread;
        `tap` is called as the trainer takes each."""
        lanes = self._lanes_now(epoch)
        if self._pending and self._pending["epoch"] == epoch:
            if int(self._pending["rows"]) != start_step * self.batch_size:
                raise ValueError(
                    f"The restored Parquet position has consumed {self._pending['rows']} rows of epoch {epoch}, but "
                    f"the fit resumes at batch {start_step} ({start_step * self.batch_size} rows). The backup's "
                    "position and its data position disagree: was the batch size changed?"
                )
        self._pending = None
        plan = self._plan(epoch, lanes)
        items = self._read(plan, start_step)
        if self.read_ahead:
            items = read_ahead(items, self.read_ahead, name="meshfit-parquet")
        for step, batch, rows in items:
            self._position = self._state(epoch, lanes, step + 1)
            if self.tap is not None:
                self.tap(epoch, step, rows)
            yield batch

    def get_state(self) -> dict:
        """The position after the last batch taken: `{"epoch", "rows", "lanes", "shuffle_seed", "batch_size"}`,
        `rows` the global rows consumed (padding positions counted) — one offset, whatever the processes."""
        return dict(self._position)

    def set_state(self, state: dict) -> None:
        """Continues from a position `get_state` gave (a backup's), on any number of processes dividing the batch.

        Raises a ValueError, before anything is read, for a position of another batch size or shuffle seed."""
        if not state:
            self._pending, self._position = None, {}
            return
        for key, mine in (("batch_size", self.batch_size), ("shuffle_seed", self.shuffle_seed)):
            if state.get(key) != mine:
                raise ValueError(
                    f"The backup's Parquet position was saved with {key}={state.get(key)!r}; this input has "
                    f"{key}={mine!r}. Resume with the same {key}, or start without the backup."
                )
        self._pending, self._position = dict(state), dict(state)

    def set_label_check(self, check: Callable[[Any, Callable[[int], str]], None]) -> None:
        """Checks each batch's targets on the reading thread, before the trainer takes it."""
        self._label_check = check

    # -- reading ------------------------------------------------------------------------------

    def _state(self, epoch: int, lanes: int, steps_done: int) -> dict:
        return {
            "epoch": epoch,
            "rows": steps_done * self.batch_size,
            "lanes": lanes,
            "shuffle_seed": self.shuffle_seed,
            "batch_size": self.batch_size,
        }

    def _features(self, columns: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        if self.stack_x:
            x = np.stack([columns[name] for name in self.x_columns], axis=1)
        else:
            x = columns[self.x_columns[0]]
        return x, None if self.y_column is None else columns[self.y_column]

    def _read(self, plan: _Plan, start_step: int) -> Iterator[tuple[int, Batch, dict]]:
        """`(step, batch, tap rows)` of this process from `start_step` on (the row groups wholly before it unread)."""
        width = self.batch_size // plan.lanes
        pieces = self._pieces(plan.lanes)
        cursors = {lane: _LaneCursor(self, plan, lane) for lane, _, _ in pieces}
        for step in range(start_step, plan.steps):
            parts = []
            for lane, start, stop in pieces:
                begin = step * width + start
                end = min(step * width + stop, plan.lane_rows[lane])
                if begin < end:
                    parts.append(cursors[lane].take(begin, end))
            yield step, *self._batch(plan, step, parts)

    def _batch(self, plan: _Plan, step: int, parts: list[dict]) -> tuple[Batch, dict]:
        """This process's batch of real rows `parts` (concatenated), padded to `padded_rows` and masked."""
        if not parts:  # this process's lanes have run out: a batch of padding only (mask 0)
            padding = self.peek()._replace(mask=np.zeros(self.padded_rows, np.float32))
            return padding, {name: self._empty(name) for name in self.columns}
        columns = {name: np.concatenate([p[name] for p in parts]) for name in self.read_columns}
        real = len(columns[self.read_columns[0]])
        mask = (np.arange(self.padded_rows) < real).astype(np.float32)
        x, y = self._features(columns)
        if self._label_check is not None and y is not None:
            self._label_check(y, lambda row: f"row {row} of batch {step} of epoch {plan.epoch} on this process")
        if real < self.padded_rows:
            index = np.arange(self.padded_rows) % real
            x, y = x[index], None if y is None else y[index]
        return Batch(x, y, None, mask), {name: columns[name] for name in self.columns}


class _LaneCursor:
    """Reads one lane's rows in order: a row group at a time, its rows shuffled when the source is."""

    def __init__(self, source: ParquetData, plan: _Plan, lane: int) -> None:
        self.source, self.plan = source, plan
        self.groups = plan.lane_groups[lane]
        self.starts = np.cumsum([0] + [source._group_rows[g] for g in self.groups])
        self._loaded: tuple[int, dict] | None = None  # (position in the lane's groups, its columns)
        self._files: dict[int, Any] = {}

    def take(self, begin: int, end: int) -> dict[str, np.ndarray]:
        """The lane's rows `[begin, end)`, as `{column: array}` (reads the row groups they lie in)."""
        parts = []
        while begin < end:
            at = int(np.searchsorted(self.starts, begin, side="right")) - 1
            columns = self._group(at)
            stop = min(end, int(self.starts[at + 1]))
            offset = int(self.starts[at])
            parts.append({k: v[begin - offset : stop - offset] for k, v in columns.items()})
            begin = stop
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def _group(self, at: int) -> dict[str, np.ndarray]:
        if self._loaded is not None and self._loaded[0] == at:
            return self._loaded[1]
        _, pq = _pyarrow()
        source, group = self.source, self.groups[at]
        file_index, row_group = source._groups[group]
        handle = self._files.get(file_index)
        if handle is None:
            handle = self._files[file_index] = pq.ParquetFile(source.files[file_index])
        table = handle.read_row_group(row_group, columns=source.read_columns)
        columns = {name: _to_numpy(table.column(name)) for name in source.read_columns}
        if source.shuffle_seed is not None:
            order = np.random.default_rng([source.shuffle_seed, self.plan.epoch, group]).permutation(table.num_rows)
            columns = {k: v[order] for k, v in columns.items()}
        self._loaded = (at, columns)
        return columns


def _expand(paths_or_glob: Any) -> list[str]:
    """The files `paths_or_glob` names (each a file, a directory's `*.parquet`, or a glob), sorted per entry."""
    entries = [paths_or_glob] if isinstance(paths_or_glob, (str, os.PathLike)) else list(paths_or_glob)
    files: list[str] = []
    for entry in entries:
        entry = os.fspath(entry)
        if os.path.isdir(entry):
            found = sorted(glob_lib.glob(os.path.join(entry, "*.parquet")))
        elif os.path.isfile(entry):
            found = [entry]
        else:
            found = sorted(glob_lib.glob(entry))
        if not found:
            raise ValueError(
                f"mf.data.parquet: {entry!r} matches no file. Pass a Parquet file, a directory of *.parquet files, "
                "or a glob such as 'shards/*.parquet'."
            )
        files.extend(found)
    if not files:
        raise ValueError("mf.data.parquet needs at least one file. Received: an empty list.")
    return files


def _same_schema(pq: Any, files: list[str]) -> Any:
    """The files' common schema; a ValueError naming the first two files whose columns or types differ."""
    first = pq.read_schema(files[0])
    fields = [(f.name, f.type) for f in first]
    for path in files[1:]:
        schema = pq.read_schema(path)
        if [(f.name, f.type) for f in schema] != fields:
            describe = lambda s: ", ".join(f"{f.name}: {f.type}" for f in s)  # noqa: E731
            raise ValueError(
                f"Every Parquet file must have the same schema. {files[0]!r} has ({describe(first)}); "
                f"{path!r} has ({describe(schema)}). Rewrite the files with one schema, or pass them separately."
            )
    return first


def _check_numeric(pa: Any, field: Any, name: str, list_ok: bool) -> None:
    """Raises a TypeError unless column `name` holds numbers (or, where allowed, lists of numbers)."""
    kind = field.type
    if list_ok and (pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind)):
        kind = kind.value_type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        hint = "a numeric column, or a list column of numbers" if list_ok else "numeric scalar columns"
        raise TypeError(
            f"Column {name!r} must hold numbers ({hint}). Received: {field.type}. "
            "Encode it as numbers when writing the files (e.g. categories as integer ids)."
        )


def _to_numpy(column: Any) -> np.ndarray:
    """An Arrow column as numpy: scalars 1-D; a list column `(rows, length)` (every list of one length)."""
    array = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    if array.null_count:
        raise ValueError(
            f"A Parquet column read holds {array.null_count} null value(s); meshfit needs every value. "
            "Fill or drop them when writing the files."
        )
    kind = array.type
    import pyarrow as pa

    if pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind) or pa.types.is_large_list(kind):
        values = array.flatten().to_numpy(zero_copy_only=False)
        rows = len(array)
        if rows and len(values) % rows:
            raise ValueError("A list column's lists must all have one length (rows of a fixed shape).")
        return values.reshape(rows, -1 if rows else 0)
    return array.to_numpy(zero_copy_only=False)
