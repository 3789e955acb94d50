"""The strategy interface and the `scope()` stack.

A strategy decides four things and nothing else:
  * placement of state — where parameters, optimizer state and accumulators live
    (`place_state`);
  * split of the batch — how a host batch becomes a global array over devices
    and processes (`distribute_batch`, `batch_multiple`);
  * compilation of the step — how a pure step function becomes an executable
    (`compile`);
  * reduction of results — how device values come back to the host
    (`to_host`).
The training loop calls only these and never asks which strategy it runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import jax

from meshfit.strategies import placement

_local = threading.local()


def _stack() -> list[Strategy]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class Strategy:
    """Base class; subclasses live one per file in `meshfit/strategies/`."""

    #: Number of model replicas a global batch is split over.
    num_replicas_in_sync: int = 1

    #: Whether single-step training may place a block of batches on the devices
    #: at once (`place_block`) and pick one batch per step inside the compiled step.
    stages_batches: bool = True

    @contextlib.contextmanager
    def scope(self):
        """Makes this the current strategy: models created inside belong to it."""
        _stack().append(self)
        try:
            yield self
        finally:
            _stack().pop()

    # -- what a strategy decides -------------------------------------------------

    @property
    def batch_multiple(self) -> int:
        """A global batch is padded to a multiple of this many rows."""
        return self.num_replicas_in_sync

    def place_state(self, state, param_hints=None):
        """Lays out a `TrainState` on this strategy's devices.

        `param_hints` are PartitionSpecs from the module's sharding metadata,
        for strategies that shard parameters.
        """
        return self.replicate(state)

    def replicate(self, tree):
        """Puts a full copy of a pytree on every device of this strategy."""
        raise NotImplementedError

    @property
    def batch_block(self) -> tuple[int, int]:
        """`(index, count)`: this process feeds block `index` of `count` equal row blocks of each batch."""
        return self.process_index, self.process_count

    @property
    def local_batch_multiple(self) -> int:
        """This process's share of `batch_multiple` (rows of each global batch it feeds)."""
        return self.batch_multiple // self.batch_block[1]

    def distribute_batch(self, host_batch, stacked: bool = False):
        """Turns this process's rows of a batch (numpy pytree) into global device arrays.

        `stacked` batches carry a leading steps axis (`steps_per_execution > 1`);
        their batch dimension is the second.
        """
        raise NotImplementedError

    def place_block(self, host_block):
        """Places batches stacked on a leading axis as device arrays, for several steps to read.

        Laid out as `distribute_batch(host_block, stacked=True)` lays them out.
        """
        return self.distribute_batch(host_block, True)

    def compile(self, fn: Callable, *, donate_argnums: tuple[int, ...] = ()) -> Callable:
        """Compiles a pure step function for this strategy's devices."""
        raise NotImplementedError

    def train_function(self, steps, stacked: bool):
        """The callable `(state, batch) -> (state, logs)` the loop calls for each execution.

        By default the compiled `steps.train_step` (or its K-step scan). A
        strategy that splits a step between workers and a server builds its
        own from `steps.gradients` and `steps.apply_gradients`; if the result
        runs asynchronously it has `drain() -> (state, logs)`.
        """
        fn = steps.multi_train_step if stacked else steps.train_step
        return self.compile(fn, donate_argnums=(0,))

    def to_host(self, tree):
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


_default: list[Strategy] = []


def get_strategy() -> Strategy:
    """The strategy of the innermost `scope()`, or the default `OneDeviceStrategy`."""
    stack = _stack()
    if stack:
        return stack[-1]
    if not _default:
        from meshfit.strategies.one_device import OneDeviceStrategy

        _default.append(OneDeviceStrategy())
    return _default[0]


def has_strategy() -> bool:
    """True inside some strategy's `scope()`."""
    return bool(_stack())
