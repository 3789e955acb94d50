"""The pipelined loop: microbatches through the stages of a `stage` mesh axis, a tick at a time.

Inside `jax.shard_map` over the `stage` axis (the other mesh axes stay with
the compiler), each stage holds its layers' parameters. At tick t, stage s
works on item i = t - s: microbatch i mod M in round i // M (rounds > 0 only
for "circular"). Stage 0 reads its microbatch from the batch in round 0 and
from what the last stage sent round in later rounds; every stage then applies
its layers of that round and sends the result to the next stage with
`lax.ppermute`. After repeats * M + P - 1 ticks, the first stage holds every
microbatch's output. GPipe's and the circular schedule's backward pass is
autodiff of this loop. "1f1b" runs this loop for evaluation and prediction;
the built-in train step runs its own loop instead (`one_f_one_b.py`), with
the loss inside the last stage. Traced inside a `schedule_costs.recording()`,
the loop records what it costs a device (`schedule_costs.ScheduleCost`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from meshfit.core import compat
from meshfit.pipeline import schedule_costs
from meshfit.pipeline.settings import STAGE_AXIS, Pipeline
from meshfit.pipeline.stage_layout import StageLayout
from meshfit.pipeline.vma import vary

Apply = Callable[[Any, jax.Array], jax.Array]


def run(apply: Apply, params: Any, x: jax.Array, layout: StageLayout, repeat_major: bool = False) -> jax.Array:
    """Runs the stacked layers `params` (leading layer axis) on `x` pipelined over `layout`'s stage axis.

    `apply(layer_params, h)` applies one layer. The batch `x` is cut into
    `pipeline.microbatches` parts within each of the layout's data replicas.
    The layout's `data_axes` are the leading batch axes over which each
    stage's parameters are whole copies: the loop runs manual over them too,
    so each data shard sums its parameters' gradient over the ticks and the
    shards reduce it once per step (left to the compiler, the reduction runs
    inside every tick). `repeat_major`: `params` are stored (repeats, layers /
    repeats, ...), as `group` says.
    """
    pipeline, data_axes = layout.pipeline, layout.data_axes
    stages, microbatches = layout.stages, pipeline.microbatches
    grouped = group(params, stages, pipeline, repeat_major)
    micro = to_micro(x, microbatches, layout.replicas)
    body = _loop(apply, layout)
    rows_spec = P(None, data_axes or None)
    forward = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(P(STAGE_AXIS), rows_spec),
        out_specs=rows_spec,
        axis_names={STAGE_AXIS, *data_axes},
    )
    return from_micro(forward(grouped, micro))


def group(params: Any, stages: int, pipeline: Pipeline, repeat_major: bool = False) -> Any:
    """(layers, ...) -> (stages, repeats, layers of a stage's round, ...): stage s runs layer blocks s, s + P, ...

    With `repeat_major`, `params` come as a circular pipeline's `Stages` store them, (repeats, layers /
    repeats, ...) split over the stages on their second axis (`meshfit.pipeline.layer_stacks`): the same
    layers row by row, each stage's blocks already on its devices, so the regrouping moves nothing. From the
    contiguous form (layers, ...) split over the stages, a circular pipeline's regrouping moves the blocks
    to the stages that run them (and their gradients back) every step.
    """
    lead = 2 if repeat_major else 1
    first = jax.tree.leaves(params)[0]
    layers = math.prod(first.shape[:lead])
    pipeline.check_layers(layers, stages)
    repeats = pipeline.repeats
    per_round = layers // (stages * repeats)
    return jax.tree.map(lambda a: jnp.swapaxes(a.reshape(repeats, stages, per_round, *a.shape[lead:]), 0, 1), params)


def to_micro(x: jax.Array, microbatches: int, replicas: int = 1) -> jax.Array:
    """(rows, ...) -> (M, rows / M, ...): each data replica's rows cut in place, row j * M + m to microbatch m."""
    rows = x.shape[0]
    if rows % (microbatches * replicas):
        raise ValueError(
            f"A pipelined batch is cut into {microbatches} microbatches per data replica ({replicas} replicas): "
            f"its rows must divide by {microbatches * replicas}. Received a batch of {rows} rows."
        )
    return jnp.swapaxes(x.reshape(rows // microbatches, microbatches, *x.shape[1:]), 0, 1)


def from_micro(micro: jax.Array) -> jax.Array:
    """The inverse of `to_micro`: (M, rows / M, ...) -> (rows, ...) in the batch's row order."""
    return jnp.swapaxes(micro, 0, 1).reshape(micro.shape[0] * micro.shape[1], *micro.shape[2:])


def _loop(apply: Apply, layout: StageLayout) -> Callable:
    pipeline, stages, data_axes = layout.pipeline, layout.stages, layout.data_axes
    microbatches, repeats = pipeline.microbatches, pipeline.repeats
    items = repeats * microbatches
    ring = [(s, (s + 1) % stages) for s in range(stages)]

    def body(grouped: Any, micro: jax.Array) -> jax.Array:
        # (repeats, layers of a round, ...), each data shard's own copy: the gradient is reduced once, after the loop.
        local = jax.tree.map(lambda a: vary(a[0], data_axes), grouped)
        stage = lax.axis_index(STAGE_AXIS)
        varying = functools.partial(vary, axes=(STAGE_AXIS, *data_axes))  # each stage's (and data shard's) own values

        def scan_layers(params, h):
            return lax.scan(lambda h, p: (apply(p, h), None), h, params)[0]

        if repeats == 1:  # one round: the stage's parameters are the loop's constants, saved once

            def layers_of_round(r, h):
                return scan_layers(jax.tree.map(lambda a: a[0], local), h)

        else:  # the round's slice is taken again in the backward pass: saved, it would be a residual of every tick

            @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_saveable)
            def round_of_layers(params, r, h):
                return scan_layers(jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, r, keepdims=False), params), h)

            def layers_of_round(r, h):
                return round_of_layers(local, r, h)

        if schedule_costs.active():
            # What autodiff keeps of one microbatch's pass through the stage's layers of a round, as a tick runs
            # them: the stage's parameters are the loop's, kept once (`vjp_residuals` sets them apart).
            h = varying(micro[0])
            if repeats == 1:
                residuals = compat.vjp_residuals(scan_layers, jax.tree.map(lambda a: a[0], local), h)
            else:
                residuals = compat.vjp_residuals(lambda p, h: round_of_layers(p, 0, h), local, h)
            _record(layout, residuals, h)

        def tick(carry, t):
            received, done = carry
            item = jnp.clip(t - stage, 0, items - 1)
            m, r = item % microbatches, item // microbatches
            first = jnp.where(r == 0, micro[m], done[m])
            out = layers_of_round(r, jnp.where(stage == 0, first, received))
            sent = lax.ppermute(out, STAGE_AXIS, ring)
            # Stage 0 keeps what the last stage finished (item t - P + 1) for its next round or the result.
            back = t - (stages - 1)
            slot = jnp.clip(back, 0, items - 1) % microbatches
            keep = (stage == 0) & (back >= 0)
            done = lax.dynamic_update_index_in_dim(done, jnp.where(keep, sent, done[slot]), slot, 0)
            return (sent, done), None

        start = (varying(jnp.zeros_like(micro[0])), varying(jnp.zeros_like(micro)))
        (_, done), _ = lax.scan(tick, start, jnp.arange(items + stages - 1))
        return lax.psum(jnp.where(stage == 0, done, jnp.zeros_like(done)), STAGE_AXIS)

    return body


def _record(layout: StageLayout, residuals: compat.VjpResiduals, h: jax.Array) -> None:
    """Records the loop's `ScheduleCost` for a train step: autodiff runs its ticks again backward, each tick's
    residuals kept from its forward to its backward (idle ticks' too: they run on zeros)."""
    pipeline, share = layout.pipeline, schedule_costs.share(layout)
    ticks = pipeline.ticks(layout.stages)
    schedule_costs.record(
        schedule_costs.ScheduleCost(
            schedule="circular" if pipeline.schedule == "circular" else "gpipe",  # 1f1b evaluates on GPipe's loop
            stages=layout.stages,
            microbatches=pipeline.microbatches,
            repeats=pipeline.repeats,
            forward_ticks=ticks,
            backward_ticks=ticks,
            depth=ticks,
            send_bytes=schedule_costs.nbytes(h) // share,
            pass_residual_bytes=schedule_costs.nbytes(residuals.kept_shapes) // share,
        )
    )
