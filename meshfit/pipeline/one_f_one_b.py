"""The "1f1b" training step: the loss inside the pipeline's last stage, a forward and a backward each tick.

With the loss outside the pipeline no cotangent exists until every output
does, so the backward could only start after a whole forward pass. Here the
last stage runs the rest of the model (the tail: every layer after `Stages`,
e.g. a norm and a head) and the loss on each microbatch as soon as the
microbatch leaves the stack, and starts its backward in the same tick.

A strategy that trains on this schedule hands the built-in train step
`pipelined_objective(module, layout)`; the step calls it with its objective,
which is computed so:

* the split: the module runs once with `Stages` in capture mode
  (`capture.py`), which records the stack's input h and blocks and returns h;
  the rest of that pass is traced but unused (XLA drops it);
* the loop, inside `jax.shard_map` over the stage (and whole-copy data) axes,
  runs P - 1 warm-up ticks of `forward_tick` only, M steady ticks of
  `forward_tick`, `loss_tick` and `backward_tick`, and P - 1 cool-down ticks
  of `backward_tick` only. Stage s forwards microbatch t - s and backwards
  microbatch t - (2P - 2 - s); on the last stage these are one microbatch,
  whose tail and loss (`jax.vjp`) `loss_tick` runs between the two, so its
  cotangent goes back in the tick its output arrived;
* the `Stash`: each forward's `jax.vjp` residuals wait in a ring of
  min(2P - 1, M) slots until that microbatch's backward: nothing is
  recomputed, and a stage keeps at most 2P - 1 microbatches' residuals,
  whatever M. Residuals that are the stage's own parameters are not stored
  (`meshfit.core.compat.VjpResiduals`).

Traced inside a `schedule_costs.recording()`, the loop records what it costs a
device (`schedule_costs.ScheduleCost`): its ticks, the stash's slots and the
bytes of the residuals one slot holds.

With F one microbatch's forward through a stage, a stage runs
(P - 1) F + 3 M F + (P - 1) 2F = 3 (M + P - 1) F: its idle share is the GPipe
bubble, (P - 1) / (M + P - 1). The tail runs on the last stage only
(`lax.cond` on the stage), the others waiting for it at the tick's end. The
objective's gradient comes out of the loop whole (for a unit cotangent; a
custom VJP scales it), so the step's `jax.grad` carries only the input's
cotangent back through the layers before `Stages`. Each data shard sums its
gradients over the ticks; the shards reduce them once, after the loop.

The tail runs per microbatch, so its rows must be independent (Dense,
LayerNorm, embedding heads are); the objective must be a sum over rows (one
loss's weighted total, or losses reduced by "sum"); the tail must not update
module state (BatchNorm statistics, dropout streams). The built-in train
step (`meshfit.steps.builtin`) refuses the rest before any step runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from meshfit.core import compat
from meshfit.pipeline import capture, schedule_costs, schedules
from meshfit.pipeline.settings import STAGE_AXIS
from meshfit.pipeline.stage_layout import StageLayout
from meshfit.pipeline.stages import Stages
from meshfit.pipeline.vma import vary

#: `(params, batch, consts) -> (objective, aux)`: the step's objective on a batch (or one microbatch of it).
Objective = Callable[[Any, Any, Any], tuple[jax.Array, Any]]
#: `(objective fn, params, batch, consts) -> (objective, aux)`: `fn`'s objective computed by the fused loop.
PipelinedObjective = Callable[[Objective, Any, Any, Any], tuple[jax.Array, Any]]


def stages_path(module: Any) -> tuple | None:
    """The path of `module`'s `Stages` stack; None for a module without one (or not an NNX module)."""
    if not isinstance(module, nnx.Module):
        return None
    paths = [path for path, node in nnx.iter_graph(module) if isinstance(node, Stages)]
    if len(paths) > 1:
        raise ValueError(
            f"The 1f1b schedule pipelines one Stages stack. Received a module holding {len(paths)} "
            f"(at {['/'.join(map(str, p)) for p in paths]}); use one, or schedule='gpipe'."
        )
    return tuple(paths[0]) if paths else None


def pipelined_objective(module: Any, layout: StageLayout) -> PipelinedObjective | None:
    """`objective` bound to `module`'s `Stages` path and `layout`; None where the module holds no `Stages`."""
    path = stages_path(module)
    if path is None:
        return None
    return functools.partial(objective, path=path, layout=layout)


