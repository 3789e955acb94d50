"""Every benchmark runs with `--smoke` (tiny sizes): a change that breaks one fails here, not months later."""

import glob
import os
import sys

import pytest
from processes import run, without_suite_cache

pytestmark = pytest.mark.slow  # each starts a Python process with JAX and compiles its contenders

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
HELPERS = {"smoke.py"}  # modules the benchmarks import, not benchmarks
OWN_TESTS = {"bench_plan.py"}  # smoke-run by a test of their own that also checks what they print
CHECKLISTS = {"gpu_checklist.py"}  # runs benchmarks on a lent GPU: its commands are checked below
OPTIONAL = {"bench_replica_transport.py": "ray"}  # benchmarks of an optional extra: skipped without it
SCRIPTS = sorted(
    name
    for name in map(os.path.basename, glob.glob(os.path.join(BENCHMARKS, "*.py")))
    if name not in HELPERS | OWN_TESTS | CHECKLISTS and not name.startswith("test_") and name != "conftest.py"
)


def test_every_benchmark_is_collected():
    assert "bench_fit.py" in SCRIPTS and "bench_checkpoint.py" in SCRIPTS, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_in_smoke_mode(script):
    if script in OPTIONAL:
        pytest.importorskip(OPTIONAL[script])
    env = without_suite_cache({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})  # as from a shell
    job = run([sys.executable, os.path.join(BENCHMARKS, script), "--smoke"], timeout=240, env=env)
    assert job.returncode == 0, f"{script} --smoke exited {job.returncode}:\n{job.stderr[-3000:]}"
    assert job.stdout.strip(), f"{script} --smoke printed nothing"


def test_every_command_of_the_gpu_checklist_parses_and_a_wrong_flag_is_caught():
    checklist = os.path.join(BENCHMARKS, "gpu_checklist.py")
    job = run([sys.executable, checklist, "--check"], timeout=120)
    assert job.returncode == 0, job.stderr[-3000:]
    assert job.stdout.count("flags parse") >= 6, job.stdout
    wrong = (
        f"import sys; sys.path.insert(0, {BENCHMARKS!r}); import gpu_checklist as g; "
        "g.check(g.STAGES[0]._replace(args=('--no-such-flag',)))"
    )
    job = run([sys.executable, "-c", wrong], timeout=120)
    assert job.returncode == 2 and "--no-such-flag" in job.stderr, (job.returncode, job.stderr[-3000:])


def test_bench_recovery_refuses_an_unknown_model_before_starting_a_job():
    script = os.path.join(BENCHMARKS, "bench_recovery.py")
    job = run([sys.executable, script, "--model", "digits,gpt"], timeout=60)
    assert job.returncode == 2, (job.returncode, job.stdout[-2000:], job.stderr[-2000:])
    assert "'digits', 'transformer'" in job.stderr and "digits,gpt" in job.stderr, job.stderr[-2000:]
    assert "SIGKILL" not in job.stdout, job.stdout[-2000:]
