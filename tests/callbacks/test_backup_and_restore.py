"""BackupAndRestore: real processes killed with SIGKILL or SIGTERM resume exactly; damage is skipped.

Resumed runs are compared with uninterrupted ones bitwise (CPU, same machine: the
same computations in the same order give the same bits).
"""

import json
import os
import signal
import sys
import warnings

import numpy as np
import pytest
from helpers import MLP, classification_data
from processes import Job, run

import meshfit as mf

WORKER = os.path.join(os.path.dirname(__file__), "..", "workers", "train_resumable.py")


def run_worker(out, backup, *args, stop_at=None, sig=signal.SIGKILL, timeout=180):
    """Runs the worker; with `stop_at`, sends `sig` when it prints that step. Returns (status, stdout)."""
    with Job([sys.executable, WORKER, str(out), str(backup), *args], timeout=timeout) as job:
        if stop_at is not None:
            job.wait_for(rf"step {stop_at}$")
            job.proc.send_signal(sig)
        status = job.finish()
    return status, job.stdout + job.stderr


def load(out):
    weights = np.load(os.path.join(out, "weights.npz"))
    return [weights[f"arr_{i}"] for i in range(len(weights.files))], json.loads(
        open(os.path.join(out, "history.json")).read())


def assert_same_run(a, b):
    (wa, ha), (wb, hb) = load(a), load(b)
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb):
        np.testing.assert_array_equal(x, y)  # bitwise
    assert ha == hb


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    base = tmp_path_factory.mktemp("full")
    runs = {}
    for name, args in {"freq3": ("--slow", "0"), "spe2": ("--spe", "2", "--save-freq", "epoch")}.items():
        status, output = run_worker(base / name, base / f"{name}-backup", *args)
        assert status == 0, output
        assert not (base / f"{name}-backup").exists()  # deleted after a finished fit
        runs[name] = base / name
    return runs


def test_sigkill_mid_epoch_then_restart_is_bitwise_identical(tmp_path, uninterrupted):
    backup = tmp_path / "backup"
    status, output = run_worker(tmp_path / "out", backup, "--slow", "0.02", stop_at=17)
    assert status == -signal.SIGKILL
    steps = sorted(int(p) for p in os.listdir(backup) if p.isdigit())
    assert steps and max(steps) in (12, 15)  # every 3 steps; the newest may still have been in flight
    status, output = run_worker(tmp_path / "out", backup)
    assert status == 0, output
    assert "BackupAndRestore: resumed" in output and "batch" in output
    assert_same_run(tmp_path / "out", uninterrupted["freq3"])


def test_sigkill_with_steps_per_execution_and_epoch_backups(tmp_path, uninterrupted):
    backup = tmp_path / "backup"
    status, _ = run_worker(tmp_path / "out", backup, "--spe", "2", "--save-freq", "epoch", "--slow", "0.02",
                           stop_at=24)
    assert status == -signal.SIGKILL
    status, output = run_worker(tmp_path / "out", backup, "--spe", "2", "--save-freq", "epoch")
    assert status == 0, output
    # Epoch-end backups: the one after epoch 2 may still have been in flight at the kill.
    assert "resumed from" in output and ("at epoch 3, batch 0" in output or "at epoch 2, batch 0" in output)
    assert_same_run(tmp_path / "out", uninterrupted["spe2"])


def test_sigterm_saves_exits_143_and_resumes_exactly(tmp_path, uninterrupted):
    backup = tmp_path / "backup"
    status, output = run_worker(tmp_path / "out", backup, "--slow", "0.02", stop_at=13, sig=signal.SIGTERM)
    assert status == mf.PREEMPTED_EXIT_CODE == 143, output
    steps = sorted(int(p) for p in os.listdir(backup) if p.isdigit())
    assert steps[-1] in (13, 14)  # saved at the next step boundary after the signal
    status, output = run_worker(tmp_path / "out", backup)
    assert status == 0, output
    assert_same_run(tmp_path / "out", uninterrupted["freq3"])


def train_in_process(backup_dir, epochs, **backup_kwargs):
    x, y = classification_data(n=96)
    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = mf.callbacks.BackupAndRestore(backup_dir, **backup_kwargs)
    history = model.fit(x, y, batch_size=16, epochs=epochs, callbacks=[backup], verbose=0)
    return model, history


