"""The persistent compilation cache: where it goes, whose choice wins, and a restarted process that loads it."""

import glob
import os
import shutil
import signal
import socket
import stat
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import MLP, classification_data
from processes import run, without_suite_cache

import meshfit as mf
from meshfit import compilation_cache
from meshfit.checkpointing.trusted_dirs import UntrustedDirectory


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
    compilation_cache.default_to(tmp_path / "chosen-by-meshfit-before")  # a default of meshfit's is replaced
    fit_with_backup(deleted)
    assert not deleted.exists()  # backups and cache gone, the directory with them
    assert compilation_cache.directory() is None  # nothing would make the directory again
    jax.jit(lambda a: a + 1.5)(np.ones(3, np.float32)).block_until_ready()
    assert not deleted.exists()


def test_a_cache_chosen_with_use_is_kept_by_backup_and_restore(tmp_path):
    mine = compilation_cache.use(tmp_path / "mine")
    fit_with_backup(tmp_path / "backup", delete_checkpoint=False)
    assert compilation_cache.directory() == mine
    assert compiled_files(mine)  # the fit's programs, there
    assert not (tmp_path / "backup" / compilation_cache.BACKUP_CACHE_NAME).exists()


def test_the_launchs_own_cache_gives_way_to_the_backups_cache(tmp_path, monkeypatch):
    """`meshfit launch` turns on a cache of its own for the ranks (JAX's variable, at import); it lives as long
    as the launch, so BackupAndRestore's cache in the backups, which outlives it, takes its place for the fit."""
    launch = compilation_cache.use(tmp_path / "launch")
    compilation_cache.release(launch)
    jax.config.update("jax_compilation_cache_dir", launch)  # as JAX_COMPILATION_CACHE_DIR does at import
    monkeypatch.setenv(compilation_cache.ENV_LAUNCH_CACHE, launch)
    try:
        fit_with_backup(tmp_path / "backup", delete_checkpoint=False)
        assert compiled_files(tmp_path / "backup" / compilation_cache.BACKUP_CACHE_NAME)
    finally:
        compilation_cache.jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", None)


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
@pytest.mark.processes
def test_a_restarted_process_loads_its_programs_from_the_cache(tmp_path):
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
    # The restore's own programs (the check of what it read) come from the cache too: it is on before the restore.
    checks = {name for name in first["compiled"] if "snapshot" in name or "report" in name}
    assert checks and not checks & set(resumed["compiled"]), (first, resumed)


# -- what meshfit trusts: a cache of the user's alone, and only regular files of theirs in it -----------------


def test_use_makes_the_cache_0700_and_refuses_one_others_can_write_to(tmp_path):
    cache = compilation_cache.use(tmp_path / "new")
    assert os.stat(cache).st_mode & 0o777 == 0o700
    compilation_cache.release(cache)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UntrustedDirectory, match=r"others can write to it \(mode 0777\)"):
        compilation_cache.use(shared)
    assert compilation_cache.directory() is None
    with pytest.warns(UserWarning, match="No persistent compilation cache .* others can write"):
        assert compilation_cache.default_to(shared) is None
    assert os.listdir(shared) == []


@pytest.fixture
def alarm():
    """Fails a test that blocks (an entry opened that a FIFO makes wait for ever) instead of hanging the suite."""

    def blocked(signum, frame):
        raise TimeoutError("blocked for 30 s: an entry of the cache was opened")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.skipif(os.geteuid() != 0, reason="a foreign file needs chown (root)")
def test_entries_jax_must_not_read_are_moved_aside_unopened_and_the_user_s_files_stay(tmp_path, alarm):
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir(mode=0o700)
    outside.write_bytes(b"precious")
    (cache / "mine-cache").write_bytes(b"compiled by me")
    os.mkfifo(cache / "fifo-cache")
    (cache / "link-cache").symlink_to(outside)
    (cache / "dir-cache").mkdir()
    (cache / "foreign-cache").write_bytes(b"another program")
    os.chown(cache / "foreign-cache", 65534, 65534)
    os.link(outside, cache / "hardlink-cache")
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(cache / "socket-cache"))
    planted = {"fifo-cache", "link-cache", "dir-cache", "foreign-cache", "hardlink-cache", "socket-cache"}
    with pytest.warns(UserWarning, match="moved 6 entries JAX must not load"):
        compilation_cache.use(cache)
    listening.close()
    (folder,) = [name for name in os.listdir(cache) if name.startswith(compilation_cache.QUARANTINE_PREFIX)]
    assert set(os.listdir(cache)) == {"mine-cache", folder}
    assert set(os.listdir(cache / folder)) == planted and os.stat(cache / folder).st_mode & 0o777 == 0o700
    assert stat.S_ISFIFO(os.lstat(cache / folder / "fifo-cache").st_mode)  # moved, not opened nor replaced
    assert outside.read_bytes() == b"precious" and (cache / "mine-cache").read_bytes() == b"compiled by me"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compilation_cache.use(cache)  # nothing more to move; the quarantine folder stays as it is
    assert set(os.listdir(cache / folder)) == planted
    compilation_cache.release(str(cache))
    assert compilation_cache.remove(cache) == [folder]  # deleting the cache keeps what was moved aside
    assert os.listdir(cache) == [folder]


