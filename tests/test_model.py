"""meshfit.Model on one device: Keras semantics, exactness, determinism, no retracing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import MLP, assert_trees_close, classification_data

import meshfit as mf
from meshfit.data import sources


def make_model(**compile_kwargs):
    model = mf.Model(MLP())
    kwargs = dict(
        optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    kwargs.update(compile_kwargs)
    model.compile(**kwargs)
    return model


def test_fit_learns_and_history_has_keras_keys():
    x, y = classification_data(n=256)
    model = make_model(optimizer=mf.optimizers.get("adam", learning_rate=1e-2))
    history = model.fit(x, y, batch_size=32, epochs=15, validation_split=0.25, verbose=0)
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history.epoch == list(range(15))
    assert all(len(v) == 15 for v in history.history.values())
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
    assert history.history["val_accuracy"][-1] > 0.85
    assert model.history is history


def manual_loss(model, x, y):
    logits = np.asarray(model.module(jnp.asarray(x)))
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    return float(-logp[np.arange(len(y)), y].mean()), float((logits.argmax(-1) == y).mean())


@pytest.mark.parametrize("batch_size", [7, 13, 50, 64])
def test_evaluate_is_exact_on_partial_batches(batch_size):
    x, y = classification_data(n=50)
    model = make_model()
    result = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    loss, accuracy = manual_loss(model, x, y)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert result["accuracy"] == pytest.approx(accuracy, abs=1e-7)


def test_evaluate_return_forms_follow_keras():
    x, y = classification_data(n=20)
    model = make_model()
    values = model.evaluate(x, y, verbose=0)
    assert isinstance(values, list) and len(values) == 2
    assert model.metrics_names == ["loss", "accuracy"]
    plain = make_model(metrics=None)
    assert isinstance(plain.evaluate(x, y, verbose=0), float)


def sgd_reference(x, y, batch_size, lr):
    """Plain JAX SGD over the same batches, partial last batch included."""
    graphdef, params = nnx.split(MLP())

    def loss_fn(p, xb, yb):
        logits = nnx.merge(graphdef, p)(xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    for start in range(0, len(x), batch_size):
        grads = jax.grad(loss_fn)(params, x[start : start + batch_size], y[start : start + batch_size])
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return nnx.to_pure_dict(params)


@pytest.mark.slow
def test_partial_last_batch_trains_exactly():
    x, y = classification_data(n=10)
    model = make_model(optimizer=optax.sgd(0.1), metrics=None)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)  # batches of 4, 4 and 2
    assert_trees_close(model.params, sgd_reference(x, y, 4, 0.1), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_same_seed_same_result_and_different_seed_differs():
    x, y = classification_data(n=100)

    def run(seed):
        model = mf.Model(MLP(dropout=0.2), seed=seed)
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=3, verbose=0)
        return model.get_weights()

    a, b, c = run(0), run(0), run(1)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)
    assert any(not np.array_equal(u, v) for u, v in zip(a, c, strict=True))


def test_steps_compile_once_across_epochs_partial_batches_and_fits():
    x, y = classification_data(n=70)
    model = make_model()
    model.fit(x, y, batch_size=16, epochs=2, validation_split=0.2, verbose=0)
    model.fit(x, y, batch_size=16, epochs=2, validation_data=(x[:9], y[:9]), verbose=0)
    model.evaluate(x[:5], y[:5], batch_size=16, verbose=0)
    compiles = model.session.executables.compilations()
    assert compiles["staged"] == 1
    assert compiles["evaluate"] == 1


def test_predict_is_exact_on_partial_batches():
    x, _ = classification_data(n=23)
    model = make_model()
    expected = np.asarray(model.module(jnp.asarray(x)))
    np.testing.assert_allclose(model.predict(x, batch_size=5, verbose=0), expected, rtol=1e-6, atol=1e-6)
    assert model.predict(x[:3], batch_size=5, verbose=0).shape == (3, 3)


def test_predict_without_compile():
    x, _ = classification_data(n=6)
    model = mf.Model(MLP())
    assert model.predict(x, verbose=0).shape == (6, 3)


def test_get_set_weights_round_trip_and_order():
    model = make_model()
    names = model.weight_names()
    assert names == ["hidden/bias", "hidden/kernel", "out/bias", "out/kernel"]
    weights = model.get_weights()
    assert [w.shape for w in weights] == [(16,), (4, 16), (3,), (16, 3)]
    new = [w + 1.0 for w in weights]
    model.set_weights(new)
    for got, want in zip(model.get_weights(), new, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(model.module.out.bias[...]), new[2])
    with pytest.raises(ValueError, match="hidden/bias.*shape"):
        model.set_weights([np.zeros(3)] + new[1:])
    with pytest.raises(ValueError, match="list of 4 arrays"):
        model.set_weights(new[:2])


def test_summary_lists_every_weight_with_totals():
    model = make_model()
    text = model.summary(print_fn=None)
    assert text.startswith(f'Model: "{type(model.module).__name__}"')
    assert "Train step" not in text  # no step is compiled before the model has seen data
    for name, shape, count in [("hidden/kernel", "(4, 16)", "64"), ("out/bias", "(3,)", "3")]:
        line = next(ln for ln in text.splitlines() if ln.startswith(name))
        assert shape in line and count in line and "float32" in line
    total = 4 * 16 + 16 + 16 * 3 + 3
    assert f"Total params: {total:,}" in text
    assert f"({total * 4} B)" in text or f"{total * 4 / 1024:.2f} KB" in text
    assert model.count_params() == total


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_sample_weight_and_class_weight():
    x, y = classification_data(n=40)
    model = make_model(metrics=None)
    weights = np.linspace(0.0, 2.0, 40).astype(np.float32)
    weighted = model.evaluate(x, y, sample_weight=weights, batch_size=7, verbose=0)
    logits = np.asarray(model.module(jnp.asarray(x)))
    per_sample = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    # Keras's sum_over_batch_size: sum(w * l) / batch size, averaged over batches weighted by size.
    expected = sum((weights[s : s + 7] * per_sample[s : s + 7]).sum() for s in range(0, 40, 7)) / 40
    assert weighted == pytest.approx(expected, rel=1e-5)
    model.fit(x, y, class_weight={0: 1.0, 1: 2.0, 2: 0.5}, batch_size=8, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="no weight for classes"):
        model.fit(x, y, class_weight={0: 1.0}, verbose=0)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_multi_input_dict_and_tuple_inputs():
    class TwoInputs(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(5, 2, rngs=nnx.Rngs(1))

        def __call__(self, inputs):
            return self.a(inputs["a"]) + self.b(inputs["b"])

    rng = np.random.default_rng(0)
    x = {"a": rng.standard_normal((30, 3), np.float32), "b": rng.standard_normal((30, 5), np.float32)}
    y = rng.standard_normal((30, 2)).astype(np.float32)
    model = mf.Model(TwoInputs())
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert model.predict(x, batch_size=8, verbose=0).shape == (30, 2)

    class Pair(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

        def __call__(self, a, b):
            return self.a(a) * b

    model = mf.Model(Pair())
    model.compile(optimizer="sgd", loss="mse")
    model.fit((x["a"], y), y, batch_size=8, epochs=1, verbose=0)


def test_generator_and_list_of_batches_inputs():
    x, y = classification_data(n=40)
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 40, 8)] + [(x[:3], y[:3])]

    class Batches:  # re-iterable (a list would be read as multi-input arrays, as in Keras)
        def __iter__(self):
            return iter(batches)

    model = make_model()
    history = model.fit(Batches(), epochs=3, verbose=0)  # a new pass each epoch
    assert len(history.history["loss"]) == 3
    # A list of batches evaluates like the arrays it holds (padding masked).
    xs = np.concatenate([b[0] for b in batches])
    ys = np.concatenate([b[1] for b in batches])
    by_list = model.evaluate(Batches(), verbose=0, return_dict=True)
    by_arrays = model.evaluate(xs, ys, batch_size=len(xs), verbose=0, return_dict=True)
    assert by_list["loss"] == pytest.approx(by_arrays["loss"], rel=1e-5)

    def gen():
        for i in range(0, 40, 8):
            yield x[i : i + 8], y[i : i + 8]

    model = make_model()
    with pytest.warns(UserWarning, match="ran out of data"):
        history = model.fit(gen(), epochs=3, verbose=0)  # a one-shot generator lasts one epoch
    assert len(history.history["loss"]) == 1
    model = make_model()
    history = model.fit((b for b in batches * 10), steps_per_epoch=4, epochs=3, verbose=0)
    assert len(history.history["loss"]) == 3


def test_grain_dataset_input():
    grain = pytest.importorskip("grain")
    x, y = classification_data(n=48)
    dataset = (
        grain.MapDataset.source([{"x": x[i], "y": y[i]} for i in range(48)]).batch(16).map(lambda b: (b["x"], b["y"]))
    )
    model = make_model()
    history = model.fit(dataset, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert model.evaluate(dataset, verbose=0, return_dict=True)["accuracy"] >= 0.0


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_linen_module_with_batchnorm_and_dropout():
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.Dense(16)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
            return nn.Dense(3)(x)

    x, y = classification_data(n=96)
    model = mf.Model(Net(), sample_input=x[:1])
    model.compile(
        optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(x, y, batch_size=16, epochs=10, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    names = model.weight_names()
    assert any(n.startswith("batch_stats/BatchNorm_0/mean") for n in names)
    moved = [not np.allclose(a, b) for a, b in zip(before, model.get_weights(), strict=True)]
    assert all(moved)  # trainable params and BatchNorm statistics both changed
    with pytest.raises(ValueError, match="sample_input"):
        mf.Model(Net())


def test_compile_accepts_names_objects_and_callables():
    x, y = classification_data(n=16)
    model = mf.Model(MLP())

    def my_loss(y_true, y_pred):
        return optax.softmax_cross_entropy_with_integer_labels(y_pred, y_true)

    model.compile(optimizer=optax.adam(1e-3), loss=my_loss, metrics=[mf.metrics.SparseCategoricalAccuracy()])
    model.fit(x, y, epochs=1, verbose=0)


def test_keras_default_optimizer_and_learning_rate_access():
    model = make_model(optimizer="sgd")
    assert model.optimizer.learning_rate == pytest.approx(0.01)
    model.optimizer.learning_rate = 0.5
    assert model.optimizer.learning_rate == pytest.approx(0.5)
    plain = make_model(optimizer=optax.sgd(0.1))
    with pytest.raises(AttributeError, match="inject_hyperparams"):
        _ = plain.optimizer.learning_rate


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_on_batch_methods_match_keras_on_the_same_weights(strategy):
    """train_on_batch / test_on_batch / predict_on_batch against Keras 3's, from the same weights."""
    keras = pytest.importorskip("keras")
    x, y = classification_data(n=30)
    scope = mf.strategies.MirroredStrategy() if strategy == "mirrored" else mf.strategies.OneDeviceStrategy()
    with scope.scope():
        model = make_model(optimizer=mf.optimizers.get("sgd", learning_rate=0.1, momentum=0.9))
    twin = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    module = model.module
    twin.set_weights(
        [np.asarray(v) for v in (module.hidden.kernel[...], module.hidden.bias[...])]
        + [np.asarray(v) for v in (module.out.kernel[...], module.out.bias[...])]
    )
    twin.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    for start in (0, 10, 20, 0):  # 10 rows: padded to 16 under 8 replicas
        rows = slice(start, start + 10)
        got, want = model.train_on_batch(x[rows], y[rows]), twin.train_on_batch(x[rows], y[rows])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.get_weights()[1], twin.get_weights()[0], rtol=1e-5, atol=1e-6)  # hidden kernel
    assert model.test_on_batch(x[:7], y[:7], return_dict=True) == pytest.approx(
        twin.test_on_batch(x[:7], y[:7], return_dict=True), rel=1e-5
    )
    np.testing.assert_allclose(model.predict_on_batch(x[:7]), twin.predict_on_batch(x[:7]), rtol=1e-5, atol=1e-6)


