"""The training loop: steps_per_execution, callback order and indices, stop_training, validation_freq."""

import numpy as np
import optax
import pytest
from helpers import MLP, assert_trees_close, classification_data

import meshfit as mf
from meshfit.training.in_flight import InFlight


class Recorder(mf.callbacks.Callback):
    """Records every hook call as (hook, index) pairs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        if name.startswith("on_") and name not in ("on_batch_begin", "on_batch_end"):
            calls = object.__getattribute__(self, "calls")

            def record(*args, **kwargs):
                index = args[0] if args and isinstance(args[0], int) else None
                calls.append((name, index))

            return record
        return object.__getattribute__(self, name)


def recorder():
    rec = Recorder()
    for hook in [h for h in dir(mf.callbacks.Callback) if h.startswith("on_")]:
        rec.__dict__[hook] = None  # mark every hook as implemented for the dispatcher
    return rec


def make_model(spe=1, optimizer="sgd"):
    model = mf.Model(MLP())
    model.compile(
        optimizer=optimizer,
        loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=spe,
    )
    return model


@pytest.mark.slow
def test_steps_per_execution_matches_single_steps_with_ragged_last_group():
    x, y = classification_data(n=90)  # 10 batches of 9: groups of 4, 4, 2
    one, four = make_model(1, "adam"), make_model(4, "adam")
    h1 = one.fit(x, y, batch_size=9, epochs=3, verbose=0)
    h4 = four.fit(x, y, batch_size=9, epochs=3, verbose=0)
    assert_trees_close(one.params, four.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h1.history["loss"], h4.history["loss"], rtol=1e-5)
    assert int(four.session.state.step) == 30  # padding steps of the last group did not count
    r1 = one.evaluate(x, y, batch_size=9, verbose=0, return_dict=True)
    r4 = four.evaluate(x, y, batch_size=9, verbose=0, return_dict=True)
    assert r1["loss"] == pytest.approx(r4["loss"], rel=1e-5)
    np.testing.assert_allclose(
        one.predict(x, batch_size=9, verbose=0), four.predict(x, batch_size=9, verbose=0), rtol=1e-5, atol=1e-6
    )
    assert four.session.executables.compilations()["execution"] == 1


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_callback_order_and_batch_indices_follow_keras():
    x, y = classification_data(n=40)
    rec = recorder()
    model = make_model(spe=4)
    model.fit(x, y, batch_size=4, epochs=1, validation_data=(x[:8], y[:8]), callbacks=[rec], verbose=0)
    calls = rec.calls
    train_batches = [(h, i) for h, i in calls if h.startswith("on_train_batch")]
    # 10 batches in calls of 4: Keras calls begin with the first index and end with the last.
    assert train_batches == [
        ("on_train_batch_begin", 0),
        ("on_train_batch_end", 3),
        ("on_train_batch_begin", 4),
        ("on_train_batch_end", 7),
        ("on_train_batch_begin", 8),
        ("on_train_batch_end", 9),
    ]
    hooks = [h for h, _ in calls if "batch" not in h]
    assert hooks == ["on_train_begin", "on_epoch_begin", "on_test_begin", "on_test_end", "on_epoch_end", "on_train_end"]


def test_batch_logs_are_running_means_and_epoch_logs_floats():
    x, y = classification_data(n=32)
    seen = []
    cb = mf.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(float(logs["loss"])),
        on_epoch_end=lambda epoch, logs: seen.append(logs),
    )
    model = make_model()
    model.fit(x, y, batch_size=8, epochs=1, callbacks=[cb], shuffle=False, verbose=0)
    epoch_logs = seen[-1]
    assert isinstance(epoch_logs["loss"], float)
    assert seen[-2] == pytest.approx(epoch_logs["loss"])  # the last batch's running mean is the epoch mean


def test_stop_training_from_a_batch_callback_stops_at_once():
    x, y = classification_data(n=64)

    class StopAt(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                self.model.stop_training = True

    model = make_model()
    history = model.fit(x, y, batch_size=8, epochs=5, callbacks=[StopAt()], verbose=0)
    assert history.epoch == [0]
    assert int(model.session.state.step) == 3


def test_validation_freq_int_and_list():
    x, y = classification_data(n=32)
    model = make_model()
    seen = []
    cb = mf.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: seen.append("val_loss" in logs))
    model.fit(x, y, epochs=4, validation_split=0.25, validation_freq=2, callbacks=[cb], verbose=0)
    assert seen == [False, True, False, True]
    seen.clear()
    model.fit(x, y, epochs=3, validation_split=0.25, validation_freq=[1, 3], callbacks=[cb], verbose=0)
    assert seen == [True, False, True]


def test_initial_epoch_and_steps_per_epoch_stream():
    x, y = classification_data(n=40)
    model = make_model()
    history = model.fit(x, y, batch_size=8, epochs=4, initial_epoch=2, verbose=0)
    assert history.epoch == [2, 3]
    model = make_model()
    model.fit(x, y, batch_size=8, epochs=3, steps_per_epoch=2, verbose=0)
    assert int(model.session.state.step) == 6


def test_learning_rate_scheduler_changes_lr_without_recompiling():
    x, y = classification_data(n=32)
    model = make_model()
    schedule = mf.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))
    history = model.fit(x, y, batch_size=8, epochs=3, callbacks=[schedule], verbose=0)
    np.testing.assert_allclose(history.history["learning_rate"], [0.1, 0.05, 0.1 / 3], rtol=1e-6)
    assert model.optimizer.learning_rate == pytest.approx(0.1 / 3)
    assert model.session.executables.compilations()["staged"] == 1


def test_learning_rate_change_has_effect_on_updates():
    x, y = classification_data(n=16)
    frozen = make_model()
    before = frozen.get_weights()
    frozen.fit(
        x, y, batch_size=16, epochs=2, callbacks=[mf.callbacks.LearningRateScheduler(lambda e, lr: 0.0)], verbose=0
    )
    for a, b in zip(before, frozen.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_reduce_lr_on_plateau_and_early_stopping_on_a_real_model():
    x, y = classification_data(n=32)
    model = make_model(optimizer=mf.optimizers.get("sgd", learning_rate=0.0))  # a plateau from the start
    reduce = mf.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=1.0)
    stop = mf.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1.0, restore_best_weights=True)
    history = model.fit(x, y, batch_size=8, epochs=10, callbacks=[reduce, stop], verbose=0)
    assert len(history.epoch) == 4  # EarlyStopping: stops after patience epochs without improvement


def test_early_stopping_restores_best_weights():
    x, y = classification_data(n=64)
    model = make_model(optimizer=mf.optimizers.get("sgd", learning_rate=0.5))
    snapshots = []
    record = mf.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: snapshots.append((logs["val_loss"], model.get_weights()))
    )
    stop = mf.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    model.fit(x, y, batch_size=8, epochs=12, validation_split=0.25, callbacks=[record, stop], verbose=0)
    best = min(snapshots, key=lambda s: s[0])[1]
    for a, b in zip(model.get_weights(), best, strict=True):
        np.testing.assert_array_equal(a, b)


def test_terminate_on_nan_stops_training():
    x, y = classification_data(n=32)
    x = x.copy()
    x[5:] = np.nan
    model = make_model()
    history = model.fit(
        x, y, batch_size=4, epochs=3, callbacks=[mf.callbacks.TerminateOnNaN()], shuffle=False, verbose=0
    )
    assert history.epoch == [] or len(history.epoch) <= 1
    assert int(model.session.state.step) == 2  # the NaN appeared in the second batch


def test_progress_bar_is_default_with_verbose_and_silent_with_zero(capsys):
    x, y = classification_data(n=32)
    model = make_model()
    model.fit(x, y, batch_size=8, epochs=2, verbose=2)
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Epoch 1/2" in text and "loss:" in text and "accuracy:" in text
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    out = capsys.readouterr()
    assert out.out + out.err == ""


def test_csv_logger_and_tensorboard_in_fit(tmp_path):
    x, y = classification_data(n=32)
    model = make_model()
    csv_path = tmp_path / "log.csv"
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        validation_split=0.25,
        verbose=0,
        callbacks=[mf.callbacks.CSVLogger(str(csv_path)), mf.callbacks.TensorBoard(log_dir=str(tmp_path / "tb"))],
    )
    lines = csv_path.read_text().splitlines()
    assert lines[0] == "epoch,accuracy,loss,val_accuracy,val_loss"
    assert len(lines) == 3
    assert list((tmp_path / "tb" / "train").iterdir()) and list((tmp_path / "tb" / "validation").iterdir())


def test_each_call_of_fit_shuffles_anew_and_a_loop_of_fits_trains_as_one_fit():
    """As in Keras, epochs of separate `fit` calls are shuffled differently; here exactly as one longer fit."""
    x, y = classification_data(n=64)
    first_batch_losses = []
    frozen = make_model(optimizer=optax.sgd(0.0))  # no update: a batch's loss shows which rows it holds
    probe = mf.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch == 0 and first_batch_losses.append(float(logs["loss"]))
    )
    for _ in range(3):
        frozen.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[probe])
    assert len(set(first_batch_losses)) == 3, first_batch_losses  # three orders, not one repeated

    once, looped = make_model(), make_model()
    h_once = once.fit(x, y, batch_size=16, epochs=3, verbose=0)
    h_looped = [looped.fit(x, y, batch_size=16, epochs=1, verbose=0) for _ in range(3)]
    for a, b in zip(once.get_weights(), looped.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [h.history["loss"][0] for h in h_looped] == h_once.history["loss"]


class Token:
    """A stand-in for a step's output that records when the host waits on it."""

    def __init__(self, name, waits):
        self.name, self.waits = name, waits

    def block_until_ready(self):
        self.waits.append(self.name)
        return self


