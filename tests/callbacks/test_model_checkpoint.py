"""ModelCheckpoint: Orbax checkpoints per epoch or N steps, best-only, weights-only, async."""

import json
import os

import numpy as np
import pytest
from helpers import MLP, classification_data, linked_meshfit_names, meshfit_names, plant_symlinks, read_all

import meshfit as mf
from meshfit.checkpointing import checkpoint


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


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
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


@pytest.mark.slow
def test_a_second_run_overwrites_as_keras_does_and_overwrite_false_refuses(tmp_path):
    fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "ck"), epochs=4)
    assert steps_in(tmp_path / "ck") == [1, 2, 3, 4]
    model, _, snapshots = fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "ck", monitor="loss"), epochs=2)
    # The earlier run's checkpoints are replaced whole: none of its epochs 3 and 4 is left to pass for the newest.
    assert steps_in(tmp_path / "ck") == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging or replaced copy left beside it
    restored = mf.Model(MLP(seed=1))
    restored.load_weights(tmp_path / "ck")
    for a, b in zip(restored.get_weights(), snapshots[2][0], strict=True):
        np.testing.assert_array_equal(a, b)
    before = steps_in(tmp_path / "ck")
    with pytest.raises(FileExistsError, match="already exists.*does not overwrite"):
        fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "ck", overwrite=False), epochs=2)
    assert steps_in(tmp_path / "ck") == before


