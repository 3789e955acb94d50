"""MultiWorkerMirroredStrategy under `meshfit launch` (real processes, gloo collectives)."""

import json
import os
import sys

import jax
import numpy as np
import pytest
from helpers import MLP, classification_data
from processes import run

import meshfit as mf

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # starts real processes (the fast tier leaves these out)

WORKER = os.path.join(os.path.dirname(__file__), "..", "workers", "train_data_parallel.py")


def launch(out, *worker_args, nprocs=2, devices=2, timeout=240):
    cmd = [
        sys.executable,
        "-m",
        "meshfit.cli",
        "launch",
        "--nprocs",
        str(nprocs),
        "--devices-per-proc",
        str(devices),
        WORKER,
        str(out),
        *worker_args,
    ]
    result = run(cmd, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def in_process(strategy, spe=1, epochs=2, n=150, batch_size=15, module=None):
    x, y = classification_data(n=n)
    with strategy.scope():
        model = mf.Model(MLP(din=4, hidden=32, dout=3) if module is None else module())
        model.compile(
            optimizer="adam",
            loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=spe,
        )
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, validation_split=0.2, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    return model, history.history, evaluation, model.predict(x[:23], batch_size=batch_size, verbose=0)


@pytest.mark.parametrize("spe", [1, 3])
def test_two_processes_equal_one_process_with_four_devices(two_process_job, spe):
    # The shared job (tests/strategies/conftest.py) trained with --steps-per-execution 1, then 3, among others.
    out = two_process_job.folder(f"spe{spe}")
    assert "trains alone" not in two_process_job.result.stdout  # the processes joined one job
    lines = two_process_job.lines(f"spe{spe}")
    assert any(ln.startswith("[rank 0] Epoch 1/2") for ln in lines)
    assert not any(ln.startswith("[rank 1] Epoch") for ln in lines)  # only process 0 prints progress
    assert any(ln.startswith("[rank 1] pid") for ln in lines) and any("replicas 4" in ln for ln in lines)

    model, history, evaluation, predictions = in_process(mf.strategies.MirroredStrategy(jax.devices()[:4]), spe)
    saved = np.load(out / "params.npz")
    for i, weight in enumerate(model.get_weights()):
        np.testing.assert_allclose(saved[f"arr_{i}"], weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saved["predictions"], predictions, rtol=1e-5, atol=1e-6)
    for rank in (0, 1):  # every process returns the same History
        got = json.loads((out / f"history_{rank}.json").read_text())
        assert set(got["history"]) == set(history)
        for key in history:
            np.testing.assert_allclose(got["history"][key], history[key], rtol=1e-5)
        for key in evaluation:
            assert got["evaluate"][key] == pytest.approx(evaluation[key], rel=1e-5)

    one_model, one_history, _, _ = in_process(mf.strategies.OneDeviceStrategy(), spe)
    for a, b in zip(one_model.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_custom_train_step_in_two_processes_equals_one_device(two_process_job):
    """Full batches train as on one device; a partial batch, which no process can give the step at its real
    rows, is refused before any step."""
    from custom_models import OwnGradients

    out = two_process_job.folder("custom")
    x, y = classification_data(n=160)
    model = OwnGradients(MLP(din=4, hidden=32, dout=3))
    model.compile(optimizer="adam")
    history = model.fit(x, y, batch_size=16, epochs=2, validation_split=0.2, verbose=0)
    saved = np.load(out / "params.npz")
    for i, weight in enumerate(model.get_weights()):
        np.testing.assert_allclose(saved[f"arr_{i}"], weight, rtol=1e-5, atol=1e-6)
    for rank in (0, 1):
        got = json.loads((out / f"history_{rank}.json").read_text())
        np.testing.assert_allclose(got["history"]["xent"], history.history["xent"], rtol=1e-5)
        assert got["refusal"]["steps"] == 0 and "every batch is full" in got["refusal"]["message"]


def test_processes_that_never_join_a_job_are_told_which_strategy_to_use(tmp_path):
    """`meshfit launch --nprocs 2` of a MirroredStrategy script: two independent copies. Process 0 warns, once."""
    result = launch(tmp_path, "--strategy", "mirrored", "--epochs", "1")
    warnings = [ln for ln in result.stdout.splitlines() if "trains alone" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("[rank 0]"), result.stdout[-3000:]
    assert "meshfit launch started 2 processes" in warnings[0] and "MultiWorkerMirroredStrategy()" in warnings[0]


def test_bf16_compression_across_processes_equals_it_in_one_process(two_process_job):
    """2 processes x 2 devices with gradient_compression="bf16": meshfit's own psum of bf16 gradients over gloo."""
    out = two_process_job.folder("bf16")  # the shared job trained with --compression bf16 --epochs 1
    model, history, _, _ = in_process(
        mf.strategies.MirroredStrategy(jax.devices()[:4], gradient_compression="bf16"), epochs=1
    )
    saved = np.load(out / "params.npz")
    for i, weight in enumerate(model.get_weights()):
        np.testing.assert_allclose(saved[f"arr_{i}"], weight, rtol=1e-4, atol=1e-5)
    param_bytes = sum(w.nbytes for w in model.get_weights())
    for rank in (0, 1):
        got = json.loads((out / f"history_{rank}.json").read_text())
        np.testing.assert_allclose(got["history"]["loss"], history["loss"], rtol=1e-4)
        lowered = got["collectives"]["lowered"]["all-reduce"]
        assert 0.5 * param_bytes <= lowered <= 0.5 * param_bytes + 64  # the gradients cross in bf16


def test_a_keras_model_in_two_processes_equals_one_device(two_process_job):
    """The shared job also trained a Keras 3 Sequential MLP under MultiWorkerMirroredStrategy: the same
    weights, History and predictions as the same Keras model on one device."""
    from workers.train_data_parallel import keras_mlp

    out = two_process_job.folder("keras")
    assert any("replicas 4" in ln for ln in two_process_job.lines("keras"))
    model, history, evaluation, predictions = in_process(mf.strategies.OneDeviceStrategy(), module=keras_mlp)
    saved = np.load(out / "params.npz")
    for i, weight in enumerate(model.get_weights()):
        np.testing.assert_allclose(saved[f"arr_{i}"], weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saved["predictions"], predictions, rtol=1e-5, atol=1e-6)
    got = json.loads((out / "history_1.json").read_text())
    for key in history:
        np.testing.assert_allclose(got["history"][key], history[key], rtol=1e-5)
