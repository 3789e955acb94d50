"""A variational autoencoder on scikit-learn's 8x8 digits: the KL term comes from the module's forward pass.

python examples/vae.py                    # one device, a few seconds on a CPU
python examples/vae.py --epochs 50

The module returns its reconstruction and its KL divergence; the model
overrides `compute_loss` to add the KL term to the compiled reconstruction
loss (Keras's "Customizing what happens in fit()" VAE, JAX backend). The
default `train_step` differentiates it; `fit`, `evaluate` and every strategy
work as for any model.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from sklearn.datasets import load_digits

import meshfit as mf


class VAE(nnx.Module):
    """Encoder to a Gaussian latent, a sample by the reparameterization trick, decoder back to pixels."""

    def __init__(self, pixels: int = 64, hidden: int = 64, latent: int = 4, *, rngs: nnx.Rngs):
        self.encoder = nnx.Linear(pixels, hidden, rngs=rngs)
        self.mean = nnx.Linear(hidden, latent, rngs=rngs)
        self.log_var = nnx.Linear(hidden, latent, rngs=rngs)
        self.decoder = nnx.Sequential(
            nnx.Linear(latent, hidden, rngs=rngs), nnx.relu, nnx.Linear(hidden, pixels, rngs=rngs)
        )
        self.rngs = rngs

    def __call__(self, x):
        h = nnx.relu(self.encoder(x))
        mean, log_var = self.mean(h), self.log_var(h)
        z = mean + jnp.exp(0.5 * log_var) * jax.random.normal(self.rngs.sample(), mean.shape)
        kl = -0.5 * jnp.sum(1 + log_var - jnp.square(mean) - jnp.exp(log_var), axis=-1)
        return {"reconstruction": nnx.sigmoid(self.decoder(z)), "kl": kl}


class KLModel(mf.Model):
    """The compiled reconstruction loss plus the KL term the module computed (per row, averaged)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        reconstruction = super().compute_loss(x, y, y_pred, sample_weight, training)
        return reconstruction + jnp.mean(y_pred["kl"]) / 64.0  # per pixel, as the reconstruction loss


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--latent", type=int, default=4)
    parser.add_argument("--verbose", type=int, default=2)
    args = parser.parse_args(argv)

    pixels = (load_digits().data / 16.0).astype(np.float32)
    model = KLModel(VAE(latent=args.latent, rngs=nnx.Rngs(params=0, sample=1)), seed=0)
    model.compile(optimizer=mf.optimizers.get("adam", learning_rate=3e-3), loss={"reconstruction": "mse"})
    history = model.fit(
        pixels, {"reconstruction": pixels}, batch_size=args.batch_size, epochs=args.epochs, verbose=args.verbose
    )
    print(f"loss: {history.history['loss'][0]:.4f} -> {history.history['loss'][-1]:.4f}")
    return history.history


if __name__ == "__main__":
    main()
