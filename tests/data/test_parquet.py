"""mf.data.parquet: the same training as arrays, each process its own row groups, every row exactly once
per epoch (counted through `tap`) across a resume from a backup and a change in the number of processes."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import EXAMPLES, MLP, classification_data
from processes import LAUNCH, run

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import meshfit as mf  # noqa: E402

FEATURES = ["f0", "f1", "f2", "f3"]
WORKER = os.path.join(os.path.dirname(__file__), "..", "workers", "train_parquet.py")


def write_shards(directory, x, y, files, row_group_size):
    """`x`, `y` and an `id` column (0, 1, ...) split over `files` Parquet files in order, `row_group_size` rows a
    row group (the last group of each file may be shorter)."""
    os.makedirs(directory, exist_ok=True)
    ids = np.arange(len(x))
    for index, part in enumerate(np.array_split(ids, files)):
        table = pa.table({"id": ids[part], **{f: x[part, j] for j, f in enumerate(FEATURES)}, "label": y[part]})
        pq.write_table(table, os.path.join(directory, f"part-{index:02d}.parquet"), row_group_size=row_group_size)
    return directory


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """200 rows in 3 files (67, 67, 66 rows) of row groups of 32: 9 groups, each file's last one short."""
    x, y = classification_data(n=200)
    return write_shards(tmp_path_factory.mktemp("shards"), x, y, files=3, row_group_size=32), x, y


def source(directory, batch_size=16, **kwargs):
    return mf.data.parquet(directory, x=FEATURES, y="label", columns=["id"], batch_size=batch_size, **kwargs)


def ids_of(data, epoch, start_step=0):
    """Per batch, the ids the source yields (through `tap`, as the trainer takes them)."""
    taken = []
    data.tap = lambda e, step, rows: taken.append((step, rows["id"].tolist()))
    for _ in data.batches(epoch, start_step):
        pass
    return taken


