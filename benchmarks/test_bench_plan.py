"""`benchmarks/bench_plan.py --smoke` runs and prints predictions against measurements."""

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_plan.py")


@pytest.mark.slow
def test_bench_plan_smoke_prints_predicted_against_measured_each_candidate_in_a_child_that_does_not_preallocate():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE")}
    command = [sys.executable, BENCH, "--smoke", "--isolate"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "3 candidates compiled in" in out  # mirrored and the meshes fsdp=2 and tensor=2
    # The GPU's 75 % preallocation is off in the parent (it compiled the plan) and in every child it measured in:
    assert "each candidate measured in a process of its own, XLA_PYTHON_CLIENT_PREALLOCATE=false" in out
    assert "measured (simulated devices)" in out
    rows = [line for line in out.splitlines() if line.endswith(tuple("0123456789")) and " MiB " in line]
    assert len(rows) == 3
    ratios = [float(line.split("MiB")[2].split()[0]) for line in rows]  # measured / predicted peak per device
    assert all(0.5 < r < 2 for r in ratios), rows
    assert "plan's pick: " in out and "fastest measured: " in out
