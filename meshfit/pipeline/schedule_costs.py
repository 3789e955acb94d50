"""What each pipelined loop costs a device, said by the loop itself while a step is traced.

A pipelined loop (`meshfit.pipeline.schedules`' GPipe and circular loop,
`meshfit.pipeline.one_f_one_b`'s fused loop) knows what it runs: its ticks,
how many microbatch passes' residuals a stage keeps at once, what a tick
sends, and (traced once more with `jax.vjp`) what one pass through a stage
keeps for its backward. Inside `recording()` each loop traced appends its
`ScheduleCost`; outside it a loop measures and records nothing. The cost
layer (`meshfit.cost.pipeline_cost`) opens the recording around the trace of
a train step, so the figures are the train step's: forward and backward.

Figures are per device: a loop runs manual over the stage axis and the data
axes over which a stage's parameters are whole copies, so it sees one
device's rows; a data replica axis it leaves to the compiler (`share`) splits
what it sees further.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import jax

from meshfit.pipeline.stage_layout import StageLayout

_RECORDED: contextvars.ContextVar[list[ScheduleCost] | None] = contextvars.ContextVar(
    "meshfit_schedule_costs", default=None
)


@dataclasses.dataclass(frozen=True)
class ScheduleCost:
    """One pipelined loop of a train step, per device of a stage.

    Attributes:
        schedule: the loop that ran: "gpipe", "circular" or "1f1b".
        stages: P, the stages of the loop.
        microbatches: M, the parts each data replica's rows are cut into.
        repeats: v, the rounds a microbatch makes through the stages (circular; else 1).
        forward_ticks: ticks that run a forward and send an activation on (v M + P - 1).
        backward_ticks: ticks that run a backward and send a cotangent back (as many: autodiff of
            the forward loop for gpipe and circular, the fused loop's own for 1f1b).
        depth: how many microbatch passes' residuals a stage keeps at once (gpipe, circular: every
            forward tick's, idle ones included; 1f1b: the slots of its stash, min(2P - 1, M)).
        send_bytes: bytes of one microbatch's activation, what a tick sends (a cotangent has its shape).
        pass_residual_bytes: bytes autodiff keeps of one microbatch's pass through a stage's layers (of one
            round, for circular), measured from the residuals themselves; the stage's parameters, kept
            once for every pass, are not counted.
    """

    schedule: str
    stages: int
    microbatches: int
    repeats: int
    forward_ticks: int
    backward_ticks: int
    depth: int
    send_bytes: int
    pass_residual_bytes: int

    @property
    def p2p_bytes(self) -> int:
        """Bytes a device sends to a neighbour stage per step: one activation or cotangent a tick."""
        return (self.forward_ticks + self.backward_ticks) * self.send_bytes

    @property
    def activation_bytes(self) -> int:
        """Bytes of the residuals a stage keeps at once: depth passes."""
        return self.depth * self.pass_residual_bytes

    @property
    def bubble(self) -> float:
        """The fraction of its ticks a stage idles: P - 1 of the forward ticks (and as many backward)."""
        return (self.stages - 1) / self.forward_ticks


@contextlib.contextmanager
def recording() -> Iterator[list[ScheduleCost]]:
    """Collects the `ScheduleCost` of every pipelined loop traced until the block ends, in the list yielded."""
    found: list[ScheduleCost] = []
    token = _RECORDED.set(found)
    try:
        yield found
    finally:
        _RECORDED.reset(token)


def active() -> bool:
    """Whether a `recording()` is open: a loop measures its residuals only then (it costs a trace)."""
    return _RECORDED.get() is not None


def record(cost: ScheduleCost) -> None:
    """Adds `cost` to the open recording; nothing outside one."""
    found = _RECORDED.get()
    if found is not None:
        found.append(cost)


def share(layout: StageLayout) -> int:
    """The data replicas whose rows one device of a loop on `layout` sees together: those of the replica
    axes the loop leaves to the compiler (1 where it runs manual over every replica axis)."""
    manual = math.prod(int(layout.mesh.shape[axis]) for axis in layout.data_axes)
    return max(layout.replicas // manual, 1)


def nbytes(tree: Any) -> int:
    """Bytes of the arrays (or shapes) in `tree`."""
    return sum(int(math.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))
