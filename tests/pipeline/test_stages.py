"""Stages: one scan without a `stage` axis, pipelined under one; every schedule equals one device; errors first."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ResidualBlock, assert_trees_close, classification_data

import meshfit as mf
from meshfit.pipeline import Stages

LAYERS = 8


class Net(nnx.Module):
    """Embedding and head outside the pipeline, `layers` blocks inside it."""

    def __init__(self, layers=LAYERS, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Linear(8, 16, rngs=rngs)
        self.body = Stages(ResidualBlock, layers, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(self.embed(x)))


def train(strategy, layers=LAYERS, steps=3, batch_size=16, model=None):
    x, y = classification_data(n=steps * batch_size, din=8, classes=4)
    with strategy.scope():
        model = mf.Model(model or (lambda: Net(layers)))
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
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


def test_stages_run_the_blocks_in_order_as_one_scan():
    net = Net(layers=3)
    x = jnp.asarray(classification_data(n=5, din=8)[0])
    h = net.embed(x)
    expected = h
    for layer in range(3):
        block = ResidualBlock(nnx.Rngs(0))
        nnx.update(block, jax.tree.map(lambda a, i=layer: a[i], nnx.state(net.body.blocks)))
        expected = block(expected)
    np.testing.assert_allclose(net.body(h), expected, rtol=1e-6)


@pytest.mark.slow
def test_the_same_model_trains_without_a_stage_axis(reference):
    one, h_one = reference
    model, history = train(mf.strategies.MeshStrategy(axes={"data": 4, "fsdp": 2}, min_shard_size=1))
    assert_trees_close(one.params, model.params, rtol=2e-5, atol=2e-6)
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
    assert_trees_close(one.params, model.params, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(h_one.history["loss"], history.history["loss"], rtol=1e-5)
    # Each stage's devices hold only that stage's layers (and Adam's moments follow them).
    mesh = strategy.mesh
    stage_of = {d: int(np.argwhere(mesh.devices == d)[0][0]) for d in mesh.devices.flat}
    per_stage = LAYERS // 4
    for leaf in jax.tree.leaves(model.session.state.params["body"]):
        assert leaf.sharding.spec[0] == "stage"
        for shard in leaf.addressable_shards:
            stage = stage_of[shard.device]
            assert shard.data.shape[0] == per_stage
            assert shard.index[0] == slice(stage * per_stage, (stage + 1) * per_stage)
    assert model.params["embed"]["kernel"].sharding.spec == jax.sharding.PartitionSpec()


def test_layers_that_do_not_split_over_the_stages_are_refused_before_any_step():
    with pytest.raises(ValueError, match=r"holds 6 layers, which do not split over 4 stages"):
        train(pipelined(), layers=6)
    with pytest.raises(ValueError, match=r"holds 4 layers, which do not split over stages x repeats = 4 x 2"):
        train(pipelined("circular", repeats=2), layers=4)


def test_a_stage_axis_without_stages_is_refused():
    with pytest.raises(ValueError, match=r"'stage' axis of size 4, but no parameter of the model lies on it"):
        train(pipelined(), model=lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0)))


def test_a_batch_that_does_not_cut_into_microbatches_is_refused():
    net = Net()
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
            model = mf.load_model(tmp_path / "model", lambda: Net())
        assert_trees_close(saved.params, model.params, rtol=0, atol=0)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        restored[name] = model
    kernel = restored["circular"].session.state.params["body"]["blocks"]["up"]["kernel"]
    assert kernel.sharding.spec[0] == "stage" and kernel.addressable_shards[0].data.shape[0] == LAYERS // 2
    assert_trees_close(restored["one"].params, restored["circular"].params, rtol=2e-5, atol=2e-6)


class PinnedBlock(ResidualBlock):
    """A ResidualBlock that pins its activations to the batch axes, as a model's blocks do under a mesh."""

    def __call__(self, x):
        return mf.strategies.constrain(super().__call__(x), "data", None)


def test_blocks_that_constrain_their_activations_run_inside_the_stage_loop():
    """`constrain` inside a stage's loop pins on the mesh the loop sees (its stage axis manual)."""
    net = Net()
    pinned = nnx.merge(nnx.graphdef(Stages(PinnedBlock, LAYERS, rngs=nnx.Rngs(0))), nnx.state(net.body))
    h = jnp.asarray(classification_data(n=16, din=16)[0])
    with pipelined(microbatches=2).scope():
        out = jax.jit(lambda h: pinned(h))(h)
    np.testing.assert_allclose(out, net.body(h), rtol=1e-5, atol=1e-6)
