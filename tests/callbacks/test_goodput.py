"""Goodput: the ledger's buckets add up to the job's wall-clock time, in one fit, across fits and across a
SIGKILLed and resumed process."""

import json
import os
import re
import shutil
import signal
import sys
import time
import warnings

import numpy as np
import pytest
from helpers import MLP, classification_data
from processes import Job, run

import meshfit as mf
from meshfit.callbacks.goodput import BUCKETS, RECORD_NAME, Ledger, process_start_time

WORKER = os.path.join(os.path.dirname(__file__), "..", "workers", "train_resumable.py")


def new_model(hidden=64):
    with mf.strategies.OneDeviceStrategy().scope():
        model = mf.Model(MLP(din=16, hidden=hidden, dout=4))
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def timed_fit(model, x, y=None, **fit_args):
    began = time.time()
    history = model.fit(x, y, verbose=0, **fit_args)
    return history, time.time() - began


@pytest.mark.slow
def test_the_buckets_add_up_to_the_wall_clock_and_reach_the_logs(tmp_path, capsys):
    pytest.importorskip("tensorboardX")  # the TensorBoard callback's writer
    from test_tensorboard import read_events

    x, y = classification_data(n=640, din=16, classes=4)
    model = new_model()
    goodput = mf.callbacks.Goodput()
    csv = mf.callbacks.CSVLogger(tmp_path / "log.csv")
    board = mf.callbacks.TensorBoard(tmp_path / "logs")
    backup = mf.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=5)
    history, seconds = timed_fit(
        model, x, y, batch_size=32, epochs=3, validation_split=0.25, callbacks=[csv, board, backup, goodput]
    )
    ledger = goodput.ledger
    assert all(value >= 0 for value in ledger.seconds().values()), ledger
    in_fit = ledger.wall - ledger.startup
    assert in_fit == pytest.approx(seconds, rel=0.01)
    assert ledger.ended_at - ledger.started_at == pytest.approx(ledger.wall, rel=0.01)
    assert ledger.started_at == process_start_time() < ledger.ended_at - seconds
    for bucket in ("startup", "compile", "steps", "checkpoint", "evaluate", "callbacks"):
        assert getattr(ledger, bucket) > 0, bucket
    assert ledger.lost == ledger.down == ledger.idle == 0 and ledger.lost_steps == 0
    assert ledger.step == 3 * 15 and ledger.processes == 1
    assert ledger.goodput == pytest.approx(ledger.steps / ledger.wall)
    logs = history.history
    assert len(logs["goodput"]) == 3 and logs["time_lost"] == logs["time_down"] == [0.0, 0.0, 0.0]
    assert {name for name in logs if name.startswith("time_")} == {"time_lost", "time_down"}  # the rest: ledger
    header = (tmp_path / "log.csv").read_text().splitlines()[0].split(",")
    assert "goodput" in header and "time_lost" in header and "time_compile" not in header
    scalars, _ = read_events(tmp_path / "logs" / "train")
    assert [value for _, value in scalars["epoch_goodput"]] == pytest.approx(logs["goodput"])
    assert len(scalars["epoch_time_lost"]) == 3
    assert not os.path.exists(f"{tmp_path / 'backup'}.goodput.json")  # a finished fit keeps no record
    table = str(ledger)
    assert table.startswith(f"Goodput {ledger.goodput:.1%}") and all(bucket in table for bucket in BUCKETS)
    printed = capsys.readouterr().out  # the fit printed its table at its end (verbose=0 silenced only the bar)
    assert printed.count("Goodput ") == 1 and all(
        re.search(rf"^{bucket} +[0-9.]+", printed, re.M) for bucket in BUCKETS
    )


