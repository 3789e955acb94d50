import io
import os
import pty
import re
import sys

import jax.numpy as jnp
import pytest

from meshfit.callbacks import CallbackList, ProgbarLogger


class CountingScalar:
    """A batch-log value standing for a device scalar: counts how often it is read."""

    reads = 0

    def __init__(self, value):
        self.value = value

    def __float__(self):
        CountingScalar.reads += 1
        return float(self.value)


EPOCH_LOGS = {"loss": 0.25, "accuracy": 0.5, "val_loss": 0.3, "val_accuracy": 0.0}


def _fit(cb, epochs=2, steps=5, batch_logs=None, epoch_logs=EPOCH_LOGS, verbose=1, known_steps=True, validate=True):
    cbs = CallbackList([cb], epochs=epochs, steps=steps if known_steps else None, verbose=verbose)
    cbs.on_train_begin()
    for epoch in range(epochs):
        cbs.on_epoch_begin(epoch)
        for batch in range(steps):
            cbs.on_train_batch_begin(batch)
            logs = batch_logs(batch) if batch_logs else {"loss": jnp.asarray(1.0 / (batch + 1))}
            cbs.on_train_batch_end(batch, logs)
        if validate:  # validation inside fit(): silent
            cbs.on_test_begin()
            cbs.on_test_batch_end(0, {"loss": CountingScalar(7.0)})
            cbs.on_test_end({"loss": 0.3})
        cbs.on_epoch_end(epoch, dict(epoch_logs))
    cbs.on_train_end()


def _lines(text):
    """Every state the terminal showed: tqdm redraws with \\r, lines end with \\n."""
    return [seg.rstrip() for seg in re.split(r"[\r\n]", text) if seg.strip()]


def test_verbose_1(tmp_path):
    stream = io.StringIO()
    _fit(ProgbarLogger(stream=stream, interval=0), epochs=2, steps=5)
    out = stream.getvalue()
    lines = _lines(out)
    assert lines[0] == "Epoch 1/2"
    assert "Epoch 2/2" in lines
    # One bar state per batch with the batch logs, formatted as Keras does.
    assert re.fullmatch(r"1/5 \S+\s+\d+s \d+(ms|us|s)/step - loss: 1\.0000", lines[2])
    assert re.fullmatch(r"3/5 \S+\s+\d+s \d+(ms|us|s)/step - loss: 0\.3333", lines[4])
    # Final state of each epoch: all epoch logs, validation included; then a newline.
    final = r"5/5 \S+ \d+s \d+(ms|us|s)/step - loss: 0\.2500 - accuracy: 0\.5000 - val_loss: 0\.3000 - val_accuracy: 0\.0000e\+00\n"  # noqa: E501 (Keras's message, verbatim)
    assert len(re.findall(final, out)) == 2
    assert out.endswith("\n")
    assert "7.0000" not in out  # validation inside fit is not shown


def test_a_terminal_that_reports_no_width_still_shows_the_metrics(monkeypatch):
    """A fresh pseudo-terminal reports 0 columns and 0 rows (as some CI runners and containers do)."""
    leader, follower = pty.openpty()
    assert os.get_terminal_size(follower) == (0, 0)
    terminal = open(follower, "w", buffering=1)  # noqa: SIM115  (closed below)
    monkeypatch.setattr(sys, "stdout", terminal)  # tqdm reads the size of sys.stdout's terminal
    try:
        _fit(ProgbarLogger(interval=0), epochs=2, steps=5)
    finally:
        terminal.close()
    out = b""
    while chunk := _read_or_empty(leader):
        out += chunk
    os.close(leader)
    final = re.findall(r"5/5 \S+ \d+s \d+(?:ms|us|s)/step - loss: 0\.2500 - accuracy: 0\.5000", out.decode())
    assert len(final) == 2, out


def _read_or_empty(fd):
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: the other end is closed and everything was read
        return b""


def test_verbose_2():
    stream = io.StringIO()
    CountingScalar.reads = 0
    _fit(ProgbarLogger(stream=stream), epochs=3, steps=4, verbose=2, batch_logs=lambda b: {"loss": CountingScalar(b)})
    lines = stream.getvalue().split("\n")
    assert lines[::2][:3] == ["Epoch 1/3", "Epoch 2/3", "Epoch 3/3"]
    for line in lines[1::2][:3]:
        assert re.fullmatch(
            r"4/4 - \d+s - \d+(ms|us|s)/step - loss: 0\.2500 - accuracy: 0\.5000 - val_loss: 0\.3000 - val_accuracy: 0\.0000e\+00",  # noqa: E501 (Keras's message, verbatim)
            line,
        ), line
    assert lines[-1] == "" and len(lines) == 7
    assert CountingScalar.reads == 0  # verbose=2 never reads batch logs


def test_verbose_0_prints_nothing(capsys):
    CountingScalar.reads = 0
    _fit(ProgbarLogger(), verbose=0, batch_logs=lambda b: {"loss": CountingScalar(b)})
    assert capsys.readouterr().out == ""
    assert CountingScalar.reads == 0


