"""examples/gan.py and examples/vae.py run with tiny settings: losses finite, the VAE's falls."""

import importlib.util
import os

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # trains the examples for seconds each (the fast tier leaves these out)

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gan_example_trains_both_parts():
    history = load("gan").main(["--epochs", "2", "--samples", "256", "--batch-size", "64", "--verbose", "0"])
    assert set(history) == {"d_loss", "g_loss"}
    assert np.all(np.isfinite(history["d_loss"] + history["g_loss"]))


@pytest.mark.parametrize("epochs", [3])
def test_vae_example_loss_falls(epochs):
    history = load("vae").main(["--epochs", str(epochs), "--verbose", "0"])
    assert history["loss"][-1] < history["loss"][0]
