"""The launch's fork server (`meshfit.launch.fork_server`): real forks of a real server, its failures included."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from meshfit.launch.fork_server import ForkServer, forkable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from processes import LAUNCH, Job  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.processes]  # a server imports JAX, Flax, Optax, Orbax and meshfit

ENV = dict(os.environ, JAX_PLATFORMS="cpu", MESHFIT_PROCESS_ID="0", PYTHONUNBUFFERED="1")
ENV.pop("XLA_FLAGS", None)


@pytest.fixture(scope="module")
def server():
    forks = ForkServer(ENV, learn_imports=True)
    yield forks
    forks.close()


def _finish(proc) -> str:
    out = proc.stdout.read()
    proc.wait(timeout=120)
    return out


def test_a_rank_runs_its_script_as_python_would_with_its_own_environment_and_devices(server, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "import jax, numpy as np\n"
        "print('argv', sys.argv, 'path0', sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n"
        "print('name', __name__, 'rank', os.environ['MESHFIT_PROCESS_ID'], 'left out', os.environ.get('LEFT_OUT'))\n"
        "print('devices', len(jax.devices()), 'random', np.random.rand())\n"
        "sys.exit(int(os.environ['MESHFIT_PROCESS_ID']) + 3)\n"
    )
    procs = [
        server.start(
            {**ENV, "MESHFIT_PROCESS_ID": str(rank), "XLA_FLAGS": f"--xla_force_host_platform_device_count={rank + 1}"},
            [str(script), "--flag"],
            rank=rank,
        )
        for rank in (0, 1)
    ]
    assert all(proc is not None for proc in procs), server.why
    outs = [_finish(proc) for proc in procs]
    assert [proc.returncode for proc in procs] == [3, 4], outs
    randoms = set()
    for rank, out in enumerate(outs):
        lines = out.splitlines()
        assert lines[:2] == [f"argv ['{script}', '--flag'] path0 True", f"name __main__ rank {rank} left out None"]
        devices, random = lines[2].split(" random ")
        assert devices == f"devices {rank + 1}", out  # its own XLA_FLAGS, read after the fork
        randoms.add(random)
    assert len(randoms) == 2  # numpy's global random state is its own, as in a new process
    assert all(os.getppid() != proc.pid for proc in procs)


def test_a_killed_rank_reports_its_signal_and_is_never_signalled_once_gone(server, tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    proc = server.start(ENV, [str(script)])
    assert proc is not None and proc.stdout.readline() == "up\n"
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.send_signal(signal.SIGTERM)  # its pidfd is closed: nothing is signalled, nothing raises


def test_what_a_rank_imported_is_imported_for_the_next_start(server, tmp_path):
    first = tmp_path / "first.py"
    first.write_text("import wave\nfrom meshfit.runtime import start_phases\nstart_phases.first_step()\n")
    proc = server.start(ENV, [str(first)], rank=0)
    assert proc is not None
    _finish(proc)
    assert proc.returncode == 0
    deadline = time.monotonic() + 30
    while os.path.exists(server.imports_report):  # written at its first step; taken (then imported) by the server
        assert time.monotonic() < deadline, "the server did not take rank 0's list of imports"
        time.sleep(0.05)
    second = tmp_path / "second.py"
    second.write_text("import sys\nprint('imported before the script:', 'wave' in sys.modules)\n")
    proc = server.start(ENV, [str(second)], rank=1)
    assert proc is not None
    assert _finish(proc).strip() == "imported before the script: True"


def test_a_rank_whose_environment_differs_beyond_what_is_read_after_the_imports_is_not_forked(server):
    assert server.start({**ENV, "JAX_ENABLE_X64": "1"}, ["job.py"]) is None  # read when JAX is imported
    assert "JAX_ENABLE_X64" in server.why
    assert server.start(ENV, ["-c", "1"]) is None


@pytest.mark.parametrize(
    ("command", "expected"), [(["job.py", "-x"], True), (["-m", "pkg.job"], True), (["-c", "1"], False), ([], False)]
)
def test_scripts_and_modules_are_forked_only(command, expected):
    assert forkable(command) is expected


def test_the_ranks_die_with_a_killed_server_and_the_next_are_not_forked(tmp_path):
    forks = ForkServer(ENV)
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    try:
        proc = forks.start(ENV, [str(script)])
        assert proc is not None and proc.stdout.readline() == "up\n"
        os.kill(forks.proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while True:  # the kernel's parent-death signal: the rank itself is gone, not only reported so
            try:
                os.kill(proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the rank outlived its fork server"
            time.sleep(0.05)
        assert forks.start(ENV, [str(script)]) is None
    finally:
        forks.close()


def test_a_launch_whose_fork_server_is_killed_restarts_its_ranks_as_new_processes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, time\n"
        "print('start', os.environ['MESHFIT_RESTART_COUNT'], 'rank', os.environ['MESHFIT_PROCESS_ID'], flush=True)\n"
        "if os.environ['MESHFIT_RESTART_COUNT'] == '0':\n"
        "    time.sleep(60)\n"
    )
    with Job(LAUNCH + ["--nprocs", "2", "--max-restarts", "1", "--verbose", str(script)], timeout=120) as job:
        job.wait_for(r"\[rank \d\] start 0 rank \d", count=2)
        (server,) = [pid for pid in _launcher_children(job.proc.pid) if b"fork_server_process" in _cmdline(pid)]
        os.kill(server, signal.SIGKILL)
        assert job.finish(timeout=90) == 0, job.stderr[-2000:]
    assert re.search(r"^\[rank 0\] start 1 rank 0$", job.stdout, re.M), job.stdout[-2000:]
    assert "[launch] rank 0 starts as a new process: the fork server ended." in job.stderr, job.stderr[-2000:]


def _launcher_children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()
