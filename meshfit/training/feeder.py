"""How batches reach the devices: grouped for `steps_per_execution`, padded, staged several at once, placed.

A data source (`meshfit.data.sources.DataSource`) only yields host batches;
everything between them and the compiled programs is here. The feeder groups
them for `steps_per_execution` (gathered at once from in-memory arrays),
fills a short group where a program needs a fixed group size, stages
batches on the devices and places them. For evaluation and prediction it
hands the host groups to the session (`host_groups`); for training it turns
them into `Execution`s, the one thing the session runs: each is a list of calls of compiled programs with
their device arguments, already chosen (a staged step, a K-step scan, the
single step of a short last group, or the program for a partial batch under a
scalar loss). The session applies the calls in order and never looks at what
kind of input they came from.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import jax
import numpy as np

from meshfit.core.batch import Batch
from meshfit.data.sources import stack_batches
from meshfit.training.executables import Executables, one_of

#: Bytes of batches placed on the devices at once for single-step training from arrays.
STAGE_BYTES = 8 * 2**20
#: At most this many batches are placed at once (the host gathers them in one go).
MAX_STAGED_STEPS = 64


class Call(NamedTuple):
    """One call of a compiled training program: `program(state, *args) -> (state, logs)`."""

    program: Callable
    args: tuple


class Execution(NamedTuple):
    """What the loop hands the session at once: `count` batches, trained by `calls` in order."""

    count: int
    calls: list[Call]


class Feeder:
    """Turns a data source's batches into `Execution`s on the devices of `executables`' strategy."""

    def __init__(self, executables: Executables):
        self.executables = executables
        self.strategy = executables.strategy
        self._indices: list = []  # device scalars 0, 1, ... picking a batch of a stage
        self._prefetched = None  # (data, epoch, start step, per_step, executions) read ahead by `prefetch`

    def executions(self, data, epoch: int, start_step: int = 0, per_step: bool = True) -> Iterator[Execution]:
        """Yields the `Execution`s of one epoch's training, from batch `start_step` on.

        With one step per execution and data that can gather any batch
        (in-memory arrays), batches travel to the devices in stages of up to
        `STAGE_BYTES`: one host gather and one transfer per stage, and each
        step picks its batch on the device. With `per_step=False` (nothing
        runs between steps: no batch callbacks, no preemption watch) a stage's
        steps come as one execution, which saves the loop's work per step.
        Otherwise an execution is one batch (or K stacked), which the strategy
        distributes when its step runs (for one device, inside the compiled call).
        """
        ahead, self._prefetched = self._prefetched, None
        if ahead is not None and ahead[:4] == (data, epoch, start_step, per_step):
            yield from ahead[4]
            return
        stage_steps = self.stage_steps(data)
        if stage_steps == 1:
            yield from self._one_by_one(data, epoch, start_step)
        else:
            yield from self._staged(data, epoch, start_step, stage_steps, per_step)

    def prefetch(self, data, epoch: int, per_step: bool = True) -> None:
        """Prepares the first execution of `epoch` now, while the devices finish the last one.

        Only for data whose batches depend on nothing but their position
        (in-memory arrays): reading ahead of an iterator would move its state.
        """
        if not data.random_access:
            return
        executions = self.executions(data, epoch, per_step=per_step)
        first = next(executions, None)
        ahead = executions if first is None else itertools.chain([first], executions)
        self._prefetched = (data, epoch, 0, per_step, ahead)

    @property
    def has_prefetched(self) -> bool:
        """Whether an epoch's executions are prepared (by `prefetch`) and not yet taken."""
        return self._prefetched is not None

    def stage_steps(self, data) -> int:
        """Batches of `data` placed on the devices at once (1: no staging)."""
        if not self.executables.stages_batches or not data.random_access:
            return 1
        return max(1, min(MAX_STAGED_STEPS, STAGE_BYTES // data.batch_nbytes))

    def one_batch(self, host_batch) -> Execution:
        """One training step on one host batch (`train_on_batch`): the single-step program."""
        return Execution(1, self._single_calls([host_batch], self.strategy.distribute_batch))

    def host_groups(self, data, epoch: int = 0, start_step: int = 0, fill: bool = True) -> Iterator[tuple[int, Batch]]:
        """Yields `(count, host)` of one epoch from batch `start_step` on: one batch, or `steps_per_execution`
        stacked on a new leading axis (gathered at once from data with random access). A short last group is
        filled up with fully masked batches (evaluation and prediction run one program per group size), or
        with `fill=False` comes stacked on a leading axis of its `count`."""
        size = self.executables.steps_per_execution
        if size == 1:
            for batch in data.batches(epoch, start_step):
                yield 1, batch
            return
        for count, group in _groups(data, epoch, start_step, size, aligned=False):
            yield count, (_filled(group, size) if fill and count < size else group)

    # -- how host batches become calls -------------------------------------------------------

    def _one_by_one(self, data, epoch: int, start_step: int) -> Iterator[Execution]:
        """Executions of one or K stacked batches, which the strategy distributes as each step runs (for one
        device, inside the compiled call); an input that reads ahead has read them on its own thread."""
        full = _all_full(data)
        lay_out = self.strategy.distribute_batch
        for count, host in self.host_groups(data, epoch, start_step, fill=False):
            yield Execution(count, self._calls_of(host, lay_out, full))

    def _calls_of(self, host, lay_out: Callable, full: bool = False) -> list[Call]:
        """The calls that train a host execution.

        K stacked batches run as one call of the K-step program, unless the
        group is a short last group (stacked on a leading axis of fewer than
        K) or holds a partial batch under a scalar loss (the K-step scan is one
        program for all K): then its batches run one by one through the
        single-step program. With `full` (every batch of the input is full)
        the K-step program's batches go without their mask (`_all_full`).
        """
        executables = self.executables
        if not executables.stacked:
            return [Call(executables.train("execution", self._rows_of(host)), (lay_out(host, False),))]
        groups = host.mask.shape[0]
        short = groups < executables.steps_per_execution
        if short or any(real is not None for real in executables.partial_rows_each(host.mask)):
            return self._single_calls([one_of(host, i) for i in range(groups)], lay_out)
        return [Call(executables.train("execution"), (lay_out(host._replace(mask=None) if full else host, True),))]

    def _single_calls(self, batches: list, lay_out: Callable) -> list[Call]:
        train = self.executables.train
        return [Call(train("single", self._rows_of(batch)), (lay_out(batch, False),)) for batch in batches]

    def _rows_of(self, host_batch) -> int | None:
        return self.executables.partial_rows(host_batch.mask)

    def _staged(self, data, epoch: int, start_step: int, stage_steps: int, per_step: bool) -> Iterator[Execution]:
        while len(self._indices) < stage_steps:
            self._indices.append(self.strategy.replicate(np.int32(len(self._indices))))
        train, real_rows = self.executables.train, self.executables.real_rows
        usual = train("staged")
        full = _all_full(data)

        for count, stage in _groups(data, epoch, start_step, stage_steps, aligned=True):
            if count < stage_steps:  # one stage shape: one compilation (the fillers are never trained)
                stage = _filled(stage, stage_steps)
            # Steps that need a partial batch's real rows read them from the host mask, before placing.
            rows = self.executables.partial_rows_each(stage.mask)[:count] if real_rows else None
            placed = self.strategy.place_stage(stage._replace(mask=None) if full else stage)
            if rows is not None and any(real is not None for real in rows):
                calls = [
                    Call(train("staged", real), (placed, index))
                    for index, real in zip(self._indices[:count], rows, strict=True)
                ]
            else:  # every batch full, or steps that mask padding: the usual program
                calls = [Call(usual, (placed, index)) for index in self._indices[:count]]
            if not per_step:
                yield Execution(count, calls)
                continue
            for call in calls:
                yield Execution(1, [call])


def _all_full(data) -> bool:
    """Whether every batch `data` gives is full, as every process knows alike (in-memory arrays whose
    batch size divides the samples): its steps then take batches without a mask, which the compiled
    step makes itself (`meshfit.steps.builtin.with_rows_all_real`): none is gathered, placed or picked. A filler
    batch that completes a stage is never trained."""
    return data.random_access and not data.has_partial_batches


def _groups(data, epoch: int, start_step: int, size: int, aligned: bool) -> Iterator[tuple[int, Batch]]:
    """`(count, group)`: consecutive groups of up to `size` batches of one epoch, stacked on a leading axis of
    their `count`; gathered at once (`aligned` for a stage) where `data` has random access, else stacked as read."""
    if data.random_access:
        for first in range(start_step, data.steps_per_epoch, size):
            steps = range(first, min(first + size, data.steps_per_epoch))
            yield len(steps), data.gather(epoch, steps, aligned)
        return
    for chunk in _chunks(data.batches(epoch, start_step), size):
        yield len(chunk), stack_batches(chunk, len(chunk))


def _filled(group: Batch, size: int) -> Batch:
    """A stacked `group` filled up to `size` batches with copies of its last batch, masked out (mask 0)."""
    extra = size - group.mask.shape[0]

    def fill(leaf: np.ndarray) -> np.ndarray:
        return np.concatenate([leaf, np.repeat(leaf[-1:], extra, axis=0)])

    mask = np.concatenate([group.mask, np.zeros((extra,) + group.mask.shape[1:], group.mask.dtype)])
    return jax.tree.map(fill, group._replace(mask=None))._replace(mask=mask)


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    """Consecutive lists of `size` items (the last may be shorter)."""
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
