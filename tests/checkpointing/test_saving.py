"""model.save / meshfit.load_model / save_weights / load_weights: Orbax files, any strategy on restore."""

import json
import os
import re
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import MLP, classification_data, linked_meshfit_names, meshfit_names, plant_symlinks, read_all
from processes import Job

import meshfit as mf
from meshfit.checkpointing.checkpoint import MARKER


def trained(strategy, epochs=2):
    x, y = classification_data(n=64)
    with strategy.scope():
        model = mf.Model(MLP(din=4, hidden=64, dout=3))
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0)
    return model, x, y


def same_weights(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights(), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["one_device", "fsdp4", "mirrored8"])
def test_saved_under_mirrored8_restores_onto_other_layouts(tmp_path, target):
    model, x, y = trained(mf.strategies.MirroredStrategy())
    model.save(tmp_path / "model")
    # What Orbax wrote: a numbered, committed checkpoint with the state and our JSON record.
    assert (tmp_path / "model" / "0" / "state" / "_METADATA").exists()
    record = json.loads((tmp_path / "model" / "0" / "meta" / "metadata").read_text())
    assert record["format"] == 2
    assert record["compile"] == {
        "optimizer": "adam",
        "loss": "sparse_categorical_crossentropy",
        "loss_weights": None,
        "metrics": ["accuracy"],
        "weighted_metrics": [],
        "steps_per_execution": 1,
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


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_loads_print_no_read_only_warning_and_orbax_still_warns_elsewhere(tmp_path, caplog, capfd):
    import orbax.checkpoint as ocp

    model = mf.Model(MLP(din=4, hidden=8, dout=3))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.save(tmp_path / "model")
    model.save_weights(tmp_path / "weights")
    capfd.readouterr()
    with caplog.at_level("INFO"):
        model.load_weights(tmp_path / "weights")
        mf.load_model(tmp_path / "model", MLP(din=4, hidden=8, dout=3))
    assert not [r.getMessage() for r in caplog.records if "read only" in r.getMessage()]
    assert "read only" not in capfd.readouterr().err
    with caplog.at_level("INFO"):  # the filter lasts only while meshfit opens a directory
        ocp.CheckpointManager(tmp_path / "model", options=ocp.CheckpointManagerOptions(read_only=True)).close()
    assert any(r.getMessage().startswith("Given directory is read only") for r in caplog.records)


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


def compiled_with_objects(x, y):
    """A model compiled with objects, not names (all of them savable), trained briefly."""
    model = mf.Model(MLP())
    model.compile(
        optimizer=mf.optimizers.get("adam", learning_rate=3e-3),
        loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[mf.metrics.SparseCategoricalAccuracy(), "mae"],
        weighted_metrics=[mf.metrics.SparseTopKCategoricalAccuracy(k=2)],
    )
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_a_reload_evaluates_predicts_and_trains_on_with_nothing_passed(tmp_path):
    x, y = classification_data(n=64)
    y = y[:, None]  # a trailing axis of 1, so that "mae" compares labels with every logit
    weights = np.linspace(0.5, 1.5, len(x)).astype(np.float32)
    model = compiled_with_objects(x, y)
    logs = model.evaluate(x, y, sample_weight=weights, batch_size=16, verbose=0, return_dict=True)
    model.save(tmp_path / "m")
    loaded = mf.load_model(tmp_path / "m", MLP(seed=3))
    again = loaded.evaluate(x, y, sample_weight=weights, batch_size=16, verbose=0, return_dict=True)
    assert list(again.items()) == list(logs.items())  # the same keys, in the same order, and the same numbers
    assert sorted(logs) == ["loss", "mae", "sparse_categorical_accuracy", "sparse_top_k_categorical_accuracy"]
    assert loaded.metrics_names == model.metrics_names
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    settings = loaded.compile_settings
    assert isinstance(settings.loss, mf.losses.SparseCategoricalCrossentropy) and settings.loss.from_logits
    assert mf.optimizers.recipe_of(settings.optimizer_id).config["learning_rate"] == 3e-3
    # The optimizer (its arguments and its state) came back: training on gives the same weights.
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    assert loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history == history
    assert same_weights(model, loaded)


class TwoHeads(nnx.Module):
    """Class logits ("cls") and a regression value ("reg") from one trunk."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.trunk = nnx.Linear(4, 8, rngs=rngs)
        self.cls = nnx.Linear(8, 3, rngs=rngs)
        self.reg = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.trunk(x))
        return {"cls": self.cls(h), "reg": self.reg(h)}


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_per_output_settings_reload_as_dicts(tmp_path):
    x, labels = classification_data(n=32)
    y = {"cls": labels, "reg": x[:, :1] * 2.0}
    model = mf.Model(TwoHeads())
    model.compile(
        optimizer="adam",
        loss={"cls": mf.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={"cls": ["accuracy"], "reg": [mf.metrics.MeanAbsoluteError()]},
    )
    logs = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert sorted(logs) == ["cls_accuracy", "cls_loss", "loss", "reg_loss", "reg_mean_absolute_error"]
    model.save(tmp_path / "m")
    record = json.loads((tmp_path / "m" / "0" / "meta" / "metadata").read_text())["compile"]
    assert record["loss_weights"] == {"cls": 1.0, "reg": 0.5} and record["loss"]["reg"] == "mse"
    loaded = mf.load_model(tmp_path / "m", TwoHeads(seed=1))
    again = loaded.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert list(again.items()) == list(logs.items())


def my_loss(y_true, y_pred):
    """A user's loss: code, which a saved model cannot hold."""
    return mf.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


@pytest.mark.slow
def test_a_custom_loss_is_asked_for_again_before_anything_is_loaded(tmp_path):
    x, y = classification_data(n=32)
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss=my_loss, metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.save(tmp_path / "m")  # saving works; the record says what could not be saved
    record = json.loads((tmp_path / "m" / "0" / "meta" / "metadata").read_text())
    assert record["compile"]["loss"] == {"__custom__": "my_loss"}
    built = []
    factory = lambda: built.append(1) or MLP(seed=3)  # noqa: E731
    expected = r"loss `my_loss`. Received: no `loss` argument.*load_model\(path, module, loss=my_loss\), or pass"
    with pytest.raises(ValueError, match=expected):
        mf.load_model(tmp_path / "m", factory)
    assert built == []  # refused before the model was made
    loaded = mf.load_model(tmp_path / "m", factory, loss=my_loss)
    assert loaded.evaluate(x, y, batch_size=16, verbose=0) == model.evaluate(x, y, batch_size=16, verbose=0)
    weights_only = mf.load_model(tmp_path / "m", MLP(seed=3), compile=False)
    assert not weights_only.compiled and same_weights(model, weights_only)


@pytest.mark.slow
def test_a_custom_optimizer_loads_without_it_until_given_then_its_saved_state_is_used(tmp_path):
    import optax

    x, y = classification_data(n=32)
    model = mf.Model(MLP())
    model.compile(
        optimizer=optax.sgd(0.1, momentum=0.9),
        loss="sparse_categorical_crossentropy",
        weighted_metrics=[mf.metrics.SparseTopKCategoricalAccuracy(k=2)],
        steps_per_execution=2,
        gradient_accumulation_steps=2,
    )
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    model.save(tmp_path / "m")
    with pytest.warns(UserWarning, match=r"optimizer `an optax transformation` is code.*optimizer=\.\.\.\)"):
        loaded = mf.load_model(tmp_path / "m", MLP(seed=3))
    # Weights, loss and metrics came back: evaluate and predict give the saved model's numbers.
    assert loaded.evaluate(x, y, batch_size=8, verbose=0, return_dict=True) == logs
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert loaded.optimizer is None and loaded.compile_settings.optimizer_id is None
    with pytest.raises(ValueError, match=r"`fit\(\)` needs an optimizer.*load_model\(path, module, optimizer=\.\.\.\)"):
        loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"`train_on_batch\(\)` needs an optimizer"):
        loaded.train_on_batch(x[:8], y[:8])
    assert same_weights(loaded, model)  # the refusals changed nothing
    # Given, the saved optimizer state (momentum, accumulators) and step are used: equal to the saved ones.
    loaded = mf.load_model(tmp_path / "m", MLP(seed=3), optimizer=optax.sgd(0.1, momentum=0.9))
    assert int(loaded.session.state.step) == int(model.session.state.step) == 4
    saved, restored = model.session.state.opt_state, loaded.session.state.opt_state
    assert jax.tree.structure(saved) == jax.tree.structure(restored)
    assert any(np.any(np.asarray(leaf) != 0) for leaf in jax.tree.leaves(saved))  # not a fresh state
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    settings = loaded.compile_settings
    assert (settings.steps_per_execution, settings.gradient_accumulation_steps) == (2, 2)
    (weighted,) = settings.weighted
    assert isinstance(weighted, mf.metrics.SparseTopKCategoricalAccuracy) and weighted.k == 2
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    assert loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history == history


