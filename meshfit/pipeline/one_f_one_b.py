"""The "1f1b" training step: the loss inside the pipeline's last stage, a forward and a backward each tick.

With the loss outside the pipeline no cotangent exists until every output
does, so the backward could only start after a whole forward pass. Here the
last stage runs the rest of the model (the tail: every layer after `Stages`,
e.g. a norm and a head) and the loss on each microbatch as soon as the
microbatch leaves the stack, and starts its backward in the same tick.

A strategy that trains on this schedule hands the built-in train step
`pipelined_objective(module, layout)`; the step calls it with its objective,
which is computed so:

* capture: the module runs once with `Stages` in capture mode (`capture.py`),
  which records the stack's input h and blocks and returns h; the rest of
  that pass is traced but unused (XLA drops it);
* the loop, inside `jax.shard_map` over the stage (and whole-copy data) axes,
  in three phases: P - 1 warm-up ticks of forward only, M ticks of forward and
  backward, P - 1 cool-down ticks of backward only. Stage s forwards microbatch
  t - s and backwards microbatch t - (2P - 2 - s); the last stage runs the
  tail and the loss (`jax.vjp`) on the microbatch it has just forwarded and
  sends the cotangent back in the same tick;
* each forward's `jax.vjp` residuals (the function `jax.vjp` returns is a
  pytree) wait in a ring of min(2P - 1, M) slots until that microbatch's
  backward: nothing is recomputed. A stage keeps at most 2P - 1 microbatches'
  residuals, whatever M.

With F one microbatch's forward through a stage, a stage runs
(P - 1) F + 3 M F + (P - 1) 2F = 3 (M + P - 1) F: its idle share is the GPipe
bubble, (P - 1) / (M + P - 1), plus the tail's own work (the last stage's,
run in lockstep by all). The objective's gradient comes out of the loop
whole (for a unit cotangent; a custom VJP scales it), so the step's
`jax.grad` carries only the input's cotangent back through the layers before
`Stages`. Each data shard sums its gradients over the ticks; the shards
reduce them once, after the loop.

The tail runs per microbatch, so its rows must be independent (Dense,
LayerNorm, embedding heads are); the objective must be a sum over rows (one
loss's weighted total, or losses reduced by "sum"); the tail must not update
module state (BatchNorm statistics, dropout streams). The built-in train
step (`meshfit.steps.builtin`) refuses the rest before any step runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from meshfit.pipeline import capture, schedules
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


def _loop(tail: Callable, apply: Callable, layout: StageLayout) -> Callable:
    """`(tail params, grouped, micro h, micro batch, consts) -> (objective, aux, (d tail, d grouped, d micro h))`."""
    stages, microbatches, data_axes = layout.stages, layout.pipeline.microbatches, layout.data_axes
    # Stage s keeps a microbatch's residuals from its forward tick to its backward tick, 2(P - 1 - s) later.
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
        by_id = {id(leaf): leaf for leaf in jax.tree.leaves(local)}  # residuals that are the stage's parameters

        def residuals(h):
            y, vjp = jax.vjp(stage_forward, local, h)
            return y, jax.tree.leaves(vjp)

        probe: dict = {}

        def shapes(h):  # the residuals' tree (static) and which of its leaves are the stage's parameters
            _, vjp = jax.vjp(stage_forward, local, h)
            leaves, probe["treedef"] = jax.tree.flatten(vjp)
            probe["params"] = [by_id.get(id(leaf)) for leaf in leaves]
            return leaves

        leaves0 = jax.eval_shape(lambda: shapes(varying(micro_h[0])))
        treedef, params = probe["treedef"], probe["params"]  # params: the parameter a leaf is, or None
        is_param = [p is not None for p in params]

        def tail_on(y, m):
            batch_m = jax.tree.map(lambda a: a[m], micro_batch)
            return jax.vjp(lambda p, y: tail(p, y, batch_m, consts), tail_local, y, has_aux=True)

        value0, aux0 = jax.eval_shape(
            lambda: tail(tail_local, micro_h[0], jax.tree.map(lambda a: a[0], micro_batch), consts)
        )

        def tick(forward: bool, backward: bool):
            def run(carry, t):
                from_prev, from_next, stash, d_stage, d_tail, d_micro, value, aux = carry
                mf = t - stage
                mf_c = jnp.clip(mf, 0, microbatches - 1)
                sent_ahead = sent_back = None
                if forward:  # microbatch t - s: its residuals to the stash, its output on
                    f_valid = (mf >= 0) & (mf < microbatches)
                    h = jnp.where(stage == 0, micro_h[mf_c], from_prev)
                    y, leaves = residuals(h)
                    slot = mf_c % depth
                    stash = [
                        s if p else lax.dynamic_update_index_in_dim(s, jnp.where(f_valid, leaf, s[slot]), slot, 0)
                        for s, leaf, p in zip(stash, leaves, is_param, strict=True)
                    ]
                    sent_ahead = lax.ppermute(y, STAGE_AXIS, ahead)
                if backward:  # microbatch t - (2P - 2 - s), cotangent from the next stage (the loss, on the last)
                    mb = t - (2 * stages - 2 - stage)
                    b_valid = (mb >= 0) & (mb < microbatches)
                    mb_c = jnp.clip(mb, 0, microbatches - 1)
                    ct = from_next
                    if forward:  # the last stage forwarded microbatch mb this tick: the tail and the loss on it
                        v, tail_vjp, a = tail_on(y, mf_c)
                        dt, dy = tail_vjp(jnp.ones_like(v))
                        ct = jnp.where(last, dy.astype(ct.dtype), ct)
                        d_tail = jax.tree.map(lambda g, d: g + jnp.where(last, d, jnp.zeros_like(d)), d_tail, dt)
                        value = value + jnp.where(last, v, jnp.zeros_like(v))
                        aux = jax.tree.map(
                            lambda buf, x: lax.dynamic_update_index_in_dim(
                                buf, jnp.where(last, x.astype(buf.dtype), buf[mf_c]), mf_c, 0
                            ),
                            aux,
                            a,
                        )
                    slot = mb_c % depth
                    leaves = [s[slot] if p is None else p for s, p in zip(stash, params, strict=True)]
                    d_params, d_h = jax.tree.unflatten(treedef, leaves)(ct)
                    d_stage = jax.tree.map(lambda g, d: g + jnp.where(b_valid, d, jnp.zeros_like(d)), d_stage, d_params)
                    keep = (stage == 0) & b_valid
                    d_micro = lax.dynamic_update_index_in_dim(d_micro, jnp.where(keep, d_h, d_micro[mb_c]), mb_c, 0)
                    sent_back = lax.ppermute(d_h, STAGE_AXIS, back)
                from_prev = from_prev if sent_ahead is None else sent_ahead
                from_next = from_next if sent_back is None else sent_back
                return (from_prev, from_next, stash, d_stage, d_tail, d_micro, value, aux), None

            return run

        zero = varying(jnp.zeros_like(micro_h[0]))
        stash = [
            jnp.zeros((), leaf.dtype) if p else varying(jnp.zeros((depth, *leaf.shape), leaf.dtype))
            for leaf, p in zip(leaves0, is_param, strict=True)
        ]
        carry = (
            zero,
            zero,
            stash,
            jax.tree.map(jnp.zeros_like, local),
            jax.tree.map(jnp.zeros_like, tail_local),
            varying(jnp.zeros_like(micro_h)),
            varying(jnp.zeros(value0.shape, value0.dtype)),
            jax.tree.map(lambda a: varying(jnp.zeros((microbatches, *a.shape), a.dtype)), aux0),
        )
        warm, full = stages - 1, microbatches
        for start, length, forward, backward in (
            (0, warm, True, False),
            (warm, full, True, True),
            (warm + full, warm, False, True),
        ):
            if length:
                carry, _ = lax.scan(tick(forward, backward), carry, start + jnp.arange(length))
        _, _, _, d_stage, d_tail, d_micro, value, aux = carry
        if data_axes:  # each data shard summed its rows' gradient over the ticks: reduce once
            d_stage = lax.psum(d_stage, data_axes)
        d_tail = lax.psum(d_tail, every)  # only the last stage's is not zero
        d_micro = lax.psum(jnp.where(stage == 0, d_micro, jnp.zeros_like(d_micro)), STAGE_AXIS)
        value = lax.psum(value, every)
        aux = jax.tree.map(lambda a: lax.psum(a, every if a.ndim == 1 else STAGE_AXIS), aux)
        return value, aux, (d_tail, jax.tree.map(lambda g: g[None, None], d_stage), d_micro)

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
