"""Keras 3 models built twice from one seed: one trained by Keras's `fit`, one by meshfit's, numbers compared.

Keras numbers the layers it names (`dense`, `dense_1`, ...) across a process; each twin is built after
`keras.backend.clear_session()`, so both have the paths a fresh process gives (and so does a model rebuilt
to load a save or resume a backup).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import meshfit as mf  # noqa: E402

#: Keras's fit and meshfit's agree to this under SGD, RMSprop and Adagrad.
RTOL, ATOL = 1e-5, 1e-6
#: ... and under Adam (meshfit's "adam" takes Keras's own step: `meshfit.optimizers.keras_adam`).
ADAM_RTOL = RTOL


def fresh(build, seed=0):
    """`build()` as a fresh process builds it: Keras's layer names restarted, its random seed set."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    return build()


def twins(build, seed=0):
    """Two models from `build` with the same paths, initial weights and seed generator states."""
    return fresh(build, seed), fresh(build, seed)


def logits_loss(lib):
    """Sparse categorical cross-entropy from logits, of Keras or of meshfit (`lib`)."""
    return lib.losses.SparseCategoricalCrossentropy(from_logits=True)


def fit_twins(build, x, y, optimizer="adam", rtol=ADAM_RTOL):
    """Twins of `build` compiled alike (logits cross-entropy, accuracy) and fit 2 epochs of batches of 16 in
    order, one by Keras, one wrapped in `meshfit.Model`; their histories asserted equal. Returns both models."""
    reference, ours = twins(build)
    reference.compile(optimizer=optimizer, loss=logits_loss(keras), metrics=["accuracy"])
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    model = mf.Model(ours)
    model.compile(optimizer=optimizer, loss=logits_loss(mf), metrics=["accuracy"])
    assert_same_history(expected, model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history, rtol)
    return reference, model


def assert_same_history(keras_history: dict, meshfit_history: dict, rtol=RTOL, atol=ATOL):
    """Every log Keras's fit wrote, per epoch, equal in meshfit's (which must log it too)."""
    missing = sorted(set(keras_history) - set(meshfit_history))
    assert not missing, f"meshfit did not log {missing}; it logged {sorted(meshfit_history)}"
    for key, values in keras_history.items():
        np.testing.assert_allclose(meshfit_history[key], values, rtol=rtol, atol=atol, err_msg=key)


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(keras.tree.flatten(a), keras.tree.flatten(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def mlp(classes=3, width=16, features=6):
    return keras.Sequential(
        [keras.Input((features,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(classes)]
    )


def classification(rows=50, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, features)).astype(np.float32), rng.integers(0, classes, rows).astype(np.int32)