@pytest.mark.slow
def test_an_optax_schedule_loads_without_the_optimizer_and_a_resave_keeps_it_out(tmp_path):
    import optax

    x, y = classification_data(n=32)
    model = mf.Model(MLP())
    schedule = optax.cosine_decay_schedule(1e-2, 100)
    model.compile(optimizer=mf.optimizers.get("adam", learning_rate=schedule), loss="sparse_categorical_crossentropy")
    model.save(tmp_path / "m")
    with pytest.warns(UserWarning, match=r"optimizer `'adam' with learning_rate=cosine_decay_schedule"):
        loaded = mf.load_model(tmp_path / "m", MLP(seed=3))
    assert loaded.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)
    loaded.save(tmp_path / "again")  # compiled without an optimizer: saved so, and reloads so, without a warning
    record = json.loads((tmp_path / "again" / "0" / "meta" / "metadata").read_text())
    assert record["compile"]["optimizer"] is None and record["has_optimizer"] is False
    again = mf.load_model(tmp_path / "again", MLP(seed=4))
    assert again.optimizer is None and again.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)
    # A custom loss is still asked for before anything loads, the optimizer named beside it.
    model.compile(optimizer=optax.adam(1e-3), loss=my_loss)
    model.save(tmp_path / "both")
    with pytest.raises(ValueError, match=r"optimizer `an optax transformation`; loss `my_loss`"):
        mf.load_model(tmp_path / "both", MLP(seed=3))


