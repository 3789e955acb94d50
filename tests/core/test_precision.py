"""Dtype policies, loss scaling, gradient accumulation and clipping (`core.precision`, `compile`, `optimizers`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import MLP, classification_data
from sklearn.datasets import load_digits

import meshfit as mf
from meshfit.core import precision


def digits():
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x = (data.data[order] / 16.0).astype(np.float32)
    y = data.target[order].astype(np.int32)
    return x[:1500], y[:1500], x[1500:], y[1500:]


class DigitsMLP(nnx.Module):
    def __init__(self, *, rngs):
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def fit_digits(policy):
    x, y, x_test, y_test = digits()
    model = mf.Model(DigitsMLP(rngs=nnx.Rngs(0)))
    model.compile(
        optimizer="adam",
        loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        dtype_policy=policy,
    )
    model.fit(x, y, batch_size=32, epochs=10, verbose=0)
    return model, model.evaluate(x_test, y_test, verbose=0, return_dict=True), model.predict(x_test, verbose=0)


@pytest.mark.slow
def test_mixed_bfloat16_keeps_float32_weights_learns_and_computes_in_bfloat16():
    mixed, mixed_logs, mixed_pred = fit_digits("mixed_bfloat16")
    full, _, full_pred = fit_digits("float32")
    assert all(w.dtype == np.float32 for w in mixed.get_weights())
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(mixed.session.state.opt_state) if a.ndim)
    assert mixed_pred.dtype == np.float32  # outputs come back float32
    assert mixed_logs["accuracy"] >= 0.93
    assert np.abs(mixed_pred - full_pred).max() > 1e-3  # the forward pass really ran in bfloat16


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_predict_and_evaluate_run_under_the_policy_too():
    x, y, x_test, y_test = digits()
    full = mf.Model(DigitsMLP(rngs=nnx.Rngs(0)))
    full.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    full.fit(x, y, batch_size=32, epochs=2, verbose=0)
    mixed = mf.Model(DigitsMLP(rngs=nnx.Rngs(0)))
    mixed.compile(
        optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), dtype_policy="mixed_bfloat16"
    )
    mixed.set_weights(full.get_weights())  # the same weights: any difference is the compute dtype
    a, b = full.predict(x_test, verbose=0), mixed.predict(x_test, verbose=0)
    assert b.dtype == np.float32 and 1e-3 < np.abs(a - b).max() < 0.5
    assert full.evaluate(x_test, y_test, verbose=0) != mixed.evaluate(x_test, y_test, verbose=0)


@pytest.mark.slow
def test_bfloat16_policy_keeps_the_weights_in_bfloat16():
    model, logs, _ = fit_digits("bfloat16")
    assert all(w.dtype == jnp.bfloat16 for w in model.get_weights())
    assert logs["accuracy"] >= 0.85


@pytest.mark.slow
def test_mixed_bfloat16_leaves_batchnorm_statistics_float32():
    class WithNorm(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)
            self.out = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.out(self.norm(nnx.relu(self.dense(x))))

    x, y = classification_data()
    model = mf.Model(WithNorm(nnx.Rngs(0)))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", dtype_policy="mixed_bfloat16")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert all(w.dtype == np.float32 for w in model.get_weights())  # BatchNorm's mean and var included
    assert "norm/mean" in " ".join(model.weight_names())


class Scaled(mf.losses.Loss):
    """Cross-entropy times 1e4: with float16's range (65504) and a loss scale of 2**15 the gradients overflow."""

    def call(self, y_true, y_pred):
        return 1e4 * optax.softmax_cross_entropy_with_integer_labels(y_pred, y_true)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_mixed_float16_skips_overflowing_steps_lowers_the_scale_and_learns():
    x, y = classification_data(n=256)
    model = mf.Model(MLP(hidden=32))
    model.compile(optimizer="adam", loss=Scaled(), dtype_policy="mixed_float16")
    history = model.fit(x, y, batch_size=32, epochs=10, shuffle=False, verbose=0)
    scale = float(model.session.state.loss_scale.scale)
    assert scale < precision.INITIAL_LOSS_SCALE  # halved on the overflowing steps
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert all(w.dtype == np.float32 for w in model.get_weights())
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0]


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_the_loss_scale_is_saved_and_loaded_with_the_model(tmp_path):
    x, y = classification_data(n=256)
    model = mf.Model(MLP(hidden=32))
    model.compile(optimizer="adam", loss=Scaled(), dtype_policy="mixed_float16")
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    scale = float(model.session.state.loss_scale.scale)
    assert scale < precision.INITIAL_LOSS_SCALE
    model.save(tmp_path / "saved")
    loaded = mf.load_model(tmp_path / "saved", MLP(hidden=32), loss=Scaled())
    assert float(loaded.session.state.loss_scale.scale) == scale


