"""meshfit.data.label_check: class ids out of range are refused before any step, with where they are and the range."""

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf
from meshfit.data.label_check import check_labels, label_ranges
from meshfit.steps.terms import LossTerm, MetricTerm, Output

OUT = Output("output", ())


def compiled(loss=None, metrics=None):
    model = mf.Model(MLP())
    model.compile(
        optimizer="adam", loss=loss or mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=metrics
    )
    return model


@pytest.mark.parametrize("bad", [7, 3, -1])
def test_array_labels_out_of_range_are_refused_before_any_step(bad):
    x, y = classification_data(n=64)
    y[13] = bad
    model = compiled(metrics=["accuracy"])
    before = model.get_weights()
    with pytest.raises(ValueError, match=rf"class ids in \[0, 3\).*Received: {bad} at sample 13 of y"):
        model.fit(x, y, batch_size=16, verbose=0)
    assert model.session.step == 0
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=rf"Received: {bad} at sample 13 of y"):
        model.evaluate(x, y, batch_size=16, verbose=0)


def test_sample_numbers_are_the_users_under_a_validation_split_and_validation_data_is_checked():
    x, y = classification_data(n=64)
    bad = y.copy()
    bad[60] = 5  # in the validation part
    with pytest.raises(ValueError, match="Received: 5 at sample 60 of y"):
        compiled().fit(x, bad, batch_size=16, validation_split=0.25, verbose=0)
    with pytest.raises(ValueError, match="Received: 5 at sample 60 of y"):
        compiled().fit(x, y, batch_size=16, validation_data=(x, bad), verbose=0)


def test_a_sparse_metric_alone_sets_the_range_and_a_nan_label_is_out_of_it():
    metric = MetricTerm(OUT, mf.metrics.SparseTopKCategoricalAccuracy(k=2), True, "top2")
    ranges = label_ranges([], [metric], jax.ShapeDtypeStruct((8, 5), np.float32))
    labels = np.array([0, 1, 4, np.nan], np.float32)
    with pytest.raises(ValueError, match=r"\[0, 5\).*sparse_top_k_categorical_accuracy reads.*Received: nan at row 3"):
        check_labels(ranges, labels, lambda row: f"row {row}")


def test_the_ignored_class_is_allowed_and_no_other():
    x, y = classification_data(n=32)
    y[3] = -1
    ignoring = mf.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    compiled(loss=ignoring).fit(x, y, batch_size=16, verbose=0)  # -1 is skipped, not refused
    y[5] = 4
    with pytest.raises(ValueError, match=r"class ids in \[0, 3\) or -1.*Received: 4 at sample 5"):
        compiled(loss=ignoring).fit(x, y, batch_size=16, verbose=0)


def test_sequence_labels_name_the_position_within_the_sample_and_other_losses_are_not_checked():
    y_pred = jax.ShapeDtypeStruct((2, 5, 10), np.float32)
    ranges = label_ranges([LossTerm(OUT, mf.losses.SparseCategoricalCrossentropy(), None)], [], y_pred)
    assert [(r.classes, r.ignore_class) for r in ranges] == [(10, None)]
    labels = np.zeros((2, 5), np.int32)
    check_labels(ranges, labels, lambda row: f"sample {row}")
    labels[1, 3] = 10
    with pytest.raises(ValueError, match=r"Received: 10 at sample 1 \(index \(3,\) within it\)"):
        check_labels(ranges, labels, lambda row: f"sample {row}")
    assert label_ranges([LossTerm(OUT, mf.losses.MeanSquaredError(), None)], [], y_pred) == ()
