"""Shared test setup: 8 simulated CPU devices, set once before JAX starts."""

import os

# The programs compiled here are tiny and each runs a few steps: LLVM's optimization of them costs more CPU than
# it saves (a third of the time of the training-heavy modules), and meshfit's behaviour does not depend on it.
# Inherited by the processes the tests start; benchmarks and users keep XLA's default.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Full float32 matmuls where a backend would round them (TF32 on NVIDIA GPUs): the tests compare
# numbers against references to float32 tolerance. Inherited by the processes the tests start.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# One persistent compilation cache for the run, shared by the xdist workers (they inherit this environment) and
# every process the tests start: each program is still compiled for real once a run, and the many processes that
# compile the same small programs (the ranks of a job, a resumed run, the next test's job) load it. Every program
# is kept, as meshfit's own cache does. Tests of the cache itself run without it (`processes.without_suite_cache`).
SUITE_CACHE = "JAX_COMPILATION_CACHE_DIR"
if SUITE_CACHE not in os.environ:
    import tempfile

    os.environ[SUITE_CACHE] = tempfile.mkdtemp(prefix="meshfit-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["MESHFIT_TESTS_OWN_CACHE"] = os.environ[SUITE_CACHE]  # removed by the process that made it

import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _compilation_cache_released():
    """A fit whose backups were kept leaves JAX caching in them (as a user's process would); tests start without."""
    yield
    cache = sys.modules.get("meshfit.compilation_cache")
    if cache is not None and cache.directory() is not None:
        cache.release(cache.directory())


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): a worker per core and one more. A tenth of a run on 2 cores is spent
    waiting on the processes the tests start (a Ray cluster's start, a heartbeat timeout, a grace period); the
    extra worker runs another test meanwhile. `PYTEST_XDIST_AUTO_NUM_WORKERS` still decides when set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return len(os.sched_getaffinity(0)) + 1


def pytest_unconfigure(config):
    made = os.environ.get("MESHFIT_TESTS_OWN_CACHE")
    if made and not hasattr(config, "workerinput"):  # the main process, after its workers are gone
        import shutil

        shutil.rmtree(made, ignore_errors=True)


#: Test modules whose tests share a module- or session-scoped fixture (a started job, a compiled model), by the
#: group they run in: under `--dist loadgroup` a group runs on one worker, so its fixtures start once; every
#: other test goes to whichever worker is free. The Ray modules share a group: a test there finds "the cluster
#: running on this machine", which another module's cluster on the other worker would make ambiguous.
GROUPS = {
    "tests/callbacks/test_backup_and_restore.py": "backup_and_restore",
    "tests/launch/test_launch.py": "launch",
    "tests/launch/test_launch_ray.py": "ray",
    "tests/strategies/parameter_server/test_ray.py": "ray",
    "tests/data/test_ray_data.py": "ray",
    "tests/strategies/parameter_server/test_processes.py": "parameter_server_processes",
    "tests/pipeline/test_stages.py": "pipeline",
    "tests/strategies/test_data_parallel.py": "data_parallel",
    # Both read the session's `two_process_job` (tests/strategies/conftest.py): one worker runs it once.
    "tests/strategies/test_mesh.py": "two_process_job",
    "tests/strategies/test_mirrored.py": "mirrored",
    "tests/strategies/test_multi_worker_mirrored.py": "two_process_job",
    "tests/test_examples_transformer.py": "examples_transformer",
    "tests/test_losses.py": "losses",
    "tests/test_metrics.py": "metrics",
    "tests/test_transformer_options.py": "transformer_options",
}


#: The audit events of starting a process: a test that causes one (itself, or a fixture it starts) belongs to the
#: `processes` tier, which the README's test command leaves to CI.
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.system", "os.exec"})
_running: list = []  # the test item whose setup or call runs now, if any


def _audit(event, args):
    if event in PROCESS_EVENTS and _running and _running[-1] is not None:
        _running[-1].user_properties.append(("started_process", event))


sys.addaudithook(_audit)


def _watching(item):
    """A hook wrapper's body: while the wrapped phase of `item` runs, the processes it starts are noted on it."""
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_watching)  # fixtures that start a job count for the test
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_watching)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that started a process without the `processes` mark fails, naming the mark: the tiers stay true."""
    report = yield
    started = [event for name, event in item.user_properties if name == "started_process"]
    if call.when == "call" and started and item.get_closest_marker("processes") is None:
        record = os.environ.get("MESHFIT_TESTS_RECORD_PROCESSES")
        if record:
            with open(record, "a") as f:
                f.write(f"{item.nodeid}\n")
        elif report.passed:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} started a process ({started[0]}) but is not marked `processes`. "
                "Mark it @pytest.mark.processes (or its module: pytestmark), so the README's tier stays in-process."
            )
    return report


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = GROUPS.get(item.nodeid.split("::")[0])
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