def test_loss_scale_follows_keras_rules():
    scale = precision.LossScale.initial()
    assert float(scale.scale) == 2.0**15
    halved = scale.next(jnp.asarray(False))
    assert float(halved.scale) == 2.0**14 and int(halved.good_steps) == 0
    grown = precision.LossScale(scale.scale, jnp.asarray(precision.LOSS_SCALE_GROWTH_STEPS - 1, jnp.int32))
    grown = grown.next(jnp.asarray(True))
    assert float(grown.scale) == 2.0**16 and int(grown.good_steps) == 0
    assert int(scale.next(jnp.asarray(True)).good_steps) == 1


def test_an_unknown_policy_lists_the_valid_ones():
    model = mf.Model(MLP())
    with pytest.raises(ValueError, match=r"Unknown dtype policy 'half'. Expected one of \['float32', 'mixed_bfloat16'"):
        model.compile(optimizer="sgd", loss="mse", dtype_policy="half")


@pytest.mark.slow
def test_a_model_saved_under_a_policy_loads_with_it(tmp_path):
    x, y = classification_data()
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", dtype_policy="mixed_bfloat16")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    model.save(tmp_path / "saved")
    loaded = mf.load_model(tmp_path / "saved", MLP())
    assert loaded.compile_settings.dtype_policy.name == "mixed_bfloat16"
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


# -- gradient accumulation -------------------------------------------------------------------


def sgd_momentum():
    return mf.optimizers.get("sgd", learning_rate=0.05, momentum=0.9)


