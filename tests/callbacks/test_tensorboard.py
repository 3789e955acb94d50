import glob
import gzip
import os
import struct
import sys

import numpy as np
import pytest

pytest.importorskip("tensorboardX")
from helpers import MLP, classification_data  # noqa: E402
from tensorboardX.proto import event_pb2  # noqa: E402

import meshfit as mf  # noqa: E402
from meshfit.callbacks import CallbackList, TensorBoard  # noqa: E402


def read_events(directory):
    """Reads every event file in `directory` (TFRecord framing: u64 length, u32 crc, data, u32 crc)."""
    files = sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*")))
    assert files, f"no event file in {directory}"
    scalars, histograms = {}, {}
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            pos += 12
            event = event_pb2.Event.FromString(data[pos : pos + length])
            pos += length + 4
            for value in event.summary.value:
                if value.HasField("histo"):
                    histograms.setdefault(value.tag, []).append((event.step, value.histo))
                else:
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars, histograms


class NamedModel:
    def __init__(self):
        self.stop_training = False
        self.weights = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([-1.0, 1.0], np.float32)]

    def get_weights(self):
        return [w.copy() for w in self.weights]

    def weight_names(self):
        return ["dense/kernel:0", "dense/bias"]


class CountingScalar:
    """A batch-log value that counts how often it is read from the "device"."""

    reads = 0

    def __init__(self, value):
        self.value = value

    def __float__(self):
        CountingScalar.reads += 1
        return float(self.value)


def _fit(cb, model, epochs, steps, with_lr=True):
    cbs = CallbackList([cb], model=model, epochs=epochs, steps=steps, verbose=0)
    cbs.on_train_begin()
    for epoch in range(epochs):
        cbs.on_epoch_begin(epoch)
        for batch in range(steps):
            cbs.on_train_batch_begin(batch)
            cbs.on_train_batch_end(
                batch, {"loss": CountingScalar(epoch * steps + batch), "accuracy": CountingScalar(0.5)}
            )
        cbs.on_test_begin()
        for batch in range(2):
            cbs.on_test_batch_begin(batch)
            cbs.on_test_batch_end(batch, {"loss": CountingScalar(9.0)})
        cbs.on_test_end({"loss": 0.25 * epoch, "accuracy": 0.5})
        logs = {
            "loss": 1.0 / (epoch + 1),
            "accuracy": 0.5 + epoch / 10,
            "val_loss": 2.0 / (epoch + 1),
            "val_accuracy": 0.25,
        }
        if with_lr:
            logs["learning_rate"] = 0.01 * (epoch + 1)
        cbs.on_epoch_end(epoch, logs)
    cbs.on_train_end()


def test_epoch_scalars_layout(tmp_path, make_model):
    CountingScalar.reads = 0
    cb = TensorBoard(log_dir=tmp_path)
    _fit(cb, make_model(), epochs=3, steps=4)
    assert CountingScalar.reads == 0  # update_freq="epoch": batch logs never read
    assert sorted(os.listdir(tmp_path)) == ["train", "validation"]
    train, train_h = read_events(tmp_path / "train")
    val, _ = read_events(tmp_path / "validation")
    assert train_h == {}
    assert set(train) == {"epoch_loss", "epoch_accuracy", "epoch_learning_rate"}
    assert train["epoch_loss"] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert train["epoch_learning_rate"] == [(e, pytest.approx(0.01 * (e + 1))) for e in range(3)]
    assert set(val) == {"epoch_loss", "epoch_accuracy"} | {
        "evaluation_loss_vs_iterations",
        "evaluation_accuracy_vs_iterations",
    }
    assert val["epoch_loss"] == [(0, 2.0), (1, 1.0), (2, pytest.approx(2 / 3))]
    assert val["epoch_accuracy"] == [(e, 0.25) for e in range(3)]
    # Evaluation scalars at the training iteration reached (4 steps per epoch).
    assert val["evaluation_loss_vs_iterations"] == [(4, 0.0), (8, 0.25), (12, 0.5)]


def test_learning_rate_taken_from_optimizer_when_not_logged(tmp_path, make_model):
    cb = TensorBoard(log_dir=tmp_path)
    _fit(cb, make_model(learning_rate=0.125), epochs=2, steps=1, with_lr=False)
    train, _ = read_events(tmp_path / "train")
    assert train["epoch_learning_rate"] == [(0, 0.125), (1, 0.125)]


