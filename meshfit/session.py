"""Session: a model's training state on its devices, and the bookkeeping that resumes a fit.

The session is the one owner of the `TrainState`. Compiled steps return a new
state (the old buffers are donated, no copy is kept) and the session stores
it; everything else reads the state through `state`, which is settled (it
accounts for every batch handed out, also under asynchronous strategies),
and replaces it through `state = ...`, `reset` or `restore`; `latest` is the
state without waiting for batches in flight. The session also
counts optimizer steps on the host, knows where a running fit stands
(`position()`), and decides how training batches reach the devices
(`train_executions`): one by one, or several staged on the devices at once.

Scalar losses: a loss that returns one value for the batch cannot be masked,
so a partial batch (padded up to full size) must not reach the step every
batch uses. The session reads each batch's real rows from its mask on the host
before the batch goes to the devices, and runs a partial batch of `n` real rows
through a step that computes the scalar on the first `n` rows
(`StepFunctions.with_rows`), compiled on its first use and kept per `n`
(`_with_rows`). In-memory arrays have one partial batch size, so one more
compilation for training and one for evaluation; an iterable's batches one per
distinct partial size (as Keras retraces per batch shape). Each costs what the
step's own compilation costs (for small MLPs on a 2-core CPU, 0.4 to 1 s for
training, 0.1 s for evaluation: `benchmarks/bench_scalar_loss.py`). Full batches
run the usual step at the usual speed; only scalar losses make the host read
masks.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple

import jax
import numpy as np

from meshfit import step_report
from meshfit.in_flight import InFlight
from meshfit.state import TrainState
from meshfit.step_report import StepReport
from meshfit.steps import LOSS_KEY, StepFunctions

#: Bytes of batches placed on the devices at once for single-step training from arrays.
STAGE_BYTES = 8 * 2**20
#: At most this many batches are placed at once (the host gathers them in one go).
MAX_STAGED_STEPS = 64
#: Executions an iterable input (generator, grain) is read and placed ahead of the step, on a thread
#: (0: read each batch when the step needs it).
PREFETCH_EXECUTIONS = 2


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a fit stands: what a backup records to continue it exactly.

    Attributes:
        epoch: the epoch to continue (numbered as `fit` numbers them).
        step_in_epoch: batches of that epoch already trained on.
        step: optimizer steps taken, over all fits.
        data_origin: the pass over array data that epoch 0 reads (passes are
            numbered across fits, so each epoch is shuffled anew).
        data: the training input's own position (an iterator's state).
    """

    epoch: int
    step_in_epoch: int
    step: int
    data_origin: int = 0
    data: dict = dataclasses.field(default_factory=dict)


class Placed(NamedTuple):
    """An execution already laid out on the devices (read ahead by the input's thread): one batch,
    stacked batches, or a list of single batches (a short last group).

    `rows`: under a scalar loss, the real rows of a partial batch (None for a
    full one), or a list of them for a list of batches; None otherwise.
    """

    batches: Any
    rows: Any = None


class Staged(NamedTuple):
    """Batches already on the devices (a stage: several stacked); each step picks one by its device index.

    `rows`: for each index, the real rows of a partial batch under a scalar loss, else None.
    """

    stage: Any
    indices: list
    rows: list