def weights_after(batch_size, strategy=None, **compile_args):
    x, y = classification_data(n=256)
    with (strategy or mf.strategies.OneDeviceStrategy()).scope():
        model = mf.Model(MLP(hidden=32))
        model.compile(optimizer=sgd_momentum(), loss="sparse_categorical_crossentropy", **compile_args)
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize(
    "strategy",
    [
        None,
        lambda: mf.strategies.MirroredStrategy(jax.local_devices()[:4]),
        lambda: mf.strategies.MeshStrategy(axes={"data": 2, "fsdp": 4}),
    ],
    ids=["one_device", "mirrored4", "mesh2x4"],
)
@pytest.mark.slow
def test_four_batches_of_16_accumulated_train_as_one_batch_of_64(strategy):
    big = weights_after(64)
    accumulated = weights_after(16, strategy() if strategy else None, gradient_accumulation_steps=4)
    for a, b in zip(big.get_weights(), accumulated.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # the mean of 4 means rounds differently
    assert int(accumulated.session.state.step) == 16  # steps count batches
    assert accumulated.session.state.opt_state.gradient_step == 4  # updates


def test_an_optax_multisteps_optimizer_is_accepted_and_equal():
    x, y = classification_data(n=256)
    model = mf.Model(MLP(hidden=32))
    multi_steps = optax.MultiSteps(sgd_momentum(), every_k_schedule=4)
    model.compile(optimizer=multi_steps, loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(weights_after(16, gradient_accumulation_steps=4).get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_accumulation_with_steps_per_execution_that_is_not_a_multiple():
    reference = weights_after(16, gradient_accumulation_steps=4)
    model = weights_after(16, gradient_accumulation_steps=4, steps_per_execution=3)
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_backup_taken_mid_accumulation_resumes_exactly(tmp_path):
    x, y = classification_data(n=192)

    class StopAt(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.session.step == 10:  # 2 batches into the third accumulation of 4
                self.model.stop_training = True

    def fit(backup=None, stop=False):
        model = mf.Model(MLP(hidden=32), seed=1)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", gradient_accumulation_steps=4)
        callbacks = [StopAt()] if stop else []
        if backup:
            callbacks.append(mf.callbacks.BackupAndRestore(backup, save_freq=1, delete_checkpoint=False))
        history = model.fit(x, y, batch_size=16, epochs=3, callbacks=callbacks, verbose=0)
        return model, history

    full, full_history = fit()
    fit(tmp_path / "b", stop=True)
    resumed, resumed_history = fit(tmp_path / "b")
    assert resumed_history.history == full_history.history
    for a, b in zip(full.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_accumulation_steps_must_be_a_positive_int(bad):
    model = mf.Model(MLP())
    with pytest.raises(ValueError, match="`gradient_accumulation_steps` must be a positive int"):
        model.compile(optimizer="sgd", loss="mse", gradient_accumulation_steps=bad)


def test_multisteps_and_accumulation_steps_together_are_refused():
    model = mf.Model(MLP())
    with pytest.raises(ValueError, match="optax.MultiSteps, which accumulates gradients itself"):
        model.compile(optimizer=optax.MultiSteps(optax.sgd(0.1), 2), loss="mse", gradient_accumulation_steps=2)


# -- clipping ------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [{"clipnorm": 0.05}, {"clipvalue": 0.01}, {"global_clipnorm": 0.05}])
def test_clipping_matches_keras(clip):
    keras = pytest.importorskip("keras")
    rng = np.random.default_rng(0)
    params = {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    grads = {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32) / 1e3}

    tx = mf.optimizers.get("sgd", learning_rate=0.5, **clip)
    updates, _ = tx.update(jax.tree.map(jnp.asarray, grads), tx.init(params), params)
    ours = jax.tree.map(lambda p, u: np.asarray(p + u), params, updates)

    variables = {k: keras.Variable(v) for k, v in params.items()}
    optimizer = keras.optimizers.SGD(learning_rate=0.5, **clip)
    optimizer.apply([grads[k] for k in ("a", "b")], [variables[k] for k in ("a", "b")])
    for k in ("a", "b"):
        np.testing.assert_allclose(ours[k], np.asarray(variables[k].value), rtol=1e-6, atol=1e-7)


def test_clipping_arguments_are_checked():
    with pytest.raises(ValueError, match="Only one of `clipnorm`"):
        mf.optimizers.get("adam", clipnorm=1.0, global_clipnorm=1.0)
    with pytest.raises(ValueError, match="Only one of `clipnorm`"):
        mf.optimizers.get("adam", clipnorm=1.0, clipvalue=0.5)
    with pytest.raises(ValueError, match="`clipvalue` must be a positive number"):
        mf.optimizers.get("adam", clipvalue=-1)
    with pytest.raises(ValueError, match="Clip inside an optax.MultiSteps"):
        mf.optimizers.get(optax.MultiSteps(optax.sgd(0.1), 2), clipnorm=1.0)


def test_a_clipped_optimizer_still_exposes_its_learning_rate():
    model = mf.Model(MLP())
    model.compile(optimizer=mf.optimizers.get("adam", learning_rate=0.01, clipnorm=1.0), loss="mse")
    assert model.optimizer.learning_rate == pytest.approx(0.01)
    model.optimizer.learning_rate = 0.002
    assert model.optimizer.learning_rate == pytest.approx(0.002)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_layers_that_fix_their_dtype_compute_in_the_policy_dtype_too():
    """`nnx.Embed` takes its parameters' float32 as its dtype when built; the policy still reaches it."""

    class Tokens(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(16, 8, rngs=rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)
            self.out = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, tokens):
            return self.out(self.norm(self.embed(tokens))).mean(axis=1)

    tokens = np.random.default_rng(0).integers(0, 16, (32, 5)).astype(np.int32)
    labels = np.zeros(32, np.int32)
    model = mf.Model(Tokens(nnx.Rngs(0)))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", dtype_policy="mixed_bfloat16")
    model.fit(tokens, labels, batch_size=16, epochs=1, verbose=0)
    session = model.session
    batch = session.strategy.distribute_batch(model.session.example_batch, False)
    jaxpr = jax.make_jaxpr(session.steps.train_step)(session.state, batch)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in dots)
    assert model.module.embed.dtype == jnp.float32  # the user's module is unchanged
