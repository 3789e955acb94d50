"""Keras 3 models trained by meshfit (`meshfit.steps.keras_module`): Keras's own numbers, its files, its errors."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from keras_twins import (
    ADAM_RTOL,
    assert_same_history,
    assert_trees_close,
    classification,
    fit_twins,
    fresh,
    logits_loss,
    mlp,
    twins,
)
from processes import LAUNCH, Job

import meshfit as mf

os.environ.setdefault("KERAS_BACKEND", "jax")
import keras  # noqa: E402

XENT = "sparse_categorical_crossentropy"


def bn_dropout():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(3),
        ]
    )


@pytest.mark.slow  # a process of its own that imports JAX and Flax
@pytest.mark.processes
def test_import_meshfit_does_not_import_keras():
    code = (  # a Flax model's fit, evaluate and predict, in a fresh interpreter
        "import sys, meshfit as mf, numpy as np\n"
        "from flax import nnx\n"
        "x, y = np.ones((10, 2), np.float32), np.ones((10, 1), np.float32)\n"
        "model = mf.Model(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))\n"
        "model.compile(optimizer=mf.optimizers.Adam(), loss='mse', metrics=['mae'])\n"
        "model.fit(x, y, batch_size=4, epochs=2, validation_split=0.2, verbose=0)\n"
        "model.evaluate(x, y, batch_size=4, verbose=0)\n"
        "model.predict(x, batch_size=4, verbose=0)\n"
        "imported = sorted(m for m in sys.modules if m == 'keras' or m.startswith('keras.'))\n"
        "print('ok' if not imported else imported[:5])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_a_sequential_model_gives_kerass_losses_metrics_evaluate_and_predict_with_a_partial_last_batch():
    x, y = classification(rows=50)  # batches of 16, 16, 16 and 2
    reference, model = fit_twins(mlp, x, y)
    reference.set_weights(model.module.get_weights())  # the same weights: evaluate and predict as Keras does
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0), rtol=1e-6)
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    assert model.weight_names()[:2] == ["sequential/dense/bias", "sequential/dense/kernel"]


def two_inputs_two_outputs():
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(keras.layers.Concatenate()([a, b]))
    outputs = {"cls": keras.layers.Dense(3, name="cls")(hidden), "reg": keras.layers.Dense(1, name="reg")(hidden)}
    return keras.Model([a, b], outputs)


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_a_functional_model_with_two_inputs_and_two_weighted_outputs_gives_kerass_numbers():
    rng = np.random.default_rng(1)
    xa, xb = rng.normal(size=(40, 4)).astype(np.float32), rng.normal(size=(40, 3)).astype(np.float32)
    y = {"cls": rng.integers(0, 3, 40).astype(np.int32), "reg": rng.normal(size=(40, 1)).astype(np.float32)}
    reference, ours = twins(two_inputs_two_outputs)

    def compile_args(lib):
        return dict(
            optimizer="adam",
            loss={"cls": logits_loss(lib), "reg": "mse"},
            loss_weights={"cls": 1.0, "reg": 0.5},
            metrics={"reg": ["mae"]},
        )

    reference.compile(**compile_args(keras))
    expected = reference.fit([xa, xb], y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    model = mf.Model(ours)
    model.compile(**compile_args(mf))
    history = model.fit([xa, xb], y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert_same_history(expected, history, rtol=ADAM_RTOL)
    reference.set_weights(model.module.get_weights())
    assert_trees_close(model.predict([xa, xb], verbose=0), reference.predict([xa, xb], verbose=0))
    evaluated = model.evaluate([xa, xb], y, batch_size=16, verbose=0, return_dict=True)  # 16, 16 and 8 rows
    expected = reference.evaluate([xa, xb], y, batch_size=16, verbose=0, return_dict=True)
    assert sorted(evaluated) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(evaluated[key], value, rtol=1e-6, err_msg=key)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(3)

    def call(self, inputs, training=False):
        return self.out(self.hidden(inputs))


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_an_unbuilt_subclassed_model_is_refused_or_built_from_sample_input_and_gives_kerass_numbers():
    x, y = classification(rows=40)
    with pytest.raises(ValueError, match=r"is not built.*model.build\(input_shape\).*sample_input=x\[:1\]"):
        mf.Model(fresh(Subclassed))
    reference, ours = twins(Subclassed)
    reference.compile(optimizer="sgd", loss=logits_loss(keras))
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    model = mf.Model(ours, sample_input=x[:1])
    model.compile(optimizer="sgd", loss=logits_loss(mf))
    assert_same_history(expected, model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history)


class TrainingWithoutDefault(keras.Model):
    """A subclassed model whose `call` requires `training` (Keras's fit passes it) and gives it to its dropout."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.dropout = keras.layers.Dropout(0.3)
        self.out = keras.layers.Dense(3)

    def call(self, inputs, training):
        return self.out(self.dropout(self.hidden(inputs), training=training))


def training_without_default():
    model = TrainingWithoutDefault()
    model(np.zeros((1, 6), np.float32), training=False)  # built by a call, as Keras builds it
    return model


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_a_subclassed_model_requiring_training_trains_under_adam_to_kerass_history_evaluate_and_predict():
    x, y = classification(rows=40)  # batches of 16, 16 and a partial 8
    reference, model = fit_twins(training_without_default, x, y)  # dropout's masks of training=True, as Keras's
    # The models as each fit left them: evaluate and predict (training=False: no dropout) agree too.
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=16, verbose=0), reference.evaluate(x, y, batch_size=16, verbose=0), rtol=1e-5
    )
    predicted = model.predict(x, batch_size=16, verbose=0)
    np.testing.assert_array_equal(predicted, model.predict(x, batch_size=16, verbose=0))
    np.testing.assert_allclose(predicted, reference.predict(x, batch_size=16, verbose=0), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def trained_bn_dropout():
    """A BatchNormalization and Dropout model trained by Keras and by meshfit, from one seed."""
    x, y = classification(rows=48)
    reference, ours = twins(bn_dropout)
    initial_mean = np.asarray(ours.layers[1].moving_mean.value).copy()
    reference.compile(optimizer="rmsprop", loss=logits_loss(keras), metrics=["accuracy"])
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    model = mf.Model(ours)
    model.compile(optimizer="rmsprop", loss=logits_loss(mf), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    return x, y, reference, model, expected, history, initial_mean


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_batchnorm_statistics_and_dropout_masks_follow_kerass(trained_bn_dropout):
    x, _, reference, model, expected, history, initial_mean = trained_bn_dropout
    assert_same_history(expected, history)
    names = model.weight_names()
    mean = model.get_weights()[names.index("sequential/batch_normalization/moving_mean")]
    assert np.abs(mean - initial_mean).max() > 1e-3  # it moved
    np.testing.assert_allclose(mean, reference.layers[1].moving_mean.value, rtol=1e-5, atol=1e-6)
    first = model.predict(x, verbose=0)
    np.testing.assert_array_equal(first, model.predict(x, verbose=0))  # no dropout in inference
    np.testing.assert_allclose(first, reference.predict(x, verbose=0), rtol=1e-5, atol=1e-5)
    assert "seed_generator/seed_generator_state" not in names  # model state, not a weight
    assert set(model.session.state.model_state) == {"weights", "rngs"}


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_the_keras_model_holds_the_trained_values_and_saves_as_keras_loads_it(trained_bn_dropout, tmp_path):
    x, _, _, model, _, _, _ = trained_bn_dropout
    keras_model = model.module
    assert isinstance(keras_model, keras.Sequential)
    expected = model.predict(x, verbose=0)
    np.testing.assert_allclose(keras_model.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)
    keras_model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(model.predict(x, verbose=0), expected)  # Keras's predict donated only its copies


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_save_and_load_model_round_trip_and_export(trained_bn_dropout, tmp_path):
    x, y, _, model, _, _, _ = trained_bn_dropout
    model.save(tmp_path / "saved")
    loaded = mf.load_model(tmp_path / "saved", fresh(bn_dropout, seed=5))  # other initial values, same paths
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert loaded.evaluate(x, y, verbose=0) == model.evaluate(x, y, verbose=0)
    model.export(tmp_path / "export")
    exported = jax.export.deserialize(open(tmp_path / "export" / "forward.jax", "rb").read())
    stored = np.load(tmp_path / "export" / "weights.npz")
    served = exported.call([stored[f"w{i}"] for i in range(len(stored.files))], x[:5])
    np.testing.assert_allclose(np.asarray(served), model.predict(x[:5], verbose=0), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_backup_and_restore_resumes_a_batchnorm_dropout_model_bitwise_mid_epoch(tmp_path):
    x, y = classification(rows=48)

    class Crash(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.context.step == 4:  # epoch 2, batch 2 of 3
                raise RuntimeError("simulated crash")

    def fit(backup, callbacks=()):
        model = mf.Model(fresh(bn_dropout), seed=3)
        model.compile(optimizer="adam", loss=logits_loss(mf), metrics=["accuracy"])
        saver = mf.callbacks.BackupAndRestore(backup, save_freq=1)
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[*callbacks, saver])
        return model, history.history

    full, full_history = fit(tmp_path / "full")
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(tmp_path / "resumed", [Crash()])
    resumed, resumed_history = fit(tmp_path / "resumed")
    assert resumed_history == full_history  # epoch 1's logs restored with the History, epochs 2 and 3 trained
    for name, a, b in zip(full.weight_names(), full.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    jax.tree.map(np.testing.assert_array_equal, full.session.state.model_state, resumed.session.state.model_state)


def wide():
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(3)])


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_mirrored_fsdp8_and_a_sync_parameter_server_give_one_devices_losses_and_fsdp_shards_a_dense_kernel():
    x, y = classification(rows=64, features=64)
    histories, kernels = {}, {}
    for name, strategy in {
        "one": mf.strategies.OneDeviceStrategy(),
        "mirrored": mf.strategies.MirroredStrategy(),
        "fsdp8": mf.strategies.MeshStrategy(axes={"fsdp": 8}),
        "parameter_server": mf.strategies.ParameterServerStrategy(mode="sync", workers=jax.devices()[:4]),
    }.items():
        with strategy.scope():
            model = mf.Model(fresh(wide))
            model.compile(optimizer="adam", loss=logits_loss(mf), metrics=["accuracy"])
            histories[name] = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        kernels[name] = model.params["sequential"]["dense"]["kernel"]
    for name in ("mirrored", "fsdp8", "parameter_server"):
        assert_same_history(histories["one"], {k: v for k, v in histories[name].items() if "staleness" not in k})
    assert kernels["fsdp8"].sharding.spec == jax.sharding.PartitionSpec("fsdp")  # 64 x 64: 4,096 elements
    assert kernels["mirrored"].sharding.is_fully_replicated


@pytest.mark.slow  # a worker thread per device, each compiling the step: several CPU-s
def test_an_async_parameter_server_trains_a_keras_model_and_its_module_holds_the_trained_values():
    x, y = classification(rows=64)
    with mf.strategies.ParameterServerStrategy(mode="async", workers=jax.devices()[:2]).scope():
        model = mf.Model(fresh(bn_dropout))
        model.compile(optimizer="adam", loss=logits_loss(mf), metrics=["accuracy"])
    names = model.weight_names()
    mean = names.index("sequential/batch_normalization/moving_mean")
    before = model.get_weights()
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0).history
    assert {"loss", "accuracy", "staleness", "max_staleness"} <= set(history)
    assert np.isfinite(history["loss"]).all()
    after = model.get_weights()
    for name, a, b in zip(names, before, after, strict=True):
        assert np.abs(a - b).max() > 0, name  # every weight trained, the moving statistics moved
    assert np.abs(after[mean] - before[mean]).max() > 1e-3
    np.testing.assert_allclose(model.module.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)


KERAS_PS_WORKER = os.path.join(os.path.dirname(__file__), "..", "workers", "train_keras_ps.py")


@pytest.mark.slow  # two launches of a server and two worker processes
@pytest.mark.processes
def test_launched_parameter_server_workers_train_a_keras_model_sync_to_one_devices_losses_and_async(tmp_path):
    sys.path.insert(0, os.path.dirname(KERAS_PS_WORKER))
    from train_keras_ps import build, data

    x, y = data()
    keras.backend.clear_session()
    with mf.strategies.OneDeviceStrategy().scope():
        model = mf.Model(build())
        model.compile(optimizer="adam", loss=logits_loss(mf))
    expected = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    histories = {}
    for mode in ("sync", "async"):
        out = tmp_path / f"{mode}.json"
        argv = LAUNCH + ["--ps", "1", "--workers", "2", KERAS_PS_WORKER, str(out), "--mode", mode]
        with Job(argv, timeout=240) as job:
            status = job.finish()
        said = job.stdout + job.stderr
        assert status == 0, said[-3000:]
        assert said.count("parameter-server worker pid") == 2, said[-3000:]  # both worker processes computed
        histories[mode] = json.loads(out.read_text())
    assert_same_history(expected, {"loss": histories["sync"]["loss"]})
    assert np.isfinite(histories["async"]["loss"]).all() and "staleness" in histories["async"]


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_a_layout_map_as_rules_shards_the_kernels_as_it_says_and_gives_one_devices_losses():
    x, y = classification(rows=40, features=8)  # batches of 16, 16 and a partial 8
    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((2, 4), ["fsdp", "tensor"]))
    layout_map["dense/kernel"] = ("fsdp", "tensor")  # 8 x 16
    layout_map["dense_1/kernel"] = ("tensor", None)  # 16 x 3
    histories, params = {}, {}
    for name, strategy in {
        "one": mf.strategies.OneDeviceStrategy(),
        "layout_map": mf.strategies.MeshStrategy(axes={"fsdp": 2, "tensor": 4}, rules=layout_map),
    }.items():
        with strategy.scope():
            model = mf.Model(fresh(lambda: mlp(width=16, features=8)))
            model.compile(optimizer="adam", loss=logits_loss(mf), metrics=["accuracy"])
        histories[name] = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        params[name] = model.params["sequential"]
    assert params["layout_map"]["dense"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert params["layout_map"]["dense_1"]["kernel"].sharding.spec == jax.sharding.PartitionSpec("tensor")
    assert params["layout_map"]["dense"]["bias"].sharding.is_fully_replicated  # no key: meshfit's default
    assert_same_history(histories["one"], histories["layout_map"])
    keras_names = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((2, 4), ["batch", "model"]))
    keras_names["dense/kernel"] = (None, "model")
    with pytest.raises(ValueError, match=r"LayoutMap key 'dense/kernel'.*axis 'model'.*axes \('fsdp', 'tensor'\)"):
        mf.strategies.MeshStrategy(axes={"fsdp": 2, "tensor": 4}, rules=keras_names)


