"""examples/gan.py and examples/vae.py run with tiny settings: losses finite, the VAE's falls."""

import numpy as np
import pytest
from helpers import load_example

pytestmark = [pytest.mark.slow, pytest.mark.examples]  # trains the examples for seconds each


def test_gan_example_trains_both_parts():
    history = load_example("gan").main(["--epochs", "2", "--samples", "256", "--batch-size", "64", "--verbose", "0"])
    assert set(history) == {"d_loss", "g_loss"}
    assert np.all(np.isfinite(history["d_loss"] + history["g_loss"]))


@pytest.mark.parametrize("epochs", [3])
def test_vae_example_loss_falls(epochs):
    history = load_example("vae").main(["--epochs", str(epochs), "--verbose", "0"])
    assert history["loss"][-1] < history["loss"][0]
