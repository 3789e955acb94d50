"""Bad input gets a clear error that says what was expected and what came, before any state changes."""

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf


@pytest.fixture
def model():
    model = mf.Model(MLP())
    model.compile(
        optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    x, y = classification_data(n=16)
    model.fit(x, y, epochs=1, verbose=0)
    return model


def snapshot(model):
    state = model.session.state
    return [np.asarray(a).copy() for a in jax.tree.leaves(jax.device_get((state.params, state.opt_state, state.step)))]


def assert_unchanged(model, before):
    for a, b in zip(before, snapshot(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fit_before_compile():
    x, y = classification_data(n=8)
    model = mf.Model(MLP())
    with pytest.raises(ValueError, match=r"call `compile\(\)` before `fit\(\)`"):
        model.fit(x, y)
    with pytest.raises(ValueError, match=r"before `evaluate\(\)`"):
        model.evaluate(x, y)


def test_x_y_length_mismatch(model):
    x, y = classification_data(n=16)
    before = snapshot(model)
    with pytest.raises(ValueError, match="x has 16 samples, y has 15"):
        model.fit(x, y[:15], verbose=0)
    assert_unchanged(model, before)


def test_input_shape_the_model_rejects(model):
    x, y = classification_data(n=16, din=5)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"expected feature shape\(s\) \(None, 4\).*received \(None, 5\)"):
        model.fit(x, y, verbose=0)
    with pytest.raises(ValueError, match=r"expected feature shape"):
        model.predict(x, verbose=0)
    assert_unchanged(model, before)


def test_input_shape_rejected_on_first_call():
    x, y = classification_data(n=16, din=5)
    model = mf.Model(MLP(din=4))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"could not be called on inputs of shape \(16, 5\)"):
        model.fit(x, y, batch_size=16, verbose=0)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(optimizer="adamm"), r"Unknown optimizer name 'adamm'. Expected one of \[.*'adam'"),
        (dict(optimizer=3), r"`optimizer` must be"),
        (dict(loss="crossentropee"), r"crossentropee.*mean_squared_error|mean_squared_error.*crossentropee"),
        (dict(metrics=["acuracy"]), r"acuracy.*accuracy|accuracy.*acuracy"),
        (dict(steps_per_execution=0), r"`steps_per_execution` must be a positive int"),
        (dict(steps_per_execution=10**12), r"`steps_per_execution` must be a positive int below 2\*\*31 \(the step"),
        (dict(gradient_accumulation_steps=2**31), r"`gradient_accumulation_steps` must be .* below 2\*\*31"),
    ],
)
def test_unknown_names_list_valid_ones(model, kwargs, pattern):
    full = dict(optimizer="sgd", loss="mse")
    full.update(kwargs)
    before = snapshot(model)
    compiled = model.compile_settings
    with pytest.raises((ValueError, TypeError), match=pattern):
        model.compile(**full)
    assert model.compile_settings is compiled
    assert_unchanged(model, before)


def test_empty_datasets(model):
    before = snapshot(model)
    with pytest.raises(ValueError, match="empty.*0 samples"):
        model.fit(np.zeros((0, 4), np.float32), np.zeros((0,), np.int32), verbose=0)
    with pytest.raises(ValueError, match="dataset is empty"):
        model.fit(iter([]), verbose=0)
    assert_unchanged(model, before)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(epochs=0), r"`epochs` must be a positive int. Received: epochs=0"),
        (dict(batch_size=-1), r"`batch_size` must be a positive int"),
        (dict(verbose=3), r"`verbose` must be 'auto', 0, 1 or 2"),
        (dict(validation_split=1.5), r"`validation_split` must be in \(0, 1\)"),
        (dict(validation_data=(1, 2, 3, 4)), r"`validation_data` must be"),
        (dict(callbacks=[object()]), r"meshfit.callbacks.Callback"),
        (dict(validation_freq=0), r"`validation_freq`"),
    ],
)
def test_bad_fit_arguments(model, kwargs, pattern):
    x, y = classification_data(n=16)
    before = snapshot(model)
    with pytest.raises((ValueError, TypeError), match=pattern):
        model.fit(x, y, **kwargs)
    assert_unchanged(model, before)


