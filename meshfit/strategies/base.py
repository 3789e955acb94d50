"""The strategy interface and the `scope()` stack (`current.py` answers which strategy is current).

A strategy decides four things and nothing else:
  * placement of state — where parameters, optimizer state and accumulators live
    (`place_state`);
  * split of the batch — how a host batch becomes a global array over devices
    and processes (`distribute_batch`, `batch_multiple`);
  * compilation of the step — how a pure step function becomes an executable
    (`compile`);
  * reduction of results — how device values come back to the host
    (`to_host`).
What a strategy can and cannot do beyond that is one declared object,
`Capabilities`, which the model and the session read. The training loop calls
only these and never asks which strategy it runs.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import jax

from meshfit.pipeline import stage_layout as pipeline_layout
from meshfit.strategies import placement
from meshfit.strategies.leaf_programs import LeafProgram

if TYPE_CHECKING:
    from meshfit.core.state import TrainState
    from meshfit.steps.builtin import StepFunctions

_local = threading.local()


def scope_stack() -> list[Strategy]:
    """This thread's stack of entered `scope()`s, innermost last."""
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@dataclass(frozen=True)
class Capabilities:
    """What a strategy can do beyond placing, splitting, compiling and fetching, declared in one place.

    A strategy states these once (`Strategy.capabilities`); `Model.compile`,
    the model's first batch and the session read them instead of asking which
    strategy they run.

    Args:
        stages_batches: whether single-step training may place a block of
            batches on the devices at once (`Strategy.place_stage`) and pick
            one batch per step inside the compiled step.
        loss_scaling: whether the loss and its gradients are computed in one
            step, as a `mixed_float16` loss scale needs.
        scalar_loss_refusal: why a loss that returns a scalar for the batch
            cannot be trained; None when it can. Such a loss cannot be masked,
            so a partial batch's step computes it on the batch's first real
            rows (`StepFunctions.with_rows`), picked on the host from the
            batch's mask: that takes the whole global batch in one synchronous
            step and a host that knows its real rows.
    """

    stages_batches: bool = True
    loss_scaling: bool = True
    scalar_loss_refusal: str | None = None


def multi_process_refusal(process_count: int) -> str | None:
    """Why a job of `process_count` processes cannot train a scalar loss (None for one process).

    Across processes, a process knows only its own rows of a generator's batch.
    """
    if process_count > 1:
        return (
            f"a job of {process_count} processes feeds each batch in per-process parts, "
            "so no process knows how many rows of a partial batch are real"
        )
    return None


class TrainFunction(Protocol):
    """What `Strategy.train_function` returns: the loop's call for one execution of training steps."""

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        """Runs the execution on `state` (donated) and returns the new state and the logs (device scalars)."""

    def drain(self) -> tuple[Any, dict[str, Any]] | None:
        """Applies every batch handed out but not applied yet and returns `(state, logs)`; None when
        nothing is ever left in flight (synchronous training)."""


class CompiledTrainFunction(LeafProgram):
    """A synchronous `TrainFunction`: a step compiled on the state's leaves (`meshfit.strategies.leaf_programs`),
    applied before the next call returns its state."""

    __slots__ = ()

    def drain(self) -> None:
        return None


