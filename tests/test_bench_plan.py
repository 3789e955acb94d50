"""`benchmarks/bench_plan.py --smoke` runs and prints predictions against measurements."""

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_plan.py")


@pytest.mark.slow
def test_bench_plan_smoke_prints_predicted_against_measured():
    result = subprocess.run([sys.executable, BENCH, "--smoke"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "3 candidates compiled in" in out  # mirrored and the meshes 1x2x1 and 1x1x2
    assert "measured (simulated devices)" in out
    rows = [line for line in out.splitlines() if line.endswith(tuple("0123456789")) and " MiB " in line]
    assert len(rows) == 3
    ratios = [float(line.split("MiB")[2].split()[0]) for line in rows]  # measured / predicted peak per device
    assert all(0.5 < r < 2 for r in ratios), rows
    assert "plan's pick: " in out and "fastest measured: " in out
