import itertools
import os
import warnings

import numpy as np
import pytest

from meshfit.callbacks import CallbackList, EarlyStopping

# Monitored sequences (one value per epoch); None = key missing that epoch.
LOSS_SEQUENCES = [
    [1.0, 0.9, 0.8, 0.85, 0.81, 0.82, 0.79, 0.9, 0.95, 1.0, 1.1],
    [0.5, 0.6, 0.7, 0.4, 0.45, 0.46, 0.47, 0.48, 0.3, 0.31],
    [1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94],
    [0.7, None, 0.8, 0.6, None, 0.65, 0.66, 0.67],
    [1.0, 1.0 + 1e-9, 1.0 - 1e-9, 0.95, float("nan"), 0.9, 0.9, 0.9],
]
ACC_SEQUENCES = [
    [0.5, 0.6, 0.65, 0.64, 0.66, 0.66, 0.7, 0.69, 0.68, 0.67],
    [0.9, 0.8, 0.7, 0.95, 0.94, 0.96, 0.5, 0.5],
]


def _run(cb, model, values, key):
    """Feeds one epoch per value; weights encode the epoch. Returns what a caller can observe."""
    cb.set_model(model)
    cb.on_train_begin({})
    last = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch, value in enumerate(values):
            model.set_weights([np.full((2,), epoch, np.float32)])
            cb.on_epoch_begin(epoch, {})
            logs = {"loss": 0.0}
            if value is not None:
                logs[key] = value
            cb.on_epoch_end(epoch, logs)
            last = epoch
            if model.stop_training:
                break
    cb.on_train_end({})
    best = None if cb.best is None else float(cb.best)
    return {
        "last_epoch": last,
        "stop_training": model.stop_training,
        "stopped_epoch": cb.stopped_epoch,
        "best_epoch": cb.best_epoch,
        "wait": cb.wait,
        "best": "nan" if best is not None and np.isnan(best) else best,
        "final_weights_epoch": float(model.get_weights()[0][0]),
    }


def _cases():
    grid = itertools.product(
        [0, 1, 2, 4],  # patience
        [0, 0.05],  # min_delta
        [None, "good", "bad"],  # baseline
        [0, 2],  # start_from_epoch
        [False, True],  # restore_best_weights
    )
    for patience, min_delta, baseline, start, restore in grid:
        for mode, key, seqs, baselines in (
            ("min", "val_loss", LOSS_SEQUENCES, {"good": 0.95, "bad": 0.2}),
            ("auto", "val_loss", LOSS_SEQUENCES, {"good": 0.95, "bad": 0.2}),
            ("max", "val_accuracy", ACC_SEQUENCES, {"good": 0.55, "bad": 0.99}),
            ("auto", "accuracy", ACC_SEQUENCES, {"good": 0.55, "bad": 0.99}),
        ):
            for seq in seqs:
                kwargs = dict(
                    monitor=key,
                    patience=patience,
                    min_delta=min_delta,
                    mode=mode,
                    baseline=None if baseline is None else baselines[baseline],
                    start_from_epoch=start,
                    restore_best_weights=restore,
                )
                yield kwargs, seq


def test_matches_keras_early_stopping(make_model):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    from keras.src.trainers.compile_utils import MetricsList

    # What Keras needs to resolve mode="auto" for "accuracy": the compiled metric.
    keras_metrics = [MetricsList([keras.metrics.Accuracy(name="accuracy")])]
    n = 0
    for kwargs, seq in _cases():
        ours = _run(EarlyStopping(**kwargs), make_model(), seq, kwargs["monitor"])
        theirs = _run(
            keras.callbacks.EarlyStopping(**kwargs),
            make_model(metrics=keras_metrics),
            seq,
            kwargs["monitor"],
        )
        assert ours == theirs, (kwargs, seq)
        n += 1
    assert n == 4 * 2 * 3 * 2 * 2 * (2 * len(LOSS_SEQUENCES) + 2 * len(ACC_SEQUENCES))


def test_basic_patience(make_model):
    model = make_model()
    cb = EarlyStopping(monitor="loss", patience=2)
    r = _run(cb, model, [1.0, 0.5, 0.6, 0.7, 0.4], "loss")
    assert r["last_epoch"] == 3 and r["stopped_epoch"] == 3 and model.stop_training
    assert cb.best == 0.5 and cb.best_epoch == 1


def test_restore_best_weights_without_stopping(make_model):
    # Keras restores in on_train_end even when training ran to the end.
    model = make_model()
    cb = EarlyStopping(monitor="val_loss", patience=10, restore_best_weights=True)
    r = _run(cb, model, [1.0, 0.2, 0.5, 0.6], "val_loss")
    assert not model.stop_training and r["last_epoch"] == 3
    assert r["final_weights_epoch"] == 1.0


def test_baseline_never_beaten_does_not_reset_patience(make_model):
    seq = [1.0, 0.5, 0.6, 0.7, 0.8]
    model = make_model()
    cb = EarlyStopping(monitor="val_loss", baseline=0.1, patience=2, restore_best_weights=True)
    r = _run(cb, model, seq, "val_loss")
    # Improvements that don't beat the baseline don't reset the wait counter.
    assert r["stopped_epoch"] == 2
    assert r["final_weights_epoch"] == 1.0
    r = _run(EarlyStopping(monitor="val_loss", patience=2), make_model(), seq, "val_loss")
    assert r["stopped_epoch"] == 3


