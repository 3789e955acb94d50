"""A corpus of small Keras 3 programs, each run by Keras's `fit` and by meshfit's from the same weights and data.

Each program is written once against a library `lib`, `keras` or `meshfit` (the same names: `lib.losses.*`,
`lib.callbacks.*`), as a user ports one by changing the import; the model is the same Keras model, wrapped in
`mf.Model` for meshfit. Every log of every epoch (losses, metrics, `val_*`) must agree, and so must the weights.
Tiny on purpose (a few dozen rows, two or three epochs): SGD, RMSprop and Adagrad agree to 1e-5, Adam to
`ADAM_RTOL` (`keras_twins`).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from keras_twins import ADAM_RTOL, RTOL, assert_same_history, logits_loss, twins

import meshfit as mf

pytestmark = pytest.mark.slow  # a Keras fit and a meshfit fit each: a few CPU-s a program

import keras  # noqa: E402 (keras_twins set KERAS_BACKEND)

RNG = np.random.default_rng(7)


def features(rows, *shape):
    return RNG.normal(size=(rows, *shape)).astype(np.float32)


def labels(rows, classes=3):
    return RNG.integers(0, classes, rows).astype(np.int32)


class Program(NamedTuple):
    """A Keras program: `build()` its model, `compile(lib)` its arguments, `fit(lib)` its data and arguments."""

    build: Callable[[], Any]
    compile: Callable[[Any], dict]
    fit: Callable[[Any], dict]
    rtol: float = RTOL
    meshfit_class: type = mf.Model


def mlp(classes=3, features=6, dropout=0.0, batchnorm=False):
    def build():
        layers = [keras.Input((features,)), keras.layers.Dense(12, activation="relu")]
        layers += [keras.layers.BatchNormalization()] if batchnorm else []
        layers += [keras.layers.Dropout(dropout)] if dropout else []
        return keras.Sequential([*layers, keras.layers.Dense(classes)])

    return build


def two_inputs(dict_outputs=False):
    def build():
        a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
        hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(keras.layers.Concatenate()([a, b]))
        if not dict_outputs:
            return keras.Model([a, b], keras.layers.Dense(1, activation="sigmoid", name="p")(hidden))
        outputs = {"cls": keras.layers.Dense(3, name="cls")(hidden), "reg": keras.layers.Dense(1, name="reg")(hidden)}
        return keras.Model({"a": a, "b": b}, outputs)

    return build


class Residual(keras.Model):
    """A subclassed model: a residual block of its own layers."""

    def __init__(self):
        super().__init__()
        self.inner = keras.layers.Dense(6, activation="relu")
        self.head = keras.layers.Dense(3)

    def call(self, inputs, training=False):
        return self.head(inputs + self.inner(inputs))


def subclassed():
    model = Residual()
    model(np.zeros((1, 6), np.float32))  # built by a call, as Keras builds it
    return model


def conv():
    return keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


def embedding():
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(20, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )


X, Y = features(40, 6), labels(40)  # batches of 16, 16 and a partial 8
X48, Y48 = features(48, 6), labels(48)  # full batches of 16 (BatchNormalization sees no padding rows)
XA, XB, YP = features(40, 4), features(40, 3), RNG.integers(0, 2, (40, 1)).astype(np.float32)
Y2 = {"cls": labels(40), "reg": features(40, 1)}


def halve(epoch, lr):
    return lr * 0.5 if epoch else lr


class KerasOwnStep(keras.Model):
    """Keras 3's JAX-style `train_step`: `stateless_call`, `jax.value_and_grad`, `optimizer.stateless_apply`."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss_fn(trainable):
            y_pred, new_non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
            return jnp.mean(jnp.square(y_pred - y)), new_non_trainable

        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
        return {"mse": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


class MeshfitOwnStep(mf.Model):
    """The same `train_step` ported: `state` is a `meshfit.TrainState`."""

    def train_step(self, state, data):
        x, y, _ = mf.utils.unpack_x_y_sample_weight(data)

        def loss_fn(params):
            y_pred, model_state = self.stateless_call(params, state.model_state, x, training=True)
            return jnp.mean(jnp.square(y_pred - y)), model_state

        (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        params, opt_state = self.optimizer.stateless_apply(state.opt_state, grads, state.params)
        return {"mse": loss}, state._replace(params=params, model_state=model_state, opt_state=opt_state)


def own_step_model():
    inputs = keras.Input((6,))
    return KerasOwnStep(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs)))


XR, YR = features(32, 6), features(32, 1)
Y_REG = features(40, 1)
X_IMG, Y_IMG = features(24, 6, 6, 1), labels(24)
TOKENS, Y_TOK = RNG.integers(0, 20, (32, 5)).astype(np.int32), labels(32)