@pytest.mark.slow  # compiles Keras's steps and meshfit's: several CPU-s
def test_a_keras_optimizer_object_is_its_meshfit_name_and_others_are_refused_by_name():
    x, y = classification(rows=32)
    models = []
    for optimizer in (keras.optimizers.Adam(learning_rate=3e-3), mf.optimizers.Adam(learning_rate=3e-3)):
        model = mf.Model(fresh(mlp))
        model.compile(optimizer=optimizer, loss=logits_loss(mf))
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        models.append(model)
    for a, b in zip(models[0].get_weights(), models[1].get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert models[0].get_compile_config()["optimizer"] == models[1].get_compile_config()["optimizer"]
    with pytest.raises(TypeError, match=r"keras.optimizers.Nadam.*meshfit.optimizers.get\('nadam', ...\)"):
        models[0].compile(optimizer=keras.optimizers.Nadam(), loss=XENT)
    with pytest.raises(ValueError, match=r"use_ema"):
        models[0].compile(optimizer=keras.optimizers.Adam(use_ema=True), loss=XENT)


class TwoArguments(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, a, b):
        return self.dense(a) + b


class NoJit(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.supports_jit = False

    def call(self, x):
        return x


class SameNames(keras.Model):
    def __init__(self):
        super().__init__()
        self.first, self.second = keras.layers.Dense(2, name="d"), keras.layers.Dense(2, name="d")

    def call(self, x):
        return self.second(self.first(x))


def test_models_meshfit_cannot_train_are_refused_by_name_before_any_step():
    with pytest.raises(ValueError, match=r"several variables with the path 'same_names/d/bias'.*distinct names"):
        mf.Model(fresh(SameNames), sample_input=np.zeros((1, 2), np.float32))
    with pytest.raises(TypeError, match=r"requires \['a', 'b'\].*call\(self, inputs\)"):
        mf.Model(fresh(TwoArguments), sample_input=[np.zeros((1, 3), np.float32), np.zeros((1, 2), np.float32)])
    with pytest.raises(ValueError, match=r"layer 'no_jit' \(NoJit\).*supports_jit=False"):
        mf.Model(fresh(lambda: keras.Sequential([keras.Input((3,)), NoJit(), keras.layers.Dense(2)])))
    with pytest.raises(TypeError, match=r"layer.trainable = False"):
        mf.Model(fresh(mlp), trainable=lambda path, value: True)
    regularized = mf.Model(
        fresh(lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_regularizer="l2")]))
    )
    regularized.compile(optimizer="sgd", loss="mse")
    before = regularized.get_weights()
    with pytest.raises(ValueError, match=r"adds losses of its own \(a kernel_regularizer"):
        regularized.fit(np.ones((4, 3), np.float32), np.ones((4, 2), np.float32), epochs=1, verbose=0)
    for a, b in zip(before, regularized.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"computes in its layers' own dtype policy"):
        model = mf.Model(fresh(mlp))
        model.compile(optimizer="sgd", loss=XENT, dtype_policy="mixed_bfloat16")
        model.fit(*classification(rows=8), epochs=1, verbose=0)


