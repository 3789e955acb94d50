"""`model.optimizer.learning_rate` with an optax schedule: read as the schedule's current value, never set."""

import numpy as np
import optax
import pytest
from helpers import MLP, classification_data

import meshfit as mf
from meshfit.optimizers import keras_adam

SCHEDULE = optax.exponential_decay(0.05, transition_steps=3, decay_rate=0.5)


def scheduled(**compile_kwargs):
    model = mf.Model(MLP())
    model.compile(
        optimizer=compile_kwargs.pop("optimizer", mf.optimizers.get("adam", learning_rate=SCHEDULE)),
        loss="sparse_categorical_crossentropy",
        **compile_kwargs,
    )
    return model


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_a_schedules_learning_rate_is_its_value_at_the_step_count_after_fit():
    x, y = classification_data(n=64)
    model = scheduled()
    assert model.optimizer.learning_rate == pytest.approx(float(SCHEDULE(0)))
    seen = []
    record = mf.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(model.optimizer.learning_rate))
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[record])
    assert model.optimizer.iterations == 12
    assert model.optimizer.learning_rate == pytest.approx(float(SCHEDULE(12)))
    assert seen == pytest.approx([float(SCHEDULE(4)), float(SCHEDULE(8)), float(SCHEDULE(12))])
    # The steps followed the schedule: the same as Keras's Adam step with it, built directly.
    reference = scheduled(optimizer=keras_adam.adam(SCHEDULE))
    reference.set_weights(scheduled().get_weights())
    reference.fit(x, y, batch_size=16, epochs=3, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_with_clipping_and_gradient_accumulation_the_schedule_counts_updates():
    x, y = classification_data(n=64)
    model = scheduled(
        optimizer=mf.optimizers.get("sgd", learning_rate=SCHEDULE, clipnorm=1.0), gradient_accumulation_steps=2
    )
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)  # 8 batches, 4 updates
    assert model.optimizer.learning_rate == pytest.approx(float(SCHEDULE(4)))


