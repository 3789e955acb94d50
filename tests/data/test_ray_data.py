"""`model.fit(ray_dataset, batch_size=B)`: a Ray Data Dataset trains as the same rows as arrays, on one local Ray
instance (one CPU); a resumed epoch skips the batches its backup had taken; under `meshfit launch --ray` each rank
reads its share through Ray Data's `streaming_split`."""

import json
import os
import sys

import numpy as np
import pytest
from helpers import MLP, classification_data

import meshfit as mf

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pytest.importorskip("pandas")  # Ray Data's own need (the `ray` extra)

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # a local Ray instance starts: several CPU-s


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
        np.testing.assert_array_equal(a, b)  # the same rows, the same programs: bitwise
    assert history.history["loss"] == reference.history["loss"]


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
    resumed, taps = compiled_model(), []
    tapped = mf.data.ray_dataset(dataset(x, y), batch_size=16, tap=lambda e, s, rows: taps.append((e, s)))
    resumed.fit(tapped, validation_data=tapped, epochs=1, verbose=0, callbacks=[backup()])
    assert taps == [(0, step) for step in range(4, 7)]  # the skipped batches and validation's are not tapped
    uninterrupted = compiled_model()
    uninterrupted.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_refusals(local_ray):
    x, y = classification_data(n=8)
    model = compiled_model()
    unnamed = ray.data.from_items([{"features": x[i], "label": y[i]} for i in range(8)])
    with pytest.raises(ValueError, match="must have a column named 'x'.*Received columns: features, label"):
        model.fit(unnamed, batch_size=4, verbose=0)
    with pytest.raises(ValueError, match="`y` and `sample_weight` must be None"):
        model.fit(dataset(x, y), y, batch_size=4, verbose=0)
    data = mf.data.ray_data.RayData(dataset(x, y), batch_size=4)
    with pytest.raises(ValueError, match="split over 2 processes needs each process to be one rank of a `meshfit"):
        data.lay_out((0, 2), 2)


def test_under_launch_ray_each_rank_reads_its_own_share_through_a_streaming_split(tmp_path):
    """2 ranks of `meshfit launch --ray` on a one-node cluster (4 logical CPUs: a rank each, the rest for Ray
    Data's reads) train 2 epochs; what `fit` took, counted by each rank's tap: 8 rows a step, ids the other rank
    does not take, together every id once an epoch."""
    from processes import run
    from ray_clusters import token_cluster

    worker = os.path.join(os.path.dirname(__file__), "..", "workers", "train_ray_data.py")
    with token_cluster({"num_cpus": 4}, []) as (cluster, _):
        argv = [sys.executable, "-m", "meshfit.cli", "launch", "--ray", cluster.address, "--nprocs", "2"]
        job = run(argv + [worker, cluster.address, str(tmp_path)], timeout=600)
    said = job.stdout[-3000:] + job.stderr[-3000:]
    assert job.returncode == 0, said
    taps = [json.load(open(tmp_path / f"ids-{rank}.json")) for rank in range(2)]
    for epoch in ("0", "1"):
        steps = [[step for step, _ in tap[epoch]] for tap in taps]
        assert steps == [list(range(6))] * 2, steps  # 96 rows, 16 a step
        taken = [[i for _, ids in tap[epoch] for i in ids] for tap in taps]
        assert all(len(ids) == 8 for tap in taps for _, ids in tap[epoch])  # 16 / 2 rows a step on each rank
        assert not set(taken[0]) & set(taken[1])
        assert sorted(taken[0] + taken[1]) == list(range(96))


def test_ranks_each_on_a_ray_of_their_own_are_refused_together_before_any_step(tmp_path):
    """`meshfit launch --nprocs 2` (no shared cluster) whose ranks each start a local Ray: the split is refused
    on every rank, naming the rank on another cluster, and the launch ends without a restart."""
    from processes import run

    worker = os.path.join(os.path.dirname(__file__), "..", "workers", "train_ray_data.py")
    argv = [sys.executable, "-m", "meshfit.cli", "launch", "--nprocs", "2", "--max-restarts", "2"]
    job = run(argv + [worker, "local", str(tmp_path)], timeout=600)
    said = job.stdout[-4000:] + job.stderr[-4000:]
    assert job.returncode != 0, said
    assert "joined to another Ray cluster than process 0's" in said, said
    assert "Process(es) [1]" in said, said
    assert not list(tmp_path.glob("ids-*.json")), said  # no rank trained