def test_dataset_with_y_or_batch_size(model):
    x, y = classification_data(n=16)
    with pytest.raises(ValueError, match="`y` and `sample_weight` must be None"):
        model.fit(iter([(x, y)]), y, verbose=0)
    with pytest.raises(ValueError, match="`batch_size` must be None"):
        model.fit(iter([(x, y)]), batch_size=4, verbose=0)
    with pytest.raises(TypeError, match="Received: str"):
        model.fit("data.csv", verbose=0)


def test_fit_without_targets(model):
    x, _ = classification_data(n=16)
    with pytest.raises(ValueError, match="needs targets"):
        model.fit(x, verbose=0)


def test_non_flax_module():
    with pytest.raises(
        TypeError,
        match=r"flax.nnx.Module, a flax.linen.Module, a Keras 3 model, or a factory.*Received: module of type dict",
    ):
        mf.Model({"w": 1})


@pytest.mark.parametrize(
    "labels, says",
    [
        (np.array(["cat", "dog"] * 8), r"`y` must hold numbers.*dtype <U3 \(strings\).*np.unique"),
        (np.array([0, 1] * 8, dtype=object), r"`y` must hold numbers.*dtype object \(Python objects\)"),
    ],
)
def test_string_or_object_labels(model, labels, says):
    x, _ = classification_data(n=16)
    before = snapshot(model)
    for call in (model.fit, model.evaluate):
        with pytest.raises(TypeError, match=says):
            call(x, labels, verbose=0)
    with pytest.raises(TypeError, match=says.replace("`y`", r"`y \(a batch the dataset yielded\)`")):
        model.fit(iter([(x, labels)]), verbose=0)
    assert_unchanged(model, before)
    fresh = mf.Model(MLP())  # before anything is built: the model still builds from good data afterwards
    fresh.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    with pytest.raises(TypeError, match=says):
        fresh.fit(x, labels, verbose=0)
    assert not fresh.session.built
    fresh.fit(x, np.zeros(16, np.int32), verbose=0)


def test_string_inputs_and_non_array_x_with_y(model):
    x, y = classification_data(n=16)
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"`x` must hold numbers.*dtype <U1 \(strings\)"):
        model.predict(np.full((16, 4), "a"), verbose=0)
    with pytest.raises(TypeError, match=r"`sample_weight` must hold numbers"):
        model.fit(x, y, sample_weight=np.array(["1"] * 16), verbose=0)
    with pytest.raises(TypeError, match=r"`x` must be a numpy/JAX array.*Received: x of type list of list"):
        model.fit(x.tolist(), y, verbose=0)
    with pytest.raises(TypeError, match=r"Received: x of type dict of list"):
        model.evaluate({"a": [1.0, 2.0]}, y, verbose=0)
    with pytest.raises(TypeError, match=r"Received: x of type int"):
        model.fit(5, y, verbose=0)
    assert_unchanged(model, before)


def test_metrics_in_the_third_positional_argument_are_named_as_loss_weights():
    model = mf.Model(MLP())
    keras3 = r"since Keras 3 the third positional argument of `compile` is `loss_weights`.*metrics=\['accuracy'\]"
    for metrics in (["accuracy"], [mf.metrics.SparseCategoricalAccuracy()], {"out": ["mae", mf.metrics.AUC]}):
        with pytest.raises(TypeError, match=r"`loss_weights` must be a number.*" + keras3):
            model.compile("adam", "sparse_categorical_crossentropy", metrics)
    assert not model.compiled
    with pytest.raises(TypeError, match=r"`loss_weights` must be a number") as refused:
        model.compile("adam", "mse", [1.0, np.ones(2)])  # not metrics: no word about them
    assert "Keras 3" not in str(refused.value)


def test_a_list_of_batches_is_told_to_pass_an_iterator(model):
    x, y = classification_data(n=16)
    before = snapshot(model)
    batches = [(x[:8], y[:8]), (x[8:12], y[8:12]), (x[12:], y[12:], np.ones(4, np.float32))]
    for call in (model.fit, model.evaluate):
        with pytest.raises(ValueError, match=r"list of 3 tuples of arrays.*iter\(batches\)\), or a generator"):
            call(batches, verbose=0)
    assert_unchanged(model, before)
    same_size = [(x[:8], y[:8]), (x[8:], y[8:])]
    with pytest.raises(ValueError, match=r"model.evaluate\(iter\(batches\)\).*Received: x=list of 2 tuples"):
        model.evaluate(same_size, verbose=0)
    assert model.evaluate(iter(same_size), verbose=0) == model.evaluate(x, y, batch_size=8, verbose=0)
