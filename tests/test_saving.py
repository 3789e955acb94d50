"""model.save / meshfit.load_model / save_weights / load_weights: Orbax files, any strategy on restore."""

import json
import os
import re
import sys
import time

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data
from processes import Job

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
        other.save_weights(tmp_path / "w", overwrite=False)
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


def test_save_overwrites_by_default_and_overwrite_false_refuses(tmp_path):
    model, _, _ = trained(mf.strategies.OneDeviceStrategy(), epochs=1)
    model.save(tmp_path / "m")
    first = model.get_weights()
    model.set_weights([w + 1 for w in first])
    model.save(tmp_path / "m")  # a re-run, as in Keras
    assert sorted(p for p in os.listdir(tmp_path / "m") if p.isdigit()) == ["1"]
    loaded = mf.load_model(tmp_path / "m", MLP(din=4, hidden=64, dout=3, seed=9))
    assert same_weights(model, loaded)
    before = sorted(os.listdir(tmp_path / "m"))
    with pytest.raises(FileExistsError, match="already holds a saved model. Pass overwrite=True"):
        model.save(tmp_path / "m", overwrite=False)
    assert sorted(os.listdir(tmp_path / "m")) == before
    model.save_weights(tmp_path / "w")
    model.save_weights(tmp_path / "w")
    with pytest.raises(FileExistsError, match="holds meshfit model checkpoints, not weights ones"):
        model.save_weights(tmp_path / "m")  # another kind is still refused


@pytest.mark.parametrize("kind", ["model", "weights"])
def test_a_save_killed_while_overwriting_leaves_one_complete_copy(tmp_path, kind):
    """SIGKILL lands inside an overwriting save (after the first saves): the old or the new copy loads whole."""
    path = tmp_path / "saved"
    worker = os.path.join(os.path.dirname(__file__), "workers", "save_repeatedly.py")
    with Job([sys.executable, worker, str(path), kind], timeout=240) as job:
        timings = [float(m.group(1)) for m in job.wait_for(r"saved \d+ in ([\d.]+)", count=3)]
        target = 3 + int(job.wait_for(r"saved (\d+)", count=3)[-1].group(1))
        job.wait_for(rf"saving {target}$")
        time.sleep(min(timings) / 2)  # about half-way into save number `target`
        job.kill()
    started = [int(m.group(1)) for m in map(re.compile(r"saving (\d+)").match, job.out) if m]
    done = [int(m.group(1)) for m in map(re.compile(r"saved (\d+)").match, job.out) if m]
    loaded = mf.Model(MLP(din=4, hidden=256, dout=3, seed=7))
    if kind == "model":
        loaded = mf.load_model(path, MLP(din=4, hidden=256, dout=3, seed=7))
    else:
        loaded.load_weights(path)
    assert started[-1] == done[-1] + 1  # killed inside a save
    values = {float(np.unique(w).item()) for w in loaded.get_weights()}
    assert len(values) == 1  # every array from one save: complete, not mixed
    assert values.pop() in (done[-1], started[-1])
    # The directory stays usable: a new save takes over the dead writer's lock and replaces it.
    (loaded.save if kind == "model" else loaded.save_weights)(path)
    assert len([p for p in os.listdir(path) if p.isdigit()]) == 1
