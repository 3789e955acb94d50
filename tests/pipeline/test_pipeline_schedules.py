"""The pipelined loop's cost: one collective per tick, no per-tick parameter copies, 1f1b keeps only its input's
cotangent and at most 2P - 1 microbatches' residuals."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import ResidualBlock

import meshfit as mf
from meshfit.pipeline import Stages, one_f_one_b

WIDTH, LAYERS, ROWS = 16, 8, 32  # ResidualBlock maps 16 features to 16 (through 32)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("circular", 2)]


def stack(schedule, repeats):
    """(strategy, forward of (params, x), params laid out by the strategy) of a stage=4 x data=2 stack, M = 8."""
    strategy = mf.strategies.MeshStrategy(
        axes={"stage": 4, "data": 2},
        pipeline=mf.strategies.Pipeline(microbatches=8, schedule=schedule, repeats=repeats),
    )
    with strategy.scope():
        graphdef, params = nnx.split(Stages(ResidualBlock, LAYERS, rngs=nnx.Rngs(0)))
    return strategy, lambda params, x: nnx.merge(graphdef, params)(x), params


def loss_of(strategy, forward):
    """The mean square of the stack's output, as `jax.grad` of a train step sees it: for 1f1b, the fused loop
    with the loss inside the last stage (the parameters as a pure dict)."""
    if strategy.pipeline.schedule != "1f1b":
        return lambda p, x: jnp.mean(forward(p, x) ** 2)

    def loss(params, x):
        parts = lambda tree, x, _: (jnp.sum(forward(tree["stack"], x) ** 2) / x.size, ())  # noqa: E731
        tree = {"stack": nnx.to_pure_dict(params)}
        return one_f_one_b.objective(parts, tree, x, (), ("stack",), strategy.stage_layout)[0]

    return loss


def residual_bytes(strategy, forward, params, rows):
    """Global bytes of what `jax.vjp` of the stack keeps for the backward pass, on `rows` rows."""
    with strategy.scope():
        leaves = jax.eval_shape(
            lambda p, x: jax.tree.leaves(jax.vjp(forward, p, x)[1]), params, jnp.ones((rows, WIDTH))
        )
    return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("schedule, repeats", SCHEDULES)
def test_a_tick_runs_no_collective_but_its_ppermute(schedule, repeats):
    strategy, forward, params = stack(schedule, repeats)
    loss = loss_of(strategy, forward)
    x = jax.device_put(jnp.ones((ROWS, WIDTH)), strategy.batch_sharding())
    with strategy.scope():
        hlo = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
    in_loops = [
        line.split("=", 1)[1][:120]
        for line in hlo.splitlines()
        if re.search(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all)\(", line) and "while/body" in line
    ]
    assert not in_loops, (
        f"collectives inside the tick loop (the data-parallel gradient reduction belongs after it): {in_loops}"
    )
    assert "collective-permute(" in hlo


@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("circular", 2)])
def test_the_stage_parameters_are_kept_once_not_per_tick(schedule, repeats):
    strategy, forward, params = stack(schedule, repeats)
    one, two = (residual_bytes(strategy, forward, params, n * ROWS) for n in (1, 2))
    fixed = one - (two - one)  # what does not grow with the rows: parameters
    param_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    # Each data shard keeps its copy of its stage's parameters (2 shards), plus each tick's indices;
    # a copy of the parameters per tick would be over 20x.
    assert fixed < 3 * param_bytes, f"kept {fixed} parameter bytes for {param_bytes} bytes of parameters"


def test_1f1b_keeps_only_its_inputs_cotangent_and_2p_minus_1_microbatches_residuals():
    strategy, forward, params = stack("1f1b", 1)
    loss = loss_of(strategy, forward)

    def kept(rows):  # what the loss's vjp keeps, and the largest carry of a loop inside it (the stash)
        x = jnp.ones((rows, WIDTH))
        with strategy.scope():
            leaves = jax.eval_shape(lambda p, x: jax.tree.leaves(jax.vjp(loss, p, x)[1]), params, x)
            jaxpr = jax.make_jaxpr(loss)(params, x)
        carries = [
            sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars[eqn.params["num_consts"] :])
            for eqn in _scans(jaxpr.jaxpr)
        ]
        return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves), max(carries)

    (kept_one, carry_one), (kept_two, carry_two) = kept(ROWS), kept(2 * ROWS)
    assert kept_two - kept_one == ROWS * WIDTH * 4  # the input's cotangent: the loop ran forward and backward
    # Inside the loop a device holds its own rows: a microbatch's are ROWS / (M x data) (doubled here).
    rows = ROWS // (8 * 2)
    buffers = (8 + 2) * rows * WIDTH * 4  # the input's cotangent (M microbatches) and the two received buffers
    per_pass = (LAYERS // 4) * rows * (WIDTH + 2 * WIDTH + 2 * WIDTH) * 4  # a block keeps x, up(x), tanh(up(x))
    assert carry_two - carry_one - buffers == 7 * per_pass  # 2P - 1 = 7 microbatches' residuals, whatever M


def _scans(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    yield from _scans(getattr(sub, "jaxpr", sub))