def test_a_cache_the_user_configured_is_kept_with_one_warning_if_others_can_write_to_it(tmp_path):
    theirs = tmp_path / "team-cache"
    theirs.mkdir()
    os.chmod(theirs, 0o775)
    jax.config.update("jax_compilation_cache_dir", str(theirs))
    try:
        with pytest.warns(UserWarning, match=r"you configured, .* is not yours alone \(others can write"):
            assert compilation_cache.default_to(tmp_path / "backup-cache") == str(theirs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert compilation_cache.default_to(tmp_path / "backup-cache") == str(theirs)  # once
    finally:
        compilation_cache.jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", None)
    assert not (tmp_path / "backup-cache").exists()


def _fit(backup, learning_rate, epochs):
    """A fit with BackupAndRestore keeping its backups and cache; the last epoch's loss. JAX's in-memory caches
    are emptied after it, so the next fit's programs come from the persistent cache or a new compile."""
    x, y = classification_data(n=64)
    model = mf.Model(MLP(), seed=7)
    model.compile(optimizer=optax.sgd(learning_rate), loss="sparse_categorical_crossentropy")
    backup = mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False)
    try:
        return model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=[backup]).history["loss"][-1]
    finally:
        jax.clear_caches()


def _plant_programs(victim, source, owner=None):
    """Copies each program compiled into `source`'s cache over the entry of the same function in `victim`'s:
    the resumed job would load `source`'s program for its own."""
    caches = [os.path.join(d, compilation_cache.BACKUP_CACHE_NAME) for d in (victim, source)]
    named = [{n.rsplit("-", 2)[0]: n for n in compiled_files(c)} for c in caches]
    for function, entry in named[0].items():
        if function in named[1]:
            shutil.copyfile(os.path.join(caches[1], named[1][function]), os.path.join(caches[0], entry))
            if owner is not None:
                os.chown(os.path.join(caches[0], entry), owner, owner)


@pytest.mark.slow  # seven small fits
@pytest.mark.skipif(os.geteuid() != 0, reason="another user's files need chown (root)")
def test_a_program_planted_in_the_cache_by_another_user_never_runs(tmp_path):
    """The train step of a fit with another learning rate, planted under the names of a backup's cached
    programs: with the files the user's own the job runs it (the attack is real); planted by another user in a
    directory of the user's, they are moved aside and the loss is the undisturbed one; in a directory others
    own and can write to, the job is refused before any step and nothing there changes."""
    for name in ("undisturbed", "mine", "theirs", "open", "source"):
        _fit(tmp_path / name, 0.5 if name == "source" else 0.1, 1)
    undisturbed = _fit(tmp_path / "undisturbed", 0.1, 2)

    _plant_programs(tmp_path / "mine", tmp_path / "source")  # written as the user: trusted, as any file of theirs
    assert _fit(tmp_path / "mine", 0.1, 2) != undisturbed

    _plant_programs(tmp_path / "theirs", tmp_path / "source", owner=65534)
    with pytest.warns(UserWarning, match="JAX must not load"):
        assert _fit(tmp_path / "theirs", 0.1, 2) == undisturbed

    opened = tmp_path / "open"
    _plant_programs(opened, tmp_path / "source", owner=65534)
    for path in (opened, opened / compilation_cache.BACKUP_CACHE_NAME):
        os.chown(path, 65534, 65534)
        os.chmod(path, 0o777)
    before = {p: os.lstat(p) for p in glob.glob(f"{opened}/**", recursive=True)}
    with pytest.raises(UntrustedDirectory, match=r"uid 65534 \(nobody\), not to you"):
        _fit(opened, 0.1, 2)
    assert {p: os.lstat(p) for p in glob.glob(f"{opened}/**", recursive=True)} == before


FIFO_FIT = textwrap.dedent(
    """
    import sys
    from helpers import MLP, classification_data
    import meshfit as mf
    x, y = classification_data(n=64)
    model = mf.Model(MLP())
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")  # as fit_with_backup
    backup = mf.callbacks.BackupAndRestore(sys.argv[1], delete_checkpoint=False)
    print("loss", model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[backup]).history["loss"][-1])
    """
)


@pytest.mark.slow  # a fit, then one in a new process
@pytest.mark.processes
def test_a_fifo_at_a_cached_program_s_name_does_not_hang_the_fit(tmp_path):
    """JAX would block reading a FIFO at the name of the program it looks up; the new process moves it aside."""
    backup = tmp_path / "backup"
    fit_with_backup(backup, delete_checkpoint=False)
    cache = backup / compilation_cache.BACKUP_CACHE_NAME
    (step,) = [name for name in compiled_files(cache) if "train_step" in name]
    os.remove(cache / step)
    os.mkfifo(cache / step)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = without_suite_cache({**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    done = run([sys.executable, "-c", FIFO_FIT, str(backup)], timeout=120, env=env)
    assert done.returncode == 0 and "loss" in done.stdout, done.stderr[-2000:]
    (folder,) = [name for name in os.listdir(cache) if name.startswith(compilation_cache.QUARANTINE_PREFIX)]
    assert stat.S_ISFIFO(os.lstat(cache / folder / step).st_mode)
