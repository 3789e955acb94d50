"""A circular pipeline keeps each stage's layers where they run: stored repeat-major, no step moves them, and
weights, checkpoints and backups show and hold the natural layer order under every schedule."""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import PIPELINE_TOLERANCE, StagedNet, assert_trees_close, classification_data

import meshfit as mf
from meshfit.pipeline import Stages

eight_devices = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (simulated on a CPU)")
LAYERS = 8
LOSS = mf.losses.SparseCategoricalCrossentropy(from_logits=True)


def pipelined(schedule="gpipe", repeats=1, microbatches=4, stages=4):
    return mf.strategies.MeshStrategy(
        axes={"stage": stages, "data": 8 // stages},
        pipeline=mf.strategies.Pipeline(microbatches=microbatches, schedule=schedule, repeats=repeats),
    )


def built(strategy, model=None, optimizer="adam"):
    with strategy.scope():
        model = mf.Model(model or (lambda: StagedNet(LAYERS)))
        model.compile(optimizer=optimizer, loss=LOSS)
    return model


def fitted(strategy, steps=3, **fit):
    model = built(strategy)
    x, y = classification_data(n=steps * 16, din=8, classes=4)
    model.fit(x, y, batch_size=16, epochs=fit.pop("epochs", 1), verbose=0, shuffle=False, **fit)
    return model


@eight_devices
def test_each_stage_holds_the_blocks_it_runs_in_every_round():
    """stage=4, repeats=2: stage s runs layers s and 4 + s, and its devices hold exactly those (Adam's moments
    too); the weights a user reads are the natural stack, equal to one device's."""
    model = built(pipelined("circular", repeats=2))
    one = built(mf.strategies.OneDeviceStrategy())
    mesh = model.strategy.mesh
    stage_of = {d: int(np.argwhere(mesh.devices == d)[0][0]) for d in mesh.devices.flat}
    state = model.session.state
    stored = state.params["body"]["blocks"]["up"]["kernel"]
    assert stored.shape == (2, LAYERS // 2, 16, 32) and stored.sharding.spec[:2] == (None, "stage")
    natural = np.asarray(one.params["body"]["blocks"]["up"]["kernel"])
    for shard in stored.addressable_shards:
        stage = stage_of[shard.device]
        assert shard.data.shape == (2, 1, 16, 32)
        # (initialised by another compiled program than one device's: equal to rounding)
        np.testing.assert_allclose(np.asarray(shard.data)[:, 0], natural[[stage, 4 + stage]], rtol=1e-6, atol=1e-6)
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if getattr(leaf, "ndim", 0) == 4]
    assert moments and all(m.sharding.spec[:2] == (None, "stage") for m in moments)
    assert model.params["body"]["blocks"]["up"]["kernel"].shape == (LAYERS, 16, 32)
    assert_trees_close(one.params, model.params, rtol=1e-6, atol=1e-6)
    assert [w.shape for w in model.get_weights()] == [w.shape for w in one.get_weights()]
    assert model.weight_names() == one.weight_names()


class WideBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(256, 256, rngs=rngs)

    def __call__(self, x):
        return x + nnx.relu(self.linear(x))


class WideNet(nnx.Module):
    """8 blocks of 256 x 256 in `Stages` between an embedding and a head."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Linear(32, 256, rngs=rngs)
        self.body = Stages(WideBlock, 8, rngs=rngs)
        self.head = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(self.embed(x)))


@eight_devices
@pytest.mark.slow
def test_a_circular_step_moves_only_activations_between_stages():
    """stage=4 x data=2, M=8, 8 blocks of 256 x 256: besides the gradient's all-reduce, the circular step
    (repeats=2) sends only the activations' point-to-point bytes, at most 8 x GPipe's; a stage's parameters
    (526 kB) and their gradients never leave it (2.1 MB a step when stored contiguously)."""
    x, y = np.zeros((64, 32), np.float32), np.zeros((64,), np.int32)
    moved = {}
    for schedule, repeats in [("gpipe", 1), ("circular", 2)]:
        model = built(pipelined(schedule, repeats, microbatches=8), model=WideNet)
        collectives = model.step_report(x, y).collectives
        moved[schedule] = {kind: n for kind, n in collectives.items() if kind != "all-reduce"}
    assert set(moved["gpipe"]) == {"collective-permute"}, moved
    assert set(moved["circular"]) == {"collective-permute"}, moved  # no all-to-all, no all-gather
    assert moved["circular"]["collective-permute"] <= 8 * moved["gpipe"]["collective-permute"], moved


@eight_devices
@pytest.mark.slow
def test_a_checkpoint_saved_under_circular_loads_under_gpipe_and_on_one_device(tmp_path):
    """Saved under circular (repeat-major), the checkpoint holds the natural stack: loaded under GPipe and on
    one device it gives the same weights and optimizer state, and both train on as one device does."""
    saved = fitted(pipelined("circular", repeats=2))
    saved.save(tmp_path / "model")
    x, y = classification_data(n=32, din=8, classes=4, seed=1)
    loaded = {}
    for name, strategy in [("one", mf.strategies.OneDeviceStrategy()), ("gpipe", pipelined("gpipe"))]:
        with strategy.scope():
            model = mf.load_model(tmp_path / "model", lambda: StagedNet(LAYERS))
        assert model.get_weights()[0].shape == saved.get_weights()[0].shape
        for a, b in zip(saved.get_weights(), model.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        loaded[name] = model
    saved.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)  # circular goes on from the same point
    assert_trees_close(loaded["one"].params, loaded["gpipe"].params, **PIPELINE_TOLERANCE)
    assert_trees_close(loaded["one"].params, saved.params, **PIPELINE_TOLERANCE)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@eight_devices
def test_weights_set_under_circular_are_the_natural_stack():
    """`set_weights` takes the natural stack (as `get_weights` gives it) under circular; a one-device model's
    weights set into a circular one read back unchanged and sit on the stages that run them."""
    one = built(mf.strategies.OneDeviceStrategy(), model=lambda: StagedNet(LAYERS, seed=5))
    circular = built(pipelined("circular", repeats=2))
    circular.set_weights(one.get_weights())
    for a, b in zip(one.get_weights(), circular.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    stored = circular.session.state.params["body"]["blocks"]["down"]["kernel"]
    natural = one.get_weights()[circular.weight_names().index("body/blocks/down/kernel")]
    np.testing.assert_array_equal(np.asarray(stored).reshape(natural.shape), natural)
    with pytest.raises(ValueError, match=r"Weight 'body/blocks/down/kernel' has shape \(8, 32, 16\)"):
        circular.set_weights(
            [np.asarray(w).reshape(2, 4, *w.shape[1:]) if w.ndim == 3 else w for w in one.get_weights()]
        )


class Crash(mf.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.session.step == 5:
            raise RuntimeError("simulated crash")


@eight_devices
@pytest.mark.slow
@pytest.mark.parametrize("resume_on", ["gpipe", "one"])
def test_a_backup_written_under_circular_resumes_under_another_schedule(tmp_path, resume_on):
    """A fit under circular crashes after its backup at step 4; the fit resumed under GPipe or on one device
    continues from it and ends where an uninterrupted one-device fit ends."""
    x, y = classification_data(n=64, din=8, classes=4)
    fit = dict(batch_size=16, epochs=2, verbose=0, shuffle=False)
    crashed = built(pipelined("circular", repeats=2))
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(x, y, **fit, callbacks=[Crash(), mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2)])
    strategy = pipelined("gpipe") if resume_on == "gpipe" else mf.strategies.OneDeviceStrategy()
    resumed = built(strategy)
    resumed.fit(x, y, **fit, callbacks=[mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2)])
    assert int(resumed.session.state.step) == 8
    uninterrupted = built(mf.strategies.OneDeviceStrategy())
    uninterrupted.fit(x, y, **fit)
    assert_trees_close(uninterrupted.params, resumed.params, **PIPELINE_TOLERANCE)