def test_corrupt_newest_backup_is_skipped_for_the_previous_one(tmp_path):
    backup = tmp_path / "backup"
    train_in_process(backup, 2, save_freq=4, delete_checkpoint=False, max_to_keep=3)
    steps = sorted(int(p) for p in os.listdir(backup) if p.isdigit())
    assert steps == [4, 8, 12]
    newest = backup / "12" / "state"
    data_files = [os.path.join(root, f) for root, _, files in os.walk(newest) for f in files
                  if os.path.getsize(os.path.join(root, f)) > 0 and "d" in root.split(os.sep)[-1:]]
    assert data_files, "expected OCDBT data files in the checkpoint"
    for path in data_files:  # truncate the array data: the write "cut off"
        with open(path, "r+b") as f:
            f.truncate(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, history = train_in_process(backup, 2, save_freq=4, delete_checkpoint=False, max_to_keep=3)
    messages = [str(w.message) for w in caught]
    assert any(str(backup / "12") in m and "could not be read" in m for m in messages), messages
    # Resumed from step 8 (epoch 1, batch 2), so the fit ran the last 4 steps of epoch 2 again.
    assert int(model._state.step) == 12
    assert (backup / "12.unreadable").is_dir()  # moved aside at once, never deleted
    assert history.epoch == [0, 1]


def test_foreign_directory_is_refused_and_kept(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("important")
    with pytest.raises(FileExistsError, match="meshfit did not write"):
        train_in_process(foreign, 1)
    assert (foreign / "notes.txt").read_text() == "important"


def test_bad_save_freq():
    with pytest.raises(ValueError, match="`save_freq` must be 'epoch' or a positive int"):
        mf.callbacks.BackupAndRestore("/tmp/x", save_freq=0)


LAUNCH = [sys.executable, "-m", "meshfit.cli", "launch", "--nprocs", "2", "--devices-per-proc", "2"]


@pytest.fixture(scope="module")
def uninterrupted_two_processes(tmp_path_factory):
    base = tmp_path_factory.mktemp("launch")
    clean = run(LAUNCH + [WORKER, str(base / "out"), str(base / "backup"), "--strategy", "multi_worker"], timeout=300)
    assert clean.returncode == 0, clean.stderr[-3000:]
    return base / "out"


def test_restart_under_launch_with_a_killed_worker(tmp_path, uninterrupted_two_processes):
    """2 processes, rank 1 SIGKILLs itself mid-epoch; --max-restarts resumes; equals an uninterrupted job."""
    killed = run(LAUNCH + ["--max-restarts", "2", WORKER, str(tmp_path / "a"), str(tmp_path / "ab"),
                                      "--strategy", "multi_worker", "--die-at-step", "14", "--slow", "0.02"], timeout=300)
    assert killed.returncode == 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "rank 1 exited with status -9" in killed.stderr and "restarting the job (1/2)" in killed.stderr
    assert "[rank 0] BackupAndRestore: resumed" in killed.stdout
    assert_same_run(tmp_path / "a", uninterrupted_two_processes)


def test_sigterm_to_every_process_agrees_on_a_step_saves_and_resumes(tmp_path, uninterrupted_two_processes):
    """A preempted multi-process job: all ranks stop at one step (JAX's sync point), save, exit 143."""
    with Job(LAUNCH + [WORKER, str(tmp_path / "a"), str(tmp_path / "ab"), "--strategy", "multi_worker",
                       "--slow", "0.03"], timeout=300) as job:
        job.wait_for(r".*step 11$")
        workers = job.children()
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        assert job.finish(timeout=120) == 143, job.stderr[-3000:]
    steps = sorted(int(p) for p in os.listdir(tmp_path / "ab") if p.isdigit())
    assert steps and steps[-1] >= 11
    resumed = run(LAUNCH + [WORKER, str(tmp_path / "a"), str(tmp_path / "ab"), "--strategy", "multi_worker"],
                  timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {steps[-1]})" in resumed.stdout
    assert_same_run(tmp_path / "a", uninterrupted_two_processes)


def test_grain_iterator_position_is_restored(tmp_path):
    """A continuing grain stream (steps_per_epoch) resumes at the saved iterator state."""
    grain = pytest.importorskip("grain")
    x, y = classification_data(n=80)
    dataset = grain.MapDataset.source([{"x": x[i], "y": y[i]} for i in range(80)]).shuffle(seed=1).repeat().batch(
        8).map(lambda b: (b["x"], b["y"]))

    def fit(epochs, backup=None):
        model = mf.Model(MLP(), seed=1)
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        callbacks = [mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)] if backup else []
        history = model.fit(dataset.to_iter_dataset(), steps_per_epoch=3, epochs=epochs, callbacks=callbacks,
                            verbose=0)
        return model, history

    full, full_history = fit(4)
    fit(2, tmp_path / "b")  # stops after epoch 2, its backup kept
    resumed, resumed_history = fit(4, tmp_path / "b")  # resumes at epoch 3 from the saved stream position
    assert resumed_history.history == full_history.history
    for a, b in zip(full.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("stop_at, newest", [(5, 4), (7, 6)])  # backup mid-epoch (epoch 2, batch 1); at its end
def test_grain_stream_resumes_mid_epoch_exactly(tmp_path, stop_at, newest):
    """The restored iterator state stands at the saved batch and must not be skipped past again."""
    grain = pytest.importorskip("grain")
    x, y = classification_data(n=80)
    dataset = grain.MapDataset.source([{"x": x[i], "y": y[i]} for i in range(80)]).shuffle(seed=2).repeat().batch(
        8).map(lambda b: (b["x"], b["y"]))

    class StopAtStep(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model._host_step == stop_at:
                self.model.stop_training = True

    def fit(epochs, backup=None, stop=False):
        model = mf.Model(MLP(), seed=1)
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        callbacks = [StopAtStep()] if stop else []
        if backup:
            callbacks.append(mf.callbacks.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False))
        history = model.fit(dataset.to_iter_dataset(), steps_per_epoch=3, epochs=epochs, callbacks=callbacks,
                            verbose=0)
        return model, history

    full, full_history = fit(4)
    fit(4, tmp_path / "b", stop=True)
    steps = sorted(int(p) for p in os.listdir(tmp_path / "b") if p.isdigit())
    assert steps[-1] == newest
    resumed, resumed_history = fit(4, tmp_path / "b")
    assert int(resumed._state.step) == 12
    assert resumed_history.history == full_history.history
    for a, b in zip(full.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_fit_that_raises_leaves_a_usable_backup_for_the_next_fit(tmp_path):
    x, y = classification_data(n=96)

    class Crash(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model._host_step == 7:
                raise RuntimeError("simulated crash")

    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                  callbacks=[Crash(), mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2)])
    steps = sorted(int(p) for p in os.listdir(tmp_path / "b") if p.isdigit())
    assert steps[-1] == 6  # the write in flight at the crash was finished, not left half-done
    fresh, uninterrupted = train_in_process(tmp_path / "other", 3)
    resumed = mf.Model(MLP(), seed=3)
    resumed.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = resumed.fit(x, y, batch_size=16, epochs=3, verbose=0,
                          callbacks=[mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2)])
    assert history.history == uninterrupted.history
    for a, b in zip(fresh.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_resumed_fit_reads_the_shuffled_passes_of_the_fit_it_resumes(tmp_path):
    """The crashed fit was the model's second: its epochs read passes 1 to 3, and so does its resumption."""
    x, y = classification_data(n=96)

    class Crash(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model._host_step == 13:  # in the second epoch of the second fit
                raise RuntimeError("simulated crash")

    def model_():
        model = mf.Model(MLP(), seed=3)
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    def fit(model, callbacks=()):
        return model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=list(callbacks))

    full = model_()
    full.fit(x, y, batch_size=16, epochs=1, verbose=0)
    full_history = fit(full)
    crashed = model_()
    crashed.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(crashed, [Crash(), mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2)])
    resumed = model_()  # a restarted job need not redo the first fit: the backup holds what it did
    history = fit(resumed, [mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2)])
    assert history.history == full_history.history
    for a, b in zip(full.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
