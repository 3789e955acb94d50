"""Stand-ins for the parts of `meshfit.Model` that callbacks use.

They hold plain numpy weights and a float learning rate, like the real model
exposes them to callbacks (`get_weights`/`set_weights`, `stop_training`,
`optimizer.learning_rate`), so callback logic can be tested without training.
"""

import numpy as np
import pytest


class StandInOptimizer:
    """`learning_rate` reads back float32-rounded, like an optax injected hyperparameter."""

    def __init__(self, learning_rate=0.01):
        self._lr = float(np.float32(learning_rate))

    @property
    def learning_rate(self):
        return self._lr

    @learning_rate.setter
    def learning_rate(self, value):
        self._lr = float(np.float32(value))


class StandInModel:
    def __init__(self, weights=None, learning_rate=0.01, metrics=None):
        self.stop_training = False
        self._weights = [np.asarray(w, dtype=np.float32) for w in (weights or [np.zeros((2, 3)), np.zeros(3)])]
        self.optimizer = StandInOptimizer(learning_rate)
        if metrics is not None:
            self.metrics = metrics

    def get_weights(self):
        return [w.copy() for w in self._weights]

    def set_weights(self, weights):
        self._weights = [np.asarray(w, dtype=np.float32).copy() for w in weights]


@pytest.fixture
def make_model():
    return StandInModel
