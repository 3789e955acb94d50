"""Checkpoint directories: a different model is refused with nothing touched, damage is told from
mismatch, altered bytes are caught, markers that are broken or missing give errors that say what to do.

Each fault is injected for real: files Orbax wrote are rewritten, truncated or removed.
"""

import hashlib
import os
import shutil
import stat
import warnings

import jax
import numpy as np
import optax
import pytest
from helpers import MLP, classification_data

import meshfit as mf
from meshfit.checkpointing import safe_files
from meshfit.checkpointing.checkpoint import MARKER, CheckpointDamaged, CheckpointDir, CheckpointMismatch, write_marker


def snapshot(directory) -> dict[str, str]:
    """Every file under `directory` (names and contents' hashes): compared before and after an operation."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return found


def trained(hidden=16, optimizer="adam", epochs=1):
    x, y = classification_data(n=64)
    model = mf.Model(MLP(hidden=hidden), seed=1)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0)
    return model


def largest_data_file(step_dir) -> str:
    files = [
        os.path.join(root, f)
        for root, _, names in os.walk(os.path.join(step_dir, "state"))
        for f in names
        if os.sep + "d" + os.sep in os.path.join(root, f)
    ]
    return max(files, key=os.path.getsize)


def flip_bytes(path, count=8) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        data = f.read(count)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def test_load_model_into_a_different_architecture_is_a_mismatch_and_touches_nothing(tmp_path):
    trained(hidden=16).save(tmp_path / "m")
    before = snapshot(tmp_path / "m")
    with pytest.raises(ValueError, match=r"does not match the model loading it") as caught:
        mf.load_model(tmp_path / "m", MLP(hidden=32))
    message = str(caught.value)
    assert isinstance(caught.value, CheckpointMismatch)
    assert "params/hidden/kernel: saved (4, 16) float32, expected (4, 32) float32" in message
    assert message.index("params/hidden") < message.index("opt_state")  # weights named first
    assert "Nothing on disk was changed" in message and len(message) < 1200  # a short list, no spec dumps
    assert snapshot(tmp_path / "m") == before  # byte for byte
    assert mf.load_model(tmp_path / "m", MLP(hidden=16)).count_params() > 0  # the right module still loads


def test_load_model_with_another_optimizer_is_a_mismatch_and_touches_nothing(tmp_path):
    trained(optimizer="adam").save(tmp_path / "m")
    before = snapshot(tmp_path / "m")
    with pytest.raises(CheckpointMismatch, match="opt_state"):
        mf.load_model(tmp_path / "m", MLP(), optimizer="sgd")
    assert snapshot(tmp_path / "m") == before


def test_load_weights_of_another_shape_is_a_mismatch_and_touches_nothing(tmp_path):
    trained(hidden=16).save_weights(tmp_path / "w")
    before = snapshot(tmp_path / "w")
    other = mf.Model(MLP(hidden=8))
    with pytest.raises(CheckpointMismatch, match=r"params/out/kernel: saved \(16, 3\) float32, expected \(8, 3\)"):
        other.load_weights(tmp_path / "w")
    assert snapshot(tmp_path / "w") == before


def restore_outcome(directory, state) -> str:
    """Restores the newest checkpoint read-only: "same", "fingerprint", "unreadable" or "SILENTLY ALTERED"."""
    ckpt = CheckpointDir(directory, "backup", read_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = ckpt.restore_latest(state)
    finally:
        ckpt.close()
    messages = " ".join(str(w.message) for w in caught)
    if found is None:
        return "fingerprint" if "fingerprint mismatch" in messages else "unreadable"
    same = all(np.array_equal(a, np.asarray(b)) for a, b in zip(state.values(), found[1].values(), strict=True))
    return "same" if same and not messages else "SILENTLY ALTERED"


def test_flipped_bytes_in_any_data_file_are_never_restored_silently(tmp_path):
    """8 bytes flipped in each data file Orbax wrote, one file at a time: each restore is exact or refused."""
    rng = np.random.default_rng(0)
    state = {"kernel": rng.standard_normal((64, 256)).astype(np.float32), "step": np.int32(7)}
    ckpt = CheckpointDir(tmp_path / "b", "backup")  # asynchronous, as BackupAndRestore writes
    ckpt.save(1, state, {})
    ckpt.close()
    files = [
        os.path.relpath(os.path.join(root, name), tmp_path / "b")
        for root, _, names in os.walk(tmp_path / "b" / "1")
        for name in names
        if os.sep + "d" + os.sep in os.path.join(root, name)
    ]
    outcomes = {}
    for name in files:
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(tmp_path / "b", copy)
        flip_bytes(copy / name)
        outcomes[name] = restore_outcome(copy, state)
    assert "SILENTLY ALTERED" not in outcomes.values(), outcomes
    assert "fingerprint" in outcomes.values(), outcomes  # bytes the format itself does not check


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_an_altered_model_file_is_refused_and_left_in_place(tmp_path):
    trained(hidden=64).save(tmp_path / "m")
    data = [
        os.path.join(root, f)
        for root, _, names in os.walk(tmp_path / "m" / "0" / "state")
        for f in names
        if os.sep + "d" + os.sep in os.path.join(root, f)
    ]
    for path in data:
        flip_bytes(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(FileNotFoundError, match="holds no readable saved model"):
            mf.load_model(tmp_path / "m", MLP(hidden=64))
    assert any(str(tmp_path / "m" / "0") in str(w.message) for w in caught)
    assert sorted(os.listdir(tmp_path / "m")) == ["0", MARKER]  # a reader moves nothing


@pytest.mark.slow  # trains or compiles for seconds: the full suite, not the fast tier
def test_fingerprints_verify_under_another_layout(tmp_path):
    """Saved from 8 devices (replicated), loaded on one and onto an FSDP mesh: fingerprints still match."""
    with mf.strategies.MirroredStrategy().scope():
        model = trained(hidden=64)
    model.save(tmp_path / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fingerprint mismatch would warn
        with mf.strategies.MeshStrategy(axes={"data": 2, "fsdp": 4}, min_shard_size=16).scope():
            sharded = mf.load_model(tmp_path / "m", MLP(hidden=64))
    assert "fsdp" in str(sharded.params["hidden"]["kernel"].sharding.spec)
    for a, b in zip(model.get_weights(), sharded.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_damaged_content_is_damage_not_mismatch(tmp_path):
    trained().save(tmp_path / "m")
    metadata = tmp_path / "m" / "0" / "state" / "_METADATA"
    metadata.write_bytes(b"\x00garbage")
    ckpt = CheckpointDir(tmp_path / "m", "model", read_only=True)
    try:
        with pytest.raises(CheckpointDamaged, match="array metadata cannot be read"):
            ckpt.restore(0, {"weights": {"params": trained().params}}, partial=True)
    finally:
        ckpt.close()


def garble_marker(directory):
    (directory / MARKER).write_bytes(b"\xff\xfe\x00 not json")


def delete_marker(directory):
    os.remove(directory / MARKER)


@pytest.mark.parametrize(
    "damage, error, says",
    [
        (garble_marker, ValueError, r"marker file .* is damaged .*rewrite the file as"),
        (
            delete_marker,
            FileNotFoundError,
            r"holds Orbax checkpoints but not meshfit's marker file .*recreate the marker",
        ),
    ],
)
def test_a_broken_or_missing_marker_says_what_is_wrong_and_what_to_do(tmp_path, damage, error, says):
    trained().save(tmp_path / "m")
    damage(tmp_path / "m")
    before = snapshot(tmp_path / "m")
    with pytest.raises(error, match=says):  # reading
        mf.load_model(tmp_path / "m", MLP())
    with pytest.raises(error, match=says):  # writing
        trained().save(tmp_path / "m", overwrite=True)
    assert snapshot(tmp_path / "m") == before


def test_loading_from_an_empty_directory_writes_nothing_there(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="No meshfit checkpoint"):
        mf.load_model(tmp_path / "empty", MLP())
    with pytest.raises(FileNotFoundError, match="No meshfit checkpoint"):
        mf.Model(MLP()).load_weights(tmp_path / "empty")
    assert os.listdir(tmp_path / "empty") == []


def test_a_custom_optimizer_state_still_loads_with_the_same_optimizer(tmp_path):
    model = mf.Model(MLP())
    model.compile(optimizer=optax.adamw(1e-3), loss="mse")
    model.save(tmp_path / "m")
    loaded = mf.load_model(tmp_path / "m", MLP(), optimizer=optax.adamw(1e-3))
    for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_remove_complete_keeps_what_was_moved_aside(tmp_path):
    ckpt = CheckpointDir(tmp_path / "b", "backup", async_save=False)
    state = {"w": np.arange(4.0, dtype=np.float32)}
    for step in (1, 2):
        ckpt.save(step, state, {})
    os.rename(tmp_path / "b" / "1", tmp_path / "b" / "1.unreadable")
    ckpt.close()
    assert ckpt.remove_complete() == ["1.unreadable"]
    assert sorted(os.listdir(tmp_path / "b")) == ["1.unreadable", MARKER]


def test_a_marker_temporary_planted_after_the_directory_was_checked_is_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    ckpt = CheckpointDir(tmp_path / "b", "backup", async_save=False)  # checked, locked, marked
    os.symlink(victim, tmp_path / "b" / f".{MARKER}.{os.getpid()}.tmp")
    os.unlink(tmp_path / "b" / MARKER)
    with pytest.raises(safe_files.PlantedFile, match=rf"\.{MARKER}\.{os.getpid()}\.tmp'"):
        write_marker(str(tmp_path / "b"), "backup")
    ckpt.close()
    assert victim.read_bytes() == b"precious"
    assert not os.path.lexists(tmp_path / "b" / MARKER)


@pytest.mark.slow
@pytest.mark.parametrize("umask", [0o002, 0o022], ids=["umask 002", "umask 022"])
def test_created_directories_are_0700_their_parents_0755_less_the_umask_and_none_is_world_writable(tmp_path, umask):
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="mse")
    previous = os.umask(umask)
    try:
        model.save(tmp_path / "new" / "model")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "model").st_mode) == 0o700  # its contents are trusted
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o755 & ~umask  # a missing parent
    modes = {
        os.path.join(root, name): os.stat(os.path.join(root, name)).st_mode
        for root, dirs, files in os.walk(tmp_path / "new")
        for name in dirs + files
    }
    assert len(modes) > 5 and not [path for path, mode in modes.items() if mode & stat.S_IWOTH]


def test_remove_complete_keeps_a_symlink_at_a_step_name_and_its_target(tmp_path):
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep.txt").write_text("precious")
    ckpt = CheckpointDir(tmp_path / "b", "backup", async_save=False)
    ckpt.save(1, {"w": np.arange(4.0, dtype=np.float32)}, {})
    os.symlink(tmp_path / "outside", tmp_path / "b" / "7")
    ckpt.close()
    assert ckpt.remove_complete() == ["7"]
    assert os.path.islink(tmp_path / "b" / "7") and os.listdir(tmp_path / "outside") == ["keep.txt"]


def test_a_background_save_writes_the_state_of_its_step_although_the_next_step_donated_it(tmp_path):
    import jax
    import jax.numpy as jnp

    state = {"w": jnp.arange(4096.0).reshape(64, 64), "count": jnp.array(7, jnp.int32)}
    expected = jax.tree.map(np.asarray, state)
    step = jax.jit(lambda tree: jax.tree.map(lambda x: x + 1, tree), donate_argnums=0)
    ckpt = CheckpointDir(tmp_path / "c", "checkpoint", async_save=True)
    try:
        ckpt.save(1, state, {"note": "one"})
        for _ in range(3):  # training goes on, overwriting the saved buffers where the backend donates them
            state = step(state)
        assert int(state["count"]) == 10
        ckpt.wait()
        template = jax.tree.map(jnp.zeros_like, state)
        restored, meta = ckpt.restore(1, template)  # also checks the fingerprints written with it
    finally:
        ckpt.close()
    assert meta["note"] == "one"
    np.testing.assert_array_equal(np.asarray(restored["w"]), expected["w"])
    assert int(restored["count"]) == 7


def test_a_restore_and_the_finiteness_check_reuse_the_program_the_background_saves_compiled(tmp_path):
    """A restarted job finds in its compilation cache only what the run before it compiled: the restore's
    fingerprints and the end-of-fit finiteness check come from the save's copy-and-report program, not from
    a second program for the same arrays (1.1-1.3 s each for the example transformer on the CPU)."""
    import jax.numpy as jnp

    from meshfit.checkpointing import integrity
    from meshfit.core.compat import compilations

    state = {"w": jnp.arange(37.0 * 29).reshape(37, 29), "n": jnp.array(3, jnp.int32)}  # shapes no other test uses
    state = jax.device_put(state, jax.devices()[0])  # placed, as a model's state is (and a restored one)
    alone_before, with_copy_before = compilations(integrity._device_report), compilations(integrity._device_snapshot)
    ckpt = CheckpointDir(tmp_path / "c", "checkpoint", async_save=True)
    try:
        ckpt.save(1, state, {}, wait=True)
        restored, _ = ckpt.restore(1, jax.tree.map(jnp.zeros_like, state))
        assert ckpt.non_finite(restored) == []
        assert ckpt.non_finite({**state, "w": state["w"].at[0, 0].set(jnp.nan)}) == ["w"]
    finally:
        ckpt.close()
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(state["w"]))
    assert compilations(integrity._device_report) == alone_before  # no second program
    assert compilations(integrity._device_snapshot) == with_copy_before + 1  # one, for saves, restores and checks


def test_a_failed_background_save_raises_at_the_next_save_wait_or_close_and_keeps_the_previous(tmp_path):
    import jax.numpy as jnp

    from meshfit.checkpointing.checkpoint import CheckpointWriteError

    state = {"w": jnp.ones((8, 8))}
    ckpt = CheckpointDir(tmp_path / "c", "checkpoint", async_save=True)
    try:
        ckpt.save(1, state, {}, wait=True)
        ckpt.save(2, state, {"bad": object()})  # Orbax cannot write this JSON part: it fails in the background
        with pytest.raises(CheckpointWriteError, match=r"steps: \[1\]"):
            ckpt.wait()
        ckpt.wait()  # raised once, not again
        ckpt.save(3, state, {"bad": object()})
        with pytest.raises(CheckpointWriteError):
            ckpt.save(4, state, {})  # the next save raises it, and is not started
        ckpt.save(5, state, {"bad": object()})
    finally:
        with pytest.raises(CheckpointWriteError):
            ckpt.close()  # close raises it too, and still releases the directory
    reopened = CheckpointDir(tmp_path / "c", "checkpoint", async_save=True)  # the lock was released
    try:
        assert reopened.steps() == [1]
        np.testing.assert_array_equal(np.asarray(reopened.restore(1, state)[0]["w"]), np.ones((8, 8)))
    finally:
        reopened.close()


@pytest.mark.slow
@pytest.mark.processes
def test_a_sigkill_during_a_background_save_leaves_the_previous_checkpoint_complete(tmp_path):
    import signal
    import sys
    import time

    import jax.numpy as jnp
    from processes import Job

    directory = tmp_path / "b"
    worker = os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers", "save_in_background.py")
    with Job([sys.executable, worker, str(directory)], timeout=120) as job:
        job.wait_for(r"started 3$")  # save 2 was complete before save 3 started
        time.sleep(0.05)  # inside save 3's (or 4's) background write
        job.kill()
    assert job.returncode == -signal.SIGKILL
    template = {"w": jnp.zeros((2048, 2048)), "b": jnp.zeros((2048,))}
    ckpt = CheckpointDir(directory, "backup")  # takes over the dead writer's lock
    try:
        steps = ckpt.steps()
        assert steps and max(steps) >= 2, steps
        for step in steps:  # every checkpoint listed is whole: all its values from its own save
            state, meta = ckpt.restore(step, template)
            assert meta["number"] == step
            assert {float(v) for v in np.unique(np.asarray(state["w"]))} == {step}
            assert {float(v) for v in np.unique(np.asarray(state["b"]))} == {step}
    finally:
        ckpt.close()


def test_a_rotated_out_checkpoint_leaves_the_listing_whole_before_it_is_deleted(tmp_path):
    """Deleting a directory tree is not atomic: a crash part-way used to leave a step directory that Orbax still
    listed as complete (seen in CI after a SIGKILL: step 1 with its state and no JSON part). Orbax now renames it
    into `.meshfit-deleted` first, which meshfit empties; what a crashed writer left there is deleted on open."""
    from meshfit.checkpointing.checkpoint import DELETED

    state = {"w": np.ones((8, 8), np.float32)}
    ckpt = CheckpointDir(tmp_path / "c", "backup", max_to_keep=1, async_save=False)
    try:
        ckpt.save(1, state, {}, wait=True)
        ckpt.save(2, state, {}, wait=True)  # rotates step 1 out
        assert ckpt.steps() == [2]
        assert not os.path.exists(tmp_path / "c" / "1") and os.listdir(tmp_path / "c" / DELETED) == []
    finally:
        ckpt.close()
    half_deleted = tmp_path / "c" / DELETED / "1" / "state"  # a crash in the middle of the delete
    half_deleted.mkdir(parents=True)
    (half_deleted / "part").write_bytes(b"x" * 100)
    reopened = CheckpointDir(tmp_path / "c", "backup", max_to_keep=1)
    try:
        assert reopened.steps() == [2]
        assert os.listdir(tmp_path / "c" / DELETED) == []
    finally:
        reopened.close()


def test_a_symlink_where_rotated_out_checkpoints_go_is_refused(tmp_path):
    from meshfit.checkpointing.checkpoint import DELETED

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"mine")
    directory = tmp_path / "c"
    directory.mkdir()
    os.symlink(outside, directory / DELETED)
    with pytest.raises(safe_files.PlantedFile, match=DELETED):
        CheckpointDir(directory, "backup")
    assert (outside / "keep").read_bytes() == b"mine"