def objective(
    fn: Objective, params: Any, batch: Any, consts: Any, path: tuple, layout: StageLayout
) -> tuple[jax.Array, Any]:
    """`fn(params, batch, consts)`, the objective and its aux, computed by the fused 1F1B loop on `layout`.

    `params` is a nested dict holding the `Stages` parameters at `path`; every
    leaf of `batch` has the batch's rows first; `consts` are not differentiated.
    `fn`'s objective must be a sum over microbatches; its aux leaves are scalars
    (summed over the microbatches) or arrays with rows first (put back in row order).
    """
    with capture.capturing() as found:
        fn(params, batch, consts)  # up to Stages; what follows runs on the stack's input, unused
    stack = found.call
    if stack is None:
        raise ValueError(
            f"The module holds a Stages stack at {'/'.join(map(str, path))} that its forward pass never calls."
        )
    pipeline = layout.pipeline
    grouped = schedules.group(stack.params, layout.stages, pipeline)
    micro_h = schedules.to_micro(stack.x, pipeline.microbatches, layout.replicas)
    micro_batch = jax.tree.map(lambda a: schedules.to_micro(a, pipeline.microbatches), batch)
    tail_params = _without(params, path)
    placeholder = jax.tree.map(lambda a: jnp.zeros((), a.dtype), _at(params, path))

    def tail(tail_params, y, batch_m, consts):
        with capture.injecting(y):
            return fn(_with(tail_params, path, placeholder), batch_m, consts)

    loop = _loop(tail, stack.apply, layout)

    @jax.custom_vjp
    def fused(tail_params, grouped, micro_h, micro_batch, consts):
        return loop(tail_params, grouped, micro_h, micro_batch, consts)[:2]

    def fused_fwd(tail_params, grouped, micro_h, micro_batch, consts):
        value, aux, grads = loop(tail_params, grouped, micro_h, micro_batch, consts)
        return (value, aux), grads

    def fused_bwd(grads, cotangents):
        scale = cotangents[0]
        scaled = jax.tree.map(lambda g: (g * scale.astype(g.dtype)).astype(g.dtype), grads)
        return (*scaled, None, None)

    fused.defvjp(fused_fwd, fused_bwd)
    value, aux = fused(tail_params, grouped, micro_h, micro_batch, consts)
    aux = jax.tree.map(lambda a: jnp.sum(a, axis=0) if a.ndim == 1 else schedules.from_micro(a), aux)
    return value, aux


class Stash(NamedTuple):
    """A ring of `depth` slots, each holding one microbatch's forward residuals: microbatch m in slot m mod depth.

    Stage s backwards microbatch m 2 (P - 1 - s) ticks after forwarding it, so at
    most 2P - 1 microbatches wait at once (on stage 0): depth = min(2P - 1, M)
    slots, and a slot is free again before it is written. Only the residuals
    that are not the stage's parameters are stored (`compat.VjpResiduals.kept`).
    """

    slots: tuple[jax.Array, ...]  # one (depth, *residual shape) buffer per kept residual leaf

    @classmethod
    def empty(cls, shapes: Sequence[Any], depth: int, varying: Callable) -> Stash:
        return cls(tuple(varying(jnp.zeros((depth, *shape.shape), shape.dtype)) for shape in shapes))

    def put(self, slot: jax.Array, residuals: Sequence[jax.Array], valid: jax.Array) -> Stash:
        """The stash with `residuals` in `slot` where `valid` (a bubble tick leaves the slot as it was)."""
        return Stash(
            tuple(
                lax.dynamic_update_index_in_dim(buf, jnp.where(valid, leaf, buf[slot]), slot, 0)
                for buf, leaf in zip(self.slots, residuals, strict=True)
            )
        )

    def take(self, slot: jax.Array) -> list[jax.Array]:
        return [buf[slot] for buf in self.slots]


class Carry(NamedTuple):
    """What one tick hands the next, on each device of the loop."""

    from_prev: jax.Array  # the activation the previous stage sent last tick (this stage's next input)
    from_next: jax.Array  # the cotangent the next stage sent last tick (this stage's next output cotangent)
    stash: Stash  # the residuals of the microbatches forwarded and not yet backwarded
    d_stage: Any  # the stage's parameters' gradient, summed over the ticks
    d_tail: Any  # the tail's parameters' gradient (nonzero on the last stage), summed over the microbatches
    d_input: jax.Array  # stage 0: each microbatch's input cotangent, (M, rows, ...)
    value: jax.Array  # the objective, summed over the microbatches (on the last stage)
    aux: Any  # the tail's aux of each microbatch, each leaf (M, ...) (on the last stage)