def test_a_keras_layer_jax_cannot_trace_is_refused_naming_it_and_the_input_pipeline():
    crop = keras.layers.RandomCrop(4, 4)
    assert crop.supports_jit is False  # as Keras marks it (with RandomZoom, RandomTranslation, the lookups, ...)
    with pytest.raises(
        ValueError,
        match=r"layer 'random_crop' \(RandomCrop\).*supports_jit=False: jax.jit cannot trace it.*"
        r"in the input pipeline before fit",
    ):
        mf.Model(fresh(lambda: keras.Sequential([keras.Input((8, 8, 3)), crop, keras.layers.Flatten()])))


def step_override(name):
    """A Sequential whose class overrides the Keras step method `name`, as a Keras 3 program does."""

    def override(self, *args, **kwargs):
        raise AssertionError(f"meshfit called Keras's {name}")

    cls = type(f"Own{name.title().replace('_', '')}", (keras.Sequential,), {name: override})
    return cls([keras.Input((3,)), keras.layers.Dense(2)])


class PortedTrainStep(mf.Model):
    """A meshfit model whose own train_step ports a Keras model's (the corpus's `MeshfitOwnStep` runs one)."""

    def train_step(self, state, data):
        return super().train_step(state, data)


def test_a_keras_step_override_meshfit_would_not_call_is_refused_naming_the_class_and_the_method():
    for name in ("train_step", "test_step", "predict_step", "compute_loss"):
        model = fresh(lambda: step_override(name))  # noqa: B023 (called at once)
        cls = type(model).__name__
        with pytest.raises(TypeError, match=rf"class {cls} overrides {name}, which meshfit never calls.*mf.Model"):
            mf.Model(model)
    PortedTrainStep(fresh(lambda: step_override("train_step")))  # ported: the meshfit class overrides it too
    with pytest.raises(TypeError, match=r"overrides test_step"):
        PortedTrainStep(fresh(lambda: step_override("test_step")))
    mf.Model(fresh(mlp))  # Sequential's own methods are keras.Model's


