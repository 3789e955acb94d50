"""What a pipelined step costs a stage: its parameters, the activations its schedule keeps, its
point-to-point bytes and its bubble, as the step's pipelined loops say while it is traced.

A `MeshStrategy` with a `stage` axis runs a `meshfit.pipeline.Stages` stack as
a loop of ticks inside `jax.shard_map`: each tick a stage runs its layers on
one microbatch and `lax.ppermute`s the result to its neighbour. Each loop
knows its own costs (`meshfit.pipeline.schedule_costs.ScheduleCost`): its
ticks forward and backward, what a tick sends, how many microbatch passes'
residuals a stage keeps at once, and what one pass keeps (measured from its
residuals with `jax.vjp`):

* "gpipe" and "circular": every tick of the forward loop, repeats * M + P - 1
  (idle ticks too: they run on zeros), each the residuals of its pass
  (circular's: a round's input and its matrix products' outputs, what its
  `jax.checkpoint` saves);
* "1f1b": the min(2P - 1, M) slots of the ring its loop stashes residuals in
  between a microbatch's forward tick and its backward tick (the loss runs
  inside the last stage, `meshfit.pipeline.one_f_one_b`).

`recorded` collects them while the train step is traced; `pipeline_cost`
adds the parameters one device holds, read from their shardings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from meshfit.pipeline import layer_stacks
from meshfit.pipeline.schedule_costs import ScheduleCost, recording

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """One pipelined train step, per device of one stage.

    Attributes:
        stages: P, the size of the `stage` axis.
        microbatches: M, the parts each data replica's rows are cut into.
        schedule: "gpipe", "circular" or "1f1b": the loop the train step runs.
        repeats: v, the layer groups a stage runs per microbatch (circular).
        bubble: the fraction of a stage's ticks spent idle, (P - 1) / (v * M + P - 1).
        p2p_bytes: bytes a device sends to its neighbour stage per step: an activation each
            forward tick, a cotangent each backward tick.
        microbatch_bytes: bytes of one microbatch's activation on one device (what a tick sends).
        stage_param_bytes: bytes of the `Stages` parameters one device holds: its stage's layers.
        pass_residual_bytes: bytes autodiff keeps of one microbatch's pass through a stage's
            layers (of one round, for circular).
        kept_passes: how many passes' residuals a stage keeps at once (gpipe, circular: every
            forward tick, v * M + P - 1; 1f1b: the min(2P - 1, M) its ring stashes).
        activation_bytes: the activations the schedule keeps on one device:
            kept_passes * pass_residual_bytes (summed over the step's stacks, where it has several).
    """

    stages: int
    microbatches: int
    schedule: str
    repeats: int
    bubble: float
    p2p_bytes: int
    microbatch_bytes: int
    stage_param_bytes: int
    pass_residual_bytes: int
    kept_passes: int
    activation_bytes: int


def recorded(trace: Callable[[], T]) -> tuple[T, tuple[ScheduleCost, ...]]:
    """`trace()`'s result (a step traced: its jaxpr) and the `ScheduleCost`s its pipelined loops recorded.

    Only a trace that runs the step's Python records: trace the step itself (`jax.make_jaxpr`), not a
    program a cache may answer from without running it."""
    with recording() as found:
        result = trace()
    return result, tuple(found)


def pipeline_cost(schedules: Sequence[ScheduleCost], params: Any) -> PipelineCost | None:
    """The `PipelineCost` of a train step from the `schedules` its pipelined loops recorded while it was traced
    (`recording()`); None where it ran none. `params` are the state's parameters (laid out, or abstract with
    their shardings).

    Where a step runs several pipelined stacks, their sends and kept activations add up (each keeps its
    residuals until its own backward); `pass_residual_bytes` and `kept_passes` are the largest stack's.
    """
    if not schedules:
        return None
    first = schedules[0]
    return PipelineCost(
        stages=first.stages,
        microbatches=first.microbatches,
        schedule=first.schedule,
        repeats=first.repeats,
        bubble=first.bubble,
        p2p_bytes=sum(s.p2p_bytes for s in schedules),
        microbatch_bytes=first.send_bytes,
        stage_param_bytes=_stage_param_bytes(params),
        pass_residual_bytes=max(s.pass_residual_bytes for s in schedules),
        kept_passes=max(s.depth for s in schedules),
        activation_bytes=sum(s.activation_bytes for s in schedules),
    )


def _stage_param_bytes(params: Any) -> int:
    """Bytes per device of the parameters laid out on the stage axis (a `Stages` stack's), from their shardings."""
    total = 0
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", None)
        if layer_stacks.layer_axes(spec):
            total += int(math.prod(sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
    return total
