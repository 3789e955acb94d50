"""Small models, data and assertions shared by the tests."""

import jax
import numpy as np
from flax import nnx


class MLP(nnx.Module):
    """A small MLP used across tests (optionally with dropout)."""

    def __init__(self, din=4, hidden=16, dout=3, *, dropout=0.0, seed=0):
        rngs = nnx.Rngs(seed)
        self.hidden = nnx.Linear(din, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.out = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.hidden(x))
        if self.dropout is not None:
            x = self.dropout(x)
        return self.out(x)


def classification_data(n=64, din=4, classes=3, seed=0):
    """Linearly separable-ish data: labels from a fixed random projection."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, din)).astype(np.float32)
    w = rng.standard_normal((din, classes)).astype(np.float32)
    y = np.argmax(x @ w, axis=-1).astype(np.int32)
    return x, y


def assert_trees_close(a, b, rtol=1e-6, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