@pytest.mark.slow
def test_compilation_counts_on_the_first_fit_and_not_on_a_second_with_the_same_shapes():
    x, y = classification_data(n=256, din=16, classes=4)
    model = new_model(hidden=48)
    goodput = mf.callbacks.Goodput()
    timed_fit(model, x, y, batch_size=32, epochs=1, callbacks=[goodput])
    first = goodput.ledger
    compiled = dict(model.session.executables.compilations())
    time.sleep(0.3)
    _, seconds = timed_fit(model, x, y, batch_size=32, epochs=2, callbacks=[goodput])
    second = goodput.ledger
    assert model.session.executables.compilations() == compiled  # nothing compiled again
    assert first.compile > 0.05
    assert second.compile - first.compile < 0.05 * first.compile
    assert second.idle >= 0.3  # between the fits
    added = second.wall - first.wall - (second.idle - first.idle)  # the second fit's own time in the ledger
    assert second.steps - first.steps <= added <= seconds + 0.01  # within the fit call, at least its steps
    assert second.startup == first.startup and second.step == first.step + 2 * 8


@pytest.mark.slow
def test_a_sleeping_input_generator_shows_as_input_wait():
    x, y = classification_data(n=32 * 12, din=16, classes=4)

    def batches():
        for i in range(12):
            time.sleep(0.1)
            yield x[32 * i : 32 * (i + 1)], y[32 * i : 32 * (i + 1)]

    goodput = mf.callbacks.Goodput()
    _, seconds = timed_fit(new_model(), batches(), epochs=1, callbacks=[goodput])
    ledger = goodput.ledger
    # The first batch is read (peeked) as fit starts; the reading thread reads a few ahead while the
    # first step compiles; the loop waits for the others.
    assert 0.6 <= ledger.input < 1.2
    assert ledger.input > ledger.steps + ledger.callbacks
    assert ledger.wall - ledger.startup == pytest.approx(seconds, rel=0.01, abs=0.02)


@pytest.mark.slow
def test_a_sleeping_callback_shows_in_callbacks_time(capsys):
    x, y = classification_data(n=256, din=16, classes=4)
    sleepy = mf.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: time.sleep(0.01), on_epoch_end=lambda epoch, logs: time.sleep(0.1)
    )
    goodput = mf.callbacks.Goodput(verbose=0)
    _, seconds = timed_fit(new_model(), x, y, batch_size=32, epochs=2, callbacks=[sleepy, goodput])
    assert "Goodput" not in capsys.readouterr().out  # verbose=0: no table
    ledger = goodput.ledger
    slept = 2 * 8 * 0.01 + 2 * 0.1
    assert slept <= ledger.callbacks < slept + 0.25
    assert ledger.wall - ledger.startup == pytest.approx(seconds, rel=0.01, abs=0.02)


class FailAtStep(mf.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.context.step == self.step:
            raise RuntimeError("failing on purpose")


@pytest.mark.slow
def test_a_fit_resumed_in_the_same_process_counts_lost_steps_and_no_down_time(tmp_path):
    """A fit fails after its backup at step 6 (save_freq=3) at step 8; the next fit resumes from step 6."""
    x, y = classification_data(n=320, din=16, classes=4)
    model = new_model()

    def callbacks(*more):
        backup = mf.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=3, async_save=False)
        return [*more, backup, mf.callbacks.Goodput(record_every=0)]

    failing = callbacks(FailAtStep(8))
    with pytest.raises(RuntimeError, match="failing on purpose"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=failing)
    crashed = failing[-1].ledger
    assert crashed.step == 8 and os.path.exists(tmp_path / "backup" / RECORD_NAME)  # inside the backup directory
    assert os.listdir(tmp_path) == ["backup"]  # nothing beside it
    resumed = callbacks()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=resumed)
    ledger = resumed[-1].ledger
    assert ledger.lost_steps == 2 and ledger.processes == 1 and ledger.down == 0
    assert 0 < ledger.lost < crashed.wall - crashed.startup
    assert ledger.started_at == crashed.started_at and ledger.step == 10
    assert ledger.wall == pytest.approx(ledger.ended_at - ledger.started_at, rel=0.01)


