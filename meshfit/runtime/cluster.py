"""Joining a multi-process JAX job: `jax.distributed` set-up from arguments or the environment.

Order of precedence for each setting: the argument, then `MESHFIT_*` variables
(set by `meshfit launch`), then JAX's own (`JAX_COORDINATOR_ADDRESS`, ...), then
JAX's cluster auto-detection (SLURM, Open MPI, Cloud TPU, Kubernetes). With none
of these, the job is a single process. Before JAX joins them, the processes meet
in meshfit's start-up handshake (`meshfit.runtime.rendezvous`), which says what it
waits for and turns a job that cannot assemble into a Python exception.
"""

from __future__ import annotations

import logging
import os
import warnings

import jax

from meshfit.core import compat
from meshfit.runtime import rendezvous, start_phases
from meshfit.runtime.job_env import (
    ENV_COORDINATOR,
    ENV_HEARTBEAT,
    ENV_INIT_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

__all__ = [
    "initialize",
    "detected_cluster",
    "DEFAULT_INIT_TIMEOUT",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "heartbeat_timeout",
]

logger = logging.getLogger("meshfit")

#: Seconds `initialize` waits for every process to join, unless told otherwise.
DEFAULT_INIT_TIMEOUT = 300
#: Seconds without heartbeats after which a process is declared dead and the job ends, unless told otherwise
#: (JAX's own default is 100).
DEFAULT_HEARTBEAT_TIMEOUT = 30
# Variables launchers set that reveal a multi-process job JAX may not detect (e.g. Open MPI 5).
_SIZE_HINTS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE")


def detected_cluster() -> str | None:
    """Name of the cluster environment JAX would auto-detect, or None."""
    for env in compat.cluster_environments():
        if not getattr(env, "opt_in_only_method", False) and env.is_env_present():
            return env.__name__
    return None


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Environment variable {name} must be an integer. Received: {name}={value!r}.") from None


def check_settings(coordinator_address, num_processes, process_id, completed_by: str | None = None) -> None:
    """Refuses settings that cannot form a job, naming the setting and the form it takes.

    `completed_by`: a cluster environment JAX detected, which supplies what is not given.
    """
    if coordinator_address:
        host, sep, port = str(coordinator_address).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"The coordinator address ({ENV_COORDINATOR} or coordinator_address) must be HOST:PORT, "
                f"e.g. 10.0.0.1:12355, with a port from 1 to 65535. Received: {coordinator_address!r}"
                + (" (no port)." if not sep or not port else ".")
            )
    if num_processes is not None and num_processes < 1:
        raise ValueError(
            f"The number of processes ({ENV_NUM_PROCESSES} or num_processes) must be at least 1. "
            f"Received: {num_processes}."
        )
    if process_id is not None and process_id < 0:
        raise ValueError(f"The process id ({ENV_PROCESS_ID} or process_id) must be 0 or more. Received: {process_id}.")
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(
            f"The process id ({ENV_PROCESS_ID}={process_id}) must be below the number of processes "
            f"({ENV_NUM_PROCESSES}={num_processes}): ids run from 0 to {num_processes - 1}."
        )
    given = {
        ENV_COORDINATOR: coordinator_address or None,
        ENV_NUM_PROCESSES: num_processes,
        ENV_PROCESS_ID: process_id,
    }
    if completed_by is None and any(v is not None for v in given.values()) and num_processes != 1:
        missing = [name for name, value in given.items() if value is None]
        if missing and not (missing == [ENV_COORDINATOR] and os.environ.get("JAX_COORDINATOR_ADDRESS")):
            set_ = {name: value for name, value in given.items() if value is not None}
            raise ValueError(
                f"A multi-process job needs the coordinator address, the number of processes and this process's "
                f"id; {set_} came without {' and '.join(missing)}, and no cluster (SLURM, Open MPI, Cloud TPU, "
                "Kubernetes) was detected to supply them. Set all three (meshfit launch does), or none."
            )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids=None,
    heartbeat_timeout_seconds: int | None = None,
    initialization_timeout: int | None = None,
) -> bool:
    """Initializes `jax.distributed` once; returns True if this is a multi-process job.

    Must run before any JAX computation. CPU collectives go through gloo, so a
    multi-process job also runs on hosts without accelerators. Settings that
    cannot form a job (an address without a port, a process id without a
    count, an id out of range) are a `ValueError` before any network wait.

    The processes first meet in meshfit's start-up handshake on the
    coordinator's port (`meshfit.runtime.rendezvous`), then join JAX's job, all of
    them there. While it waits, process 0 says once for how many processes
    and how many came; when `initialization_timeout` (seconds; default
    `MESHFIT_INIT_TIMEOUT`, else 300) passes first, the error is a
    `rendezvous.JoinTimeoutError` naming the count and the likely causes, and
    two processes with one id, or given different counts, are a `ValueError`,
    in place of JAX's abort after its timeout.

    `heartbeat_timeout_seconds` (default `MESHFIT_HEARTBEAT_TIMEOUT`, else 30):
    a process whose heartbeats stop for this long is declared dead and the
    others end (JAX aborts them, naming it). Heartbeats come from a thread of
    JAX's client in C++, so a process busy for longer (a long compilation,
    Python code holding the GIL) is not declared dead.
    """
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else _int_env(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _int_env(ENV_PROCESS_ID)
    heartbeat = heartbeat_timeout(heartbeat_timeout_seconds)
    if initialization_timeout is None:
        initialization_timeout = _int_env(ENV_INIT_TIMEOUT) or DEFAULT_INIT_TIMEOUT
    if initialization_timeout < 1:
        raise ValueError(
            f"The initialization timeout ({ENV_INIT_TIMEOUT} or initialization_timeout) must be a positive number "
            f"of seconds. Received: {initialization_timeout!r}."
        )
    cluster = detected_cluster()
    check_settings(coordinator_address, num_processes, process_id, completed_by=cluster)
    explicit = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not explicit and num_processes is None and cluster is None:
        hinted = {k: os.environ[k] for k in _SIZE_HINTS if os.environ.get(k, "1") not in ("", "0", "1")}
        if hinted:
            warnings.warn(
                f"The environment says this is one of several processes ({hinted}) but JAX detected no cluster, "
                "so this process trains alone. Pass coordinator_address, num_processes and process_id (or set "
                f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}).",
                stacklevel=3,
            )
        logger.info("No coordinator address or cluster found; running as a single process.")
        return False
    if num_processes == 1:
        return False
    if compat.backends_are_initialized():
        raise RuntimeError(
            "This process cannot join the job: JAX's backend has already started (an array was created, or "
            "jax.devices() called, before the strategy). Create MultiWorkerMirroredStrategy or MeshStrategy "
            "(or call meshfit.runtime.cluster.initialize) first, before any other JAX work."
        )
    address, count, index, devices = complete_settings(
        coordinator_address, num_processes, process_id, local_device_ids, initialization_timeout, cluster
    )
    rendezvous.assemble(
        address, count, index, initialization_timeout, bind_address=os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
    )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=count,
        process_id=index,
        local_device_ids=devices,
        cluster_detection_method="deactivate",  # done above, once
        heartbeat_timeout_seconds=heartbeat,
        initialization_timeout=initialization_timeout,  # every process is there by now: this wait is short
    )
    # A silent stranger at the service must not hold the exit (nor abort it): its connections are cut at exit.
    compat.bound_coordination_shutdown(port=int(address.rsplit(":", 1)[1]))
    start_phases.mark("joined")
    logger.info("Joined a %d-process job as process %d.", jax.process_count(), jax.process_index())
    return jax.process_count() > 1


