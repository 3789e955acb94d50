"""ModelCheckpoint: Orbax checkpoints per epoch or N steps, best-only, weights-only, async."""

import json
import os

import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf


def fit_with(callback, epochs=4, **kwargs):
    x, y = classification_data(n=64)
    model = mf.Model(MLP())
    model.compile(
        optimizer=mf.optimizers.get("adam", learning_rate=0.02),
        loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    snapshots = {}
    record = mf.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: snapshots.setdefault(e + 1, (model.get_weights(), logs))
    )
    history = model.fit(
        x, y, batch_size=16, epochs=epochs, validation_split=0.25, callbacks=[record, callback], verbose=0, **kwargs
    )
    return model, history, snapshots


def steps_in(directory):
    return sorted(int(p) for p in os.listdir(directory) if p.isdigit())


def test_every_epoch_with_max_to_keep(tmp_path):
    model, _, snapshots = fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "ck", max_to_keep=2))
    assert steps_in(tmp_path / "ck") == [3, 4]
    meta = json.loads((tmp_path / "ck" / "4" / "meta" / "metadata").read_text())
    assert meta["epoch"] == 3 and "val_loss" in meta["logs"]
    restored = mf.Model(MLP(seed=1))
    restored.load_weights(tmp_path / "ck")
    for a, b in zip(restored.get_weights(), snapshots[4][0], strict=True):
        np.testing.assert_array_equal(a, b)


def test_save_best_only_keeps_only_improvements(tmp_path):
    cb = mf.callbacks.ModelCheckpoint(tmp_path / "best", monitor="val_loss", save_best_only=True)
    _, history, snapshots = fit_with(cb, epochs=6)
    val = history.history["val_loss"]
    improved = [i + 1 for i, v in enumerate(val) if v < min(val[:i], default=np.inf)]
    assert steps_in(tmp_path / "best") == improved
    best_epoch = improved[-1]
    restored = mf.Model(MLP(seed=1))
    restored.load_weights(tmp_path / "best")
    for a, b in zip(restored.get_weights(), snapshots[best_epoch][0], strict=True):
        np.testing.assert_array_equal(a, b)


def test_every_n_steps_and_weights_only(tmp_path):
    cb = mf.callbacks.ModelCheckpoint(tmp_path / "steps", save_freq=5, save_weights_only=True)
    fit_with(cb, epochs=2)  # 3 steps per epoch: steps 5 cross once
    assert steps_in(tmp_path / "steps") == [5]
    assert not (tmp_path / "steps" / "5" / "state" / "opt_state").exists()
    meta = json.loads((tmp_path / "steps" / "5" / "meta" / "metadata").read_text())
    assert meta["weights_only"] is True and meta["step"] == 5


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="`save_freq` must be 'epoch' or a positive int"):
        mf.callbacks.ModelCheckpoint(tmp_path, save_freq="batch")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.me").write_text("!")
    with pytest.raises(FileExistsError, match="meshfit did not write"):
        fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "x"), epochs=1)


def test_a_second_run_into_the_same_directory_is_refused(tmp_path):
    fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "ck"), epochs=2)
    before = steps_in(tmp_path / "ck")
    with pytest.raises(FileExistsError, match="already exists.*does not overwrite"):
        fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "ck"), epochs=2)
    assert steps_in(tmp_path / "ck") == before
