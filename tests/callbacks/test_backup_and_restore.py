"""BackupAndRestore: real processes killed with SIGKILL or SIGTERM resume exactly; damage is skipped.

Resumed runs are compared with uninterrupted ones bitwise (CPU, same machine: the
same computations in the same order give the same bits).
"""

import glob
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import (
    MLP,
    classification_data,
    linked_meshfit_names,
    meshfit_names,
    mounted,
    plant_symlinks,
    read_all,
    remount_read_only,
)
from processes import Job, alive, run

import meshfit as mf
from meshfit.checkpointing.checkpoint import MARKER
from meshfit.training import callback_protocol

pytestmark = pytest.mark.slow  # starts real processes (the fast tier leaves these out)

WORKER = os.path.join(os.path.dirname(__file__), "..", "workers", "train_resumable.py")


def run_worker(out, backup, *args, stop_at=None, sig=signal.SIGKILL, timeout=180):
    """Runs the worker; with `stop_at`, sends `sig` when it prints that step. Returns (status, stdout)."""
    with Job([sys.executable, WORKER, str(out), str(backup), *args], timeout=timeout) as job:
        if stop_at is not None:
            job.wait_for(rf"step {stop_at}$")
            job.proc.send_signal(sig)
        status = job.finish()
    return status, job.stdout + job.stderr


