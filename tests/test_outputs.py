"""Multiple outputs and inputs (`meshfit.outputs`): Keras 3's per-output losses, weights, metrics and log names."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close

import meshfit as mf

S = mf.strategies
N, DIN = 100, 8  # 100 rows in batches of 32: a partial last batch of 4 rows


class TwoHeads(nnx.Module):
    """A trunk and two heads: class logits ("cls") and a regression value ("reg")."""

    def __init__(self, rngs, as_tuple=False):
        self.trunk = nnx.Linear(DIN, 16, rngs=rngs)
        self.cls = nnx.Linear(16, 3, rngs=rngs)
        self.reg = nnx.Linear(16, 1, rngs=rngs)
        self.as_tuple = as_tuple

    def __call__(self, x):
        h = nnx.relu(self.trunk(x))
        if self.as_tuple:
            return self.cls(h), self.reg(h)
        return {"cls": self.cls(h), "reg": self.reg(h)}


class TwoInputs(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(DIN, 4, rngs=rngs)
        self.b = nnx.Linear(3, 4, rngs=rngs)

    def __call__(self, image, extra):
        return self.a(image) + self.b(extra)


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, DIN)).astype(np.float32)
    y = {"cls": rng.integers(0, 3, size=(N,)), "reg": rng.normal(size=(N, 1)).astype(np.float32)}
    return x, y


def compile_kwargs(keras=None):
    cce = (keras.losses if keras else mf.losses).SparseCategoricalCrossentropy(from_logits=True)
    return {
        "loss": {"cls": cce, "reg": "mse"},
        "loss_weights": {"cls": 1.0, "reg": 0.5},
        "metrics": {"cls": ["accuracy"], "reg": ["mae"]},
    }


def keras_twin(model):
    """A Keras functional model with the same layers and weights as `TwoHeads`."""
    import keras

    inputs = keras.Input((DIN,))
    h = keras.layers.Dense(16, activation="relu", name="trunk")(inputs)
    heads = {"cls": keras.layers.Dense(3, name="cls")(h), "reg": keras.layers.Dense(1, name="reg")(h)}
    twin = keras.Model(inputs, heads)
    weights = dict(zip(model.weight_names(), model.get_weights(), strict=True))
    for layer in ("trunk", "cls", "reg"):
        twin.get_layer(layer).set_weights([weights[f"{layer}/kernel"], weights[f"{layer}/bias"]])
    return twin


@pytest.mark.slow
def test_two_output_model_matches_keras_through_fit_train_on_batch_and_evaluate():
    keras = pytest.importorskip("keras")
    x, y = data()
    model = mf.Model(TwoHeads(nnx.Rngs(0)))
    model.compile(optimizer=optax.sgd(0.1), **compile_kwargs())
    twin = keras_twin(model)
    twin.compile(optimizer=keras.optimizers.SGD(0.1), **compile_kwargs(keras))

    fit = {"batch_size": 32, "epochs": 2, "shuffle": False, "verbose": 0, "validation_split": 0.2}
    ours = model.fit(x, y, **fit).history
    theirs = twin.fit(x, y, **fit).history
    names = {"loss", "cls_loss", "reg_loss", "cls_accuracy", "reg_mae"}
    assert set(ours) == set(theirs) == names | {f"val_{name}" for name in names}
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, err_msg=key)

    batch = (x[:20], {"cls": y["cls"][:20], "reg": y["reg"][:20]})
    ours = model.train_on_batch(*batch, return_dict=True)
    theirs = twin.train_on_batch(*batch, return_dict=True)
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, err_msg=key)
    assert model.metrics_names == ["loss", "cls_loss", "reg_loss", "cls_accuracy", "reg_mae"]
    assert len(model.test_on_batch(*batch)) == 5  # [loss, *each loss, *metrics], as a list

    weights = {"cls": np.linspace(0.5, 2.0, N).astype(np.float32), "reg": np.linspace(2.0, 0.1, N).astype(np.float32)}
    ours = model.evaluate(x, y, sample_weight=weights, batch_size=32, verbose=0, return_dict=True)
    theirs = twin.evaluate(x, y, sample_weight=weights, batch_size=32, verbose=0, return_dict=True)
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-5, err_msg=key)
    final = dict(zip(model.weight_names(), model.get_weights(), strict=True))
    np.testing.assert_allclose(final["cls/kernel"], twin.get_layer("cls").get_weights()[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final["trunk/kernel"], twin.get_layer("trunk").get_weights()[0], rtol=1e-5, atol=1e-6)


def test_tuple_outputs_take_lists_and_are_named_output_i():
    """Per-output lists in output order; the loss is each output's loss times its weight, summed."""
    x, y = data()
    model = mf.Model(TwoHeads(nnx.Rngs(0), as_tuple=True))
    model.compile(
        optimizer="sgd",
        loss=[mf.losses.SparseCategoricalCrossentropy(from_logits=True), "mae"],
        loss_weights=[0.3, 2.0],
        metrics=[["accuracy"], ["mse", "mae"]],
    )
    targets = [y["cls"], y["reg"]]
    logs = model.evaluate(x, targets, batch_size=32, verbose=0, return_dict=True)
    names = ["loss", "output_0_loss", "output_1_loss", "output_0_accuracy", "output_1_mse", "output_1_mae"]
    assert model.metrics_names == names and set(logs) == set(names)
    logits, values = model.predict(x, verbose=0)
    cce = float(mf.losses.SparseCategoricalCrossentropy(from_logits=True)(y["cls"], logits))
    mae = float(np.mean(np.abs(values - y["reg"])))
    np.testing.assert_allclose(logs["output_0_loss"], cce, rtol=1e-5)
    np.testing.assert_allclose(logs["output_1_loss"], mae, rtol=1e-5)
    np.testing.assert_allclose(logs["output_1_mae"], mae, rtol=1e-5)
    np.testing.assert_allclose(logs["loss"], 0.3 * cce + 2.0 * mae, rtol=1e-5)
    np.testing.assert_allclose(logs["output_0_accuracy"], np.mean(logits.argmax(-1) == y["cls"]), rtol=1e-6)
    model.fit(x, tuple(targets), batch_size=32, verbose=0)  # a tuple of targets for tuple outputs works too


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_one_loss_for_every_output_and_outputs_without_a_loss():
    x, y = data()
    y["cls"] = np.eye(3, dtype=np.float32)[y["cls"]]
    model = mf.Model(TwoHeads(nnx.Rngs(0)))
    model.compile(optimizer="sgd", loss="mse")  # Keras: one loss, applied to each output
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    out = model.predict(x, verbose=0)
    each = {k: float(np.mean(np.mean((out[k] - y[k]) ** 2, axis=-1))) for k in ("cls", "reg")}
    np.testing.assert_allclose([logs["cls_loss"], logs["reg_loss"]], [each["cls"], each["reg"]], rtol=1e-5)
    np.testing.assert_allclose(logs["loss"], each["cls"] + each["reg"], rtol=1e-5)

    only = mf.Model(TwoHeads(nnx.Rngs(0)))
    only.compile(optimizer="sgd", loss={"reg": "mse"}, metrics={"cls": ["categorical_accuracy"]})
    logs = only.evaluate(x, y, verbose=0, return_dict=True)
    assert only.metrics_names == ["loss", "cls_categorical_accuracy"]  # one loss: no per-output loss entry
    assert set(logs) == set(only.metrics_names)
    np.testing.assert_allclose(logs["loss"], each["reg"], rtol=1e-5)
    with pytest.raises(ValueError, match="no target for the model's output 'cls'"):
        only.fit(x, {"reg": y["reg"]}, verbose=0)  # the cls metric reads cls targets
    only.compile(optimizer="sgd", loss={"reg": "mse"})
    before = only.get_weights()
    only.fit(x, {"reg": y["reg"]}, verbose=0)  # targets only for the outputs that need them...
    names = only.weight_names()
    changed = {n for n, a, b in zip(names, before, only.get_weights(), strict=True) if not np.array_equal(a, b)}
    assert changed == {"reg/kernel", "reg/bias", "trunk/kernel", "trunk/bias"}  # ...and the cls head gets no gradient


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_list_inputs_are_positional_arguments_and_dict_inputs_keywords():
    rng = np.random.default_rng(1)
    image, extra = rng.normal(size=(40, DIN)).astype(np.float32), rng.normal(size=(40, 3)).astype(np.float32)
    y = rng.normal(size=(40, 4)).astype(np.float32)
    module = TwoInputs(nnx.Rngs(0))
    expected = np.asarray(module(image, extra))
    model = mf.Model(module)
    model.compile(optimizer="sgd", loss="mse")
    for x in ([image, extra], (image, extra), {"image": image, "extra": extra}):
        np.testing.assert_allclose(model.predict(x, batch_size=16, verbose=0), expected, rtol=1e-6)
    model.fit({"extra": extra, "image": image}, y, batch_size=16, verbose=0)
    model.fit([image, extra], y, batch_size=16, verbose=0)
    trained = np.asarray(model.module(image, extra))
    np.testing.assert_allclose(model.predict_on_batch([image, extra]), trained, rtol=1e-6)


