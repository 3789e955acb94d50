"""Training logic of the user's own (Keras 3's JAX contract), against hand-written JAX/optax loops."""

import json
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from custom_models import GAN, OwnGradients, TinyGAN, bce_with_logits, gan_noise
from flax import nnx
from helpers import MLP, classification_data
from processes import Job

import meshfit as mf

RTOL = 1e-5
XENT = mf.losses.SparseCategoricalCrossentropy(from_logits=True)


def functional(module):
    """`(apply(params, x, method=None), params)`: the module as a pure function, written with Flax alone."""
    graphdef, state = nnx.split(module)

    def apply(params, x, method=None):
        filled = jax.tree.map(lambda a: a, state)
        nnx.replace_by_pure_dict(filled, params)
        merged = nnx.merge(graphdef, filled)
        return merged(x) if method is None else getattr(merged, method)(x)

    return apply, jax.tree.map(np.asarray, nnx.to_pure_dict(state))


def batches(n, batch_size):
    """Row slices of an unshuffled epoch: full batches, then the partial one."""
    return [slice(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def assert_close(a, b, rtol=RTOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-6)


# -- compute_loss with a term from the module's extra outputs ----------------------------------------


class WithActivity(nnx.Module):
    """An MLP that also returns its hidden activity (as a VAE returns its KL term)."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.hidden(x))
        return {"logits": self.out(h), "activity": h}


class ActivityPenalty(mf.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.1 * jnp.mean(jnp.square(y_pred["activity"]))


@pytest.mark.slow
def test_compute_loss_override_adds_a_term_from_extra_outputs_and_equals_a_hand_written_loop():
    x, y = classification_data(n=40)  # batches of 16, 16 and a partial 8
    model = ActivityPenalty(WithActivity(), seed=0)
    apply, params = functional(WithActivity())
    model.compile(optimizer=optax.adam(1e-2), loss={"logits": XENT}, metrics={"logits": ["accuracy"]})
    history = model.fit(x, {"logits": y}, batch_size=16, epochs=2, shuffle=False, verbose=0)

    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    def loss_fn(params, xb, yb):
        out = apply(params, xb)
        xent = optax.softmax_cross_entropy_with_integer_labels(out["logits"], yb).mean()
        return xent + 0.1 * jnp.mean(jnp.square(out["activity"]))

    epoch_losses = []
    for _ in range(2):
        total = 0.0
        for rows in batches(40, 16):
            loss, grads = jax.value_and_grad(loss_fn)(params, x[rows], y[rows])
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            total += float(loss) * len(x[rows])
        epoch_losses.append(total / 40)
    assert_close(model.params, params)
    np.testing.assert_allclose(history.history["loss"], epoch_losses, rtol=RTOL)
    assert set(history.history) == {"loss", "logits_accuracy"}
    # The partial batch ran at its real size: one more program, for 8 rows.
    assert ("staged", 8) in model.session.executables.partial_batch_steps


# -- train_step with its own gradients (Keras 3's JAX contract) ----------------------------------------


def own_gradients_model(strategy=None, **compile_kwargs):
    with (strategy or mf.strategies.OneDeviceStrategy()).scope():
        model = OwnGradients(MLP(hidden=8), seed=0)
        model.compile(optimizer=optax.adam(1e-2), **compile_kwargs)
    return model


def hand_written_own_gradients(x, y, epochs, batch_size):
    """The same training in plain JAX/optax: params, per-epoch mean batch loss, last batch loss."""
    apply, params = functional(MLP(hidden=8))
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    def loss_fn(params, xb, yb):
        return optax.softmax_cross_entropy_with_integer_labels(apply(params, xb), yb).mean()

    means, lasts = [], []
    for _ in range(epochs):
        losses = []
        for rows in batches(len(x), batch_size):
            loss, grads = jax.value_and_grad(loss_fn)(params, x[rows], y[rows])
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            losses.append(float(loss))
        means.append(np.mean(losses))
        lasts.append(losses[-1])
    return params, means, lasts


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_train_step_override_equals_a_hand_written_loop_and_logs_by_keras_rule():
    x, y = classification_data(n=40)
    model = own_gradients_model()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    params, means, lasts = hand_written_own_gradients(x, y, 2, 16)
    assert_close(model.params, params)
    np.testing.assert_allclose(history.history["xent"], means, rtol=RTOL)  # a Mean tracker: the epoch's mean
    np.testing.assert_allclose(history.history["batch_xent"], lasts, rtol=RTOL)  # a plain value: the last batch's
    assert int(model.session.state.step) == model.optimizer.iterations == 6  # meshfit counts the steps
    logits = MLP(hidden=8)
    apply, _ = functional(logits)
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    expected = np.mean(
        [optax.softmax_cross_entropy_with_integer_labels(apply(params, x[r]), y[r]).mean() for r in batches(40, 16)]
    )
    np.testing.assert_allclose(evaluated["xent"], expected, rtol=RTOL)
    np.testing.assert_allclose(model.predict(x, batch_size=16, verbose=0), apply(params, x), rtol=RTOL, atol=1e-6)
    assert model.test_on_batch(x[:8], y[:8]) == pytest.approx(
        float(optax.softmax_cross_entropy_with_integer_labels(apply(params, x[:8]), y[:8]).mean()), rel=RTOL
    )


@pytest.mark.slow
def test_steps_per_execution_and_gradient_accumulation_apply_to_a_custom_step():
    x, y = classification_data(n=48)
    reference = own_gradients_model()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    stacked = own_gradients_model(steps_per_execution=2)
    history = stacked.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_close(stacked.params, reference.params)
    assert history.history["xent"][-1] == pytest.approx(reference.history.history["xent"][-1], rel=RTOL)
    # Two batches of 8 accumulated make the update one batch of 16 makes (the loss is a batch mean).
    accumulated = own_gradients_model(gradient_accumulation_steps=2)
    accumulated.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_close(accumulated.params, reference.params)


def test_mixed_bfloat16_runs_a_custom_step_in_the_compute_dtype():
    x, y = classification_data(n=32)
    model = own_gradients_model(dtype_policy="mixed_bfloat16")
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["xent"][0])
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(model.params))


# -- a GAN with two optimizers ------------------------------------------------------------------------


def gan_data(n=32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((n, 2)) * 0.5 + np.array([2.0, -1.0])).astype(np.float32)


@pytest.mark.slow
def test_gan_with_a_dict_of_optimizers_equals_a_hand_written_loop(capsys):
    data = gan_data()
    model = GAN(TinyGAN(), seed=0)
    model.compile(optimizer={"generator": optax.adam(2e-3), "discriminator": optax.adam(1e-3)})
    history = model.fit(data, batch_size=16, epochs=2, shuffle=False, verbose=2)
    printed = capsys.readouterr().out
    assert "d_loss: " in printed and "g_loss: " in printed, printed  # the progress bar shows every key

    apply, params = functional(TinyGAN())
    txs = {"generator": optax.adam(2e-3), "discriminator": optax.adam(1e-3)}
    opt = {k: tx.init(params[k]) for k, tx in txs.items()}
    d_means, g_means, step = [], [], 0
    for _ in range(2):
        d_losses, g_losses = [], []
        for rows in batches(32, 16):
            real, noise = data[rows], gan_noise(step, 16)

            def d_loss_fn(d, params=params, real=real, noise=noise):
                fake = apply(params, noise, "generate")
                both = {**params, "discriminator": d}
                return bce_with_logits(apply(both, real), 1.0) + bce_with_logits(apply(both, fake), 0.0)

            d_loss, d_grads = jax.value_and_grad(d_loss_fn)(params["discriminator"])
            updates, opt["discriminator"] = txs["discriminator"].update(d_grads, opt["discriminator"])
            params = {**params, "discriminator": optax.apply_updates(params["discriminator"], updates)}

            def g_loss_fn(g, params=params, noise=noise):
                both = {**params, "generator": g}
                return bce_with_logits(apply(both, apply(both, noise, "generate")), 1.0)

            g_loss, g_grads = jax.value_and_grad(g_loss_fn)(params["generator"])
            updates, opt["generator"] = txs["generator"].update(g_grads, opt["generator"])
            params = {**params, "generator": optax.apply_updates(params["generator"], updates)}
            d_losses.append(float(d_loss))
            g_losses.append(float(g_loss))
            step += 1
        d_means.append(np.mean(d_losses))
        g_means.append(np.mean(g_losses))
    assert_close(model.params, params)
    np.testing.assert_allclose(history.history["d_loss"], d_means, rtol=RTOL)
    np.testing.assert_allclose(history.history["g_loss"], g_means, rtol=RTOL)
    assert set(model.session.state.opt_state) == {"generator", "discriminator"}
    assert sorted(model.optimizer) == ["discriminator", "generator"]


def test_a_dict_of_optimizers_must_name_every_top_level_part():
    model = GAN(TinyGAN(), seed=0)
    with pytest.raises(ValueError, match=r"unknown: \['critic'\], missing: \['discriminator'\]"):
        model.compile(optimizer={"generator": "adam", "critic": "adam"})


def test_learning_rate_callbacks_name_the_optimizer_they_act_on():
    data = gan_data()
    model = GAN(TinyGAN(), seed=0)
    model.compile(
        optimizer={
            "generator": mf.optimizers.get("adam", learning_rate=1e-3),
            "discriminator": mf.optimizers.get("adam", learning_rate=1e-3),
        }
    )
    unnamed = mf.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)
    with pytest.raises(ValueError, match=r"optimizer='discriminator'"):
        model.fit(data, batch_size=16, epochs=1, verbose=0, callbacks=[unnamed])
    assert int(model.session.state.step) == 0  # refused before any step
    named = mf.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5, optimizer="generator")
    history = model.fit(data, batch_size=16, epochs=1, verbose=0, callbacks=[named])
    assert model.optimizer["generator"].learning_rate == pytest.approx(5e-4)
    assert model.optimizer["discriminator"].learning_rate == pytest.approx(1e-3)
    assert history.history["learning_rate"] == [pytest.approx(5e-4)]
    plateau = mf.callbacks.ReduceLROnPlateau(monitor="d_loss", mode="min", patience=0, factor=0.5, min_delta=10.0)
    with pytest.raises(ValueError, match=r"optimizer="):
        model.fit(data, batch_size=16, epochs=1, verbose=0, callbacks=[plateau])
    plateau = mf.callbacks.ReduceLROnPlateau(
        monitor="d_loss", mode="min", patience=0, factor=0.5, min_delta=10.0, optimizer="discriminator"
    )
    model.fit(data, batch_size=16, epochs=2, verbose=0, callbacks=[plateau])  # never improves by 10: halves
    assert model.optimizer["discriminator"].learning_rate < 1e-3
    assert model.optimizer["generator"].learning_rate == pytest.approx(5e-4)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_a_dict_of_optimizers_saves_and_loads_with_its_state(tmp_path):
    data = gan_data()
    optimizers = {"generator": optax.adam(2e-3), "discriminator": optax.adam(1e-3)}
    model = GAN(TinyGAN(), seed=0)
    model.compile(optimizer=optimizers)
    model.fit(data, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "gan")
    with pytest.warns(UserWarning, match="optimizer"):  # optax transforms are code: loaded without them
        unoptimized = mf.load_model(tmp_path / "gan", TinyGAN())
    assert unoptimized.optimizer is None
    with pytest.raises(ValueError, match=r"`fit\(\)` needs an optimizer.*optimizer=\.\.\."):  # passed again
        unoptimized.fit(data, batch_size=16, epochs=1, verbose=0)
    loaded = mf.load_model(tmp_path / "gan", TinyGAN(seed=1), optimizer=optimizers)
    assert sorted(loaded.optimizer) == ["discriminator", "generator"]
    assert_close(loaded.session.state.opt_state, model.session.state.opt_state, rtol=0)
    assert_close(loaded.params, model.params, rtol=0)
    again = GAN(TinyGAN(seed=2), seed=0)  # the subclass, compiled afresh, takes the saved weights
    again.compile(optimizer=optimizers)
    again.load_weights(tmp_path / "gan")
    assert_close(again.params, model.params, rtol=0)


# -- strategies ---------------------------------------------------------------------------------------


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_custom_step_under_mirrored_on_four_devices_equals_one_device():
    x, y = classification_data(n=40)  # a partial last batch of 8 rows, 2 per device
    one = own_gradients_model()
    one.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    mirrored = own_gradients_model(mf.strategies.MirroredStrategy(jax.devices()[:4]))
    history = mirrored.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_close(mirrored.params, one.params)
    np.testing.assert_allclose(history.history["xent"], one.history.history["xent"], rtol=RTOL)


@pytest.mark.slow
def test_gan_under_a_mesh_strategy_equals_one_device():
    data = gan_data()

    def fit(strategy):
        with strategy.scope():
            model = GAN(TinyGAN(), seed=0)
            model.compile(optimizer={"generator": optax.adam(2e-3), "discriminator": optax.adam(1e-3)})
        model.fit(data, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model

    one = fit(mf.strategies.OneDeviceStrategy())
    mesh = fit(mf.strategies.MeshStrategy(axes={"data": 2, "fsdp": 2, "tensor": 2}))
    assert_close(mesh.params, one.params)


def test_what_a_custom_step_cannot_do_is_refused_before_any_step():
    x, y = classification_data(n=32)
    explicit = own_gradients_model(mf.strategies.MirroredStrategy(jax.devices()[:2], reduction="explicit"))
    with pytest.raises(ValueError, match="reduction='auto'"):
        explicit.fit(x, y, batch_size=16, verbose=0)
    assert int(explicit.session.state.step) == 0
    scaled = own_gradients_model(dtype_policy="mixed_float16")
    with pytest.raises(ValueError, match="mixed_bfloat16"):
        scaled.fit(x, y, batch_size=16, verbose=0)
    server = own_gradients_model(mf.strategies.ParameterServerStrategy(workers=jax.devices()[:2]))
    with pytest.raises(ValueError, match="splits each step between workers and a server"):
        server.fit(x, y, batch_size=16, verbose=0)
    assert int(server.session.state.step) == 0


def test_unpack_x_y_sample_weight_as_keras():
    x, y, w = np.zeros(2), np.ones(2), np.full(2, 3.0)
    assert mf.utils.unpack_x_y_sample_weight(x)[1:] == (None, None)
    assert mf.utils.unpack_x_y_sample_weight((x, y))[2] is None
    assert mf.utils.unpack_x_y_sample_weight((x, y, w))[2] is w
    with pytest.raises(ValueError, match="sample_weight"):
        mf.utils.unpack_x_y_sample_weight((x, y, w, w))


# -- exact resume after SIGKILL -----------------------------------------------------------------------

WORKER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "train_custom_resumable.py")


def run_custom_worker(out, backup, *args, stop_at=None):
    """Runs the worker; with `stop_at`, SIGKILLs it when it prints that step. Returns (status, output)."""
    with Job([sys.executable, WORKER, str(out), str(backup), *args], timeout=180) as job:
        if stop_at is not None:
            job.wait_for(rf"step {stop_at}$")
            job.proc.send_signal(signal.SIGKILL)
        status = job.finish()
    return status, job.stdout + job.stderr


def finished_run(out) -> tuple[dict, dict]:
    with open(out / "history.json") as f:
        history = json.load(f)
    weights = np.load(out / "weights.npz")
    return history, {key: weights[key] for key in weights.files}


@pytest.mark.slow
@pytest.mark.processes
def test_sigkilled_custom_step_resumes_bitwise_from_backup_and_restore(tmp_path):
    status, output = run_custom_worker(tmp_path / "reference", tmp_path / "reference-backup")
    assert status == 0, output
    status, output = run_custom_worker(tmp_path / "out", tmp_path / "backup", "--slow", "0.05", stop_at=7)
    assert status == -signal.SIGKILL, output
    status, output = run_custom_worker(tmp_path / "out", tmp_path / "backup")
    assert status == 0 and "BackupAndRestore: resumed" in output, output
    reference_history, reference_weights = finished_run(tmp_path / "reference")
    history, weights = finished_run(tmp_path / "out")
    assert history == reference_history
    for key, value in reference_weights.items():
        np.testing.assert_array_equal(weights[key], value)


class KerasUnpacking(mf.Model):
    """A train_step ported from Keras's JAX backend without changing how it reads `state`."""

    def train_step(self, state, data):
        trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
        return {}, state


def test_unpacking_state_as_kerass_tuple_shows_the_port():
    x, y = classification_data(n=16)
    model = KerasUnpacking(MLP())
    model.compile(optimizer="sgd", loss=XENT)
    with pytest.raises(
        ValueError,
        match=r"`state` is a meshfit.TrainState .*not Keras's \(trainable_variables.*"
        r"Port: `params, model_state, opt_state, metrics = state.params, state.model_state",
    ):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    params, model_state, opt_state, metrics, step, rng, loss_scale = model.session.state  # meshfit's own length
    assert step == 0 and loss_scale is None