def test_a_stage_axis_refuses_a_keras_model_naming_it_and_what_works():
    with mf.strategies.MeshStrategy(axes={"stage": 2, "data": 4}).scope():
        with pytest.raises(
            ValueError,
            match=r"Keras model 'sequential' \(Sequential\) cannot run pipelined over MeshStrategy's 'stage' axis "
            r"\(size 2\).*meshfit.pipeline.Stages.*'data', 'fsdp' and 'tensor' axes",
        ):
            mf.Model(fresh(mlp))


@pytest.mark.slow  # compiles two train steps: a few CPU-s
def test_plan_refuses_a_keras_model_naming_what_it_takes_and_step_report_costs_its_step_on_one_device_and_a_mesh():
    x, y = classification(rows=16, features=64)
    compile_args = dict(optimizer="adam", loss=logits_loss(mf))
    for given, received in ((fresh(wide), "Sequential"), (wide, "a factory returning Sequential")):
        with pytest.raises(
            TypeError,
            match=rf"meshfit.plan takes a factory of a Flax module.*Received: {received}.*"
            r"step_report\(x, y\)",
        ):
            mf.plan(given, x, y, compile=compile_args, verbose=0)
    reports = {}
    for name, strategy in {
        "one": mf.strategies.OneDeviceStrategy(),
        "fsdp8": mf.strategies.MeshStrategy(axes={"fsdp": 8}),
    }.items():
        with strategy.scope():
            model = mf.Model(fresh(wide))
            model.compile(**compile_args)
        reports[name] = model.step_report(x, y)
    assert reports["one"].num_devices == 1 and reports["fsdp8"].num_devices == 8
    assert reports["one"].flops > 2 * 16 * 64 * 64  # the first Dense's forward matmul, at least
    assert not reports["one"].collectives and reports["fsdp8"].collectives  # FSDP gathers the sharded kernel
    assert reports["fsdp8"].memory["arguments"] < reports["one"].memory["arguments"]  # a shard of the state each


