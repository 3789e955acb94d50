"""Generators and datasets: batches of any size and order (a bounded number of compilations, exact
results), and validation generators evaluated on every epoch."""

import logging
import math
import warnings

import grain
import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf
import meshfit.data.sources as data_lib

SIZES = [2, 3, 5, 16, 7, 1, 40, 9]  # the first is the smallest; padded to 2, 4, 8, 16, 16, 16, 40, 40


def batches(x, y, sizes=SIZES):
    starts = np.cumsum([0, *sizes])
    return [(x[a:b], y[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def compiled(model):
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class TrainStepCompilations(logging.Handler):
    """Counts XLA compilations of the train step, from JAX's own log of compilations."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("Compiling jit(train_step)")


@pytest.fixture
def train_compilations():
    handler, logger = TrainStepCompilations(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield handler
    finally:
        logger.removeHandler(handler)


@pytest.mark.slow
def test_batches_of_any_size_train_exactly_with_a_bounded_number_of_compilations(train_compilations):
    x, y = classification_data(n=sum(SIZES))
    model = compiled(mf.Model(MLP()))
    history = model.fit(iter(batches(x, y)), verbose=0)
    # One compilation per padded size (2, 4, 8, 16, 40): at most 1 + ceil(log2(largest / first)).
    assert train_compilations.count == 5 <= 1 + math.ceil(math.log2(max(SIZES) / SIZES[0]))
    # Padding rows count for nothing: the same as training on each batch unpadded, one fit per batch.
    reference = compiled(mf.Model(MLP()))
    losses = [reference.fit(iter([batch]), verbose=0).history["loss"][0] for batch in batches(x, y)]
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The epoch's loss is the mean over its real rows, as Keras weighs batches by their sizes.
    assert history.history["loss"][0] == pytest.approx(np.average(losses, weights=SIZES), rel=1e-5)
    # Losses and metrics over ragged batches equal those over all rows at once.
    ragged = model.evaluate(iter(batches(x, y)), return_dict=True, verbose=0)
    whole = model.evaluate(x, y, batch_size=len(x), return_dict=True, verbose=0)
    assert ragged == pytest.approx(whole, rel=1e-5)


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_growing_batches_with_steps_per_execution():
    x, y = classification_data(n=sum(SIZES))
    # Logits, not the probabilities the loss's name expects: clipped "probabilities" make gradients so
    # large that float32 rounding of the two padded sums (to 5, 16, 40 rows here; 2, 4, 8, ... there)
    # grows to 3e-5 over 8 steps. With logits the two runs stay within float32 rounding.
    loss = mf.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = mf.Model(MLP())
    model.compile(optimizer="sgd", loss=loss, steps_per_execution=3)
    reference = mf.Model(MLP())
    reference.compile(optimizer="sgd", loss=loss)
    model.fit(iter(batches(x, y)), verbose=0)
    reference.fit(iter(batches(x, y)), verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def one_shot(items):
    return (item for item in items)


@pytest.mark.parametrize("kind", ["generator", "list", "grain"])
def test_a_finite_validation_input_is_evaluated_on_every_epoch(kind):
    x, y = classification_data(n=96)
    val = batches(x[64:], y[64:], sizes=[8, 16, 8])
    source = {
        "generator": lambda: one_shot(val),
        "list": lambda: [tuple(b) for b in val],
        "grain": lambda: grain.MapDataset.source(val),
    }[kind]()
    if kind == "list":
        source = _ListOfBatches(source)  # a plain list of tuples is read as arrays, as in Keras
    model = compiled(mf.Model(MLP()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ran out of data" warning
        history = model.fit(x[:64], y[:64], batch_size=16, epochs=3, validation_data=source, verbose=0)
    assert len(history.history["val_loss"]) == 3
    # Each epoch's entry is the evaluation of the same batches with that epoch's weights: the last one, here.
    last = model.evaluate(x[64:], y[64:], batch_size=32, return_dict=True, verbose=0)
    assert history.history["val_loss"][-1] == pytest.approx(last["loss"], rel=1e-5)
    assert history.history["val_accuracy"][-1] == pytest.approx(last["accuracy"], rel=1e-5)
    assert len(set(history.history["val_loss"])) == 3  # evaluated anew each epoch


class _ListOfBatches:
    """A re-iterable of batches that is not itself an iterator (like a grain dataset or a Keras PyDataset)."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def test_a_one_shot_validation_generator_too_large_to_keep_warns(monkeypatch):
    monkeypatch.setattr(data_lib, "REPLAY_BYTES", 100)  # smaller than one batch
    x, y = classification_data(n=96)
    model = compiled(mf.Model(MLP()))
    with pytest.warns(UserWarning, match="one-shot iterator.*ran out after its first pass.*re-iterable"):
        history = model.fit(
            x[:64],
            y[:64],
            batch_size=16,
            epochs=3,
            validation_data=one_shot(batches(x[64:], y[64:], [16, 16])),
            verbose=0,
        )
    assert len(history.history["val_loss"]) == 1 and len(history.history["loss"]) == 3


def _stream(x, y, bad_batch=None, rows=16, change=None):
    """Batches of `rows`; batch `bad_batch` gets label 7 at row 5, or its features changed by `change`."""
    for i in range(len(x) // rows):
        xb, yb = x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows].copy()
        if i == bad_batch:
            if change is None:
                yb[5] = 7
            else:
                xb = change(xb)
        yield xb, yb


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_streamed_label_out_of_range_is_refused_before_a_step_uses_its_batch(prefetch):
    """Read here or ahead on the reading thread: the error comes when the loop takes batch 4, before its step."""
    x, y = classification_data(n=96)
    model = compiled(mf.Model(MLP()))
    stream = data_lib.IterableData(_stream(x, y, bad_batch=4), prefetch=prefetch)
    with pytest.raises(ValueError, match=r"\[0, 3\).*Received: 7 at batch 4 of the epoch \(counting from 0\), row 5"):
        model.fit(stream, verbose=0)
    assert model.session.step == 4  # batches 0 to 3 trained; batch 4 reached no step


@pytest.mark.parametrize(
    "change,says",
    [
        (lambda xb: xb[:, :3], r"Batch 2 .* x of .* kind \(3,\) float; the first batch had \(4,\) float"),
        (lambda xb: (xb * 10).astype(np.int32), r"Batch 2 .* \(4,\) int; the first batch had \(4,\) float"),
    ],
)
def test_a_batch_unlike_the_first_is_refused_by_number(change, says):
    x, y = classification_data(n=64)
    model = compiled(mf.Model(MLP()))
    with pytest.raises(ValueError, match=says):
        model.fit(_stream(x, y, bad_batch=2, change=change), verbose=0)
    assert model.session.step == 2
