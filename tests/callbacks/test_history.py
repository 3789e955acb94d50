import pytest

from meshfit.callbacks import CallbackList, History, LambdaCallback


def test_history_records_epoch_logs(make_model):
    h = History()
    cbs = CallbackList([h], model=make_model(), epochs=3, steps=2, verbose=0)
    cbs.on_train_begin()
    for epoch in range(3):
        cbs.on_epoch_begin(epoch)
        logs = {"loss": 1.0 / (epoch + 1), "val_loss": 2.0 / (epoch + 1)}
        if epoch == 2:
            logs["learning_rate"] = 0.1
        cbs.on_epoch_end(epoch, logs)
    cbs.on_train_end()
    assert h.epoch == [0, 1, 2]
    assert h.history == {
        "loss": [1.0, 0.5, 1.0 / 3],
        "val_loss": [2.0, 1.0, 2.0 / 3],
        "learning_rate": [0.1],
    }
    assert h.params == {"epochs": 3, "steps": 2, "verbose": 0}


def test_history_epoch_resets_but_history_accumulates_like_keras(make_model):
    h = History()
    h.set_model(make_model())
    h.on_train_begin()
    h.on_epoch_end(0, {"loss": 3.0})
    h.on_train_begin()  # a second fit() with the same instance
    h.on_epoch_end(0, {"loss": 2.0})
    h.on_epoch_end(1, None)
    assert h.epoch == [0, 1]
    assert h.history == {"loss": [3.0, 2.0]}


def test_history_does_not_set_model_history(make_model):
    model = make_model()
    h = History()
    h.set_model(model)
    h.on_train_begin()
    h.on_epoch_end(0, {"loss": 1.0})
    assert not hasattr(model, "history")


def _fit(callbacks):
    from helpers import MLP, classification_data

    import meshfit as mf

    x, y = classification_data(n=70)
    model = mf.Model(MLP())
    model.compile(
        optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=callbacks, validation_data=(x[:20], y[:20]))
    return history


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_a_fit_with_only_history_reads_epoch_logs_when_history_is_read():
    import jax

    seen = []
    reader = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(dict(logs)))
    synced = _fit([reader])
    deferred = _fit([])
    assert all(isinstance(v, float) for logs in seen for v in logs.values())  # a callback that reads: floats
    pending = deferred._unread
    assert len(pending) == 3 and all(isinstance(logs["loss"], jax.Array) for logs in pending)  # no sync yet
    assert all(isinstance(logs["val_loss"], float) for logs in pending)  # validation had synced anyway
    assert deferred.history == synced.history  # the same values, read on access
    assert deferred._unread == [] and set(deferred.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert all(isinstance(v, float) for values in deferred.history.values() for v in values)


def test_only_history_itself_takes_device_logs_not_its_subclasses():
    class Recording(History):
        def on_epoch_end(self, epoch, logs=None):
            assert all(isinstance(v, float) for v in logs.values())
            super().on_epoch_end(epoch, logs)

    assert CallbackList([History()]).accepts_device_logs
    assert not CallbackList([Recording()]).accepts_device_logs
    assert not CallbackList([History(), LambdaCallback()]).accepts_device_logs
    _fit([Recording()])