@pytest.mark.slow  # a process of its own, importing Keras under another backend
@pytest.mark.processes
def test_a_keras_model_under_another_backend_is_refused_naming_keras_backend():
    code = (
        "import keras, meshfit as mf\n"
        "model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "try:\n    mf.Model(model)\nexcept ValueError as e:\n    print(e)\n"
    )
    env = dict(os.environ, KERAS_BACKEND="numpy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert "keras.backend.backend()='numpy'" in result.stdout and "KERAS_BACKEND=jax" in result.stdout, result.stderr


KERAS_WORKER = os.path.join(os.path.dirname(__file__), "..", "workers", "train_keras_resumable.py")


def run_keras_worker(out, backup, *args, kill_at=None):
    """Runs the Keras worker; with `kill_at`, SIGKILLs it when it prints that step. Returns (status, output)."""
    with Job([sys.executable, KERAS_WORKER, str(out), str(backup), *args], timeout=240) as job:
        if kill_at is not None:
            job.wait_for(rf"step {kill_at}$")
            job.proc.send_signal(signal.SIGKILL)
        status = job.finish()
    return status, job.stdout + job.stderr


@pytest.fixture(scope="module")
def uninterrupted_keras_job(tmp_path_factory):
    """The Keras worker's run, never killed: what every resumed run must end as."""
    base = tmp_path_factory.mktemp("keras_full")
    status, output = run_keras_worker(base / "full", base / "full-backup")
    assert status == 0, output
    return base / "full"


def assert_same_keras_run(a, b):
    expected, got = np.load(a / "weights.npz"), np.load(b / "weights.npz")
    assert expected.files == got.files
    for name in expected.files:  # weights, BatchNormalization statistics, the dropout seed state: bitwise
        np.testing.assert_array_equal(expected[name], got[name], err_msg=name)
    assert (a / "history.json").read_text() == (b / "history.json").read_text()


@pytest.mark.slow  # three processes, each importing Keras and compiling
@pytest.mark.processes
def test_a_keras_job_sigkilled_mid_epoch_resumes_bitwise_equal_to_an_uninterrupted_one(
    tmp_path, uninterrupted_keras_job
):
    status, output = run_keras_worker(tmp_path / "out", tmp_path / "backup", "--slow", "0.05", kill_at=6)
    assert status == -signal.SIGKILL, output  # epoch 2 of 3, batch 2 of 4
    status, output = run_keras_worker(tmp_path / "out", tmp_path / "backup")
    assert status == 0, output
    assert "BackupAndRestore: resumed" in output
    assert_same_keras_run(uninterrupted_keras_job, tmp_path / "out")


@pytest.mark.slow  # a launch: a fork server and its two starts
@pytest.mark.processes
def test_a_killed_keras_job_resumes_from_the_launchers_memory_snapshot_bitwise(tmp_path, uninterrupted_keras_job):
    """Memory snapshots every 2 steps, no disk backup within the run; the rank SIGKILLs itself at step 9: the
    restart resumes from the launcher's memory and ends bitwise equal to the uninterrupted run."""
    argv = LAUNCH + [
        "--nprocs",
        "1",
        "--max-restarts",
        "1",
        KERAS_WORKER,
        str(tmp_path / "out"),
        str(tmp_path / "backup"),
    ]
    with Job(argv + ["--save-freq", "1000", "--memory-freq", "2", "--die-at-step", "9"], timeout=240) as job:
        status = job.finish()
    said = job.stdout + job.stderr
    assert status == 0, said[-3000:]
    assert "restarting the job (1/1)" in job.stderr, said[-3000:]
    assert "BackupAndRestore: resumed from the launcher's memory snapshot" in job.stdout, said[-3000:]
    assert_same_keras_run(uninterrupted_keras_job, tmp_path / "out")
