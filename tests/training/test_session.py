"""The session: fresh accumulators laid out like the state, the host's step count across fits."""

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf


def make_model(optimizer="adam"):
    model = mf.Model(MLP())
    model.compile(
        optimizer=optimizer, loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    return model


def test_fresh_accumulators_keep_the_state_layout_and_values():
    x, y = classification_data(n=64)
    model = make_model()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    fresh = model.session.fresh_eval_metrics()
    expected = jax.device_get(model.session.steps.init_metrics())
    for a, b, c in zip(
        jax.tree.leaves(fresh), jax.tree.leaves(expected), jax.tree.leaves(model.session.state.metrics), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), b)
        assert a.sharding == c.sharding


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_a_fit_after_a_fit_does_not_read_the_step_from_the_device(monkeypatch, steps_per_execution):
    """Its step count is the one the last fit counted (no host sync before its first step).

    Anything that replaced the state in between (here a new learning rate) makes the next fit read it.
    """
    x, y = classification_data(n=64)
    model = make_model()
    model.compile(
        optimizer="adam",
        loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    reads = []
    to_host = model.strategy.to_host
    monkeypatch.setattr(model.strategy, "to_host", lambda tree: reads.append(tree) or to_host(tree))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert reads == [] and model.session.step == 12
    model.optimizer.learning_rate = 0.01  # a new state: its step is read once
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert len(reads) == 1 and model.session.step == int(model.session.state.step) == 16
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.session.step == int(model.session.state.step) == 4