@pytest.mark.slow
@pytest.mark.processes
def test_a_sigkilled_and_resumed_run_reports_its_lost_work_and_the_time_between(tmp_path):
    """Backups every 3 steps; SIGKILL while paused at step 8; a new process resumes from the last backup."""
    backup, record = tmp_path / "backup", tmp_path / "ledger.json"
    argv = [sys.executable, WORKER, str(tmp_path / "out"), str(backup), "--save-freq", "3", "--goodput", str(record)]
    began = time.time()
    with Job([*argv, "--pause-at-step", "8", str(tmp_path / "never")], timeout=180) as job:
        job.wait_for(r"paused at step 8")
        time.sleep(0.5)  # the backup at step 6, written in the background, completes
        killed_at = time.time()
        job.kill()
    assert job.returncode == -signal.SIGKILL
    restarted_at = time.time()
    resumed = run(argv, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    backed_up = int(re.search(r"BackupAndRestore: resumed from .* \(step (\d+)\)", resumed.stdout).group(1))
    saved = json.loads(record.read_text())
    ledger = Ledger.from_dict(saved["ledger"])
    assert backed_up in (3, 6)
    assert ledger.lost_steps == 8 - backed_up and ledger.lost > 0
    assert ledger.processes == 2 and ledger.step == 40
    assert ledger.down >= restarted_at - killed_at
    wall = saved["finished_at"] - began
    assert ledger.wall == pytest.approx(wall, rel=0.02)
    assert ledger.started_at == pytest.approx(began, abs=0.1)


@pytest.mark.slow
def test_a_link_planted_at_the_record_is_not_followed_and_the_fit_completes(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("not meshfit's")
    (tmp_path / "backup").mkdir()
    os.symlink(outside, tmp_path / "backup" / RECORD_NAME)
    x, y = classification_data(n=128, din=16, classes=4)
    callbacks = [mf.callbacks.BackupAndRestore(tmp_path / "backup"), mf.callbacks.Goodput(record_every=0)]
    with pytest.warns(UserWarning, match=f"Goodput: not recording the ledger in .*{RECORD_NAME}"):
        new_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks)
    assert outside.read_text() == "not meshfit's"
    assert callbacks[1].ledger.step == 4
    assert not [name for name in os.listdir(tmp_path / "backup") if name.endswith(".partial")]


def test_a_ledger_adds_prints_and_reads_back():
    ledger = Ledger(startup=2.0, compile=1.0, steps=6.0, lost=1.0, lost_steps=3, step=40, processes=2, job="j")
    assert ledger.wall == 10.0 and ledger.goodput == 0.6
    assert ledger.plus(steps=4.0, down=1.0).seconds() == {**ledger.seconds(), "steps": 10.0, "down": 1.0}
    assert Ledger.from_dict(json.loads(json.dumps(ledger.to_dict()))) == ledger
    logs = ledger.logs()
    assert logs == {"goodput": 0.6, "time_lost": 1.0, "time_down": 0.0}
    table = str(ledger)
    assert "over 2 processes, 40 steps" in table and "(3 steps trained again)" in table
    assert re.search(r"steps\s+6\.00\s+60\.0%", table) and re.search(r"total\s+10\.00\s+100\.0%", table)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"record_every": -1}, "`record_every` must be a number of seconds >= 0"),
        ({"record_every": True}, "`record_every` must be a number of seconds >= 0"),
        ({"record_path": 3}, "`record_path` must be a file path or None"),
        ({"verbose": 2}, "`verbose` must be 0 or 1. Received: verbose=2"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mf.callbacks.Goodput(**kwargs)


def test_the_process_start_time_comes_before_now():
    start = process_start_time()
    assert start < time.time() and start == process_start_time()
    assert np.isfinite(start) and time.time() - start < 24 * 3600


@pytest.mark.slow
@pytest.mark.processes
def test_a_preempted_run_loses_no_work_and_counts_the_restart_as_down_time(tmp_path):
    """SIGTERM: BackupAndRestore backs up at the step where training stops, so nothing is trained again."""
    backup, record = tmp_path / "backup", tmp_path / "ledger.json"
    argv = [sys.executable, WORKER, str(tmp_path / "out"), str(backup), "--save-freq", "3", "--goodput", str(record)]
    began = time.time()
    with Job([*argv, "--slow", "0.02"], timeout=180) as job:
        job.wait_for(r"step 13")
        os.kill(job.proc.pid, signal.SIGTERM)
        assert job.finish() == 143
    time.sleep(0.5)
    resumed = run(argv, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    saved = json.loads(record.read_text())
    ledger = Ledger.from_dict(saved["ledger"])
    assert ledger.lost == 0 and ledger.lost_steps == 0
    assert ledger.processes == 2 and ledger.step == 40
    assert ledger.down >= 0.5  # from the backup at the stop to the new process's start
    assert ledger.wall == pytest.approx(saved["finished_at"] - began, rel=0.02)


def _plant_fifo(path):
    os.mkfifo(path)


def _plant_foreign(path):
    path.write_text(json.dumps(Ledger(steps=1e6, step=8, job="forged").to_dict()))
    os.chown(path, 65534, 65534)


#: What another user (or a damaged disk) may leave at the record's name, and how to plant it.
PLANTED_RECORDS = {
    "symlink": lambda path: os.symlink(path.parent.parent / "outside.txt", path),
    "fifo": _plant_fifo,
    "directory": lambda path: path.mkdir(),
    "garbage": lambda path: path.write_bytes(b"\xff{not json"),
    "non-numeric field": lambda path: path.write_text(json.dumps({"steps": "lots", "step": 8})),
    "negative time": lambda path: path.write_text(json.dumps({"down": -5.0, "step": 8})),
    "infinite time": lambda path: path.write_text('{"lost": Infinity, "step": 8}'),
    "foreign": _plant_foreign,
}


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="a foreign file needs chown (root)")
def test_a_planted_or_garbled_record_is_ignored_with_one_warning_and_the_resumed_fit_completes(tmp_path):
    """A fit fails after its backup at step 6; whatever stands at the record's name, the resume completes,
    warns once naming the record, counts the time after the backup as down time, and writes only inside the
    backup directory."""
    x, y = classification_data(n=320, din=16, classes=4)
    crashed = tmp_path / "crashed"

    def callbacks(backup, *more):
        return [*more, mf.callbacks.BackupAndRestore(backup, save_freq=3, async_save=False), mf.callbacks.Goodput()]

    with pytest.raises(RuntimeError, match="failing on purpose"):
        new_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks(crashed, FailAtStep(8)))
    (tmp_path / "outside.txt").write_text("not meshfit's")
    for name, plant in PLANTED_RECORDS.items():
        base = tmp_path / name.replace(" ", "-")
        shutil.copytree(crashed, base / "backup", symlinks=True)
        os.chmod(base, 0o700)
        os.remove(base / "backup" / RECORD_NAME)
        plant(base / "backup" / RECORD_NAME)
        resumed = callbacks(base / "backup")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            new_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=resumed)
        said = [str(w.message) for w in caught if "Goodput" in str(w.message)]
        assert len(said) == 1 and f"ignored the record '{base / 'backup' / RECORD_NAME}'" in said[0], (name, said)
        ledger = resumed[-1].ledger
        assert ledger.step == 10 and ledger.lost_steps == 0 and ledger.job != "forged", name
        assert all(np.isfinite(v) and v >= 0 for v in ledger.seconds().values()), name
        assert set(os.listdir(base)) <= {"backup"}, name  # nothing written beside the backup directory
    assert (tmp_path / "outside.txt").read_text() == "not meshfit's"