class Session:
    """A model's `TrainState`, its compiled steps and the position of the running fit.

    Args:
        strategy: the model's strategy (placement, compilation, transfers).
        state: the initial state, already laid out by `strategy.place_state`.
        max_in_flight: see `meshfit.in_flight.InFlight`.
        follow: called with each state set from outside a step and at the end of
            each fit: the model points the user's module at the state's arrays, so
            the module never keeps alive arrays the model has dropped.
    """

    def __init__(self, strategy, state: TrainState, max_in_flight: int = 4, follow=None):
        self.strategy = strategy
        self._state = state
        self._follow = follow or (lambda state: None)
        self._follow(state)
        self._step = 0  # optimizer steps taken, counted on the host
        self._step_known = True  # whether `_step` counts `_state` (else read once from the device)
        self.in_flight = InFlight(max_in_flight)
        # The running fit: its callbacks (BackupAndRestore saves their state), its input, its position.
        self.callbacks: list = []
        self.resumed = False  # the running fit continues one restored from a backup
        self._data = None
        self._epoch = self._step_in_epoch = 0
        self._resume_point: tuple[int, int] | None = None
        # Shuffled passes over array data are numbered across fits: epoch e reads pass `_data_origin + e`.
        self._epochs_begun = 0
        self._data_origin = 0
        self.steps: StepFunctions | None = None  # set by `build`
        self._report: tuple | None = None

    # -- the state -------------------------------------------------------------------

    @property
    def state(self) -> TrainState:
        """The state after every batch handed out so far (see `settle`): what savers write and
        `get_weights` returns."""
        self.settle()
        return self._state

    @state.setter
    def state(self, state: TrainState) -> None:
        """Replaces the state from outside a step (weights set, a learning rate changed, a restore)."""
        self._state = state
        self._follow(state)
        self._step_known = False  # a restored state may hold another step: the next fit reads it

    @property
    def latest(self) -> TrainState:
        """The state as the last step returned it, without waiting for batches still in flight.

        The same as `state` under synchronous strategies. Under asynchronous
        ones, reading it costs nothing and joins no other process, so reads
        that need no exact position (shapes, the learning rate, a summary) use it.
        """
        return self._state

    def reset(self, state: TrainState) -> None:
        """A fresh start (`compile`): the state at step 0, compiled steps dropped."""
        self._state, self._step, self._step_known = state, 0, True
        self._follow(state)
        self.steps = None

    @property
    def step(self) -> int:
        """Optimizer steps taken, counted on the host (no transfer)."""
        return self._step

    def settle(self):
        """Applies every batch handed out but not yet applied (asynchronous strategies).

        Afterwards the state accounts for exactly the batches the data position
        counts as consumed, so what a saver writes resumes exactly. Returns the
        logs after that, or None for a strategy with nothing in flight.
        """
        if self.steps is None:
            return None
        drained = self._train.drain()
        if drained is None:
            return None
        self._state, logs = drained
        return logs

    # -- a fit's position ------------------------------------------------------------------

    def begin_fit(self, data, callbacks: list, initial_epoch: int) -> None:
        """Starts a fit over `data` at `initial_epoch`; callbacks may `restore` a position next."""
        self._data, self.callbacks, self.resumed = data, list(callbacks), False
        if not self._step_known:  # set from outside since the last fit: read its step once
            self._step = int(self.strategy.to_host(self._state.step))
        self._step_known = False  # until this fit ends normally, the count may run ahead of the state
        self._data_origin = self._epochs_begun - initial_epoch
        self._resume_point = None

    def end_fit(self, finished: bool) -> None:
        """Ends the fit; after one that `finished`, the host count matches the state, so the next need not read it."""
        self._step_known = finished
        self._data, self.callbacks = None, []
        self._follow(self.latest)

    def start_point(self, initial_epoch: int) -> tuple[int, int]:
        """`(epoch, step_in_epoch)` the fit starts at: a restored position, or `initial_epoch`'s start."""
        start, self._resume_point = self._resume_point or (initial_epoch, 0), None
        return start

    def begin_epoch(self, epoch: int, step_in_epoch: int) -> int:
        """Marks the start of `epoch` (at `step_in_epoch`); returns the data pass it reads."""
        self._epoch, self._step_in_epoch = epoch, step_in_epoch
        data_epoch = self._data_origin + epoch
        self._epochs_begun = data_epoch + 1
        return data_epoch

    def count(self, steps: int) -> None:
        """Counts `steps` trained batches of the current epoch."""
        self._step += steps
        self._step_in_epoch += steps

    def epoch_done(self) -> None:
        """The current epoch is complete: the position is the next epoch's start."""
        self._epoch, self._step_in_epoch = self._epoch + 1, 0

    def position(self) -> Position:
        """Where the running fit stands, with the state settled to match it."""
        self.settle()
        data = self._data.get_state() if self._data is not None else {}
        return Position(self._epoch, self._step_in_epoch, self._step, self._data_origin, data)

    def restore(self, state: TrainState, position: Position) -> None:
        """Continues the running fit from a backup: its state, step count, input position and epoch."""
        self.state = state
        self._step, self._step_known = position.step, True
        if self._data is not None:
            self._data.set_state(position.data)
        self._resume_point = (position.epoch, position.step_in_epoch)
        self._data_origin = position.data_origin
        self.resumed = True

    # -- compiled steps -------------------------------------------------------------------

    @property
    def built(self) -> bool:
        return self.steps is not None

    def build(self, steps: StepFunctions, steps_per_execution: int = 1) -> None:
        """Compiles the steps (once per batch shape, on first use) and sets fresh metric accumulators."""
        self.steps = steps = self.strategy.step_functions(steps)
        self.steps_per_execution = steps_per_execution
        multi = self.stacked = steps_per_execution > 1
        compile_ = self.strategy.compile
        self._train = self.strategy.train_function(steps, multi)
        # A short last group of an epoch runs step by step (compiled on first use).
        self._train_one = self.strategy.train_function(steps, False) if multi else self._train
        self._evaluate = compile_(steps.multi_eval_step if multi else steps.eval_step, donate_argnums=(1,))
        self._predict = compile_(steps.multi_predict_step if multi else steps.predict_step)
        self._train_staged = None
        if not multi and self.strategy.capabilities.stages_batches:
            self._train_staged = compile_(steps.staged_train_step, donate_argnums=(0,))
        self._indices: list = []  # device scalars 0, 1, ... picking a batch of a stage
        self._prefetched = None  # (data, epoch, start step, per_step, executions) read ahead by `prefetch`
        self._fresh_metrics = None  # compiled on first use, to lay out fresh accumulators like the first
        # The next epoch's accumulators, made while the devices finish an epoch: the
        # host work before an epoch's first step is what the devices wait for.
        self._spare_metrics = None
        self._report: tuple | None = None  # (batch shape, StepReport) of `step_report`
        # Scalar losses: the steps for partial batches, by kind and real rows (see the module docstring).
        self._scalar = bool(steps.scalar_losses)
        self._by_rows: dict[tuple[str, int], Any] = {}
        self._state = self._state._replace(metrics=self.fresh_eval_metrics())

    def reset_train_metrics(self) -> None:
        """Fresh accumulators for an epoch: those `finish_epoch` prepared, or new ones."""
        metrics, self._spare_metrics = self._spare_metrics, None
        if metrics is None:
            metrics = self.fresh_eval_metrics()
        self._state = self._state._replace(metrics=metrics)

    def fresh_eval_metrics(self):
        """Fresh loss and metric accumulators on the strategy's devices.

        After the first, they come from a compiled call laid out like the
        first: an epoch start then costs one dispatch, not a host transfer.
        """
        if self._fresh_metrics is None:
            placed = self.strategy.replicate(self.steps.init_metrics())
            shardings = jax.tree.map(lambda a: a.sharding, placed)
            self._fresh_metrics = jax.jit(self.steps.init_metrics, out_shardings=shardings)
            return placed
        return self._fresh_metrics()

    def epoch_logs(self):
        """The logs of the accumulated metrics (device values)."""
        return self.steps.logs(self._state.metrics)

    # -- training -------------------------------------------------------------------------

    def train_executions(self, data, epoch: int, start_step: int = 0, per_step: bool = True):
        """Yields `(count, execution)` for the training steps of one epoch, from `start_step` on.

        With one step per execution and data that can gather any batch (in-memory
        arrays), batches travel to the devices in stages of up to `STAGE_BYTES`:
        one host gather and one transfer per stage, and each step picks its
        batch on the device (`Staged`, one step each). With `per_step=False`
        (nothing runs between steps: no batch callbacks, no preemption watch) a
        stage's steps come as one execution, which saves the loop's work per
        step. Otherwise an execution is a host batch.
        """
        ahead, self._prefetched = self._prefetched, None
        if ahead is not None and ahead[:4] == (data, epoch, start_step, per_step):
            yield from ahead[4]
            return
        stage_steps = self._stage_steps(data)
        if stage_steps == 1:
            place = self._place if PREFETCH_EXECUTIONS > 0 else None
            yield from data.executions(epoch, self.steps_per_execution, start_step, pad_last=False, place=place)
            return
        while len(self._indices) < stage_steps:
            self._indices.append(self.strategy.replicate(np.int32(len(self._indices))))
        for count, stage in data.executions(epoch, stage_steps, start_step, pad_last=True):
            rows = self._partial_rows_each(stage.mask)[:count]  # from the host mask, before placing
            placed = self.strategy.place_stage(stage)
            if not per_step:
                yield count, Staged(placed, self._indices[:count], rows)
                continue
            for index, real in zip(self._indices[:count], rows, strict=True):
                yield 1, Staged(placed, [index], [real])

    def prefetch(self, data, epoch: int, per_step: bool = True) -> None:
        """Prepares the first execution of `epoch` now, while the devices finish the last one.

        Only for data whose batches depend on nothing but their position
        (in-memory arrays): reading ahead of an iterator would move its state.
        """
        if not data.random_access:
            return
        executions = self.train_executions(data, epoch, per_step=per_step)
        first = next(executions, None)
        ahead = executions if first is None else itertools.chain([first], executions)
        self._prefetched = (data, epoch, 0, per_step, ahead)

    def _stage_steps(self, data) -> int:
        if self._train_staged is None or not data.random_access:
            return 1
        return max(1, min(MAX_STAGED_STEPS, STAGE_BYTES // data.batch_nbytes))

    def _place(self, execution) -> Placed:
        """Lays out a host execution on the devices (on the input's reading thread)."""
        execution, rows = self._by_batch(execution)
        if isinstance(execution, list):
            return Placed([self.strategy.place_batch(single, False) for single in execution], rows)
        return Placed(self.strategy.place_batch(execution, self.stacked), rows)

    def train(self, execution):
        """One execution: staged batches, a (stacked) batch read ahead and placed, a (stacked) host
        batch, or a list of single batches (a short last group). Returns its logs (device values)."""
        if isinstance(execution, Staged):
            return self._train_staged_steps(execution)
        placed = isinstance(execution, Placed)
        if placed:
            execution, rows = execution.batches, execution.rows
        else:
            execution, rows = self._by_batch(execution)
        if isinstance(execution, list):
            for single, real in zip(execution, rows or [None] * len(execution), strict=True):
                batch = single if placed else self.strategy.distribute_batch(single, False)
                train = self._train_one if real is None else self._with_rows("train", real)
                self._state, logs = train(self._state, batch)
        else:
            batch = execution if placed else self.strategy.distribute_batch(execution, self.stacked)
            train = self._train if rows is None else self._with_rows("train", rows)
            self._state, logs = train(self._state, batch)
        self.in_flight.add(logs[LOSS_KEY])
        return logs

    # -- scalar losses: partial batches by their real rows ---------------------------------

    def _partial_rows(self, mask) -> int | None:
        """The real rows of a partial batch (from its host mask) under a scalar loss; else None: the
        usual step (a full batch, a batch of padding only, or no scalar loss, where masks are not read)."""
        if not self._scalar:
            return None
        real = int(np.count_nonzero(mask))
        return real if 0 < real < np.shape(mask)[-1] else None

    def _partial_rows_each(self, mask) -> list:
        """`_partial_rows` of each batch of a stacked group (host mask of shape (K, rows))."""
        if not self._scalar:
            return [None] * np.shape(mask)[0]
        return [self._partial_rows(row) for row in np.asarray(mask)]

    def _by_batch(self, execution):
        """`(execution, rows)`: `rows` as `Placed` holds them; under a scalar loss a stacked group that
        holds a partial batch becomes the list of its single batches (the K-step scan is one program
        for all K, so that group runs step by step: the single step, as for a short last group)."""
        if not self._scalar:
            return execution, None
        if isinstance(execution, list):
            return execution, [self._partial_rows(single.mask) for single in execution]
        if not self.stacked:
            return execution, self._partial_rows(execution.mask)
        rows = self._partial_rows_each(execution.mask)
        if all(real is None for real in rows):
            return execution, None
        return [_one_of(execution, i) for i in range(len(rows))], rows

    def _with_rows(self, kind: str, rows: int):
        """The step of `kind` ("train", "staged" or "evaluate") for a partial batch of `rows` real rows,
        compiled on first use and kept (each computes the scalar losses on the first `rows` rows)."""
        step = self._by_rows.get((kind, rows))
        if step is None:
            steps = self.steps.with_rows(rows)
            if kind == "train":
                step = self.strategy.train_function(steps, False)
            elif kind == "staged":
                step = self.strategy.compile(steps.staged_train_step, donate_argnums=(0,))
            else:
                step = self.strategy.compile(steps.eval_step, donate_argnums=(1,))
            self._by_rows[(kind, rows)] = step
        return step

    @property
    def partial_batch_steps(self) -> list[tuple[str, int]]:
        """`(kind, real rows)` of each step compiled for partial batches under a scalar loss (the extra
        compilations a scalar loss costs; empty without one)."""
        return sorted(self._by_rows)

    def train_batch(self, host_batch):
        """One training step on one host batch (`train_on_batch`), its metrics counted afresh; returns its logs.

        The step is the single-step function `fit` uses for a short last group:
        compiled once per batch shape.
        """
        self.reset_train_metrics()
        rows = self._partial_rows(host_batch.mask)  # a batch padded to the strategy's batch multiple
        train = self._train_one if rows is None else self._with_rows("train", rows)
        self._state, logs = train(self._state, self.strategy.distribute_batch(host_batch, False))
        self._step += 1
        settled = self.settle()  # asynchronous strategies: the batch is applied before its logs are read
        return logs if settled is None else settled

    def _train_staged_steps(self, staged: Staged):
        """Each staged step in turn, with the in-flight bound kept at every step."""
        train, stage, add = self._train_staged, staged.stage, self.in_flight.add
        for index, rows in zip(staged.indices, staged.rows, strict=True):
            step = train if rows is None else self._with_rows("staged", rows)
            self._state, logs = step(self._state, stage, index)
            add(logs[LOSS_KEY])
        return logs

    def finish_epoch(self, logs):
        """Returns the epoch's final logs (device values), after `settle`.

        Queued steps stay counted by `in_flight`: an epoch whose logs nobody
        reads yet ends without a sync, and the bound holds across epochs.
        """
        settled = self.settle()
        if self._spare_metrics is None:
            self._spare_metrics = self.fresh_eval_metrics()
        return logs if settled is None else settled

    def step_report(self, host_batch) -> StepReport:
        """Compiles the train step for one batch shaped like `host_batch` (nothing runs) and reports its cost.

        The report is kept until the steps are built again: a `Throughput` callback asks at every `fit`.
        """
        shape = jax.tree.map(lambda a: (np.shape(a), np.dtype(a.dtype)), host_batch)
        if self._report is not None and self._report[0] == shape:
            return self._report[1]
        report = self._compile_report(host_batch)
        self._report = (shape, report)
        return report

    def _compile_report(self, host_batch) -> StepReport:
        batch = self.strategy.distribute_batch(host_batch, False)
        train_step = self.strategy.compile(self.steps.train_step, donate_argnums=(0,))  # as fit compiles it
        lowered = train_step.lower(self._state, batch)
        compiled = lowered.compile()
        state = self._state

        def jaxpr():  # traced only where the backend has no cost analysis of a lowered program
            return jax.make_jaxpr(self.steps.train_step)(state, batch)

        rows = jax.tree.leaves(batch.mask)[0].shape[0]
        leaf = jax.tree.leaves(self._state.params)[0]
        devices = sorted(leaf.sharding.device_set, key=lambda d: d.id)
        return step_report.analyse(lowered, compiled, rows, devices, jaxpr)

    # -- evaluation and prediction ------------------------------------------------------------

    def _variables(self):
        return self._state.params, self._state.model_state

    def evaluate(self, metrics, host_batch):
        """One evaluation execution on the current weights; returns the new accumulators and logs.

        Under a scalar loss a partial batch runs alone through its own step
        (`_with_rows`); in a stacked group, the others run as a group with the
        partial batch's mask zeroed (it counts for nothing there), so no
        single-batch step is compiled besides.
        """
        variables = self._variables()
        rows = [None]
        if self._scalar:
            rows = self._partial_rows_each(host_batch.mask) if self.stacked else [self._partial_rows(host_batch.mask)]
        if all(real is None for real in rows):
            batch = self.strategy.distribute_batch(host_batch, self.stacked)
            metrics, logs = self._evaluate(variables, metrics, batch)
        elif not self.stacked:
            batch = self.strategy.distribute_batch(host_batch, False)
            metrics, logs = self._with_rows("evaluate", rows[0])(variables, metrics, batch)
        else:
            partial = np.asarray([real is not None for real in rows])
            mask = np.where(partial[:, None], 0, host_batch.mask).astype(host_batch.mask.dtype)
            if mask.any():
                batch = self.strategy.distribute_batch(host_batch._replace(mask=mask), True)
                metrics, logs = self._evaluate(variables, metrics, batch)
            for i in np.flatnonzero(partial):
                batch = self.strategy.distribute_batch(_one_of(host_batch, i), False)
                metrics, logs = self._with_rows("evaluate", rows[i])(variables, metrics, batch)
        self.in_flight.add(logs[LOSS_KEY])
        return metrics, logs

    def predict(self, host_batch):
        """Outputs of one execution, and the mask of its real rows (of every process)."""
        batch = self.strategy.distribute_batch(host_batch, self.stacked)
        y_pred = self._predict(self._variables(), batch)
        self.in_flight.add(y_pred)
        return y_pred, batch.mask


def _one_of(stacked, i: int):
    """Batch `i` of a stacked host group (a view of its rows)."""
    return jax.tree.map(lambda a: a[i], stacked)