def heartbeat_timeout(given: int | None = None) -> int:
    """The seconds without heartbeats after which a job declares a process dead: `given`, else
    `MESHFIT_HEARTBEAT_TIMEOUT`, else `DEFAULT_HEARTBEAT_TIMEOUT` (JAX's own default, 100 s, is longer)."""
    return given or _int_env(ENV_HEARTBEAT) or DEFAULT_HEARTBEAT_TIMEOUT


def complete_settings(
    coordinator_address, num_processes, process_id, local_device_ids, timeout: int, cluster: str | None
) -> tuple:
    """The job's (coordinator address, process count, process id, local device ids), as JAX would complete them.

    What is unset comes from JAX's variables (`JAX_COORDINATOR_ADDRESS`,
    `JAX_LOCAL_DEVICE_IDS`), then from the detected `cluster`, in the order
    and by the code `jax.distributed.initialize` uses, so that meshfit's
    handshake and JAX's join meet at the same address.
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if local_device_ids is None and os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        local_device_ids = [int(i) for i in os.environ["JAX_LOCAL_DEVICE_IDS"].split(",")]
    if None in (coordinator_address, num_processes, process_id, local_device_ids):
        coordinator_address, num_processes, process_id, local_device_ids = compat.detect_cluster_settings(
            coordinator_address, num_processes, process_id, local_device_ids, timeout
        )
    source = f" ({cluster} gave them)" if cluster else ""
    unset = [
        name
        for name, value in (
            (f"the coordinator address ({ENV_COORDINATOR})", coordinator_address),
            (f"the number of processes ({ENV_NUM_PROCESSES})", num_processes),
            (f"this process's id ({ENV_PROCESS_ID})", process_id),
        )
        if value is None
    ]
    if unset:
        raise ValueError(f"A multi-process job needs {' and '.join(unset)}, which nothing set{source}.")
    if not 0 <= process_id < num_processes:
        raise ValueError(
            f"The process id {process_id} is out of range for {num_processes} processes{source}: ids run from 0 "
            f"to {num_processes - 1}."
        )
    return coordinator_address, num_processes, process_id, local_device_ids


_warned_alone: list[bool] = []


def warn_if_launched_but_alone(strategy) -> None:
    """Warns once when `meshfit launch --nprocs N` (N > 1) started this process but it is in no job.

    Each process would then train its own copy of the model and write the same
    files. Ranks meant to join no job are told no process count (a parameter-server job's workers, its
    only server), so they are never warned.
    """
    if _warned_alone or (_int_env(ENV_NUM_PROCESSES) or 1) <= 1:
        return
    if jax.process_count() > 1:
        return
    _warned_alone.append(True)
    if os.environ.get(ENV_PROCESS_ID, "0") != "0":
        return  # one warning for the job, from its first process
    warnings.warn(
        f"meshfit launch started {os.environ[ENV_NUM_PROCESSES]} processes, but this one trains alone under "
        f"{strategy!r}: every process trains its own copy and writes the same files. Use "
        "MultiWorkerMirroredStrategy() (data parallel over the processes) or MeshStrategy(...) to train one "
        "model together.",
        stacklevel=3,
    )
