"""Stages: one scan without a `stage` axis, pipelined under one; every schedule equals one device; errors first."""

import os
import signal
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import PIPELINE_TOLERANCE, ResidualBlock, StagedNet, assert_trees_close, classification_data
from processes import run

import meshfit as mf
from meshfit.pipeline import Stages

LAYERS = 8


def train(strategy, layers=LAYERS, steps=3, batch_size=16, model=None, **settings):
    x, y = classification_data(n=steps * batch_size, din=8, classes=4)
    with strategy.scope():
        model = mf.Model(model or (lambda: StagedNet(layers)))
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), **settings)
    history = model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
    return model, history


def pipelined(schedule="gpipe", repeats=1, microbatches=4, stages=4):
    return mf.strategies.MeshStrategy(
        axes={"stage": stages, "data": 8 // stages},
        pipeline=mf.strategies.Pipeline(microbatches=microbatches, schedule=schedule, repeats=repeats),
    )


@pytest.fixture(scope="module")
def reference():
    return train(mf.strategies.OneDeviceStrategy())


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_stages_run_the_blocks_in_order_as_one_scan():
    net = StagedNet(layers=3)
    x = jnp.asarray(classification_data(n=5, din=8)[0])
    h = net.embed(x)
    expected = h
    for layer in range(3):
        block = ResidualBlock(nnx.Rngs(0))
        nnx.update(block, jax.tree.map(lambda a, i=layer: a[i], nnx.state(net.body.blocks)))
        expected = block(expected)
    np.testing.assert_allclose(net.body(h), expected, rtol=1e-6, atol=1e-6)  # one scan against three calls


class KeywordBlock(nnx.Module):
    """A block written as Flax modules are: `rngs` keyword-only."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


def test_stages_builds_a_block_whose_rngs_is_keyword_only():
    """`Stages(Block, ...)` passes `rngs=` by keyword, so a block written the Flax way is taken as it is."""
    stack = Stages(KeywordBlock, 4, rngs=nnx.Rngs(0))
    assert stack.blocks.linear.kernel.shape == (4, 16, 16)
    assert stack(jnp.ones((2, 16))).shape == (2, 16)


@pytest.mark.slow
def test_the_same_model_trains_without_a_stage_axis(reference):
    one, h_one = reference
    model, history = train(mf.strategies.MeshStrategy(axes={"data": 4, "fsdp": 2}, min_shard_size=1))
    assert_trees_close(one.params, model.params, **PIPELINE_TOLERANCE)
    np.testing.assert_allclose(h_one.history["loss"], history.history["loss"], rtol=1e-5)


@pytest.mark.parametrize(
    "schedule, repeats, microbatches", [("gpipe", 1, 4), ("circular", 2, 4), ("1f1b", 1, 4), ("1f1b", 1, 8)]
)
@pytest.mark.slow
def test_pipelined_training_equals_one_device(reference, schedule, repeats, microbatches):
    one, h_one = reference
    strategy = pipelined(schedule, repeats, microbatches)
    model, history = train(strategy)
    assert int(model.session.state.step) == 3
    assert_trees_close(one.params, model.params, **PIPELINE_TOLERANCE)
    np.testing.assert_allclose(h_one.history["loss"], history.history["loss"], rtol=1e-5)
    # Each stage's devices hold only that stage's layers (and Adam's moments follow them).
    mesh = strategy.mesh
    stage_of = {d: int(np.argwhere(mesh.devices == d)[0][0]) for d in mesh.devices.flat}
    # Circular stores them repeat-major, (repeats, layers / repeats, ...), split on the second axis.
    axis, rows = (1, LAYERS // 4 // repeats) if repeats > 1 else (0, LAYERS // 4)
    for leaf in jax.tree.leaves(model.session.state.params["body"]):
        assert leaf.sharding.spec[axis] == "stage"
        for shard in leaf.addressable_shards:
            stage = stage_of[shard.device]
            assert shard.data.shape[axis] == rows
            assert shard.index[axis] == slice(stage * rows, (stage + 1) * rows)
    assert model.params["embed"]["kernel"].sharding.spec == jax.sharding.PartitionSpec()


ACCUMULATED = dict(steps_per_execution=2, gradient_accumulation_steps=2)


@pytest.fixture(scope="module")
def accumulated_reference():
    return train(mf.strategies.OneDeviceStrategy(), steps=8, **ACCUMULATED)


@pytest.mark.parametrize("schedule, repeats", [("gpipe", 1), ("circular", 2), ("1f1b", 1)])
@pytest.mark.slow
def test_steps_per_execution_and_accumulation_train_as_on_one_device(accumulated_reference, schedule, repeats):
    """Two steps per call, two batches per optimizer update: the pipelined run equals one device's."""
    one, h_one = accumulated_reference
    model, history = train(pipelined(schedule, repeats), steps=8, **ACCUMULATED)
    assert int(model.session.state.step) == 8  # a step per batch; the optimizer updates every 2
    assert_trees_close(one.params, model.params, **PIPELINE_TOLERANCE)
    np.testing.assert_allclose(h_one.history["loss"], history.history["loss"], rtol=1e-5)


@pytest.mark.slow
def test_a_dtype_policy_trains_as_on_one_device():
    """mixed_bfloat16 under 1f1b (the layers after Stages run in the last stage): float32 weights, and one
    device's run to bfloat16's precision (the stages compute each microbatch's rows as one device computes them,
    and sum the microbatches' gradients in another order)."""
    policy = dict(ACCUMULATED, dtype_policy="mixed_bfloat16")
    one, h_one = train(mf.strategies.OneDeviceStrategy(), steps=8, **policy)
    model, history = train(pipelined("1f1b"), steps=8, **policy)
    assert model.params["body"]["blocks"]["up"]["kernel"].dtype == jnp.float32
    # Adam moves a parameter by about its learning rate (1e-3) an update whatever the gradient's size, so a
    # near-zero gradient rounded otherwise in bfloat16 can move it by up to that, 4 updates: atol 4e-3.
    assert_trees_close(one.params, model.params, rtol=1e-2, atol=4e-3)
    np.testing.assert_allclose(h_one.history["loss"], history.history["loss"], rtol=1e-2)


RESUMABLE = textwrap.dedent(
    """
    import os, signal, sys
    import jax
    import numpy as np
    from helpers import StagedNet, classification_data
    import meshfit as mf
    out, backup, die_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    x, y = classification_data(n=96, din=8, classes=4)
    pipeline = mf.strategies.Pipeline(microbatches=4, schedule="1f1b")
    with mf.strategies.MeshStrategy(axes={"stage": 4, "data": 2}, pipeline=pipeline).scope():
        model = mf.Model(lambda: StagedNet(), seed=0)
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Die(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if model.session.step == die_at:
                jax.block_until_ready(self.context.latest)  # a step that exists, not one only dispatched
                os.kill(os.getpid(), signal.SIGKILL)

    backup = mf.callbacks.BackupAndRestore(backup, save_freq=2)
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[backup, Die()])
    np.savez(out, *model.get_weights(), loss=history.history["loss"])
    """
)


@pytest.mark.slow
@pytest.mark.processes
def test_a_sigkilled_pipelined_run_resumes_bitwise(tmp_path):
    """1f1b over stage=4 x data=2 with backups every 2 steps, SIGKILLed at step 9 of 18: the rerun resumes
    from the newest backup and ends with the uninterrupted run's weights and losses, bitwise."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}

    def fit(name, die_at):
        return run(
            [sys.executable, "-c", RESUMABLE, str(tmp_path / f"{name}.npz"), str(tmp_path / name), str(die_at)],
            timeout=300,
            env=env,
        )

    with ThreadPoolExecutor(2) as pool:  # the uninterrupted run beside the one killed
        uninterrupted, killed = pool.map(fit, ["whole", "killed"], [-1, 9])
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = fit("killed", -1)
    assert resumed.returncode == 0 and "BackupAndRestore: resumed" in resumed.stdout, resumed.stderr[-3000:]
    expected, got = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "killed.npz")
    assert expected.files == got.files
    for key in expected.files:
        np.testing.assert_array_equal(got[key], expected[key])


def test_layers_that_do_not_split_over_the_stages_are_refused_before_any_step():
    with pytest.raises(ValueError, match=r"holds 6 layers, which do not split over 4 stages"):
        train(pipelined(), layers=6)
    with pytest.raises(ValueError, match=r"holds 4 layers, which do not split over stages x repeats = 4 x 2"):
        train(pipelined("circular", repeats=2), layers=4)


def test_a_stage_axis_without_stages_is_refused():
    with pytest.raises(ValueError, match=r"'stage' axis of size 4, but no parameter of the model lies on it"):
        train(pipelined(), model=lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0)))


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_a_batch_that_does_not_cut_into_microbatches_is_refused():
    net = StagedNet()
    x = jnp.ones((12, 16))  # 2 data replicas x 4 microbatches need a multiple of 8 rows
    with pipelined().scope(), pytest.raises(ValueError, match=r"rows must divide by 8. Received a batch of 12"):
        net.body(x)


def test_pipeline_settings_are_checked():
    with pytest.raises(ValueError, match=r"`schedule` must be one of \('gpipe', 'circular', '1f1b'\)"):
        mf.strategies.Pipeline(microbatches=4, schedule="zero-bubble")
    with pytest.raises(ValueError, match=r"`repeats` > 1 needs schedule='circular'"):
        mf.strategies.Pipeline(microbatches=4, repeats=2)
    with pytest.raises(ValueError, match=r"at least as many microbatches as stages \(4\)"):
        pipelined("circular", repeats=2, microbatches=2)
    with pytest.raises(ValueError, match=r"`pipeline` needs a 'stage' mesh axis"):
        mf.strategies.MeshStrategy(axes={"data": 8}, pipeline=mf.strategies.Pipeline(microbatches=2))


@pytest.mark.parametrize("microbatches", [True, False, 4.0, "4", 0, -2, None])
def test_microbatches_that_is_not_a_positive_int_is_refused_naming_what_came(microbatches):
    received = f"Received: microbatches={microbatches!r} ({type(microbatches).__name__})."
    with pytest.raises(ValueError, match=r"Pipeline `microbatches` must be a positive int") as refusal:
        mf.strategies.Pipeline(microbatches=microbatches)
    assert received in str(refusal.value)
    with pytest.raises(ValueError, match=r"`repeats` must be a positive int .* Received: repeats=True \(bool\)"):
        mf.strategies.Pipeline(microbatches=4, schedule="circular", repeats=True)


def test_the_batch_is_padded_to_whole_microbatches_per_replica():
    assert pipelined(microbatches=4).batch_multiple == 2 * 4
    assert mf.strategies.Pipeline(microbatches=8, schedule="circular", repeats=2).bubble(4) == pytest.approx(3 / 19)


@pytest.mark.slow
def test_a_checkpoint_restores_under_another_pipeline_layout_and_on_one_device(tmp_path):
    saved, _ = train(pipelined("gpipe"))
    saved.save(tmp_path / "model")
    x, y = classification_data(n=32, din=8, classes=4, seed=1)
    restored = {}
    for name, strategy in [
        ("one", mf.strategies.OneDeviceStrategy()),
        ("circular", pipelined("circular", repeats=2, microbatches=2, stages=2)),
    ]:
        with strategy.scope():
            model = mf.load_model(tmp_path / "model", lambda: StagedNet())
        assert_trees_close(saved.params, model.params, rtol=0, atol=0)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        restored[name] = model
    kernel = restored["circular"].session.state.params["body"]["blocks"]["up"]["kernel"]
    assert kernel.sharding.spec[:2] == (None, "stage")  # repeat-major: a stage's 4 layers, 2 in each round
    assert kernel.addressable_shards[0].data.shape[:2] == (2, LAYERS // 4)
    assert_trees_close(restored["one"].params, restored["circular"].params, **PIPELINE_TOLERANCE)


class PinnedBlock(ResidualBlock):
    """A ResidualBlock that pins its activations to the batch axes, as a model's blocks do under a mesh."""

    def __call__(self, x):
        return mf.strategies.constrain(super().__call__(x), "data", None)


def test_blocks_that_constrain_their_activations_run_inside_the_stage_loop():
    """`constrain` inside a stage's loop pins on the mesh the loop sees (its stage axis manual)."""
    net = StagedNet()
    pinned = nnx.merge(nnx.graphdef(Stages(PinnedBlock, LAYERS, rngs=nnx.Rngs(0))), nnx.state(net.body))
    h = jnp.asarray(classification_data(n=16, din=16)[0])
    with pipelined(microbatches=2).scope():
        out = jax.jit(lambda h: pinned(h))(h)
    np.testing.assert_allclose(out, net.body(h), rtol=1e-5, atol=1e-6)