@pytest.mark.parametrize("update_freq, steps_written", [("batch", list(range(1, 11))), (3, [3, 6, 9])])
def test_batch_scalars_every_update_freq(tmp_path, make_model, update_freq, steps_written):
    CountingScalar.reads = 0
    cb = TensorBoard(log_dir=tmp_path, update_freq=update_freq, write_steps_per_second=True)
    _fit(cb, make_model(), epochs=2, steps=5)
    # Only the written batches are read: 2 keys per written batch.
    assert CountingScalar.reads == 2 * len(steps_written)
    train, _ = read_events(tmp_path / "train")
    assert [s for s, _ in train["batch_loss"]] == steps_written
    # The global step counts across epochs (value = epoch * steps + batch = step - 1).
    assert [v for _, v in train["batch_loss"]] == [s - 1 for s in steps_written]
    assert [s for s, _ in train["batch_accuracy"]] == steps_written
    assert [s for s, _ in train["batch_steps_per_second"]] == steps_written
    assert [s for s, _ in train["epoch_steps_per_second"]] == [0, 1]
    assert all(v > 0 for _, v in train["epoch_steps_per_second"])


def test_histograms(tmp_path):
    cb = TensorBoard(log_dir=tmp_path, histogram_freq=2)
    _fit(cb, NamedModel(), epochs=5, steps=1)
    _, hist = read_events(tmp_path / "train")
    assert set(hist) == {"dense/kernel_0/histogram", "dense/bias/histogram"}
    assert [s for s, _ in hist["dense/kernel_0/histogram"]] == [0, 2, 4]
    h = hist["dense/kernel_0/histogram"][0][1]
    assert (h.min, h.max, h.num, h.sum) == (0.0, 5.0, 6.0, 15.0)


def test_histogram_default_names(tmp_path, make_model):
    cb = TensorBoard(log_dir=tmp_path, histogram_freq=1)
    _fit(cb, make_model(), epochs=1, steps=1)
    _, hist = read_events(tmp_path / "train")
    assert set(hist) == {"weight_0/histogram", "weight_1/histogram"}


def test_second_fit_writes_new_files(tmp_path, make_model):
    cb = TensorBoard(log_dir=tmp_path)
    model = make_model()
    _fit(cb, model, epochs=1, steps=1)
    _fit(cb, model, epochs=1, steps=1)
    train, _ = read_events(tmp_path / "train")
    assert train["epoch_loss"] == [(0, 1.0), (0, 1.0)]


def test_nothing_written_off_process_zero(tmp_path, make_model, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    CountingScalar.reads = 0
    _fit(TensorBoard(log_dir=tmp_path, update_freq=1, histogram_freq=1), make_model(), epochs=2, steps=2)
    assert not tmp_path.joinpath("train").exists()
    assert CountingScalar.reads == 0


def test_bad_update_freq():
    with pytest.raises(ValueError, match="update_freq"):
        TensorBoard(update_freq="sometimes")


def test_missing_tensorboardx_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError, match=r"pip install meshfit\[tensorboard\]"):
        TensorBoard()


def test_batch_steps_with_several_steps_per_call(tmp_path, make_model):
    # With steps_per_execution=3 the loop reports batches 2, 5, 8 (the last of each call).
    cb = TensorBoard(log_dir=tmp_path, update_freq=4)
    cbs = CallbackList([cb], model=make_model(), epochs=2, steps=9, verbose=0)
    cbs.on_train_begin()
    for epoch in range(2):
        cbs.on_epoch_begin(epoch)
        for first in range(0, 9, 3):
            cbs.on_train_batch_begin(first)
            cbs.on_train_batch_end(first + 2, {"loss": float(epoch * 9 + first + 3)})
        cbs.on_epoch_end(epoch, {"loss": 1.0})
    cbs.on_train_end()
    train, _ = read_events(tmp_path / "train")
    # A point at the end of each call that passed a multiple of 4, at its true step.
    assert train["batch_loss"] == [(6, 6.0), (9, 9.0), (12, 12.0), (18, 18.0)]