PROGRAMS = {
    "sequential_mlp_sgd_partial_batch": Program(
        mlp(),
        lambda lib: dict(optimizer="sgd", loss=logits_loss(lib), metrics=["accuracy"]),
        lambda lib: dict(x=X, y=Y, batch_size=16, epochs=2),
    ),
    "sequential_adam_names": Program(
        mlp(),
        lambda lib: dict(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]),
        lambda lib: dict(x=X, y=(Y[:, None] == np.arange(3)).astype(np.float32).argmax(-1), batch_size=8, epochs=2),
        rtol=ADAM_RTOL,
    ),
    "regression_rmsprop_mae": Program(
        mlp(classes=1),
        lambda lib: dict(optimizer="rmsprop", loss="mse", metrics=["mae"]),
        lambda lib: dict(x=X, y=Y_REG, batch_size=16, epochs=2),
    ),
    "functional_two_inputs_binary": Program(
        two_inputs(),
        lambda lib: dict(optimizer="adagrad", loss="binary_crossentropy", metrics=["accuracy"]),
        lambda lib: dict(x=[XA, XB], y=YP, batch_size=16, epochs=2),
    ),
    "functional_dict_inputs_two_outputs_loss_weights": Program(
        two_inputs(dict_outputs=True),
        lambda lib: dict(
            optimizer="sgd",
            loss={"cls": logits_loss(lib), "reg": "mse"},
            loss_weights={"cls": 1.0, "reg": 0.25},
            metrics={"cls": ["accuracy"], "reg": ["mae"]},
        ),
        lambda lib: dict(x={"a": XA, "b": XB}, y=Y2, batch_size=16, epochs=2),
    ),
    "subclassed_residual": Program(
        subclassed,
        lambda lib: dict(optimizer="rmsprop", loss=logits_loss(lib), metrics=["accuracy"]),
        lambda lib: dict(x=X, y=Y, batch_size=16, epochs=2),
    ),
    "sample_weight": Program(
        mlp(),
        lambda lib: dict(optimizer="sgd", loss=logits_loss(lib), weighted_metrics=["accuracy"]),
        lambda lib: dict(x=X, y=Y, sample_weight=np.linspace(0.2, 2.0, 40).astype(np.float32), batch_size=16, epochs=2),
    ),
    "class_weight": Program(
        mlp(),
        lambda lib: dict(optimizer="sgd", loss=logits_loss(lib)),
        lambda lib: dict(x=X, y=Y, class_weight={0: 1.0, 1: 2.0, 2: 0.5}, batch_size=16, epochs=2),
    ),
    "validation_data": Program(
        mlp(),
        lambda lib: dict(optimizer="sgd", loss=logits_loss(lib), metrics=["accuracy"]),
        lambda lib: dict(x=X, y=Y, validation_data=(X48[:20], Y48[:20]), batch_size=16, epochs=2),
    ),
    "callbacks_scheduler_early_stopping_terminate_on_nan": Program(
        mlp(),
        lambda lib: dict(optimizer="sgd", loss=logits_loss(lib), metrics=["accuracy"]),
        lambda lib: dict(
            x=X,
            y=Y,
            batch_size=16,
            epochs=3,
            callbacks=[
                lib.callbacks.LearningRateScheduler(halve),
                lib.callbacks.EarlyStopping(monitor="loss", patience=1),
                lib.callbacks.TerminateOnNaN(),
            ],
        ),
    ),
    "batchnorm_dropout": Program(
        mlp(dropout=0.25, batchnorm=True),
        lambda lib: dict(optimizer="rmsprop", loss=logits_loss(lib), metrics=["accuracy"]),
        lambda lib: dict(x=X48, y=Y48, batch_size=16, epochs=2),
    ),
    "keras_optimizer_object": Program(
        mlp(),
        lambda lib: dict(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True), loss=logits_loss(lib)),
        lambda lib: dict(x=X, y=Y, batch_size=16, epochs=2),
    ),
    "conv2d": Program(
        conv,
        lambda lib: dict(optimizer="sgd", loss=logits_loss(lib), metrics=["accuracy"]),
        lambda lib: dict(x=X_IMG, y=Y_IMG, batch_size=8, epochs=2),
    ),
    "embedding_pooling": Program(
        embedding,
        lambda lib: dict(optimizer="adagrad", loss=logits_loss(lib), metrics=["accuracy"]),
        lambda lib: dict(x=TOKENS, y=Y_TOK, batch_size=16, epochs=2),
    ),
    "categorical_one_hot": Program(
        mlp(),
        lambda lib: dict(
            optimizer="rmsprop", loss=lib.losses.CategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
        ),
        lambda lib: dict(x=X, y=np.eye(3, dtype=np.float32)[Y], batch_size=16, epochs=2),
    ),
    "own_train_step_jax_style": Program(
        own_step_model,
        lambda lib: dict(optimizer="sgd"),
        lambda lib: dict(x=XR, y=YR, batch_size=8, epochs=2),
        meshfit_class=MeshfitOwnStep,
    ),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_keras_and_meshfit_run_the_program_to_the_same_numbers(name):
    program = PROGRAMS[name]
    reference, ours = twins(program.build)
    reference.compile(**program.compile(keras))
    expected = reference.fit(shuffle=False, verbose=0, **program.fit(keras)).history
    model = program.meshfit_class(ours)
    model.compile(**program.compile(mf))
    history = model.fit(shuffle=False, verbose=0, **program.fit(mf)).history
    assert_same_history(expected, history, rtol=program.rtol)
    weights = {path: value for path, value in zip(model.weight_names(), model.get_weights(), strict=True)}
    tolerance = program.rtol * 30  # a few steps' rounding (Adam: its epsilon, see keras_twins)
    for variable in reference.weights:
        np.testing.assert_allclose(
            weights[variable.path], variable.value, rtol=tolerance, atol=tolerance, err_msg=variable.path
        )
