import os

import numpy as np
import pytest

from meshfit.callbacks import CSVLogger

EPOCH_LOGS = [
    {"loss": 0.5, "accuracy": 0.75, "val_loss": 0.625, "val_accuracy": 0.5},
    {"loss": 0.25, "accuracy": 0.875, "val_loss": 0.5, "val_accuracy": 0.625},
]


def _fit(cb, logs_seq, start_epoch=0):
    cb.on_train_begin({})
    for i, logs in enumerate(logs_seq):
        cb.on_epoch_begin(start_epoch + i, {})
        cb.on_epoch_end(start_epoch + i, dict(logs))
    cb.on_train_end({})


def test_format(tmp_path):
    path = tmp_path / "log.csv"
    _fit(CSVLogger(path), EPOCH_LOGS)
    with open(path, newline="") as f:
        assert f.read() == (
            "epoch,accuracy,loss,val_accuracy,val_loss\r\n0,0.75,0.5,0.5,0.625\r\n1,0.875,0.25,0.625,0.5\r\n"
        )


def test_without_validation_adds_val_columns_like_keras(tmp_path):
    path = tmp_path / "log.csv"
    _fit(CSVLogger(str(path), separator=";"), [{"loss": 1.5}, {"loss": 1.25, "val_loss": 2.0}])
    with open(path, newline="") as f:
        assert f.read() == "epoch;loss;val_loss\r\n0;1.5;NA\r\n1;1.25;2.0\r\n"


def test_append_writes_header_once(tmp_path):
    path = tmp_path / "log.csv"
    _fit(CSVLogger(path, append=True), EPOCH_LOGS[:1])
    _fit(CSVLogger(path, append=True), EPOCH_LOGS[1:], start_epoch=1)
    with open(path, newline="") as f:
        lines = f.read().split("\r\n")
    assert lines == [
        "epoch,accuracy,loss,val_accuracy,val_loss",
        "0,0.75,0.5,0.5,0.625",
        "1,0.875,0.25,0.625,0.5",
        "",
    ]
    # Without append the file is overwritten.
    _fit(CSVLogger(path), EPOCH_LOGS[1:])
    with open(path, newline="") as f:
        assert f.read().count("\r\n") == 2


def test_iterable_values_and_file_closed(tmp_path):
    path = tmp_path / "log.csv"
    cb = CSVLogger(path)
    _fit(cb, [{"loss": np.float32(0.5), "hist": np.array([1, 2]), "name": "a"}])
    assert cb.csv_file.closed
    with open(path, newline="") as f:
        # csv quoting of the Keras-formatted '"[1, 2]"' value.
        assert f.read() == 'epoch,hist,loss,name,val_hist,val_loss,val_name\r\n0,"""[1, 2]""",0.5,a,NA,NA,NA\r\n'


def test_nothing_written_off_process_zero(tmp_path, monkeypatch):
    import jax

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    path = tmp_path / "log.csv"
    _fit(CSVLogger(path), EPOCH_LOGS)
    assert not path.exists()


@pytest.mark.parametrize("append", [False, True])
def test_same_bytes_as_keras(tmp_path, append):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    logs_seq = EPOCH_LOGS + [{"loss": 0.125, "accuracy": 0.9375}]  # then validation is missing
    files = []
    for name, cls in (("ours.csv", CSVLogger), ("keras.csv", keras.callbacks.CSVLogger)):
        path = tmp_path / name
        if append:
            path.write_text("")
        cb = cls(str(path), separator="|", append=append)
        _fit(cb, logs_seq[:2])
        _fit(cls(str(path), separator="|", append=True), logs_seq[2:], start_epoch=2)
        files.append(path.read_bytes())
    assert files[0] == files[1]
    assert files[0].startswith(b"epoch|accuracy|loss|val_accuracy|val_loss\r\n")