def test_profile_batch_writes_a_trace_of_those_batches(tmp_path):
    x, y = classification_data(n=64)
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    board = mf.callbacks.TensorBoard(tmp_path / "logs", profile_batch=(2, 3))
    model.fit(x, y, batch_size=16, epochs=2, callbacks=[board], verbose=0)
    traces = list((tmp_path / "logs" / "train" / "plugins" / "profile").glob("*/*"))
    names = sorted(p.name.split(".", 1)[1] for p in traces)
    assert names == ["trace.json.gz", "xplane.pb"], traces  # one run: TensorBoard's plugin and Perfetto
    trace = gzip.decompress(next(p for p in traces if p.name.endswith(".json.gz")).read_bytes())
    assert b"traceEvents" in trace


@pytest.mark.parametrize("bad", [-1, (3, 2), (0, 2), "a,b", (1, 2, 3), 1.5])
def test_bad_profile_batch_is_refused(bad, tmp_path):
    with pytest.raises(ValueError, match="`profile_batch` must be a non-negative int"):
        mf.callbacks.TensorBoard(tmp_path, profile_batch=bad)


def test_the_learning_rate_of_an_optax_schedule_is_logged(tmp_path):
    import optax

    schedule = optax.linear_schedule(0.1, 0.0, transition_steps=12)
    x, y = classification_data(n=64)
    model = mf.Model(MLP())
    model.compile(optimizer=mf.optimizers.get("sgd", learning_rate=schedule), loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[TensorBoard(str(tmp_path))])
    scalars, _ = read_events(os.path.join(tmp_path, "train"))
    assert scalars["epoch_learning_rate"] == [(e, pytest.approx(float(schedule(4 * (e + 1))))) for e in range(3)]


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_each_of_several_optimizers_logs_its_learning_rate(tmp_path):
    from custom_models import GAN, TinyGAN

    model = GAN(TinyGAN(), seed=0)
    model.compile(
        optimizer={
            "generator": mf.optimizers.get("adam", learning_rate=2e-3),
            "discriminator": mf.optimizers.get("adam", learning_rate=1e-3),
        }
    )
    data = np.random.default_rng(0).standard_normal((32, 2)).astype(np.float32)
    model.fit(data, batch_size=16, epochs=2, verbose=0, callbacks=[TensorBoard(log_dir=tmp_path)])
    train, _ = read_events(tmp_path / "train")
    assert train["epoch_generator_learning_rate"] == [(0, pytest.approx(2e-3)), (1, pytest.approx(2e-3))]
    assert train["epoch_discriminator_learning_rate"] == [(0, pytest.approx(1e-3)), (1, pytest.approx(1e-3))]
    assert {"epoch_d_loss", "epoch_g_loss"} <= set(train)


def read_texts(directory):
    """The text summaries of every event file in `directory`, by tag."""
    texts = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "text":
                    texts.setdefault(value.tag, []).append(value.tensor.string_val[0].decode())
    return texts


def test_write_graph_writes_the_train_steps_jaxpr(tmp_path):
    """Keras's `write_graph` (on by default, as in Keras): the train step's jaxpr as a file and a text summary."""
    x, y = classification_data(n=32)
    model = mf.Model(MLP())
    model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[TensorBoard(tmp_path / "on")])
    text = (tmp_path / "on" / "train" / "train_step.jaxpr.txt").read_text()
    assert "{ lambda" in text and "dot_general" in text  # a jaxpr, with the step's matrix products
    (summary,) = read_texts(tmp_path / "on" / "train")["train_step_jaxpr/text_summary"]
    assert [line[4:] for line in summary.splitlines()] == text.splitlines()  # indented: Markdown code
    # Keras's positional order: log_dir, histogram_freq, write_graph.
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[TensorBoard(tmp_path / "off", 0, False)])
    assert not (tmp_path / "off" / "train" / "train_step.jaxpr.txt").exists()
    assert read_texts(tmp_path / "off" / "train") == {}


@pytest.mark.parametrize(
    "argument, words",
    [
        ({"write_images": True}, "no weight images.*histogram_freq"),
        ({"embeddings_freq": 1}, "no Projector data"),
        ({"embeddings_metadata": {"emb": "meta.tsv"}}, "no Projector data"),
    ],
)
def test_kerass_arguments_with_nothing_to_do_in_jax_warn(tmp_path, argument, words):
    with pytest.warns(UserWarning, match=f"TensorBoard\\({next(iter(argument))}=.*is ignored: {words}"):
        TensorBoard(tmp_path, **argument)
