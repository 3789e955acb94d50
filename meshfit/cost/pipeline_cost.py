"""What a pipelined step costs a stage: its parameters, the activations its schedule keeps, its
point-to-point bytes and its bubble, read from the train step's jaxpr.

A `MeshStrategy` with a `stage` axis runs a `meshfit.pipeline.Stages` stack as
a loop of ticks inside `jax.shard_map` (`meshfit.pipeline.schedules`): each
tick a stage runs its layers on one microbatch and `lax.ppermute`s the result
to its neighbour. The jaxpr of the train step holds those loops, forward and
backward, so the bytes sent are counted from it: each `ppermute` over the
`stage` axis, its operand's bytes times the ticks of the loops around it. A
tick's layer residuals (what autodiff of one microbatch's pass through the
stage's layers keeps for the backward) are read from the same loops, and the
schedule says how many passes are kept at once:

* "gpipe" and "circular": every tick of the forward loop, repeats * M + P - 1
  (bubble ticks too: they run on zeros), each the residuals of its pass;
* "1f1b": min(2P - 1, M), the passes whose residuals its loop stashes between a
  microbatch's forward tick and its backward tick (the loss runs inside the
  last stage, `meshfit.pipeline.one_f_one_b`).

Shapes inside the `shard_map` span the whole batch (the other mesh axes stay
with the compiler); a microbatch's rows are split over the data replicas, so
its bytes per device are divided by them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.extend import core as jax_core

from meshfit.pipeline import layer_stacks
from meshfit.pipeline.settings import STAGE_AXIS


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """One pipelined train step, per device of one stage.

    Attributes:
        stages: P, the size of the `stage` axis.
        microbatches: M, the parts each data replica's rows are cut into.
        schedule: "gpipe", "circular" or "1f1b".
        repeats: v, the layer groups a stage runs per microbatch (circular).
        bubble: the fraction of a stage's ticks spent idle, (P - 1) / (v * M + P - 1).
        p2p_bytes: bytes a device sends to its neighbour stage per step (`ppermute`
            operands times the ticks that send them, forward and backward).
        microbatch_bytes: bytes of one microbatch's activation on one device (what a tick sends).
        stage_param_bytes: bytes of the `Stages` parameters one device holds: its stage's layers.
        pass_residual_bytes: bytes autodiff keeps of one microbatch's pass through a stage's
            layers (of one round, for circular).
        kept_passes: how many passes' residuals a stage keeps at once (gpipe, circular: every
            forward tick, v * M + P - 1; 1f1b: the min(2P - 1, M) its ring stashes).
        activation_bytes: the activations the schedule keeps on one device:
            kept_passes * pass_residual_bytes.
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


def pipeline_cost(strategy: Any, jaxpr: jax_core.ClosedJaxpr, params: Any) -> PipelineCost | None:
    """The `PipelineCost` of a train step's `jaxpr` under `strategy`; None without a `stage` axis or
    where the step runs no pipelined loop. `params` are the state's parameters (laid out, or abstract
    with their shardings)."""
    pipeline = getattr(strategy, "pipeline", None)
    if pipeline is None:
        return None
    loops = _tick_loops(jaxpr.jaxpr)
    if not loops:
        return None
    replicas = max(int(strategy.num_replicas_in_sync), 1)
    stages, microbatches, repeats = strategy.stages, pipeline.microbatches, pipeline.repeats
    # A loop manual over the data axes sees one device's rows already; one left to the compiler, every row.
    manual = loops[0].manual - {STAGE_AXIS}
    replicas = max(replicas // math.prod(strategy.mesh.shape[axis] for axis in manual), 1)
    p2p = sum(loop.sent for loop in loops) // replicas
    microbatch = loops[0].operand // replicas
    residuals = max(loop.residuals for loop in loops) // replicas
    if pipeline.schedule == "1f1b":
        kept = min(2 * stages - 1, microbatches)
        activations = kept * residuals
    else:
        kept = pipeline.ticks(stages)
        activations = kept * residuals
    return PipelineCost(
        stages=stages,
        microbatches=microbatches,
        schedule=pipeline.schedule,
        repeats=repeats,
        bubble=pipeline.bubble(stages),
        p2p_bytes=p2p,
        microbatch_bytes=microbatch,
        stage_param_bytes=_stage_param_bytes(params),
        pass_residual_bytes=residuals,
        kept_passes=kept,
        activation_bytes=activations,
    )


@dataclasses.dataclass(frozen=True)
class _Loop:
    operand: int  # bytes of one ppermute operand (as the loop sees it: one device's rows, or every row)
    sent: int  # ppermute bytes over all ticks
    residuals: int  # ys bytes of the layer loops one tick runs
    manual: frozenset  # the mesh axes the enclosing `shard_map` runs manual over


def _tick_loops(jaxpr: jax_core.Jaxpr, manual: frozenset | None = None) -> list[_Loop]:
    """The scans inside a `shard_map` whose bodies send over the stage axis: the pipeline's tick loops."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and manual is not None:
            body = eqn.params["jaxpr"].jaxpr
            sends = [e for e in body.eqns if e.primitive.name == "ppermute" and STAGE_AXIS in _axes(e)]
            if sends:
                aval = sends[0].invars[0].aval
                sent = eqn.params["length"] * sum(_bytes(e.invars[0].aval) for e in sends)
                residuals = max((_residual_bytes(e, aval.shape[0]) for e in _eqns(body)), default=0)
                found.append(_Loop(_bytes(aval), sent, residuals, manual))
                continue
        inner = manual
        if eqn.primitive.name == "shard_map":
            inner = (manual or frozenset()) | frozenset(eqn.params.get("newly_manual_axes", ()))
        for sub in _subjaxprs(eqn):
            found += _tick_loops(sub, inner)
    return found


def _axes(eqn: Any) -> tuple:
    names = eqn.params.get("axis_name", ())
    return names if isinstance(names, tuple) else (names,)


def _residual_bytes(eqn: Any, rows: int) -> int:
    """Bytes of the activations a layer loop stacks over its layers: the outputs beyond its carry
    shaped (layers, rows of a microbatch, ...), not the parameters' gradients it stacks too."""
    if eqn.primitive.name != "scan":
        return 0
    stacked = [v.aval for v in eqn.outvars[eqn.params["num_carry"] :]]
    return sum(_bytes(a) for a in stacked if len(a.shape) > 1 and a.shape[1] == rows)


def _eqns(jaxpr: jax_core.Jaxpr) -> list[Any]:
    """`jaxpr`'s equations and those nested in them (a `checkpoint`'s, a `pjit`'s), in order."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        if eqn.primitive.name != "scan":
            for sub in _subjaxprs(eqn):
                found += _eqns(sub)
    return found


def _subjaxprs(eqn: Any) -> list[jax_core.Jaxpr]:
    subs = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax_core.ClosedJaxpr):
                subs.append(item.jaxpr)
            elif isinstance(item, jax_core.Jaxpr):
                subs.append(item)
    return subs


def _bytes(aval: Any) -> int:
    return int(math.prod(aval.shape)) * aval.dtype.itemsize


def _stage_param_bytes(params: Any) -> int:
    """Bytes per device of the parameters laid out on the stage axis (a `Stages` stack's), from their shardings."""
    total = 0
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", None)
        if layer_stacks.layer_axes(spec):
            total += int(math.prod(sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
    return total
