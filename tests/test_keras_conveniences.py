"""Keras conveniences: run_eagerly / jit_compile, model(x), the weights lists, get_config, F-scores in fit."""

import json

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf


def fitted(strategy=None, **compile_kwargs):
    x, y = classification_data(n=72)
    with (strategy or mf.strategies.OneDeviceStrategy()).scope():
        model = mf.Model(MLP())
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", **compile_kwargs)
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)  # 72 rows: a partial last batch
    return model, history


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_run_eagerly_trains_to_the_numbers_of_the_compiled_steps(steps_per_execution):
    compiled, h_compiled = fitted(steps_per_execution=steps_per_execution)
    eager, h_eager = fitted(steps_per_execution=steps_per_execution, run_eagerly=True)
    assert eager.run_eagerly and not eager.jit_compile and compiled.jit_compile
    assert eager.session.executables.compilations()["execution"] == 0  # nothing compiled
    for a, b in zip(compiled.get_weights(), eager.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h_compiled.history["loss"], h_eager.history["loss"], rtol=1e-5)


@pytest.mark.slow
def test_jit_compile_false_runs_eagerly_under_a_data_parallel_strategy():
    mirrored = lambda: mf.strategies.MirroredStrategy(jax.devices()[:4])  # noqa: E731
    compiled, _ = fitted(mirrored())
    eager, _ = fitted(mirrored(), jit_compile=False)
    assert eager.run_eagerly
    for a, b in zip(compiled.get_weights(), eager.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class Printing(mf.Model):
    """A custom train_step with a Python side effect: each call appends the step's loss as a float."""

    seen: list

    def train_step(self, state, data):
        logs, state = super().train_step(state, data)
        self.seen.append(float(logs["loss"]))  # concrete only when the step runs eagerly
        return logs, state


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_a_side_effect_in_a_custom_train_step_runs_at_every_eager_step():
    x, y = classification_data(n=64)
    model = Printing(MLP())
    model.seen = []
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", run_eagerly=True)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert len(model.seen) == 8 and all(np.isfinite(model.seen))


def test_compile_checks_run_eagerly_and_jit_compile():
    model = mf.Model(MLP())
    with pytest.raises(ValueError, match="run_eagerly"):
        model.compile(optimizer="sgd", loss="mse", run_eagerly="yes")
    with pytest.raises(ValueError, match="jit_compile"):
        model.compile(optimizer="sgd", loss="mse", jit_compile="xla")


def test_calling_the_model_the_weights_lists_and_get_config():
    model, _ = fitted(metrics=["accuracy"])
    x, _ = classification_data(n=5, seed=3)
    np.testing.assert_allclose(model(x), model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)  # two programs: rounding
    with pytest.raises(ValueError, match="inference only"):
        model(x, training=True)
    names = model.weight_names()
    assert len(model.weights) == len(names) == len(model.trainable_weights) + len(model.non_trainable_weights)
    for array, host in zip(model.weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(np.asarray(array), host)
    config = json.loads(json.dumps(model.get_config()))
    assert config["module"].endswith("MLP") and config["seed"] == 0
    assert list(config["weights"]) == names
    assert config["compile"]["optimizer"] == "adam" and config["compile"]["metrics"] == ["accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["f1_score", "r2_score"])
def test_scores_in_evaluate_are_exact_under_a_data_parallel_strategy(metric):
    keras = pytest.importorskip("keras")
    x, y = classification_data(n=70)  # 70 rows: partial batches padded with weight-0 rows
    with mf.strategies.MirroredStrategy(jax.devices()[:4]).scope():
        model = mf.Model(MLP())
        model.compile(optimizer="adam", loss="mse", metrics=[metric])
        one_hot = np.eye(3, dtype="float32")[y]
        model.fit(x, one_hot, batch_size=16, epochs=1, verbose=0)
        logs = model.evaluate(x, one_hot, batch_size=16, verbose=0, return_dict=True)
    reference = {"f1_score": keras.metrics.F1Score(), "r2_score": keras.metrics.R2Score()}[metric]
    reference.update_state(one_hot, model.predict(x, verbose=0))
    np.testing.assert_allclose(logs[metric], np.asarray(reference.result()), rtol=1e-5, atol=1e-6)