def test_train_on_batch_compiles_once_per_batch_shape():
    x, y = classification_data(n=40)
    model = make_model(metrics=None)
    assert isinstance(model.train_on_batch(x[:8], y[:8]), float)
    compiles = model.session.executables.compilations
    sizes = {compiles()["execution"]}  # one step per execution: the single step is the execution's
    for start in range(8, 40, 8):
        model.train_on_batch(x[start : start + 8], y[start : start + 8])
        sizes.add(compiles()["execution"])
    assert sizes == {1}
    assert model.session.step == 5
    with pytest.raises(TypeError, match="takes one batch of arrays"):
        model.train_on_batch(iter([(x, y)]))


# -- losses returning a scalar ------------------------------------------------------------------


def scalar_cross_entropy(y_true, y_pred):
    """The built-in's value as one scalar for the batch: it cannot be masked per row."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(y_pred, y_true))


BUILT_IN = mf.losses.SparseCategoricalCrossentropy(from_logits=True)


def strategy_named(name):
    return mf.strategies.MirroredStrategy() if name == "mirrored" else mf.strategies.OneDeviceStrategy()


def fit_both(run):
    """`run(loss)` with the per-sample built-in, then with its scalar twin; both results."""
    return run(BUILT_IN), run(scalar_cross_entropy)


def assert_same_training(per_sample, scalar, rtol=1e-5):
    (a, history_a), (b, history_b) = per_sample, scalar
    assert history_a.keys() == history_b.keys()
    for key in history_a:
        np.testing.assert_allclose(history_a[key], history_b[key], rtol=rtol)
    assert_trees_close(a.params, b.params, rtol=rtol, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_scalar_loss_trains_and_evaluates_as_the_per_sample_built_in(strategy):
    """70 rows in batches of 16 (a last batch of 6), validation on 37 (one of 5): the scalar is
    computed on the real rows only, so it equals the masked per-sample mean. Batches are staged on
    the devices: one device runs a stage's steps as one execution, mirrored (a batch callback) one
    by one."""
    x, y = classification_data(n=70)
    seen = mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)
    callbacks = [seen] if strategy == "mirrored" else []

    def run(loss):
        with strategy_named(strategy).scope():
            model = make_model(loss=loss)
        validation = (x[:37], y[:37])
        history = model.fit(x, y, batch_size=16, epochs=3, validation_data=validation, callbacks=callbacks, verbose=0)
        return model, history.history

    per_sample, scalar = fit_both(run)
    assert_same_training(per_sample, scalar)
    (a, _), (b, _) = per_sample, scalar
    evaluated = [m.evaluate(x[:45], y[:45], batch_size=16, verbose=0, return_dict=True) for m in (a, b)]
    assert evaluated[0] == pytest.approx(evaluated[1], rel=1e-5)
    assert a.session.executables.partial_batch_steps == []  # per-sample losses: nothing more compiled
    # Scalar: one step per partial size: training (staged) on 6 rows, validation on 5, evaluation on 13.
    assert b.session.executables.partial_batch_steps == [("evaluate", 5), ("evaluate", 13), ("staged", 6)]


@pytest.mark.slow
def test_scalar_loss_with_steps_per_execution_and_a_partial_batch_in_a_full_group():
    """120 rows in batches of 16: 8 batches, the second group of 4 holds the partial one (it runs step
    by step); evaluation's group of 3 real batches runs stacked, its partial batch alone."""
    x, y = classification_data(n=120)

    def run(loss):
        model = make_model(loss=loss, steps_per_execution=4)
        history = model.fit(x, y, batch_size=16, epochs=2, validation_data=(x[:45], y[:45]), verbose=0)
        return model, history.history

    per_sample, scalar = fit_both(run)
    assert_same_training(per_sample, scalar)
    assert scalar[0].session.executables.partial_batch_steps == [("evaluate", 13), ("train", 8)]


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 2], ids=["host-batches", "read-ahead"])
def test_scalar_loss_on_a_generator_of_ragged_batches(monkeypatch, prefetch):
    """Batches of 8, 5, 8, 3, 8, 5 rows (padded to 8): one step per distinct partial size (5 and 3)."""
    monkeypatch.setattr(sources, "PREFETCH_BATCHES", prefetch)
    sizes = [8, 5, 8, 3, 8, 5]
    x, y = classification_data(n=sum(sizes))
    ends = np.cumsum(sizes)

    class Batches:  # re-iterable: each epoch reads it anew
        def __iter__(self):
            return ((x[end - size : end], y[end - size : end]) for size, end in zip(sizes, ends, strict=True))

    def run(loss):
        model = make_model(loss=loss)
        history = model.fit(Batches(), epochs=2, validation_data=Batches(), verbose=0)
        return model, history.history

    per_sample, scalar = fit_both(run)
    assert_same_training(per_sample, scalar)
    assert scalar[0].session.executables.partial_batch_steps == [
        ("evaluate", 3),
        ("evaluate", 5),
        ("train", 3),
        ("train", 5),
    ]


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_scalar_loss_on_batch_methods_under_mirrored():
    """10 rows padded to 16 over 8 replicas: train_on_batch and test_on_batch take the real rows."""
    x, y = classification_data(n=30)
    models = []
    for loss in (BUILT_IN, scalar_cross_entropy):
        with mf.strategies.MirroredStrategy().scope():
            models.append(make_model(loss=loss))
    for start in (0, 10, 20):
        rows = slice(start, start + 10)
        got = [m.train_on_batch(x[rows], y[rows], return_dict=True) for m in models]
        assert got[0] == pytest.approx(got[1], rel=1e-5)
    assert_trees_close(models[0].params, models[1].params, rtol=1e-5)
    tested = [m.test_on_batch(x[:7], y[:7], return_dict=True) for m in models]
    assert tested[0] == pytest.approx(tested[1], rel=1e-5)
    assert models[1].session.executables.partial_batch_steps == [("evaluate", 7), ("train", 10)]


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_scalar_loss_found_after_predict_built_the_steps():
    """`predict` builds the steps without targets; the first fit finds the scalar loss and builds them again."""
    x, y = classification_data(n=70)

    def run(loss):
        model = make_model(loss=loss, metrics=None)  # ("accuracy" needs targets to resolve)
        model.predict(x[:3], verbose=0)
        return model, model.fit(x, y, batch_size=16, epochs=1, verbose=0).history

    assert_same_training(*fit_both(run))