def _loop(tail: Callable, apply: Callable, layout: StageLayout) -> Callable:
    """`(tail params, grouped, micro h, micro batch, consts) -> (objective, aux, (d tail, d grouped, d micro h))`."""
    stages, microbatches, data_axes = layout.stages, layout.pipeline.microbatches, layout.data_axes
    depth = min(2 * stages - 1, microbatches)
    ahead = [(s, s + 1) for s in range(stages - 1)]
    back = [(s + 1, s) for s in range(stages - 1)]
    every = (STAGE_AXIS, *data_axes)
    varying = functools.partial(vary, axes=every)

    def stage_forward(params, h):
        return lax.scan(lambda h, p: (apply(p, h), None), h, params)[0]

    def body(tail_params, grouped, micro_h, micro_batch, consts):
        local = jax.tree.map(lambda a: vary(a[0, 0], data_axes), grouped)  # (layers of the stage, ...)
        tail_local = jax.tree.map(varying, tail_params)  # each device's own copy: its gradient is reduced once
        stage = lax.axis_index(STAGE_AXIS)
        last = stage == stages - 1
        residuals = compat.vjp_residuals(stage_forward, local, varying(micro_h[0]))
        _record(layout, depth, residuals, micro_h[0])

        def tail_and_loss(y, m):
            """The tail and the loss on microbatch m's stage output y, and their backward for a unit cotangent."""
            batch_m = jax.tree.map(lambda a: a[m], micro_batch)
            value, tail_vjp, aux = jax.vjp(lambda p, y: tail(p, y, batch_m, consts), tail_local, y, has_aux=True)
            d_tail, d_y = tail_vjp(jnp.ones_like(value))
            return jax.tree.map(varying, (value, aux, d_tail, d_y))

        tail_shapes = jax.eval_shape(tail_and_loss, varying(micro_h[0]), 0)

        def no_tail(y, m):  # the stages before the last: nothing to run
            return jax.tree.map(lambda s: varying(jnp.zeros(s.shape, s.dtype)), tail_shapes)

        def forward_tick(carry: Carry, t) -> tuple[Carry, jax.Array, jax.Array]:
            """Stage s forwards microbatch t - s: its residuals to the stash, its output to the next stage."""
            m = t - stage
            valid = (m >= 0) & (m < microbatches)
            m = jnp.clip(m, 0, microbatches - 1)
            h = jnp.where(stage == 0, micro_h[m], carry.from_prev)
            y, vjp = jax.vjp(stage_forward, local, h)
            stash = carry.stash.put(m % depth, residuals.kept(vjp), valid)
            sent = lax.ppermute(y, STAGE_AXIS, ahead)
            return carry._replace(from_prev=sent, stash=stash), y, m

        def loss_tick(carry: Carry, y, m) -> tuple[Carry, jax.Array]:
            """The last stage runs the tail and the loss on microbatch m, just forwarded: its output's cotangent."""
            value, aux, d_tail, d_y = lax.cond(last, tail_and_loss, no_tail, y, m)
            carry = carry._replace(
                d_tail=jax.tree.map(jnp.add, carry.d_tail, d_tail),
                value=carry.value + value,
                aux=jax.tree.map(
                    lambda buf, a: lax.dynamic_update_index_in_dim(buf, a.astype(buf.dtype), m, 0), carry.aux, aux
                ),
            )
            return carry, jnp.where(last, d_y.astype(carry.from_next.dtype), carry.from_next)

        def backward_tick(carry: Carry, t, cotangent) -> Carry:
            """Stage s backwards microbatch t - (2P - 2 - s): its input's cotangent to the previous stage."""
            m = t - (2 * stages - 2 - stage)
            valid = (m >= 0) & (m < microbatches)
            m = jnp.clip(m, 0, microbatches - 1)
            d_params, d_h = residuals.rebuild(local, carry.stash.take(m % depth))(cotangent)
            d_stage = jax.tree.map(lambda g, d: g + jnp.where(valid, d, jnp.zeros_like(d)), carry.d_stage, d_params)
            keep = (stage == 0) & valid
            d_input = lax.dynamic_update_index_in_dim(carry.d_input, jnp.where(keep, d_h, carry.d_input[m]), m, 0)
            sent = lax.ppermute(d_h, STAGE_AXIS, back)
            return carry._replace(from_next=sent, d_stage=d_stage, d_input=d_input)

        def warm_up(carry, t):
            return forward_tick(carry, t)[0], None

        def steady(carry, t):
            carry, y, m = forward_tick(carry, t)
            carry, cotangent = loss_tick(carry, y, m)
            return backward_tick(carry, t, cotangent), None

        def cool_down(carry, t):
            return backward_tick(carry, t, carry.from_next), None

        value0, aux0 = tail_shapes[:2]
        zero = varying(jnp.zeros_like(micro_h[0]))
        carry = Carry(
            from_prev=zero,
            from_next=zero,
            stash=Stash.empty(residuals.kept_shapes, depth, varying),
            d_stage=jax.tree.map(jnp.zeros_like, local),
            d_tail=jax.tree.map(jnp.zeros_like, tail_local),
            d_input=varying(jnp.zeros_like(micro_h)),
            value=varying(jnp.zeros(value0.shape, value0.dtype)),
            aux=jax.tree.map(lambda a: varying(jnp.zeros((microbatches, *a.shape), a.dtype)), aux0),
        )
        warm = stages - 1
        for phase, start, length in (
            (warm_up, 0, warm),
            (steady, warm, microbatches),
            (cool_down, warm + microbatches, warm),
        ):
            if length:
                carry, _ = lax.scan(phase, carry, start + jnp.arange(length))
        d_stage, d_tail, d_input, value, aux = carry.d_stage, carry.d_tail, carry.d_input, carry.value, carry.aux
        if data_axes:  # each data shard summed its rows' gradient over the ticks: reduce once
            d_stage = lax.psum(d_stage, data_axes)
        d_tail = lax.psum(d_tail, every)  # only the last stage's is not zero
        d_input = lax.psum(jnp.where(stage == 0, d_input, jnp.zeros_like(d_input)), STAGE_AXIS)
        value = lax.psum(value, every)
        aux = jax.tree.map(lambda a: lax.psum(a, every if a.ndim == 1 else STAGE_AXIS), aux)
        return value, aux, (d_tail, jax.tree.map(lambda g: g[None, None], d_stage), d_input)

    rows = P(None, data_axes or None)

    def run(tail_params, grouped, micro_h, micro_batch, consts):
        aux_specs = jax.tree.map(
            lambda a: P() if a.ndim == 1 else rows,
            jax.eval_shape(lambda: _aux_shape(tail, tail_params, micro_h, micro_batch, consts, microbatches)),
        )
        replicated = jax.tree.map(lambda _: P(), tail_params)
        mapped = jax.shard_map(
            body,
            mesh=layout.mesh,
            in_specs=(
                replicated,
                P(STAGE_AXIS),
                rows,
                jax.tree.map(lambda _: rows, micro_batch),
                jax.tree.map(lambda _: P(), consts),
            ),
            out_specs=(P(), aux_specs, (replicated, P(STAGE_AXIS), rows)),
            axis_names={STAGE_AXIS, *data_axes},
        )
        return mapped(tail_params, grouped, micro_h, micro_batch, consts)

    return run