def rewrite_record(path, **changes):
    """Edits the JSON record of a saved model, as an older meshfit would have written it."""
    meta = path / "0" / "meta" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), **changes}))


def test_records_of_format_1_names_only_load_as_before(tmp_path):
    x, y = classification_data(n=32)
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.save(tmp_path / "m")
    old = {"optimizer": "adam", "loss": "sparse_categorical_crossentropy", "metrics": ["accuracy"]}
    old.update(dtype_policy="float32", gradient_accumulation_steps=1)
    rewrite_record(tmp_path / "m", format=1, compile=old)
    loaded = mf.load_model(tmp_path / "m", MLP(seed=9))
    assert loaded.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)
    # Format 1 left out an optimizer that was not a name: the weights load, uncompiled.
    rewrite_record(tmp_path / "m", format=1, compile={**old, "optimizer": None})
    loaded = mf.load_model(tmp_path / "m", MLP(seed=9))
    assert not loaded.compiled and same_weights(model, loaded)


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


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["model", "weights"])
@pytest.mark.processes
def test_a_save_killed_while_overwriting_leaves_one_complete_copy(tmp_path, kind):
    """SIGKILL lands inside an overwriting save (after the first saves): the old or the new copy loads whole."""
    path = tmp_path / "saved"
    worker = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "save_repeatedly.py")
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


@pytest.mark.slow
@pytest.mark.parametrize("used", [False, True], ids=["new directory", "holding a saved model"])
def test_planted_symlinks_at_meshfit_names_are_refused_by_name_and_nothing_outside_changes(tmp_path, used):
    """Symlinks at the lock, the marker, its temporary and the probe of this process (a shared /tmp):
    save and save_weights refuse naming each, before writing anything; once they are gone, saving works and
    leaves no meshfit name a symlink."""
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="mse")
    directory = tmp_path / "model"
    if used:
        model.save(directory)
    victims = plant_symlinks(directory, tmp_path / "outside")
    before = sorted(os.listdir(directory))
    for save in (model.save, model.save_weights):
        with pytest.raises(FileExistsError, match="Received: symlinks") as refusal:
            save(directory)
        assert all(f"'{directory / name}'" in str(refusal.value) for name in meshfit_names())
        assert sorted(os.listdir(directory)) == before and read_all(tmp_path / "outside") == victims
    with pytest.raises(FileExistsError, match="Received: a symlink"):  # a reader does not follow the marker either
        mf.load_model(directory, MLP())
    for name in meshfit_names():
        os.unlink(directory / name)
    if used:
        (directory / MARKER).write_text('{"kind": "model", "format": 1}')
    model.save(directory)
    assert linked_meshfit_names(directory) == [] and read_all(tmp_path / "outside") == victims
    assert same_weights(model, mf.load_model(directory, MLP(seed=3)))


def test_a_saved_model_s_directory_is_made_0700_and_one_others_can_write_to_is_refused(tmp_path):
    x, y = classification_data(n=32)
    model = mf.Model(MLP())
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.save(tmp_path / "model")
    model.save_weights(tmp_path / "weights")
    assert {os.stat(tmp_path / d).st_mode & 0o777 for d in ("model", "weights")} == {0o700}
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    for save in (model.save, model.save_weights):
        with pytest.raises(PermissionError, match=r"others can write to it \(mode 0777\)"):
            save(shared)
    assert os.listdir(shared) == []
    if os.geteuid() == 0:
        os.chmod(shared, 0o755)
        os.chown(shared, 65534, 65534)
        with pytest.raises(PermissionError, match=r"uid 65534 \(nobody\), not to you"):
            model.save(shared)
        assert os.listdir(shared) == []