def test_a_schedule_cannot_be_set_and_callbacks_that_set_it_are_refused_before_training():
    x, y = classification_data(n=64)
    model = scheduled()
    with pytest.raises(mf.optimizers.LearningRateIsSchedule, match="optax schedule, so it cannot be set"):
        model.optimizer.learning_rate = 0.1
    before = model.get_weights()
    for callback, what in [
        (mf.callbacks.ReduceLROnPlateau(monitor="loss"), "reduced by ReduceLROnPlateau"),
        (mf.callbacks.LearningRateScheduler(lambda epoch, lr: lr), "set by LearningRateScheduler"),
    ]:
        with pytest.raises(mf.optimizers.LearningRateIsSchedule, match=f"cannot be {what}.*float learning rate"):
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[callback])
        assert model.optimizer.iterations == 0
        for a, b in zip(model.get_weights(), before, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_float_learning_rate_is_still_set_and_read():
    model = scheduled(optimizer=mf.optimizers.get("adam", learning_rate=0.01))
    assert not model.optimizer.learning_rate_is_schedule
    model.optimizer.learning_rate = 0.25
    assert model.optimizer.learning_rate == 0.25


def test_a_numpy_learning_rate_is_held_in_the_state_as_a_float_is():
    model = scheduled(optimizer=mf.optimizers.get("adam", learning_rate=np.float32(0.01)))
    assert model.optimizer.learning_rate == np.float32(0.01)
    model.optimizer.learning_rate = 0.25  # optax would have kept a numpy scalar static, out of reach
    assert model.optimizer.learning_rate == 0.25


def test_an_optimizer_reads_and_sets_the_learning_rate_through_its_state_access_alone():
    """No session: whatever holds the optimizer state hands the `Optimizer` four functions."""
    tx = mf.optimizers.get("sgd", learning_rate=0.1)
    held = {"opt_state": tx.init({"w": np.zeros(3, np.float32)})}
    access = mf.optimizers.OptimizerStateAccess(
        opt_state=lambda: held["opt_state"],
        replace_opt_state=lambda opt_state: held.update(opt_state=opt_state),
        step=lambda: np.int32(7),
        to_host=np.asarray,
    )
    optimizer = mf.optimizers.Optimizer(tx, access)
    assert optimizer.learning_rate == pytest.approx(0.1)
    optimizer.learning_rate = 0.025
    assert float(held["opt_state"].hyperparams["learning_rate"]) == pytest.approx(0.025)
    assert optimizer.learning_rate == pytest.approx(0.025) and optimizer.iterations == 7


# -- Keras's optimizer classes: the same steps as keras.optimizers on the same gradients ----------------

KERAS_CASES = [
    ("Adam", dict(learning_rate=0.01)),
    ("Adam", dict(learning_rate=0.01, weight_decay=0.1, clipnorm=0.5)),
    ("Adam", dict(learning_rate=0.01, amsgrad=True)),
    ("AdamW", dict(learning_rate=0.01)),
    ("AdamW", dict(learning_rate=0.01, weight_decay=0.1, amsgrad=True)),
    ("SGD", dict()),
    ("SGD", dict(learning_rate=0.1, momentum=0.9)),
    ("SGD", dict(learning_rate=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, global_clipnorm=0.5)),
    ("RMSprop", dict(learning_rate=0.01)),
    ("RMSprop", dict(learning_rate=0.01, momentum=0.5, centered=True, weight_decay=0.05)),
    ("Adagrad", dict(learning_rate=0.1, clipvalue=0.2)),
]


@pytest.mark.parametrize("name, kwargs", KERAS_CASES)
def test_keras_optimizer_classes_take_the_steps_keras_takes(name, kwargs):
    import jax.numpy as jnp
    import keras

    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(4, 3)).astype("float32")
    # Small gradients too: where Keras's and optax's Adam differ (where each adds epsilon).
    grads = [rng.normal(size=(4, 3)).astype("float32") * (0.3 if i % 2 else 1e-3) for i in range(6)]
    variable = keras.Variable(w0.copy())
    reference = getattr(keras.optimizers, name)(**kwargs)
    reference.build([variable])
    tx = getattr(mf.optimizers, name)(**kwargs)
    params = {"w": jnp.asarray(w0)}
    state = tx.init(params)
    for g in grads:
        reference.apply_gradients([(jnp.asarray(g), variable)])
        updates, state = tx.update({"w": jnp.asarray(g)}, state, params)
        params = optax.apply_updates(params, updates)
    assert np.abs(np.asarray(variable.value) - w0).max() > 5e-3  # the steps moved the weights
    np.testing.assert_allclose(np.asarray(params["w"]), np.asarray(variable.value), rtol=1e-5, atol=1e-6)


def test_a_keras_optimizer_object_compiles_saves_and_loads_as_its_name(tmp_path):
    x, y = classification_data(n=64)
    model = mf.Model(MLP())
    model.compile(optimizer=mf.optimizers.Adam(3e-3, weight_decay=0.01), loss="sparse_categorical_crossentropy")
    assert model.optimizer.learning_rate == pytest.approx(3e-3)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    record = model.get_compile_config()["optimizer"]
    assert record["name"] == "adam" and record["config"]["weight_decay"] == 0.01
    model.save(tmp_path / "m")
    loaded = mf.load_model(tmp_path / "m", MLP())
    assert mf.optimizers.recipe_of(loaded.compile_settings.tx) == mf.optimizers.recipe_of(model.compile_settings.tx)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_keras_optimizer_arguments_are_checked():
    with pytest.raises(ValueError, match="weight_decay"):
        mf.optimizers.SGD(weight_decay=-1.0)
    with pytest.raises(ValueError, match="momentum"):
        mf.optimizers.SGD(momentum=2.0)