def test_single_epoch_has_no_header_and_defaults_to_stdout(capsys):
    _fit(ProgbarLogger(), epochs=1, steps=3, verbose=2)
    out = capsys.readouterr().out
    assert re.fullmatch(
        r"3/3 - \d+s - \d+(ms|us|s)/step - loss: 0\.2500 - accuracy: 0\.5000 - val_loss: 0\.3000 - val_accuracy: 0\.0000e\+00\n",  # noqa: E501 (Keras's message, verbatim)
        out,
    )


def test_batch_logs_read_only_when_the_bar_redraws():
    # A long interval: only the first batch of each epoch redraws.
    CountingScalar.reads = 0
    cb = ProgbarLogger(stream=io.StringIO(), interval=3600)
    _fit(cb, epochs=2, steps=200, batch_logs=lambda b: {"loss": CountingScalar(b), "acc": CountingScalar(0.5)})
    assert CountingScalar.reads == 2 * 2  # 2 keys, 1 redraw per epoch
    assert cb.refresh_count == 2 * 2  # + the final redraw of each epoch (epoch logs are floats)

    # No throttling: every batch redraws, and each redraw reads each value once.
    CountingScalar.reads = 0
    cb = ProgbarLogger(stream=io.StringIO(), interval=0)
    _fit(cb, epochs=2, steps=50, batch_logs=lambda b: {"loss": CountingScalar(b), "acc": CountingScalar(0.5)})
    assert CountingScalar.reads == 2 * 2 * 50
    assert cb.refresh_count == 2 * 51

    # Default interval: far fewer reads than batches on fast steps.
    CountingScalar.reads = 0
    cb = ProgbarLogger(stream=io.StringIO())
    _fit(cb, epochs=1, steps=2000, batch_logs=lambda b: {"loss": CountingScalar(b)})
    assert CountingScalar.reads == cb.refresh_count - 1 < 200


def test_unknown_steps_learned_after_first_epoch():
    stream = io.StringIO()
    _fit(ProgbarLogger(stream=stream, interval=0), epochs=2, steps=3, known_steps=False)
    lines = _lines(stream.getvalue())
    assert re.fullmatch(r"1/Unknown \d+s \d+(ms|us|s)/step - loss: 1\.0000", lines[2].strip())
    epoch2 = lines.index("Epoch 2/2")
    assert all("Unknown" in line for line in lines[1 : epoch2 - 1])
    assert re.fullmatch(r"3/3 \S+ \d+s .*val_accuracy: 0\.0000e\+00", lines[epoch2 - 1])
    # Second epoch knows the target found in the first one.
    assert re.fullmatch(r"1/3 \S+\s+\d+s \d+(ms|us|s)/step - loss: 1\.0000", lines[epoch2 + 2])


@pytest.mark.parametrize("verbose", [1, 2])
def test_evaluate_progress(verbose):
    stream = io.StringIO()
    cb = ProgbarLogger(stream=stream, interval=0)
    cbs = CallbackList([cb], steps=4, verbose=verbose)
    cbs.on_test_begin()
    for batch in range(4):
        cbs.on_test_batch_begin(batch)
        cbs.on_test_batch_end(batch, {"loss": jnp.asarray(2.0)})
    cbs.on_test_end({"loss": 1.5, "mae": 0.0005})
    out = stream.getvalue()
    if verbose == 1:
        assert "3/4" in out and "loss: 2.0000" in out
        assert re.search(r"4/4 \S+ \d+s \d+(ms|us|s)/step - loss: 1\.5000 - mae: 5\.0000e-04\n$", out)
    else:
        assert re.fullmatch(r"4/4 - \d+s - \d+(ms|us|s)/step - loss: 1\.5000 - mae: 5\.0000e-04\n", out)


def test_predict_progress():
    stream = io.StringIO()
    cbs = CallbackList([ProgbarLogger(stream=stream, interval=0)], steps=None, verbose=1)
    cbs.on_predict_begin()
    for batch in range(3):
        cbs.on_predict_batch_begin(batch)
        cbs.on_predict_batch_end(batch, {"outputs": object()})  # never read
    cbs.on_predict_end()
    lines = _lines(stream.getvalue())
    assert lines[-1].startswith("3/3 ") and lines[-1].endswith("/step")
    assert any(line.strip().startswith("2/Unknown") for line in lines)


def test_same_instance_shows_evaluate_after_fit():
    stream = io.StringIO()
    cb = ProgbarLogger(stream=stream)
    _fit(cb, epochs=1, steps=2, verbose=2, validate=False)
    cb.set_params({"steps": 1, "verbose": 2})
    cb.on_test_begin()
    cb.on_test_batch_end(0, {"loss": 1.0})
    cb.on_test_end({"loss": 1.0})
    assert re.search(r"\n1/1 - \d+s - .* - loss: 1\.0000\n$", stream.getvalue())


def test_prints_only_on_process_zero(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "process_index", lambda: 3)
    stream = io.StringIO()
    CountingScalar.reads = 0
    _fit(ProgbarLogger(stream=stream, interval=0), batch_logs=lambda b: {"loss": CountingScalar(b)})
    _fit(ProgbarLogger(stream=stream), verbose=2)
    assert stream.getvalue() == ""
    assert CountingScalar.reads == 0


def test_count_mode_samples_not_supported():
    with pytest.raises(ValueError, match="count_mode"):
        ProgbarLogger(count_mode="samples")