class BackendCompiles:
    """Counts XLA compilations (JAX's backend-compile events) while entered."""

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._event)
        return self

    def _event(self, event, duration, **kwargs):
        self.count += event == "/jax/core/compile/backend_compile_duration"

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._event)


@pytest.mark.slow
def test_scalar_loss_costs_one_compilation_per_partial_size_and_data():
    """Against the per-sample built-in: one more XLA compilation for training, one for validation,
    whatever the epochs; a second fit compiles nothing."""
    x, y = classification_data(n=70)

    def fit(model, epochs):
        model.fit(x, y, batch_size=16, epochs=epochs, validation_data=(x[:37], y[:37]), verbose=0)

    fit(make_model(), 1)  # warms what every model shares
    compiles = {}
    for name, loss in (("per_sample", BUILT_IN), ("scalar", scalar_cross_entropy)):
        model = make_model(loss=loss)
        with BackendCompiles() as first:
            fit(model, 3)
        with BackendCompiles() as again:
            fit(model, 2)
        compiles[name] = (first.count, again.count)
    assert compiles["scalar"] == (compiles["per_sample"][0] + 2, 0)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_scalar_loss_matches_keras_fit_with_sample_weight():
    """Keras 3 weights a scalar loss by the batch's mean sample weight: so does meshfit, on 30 rows in
    batches of 8 (a last batch of 6)."""
    keras = pytest.importorskip("keras")
    x, y = classification_data(n=30)
    targets = np.eye(3, dtype=np.float32)[y]
    weights = np.linspace(0.5, 2.0, 30, dtype=np.float32)
    model = make_model(
        optimizer=mf.optimizers.get("sgd", learning_rate=0.1), loss=lambda t, p: jnp.mean((t - p) ** 2), metrics=None
    )
    twin = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    module = model.module
    twin.set_weights(
        [np.asarray(v) for v in (module.hidden.kernel[...], module.hidden.bias[...])]
        + [np.asarray(v) for v in (module.out.kernel[...], module.out.bias[...])]
    )
    twin.compile(optimizer=keras.optimizers.SGD(0.1), loss=lambda t, p: keras.ops.mean((t - p) ** 2))
    fit_args = dict(sample_weight=weights, batch_size=8, epochs=2, shuffle=False, verbose=0)
    ours, theirs = model.fit(x, targets, **fit_args), twin.fit(x, targets, **fit_args)
    np.testing.assert_allclose(ours.history["loss"], theirs.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(model.get_weights()[1], twin.get_weights()[0], rtol=1e-5, atol=1e-6)  # hidden kernel
    evaluated = [m.evaluate(x, targets, sample_weight=weights, batch_size=8, verbose=0) for m in (model, twin)]
    assert evaluated[0] == pytest.approx(evaluated[1], rel=1e-5)


class TwoProcesses(mf.strategies.OneDeviceStrategy):
    """One device that says it is one of two processes (what a multi-process job's strategy says)."""

    process_count = 2


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
@pytest.mark.parametrize(
    "strategy, reason",
    [
        (lambda: mf.strategies.MirroredStrategy(reduction="explicit"), "reduction='explicit'"),
        (lambda: mf.strategies.ParameterServerStrategy(workers=jax.devices()[:2]), "workers compute gradients"),
        (TwoProcesses, "job of 2 processes"),
    ],
    ids=["explicit-data-parallel", "parameter-server", "multi-process"],
)
def test_scalar_loss_is_refused_where_it_cannot_be_exact(strategy, reason):
    x, y = classification_data(n=20)
    with strategy().scope():
        model = make_model(loss=scalar_cross_entropy)
    weights = model.get_weights()
    with pytest.raises(ValueError, match=f"one value per sample.*{reason}.*Received: a loss returning a scalar"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert not model.session.built
    for before, after in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(before, after)
    model.compile(optimizer="adam", loss=BUILT_IN)  # per-sample values: accepted
    model.fit(x, y, batch_size=8, verbose=0)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_ignore_class_leaves_ignored_labels_out_of_the_loss_in_fit_and_evaluate():
    """The step combines the loss's own mask (ignored entries) with the padding mask, as calling the loss does."""
    keras = pytest.importorskip("keras")
    x, y = classification_data(n=50)
    y = y.copy()
    y[::3] = -1  # a third of the labels ignored
    loss = mf.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    model = mf.Model(MLP(din=4, hidden=16, dout=3))
    model.compile(optimizer=optax.sgd(0.1), loss=loss)
    logits = model.predict(x, verbose=0)
    direct = float(loss(y, logits))
    theirs = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)(y, logits))
    np.testing.assert_allclose(direct, theirs, rtol=1e-5)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=64, verbose=0), direct, rtol=1e-5)  # padded to 64
    history = model.fit(x, y, batch_size=50, epochs=1, shuffle=False, verbose=0).history
    np.testing.assert_allclose(history["loss"][0], direct, rtol=1e-5)  # the loss of the weights it started from


def test_an_abstract_model_holds_shapes_and_shardings_and_refuses_to_train():
    with mf.strategies.MeshStrategy(axes={"data": 1, "fsdp": 2, "tensor": 1}, devices=jax.devices()[:2]).scope():
        model = mf.Model(lambda: MLP(din=64, hidden=128), abstract=True)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    state = model.session.latest
    kernel = state.params["hidden"]["kernel"]
    assert isinstance(kernel, jax.ShapeDtypeStruct) and kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(state.opt_state))
    x, y = classification_data(n=8, din=64)
    for call in (lambda: model.fit(x, y, verbose=0), lambda: model.evaluate(x, y), lambda: model.predict(x)):
        with pytest.raises(ValueError, match="this model is abstract .* Received: Model\\(..., abstract=True\\)"):
            call()
