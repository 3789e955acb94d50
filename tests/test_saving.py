"""model.save / meshfit.load_model / save_weights / load_weights: Orbax files, any strategy on restore."""

import json
import os

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf


def trained(strategy, epochs=2):
    x, y = classification_data(n=64)
    with strategy.scope():
        model = mf.Model(MLP(din=4, hidden=64, dout=3))
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0)
    return model, x, y


def same_weights(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights(), strict=True))


@pytest.mark.parametrize("target", ["one_device", "fsdp4", "mirrored8"])
def test_saved_under_mirrored8_restores_onto_other_layouts(tmp_path, target):
    model, x, y = trained(mf.strategies.MirroredStrategy())
    model.save(tmp_path / "model")
    # What Orbax wrote: a numbered, committed checkpoint with the state and our JSON record.
    assert (tmp_path / "model" / "0" / "state" / "_METADATA").exists()
    record = json.loads((tmp_path / "model" / "0" / "meta" / "metadata").read_text())
    assert record["compile"] == {
        "optimizer": "adam",
        "loss": "sparse_categorical_crossentropy",
        "metrics": ["accuracy"],
        "dtype_policy": "float32",
        "gradient_accumulation_steps": 1,
    }
    strategy = {
        "one_device": mf.strategies.OneDeviceStrategy(),
        "fsdp4": mf.strategies.MeshStrategy(axes={"data": 2, "fsdp": 4}, min_shard_size=64),
        "mirrored8": mf.strategies.MirroredStrategy(),
    }[target]
    with strategy.scope():
        loaded = mf.load_model(tmp_path / "model", MLP(din=4, hidden=64, dout=3, seed=99))
    assert same_weights(model, loaded)
    assert int(loaded.session.state.step) == int(model.session.state.step) == 8
    if target == "fsdp4":
        assert loaded.params["hidden"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    # The optimizer state came back too: one more epoch from both gives the same weights.
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for u, v in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def test_weights_round_trip_and_no_silent_overwrite(tmp_path):
    model, _, _ = trained(mf.strategies.OneDeviceStrategy(), epochs=1)
    model.save_weights(tmp_path / "w")
    other = mf.Model(MLP(din=4, hidden=64, dout=3, seed=5))
    assert not same_weights(model, other)
    other.load_weights(tmp_path / "w")
    assert same_weights(model, other)
    before = os.listdir(tmp_path / "w")
    with pytest.raises(FileExistsError, match="already holds saved weights. Pass overwrite=True"):
        other.save_weights(tmp_path / "w")
    assert os.listdir(tmp_path / "w") == before
    other.save_weights(tmp_path / "w", overwrite=True)
    assert sorted(p for p in os.listdir(tmp_path / "w") if p.isdigit()) == ["1"]  # the new one replaced the old


def test_refuses_foreign_and_wrong_kind_directories(tmp_path):
    model, _, _ = trained(mf.strategies.OneDeviceStrategy(), epochs=1)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("1,2\n")
    with pytest.raises(FileExistsError, match="meshfit did not write"):
        model.save(tmp_path / "data")
    assert (tmp_path / "data" / "train.csv").read_text() == "1,2\n"
    model.save_weights(tmp_path / "w")
    with pytest.raises(FileExistsError, match="holds meshfit weights checkpoints, not model ones"):
        model.save(tmp_path / "w")
    with pytest.raises(FileNotFoundError, match="No meshfit checkpoint"):
        model.load_weights(tmp_path / "nothing")


def test_load_model_with_a_custom_optimizer_needs_compile_arguments(tmp_path):
    import optax

    model = mf.Model(MLP())
    model.compile(optimizer=optax.sgd(0.1), loss="mse")
    model.save(tmp_path / "m")
    loaded = mf.load_model(tmp_path / "m", MLP(seed=3))
    assert not loaded.compiled and same_weights(model, loaded)
    loaded = mf.load_model(tmp_path / "m", MLP(seed=3), optimizer=optax.sgd(0.1))
    assert loaded.compiled