def test_in_flight_waits_on_the_mark_one_limit_back():
    waits = []
    in_flight = InFlight(limit=3)
    for i in range(1, 11):
        in_flight.add(Token(i, waits))
    assert waits == [3, 6]  # at execution 6 for 3, at 9 for 6: at most 2 * limit queued
    in_flight.clear()
    for i in range(11, 17):
        in_flight.add(Token(i, waits))
    assert waits == [3, 6, 13]  # after clear, counting starts afresh


def test_a_state_store_counts_its_calls_against_the_in_flight_bound_as_add_does():
    """`StateStore.advance` counts through `InFlight` (the rule's one owner): the waits of `add`, across calls."""
    from meshfit.training.state_store import StateStore

    waits, added = [], []
    store, in_flight = StateStore({"w": np.zeros(2)}), InFlight(limit=3)
    calls = [(lambda state, i: (state, {"loss": Token(i, waits)}), (i,)) for i in range(1, 11)]
    store.advance(calls[:4], in_flight)
    store.advance(calls[4:], in_flight)
    reference = InFlight(limit=3)
    for i in range(1, 11):
        reference.add(Token(i, added))
    assert waits == added == [3, 6] and in_flight.since_mark == reference.since_mark == 1


def test_in_flight_on_one_device_spaces_marks_further_while_they_come_fast(monkeypatch):
    """Marks less than SHORT_INTERVAL apart double the spacing (to max_spacing); far apart, it halves back."""
    import meshfit.training.in_flight as in_flight_lib

    clock = [0.0]
    monkeypatch.setattr(in_flight_lib, "perf_counter", lambda: clock[0])
    waits = []
    in_flight = InFlight(limit=2, max_spacing=8)
    spacings = []
    for i in range(1, 41):
        clock[0] += in_flight_lib.SHORT_INTERVAL / 100  # tiny executions
        in_flight.add(Token(i, waits))
        spacings.append(in_flight.spacing)
    assert waits == [2, 4, 6, 10, 18, 26]  # the previous mark, every 2, 4, then 8 executions
    assert max(spacings) == 8 == in_flight.spacing  # never past max_spacing: at most 16 queued
    for i in range(41, 81):
        clock[0] += 2 * in_flight_lib.SHORT_INTERVAL  # slow executions: marks 8 or more intervals apart
        in_flight.add(Token(i, waits))
    assert in_flight.spacing == 2  # back at the limit
    in_flight.clear()
    assert in_flight.spacing == 2 and in_flight.since_mark == 0


def test_in_flight_spacing_stays_at_the_limit_without_max_spacing():
    waits = []
    in_flight = InFlight(limit=3)
    for i in range(1, 31):
        in_flight.add(Token(i, waits))
    assert waits == list(range(3, 28, 3)) and in_flight.spacing == 3


def test_a_one_device_model_gets_the_adaptive_bound_and_a_mirrored_one_the_fixed_bound():
    from meshfit.training.session import ONE_DEVICE_SPACING

    assert make_model().session.in_flight.max_spacing == ONE_DEVICE_SPACING
    with mf.strategies.MirroredStrategy().scope():
        mirrored = make_model()
    assert mirrored.session.in_flight.max_spacing == mirrored.session.in_flight.limit