def test_start_from_epoch_warmup(make_model):
    model = make_model()
    cb = EarlyStopping(monitor="loss", patience=0, start_from_epoch=3)
    r = _run(cb, model, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "loss")
    assert r["stopped_epoch"] == 4 and cb.best == 4.0


def test_missing_monitor_warns_like_keras(make_model):
    cb = EarlyStopping(monitor="val_loss")
    cb.set_model(make_model())
    cb.on_train_begin()
    with pytest.warns(
        UserWarning,
        match=r"Early stopping conditioned on metric `val_loss` which is not available. Available metrics are: loss,acc",  # noqa: E501 (Keras's message, verbatim)
    ):
        cb.on_epoch_end(0, {"loss": 1.0, "acc": 0.5})


def test_unknown_mode_warns_and_falls_back_to_auto():
    with pytest.warns(UserWarning, match="EarlyStopping mode 'bogus' is unknown, fallback to auto mode."):
        cb = EarlyStopping(mode="bogus")
    assert cb.mode == "auto"


def test_auto_mode_direction(make_model):
    class Metric:
        def __init__(self, name, direction):
            self.name = name
            self._direction = direction

    # Known Keras metric names (as compiled from strings) resolve without help.
    for monitor, maximize in [("val_accuracy", True), ("auc", True), ("val_mae", False), ("loss", False)]:
        cb = EarlyStopping(monitor=monitor, min_delta=0.1)
        cb.set_model(make_model())
        cb._set_monitor_op()
        assert cb._is_improvement(1.0, 0.5) is maximize, monitor
        assert cb.min_delta == (0.1 if maximize else -0.1)
    # The model's own metrics decide for other names.
    cb = EarlyStopping(monitor="val_score")
    cb.set_model(make_model(metrics=[Metric("score", "up")]))
    cb._set_monitor_op()
    assert cb._is_improvement(2.0, 1.0)
    cb = EarlyStopping(monitor="val_score")
    cb.set_model(make_model())
    with pytest.raises(ValueError, match="isn't able to automatically determine"):
        cb.on_epoch_end(0, {"val_score": 1.0})


def test_verbose_messages(make_model, capsys):
    cb = EarlyStopping(monitor="loss", patience=1, verbose=1, restore_best_weights=True)
    _run(cb, make_model(), [1.0, 2.0, 3.0], "loss")
    assert capsys.readouterr().out == (
        "Epoch 2: early stopping\nRestoring model weights from the end of the best epoch: 1.\n"
    )


@pytest.mark.parametrize("load_before_train_begin", [True, False])
def test_state_dict_resume(make_model, load_before_train_begin):
    seq = [1.0, 0.5, 0.6, 0.7, 0.8, 0.9]
    full = _run(EarlyStopping(monitor="loss", patience=3, restore_best_weights=True), make_model(), seq, "loss")

    # First run: 3 epochs, then the state is saved and the run "crashes".
    model = make_model()
    cb = EarlyStopping(monitor="loss", patience=3, restore_best_weights=True)
    cb.set_model(model)
    cb.on_train_begin()
    for epoch in range(3):
        model.set_weights([np.full((2,), epoch, np.float32)])
        cb.on_epoch_end(epoch, {"loss": seq[epoch]})
    state = cb.state_dict()
    assert state["wait"] == 1 and state["best"] == 0.5 and state["best_epoch"] == 1
    assert state["stopped_epoch"] == 0
    np.testing.assert_array_equal(state["best_weights"][0], [1.0, 1.0])

    # Resumed run with a fresh callback, in either order w.r.t. on_train_begin.
    model2 = make_model()
    cb2 = EarlyStopping(monitor="loss", patience=3, restore_best_weights=True)
    cb2.set_model(model2)
    if load_before_train_begin:
        cb2.load_state_dict(state)
        cb2.on_train_begin()
    else:
        cb2.on_train_begin()
        cb2.load_state_dict(state)
    for epoch in range(3, len(seq)):
        cb2.on_epoch_begin(epoch)
        model2.set_weights([np.full((2,), epoch, np.float32)])
        cb2.on_epoch_end(epoch, {"loss": seq[epoch]})
        if model2.stop_training:
            break
    cb2.on_train_end()
    assert cb2.stopped_epoch == full["stopped_epoch"] == 4
    assert float(model2.get_weights()[0][0]) == full["final_weights_epoch"] == 1.0

    # A later fit() with the same instance starts fresh again.
    cb2.on_train_begin()
    assert cb2.wait == 0 and cb2.best is None and cb2.best_weights is None


def test_works_in_callback_list(make_model):
    model = make_model()
    cbs = CallbackList([EarlyStopping(monitor="loss")], model=model, epochs=5, steps=1, verbose=0)
    cbs.on_train_begin()
    for epoch, loss in enumerate([1.0, 2.0]):
        cbs.on_epoch_begin(epoch)
        cbs.on_epoch_end(epoch, {"loss": loss})
    assert model.stop_training
