"""The persistent compilation cache: where it goes, whose choice wins, and a restarted process that loads it."""

import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MLP, classification_data
from processes import run, without_suite_cache

import meshfit as mf
from meshfit import compilation_cache


@pytest.fixture(autouse=True)
def without_the_suite_cache():
    """These tests start where a user's process does: no cache chosen (the suite's own, tests/conftest.py, is set
    aside and put back)."""
    suite = compilation_cache.directory()
    if suite is not None:
        compilation_cache.jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", None)
    yield
    if suite is not None:
        compilation_cache.jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", suite)


def compiled_files(directory):
    return [name for name in os.listdir(directory) if not name.startswith(".")] if os.path.isdir(directory) else []


def fit_with_backup(backup, **kwargs):
    x, y = classification_data()
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[mf.callbacks.BackupAndRestore(backup, **kwargs)])
    return model


def test_use_keeps_every_program_compiled_after_it_and_release_stops(tmp_path):
    cache = compilation_cache.use(tmp_path / "cache")
    assert compilation_cache.directory() == cache == str(tmp_path / "cache")
    jax.jit(lambda a: jnp.sin(a) * 3.25)(np.ones(7, np.float32)).block_until_ready()  # compiles in ms: still kept
    assert compiled_files(cache)
    compilation_cache.release(cache)
    assert compilation_cache.directory() is None


def test_a_symlink_in_the_cache_s_place_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "cache").symlink_to(target)
    with pytest.raises(ValueError, match="symlink"):
        compilation_cache.use(tmp_path / "cache")
    assert compilation_cache.directory() is None
    with pytest.warns(UserWarning, match="No persistent compilation cache"):
        assert compilation_cache.default_to(tmp_path / "cache") is None
    assert os.listdir(target) == []


def test_backup_and_restore_caches_in_the_backup_directory_and_deletes_it_with_the_backups(tmp_path):
    kept = tmp_path / "kept"
    fit_with_backup(kept, delete_checkpoint=False)
    assert compiled_files(kept / compilation_cache.BACKUP_CACHE_NAME)  # the train step, at least
    assert compilation_cache.directory() is None  # off when the fit ends: later programs are not written there
    before = sorted(compiled_files(kept / compilation_cache.BACKUP_CACHE_NAME))
    jax.jit(lambda a: a * 2.5)(np.ones(3, np.float32)).block_until_ready()
    assert sorted(compiled_files(kept / compilation_cache.BACKUP_CACHE_NAME)) == before

    deleted = tmp_path / "deleted"
    compilation_cache.use(tmp_path / "chosen-by-meshfit-before")  # a choice of meshfit's own is replaced
    fit_with_backup(deleted)
    assert not deleted.exists()  # backups and cache gone, the directory with them
    assert compilation_cache.directory() is None  # nothing would make the directory again
    jax.jit(lambda a: a + 1.5)(np.ones(3, np.float32)).block_until_ready()
    assert not deleted.exists()


def test_a_cache_the_user_chose_is_kept(tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    try:
        fit_with_backup(tmp_path / "backup", delete_checkpoint=False)
        assert compilation_cache.directory() == str(tmp_path / "mine")
        assert not (tmp_path / "backup" / compilation_cache.BACKUP_CACHE_NAME).exists()
    finally:
        compilation_cache.jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", None)


def test_compilation_cache_false_leaves_jax_alone(tmp_path):
    fit_with_backup(tmp_path / "backup", delete_checkpoint=False, compilation_cache=False)
    assert compilation_cache.directory() is None
    assert not (tmp_path / "backup" / compilation_cache.BACKUP_CACHE_NAME).exists()


RESTART = textwrap.dedent(
    """
    import sys
    import jax
    from helpers import MLP, classification_data
    import meshfit as mf

    hit, loaded, compiled = [False], [], []  # JAX reports a cache hit just before that program's compile time
    def on_event(event, **kwargs):
        hit[0] = hit[0] or event == "/jax/compilation_cache/cache_hits"
    def on_duration(event, seconds, fun_name="", **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            (loaded if hit[0] else compiled).append(fun_name)
            hit[0] = False
    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    x, y = classification_data()
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    del loaded[:], compiled[:]  # before fit, the cache is not on yet
    backup = mf.callbacks.BackupAndRestore(sys.argv[1], delete_checkpoint=False)
    model.fit(x, y, batch_size=16, epochs=int(sys.argv[2]), verbose=0, callbacks=[backup])
    print("loaded", *loaded)
    print("compiled", *compiled)
    """
)


@pytest.mark.slow  # two Python processes
def test_a_restarted_process_loads_the_train_step_from_the_cache(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    env = without_suite_cache(
        {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    )
    runs = []
    for epochs in (1, 2):  # the second resumes after the first's last backup and trains epoch 2
        job = run([sys.executable, "-c", RESTART, str(tmp_path / "backup"), str(epochs)], timeout=120, env=env)
        assert job.returncode == 0, job.stderr[-3000:]
        lines = dict(line.split(" ", 1) if " " in line else (line, "") for line in job.stdout.splitlines())
        runs.append({kind: lines[kind].split() for kind in ("loaded", "compiled")})
    first, resumed = runs
    train_step = [name for name in first["compiled"] if "train_step" in name]
    assert train_step and not first["loaded"], first
    assert set(train_step) <= set(resumed["loaded"]) and not set(train_step) & set(resumed["compiled"]), resumed