def test_a_replacement_interrupted_by_a_crash_is_finished_or_undone(tmp_path):
    """The states a crash can leave between the renames of a replacement: readers find a whole copy,
    the next writer puts it back in place."""
    fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "ck"), epochs=2)
    _, _, snapshots = fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "new"), epochs=1)
    # Crashed after `ck` was renamed aside, before the new copy took its place.
    os.rename(tmp_path / "ck", tmp_path / "ck.meshfit-old")
    os.rename(tmp_path / "new", tmp_path / "ck.meshfit-new")
    restored = mf.Model(MLP(seed=1))
    restored.load_weights(tmp_path / "ck")  # a reader finds the complete new copy and moves nothing
    for a, b in zip(restored.get_weights(), snapshots[1][0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert sorted(os.listdir(tmp_path)) == ["ck.meshfit-new", "ck.meshfit-old"]
    checkpoint.finish_replacement(str(tmp_path / "ck"), "checkpoint")
    assert sorted(os.listdir(tmp_path)) == ["ck"] and steps_in(tmp_path / "ck") == [1]
    # Crashed while staging (no complete new copy): the old one goes back.
    os.rename(tmp_path / "ck", tmp_path / "ck.meshfit-old")
    (tmp_path / "ck.meshfit-new").mkdir()
    checkpoint.write_marker(str(tmp_path / "ck.meshfit-new"), "checkpoint")
    checkpoint.finish_replacement(str(tmp_path / "ck"), "checkpoint")
    assert sorted(os.listdir(tmp_path)) == ["ck"] and steps_in(tmp_path / "ck") == [1]
    # A sibling meshfit did not write is never touched.
    (tmp_path / "ck.meshfit-old").mkdir()
    (tmp_path / "ck.meshfit-old" / "notes.txt").write_text("mine")
    checkpoint.finish_replacement(str(tmp_path / "ck"), "checkpoint")
    assert (tmp_path / "ck.meshfit-old" / "notes.txt").read_text() == "mine"


def test_formatted_paths_as_keras(tmp_path):
    pattern = str(tmp_path / "model-{epoch:02d}")
    model, _, snapshots = fit_with(mf.callbacks.ModelCheckpoint(pattern), epochs=3)
    assert sorted(os.listdir(tmp_path)) == ["model-01", "model-02", "model-03"]  # 1-based, as Keras
    # Each a saved model, optimizer state and step included.
    loaded = mf.load_model(tmp_path / "model-02", MLP(seed=1), optimizer=mf.optimizers.get("adam", learning_rate=0.02))
    for a, b in zip(loaded.get_weights(), snapshots[2][0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert loaded.optimizer.iterations == 6  # 3 steps per epoch, 2 epochs
    with pytest.raises(FileExistsError, match="holds meshfit model checkpoints, not weights ones"):
        fit_with(mf.callbacks.ModelCheckpoint(pattern, save_weights_only=True), epochs=1)  # another kind


def test_keras_filepath_and_suffixes(tmp_path):
    """Keras's `filepath=`: `{epoch}.keras` names one saved model per epoch (a directory), `.weights.h5` weights
    only, and a plain `best.keras` one save replaced each time."""
    model, _, snapshots = fit_with(mf.callbacks.ModelCheckpoint(filepath=str(tmp_path / "ckpt" / "{epoch}.keras")), 2)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1.keras", "2.keras"]
    loaded = mf.load_model(tmp_path / "ckpt" / "1.keras", MLP(seed=1))
    for a, b in zip(loaded.get_weights(), snapshots[1][0], strict=True):
        np.testing.assert_array_equal(a, b)
    weights = mf.callbacks.ModelCheckpoint(filepath=tmp_path / "best.weights.h5", save_best_only=True)
    assert weights.save_weights_only
    _, history, snapshots = fit_with(weights, epochs=3)
    best = int(np.argmin(history.history["val_loss"])) + 1
    restored = mf.Model(MLP(seed=1))
    restored.load_weights(tmp_path / "best.weights.h5")
    for a, b in zip(restored.get_weights(), snapshots[best][0], strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="holds meshfit weights checkpoints"):  # weights only: not a model
        mf.load_model(tmp_path / "best.weights.h5", MLP(seed=1))
    with pytest.raises(TypeError, match="`filepath` .Keras's name. and `directory`"):
        mf.callbacks.ModelCheckpoint(tmp_path / "a", filepath=tmp_path / "b")
    with pytest.raises(TypeError, match="needs where to save"):
        mf.callbacks.ModelCheckpoint()


@pytest.mark.slow
def test_formatted_path_with_log_keys_and_save_best_only(tmp_path):
    pattern = str(tmp_path / "w-{epoch}-{val_loss:.3f}")
    cb = mf.callbacks.ModelCheckpoint(pattern, save_best_only=True, save_weights_only=True)
    _, history, snapshots = fit_with(cb, epochs=6)
    val = history.history["val_loss"]
    improved = [i + 1 for i, v in enumerate(val) if v < min(val[:i], default=np.inf)]
    assert sorted(os.listdir(tmp_path)) == sorted(f"w-{e}-{val[e - 1]:.3f}" for e in improved)
    restored = mf.Model(MLP(seed=1))
    restored.load_weights(tmp_path / f"w-{improved[-1]}-{val[improved[-1] - 1]:.3f}")
    for a, b in zip(restored.get_weights(), snapshots[improved[-1]][0], strict=True):
        np.testing.assert_array_equal(a, b)
    # The same formatted path saved again (here: every epoch into "best") is replaced, as Keras overwrites.
    _, _, snapshots = fit_with(mf.callbacks.ModelCheckpoint(str(tmp_path / "best{batch}"), save_freq=3), epochs=2)
    assert "best3" in os.listdir(tmp_path)
    restored.load_weights(tmp_path / "best3")  # the second epoch's save replaced the first's
    for a, b in zip(restored.get_weights(), snapshots[2][0], strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(KeyError, match="Failed to format this callback filepath.*nope.*the logs"):
        fit_with(mf.callbacks.ModelCheckpoint(str(tmp_path / "x-{nope}")), epochs=1)


@pytest.mark.slow
def test_planted_symlinks_are_refused_by_name_and_nothing_outside_changes(tmp_path):
    """Symlinks at the meshfit names of a plain directory or of a formatted path's save, or at the siblings a
    replacement writes (`<directory>.meshfit-new`, `.meshfit-old`): the fit is refused naming them, before the
    directory they are in is written; outside files stay byte-for-byte the same."""
    outside = tmp_path / "outside"
    victims = plant_symlinks(tmp_path / "plain", outside)
    with pytest.raises(FileExistsError, match="Received: symlinks") as refusal:
        fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "plain"), epochs=1)
    assert all(f"'{tmp_path / 'plain' / name}'" in str(refusal.value) for name in meshfit_names())
    assert sorted(os.listdir(tmp_path / "plain")) == sorted(meshfit_names())

    plant_symlinks(tmp_path / "formatted" / "model-1", outside)
    with pytest.raises(FileExistsError, match=f"{tmp_path / 'formatted' / 'model-1'}.*Received: symlinks"):
        fit_with(mf.callbacks.ModelCheckpoint(str(tmp_path / "formatted" / "model-{epoch}")), epochs=1)

    fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "ck"), epochs=1)
    (outside / "dir").mkdir()
    for sibling in ("ck.meshfit-new", "ck.meshfit-old"):
        os.symlink(outside / "dir", tmp_path / sibling)
    with pytest.raises(FileExistsError, match=r"ck\.meshfit-new', '.*ck\.meshfit-old'. Received: symlinks"):
        fit_with(mf.callbacks.ModelCheckpoint(tmp_path / "ck"), epochs=1)
    assert os.listdir(outside / "dir") == [] and steps_in(tmp_path / "ck") == [1]
    assert read_all(outside) == victims
    assert linked_meshfit_names(tmp_path / "ck") == []


def test_the_checkpoint_directory_is_made_0700_and_one_others_can_write_to_is_refused(tmp_path):
    x, y = classification_data(n=32)
    model = mf.Model(MLP())
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[mf.callbacks.ModelCheckpoint(tmp_path / "ckpt")])
    assert os.stat(tmp_path / "ckpt").st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match=r"others can write to it \(mode 0777\)"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[mf.callbacks.ModelCheckpoint(shared)])
    assert os.listdir(shared) == []
