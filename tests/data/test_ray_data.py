"""`model.fit(ray_dataset, batch_size=B)`: a Ray Data Dataset trains as the same rows as arrays, on one local Ray
instance (one CPU); a resumed epoch skips the batches its backup had taken; several processes are refused."""

import os

import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pytest.importorskip("pandas")  # Ray Data's own need (the `ray` extra)

pytestmark = pytest.mark.slow  # a local Ray instance starts: several CPU-s


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # the same order every pass: exact resume
    context.enable_progress_bars = False
    yield
    ray.shutdown()


def dataset(x, y):
    return ray.data.from_items([{"x": x[i], "y": y[i]} for i in range(len(x))])


def compiled_model():
    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_ray_dataset_trains_as_the_same_rows_as_arrays(local_ray):
    x, y = classification_data(n=100)  # 7 batches of 16, the last partial
    from_ray = compiled_model()
    history = from_ray.fit(dataset(x, y), batch_size=16, epochs=2, verbose=0)
    from_arrays = compiled_model()
    reference = from_arrays.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(from_ray.get_weights(), from_arrays.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(history.history["loss"], reference.history["loss"], rtol=1e-6)


def test_a_fit_resumed_mid_epoch_skips_the_batches_its_backup_had_taken(local_ray, tmp_path):
    x, y = classification_data(n=100)

    class Crash(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.session.step == 5:
                raise RuntimeError("simulated crash")

    def backup():
        return mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2, compilation_cache=False)

    with pytest.raises(RuntimeError, match="simulated crash"):
        compiled_model().fit(dataset(x, y), batch_size=16, epochs=1, verbose=0, callbacks=[Crash(), backup()])
    assert max(int(p) for p in os.listdir(tmp_path / "b") if p.isdigit()) == 4
    resumed = compiled_model()
    resumed.fit(dataset(x, y), batch_size=16, epochs=1, verbose=0, callbacks=[backup()])
    uninterrupted = compiled_model()
    uninterrupted.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_refusals(local_ray):
    x, y = classification_data(n=8)
    model = compiled_model()
    unnamed = ray.data.from_items([{"features": x[i], "label": y[i]} for i in range(8)])
    with pytest.raises(ValueError, match="must have a column named 'x'.*Received columns: features, label"):
        model.fit(unnamed, batch_size=4, verbose=0)
    with pytest.raises(ValueError, match="`y` and `sample_weight` must be None"):
        model.fit(dataset(x, y), y, batch_size=4, verbose=0)
    data = mf.data.ray_data.RayData(dataset(x, y), batch_size=4)
    with pytest.raises(ValueError, match="runs on one process; this strategy splits each batch over 2 processes"):
        data.lay_out((0, 2), 2)