def _record(layout: StageLayout, depth: int, residuals: compat.VjpResiduals, h: jax.Array) -> None:
    """Records the loop's `ScheduleCost` where a recording is open: P - 1 + M ticks forward and M + P - 1 backward,
    each sending one microbatch's activation or its cotangent; a stash of `depth` slots of `residuals.kept_shapes`."""
    if not schedule_costs.active():
        return
    pipeline, share = layout.pipeline, schedule_costs.share(layout)
    ticks = pipeline.ticks(layout.stages)
    schedule_costs.record(
        schedule_costs.ScheduleCost(
            schedule="1f1b",
            stages=layout.stages,
            microbatches=pipeline.microbatches,
            repeats=1,
            forward_ticks=ticks,
            backward_ticks=ticks,
            depth=depth,
            send_bytes=schedule_costs.nbytes(h) // share,
            pass_residual_bytes=schedule_costs.nbytes(residuals.kept_shapes) // share,
        )
    )


def _aux_shape(tail, tail_params, micro_h, micro_batch, consts, microbatches):
    """The aux of the tail on one microbatch, stacked over the microbatches (shapes only)."""
    batch_m = jax.tree.map(lambda a: a[0], micro_batch)
    _, aux = tail(tail_params, micro_h[0], batch_m, consts)
    return jax.tree.map(lambda a: jnp.zeros((microbatches, *a.shape), a.dtype), aux)


def _at(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _with(tree: dict, path: tuple, value: Any) -> dict:
    """A copy of the nested dict `tree` with `value` at `path` (the dicts along the path copied)."""
    if not path:
        return value
    out = dict(tree)
    out[path[0]] = _with(tree.get(path[0], {}), path[1:], value)
    return out


def _without(tree: dict, path: tuple) -> dict:
    """A copy of `tree` without the entry at `path`."""
    out = dict(tree)
    if len(path) == 1:
        out.pop(path[0])
    else:
        out[path[0]] = _without(tree[path[0]], path[1:])
    return out
