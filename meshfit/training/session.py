"""Session: a model's training state, its compiled programs and the running fit, each with one owner.

The session joins four owners and answers the model and the loop:

* `store` (`meshfit.training.state_store.StateStore`): the `TrainState`, settled and
  latest reads, the host's count of optimizer steps;
* `cursor` (`meshfit.training.fit_cursor.FitCursor`): where the running fit stands and
  where a resumed one continues;
* `executables` (`meshfit.training.executables.Executables`): the compiled train,
  evaluate and predict programs, built through the strategy (the one place
  that knows about steps needing a partial batch's real rows);
* `feeder` (`meshfit.training.feeder.Feeder`): how training batches reach the devices,
  as `Execution`s the session runs without looking at their kind.

Beside them, `timer` (`meshfit.training.fit_timer.FitTimer`) measures where a running
fit's time goes; the session marks its steps and its waits for them, and the loop its phases (`phase`).

The model and the loop ask the session through its methods, never its owners: `executions`, `prefetch`
and `host_groups` (the feeder), `start_point`, `begin_epoch` and `epoch_done` (the cursor), `settle`
(what an asynchronous strategy has in flight), `finish_pass` (the in-flight bound). Callbacks see the
running fit through `context` (`meshfit.training.fit_context.FitContext`), not the session.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager

import jax

from meshfit.core.batch import Batch
from meshfit.core.state import TrainState
from meshfit.cost.step_report import StepReport
from meshfit.pipeline import layer_stacks
from meshfit.steps.builtin import Steps
from meshfit.training.executables import Executables
from meshfit.training.feeder import Execution, Feeder
from meshfit.training.fit_context import FitContext
from meshfit.training.fit_cursor import FitCursor, Position
from meshfit.training.fit_timer import FitTimer
from meshfit.training.in_flight import InFlight
from meshfit.training.state_store import StateStore, wait_token

#: The farthest apart the in-flight bound's marks may grow for a state on one device (`InFlight.max_spacing`).
ONE_DEVICE_SPACING = 16


def _on_one_device(state: TrainState) -> bool:
    """Whether `state` lives on a single device of a single process (no collectives in its steps)."""
    if jax.process_count() != 1:
        return False
    leaves = jax.tree.leaves(state)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    return sharding is not None and len(sharding.device_set) == 1


class Session:
    """A model's `TrainState`, its compiled programs and the position of the running fit.

    Args:
        strategy: the model's strategy (placement, compilation, transfers).
        state: the initial state, already laid out by `strategy.place_state`.
        max_in_flight: see `meshfit.training.in_flight.InFlight` (its `limit`).
        follow: see `meshfit.training.state_store.StateStore`.
    """

    def __init__(self, strategy, state: TrainState, max_in_flight: int = 4, follow=None, create=None):
        self.strategy = strategy
        self.store = StateStore(state, follow, create)
        self.cursor = FitCursor()
        # On one device nothing waits on a collective: tiny executions may queue further apart.
        self.in_flight = InFlight(max_in_flight, ONE_DEVICE_SPACING if _on_one_device(state) else None)
        self.executables: Executables | None = None  # set by `build`
        self.example_batch: Batch | None = None  # the host batch the programs were built for (set by `build`)
        self.feeder: Feeder | None = None
        self.callbacks: list = []  # the running fit's (BackupAndRestore saves their state)
        self.timer = FitTimer()  # where a fit's time goes: `fit` runs inside it; the loop and savers mark it
        self.context = FitContext(self)
        # The next epoch's accumulators, made while the devices finish an epoch: the
        # host work before an epoch's first step is what the devices wait for.
        self._spare_metrics = None

    # -- the state -------------------------------------------------------------------------

    @property
    def state(self) -> TrainState:
        """The state after every batch handed out so far (see `settle`): what savers write and `get_weights`
        returns."""
        self.settle()
        return self.store.latest

    @state.setter
    def state(self, state: TrainState) -> None:
        self.store.replace(state)

    @property
    def latest(self) -> TrainState:
        """The state without waiting for batches in flight (see `StateStore.latest`)."""
        return self.store.latest

    @property
    def template(self) -> TrainState:
        """The state's shapes, dtypes and shardings, without creating a state not created yet (see
        `StateStore.template`)."""
        return self.store.template

    @property
    def pending(self):
        """What creates the state on its first read, while it is not created yet (a factory's model); else None."""
        return self.store.pending

    @property
    def step(self) -> int:
        """Optimizer steps taken, counted on the host (no transfer)."""
        return self.store.step

    def settle(self) -> dict | None:
        """Applies every batch handed out but not yet applied (asynchronous strategies: their train
        program's `drain`).

        Afterwards the state accounts for exactly the batches the fit's
        position counts as consumed. Returns the logs after that, or None for
        a strategy with nothing in flight.
        """
        drained = None if self.executables is None else self.executables.drain()
        if drained is None:
            return None
        state, logs = drained
        self.store.settle(state)
        return logs

    def reset(self, state: TrainState) -> None:
        """A fresh start (`compile`): the state at step 0, compiled programs dropped."""
        self.store.reset(state)
        self._drop_programs()

    def reset_later(self, template: TrainState, create) -> None:
        """`reset` to the state `create` makes when it is first read; `template` its shapes and layouts."""
        self.store.defer(template, create)
        self._drop_programs()

    def _drop_programs(self) -> None:
        self.executables = self.feeder = self._spare_metrics = self.example_batch = None

    # -- a fit -----------------------------------------------------------------------------

    def begin_fit(self, data, callbacks: list, initial_epoch: int) -> None:
        """Starts a fit over `data` at `initial_epoch`; callbacks may `restore` a position next."""
        self.callbacks = list(callbacks)
        self.cursor.begin_fit(data, initial_epoch)
        self.store.begin_fit(self.strategy.to_host)

    def end_fit(self, finished: bool) -> None:
        self.callbacks = []
        self.cursor.end_fit()
        self.store.end_fit(finished)

    def count(self, steps: int) -> None:
        """Counts `steps` trained batches."""
        self.store.count(steps)
        self.cursor.count(steps)

    def position(self, finished: bool = True) -> Position:
        """Where the running fit stands, with the state settled to match it (and its steps finished).

        A saver asks before it writes: waiting here for the steps in flight is step time, so the
        timer does not count it as the save's. With `finished=False` nothing waits for the devices:
        for a saver whose copies of the state queue behind the steps in flight (the memory tier).
        """
        with self.timer.phase("steps"):
            self.settle()
            if finished:
                jax.block_until_ready(self.store.latest.step)
        return self.cursor.position(self.store.step)

    def restore(self, state: TrainState, position: Position) -> None:
        """Continues the running fit from a backup: its state (layer stacks in either form: each is stored as
        the live state stores it, `meshfit.pipeline.layer_stacks`), step count, input position and epoch."""
        self.store.restore(layer_stacks.stored(state, self.store.template), position.step)
        self.cursor.restore(position)

    def start_point(self, initial_epoch: int) -> tuple[int, int]:
        """`(epoch, step_in_epoch)` the running fit starts at: a restored position, or `initial_epoch`'s start."""
        return self.cursor.start_point(initial_epoch)

    def begin_epoch(self, epoch: int, step_in_epoch: int) -> int:
        """Marks the start of `epoch` (at `step_in_epoch`); returns the data pass it reads."""
        return self.cursor.begin_epoch(epoch, step_in_epoch)

    def epoch_done(self) -> None:
        """The current epoch is complete: the position is the next epoch's start."""
        self.cursor.epoch_done()

    def phase(self, name: str) -> AbstractContextManager:
        """A context that counts the time inside it as the fit timer's phase `name` (see `FitTimer`)."""
        return self.timer.phase(name)

    # -- compiled programs -----------------------------------------------------------------

    @property
    def built(self) -> bool:
        return self.executables is not None

    @property
    def steps(self) -> Steps | None:
        """The step functions the programs were compiled from (None before `build`)."""
        return None if self.executables is None else self.executables.steps

    @property
    def steps_per_execution(self) -> int:
        return self.executables.steps_per_execution

    def build(
        self, steps: Steps, steps_per_execution: int = 1, example_batch: Batch | None = None, eager: bool = False
    ) -> None:
        """Compiles the programs (once per batch shape, on first use; `eager`: runs them un-jitted) and sets
        fresh metric accumulators.

        `example_batch`: a host batch of the shape the programs are built for (`step_report`, `train_step_jaxpr`).
        """
        self.executables = Executables(self.strategy, steps, steps_per_execution, eager)
        self.example_batch = example_batch
        self.feeder = Feeder(self.executables)
        self._spare_metrics = None
        self.store.replace_metrics(self.executables.fresh_metrics())

    def step_report(self, host_batch) -> StepReport:
        """The cost of the train step for one batch shaped like `host_batch` (compiled, not run)."""
        return self.executables.step_report(self.store.latest, host_batch)

    def train_step_jaxpr(self):
        """The jaxpr of the train step for the example batch (traced, not compiled); None before `build`."""
        if self.executables is None or self.example_batch is None:
            return None
        return self.executables.train_step_jaxpr(self.store.latest, self.example_batch)

    # -- metric accumulators ---------------------------------------------------------------

    def reset_train_metrics(self) -> None:
        """Fresh accumulators for an epoch: those `finish_epoch` prepared, or new ones."""
        metrics, self._spare_metrics = self._spare_metrics, None
        self.store.replace_metrics(self.executables.fresh_metrics() if metrics is None else metrics)

    def fresh_eval_metrics(self):
        """Fresh loss and metric accumulators on the strategy's devices."""
        return self.executables.fresh_metrics()

    def epoch_logs(self) -> dict:
        """The logs of the accumulated metrics (device values)."""
        return self.executables.steps.logs(self.store.latest.metrics)

    def check_batches(self, data) -> None:
        """Refuses, before any step, an input whose partial batches the steps cannot take here
        (`Executables.check_batches`)."""
        self.executables.check_batches(data)

    # -- batches -----------------------------------------------------------------------------

    def executions(self, data, epoch: int, start_step: int = 0, per_step: bool = True) -> Iterator[Execution]:
        """The `Execution`s of data pass `epoch`'s training from batch `start_step` on (`Feeder.executions`)."""
        return self.feeder.executions(data, epoch, start_step, per_step)

    def prefetch(self, data, epoch: int, per_step: bool = True) -> None:
        """Prepares data pass `epoch`'s first execution now, while the devices finish (`Feeder.prefetch`)."""
        self.feeder.prefetch(data, epoch, per_step)

    def host_groups(self, data) -> Iterator[tuple[int, Batch]]:
        """`(count, host)` of one pass of evaluation or prediction: a batch, or `steps_per_execution` stacked
        (`Feeder.host_groups`), read from `data.for_evaluation()`: it moves no training position."""
        return self.feeder.host_groups(data.for_evaluation())

    # -- training --------------------------------------------------------------------------

    def train(self, execution: Execution) -> dict:
        """Runs one `Execution` (from `executions`); returns its logs (device values)."""
        with self.timer.phase("steps"):
            return self.store.advance(execution.calls, self.in_flight)

    def train_batch(self, host_batch) -> dict:
        """One training step on one host batch (`train_on_batch`), its metrics counted afresh; returns its logs.

        The program is the single step `fit` uses for a short last group: compiled once per batch shape.
        """
        self.reset_train_metrics()
        logs = self.store.advance(self.feeder.one_batch(host_batch).calls, self.in_flight)
        self.store.count(1)
        settled = self.settle()  # asynchronous strategies: the batch is applied before its logs are read
        return logs if settled is None else settled

    def finish_epoch(self, logs):
        """Returns the epoch's final logs (device values), after settling the state.

        Queued steps stay counted by `in_flight`: an epoch whose logs nobody
        reads yet ends without a sync, and the bound holds across epochs.
        """
        with self.timer.phase("steps"):
            settled = self.settle()
        if self._spare_metrics is None:
            self._spare_metrics = self.executables.fresh_metrics()
        return logs if settled is None else settled

    # -- evaluation and prediction ---------------------------------------------------------

    def evaluate(self, metrics, host_batch):
        """One evaluation execution on the current weights; returns the new accumulators and logs."""
        state = self.store.latest
        metrics, logs = self.executables.evaluate((state.params, state.model_state), metrics, host_batch)
        token = wait_token(logs)
        self.in_flight.add(metrics if token is None else token)
        return metrics, logs

    def predict(self, host_batch):
        """Outputs of one execution, and the mask of its real rows (of every process)."""
        state = self.store.latest
        y_pred, mask = self.executables.predict((state.params, state.model_state), host_batch)
        self.in_flight.add(y_pred)
        return y_pred, mask

    def finish_pass(self) -> None:
        """Ends an evaluation or prediction pass whose results are read next: the in-flight bound forgets its
        mark (everything before the read is finished)."""
        self.in_flight.clear()
