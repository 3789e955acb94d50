"""Each pipelined loop says its own costs while a step is traced (`meshfit.pipeline.schedule_costs`): its ticks,
depth, point-to-point bytes and kept activations, against the formulas from the model's shapes."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import ResidualBlock

import meshfit as mf
from meshfit.pipeline import Stages, one_f_one_b, schedule_costs

WIDTH, HIDDEN, LAYERS = 16, 32, 8  # ResidualBlock: 16 features through 32 (tanh) and back, float32
STAGES, DATA, MICRO, ROWS = 4, 2, 8, 64
F32 = 4


def traced_costs(axes, pipeline):
    """The `ScheduleCost`s recorded while `jax.grad` of a loss through a `Stages` stack on `axes` is traced
    (for 1f1b, the fused loop with the loss inside the last stage, as the built-in train step runs it)."""
    strategy = mf.strategies.MeshStrategy(axes=axes, pipeline=pipeline)
    with strategy.scope():
        graphdef, params = nnx.split(Stages(ResidualBlock, LAYERS, rngs=nnx.Rngs(0)))
        x = jnp.ones((ROWS, WIDTH))

        def forward(params, x):
            return nnx.merge(graphdef, params)(x)

        def loss(params, x):
            if pipeline is None or pipeline.schedule != "1f1b":
                return jnp.mean(forward(params, x) ** 2)
            parts = lambda tree, x, _: (jnp.sum(forward(tree["stack"], x) ** 2) / x.size, ())  # noqa: E731
            tree = {"stack": nnx.to_pure_dict(params)}
            return one_f_one_b.objective(parts, tree, x, (), ("stack",), strategy.stage_layout)[0]

        with schedule_costs.recording() as found:
            jax.make_jaxpr(jax.grad(loss))(params, x)
    return found


@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("circular", 2), ("1f1b", 1)])
def test_each_schedule_reports_its_depth_sends_and_kept_activations(schedule, repeats):
    pipeline = mf.strategies.Pipeline(microbatches=MICRO, schedule=schedule, repeats=repeats)
    (cost,) = traced_costs({"stage": STAGES, "data": DATA}, pipeline)
    rows = ROWS // (DATA * MICRO)  # a microbatch's rows on one device: 4
    ticks = repeats * MICRO + STAGES - 1  # 11 (gpipe, 1f1b), 19 (circular)
    send = rows * WIDTH * F32  # one microbatch's activation (or its cotangent)
    layers = LAYERS // (STAGES * repeats)  # a stage's layers of one round: 2, or 1 under circular
    if schedule == "circular":  # its jax.checkpoint saves the round's input and each block's matmul outputs
        one_pass = rows * (WIDTH + layers * (HIDDEN + WIDTH)) * F32
    else:  # each block's input, tanh's output and its derivative
        one_pass = layers * rows * (WIDTH + HIDDEN + HIDDEN) * F32
    depth = min(2 * STAGES - 1, MICRO) if schedule == "1f1b" else ticks  # the stash's slots: 7; every forward tick

    assert (cost.schedule, cost.stages, cost.microbatches, cost.repeats) == (schedule, STAGES, MICRO, repeats)
    assert (cost.forward_ticks, cost.backward_ticks) == (ticks, ticks)
    assert cost.send_bytes == send
    assert cost.p2p_bytes == 2 * ticks * send
    assert cost.depth == depth
    assert cost.pass_residual_bytes == one_pass
    assert cost.activation_bytes == depth * one_pass
    assert cost.bubble == pytest.approx(pipeline.bubble(STAGES))


def test_rows_on_a_replica_axis_left_to_the_compiler_count_by_each_devices_share():
    """Along `fsdp` a stage's parameters are split, so its loop sees the rows of both fsdp replicas: a device
    holds half of them, as it does of a microbatch on `data`, which the loop runs manual over."""
    pipeline = mf.strategies.Pipeline(microbatches=MICRO)
    (on_data,) = traced_costs({"stage": STAGES, "data": DATA}, pipeline)
    (on_fsdp,) = traced_costs({"stage": STAGES, "fsdp": DATA}, pipeline)
    assert on_fsdp == on_data


@pytest.mark.parametrize("axes", [{"data": 8}, {"fsdp": 8}])
def test_a_step_without_a_stage_axis_records_nothing(axes):
    assert traced_costs(axes, None) == []


def test_nothing_is_recorded_outside_a_recording():
    schedule_costs.record(schedule_costs.ScheduleCost("gpipe", 4, 8, 1, 11, 11, 11, 256, 2560))
    with schedule_costs.recording() as found:
        assert schedule_costs.active()
    assert found == [] and not schedule_costs.active()