def snapshot(directory) -> dict[str, str]:
    """Every file under `directory`, by relative path and content hash (the writers' lock file aside: a
    SIGKILLed writer leaves a stale one, which the next writer takes over and removes)."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            if name == ".meshfit.lock":
                continue
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), directory)] = hashlib.sha256(f.read()).hexdigest()
    return found


def load(out):
    weights = np.load(os.path.join(out, "weights.npz"))
    return [weights[f"arr_{i}"] for i in range(len(weights.files))], json.loads(
        open(os.path.join(out, "history.json")).read()
    )


def assert_same_run(a, b):
    (wa, ha), (wb, hb) = load(a), load(b)
    assert len(wa) == len(wb)
    for x, y in zip(wa, wb, strict=True):
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


@pytest.mark.processes
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


@pytest.mark.processes
def test_sigkill_with_steps_per_execution_and_epoch_backups(tmp_path, uninterrupted):
    backup = tmp_path / "backup"
    status, _ = run_worker(tmp_path / "out", backup, "--spe", "2", "--save-freq", "epoch", "--slow", "0.02", stop_at=24)
    assert status == -signal.SIGKILL
    status, output = run_worker(tmp_path / "out", backup, "--spe", "2", "--save-freq", "epoch")
    assert status == 0, output
    # Epoch-end backups: the one after epoch 2 may still have been in flight at the kill.
    assert "resumed from" in output and ("at epoch 3, batch 0" in output or "at epoch 2, batch 0" in output)
    assert_same_run(tmp_path / "out", uninterrupted["spe2"])


@pytest.mark.processes
def test_sigterm_saves_exits_143_and_resumes_exactly_also_when_repeated_during_the_save(tmp_path, uninterrupted):
    """One SIGTERM at step 13: the process saves at the next step boundary and exits 143. The process resumed from
    that backup gets SIGTERM after step 25 again and again until it is gone, as a scheduler may: it still saves and
    exits 143. Resumed once more, the run ends bitwise equal to an uninterrupted one: each preemption backup
    resumed exactly."""
    backup = tmp_path / "backup"
    status, output = run_worker(tmp_path / "out", backup, "--slow", "0.02", stop_at=13, sig=signal.SIGTERM)
    assert status == mf.PREEMPTED_EXIT_CODE == 143, output
    steps = sorted(int(p) for p in os.listdir(backup) if p.isdigit())
    assert steps[-1] in (13, 14)  # saved at the next step boundary after the signal

    with Job([sys.executable, WORKER, str(tmp_path / "out"), str(backup), "--slow", "0.02"], timeout=180) as job:
        job.wait_for(r"step 25$")
        job.proc.send_signal(signal.SIGTERM)
        while job.proc.poll() is None:  # as a scheduler may: again and again until it is gone
            time.sleep(0.05)
            try:
                job.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                break
        status = job.finish()
    assert status == 143, job.stdout[-2000:] + job.stderr[-2000:]
    assert f"(step {steps[-1]})." in job.stdout, job.stdout[-2000:]  # resumed from the first preemption backup
    assert backup_steps(backup)[-1] in (25, 26)

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
    data_files = [
        os.path.join(root, f)
        for root, _, files in os.walk(newest)
        for f in files
        if os.path.getsize(os.path.join(root, f)) > 0 and "d" in root.split(os.sep)[-1:]
    ]
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
    assert int(model.session.state.step) == 12
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
    # Backups only at steps 20 (the end of epoch 2, which the elastic test's reference resumes from) and 40, both
    # kept: backups do not change what it trains (a memory-tier run matches it bitwise).
    argv = [WORKER, str(base / "out"), str(base / "backup"), "--strategy", "multi_worker", "--save-freq", "20"]
    clean = run(LAUNCH + argv + ["--keep-backups"], timeout=300)
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert backup_steps(base / "backup") == [20, 40]
    return base / "out"


def resume_two_processes_exactly(tmp_path, reference, saved_from: int) -> None:
    """The preemption backup (at a step all ranks agreed on, at or after `saved_from`) resumes a 2-process job
    to the weights and History of an uninterrupted one."""
    steps = sorted(int(p) for p in os.listdir(tmp_path / "ab") if p.isdigit())
    assert steps and steps[-1] >= saved_from
    resumed = run(
        LAUNCH + [WORKER, str(tmp_path / "a"), str(tmp_path / "ab"), "--strategy", "multi_worker"], timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {steps[-1]})" in resumed.stdout
    assert_same_run(tmp_path / "a", reference)


@pytest.mark.processes
def test_restart_under_launch_with_a_killed_worker(tmp_path, uninterrupted_two_processes):
    """2 processes, rank 1 SIGKILLs itself mid-epoch; --max-restarts resumes; equals an uninterrupted job."""
    killed = run(
        LAUNCH
        + [
            "--max-restarts",
            "2",
            "--stop-grace",  # rank 0, left waiting on its dead peer, is killed 1 s after the SIGTERM (default 5)
            "1",
            WORKER,
            str(tmp_path / "a"),
            str(tmp_path / "ab"),
            "--strategy",
            "multi_worker",
            "--die-at-step",
            "14",
            "--slow",
            "0.02",
        ],
        timeout=300,
    )
    assert killed.returncode == 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "rank 1 exited with status -9" in killed.stderr and "restarting the job (1/2)" in killed.stderr
    assert "[rank 0] BackupAndRestore: resumed" in killed.stdout
    assert_same_run(tmp_path / "a", uninterrupted_two_processes)


@pytest.mark.processes
def test_a_killed_rank_resumes_from_the_launchers_memory_snapshot(tmp_path, uninterrupted_two_processes):
    """memory_freq=5 and no disk backup after step 0; rank 1 SIGKILLed at step 23: the restart resumes at
    step 20 from the launcher's memory, finishes bitwise equal to an uninterrupted job; no backup on disk."""
    killed = run(
        LAUNCH
        + ["--max-restarts", "1", "--stop-grace", "1"]
        + [WORKER, str(tmp_path / "a"), str(tmp_path / "ab"), "--strategy", "multi_worker", "--keep-backups"]
        + ["--save-freq", "1000", "--memory-freq", "5", "--die-at-step", "23"],
        timeout=300,
    )
    assert killed.returncode == 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "rank 1 exited with status -9" in killed.stderr and "restarting the job (1/1)" in killed.stderr
    assert "[rank 0] BackupAndRestore: resumed from the launcher's memory snapshot" in killed.stdout
    assert "(step 20), newer than the newest disk backup (none)" in killed.stdout
    assert "keeper: committed the memory snapshot of step 5" in killed.stderr
    assert not [p for p in os.listdir(tmp_path / "ab") if p.split(".")[0].isdigit()]  # no disk backup at all
    assert_same_run(tmp_path / "a", uninterrupted_two_processes)


@pytest.mark.processes
def test_ranks_that_find_different_snapshots_resume_together_from_disk(tmp_path, uninterrupted_two_processes):
    """Disk backups every 6 steps, memory snapshots every 2; rank 1 SIGKILLed at step 23. In the restart rank
    1's keeper cannot be reached while rank 0's snapshot of step 22 (or 20) can: the ranks agree to resume
    together from the disk backup of step 18 (or 12, when 18 was in flight; one line says why), with the memory
    tier off, and end bitwise equal to an uninterrupted job instead of deadlocking on different steps."""
    killed = run(
        LAUNCH
        + ["--max-restarts", "1", "--stop-grace", "1"]
        + [WORKER, str(tmp_path / "a"), str(tmp_path / "ab"), "--strategy", "multi_worker"]
        + ["--save-freq", "6", "--memory-freq", "2", "--die-at-step", "23", "--rank1-loses-its-keeper"],
        timeout=300,
    )
    said = killed.stdout[-3000:] + killed.stderr[-3000:]
    assert killed.returncode == 0, said
    assert "restarting the job (1/1)" in killed.stderr, said
    assert re.search(  # 22, or 20 when the kill came while 22 was in flight
        r"\[rank 0\] BackupAndRestore: not resuming from the memory snapshot of step 2[02]: process\(es\) 1 \(none\) "
        "could not restore their part of it; every process resumes from disk.",
        killed.stdout,
    ), said
    assert re.search(r"\[rank 0\] BackupAndRestore: resumed from \S+ab at .* \(step (12|18)\)\.", killed.stdout), said
    assert "memory snapshots are off for this fit, backing up to disk only: process(es) 1 could not reach" in said
    assert_same_run(tmp_path / "a", uninterrupted_two_processes)


