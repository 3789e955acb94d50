import numpy as np
import pytest

from meshfit.callbacks import LearningRateScheduler


def _run(cb, model, epochs):
    cb.set_model(model)
    cb.on_train_begin()
    seen, logged = [], []
    for epoch in range(epochs):
        cb.on_epoch_begin(epoch)
        seen.append(model.optimizer.learning_rate)
        logs = {"loss": 1.0}
        cb.on_epoch_end(epoch, logs)
        logged.append(logs["learning_rate"])
    return seen, logged


def test_schedule_with_epoch_and_lr(make_model):
    model = make_model(learning_rate=0.1)
    calls = []

    def schedule(epoch, lr):
        calls.append((epoch, lr))
        return lr if epoch < 2 else lr * 0.5

    seen, logged = _run(LearningRateScheduler(schedule), model, 4)
    assert [c[0] for c in calls] == [0, 1, 2, 3]
    assert calls[0][1] == pytest.approx(0.1)
    assert seen == pytest.approx([0.1, 0.1, 0.05, 0.025])
    assert logged == seen


def test_one_argument_schedule_is_supported(make_model):
    model = make_model()
    seen, _ = _run(LearningRateScheduler(lambda epoch: 1.0 / (epoch + 1)), model, 3)
    assert seen == pytest.approx([1.0, 0.5, 1.0 / 3])


def test_numpy_floats_accepted(make_model):
    model = make_model()
    seen, _ = _run(LearningRateScheduler(lambda e, lr: np.float32(0.25)), model, 1)
    assert seen == [0.25]


@pytest.mark.parametrize("bad", [1, "0.1", None])
def test_non_float_schedule_output_raises_keras_error(make_model, bad):
    cb = LearningRateScheduler(lambda epoch, lr: bad)
    cb.set_model(make_model())
    with pytest.raises(ValueError, match="The output of the `schedule` function should be a float"):
        cb.on_epoch_begin(0)


def test_optimizer_without_learning_rate(make_model):
    model = make_model()
    model.optimizer = object()
    cb = LearningRateScheduler(lambda e, lr: 0.1)
    cb.set_model(model)
    with pytest.raises(ValueError, match='Optimizer must have a "learning_rate" attribute.'):
        cb.on_epoch_begin(0)


def test_verbose_message(make_model, capsys):
    cb = LearningRateScheduler(lambda e, lr: 0.5, verbose=1)
    cb.set_model(make_model())
    cb.on_epoch_begin(2)
    assert capsys.readouterr().out == "\nEpoch 3: LearningRateScheduler setting learning rate to 0.5.\n"
