"""A small GAN on scikit-learn's two moons: Keras 3's GAN `train_step` on meshfit, with two optimizers.

python examples/gan.py                    # one device, a few seconds on a CPU
python examples/gan.py --epochs 40

The model's `train_step` updates the discriminator, then the generator, in one
compiled step (Keras's "Customizing what happens in fit()" GAN, JAX backend);
`fit` keeps its callbacks, strategies and exact resume.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import make_moons

import meshfit as mf

LATENT = 4


class MoonsGAN(nnx.Module):
    """A generator (`generate`: latent -> point) and a discriminator (`__call__`: point -> logit)."""

    def __init__(self, hidden: int = 32, *, rngs: nnx.Rngs):
        self.generator = nnx.Sequential(
            nnx.Linear(LATENT, hidden, rngs=rngs), nnx.relu, nnx.Linear(hidden, hidden, rngs=rngs), nnx.relu,
            nnx.Linear(hidden, 2, rngs=rngs),
        )  # fmt: skip
        self.discriminator = nnx.Sequential(
            nnx.Linear(2, hidden, rngs=rngs), nnx.relu, nnx.Linear(hidden, hidden, rngs=rngs), nnx.relu,
            nnx.Linear(hidden, 1, rngs=rngs),
        )  # fmt: skip

    def __call__(self, points):
        return self.discriminator(points)

    def generate(self, z):
        return self.generator(z)


def bce(logits, label: float):
    return optax.sigmoid_binary_cross_entropy(logits, jnp.full_like(logits, label)).mean()


class GAN(mf.Model):
    """The GAN's training logic: `train_step(state, data) -> (logs, state)`, Keras 3's JAX contract."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.d_loss_tracker = mf.metrics.Mean(name="d_loss")
        self.g_loss_tracker = mf.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, state, data):
        real = data
        noise = jax.random.normal(jax.random.fold_in(jax.random.key(self.seed), state.step), (real.shape[0], LATENT))
        params, model_state = state.params, state.model_state

        def generate(g_params):
            return self.stateless_call({**params, "generator": g_params}, model_state, noise, method="generate")[0]

        def discriminate(d_params, points):
            return self.stateless_call({**params, "discriminator": d_params}, model_state, points)[0]

        # The discriminator: real points are 1, generated ones 0.
        def d_loss_fn(d_params):
            fake = generate(params["generator"])
            return bce(discriminate(d_params, real), 1.0) + bce(discriminate(d_params, fake), 0.0)

        d_loss, d_grads = jax.value_and_grad(d_loss_fn)(params["discriminator"])
        d_params, d_opt = self.optimizer["discriminator"].stateless_apply(
            state.opt_state["discriminator"], d_grads, params["discriminator"]
        )

        # The generator: fool the updated discriminator.
        def g_loss_fn(g_params):
            return bce(discriminate(d_params, generate(g_params)), 1.0)

        g_loss, g_grads = jax.value_and_grad(g_loss_fn)(params["generator"])
        g_params, g_opt = self.optimizer["generator"].stateless_apply(
            state.opt_state["generator"], g_grads, params["generator"]
        )

        metrics = dict(state.metrics)
        metrics["d_loss"] = self.d_loss_tracker.stateless_update_state(metrics["d_loss"], d_loss)
        metrics["g_loss"] = self.g_loss_tracker.stateless_update_state(metrics["g_loss"], g_loss)
        state = state._replace(
            params={"generator": g_params, "discriminator": d_params},
            opt_state={"generator": g_opt, "discriminator": d_opt},
            metrics=metrics,
        )
        return self.get_metrics_result(metrics), state

    def sample(self, count: int, seed: int = 1) -> np.ndarray:
        """Generated points (on the host)."""
        state = self.session.state
        z = jax.random.normal(jax.random.key(seed), (count, LATENT))
        return np.asarray(self.stateless_call(state.params, state.model_state, z, method="generate")[0])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--verbose", type=int, default=2)
    args = parser.parse_args(argv)

    points, _ = make_moons(args.samples, noise=0.05, random_state=0)
    points = ((points - points.mean(0)) / points.std(0)).astype(np.float32)
    model = GAN(MoonsGAN(args.hidden, rngs=nnx.Rngs(0)), seed=0)
    model.compile(optimizer={"generator": "adam", "discriminator": "adam"})
    history = model.fit(points, batch_size=args.batch_size, epochs=args.epochs, verbose=args.verbose)
    fake = model.sample(1000)
    print(f"generated points: mean {fake.mean(0).round(2)}, std {fake.std(0).round(2)} (data: mean 0, std 1)")
    return history.history


if __name__ == "__main__":
    main()