def test_grain_iterator_position_is_restored(tmp_path):
    """A continuing grain stream (steps_per_epoch) resumes at the saved iterator state."""
    grain = pytest.importorskip("grain")
    x, y = classification_data(n=80)
    dataset = (
        grain.MapDataset.source([{"x": x[i], "y": y[i]} for i in range(80)])
        .shuffle(seed=1)
        .repeat()
        .batch(8)
        .map(lambda b: (b["x"], b["y"]))
    )

    def fit(epochs, backup=None):
        model = mf.Model(MLP(), seed=1)
        model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
        callbacks = [mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)] if backup else []
        history = model.fit(dataset.to_iter_dataset(), steps_per_epoch=3, epochs=epochs, callbacks=callbacks, verbose=0)
        return model, history

    full, full_history = fit(4)
    fit(2, tmp_path / "b")  # stops after epoch 2, its backup kept
    resumed, resumed_history = fit(4, tmp_path / "b")  # resumes at epoch 3 from the saved stream position
    assert resumed_history.history == full_history.history
    for a, b in zip(full.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def grain_stream():
    """A continuing grain stream of batches of 8 from 80 rows, shuffled (seed 2)."""
    grain = pytest.importorskip("grain")
    x, y = classification_data(n=80)
    return (
        grain.MapDataset.source([{"x": x[i], "y": y[i]} for i in range(80)])
        .shuffle(seed=2)
        .repeat()
        .batch(8)
        .map(lambda b: (b["x"], b["y"]))
    )


def fit_grain_stream(epochs, backup=None, stop_at=None):
    """The MLP fit on `grain_stream()`'s iterator, 3 steps an epoch; backups every 2 steps into `backup` (kept);
    `stop_at`: the fit stops after that step."""

    class StopAtStep(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.session.step == stop_at:
                self.model.stop_training = True

    model = mf.Model(MLP(), seed=1)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [StopAtStep()] if stop_at is not None else []
    if backup:
        callbacks.append(mf.callbacks.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False))
    history = model.fit(
        grain_stream().to_iter_dataset(), steps_per_epoch=3, epochs=epochs, callbacks=callbacks, verbose=0
    )
    return model, history


@pytest.fixture(scope="module")
def uninterrupted_grain_stream():
    """(weights, History) of `fit_grain_stream(4)` without a stop or a backup: the reference of the tests below."""
    model, history = fit_grain_stream(4)
    return model.get_weights(), history.history


@pytest.mark.parametrize("stop_at, newest", [(5, 4), (7, 6)])  # backup mid-epoch (epoch 2, batch 1); at its end
def test_grain_stream_resumes_mid_epoch_exactly(tmp_path, stop_at, newest, uninterrupted_grain_stream):
    """The restored iterator state stands at the saved batch and must not be skipped past again."""
    full_weights, full_history = uninterrupted_grain_stream
    fit_grain_stream(4, tmp_path / "b", stop_at=stop_at)
    steps = sorted(int(p) for p in os.listdir(tmp_path / "b") if p.isdigit())
    assert steps[-1] == newest
    resumed, resumed_history = fit_grain_stream(4, tmp_path / "b")
    assert int(resumed.session.state.step) == 12
    assert resumed_history.history == full_history
    for a, b in zip(full_weights, resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_fit_that_raises_leaves_a_usable_backup_for_the_next_fit(tmp_path):
    x, y = classification_data(n=96)

    class Crash(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.session.step == 7:
                raise RuntimeError("simulated crash")

    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=3,
            verbose=0,
            callbacks=[Crash(), mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2)],
        )
    steps = sorted(int(p) for p in os.listdir(tmp_path / "b") if p.isdigit())
    assert steps[-1] == 6  # the write in flight at the crash was finished, not left half-done
    fresh, uninterrupted = train_in_process(tmp_path / "other", 3)
    resumed = mf.Model(MLP(), seed=3)
    resumed.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = resumed.fit(
        x, y, batch_size=16, epochs=3, verbose=0, callbacks=[mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2)]
    )
    assert history.history == uninterrupted.history
    for a, b in zip(fresh.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_resumed_fit_reads_the_shuffled_passes_of_the_fit_it_resumes(tmp_path):
    """The crashed fit was the model's second: its epochs read passes 1 to 3, and so does its resumption."""
    x, y = classification_data(n=96)

    class Crash(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.session.step == 13:  # in the second epoch of the second fit
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
    for a, b in zip(full.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


# -- faults that must lose nothing and hang nothing ---------------------------------------------


def backup_steps(backup) -> list[int]:
    return sorted(int(p) for p in os.listdir(backup) if p.isdigit())


@pytest.mark.processes
def test_resuming_with_a_different_model_is_refused_and_the_backups_are_untouched(tmp_path):
    backup = tmp_path / "backup"
    status, output = run_worker(tmp_path / "out", backup, "--slow", "0.02", stop_at=10)
    assert status == -signal.SIGKILL
    before = snapshot(backup)
    status, output = run_worker(tmp_path / "other", backup, "--hidden", "48")
    assert status != 0
    assert (
        "does not match the model loading it" in output
        and "params/hidden/kernel: saved (4, 32) float32, expected (4, 48) float32" in output
    ), output[-3000:]
    assert snapshot(backup) == before  # nothing renamed, nothing deleted
    status, output = run_worker(tmp_path / "out", backup)  # the right model still resumes from them
    assert status == 0 and "BackupAndRestore: resumed" in output, output[-3000:]


@pytest.mark.processes
def test_sigterm_while_fit_sets_up_still_ends_in_a_backup_and_143(tmp_path):
    """The SIGTERM arrives before the restore and the first compile: the handler is armed already."""
    status, output = run_worker(tmp_path / "out", tmp_path / "backup", "--sigterm-in-setup")
    assert status == 143, output[-3000:]
    assert "sent SIGTERM in setup" in output
    assert backup_steps(tmp_path / "backup") == [1]  # stopped after the first step, and saved it


@pytest.mark.processes
def test_a_second_job_on_the_same_backup_directory_is_refused_and_the_first_is_undisturbed(tmp_path, uninterrupted):
    backup = tmp_path / "backup"
    go_on = tmp_path / "go_on"  # the first job waits after step 7, mid-epoch, until the second one has ended
    with Job(
        [sys.executable, WORKER, str(tmp_path / "out"), str(backup), "--pause-at-step", "7", str(go_on)], timeout=180
    ) as first:
        pid = int(first.wait_for(r"pid (\d+) fitting")[0].group(1))
        first.wait_for(r"paused at step 7$")
        status, output = run_worker(tmp_path / "second", backup)
        go_on.touch()
        assert status != 0
        assert f"is being written by another process: pid {pid} on host" in output, output[-3000:]
        assert first.finish() == 0, first.stderr[-3000:]
    assert not backup.exists()  # the first job finished and cleaned up its own backups
    assert_same_run(tmp_path / "out", uninterrupted["freq3"])


class SpikeLearningRate(mf.callbacks.Callback):
    """Sets a learning rate that makes the weights overflow, as a bad schedule would."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.model.session.step == self.at:
            self.model.optimizer.learning_rate = 1e38


@pytest.mark.parametrize("terminate_on_nan, delete_checkpoint", [(True, True), (True, False), (False, True)])
def test_a_nan_stop_keeps_the_last_finite_backup_and_saves_no_nan(
    tmp_path, capsys, terminate_on_nan, delete_checkpoint
):
    from meshfit.checkpointing import integrity
    from meshfit.checkpointing.checkpoint import CheckpointDir

    x, y = classification_data(n=96)
    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = tmp_path / "backup"
    callbacks = [SpikeLearningRate(at=5)] + ([mf.callbacks.TerminateOnNaN()] if terminate_on_nan else [])
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=4,
        verbose=0,
        callbacks=callbacks
        + [mf.callbacks.BackupAndRestore(backup, save_freq=2, max_to_keep=20, delete_checkpoint=delete_checkpoint)],
    )
    out = capsys.readouterr().out
    if terminate_on_nan:
        assert "Invalid loss, terminating training" in out
    else:  # training went on in NaN: every later backup was refused
        assert "not saving the state at step" in out and "NaN or Inf" in out
        assert model.session.step == 24
    if delete_checkpoint:
        assert "training ended on a non-finite loss or state" in out and "are kept" in out
    steps = backup_steps(backup)
    assert steps and steps[-1] <= 6  # nothing after the weights overflowed
    ckpt = CheckpointDir(backup, "backup", read_only=True)
    try:
        for step in steps:  # every backup on disk is finite
            restored, _ = ckpt.restore(
                step,
                lambda meta: {
                    "train": model.session.state,
                    "arrays": {k: np.zeros(shape, dtype) for k, (shape, dtype) in meta["array_specs"].items()},
                },
            )
            assert integrity.report(restored["train"]).non_finite() == [], step
    finally:
        ckpt.close()


def test_unreadable_backups_are_kept_when_fit_deletes_its_backups(tmp_path):
    backup = tmp_path / "backup"
    train_in_process(backup, 2, save_freq=4, delete_checkpoint=False, max_to_keep=3)
    for path in glob.glob(str(backup / "12" / "state" / "**" / "d" / "*"), recursive=True):
        with open(path, "r+b") as f:
            f.truncate(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_in_process(backup, 2, save_freq=4)  # resumes from 8, ends normally, deletes the backups
    assert sorted(os.listdir(backup)) == ["12.unreadable", "meshfit_checkpoints.json"]


@pytest.mark.processes
def test_a_read_only_backup_directory_fails_fit_clearly_and_the_process_exits(tmp_path):
    backup = tmp_path / "backup"
    with mounted(backup, "--bind"):
        status, _ = run_worker(tmp_path / "out", backup, "--slow", "0.02", stop_at=8)
        assert status == -signal.SIGKILL
        before = snapshot(backup)
        remount_read_only(backup)
        start = time.monotonic()
        status, output = run_worker(tmp_path / "out", backup, timeout=90)
        assert time.monotonic() - start < 60
        assert status == 1 and "CheckpointWriteError" in output and "Read-only file system" in output, output[-3000:]
        assert snapshot(backup) == before


@pytest.mark.processes
def test_a_backup_directory_that_becomes_read_only_ends_the_process_at_the_next_save(tmp_path):
    backup = tmp_path / "backup"
    with mounted(backup, "--bind"):
        with Job([sys.executable, WORKER, str(tmp_path / "out"), str(backup), "--slow", "0.1"], timeout=120) as job:
            job.wait_for(r"step 8$")  # the backup of step 3 is complete; that of step 6 may be in flight
            remount_read_only(backup)
            made_read_only = time.monotonic()
            status = job.finish(timeout=60)  # fails the test, killing the job, if it hangs
        assert time.monotonic() - made_read_only < 60
        output = job.stdout + job.stderr
        assert status == 1 and "Writing a checkpoint into" in output and "Read-only file system" in output, output[
            -3000:
        ]
        assert 3 in backup_steps(backup)  # what was written before is all there


@pytest.mark.processes
def test_a_full_disk_ends_the_process_with_a_clear_error(tmp_path):
    backup = tmp_path / "backup"
    with mounted(backup, "-t", "tmpfs", "-o", "size=192k"):
        with open(backup / "filler", "wb") as f:  # leave too little for a backup
            try:
                f.write(b"\0" * (160 * 1024))
            except OSError:
                pass
        status, output = run_worker(tmp_path / "out", tmp_path / "backup" / "b", timeout=90)
        assert status == 1 and "No space left on device" in output and "CheckpointWriteError" in output, output[-3000:]


@pytest.mark.processes
def test_sigterm_to_the_launcher_then_to_every_rank_saves_exits_143_and_resumes_exactly(
    tmp_path, uninterrupted_two_processes
):
    """What SLURM and Kubernetes do on preemption: SIGTERM to the launcher, not to the ranks; it reaches every rank,
    which save and exit 143. The job resumed from that backup is then preempted as a multi-process job without a
    launcher in between is: SIGTERM to every process, which agree on a step (JAX's sync point), save and exit 143.
    Resumed once more, it ends bitwise equal to an uninterrupted job: each preemption backup resumed exactly."""
    with Job(
        LAUNCH
        + [
            "--grace-period",
            "60",
            WORKER,
            str(tmp_path / "a"),
            str(tmp_path / "ab"),
            "--strategy",
            "multi_worker",
            "--slow",
            "0.03",
        ],
        timeout=300,
    ) as job:
        job.wait_for(r".*step 11$")
        ranks = job.children()
        assert len(ranks) == 2
        job.proc.send_signal(signal.SIGTERM)
        assert job.finish(timeout=90) == 143, job.stderr[-3000:]
    assert "[launch] received SIGTERM: sending SIGTERM to every rank" in job.stderr
    assert not [pid for pid in ranks if alive(pid)], "a rank outlived the launcher"
    saved = backup_steps(tmp_path / "ab")
    assert saved and saved[-1] >= 11

    with Job(
        LAUNCH + [WORKER, str(tmp_path / "a"), str(tmp_path / "ab"), "--strategy", "multi_worker", "--slow", "0.03"],
        timeout=300,
    ) as job:
        job.wait_for(r".*step 25$")
        workers = job.children()
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        assert job.finish(timeout=120) == 143, job.stderr[-3000:]
    assert f"(step {saved[-1]})" in job.stdout, job.stdout[-3000:]  # resumed from the launcher's preemption
    resume_two_processes_exactly(tmp_path, uninterrupted_two_processes, saved_from=25)


@pytest.mark.processes
def test_a_launcher_killed_outright_takes_its_ranks_along(tmp_path):
    with Job(
        LAUNCH + [WORKER, str(tmp_path / "a"), str(tmp_path / "ab"), "--strategy", "multi_worker", "--slow", "0.05"],
        timeout=300,
    ) as job:
        job.wait_for(r"\[rank \d\] pid \d+ fitting", count=2)  # both ranks alive, past their set-up
        ranks = job.children()
        os.kill(job.proc.pid, signal.SIGKILL)  # no handler runs: the kernel kills the ranks
        end = time.monotonic() + 10
        while any(alive(pid) for pid in ranks) and time.monotonic() < end:
            time.sleep(0.2)
        left = [pid for pid in ranks if alive(pid)]
        job.kill()
    assert not left, "ranks outlived a SIGKILLed launcher"


# -- other callbacks' state, filed by a stable key ------------------------------------------------


class Tagged(mf.callbacks.Callback):
    """A callback with state: a tag it was made with, or the one a backup gave it back."""

    def __init__(self, tag=None, state_key=None):
        super().__init__()
        self.tag, self.loaded, self.batches = tag, None, 0
        if state_key is not None:
            self.state_key = state_key

    def state_dict(self):
        return {"tag": self.tag} if self.tag else {}

    def load_state_dict(self, state):
        self.loaded = state["tag"]

    def on_train_batch_begin(self, batch, logs=None):
        self.batches += 1


class Counted(Tagged):
    pass


def fit_tagged(backup, callbacks, epochs=1):
    x, y = classification_data(n=64)
    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup_cb = mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=[*callbacks, backup_cb])
    return model


def test_callbacks_reordered_keep_their_state_by_class_and_order(tmp_path):
    fit_tagged(tmp_path / "b", [Tagged("t0"), Counted("c0"), Tagged("t1"), Tagged("n", state_key="named")])
    meta = json.loads((tmp_path / "b" / "4" / "meta" / "metadata").read_text())
    assert {"Tagged": {"tag": "t0"}, "Counted": {"tag": "c0"}, "Tagged_1": {"tag": "t1"}}.items() <= meta[
        "callbacks"
    ].items()
    assert meta["callbacks"]["named"] == {"tag": "n"}
    now = [Tagged(state_key="named"), Counted(), Tagged(), Tagged()]  # another order of classes
    fit_tagged(tmp_path / "b", now)
    assert [cb.loaded for cb in now] == ["n", "c0", "t0", "t1"]


def test_a_backup_with_state_for_a_callback_not_in_the_fit_is_refused_before_any_step(tmp_path):
    fit_tagged(tmp_path / "b", [Tagged("t0"), Counted("c0")])
    before = snapshot(tmp_path / "b")
    sentinel = Counted()  # its state is empty, so it may come and go
    sentinel.state_key = "sentinel"
    with pytest.raises(ValueError, match=r"holds the state of callback\(s\) 'Tagged', expected among") as error:
        fit_tagged(tmp_path / "b", [sentinel, Counted()], epochs=2)
    assert "Pass those callbacks to fit again" in str(error.value) and "new or empty backup_dir" in str(error.value)
    assert sentinel.batches == 0 and snapshot(tmp_path / "b") == before
    again = [Counted(), Tagged()]
    fit_tagged(tmp_path / "b", again, epochs=2)  # with the callback back, it resumes
    assert [cb.loaded for cb in again] == ["c0", "t0"]


def test_two_callbacks_with_one_state_key_are_refused():
    with pytest.raises(ValueError, match="Received: 'Tagged_1' more than once. Set a distinct `state_key`"):
        callback_protocol.state_keys([Tagged(), Tagged(), Counted(state_key="Tagged_1")])


def fit_keeping_backups(backup, epochs):
    """Trains the MLP on 64 rows for `epochs`, backing up every 2 steps into `backup` (kept)."""
    x, y = classification_data(n=64)
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    callback = mf.callbacks.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False)
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=[callback])
    return model


def test_planted_symlinks_are_refused_or_moved_aside_and_nothing_outside_is_touched(tmp_path):
    """Symlinks to a directory outside, named as meshfit's checkpoints would be: in a fresh directory fit refuses
    before any step; among meshfit's own backups they are moved aside as unreadable and the fit resumes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for name in ("2", "4", "tmp"):
        os.symlink(outside, fresh / name)
    with pytest.raises(FileExistsError, match="did not write"):
        fit_keeping_backups(fresh, 1)

    used = tmp_path / "used"
    fit_keeping_backups(used, 1)  # backups at steps 2 and 4
    for step in ("6", "8"):
        os.symlink(outside, used / step)
    with pytest.warns(UserWarning, match="unreadable"):
        resumed = fit_keeping_backups(used, 2)
    assert resumed.optimizer.iterations == 8
    assert sorted(os.listdir(outside)) == ["keep.txt"] and (outside / "keep.txt").read_text() == "precious"
    assert {"6.unreadable", "8.unreadable"} <= set(os.listdir(used))
    assert all(os.path.islink(used / f"{step}.unreadable") for step in ("6", "8"))  # moved, never followed


@pytest.mark.slow
def test_planted_symlinks_at_meshfit_names_are_refused_by_name_and_nothing_outside_changes(tmp_path):
    """Symlinks at the lock, marker, its temporary and the probe of this process, in a fresh backup directory
    and in one holding backups: fit refuses before any step, naming each; the backups and the outside files
    are unchanged, and once the links are gone the fit resumes from the backups."""
    fit_keeping_backups(tmp_path / "used", 1)  # backups at steps 2 and 4
    marker = (tmp_path / "used" / MARKER).read_bytes()
    for backup in (tmp_path / "fresh", tmp_path / "used"):
        victims = plant_symlinks(backup, tmp_path / "outside")
        before = {name: os.lstat(backup / name).st_mtime_ns for name in os.listdir(backup)}
        with pytest.raises(FileExistsError, match="Received: symlinks") as refusal:
            fit_keeping_backups(backup, 2)
        assert all(f"'{backup / name}'" in str(refusal.value) for name in meshfit_names())
        assert {name: os.lstat(backup / name).st_mtime_ns for name in os.listdir(backup)} == before
        assert read_all(tmp_path / "outside") == victims
    for name in meshfit_names():
        os.unlink(tmp_path / "used" / name)
    (tmp_path / "used" / MARKER).write_bytes(marker)
    assert fit_keeping_backups(tmp_path / "used", 2).optimizer.iterations == 8
    assert linked_meshfit_names(tmp_path / "used") == [] and read_all(tmp_path / "outside") == victims


def test_labels_out_of_range_mid_stream_end_fit_with_the_backups_kept(tmp_path):
    """A ValueError from batch 5's labels ends the fit; the backups before it stay, whole, for the next run."""
    x, y = classification_data(n=96)

    def stream():
        for i in range(6):
            yb = y[i * 16 : (i + 1) * 16].copy()
            if i == 5:
                yb[2] = -1
            yield x[i * 16 : (i + 1) * 16], yb

    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    backup = mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2)
    with pytest.raises(ValueError, match="Received: -1 at batch 5 of the epoch"):
        model.fit(stream(), verbose=0, callbacks=[backup])
    assert model.session.step == 5
    assert sorted(int(p) for p in os.listdir(tmp_path / "b") if p.isdigit()) == [2, 4]
    resumed = mf.Model(MLP(), seed=3)
    resumed.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    resumed.fit(x[:80], y[:80], batch_size=16, verbose=0, callbacks=[mf.callbacks.BackupAndRestore(tmp_path / "b")])
    assert resumed.session.step == 5  # resumed at step 4: one batch of the epoch left


# -- a directory whose contents decide what the job resumes and runs: the user's alone ------------------------


class CountSteps(mf.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def test_the_backup_directory_is_made_0700(tmp_path):
    x, y = classification_data(n=32)
    model = mf.Model(MLP())
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    backup = mf.callbacks.BackupAndRestore(tmp_path / "backup", delete_checkpoint=False, compilation_cache=False)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[backup])
    assert os.stat(tmp_path / "backup").st_mode & 0o777 == 0o700


@pytest.mark.parametrize("owner, mode", [(65534, 0o755), (None, 0o777), (None, 0o770)])
def test_a_backup_directory_another_user_owns_or_others_can_write_to_is_refused_before_any_step(tmp_path, owner, mode):
    if owner is not None and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    backup = tmp_path / "backup"
    backup.mkdir()
    os.chmod(backup, mode)
    if owner is not None:
        os.chown(backup, owner, owner)
    x, y = classification_data(n=32)
    model = mf.Model(MLP())
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    counted = CountSteps()
    with pytest.raises(PermissionError, match=f"backup directory '{backup}'") as refusal:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[mf.callbacks.BackupAndRestore(backup), counted])
    why = "uid 65534 (nobody), not to you" if owner else f"others can write to it (mode 0{mode:o})"
    assert why in str(refusal.value) and len(str(refusal.value).splitlines()) <= 3
    assert counted.steps == 0 and os.listdir(backup) == []  # refused before any step, nothing written


def test_kerass_double_checkpoint_keeps_the_previous_backup(tmp_path):
    """Keras's positional order (backup_dir, save_freq, double_checkpoint): True keeps at least two backups."""
    keras_style = mf.callbacks.BackupAndRestore(tmp_path, "epoch", True, max_to_keep=1)
    assert keras_style.double_checkpoint and keras_style.max_to_keep == 2
    assert mf.callbacks.BackupAndRestore(tmp_path, max_to_keep=1).max_to_keep == 1


@pytest.mark.processes
def test_an_elastic_restart_onto_one_process_resumes_from_the_two_process_jobs_memory_snapshot(
    tmp_path, uninterrupted_two_processes
):
    """--min-nprocs 1: rank 1 is SIGKILLed at step 23, then fails at once in the restart; the launcher drops
    it and restarts the job on 1 process (2 devices), which resumes from the 2-process job's memory snapshot
    of step 20 and finishes as a 1-process job resumed from a disk backup of that step does (the uninterrupted
    2-process job's backup of step 20, alone in a directory of its own)."""
    elastic_argv = (
        LAUNCH
        + ["--min-nprocs", "1", "--max-restarts", "2", "--stop-grace", "1"]
        + [WORKER, str(tmp_path / "a"), str(tmp_path / "ab"), "--strategy", "multi_worker", "--keep-backups"]
        + ["--save-freq", "1000", "--memory-freq", "5", "--die-at-step", "23", "--slow", "0.03"]
        + ["--rank1-fails-to-restart"]
    )
    pool = ThreadPoolExecutor(1)  # the elastic job runs beside the reference
    elastic_run = pool.submit(run, elastic_argv, timeout=300)
    # The reference: the uninterrupted 2-process job's backup of step 20 (the end of epoch 2), which 1 process
    # resumes. Copied alone: the job's backup of step 40 stays behind.
    two_process_backup = uninterrupted_two_processes.parent / "backup"
    os.makedirs(tmp_path / "rb", mode=0o700)
    shutil.copy2(two_process_backup / "meshfit_checkpoints.json", tmp_path / "rb")
    shutil.copytree(two_process_backup / "20", tmp_path / "rb" / "20")
    one_process = [sys.executable, "-m", "meshfit.cli", "launch", "--nprocs", "1", "--devices-per-proc", "2"]
    reference = run(
        one_process + [WORKER, str(tmp_path / "r"), str(tmp_path / "rb"), "--strategy", "multi_worker"], timeout=300
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "resumed from" in reference.stdout and "(step 20)." in reference.stdout

    elastic = elastic_run.result()
    pool.shutdown()
    assert elastic.returncode == 0, elastic.stdout[-3000:] + elastic.stderr[-3000:]
    assert "rank 1 exited with status 3" in elastic.stderr
    assert "rank 1 (slot 1) failed" in elastic.stderr and "restarting the job with 1 process(es)" in elastic.stderr
    assert "resumed from the launcher's memory snapshot of a 2-process job at epoch 2, batch 10 (step 20)" in (
        elastic.stdout
    )
    assert not [p for p in os.listdir(tmp_path / "ab") if p.split(".")[0].isdigit()]  # no disk backup at all
    (wa, ha), (wr, hr) = load(tmp_path / "a"), load(tmp_path / "r")
    for x, y in zip(wa, wr, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)  # as saved_under_mirrored8_restores_onto_other_layouts
    assert ha["epoch"] == hr["epoch"] == [0, 1, 2, 3] and ha["history"].keys() == hr["history"].keys()
    for key, values in hr["history"].items():
        np.testing.assert_allclose(ha["history"][key], values, rtol=1e-5, atol=1e-6, err_msg=key)
