"""The session: batches staged on the devices, the next epoch read ahead, fresh accumulators, the position."""

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf
import meshfit.session as session_lib


def make_model(optimizer="adam"):
    model = mf.Model(MLP())
    model.compile(
        optimizer=optimizer, loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    return model


def fit_weights(monkeypatch, stage_bytes, max_steps=session_lib.MAX_STAGED_STEPS, **fit_args):
    monkeypatch.setattr(session_lib, "STAGE_BYTES", stage_bytes)
    monkeypatch.setattr(session_lib, "MAX_STAGED_STEPS", max_steps)
    x, y = classification_data(n=70)  # batches of 16: 4 full and one of 6 rows
    model = make_model()
    history = model.fit(x, y, batch_size=16, verbose=0, **fit_args)
    return model, history


@pytest.mark.parametrize("per_step", [False, True], ids=["whole-stages", "step-by-step"])
@pytest.mark.parametrize("max_steps", [2, 3, 64], ids=["stages-of-2", "stages-of-3", "one-stage"])
def test_staged_batches_train_exactly_as_host_batches(monkeypatch, max_steps, per_step):
    """Without batch callbacks a stage's steps run as one execution; with one, step by step."""
    seen = []
    watcher = mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))
    host, h_host = fit_weights(monkeypatch, 0, epochs=3)
    staged, h_staged = fit_weights(
        monkeypatch, 2**20, max_steps=max_steps, epochs=3, callbacks=[watcher] if per_step else []
    )
    assert seen == ([0, 1, 2, 3, 4] * 3 if per_step else [])
    assert host.session._train_staged._cache_size() == 0  # staging off: every step took a host batch
    assert staged.session._train.step._cache_size() == 0  # staging on: no step took a host batch
    assert staged.session._train_staged._cache_size() == 1  # one compile, the partial batch included
    for a, b in zip(host.get_weights(), staged.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert h_host.history == h_staged.history
    assert int(staged.session.state.step) == 15 == staged.session.step


def test_stage_size_follows_the_byte_budget(monkeypatch):
    x, y = classification_data(n=64)
    model = make_model()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    data = model._make_data(x, y, None, 16)
    assert data.batch_nbytes == 16 * (4 * 4 + 4 + 4)  # x: 4 float32, y: int32, mask: float32 per row
    monkeypatch.setattr(session_lib, "STAGE_BYTES", data.batch_nbytes * 3)
    assert model.session._stage_steps(data) == 3
    monkeypatch.setattr(session_lib, "STAGE_BYTES", data.batch_nbytes // 2)
    assert model.session._stage_steps(data) == 1  # a batch over budget travels alone, unstaged


def test_iterators_are_not_staged_or_read_ahead():
    x, y = classification_data(n=64)
    model = make_model()
    seen = []

    def batches():
        for i in range(0, 64, 16):
            seen.append(i)
            yield x[i : i + 16], y[i : i + 16]

    model.fit(batches(), epochs=1, verbose=0)
    assert model.session._train.step._cache_size() == 1
    assert model.session._train_staged._cache_size() == 0
    assert seen == [0, 16, 32, 48]


def test_epochs_read_ahead_equal_epochs_started_fresh():
    """fit(epochs=3) prefetches epochs 1 and 2; three one-epoch fits prefetch nothing."""
    x, y = classification_data(n=70)
    whole = make_model()
    whole.fit(x, y, batch_size=16, epochs=3, verbose=0)
    parts = make_model()
    for epoch in range(3):
        parts.fit(x, y, batch_size=16, epochs=epoch + 1, initial_epoch=epoch, verbose=0)
    for a, b in zip(whole.get_weights(), parts.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_prefetch_for_other_data_is_not_used():
    x, y = classification_data(n=64)
    model = make_model()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    other = model._make_data(x[::-1].copy(), y[::-1].copy(), None, 16)
    data = model._make_data(x, y, None, 16)
    session = model.session
    session.prefetch(other, 1)
    count, first = next(session.train_executions(data, 1))
    assert count == 1 and isinstance(first, session_lib.Staged)
    expected = next(data.executions(1, 1))[1].x
    np.testing.assert_array_equal(np.asarray(first.stage.x[int(first.indices[0])]), expected)
    assert session._prefetched is None  # dropped, not kept for later


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


def test_mirrored_staged_batches_equal_one_device(monkeypatch):
    monkeypatch.setattr(session_lib, "MAX_STAGED_STEPS", 3)
    x, y = classification_data(n=70)
    one = make_model("sgd")
    one.fit(x, y, batch_size=16, epochs=2, verbose=0)
    with mf.strategies.MirroredStrategy(jax.local_devices()[:4]).scope():
        mirrored = make_model("sgd")
    mirrored.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert mirrored.session._train_staged._cache_size() == 1
    for a, b in zip(one.get_weights(), mirrored.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


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
