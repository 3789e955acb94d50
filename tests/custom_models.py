"""Models with training logic of their own (Keras 3's JAX contract), shared by the custom-step tests."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import meshfit as mf


class OwnGradients(mf.Model):
    """`train_step` with its own gradient computation and a `Mean` tracker of the loss; `test_step` too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = mf.metrics.Mean(name="xent")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, state, data):
        x, y, _ = mf.utils.unpack_x_y_sample_weight(data)

        def loss_fn(params):
            logits, model_state = self.stateless_call(params, state.model_state, x, training=True, rng=state.rng)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), model_state

        (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        params, opt_state = self.optimizer.stateless_apply(state.opt_state, grads, state.params)
        metrics = {**state.metrics, "xent": self.loss_tracker.stateless_update_state(state.metrics["xent"], loss)}
        logs = {"xent": self.loss_tracker.stateless_result(metrics["xent"]), "batch_xent": loss}
        return logs, state._replace(params=params, model_state=model_state, opt_state=opt_state, metrics=metrics)

    def test_step(self, state, data):
        x, y, _ = mf.utils.unpack_x_y_sample_weight(data)
        logits, _ = self.stateless_call(state.params, state.model_state, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        metrics = {**state.metrics, "xent": self.loss_tracker.stateless_update_state(state.metrics["xent"], loss)}
        return {"xent": self.loss_tracker.stateless_result(metrics["xent"])}, state._replace(metrics=metrics)


class TinyGAN(nnx.Module):
    """A generator (latent -> data, `generate`) and a discriminator (data -> logit, `__call__`)."""

    latent = 3

    def __init__(self, data=2, hidden=8, seed=0):
        rngs = nnx.Rngs(seed)
        self.generator = nnx.Sequential(
            nnx.Linear(self.latent, hidden, rngs=rngs), nnx.tanh, nnx.Linear(hidden, data, rngs=rngs)
        )
        self.discriminator = nnx.Sequential(
            nnx.Linear(data, hidden, rngs=rngs), nnx.tanh, nnx.Linear(hidden, 1, rngs=rngs)
        )

    def __call__(self, x):
        return self.discriminator(x)

    def generate(self, z):
        return self.generator(z)


def gan_noise(step, rows):
    """The latent batch of a step: a function of the step alone, so a hand-written loop draws the same."""
    return jax.random.normal(jax.random.fold_in(jax.random.key(42), step), (rows, TinyGAN.latent))


def bce_with_logits(logits, label):
    return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, label)).mean()


class GAN(mf.Model):
    """Keras 3's GAN `train_step` on meshfit: the discriminator's update, then the generator's, in one step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.d_loss_tracker = mf.metrics.Mean(name="d_loss")
        self.g_loss_tracker = mf.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, state, data):
        real = data
        noise = gan_noise(state.step, real.shape[0])
        params, model_state = state.params, state.model_state

        def generate(g_params):
            return self.stateless_call({**params, "generator": g_params}, model_state, noise, method="generate")[0]

        def discriminate(d_params, x):
            return self.stateless_call({**params, "discriminator": d_params}, model_state, x)[0]

        def d_loss_fn(d_params):
            fake = generate(params["generator"])
            real_loss = bce_with_logits(discriminate(d_params, real), 1.0)
            return real_loss + bce_with_logits(discriminate(d_params, fake), 0.0)

        d_loss, d_grads = jax.value_and_grad(d_loss_fn)(params["discriminator"])
        d_params, d_opt = self.optimizer["discriminator"].stateless_apply(
            state.opt_state["discriminator"], d_grads, params["discriminator"]
        )
        params = {**params, "discriminator": d_params}

        def g_loss_fn(g_params):
            return bce_with_logits(discriminate(d_params, generate(g_params)), 1.0)

        g_loss, g_grads = jax.value_and_grad(g_loss_fn)(params["generator"])
        g_params, g_opt = self.optimizer["generator"].stateless_apply(
            state.opt_state["generator"], g_grads, params["generator"]
        )
        metrics = dict(state.metrics)
        metrics["d_loss"] = self.d_loss_tracker.stateless_update_state(metrics["d_loss"], d_loss)
        metrics["g_loss"] = self.g_loss_tracker.stateless_update_state(metrics["g_loss"], g_loss)
        new_state = state._replace(
            params={**params, "generator": g_params},
            opt_state={"discriminator": d_opt, "generator": g_opt},
            metrics=metrics,
        )
        return self.get_metrics_result(metrics), new_state