def compiled_model():
    model = mf.Model(MLP(), seed=3)
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.slow  # fits that compile: 3 to 5 CPU-s
def test_training_from_parquet_equals_training_on_the_same_rows_as_arrays(shards):
    directory, x, y = shards
    taps = []
    from_parquet = compiled_model()
    from_parquet.fit(source(directory, tap=lambda e, s, rows: taps.append((e, s, rows["id"]))), epochs=2, verbose=0)
    from_arrays = compiled_model()
    from_arrays.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(from_parquet.get_weights(), from_arrays.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [(e, s) for e, s, _ in taps] == [(e, s) for e in range(2) for s in range(13)]  # in step order, no peek
    for epoch in range(2):
        np.testing.assert_array_equal(np.concatenate([ids for e, _, ids in taps if e == epoch]), np.arange(200))


def test_a_shuffled_epoch_is_every_row_once_in_an_order_from_the_seed_and_the_epoch(shards):
    directory, _, _ = shards
    data = source(directory, shuffle_seed=5)
    epoch0, epoch1 = (np.concatenate([ids for _, ids in ids_of(data, e)]) for e in (0, 1))
    assert sorted(epoch0) == sorted(epoch1) == list(range(200))
    assert list(epoch0) != list(epoch1)
    again = np.concatenate([ids for _, ids in ids_of(source(directory, shuffle_seed=5), 0)])
    np.testing.assert_array_equal(epoch0, again)


def group_of(ids):
    """The (file, row group) each id was read from (67, 67, 66 rows per file, groups of 32)."""
    starts = np.array([0, 67, 134])
    file = np.searchsorted(starts, ids, side="right") - 1
    return set(zip(file.tolist(), ((np.asarray(ids) - starts[file]) // 32).tolist(), strict=True))


def as_process(directory, block, state=None, **kwargs):
    data = source(directory, **kwargs)
    data.lay_out(block, block[1])
    if state is not None:
        data.set_state(state)
    return data


@pytest.mark.parametrize("seed", [None, 3])
def test_two_processes_read_disjoint_row_groups_and_a_one_process_resume_finishes_the_epoch_exactly_once(shards, seed):
    """Blocks 0 and 1 of 2 (each process's view) take 8 rows a step from row groups the other never reads; the
    position after 5 steps, restored on 1 process, yields the rest of the epoch: every id exactly once."""
    directory, _, _ = shards
    ranks = [as_process(directory, (rank, 2), shuffle_seed=seed) for rank in range(2)]
    taken = [ids_of(data, 0) for data in ranks]
    assert len(taken[0]) == len(taken[1]) == ranks[0].steps_per_epoch
    assert all(len(ids) <= 8 for rank in taken for _, ids in rank)
    assert not group_of(sum((ids for _, ids in taken[0]), [])) & group_of(sum((ids for _, ids in taken[1]), []))
    state = ranks[0].get_state()
    assert state == ranks[1].get_state()
    # Stopped after step 4 (5 batches taken): the state the trainer would have saved.
    partial = [as_process(directory, (rank, 2), shuffle_seed=seed) for rank in range(2)]
    before = []
    for data in partial:
        batches = data.batches(0)
        data.tap = lambda e, s, rows: before.extend(rows["id"].tolist())
        for _ in range(5):
            next(batches)
        batches.close()
    position = partial[0].get_state()
    assert position == {"epoch": 0, "rows": 80, "lanes": 2, "shuffle_seed": seed, "batch_size": 16}
    alone = as_process(directory, (0, 1), state=position, shuffle_seed=seed)
    after = sum((ids for _, ids in ids_of(alone, 0, start_step=5)), [])
    assert sorted(before + after) == list(range(200))
    assert alone.get_state()["lanes"] == 2  # the resumed epoch keeps its layout; the next one starts anew
    assert ids_of(alone, 1) and alone.get_state()["lanes"] == 1


def test_a_process_whose_row_groups_run_out_first_yields_masked_padding_until_the_epoch_ends(tmp_path):
    """Row groups of 64 and 8 rows dealt to 2 processes: process 1's 8 rows fill its first batch, then it
    yields batches of padding only (mask 0, an empty tap) as long as process 0 has rows: as many steps."""
    x, y = classification_data(n=72)
    write_shards(tmp_path, x, y, files=1, row_group_size=64)
    ranks = [as_process(tmp_path, (rank, 2)) for rank in range(2)]
    taken = [ids_of(data, 0) for data in ranks]
    assert [len(t) for t in taken] == [8, 8]
    assert [len(ids) for _, ids in taken[1]] == [8] + [0] * 7
    assert sorted(sum((ids for t in taken for _, ids in t), [])) == list(range(72))
    last = list(ranks[1].batches(0))[-1]
    assert last.x.shape == (8, 4) and last.x.dtype == np.float32 and not last.mask.any()


@pytest.mark.parametrize("group_rows", [(32, 32, 32, 32), (40, 24, 32, 32, 16, 16), (32, 32, 16, 16, 32, 32)])
@pytest.mark.parametrize("seed", [None, 1])
@pytest.mark.parametrize("processes", [1, 2])
def test_has_partial_batches_is_true_whenever_some_epoch_pads(tmp_path, group_rows, seed, processes):
    """What `has_partial_batches` says before the fit (a strategy may refuse partial batches on it) holds for
    every epoch, shuffled ones included, where each epoch deals its row groups anew."""
    x, y = classification_data(n=sum(group_rows))
    for index, rows in enumerate(group_rows):  # a file per row group, of the sizes given
        start = sum(group_rows[:index])
        part = slice(start, start + rows)
        table = pa.table(
            {"id": np.arange(start, start + rows), **{f: x[part, j] for j, f in enumerate(FEATURES)}, "label": y[part]}
        )
        pq.write_table(table, tmp_path / f"part-{index}.parquet")
    blocks = [as_process(tmp_path, (rank, processes), shuffle_seed=seed, batch_size=32) for rank in range(processes)]
    padded = any((batch.mask == 0).any() for data in blocks for epoch in range(6) for batch in data.batches(epoch))
    dealt_anew = seed is not None and processes > 1 and len(set(group_rows)) > 1  # said without reading
    assert blocks[0].has_partial_batches == (padded or dealt_anew)
    if len(set(group_rows)) == 1:
        assert not padded and not blocks[0].has_partial_batches


def test_a_list_column_is_one_input_of_its_lists_length(tmp_path):
    x, y = classification_data(n=20)
    table = pa.table({"pixels": pa.array(list(x)), "label": y})  # a list<float> column of lists of 4
    pq.write_table(table, tmp_path / "lists.parquet", row_group_size=8)
    data = mf.data.parquet(tmp_path, x="pixels", y="label", batch_size=8)
    assert data.peek().x.shape == (8, 4) and data.peek().x.dtype == np.float32
    batches = list(data.batches(0))
    np.testing.assert_array_equal(np.concatenate([b.x[b.mask > 0] for b in batches]), x)
    np.testing.assert_array_equal(np.concatenate([b.y[b.mask > 0] for b in batches]), y)


@pytest.mark.slow  # fits that compile: 3 to 5 CPU-s
def test_a_fit_resumed_from_a_disk_backup_mid_epoch_takes_every_row_once_and_ends_as_an_uninterrupted_one(
    shards, tmp_path
):
    directory, _, _ = shards

    class Crash(mf.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.session.step == 7:
                raise RuntimeError("simulated crash")

    taken = []

    def tap(epoch, step, rows):
        taken.append((epoch, step, rows["id"].tolist()))

    def backup():
        return mf.callbacks.BackupAndRestore(tmp_path / "b", save_freq=3, compilation_cache=False)

    crashed = compiled_model()
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(source(directory, shuffle_seed=1, tap=tap), epochs=1, verbose=0, callbacks=[Crash(), backup()])
    resumed_at = max(int(p) for p in os.listdir(tmp_path / "b") if p.isdigit())
    assert resumed_at == 6
    before = [ids for _, step, ids in taken if step < resumed_at]  # steps 6 and 7 are trained again
    taken.clear()
    resumed = compiled_model()
    resumed.fit(source(directory, shuffle_seed=1, tap=tap), epochs=1, verbose=0, callbacks=[backup()])
    assert [step for _, step, _ in taken] == list(range(resumed_at, 13))
    assert sorted(sum(before + [ids for _, _, ids in taken], [])) == list(range(200))
    uninterrupted = compiled_model()
    uninterrupted.fit(source(directory, shuffle_seed=1), epochs=1, verbose=0)
    for a, b in zip(resumed.get_weights(), uninterrupted.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # fits that compile: 3 to 5 CPU-s
def test_validation_and_evaluate_read_the_rows_without_tapping_or_moving_the_training_position(shards, tmp_path):
    """The same source as `x` and `validation_data`, then `evaluate`d: the tap sees the training steps only, and
    the position a backup saves at each epoch's end is training's (every row consumed), not evaluation's."""
    directory, x, y = shards
    taps, positions = [], []
    data = source(directory, tap=lambda e, s, rows: taps.append((e, s)))

    class Position(mf.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            positions.append(data.get_state())

    model = compiled_model()
    history = model.fit(data, validation_data=data, epochs=2, verbose=0, callbacks=[Position()])
    assert taps == [(e, s) for e in range(2) for s in range(13)]
    assert [(p["epoch"], p["rows"]) for p in positions] == [(0, 13 * 16), (1, 13 * 16)]
    logs = model.evaluate(data, verbose=0, return_dict=True)
    assert len(taps) == 26 and data.get_state() == positions[-1]
    reference = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert logs["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    assert history.history["val_loss"][-1] == pytest.approx(reference["loss"], rel=1e-6)


def test_a_missing_column_is_refused_naming_the_columns_that_exist(shards):
    directory, _, _ = shards
    with pytest.raises(ValueError, match=r"`y` names column 'target', which no file has\. The files' columns: id, f0"):
        mf.data.parquet(directory, x=FEATURES, y="target", batch_size=16)
    with pytest.raises(ValueError, match=r"`x` names column 'f9', which no file has\. The files' columns: id, f0"):
        mf.data.parquet(directory, x=["f0", "f9"], y="label", batch_size=16)


def test_files_of_different_schemas_are_refused_naming_both(tmp_path):
    pq.write_table(pa.table({"a": np.zeros(4, np.float32), "y": np.zeros(4, np.int32)}), tmp_path / "one.parquet")
    pq.write_table(pa.table({"a": np.zeros(4, np.float64), "y": np.zeros(4, np.int32)}), tmp_path / "two.parquet")
    with pytest.raises(ValueError, match="same schema") as refusal:
        mf.data.parquet(tmp_path, x=["a"], y="y", batch_size=4)
    assert "one.parquet" in str(refusal.value) and "two.parquet" in str(refusal.value)
    assert "a: float" in str(refusal.value) and "a: double" in str(refusal.value)


def test_an_empty_glob_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"'.*nothing-\*\.parquet' matches no file"):
        mf.data.parquet(str(tmp_path / "nothing-*.parquet"), x="a", batch_size=4)


def test_a_global_batch_the_processes_cannot_split_evenly_is_refused_before_any_read(shards):
    directory, _, _ = shards
    data = source(directory, batch_size=16)
    with pytest.raises(ValueError, match=r"split evenly over 3 processes: it must be a multiple of 3\. "):
        data.lay_out((0, 3), 3)


def test_a_backup_position_of_another_batch_size_is_refused(shards):
    directory, _, _ = shards
    data = source(directory, batch_size=16)
    with pytest.raises(ValueError, match="saved with batch_size=32; this input has batch_size=16"):
        data.set_state({"epoch": 0, "rows": 64, "lanes": 1, "shuffle_seed": None, "batch_size": 32})


@pytest.mark.processes
def test_a_fit_evaluate_and_predict_on_arrays_import_neither_pyarrow_nor_ray():
    """In a fresh interpreter: meshfit's data names are reachable, and a whole fit, evaluate and predict on arrays
    (the path every input goes through) leave pyarrow and Ray unimported."""
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import numpy as np, meshfit as mf; from helpers import MLP\n"
        "assert callable(mf.data.parquet) and callable(mf.data.ray_dataset)\n"
        "model = mf.Model(MLP(), seed=0); model.compile(optimizer='adam', loss='sparse_categorical_crossentropy')\n"
        "x, y = np.zeros((8, 4), np.float32), np.zeros(8, np.int32)\n"
        "model.fit(x, y, batch_size=4, verbose=0, validation_data=(x, y)); model.evaluate(x, y, verbose=0)\n"
        "model.predict(x, verbose=0)\n"
        "print(sorted(m for m in ('pyarrow', 'ray', 'ray.data', 'pandas') if m in sys.modules))"
    )
    tests = os.path.join(os.path.dirname(__file__), "..")
    ran = subprocess.run([sys.executable, "-c", probe, tests], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip().splitlines()[-1] == "[]"


# -- real processes: a 2-process job killed mid-epoch -------------------------------------------------------


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory):
    """4096 rows with an id column, in 8 files of row groups of 256: 16 groups."""
    x, y = classification_data(n=4096)
    return write_shards(tmp_path_factory.mktemp("big"), x, y, files=8, row_group_size=256)


def read_taps(out, name):
    """The records `{"epoch", "step", "ids"}` of a tap file, in the order written (none if it was never made)."""
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def exactly_once(*records):
    ids = sorted(i for part in records for r in part for i in r["ids"])
    return ids == list(range(4096))


def groups(records):
    return {i // 256 for r in records for i in r["ids"]}


@pytest.mark.slow
@pytest.mark.processes
def test_a_killed_two_process_job_resumes_with_two_processes_and_a_plain_fit_finishes_its_epoch(big_shards, tmp_path):
    """2 processes, rank 1 SIGKILLed after step 23 (once the backup of step 20 is written), --max-restarts 1:
    the restart resumes from the backup of step 20 and every id is taken exactly once in the epoch, each
    process reading row groups the other does not. A plain one-process fit from the same backup finishes the
    epoch exactly once too."""
    out, backup = tmp_path / "out", tmp_path / "backup"
    job = run(
        LAUNCH
        + ["--nprocs", "2", "--max-restarts", "1", "--stop-grace", "1"]
        + [WORKER, str(big_shards), str(out), str(backup), "--save-freq", "10", "--die-at-step", "23"],
        timeout=300,
    )
    said = job.stdout[-3000:] + job.stderr[-3000:]
    assert job.returncode == 0, said
    assert "restarting the job (1/1)" in job.stderr, said
    assert re.search(r"\[rank 0\] BackupAndRestore: resumed from \S+ at .* \(step 20\)\.", job.stdout), said
    at = 20
    first = [[r for r in read_taps(out, f"tap-0-{rank}.jsonl") if r["step"] < at] for rank in range(2)]
    again = [read_taps(out, f"tap-1-{rank}.jsonl") for rank in range(2)]
    assert [r["step"] for r in again[0]] == [r["step"] for r in again[1]] == list(range(at, 64))
    assert exactly_once(*first, *again)
    assert not groups(first[0] + again[0]) & groups(first[1] + again[1])

    plain_backup = tmp_path / "plain-backup"
    os.makedirs(plain_backup, mode=0o700)
    shutil.copy2(backup / "meshfit_checkpoints.json", plain_backup)
    shutil.copytree(backup / str(at), plain_backup / str(at))
    plain = run([sys.executable, WORKER, str(big_shards), str(tmp_path / "plain"), str(plain_backup)], timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert f"(step {at})." in plain.stdout
    alone = read_taps(tmp_path / "plain", "tap-plain-0.jsonl")
    assert [r["step"] for r in alone] == list(range(at, 64))
    assert exactly_once(*first, alone)


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_an_elastic_restart_onto_one_process_takes_every_row_once(big_shards, tmp_path, tier):
    """--min-nprocs 1: rank 1 is SIGKILLed after step 23 (once the snapshot or backup of step 20 is complete)
    and fails its restart; one process resumes from step 20 — the launcher's memory snapshot (every 5 steps,
    no disk backup after step 0) or the disk backup (every 10) — and takes the rest of the epoch (both lanes
    of the 2-process layout), every id exactly once."""
    out = tmp_path / "out"
    frequencies = ["--save-freq", "1000", "--memory-freq", "5"] if tier == "memory" else ["--save-freq", "10"]
    job = run(
        LAUNCH
        + ["--nprocs", "2", "--min-nprocs", "1", "--max-restarts", "2", "--stop-grace", "1"]
        + [WORKER, str(big_shards), str(out), str(tmp_path / "backup"), *frequencies]
        + ["--die-at-step", "23", "--rank1-fails-to-restart"],
        timeout=300,
    )
    said = job.stdout[-3000:] + job.stderr[-3000:]
    assert job.returncode == 0, said
    assert "restarting the job with 1 process(es)" in job.stderr, said
    if tier == "memory":
        assert re.search(r"resumed from the launcher's memory snapshot of a 2-process job .*\(step 20\)", said), said
    else:
        assert re.search(r"BackupAndRestore: resumed from \S+ at .* \(step 20\)\.", said), said
    first = [[r for r in read_taps(out, f"tap-0-{rank}.jsonl") if r["step"] < 20] for rank in range(2)]
    attempts = sorted(name for name in os.listdir(out) if name.startswith("tap-") and not name.startswith("tap-0-"))
    last = attempts[-1]
    assert last.endswith("-0.jsonl")
    alone = read_taps(out, last)
    assert [r["step"] for r in alone] == list(range(20, 64))
    assert exactly_once(*first, alone)


@pytest.mark.processes
def test_a_global_batch_two_processes_cannot_split_is_refused_before_any_step_and_not_restarted(big_shards, tmp_path):
    job = run(
        LAUNCH
        + ["--nprocs", "2", "--max-restarts", "2"]
        + [WORKER, str(big_shards), str(tmp_path / "out"), str(tmp_path / "backup"), "--batch-size", "63"],
        timeout=300,
    )
    said = job.stdout[-3000:] + job.stderr[-3000:]
    assert job.returncode != 0, said
    assert "split evenly over 2 processes: it must be a multiple of 2. Received: batch_size=63" in said, said
    assert "not restarting" in job.stderr and "restarting the job" not in job.stderr, said
    assert not any(read_taps(tmp_path / "out", p.name) for p in (tmp_path / "out").glob("tap-*")), said  # no batch


@pytest.mark.slow
@pytest.mark.processes
def test_the_digits_parquet_example_trains_from_its_shards_on_two_processes(tmp_path):
    example = os.path.join(EXAMPLES, "digits_parquet.py")
    job = run(
        LAUNCH + ["--nprocs", "2", "--devices-per-proc", "2", example, "--epochs", "2", "--shards", str(tmp_path)],
        timeout=300,
    )
    said = job.stdout[-3000:] + job.stderr[-3000:]
    assert job.returncode == 0, said
    assert sorted(os.listdir(tmp_path)) == [f"part-{i:02d}.parquet" for i in range(8)]
    accuracy = re.search(r"test accuracy: ([0-9.]+) on 2 processes, from Parquet", job.stdout)
    assert accuracy and float(accuracy.group(1)) > 0.5, said
