import itertools
import os
import warnings

import numpy as np
import pytest

from meshfit.callbacks import ReduceLROnPlateau

LOSS_SEQUENCES = [
    [1.0, 0.9, 0.9, 0.9, 0.9, 0.9, 0.85, 0.85, 0.85, 0.85, 0.85, 0.85, 0.7, 0.7, 0.7, 0.7],
    [0.5, 0.49995, 0.4999, 0.6, 0.45, 0.46, 0.47, None, 0.48, 0.3, 0.31, 0.32, 0.33, 0.34],
    [1.0] * 14,
]
ACC_SEQUENCES = [
    [0.5, 0.6, 0.6, 0.61, 0.62, 0.62, 0.62, 0.7, 0.69, 0.68, 0.67, 0.66, 0.65, 0.64],
]


def _run(cb, model, values, key):
    """One epoch per value; returns the learning rate after each epoch and the logged one."""
    cb.set_model(model)
    cb.on_train_begin({})
    lrs, logged = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch, value in enumerate(values):
            cb.on_epoch_begin(epoch, {})
            logs = {"loss": 0.0}
            if value is not None:
                logs[key] = value
            cb.on_epoch_end(epoch, logs)
            logged.append(logs["learning_rate"])
            lrs.append(float(np.asarray(model.optimizer.learning_rate)))
    cb.on_train_end({})
    return {"lrs": lrs, "logged": logged, "wait": cb.wait, "cooldown_counter": cb.cooldown_counter}


def _cases():
    grid = itertools.product(
        [0, 1, 3],  # patience
        [0.5, 0.1],  # factor
        [0, 2],  # cooldown
        [0.0, 0.003],  # min_lr
        [1e-4, 0.05],  # min_delta
    )
    for patience, factor, cooldown, min_lr, min_delta in grid:
        for mode, key, seqs in (
            ("auto", "val_loss", LOSS_SEQUENCES),
            ("min", "loss_like", LOSS_SEQUENCES),
            ("max", "val_accuracy", ACC_SEQUENCES),
            ("auto", "val_accuracy", ACC_SEQUENCES),
        ):
            for seq in seqs:
                kwargs = dict(
                    monitor=key, patience=patience, factor=factor, cooldown=cooldown,
                    min_lr=min_lr, min_delta=min_delta, mode=mode,
                )  # fmt: skip
                yield kwargs, seq


class _KerasStandIn:
    def __init__(self, optimizer, metrics):
        self.optimizer = optimizer
        self.metrics = metrics
        self.stop_training = False


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_matches_keras_reduce_lr_on_plateau(make_model):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    from keras.src.trainers.compile_utils import MetricsList

    keras_metrics = [MetricsList([keras.metrics.Accuracy(name="accuracy")])]
    n = 0
    for kwargs, seq in _cases():
        key = kwargs["monitor"]
        ours = _run(ReduceLROnPlateau(**kwargs), make_model(learning_rate=0.01), seq, key)
        keras_model = _KerasStandIn(keras.optimizers.SGD(learning_rate=0.01), keras_metrics)
        theirs = _run(keras.callbacks.ReduceLROnPlateau(**kwargs), keras_model, seq, key)
        assert ours == theirs, (kwargs, seq)
        n += 1
    assert n == 3 * 2 * 2 * 2 * 2 * (2 * len(LOSS_SEQUENCES) + 2 * len(ACC_SEQUENCES))


def test_reduces_after_patience_with_cooldown_and_floor(make_model):
    model = make_model(learning_rate=1.0)
    cb = ReduceLROnPlateau(monitor="loss", factor=0.5, patience=2, cooldown=1, min_lr=0.2)
    r = _run(cb, model, [1.0] * 9, "loss")
    # Epoch 0 sets best; 1, 2 wait -> reduce at 2. As in Keras the cooldown
    # counter is decremented before it is checked, so cooldown=1 lets epoch 3
    # count again: reduce at 4 and 6 (floored at min_lr), then lr == min_lr stops it.
    assert r["lrs"] == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2, 0.2, 0.2])
    assert r["logged"] == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2, 0.2])


def test_factor_must_be_below_one():
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau does not support a factor >= 1.0. Received factor=1.0"):
        ReduceLROnPlateau(factor=1.0)


def test_missing_monitor_warns_and_still_logs_lr(make_model):
    cb = ReduceLROnPlateau()
    cb.set_model(make_model(learning_rate=0.5))
    cb.on_train_begin()
    logs = {"loss": 1.0}
    with pytest.warns(
        UserWarning,
        match=r"Learning rate reduction is conditioned on metric `val_loss` which is not available. Available metrics are: loss,learning_rate.",  # noqa: E501 (Keras's message, verbatim)
    ):
        cb.on_epoch_end(0, logs)
    assert logs["learning_rate"] == 0.5


def test_verbose_message(make_model, capsys):
    cb = ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, verbose=1)
    _run(cb, make_model(learning_rate=1.0), [1.0, 1.0], "loss")
    assert capsys.readouterr().out == "\nEpoch 2: ReduceLROnPlateau reducing learning rate to 0.5.\n"


@pytest.mark.parametrize("load_before_train_begin", [True, False])
def test_state_dict_resume(make_model, load_before_train_begin):
    seq = [1.0, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    kwargs = dict(monitor="loss", factor=0.5, patience=2, cooldown=2)
    full = _run(ReduceLROnPlateau(**kwargs), make_model(learning_rate=1.0), seq, "loss")

    model = make_model(learning_rate=1.0)
    cb = ReduceLROnPlateau(**kwargs)
    r1 = _run(cb, model, seq[:4], "loss")
    state = cb.state_dict()
    assert state == {"wait": 0, "best": 0.9, "cooldown_counter": 2}  # reduced at epoch 3

    cb2 = ReduceLROnPlateau(**kwargs)
    cb2.set_model(model)  # the model (and its learning rate) is restored separately
    if load_before_train_begin:
        cb2.load_state_dict(state)
        cb2.on_train_begin()
    else:
        cb2.on_train_begin()
        cb2.load_state_dict(state)
    lrs = []
    for epoch in range(4, len(seq)):
        cb2.on_epoch_begin(epoch)
        cb2.on_epoch_end(epoch, {"loss": seq[epoch]})
        lrs.append(model.optimizer.learning_rate)
    assert r1["lrs"] + lrs == full["lrs"]
