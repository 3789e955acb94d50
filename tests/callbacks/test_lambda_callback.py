from meshfit.callbacks import Callback, CallbackList, LambdaCallback


def test_lambda_callback_calls_each_hook_with_its_arguments():
    calls = []
    cb = LambdaCallback(
        on_epoch_begin=lambda epoch, logs: calls.append(("epoch_begin", epoch, logs)),
        on_epoch_end=lambda epoch, logs: calls.append(("epoch_end", epoch, logs)),
        on_train_begin=lambda logs: calls.append(("train_begin", logs)),
        on_train_end=lambda logs: calls.append(("train_end", logs)),
        on_train_batch_begin=lambda batch, logs: calls.append(("batch_begin", batch, logs)),
        on_train_batch_end=lambda batch, logs: calls.append(("batch_end", batch, logs)),
        on_test_begin=lambda logs: calls.append(("test_begin", logs)),
        on_test_batch_end=lambda batch, logs: calls.append(("test_batch_end", batch, logs)),
        on_predict_end=lambda logs: calls.append(("predict_end", logs)),
    )
    assert isinstance(cb, Callback)
    cbs = CallbackList([cb])
    cbs.on_train_begin({})
    cbs.on_epoch_begin(0, {})
    cbs.on_train_batch_begin(0, {})
    cbs.on_train_batch_end(0, {"loss": 1.0})
    cbs.on_test_begin({})
    cbs.on_test_batch_end(3, {"loss": 2.0})
    cbs.on_test_end({"loss": 2.0})  # not given: the base no-op
    cbs.on_epoch_end(0, {"loss": 1.0})
    cbs.on_train_end({})
    cbs.on_predict_end({})
    assert calls == [
        ("train_begin", {}),
        ("epoch_begin", 0, {}),
        ("batch_begin", 0, {}),
        ("batch_end", 0, {"loss": 1.0}),
        ("test_begin", {}),
        ("test_batch_end", 3, {"loss": 2.0}),
        ("epoch_end", 0, {"loss": 1.0}),
        ("train_end", {}),
        ("predict_end", {}),
    ]


def test_lambda_callback_unset_hooks_are_noops_and_legacy_batch_hook_works():
    seen = []
    cb = LambdaCallback(on_batch_end=lambda batch, logs: seen.append(batch))
    # The default on_train_batch_end forwards to on_batch_end, as in Keras.
    cb.on_train_batch_end(7, {})
    cb.on_epoch_end(0, {})
    cb.on_train_begin()
    assert seen == [7]
