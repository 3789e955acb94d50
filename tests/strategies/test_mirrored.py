"""MirroredStrategy over 8 simulated devices equals one device on the same global batches."""

import jax
import numpy as np
import pytest
from helpers import MLP, assert_trees_close, classification_data

import meshfit as mf
from meshfit.data.inputs import data_source


def train(strategy, x, y, batch_size, epochs, spe=1, **fit_kwargs):
    with strategy.scope():
        model = mf.Model(MLP(din=4, hidden=32, dout=3, dropout=0.0))
        model.compile(
            optimizer="adam",
            loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=spe,
        )
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, **fit_kwargs)
    return model, history


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize(
    "n, batch_size",
    [
        (320, 16),  # 20 steps, every batch divides by 8
        (300, 15),  # 20 steps; 15 rows padded to 16 on 8 replicas
        (290, 16),  # 19 steps; last batch 2 rows on 8 replicas
    ],
)
def test_mirrored_equals_one_device(n, batch_size):
    assert len(jax.devices()) == 8
    x, y = classification_data(n=n)
    one, h_one = train(mf.strategies.OneDeviceStrategy(), x, y, batch_size, 1)
    mirrored, h_mir = train(mf.strategies.MirroredStrategy(), x, y, batch_size, 1)
    assert mirrored.strategy.num_replicas_in_sync == 8
    assert_trees_close(one.params, mirrored.params, rtol=1e-5, atol=1e-6)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(h_one.history[key], h_mir.history[key], rtol=1e-5)
    e_one = one.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    e_mir = mirrored.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    assert e_one["loss"] == pytest.approx(e_mir["loss"], rel=1e-5)
    assert e_one["accuracy"] == pytest.approx(e_mir["accuracy"], abs=1e-7)
    np.testing.assert_allclose(
        one.predict(x[:37], batch_size=batch_size, verbose=0),
        mirrored.predict(x[:37], batch_size=batch_size, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_mirrored_state_is_replicated_and_batches_are_split():
    x, y = classification_data(n=64)
    model, _ = train(mf.strategies.MirroredStrategy(), x, y, 16, 1)
    for leaf in jax.tree.leaves(model.session.state):
        assert leaf.sharding.is_fully_replicated
        assert len(leaf.sharding.device_set) == 8
    batch = model.strategy.distribute_batch(next(data_source(x, y, None, 16, model.strategy).batches(0)))
    assert batch.x.sharding.spec == jax.sharding.PartitionSpec("data")
    assert {s.data.shape for s in batch.x.addressable_shards} == {(2, 4)}


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_mirrored_steps_per_execution_and_subset_of_devices():
    x, y = classification_data(n=150)
    one, _ = train(mf.strategies.OneDeviceStrategy(), x, y, 12, 2)
    four, _ = train(mf.strategies.MirroredStrategy(jax.devices()[:4]), x, y, 12, 2, spe=5)
    assert four.strategy.num_replicas_in_sync == 4
    assert_trees_close(one.params, four.params, rtol=1e-5, atol=1e-6)


def test_strategy_scope_and_mixing_is_an_error():
    mirrored = mf.strategies.MirroredStrategy()
    assert isinstance(mf.strategies.get_strategy(), mf.strategies.OneDeviceStrategy)
    with mirrored.scope():
        assert mf.strategies.get_strategy() is mirrored
        model = mf.Model(MLP())
    assert model.strategy is mirrored
    with mf.strategies.OneDeviceStrategy().scope():
        with pytest.raises(ValueError, match="created under MirroredStrategy.*called under OneDeviceStrategy"):
            model.compile(optimizer="sgd", loss="mse")
    model.compile(optimizer="sgd", loss="mse")  # outside any scope: the model's own strategy