class Strategy(ABC):
    """What a strategy must implement: `replicate` and `distribute_batch`; the rest has defaults.

    Subclasses live one per file in `meshfit/strategies/`. A strategy that
    shards overrides `state_shardings` (or `place_state`); one that splits a
    step between workers and a server overrides `train_function`; one that
    cannot do all a synchronous step over the whole batch allows says so in
    `capabilities`.
    """

    #: Number of model replicas a global batch is split over.
    num_replicas_in_sync: int = 1

    @property
    def capabilities(self) -> Capabilities:
        """What this strategy can do (`Capabilities`): by default all of it, but a scalar loss across processes."""
        return Capabilities(scalar_loss_refusal=multi_process_refusal(self.process_count))

    @property
    def stage_layout(self) -> pipeline_layout.StageLayout | None:
        """Where a `meshfit.pipeline.Stages` stack called in this strategy's scope runs pipelined; None (the
        default): no `stage` axis, so its blocks run in one scan."""
        return None

    @property
    def context_layout(self) -> Any:
        """How a `context` mesh axis splits sequences (`meshfit.strategies.context_layout.ContextLayout`);
        None (the default): sequences are whole on every device, and attention is plain."""
        return None

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Makes this the current strategy: models created inside belong to it, and `Stages` stacks called
        inside run on its `stage_layout`."""
        scope_stack().append(self)
        try:
            with pipeline_layout.scope(self.stage_layout):
                yield self
        finally:
            scope_stack().pop()

    # -- what a strategy decides -------------------------------------------------

    @property
    def batch_multiple(self) -> int:
        """A global batch is padded to a multiple of this many rows."""
        return self.num_replicas_in_sync

    def check_batch_size(self, batch_size: int) -> None:
        """Raises a ValueError if a global batch of `batch_size` rows cannot be split as this strategy splits
        it. Called for array inputs before a call reads anything; the base strategy takes any size (padding
        to `batch_multiple`), a pipelined one needs whole microbatches."""
        del batch_size

    def step_functions(self, steps: StepFunctions) -> StepFunctions:
        """The step functions this strategy compiles: `steps` as they are, unless it computes
        gradients its own way (the explicit data-parallel step swaps in its per-replica gradients)
        or the objective (a 1F1B pipeline hands in its fused loop)."""
        return steps

    def state_shardings(self, state: TrainState, param_hints: Any = None) -> Any | None:
        """Where `place_state` puts each leaf of a `TrainState`: a matching pytree of shardings.

        `state` may hold arrays or `jax.ShapeDtypeStruct`s: state that does not
        exist yet (a model built from a factory, an optimizer's moments) is
        created in a compiled function with these as its output shardings, so
        no device ever holds what the layout splits. None: the strategy places
        state its own way (`place_state`), and it is created first, then placed.
        """
        del state, param_hints
        return None

    def place_state(self, state: TrainState, param_hints: Any = None) -> TrainState:
        """Lays out a `TrainState` on this strategy's devices (as `state_shardings` says).

        `param_hints` are PartitionSpecs from the module's sharding metadata,
        for strategies that shard parameters.
        """
        shardings = self.state_shardings(state, param_hints)
        return self.replicate(state) if shardings is None else placement.put(state, shardings)

    @abstractmethod
    def replicate(self, tree: Any) -> Any:
        """Puts a full copy of a pytree on every device of this strategy."""

    @property
    def batch_block(self) -> tuple[int, int]:
        """`(index, count)`: this process feeds block `index` of `count` equal row blocks of each batch."""
        return self.process_index, self.process_count

    @property
    def local_batch_multiple(self) -> int:
        """This process's share of `batch_multiple` (rows of each global batch it feeds)."""
        return self.batch_multiple // self.batch_block[1]

    @abstractmethod
    def distribute_batch(self, host_batch: Any, stacked: bool = False) -> Any:
        """Turns this process's rows of a batch (numpy pytree) into global device arrays.

        `stacked` batches carry a leading steps axis (`steps_per_execution > 1`);
        their batch dimension is the second.
        """

    def place_batch(self, host_batch: Any, stacked: bool = False) -> Any:
        """Lays out a batch on the devices ahead of its step (from an input's reading thread).

        The same layout as `distribute_batch`; a strategy whose `distribute_batch`
        leaves the transfer to the compiled step places the batch here.
        """
        return self.distribute_batch(host_batch, stacked)

    def place_stage(self, host_batches: Any) -> Any:
        """Places batches stacked on a leading axis (a stage) as device arrays, for several steps to read.

        Laid out as `distribute_batch(host_batches, stacked=True)` lays them out.
        """
        return self.distribute_batch(host_batches, True)

    def compile(self, fn: Callable, *, donate_argnums: tuple[int, ...] = ()) -> Callable:
        """Compiles a pure step function for this strategy's devices: `jax.jit`, the arguments' layouts
        deciding where it runs."""
        return jax.jit(fn, donate_argnums=donate_argnums)

    def constrain(self, x: jax.Array, *spec: Any) -> jax.Array:
        """Pins the layout of an activation while this strategy traces a step (`meshfit.strategies.constrain`).

        `x` as it is, unless the strategy lays activations out over named mesh axes.
        """
        del spec
        return x

    def train_function(self, steps: StepFunctions, stacked: bool) -> TrainFunction:
        """The `TrainFunction` the loop calls for each execution.

        By default the compiled `steps.train_step` (or its K-step scan). A
        strategy that splits a step between workers and a server builds its
        own from `steps.gradients` and `steps.apply_gradients`; if it runs
        asynchronously, its `drain` applies what is in flight.
        """
        fn = steps.multi_train_step if stacked else steps.train_step
        return CompiledTrainFunction(self.compile, fn)

    def to_host(self, tree: Any) -> Any:
        """Fetches a pytree of device arrays as numpy (a host sync)."""
        return placement.fetch(tree)

    # -- process topology (single process unless a subclass says otherwise) ------

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def process_count(self) -> int:
        return jax.process_count()

    @property
    def is_chief(self) -> bool:
        """True on the process that prints progress and writes logs."""
        return self.process_index == 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