def test_a_dict_input_a_module_takes_whole_is_one_argument():
    class DictIn(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(DIN + 3, 2, rngs=rngs)

        def __call__(self, features):
            return self.dense(jnp.concatenate([features["a"], features["b"]], axis=-1))

    x = {"a": np.ones((8, DIN), np.float32), "b": np.ones((8, 3), np.float32)}
    model = mf.Model(DictIn(nnx.Rngs(0)))
    model.compile(optimizer="sgd", loss="mse")
    assert model.predict(x, verbose=0).shape == (8, 2)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("strategy", ["mirrored", "explicit"])
def test_several_outputs_under_data_parallelism_equal_one_device(strategy):
    """The explicit step sums each loss's divisor over the replicas before dividing: still one device's numbers."""
    x, y = data()
    weights = {"cls": np.linspace(0.5, 2.0, N).astype(np.float32), "reg": np.ones(N, np.float32)}
    runs = []
    reduction = "explicit" if strategy == "explicit" else "auto"
    for current in (S.OneDeviceStrategy(), S.MirroredStrategy(reduction=reduction)):
        with current.scope():
            model = mf.Model(TwoHeads(nnx.Rngs(0)))
            model.compile(optimizer="adam", **compile_kwargs())
            history = model.fit(x, y, sample_weight=weights, batch_size=20, epochs=2, shuffle=False, verbose=0)
        runs.append((model, history.history))
    (one, h_one), (many, h_many) = runs
    assert_trees_close(one.params, many.params, rtol=1e-5, atol=1e-6)
    for key in h_one:
        np.testing.assert_allclose(h_one[key], h_many[key], rtol=1e-5, err_msg=key)


def test_metric_names_are_made_unique_as_keras_does():
    x, y = data()
    model = mf.Model(TwoHeads(nnx.Rngs(0)))
    model.compile(
        optimizer="sgd",
        loss={"reg": "mse"},
        metrics={"reg": ["mae", "mae"]},
        weighted_metrics={"reg": ["mae"]},
    )
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    assert model.metrics_names == ["loss", "reg_mae", "reg_mae_1", "reg_weighted_mae"]
    assert set(logs) == set(model.metrics_names)


@pytest.mark.parametrize(
    "kwargs, y, message",
    [
        ({"loss": {"cls": "mse", "regr": "mse"}}, None, r"keys \['regr'\] that name no output.*'cls', 'reg'"),
        ({"loss": ["mse"]}, None, "one entry per output"),
        ({"loss": "mse", "loss_weights": 0.5}, None, "loss_weights.*2 outputs"),
        ({"loss": "mse", "metrics": ["mae"]}, None, "`metrics` for a model with 2 outputs"),
        ({"loss": "mse"}, {"cls": np.zeros((N, 3), np.float32)}, "no target for the model's output 'reg'"),
    ],
)
def test_per_output_arguments_that_do_not_match_the_outputs_are_refused_clearly(kwargs, y, message):
    x, targets = data()
    model = mf.Model(TwoHeads(nnx.Rngs(0)))
    model.compile(optimizer="sgd", **kwargs)
    before = model.get_weights()
    with pytest.raises(ValueError, match=message):
        model.fit(x, targets if y is None else y, verbose=0)
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_loss_weights_must_be_numbers():
    model = mf.Model(TwoHeads(nnx.Rngs(0)))
    with pytest.raises(TypeError, match="loss_weights.*numbers"):
        model.compile(optimizer="sgd", loss="mse", loss_weights={"cls": "high"})


def test_outputs_are_named_from_their_paths():
    spec = {"b": jax.ShapeDtypeStruct((2, 1), jnp.float32), "a": [jax.ShapeDtypeStruct((2,), jnp.float32)] * 2}
    names = [o.name for o in mf.outputs.outputs_of(spec)]
    assert names == ["a/0", "a/1", "b"]
    assert [o.name for o in mf.outputs.outputs_of((spec["b"], spec["b"]))] == ["output_0", "output_1"]
    assert mf.outputs.outputs_of(spec["b"]) == [mf.outputs.Output("", ())]

    class Pair(NamedTuple):
        logits: jax.Array
        value: jax.Array

    pair = Pair(jnp.zeros((2, 3)), jnp.ones((2, 1)))
    outputs = mf.outputs.outputs_of(pair)
    assert [o.name for o in outputs] == ["logits", "value"]
    assert outputs[1].of(pair) is pair.value
    assert outputs[1].of({"logits": 0, "value": 1}) == 1  # targets for them may be a dict


@pytest.mark.slow
def test_a_scalar_loss_on_one_output_equals_its_per_sample_twin():
    """A scalar loss for "reg" beside a per-sample one for "cls", with loss weights: on 100 rows in
    batches of 32 and validation on 37 (partial batches of 4 and 5) the same logs and weights as
    per-sample losses for both; the scalar one is computed on the real rows only."""
    x, y = data()

    def run(reg_loss):
        model = mf.Model(TwoHeads(nnx.Rngs(0)))
        kwargs = compile_kwargs()
        model.compile(optimizer="adam", **{**kwargs, "loss": {**kwargs["loss"], "reg": reg_loss}})
        validation = (x[:37], jax.tree.map(lambda a: a[:37], y))
        history = model.fit(x, y, batch_size=32, epochs=2, validation_data=validation, verbose=0)
        return model, history.history

    (per_sample, logs), (scalar, scalar_logs) = run("mse"), run(lambda t, p: jnp.mean(jnp.square(t - p)))
    assert logs.keys() == scalar_logs.keys()
    for key in logs:
        np.testing.assert_allclose(logs[key], scalar_logs[key], rtol=1e-5, err_msg=key)
    assert_trees_close(per_sample.params, scalar.params, rtol=1e-5, atol=1e-6)
    assert scalar.session.steps.scalar_losses == ["reg"]
    assert scalar.session.executables.partial_batch_steps == [("evaluate", 5), ("staged", 4)]
