"""Warm spares (`meshfit.launch.spares`): real spare processes, handed a start or refused one."""

import os
import sys

import pytest

from meshfit.launch.spares import Spare, usable

pytestmark = pytest.mark.slow  # starts processes that import JAX


def test_a_spare_runs_the_script_it_is_handed_as_python_would(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "print('argv', sys.argv, 'path0', sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n"
        "print('name', __name__, 'env', os.environ['MESHFIT_PROCESS_ID'], os.environ.get('LEFT_OUT'))\n"
    )
    env = dict(os.environ, MESHFIT_PROCESS_ID="0", JAX_PLATFORMS="cpu")
    spare = Spare(env)
    proc = spare.take({**env, "MESHFIT_PROCESS_ID": "1"}, [str(script), "--flag"])
    assert proc is not None
    out = proc.stdout.read()  # (its stdin is closed: the start was its one line)
    assert proc.wait(timeout=120) == 0, out
    lines = [line for line in out.splitlines() if not line.startswith("meshfit-spare-ready")]
    assert lines == [f"argv ['{script}', '--flag'] path0 True", "name __main__ env 1 None"], out


def test_a_spare_whose_environment_differs_beyond_meshfits_own_variables_is_not_used(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    spare = Spare(env)
    moved = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}  # the rank's devices changed
    assert spare.take(moved, [sys.executable]) is None
    assert spare.proc.poll() is not None  # ended, not left behind


@pytest.mark.parametrize(
    ("command", "expected"), [(["job.py", "-x"], True), (["-m", "pkg.job"], True), (["-c", "1"], False), ([], False)]
)
def test_a_spare_runs_scripts_and_modules_only(command, expected):
    assert usable(command) is expected
