from meshfit.callbacks import CallbackList, History


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
