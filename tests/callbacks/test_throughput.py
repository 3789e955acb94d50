"""Throughput: samples and FLOPs per second and MFU in the epoch logs, from the compiled step's cost analysis."""

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf
from meshfit.callbacks.throughput import peak_flops


def fitted(callbacks=(), strategy=None, **fit_args):
    x, y = classification_data(n=256, din=32, classes=10)
    with (strategy or mf.strategies.OneDeviceStrategy()).scope():
        model = mf.Model(MLP(din=32, hidden=128, dout=10))
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=32, epochs=2, callbacks=list(callbacks), verbose=0, **fit_args)
    return model, history


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_throughput_logs_reach_history_and_csv(tmp_path):
    throughput = mf.callbacks.Throughput(peak_flops=1e12, tokens_per_sample=4)
    csv = mf.callbacks.CSVLogger(tmp_path / "log.csv")
    model, history = fitted([csv, throughput], validation_split=0.25)  # listed last: still runs first
    logs = history.history
    for name in ("samples_per_second", "flops_per_second", "tokens_per_second", "mfu"):
        assert len(logs[name]) == 2 and all(v > 0 for v in logs[name]), name
    report = throughput.report
    for samples, flops, tokens, mfu in zip(
        logs["samples_per_second"], logs["flops_per_second"], logs["tokens_per_second"], logs["mfu"], strict=True
    ):
        assert flops == pytest.approx(samples / report.batch_size * report.flops * report.num_devices)
        assert mfu == pytest.approx(flops / 1e12)
        assert tokens == pytest.approx(4 * samples)
    header = (tmp_path / "log.csv").read_text().splitlines()[0].split(",")
    assert "mfu" in header and "samples_per_second" in header


def test_no_mfu_without_a_known_peak():
    if peak_flops(jax.devices()[0].device_kind) is not None:
        pytest.skip("these devices have a known peak")
    _, history = fitted([mf.callbacks.Throughput()])
    assert "mfu" not in history.history and "samples_per_second" in history.history


def test_peaks_by_device_kind():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("TPU v5 lite") == 197e12 and peak_flops("TPU v5") == 459e12


@pytest.mark.parametrize("bad", [0, -1.0, True, "fast"])
def test_bad_arguments(bad):
    with pytest.raises(ValueError, match="`peak_flops` must be a positive number"):
        mf.callbacks.Throughput(peak_flops=bad)


def test_samples_per_second_measures_the_training_time():
    _, history = fitted([mf.callbacks.Throughput()])
    rates = np.asarray(history.history["samples_per_second"])
    assert np.all(np.isfinite(rates)) and rates[1] > 0
