"""The compiled programs of a built model: train, evaluate and predict, built through its strategy.

This is the one place that knows about steps that need a partial batch's
real rows (`Steps.needs_real_rows`): the built-in steps under a loss that
returns a scalar for the batch (it cannot be masked), and a `Model`
subclass's own `train_step` / `test_step` (`meshfit.steps.custom_steps`), which
sees a partial batch at its real size, as in Keras. Such a batch (padded up to
full size) must not reach the step every batch uses: its real rows are read
from its mask on the host before it goes to the devices (`partial_rows`), and
a batch of `n` real rows runs through a copy of the steps made by
`with_rows(n)`, compiled on its first use and kept per `n`. In-memory arrays
have one partial batch size, so one more compilation for training and one
for evaluation; an iterable's batches one per distinct partial size (as Keras
retraces per batch shape). Each costs what the step's own compilation costs
(for small MLPs on a 2-core CPU, 0.4 to 1 s for training, 0.1 s for
evaluation: `benchmarks/bench_scalar_loss.py`). Full batches run the usual
step at the usual speed; only such steps make the host read masks.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from meshfit.core import compat
from meshfit.core.state import TrainState
from meshfit.cost import context_cost, pipeline_cost, step_report
from meshfit.cost.step_report import StepReport
from meshfit.steps.builtin import Steps
from meshfit.strategies.base import Strategy
from meshfit.strategies.leaf_programs import LeafProgram

#: The kinds of training program: "execution" (one call of the loop: one step, or K in a scan),
#: "single" (one step, for a short last group of K), "staged" (one step on a batch picked from a stage).
TRAIN_KINDS = ("execution", "single", "staged")


class Executables:
    """The compiled train, evaluate and predict programs of one `Steps`, through `strategy`.

    Args:
        strategy: compiles each program and decides how training runs (`train_function`).
        steps: the model's steps (`meshfit.steps.builtin.Steps`; the strategy may swap in its own gradients).
        steps_per_execution: steps run by one call of the loop (a `lax.scan` over K stacked batches).
        eager: run every program un-jitted, op by op (`compile(run_eagerly=True)`): each call runs the
            step's Python (a `print`, a breakpoint) under `jax.disable_jit()`, to the same numbers.
    """

    def __init__(self, strategy, steps: Steps, steps_per_execution: int = 1, eager: bool = False):
        self.strategy = strategy
        self.steps = steps = strategy.step_functions(steps)
        self.steps_per_execution = steps_per_execution
        self.stacked = stacked = steps_per_execution > 1
        self.eager = eager
        self._train = self._maybe_eager(strategy.train_function(steps, stacked))
        # A short last group of an epoch runs step by step (compiled on first use).
        single = self._maybe_eager(strategy.train_function(steps, False)) if stacked else self._train
        staged = None
        if not stacked and strategy.capabilities.stages_batches:
            staged = self._maybe_eager(LeafProgram(strategy.compile, steps.staged_train_step))
        self._trains = {"execution": self._train, "single": single, "staged": staged}
        evaluate = strategy.compile(steps.multi_eval_step if stacked else steps.eval_step, donate_argnums=(1,))
        self._evaluate = self._maybe_eager(evaluate)
        self._predict = self._maybe_eager(strategy.compile(steps.multi_predict_step if stacked else steps.predict_step))
        self._fresh_metrics = None  # compiled on first use, to lay out fresh accumulators like the first
        self._report: tuple | None = None  # (batch shape, StepReport) of `step_report`
        # Steps that need real rows: the programs for partial batches, by kind and real rows (module docstring).
        self.real_rows = bool(steps.needs_real_rows)
        # Where no process knows a partial batch's real rows (several processes), steps that need them
        # take full batches only.
        self._real_rows_refusal = strategy.capabilities.scalar_loss_refusal if self.real_rows else None
        self._by_rows: dict[tuple[str, int], Callable] = {}
        self._by_rows_lock = threading.Lock()  # the input's reading thread asks too

    def _maybe_eager(self, program):
        return Eager(program) if self.eager and program is not None else program

    # -- training -------------------------------------------------------------------------

    @property
    def stages_batches(self) -> bool:
        """Whether single steps may pick their batch from a stage placed on the devices at once."""
        return self._trains["staged"] is not None

    def train(self, kind: str, rows: int | None = None) -> Callable:
        """The training program of `kind` (see `TRAIN_KINDS`), for a partial batch of `rows` real rows
        where the steps need real rows (None: the usual program)."""
        if rows is None:
            return self._trains[kind]
        return self._with_rows("single" if kind == "execution" else kind, rows)

    def drain(self) -> tuple[TrainState, dict] | None:
        """Applies what an asynchronous strategy has in flight; None when nothing ever is."""
        return self._train.drain()

    # -- metric accumulators ---------------------------------------------------------------

    def fresh_metrics(self):
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

    # -- evaluation and prediction ---------------------------------------------------------

    def evaluate(self, variables, metrics, host_batch):
        """One evaluation execution of a host batch; returns the new accumulators and logs.

        Where the steps need real rows a partial batch runs alone through its
        own program; in a stacked group, the others run as a group with the
        partial batch's mask zeroed (it counts for nothing there), so no
        single-batch program is compiled besides. Steps that do not mask
        padding (a custom `test_step`) instead run each batch of such a group
        alone, at its real rows, and skip the fillers of padding only.
        """
        distribute = self.strategy.distribute_batch
        rows = self.partial_rows_each(host_batch.mask) if self.stacked else [self.partial_rows(host_batch.mask)]
        if all(real is None for real in rows):
            return self._evaluate(variables, metrics, distribute(host_batch, self.stacked))
        if not self.stacked:
            return self._with_rows("evaluate", rows[0])(variables, metrics, distribute(host_batch, False))
        if not self.steps.masks_padding:
            return self._evaluate_each(variables, metrics, host_batch)
        partial = np.asarray([real is not None for real in rows])
        mask = np.where(partial[:, None], 0, host_batch.mask).astype(host_batch.mask.dtype)
        if mask.any():
            metrics, logs = self._evaluate(variables, metrics, distribute(host_batch._replace(mask=mask), True))
        for i in np.flatnonzero(partial):
            batch = distribute(one_of(host_batch, i), False)
            metrics, logs = self._with_rows("evaluate", rows[i])(variables, metrics, batch)
        return metrics, logs

    def _evaluate_each(self, variables, metrics, host_batch):
        """A stacked group's batches one by one, each at its real rows; batches of padding only skipped."""
        logs = None
        for i, mask in enumerate(np.asarray(host_batch.mask)):
            real = int(np.count_nonzero(mask))
            if real == 0:
                continue
            batch = self.strategy.distribute_batch(one_of(host_batch, i), False)
            metrics, logs = self._with_rows("evaluate", real)(variables, metrics, batch)
        return metrics, logs

    def predict(self, variables, host_batch):
        """Outputs of one execution, and the mask of its real rows (of every process)."""
        batch = self.strategy.distribute_batch(host_batch, self.stacked)
        return self._predict(variables, batch), batch.mask

    # -- steps that need real rows: partial batches by their real rows ----------------------------

    def check_batches(self, data) -> None:
        """Refuses, before any step, an input with partial batches that these steps need at their real rows
        where the strategy cannot give them (several processes; see `partial_rows`)."""
        if self._real_rows_refusal and data.has_partial_batches:
            raise ValueError(self._refusal_message("an input whose batches are not all full"))

    def _refusal_message(self, received: str) -> str:
        return (
            "A custom train_step or test_step sees a partial batch at its real rows, which this strategy "
            f"cannot give it: {self._real_rows_refusal}. Received: {received}. Make sure every batch is full: a batch "
            "size that divides the samples (a multiple of the devices), or drop the last partial batch."
        )

    def partial_rows(self, mask) -> int | None:
        """The real rows of a partial batch (from its host mask) where the steps need real rows; else
        None: the usual program (a full batch, a batch of padding only, or steps that mask padding
        themselves: no mask is read)."""
        if not self.real_rows:
            return None
        real = int(np.count_nonzero(mask))
        if 0 < real < np.shape(mask)[-1] and self._real_rows_refusal:  # (a filler of padding only is no batch)
            raise ValueError(
                self._refusal_message(f"a batch with {real} real rows of {np.shape(mask)[-1]} on this process")
            )
        return real if 0 < real < np.shape(mask)[-1] else None

    def partial_rows_each(self, mask) -> list:
        """`partial_rows` of each batch of a stacked group (host mask of shape (K, rows))."""
        if not self.real_rows:
            return [None] * np.shape(mask)[0]
        return [self.partial_rows(row) for row in np.asarray(mask)]

    def _with_rows(self, kind: str, rows: int) -> Callable:
        """The program of `kind` ("single", "staged" or "evaluate") for a partial batch of `rows` real
        rows, compiled on first use and kept (its steps see the first `rows` rows: see `with_rows`)."""
        key = ("train" if kind == "single" else kind, rows)
        with self._by_rows_lock:
            program = self._by_rows.get(key)
            if program is None:
                steps = self.steps.with_rows(rows)
                if kind == "single":
                    program = self.strategy.train_function(steps, False)
                elif kind == "staged":
                    program = LeafProgram(self.strategy.compile, steps.staged_train_step)
                else:
                    program = self.strategy.compile(steps.eval_step, donate_argnums=(1,))
                self._by_rows[key] = program = self._maybe_eager(program)
        return program

    @property
    def partial_batch_steps(self) -> list[tuple[str, int]]:
        """`(kind, real rows)` of each program compiled for partial batches where the steps need real
        rows (the extra compilations these cost; empty otherwise)."""
        return sorted(self._by_rows)

    def compilations(self) -> dict[str, int]:
        """How many times each program has been compiled so far (one per batch shape it met).

        Keys: "execution", "single" and "staged" (0 where the program is not
        used), "evaluate", "predict". A strategy whose train function is not a
        compiled program of its own (the parameter server) counts 0 for it.
        """
        counts = {kind: _cache_size(program) for kind, program in self._trains.items()}
        if self._trains["single"] is self._trains["execution"]:
            counts["single"] = 0
        counts["evaluate"] = _cache_size(self._evaluate)
        counts["predict"] = _cache_size(self._predict)
        return counts

    # -- cost ------------------------------------------------------------------------------

    def step_report(self, state: TrainState, host_batch) -> StepReport:
        """Compiles the train step for one batch shaped like `host_batch` (nothing runs) and reports its cost.

        The report is kept: a `Throughput` callback asks at every `fit`.
        """
        shape = jax.tree.map(lambda a: (np.shape(a), np.dtype(a.dtype)), host_batch)
        if self._report is None or self._report[0] != shape:
            self._report = (shape, self._compile_report(state, host_batch))
        return self._report[1]

    def train_step_jaxpr(self, state: TrainState, host_batch):
        """The train step's `ClosedJaxpr` for one batch shaped like `host_batch`: traced, not compiled or run."""
        return jax.make_jaxpr(self.steps.train_step)(_abstract(state), _abstract(host_batch))

    def _compile_report(self, state: TrainState, host_batch) -> StepReport:
        batch = self.strategy.distribute_batch(host_batch, False)
        train_step = self.strategy.compile(self.steps.train_step, donate_argnums=(0,))  # as fit compiles it
        lowered = train_step.lower(state, batch)
        compiled = lowered.compile()

        @functools.cache
        def traced():  # (in the strategy's scope, as compiled) only where a part of the report needs it
            with Strategy.scope(self.strategy):  # its jaxpr, and the costs its pipelined loops say as they are traced
                return pipeline_cost.recorded(lambda: jax.make_jaxpr(self.steps.train_step)(state, batch))

        rows = jax.tree.leaves(batch.mask)[0].shape[0]
        leaf = jax.tree.leaves(state.params)[0]
        devices = sorted(leaf.sharding.device_set, key=lambda d: d.id)
        report = step_report.analyse(lowered, compiled, rows, devices, lambda: traced()[0])
        if getattr(self.strategy, "pipeline", None) is not None:
            report = dataclasses.replace(report, pipeline=pipeline_cost.pipeline_cost(traced()[1], state.params))
        if self.strategy.context_layout is not None:
            context = context_cost.context_cost(report.lowered_collectives, self.strategy.context_layout.size)
            report = dataclasses.replace(report, context=context)
        return report


class Eager:
    """A program run un-jitted: each call runs its Python under `jax.disable_jit()` (op by op, as
    Keras's `run_eagerly`); anything else (`drain`) is the program's own. Nothing is compiled, so
    `compilations` counts 0 for it."""

    def __init__(self, program: Callable) -> None:
        self.program = program

    def __call__(self, *args: Any) -> Any:
        with jax.disable_jit():
            return self.program(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.program, name)


def _abstract(tree: Any) -> Any:
    """Shapes and dtypes of a tree's arrays: what tracing reads (no buffer is touched)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype) if hasattr(a, "dtype") else a, tree)


def one_of(stacked: Any, i: int) -> Any:
    """Batch `i` of a stacked host group (a view of its rows)."""
    return jax.tree.map(lambda a: a[i], stacked)


def _cache_size(program) -> int:
    """Compilations of a jitted program or a `LeafProgram` (a synchronous train function); 0 otherwise."""
    return compat.compilations(program)
