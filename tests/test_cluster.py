"""meshfit.cluster: single-process fallback and the warning for an undetected multi-process launch."""

import os
import sys

import processes
import pytest

CODE = """
import warnings, meshfit as mf
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    multi = mf.cluster.initialize()
print("multi", multi, "|".join(str(w.message) for w in caught))
"""


def run_with(env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "OMPI", "PMI", "MESHFIT_", "JAX_COORD"))}
    env.update(env_extra)
    return processes.run([sys.executable, "-c", CODE], env=env, timeout=120)


def test_no_cluster_means_one_process_without_warning():
    out = run_with({}).stdout
    assert "multi False" in out and "trains alone" not in out


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"])
def test_undetected_multi_process_launch_warns(var):
    out = run_with({var: "4"}).stdout
    assert "multi False" in out
    assert f"'{var}': '4'" in out and "trains alone" in out
