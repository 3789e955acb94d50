"""meshfit.cluster: single-process fallback and the warning for an undetected multi-process launch."""

import os
import sys
import time

import processes
import pytest

from meshfit.cluster import check_settings
from meshfit.launch import free_port

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


# -- settings that cannot form a job fail before any network wait -------------------------------------


def refused(env_extra):
    """Runs `initialize` with these variables; returns its output (the ValueError's message)."""
    started = time.monotonic()
    result = run_with(env_extra)
    assert result.returncode != 0 and "ValueError" in result.stderr, result.stdout + result.stderr
    assert time.monotonic() - started < 60  # no network wait (JAX would wait 300 s)
    return result.stderr


def test_an_address_without_a_port_names_the_port():
    env = {"MESHFIT_COORDINATOR_ADDRESS": "127.0.0.1", "MESHFIT_NUM_PROCESSES": "2", "MESHFIT_PROCESS_ID": "0"}
    message = refused(env)
    assert "must be HOST:PORT" in message and "'127.0.0.1' (no port)" in message and "IndexError" not in message


def test_a_process_id_alone_is_refused_naming_what_is_missing():
    message = refused({"MESHFIT_PROCESS_ID": "1"})
    assert "came without MESHFIT_COORDINATOR_ADDRESS and MESHFIT_NUM_PROCESSES" in message


@pytest.mark.parametrize("process_id, count", [("2", "2"), ("-1", "2"), ("0", "0")])
def test_ids_and_counts_out_of_range(process_id, count):
    env = {"MESHFIT_COORDINATOR_ADDRESS": "127.0.0.1:1234", "MESHFIT_NUM_PROCESSES": count}
    message = refused({**env, "MESHFIT_PROCESS_ID": process_id})
    assert "MESHFIT_PROCESS_ID" in message or "MESHFIT_NUM_PROCESSES" in message


def test_a_cluster_detected_by_jax_completes_partial_settings():
    """Under SLURM the address may be given alone: JAX's detector supplies the count and the id."""
    check_settings("10.0.0.1:1234", None, None, completed_by="SlurmCluster")
    with pytest.raises(ValueError, match="came without MESHFIT_NUM_PROCESSES and MESHFIT_PROCESS_ID"):
        check_settings("10.0.0.1:1234", None, None)
    check_settings(None, 1, 0)  # one process: nothing to join


def test_the_initialization_timeout_comes_from_the_environment():
    """MESHFIT_INIT_TIMEOUT=3 with a second process that never starts: the wait ends in seconds, not 300."""
    env = {
        "MESHFIT_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "MESHFIT_NUM_PROCESSES": "2",
        "MESHFIT_PROCESS_ID": "0",
        "MESHFIT_INIT_TIMEOUT": "3",
    }
    started = time.monotonic()
    result = run_with(env)
    assert result.returncode != 0
    assert time.monotonic() - started < 90
