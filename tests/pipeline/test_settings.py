"""Pipeline settings are checked as documented, before any state changes: a circular schedule needs at least as
many microbatches as stages at any `repeats`, and a batch size must give each data replica whole microbatches."""

import jax
import numpy as np
import pytest
from helpers import StagedNet, classification_data

import meshfit as mf


def pipelined(schedule="gpipe", repeats=1, microbatches=4, stages=4):
    return mf.strategies.MeshStrategy(
        axes={"stage": stages, "data": 8 // stages},
        pipeline=mf.strategies.Pipeline(microbatches=microbatches, schedule=schedule, repeats=repeats),
    )


@pytest.mark.parametrize("repeats", [1, 2])
def test_a_circular_pipeline_with_fewer_microbatches_than_stages_is_refused_at_any_repeats(repeats):
    with pytest.raises(ValueError) as refusal:
        pipelined("circular", repeats=repeats, microbatches=2, stages=4)
    message = str(refusal.value)
    assert "at least as many microbatches as stages (4)" in message
    assert f"Received: microbatches=2 (repeats={repeats})" in message and len(message.splitlines()) <= 3
    pipelined("circular", repeats=repeats, microbatches=4, stages=4)  # as many as the stages: taken
    pipelined("gpipe", microbatches=2, stages=4)  # fewer under GPipe: taken


def compiled(strategy):
    with strategy.scope():
        model = mf.Model(lambda: StagedNet())
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_batch_size_that_leaves_a_microbatch_short_is_refused_before_anything_runs(tmp_path):
    """batch_size=64 over 2 data replicas is 32 rows a replica, which 3 microbatches do not divide: fit,
    evaluate and predict refuse it naming both numbers, with no step run and no callback started."""
    model = compiled(pipelined(microbatches=3, stages=4))
    before = jax.tree.map(np.asarray, model.params)
    x, y = classification_data(n=64, din=8, classes=4)
    log = tmp_path / "log.csv"
    expected = r"microbatches=3 must divide each data replica's rows. Received: batch_size=64, 32 rows a replica"
    with pytest.raises(ValueError, match=expected) as refusal:
        model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[mf.callbacks.CSVLogger(str(log))])
    assert "a multiple of 6 (replicas x microbatches)" in str(refusal.value)
    assert len(str(refusal.value).splitlines()) <= 3
    with pytest.raises(ValueError, match=expected):
        model.evaluate(x, y, batch_size=64, verbose=0)
    with pytest.raises(ValueError, match=r"microbatches=3 .* batch_size=32, 16 rows a replica"):
        model.predict(x, verbose=0)  # Keras's default batch size, 32
    assert not log.exists()
    assert int(model.session.state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, model.params))


@pytest.mark.slow
def test_a_batch_size_of_whole_microbatches_trains_and_the_last_partial_batch_is_padded():
    """batch_size=48: 24 rows a replica, 8 a microbatch; 64 rows leave a last batch of 16, padded and masked."""
    model = compiled(pipelined(microbatches=3, stages=4))
    x, y = classification_data(n=64, din=8, classes=4)
    history = model.fit(x, y, batch_size=48, epochs=1, verbose=0, shuffle=False)
    assert int(model.session.state.step) == 2 and np.isfinite(history.history["loss"][0])
