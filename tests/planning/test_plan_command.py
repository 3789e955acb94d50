"""`meshfit plan MODULE:FACTORY ...`: the plan's table from the command line."""

import argparse
import subprocess
import sys

import pytest

from meshfit.planning import command as plan_command

FACTORY = """
from flax import nnx


class Tiny(nnx.Module):
    def __init__(self, remat=False):
        self.dense = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.dense(x)


def factory(remat=False):
    return Tiny(remat)
"""


@pytest.mark.slow
@pytest.mark.processes
def test_plan_prints_the_table(tmp_path):
    (tmp_path / "tiny.py").write_text(FACTORY)
    command = [sys.executable, "-m", "meshfit.cli", "plan", f"{tmp_path / 'tiny.py'}:factory", "--batch-size", "8"]
    command += ["--x", "4:float32", "--y", ":int32", "--loss", "sparse_categorical_crossentropy", "--devices", "1"]
    command += ["--device-spec", "1e12,1e11,1e10", "--measure", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Plan: 1 x cpu, memory limit none per device; 2 candidates compiled, 1 measured, in")
    assert lines[0].endswith("roofline 1 TFLOP/s, memory 100 GB/s, interconnect 10 GB/s")
    assert lines[1].split()[:4] == ["layout", "batch", "remat", "peak/device"]
    assert "step ≥ (roofline)  step measured  samples/s" in lines[1]
    assert [line.split()[:3] for line in lines[3:5]] == [["mirrored", "8", "False"], ["mirrored", "8", "True"]]
    at = lines[1].index("step measured")
    assert lines[3][at:].split()[1] == "ms" and lines[4][at:].split()[0] == "≤"  # measured; not measured: blank
    assert lines[5].startswith("step ≥ (roofline): a lower bound") and lines[6].startswith("step measured: 3 real")
    assert "mirrored, batch 8, remat False" in result.stderr  # the progress bar names each candidate

    quiet = subprocess.run([*command, "--quiet"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "Compiling" not in quiet.stderr, quiet.stderr


def test_measure_must_be_a_count():
    parser = argparse.ArgumentParser()
    plan_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "m.py:f", "--batch-size", "8", "--x", "4:f32", "--y", ":i32", "--loss", "mse"])
    assert args.measure == 0
    args.measure = -2
    with pytest.raises(ValueError, match="--measure takes how many candidates to time, an int >= 0. Received: -2"):
        plan_command.run(args)


def test_rows_and_byte_counts_are_read_or_refused_clearly():
    assert plan_command.row("64:int32", "--x") == ((64,), "int32")
    assert plan_command.row("28,28:float32", "--x") == ((28, 28), "float32")
    assert plan_command.row(":int32", "--y") == ((), "int32")
    with pytest.raises(ValueError, match="--x takes SHAPE:DTYPE.*Received: '64'"):
        plan_command.row("64", "--x")
    assert plan_command.byte_count("16GiB") == 16 * 2**30 and plan_command.byte_count("1000") == 1000
    with pytest.raises(ValueError, match="--memory-limit takes bytes.*Received: 'lots'"):
        plan_command.byte_count("lots")
    assert plan_command.peaks("989e12,3.35e12,450e9") == (989e12, 3.35e12, 450e9)
    with pytest.raises(ValueError, match="--device-spec takes three positive numbers.*Received: '1,2'"):
        plan_command.peaks("1,2")
    with pytest.raises(ValueError, match="MODULE:FACTORY must be MODULE:NAME.*Received: 'nocolon'"):
        plan_command.load("nocolon", "MODULE:FACTORY")
