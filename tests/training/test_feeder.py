"""The feeder: batches staged on the devices, the next epoch read ahead, executions of every input kind."""

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf
import meshfit.training.feeder as feeder_lib
from meshfit.data.inputs import data_source


def make_model(optimizer="adam", steps_per_execution=1):
    model = mf.Model(MLP())
    model.compile(
        optimizer=optimizer,
        loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model


def fit_weights(monkeypatch, stage_bytes, max_steps=feeder_lib.MAX_STAGED_STEPS, **fit_args):
    monkeypatch.setattr(feeder_lib, "STAGE_BYTES", stage_bytes)
    monkeypatch.setattr(feeder_lib, "MAX_STAGED_STEPS", max_steps)
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
    assert host.session.executables.compilations()["staged"] == 0  # staging off: every step took a host batch
    staged_compiles = staged.session.executables.compilations()
    assert staged_compiles["execution"] == 0  # staging on: no step took a host batch
    assert staged_compiles["staged"] == 1  # one compile, the partial batch included
    for a, b in zip(host.get_weights(), staged.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert h_host.history == h_staged.history
    assert int(staged.session.state.step) == 15 == staged.session.step


def test_stage_size_follows_the_byte_budget(monkeypatch):
    x, y = classification_data(n=64)
    model = make_model()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    data = data_source(x, y, None, 16, model.strategy)
    assert data.batch_nbytes == 16 * (4 * 4 + 4 + 4)  # x: 4 float32, y: int32, mask: float32 per row
    monkeypatch.setattr(feeder_lib, "STAGE_BYTES", data.batch_nbytes * 3)
    assert model.session.feeder.stage_steps(data) == 3
    monkeypatch.setattr(feeder_lib, "STAGE_BYTES", data.batch_nbytes // 2)
    assert model.session.feeder.stage_steps(data) == 1  # a batch over budget travels alone, unstaged


def test_iterators_are_not_staged_or_read_ahead():
    x, y = classification_data(n=64)
    model = make_model()
    seen = []

    def batches():
        for i in range(0, 64, 16):
            seen.append(i)
            yield x[i : i + 16], y[i : i + 16]

    model.fit(batches(), epochs=1, verbose=0)
    compiles = model.session.executables.compilations()
    assert compiles["execution"] == 1 and compiles["staged"] == 0
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
    other = data_source(x[::-1].copy(), y[::-1].copy(), None, 16, model.strategy)
    data = data_source(x, y, None, 16, model.strategy)
    feeder = model.session.feeder
    feeder.prefetch(other, 1)
    assert feeder.has_prefetched
    execution = next(feeder.executions(data, 1))
    assert execution.count == 1 and len(execution.calls) == 1
    stage, index = execution.calls[0].args  # a staged step: the stage on the devices and its batch's index
    expected = next(data.batches(1)).x
    np.testing.assert_array_equal(np.asarray(stage.x[int(index)]), expected)
    assert not feeder.has_prefetched  # dropped, not kept for later


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_mirrored_staged_batches_equal_one_device(monkeypatch):
    monkeypatch.setattr(feeder_lib, "MAX_STAGED_STEPS", 3)
    x, y = classification_data(n=70)
    one = make_model("sgd")
    one.fit(x, y, batch_size=16, epochs=2, verbose=0)
    with mf.strategies.MirroredStrategy(jax.local_devices()[:4]).scope():
        mirrored = make_model("sgd")
    mirrored.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert mirrored.session.executables.compilations()["staged"] == 1
    for a, b in zip(one.get_weights(), mirrored.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _staged_masks(model, x, y, batch_size):
    """The mask each stage of one epoch reaches the compiled step with (None: the step's rows are all real)."""
    session = model.session
    data = data_source(x, y, None, batch_size, model.strategy, shuffle=True)
    return [call.args[0].mask for execution in session.feeder.executions(data, 0, 0, False) for call in execution.calls]


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_batches_that_are_all_full_train_without_a_mask_as_they_do_with_one(monkeypatch, steps_per_execution):
    """Where the batch size divides the samples, every process knows that every batch is full: the steps get
    no mask (none is gathered, placed or picked: benchmarks/RESULTS.md, session 16) and train bitwise as
    the masked steps do."""
    x, y = classification_data(n=64)

    def fit(keep_masks):
        if keep_masks:
            monkeypatch.setattr(feeder_lib, "_all_full", lambda data: False)
        model = make_model(steps_per_execution=steps_per_execution)
        history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
        monkeypatch.undo()
        return model, history

    unmasked, h_unmasked = fit(keep_masks=False)
    masked, h_masked = fit(keep_masks=True)
    for a, b in zip(unmasked.get_weights(), masked.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert h_unmasked.history == h_masked.history
    if steps_per_execution == 1:
        assert _staged_masks(unmasked, x, y, 16) == [None] * 4


def test_an_input_with_a_partial_batch_keeps_the_mask_on_every_batch():
    """One program for every stage: a partial batch anywhere keeps the masks (no second compilation)."""
    x, y = classification_data(n=70)
    model = make_model()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    masks = _staged_masks(model, x, y, 16)
    assert len(masks) == 5 and all(mask is not None for mask in masks)
    assert model.session.executables.compilations()["staged"] == 1
